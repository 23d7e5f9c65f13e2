"""Token-bucketed batches cut from length arrays with numpy, for corpora of millions of pairs.

Section 5.1, "batched together by approximate sequence length": pairs sorted by (cost, source
length), where cost = max(source, target + 1) is the padded width a pair needs; cut greedily so that
`rows * widest cost <= max_tokens`; ties in the sort and the batch order shuffled with (seed, epoch).
At WMT14 size: no Python object per pair, and memory that does not grow with a second copy of the corpus.

- `plan_batches` does the epoch-independent work once: a counting sort of the pairs (in chunks,
  so no int64 index array the size of the corpus is ever built) and the cut points. Shuffling ties
  only permutes pairs of equal (cost, source length), so the cut points are the same every epoch.
- `epoch_batches` shuffles inside each run of equal keys and then the batch order, with a
  generator seeded by (seed, epoch): the same arguments always give the same batches (exact resume).
- `rank_batches` gives one rank of a torchrun job its batches of an epoch: each optimizer step's
  `world * update_freq` batches are shared out so that every rank gets the same number of batches
  and about the same number of (padded) tokens; the union per step is what one process with
  `update_freq * world` would take, so data parallelism and accumulation give the same update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence, overload

import numpy as np

from aiayn.errors import AiaynError

_CHUNK = 1 << 18  # pairs handled at a time while sorting (bounds the temporary arrays)
MAX_WIDTH = 4097  # sentence length + 1: the sort keeps one counter per (cost, source length)


def pair_costs(src_len: np.ndarray, tgt_len: np.ndarray) -> np.ndarray:
    """Padded positions each pair takes in a batch: max(source, BOS/EOS + target). Shape (N,), int64."""
    return np.maximum(np.asarray(src_len, np.int64), np.asarray(tgt_len, np.int64) + 1)


@dataclass(frozen=True)
class BatchPlan:
    """The pairs in (cost, source length) order with equal-key runs and batch cut points.

    order:  (N,) int32, pair ids sorted by (cost, source length), ties by id
    runs:   (R + 1,) int64, where each run of equal (cost, source length) starts in `order`
    bounds: (B + 1,) int64, where each batch starts in `order`
    tokens: (B,) int64, padded tokens of each batch (rows * widest cost)
    """

    order: np.ndarray
    runs: np.ndarray
    bounds: np.ndarray
    tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.tokens)


def plan_batches(src_len: np.ndarray, tgt_len: np.ndarray, max_tokens: int, keep: np.ndarray | None = None,
                 alone: bool = False) -> BatchPlan:
    """Sort the pairs whose `keep` is True (all by default) and cut them into batches of at most
    `max_tokens` padded tokens. A pair wider than that is an error, or with `alone` (validation, no
    gradients kept) a batch of its own. `src_len`, `tgt_len` may be memory maps; read in chunks."""
    if int(max_tokens) < 1:
        raise AiaynError(f"--max-tokens must be positive, got {max_tokens}")
    n = len(src_len)
    width = int(max((int(np.max(src_len[s : s + _CHUNK], initial=0)) for s in range(0, n, _CHUNK)), default=0)) + 1
    if width > MAX_WIDTH:
        raise AiaynError(f"a source sentence has {width - 1} tokens; batching handles at most {MAX_WIDTH - 1}: "
                         "lower --max-len")
    longest = 0

    def keys(start: int) -> tuple[np.ndarray, np.ndarray]:  # (ids, key) of the kept pairs of a chunk
        nonlocal longest
        s, t = src_len[start : start + _CHUNK], tgt_len[start : start + _CHUNK]
        ids = np.arange(start, start + len(s), dtype=np.int64)
        if keep is not None:
            mask = np.asarray(keep[start : start + _CHUNK], bool)
            ids, s, t = ids[mask], s[mask], t[mask]
        cost = pair_costs(s, t)
        longest = max(longest, int(cost.max(initial=0)))
        return ids, cost * width + np.asarray(s, np.int64)

    order, counts = _counting_sort(keys, n)
    if longest > max_tokens and not alone:
        raise AiaynError(
            f"--max-tokens {max_tokens} is smaller than the longest training pair ({longest} tokens with BOS/EOS); "
            f"raise --max-tokens to at least {longest} or lower --max-len"
        )
    present = np.flatnonzero(counts)
    run_sizes = counts[present]
    runs = np.concatenate(([0], np.cumsum(run_sizes)))
    bounds, tokens = _cut(present // width, run_sizes, int(max_tokens))
    return BatchPlan(order, runs, bounds, tokens)


def _counting_sort(keys, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Stable sort of pair ids by key, one chunk at a time: ((N,) int32 ids, (K,) int64 counts per key).

    A counting sort: one pass counts each key, a second writes each chunk's ids into its keys' slots,
    so the only array the size of the corpus is the int32 result.
    """
    counts = np.zeros(0, np.int64)
    for start in range(0, n, _CHUNK):
        counts = _add(counts, np.bincount(keys(start)[1]))
    filled = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)  # next free slot of each key
    order = np.empty(int(counts.sum()), np.int32)
    for start in range(0, n, _CHUNK):
        ids, k = keys(start)
        idx = np.argsort(k, kind="stable")
        ks = k[idx]
        rank_in_run = np.arange(len(ks)) - np.searchsorted(ks, ks, side="left")
        order[filled[ks] + rank_in_run] = ids[idx]
        filled = _add(filled, np.bincount(k))
    return order, counts


