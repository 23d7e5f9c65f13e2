"""Speed paths of the model, kept out of the paper's code in `aiayn.model`: none changes what the
model computes (Sections 3.2-3.4), only how fast it is computed (and the rounding; dropout's rate
moves by at most 2^-17).

- `inference_linear` (and `Linear`, which calls it): a linear layer on a weight pre-packed by oneDNN
  through private, CPU-only torch ops (`torch.ops.mkldnn`), for frozen weights at inference. It is
  the one function that touches those ops; anywhere they do not apply (training, other devices, a
  CPU or torch without them) it is `F.linear`, so a torch release that drops them costs speed only.
  `aiayn.model` calls it as `kernels.inference_linear`, which is also where bench/decode.py counts.
- `attention`: scaled dot-product attention on the faster path for the device, the spelled-out
  matmul-softmax-matmul for short keys on the CPU (and whenever the weights are wanted, for plots),
  else `F.scaled_dot_product_attention` (off the CPU never on cuDNN's backend, which pays for each
  new shape).
- int8 decoding (`quantize_int8`): FBGEMM's and oneDNN's dynamically quantized GEMMs behind
  `inference_linear`; `compiled` holds the TorchScript units that call them without Python's cost
  per call (search's compiled steps are in `aiayn.step`).
- `Packed`: the position-wise layers run on the real tokens of a padded batch only (training);
  `LossPacking` says where they are for the loss, found on the host where a batch is built.

`Layers`, a typed `nn.ModuleList`, is here too only because `aiayn.model` may import nothing else
(but `aiayn.step`, search's decoding step, which builds on this module).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn.attention import SDPBackend, sdpa_kernel

# ------------------------------------------------------------------ inference GEMMs on the CPU
# Decoding runs every linear layer on a few hundred rows at a time, where a weight pre-packed in
# oneDNN's blocked layout makes the CPU GEMM faster than `F.linear` (the most on the wide
# vocabulary projection; docs/speed.md), and under bf16 autocast saves casting every weight at every step. The
# packed copies live beside the model (keyed by the weight, rebuilt when its data pointer, version
# counter or the dtype changes), never in it, so state_dict, deepcopy and `.to()` are unaffected.
# Only frozen weights (requires_grad False, as `Translator` sets) are packed: an optimizer may update
# trainable weights without bumping their version counter (fused Adam does not), so a packed copy of
# them could go stale; they, and training, take `F.linear`.
_PACKED: dict[int, tuple[weakref.ref, tuple, Tensor, Tensor | None]] = {}  # id(weight) -> (ref, key, packed, bias)
_PACK_BATCH_HINT = 128


def cpu_has_fast_bf16() -> bool:
    """Whether oneDNN has bf16 kernels for this CPU (AVX-512 or AMX); elsewhere bf16 runs on slow
    fallback code and fp32 is faster. The one check behind bf16 packing and `--precision auto`."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def slow_bf16_on(device: torch.device) -> bool:
    """Whether bf16 on `device` runs on oneDNN's fallback code: a CPU without its bf16 kernels."""
    return device.type == "cpu" and not cpu_has_fast_bf16()


# What `train`, `translate` and `serve` say when asked for bf16 on such a CPU (it is 10-100x slower).
# oneDNN's test (torch's `_is_mkldnn_bf16_supported`): AVX-512 (bf16 native with AVX-512 BF16 or AMX) or AVX2-VNNI-2.
SLOW_BF16 = "bf16 on this CPU runs on slow fallback code (oneDNN has bf16 kernels only for AVX-512 or AVX2-VNNI-2)"


def _packing_works(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.bfloat16:
        return cpu_has_fast_bf16()
    return dtype == torch.float32


_PACKING = {dt: _packing_works(dt) for dt in (torch.float32, torch.bfloat16)}


def inference_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, relu: bool = False) -> Tensor:
    """`F.linear(x, weight, bias)` (then ReLU if `relu`); for a frozen weight on the CPU, on a packed
    copy of it (faster), with the ReLU fused into the GEMM; for a weight that `quantize_int8` chose,
    in int8 (see there).

    Under autocast, computes in the autocast dtype like `F.linear` would. Shape: (..., in) -> (..., out).
    """
    if torch.compiler.is_compiling():  # traced: no lookup by the weight's id (it would specialise each layer)
        return F.relu(F.linear(x, weight, bias)) if relu else F.linear(x, weight, bias)
    q = _INT8.get(id(weight))
    if q is not None and q[0]() is weight:
        return _int8_linear(x if x.dtype == torch.float32 else x.float(), q[1], q[2], relu)
    dev = x.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
    grads = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
    if dev != "cpu" or grads or not packs(weight, dtype):  # (a trainable bias of a frozen weight: F.linear)
        return F.relu(F.linear(x, weight, bias)) if relu else F.linear(x, weight, bias)
    w, b = packed_weight(weight, bias, dtype)
    return torch.ops.mkldnn._linear_pointwise(x.to(dtype).contiguous(), w, b, "relu" if relu else "none", [], "")


def packs(weight: Tensor, dtype: torch.dtype) -> bool:
    """Whether `inference_linear` runs `weight` on a oneDNN-packed copy in `dtype` (given an input
    without gradients): a frozen CPU weight, not int8, in a dtype oneDNN packs fast here."""
    return (weight.device.type == "cpu" and not weight.requires_grad and _PACKING.get(dtype, False)
            and not is_int8(weight))


def _version(t: Tensor) -> int:
    """`t`'s version counter, -1 for an inference tensor (a model built under `inference_mode`),
    which has none: written in place under inference mode, its packed copy goes stale unseen."""
    return -1 if t.is_inference() else t._version


def packed_weight(weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """The oneDNN-packed copy of `weight` in `dtype` and `bias` in `dtype`: made on first use, again
    when either tensor changes, and kept while the weight lives (`inference_linear`, search's
    compiled float step on the CPU)."""
    key = (weight.data_ptr(), _version(weight), dtype, None if bias is None else (bias.data_ptr(), _version(bias)))
    entry = _PACKED.get(id(weight))
    if entry is None or entry[0]() is not weight or entry[1] != key:
        w = weight.detach().to(dtype)
        b = None if bias is None else bias.detach().to(dtype)
        key_id = id(weight)
        ref = weakref.ref(weight, _forget(_PACKED, key_id))  # dropped with the weight
        entry = (ref, key, torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT), b)
        _PACKED[id(weight)] = entry
    return entry[2], entry[3]


