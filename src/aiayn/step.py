"""Search's decoding step: the decoder for one new position on the key/value cache (Section 3.2.3's
masked self-attention, the cross-attention and the feed-forward layer of each decoder layer), as
`Transformer.decode` runs it with a cache, the same operations as the decoder's forward with fewer
calls, and its compiled twins that TorchScript dispatches from C++: on the CPU in int8 and in
float32 or bf16 (one source for all three), on a GPU in float. Nothing here changes what the model
computes: tests/test_search.py pins every path to the decoder's forward, bitwise (the GPU's float
one here on the CPU, with a GPU's linear layers and attention), and tests/test_cuda.py the GPU's
one there to the Python step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn import kernels


COMPILED_STEPS = True  # False: every search's step in Python (what bench/engines.py's "Python step" rows time)


def decoder_step(decoder: Any, x: Tensor, cache: Any, src_keep: Tensor) -> Tensor:
    """`Decoder.forward` for one new position on the key/value cache (`DecoderCache`), as search's
    steps run it: the same operations in the same order, without the general path's branches and
    module calls, and with the source mask's additive form made once per step rather than per layer.
    Once few sentences are left in a batch these cost as much as the arithmetic (int8, a step at
    one sentence: 0.69 -> 0.63 ms, measured in one process; docs/speed.md), and in the common cases
    the whole stack runs compiled with the same operations: int8, float32 or bf16 on the CPU
    (`_StepPlan`), float on a GPU (`_FloatStepPlan`). Dropout follows each
    module's `training` as forward does; forward hooks of the modules do not run here.

    Shape: x (b, d), src_keep (N, S) bool -> (b, d); b = N * beam rows."""
    if cache.step_plan is None:
        cache.step_plan = COMPILED_STEPS and (_StepPlan.make(decoder, cache) or _FloatStepPlan.make(decoder, cache)) or False
    if cache.step_plan and cache.step_plan.applies(x, cache):
        return cache.step_plan.run(decoder, x, cache, src_keep)
    mask, bias = src_keep[:, None, None, :], kernels.MaskBias()  # (N, 1, 1, S)
    for layer, lc in zip(decoder.layers, cache.layers, strict=True):
        x = _residual_step(layer, layer.norm1, x, lambda h: _attention_step(layer.self_attn, h, lc))  # noqa: B023
        x = _residual_step(layer, layer.norm2, x, lambda h: _attention_step(layer.cross_attn, h, lc, mask, bias))  # noqa: B023
        x = _residual_step(layer, layer.norm3, x, lambda h: _feed_forward_step(layer.ff, h))  # noqa: B023
    return x if decoder.norm is None else _layer_norm(decoder.norm, x)


def _layer_norm(norm: nn.LayerNorm, x: Tensor) -> Tensor:
    """What `norm(x)` computes, without the module call."""
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def _residual_step(layer: Any, norm: nn.LayerNorm, x: Tensor, f: Callable[[Tensor], Tensor]) -> Tensor:
    """The layer's `_residual` (post- or pre-norm) without module calls."""
    if layer.norm_first:
        return x + kernels.dropout(f(_layer_norm(norm, x)), layer.dropout, layer.training)
    return _layer_norm(norm, x + kernels.dropout(f(x), layer.dropout, layer.training))


def _feed_forward_step(ff: Any, x: Tensor) -> Tensor:
    """`FeedForward.forward` without module calls. Shape: (b, d) -> (b, d)."""
    if ff.act is F.relu and not ff.training:  # inference: ReLU fused into the first GEMM
        h = kernels.inference_linear(x, ff.w1.weight, ff.w1.bias, relu=True)
    else:
        h = kernels.dropout(ff.act(kernels.inference_linear(x, ff.w1.weight, ff.w1.bias)), ff.dropout, ff.training)
    return kernels.inference_linear(h, ff.w2.weight, ff.w2.bias)


