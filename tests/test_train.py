"""The trainer: the paper's schedule and loss, determinism, gradient accumulation, the loop's
stopping rules, checkpoints and metrics, the command line and its errors."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from aiayn import checkpoint as ckpt
from aiayn import train as T
from aiayn import train_options as TO
from aiayn import trainer as TR
from aiayn.cli import build_parser
from aiayn.cli import main as cli_main
from aiayn.config import ConfigError, ModelConfig, TrainConfig, learning_rate, preset
from aiayn.data.text import Batch, collate
from aiayn.errors import AiaynError
from aiayn.data.bindata import open_prepared
from aiayn.model import Transformer

EN = "the a cat dog sees runs big small red house tree man woman child ball blue green eats under".split()
DE = "der ein katze hund sieht läuft groß klein rot haus baum mann frau kind ball blau grün isst unter".split()


def make_corpus(folder: Path, n_train: int = 120, n_valid: int = 12, seed: int = 0) -> dict[str, str]:
    """A tiny word-for-word 'translation' corpus; returns the four file paths by option name."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n in (("train", n_train), ("valid", n_valid)):
        src, tgt = [], []
        for _ in range(n):
            idx = [rng.randrange(len(EN)) for _ in range(rng.randint(2, 7))]
            src.append(" ".join(EN[i] for i in idx))
            tgt.append(" ".join(DE[i] for i in idx))
        for side, lines in (("src", src), ("tgt", tgt)):
            p = folder / f"{split}.{side}"
            p.write_text("\n".join(lines) + "\n", encoding="utf-8")
            paths[f"{split}_{side}"] = str(p)
    return paths


def tiny_args(paths: dict[str, str], out: Path, *extra: str) -> list[str]:
    """`aiayn train` arguments for a tiny, fast, deterministic (fp32, one thread) run."""
    return ["train", "--train-src", paths["train_src"], "--train-tgt", paths["train_tgt"],
            "--valid-src", paths["valid_src"], "--valid-tgt", paths["valid_tgt"], "--preset", "tiny",
            "--vocab-size", "300", "--max-tokens", "160", "--warmup", "10", "--lr-factor", "2",
            "--precision", "fp32", "--threads", "1", "--valid-bleu", "8", "--out", str(out), *extra]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # tokenizer cache stays in tmp


@pytest.fixture()
def corpus(tmp_path) -> dict[str, str]:
    return make_corpus(tmp_path / "data")


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / f"step_{step}" / "model.safetensors"))


def train_cli(args: list[str]) -> dict:
    parsed = build_parser("train").parse_args(args)
    name, over, tc = TO.build_configs(parsed)
    return T.train(name, over, tc, resume=parsed.resume, log=lambda m: None)


# ----------------------------------------------------------------------------------- the recipe


