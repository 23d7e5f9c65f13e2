"""On a CUDA device, the GPU path computes what the CPU computes and takes the fused attention kernels.

    pytest -m cuda tests/test_cuda.py                       # skipped where there is no CUDA device
    AIAYN_TEST_DEVICE=cpu pytest -m cuda tests/test_cuda.py  # the same tests on the CPU

On the CPU the comparisons with the CPU are trivially true (and fp16 training, which needs CUDA, and
the real out-of-memory are left out): that run shows that the module itself works on a machine
without a GPU. With AIAYN_CUDA_REPORT=DIR each test adds its measured figures to DIR/cuda.md and
the attention test writes DIR/sdpa_kernels.md, the kernel every kind of attention ran on.
"""

from __future__ import annotations

import copy
import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from aiayn import kernels, step
from aiayn.config import TrainConfig, preset
from aiayn.copytask import BOS, EOS, make_batch, train_copy
from aiayn.data.text import Batch, collate
from aiayn.model import MultiHeadAttention, Transformer
from aiayn.search import beam_search, greedy_search

DEVICE = os.environ.get("AIAYN_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "")
ON_GPU = DEVICE.startswith("cuda")
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not DEVICE, reason="no CUDA device (AIAYN_TEST_DEVICE=cpu runs "
                                                                      "these tests on the CPU)")]
# Training precisions (autocast; fp16 with the gradient scaler, on CUDA only) and search precisions
# (a model copy in that dtype, as `Translator` makes).
TRAIN_PRECISIONS = ("fp32", "bf16", "fp16") if ON_GPU else ("fp32", "bf16")
SEARCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
V = 500


def report(line: str) -> None:
    """Adds a line to $AIAYN_CUDA_REPORT/cuda.md (bench/gpu.sh collects it), and prints it."""
    print(line)
    folder = os.environ.get("AIAYN_CUDA_REPORT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / "cuda.md", "a", encoding="utf-8") as f:
            f.write(f"- {line} ({DEVICE})\n")


@pytest.fixture(autouse=True)
def _full_fp32_matmuls() -> Iterator[None]:
    """fp32 means fp32: no TF32 matmuls (torch's default, pinned here against a user's setting)."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)


def random_model(seed: int = 0, **over: Any) -> Transformer:
    """A `small`-shaped model (d_model 256, 3+3 layers) with a 500-word vocabulary, in eval mode."""
    torch.manual_seed(seed)
    return Transformer(preset("small", src_vocab_size=V, tgt_vocab_size=V, dropout=0.0, **over)).eval()


def pairs(seed: int = 1, rows: int = 12) -> Batch:
    """A batch of random pairs of 3..39 tokens: src (B, S), tgt_in (B, T), tgt_out (B, T), right-padded."""
    g = torch.Generator().manual_seed(seed)

    def sentence() -> list[int]:
        return torch.randint(4, V, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()

    return collate([(sentence(), sentence()) for _ in range(rows)], list(range(rows)))


def padded_batch(seed: int = 1, rows: int = 12) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b = pairs(seed, rows)
    return b.src, b.tgt_in, b.tgt_out


def on(device: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


# ---------------------------------------------------------------------------------- fp32 equality


def test_fp32_on_the_gpu_computes_what_the_cpu_computes():
    """Logits, the training loss and its gradients agree within 1e-4 (absolute for logits, relative to
    the largest for gradients): the kernels differ (fused attention, other GEMM tilings), the
    arithmetic is the same."""
    cpu = random_model()
    gpu = copy.deepcopy(cpu).to(DEVICE)
    src, tgt_in, tgt_out = padded_batch()
    with torch.no_grad():
        want = cpu(src, tgt_in)
        got = gpu(*on(DEVICE, src, tgt_in)).cpu()
    logits = (got - want).abs().max().item()
    assert logits < 1e-4
    losses = []
    for m in (cpu, gpu):
        m.train()
        loss = m.loss(*on(str(next(m.parameters()).device), src, tgt_in, tgt_out), label_smoothing=0.1, reduction="sum")
        loss.backward()
        losses.append(float(loss.detach()))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    worst = 0.0
    for (name, p), q in zip(cpu.named_parameters(), gpu.parameters()):
        assert p.grad is not None and q.grad is not None, name
        worst = max(worst, ((q.grad.cpu() - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)).item())
    assert worst < 1e-4
    report(f"fp32 forward GPU vs CPU: max |logit difference| {logits:.1e} (limit 1e-4); loss sum relative "
           f"{abs(losses[1] - losses[0]) / abs(losses[0]):.1e}; gradients, worst tensor, {worst:.1e} of its largest")


# ------------------------------------------------------------------ one training step, precisions


def one_step(model: Transformer, precision: str) -> tuple[float, Any, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One update by the real trainer from `model`'s weights: (loss per token, trainer, gradients,
    weight changes), on the CPU in float32."""
    from aiayn.trainer import Dist, Trainer

    m = copy.deepcopy(model).train()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    tc = TrainConfig(warmup=10, lr_factor=1.0, label_smoothing=0.1, precision=precision, device=DEVICE)
    trainer = Trainer(m, tc, Dist(device=torch.device(DEVICE)), precision)
    loss, _ = trainer.train_step([pairs(rows=32)])
    grads = {n: p.grad.detach().float().cpu() for n, p in m.named_parameters() if p.grad is not None}
    delta = {n: p.detach().float().cpu() - before[n].cpu() for n, p in m.named_parameters()}
    return loss, trainer, grads, delta


def flat(d: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.flatten() for _, t in sorted(d.items())])


