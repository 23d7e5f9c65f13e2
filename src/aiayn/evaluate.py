"""Scoring with sacreBLEU: cased detokenized BLEU (the standard), lowercased BLEU, and chrF."""

from __future__ import annotations

from typing import Any, Sequence

import sacrebleu


def corpus_scores(hyps: Sequence[str], refs: Sequence[str]) -> dict[str, Any]:
    """BLEU, lowercased BLEU and chrF of detokenized hypotheses against one reference each."""
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")
    bleu = sacrebleu.metrics.BLEU()
    bleu_lc = sacrebleu.metrics.BLEU(lowercase=True)
    chrf = sacrebleu.metrics.CHRF()
    b, lc, c = bleu.corpus_score(hyps, [refs]), bleu_lc.corpus_score(hyps, [refs]), chrf.corpus_score(hyps, [refs])
    return {
        "bleu": round(b.score, 2),
        "bleu_lc": round(lc.score, 2),
        "chrf": round(c.score, 2),
        "bleu_signature": str(bleu.get_signature()),
        "bleu_lc_signature": str(bleu_lc.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
        "n": len(hyps),
    }