def test_learning_rate_follows_the_paper():
    d, w = 512, 4000
    peak = d**-0.5 * w**-0.5
    assert learning_rate(w, d, w) == pytest.approx(peak)
    assert learning_rate(w // 2, d, w) == pytest.approx(peak / 2)  # linear warm-up
    assert learning_rate(4 * w, d, w) == pytest.approx(peak / 2)  # inverse square root decay
    assert learning_rate(0, d, w) == learning_rate(1, d, w) > 0
    assert learning_rate(100, d, w, factor=2.0) == pytest.approx(2 * learning_rate(100, d, w))


def test_cooldown_ramps_the_paper_schedule_down_until_max_steps():
    d, w, n, c = 256, 100, 1000, 200
    paper = lambda step: learning_rate(step, d, w)  # noqa: E731
    cooled = lambda step: learning_rate(step, d, w, cooldown=c, max_steps=n)  # noqa: E731
    assert [cooled(s) for s in (1, w, n - c + 1)] == [paper(s) for s in (1, w, n - c + 1)]  # untouched before
    assert cooled(n - c // 2 + 1) == pytest.approx(paper(n - c // 2 + 1) / 2)  # half way down the ramp
    assert cooled(n) == pytest.approx(paper(n) / c)  # the last step still moves the weights
    assert cooled(n + 1) == 0.0


def test_cooldown_needs_a_step_budget():
    with pytest.raises(ConfigError, match="--cooldown 500 needs --max-steps of at least"):
        TrainConfig(cooldown=500).check_cooldown()
    with pytest.raises(ConfigError, match="--cooldown must be 0"):
        TrainConfig(cooldown=-1, max_steps=10)
    TrainConfig(cooldown=500, max_steps=500).check_cooldown()


def test_cooldown_is_checked_on_the_settings_a_run_ends_up_with(tmp_path, corpus, capsys):
    out = tmp_path / "r"
    assert cli_main(tiny_args(corpus, out, "--cooldown", "3")) == 2  # a fresh run without --max-steps
    assert "--cooldown 3 needs --max-steps" in capsys.readouterr().err and not out.exists()
    assert cli_main(tiny_args(corpus, out, "--max-steps", "2")) == 0
    assert cli_main(["train", "--out", str(out), "--resume", "--cooldown", "2"]) == 0  # the run's --max-steps 2
    assert cli_main(["train", "--out", str(out), "--resume", "--cooldown", "3"]) == 2
    assert "--cooldown 3 needs --max-steps of at least" in capsys.readouterr().err


def test_loss_is_label_smoothed_and_ignores_padding():
    torch.manual_seed(0)
    V, eps = 40, 0.1
    m = Transformer(preset("tiny", src_vocab_size=V, tgt_vocab_size=V)).eval()
    src = torch.tensor([[5, 6, 7], [8, 9, 0]])
    tgt = torch.tensor([[4, 5, 3], [6, 3, 0]])  # the second row has one pad position
    batch = Batch(src, tgt, tgt, [0, 1], 5)
    got = TR.loss_sum(m, batch, eps)
    logp = m(src, tgt).float().log_softmax(-1)
    want = 0.0
    for b, t in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]:  # every non-pad token once
        y = int(tgt[b, t])
        want += -(1 - eps) * logp[b, t, y] - eps / V * logp[b, t].sum()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    # more padding (a wider batch) does not change the loss
    pad = lambda x: F.pad(x, (0, 2))  # noqa: E731
    torch.testing.assert_close(TR.loss_sum(m, Batch(pad(src), pad(tgt), pad(tgt), [0, 1], 5), eps), got,
                               rtol=1e-5, atol=1e-4)


def test_loss_of_the_model_equals_cross_entropy_of_its_logits():
    torch.manual_seed(0)
    m = Transformer(preset("tiny", src_vocab_size=40, tgt_vocab_size=40)).eval()
    b = collate(_examples(6), list(range(6)))
    logits = m(b.src, b.tgt_in)
    want = F.cross_entropy(logits.flatten(0, 1), b.tgt_out.flatten(), ignore_index=0, label_smoothing=0.1, reduction="sum")
    torch.testing.assert_close(TR.loss_sum(m, b, 0.1), want, rtol=1e-5, atol=1e-4)


def test_label_smoothing_spreads_its_mass_over_every_class_pad_included():
    """The README's promise: the smoothed target puts 1 - eps + eps/V on the true token and eps/V on
    each of the V classes, pad (and BOS) included, at real target positions only; Transformer.loss
    computes exactly that (a pad-excluded eps/(V-1) would differ)."""
    torch.manual_seed(0)
    V, eps = 40, 0.1
    m = Transformer(preset("tiny", src_vocab_size=V, tgt_vocab_size=V)).eval()
    b = collate(_examples(6), list(range(6)))
    logp = m(b.src, b.tgt_in).float().log_softmax(-1)  # (B, T, V)
    real = b.tgt_out.ne(0)
    onehot = F.one_hot(b.tgt_out, V).float()
    every = (1 - eps) * onehot + eps / V
    without_pad = (1 - eps) * onehot + eps / (V - 1) * (torch.arange(V) != 0)
    got = TR.loss_sum(m, b, eps)
    torch.testing.assert_close(got, -(every * logp).sum(-1)[real].sum(), rtol=1e-5, atol=1e-4)
    assert not torch.allclose(got, -(without_pad * logp).sum(-1)[real].sum(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("native, want", [(True, "bf16"), (False, "fp32")])
def test_auto_precision_takes_bf16_only_on_a_cpu_that_computes_it(monkeypatch, native, want):
    import aiayn.kernels

    monkeypatch.setattr(aiayn.kernels, "cpu_has_fast_bf16", lambda: native)
    assert TR.precision_context("auto", torch.device("cpu"))[2] == want
    assert TR.precision_context("bf16", torch.device("cpu"))[2] == "bf16"  # asked for by name: as asked


def _examples(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    g = random.Random(seed)
    return [([g.randrange(4, 40) for _ in range(g.randint(1, 9))], [g.randrange(4, 40) for _ in range(g.randint(1, 9))])
            for _ in range(n)]


def test_update_freq_two_half_batches_equal_one_big_batch():
    ex = _examples(16)
    cfg = preset("tiny", src_vocab_size=40, tgt_vocab_size=40, dropout=0.0)
    tc = TrainConfig(update_freq=2, warmup=10)
    results = []
    for batches in ([collate(ex, list(range(16)))], [collate(ex, list(range(7))), collate(ex, list(range(7, 16)))]):
        torch.manual_seed(3)
        tr = TR.Trainer(Transformer(cfg), tc, TR.Dist(), "fp32")
        loss, ntok = tr.train_step(batches)
        # the gradient the optimizer used (Adam's first step is sign-like, so compare gradients, not weights)
        results.append((loss, ntok, {n: p.grad.clone() for n, p in tr.base.named_parameters()}))
    (l1, n1, g1), (l2, n2, g2) = results
    assert n1 == n2 == sum(len(t) + 1 for _, t in ex)
    assert l1 == pytest.approx(l2, rel=1e-5)
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-4, atol=1e-6)
    # the gradient is the per-token mean: summing over tokens instead would be ~n1 times larger
    g = g1["encoder.layers.0.ff.w1.weight"]
    assert 0 < g.abs().max() < 1


def test_clip_norm_clips_the_mean_gradient_the_optimizer_steps_with():
    """--clip-norm bounds the global norm of the per-token mean gradient (after the token scaling), and
    leaves a gradient within the bound alone."""
    ex = _examples(16)
    cfg = preset("tiny", src_vocab_size=40, tgt_vocab_size=40, dropout=0.0)

    def step(clip: float) -> tuple[torch.Tensor, float]:
        torch.manual_seed(3)
        tr = TR.Trainer(Transformer(cfg), TrainConfig(warmup=10, clip_norm=clip), TR.Dist(), "fp32")
        tr.train_step([collate(ex, list(range(16)))])
        flat = torch.cat([p.grad.flatten() for p in tr.base.parameters() if p.grad is not None])
        return flat, float(torch.linalg.vector_norm(flat))

    free, norm = step(0.0)
    assert 0.1 < norm < 100  # the mean over tokens, not the sum (~n times larger)
    clipped, got = step(norm / 4)
    assert got == pytest.approx(norm / 4, rel=1e-4)
    torch.testing.assert_close(clipped, free / 4, rtol=1e-4, atol=1e-8)  # scaled as a whole, direction kept
    loose, got = step(norm * 4)
    assert got == pytest.approx(norm, rel=1e-6) and torch.equal(loose, free)


def test_fp16_on_a_cpu_is_refused_with_its_message_before_anything_is_prepared(tmp_path, corpus, capsys):
    """Refused once the device is known, not after the data is prepared (minutes at WMT14 size)."""
    argv = tiny_args(corpus, tmp_path / "run", "--max-steps", "1", "--precision", "fp16", "--device", "cpu")
    assert cli_main(argv) == 2
    assert capsys.readouterr().err == ("aiayn train: error: --precision fp16 needs a CUDA device; "
                                       "use bf16 or fp32 on the CPU\n")
    assert not (tmp_path / "run" / "data").exists() and not (tmp_path / "run" / "tokenizer").exists()


def test_optimizer_and_schedule_settings():
    tc = TrainConfig(warmup=7, lr_factor=0.5, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-8)
    tr = TR.Trainer(Transformer(preset("tiny", src_vocab_size=40, tgt_vocab_size=40)), tc, TR.Dist(), "fp32")
    g = tr.opt.param_groups[0]
    assert g["betas"] == (0.8, 0.95) and g["eps"] == 1e-8
    tr.train_step([collate(_examples(4), [0, 1, 2, 3])])
    assert tr.step == 1 and g["lr"] == pytest.approx(0.5 * 32**-0.5 * 7**-1.5)


def _fp16_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 autocast and GradScaler("cpu") run on a CPU too: the Trainer's fp16 mechanism, tested here
    (`train` itself refuses fp16 without CUDA, where it would only be slow)."""
    monkeypatch.setattr(TR, "precision_context",
                        lambda p, d: ((lambda: torch.autocast("cpu", dtype=torch.float16)), True, "fp16"))


def test_fp16_counts_only_the_updates_it_applies(monkeypatch):
    """An update the scaler skips (gradients overflowed) advances neither the step nor the schedule."""
    _fp16_on_the_cpu(monkeypatch)
    tc = TrainConfig(warmup=7)
    tr = TR.Trainer(Transformer(preset("tiny", src_vocab_size=40, tgt_vocab_size=40)), tc, TR.Dist(), "fp16")
    assert tr.scaler is not None and tr.scaler.get_scale() == TR.FP16_INIT_SCALE == 2.0**7  # summed losses
    tr.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30)  # overflows, halving each time, then fits
    batch = [collate(_examples(4), [0, 1, 2, 3])]
    applied = [tr.train_step(batch) and tr.applied for _ in range(24)]
    assert 0 < tr.skipped == applied.count(False) < 24 and not any(applied[:tr.skipped]) and all(applied[tr.skipped:])
    assert tr.step == 24 - tr.skipped
    assert tr.opt.param_groups[0]["lr"] == pytest.approx(tr.lr(tr.step))  # the schedule of the applied steps
    assert int(next(iter(tr.opt.state.values()))["step"]) == tr.step  # Adam counted the same updates
    assert tr.state()["skipped"] == tr.skipped


def _step_as_before(tr: TR.Trainer, batches: list[Batch]) -> tuple[float, int]:
    """train_step as it was before the host syncs went (a float() per batch, a per-parameter scale loop)."""
    tr.model.train()
    tr.opt.zero_grad(set_to_none=True)
    total, tokens = 0.0, 0
    for batch in batches:
        loss = tr.model(batch.src, batch.tgt_in, batch.tgt_out)
        loss.backward()
        total += float(loss.detach())
        tokens += int(batch.n_tgt_tokens)
    tr.step += 1
    for g in tr.opt.param_groups:
        g["lr"] = tr.lr(tr.step)
    for p in tr.base.parameters():
        if p.grad is not None:
            p.grad.mul_(1 / max(tokens, 1))
    tr.opt.step()
    return total / max(tokens, 1), tokens


def test_one_host_read_per_update_and_bitwise_the_same_update(monkeypatch):
    """The loss is summed on the device and read once per update; the weights, the loss and the token
    count are bitwise what the per-batch reads gave."""
    ex = _examples(24)
    cfg = preset("tiny", src_vocab_size=40, tgt_vocab_size=40, dropout=0.0)
    steps = [[collate(ex, list(range(s + i * 3, s + i * 3 + 3))) for i in range(2)] for s in (0, 6, 12, 18)]
    trainers, results = [], []
    for how in ("now", "before"):
        torch.manual_seed(3)
        tr = TR.Trainer(Transformer(cfg), TrainConfig(update_freq=2, warmup=4), TR.Dist(), "fp32")
        results.append([tr.train_step(b) if how == "now" else _step_as_before(tr, b) for b in steps[:3]])
        trainers.append(tr)
    assert results[0] == results[1]
    w = [tr.base.state_dict() for tr in trainers]
    assert all(torch.equal(w[0][k], w[1][k]) for k in w[0])
    reads = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _r=real, _n=name: reads.append(_n) or _r(self, *a))
    trainers[0].train_step(steps[3])
    assert reads == ["tolist"]  # before: a float() per batch, and more


def _spy_on_host_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records each call that makes the host wait for a GPU's results: a read of a value, `nonzero`,
    and indexing with a boolean mask (whose result size the host must learn)."""
    reads: list[str] = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "nonzero"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _r=real, _n=name, **k: reads.append(_n) or _r(self, *a, **k))
    real_getitem = torch.Tensor.__getitem__

    def getitem(self, key):
        if isinstance(key, torch.Tensor) and key.dtype == torch.bool:
            reads.append("mask")
        return real_getitem(self, key)

    monkeypatch.setattr(torch.Tensor, "__getitem__", getitem)
    return reads


def test_a_step_on_collated_batches_finds_no_padding_on_the_device(monkeypatch, tmp_path, corpus):
    """On a GPU, `nonzero`, a boolean mask and `bool(tensor)` each make the host wait for the device.
    Collate finds the real tokens on the host (`Batch.packing`: what `keep.nonzero()` gives), in the
    prefetch thread, so a step on its batches waits once per update: the loss and the token count."""
    tc = TrainConfig(**{k: v for k, v in corpus.items()}, vocab_size=300, max_tokens=160)
    data = T.load_corpus(tc, None, tmp_path / "r", TR.Dist(), source_eos=True)
    ex = _examples(12)
    batches = [data.train.collate(np.arange(6), tc.max_len, True), collate(ex, list(range(6, 12)))]
    for b in batches:  # the bindata collate (training) and the text one
        assert b.packing is not None and b.packing.labelled is None  # right-padded: every target position scored
        assert torch.equal(b.packing.src.idx, b.src.ne(0).flatten().nonzero().squeeze(1))
        assert torch.equal(b.packing.tgt.idx, b.tgt_out.ne(0).flatten().nonzero().squeeze(1))
    cfg = preset("tiny", src_vocab_size=300, tgt_vocab_size=300)
    tr = TR.Trainer(Transformer(cfg), TrainConfig(update_freq=2), TR.Dist(), "fp32")
    reads = _spy_on_host_reads(monkeypatch)
    tr.train_step(batches)
    assert reads == ["tolist"]  # before: a nonzero per batch and side, and a boolean mask


def test_the_ranks_agree_to_stop_in_one_all_reduce_per_step(monkeypatch):
    """After each step every rank must take the same stop decision (a signal on one rank, the time
    limit); each all-reduce is a host read on a GPU, so both flags travel in one, not one each."""
    from types import SimpleNamespace

    reduced = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op=None: reduced.append(t.tolist()))
    run = SimpleNamespace(tc=TrainConfig(max_minutes=1), d=TR.Dist(0, 2), trainer=SimpleNamespace(step=3),
                          seconds=lambda: 61.0)
    assert T._stop_reason_after_step(run, SimpleNamespace(signum=None)) == "reached --max-minutes 1"
    assert reduced == [[0.0, 1.0]]  # before: one all-reduce for the signal, another for the time
    assert T._stop_reason_after_step(run, SimpleNamespace(signum=2)) == "interrupted by SIGINT"
    run.seconds = lambda: 59.0
    assert T._stop_reason_after_step(run, SimpleNamespace(signum=None)) == "" and len(reduced) == 3


def test_prefetch_keeps_order_hands_over_errors_and_stops_early():
    feed = TR.Prefetch(iter([[1], [2], [3]]), pin=False)
    assert list(feed) == [[1], [2], [3]]
    feed.close()

    def failing() -> Iterator[list[int]]:
        yield [1]
        raise AiaynError("bad batch")

    feed = TR.Prefetch(failing(), pin=False)
    assert next(feed) == [1]
    with pytest.raises(AiaynError, match="bad batch"):
        next(feed)
    feed.close()
    made = []

    def endless() -> Iterator[list[int]]:
        while True:
            made.append(1)
            yield [len(made)]

    feed = TR.Prefetch(endless(), pin=False, ahead=2)
    assert next(feed) == [1]
    feed.close()  # the thread ends although items remain
    assert len(made) <= 5


# ------------------------------------------------------------------------------------ the loop


def test_same_seed_gives_bitwise_same_weights(tmp_path, corpus):
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        train_cli(tiny_args(corpus, tmp_path / name, "--max-steps", "6", "--seed", seed, "--dropout", "0.1"))
    a, b, c = (weights(tmp_path / n, 6) for n in "abc")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_loop_writes_metrics_checkpoints_and_best(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    rc = cli_main(tiny_args(corpus, out, "--max-epochs", "3", "--save-every", "2", "--keep-last", "2",
                            "--log-every", "1"))
    assert rc == 0
    printed = capsys.readouterr().out
    assert "parameters" in printed and "120 training pairs (0 of 120 skipped" in printed and str(out) in printed
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    valid = [r for r in recs if r["kind"] == "valid"]
    assert set(train[0]) == {"kind", "step", "epoch", "loss", "lr", "tokens_per_s", "elapsed_s"}
    assert [r["step"] for r in train] == list(range(1, len(train) + 1))
    assert [r["epoch"] for r in valid] == [1, 2, 3]
    assert set(valid[0]) >= {"kind", "step", "epoch", "loss", "bleu", "chrf", "elapsed_s"}
    assert train[-1]["loss"] < train[0]["loss"]  # it learns
    steps = [int(p.name[5:]) for p in out.glob("step_*")]
    assert len(steps) == 2 and max(steps) == valid[-1]["step"]  # keep_last 2, the last at the epoch end
    best_step = json.loads((out / "best" / "config.json").read_text())["step"]
    best_bleu = max(r["bleu"] for r in valid)
    assert best_step == next(r["step"] for r in valid if r["bleu"] == best_bleu)
    assert not (out / "best" / "trainer_state.pt").exists()


def test_patience_stops_early_and_max_steps_stops(tmp_path, corpus):
    # a learning rate too small to learn: BLEU never improves after the first epoch
    s = train_cli(tiny_args(corpus, tmp_path / "p", "--lr-factor", "1e-6", "--patience", "2", "--max-epochs", "9"))
    assert "patience" in s["stop"] and s["epoch"] == 4  # epochs 1, 2, 3 ran; 2 and 3 were no better
    s = train_cli(tiny_args(corpus, tmp_path / "m", "--max-steps", "4"))
    assert s["step"] == 4 and "max-steps" in s["stop"]
    assert [p.name for p in (tmp_path / "m").glob("step_*")] == ["step_4"]
    s = train_cli(tiny_args(corpus, tmp_path / "t", "--max-minutes", "1e-6"))
    assert s["step"] == 1 and "max-minutes" in s["stop"] and (tmp_path / "t" / "step_1" / "trainer_state.pt").is_file()


def test_a_run_stopped_by_a_limit_validates_the_model_it_stops_with(tmp_path, corpus):
    """A time or step limit met mid-epoch ends with a validation of the last model (which becomes
    best/ when it is the best), not with the score of the last epoch end: the demo translates with it."""
    for flag, value in (("--max-minutes", "1e-6"), ("--max-steps", "3")):
        out = tmp_path / flag
        s = train_cli(tiny_args(corpus, out, flag, value))
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        valid = [r for r in recs if r["kind"] == "valid"]
        assert [r["step"] for r in valid] == [s["step"]] and valid[0]["epoch"] == 1 and "bleu" in valid[0]
        assert s["best_bleu"] == valid[0]["bleu"]
        assert json.loads((out / "best" / "config.json").read_text())["step"] == s["step"]
    # a limit met at an epoch end validates once
    one_epoch = train_cli(tiny_args(corpus, tmp_path / "e", "--max-epochs", "1"))["step"]
    s = train_cli(tiny_args(corpus, tmp_path / "s", "--max-steps", str(one_epoch)))
    recs = [json.loads(x) for x in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r["kind"] == "valid"] == [one_epoch]


def test_time_running_out_in_an_epoch_end_validation_stops_there(tmp_path, corpus, monkeypatch):
    """The run stops with the model the epoch end just scored, not one unscored step later."""
    clock = {"s": 0.0}
    real_validate = T.validate

    def slow_validate(*a, **k):
        clock["s"] = 3600.0  # this validation takes the rest of the hour
        return real_validate(*a, **k)

    monkeypatch.setattr(T, "validate", slow_validate)
    monkeypatch.setattr(T.Run, "seconds", lambda self: clock["s"])
    one_epoch = train_cli(tiny_args(corpus, tmp_path / "e", "--max-epochs", "1"))["step"]
    clock["s"] = 0.0
    s = train_cli(tiny_args(corpus, tmp_path / "t", "--max-minutes", "30"))
    recs = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert s["step"] == one_epoch and "max-minutes" in s["stop"]
    assert [r["step"] for r in recs if r["kind"] == "valid"] == [one_epoch]


def test_long_pairs_are_skipped_and_counted(tmp_path, corpus, capsys):
    src = Path(corpus["train_src"])
    tgt = Path(corpus["train_tgt"])
    src.write_text(src.read_text() + " ".join(["cat"] * 300) + "\n")
    tgt.write_text(tgt.read_text() + " ".join(["katze"] * 300) + "\n")
    assert cli_main(tiny_args(corpus, tmp_path / "r", "--max-steps", "1", "--max-len", "60", "--max-tokens", "200")) == 0
    assert "120 training pairs (1 of 121 skipped as longer than 60 tokens)" in capsys.readouterr().out


def test_refuses_to_overwrite_a_run_without_resume(tmp_path, corpus, capsys):
    assert cli_main(tiny_args(corpus, tmp_path / "r", "--max-steps", "2")) == 0
    capsys.readouterr()
    assert cli_main(tiny_args(corpus, tmp_path / "r", "--max-steps", "2")) == 2
    assert "already holds checkpoints" in capsys.readouterr().err


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_new_run_never_touches_what_it_did_not_write(tmp_path, corpus, capsys):
    # a folder holding a best/ and metrics of some earlier work, but no step_<N>/ to resume from
    out = tmp_path / "r"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "2", "--save-every", "1", "--keep-last", "1")) == 0
    (out / "step_2").rename(tmp_path / "moved")
    shutil.rmtree(out / "best")  # the stop's own; a copy of the step stands for some earlier work's
    shutil.copytree(tmp_path / "moved", out / "best")
    (out / ".tmp-notes").mkdir()
    (out / ".tmp-notes" / "todo.txt").write_text("mine\n")
    before = _tree(out)
    capsys.readouterr()
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1")) == 2
    err = capsys.readouterr().err
    assert f"--out {out} is not empty" in err and "use --resume" in err and err.count("\n") == 1, err
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1", "--resume")) == 2
    err = capsys.readouterr().err
    assert f"--out {out} holds .tmp-notes, best but no step_<N>/ checkpoint" in err and err.count("\n") == 1, err
    assert _tree(out) == before
    # a resumable run: its own stale temporaries go, a user's .tmp- folder stays
    (tmp_path / "moved").rename(out / "step_2")
    (out / ".tmp-step_3-0123abcd").mkdir()
    (out / ".tmp-pruned-step_1-89abcdef").mkdir()
    assert cli_main(tiny_args(corpus, out, "--max-steps", "3", "--resume")) == 0
    assert (out / ".tmp-notes" / "todo.txt").read_text() == "mine\n"
    assert not (out / ".tmp-step_3-0123abcd").exists() and not (out / ".tmp-pruned-step_1-89abcdef").exists()