def test_one_training_step_agrees_across_fp32_bf16_and_fp16():
    """The same update from the same weights and batch in every precision the trainer offers.

    Tolerances: bf16 keeps 8 significant bits (relative rounding 2^-9 = 0.2%), fp16 11 bits
    (2^-12); the matmuls accumulate in fp32 and the loss runs in fp32 (a softmax over the vocabulary),
    so the loss per token moves by well under 1% and the gradient by a few % of its norm, in
    direction (cosine) less than 1%. Adam's first update is about lr * sign(gradient) per weight, so
    weights whose gradient is near zero may move the other way: the updates are compared by how
    many weights move the same way (at least 90%). fp16's loss scaler must not skip this first
    update (its start scale suits a summed loss)."""
    model = random_model()
    ref_loss, _, ref_g, ref_d = one_step(model, "fp32")
    rg, rd = flat(ref_g), flat(ref_d)
    for precision in TRAIN_PRECISIONS[1:]:
        loss, trainer, g, d = one_step(model, precision)
        assert trainer.step == 1 and trainer.skipped == 0, precision  # applied, not skipped
        fg, fd = flat(g), flat(d)
        rel_loss = abs(loss - ref_loss) / ref_loss
        cos = torch.nn.functional.cosine_similarity(fg.double(), rg.double(), dim=0).item()
        rel_g = ((fg - rg).norm() / rg.norm()).item()
        same_way = (fd.sign() == rd.sign()).float().mean().item()
        report(f"one training step, {precision} vs fp32: loss {loss:.5f} vs {ref_loss:.5f} (relative {rel_loss:.1e}), "
               f"gradient cosine {cos:.5f}, relative error {rel_g:.2e}, updates the same way {same_way:.1%}")
        assert rel_loss < 1e-2, precision
        assert cos > 0.99 and rel_g < 0.1, precision
        assert same_way > 0.9, precision


# --------------------------------------------------------------------------------------- decoding


@pytest.fixture(scope="module")
def copy_model() -> Transformer:
    """A tiny model trained on the copy task (on the CPU, seconds): confident, so that decoding on
    two devices or two code paths must pick the very same tokens."""
    model, accuracy = train_copy(steps=600, seed=0)
    assert accuracy > 0.95
    return model.requires_grad_(False)


def copy_sources(n: int = 96, seed: int = 7) -> torch.Tensor:
    src, _, _ = make_batch(torch.Generator().manual_seed(seed), n, 13, 10, False)
    return src  # (n, 10), right-padded


