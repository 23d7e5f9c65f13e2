"""Numpy token buckets (aiayn.data.batching): the semantics of a plain-Python reference, cut from length arrays;
the same batches for the same (seed, epoch); ranks share each step's batches evenly."""

from __future__ import annotations

import random

import numpy as np
import pytest

from aiayn.data import batching
from aiayn.data.batching import epoch_batches, pair_costs, plan_batches, rank_batches
from aiayn.errors import AiaynError


def _lengths(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 40, n).astype(np.uint16)
    tgt = np.clip(src.astype(np.int64) + rng.integers(-5, 6, n), 0, 45).astype(np.uint16)
    return src, tgt


def _examples(src: np.ndarray, tgt: np.ndarray) -> list[tuple[list[int], list[int]]]:
    return [([7] * int(s), [7] * int(t)) for s, t in zip(src, tgt)]


def batch_indices(examples: list[tuple[list[int], list[int]]], max_tokens: int, seed: int, epoch: int,
                  shuffle: bool = True) -> list[list[int]]:
    """The reference, one Python object per pair: sorted by (cost, source length), cost =
    max(source, target + 1), ties shuffled with (seed, epoch); cut greedily so that
    `rows * widest cost <= max_tokens`; then the batch order shuffled."""
    costs = [max(len(s), len(t) + 1) for s, t in examples]
    rng = random.Random(f"{seed}:{epoch}")
    order = list(range(len(examples)))
    if shuffle:
        rng.shuffle(order)
    order.sort(key=lambda i: (costs[i], len(examples[i][0])))  # stable: ties keep the shuffled order
    batches: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in order:
        w = max(width, costs[i])
        if current and (len(current) + 1) * w > max_tokens:
            batches.append(current)
            current, w = [], costs[i]
        current.append(i)
        width = w
    batches.append(current)
    if shuffle:
        rng.shuffle(batches)
    return batches


def test_batches_are_tight_and_length_sorted():
    src, tgt = np.array([3, 10, 4, 10, 1, 9], np.uint16), np.array([2, 9, 3, 2, 1, 9], np.uint16)
    # costs max(s, t + 1): 3, 10, 4, 10, 2, 10 -> sorted 2, 3, 4 | 10, 10, 10 with budget 20
    got = [b.tolist() for b in epoch_batches(plan_batches(src, tgt, 20), seed=0, epoch=0, shuffle=False)]
    assert got == [[4, 0, 2], [5, 1], [3]]
    # a cut happens only where one more pair would overflow: 3 * 4 = 12 fits, 4 * 10 does not
    got = [b.tolist() for b in epoch_batches(plan_batches(src, tgt, 12), seed=0, epoch=0, shuffle=False)]
    assert got == [[4, 0, 2], [5], [1], [3]]


def test_unshuffled_batches_are_exactly_those_of_batch_indices():
    src, tgt = _lengths(3000)
    for max_tokens in (46, 100, 1000, 4096):
        plan = plan_batches(src, tgt, max_tokens)
        got = [b.tolist() for b in epoch_batches(plan, seed=1, epoch=0, shuffle=False)]
        assert got == batch_indices(_examples(src, tgt), max_tokens, seed=1, epoch=0, shuffle=False)


def test_the_chunked_counting_sort_equals_one_stable_sort(monkeypatch):
    src, tgt = _lengths(5000, seed=3)
    monkeypatch.setattr(batching, "_CHUNK", 333)  # many chunks, with runs crossing chunk borders
    plan = plan_batches(src, tgt, 500)
    key = pair_costs(src, tgt) * 100 + src
    assert plan.order.dtype == np.int32
    assert plan.order.tolist() == np.argsort(key, kind="stable").tolist()