def _attention_step(mha: Any, x: Tensor, cache: Any, key_keep: Tensor | None = None,
                    bias: kernels.MaskBias | None = None) -> Tensor:
    """`MultiHeadAttention.forward` for one new position: self-attention appends to the layer's
    cache, cross-attention reads it (`LayerCache.cross`), `key_keep` (N, 1, 1, S) masking the
    source, its additive form kept in `bias`. Shape: x (b, d) -> (b, d)."""
    b, D = x.shape
    H, dh = mha.n_heads, mha.d_head
    if mha.cross:
        q = kernels.inference_linear(x, mha.q_proj.weight, mha.q_proj.bias).view(b, 1, H, dh).transpose(1, 2)  # (b, H, 1, dh)
        q, k, v = cache.cross(q)  # q (N, H, G, dh): a sentence's G beam rows read its keys once
    else:
        qkv = kernels.inference_linear(x, mha.qkv_proj.weight, mha.qkv_proj.bias)  # (b, 3d)
        q, k, v = qkv.view(b, 1, 3, H, dh).permute(2, 0, 3, 1, 4).unbind(0)  # (b, H, 1, dh) each
        k, v = cache.append(k, v)  # (b, H, t, dh)
    ctx, _ = kernels.attention(q, k, v, key_keep, False, mha.dropout if mha.training else 0.0, mha.training, bias=bias)
    # (N, H, G, dh) -> (N, G, H, dh) -> (b, d): each row back in its place, heads side by side
    return kernels.inference_linear(ctx.transpose(1, 2).reshape(b, D), mha.out_proj.weight, mha.out_proj.bias)