def test_cached_decoding_equals_uncached_decoding():
    """Step by step, the decoder on its cache gives the logits of a full recompute of the prefix
    (fp32, 1e-4), and greedy and beam search give the same tokens with and without the cache, in
    fp32 and bf16."""
    model = random_model().to(DEVICE).requires_grad_(False)
    src = padded_batch()[0].to(DEVICE)
    tgt = torch.randint(4, V, (src.size(0), 20), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    worst = 0.0
    with torch.no_grad():
        keep = src.ne(0)
        memory = model.encode(src, keep)
        cache = model.new_cache(memory, keep)
        for t in range(tgt.size(1)):
            step = model.decode(tgt[:, t : t + 1], None, cache=cache)[:, -1]  # (B, V)
            full = model.decode(tgt[:, : t + 1], memory, keep)[:, -1]
            worst = max(worst, (step - full).abs().max().item())
    assert worst < 1e-4
    report(f"cached vs uncached decoder, fp32, 20 steps: max |logit difference| {worst:.1e} (limit 1e-4)")


def test_cached_and_uncached_search_pick_the_same_tokens(copy_model):
    src = copy_sources().to(DEVICE)
    for name, dtype in SEARCH_DTYPES.items():
        m = copy.deepcopy(copy_model).to(DEVICE, dtype)
        assert greedy_search(m, src, BOS, EOS) == greedy_search(m, src, BOS, EOS, use_cache=False), name
        cached = beam_search(m, src, BOS, EOS, 4, 0.6)
        uncached = beam_search(m, src, BOS, EOS, 4, 0.6, use_cache=False)
        assert [h[0][0] for h in cached] == [h[0][0] for h in uncached], name
    report(f"cached and uncached greedy and beam 4 search: the same tokens for {src.size(0)} sentences, fp32 and bf16")


def test_beam_search_on_the_gpu_gives_the_cpus_tokens(copy_model):
    """Beam 4 (and greedy) on the GPU: the CPU's translation of every sentence, on a trained model,
    and its 4-best scores within 1e-4 (the lower hypotheses themselves may trade places where two
    score within rounding of each other, so their tokens are not compared)."""
    src = copy_sources(seed=11)
    want = beam_search(copy_model, src, BOS, EOS, 4, 0.6, nbest=4)
    gpu = copy.deepcopy(copy_model).to(DEVICE)
    got = beam_search(gpu, src.to(DEVICE), BOS, EOS, 4, 0.6, nbest=4)
    assert [h[0][0] for h in got] == [h[0][0] for h in want]
    worst = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(sorted(x[1] for x in g), sorted(x[1] for x in w)))
    assert all(len(g) == len(w) for g, w in zip(got, want)) and worst < 1e-4
    assert greedy_search(gpu, src.to(DEVICE), BOS, EOS) == greedy_search(copy_model, src, BOS, EOS)
    report(f"beam 4 and greedy on {src.size(0)} copy-task sentences: GPU tokens = CPU tokens; "
           f"max |4-best score difference| {worst:.1e}")


def test_the_compiled_float_step_runs_there_and_equals_the_python_step(copy_model, monkeypatch):
    """On a GPU, search's steps run the decoder stack as one TorchScript call (`step._FloatStepPlan`),
    with the Python step's n-best tokens and scores exactly, fp32 and bf16. (On the
    CPU stand-in the step is let onto the CPU, on the linear layers and attention a GPU takes.)"""
    src = copy_sources(seed=11).to(DEVICE)
    ran: list[int] = []
    run = step._FloatStepPlan.run
    monkeypatch.setattr(step._FloatStepPlan, "run", lambda *a: (ran.append(1), run(*a))[1])
    if not ON_GPU:
        monkeypatch.setattr(step, "FLOAT_STEP_DEVICES", (DEVICE,))
        monkeypatch.setattr(kernels, "EXPLICIT_ATTENTION_MAX_KEYS", 0)
    for name, dtype in SEARCH_DTYPES.items():
        m = copy.deepcopy(copy_model).to(DEVICE, dtype).requires_grad_(not ON_GPU)  # CPU: F.linear, as a GPU's
        got = beam_search(m, src, BOS, EOS, 4, 0.6, nbest=4), greedy_search(m, src, BOS, EOS)
        steps = len(ran)
        with monkeypatch.context() as python_step:
            python_step.setattr(step, "FLOAT_STEP_DEVICES", ())
            want = beam_search(m, src, BOS, EOS, 4, 0.6, nbest=4), greedy_search(m, src, BOS, EOS)
        assert steps > 0 and len(ran) == steps, name  # compiled every step, and only there
        assert got == want, name
        ran.clear()
    report(f"search's compiled float step (TorchScript): the Python step's beam-4 n-best and greedy tokens and "
           f"scores exactly on {src.size(0)} sentences, fp32 and bf16")


# ------------------------------------------------------------------------ which attention kernel