def test_resume_starts_again_a_run_killed_before_its_first_checkpoint(tmp_path, corpus, capsys):
    out = tmp_path / "r"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "2", "--log-every", "1")) == 0
    for p in [*out.glob("step_*"), out / "best"]:  # as if killed before the first save: train.json, metrics.jsonl
        shutil.rmtree(p)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "st')  # killed while writing a line
    capsys.readouterr()
    assert cli_main(tiny_args(corpus, out, "--max-steps", "2", "--log-every", "1")) == 2
    assert "use --resume" in capsys.readouterr().err
    assert cli_main(tiny_args(corpus, out, "--max-steps", "2", "--log-every", "1", "--resume")) == 0
    steps = [(r["kind"], r["step"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    assert steps == [("train", 1), ("train", 2), ("valid", 2)] and (out / "step_2").is_dir()


def test_resume_never_rewrites_metrics_or_train_json_it_did_not_write(tmp_path, corpus, capsys):
    """--resume of an --out without a checkpoint starts the run again only if what is there is
    recognisably aiayn's: a foreign metrics.jsonl or train.json is refused and left byte-identical."""
    genuine = tmp_path / "genuine"
    assert cli_main(tiny_args(corpus, genuine, "--max-steps", "1")) == 0
    out = tmp_path / "r"
    out.mkdir()
    foreign = b'{"epoch": 1, "acc": 0.9}\n{"epoch": 2, "acc": 0.95}\nnot json\n'
    (out / "metrics.jsonl").write_bytes(foreign)
    cases = [(None, "metrics.jsonl"), (b'{"lr": 0.1}\n', "train.json"),
             ((genuine / "train.json").read_bytes(), "metrics.jsonl")]  # aiayn's settings, someone else's lines
    for train_json, named in cases:
        if train_json is not None:
            (out / "train.json").write_bytes(train_json)
        capsys.readouterr()
        assert cli_main(tiny_args(corpus, out, "--max-steps", "1", "--resume")) == 2
        err = capsys.readouterr().err
        assert f"{out / named} was not written by aiayn train" in err and err.count("\n") == 1, err
        assert (out / "metrics.jsonl").read_bytes() == foreign
        assert train_json is None or (out / "train.json").read_bytes() == train_json
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "train.json"]


def _train_dying(corpus: dict[str, str], out: Path, how: str, *extra: str) -> subprocess.CompletedProcess:
    """`aiayn train` in a process that `how` ("SIGKILL", "SIGTERM") hits while it prepares its data:
    once the training arrays are written into the temporary directory, before it is renamed."""
    script = (
        "import os, signal, sys\n"
        "from aiayn.data import bindata\n"
        "close = bindata.SplitWriter.close\n"
        "def hit(self):\n"
        "    files = close(self)\n"
        f"    os.kill(os.getpid(), signal.{how})\n"
        "    return files\n"
        "bindata.SplitWriter.close = hit\n"
        "from aiayn.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    return subprocess.run([sys.executable, "-c", script, *tiny_args(corpus, out, *extra)], capture_output=True,
                          text=True, timeout=300)


def _prepare_leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith(".data."))


def test_a_run_killed_while_preparing_its_data_goes_on_with_the_same_command(tmp_path, corpus, capsys):
    """kill -9 during the preparation leaves its lock and temporary in --out: the same command starts
    the run again, --resume of a run with checkpoints goes on, both clean them up; a user's file beside
    them still makes --out "not empty" (the abandoned leftovers are removed all the same)."""
    out = tmp_path / "r"
    proc = _train_dying(corpus, out, "SIGKILL", "--max-steps", "1")
    assert proc.returncode == -9, proc.stderr
    left = _prepare_leftovers(out)
    assert left[0] == ".data.lock" and left[1].startswith(".data.prepare-") and len(left) == 2, left
    shutil.copytree(out, tmp_path / "left")  # the same leftovers, for the cases below
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1")) == 0
    assert (out / "step_1").is_dir() and not _prepare_leftovers(out)
    theirs = tmp_path / "theirs"
    shutil.copytree(tmp_path / "left", theirs)
    (theirs / "notes.txt").write_text("mine\n")
    capsys.readouterr()
    assert cli_main(tiny_args(corpus, theirs, "--max-steps", "1")) == 2
    err = capsys.readouterr().err
    assert f"--out {theirs} is not empty (it holds notes.txt)" in err and err.count("\n") == 1, err
    assert not _prepare_leftovers(theirs) and (theirs / "notes.txt").read_text() == "mine\n"  # (aiayn's, abandoned)
    for name in left:  # killed again while preparing, after its first checkpoint (say its data was deleted)
        shutil.copytree(tmp_path / "left" / name, out / name)
    assert cli_main(tiny_args(corpus, out, "--max-steps", "2", "--resume")) == 0
    assert (out / "step_2").is_dir() and not _prepare_leftovers(out)


def test_a_preparation_that_may_be_alive_on_another_machine_is_not_taken_over(tmp_path, corpus, capsys):
    out = tmp_path / "r"
    work = out / ".data.prepare-othermachine-4242-0a1b2c3d"  # its mark is fresh: it may be at work
    work.mkdir(parents=True)
    (work / ".aiayn-prepare").touch()
    for extra in ((), ("--resume",)):
        assert cli_main(tiny_args(corpus, out, "--max-steps", "1", *extra)) == 2
        err = capsys.readouterr().err
        assert f"--out {out} holds {work.name}: another aiayn process is preparing the data there" in err, err
        assert err.count("\n") == 1
        assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [work.name, f"{work.name}/.aiayn-prepare"]
    old = os.path.getmtime(work / ".aiayn-prepare") - 3600  # untouched for an hour: abandoned
    os.utime(work / ".aiayn-prepare", (old, old))
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1")) == 0
    assert not work.exists() and (out / "step_1").is_dir()


def test_sigterm_while_preparing_the_data_ends_it_and_the_same_command_goes_on(tmp_path, corpus):
    """SIGTERM during the preparation ends the process at once (a handler would wait for the C code
    it is in, SentencePiece's training or a collective, maybe for an hour); what it leaves is the
    next start's to clean up."""
    out = tmp_path / "r"
    proc = _train_dying(corpus, out, "SIGTERM", "--max-steps", "1")
    assert proc.returncode == -15, proc.stderr
    assert _prepare_leftovers(out)
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1")) == 0
    assert (out / "step_1").is_dir() and not _prepare_leftovers(out)


def test_resume_takes_renamed_data_files_of_the_same_bytes(tmp_path, corpus):
    """The data files may move or be renamed on --resume: their bytes decide, and the prepared data
    (whose manifest sha256 the checkpoint holds) stays as it is."""
    out = tmp_path / "r"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1")) == 0
    manifest = (out / "data" / "manifest.json").read_bytes()
    renamed = dict(corpus, train_src=str(tmp_path / "train.renamed.de"), valid_tgt=str(tmp_path / "dev.en"))
    for name in ("train_src", "valid_tgt"):
        shutil.copyfile(corpus[name], renamed[name])
    assert cli_main(tiny_args(renamed, out, "--max-steps", "2", "--resume")) == 0
    assert (out / "step_2").is_dir() and (out / "data" / "manifest.json").read_bytes() == manifest


def test_new_runs_feed_the_source_ending_with_eos_and_old_runs_go_on_without(tmp_path, corpus, monkeypatch):
    from aiayn.tokenizer import EOS_ID

    out = tmp_path / "r"
    train_cli(tiny_args(corpus, out, "--max-steps", "1", "--save-every", "1"))
    assert json.loads((out / "step_1" / "config.json").read_text())["model"]["source_eos"] is True
    tc = TrainConfig(**{k: v for k, v in corpus.items()}, max_tokens=160, out=str(out))
    new = T.load_corpus(tc, None, tmp_path / "x", TR.Dist(), source_eos=True)
    bare = T.load_corpus(tc, None, tmp_path / "x", TR.Dist(), source_eos=False)
    for split in ("train", "valid"):
        rows = np.arange(len(getattr(new, split)))
        s_new = getattr(new, split).collate(rows, tc.max_len, True).src.tolist()
        s_bare = getattr(bare, split).collate(rows, tc.max_len, False).src.tolist()
        for a, b in zip(s_new, s_bare):
            a, b = [t for t in a if t != 0], [t for t in b if t != 0]
            assert a == b + [EOS_ID] and EOS_ID not in b
    # a run from before the field (its checkpoint says nothing) resumes on bare sources
    cfg = json.loads((out / "step_1" / "config.json").read_text())
    del cfg["model"]["source_eos"]
    (out / "step_1" / "config.json").write_text(json.dumps(cfg))
    seen = []
    real = T.load_corpus
    monkeypatch.setattr(T, "load_corpus", lambda *a: seen.append(a[4]) or real(*a))
    train_cli(tiny_args(corpus, out, "--max-steps", "2", "--save-every", "1", "--resume"))
    assert seen == [False] and json.loads((out / "step_2" / "config.json").read_text())["model"]["source_eos"] is False


# ----------------------------------------------------------------------------- command line


def test_help_names_every_option_with_its_default(capsys):
    with pytest.raises(SystemExit):
        cli_main(["train", "--help"])
    text = capsys.readouterr().out
    for f in TrainConfig.__dataclass_fields__:
        assert "--" + f.replace("_", "-") in text, f
    for f in ModelConfig.__dataclass_fields__:
        if f not in ("src_vocab_size", "tgt_vocab_size", "pad_id"):
            assert "--" + f.replace("_", "-") in text, f
    assert "--resume" in text and "--config" in text and "--preset" in text
    flat = " ".join(text.split())
    assert "(default: 4000)" in flat and "(default: 0.1)" in flat and "(default: 256 for small" in flat


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_config_file_and_flag_overrides(tmp_path, suffix):
    f = tmp_path / f"c{suffix}"
    if suffix == ".toml":
        f.write_text('preset = "tiny"\n[model]\nd_ff = 96\n[train]\nwarmup = 77\nmax_tokens = 999\n')
    else:
        f.write_text(json.dumps({"preset": "tiny", "model": {"d_ff": 96}, "train": {"warmup": 77, "max_tokens": 999}}))
    args = build_parser("train").parse_args(["train", "--config", str(f), "--max-tokens", "555", "--dropout", "0.2"])
    name, over, tc = TO.build_configs(args)
    assert name == "tiny" and over == {"d_ff": 96, "dropout": 0.2}
    assert tc.warmup == 77 and tc.max_tokens == 555 and tc.vocab_size == 8000
    f.write_text("[train]\nwarmpu = 3\n" if suffix == ".toml" else '{"warmpu": 3}')
    with pytest.raises(Exception, match="unknown option 'warmpu'"):
        TO.build_configs(build_parser("train").parse_args(["train", "--config", str(f)]))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--warmup", "-5"], "--warmup must be a positive number of steps, got -5"),
        (["--max-tokens", "5"], "--max-tokens 5 is smaller than the longest training pair"),
        (["--update-freq", "0"], "--update-freq must be at least 1"),
        (["--label-smoothing", "1.5"], "--label-smoothing must be in [0, 1)"),
        (["--precision", "fp8"], "--precision must be one of"),
        (["--d-model", "30"], "d_model 30 is not divisible by n_heads 4"),
        (["--config", "/nonexistent/c.toml"], "--config /nonexistent/c.toml: cannot read it"),
        (["--seed", "100000000000000000000"], "--seed must fit in 64 bits"),
        (["--vocab-size", "3000000000"], "--vocab-size must be between 16 and 1,000,000"),
        (["--threads", "100000000000"], "--threads must be at most 4096"),
        (["--warmup", "1" + "0" * 400], "--warmup must be at most 10^12 steps"),
        (["--max-positions", "100000000000"], "max_positions must be at most 100,000"),
    ],
)
def test_bad_options_give_one_line_errors(tmp_path, corpus, capsys, extra, message):
    assert cli_main(tiny_args(corpus, tmp_path / "r", "--max-steps", "1", *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("text, message", [
    ('keep_last = 1.5', "--keep-last must be a whole number, got 1.5"),
    ('device = 5', "--device must be a string, got 5"),
    ('log_every = 1.5', "--log-every must be a whole number, got 1.5"),
    ('joint_vocab = "false"', "--joint-vocab must be true or false, got 'false'"),
    ('spm_model_type = 5', "--spm-model-type must be a string, got 5"),
    ('[model]\nn_heads = 4.0', "n_heads must be a whole number, got 4.0"),
])
def test_config_file_values_of_the_wrong_type(tmp_path, corpus, capsys, text, message):
    f = tmp_path / "c.toml"
    f.write_text(text + "\n")
    assert cli_main(tiny_args(corpus, tmp_path / "r", "--max-steps", "1", "--config", str(f))) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_a_config_file_with_a_bom_is_read_and_one_not_in_utf8_is_a_one_line_error(tmp_path, corpus, capsys):
    f = tmp_path / "c.toml"
    f.write_bytes("\ufeff[train]\nvocab_size = 100\n".encode())  # as Notepad saves it
    assert TO.build_configs(build_parser("train").parse_args(["train", "--config", str(f)]))[2].vocab_size == 100
    f.write_bytes(b"[train]\nvocab_size = 100\n# caf\xe9\n")  # Latin-1
    assert cli_main(tiny_args(corpus, tmp_path / "r", "--config", str(f))) == 2
    err = capsys.readouterr().err
    assert f"--config {f}: line 3 is not UTF-8" in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("extra, toml, message", [
    (["--n-heads", "3"], "", "d_model 32 is not divisible by n_heads 3"),
    ([], '[model]\nd_model = "x"', "c.toml: d_model must be a whole number, got 'x'"),
    ([], "[model]\nn_heads = 3", "c.toml: d_model 32 is not divisible by n_heads 3"),
    (["--share-embeddings", "--no-joint-vocab"], "", "--share-embeddings needs a joint vocabulary"),
    # sizes that pass the config's checks but no machine holds: an allocator traceback after preparation
    (["--d-model", "10000000000000", "--n-heads", "1"], "", "cannot build a model of these options"),
    (["--d-ff", "100000000000"], "", "more than this machine's"),
    (["--d-model", "40000000", "--n-heads", "4"], "", "more than this machine's"),  # no table computed to say so
])
def test_bad_model_options_are_refused_before_the_data_is_prepared(tmp_path, corpus, capsys, extra, toml, message):
    # preparing a large corpus takes hours: a bad option must not wait for it, nor leave data/ in --out
    f = tmp_path / "c.toml"
    f.write_text(toml + "\n")
    out = tmp_path / "r"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1", "--config", str(f), *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_a_max_tokens_found_too_small_after_preparation_says_how_to_go_on(tmp_path, corpus, capsys):
    # only the prepared lengths tell: the error names --resume, which reuses the prepared data
    out = tmp_path / "r"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1", "--max-tokens", "2")) == 2
    err = capsys.readouterr().err
    assert "--max-tokens 2 is smaller than the longest training pair" in err and "--resume" in err, err
    assert err.count("\n") == 1
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1", "--resume")) == 0
    assert "already prepared" in capsys.readouterr().out


def test_an_explicit_preset_flag_beats_the_config_file_in_either_spelling(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('preset = "base"\n')
    for flag in (["--preset", "tiny"], ["--preset=tiny"]):
        argv = ["train", "--config", str(f), *flag]
        assert TO.build_configs(build_parser("train").parse_args(argv))[0] == "tiny", flag
    assert TO.build_configs(build_parser("train").parse_args(["train", "--config", str(f)]))[0] == "base"
    assert TO.build_configs(build_parser("train").parse_args(["train"]))[0] == "small"
    f.write_text("preset = []\n")
    with pytest.raises(AiaynError, match=r"unknown preset \[\]"):
        TO.build_configs(build_parser("train").parse_args(["train", "--config", str(f)]))


def test_an_out_that_cannot_be_a_directory_is_a_one_line_error(tmp_path, corpus, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep\n")
    for out in (afile, afile / "sub"):
        assert cli_main(tiny_args(corpus, out, "--max-steps", "1")) == 2
        err = capsys.readouterr().err
        assert f"--out {out}: cannot make the run directory" in err and err.count("\n") == 1, err
    assert afile.read_text() == "keep\n"


def test_resume_refuses_options_that_change_the_batches(tmp_path, corpus, capsys):
    out = tmp_path / "r"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1")) == 0
    capsys.readouterr()
    for flag, value, words in (("--seed", "2", "--seed 2 differs from the run's 1"),
                               ("--max-tokens", "200", "--max-tokens 200 differs from the run's 160")):
        assert cli_main(tiny_args(corpus, out, "--max-steps", "2", "--resume", flag, value)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
    assert cli_main(tiny_args(corpus, out, "--max-steps", "2", "--resume", "--patience", "3")) == 0  # others may change


def test_resume_continues_the_run_with_its_saved_settings(tmp_path, corpus, capsys):
    extra = ("--dropout", "0.1", "--label-smoothing", "0.2", "--log-every", "1", "--save-every", "1")
    ref, out = tmp_path / "ref", tmp_path / "r"
    assert cli_main(tiny_args(corpus, ref, "--max-steps", "4", *extra)) == 0
    assert cli_main(tiny_args(corpus, out, "--max-steps", "2", *extra)) == 0
    before = (out / "train.json").read_text()
    capsys.readouterr()
    # an option that would change the run: one line naming it, nothing written
    for flag, value in (("--dropout", "0.3"), ("--warmup", "20"), ("--precision", "auto"), ("--lr-factor", "1.0"),
                        ("--preset", "small"), ("--label-smoothing", "0.1")):
        assert cli_main(["train", "--out", str(out), "--resume", "--max-steps", "4", flag, value]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{flag} {value} differs from the run's" in err, err
    assert (out / "train.json").read_text() == before and not (out / "step_3").exists()
    # no data, recipe or model flags: the run's own settings continue it, as if never stopped
    assert cli_main(["train", "--out", str(out), "--resume", "--max-steps", "4"]) == 0
    a, b = weights(ref, 4), weights(out, 4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # train.json says what the checkpoint holds
    run = json.loads((out / "train.json").read_text())
    held = json.loads((out / "step_4" / "config.json").read_text())
    assert run["train"] == held["train"] and run["preset"] == held["preset"] == "tiny"
    assert run["model"] == {k: v for k, v in held["model"].items() if k not in TO.MODEL_FROM_DATA}
    assert run["model"]["dropout"] == 0.1 and run["train"]["warmup"] == 10 and run["train"]["max_steps"] == 4


@pytest.mark.parametrize("source_eos", [True, False])
def test_validation_bleu_feeds_the_source_as_the_model_was_trained(tmp_path, corpus, monkeypatch, source_eos):
    """Greedy validation BLEU reads each source as training, translate and export do: ending with
    EOS for a model with `source_eos`, bare for one trained before the field."""
    import contextlib

    import aiayn.search
    from aiayn.tokenizer import EOS_ID, PAD_ID

    tc = TrainConfig(**corpus, vocab_size=300, max_tokens=160, valid_bleu=8, out=str(tmp_path / "r"))
    data = T.load_corpus(tc, None, tmp_path / "r", TR.Dist(), source_eos)
    tok = data.tokenizers
    model = Transformer(preset("tiny", src_vocab_size=tok.src.vocab_size, tgt_vocab_size=tok.tgt.vocab_size,
                               source_eos=source_eos))
    fed = []
    real = aiayn.search.greedy_search
    monkeypatch.setattr(aiayn.search, "greedy_search", lambda m, src, *a, **k: fed.append(src) or real(m, src, *a, **k))
    TR.validate(model, data, tc, contextlib.nullcontext, torch.device("cpu"))
    rows = [[t for t in row if t != PAD_ID] for src in fed for row in src.tolist()]
    want = sorted(ids + ([EOS_ID] if source_eos else []) for ids in tok.src.encode_batch(data.valid_src[:8]))
    assert sorted(rows) == want


def test_resume_keeps_the_precision_that_auto_chose(tmp_path, corpus, monkeypatch, capsys):
    """`--precision auto` is resolved when a process starts; a resumed run goes on in the precision
    the run trained in (resumed on a CPU without bf16 kernels, or by a version whose `auto` chooses
    otherwise), not in whatever `auto` would pick now. A checkpoint from before the choice was kept
    was trained by the rule of its time: bf16 autocast on every CPU."""
    import aiayn.kernels

    def auto(out: Path, *extra: str) -> list[str]:
        return ["auto" if a == "fp32" else a for a in tiny_args(corpus, out, *extra)]  # --precision auto

    out = tmp_path / "r"
    monkeypatch.setattr(aiayn.kernels, "cpu_has_fast_bf16", lambda: True)
    assert cli_main(auto(out, "--max-steps", "1", "--save-every", "1")) == 0
    assert torch.load(out / "step_1" / "trainer_state.pt", weights_only=True)["precision"] == "bf16"
    used = []
    real = TR.Trainer.__init__
    monkeypatch.setattr(TR.Trainer, "__init__", lambda self, *a: real(self, *a) or used.append(self.precision))
    monkeypatch.setattr(aiayn.kernels, "cpu_has_fast_bf16", lambda: False)  # another machine
    capsys.readouterr()
    assert cli_main(["train", "--out", str(out), "--resume", "--max-steps", "2"]) == 0
    assert used == ["bf16"]
    logged = capsys.readouterr()
    assert "slow fallback code (oneDNN has bf16 kernels only" in logged.out + logged.err  # and what to do:
    assert "fp32 trains faster here (start a run with --precision fp32" in logged.out + logged.err
    state = torch.load(out / "step_2" / "trainer_state.pt", weights_only=True)
    del state["precision"], state["data_sha256"]  # as an older version wrote it
    torch.save(state, out / "step_2" / "trainer_state.pt")
    assert cli_main(["train", "--out", str(out), "--resume", "--max-steps", "3"]) == 0
    assert used == ["bf16", "bf16"]
    state = torch.load(out / "step_3" / "trainer_state.pt", weights_only=True)
    del state["precision"]  # as the release that brought data digests and today's `auto` wrote it
    torch.save(state, out / "step_3" / "trainer_state.pt")
    capsys.readouterr()
    assert cli_main(["train", "--out", str(out), "--resume", "--max-steps", "4"]) == 0
    assert used == ["bf16", "bf16", "fp32"]
    logged = capsys.readouterr()
    assert "slow fallback code" not in logged.out + logged.err  # fp32 on that CPU: nothing to say
    state = torch.load(out / "step_4" / "trainer_state.pt", weights_only=True)
    state["precision"] = "fp16"  # as a run on CUDA, now resumed with --device cpu
    torch.save(state, out / "step_4" / "trainer_state.pt")
    assert cli_main(["train", "--out", str(out), "--resume", "--max-steps", "5"]) == 0
    assert used == ["bf16", "bf16", "fp32", "fp32"]
    assert cli_main(auto(tmp_path / "new", "--max-steps", "1")) == 0
    assert used[-1] == "fp32"  # a new run: auto decides for this machine


def test_resume_without_device_continues_on_the_runs_device(tmp_path, corpus, monkeypatch):
    """`--device` may be given anew on resume; left out, the run goes on where it ran (a run started
    with --device cpu on a machine with a GPU must not move to the GPU, and to another precision)."""
    out = tmp_path / "r"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1", "--save-every", "1", "--device", "cpu")) == 0
    asked = []
    real = T.setup_distributed
    monkeypatch.setattr(T, "setup_distributed", lambda pref: asked.append(pref) or real("cpu"))
    assert cli_main(["train", "--out", str(out), "--resume", "--max-steps", "2"]) == 0
    assert asked == ["cpu"]
    assert json.loads((out / "train.json").read_text())["train"]["device"] == "cpu"
    assert cli_main(["train", "--out", str(out), "--resume", "--max-steps", "3", "--device", "auto"]) == 0
    assert asked == ["cpu", "auto"]  # given anew: taken


@pytest.mark.parametrize("changed", ["train_src", "valid_tgt"])
def test_resume_refuses_changed_data(tmp_path, corpus, capsys, changed):
    out = tmp_path / "r"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "2", "--save-every", "1")) == 0
    state = torch.load(out / "step_2" / "trainer_state.pt", weights_only=True)
    assert state["data_sha256"] == open_prepared(out / "data").digest  # the manifest's
    f = Path(corpus[changed])
    lines = f.read_text().splitlines()
    f.write_text("\n".join(lines[1:] + lines[:1]) + "\n")  # the same lines in another order
    capsys.readouterr()
    assert cli_main(tiny_args(corpus, out, "--max-steps", "3", "--resume")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{f} is not what {out / 'data'} was prepared from" in err, err
    assert not (out / "step_3").exists()
    f.write_text("\n".join(lines) + "\n")  # back as it was: the run continues
    assert cli_main(tiny_args(corpus, out, "--max-steps", "3", "--resume")) == 0


def test_resume_skips_a_trainer_state_that_lacks_a_field(tmp_path, corpus, capsys):
    out = tmp_path / "r"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "2", "--save-every", "1")) == 0
    f = out / "step_2" / "trainer_state.pt"
    state = torch.load(f, weights_only=True)
    del state["tokens_seen"]
    torch.save(state, f)
    capsys.readouterr()
    assert cli_main(tiny_args(corpus, out, "--max-steps", "3", "--save-every", "1", "--resume")) == 0
    printed = capsys.readouterr().out
    assert "lacks tokens_seen" in printed and f"resuming from {out / 'step_1'}" in printed


def test_bad_data_options(tmp_path, corpus, capsys, monkeypatch):
    monkeypatch.setenv("AIAYN_DATA", str(tmp_path / "nodata"))
    cases = [
        (["train", "--data", "multi30k", "--src", "de", "--tgt", "xx"], "not a Multi30k language pair"),
        (["train", "--data", "multi30k", "--src", "de", "--tgt", "de"], "not a Multi30k language pair"),
        (["train", "--data", "wmt14"], "--data 'wmt14' is not a known corpus"),
        (["train", "--train-src", corpus["train_src"], "--train-tgt", str(tmp_path / "missing.de")],
         "--train-tgt " + str(tmp_path / "missing.de") + ": no such file"),
        (["train", "--out", str(tmp_path / "r")], "no training data"),
    ]
    for argv, message in cases:
        assert cli_main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)


def test_resume_skips_an_unreadable_newest_checkpoint(tmp_path, corpus, capsys):
    out = tmp_path / "r"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "3", "--save-every", "1")) == 0
    w = out / "step_3" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])  # bit rot after the run
    capsys.readouterr()
    assert cli_main(tiny_args(corpus, out, "--max-steps", "4", "--save-every", "1", "--resume")) == 0
    printed = capsys.readouterr().out
    assert f"warning: cannot resume from {out / 'step_3'}" in printed and f"resuming from {out / 'step_2'}" in printed
    assert (out / "step_4" / "config.json").is_file()
    for p in out.glob("step_*"):  # all unreadable: one clear error
        (p / "model.safetensors").write_bytes(b"")
    assert cli_main(tiny_args(corpus, out, "--max-steps", "9", "--resume")) == 2
    assert "corrupt or truncated" in capsys.readouterr().err


