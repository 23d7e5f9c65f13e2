"""What the model thread of `aiayn serve` does with one batch: search it through `Translator.search`
(so each line gets the translation `aiayn translate` gives it with the same settings), segment the
translations into target subwords and, on request, compute their cross-attention.

No HTTP here (`aiayn.serve.app`) and no batching (`aiayn.serve.scheduler`): plain functions of a
`Translator` and lines, run in the scheduler's model thread (and, for a finished line handed over
early, in the search worker that searched it when the batch is split across torch threads).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from aiayn.errors import AiaynError
from aiayn.tokenizer import BOS_ID, PAD_ID
from aiayn.translator import Settings, one_line

DEFAULT_ALPHA = 0.6


class Key(NamedTuple):
    """Search settings: only lines with equal keys share a batch."""

    beam: int
    alpha: float
    nbest: int
    attention: bool
    pair: tuple[str, str] = ("", "")  # (source, target): the model that searches it (several may be served)


class LineTooLong(AiaynError):
    """A line has more source tokens than the model takes (the server refuses it, never truncates)."""


def refuse_long(message: str) -> None:
    """`Translator.note` for the server: a line the translator would truncate is refused instead."""
    raise LineTooLong(message)


def price(src_len: int, key: Key, layers: int) -> int:
    """The work one line asks for, in token slots: its `beam` hypotheses over the source and the
    longest output the search allows (`Settings.max_len_a/b`, EOS included) and, with attention,
    one slot per weight returned (nbest x decoder layers x output x source), a blank line none.

    The server refuses a request whose lines cost more than `--max-work` before it queues them:
    the bytes of a request say little of its work (one line at beam 16 with attention weighs what
    thousands of lines at beam 1 do)."""
    if not src_len:
        return 0
    out = math.floor(src_len * Settings.max_len_a + Settings.max_len_b) + 1
    return key.beam * (src_len + out) + (key.nbest * layers * out * src_len if key.attention else 0)


def _score(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 6)  # greedy search has no score; JSON has no nan


def cross_attention(model: Any, src_ids: list[int], hyps: list[list[int]]) -> list[list[list[list[float]]]]:
    """Cross-attention of a teacher-forced pass over (source, each hypothesis), mean over heads.

    Returns per hypothesis a list over layers of T rows of S weights: row t is what the decoder
    attends to while it predicts target token t (the EOS row is left out)."""
    T = max(len(h) for h in hyps)
    src = torch.tensor([src_ids] * len(hyps))  # (N, S)
    tgt = torch.full((len(hyps), T + 1), PAD_ID, dtype=torch.long)  # (N, 1 + T) right-padded
    tgt[:, 0] = BOS_ID
    for row, h in enumerate(hyps):
        tgt[row, 1:1 + len(h)] = torch.tensor(h, dtype=torch.long)
    with torch.inference_mode():
        dev = model_device(model)
        cross = model.attention_weights(src.to(dev), tgt.to(dev), kinds=("cross",))["cross"]  # only what is shown
        mean = torch.stack([w.float().mean(1) for w in cross], 1).cpu()  # (N, L, 1 + T, S)
    # rounded in float64: a float32 0.0163 is 0.016300000250339508 to JSON, 2.5x the bytes of the answer
    return [mean[row, :, :len(h)].double().round(decimals=4).tolist() for row, h in enumerate(hyps)]


def model_device(model: Any) -> Any:
    return next(model.parameters()).device


def _split_tokens(translator: Any, lines: list[str]) -> int:
    """A `max_tokens` that cuts the batch into about one part per torch thread: `map_batches` then
    searches the parts at once, each on its own thread, which beats one part on all threads for the
    small batches a server sees (in fp32 the results do not depend on it: each line is
    searched alike; in int8 an input's 8-bit scale is taken over its part, so a line can come out
    slightly differently in another part, as in another batch).

    `max_tokens` counts padding (a part costs its lines times its longest), so the share does too:
    counted without it, one thread got three or four parts of a 64-line batch, each with its own
    tail of steps that decode a few rows, slower than one part (docs/serving.md). At most 4096, as `translate`."""
    if model_device(translator.model).type != "cpu":
        return 4096  # a GPU searches one batch at a time (`worker_count`): parts would run in a row
    lengths = [len(ids) for ids in translator.encode(lines) if ids]  # blank lines are not searched
    longest = max(lengths, default=1)
    share = math.ceil(len(lengths) * longest * 1.05 / torch.get_num_threads())
    return max(1, min(4096, max(longest, share)))


def run_batch(translator: Any, key: Key, lines: list[str],
              on_line: Callable[[int, list[dict[str, Any]]], None] | None = None) -> list[list[dict[str, Any]]]:
    """Per line, its n-best hypotheses: text, score, target subwords (and attention on request).

    The subwords are the ones the search chose (`Translator.search_ids`), the text their
    detokenization as `Translator.search` gives it; the attention is that of a teacher-forced pass
    over the source and those subwords. `on_line(i, hypotheses)`, if given, gets each searched line
    as soon as the search is done with it (the server answers its client then, while the batch's
    longer lines go on); the returned list has every line, those too."""
    out: list[list[dict[str, Any]] | None] = [None] * len(lines)

    def done(i: int, nbest: list[tuple[list[int], float]]) -> None:
        hyps = out[i] = _hypotheses(translator, key, lines[i], nbest)
        assert on_line is not None
        on_line(i, hyps)

    found = translator.search_ids(lines, beam=key.beam, alpha=key.alpha, nbest=key.nbest,
                                  max_tokens=_split_tokens(translator, lines), on_line=done if on_line else None)
    return [hyps if hyps is not None else _hypotheses(translator, key, line, nbest)
            for line, nbest, hyps in zip(lines, found, out)]


def _hypotheses(translator: Any, key: Key, line: str, nbest: list[tuple[list[int], float]]) -> list[dict[str, Any]]:
    """One line's n-best as the API gives it: text, score, target subwords, attention if asked."""
    tgt = translator.tokenizers.tgt
    hyps = [{"text": one_line(tgt.decode(ids)), "score": _score(score),
             "tokens": [tgt.id_to_piece(i) for i in ids]} for ids, score in nbest]
    if key.attention:
        for h, m in zip(hyps, _attention(translator, line, [ids for ids, _ in nbest])):
            h["attention"] = m
    return hyps


def _attention(translator: Any, line: str, ids: list[list[int]]) -> list[list[list[list[float]]]]:
    """Per hypothesis of `line` (its target ids), its cross-attention ([] for an empty one or source)."""
    src_ids = translator.encode([line])[0]
    maps: list[list[list[list[float]]]] = [[] for _ in ids]
    fits = [i for i, h in enumerate(ids) if h]
    if src_ids and fits:
        for i, m in zip(fits, cross_attention(translator.model, src_ids, [ids[i] for i in fits])):
            maps[i] = m
    return maps


def warm_up(translator: Any, beam: int) -> None:
    """A search of a short and a longer line, so that the first client does not pay for lazy set-up."""
    src = translator.tokenizers.src
    pieces = (src.id_to_piece(i) for i in range(4, min(200, src.vocab_size)))
    words = [p[1:] for p in pieces if p.startswith("\u2581") and p[1:].isalpha()] or ["a"]
    n = max(1, min(20, translator.max_src_tokens // 4))
    translator.search([" ".join(words[:3]), " ".join((words * n)[:n])], beam=beam, alpha=DEFAULT_ALPHA)