# ------------------------------------------------------------------ int8 decoding on the CPU
# `Translator(precision="int8")`: the linear layers of a frozen copy of the model run on PyTorch's
# own dynamically quantized GEMMs (`torch.ops.quantized.linear_dynamic`, FBGEMM): each weight is
# quantized once, per output row, to 7 bits (int8 in [-63, 63]); each call quantizes its input to
# 8 bits per tensor from the input's own range, multiplies in integers and returns float32. The int8 weights live beside
# the model, keyed by the float weight like the packed ones above, so the model, its state_dict
# and checkpoints are untouched; every other operation (attention over the cache, softmax, layer
# norm, embeddings) stays in float32, where int8 would not pay: they are a small part of a step
# and the most sensitive to rounding. Without VNNI (an AVX2-only CPU) FBGEMM and oneDNN add adjacent
# u8 x s8 products in saturating 16 bits; 7-bit weights keep those sums exact on every CPU
# (2 * 255 * 63 < 2^15), as oneDNN's guide to int8 advises. Torch's own default for this backend
# gives the bit up on the inputs instead (`reduce_range`): a per-tensor scale over a whole batch
# is the coarser of the two, and Multi30k's int8 translations equal fp32's more often with 8-bit
# inputs (greedy 882 and 880 of 1000 natively and under AVX2 against 843 and 839; docs/speed.md).
# FBGEMM, not oneDNN: a oneDNN-packed weight kept the ReLU of its first call for later calls
# without it (docs/speed.md); FBGEMM follows FBGEMM_ENABLE_INSTRUCTIONS=AVX2 where a CPU must be
# treated as AVX2-only (the oneDNN copy below follows ONEDNN_MAX_CPU_ISA=AVX2; ATen's
# ATEN_CPU_CAPABILITY=avx2 sets the rows from which it runs).
#
# One exception, measured (docs/speed.md, "Figures behind choices in the code"): a wide layer (the
# projection to the vocabulary) runs faster on oneDNN's int8 GEMM from 32 rows where ATen runs
# AVX-512 (1.3-1.65x at 256 x 8000) and from 128 rows under AVX2 (1.15x on one CPU, even on
# another; FBGEMM is faster on fewer rows). Such a weight keeps a oneDNN copy too, with the row
# count from which it runs; it is only ever called without a fused ReLU. Its rows come 128 at a time
# (`search.ROW_BLOCK`), so oneDNN, which makes and keeps a kernel and its buffers for each row count,
# keeps at most ~100 of them. Other layers keep none: the encoder's broad layers were 6-10% faster on
# oneDNN from 1024 rows, but its packed-token count is new with each batch, and a long run's memory grew
# by 0.3-1 GB (docs/speed.md).
WIDE_ENGINE = "onednn"
WIDE_MIN_ROWS = {"AVX512": 32, "AVX2": 128}  # per ATen's ISA: below this FBGEMM is faster even on wide layers
WIDE_RATIO = 8  # a layer is wide when it has at least this many outputs per input (not d_ff = 4 d_model)


class OneDnnCopy:
    """A wide layer's oneDNN packs, one per caller at a time, and from how many rows they run. In torch
    2.13 a oneDNN-packed int8 weight called by two threads at once can return wrong numbers (4 threads
    at 2048 rows: 14 of 12,000 calls, off by up to 3e4; a pack per thread: none), and search threads
    (`Translator`'s workers, `aiayn serve`) share the model."""

    def __init__(self, weight: Tensor, bias: Tensor | None, rows: int) -> None:
        self.rows = rows
        self._weight = weakref.ref(weight)  # (not the weight itself: `_INT8` drops its entry with it)
        self._bias = None if bias is None else bias.detach().clone()
        self._free = [_pack_int8(weight, bias, WIDE_ENGINE)]
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def pack(self) -> Iterator[object]:
        """A pack no other caller holds meanwhile (a new one where all are held)."""
        with self._lock:
            held = self._free.pop() if self._free else None
        if held is None:
            weight = self._weight()
            assert weight is not None, "a copy outlived its weight"
            held = _pack_int8(weight, self._bias, WIDE_ENGINE)
        try:
            yield held
        finally:
            with self._lock:
                self._free.append(held)


_INT8: dict[int, tuple[weakref.ref, object, OneDnnCopy | None]] = {}  # id(weight) -> (ref, FBGEMM pack, oneDNN)
_INT8_REDUCE_RANGE = False  # 8-bit inputs: the weights give up the bit (see above)
INT8_WEIGHT_MAX = 63  # 7-bit weights
ModuleT = TypeVar("ModuleT", bound=nn.Module)
INT8_ENGINE = "fbgemm"


def _int8_linear(x: Tensor, fbgemm: object, copy: OneDnnCopy | None, relu: bool) -> Tensor:
    """x (..., in) float32 -> (..., out) float32 on the int8 weight; see the note above."""
    call = _INT8_CALL or _int8_caller()
    if copy is not None and x.numel() >= copy.rows * x.size(-1):
        with copy.pack() as pack:
            y = call(x, pack, False, _INT8_REDUCE_RANGE)  # never a fused ReLU here
        return y.relu_() if relu else y
    return call(x, fbgemm, relu, _INT8_REDUCE_RANGE)


