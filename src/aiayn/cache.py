"""The decoding cache: per-layer keys/values kept between decoding steps (Section 3.2.3's decoder
self-attention run one position at a time), and reordered for beam search (Section 6.1).

Search (`aiayn.search`) decodes token by token; without a cache every step would recompute the keys
and values of the whole prefix and of the source. `Transformer.new_cache` fills the cross-attention
keys/values once from the encoder output; `MultiHeadAttention` appends the self-attention ones
(`LayerCache.append`), or one of search's compiled steps does, into storage the cache hands out
(`LayerCache.room`, `LayerCache.appended`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class LayerCache:
    """One decoder layer's keys/values for incremental decoding.

    Cross-attention keys/values are computed once per sentence and shared by that sentence's beam
    rows (`DecoderCache.beam`), so beam search never copies them. Self-attention keys/values live
    time-major, in a flat buffer viewed as (capacity, R, H, d_head): a step writes its new position
    in place, and the keys so far are a view of the first t positions, (R, H, t, d_head) with strides
    (H*d, d, R*H*d, 1), which the batched matmuls read as they are (every head's keys a matrix with a
    row stride). Appending into a (R, H, t, d_head) layout instead copies every key at every step
    (at 64 sentences, 9% of a greedy step in the torch profiler; docs/speed.md). A buffer is
    made with room for 8 more positions and is replaced (copied) once full.
    A reorder is lazy: the rows are selected by the next append, in one copy into another buffer
    (kept in `flat` and `spare`, taking turns), so a step allocates nothing large: fresh memory of
    that size would cost page faults at every step. `append` does that copy; search's compiled
    steps (int8, float) do it in TorchScript, between `room` and `appended`.
    The layers of a `DecoderCache` share their spare buffers (`spare`, one list): each copy takes
    them and leaves there the buffers of the keys it replaces, which the next layer's copy writes
    into once this one has read them, or this layer's own next copy where it is alone. L layers
    then hold at most L + 1 buffers per tensor rather than 2L: beam search's peak memory is mostly this.
    The keys/values that `append` returns are therefore only valid until the next `append`.
    """

    cross_k: Tensor  # (N, H, S, d_head), one row per sentence
    cross_v: Tensor  # (N, H, S, d_head)
    self_k: Tensor | None = None  # (R, H, t, d_head) time-major, R = N * beam rows, before `pending` is applied
    self_v: Tensor | None = None
    pending: Tensor | None = None  # (R',) rows of self_k/self_v that the next append keeps
    # Flat storage: what self_k, self_v view (None where they are not in storage of ours), the
    # buffers for the next append (shared by a DecoderCache's layers: changed in place, never
    # rebound), and what the append between `room` and `appended` writes into. Kept here rather
    # than found through a view's `_base`, which views made under inference mode do not record.
    flat: list[Tensor | None] = field(default_factory=lambda: [None, None])
    spare: list[Tensor | None] = field(default_factory=lambda: [None, None])
    _room: list[Tensor | None] = field(default_factory=lambda: [None, None])
    layout: int = 0  # rows a position of `flat` holds (the rows in use may be fewer: `reorder_rows`' moves)
    _room_layout: int = 0

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new positions; return every key/value so far (valid until the next append).

        Shape: k, v (R, H, T, d_head) -> (R, H, t + T, d_head) each.
        """
        if self.self_k is None or self.self_v is None:  # the first step (both are set together)
            self.self_k, self.self_v = k, v
        elif torch.is_grad_enabled() and any(x.requires_grad for x in (k, v, self.self_k, self.self_v)):
            rows = self.pending  # autograd cannot record a copy into storage (out=)
            self.self_k, self.self_v = (torch.cat([old if rows is None else old.index_select(0, rows), new], dim=2)
                                        for old, new in ((self.self_k, k), (self.self_v, v)))
            self.flat = [None, None]
        else:
            old_k, old_v, store_k, store_v = self.room(k.shape, k)
            self.appended(_append_into(old_k, self.pending, k, store_k), _append_into(old_v, self.pending, v, store_v))
        self.pending = None
        return self.self_k, self.self_v

    def room(self, new: tuple[int, ...], like: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The keys and values so far (empty before the first step) and the storage for them with
        the new positions, of shape `new` (R, H, T, d_head), for an append that `appended` then
        records (`append`'s, or one of search's compiled steps'); `like` gives dtype and device.
        The storage is the keys' own buffer where the new positions fit there and no rows are to be
        selected (the append then writes only them), else another one.
        Shape: -> (R', H, t, d_head) twice, then two buffers (capacity, R, H, d_head)."""
        R, H, T, d = new
        if self.self_k is None or self.self_v is None:
            self.self_k = self.self_v = like.new_empty(R, H, 0, d)
        if self.pending is None and self.self_k.size(0) != R:  # (a copy would broadcast one row to all)
            raise ValueError(f"appending {R} rows to a cache of {self.self_k.size(0)} rows without a reorder")
        t = self.self_k.size(2)
        per_row = H * (t + T) * d
        if self._fits(R, per_row, like):
            self._room, self._room_layout = list(self.flat), self.layout
        else:
            self._room = [_storage(s, R * per_row, R * H * d, like) for s in self.spare]
            self._room_layout = R
            self.spare[:] = self.flat  # the next append's, written after this one has read them
        store_k, store_v = (_positions(s, t + T, self._room_layout, H, d).narrow(1, 0, R) for s in self._room if s is not None)
        return self.self_k, self.self_v, store_k, store_v

    def _fits(self, R: int, per_row: int, like: Tensor) -> bool:
        """Whether the next append can write into the keys' own buffers: no rows to select, the
        same rows, room for `per_row` elements a row of the buffers' layout."""
        return (self.pending is None and self.self_k is not None and self.self_k.size(0) == R <= self.layout
                and all(_usable(f, self.layout * per_row, like) for f in self.flat))

    def appended(self, k: Tensor, v: Tensor) -> None:
        """Take the keys/values that an append wrote into `room`'s storage.
        Shape: k, v (R, H, t + T, d_head)."""
        self.flat, self._room, self.layout = self._room, [None, None], self._room_layout
        self.self_k, self.self_v, self.pending = k, v, None

    def cross(self, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The cached cross-attention keys/values, and `q` regrouped to read them: the G rows of a
        sentence (its beam) attend as G*T queries of that sentence, so its keys are never copied.

        Shape: q (R, H, T, d_head), R = N * G -> q (N, H, G*T, d_head), k and v (N, H, S, d_head).
        """
        N, (R, H, T, d) = self.cross_k.size(0), q.shape
        if R > N:
            q = q.reshape(N, R // N, H, T, d).transpose(1, 2).reshape(N, H, R // N * T, d)
        return q, self.cross_k, self.cross_v

    def reorder_rows(self, indices: Tensor, m: "Moves | None" = None) -> None:
        """Self-attention rows: new row i continues old row indices[i]. With `m`, the moves of
        `indices` (`moves`; only where `movable`), rows that stay in place are not copied: the
        moved ones are copied within the keys' own buffer now. Otherwise all are selected at the
        next append (every layer of a cache alike: a compiled step passes one selection for all)."""
        if self.self_k is None or self.self_v is None:
            return
        if m is not None:
            assert self.movable(), "moves need keys in a buffer of the cache's, writable here, no selection pending"
            self.self_k, self.self_v = (_keep_rows(x.permute(2, 0, 1, 3), indices, m, dim=1).permute(1, 2, 0, 3)
                                        for x in (self.self_k, self.self_v))
            return
        self.pending = indices if self.pending is None else self.pending.index_select(0, indices)

    def movable(self) -> bool:
        """Whether rows can move within the keys' own buffer: they are in one (of `layout` rows a
        position), which may be written here, and no selection is pending."""
        return (self.pending is None and self.self_k is not None and self.layout > 0 and _writable_rows(self.self_k)
                and all(_usable(f, 0, self.self_k) for f in self.flat))


def ungroup(x: Tensor, rows: int, T: int) -> Tensor:
    """Undoes `LayerCache.cross`'s regrouping of a result. Shape: (N, H, G*T, C) -> (rows, H, T, C),
    rows = N * G."""
    N, H = x.size(0), x.size(1)
    if rows == N:
        return x
    return x.reshape(N, H, rows // N, T, x.size(-1)).transpose(1, 2).reshape(rows, H, T, x.size(-1))


def _append_into(old: Tensor, rows: Tensor | None, new: Tensor, store: Tensor) -> Tensor:
    """cat([old[rows], new], dim=2), written time-major into `store` (`LayerCache.room`): where
    `store` already holds `old` (an append in place), only the new positions are written.
    Its compiled twin is `append_kv` in `aiayn.step`, which both compiled steps call (tests/test_model.py runs it).

    Shape: old (R, H, t, d), new (R', H, T, d), store (capacity, R', H, d) -> (R', H, t+T, d)
    with strides (H*d, d, R'*H*d, 1)."""
    t, T = old.size(2), new.size(2)
    past = old.permute(2, 0, 1, 3)  # (t, R, H, d)
    if rows is not None:
        torch.index_select(past, 1, rows, out=store.narrow(0, 0, t))
    elif not past.is_set_to(store.narrow(0, 0, t)):
        store.narrow(0, 0, t).copy_(past)
    store.narrow(0, t, T).copy_(new.permute(2, 0, 1, 3))
    return store.narrow(0, 0, t + T).permute(1, 2, 0, 3)


def _positions(flat: Tensor, need: int, R: int, H: int, d: int) -> Tensor:
    """A flat buffer as time-major positions, at least `need` of them (all it holds, where a
    position holds anything). Shape: (n,) -> (n // (R*H*d), R, H, d)."""
    per = R * H * d
    if not per:
        return flat.narrow(0, 0, 0).view(need, R, H, d)
    return flat.narrow(0, 0, flat.numel() // per * per).view(-1, R, H, d)


def _storage(spare: Tensor | None, need: int, position: int, like: Tensor) -> Tensor:
    """`spare` if `_usable`, else a new flat buffer with room for 8 more positions (of `position`
    elements), so that the next steps can append in place, and reuse it as rows shrink."""
    if spare is not None and _usable(spare, need, like):
        return spare
    return like.new_empty(need + 8 * position)


def _usable(buffer: Tensor | None, need: int, like: Tensor) -> bool:
    """Whether `buffer` holds `need` elements of `like`'s kind and may be written here (a buffer
    made under inference mode cannot be written outside it)."""
    return (buffer is not None and buffer.numel() >= need and buffer.dtype == like.dtype and buffer.device == like.device
            and not (torch.is_inference(buffer) and not torch.is_inference_mode_enabled()))


IN_PLACE = True  # False: sentences leaving the batch always copy the source side (for comparison)

# A decoding step weighs each head's cross-attention values by its query's weights, `p @ v`, a product
# of a row by a matrix that torch 2.13 hands to MKL; MKL's generic code (the code it runs on AMD CPUs)
# does it 1.4-1.9x faster where each head's values lie dimension by dimension, (d_head, S), than
# position by position (one query, 800 heads x 14 positions x 64: 231 -> 127 us; 4 queries, a beam
# of 4: 1.4x at 14 positions, 0.86x at 40; docs/speed.md). So on the CPU in float32 the cache
# keeps them so, as a view (N, H, S, d_head) of (N, H, d_head, S) storage, which every reader takes
# as it is and `_keep_rows` keeps. False: position by position (for comparison).
VALUES_BY_DIM = True


def cached_values(v: Tensor) -> Tensor:
    """The cross-attention values as the cache keeps them (see the note above): a view (N, H, S, d_head)
    of (N, H, d_head, S) storage on the CPU in float32, else contiguous.
    Shape: (N, H, S, d_head) -> (N, H, S, d_head)."""
    if VALUES_BY_DIM and v.device.type == "cpu" and v.dtype == torch.float32 and not v.requires_grad:
        return v.transpose(-1, -2).contiguous().transpose(-1, -2)
    return v.contiguous()

Moves = tuple[Tensor, Tensor]  # (destination rows, source rows) of a selection done in place


def moves(indices: Tensor, rows: int) -> Moves | None:
    """The rows that keeping `indices` of `rows` rows moves (new row i is old row indices[i]), if
    moving them in place pays: at most half of the new rows move, as when finished sentences'
    places are taken by the last live ones. None otherwise (a copy is cheaper). Any selection can
    be done in place (`_keep_rows` reads every moved row before it writes one).
    Shape: indices (n,) -> (m,), (m,)."""
    n = indices.numel()
    if n > rows:
        return None
    dst = indices.ne(torch.arange(n, device=indices.device)).nonzero().squeeze(1)
    return (dst, indices.index_select(0, dst)) if 2 * dst.numel() <= n else None


def _writable_rows(x: Tensor) -> bool:
    """Whether rows of `x` may move in place (`_keep_rows`): search's inference tensors, in inference mode."""
    return torch.is_inference(x) and torch.is_inference_mode_enabled()


def _keep_rows(x: Tensor, indices: Tensor, m: Moves | None, dim: int = 0) -> Tensor:
    """x[indices] along `dim`: in place by the moves `m` of `indices` if given, else a copy. Only an
    inference tensor in inference mode (search's) is moved: outside it, one cannot be written, and
    any other tensor may have been saved for backward by cached decoding with autograd on (q @ k^T
    saves k even where k needs no gradient), which a write would break.
    Shape: (R, ...) -> (n, ...) (along `dim`)."""
    if m is None or not _writable_rows(x):
        if dim == 0 and x.dim() > 1 and not x.is_contiguous() and x.transpose(-1, -2).is_contiguous():
            return x.transpose(-1, -2).index_select(0, indices).transpose(-1, -2)  # values by dimension, kept so
        return x.index_select(dim, indices)
    if m[0].numel():
        x.index_copy_(dim, m[0], x.index_select(dim, m[1]))
    return x.narrow(dim, 0, indices.numel())


@dataclass
class DecoderCache:
    """The decoding cache: per-layer keys/values, the source padding mask and the decoded length.

    The cache holds N sentences and R = N * `beam` decoder rows; row r belongs to sentence
    r // beam. `reorder(indices, beam)` selects rows: beam search gives every sentence `beam` rows,
    reorders hypotheses and drops finished sentences. Source-side state
    (cross-attention keys/values, `src_keep`) is kept once per sentence and only copied when the
    set of sentences changes; where few of the sentences that stay change places (`moves`: the
    last live ones taking the places of those that left, `search._survivors`), only those move, in
    place (greedy int8, test_2016_flickr: 2-4% of a search; docs/speed.md).
    """

    layers: list[LayerCache]
    src_keep: Tensor  # (N, S) bool, True = real source token
    length: int = 0
    beam: int = 1  # decoder rows per sentence
    step_plan: Any = None  # `step.decoder_step`'s compiled plan for this search (False: none)

    def reorder(self, indices: Tensor, beam: int | None = None, same_sentences: bool = False) -> None:
        """Keep rows `indices` (R',): new row i continues old row indices[i].

        `beam` (default: unchanged) is the number of rows per sentence afterwards. With more than one
        row per sentence, before or after, the new rows must come in groups of `beam` that each
        come from one sentence's rows (beam search's reordering does); a group's sentence is that of
        its first row. `same_sentences` says that every sentence keeps its place (beam search knows
        when none has left): the check, a host read of the device, is skipped then.
        """
        beam = self.beam if beam is None else int(beam)
        sentences = indices[::beam]
        if self.beam > 1:
            sentences = sentences.div(self.beam, rounding_mode="floor")
        N = self.src_keep.size(0)
        unchanged = same_sentences or (sentences.numel() == N and bool(
            sentences.eq(torch.arange(N, device=sentences.device)).all()))
        m = None
        if not unchanged:  # sentences left the batch (or were permuted): select the source side
            m = moves(sentences, N) if IN_PLACE else None
            for layer in self.layers:
                layer.cross_k, layer.cross_v = (_keep_rows(x, sentences, m) for x in (layer.cross_k, layer.cross_v))
            self.src_keep = self.src_keep.index_select(0, sentences)
        if self.beam == beam == 1 and unchanged:
            return  # greedy, every row where it was
        # greedy (a row per sentence) moves its rows as the source side's, if every layer can
        if not (m is not None and self.beam == beam == 1 and all(layer.movable() for layer in self.layers)):
            m = None
        for layer in self.layers:
            layer.reorder_rows(indices, m)
        self.beam = beam
