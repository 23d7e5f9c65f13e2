"""bench/gpu_train.py: runs on the CPU with tiny shapes, writes its tables, grades the targets; not timed."""

import json
import math
import re

import pytest
import torch

import benches

from aiayn.kernels import LossPacking


def load_bench():
    return benches.load("gpu_train.py")


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_quick_cpu_run_writes_the_table_and_json(tmp_path, capsys, one_thread):
    bench = load_bench()
    assert bench.main(["--device", "cpu", "--quick", "--compile", "none", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "gpu_train.md").read_text()
    data = json.loads((tmp_path / "gpu_train.json").read_text())
    assert data["done"] and "partial" not in md
    assert re.search(r"bf16 matmul peak \(256\^3, measured in this run\): [\d.e+-]+ TFLOP/s", md)
    for tokens in ("400", "150"):
        for name in ("aiayn", "nn.Transformer"):
            assert re.search(rf"^\| tiny \| {tokens} \| {re.escape(name)} \| 1 \| [\d.]+ \| [\d,]+ \| [\d.e+-]+ "
                             rf"\| [\d.]+% \| \d+\.\d\dx \| - \| \d+ \|$", md, re.M), (tokens, name, md)
    rows = data["rows"]
    assert len(rows) == 4 and all(r["tok_s"] > 0 and r["micro"] == 1 for r in rows)
    assert capsys.readouterr().out.count("\n| tiny |") == 4  # the table is printed too


def test_profile_writes_where_the_steps_time_goes(tmp_path, one_thread):
    bench = load_bench()
    assert bench.main(["--device", "cpu", "--quick", "--profile", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "gpu_profile.md").read_text()
    assert md.startswith("# Profile: aiayn's training step\n\nCPU, torch")
    assert re.search(r"^## aiayn tiny, 400 tokens/step, bf16, eager, 2 steps \(warm-up \d+ s\)$", md, re.M)
    line = r"^- wall [\d.]+ ms a step profiled, [\d.]+ without the profiler \(no GPU kernels seen\)$"
    assert re.search(line, md, re.M)
    assert "aten::mm" in md and "Self CPU" in md  # the profiler's operator table
    assert not (tmp_path / "gpu_train.md").exists()  # a profile only, no throughput table


def test_profile_of_the_compiled_step_compiles_the_layers_as_aiayn_train_does(tmp_path, one_thread, monkeypatch):
    """`--profile --compile aiayn` profiles the step of `aiayn train --compile` (here the compilation
    itself is skipped: it would take ~40 s of the CPU; that it is asked for is what is checked)."""
    from aiayn import trainer

    compiled = []
    monkeypatch.setattr(trainer, "compile_layers", compiled.append)
    bench = load_bench()
    assert bench.main(["--device", "cpu", "--quick", "--profile", "--compile", "aiayn", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "gpu_profile.md").read_text()
    assert len(compiled) == 1
    assert re.search(r"^## aiayn\+compile tiny, 400 tokens/step, bf16, compiled, 2 steps \(warm-up \d+ s\)$", md, re.M)


def test_gpu_work_counts_kernels_and_copies_apart_and_not_annotations():
    from types import SimpleNamespace as E

    from torch.profiler import DeviceType

    profiling = benches.load("profiling.py")
    events = [E(name="sm90_gemm", device_type=DeviceType.CUDA, is_user_annotation=False),
              E(name="Memcpy HtoD (Pinned -> Device)", device_type=DeviceType.CUDA, is_user_annotation=False),
              E(name="Optimizer.step#Adam.step", device_type=DeviceType.CUDA, is_user_annotation=True),
              E(name="aten::mm", device_type=DeviceType.CPU, is_user_annotation=False)]
    kernels, moves = profiling.gpu_work(E(events=lambda: events))
    assert [e.name for e in kernels] == ["sm90_gemm"] and [e.name for e in moves] == ["Memcpy HtoD (Pinned -> Device)"]


def test_budget_skips_contenders_and_still_writes(tmp_path, one_thread):
    bench = load_bench()
    assert bench.main(["--device", "cpu", "--quick", "--compile", "none", "--budget-s", "1e-9",
                       "--out", str(tmp_path)]) == 0
    md = (tmp_path / "gpu_train.md").read_text()
    assert md.count("skipped: --budget-s spent") == 4


def test_a_failing_contender_keeps_the_others_and_fails_the_run(tmp_path, monkeypatch, one_thread):
    bench = load_bench()
    made = bench.make_contender

    def make(name, *a):
        if name == "nn.Transformer":
            raise RuntimeError("no kernel image is available\nsecond line")
        return made(name, *a)

    monkeypatch.setattr(bench, "make_contender", make)
    assert bench.main(["--device", "cpu", "--quick", "--compile", "none", "--out", str(tmp_path)]) == 1
    md = (tmp_path / "gpu_train.md").read_text()
    assert md.count("failed: RuntimeError: no kernel image is available |") == 2  # one line, both step sizes
    assert len(re.findall(r"^\| tiny \| \d+ \| aiayn \| 1 \|", md, re.M)) == 2
    assert {line.count("|") for line in md.splitlines() if line.startswith("|")} == {12}  # 11 columns each row


def test_out_of_memory_doubles_the_micro_batches():
    bench = load_bench()

    class Tight(bench.Contender):
        def __init__(self):
            super().__init__("tight", torch.device("cpu"))
            self.opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
            self.sizes = []

        def step(self, batches):
            self.sizes.append(len(batches))
            if len(batches) < 4:
                raise torch.OutOfMemoryError("CUDA out of memory")
            return 0.0

    c = Tight()
    step = bench.make_step(300, 10, 100, seed=0)
    bench.warm(c, [step])
    assert c.micro == 4 and c.sizes == [1, 2, 4]


def test_a_contender_failing_in_the_timed_rounds_keeps_the_others(tmp_path, monkeypatch, one_thread):
    """Warm-up fits, a timed round raises (out of memory at the most micro-batches, a compiled model
    failing on a new shape): its rows say why, the other rows are measured, the run fails."""
    bench = load_bench()
    made = bench.make_contender

    def make(name, *a):
        c = made(name, *a)
        if name == "nn.Transformer":
            warmed = c.run

            def run(steps):
                if len(steps) > 1:  # --quick: 1 warm-up step, 2 timed
                    raise RuntimeError("CUDA error: an illegal memory access\nsecond line")
                return warmed(steps)

            c.run = run
        return c

    monkeypatch.setattr(bench, "make_contender", make)
    assert bench.main(["--device", "cpu", "--quick", "--compile", "none", "--out", str(tmp_path)]) == 1
    md = (tmp_path / "gpu_train.md").read_text()
    assert md.count("failed: RuntimeError: CUDA error: an illegal memory access |") == 2
    assert len(re.findall(r"^\| tiny \| \d+ \| aiayn \| 1 \| [\d.]+ \|", md, re.M)) == 2
    assert {line.count("|") for line in md.splitlines() if line.startswith("|")} == {12}


def tight(bench, need, times=None):
    """A contender that runs out of memory below `need(steps)` micro-batches; its rounds take `times`."""
    class Tight(bench.Contender):
        def __init__(self):
            super().__init__("tight", torch.device("cpu"))
            self.opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
            self.events = []

        def run(self, steps):
            self.events.append(self.micro)
            if self.micro < need(steps):
                raise torch.OutOfMemoryError("CUDA out of memory")
            return times.pop(0) if times else 1.0

    return Tight()


def test_the_peak_memory_count_restarts_after_each_out_of_memory(monkeypatch):
    bench = load_bench()
    c = tight(bench, lambda steps: 4)
    monkeypatch.setattr(bench, "reset_peak", lambda device: c.events.append("reset"))
    bench.fitting(c, [bench.make_step(300, 10, 100, seed=0)])
    assert c.events == ["reset", 1, "reset", 2, "reset", 4]  # the peak read after is the attempt that fitted


def test_the_row_reports_the_micro_batches_of_its_best_round():
    bench = load_bench()
    c = tight(bench, lambda steps: 1 if len(c.events) < 2 else 2, times=[1.0, 3.0])  # round 2 needs 2: slower
    row = bench.Row("tiny", 300, "tight")
    cfg = bench.preset("tiny", src_vocab_size=100, tgt_vocab_size=100)
    bench.time_rounds([(c, row)], [bench.make_step(300, 10, 100, seed=0)], 2, torch.device("cpu"), cfg)
    assert c.events == [1, 1, 2] and c.micro == 2
    assert row.micro == 1 and row.step_ms == pytest.approx(1e3)  # round 1's time, and round 1's split


def test_each_step_size_starts_from_the_asked_micro_batches(monkeypatch, one_thread):
    """A split that the 25k step needed is not kept for the 8k step (it would be slower there)."""
    bench = load_bench()
    c = tight(bench, lambda steps: 2 if steps[0].tokens >= 400 else 1)
    monkeypatch.setattr(bench, "make_contender", lambda *a: c)
    args = bench.parse(["--device", "cpu", "--quick", "--compile", "none"])
    all_steps = {t: bench.make_steps(t, args) for t in (400, 150)}
    rows = {("tiny", t, "tight"): bench.Row("tiny", t, "tight") for t in (400, 150)}
    bench.measure(["tight"], "tiny", args, torch.device("cpu"), all_steps, rows, lambda: None, lambda: False)
    assert rows["tiny", 400, "tight"].micro == 2 and rows["tiny", 150, "tight"].micro == 1


def test_steps_hold_the_tokens_in_micro_batches():
    bench = load_bench()
    step = bench.make_step(1000, 20, 100, seed=3)
    assert step.tokens >= 1000 and step.tokens - max(step.tgt_lens) < 1000  # stops once there
    assert step.src_lens == sorted(step.src_lens) and all(18 <= s <= 24 for s in step.src_lens)  # one length bucket
    for micro in (1, 3):
        batches = step.batches(micro, torch.device("cpu"))
        assert len(batches) == micro
        assert sum(b.n_tgt_tokens for b in batches) == step.tokens
        for b in batches:
            real = b.tgt_out.ne(bench.PAD)
            assert int(real.sum()) == b.n_tgt_tokens
            assert (b.tgt_in[:, 0] == bench.BOS).all()
            assert torch.equal(b.tgt_in.ne(bench.PAD), real)  # BOS + words beside words + EOS
            ends = real.sum(1) - 1
            assert (b.tgt_out.gather(1, ends[:, None]) == bench.EOS).all()
            assert (b.src.ne(bench.PAD).sum(1) >= 18).all()
    sizes = [b.n_tgt_tokens for b in step.batches(3, torch.device("cpu"))]
    assert max(sizes) - min(sizes) < 0.2 * step.tokens  # about equal parts


def test_every_timed_batch_carries_its_loss_packing(tmp_path, monkeypatch, one_thread):
    """As collate does for `aiayn train`: the real tokens are found on the host (`Batch.of`), not by
    `Transformer.loss` on the device (a nonzero and a bool read, each a wait for the GPU)."""
    bench = load_bench()
    seen = []
    for kind in (bench.Aiayn, bench.Peer):
        step = kind.step

        def spy(self, batches, step=step):
            seen.extend(batches)
            return step(self, batches)

        monkeypatch.setattr(kind, "step", spy)
    assert bench.main(["--device", "cpu", "--quick", "--compile", "none", "--out", str(tmp_path)]) == 0
    assert seen and all(b.packing is not None for b in seen)
    b = seen[-1]
    want = LossPacking.of(b.src, b.tgt_in, b.tgt_out, bench.PAD)
    assert torch.equal(b.packing.src.idx, want.src.idx) and torch.equal(b.packing.tgt.idx, want.tgt.idx)


def test_bucket_lengths_spread_over_the_distribution():
    bench = load_bench()
    lengths = bench.bucket_lengths(8)
    assert lengths == sorted(lengths) and len(set(lengths)) == 8
    assert 10 < lengths[0] < 24 < lengths[-1] < 120  # short to long, token-weighted around 24+


def test_peer_loss_is_aiayns_loss(one_thread):
    """The peer computes the same loss over the same batch (no dropout, fp32): the same work."""
    bench = load_bench()
    cfg = bench.preset("tiny", src_vocab_size=300, tgt_vocab_size=300, dropout=0.0)
    batches = bench.make_step(120, 9, 300, seed=1).batches(2, torch.device("cpu"))
    ours = bench.make_contender("aiayn", cfg, torch.device("cpu"), "fp32", 0).step(batches)
    theirs = bench.make_contender("nn.Transformer", cfg, torch.device("cpu"), "fp32", 0).step(batches)
    assert ours == pytest.approx(theirs, rel=1e-5) and ours > 0


def row(bench, size, name, tok_s, tflops):
    return bench.Row(size, 25_000, name, micro=1, step_ms=25_000 / tok_s * 1e3, tok_s=tok_s, tflops=tflops)


def test_verdicts_grade_the_issues_targets():
    bench = load_bench()
    peak = 800e12
    rows = [row(bench, "base", "aiayn", 700_000.0, 330.0), row(bench, "base", "nn.Transformer", 400_000.0, 190.0),
            row(bench, "base", "nn.Transformer+compile", 600_000.0, 280.0),
            row(bench, "big", "aiayn", 200_000.0, 300.0), row(bench, "big", "nn.Transformer+compile", 180_000.0, 270.0),
            bench.Row("big", 25_000, "aiayn+compile", note="skipped: --budget-s spent")]
    lines = bench.verdicts(rows, peak)
    assert "target base 25k: aiayn at 41.2% of the bf16 peak, needs 40%: ratio 1.03 (met)" in lines
    # the faster peer is the compiled one: 700k / 600k
    assert "target base 25k: aiayn / nn.Transformer+compile = 1.17x, needs 1.3x: ratio 0.90 (NOT met)" in lines
    hours = 100_000 * 25_000 / 700_000 / 3600
    assert (f"projection base: the paper's 100k steps at 25k tokens: {hours:.2f} h on this card, "
            f"needs <= 1 h: ratio {1 / hours:.2f} (met)") in lines
    assert "target big 25k: aiayn at 37.5% of the bf16 peak, needs 50%: ratio 0.75 (NOT met)" in lines
    big_hours = 300_000 * 25_000 / 200_000 / 3600
    assert f"projection big: the paper's 300k steps at 25k tokens: {big_hours:.2f} h on this card" in lines
    assert math.isclose(big_hours, 10.42, abs_tol=0.01)
    assert bench.verdicts([r for r in rows if r.size == "big"], peak)[0].startswith("target big")  # base missing: no base lines


def test_warm_up_starts_with_the_longest_step_and_the_eager_pair_runs_first():
    bench = load_bench()
    args = bench.parse(["--steps", "5", "--warmup", "3", "--vocab", "100"])
    warmup, timed = bench.make_steps(200, args)
    lengths = [max(s.src_lens) for s in timed]
    assert lengths == sorted(lengths) and len(timed) == 5
    assert [max(s.src_lens) for s in warmup] == [lengths[4], lengths[0], lengths[1]]  # the hungriest first
    assert all(any(w is t for t in timed) for w in warmup)  # the shapes the timed rounds will see
    assert bench.phases("all") == [["aiayn", "nn.Transformer"], ["aiayn+compile"], ["nn.Transformer+compile"]]
    assert bench.phases("none") == [["aiayn", "nn.Transformer"]]


@pytest.mark.parametrize("flags", [["--tokens", "abc"], ["--tokens", "0"], ["--sizes", "bogus"], ["--steps", "0"],
                                   ["--rounds", "0"], ["--micro", "0"], ["--vocab", "3"], ["--device", "bogus"]])
def test_a_bad_value_is_a_one_line_usage_error(flags, capsys):
    """Not a ValueError, ConfigError or IndexError traceback after the peak was measured."""
    with pytest.raises(SystemExit) as e:
        load_bench().parse(["--device", "cpu", "--compile", "none", *flags])
    assert e.value.code == 2
    assert flags[0] in capsys.readouterr().err


def test_an_fp32_run_reports_shares_of_the_fp32_peak(tmp_path, one_thread):
    bench = load_bench()
    bench.main(["--device", "cpu", "--quick", "--compile", "none", "--precision", "fp32", "--out", str(tmp_path)])
    md = (tmp_path / "gpu_train.md").read_text()
    assert "fp32 matmul peak" in md and "| % of fp32 peak |" in md and "bf16" not in md
    row = bench.Row("base", 25_000, "aiayn", micro=1, step_ms=1.0, tok_s=1.0, tflops=1.0)
    assert "of the fp32 peak" in bench.verdicts([row], 1e12, "fp32")[0]