# ------------------------------------------------------------ search's CPU step, compiled
# Once few sentences are left in a batch, the Python between a step's ~100 operations costs more
# than they do. In the common cases on the CPU (int8 weights, or frozen float32 or bf16 ones that
# oneDNN packs; activations of that dtype, inference, keys short enough for the explicit attention) the whole
# decoder stack runs as one compiled TorchScript call (`decoder_layers`), the self-attention
# appends included, into storage that the cache hands out (`LayerCache.room`): the operations of
# `decoder_step` in the same order, so bitwise the same results, dispatched from C++ (int8, a
# greedy step at one sentence 0.47 -> 0.33 ms with each layer's work after its append compiled,
# 0.64 -> 0.55 ms on another CPU with the whole stack; docs/speed.md). One source serves both
# weight kinds: its linear layers call `int8_op` (`kernels._INT8_SOURCE`, `compiled_step`), which
# the float unit spells `dense`, a call of the packed GEMM `kernels.inference_linear` runs
# (`_DENSE_SOURCE`, `dense_step`). Anything else, or a failure to compile, takes the Python step.
_SHARED_STEP_SOURCE = """
def residual(x: Tensor, y: Tensor, w: Tensor, b: Tensor, eps: float, norm_first: bool) -> Tensor:
    if norm_first:
        return x + y
    return torch.layer_norm(x + y, [x.size(1)], w, b, eps)

def sublayer_input(x: Tensor, w: Tensor, b: Tensor, eps: float, norm_first: bool) -> Tensor:
    if norm_first:
        return torch.layer_norm(x, [x.size(1)], w, b, eps)
    return x

def append_kv(old: Tensor, rows: Optional[Tensor], new: Tensor, store: Tensor) -> Tensor:
    t, T = old.size(2), new.size(2)
    past = old.permute([2, 0, 1, 3])
    if rows is not None:
        torch.index_select(past, 1, rows, out=store.narrow(0, 0, t))
    elif not past.is_set_to(store.narrow(0, 0, t)):
        store.narrow(0, 0, t).copy_(past)
    store.narrow(0, t, T).copy_(new.permute([2, 0, 1, 3]))
    return store.narrow(0, 0, t + T).permute([1, 2, 0, 3])
"""  # both compiled steps' residuals and appends
_STEP_SOURCE = _SHARED_STEP_SOURCE + """
def softmax_rows(x: Tensor, short: int, min_rows: int) -> Tensor:
    S = x.size(-1)
    if S > 0 and S < short and x.numel() >= min_rows * S:  # (TorchScript has no chained comparisons)
        e = (x - x.amax(-1, True)).exp_()
        return e.div_(e.sum(-1, True))
    return torch.softmax(x, -1, torch.float32)

def attend(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], scale: float, short: int, min_rows: int,
           small: int, keys_first: bool) -> Tensor:
    B, H, T, dh, S = q.size(0), q.size(1), q.size(2), q.size(3), k.size(2)
    if keys_first and T == 1 and k.is_contiguous():
        kr = k.reshape(B * H, S, dh)
        if bias is None:
            scores = torch.bmm(kr, (q * scale).reshape(B * H, 1, dh).transpose(1, 2)).view(B * H, 1, S)
        else:
            scores = torch.baddbmm(bias.transpose(1, 2), kr, q.reshape(B * H, 1, dh).transpose(1, 2), beta=1, alpha=scale).view(B * H, 1, S)
    else:
        kt = k.reshape(B * H, S, dh).transpose(1, 2)
        if bias is None:
            scores = torch.bmm((q * scale).reshape(B * H, T, dh), kt)
        else:
            scores = torch.baddbmm(bias, q.reshape(B * H, T, dh), kt, beta=1, alpha=scale)
    p = softmax_rows(scores, short, min_rows).to(scores.dtype).view(B, H, T, S)
    if T == 1 and S * dh < small:
        return (v * p.transpose(-1, -2)).sum(-2, True)
    return torch.matmul(p, v)

def after_append(x: Tensor, q: Tensor, k: Tensor, v: Tensor, ck: Tensor, cv: Tensor, bias: Tensor,
                 wo: __torch__.torch.classes.quantized.LinearPackedParamsBase,
                 wq: __torch__.torch.classes.quantized.LinearPackedParamsBase,
                 wco: __torch__.torch.classes.quantized.LinearPackedParamsBase,
                 w1: __torch__.torch.classes.quantized.LinearPackedParamsBase,
                 w2: __torch__.torch.classes.quantized.LinearPackedParamsBase,
                 norms: List[Tensor], eps: float, scale: float, norm_first: bool, act: int,
                 rr: bool, short: int, min_rows: int, small: int, keys_first: bool) -> Tensor:
    b, D, H, N = x.size(0), x.size(1), q.size(1), ck.size(0)
    ctx = attend(q, k, v, None, scale, short, min_rows, small, keys_first)
    x = residual(x, int8_op(ctx.transpose(1, 2).reshape(b, D), wo, False, rr), norms[0], norms[1], eps, norm_first)
    h = sublayer_input(x, norms[2], norms[3], eps, norm_first)
    qc = int8_op(h, wq, False, rr).view(b, 1, H, D // H).transpose(1, 2)
    if b > N:
        qc = qc.reshape(N, b // N, H, 1, D // H).transpose(1, 2).reshape(N, H, b // N, D // H)
    ctx = attend(qc, ck, cv, bias, scale, short, min_rows, small, keys_first)
    x = residual(x, int8_op(ctx.transpose(1, 2).reshape(b, D), wco, False, rr), norms[2], norms[3], eps, norm_first)
    h = sublayer_input(x, norms[4], norms[5], eps, norm_first)
    if act == 0:
        f = int8_op(int8_op(h, w1, True, rr), w2, False, rr)
    elif act == 1:
        f = int8_op(torch.ops.aten.gelu(int8_op(h, w1, False, rr)), w2, False, rr)
    else:
        f = int8_op(torch.ops.aten.silu(int8_op(h, w1, False, rr)), w2, False, rr)
    return residual(x, f, norms[4], norms[5], eps, norm_first)

def decoder_layers(x: Tensor, qkv: List[__torch__.torch.classes.quantized.LinearPackedParamsBase],
                   packs: List[List[__torch__.torch.classes.quantized.LinearPackedParamsBase]],
                   norms: List[List[Tensor]], old_k: List[Tensor], old_v: List[Tensor], store_k: List[Tensor],
                   store_v: List[Tensor], rows: Optional[Tensor], ck: List[Tensor], cv: List[Tensor], bias: Tensor,
                   H: int, eps: float, scale: float, norm_first: bool, act: int, rr: bool, short: int,
                   min_rows: int, small: int, keys_first: bool) -> Tuple[Tensor, List[Tensor], List[Tensor]]:
    b, D = x.size(0), x.size(1)
    ks: List[Tensor] = []
    vs: List[Tensor] = []
    for i in range(len(qkv)):
        h = sublayer_input(x, norms[i][0], norms[i][1], eps, norm_first)
        y = int8_op(h, qkv[i], False, rr).view([b, 1, 3, H, D // H]).permute([2, 0, 3, 1, 4])
        k = append_kv(old_k[i], rows, y[1], store_k[i])
        v = append_kv(old_v[i], rows, y[2], store_v[i])
        p = packs[i]
        x = after_append(x, y[0], k, v, ck[i], cv[i], bias, p[0], p[1], p[2], p[3], p[4], norms[i], eps, scale,
                         norm_first, act, rr, short, min_rows, small, keys_first)
        ks.append(k)
        vs.append(v)
    return x, ks, vs
"""
_ACTIVATIONS = (F.relu, F.gelu, F.silu)  # FeedForward.act -> `act` above