def test_shuffled_batches_keep_the_rules_and_depend_only_on_seed_and_epoch():
    src, tgt = _lengths(4000, seed=1)
    cost = pair_costs(src, tgt)
    plan = plan_batches(src, tgt, 300)
    a = [b.tolist() for b in epoch_batches(plan, seed=5, epoch=1)]
    assert a == [b.tolist() for b in epoch_batches(plan, seed=5, epoch=1)]  # resume relies on this
    assert a != [b.tolist() for b in epoch_batches(plan, seed=5, epoch=2)]
    assert a != [b.tolist() for b in epoch_batches(plan, seed=6, epoch=1)]
    assert sorted(i for b in a for i in b) == list(range(4000))  # each pair once
    for b in a:
        assert len(b) * cost[b].max() <= 300
    # the cut points do not depend on the shuffle: the same batch sizes as batch_indices draws
    ref = batch_indices(_examples(src, tgt), 300, seed=5, epoch=1)
    assert sorted(map(len, a)) == sorted(map(len, ref))
    # ties are shuffled: some batch of equal-key pairs changes members between epochs
    b = [x.tolist() for x in epoch_batches(plan, seed=5, epoch=2)]
    assert {tuple(sorted(x)) for x in a} != {tuple(sorted(x)) for x in b}
    # the in-place shuffle forgets the epoch before: epoch 1 after epoch 2 is epoch 1 (resume relies on it)
    assert [x.tolist() for x in epoch_batches(plan, seed=5, epoch=1)] == a


def test_keep_leaves_pairs_out_and_too_long_pairs_are_a_clear_error():
    src, tgt = _lengths(500)
    keep = np.asarray(src) < 20
    plan = plan_batches(src, tgt, 200, keep=keep)
    got = sorted(i for b in epoch_batches(plan, 1, 1) for i in b.tolist())
    assert got == np.flatnonzero(keep).tolist()
    with pytest.raises(AiaynError, match=r"--max-tokens 10 is smaller than the longest training pair \(45 tokens"):
        plan_batches(np.array([3, 45]), np.array([2, 2]), 10)
    assert len(plan_batches(np.zeros(0, np.uint16), np.zeros(0, np.uint16), 10)) == 0


@pytest.mark.parametrize("world,update_freq", [(2, 1), (2, 3), (3, 2), (4, 1)])
def test_ranks_share_each_step_evenly_and_together_take_what_one_process_takes(world, update_freq):
    src, tgt = _lengths(3000, seed=2)
    plan = plan_batches(src, tgt, 256)
    batches = epoch_batches(plan, seed=1, epoch=1)
    mine = [rank_batches(plan, 1, 1, r, world, update_freq) for r in range(world)]
    assert len({len(m) for m in mine}) == 1  # every rank takes as many steps
    one = rank_batches(plan, 1, 1, 0, 1, world * update_freq)  # one process, world x accumulation
    usable = len(batches) - len(batches) % world
    assert len(one) == len(batches) and sum(map(len, mine)) == usable
    n_steps = -(-len(mine[0]) // update_freq)
    slowest = naive_slowest = 0  # sum over steps of the busiest rank's tokens: what a step waits for
    for step in range(n_steps):
        ids = sorted(int(b) for m in mine for b in m.ids[step * update_freq : (step + 1) * update_freq])
        assert ids == sorted(batches.ids[step * world * update_freq : min((step + 1) * world * update_freq, usable)])
        loads = [int(plan.tokens[m.ids[step * update_freq : (step + 1) * update_freq]].sum()) for m in mine]
        assert max(loads) - min(loads) <= plan.tokens.max()  # balanced up to one batch
        group = batches.ids[step * world * update_freq : min((step + 1) * world * update_freq, usable)]
        naive = [int(plan.tokens[group[r::world]].sum()) for r in range(world)]  # batches[rank::world]
        slowest, naive_slowest = slowest + max(loads), naive_slowest + max(naive)
    assert slowest <= naive_slowest
    totals = [int(plan.tokens[m.ids].sum()) for m in mine]
    assert max(totals) - min(totals) <= plan.tokens.max()  # and over the epoch


def test_fewer_batches_than_ranks_is_an_error_on_every_rank_not_a_hang():
    plan = plan_batches(np.array([3, 3]), np.array([3, 3]), 100)
    with pytest.raises(AiaynError, match=r"1 batches, fewer than the 2 processes"):
        rank_batches(plan, 1, 1, 1, 2, 1)


def test_batches_are_a_light_sequence():
    plan = plan_batches(*_lengths(100), 128)
    bs = epoch_batches(plan, 1, 1)
    assert len(bs[0:3]) == 3 and bs[0:3][1].tolist() == bs[1].tolist()
    assert [x.tolist() for x in bs] == [bs[i].tolist() for i in range(len(bs))]