class _SdpaOps(TorchDispatchMode):
    """Records the SDPA operators that run inside it: `F.scaled_dot_product_attention` picks a
    backend and calls its operator (flash, memory-efficient, cuDNN); the math fallback is composite
    and shows only as its parts (matmuls and a softmax). Outside autograd (inference mode) the
    dispatcher hands a mode the composite call itself: it is divided here, in the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.scaled_dot_product_attention.default:  # whole: run its parts in here
            with self:
                return func.decompose(*args, **(kwargs or {}))
        if "scaled_dot_product" in str(func):
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))


class _StepSdpa(TorchDispatchMode):
    """The attention calls of search's compiled float step (`step._FloatStepPlan`, TorchScript: no
    Python attention there to spy on) as (kind, SDPA backend) pairs: with a mask, a call reads the
    cached cross-attention keys; without, the self-attention's cache."""

    def __init__(self, calls: list[tuple[str, str]]) -> None:
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.ops.aten.scaled_dot_product_attention.default:
            return func(*args, **kwargs)
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        with _SdpaOps() as ops:
            out = func(*args, **kwargs)
        self.calls.append(("cross, cached keys" if mask is not None else "decoder self, cached", backend(ops.names)))
        return out


def backend(names: list[str]) -> str:
    for key, label in (("flash", "flash"), ("efficient", "memory-efficient"), ("cudnn", "cuDNN"), ("math", "math")):
        if any(key in n for n in names):
            return label
    return "undetermined" if names else "math"  # parts only: the math fallback, decomposed by autograd


def kind_of(module: MultiHeadAttention, kwargs: dict[str, Any]) -> str:
    """What a call of `module` with `kwargs` attends: the layer's kind (set by `attention_calls`,
    kept by copies of the model) and whether it reads the decoding cache."""
    cached = kwargs.get("cache") is not None
    kind = getattr(module, "test_kind")
    if kind == "cross":
        return "cross, cached keys" if cached else "cross"
    if kind == "decoder self":
        if cached:
            return "decoder self, cached"
        if kwargs.get("is_causal"):
            return "decoder self, causal"
        return "decoder self, one position" if kwargs.get("key_keep") is None else "decoder self, masked"
    return kind


@pytest.fixture()
def attention_calls(monkeypatch) -> Iterator[tuple[list[tuple[str, str]], Transformer]]:
    """A model whose attention calls (and those of its copies) are recorded as (kind, SDPA backend)
    pairs; SDPA everywhere (the CPU's spelled-out path for short keys is switched off)."""
    monkeypatch.setattr(kernels, "EXPLICIT_ATTENTION_MAX_KEYS", 0)
    model = random_model(attention_dropout=0.1).to(DEVICE)
    calls: list[tuple[str, str]] = []
    current = [""]
    for layer in model.encoder.layers:
        layer.self_attn.test_kind = "encoder self"
    for layer in model.decoder.layers:
        layer.self_attn.test_kind, layer.cross_attn.test_kind = "decoder self", "cross"
    for m in model.modules():
        if isinstance(m, MultiHeadAttention):
            m.register_forward_pre_hook(lambda mod, args, kwargs: current.__setitem__(0, kind_of(mod, kwargs)),
                                        with_kwargs=True)
    attention_step = step._attention_step  # search's cached steps (step.decoder_step) call it, not forward

    def noted_step(mha, x, cache, *args):
        current[0] = kind_of(mha, {"cache": cache})
        return attention_step(mha, x, cache, *args)

    monkeypatch.setattr(step, "_attention_step", noted_step)
    float_run = step._FloatStepPlan.run  # on a GPU the cached steps run compiled instead

    def noted_float_run(plan, *args):
        with _StepSdpa(calls):
            return float_run(plan, *args)

    monkeypatch.setattr(step._FloatStepPlan, "run", noted_float_run)
    attention = kernels.attention

    def spied(q, k, v, mask, is_causal, p, training, need_weights=False, bias=None):
        with _SdpaOps() as ops:
            out = attention(q, k, v, mask, is_causal, p, training, need_weights, bias)
        calls.append((current[0], backend(ops.names)))
        return out

    monkeypatch.setattr(kernels, "attention", spied)
    yield calls, model


def run_every_attention(model: Transformer, calls: list[tuple[str, str]]) -> dict[tuple[str, str], set[str]]:
    """Training steps in each precision (forward and backward, attention dropout on) and searches
    with and without the cache in fp32 and bf16: {(kind, where): backends seen}."""
    seen: dict[tuple[str, str], set[str]] = {}

    def collect(where: str) -> None:
        for kind, b in calls:
            seen.setdefault((kind, where), set()).add(b)
        calls.clear()

    src, tgt_in, tgt_out = on(DEVICE, *padded_batch())
    for precision in TRAIN_PRECISIONS:
        model.train()
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        with torch.autocast(DEVICE.split(":")[0], dtype=dtype, enabled=dtype is not None):
            loss = model.loss(src, tgt_in, tgt_out, label_smoothing=0.1, reduction="sum")
        loss.backward()
        model.zero_grad(set_to_none=True)
        collect(f"training {precision}")
    model.eval()
    for name, dtype in SEARCH_DTYPES.items():
        m = copy.deepcopy(model).to(dtype).requires_grad_(False)
        beam_search(m, src, BOS, EOS, 4, 0.6, max_len_b=8)
        collect(f"search {name}")
        greedy_search(m, src, BOS, EOS, max_len_b=8, use_cache=False)
        collect(f"search {name}, no cache")
    return seen


