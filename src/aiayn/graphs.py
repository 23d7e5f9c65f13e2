"""Search's decoder step on a GPU as one replayed CUDA graph.

On a GPU a search step of a translation-sized model gives the card little work: the host launching
the step's ~150 small kernels one by one is the step's cost, and the card waits (beam 4 on an H200,
Multi30k's 3+3 layers: the GPU busy 10% of a step; docs/gpu.md). A CUDA graph launches them all at
once. It replays fixed work on fixed memory, so the step runs here on fixed-size buffers:

- rows: `sentences x G` (G = rows per sentence: 1 for greedy, the beam for beam search, whose
  first step, one row per sentence, runs eagerly as every first step does), the sentences rounded
  up to a power of two; search's live rows are the first ones and rows past them compute on stale
  state that nobody reads;
- the self-attention keys/values of every layer in one buffer of `capacity` positions (32, 64,
  128, ...), attended with a mask up to the current position; each step reorders its rows (beam
  search's parents) and writes the new position, inside the graph;
- the source side (cross-attention keys/values and mask) in buffers of a source length rounded
  up to a multiple of 64, filled again only when sentences leave the batch.

The shapes are coarse so that the batches of a `translate` run share a few graphs: capturing one
costs a few eager steps.

Graphs are kept per shape on the model (`Graphs`, a few, least recently used dropped), so the
batches of one `translate` run reuse them. A graph belongs to one search at a time (its cache);
the step hands the keys/values back to the cache as views of its buffers, so a search can go on
without the graph (a longer output than the largest capacity, another search holding the graph).
The same steps run without capture on a CPU when a test switches them on (`ENABLED`), and must
give the eager search's tokens (tests/test_graphs.py; tests/test_cuda.py on a GPU).
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections import OrderedDict
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import sdpa_kernel

from aiayn import kernels

ENABLED = {"cuda": True, "cpu": False}  # per device type; on the CPU for tests only (no capture there)
MAX_CAPACITY = 1024  # positions; a longer output goes on without the graph
MAX_BYTES = 2**30  # self-attention buffers of one graph at most (it holds as much again); a larger batch runs without
KEEP = 4  # graphs kept per model


class Key(NamedTuple):
    sentences: int  # rounded up to a power of two
    group: int  # rows per sentence
    source: int  # source positions, rounded up to a multiple of 64
    capacity: int  # self-attention positions
    dtype: torch.dtype
    weights: tuple[int, ...]  # where the weights live: a graph reads those addresses


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _pow2(n: int, least: int) -> int:
    return max(least, 1 << (n - 1).bit_length())


class _Graph:
    """Fixed-size state and one decoder step over it, captured as a CUDA graph on a GPU."""

    def __init__(self, model: Any, key: Key, device: torch.device) -> None:
        dec, cfg = model.decoder, model.cfg
        N, G, S, C = key.sentences, key.group, key.source, key.capacity
        R, H, L = N * G, cfg.n_heads, len(dec.layers)
        self.key, self.rows = key, R  # the model is passed to each call: a graph held by the model never holds it
        # a graph reads these by address: held here, so that none is freed while the graph lives
        self.reads = [*dec.parameters(), model.tgt_embed.weight, model.pos.table]
        self.dh = cfg.d_model // H
        dev = device
        self.tokens = torch.full((R,), cfg.pad_id, dtype=torch.long, device=dev)  # (R,) the newest token of each row
        self.order = torch.arange(R, device=dev)  # (R,) row i continues row order[i] (beam search's parents)
        self.identity = torch.arange(R, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)  # the newest token's position
        self.positions = torch.arange(C, device=dev)  # (C,)
        self.kv = torch.zeros(L, 2, R, H, C, self.dh, dtype=key.dtype, device=dev)  # self-attention keys/values
        self.cross_kv = torch.zeros(L, 2, N, H, S, self.dh, dtype=key.dtype, device=dev)
        self.src_mask = torch.ones(N, 1, 1, S, dtype=torch.bool, device=dev)  # True = a real source token
        self.owner: weakref.ref | None = None  # the search's cache using the state now
        self.source_of: Tensor | None = None  # the cache's `src_keep` that the source buffers hold
        self.graph: Any = None
        self.out: Tensor | None = self._capture(model) if device.type == "cuda" else None

    def _capture(self, model: Any) -> Tensor:
        """Warm up on a side stream (cuBLAS's handles, the allocator), then record one step."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step(model)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            out = self.step(model)
        self.kv.zero_()  # the warm-up wrote stale positions; a search loads its own state anyway
        return out

    def run(self, model: Any) -> Tensor:
        """One step; the output rows are valid until the next. Shape: -> (R, d)."""
        if self.graph is None or self.out is None:
            return self.step(model)
        self.graph.replay()
        return self.out

    # ------------------------------------------------------------------- the step, on the buffers

    def step(self, m: Any) -> Tensor:
        """Embedding, every decoder layer (the rows reordered, the new keys/values written at
        `pos`), the final norm: what `kernels.decoder_step` computes, on fixed shapes. -> (R, d)."""
        with sdpa_kernel(kernels.GPU_ATTENTION_BACKENDS) if self.tokens.is_cuda else _null():
            self.kv.copy_(self.kv.index_select(2, self.order))  # beam search's parents, every layer at once
            x = m.tgt_embed(self.tokens)  # (R, d)
            x = x + m.pos.table.index_select(0, self.pos).to(x.dtype)  # (1, d) broadcast
            self_mask = (self.positions <= self.pos).view(1, 1, 1, -1)  # (1, 1, 1, C)
            for i, layer in enumerate(m.decoder.layers):
                x = kernels._residual_step(layer, layer.norm1, x, lambda h: self._self_attend(layer.self_attn, h, i, self_mask))  # noqa: B023
                x = kernels._residual_step(layer, layer.norm2, x, lambda h: self._cross_attend(layer.cross_attn, h, i))  # noqa: B023
                x = kernels._residual_step(layer, layer.norm3, x, lambda h: kernels._feed_forward_step(layer.ff, h))  # noqa: B023
            norm = m.decoder.norm
            return x if norm is None else kernels._layer_norm(norm, x)

    def _self_attend(self, mha: Any, x: Tensor, layer: int, mask: Tensor) -> Tensor:
        """Shape: x (R, d) -> (R, d)."""
        R, H, dh = self.rows, mha.n_heads, mha.d_head
        qkv = kernels.inference_linear(x, mha.qkv_proj.weight, mha.qkv_proj.bias)  # (R, 3d)
        q, k, v = qkv.view(R, 1, 3, H, dh).permute(2, 0, 3, 1, 4).unbind(0)  # (R, H, 1, dh) each
        keys, values = self.kv[layer, 0], self.kv[layer, 1]  # (R, H, C, dh)
        keys.index_copy_(2, self.pos, k.to(keys.dtype))
        values.index_copy_(2, self.pos, v.to(values.dtype))
        ctx, _ = kernels.attention(q, keys, values, mask, False, 0.0, False)  # (R, H, 1, dh)
        return kernels.inference_linear(ctx.transpose(1, 2).reshape(R, -1), mha.out_proj.weight, mha.out_proj.bias)

    def _cross_attend(self, mha: Any, x: Tensor, layer: int) -> Tensor:
        """A sentence's G rows read its keys as G queries (as `LayerCache.cross`). Shape: x (R, d) -> (R, d)."""
        R, H, dh = self.rows, mha.n_heads, mha.d_head
        N, G = self.key.sentences, self.key.group
        q = kernels.inference_linear(x, mha.q_proj.weight, mha.q_proj.bias).view(N, G, H, dh).transpose(1, 2)  # (N, H, G, dh)
        ctx, _ = kernels.attention(q, self.cross_kv[layer, 0], self.cross_kv[layer, 1], self.src_mask, False, 0.0, False)
        return kernels.inference_linear(ctx.transpose(1, 2).reshape(R, -1), mha.out_proj.weight, mha.out_proj.bias)

    # ------------------------------------------------------------------- a search's state in and out

    def load(self, cache: Any) -> None:
        """Take a search's state from its cache: source side, and the keys/values so far with the
        pending reorder applied. The next step then keeps the rows as they are."""
        self.load_source(cache)
        t = cache.length
        for i, lc in enumerate(cache.layers):
            for j, x in enumerate((lc.self_k, lc.self_v)):
                if x is None or t == 0:
                    continue
                x = x if lc.pending is None else x.index_select(0, lc.pending)
                self.kv[i, j, :x.size(0), :, :t].copy_(x)
            lc.pending = None  # applied
        self.owner = weakref.ref(cache)

    def load_source(self, cache: Any) -> None:
        """The cross-attention keys/values and the source mask of the sentences still in the search."""
        n, S = cache.src_keep.shape
        self.src_mask.fill_(True)  # rows past the live sentences attend everywhere (stale, unread)
        self.src_mask[:n, 0, 0, :S].copy_(cache.src_keep)
        self.src_mask[:n, 0, 0, S:] = False
        for i, lc in enumerate(cache.layers):
            self.cross_kv[i, 0, :n, :, :S].copy_(lc.cross_k)
            self.cross_kv[i, 1, :n, :, :S].copy_(lc.cross_v)
        self.source_of = cache.src_keep

    def prepare(self, cache: Any, tokens: Tensor) -> None:
        """The step's inputs: the rows' newest tokens, their parents and the position. Shape: tokens (b,)."""
        b = tokens.size(0)
        if cache.src_keep is not self.source_of:  # sentences left the batch
            self.load_source(cache)
        pending = cache.layers[0].pending
        self.order.copy_(self.identity)
        if pending is not None:
            self.order[:b].copy_(pending)
        self.tokens[:b].copy_(tokens)
        self.pos.fill_(cache.length)

    def hand_back(self, cache: Any, b: int) -> None:
        """The cache's keys/values as views of the buffers, so that it can go on without the graph."""
        t = cache.length + 1
        for i, lc in enumerate(cache.layers):
            lc.self_k, lc.self_v = self.kv[i, 0, :b, :, :t], self.kv[i, 1, :b, :, :t]
            lc.pending, lc.flat = None, [None, None]


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class Graphs:
    """A model's captured steps, by shape; one lock, so that two threads never replay together."""

    def __init__(self) -> None:
        self.graphs: OrderedDict[Key, _Graph] = OrderedDict()
        self.failed: set[Key] = set()  # shapes whose capture failed: they run eagerly
        self.lock = threading.Lock()

    def step(self, model: Any, tokens: Tensor, cache: Any) -> Tensor | None:
        """The decoder step of search's rows on a graph, or None where none applies (the caller runs
        the eager step). Shape: tokens (b,) -> (b, d)."""
        key = _key(model, tokens, cache)
        if key is None:
            return None
        with self.lock:
            g = self._graph(model, key, tokens.device, cache)
            if g is None:
                return None
            if g.owner is None or g.owner() is not cache:
                for other in self.graphs.values():
                    if other.owner is not None and other.owner() is cache:
                        other.owner = None  # this search moves on to a larger graph
                g.load(cache)
            g.prepare(cache, tokens)
            out = g.run(model)
            g.hand_back(cache, tokens.size(0))
            return out[: tokens.size(0)]

    def _graph(self, model: Any, key: Key, device: torch.device, cache: Any) -> _Graph | None:
        g = self.graphs.get(key)
        if g is not None:
            holder = None if g.owner is None else g.owner()
            if holder is not None and holder is not cache:
                return None  # another search holds it: this one goes on eagerly
            self.graphs.move_to_end(key)
            return g
        for old, h in list(self.graphs.items()):
            if len(self.graphs) < KEEP:
                break
            if h.owner is None or h.owner() is None:
                del self.graphs[old]
        if len(self.graphs) >= KEEP or key in self.failed:
            return None
        try:
            g = self.graphs[key] = _Graph(model, key, device)
        except (RuntimeError, torch.OutOfMemoryError) as e:  # a card or build that cannot capture: eager steps
            self.failed.add(key)
            if len(self.failed) == 1:
                print(f"aiayn: warning: decoding without CUDA graphs ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''})", file=sys.stderr, flush=True)
            return None
        return g


def _key(model: Any, tokens: Tensor, cache: Any) -> Key | None:
    """The shape of graph that this step fits, or None where a graph does not apply: not enabled
    on this device, training, weights not frozen (a model being trained: its graphs would hold memory
    through training; `Translator` freezes them), outside inference mode, under autocast (a graph must not read
    autocast's cached weight copies, which go with its context; `Translator` runs bf16 on a bf16
    copy instead), int8 weights, a position past MAX_CAPACITY or the positional table, buffers over
    MAX_BYTES, or a cache with odd rows."""
    dev = tokens.device
    if not ENABLED.get(dev.type, False) or model.training or model.tgt_embed.weight.requires_grad \
            or not torch.is_inference_mode_enabled() \
            or torch.is_autocast_enabled(dev.type) or kernels.is_int8(model.decoder.layers[0].ff.w1.weight):
        return None
    n, S = cache.src_keep.shape
    b = tokens.size(0)
    if n == 0 or b % n or cache.layers[0].cross_k.size(0) != n:
        return None
    G, t = b // n, cache.length
    if t == 0 or t + 1 > MAX_CAPACITY:  # the first step runs eagerly: beam search's has one row per sentence
        return None
    dtype = model.tgt_embed.weight.dtype
    N, C = _pow2(n, 8), min(_pow2(t + 1, 32), MAX_CAPACITY, model.pos.table.size(0))
    if C < t + 1:
        return None
    cfg = model.cfg
    size = len(model.decoder.layers) * 2 * N * G * C * cfg.d_model * torch.finfo(dtype).bits // 8
    if size > MAX_BYTES:
        return None
    weights = cache.__dict__.get("graph_weights")  # where the weights live, found once per search
    if weights is None:
        weights = cache.__dict__["graph_weights"] = tuple(p.data_ptr() for p in model.decoder.parameters()) + (
            model.tgt_embed.weight.data_ptr(), model.pos.table.data_ptr())
    return Key(N, G, _round_up(S, 64), C, dtype, weights)


def for_model(model: nn.Module) -> Graphs:
    """The model's graphs (made on first use; not a module, buffer or parameter: never saved)."""
    g = model.__dict__.get("_graphs")
    if g is None:
        g = model.__dict__["_graphs"] = Graphs()
    return g