# A quantized op called from Python costs ~6 us more than its work on one row: the binding looks for
# `__torch_function__` on every argument, and on the packed weight (a TorchScript object) that
# lookup fails by way of a C++ exception. Called from a compiled TorchScript function, the op gets its
# arguments without that lookup (one int8 linear on one row: 10.8 -> 4.1 us; a decoding step makes
# 20). TorchScript is deprecated: where compiling fails, the ops are called from Python (slower, the
# same results). Compiled from source (`compiled`: `CompilationUnit`, which warns of nothing), once,
# under a lock: the first calls may come from several search threads at once; search's compiled
# int8 step (`aiayn.step`) compiles it again into its own unit, which calls it.
_INT8_SOURCE = """
def int8_op(x: Tensor, packed: __torch__.torch.classes.quantized.LinearPackedParamsBase, relu: bool,
            reduce_range: bool) -> Tensor:
    if relu:
        return torch.ops.quantized.linear_relu_dynamic(x, packed, reduce_range)
    return torch.ops.quantized.linear_dynamic(x, packed, reduce_range)
"""


def _int8_op(x: Tensor, packed: Any, relu: bool, reduce_range: bool) -> Tensor:
    """What `_INT8_SOURCE` compiles to, called from Python."""
    if relu:
        return torch.ops.quantized.linear_relu_dynamic(x, packed, reduce_range)
    return torch.ops.quantized.linear_dynamic(x, packed, reduce_range)


_INT8_CALL: Callable[[Tensor, Any, bool, bool], Tensor] | None = None
_COMPILED: dict[str, Any] = {}  # TorchScript source -> its compilation unit, or False if it does not compile
COMPILE_LOCK = threading.Lock()


def compiled(source: str) -> Any:
    """`source` compiled by TorchScript (once per process, under a lock: the first calls may come
    from several search threads at once), or False where it does not compile."""
    with COMPILE_LOCK:
        if source not in _COMPILED:
            try:
                _COMPILED[source] = torch.jit.CompilationUnit(source)
            except Exception:  # noqa: BLE001 - any failure to compile leaves the Python calls, which work
                _COMPILED[source] = False
        return _COMPILED[source]


def _int8_caller() -> Callable[[Tensor, Any, bool, bool], Tensor]:
    """The compiled `int8_op`, else `_int8_op`."""
    global _INT8_CALL
    unit = compiled(_INT8_SOURCE)
    _INT8_CALL = unit.int8_op if unit else _int8_op
    return _INT8_CALL


def _onednn_rows(weight: Tensor) -> int:
    """From how many rows `weight` runs on a oneDNN copy (0: it keeps none); see the note above."""
    if WIDE_ENGINE not in torch.backends.quantized.supported_engines or weight.size(0) < WIDE_RATIO * weight.size(1):
        return 0
    return WIDE_MIN_ROWS.get(torch.backends.cpu.get_cpu_capability(), 0)


def int8_unavailable() -> str | None:
    """Why `--precision int8` cannot run in this torch, or None if it can."""
    if INT8_ENGINE not in torch.backends.quantized.supported_engines:
        return f"this torch has no {INT8_ENGINE} quantized engine (x86 CPUs only); use --precision fp32"
    if not hasattr(torch.ops.quantized, "linear_dynamic"):
        return "this torch has no quantized.linear_dynamic kernel; use --precision fp32"
    return None


def _pack_int8(weight: Tensor, bias: Tensor | None, engine: str = INT8_ENGINE) -> object:
    """`engine`'s packed int8 copy of a float weight (N, K): symmetric, one scale per output row,
    values in [-INT8_WEIGHT_MAX, INT8_WEIGHT_MAX] (see the note above)."""
    w = weight.detach().float()
    scale = (w.abs().amax(1) / INT8_WEIGHT_MAX).clamp_min(1e-12).double()  # (N,)
    with warnings.catch_warnings():  # torch 2.13 marks quantized tensors deprecated; the kernels are its own
        warnings.simplefilter("ignore", UserWarning)
        qw = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
        saved = torch.backends.quantized.engine
        torch.backends.quantized.engine = engine  # packing picks the engine that runs the weight
        try:
            return torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.detach().float())
        finally:
            torch.backends.quantized.engine = saved


def _forget(table: dict[int, Any], key: int) -> Callable[[weakref.ref], None]:
    """A weak reference's callback that drops `key` from `table`, which it holds itself: at the
    interpreter's exit the module's name for the table is None before the last weights go."""
    def forget(_: weakref.ref) -> None:
        table.pop(key, None)
    return forget


def quantize_int8(model: ModuleT, output: bool = True) -> ModuleT:
    """Run `model`'s linear layers (and, if `output`, its projection to the vocabulary) in int8 from
    now on, on the CPU; the model must be frozen and stay so (its float weights are kept, for the
    embeddings and for reference, and must not change: the int8 copies would not follow). Returns
    `model`. The caller owns the model: `Translator` passes a copy of its own."""
    if (why := int8_unavailable()) is not None:
        raise RuntimeError(why)
    _int8_caller()  # here, before any search thread calls it
    pairs: list[tuple[Tensor, Tensor | None]] = [(m.weight, m.bias) for m in model.modules()
                                                 if isinstance(m, nn.Linear)]
    out_w = getattr(model, "output_weight", None)
    if output and isinstance(out_w, Tensor):  # with its bias (Marian's), packed in: the int8 call takes no other
        pairs.append((out_w, getattr(model, "out_bias", None)))
    for w, b in pairs:
        if w.requires_grad or w.device.type != "cpu":
            raise ValueError("quantize_int8 takes a frozen model on the CPU")
        rows = _onednn_rows(w)
        copy = OneDnnCopy(w, b, rows) if rows else None
        _INT8[id(w)] = (weakref.ref(w, _forget(_INT8, id(w))), _pack_int8(w, b), copy)  # dropped with the weight
    return model


def is_int8(x: Tensor | nn.Module) -> bool:
    """Whether `inference_linear` runs this weight in int8 (for a module: any of its linear layers)."""
    if isinstance(x, nn.Module):
        return any(is_int8(m.weight) for m in x.modules() if isinstance(m, nn.Linear))
    q = _INT8.get(id(x))
    return q is not None and q[0]() is x


class Linear(nn.Linear):
    """`nn.Linear` that takes `inference_linear` (packed weights once frozen for inference)."""

    def forward(self, x: Tensor) -> Tensor:
        return inference_linear(x, self.weight, self.bias)