class _Stack(NamedTuple):
    """What a compiled step takes as one setting for every decoder layer, which must agree on it."""

    heads: int
    eps: float
    norm_first: bool
    act: int  # index into _ACTIVATIONS

    @classmethod
    def of(cls, decoder: Any) -> "_Stack | None":
        """The settings, or None where a compiled step cannot take the stack: no layers, a module in
        training (dropout), layers unlike each other, another activation."""
        layers = list(decoder.layers)
        if not layers or decoder.training:
            return None
        alike = {(n.eps, layer.norm_first, layer.ff.act, layer.self_attn.n_heads, layer.cross_attn.n_heads)
                 for layer in layers for n in (layer.norm1, layer.norm2, layer.norm3)}
        if len(alike) != 1 or layers[0].ff.act not in _ACTIVATIONS or any(
                m.training for layer in layers for m in (layer, layer.self_attn, layer.cross_attn, layer.ff)):
            return None
        first = layers[0]
        return cls(first.self_attn.n_heads, first.norm1.eps, bool(first.norm_first), _ACTIVATIONS.index(first.ff.act))


@dataclass
class _StepPlan:
    """The compiled CPU step's arguments for one search: each layer's int8 weights (FBGEMM packs)
    or float ones (oneDNN-packed weight and bias, float32 or bf16), and norms."""

    qkv: list[Any]  # per layer: the self-attention's fused q/k/v projection
    packs: list[list[Any]]  # per layer: self-attention out, cross-attention q and out, feed-forward w1, w2
    norms: list[list[Tensor]]  # per layer: norm1 weight, bias, norm2 weight, bias, norm3 weight, bias
    stack: _Stack
    unit: Any
    copies_from: int  # steps with this many rows or more take the Python step (see `_layer_plan`)
    dtype: torch.dtype  # of the activations: float32, or bf16 with bf16 weights
    bias: kernels.MaskBias = field(default_factory=kernels.MaskBias)  # the source mask's additive form, kept across steps

    @classmethod
    def make(cls, decoder: Any, cache: Any) -> "_StepPlan | None":
        """The plan, or None where the compiled step does not apply for the whole search."""
        stack = _Stack.of(decoder)
        if stack is None or cache.layers[0].cross_k.size(2) > kernels.EXPLICIT_ATTENTION_MAX_KEYS:
            return None
        plan, unit, dtype = [_layer_plan(layer) for layer in decoder.layers], compiled_step, torch.float32
        if any(p is None for p in plan):  # not int8: float weights that oneDNN packs, or nothing to compile
            dtype = decoder.layers[0].self_attn.qkv_proj.weight.dtype
            plan, unit = [_dense_layer_plan(layer, dtype) for layer in decoder.layers], dense_step
            if any(p is None for p in plan):  # (a float model on a GPU, a trainable one, bf16 without fast kernels)
                return None
        unit = unit()
        if not unit or not hasattr(unit, "decoder_layers"):
            return None
        layer_plans = [p for p in plan if p is not None]
        return cls([p.packs[0] for p in layer_plans], [p.packs[1:] for p in layer_plans],
                   [p.norms for p in layer_plans], stack, unit, min(p.copies_from for p in layer_plans), dtype)

    def applies(self, x: Tensor, cache: Any) -> bool:
        """Per step: the plan's dtype on the CPU, no autocast, gradients off (search runs under
        inference mode; with them on, a trainable norm or source side would carry them into the
        appends into storage, and the spelled-out softmax is for inference only), keys the explicit
        attention takes, fewer rows than a oneDNN copy runs from."""
        return (x.dtype == self.dtype and x.device.type == "cpu" and not torch.is_autocast_enabled("cpu")
                and x.size(0) < self.copies_from
                and not torch.is_grad_enabled() and cache.length < kernels.EXPLICIT_ATTENTION_MAX_KEYS)

    def run(self, decoder: Any, x: Tensor, cache: Any, src_keep: Tensor) -> Tensor:
        """`decoder_step`'s work. Shape: x (b, d) -> (b, d)."""
        D, (H, eps, norm_first, act) = x.size(1), self.stack
        bias = self.bias.get(src_keep[:, None, None, :], src_keep.size(0), H, self.dtype, source=src_keep)  # (N*H | 1, 1, S)
        fp32 = self.dtype == torch.float32  # the spelled-out softmax and weighted sum: float32 only (as `kernels`)
        x, ks, vs = self.unit.decoder_layers(
            x, self.qkv, self.packs, self.norms, *_cache_arguments(cache, x, H), bias, H, eps,
            1.0 / math.sqrt(D // H), norm_first, act, kernels._INT8_REDUCE_RANGE, kernels.SHORT_ROW if fp32 else 0,
            kernels.SHORT_ROWS_MIN, kernels.SMALL_BMM if fp32 else 0, fp32 and kernels.ONE_QUERY_KEYS_FIRST)
        return _compiled_step_done(decoder, cache, x, ks, vs)


class _LayerPlan(NamedTuple):
    """One decoder layer's part of the compiled step's arguments."""

    packs: list[Any]  # FBGEMM packs, or oneDNN (weight, bias): q/k/v, self-attention out, cross q and out, w1, w2
    norms: list[Tensor]  # norm1 weight, bias, norm2 weight, bias, norm3 weight, bias
    copies_from: int  # the fewest rows from which one of these weights runs on its oneDNN copy


NO_COPY = 2**62  # `copies_from` where no weight keeps a oneDNN copy


def _layer_plan(layer: Any) -> _LayerPlan | None:
    """One layer's int8 packs and norm tensors, or None if one of its linear layers is not int8.
    The compiled step runs FBGEMM only: a step with as many rows as a oneDNN copy runs from takes
    the Python step."""
    packs, copies_from = [], NO_COPY
    for w in (lin.weight for lin in _linears(layer)):
        q = kernels._INT8.get(id(w))
        if q is None or q[0]() is not w:
            return None
        packs.append(q[1])
        if q[2] is not None:
            copies_from = min(copies_from, q[2].rows)
    norms = _norms(layer, torch.float32)
    return None if norms is None else _LayerPlan(packs, norms, copies_from)


def _dense_layer_plan(layer: Any, dtype: torch.dtype) -> _LayerPlan | None:
    """One layer's oneDNN-packed weights with their biases, all in `dtype` (what
    `kernels.inference_linear` runs them on), and norm tensors, or None if one of its linear layers
    does not run packed."""
    lins = _linears(layer)
    if not all(kernels.packs(lin.weight, dtype) and lin.weight.dtype == dtype and (lin.bias is None or lin.bias.dtype == dtype)
               for lin in lins):  # (`packs` takes float32 and bf16 only)
        return None
    norms = _norms(layer, dtype)
    if norms is None:
        return None
    return _LayerPlan([kernels.packed_weight(lin.weight, lin.bias, dtype) for lin in lins], norms, NO_COPY)


def _linears(layer: Any) -> tuple[Any, ...]:
    """A decoder layer's linear layers in the order the compiled steps take them: q/k/v,
    self-attention out, cross-attention q and out, feed-forward w1, w2."""
    sa, ca, ff = layer.self_attn, layer.cross_attn, layer.ff
    return sa.qkv_proj, sa.out_proj, ca.q_proj, ca.out_proj, ff.w1, ff.w2


def _norms(layer: Any, dtype: torch.dtype) -> list[Tensor] | None:
    """norm1 weight, bias, norm2 weight, bias, norm3 weight, bias, if all are tensors of `dtype`."""
    norms = [t for n in (layer.norm1, layer.norm2, layer.norm3) for t in (n.weight, n.bias)]
    return None if any(t is None or t.dtype != dtype for t in norms) else norms


# ------------------------------------------------------------ search's float step on a GPU, compiled
# On a GPU a decoding step waits on the host (the card is busy about a tenth of it; docs/gpu.md),
# and Python's share of the host's work per operation is larger than the launch it makes. There the
# decoder stack in float (fp32, bf16 or fp16 weights, no autocast) runs as one TorchScript call as
# well: `decoder_step`'s operations in the same order, attention on `F.scaled_dot_product_attention`
# as there, so bitwise the same results, without Python between them. TorchScript's optimizing
# executor is switched off for the call (`torch.jit.optimized_execution(False)`): on a GPU it would
# fuse element-wise runs into kernels of its own, made for each new shape, and round differently.
# The CPU has its own compiled float step, on oneDNN-packed weights (`_StepPlan`). Not yet
# timed on a GPU (figures from a CPU stand-in: docs/speed.md).
FLOAT_STEP_DEVICES = ("cuda",)
_FLOAT_STEP_SOURCE = _SHARED_STEP_SOURCE + """
def linear(x: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
    return torch.nn.functional.linear(x, w, b)

def float_after_append(x: Tensor, q: Tensor, k: Tensor, v: Tensor, ck: Tensor, cv: Tensor, mask: Tensor,
                       ws: List[Tensor], bs: List[Optional[Tensor]], norms: List[Tensor], eps: float,
                       norm_first: bool, act: int) -> Tensor:
    b, D, H, N = x.size(0), x.size(1), q.size(1), ck.size(0)
    ctx = torch.ops.aten.scaled_dot_product_attention(q, k, v, None, 0.0, False)
    x = residual(x, linear(ctx.transpose(1, 2).reshape(b, D), ws[0], bs[0]), norms[0], norms[1], eps, norm_first)
    h = sublayer_input(x, norms[2], norms[3], eps, norm_first)
    qc = linear(h, ws[1], bs[1]).view(b, 1, H, D // H).transpose(1, 2)
    if b > N:
        qc = qc.reshape(N, b // N, H, 1, D // H).transpose(1, 2).reshape(N, H, b // N, D // H)
    ctx = torch.ops.aten.scaled_dot_product_attention(qc, ck, cv, mask, 0.0, False)
    x = residual(x, linear(ctx.transpose(1, 2).reshape(b, D), ws[2], bs[2]), norms[2], norms[3], eps, norm_first)
    h = sublayer_input(x, norms[4], norms[5], eps, norm_first)
    if act == 0:
        f = linear(torch.relu(linear(h, ws[3], bs[3])), ws[4], bs[4])
    elif act == 1:
        f = linear(torch.ops.aten.gelu(linear(h, ws[3], bs[3])), ws[4], bs[4])
    else:
        f = linear(torch.ops.aten.silu(linear(h, ws[3], bs[3])), ws[4], bs[4])
    return residual(x, f, norms[4], norms[5], eps, norm_first)

def float_decoder_layers(x: Tensor, qkv_w: List[Tensor], qkv_b: List[Optional[Tensor]], ws: List[List[Tensor]],
                         bs: List[List[Optional[Tensor]]], norms: List[List[Tensor]], old_k: List[Tensor],
                         old_v: List[Tensor], store_k: List[Tensor], store_v: List[Tensor], rows: Optional[Tensor],
                         ck: List[Tensor], cv: List[Tensor], mask: Tensor, H: int, eps: float, norm_first: bool,
                         act: int) -> Tuple[Tensor, List[Tensor], List[Tensor]]:
    b, D = x.size(0), x.size(1)
    ks: List[Tensor] = []
    vs: List[Tensor] = []
    for i in range(len(qkv_w)):
        h = sublayer_input(x, norms[i][0], norms[i][1], eps, norm_first)
        y = linear(h, qkv_w[i], qkv_b[i]).view([b, 1, 3, H, D // H]).permute([2, 0, 3, 1, 4])
        k = append_kv(old_k[i], rows, y[1], store_k[i])
        v = append_kv(old_v[i], rows, y[2], store_v[i])
        x = float_after_append(x, y[0], k, v, ck[i], cv[i], mask, ws[i], bs[i], norms[i], eps, norm_first, act)
        ks.append(k)
        vs.append(v)
    return x, ks, vs
"""
@dataclass
class _FloatStepPlan:
    """The compiled float step's arguments for one search: each layer's weights, biases and norms."""

    qkv_w: list[Tensor]  # per layer: the self-attention's fused q/k/v projection
    qkv_b: list[Tensor | None]
    ws: list[list[Tensor]]  # per layer: self-attention out, cross-attention q and out, feed-forward w1, w2
    bs: list[list[Tensor | None]]
    norms: list[list[Tensor]]  # per layer: norm1 weight, bias, norm2 weight, bias, norm3 weight, bias
    stack: _Stack
    unit: Any

    @classmethod
    def make(cls, decoder: Any, cache: Any) -> "_FloatStepPlan | None":
        """The plan, or None where the compiled float step does not apply for the whole search:
        another device than `FLOAT_STEP_DEVICES`, training, layers unlike each other, int8 weights."""
        stack = _Stack.of(decoder)
        if stack is None or cache.layers[0].cross_k.device.type not in FLOAT_STEP_DEVICES:
            return None
        layers = list(decoder.layers)
        lins = [_linears(lay) for lay in layers]
        norms = [[t for n in (lay.norm1, lay.norm2, lay.norm3) for t in (n.weight, n.bias)] for lay in layers]
        if any(kernels.is_int8(lin.weight) for row in lins for lin in row) or any(t is None for row in norms for t in row):
            return None
        unit = kernels.compiled(_FLOAT_STEP_SOURCE)
        if not unit:
            return None
        return cls([row[0].weight for row in lins], [row[0].bias for row in lins],
                   [[lin.weight for lin in row[1:]] for row in lins], [[lin.bias for lin in row[1:]] for row in lins],
                   norms, stack, unit)

    def applies(self, x: Tensor, cache: Any) -> bool:
        """Per step: the weights' dtype, no autocast, no autograd (search runs under inference mode;
        with gradients on, trainable keys could not be appended into storage: `LayerCache.append`)."""
        return (x.dtype == self.qkv_w[0].dtype and not torch.is_autocast_enabled(x.device.type)
                and not torch.is_grad_enabled())

    def run(self, decoder: Any, x: Tensor, cache: Any, src_keep: Tensor) -> Tensor:
        """`decoder_step`'s work. Shape: x (b, d) -> (b, d)."""
        H, eps, norm_first, act = self.stack
        kernels._cudnn_attention_off_once(x.device)
        with torch.jit.optimized_execution(False):
            x, ks, vs = self.unit.float_decoder_layers(
                x, self.qkv_w, self.qkv_b, self.ws, self.bs, self.norms, *_cache_arguments(cache, x, H),
                src_keep[:, None, None, :], H, eps, norm_first, act)
        return _compiled_step_done(decoder, cache, x, ks, vs)


def _cache_arguments(cache: Any, x: Tensor, H: int) -> tuple[Any, ...]:
    """The cache's side of a compiled step's arguments: each layer's keys and values so far, the
    storage for them with one more position (`LayerCache.room`), the rows to keep (every layer's
    are reordered alike) and the cross-attention keys and values. Shape: x (b, d)."""
    b, D = x.shape
    rooms = [lc.room((b, H, 1, D // H), x) for lc in cache.layers]
    old_k, old_v, store_k, store_v = (list(t) for t in zip(*rooms, strict=True))
    return (old_k, old_v, store_k, store_v, cache.layers[0].pending,
            [lc.cross_k for lc in cache.layers], [lc.cross_v for lc in cache.layers])


def _compiled_step_done(decoder: Any, cache: Any, x: Tensor, ks: list[Tensor], vs: list[Tensor]) -> Tensor:
    """After a compiled step: the cache takes the keys and values it appended (`LayerCache.appended`),
    and the decoder's final norm, if any, applies. Shape: x (b, d) -> (b, d)."""
    for lc, k, v in zip(cache.layers, ks, vs, strict=True):
        lc.appended(k, v)
    return x if decoder.norm is None else _layer_norm(decoder.norm, x)


def compiled_step() -> Any:
    """The int8 step's compilation unit (with `kernels`' int8 caller, which it calls), or False."""
    return kernels.compiled(kernels._INT8_SOURCE + _STEP_SOURCE)


_INT8_PACK = "__torch__.torch.classes.quantized.LinearPackedParamsBase"
_DENSE_SOURCE = """
def dense(x: Tensor, w: Tuple[Tensor, Optional[Tensor]], relu: bool, rr: bool) -> Tensor:
    no_scalars: List[Optional[number]] = []
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w[0], w[1], "relu" if relu else "none", no_scalars, "")
"""  # `kernels.inference_linear` on a packed float weight; `rr` (int8_op's reduce_range) unused


_DENSE_STEP_SOURCE = _DENSE_SOURCE + _STEP_SOURCE.replace("int8_op(", "dense(").replace(
    _INT8_PACK, "Tuple[Tensor, Optional[Tensor]]")
assert "int8_op" not in _DENSE_STEP_SOURCE and "quantized" not in _DENSE_STEP_SOURCE  # every call spelled `dense`


def dense_step() -> Any:
    """The float CPU step's compilation unit (float32 or bf16): `_STEP_SOURCE` with `dense` for `int8_op`, or False."""
    return kernels.compiled(_DENSE_STEP_SOURCE)
