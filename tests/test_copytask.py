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
