"""BLEU two ways, side by side: sacreBLEU (detokenized, 13a; the comparable standard) and the
paper's tokenized BLEU with compound splitting.

The paper's 27.3 (base) and 28.4 (big) on newstest2014 are tokenized BLEU as tensor2tensor's
get_ende_bleu.sh computes it: Moses tokenizer, then every hyphen inside a word "a-b" becomes
"a ##AT##-##AT## b" (so each compound part counts as a word), then case-sensitive multi-bleu.perl.
Here sacreBLEU's 13a tokenizer stands in for Moses' tokenizer.perl (no Perl); 13a, like Moses'
default, leaves hyphens inside words alone, so the compound rule applies the same way. Expect the
tokenized score to sit a point or so above sacreBLEU's on English-German.

    python bench/paper_bleu.py HYPOTHESES REFERENCES
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import sacrebleu
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

_COMPOUND = re.compile(r"(\S)-(\S)")


def split_compounds(line: str) -> str:
    """The ##AT## rule of get_ende_bleu.sh (perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g')."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def tokenized_bleu(hyps: list[str], refs: list[str]) -> float:
    """Case-sensitive BLEU of tokenized, compound-split text (the paper's number)."""
    tok = Tokenizer13a()
    prep = [[split_compounds(tok(s)) for s in side] for side in (hyps, refs)]
    return float(sacrebleu.corpus_bleu(prep[0], [prep[1]], tokenize="none", force=True).score)


def sacre_bleu(hyps: list[str], refs: list[str]) -> sacrebleu.metrics.bleu.BLEUScore:
    return sacrebleu.corpus_bleu(hyps, [refs])


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    hyps, refs = (Path(p).read_text(encoding="utf-8").rstrip("\n").split("\n") for p in argv)
    if len(hyps) != len(refs):
        print(f"{argv[0]} has {len(hyps)} lines but {argv[1]} has {len(refs)}", file=sys.stderr)
        return 2
    print(f"sacreBLEU (detokenized, 13a): {sacre_bleu(hyps, refs).score:.2f}")
    print(f"tokenized BLEU, compounds split (the paper's): {tokenized_bleu(hyps, refs):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
