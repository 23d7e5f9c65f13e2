"""bench/train_step.py runs end to end (`--quick`: tiny shapes) and reports its ratios; not timed."""

import re

import pytest
import torch

import benches


def load_bench():
    return benches.load("train_step.py")


def test_quick_run_prints_ratio_lines(capsys):
    bench = load_bench()
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--quick", "--no-compile", "--threads", "1", "--precisions", "fp32,bf16"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert re.search(r"peak matmul .* fp32 [\d.]+ GFLOP/s, bf16 [\d.]+ GFLOP/s", out)
    for prec in ("fp32", "bf16"):
        assert re.search(rf"^ratio tiny {prec}: aiayn / nn.Transformer \(eager\) = \d+\.\d\d$", out, re.M)
        assert re.search(rf"^\| tiny \| {prec} \| \d+ \| \d+ \(eager\) \| \d+\.\d\dx \| [\d.]+% \| [\d.]+% \|$", out, re.M)


def test_default_skips_bf16_where_the_cpu_has_no_bf16_kernels(capsys, monkeypatch):
    bench = load_bench()
    monkeypatch.setattr(bench, "cpu_has_fast_bf16", lambda: False)  # an AVX2-only CPU: bf16 is 100x slower
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--quick", "--no-compile", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "timing fp32 only" in out
    assert re.search(r"^ratio tiny fp32: ", out, re.M) and not re.search(r"^(ratio|\|) tiny \|? ?bf16", out, re.M)
    assert not re.search(r"peak matmul.*bf16", out)


def test_batches_are_padded_sentences_with_shared_layout():
    bench = load_bench()
    batches = bench.make_batches(3, 16, 100, 10.0, 40, seed=1)
    again = bench.make_batches(3, 16, 100, 10.0, 40, seed=1)
    for b, c in zip(batches, again):
        assert torch.equal(b.src, c.src) and torch.equal(b.tgt_out, c.tgt_out)  # same batches every run
        assert b.src.ne(0).sum(1).tolist() == b.src_lens
        assert b.tgt_out.ne(0).sum(1).tolist() == b.tgt_lens
        assert (b.tgt_in[:, 0] == bench.BOS).all()
        assert torch.equal(b.tgt_in[:, 1:].ne(0), b.tgt_out[:, :-1].ne(0) & b.tgt_out[:, :-1].ne(bench.EOS))
        assert len(set(b.src_lens)) > 1  # variable lengths, so there is padding


def test_step_flops_counts_the_projection():
    bench = load_bench()
    from aiayn.config import preset

    b = bench.make_batches(1, 4, 100, 8.0, 20, seed=0)[0]
    small, big_vocab = preset("tiny", src_vocab_size=100, tgt_vocab_size=100), preset(
        "tiny", src_vocab_size=1100, tgt_vocab_size=1100)
    extra = bench.step_flops(big_vocab, b) - bench.step_flops(small, b)
    assert extra == 3 * 2 * sum(b.tgt_lens) * small.d_model * 1000


def test_profile_lists_the_costliest_ops_per_step(capsys):
    bench = load_bench()
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--quick", "--no-compile", "--threads", "1", "--precisions", "fp32", "--profile", "20"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    rows = re.findall(r"^\| `([^`]+)` \| ([\d.]+) \| ([\d.]+)% \|$", out, re.M)
    assert len(rows) == 20  # the top 20, one profile for the one shape and precision
    ms = [float(r[1]) for r in rows]
    assert ms == sorted(ms, reverse=True) and ms[0] > 0  # costliest first
    assert {"aten::mm", "aten::addmm"} & {name for name, _, _ in rows}  # the GEMMs are there
    assert re.search(r"^\| total \| [\d.]+ \| \|$", out, re.M)


def test_one_peer_for_both_training_benches_computing_aiayns_loss():
    """bench/peer.py is the peer of this bench and of bench/gpu_train.py; without dropout its loss is aiayn's."""
    bench = load_bench()
    from aiayn.config import preset

    cfg = preset("tiny", src_vocab_size=100, tgt_vocab_size=100)  # dropout 0
    b = bench.make_batches(1, 4, 100, 8.0, 20, seed=0)[0]
    ours, peer = (bench.Contender(kind, cfg, kind, False, 0) for kind in ("aiayn", "eager"))
    assert isinstance(peer.module, bench.PeerLoss)
    with torch.no_grad():
        assert float(ours.loss_fn(b)) == pytest.approx(float(peer.loss_fn(b)), rel=1e-5)
    gpu = benches.load("gpu_train.py")
    assert gpu.PeerLoss is bench.PeerLoss and gpu.peak_matmul_flops is bench.peak_matmul_flops


@pytest.mark.parametrize("flags", [["--steps", "0"], ["--rounds", "0"], ["--batch", "0"], ["--mean-len", "0"],
                                   ["--vocab", "3"], ["--sizes", "bogus"], ["--sizes", "tiny,"]])
def test_a_bad_value_is_a_one_line_usage_error(flags, capsys):
    """Not a ZeroDivisionError in the table or an empty batch's traceback after the peak is measured."""
    with pytest.raises(SystemExit) as e:
        load_bench().main(["--sizes", "tiny", "--precisions", "fp32", "--no-compile", *flags])
    assert e.value.code == 2
    assert flags[0] in capsys.readouterr().err


def test_a_mean_length_under_one_still_makes_sentences(capsys):
    threads = torch.get_num_threads()
    try:
        assert load_bench().main(["--sizes", "tiny", "--precisions", "fp32", "--no-compile", "--threads", "1",
                                  "--vocab", "50", "--batch", "2", "--mean-len", "0.5", "--steps", "1",
                                  "--rounds", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert "ratio tiny fp32" in capsys.readouterr().out