# On CPU, for sentence-length keys, PyTorch's fused attention kernel is slower than the plain
# matmul-softmax-matmul (in torch 2.13, bf16, forward and backward; docs/speed.md); longer keys and other devices take
# `F.scaled_dot_product_attention`. Set to 0 to always use it.
EXPLICIT_ATTENTION_MAX_KEYS = 256


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, dropout_p: float,
              training: bool, need_weights: bool = False, bias: "MaskBias | None" = None) -> tuple[Tensor, Tensor | None]:
    """Scaled dot-product attention (Section 3.2.1) on the faster path for the device: explicit for
    short keys on the CPU, else `F.scaled_dot_product_attention`; the weights too if `need_weights`
    (only the explicit path has them), else None. `bias` (`MaskBias` of `mask`) keeps the additive
    form of a mask used again and again (search's steps), which the explicit path would make anew.

    Shape: q (B, H, T, d_head), k/v (B, H, S, d_head), mask broadcastable to (B, H, T, S), True = may
    attend -> (B, H, T, d_head), weights (B, H, T, S).
    """
    if need_weights or _explicit_is_faster(q, k):
        ctx, weights = _explicit_attention(q, k, v, mask, is_causal, dropout_p, training, bias)
        return ctx, (weights if need_weights else None)
    if q.device.type == "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal), None
    return _sdpa_without_cudnn(q, k, v, mask, dropout_p, is_causal), None


# Off the CPU, never cuDNN's attention: it builds an execution graph for each new shape (tenths of a
# second each), and aiayn's shapes change with every batch and every search step. Torch 2.11 picks it
# for bf16 on an H200, where it made bf16 search 13-23x slower than fp32 and the first steps of
# training take about a second each (docs/gpu.md). Flash and memory-efficient attention have no such cost.
GPU_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_cudnn_attention_off = False  # set by the first attention off the CPU


def _sdpa_without_cudnn(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float,
                        is_causal: bool) -> Tensor:
    """`F.scaled_dot_product_attention` without cuDNN's backend. The first call switches it off for
    the process (`torch.backends.cuda.enable_cudnn_sdp(False)`), once: switching it off and back
    around each call would race between threads, and `sdpa_kernel` costs 10-25 us a call, too much
    for search's small steps. A program that wants cuDNN's attention back switches it on after
    aiayn's first call (aiayn's attention then takes it too). Compiled code takes `sdpa_kernel`,
    which torch.compile traces into the graph (it also switches flash, memory-efficient and math on)."""
    if torch.compiler.is_compiling():
        with sdpa_kernel(GPU_ATTENTION_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
    _cudnn_attention_off_once(q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)


def _cudnn_attention_off_once(device: torch.device) -> None:
    """cuDNN's attention switched off, the first time aiayn's attention runs off the CPU."""
    global _cudnn_attention_off
    if not _cudnn_attention_off and device.type != "cpu":
        torch.backends.cuda.enable_cudnn_sdp(False)
        _cudnn_attention_off = True


def _explicit_is_faster(q: Tensor, k: Tensor) -> bool:
    return q.device.type == "cpu" and k.size(-2) <= EXPLICIT_ATTENTION_MAX_KEYS


def _explicit_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, dropout_p: float, training: bool,
    bias: "MaskBias | None" = None,
) -> tuple[Tensor, Tensor]:
    """softmax(q k^T / sqrt(d_head)) v, spelled out (Section 3.2.1); also returns the weights.

    The scaling and the mask ride in one `baddbmm` (masked keys get the lowest finite value added,
    not -inf: a row with every key masked then gets uniform weights rather than NaN, with no
    data-dependent branch; see `Transformer.attention_weights` for plots), and the softmax computes
    in float32 (float64 for float64 scores): in bf16 torch's CPU softmax is four times slower. float16,
    whose lowest value is too near for that sum, masks with `masked_fill` instead.

    Shape: q (B, H, T, d_head), k/v (B, H, S, d_head), mask broadcastable to (B, H, T, S), True = may
    attend -> (B, H, T, d_head), weights (B, H, T, S).
    """
    B, H, T, d_head = q.shape
    S = k.size(-2)
    if is_causal:
        causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)  # (T, S)
        mask = causal if mask is None else mask & causal
    kt = k.reshape(B * H, S, d_head).transpose(1, 2)  # (BH, dh, S)
    scale = 1.0 / math.sqrt(d_head)
    dev = q.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else torch.promote_types(q.dtype, k.dtype)
    if _keys_first(q, k, dtype):
        scores = _one_query_scores(q, k, scale, None if mask is None else
                                   _mask_bias(mask, B, H, dtype) if bias is None else bias.get(mask, B, H, dtype))
    elif mask is None or dtype == torch.float16:
        # (BH, T, S); scaled first, as q k^T may overflow float16, and before the reshape, which
        # then has a contiguous product to view rather than a strided q to copy
        scores = torch.bmm((q * scale).reshape(B * H, T, d_head), kt)
        if mask is not None:
            scores = scores.view(B, H, T, S).masked_fill(~mask, torch.finfo(scores.dtype).min).view(B * H, T, S)
    else:
        additive = _mask_bias(mask, B, H, dtype) if bias is None else bias.get(mask, B, H, dtype)
        scores = torch.baddbmm(additive, q.reshape(B * H, T, d_head), kt, alpha=scale)  # (BH, T, S)
    exact = torch.promote_types(scores.dtype, torch.float32)  # float32, or float64 kept as it is
    weights = softmax_rows(scores, exact).to(scores.dtype).view(B, H, T, S)
    attn = dropout(weights, dropout_p, training)
    return weigh_values(attn, v), weights


# One query per head over keys stored row by row (a decoding step's cross-attention over its cache):
# torch 2.13 on the CPU hands `q @ k^T` to MKL as a product of a row by a matrix, and `k @ q` as a
# matrix by a column, which MKL's generic code (the code it runs on AMD CPUs) does 1.3-2x faster
# (800 heads x 14 keys x 64: 177 -> 112 us; a greedy step's whole cross-attention at 256 sentences
# of 14 tokens 546 -> 415 us; docs/speed.md). Keys that lie time-major (the self-attention cache)
# gain nothing so. False: always `q @ k^T` (for comparison).
ONE_QUERY_KEYS_FIRST = True


