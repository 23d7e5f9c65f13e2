"""BLEU two ways, side by side: sacreBLEU (detokenized, 13a; the comparable standard, printed with its
signature) and the paper's tokenized BLEU with compound splitting.

The paper's 27.3 (base) and 28.4 (big) on newstest2014 are tokenized BLEU as tensor2tensor's
get_ende_bleu.sh computes it: Moses' tokenizer.perl -l de (its defaults: HTML-escaped ' " & < >,
no aggressive hyphen splitting), then every hyphen inside a word "a-b" becomes "a ##AT##-##AT## b"
(so each compound part counts as a word), then case-sensitive multi-bleu.perl. sacremoses is
tokenizer.perl in Python, rule for rule (German quotes „ “ ”, … and – split off, apostrophes
escaped), so no Perl or Moses checkout is needed. Expect the tokenized score to sit a point or so
above sacreBLEU's on English-German.

    python bench/paper_bleu.py HYPOTHESES REFERENCES     (pip install 'aiayn[bench]' for sacremoses)
"""

from __future__ import annotations

import re
import sys

import sacrebleu

from aiayn.errors import AiaynError
from aiayn.files import read_lines

_COMPOUND = re.compile(r"(\S)-(\S)")


def split_compounds(line: str) -> str:
    """The ##AT## rule of get_ende_bleu.sh (perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g')."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def moses_tokenize(lines: list[str], lang: str = "de") -> list[str]:
    """tokenizer.perl -l LANG with its defaults, line by line."""
    try:
        from sacremoses import MosesTokenizer
    except ImportError:
        raise SystemExit("paper_bleu.py needs sacremoses (Moses' tokenizer): pip install 'aiayn[bench]'") from None
    tok = MosesTokenizer(lang=lang)
    return [tok.tokenize(s, escape=True, return_str=True) for s in lines]


def tokenized_bleu(hyps: list[str], refs: list[str], lang: str = "de") -> float:
    """Case-sensitive BLEU of Moses-tokenized, compound-split text (the paper's number)."""
    prep = [[split_compounds(s) for s in moses_tokenize(side, lang)] for side in (hyps, refs)]
    return float(sacrebleu.corpus_bleu(prep[0], [prep[1]], tokenize="none", force=True).score)


def sacre_bleu(hyps: list[str], refs: list[str]) -> sacrebleu.metrics.bleu.BLEUScore:
    return sacrebleu.corpus_bleu(hyps, [refs])


def report(hyps: list[str], refs: list[str]) -> str:
    """The two lines this script prints: sacreBLEU with its signature, then the paper's number."""
    metric = sacrebleu.metrics.BLEU()
    score = metric.corpus_score(hyps, [refs])
    return (f"sacreBLEU (detokenized, 13a): {score.score:.2f}  {metric.get_signature()}\n"
            f"tokenized BLEU, Moses -l de, compounds split (the paper's): {tokenized_bleu(hyps, refs):.2f}")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    try:  # an empty translation is a line too (stripping every trailing newline dropped the last ones)
        hyps, refs = read_lines(argv[0], blank_ok=True), read_lines(argv[1])
    except AiaynError as e:  # a missing, empty or non-UTF-8 file: one line
        print(e, file=sys.stderr)
        return 2
    if len(hyps) != len(refs):
        print(f"{argv[0]} has {len(hyps)} lines but {argv[1]} has {len(refs)}", file=sys.stderr)
        return 2
    print(report(hyps, refs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
