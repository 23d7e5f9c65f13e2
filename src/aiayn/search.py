"""Decoding: greedy and beam search on the model's `encode`/`decode` (Vaswani et al., 2017, Section 6.1).

The paper decodes with beam size 4, length penalty alpha = 0.6 and a maximum output length of
source length + 50, stopping early when possible. Both searches here are batched across sentences,
run the decoder one token at a time on the key/value cache (`DecoderCache`, reordered at every
step), and drop finished sentences from the batch so that they stop costing compute.

Where the time goes, and what keeps it down (CPU, measured with bench/decode.py): the linear layers
are about two thirds of an fp32 step, the vocabulary projection the largest of them, so they run on
packed weights (`aiayn.kernels.inference_linear`, for frozen weights as `Translator` sets them; bf16
halves them again). The K beams of a sentence share one copy of its cross-attention keys/values,
the first beam step runs one row per sentence (its beams are still identical), candidates are
ranked within each row before the merge per sentence, and the self-attention cache is kept
time-major, so that a step writes only its new position (a reorder is one copy into a second
buffer). Nothing large is allocated per step: the cache's buffers are reused, and log-softmax and top-k run on blocks of `ROW_BLOCK` rows, the log-probabilities
written over the block's logits (fresh memory of a batch's size costs page faults at every step). The per-row top-k
takes two stages (`_topk_rows`); greedy's arg-max narrows each row to the slice holding its maximum
(`_argmax_rows`). Everything runs under `inference_mode`.

Conventions, pinned by tests/test_search.py:

- The maximum length of a sentence is `floor(max_len_a * source_length + max_len_b)` tokens (at
  least 1), not counting EOS; source length counts non-pad source tokens. A beam hypothesis that
  reaches it is ended with a forced EOS; a greedy one simply stops.
- `min_len`: EOS is forbidden before `min_len` tokens have been generated (unless the maximum length
  forces it). PAD and BOS are never generated.
- A hypothesis's score is the sum of its token log-probabilities, EOS included, divided by the
  length penalty lp(len) = ((5 + len) / 6) ** alpha (Wu et al., 2016), where len counts the
  generated tokens including EOS (BOS excluded). alpha = 0 gives raw log-probabilities.
- Beam search (as fairseq's): each step takes the best 2*beam continuations of the live hypotheses;
  an EOS continuation ranked within the best `beam` finishes a hypothesis, and the best `beam`
  non-EOS continuations live on. When a sentence is done is the stopping rule (`stop`, STOP_RULES):
  "first" (fairseq's): once `beam` hypotheses have finished. "best" (transformers' `generate` with
  early_stopping=False, and CTranslate2): it searches on while the best live hypothesis, scored at
  its current length, beats the worst of the `beam` best finished ones; a later, better hypothesis
  takes that one's place. Either way the maximum length ends it; its n-best list is the finished
  hypotheses sorted by score.

`use_cache=False` re-runs the decoder on the whole prefix at every step: the same search, slower
(kept for tests and for the benchmark).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import Tensor

from aiayn import kernels
from aiayn.errors import AiaynError

ScoredIds = tuple[list[int], float]  # a finished hypothesis: (token ids without BOS/EOS, score)


@runtime_checkable
class SearchCache(Protocol):
    """What search needs of a decoding cache (`aiayn.cache.DecoderCache` is the real one)."""

    def reorder(self, indices: Tensor, beam: int | None = None, same_sentences: bool = False) -> None:
        """Keep rows `indices`: new row i continues old row indices[i]; `beam` rows per sentence
        afterwards (None: unchanged), in groups that each come from one sentence's rows;
        `same_sentences`: the caller knows that every sentence stays, in its place."""
        ...


class _PadConfig(Protocol):
    @property
    def pad_id(self) -> int: ...


C = TypeVar("C", bound=SearchCache)


@runtime_checkable
class SearchModel(Protocol[C]):
    """What search needs of a model (`aiayn.model.Transformer` is the real one): the encoder, a
    decoding cache of type C, the decoder on it and the vocabulary projection."""

    @property
    def cfg(self) -> _PadConfig: ...

    def encode(self, src: Tensor, src_keep: Tensor | None = None) -> Tensor:
        """(B, S) -> memory (B, S, d)."""
        ...

    def new_cache(self, memory: Tensor, src_keep: Tensor) -> C: ...

    def decode(self, tgt: Tensor, memory: Tensor | None, src_keep: Tensor | None = None, *,
               cache: C | None = None, project: bool = True) -> Tensor:
        """tgt (B, T) (with a cache: only the new tokens) -> logits (B, T, V), or the hidden states
        (B, T, d) when not `project`."""
        ...

    def project(self, h: Tensor) -> Tensor:
        """Hidden states (..., d) -> logits (..., V), a tensor search may overwrite (beam search
        writes the log-probabilities over them)."""
        ...


MAX_ALPHA = 10.0  # the length penalty's largest exponent: lp(256 tokens) ** 10 is ~2e16; from about 190 on it overflows a float


def length_penalty(length: int, alpha: float) -> float:
    """((5 + length) / 6) ** alpha, the GNMT length penalty; `length` counts tokens incl. EOS."""
    return ((5.0 + length) / 6.0) ** alpha


STOP_RULES = ("first", "best")  # when a beam search sentence is done: see the module docstring
DEFAULT_STOP_RULE = "best"  # measured on Multi30k val (docs/import.md): 35.43 BLEU against first's 35.40


def _check(beam: int, nbest: int, alpha: float, max_len_a: float, max_len_b: float, min_len: int,
           stop: str = DEFAULT_STOP_RULE) -> None:
    if stop not in STOP_RULES:
        raise AiaynError(f"--stop-rule must be one of {', '.join(STOP_RULES)}, got {stop!r}")
    for flag, n in (("--beam", beam), ("--nbest", nbest), ("--min-len", min_len)):
        check_whole(flag, n)
    if int(beam) < 1:
        raise AiaynError(f"--beam must be at least 1, got {beam}")
    if not 1 <= int(nbest) <= int(beam):
        raise AiaynError(f"--nbest must be between 1 and the beam size {beam}, got {nbest}")
    if not 0 <= alpha <= MAX_ALPHA:  # nan fails the comparison
        raise AiaynError(f"--alpha (length penalty) must be between 0 and {MAX_ALPHA:g}, got {alpha}")
    # (== inf, not math.isinf: that converts, and an int past float's range raises OverflowError)
    if not (max_len_a >= 0 and max_len_b >= 0) or math.inf in (max_len_a, max_len_b):
        raise AiaynError(f"maximum length a*len+b needs finite a >= 0 and b >= 0, got a={max_len_a}, b={max_len_b}")
    if min_len < 0:
        raise AiaynError(f"minimum length must be >= 0, got {min_len}")


def check_whole(flag: str, n: Any) -> None:
    """A count given to the Python API as 2.5 (the CLI's flags are ints) met a reshape or topk later
    (and `workers=2.5` a barrier for 3.5 threads, `Settings.check`)."""
    try:
        whole = not isinstance(n, bool) and n == int(n)
    except (TypeError, ValueError, OverflowError):  # a string, nan, inf
        whole = False
    if not whole:
        raise AiaynError(f"{flag} must be a whole number, got {n!r}")


LENGTH_CAP = 2 ** 62  # longer than any search runs; past it a limit is no limit


def _max_lengths(src_keep: Tensor, a: float, b: float) -> Tensor:
    """(B, S) bool -> (B,) long: floor(a * source length + b), at least 1. a and b are capped first:
    a Python int past 2**64 (`--max-len-b 1e30` as digits) cannot meet a tensor (OverflowError)."""
    a, b = min(a, LENGTH_CAP), min(b, LENGTH_CAP)
    return (src_keep.sum(1).double() * a + b).floor().clamp(1, LENGTH_CAP).long()  # huge a: no overflow


_FORBIDDEN: dict[tuple, Tensor] = {}  # (ids, V, device) -> the ids inside the vocabulary, as a tensor


def _forbid(lprobs: Tensor, ids: tuple[int, ...]) -> None:
    """-inf at `ids` (those inside the vocabulary) in every row: one `index_fill_`, where a
    column assignment per id took two calls each (one row: 6.3 -> 2.1 us). Shape: lprobs (m, V)."""
    key = (ids, lprobs.size(-1), lprobs.device)
    cols = _FORBIDDEN.get(key)
    if cols is None:
        with torch.inference_mode(False):  # made during a search, usable outside one too (autograd)
            cols = _FORBIDDEN[key] = torch.tensor(sorted({i for i in ids if 0 <= i < key[1]}), dtype=torch.long,
                                                  device=lprobs.device)
    if cols.numel():
        lprobs.index_fill_(-1, cols, float("-inf"))


# The vocabulary stage of a beam step (log-softmax and per-row top-k over the projected logits) runs
# on blocks of this many decoder rows, the log-probabilities written over the logits (a bf16 block
# is upcast first, into a float32 buffer kept for the whole search): (rows, V) temporaries
# allocated at every step cost page faults and fall out of the caches (bf16 search, 1000
# sentences, together with the cache's two buffers: about half the system time; the wall-time
# gain, a few %, is within this machine's run-to-run noise).
ROW_BLOCK = 128


def _hidden(model: SearchModel[C], tokens: Tensor, memory: Tensor, src_keep: Tensor, cache: C | None) -> Tensor:
    """The last decoder state of every row, (b, d).

    With the cache only the newest token is fed; without it (`use_cache=False`) the decoder re-runs on
    the whole prefix. Either way only the last position is projected to the vocabulary, later."""
    if cache is not None:
        return model.decode(tokens[:, -1:], None, cache=cache, project=False)[:, -1]
    return model.decode(tokens, memory, src_keep, project=False)[:, -1]


TOPK_GROUPS = 8  # `_topk_rows` splits a row into this many strided slices


def _topk_rows(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """`x.topk(k, dim=1)` (values best first), faster for wide rows such as a vocabulary's.

    View a row of V values as G slices of S = V/G, where column j holds x[j], x[j+S], x[j+2S], ...;
    the row's best k values lie in the k columns with the largest maxima (a column left out has a
    maximum no larger than k others, each holding a value at least that large). So: the maxima of
    the columns (one vectorized pass), the best k columns, then top-k of their G*k values. Values are
    exactly those of `topk`; among equal values the indices returned may differ.

    Shape: x (m, V) -> values, indices (m, k)."""
    m, V = x.shape
    G = TOPK_GROUPS
    if V % G or V // G < k or G * k >= V or x.device.type != "cpu":  # measured on the CPU; a GPU's topk is one kernel
        return x.topk(k, dim=1)
    S = V // G
    cols = x.view(m, G, S).amax(1).topk(k, dim=1).indices  # (m, k)
    cand = (cols.unsqueeze(1) + torch.arange(0, V, S, device=x.device).view(1, G, 1)).view(m, G * k)
    v, j = x.gather(1, cand).topk(k, dim=1)
    return v, cand.gather(1, j)


ARGMAX_SPLIT = 8  # `_argmax_rows` narrows a row to the one of this many slices that holds its maximum
ARGMAX_MIN_WIDTH = 2048  # ... while it is at least this wide
ARGMAX_MIN_ROWS = 4  # on fewer rows torch's argmax is faster (1 row of 8000: 5.5 against 13.6 us)


def _argmax_rows(x: Tensor) -> Tensor:
    """`x.argmax(1)`: each row's first maximum (NaN counting as the largest, as argmax does), about
    3x faster on a vocabulary's width (torch 2.13's CPU argmax reduces a row at a tenth of amax's rate).

    Cut the row into G contiguous slices (the last few columns, if G does not divide it, apart):
    argmax over the slices' maxima is the first slice holding the row's maximum, and the first
    maximum within that slice is the row's first; recurse into it while it is wide.

    Shape: x (m, V) -> (m,) long."""
    m, V = x.shape
    if V < ARGMAX_MIN_WIDTH or m < ARGMAX_MIN_ROWS or x.device.type != "cpu":  # measured on the CPU only
        return x.argmax(1)
    G = ARGMAX_SPLIT
    S = V // G
    n = G * S
    head = x[:, :n].view(m, G, S)
    c = head.amax(2).argmax(1)  # (m,) the first slice holding the maximum of the first n columns
    if n == V and x.is_contiguous():
        sub = x.view(m * G, S).index_select(0, torch.arange(0, m * G, G, device=x.device) + c)
    else:
        sub = head[torch.arange(m, device=x.device), c]
    best = c * S + _argmax_rows(sub)  # (m,)
    if n < V:  # the tail follows every head column: it wins only with a larger value (or the first NaN)
        tail = x[:, n:]
        t = tail.argmax(1)
        tv, hv = tail.gather(1, t[:, None]).squeeze(1), x.gather(1, best[:, None]).squeeze(1)
        best = torch.where((tv > hv) | (tv.isnan() & ~hv.isnan()), t + n, best)
    return best


def _int8_vocabulary(model: SearchModel[C]) -> int:
    """The vocabulary size if `model` projects to it in int8 (then block by block), else 0."""
    out_w = getattr(model, "output_weight", None)
    return out_w.size(0) if isinstance(out_w, Tensor) and kernels.is_int8(out_w) else 0


def _best_tokens(model: SearchModel[C], hidden: Tensor, banned: tuple[int, ...], by_block: bool) -> Tensor:
    """Each row's most likely token, `banned` ids never chosen; `by_block` (an int8 projection,
    `_int8_vocabulary`) projects `ROW_BLOCK` rows at a time, so that argmax reads its logits from
    the cache (as `_RowTopk`).

    Shape: hidden (b, d) -> (b,)."""
    step = ROW_BLOCK if by_block else max(1, hidden.size(0))
    best = []
    for i in range(0, hidden.size(0), step):
        logits = model.project(hidden[i:i + step])  # (m, V)
        _forbid(logits, banned)
        best.append(_argmax_rows(logits))
    return best[0] if len(best) == 1 else torch.cat(best)


class _RowTopk:
    """log_softmax over the vocabulary, then the best `width` tokens of each row, block by block.

    The rules on tokens apply before ranking: `banned` ids are never chosen, EOS is the only choice
    of a `forced` row and is forbidden in the others when `no_eos`."""

    def __init__(self, model: SearchModel[C], width: int, beam: int, banned: tuple[int, ...], eos_id: int) -> None:
        self.project = model.project
        # An int8 projection is projected block by block too: its float32 output (rows x V) is what
        # costs there, and a block's logits are still in the cache when log-softmax reads them
        # (docs/speed.md, "Figures behind choices in the code").
        self.by_block = _int8_vocabulary(model)  # V, or 0
        self.width, self.beam, self.banned, self.eos = width, beam, banned, eos_id
        self.buf: Tensor | None = None  # (rows, V) float32: a low-precision block is upcast into it

    def _upcast(self, blk: Tensor) -> Tensor:
        """A float32 copy of a low-precision block, in the buffer. Shape: (m, V) -> (m, V)."""
        m, V = blk.shape
        if self.buf is None or self.buf.size(1) != V or self.buf.size(0) < m:
            self.buf = blk.new_empty(m, V, dtype=torch.float32)
        return self.buf[:m].copy_(blk)

    def __call__(self, hidden: Tensor, forced: Tensor | None, no_eos: bool) -> tuple[Tensor, Tensor]:
        """Shape: hidden (n, d), forced (n,) bool or None -> values, ids (n, width)."""
        n = hidden.size(0)
        if self.by_block:
            logits, V = hidden, self.by_block  # projected below, block by block
        else:
            logits = self.project(hidden)  # (n, V), one GEMM
            V = logits.size(-1)
        if V < self.beam:
            raise AiaynError(f"--beam {self.beam} is larger than the target vocabulary ({V} tokens)")
        vals, ids = [], []
        rows = min(ROW_BLOCK, n) if hidden.device.type == "cpu" else max(n, 1)  # a GPU takes every row at once
        for i in range(0, n, rows):
            blk = logits[i:i + rows]
            if self.by_block:
                blk = self.project(blk)  # (m, V)
            m = blk.size(0)
            x = blk if blk.dtype == torch.float32 else self._upcast(blk)
            # (m, V) token log-probabilities, written over the logits (a fresh projection or the
            # buffer): one block of memory in the cache rather than two (1.8-2.2% of beam 4 int8)
            lprobs = torch.log_softmax(x, dim=-1, out=x)
            _forbid(lprobs, self.banned)
            if forced is not None:
                f = forced[i:i + m]
                if bool(f.any()):
                    eos_lp = lprobs[f, self.eos]
                    lprobs[f] = float("-inf")
                    lprobs[f, self.eos] = eos_lp
                if no_eos:
                    lprobs[~f, self.eos] = float("-inf")
            elif no_eos:
                lprobs[:, self.eos] = float("-inf")
            v, j = _topk_rows(lprobs, min(self.width, V))
            vals.append(v)
            ids.append(j)
        if len(vals) == 1:
            return vals[0], ids[0]
        return torch.cat(vals), torch.cat(ids)


def _survivors(done: Tensor) -> Tensor:
    """The rows that go on, each finished row's place taken by one of the last live rows rather than
    all of them moving up: the cache then moves just those rows, in place (`DecoderCache.reorder`).

    Shape: done (b,) bool -> (b',) long, b' = live rows."""
    live = ~done
    n = int(live.sum())
    keep = torch.arange(n, device=done.device)
    holes = done[:n].nonzero().squeeze(1)
    if holes.numel():
        keep[holes] = live[n:].nonzero().squeeze(1) + n
    return keep


@torch.inference_mode()  # no autograd bookkeeping at all (a few % per step over no_grad)
def greedy_search(model: SearchModel[C], src: Tensor, bos_id: int, eos_id: int, max_len_a: float = 1.0,
                  max_len_b: int = 50, min_len: int = 0, use_cache: bool = True,
                  on_done: Callable[[int, list[int]], None] | None = None) -> list[list[int]]:
    """Greedy search for a batch of right-padded sources; `on_done(row, ids)` (if given) as soon
    as a sentence is done, before the rest of the batch (a server answers its client then).

    Shape: src (B, S) -> B lists of token ids without BOS/EOS.
    """
    _check(1, 1, 0.0, max_len_a, max_len_b, min_len)
    pad = int(model.cfg.pad_id)
    src_keep = src.ne(pad)  # (B, S)
    limit = _max_lengths(src_keep, max_len_a, max_len_b)  # (b,) each live sentence's, as `alive`
    soonest = int(limit.min()) if limit.numel() else 0  # the first step at which one is reached
    memory = model.encode(src, src_keep)  # (B, S, d)
    B = src.size(0)
    cache = model.new_cache(memory, src_keep) if use_cache else None
    alive = torch.arange(B, device=src.device)  # original row of each live sentence
    tokens = torch.full((B, 1), bos_id, dtype=torch.long, device=src.device)  # (b, 1 + t)
    out: list[list[int]] = [[] for _ in range(B)]
    by_block = bool(_int8_vocabulary(model))
    step = 0
    while alive.numel():
        hidden = _hidden(model, tokens, memory, src_keep, cache)  # (b, d)
        # before min_len, EOS is banned too (the limit is always above `step` here: greedy stops on reaching it)
        banned = (pad, bos_id, eos_id) if step < min_len else (pad, bos_id)
        next_tok = _best_tokens(model, hidden, banned, by_block)  # (b,)
        tokens = torch.cat([tokens, next_tok[:, None]], dim=1)
        step += 1
        done = next_tok.eq(eos_id)  # (b,)
        if step >= soonest:  # some row's length limit is reached
            done |= limit.le(step)
        if bool(done.any()):  # finished sentences leave the batch and stop costing compute
            for row, ids in zip(alive[done].tolist(), tokens[done, 1:].tolist()):
                out[row] = ids[:-1] if ids[-1] == eos_id else ids
                if on_done is not None:
                    on_done(row, out[row])
            keep = _survivors(done)
            alive, tokens, limit = alive[keep], tokens[keep], limit[keep]
            soonest = int(limit.min()) if keep.numel() else 0
            if cache is not None:
                cache.reorder(keep)
            else:
                memory, src_keep = memory[keep], src_keep[keep]
    return out


@torch.inference_mode()  # no autograd bookkeeping at all (a few % per step over no_grad)
def beam_search(model: SearchModel[C], src: Tensor, bos_id: int, eos_id: int, beam: int = 4, alpha: float = 0.6,
                max_len_a: float = 1.0, max_len_b: int = 50, min_len: int = 0, nbest: int = 1,
                use_cache: bool = True, on_done: Callable[[int, list[ScoredIds]], None] | None = None,
                stop: str = DEFAULT_STOP_RULE) -> list[list[ScoredIds]]:
    """Batched beam search; returns, per sentence, up to `nbest` (tokens, score) pairs, best first.
    `on_done(row, n-best)` (if given) as soon as a sentence is done, as `greedy_search`'s; `stop`
    is the stopping rule ("first" or "best", see the module docstring).

    Shape: src (B, S) right-padded -> B lists of (ids without BOS/EOS, score).
    """
    _check(beam, nbest, alpha, max_len_a, max_len_b, min_len, stop)
    pad, K, dev = int(model.cfg.pad_id), int(beam), src.device
    B = src.size(0)
    src_keep = src.ne(pad)  # (B, S)
    max_len = _max_lengths(src_keep, max_len_a, max_len_b)  # (B,)
    memory = model.encode(src, src_keep)  # (B, S, d)
    # The K beams of a sentence start identical, so the first step runs one row per sentence and
    # its best K continuations become the K beams; R is the number of rows per live sentence.
    cache = model.new_cache(memory, src_keep) if use_cache else None  # cross K/V once per sentence
    R = 1
    sent = torch.arange(B, device=dev)  # original sentence of each live sentence (b,)
    tokens = torch.full((B, 1), bos_id, dtype=torch.long, device=dev)  # (b*R, 1 + t)
    scores = torch.zeros(B, 1, device=dev)  # (b, R) summed log-probs
    n_final = torch.zeros(B, dtype=torch.long, device=dev)  # (b,)
    worst = torch.full((B,), float("-inf"), device=dev)  # (b,) "best": the K-th best finished score
    finals: list[list[ScoredIds]] = [[] for _ in range(B)]
    neg_inf = float("-inf")
    row_topk = _RowTopk(model, 2 * K, K, (pad, bos_id), eos_id)
    step = 0
    soonest = int(max_len.min()) if B else 0  # the first step at which a live sentence's limit is reached
    while sent.numel():
        b = sent.numel()
        hidden = _hidden(model, tokens, memory, src_keep, cache)  # (b*R, d)
        # (b,) hypotheses that hold max_len tokens: EOS is forced (None: none does yet)
        at_limit = max_len.le(step) if step >= soonest else None
        forced = None if at_limit is None else at_limit.repeat_interleave(R)  # (b*R,)
        row_lp, row_tok = row_topk(hidden, forced, step < min_len)  # (b*R, W)
        W = row_lp.size(1)
        cand = (row_lp + scores.view(-1, 1)).view(b, R * W)  # hypothesis score + token log-probability
        top_scores, top_pos = cand.topk(min(2 * K, R * W), dim=1)  # (b, 2K), best first
        top_beam, top_tok = top_pos // W, row_tok.view(b, R * W).gather(1, top_pos)
        is_eos = top_tok.eq(eos_id) & top_scores.gt(neg_inf)  # (b, 2K)
        fin = is_eos[:, :K]  # (b, K) only an EOS among the best K candidates ends a hypothesis
        lp = length_penalty(step + 1, alpha)  # every hypothesis finishing now has step + 1 tokens
        if bool(fin.any()):
            if stop == "first":
                fin = fin & (n_final.unsqueeze(1) + fin.long().cumsum(1)).le(K)  # at most K finished per sentence
            n_final = n_final + fin.sum(1)
            _collect(finals, worst if stop == "best" else None, fin, sent, tokens, top_beam, top_scores, R, K, lp)
        cont_scores, cont_pos = top_scores.masked_fill(is_eos, neg_inf).topk(K, dim=1)  # (b, K)
        if stop == "first":
            full = n_final.ge(K)
        else:  # nothing live can still beat the K-th best finished (at the live hypotheses' length)
            full = (cont_scores[:, 0] / lp).le(worst)
        done = full | cont_scores[:, 0].eq(neg_inf)  # (b,)
        if at_limit is not None:
            done |= at_limit
        any_done = bool(done.any())
        if on_done is not None and any_done:
            for s in sent[done].tolist():
                on_done(s, _best(finals[s], nbest))
        keep = _survivors(done) if any_done else None
        if keep is not None:
            if keep.numel() == 0:
                break
            sent, max_len, n_final, worst = sent[keep], max_len[keep], n_final[keep], worst[keep]
            soonest = int(max_len.min())
            cont_scores, cont_pos, top_beam, top_tok = cont_scores[keep], cont_pos[keep], top_beam[keep], top_tok[keep]
            base = keep * R
        else:
            base = torch.arange(b, device=dev) * R
        src_rows = (base.unsqueeze(1) + top_beam.gather(1, cont_pos)).view(-1)  # (b'*K,) parent hypotheses
        tokens = torch.cat([tokens.index_select(0, src_rows), top_tok.gather(1, cont_pos).view(-1, 1)], dim=1)
        scores = cont_scores
        if cache is not None:
            # K rows per sentence from now on; the source side stays shared (and unchanged: no check)
            cache.reorder(src_rows, beam=K, same_sentences=keep is None)
        else:
            memory, src_keep = memory.index_select(0, src_rows), src_keep.index_select(0, src_rows)
        R = K
        step += 1
    return [_best(hyps, nbest) for hyps in finals]


def _collect(finals: list[list[ScoredIds]], worst: Tensor | None, fin: Tensor, sent: Tensor, tokens: Tensor,
             top_beam: Tensor, top_scores: Tensor, R: int, K: int, lp: float) -> None:
    """The hypotheses that `fin` marks join their sentences' `finals`, scored with the length
    penalty `lp`. With `worst` (the "best" stopping rule) each such sentence keeps its K best, and
    `worst` takes the K-th best score where there are K. The host reads the device a fixed number
    of times, not once per sentence (each read waits for a GPU).

    Shape: fin (b, K) bool (or wider), sent (b,), tokens (b*R, 1 + t), top_beam and top_scores (b, 2K); worst (b,)."""
    fin_i, fin_j = fin.nonzero(as_tuple=True)
    hyp_rows = fin_i * R + top_beam[fin_i, fin_j]
    rows, sents = torch.stack([fin_i, sent[fin_i]]).tolist()
    for s, ids, sc in zip(sents, tokens[hyp_rows, 1:].tolist(), top_scores[fin_i, fin_j].tolist()):
        finals[s].append((ids, sc / lp))
    if worst is None:
        return
    at, to = [], []
    for i, s in dict(zip(rows, sents)).items():  # each sentence once
        finals[s] = _best(finals[s], K)
        if len(finals[s]) == K:
            at.append(i)
            to.append(finals[s][-1][1])
    if at:
        worst[torch.tensor(at, device=worst.device)] = torch.tensor(to, dtype=worst.dtype, device=worst.device)


def _best(hyps: list[ScoredIds], nbest: int) -> list[ScoredIds]:
    """The `nbest` best finished hypotheses; stable: ties keep the order in which they finished."""
    return sorted(hyps, key=lambda h: -h[1])[:nbest]