def test_every_attention_runs_on_a_fused_kernel_never_the_math_fallback(attention_calls):
    """Each kind of attention (encoder self with its padding mask, decoder self causal and on the
    cache, cross with the mask, on the encoder output and on the cached keys) in training (fp32,
    bf16, fp16; dropout on) and in search (fp32, bf16) runs on flash or memory-efficient attention
    by PyTorch's own choice, never on cuDNN's (`kernels.GPU_ATTENTION_BACKENDS`: it pays for each
    new shape, and on an H200 aiayn's bf16 searches ran 13-23x slower than fp32), and still runs with the math
    fallback forbidden. On the CPU the table
    is made but not held to it (its flash kernel has no dropout, so training falls back there)."""
    calls, model = attention_calls
    seen = run_every_attention(model, calls)
    kinds = sorted({k for k, _ in seen})
    wheres = list(dict.fromkeys(w for _, w in seen))
    table = ["| attention | " + " | ".join(wheres) + " |", "|---|" + "---|" * len(wheres)]
    for kind in kinds:
        table.append(f"| {kind} | " + " | ".join(", ".join(sorted(seen.get((kind, w), {"-"}))) for w in wheres) + " |")
    text = f"SDPA backend per attention call, torch {torch.__version__}, {DEVICE}" + (
        f" ({torch.cuda.get_device_name()})" if ON_GPU else "") + "\n\n" + "\n".join(table) + "\n"
    print(text)
    folder = os.environ.get("AIAYN_CUDA_REPORT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "sdpa_kernels.md").write_text(text, encoding="utf-8")
    assert {"encoder self", "decoder self, causal", "decoder self, cached", "cross", "cross, cached keys"} <= set(kinds)
    if not ON_GPU:
        return
    slow = sorted(f"{k} ({w}): {', '.join(sorted(b))}" for (k, w), b in seen.items()
                  if not b <= {"flash", "memory-efficient"})  # cuDNN: a graph build per new shape
    assert not slow, f"not on flash or memory-efficient attention: {'; '.join(slow)}"
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):  # no math to fall back to
        run_every_attention(model, calls)
    report("every attention kind ran on flash or memory-efficient attention (sdpa_kernels.md), also with math forbidden")


# ------------------------------------------------------------------------------ a batch too large


@pytest.mark.skipif(not ON_GPU, reason="a real out-of-memory needs a GPU (test_memory.py simulates one on the CPU)")
def test_a_batch_too_large_for_the_gpu_is_one_line_naming_max_tokens(tmp_path, capsys):
    """1,000 pairs of 1,000 tokens in one batch of the base model need hundreds of GB: `aiayn train`
    stops with one line that names --max-tokens, no traceback, and the GPU is usable afterwards."""
    from aiayn.cli import main as cli_main

    g = torch.Generator().manual_seed(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    for side in ("src", "tgt"):
        rows = torch.randint(0, 26, (1000, 1000), generator=g).tolist()
        (tmp_path / f"train.{side}").write_text("".join(" ".join(letters[i] for i in r) + "\n" for r in rows))
    args = ["train", "--train-src", str(tmp_path / "train.src"), "--train-tgt", str(tmp_path / "train.tgt"),
            "--preset", "base", "--vocab-size", "320", "--max-len", "1100", "--max-tokens", "2000000",
            "--max-steps", "1", "--precision", "bf16", "--device", DEVICE, "--out", str(tmp_path / "run")]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("aiayn train: error: --max-tokens 2000000: out of memory on cuda"), err[-3:]
    assert "lower --max-tokens" in err[-1] and not any("Traceback" in line for line in err)
    gc.collect()  # the failed step's tensors, held by the exception's frames until now
    torch.cuda.empty_cache()
    assert torch.ones(1, device=DEVICE).item() == 1.0
    report(f"--max-tokens 2000000 (base model): {err[-1]}")
