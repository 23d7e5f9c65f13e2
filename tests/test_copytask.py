"""The copy task: a tiny model learns to copy and to reverse strings to 100% greedy exact match."""

import pytest
import torch

from aiayn.copytask import BOS, EOS, PAD, make_batch, train_copy


def test_make_batch_layout():
    gen = torch.Generator().manual_seed(3)
    for reverse in (False, True):
        src, tgt_in, tgt_out = make_batch(gen, 16, 13, 6, reverse)
        assert src.shape == (16, 6) and tgt_in.shape == tgt_out.shape == (16, 7)
        for s, ti, to in zip(src.tolist(), tgt_in.tolist(), tgt_out.tolist()):
            seq = [t for t in s if t != PAD]
            want = seq[::-1] if reverse else seq
            n = len(seq)
            assert 1 <= n <= 6 and s[n:] == [PAD] * (6 - n)  # right-padded
            assert ti == [BOS] + want + [PAD] * (6 - n)
            assert to == want + [EOS] + [PAD] * (6 - n)
            assert all(3 <= t < 13 for t in seq)


@pytest.mark.parametrize("reverse", [False, True], ids=["copy", "reversed-copy"])
def test_tiny_model_learns_the_task_perfectly(reverse):
    threads = torch.get_num_threads()
    model, accuracy = train_copy(reverse=reverse, seed=0)
    assert accuracy == 1.0  # greedy exact match on 200 strings it never saw
    assert not model.training
    assert torch.get_num_threads() == threads  # the one-thread setting does not leak


@pytest.mark.parametrize("argv, words", [(["--steps", "0"], "--steps must be at least 1"),
                                         (["--steps", "-3"], "--steps must be at least 1"),
                                         (["--seed", "99999999999999999999"], "--seed must fit in 64 bits")])
def test_bad_demo_flags_are_one_line_errors(argv, words, capsys):
    from aiayn.cli import main

    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err


def test_seeds_that_differ_only_above_bit_32_train_other_models():
    """torch's CPU generators keep the low 32 bits of a seed: --seed 1 and 2^32 + 1 trained one model."""
    a, b, c = (train_copy(steps=1, seed=s, d_model=16, layers=1)[0] for s in (1, 2**32 + 1, 1))
    w = "encoder.layers.0.ff.w1.weight"
    assert not torch.equal(a.state_dict()[w], b.state_dict()[w])
    assert torch.equal(a.state_dict()[w], c.state_dict()[w])


def test_demo_says_1_step_and_refuses_a_closed_stdout(capsys, monkeypatch):
    """With standard output closed (`>&-`) it trained both models to print nothing, exit 0."""
    from aiayn.cli import main

    assert main(["demo", "--steps", "1"]) == 0
    assert capsys.readouterr().out.startswith("== copy task: tiny Transformer, 1 step\n")
    monkeypatch.setattr("sys.stdout", None)
    assert main(["demo", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err == ("aiayn demo: error: standard output is closed; the demo prints its results there: "
                   "redirect it to a file instead\n"), err


@pytest.mark.parametrize("where", ["closed pipe", "full disk"])
def test_demo_ends_at_once_when_its_reader_goes_or_the_disk_is_full(where):
    """To a pipe or a file its lines waited in Python's buffer until exit: `aiayn demo | head -1`
    showed nothing until both models were trained, and a reader gone (or a full disk) was then
    "Exception ignored ... BrokenPipeError" and exit 120. Each line now goes out as it is made."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if where == "full disk" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a user's: block-buffered
    argv = [sys.executable, "-m", "aiayn", "demo", "--steps", "1000000"]  # hours of training
    if where == "closed pipe":
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        p.stdout.close()  # the reader is gone (`| head -0`)
        try:
            assert p.wait(timeout=120) == 0
        finally:
            p.kill()
        assert p.stderr.read() == b""
    else:
        with open("/dev/full", "w") as full:
            done = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
        assert done.returncode == 2 and done.stderr == (
            "aiayn demo: error: standard output: cannot write (No space left on device); "
            "the demo prints its results there\n"), done.stderr