def test_pruning_after_resuming_past_an_unreadable_checkpoint_keeps_the_new_one(tmp_path, corpus, capsys):
    """Resumed from step_2 past an unreadable step_5, the run's new step_3 is the one --keep-last 1
    keeps (step_5 waits to be replaced when the run gets there), not deleted for the bad one."""
    out = tmp_path / "r"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "5", "--save-every", "1")) == 0
    shutil.rmtree(out / "step_3")
    shutil.rmtree(out / "step_4")
    (out / "step_5" / "model.safetensors").write_bytes(b"")
    assert cli_main(tiny_args(corpus, out, "--max-steps", "3", "--save-every", "1", "--keep-last", "1", "--resume")) == 0
    assert f"resuming from {out / 'step_2'}" in capsys.readouterr().out
    assert [n for n, _ in ckpt.step_checkpoints(out)] == [3, 5]
    assert ckpt.load_checkpoint(out / "step_3", with_trainer_state=True).config["step"] == 3


def test_resuming_a_finished_run_takes_no_further_step(tmp_path, corpus):
    # A run killed after its last checkpoint (or simply re-run with --resume) must not train, save or
    # log a step past its limit: this once made the SIGKILL resume test log a step 37 of 36.
    out = tmp_path / "r"
    args = tiny_args(corpus, out, "--max-steps", "3", "--save-every", "1", "--log-every", "1")
    train_cli(args)
    before = (out / "metrics.jsonl").read_text()
    s = train_cli(args + ["--resume"])
    assert s["step"] == 3 and s["stop"] == "reached --max-steps 3" and s["checkpoint"] == str(out / "step_3")
    assert sorted(p.name for p in out.glob("step_*")) == ["step_1", "step_2", "step_3"]
    assert (out / "metrics.jsonl").read_text() == before
    # the same for --patience and --max-minutes limits that the checkpoint already meets
    p = tmp_path / "p"
    s = train_cli(tiny_args(corpus, p, "--lr-factor", "1e-6", "--patience", "1", "--max-epochs", "9"))
    assert "patience" in s["stop"]
    step = s["step"]
    s = train_cli(tiny_args(corpus, p, "--lr-factor", "1e-6", "--patience", "1", "--max-epochs", "9", "--resume"))
    assert "patience" in s["stop"] and s["step"] == step
    m = tmp_path / "m"
    train_cli(tiny_args(corpus, m, "--max-minutes", "1e-6"))
    s = train_cli(tiny_args(corpus, m, "--max-minutes", "1e-6", "--resume"))
    assert s["step"] == 1 and "max-minutes" in s["stop"]