def _keys_first(q: Tensor, k: Tensor, dtype: torch.dtype) -> bool:
    """Whether `_one_query_scores` takes these scores: one float32 query per head on the CPU over
    contiguous keys, without autograd (the compiled step's `attend` does the same)."""
    return (ONE_QUERY_KEYS_FIRST and q.size(2) == 1 and k.is_contiguous() and dtype == q.dtype == k.dtype == torch.float32
            and q.device.type == "cpu" and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)))


def _one_query_scores(q: Tensor, k: Tensor, scale: float, additive: Tensor | None) -> Tensor:
    """The scaled (and masked) scores of one query per head as `k @ q` (see the note above).
    Shape: q (B, H, 1, d_head), k (B, H, S, d_head), additive (1 | B*H, 1, S) -> (B*H, 1, S)."""
    B, H, _, dh = q.shape
    S = k.size(2)
    kr = k.reshape(B * H, S, dh)
    if additive is None:
        return torch.bmm(kr, (q * scale).reshape(B * H, 1, dh).transpose(1, 2)).view(B * H, 1, S)
    # (1 | B*H, S, 1) by a transpose, not a view: view(-1, S, 1) cannot size a batch of 0 keys
    return torch.baddbmm(additive.transpose(1, 2), kr, q.reshape(B * H, 1, dh).transpose(1, 2), beta=1, alpha=scale).view(B * H, 1, S)


# torch 2.13's CPU softmax takes a slow path over rows shorter than one vector register (16 floats
# with AVX-512, 8 with AVX2): 1024 rows of 14 keys take 171 us natively against 23 us under AVX2 and
# 37 us spelled out (exp of the shifted scores, then divide by their sum). Such rows are common:
# a decoding step's first self-attention keys, the cross-attention keys of short sentences, the
# encoder of a batch of short sentences (a greedy int8 search on test_2016_flickr spent 4.3% of its
# time in softmax natively, 1.0% under AVX2; docs/speed.md). Spelled out costs about 3 us more in
# fixed overhead, so it is taken from SHORT_ROWS_MIN rows on (where the two cross, 32-64 rows).
SHORT_ROW = {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability(), 0)
SHORT_ROWS_MIN = 64


def softmax_rows(x: Tensor, dtype: torch.dtype) -> Tensor:
    """`torch.softmax(x, -1, dtype=dtype)`, spelled out in float32 inference over many short rows
    (see the note above; equal within rounding, not bitwise). Shape: (..., S) -> (..., S)."""
    S = x.size(-1)
    if (0 < S < SHORT_ROW and x.dtype == dtype == torch.float32 and x.device.type == "cpu"
            and x.numel() >= SHORT_ROWS_MIN * S and not (torch.is_grad_enabled() and x.requires_grad)):
        e = (x - x.amax(-1, keepdim=True)).exp_()
        return e.div_(e.sum(-1, keepdim=True))
    return torch.softmax(x, -1, dtype=dtype)


# torch 2.13's CPU bmm multiplies matrices of fewer than SMALL_BMM multiply-adds (contraction x
# rows x columns) in a plain loop rather than MKL's kernels. For one query's weighted sum of
# values (1 x S by S x d_head) that loop is 3-5x slower than a multiply and a sum over the keys
# (1920 rows of 12 keys at d_head 32: 457 against 125 us). Such products are a decoding step's:
# its self-attention over the first 400 / d_head keys, its cross-attention over short sources.
SMALL_BMM = 400


def weigh_values(p: Tensor, v: Tensor) -> Tensor:
    """`p @ v`, the attention weights' sum of the values, spelled out where torch's bmm would take
    its plain loop in float32 inference (see the note above; equal within rounding, not bitwise).

    Shape: p (..., T, S), v (..., S, d_head) -> (..., T, d_head)."""
    if (p.size(-2) == 1 and p.size(-1) * v.size(-1) < SMALL_BMM and p.dtype == v.dtype == torch.float32
            and p.device.type == "cpu" and not (torch.is_grad_enabled() and (p.requires_grad or v.requires_grad))):
        return (v * p.transpose(-1, -2)).sum(-2, keepdim=True)
    return p @ v


def _mask_bias(mask: Tensor, B: int, H: int, dtype: torch.dtype) -> Tensor:
    """The additive form of a keep-mask: 0 where True, the lowest finite value of `dtype` (the one
    the scores are computed in) where False.

    Shape: mask broadcastable to (B, H, T, S) -> (1 | B*H, T | 1, S), broadcastable to (B*H, T, S).
    """
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (B | 1, H | 1, T | 1, S)
    bias = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, torch.finfo(dtype).min)
    if bias.size(0) == 1 and bias.size(1) == 1:
        return bias[0]
    return bias.expand(B, H, -1, -1).reshape(B * H, *bias.shape[-2:])


class MaskBias:
    """`_mask_bias` of a mask, made once and kept while the same mask (the same tensor object, or
    `source`, the tensor the mask is a view of) comes with the same shapes and dtype: search's steps
    use the source mask in every layer, and the compiled step in every step until sentences leave.
    (Inference tensors have no version counter: a mask changed in place between calls is not seen.)"""

    def __init__(self) -> None:
        self._made: tuple[Tensor, tuple, Tensor] | None = None

    def get(self, mask: Tensor, B: int, H: int, dtype: torch.dtype, source: Tensor | None = None) -> Tensor:
        owner, key = (mask if source is None else source), (B, H, dtype)
        if self._made is None or self._made[0] is not owner or self._made[1] != key:
            self._made = (owner, key, _mask_bias(mask, B, H, dtype))
        return self._made[2]


