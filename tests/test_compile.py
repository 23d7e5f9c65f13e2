"""`aiayn train --compile` (`trainer.compile_layers`): one compilation per stack of layers for every
batch shape, computing what the eager layers compute, with the weights' names unchanged."""

from __future__ import annotations

import contextlib
import copy

import torch
from torch._dynamo.utils import counters

from aiayn import kernels
from aiayn.config import TrainConfig, preset
from aiayn.data.text import collate
from aiayn.model import Transformer
from aiayn.trainer import Dist, Trainer

V = 200


def batch(seed: int, rows: int, longest: int):
    g = torch.Generator().manual_seed(seed)

    def sentence() -> list[int]:
        return torch.randint(4, V, (int(torch.randint(2, longest, (1,), generator=g)),), generator=g).tolist()

    return collate([(sentence(), sentence()) for _ in range(rows)], list(range(rows)))


def test_compiled_layers_train_as_the_eager_ones_and_compile_once(monkeypatch):
    """Four steps of new token counts: the losses of eager training (each after the updates before
    it; the weights themselves are not compared, as Adam turns rounding noise in a near-zero
    gradient into a full step), and no layer compiled again after the first step. Attention takes
    SDPA, as on a GPU (the CPU's spelled-out path for short keys branches on their number: a
    compilation per range there)."""
    monkeypatch.setattr(kernels, "EXPLICIT_ATTENTION_MAX_KEYS", 0)
    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=V, tgt_vocab_size=V, dropout=0.0, attention_dropout=0.0))
    names = list(model.state_dict())
    dev = Dist(0, 1, torch.device("cpu"))
    eager = Trainer(copy.deepcopy(model), TrainConfig(warmup=10), dev, "fp32")
    torch._dynamo.reset()
    counters.clear()
    compiled = Trainer(model, TrainConfig(warmup=10, compile=True), dev, "fp32")
    assert list(compiled.base.state_dict()) == names  # checkpoints keep their names
    shapes = [(8, 9), (5, 17), (11, 6), (3, 23)]  # rows, longest sentence: new token counts each step
    for i, (rows, longest) in enumerate(shapes):
        b = batch(i, rows, longest)
        want, got = eager.train_step([b])[0], compiled.train_step([b])[0]
        # The first step's weights are the same: only the fused kernels' rounding differs, in the
        # loss and in the gradients (left in .grad until the next step). Each update carries that
        # rounding into the weights, Adam enlarging it where a gradient is near zero (an AVX2-only
        # CPU: the losses 8e-7, 2e-6, then 9e-5 apart by the fourth step), so later losses get 1e-3.
        assert abs(want - got) <= (1e-5 if i == 0 else 1e-3) * abs(want), (i, want, got)
        if i == 0:
            frames = counters["frames"]["ok"]
            grads = dict(compiled.base.named_parameters())
            for name, p in eager.base.named_parameters():
                g = grads[name].grad
                assert g is not None and (g - p.grad).norm() <= 1e-5 * p.grad.norm() + 1e-12, name
    assert frames == 2, f"{frames} compilations for the first step, not one per stack"
    assert counters["frames"]["ok"] == frames, "a new batch shape recompiled a layer"


def test_validation_runs_the_compiled_layers_eagerly(monkeypatch, tmp_path):
    """Evaluation and greedy search in `validate` compile nothing (each mode and shape would
    compile the layers again), and give what the uncompiled model gives."""
    from test_train import make_corpus

    from aiayn import train as T
    from aiayn.trainer import validate

    monkeypatch.setattr(kernels, "EXPLICIT_ATTENTION_MAX_KEYS", 0)
    tc = TrainConfig(**make_corpus(tmp_path / "data"), vocab_size=300, max_tokens=160, valid_bleu=8,
                     out=str(tmp_path / "r"))
    data = T.load_corpus(tc, None, tmp_path / "r", Dist(), False)
    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=data.tokenizers.src.vocab_size,
                               tgt_vocab_size=data.tokenizers.tgt.vocab_size))
    plain = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    trainer = Trainer(model, TrainConfig(compile=True), Dist(0, 1, torch.device("cpu")), "fp32")
    trainer.train_step([batch(0, 6, 9)])
    frames = counters["frames"]["ok"]
    got = validate(trainer.base, data, tc, contextlib.nullcontext, torch.device("cpu"))
    assert counters["frames"]["ok"] == frames, "validation compiled the layers again"
    plain.load_state_dict(trainer.base.state_dict())
    want = validate(plain, data, tc, contextlib.nullcontext, torch.device("cpu"))
    assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-4 for k in got), (got, want)


def test_a_compiled_run_resumes_exactly(tmp_path, monkeypatch):
    """`--compile` and `--resume`: 3 steps, then 3 more from the checkpoint, end with the weights of
    6 steps in one go, bitwise (in separate processes too, checked by hand on 2026-11-27). With
    dropout: its masks, drawn inside the compiled layers, must continue from the saved RNG state."""
    from safetensors.torch import load_file
    from test_train import make_corpus, tiny_args, train_cli

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    paths = make_corpus(tmp_path / "data")
    common = ("--compile", "--save-every", "3", "--dropout", "0.1")
    train_cli(tiny_args(paths, tmp_path / "whole", *common, "--max-steps", "6"))
    train_cli(tiny_args(paths, tmp_path / "cut", *common, "--max-steps", "3"))
    train_cli(tiny_args(paths, tmp_path / "cut", *common, "--max-steps", "6", "--resume"))
    a, b = (load_file(str(tmp_path / run / "step_6" / "model.safetensors")) for run in ("whole", "cut"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