def _add(total: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """`total + counts` for count vectors of different lengths."""
    if len(counts) > len(total):
        total = np.concatenate((total, np.zeros(len(counts) - len(total), np.int64)))
    total[: len(counts)] += counts
    return total


def _cut(cost: np.ndarray, size: np.ndarray, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy cut of sorted pairs given as runs of equal cost (`cost` ascending, `size` pairs each).

    A batch starting at position s grows while rows * (cost of its last pair) <= max_tokens; since
    costs only grow, it is enough to walk the runs, never the pairs. A pair wider than max_tokens
    (`plan_batches`'s `alone`) is a batch of one.
    """
    ends = np.cumsum(size)
    bounds, tokens = [0], []
    s, r = 0, 0
    while r < len(size):
        end, width = s, 0
        while r < len(size) and s + (rows := max(1, max_tokens // int(cost[r]))) > ends[r] - size[r]:
            end, width = min(int(ends[r]), s + rows), int(cost[r])
            if end < ends[r]:
                break
            r += 1
        bounds.append(end)
        tokens.append((end - s) * width)
        s = end
        while r < len(size) and ends[r] <= s:
            r += 1
    return np.asarray(bounds, np.int64), np.asarray(tokens, np.int64)


class Batches(Sequence[np.ndarray]):
    """A list of batches (each an int32 array of pair ids) that holds only a shuffled order and ids."""

    def __init__(self, order: np.ndarray, bounds: np.ndarray, ids: np.ndarray) -> None:
        self.order, self.bounds, self.ids = order, bounds, ids  # (N,) int32, (B+1,) int64, (b,) int64

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, i: int) -> np.ndarray: ...
    @overload
    def __getitem__(self, i: slice) -> list[np.ndarray]: ...
    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        b = int(self.ids[i])
        return self.order[self.bounds[b] : self.bounds[b + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[j] for j in range(len(self)))


def epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    """The generator of one epoch's shuffles: the same in every process for the same (seed, epoch)."""
    return np.random.default_rng([int(seed) % 2**64, int(epoch) % 2**64])


def epoch_batches(plan: BatchPlan, seed: int, epoch: int, shuffle: bool = True) -> Batches:
    """All batches of an epoch: ties shuffled within each run, then the batch order shuffled.
    Without `shuffle`, batches come in length order (validation).

    The shuffle works in place on `plan.order` (a copy would be another 4 bytes a pair): each run is
    sorted back to id order first, so the result depends on (seed, epoch) only, never on the epoch
    before; but the batches an earlier call returned change with it.
    """
    if not shuffle:
        return Batches(plan.order, plan.bounds, np.arange(len(plan), dtype=np.int64))
    rng = epoch_rng(seed, epoch)
    for a, b in zip(plan.runs[:-1].tolist(), plan.runs[1:].tolist()):
        if b - a > 1:
            run = plan.order[a:b]
            run.sort()
            rng.shuffle(run)
    return Batches(plan.order, plan.bounds, rng.permutation(len(plan)))


def rank_batches(plan: BatchPlan, seed: int, epoch: int, rank: int, world: int, update_freq: int) -> Batches:
    """Rank `rank`'s batches of an epoch (`epoch_batches`): each step's `world * update_freq`
    consecutive batches are shared out so that every rank gets as many batches and about as many
    padded tokens (`plan.tokens[b]`) as the others. Batches past the last multiple of `world` are left
    out, so every rank takes as many steps. One process (world 1) takes the epoch's batches as they are.
    """
    batches = epoch_batches(plan, seed, epoch)
    if len(batches) < world:
        raise AiaynError(
            f"the data makes {len(batches)} batches, fewer than the {world} processes; lower --max-tokens "
            "or use fewer processes"
        )
    usable = len(batches) - len(batches) % world
    group = world * update_freq
    mine: list[int] = []
    totals = [0] * world  # tokens given to each rank so far this epoch: the tie-breaker
    for start in range(0, usable, group):
        shares = _share(batches.ids[start : min(start + group, usable)], plan.tokens, totals)
        mine.extend(shares[rank])
    return Batches(batches.order, batches.bounds, np.asarray(mine, np.int64))


def _share(ids: np.ndarray, tokens: np.ndarray, totals: list[int]) -> list[list[int]]:
    """Split one step's batch ids into equal-sized lists, one per rank, with balanced token sums:
    largest first, each to the rank with the fewest tokens in this step (then this epoch) that still
    has room. Each list keeps the step's order; `totals` is updated."""
    world = len(totals)
    per_rank = len(ids) // world
    position = {b: i for i, b in enumerate(ids.tolist())}
    load, chosen = [0] * world, [[] for _ in range(world)]  # type: list[int], list[list[int]]
    for b in sorted(position, key=lambda b: (-int(tokens[b]), position[b])):
        r = min((r for r in range(world) if len(chosen[r]) < per_rank), key=lambda r: (load[r], totals[r], r))
        chosen[r].append(b)
        load[r] += int(tokens[b])
        totals[r] += int(tokens[b])
    return [sorted(c, key=position.__getitem__) for c in chosen]