# ---------------------------------------------------------------------------------- dropout
def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """`F.dropout(x, p, training)`: zero each element with probability p, scale the rest so that
    the expectation is x.

    On the CPU, torch draws the mask with `bernoulli_`, one random number per element, and that was
    a tenth of a training step at the small shape; here each 64-bit draw gives four 16-bit integers,
    each compared with round(p * 2^16), and the survivors are scaled by 1 / P(keep), so the
    expectation stays exactly x. Half the time of 32-bit coins (two per draw). Where 2^-16 steps
    cannot hold P(drop) within 1e-4 of p relatively (some p below 0.08, such as 0.01, and p within
    2^-17 of 1), torch's own dropout runs instead.
    Shape: any -> the same.
    """
    if not training or p == 0.0:
        return x
    drop = round(p * 2**16)  # P(drop) = drop / 2^16
    # p out of range or near 1, or 2^-16 steps too coarse for it (drop = 0 included)
    if x.device.type != "cpu" or drop >= 2**16 or abs(drop / 2**16 - p) > 1e-4 * p:
        return F.dropout(x, p, training)
    bits = torch.empty((x.numel() + 3) // 4, dtype=torch.int64).random_(-(2**63), None)  # every bit random
    keep = bits.view(torch.int16)[: x.numel()].view(x.shape) >= drop - 2**15  # P(keep) = 1 - drop / 2^16
    return x * keep.to(x.dtype).mul_(2**16 / (2**16 - drop))


# ------------------------------------------------------------ position-wise work without padding
@dataclass
class Packed:
    """Where the real tokens of a right-padded (B, T) batch sit, for running the position-wise work
    (projections, feed-forward, LayerNorm) on real tokens only, (N, d) instead of (B, T, d); only
    attention needs the padded layout. Used by `Transformer.loss` (a batch of sentences is often a
    third padding, and nn.Transformer spends full price on it) and by search's encoder."""

    idx: Tensor  # (N,) flat positions of the real tokens in (B*T)
    B: int
    T: int
    _gathers: dict[tuple, Any] = field(default_factory=dict, repr=False, compare=False)  # see `_gather`

    @classmethod
    def from_keep(cls, keep: Tensor) -> "Packed":
        return cls(keep.flatten().nonzero().squeeze(1), keep.size(0), keep.size(1))

    @classmethod
    def if_padded(cls, keep: Tensor) -> "Packed | None":
        """`from_keep`, or None when there is no padding to skip."""
        return None if bool(keep.all()) else cls.from_keep(keep)

    def pack(self, x: Tensor) -> Tensor:
        """(B, T, C) -> (N, C)"""
        return x.reshape(self.B * self.T, -1).index_select(0, self.idx)

    def unpack(self, x: Tensor) -> Tensor:
        """(N, C) -> (B, T, C), zeros at the padding"""
        return x.new_zeros(self.B * self.T, x.size(-1)).index_copy_(0, self.idx, x).view(self.B, self.T, -1)

    def _gather(self, n: int, H: int, by_sentence: bool) -> tuple[Tensor, Tensor]:
        """For `heads`: which d_head-wide row of the projections (N*n*H of them) each row of the
        result reads, in the result's order (n, H, B, T) or by_sentence (n, B, H, T) (a padding
        position reads row 0), and the result's rows at the padding. Made once per batch and layout:
        every layer of a stack reuses them. Shape: -> (n*H*B*T,), (n*H*(B*T - N),) long."""
        key = (n, H, by_sentence)
        if key not in self._gathers:
            B, T, dev = self.B, self.T, self.idx.device
            src_row = torch.zeros(B * T, dtype=torch.long, device=dev)  # packed row of each padded position
            src_row.index_copy_(0, self.idx, torch.arange(self.idx.numel(), device=dev))
            pad = torch.ones(B * T, dtype=torch.bool, device=dev).index_fill_(0, self.idx, False)
            part = torch.arange(n, device=dev).view(n, 1, 1, 1) * H
            head = torch.arange(H, device=dev).view((1, 1, H, 1) if by_sentence else (1, H, 1, 1))
            src_row, pad = (t.view((1, B, 1, T) if by_sentence else (1, 1, B, T)) for t in (src_row, pad))
            order = (n, B, H, T) if by_sentence else (n, H, B, T)
            self._gathers[key] = ((src_row * (n * H) + part + head).flatten(),
                                  pad.expand(order).flatten().nonzero().squeeze(1))
        return self._gathers[key]

    def heads(self, x: Tensor, n: int, H: int, by_sentence: bool = False) -> tuple[Tensor, ...]:
        """n projections of the real tokens (q, k, v side by side) spread over the padded positions,
        zeros at the padding, and split into heads, head-major (attention over packed tokens) or
        `by_sentence` (a decoding cache's keys and values): one gather of d_head-wide rows, where a
        gather of whole rows and a copy into the heads' layout took two (0.91 -> 0.47 ms for the
        keys and values of 186 sentences of up to 22 tokens at d 256; docs/speed.md).

        Shape: x (N, n*H*d_head) -> n tensors (H, B, T, d_head), or (B, H, T, d_head) by_sentence."""
        dh = x.size(1) // (n * H)
        shape = (n, self.B, H, self.T, dh) if by_sentence else (n, H, self.B, self.T, dh)
        if x.size(0) == 0:  # no real token at all: nothing to gather from
            out = x.new_zeros(shape)
        else:
            rows, pads = self._gather(n, H, by_sentence)
            out = x.reshape(-1, dh).index_select(0, rows)  # (n*B*H*T | n*H*B*T, dh)
            if pads.numel():
                out.index_fill_(0, pads, 0)
            out = out.view(shape)
        return tuple(out[i] for i in range(n))  # not unbind: a cache moves rows of its keys in place

    def runs(self) -> list[tuple[int, int, int]]:
        """The batch as runs of consecutive sentences with as many real tokens each (a length-sorted
        batch has a few): (first packed row, sentences, tokens each) per run, empty sentences left out.
        Reads the positions on the host; made once per batch."""
        if ("runs",) not in self._gathers:
            lengths = torch.bincount(self.idx // self.T, minlength=self.B).tolist()
            runs, row = [], 0
            for length, group in itertools.groupby(lengths):
                n = len(list(group))
                if length:
                    runs.append((row, n, length))
                row += n * length
            self._gathers[("runs",)] = runs
        return self._gathers[("runs",)]

    def merge_heads(self, ctx: Tensor) -> Tensor:
        """The real tokens' rows of a head-major result, heads side by side: one gather of
        d_head-wide rows. Shape: (H, B, T, d_head) -> (N, H*d_head)."""
        H, dh, BT = ctx.size(0), ctx.size(3), self.B * self.T
        key = ("merge", H)
        if key not in self._gathers:  # (N, H): row h*B*T + position of the token
            self._gathers[key] = (self.idx.view(-1, 1) + torch.arange(H, device=ctx.device) * BT).flatten()
        return ctx.reshape(H * BT, dh).index_select(0, self._gathers[key]).view(-1, H * dh)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Packed":
        return Packed(self.idx.to(device, non_blocking=non_blocking), self.B, self.T)

    def pin_memory(self) -> "Packed":
        return Packed(self.idx.pin_memory(), self.B, self.T)


def packed_attention(mha: Any, x: Tensor, memory: Tensor | None, key_keep: Tensor | None, is_causal: bool,
                     packed: "Packed", mem_packed: "Packed | None") -> Tensor:
    """`MultiHeadAttention` over packed tokens, up to its output projection.

    Without autograd (encoding for search), q, k and v go from the projections of the real tokens
    into head-major batches (H, B, T, d_head), and the context back to the real tokens
    (`Packed.heads`, `Packed.merge_heads`): one gather each way, where spreading to (B, T, d) with
    zeros, splitting heads and packing again take five copies (docs/speed.md, the figures table).
    Attention is the same for each (head, sentence) in either order: the sentences take the place
    of the heads, and the mask broadcasts over them. With autograd
    (training) the spread layout is kept: its backward is the cheaper (a bf16 training step 6%
    faster).

    Shape: x (N, d), memory (N_src, d), or (B, S, d) without `mem_packed` (cross), key_keep (B, S)
    or (B, T, S) -> (N, d)."""
    hm = not torch.is_grad_enabled()  # head-major

    def heads(p: Packed | None, y: Tensor, n: int) -> tuple[Tensor, ...]:
        if hm and p is not None:
            return p.heads(y, n, mha.n_heads)  # n x (H, B, T, d_head)
        hs = mha._heads(y if p is None else p.unpack(y), n)  # n x (B, H, T, d_head)
        return tuple(h.transpose(0, 1) for h in hs) if hm else hs

    if mha.cross:
        assert memory is not None, "cross-attention needs the encoder output"
        q, (k, v) = heads(packed, mha.q_proj(x), 1)[0], heads(mem_packed, mha.kv_proj(memory), 2)
    else:
        qkv = mha.qkv_proj(x)  # (N, 3d)
        if ATTENTION_BY_RUNS and hm and not is_causal and not mha.training and qkv.device.type == "cpu" \
                and qkv.dtype == torch.float32 and mha.d_head >= RUNS_MIN_HEAD and key_keep is not None \
                and key_keep.dim() == 2:
            return _attention_by_runs(qkv, packed.runs(), mha.n_heads)
        q, k, v = heads(packed, qkv, 3)
    mask = None if key_keep is None else key_keep[:, None] if key_keep.dim() == 3 else key_keep[:, None, None, :]
    if mask is not None and hm:
        mask = mask.transpose(0, 1)  # (1, B, T | 1, S)
    ctx, _ = attention(q, k, v, mask, is_causal, mha.dropout if mha.training else 0.0, mha.training)
    if hm:
        return packed.merge_heads(ctx)
    return packed.pack(ctx.transpose(1, 2).reshape(packed.B, packed.T, -1))


# Self-attention over packed tokens without a mask (an encoder's, in search): each run of sentences of
# one length (`Packed.runs`) attends on views of the projections, no padding, no gathers. The int8
# encoder of the bench's longest batch, 102 sentences of up to 40 tokens, a third of them padding:
# 49 -> 41 ms; of 256 sentences of 5-40 tokens in no order, 249 runs of about one sentence: 110 -> 85
# ms (docs/speed.md). In float32 only: a bf16 encoder was 3% slower so (the fused kernel is slow in bf16,
# `EXPLICIT_ATTENTION_MAX_KEYS`). From heads of 16 dimensions: at 8, torch 2.13's fused kernel gives results that
# depend on the thread count (by ~1e-7; a translation would then depend on `--workers`), at 4-128 otherwise not.
# False: the gathers always (tests compare the two).
ATTENTION_BY_RUNS = True
RUNS_MIN_HEAD = 16


def _attention_by_runs(qkv: Tensor, runs: list[tuple[int, int, int]], H: int) -> Tensor:
    """Self-attention of the real tokens, run by run: `F.scaled_dot_product_attention` takes the
    strided views of q, k and v as they lie in the projections, and writes its context with the
    heads side by side, each token's in its row.

    Shape: qkv (N, 3*H*d_head) -> (N, H*d_head)."""
    N, D = qkv.size(0), qkv.size(1) // 3
    ctx = qkv.new_empty(N, D)
    for row, n, length in runs:
        q, k, v = qkv[row:row + n * length].view(n, length, 3, H, D // H).unbind(2)  # (n, L, H, dh) each
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (n, H, L, dh)
        ctx[row:row + n * length].view(n, length, H, D // H).copy_(out.transpose(1, 2))
    return ctx


@dataclass
class LossPacking:
    """Where the real tokens of a training batch sit, for `Transformer.loss`. Finding them takes
    `nonzero` (and a test for padding), each of which makes the host wait for a GPU: collate finds
    them on the host, where it builds the batch, and a training step on a GPU need not wait per batch.
    """

    src: Packed  # the real source tokens, (N_src,) of (B*S)
    tgt: Packed  # the target positions, (N_tgt,) of (B*T): where tgt_in or tgt_out is not padding
    labelled: Tensor | None  # (N,) positions in `tgt` whose label (tgt_out) is not padding; None: all

    @classmethod
    def of(cls, src: Tensor, tgt_in: Tensor, tgt_out: Tensor, pad_id: int) -> "LossPacking":
        """Shape: src (B, S), tgt_in and tgt_out (B, T). Reads them: call it where they are."""
        # Targets are right-padded, so no real query sees a padded key through the causal mask, and
        # the decoder too can drop the padding.
        tgt = Packed.from_keep(tgt_in.ne(pad_id) | tgt_out.ne(pad_id))
        real = tgt_out.flatten().index_select(0, tgt.idx).ne(pad_id)  # (N_tgt,)
        return cls(Packed.from_keep(src.ne(pad_id)), tgt, None if bool(real.all()) else real.nonzero().squeeze(1))

    def targets(self, h: Tensor, tgt_out: Tensor) -> tuple[Tensor, Tensor]:
        """The decoder states and labels of the real target tokens (index_select: no mask to resolve).
        Shape: h (N_tgt, d), tgt_out (B, T) -> (N, d), (N,)."""
        labels = tgt_out.flatten().index_select(0, self.tgt.idx)  # (N_tgt,)
        if self.labelled is None:
            return h, labels
        return h.index_select(0, self.labelled), labels.index_select(0, self.labelled)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "LossPacking":
        labelled = None if self.labelled is None else self.labelled.to(device, non_blocking=non_blocking)
        return LossPacking(self.src.to(device, non_blocking), self.tgt.to(device, non_blocking), labelled)

    def pin_memory(self) -> "LossPacking":
        """In page-locked memory, for a copy to a GPU that runs beside the compute."""
        labelled = None if self.labelled is None else self.labelled.pin_memory()
        return LossPacking(self.src.pin_memory(), self.tgt.pin_memory(), labelled)


# ----------------------------------------------------------------- the loss over the vocabulary
# `F.cross_entropy(logits.float(), ..., label_smoothing=eps)` makes about ten passes over the (N, V)
# logits and keeps float32 copies of them (the cast and the log-probabilities, saved for backward):
# 130 MB each at 4096 tokens and 8000 words. Here row blocks are processed in a few passes: the
# logits are read once each way (a float32 log-softmax forward, a float32 softmax backward, each a
# cast and one pass from bf16), the gradient written once, and nothing of (N, V) size is kept but
# the logits themselves. On the CPU a block of about half a million logits sits in the cache. On a
# GPU the blocks are large (a handful per step). There torch's call took about 9.5 ms of a 75 ms base
# step at 25k tokens on an H200 (log-softmax forward 3.0, backward 3.7, the two casts 2.8;
# docs/logs/gpu-h200-2026-11-27-b/part1/gpu_profile.md); this one lowered the step's peak memory
# (20.1 -> 16.2 GiB) but its time stayed within the run-to-run spread (docs/gpu.md).
_LOSS_BLOCK = 2**19  # logits per row block on the CPU: 2 MB of float32, about what one core caches
_GPU_LOSS_BLOCK = 2**28  # elsewhere: a block's float32 temporaries take 1 GiB each (2 in backward)


def _autocast_off(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Autocast switched off on `device`, where it has autocast at all (not on `meta`)."""
    available = torch.amp.is_autocast_available(device.type)
    return torch.autocast(device.type, enabled=False) if available else contextlib.nullcontext()


def _row_blocks(N: int, V: int, device: torch.device) -> Iterator[slice]:
    rows = max(1, (_LOSS_BLOCK if device.type == "cpu" else _GPU_LOSS_BLOCK) // V)
    return (slice(s, s + rows) for s in range(0, N, rows))


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Per-row label-smoothed cross entropy; the gradient is softmax minus the smoothed target."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, eps: float) -> Tensor:
        N, V = logits.shape
        loss = torch.empty(N, dtype=torch.float32, device=logits.device)  # (N,)
        with _autocast_off(logits.device):
            for rows in _row_blocks(N, V, logits.device):
                logp = torch.log_softmax(logits[rows], 1, dtype=torch.float32)  # (R, V)
                # -(1-eps) log p_y - eps/V sum_j log p_j
                loss[rows] = logp.gather(1, labels[rows, None]).squeeze(1).mul_(eps - 1).sub_(logp.mean(1), alpha=eps)
        ctx.save_for_backward(logits, labels)
        ctx.eps = eps
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor, None, None]:
        logits, labels = ctx.saved_tensors
        eps, (N, V) = ctx.eps, logits.shape
        grad = torch.empty_like(logits)  # (N, V), the logits' dtype
        with _autocast_off(logits.device):
            for rows in _row_blocks(N, V, logits.device):
                p = torch.softmax(logits[rows], 1, dtype=torch.float32)  # (R, V)
                p.scatter_add_(1, labels[rows, None], p.new_full((p.size(0), 1), eps - 1.0))  # p - (1-eps) at y
                g = grad_loss[rows, None]  # (R, 1)
                torch.addcmul(g * (-eps / V), p, g, out=grad[rows])  # (p - smoothed target) * g, cast once
        return grad, None, None


def smoothed_cross_entropy(logits: Tensor, labels: Tensor, eps: float = 0.0) -> Tensor:
    """Cross entropy of each row against a target with 1 - eps on `labels` and eps spread evenly
    over all V classes (Section 5.4), in float32 whatever the logits' dtype: what
    `F.cross_entropy(logits.float(), labels, label_smoothing=eps, reduction="none")` computes, for
    labels in [0, V) (no ignore_index: the caller keeps only real tokens). Compiled code takes that
    call itself: torch.compile fuses it, and the loop over row blocks would make it recompile for
    every new number of tokens.

    Shape: logits (N, V), labels (N,) -> (N,) float32.
    """
    if torch.compiler.is_compiling():
        return F.cross_entropy(logits.float(), labels, label_smoothing=eps, reduction="none")
    return _SmoothedCrossEntropy.apply(logits, labels, eps)


L = TypeVar("L", bound=nn.Module)


class Layers(nn.ModuleList, Generic[L]):
    """An `nn.ModuleList` whose items type-check as their class (same modules, same state dict)."""

    def __init__(self, layers: Iterable[L]) -> None:
        super().__init__(layers)

    def __iter__(self) -> Iterator[L]:
        return cast(Iterator[L], super().__iter__())  # __init__ took only L's
