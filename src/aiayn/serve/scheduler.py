"""The batching scheduler of `aiayn serve`: lines of concurrent requests in, token-bounded batches out.

HTTP handlers only validate and `submit`; this scheduler is the one place that decides what runs
next. It lives on the event loop (all its state is touched there only, so it needs no locks) and
hands each batch to one model thread, so the event loop never runs a tensor operation and the model
is never used by two batches at once (the CPU workers of `aiayn.translator.map_batches` split a
batch further inside that thread).

A batch holds lines that share one `key` (the search settings): lines with other settings wait for
a batch of their own, so every line is searched exactly as `aiayn translate` would search it. A line
is answered as soon as the search is done with it (`run` calls `early`), while the longer lines of
its batch go on; a request's future is answered once all its lines are (they may be cut across
batches).

Fairness: no request holds the model from the others. The next batch is for the request served
least recently (its arrival, or the last batch that took its lines), under that request's key; the
batch takes one line from each request of that key in turn (that request first, then by the same
order) until `max_batch_tokens` source tokens; and while other requests wait, one request takes at
most `max_share` of those tokens (at least one line). So a one-line request that arrives behind a
1,024-line one waits for the batch that is running, then rides in a small batch: a long request
alone fills every batch, a long request among others gets a share of each.

A batch waits to fill at most `max_wait` seconds after the next request arrived or, under the key of
the previous batch, after that batch ended (whichever is later), and no longer than it takes for
the clients that batch answered to come back: the lines of the requests it completed, plus those of
its key that were waiting, where lines that arrived during the batch count first as the clients it
answered early. Under steady load (c clients, each sending again as soon as it is answered) that is
all c lines, most of them back before the batch ends, so the clients move as one cohort in batches
of c instead of splitting into cohorts that take turns in smaller, slower batches. A lone client,
whose previous batch was one line, never waits; neither do the rest of a request too long for one
batch, nor lines with other settings than the previous batch (no client it answered will join them).

Limits are data: `max_queue` lines may wait (not yet in a batch); beyond that `submit` raises
`QueueFull` (the most lines of one request, `Limits.max_lines`, is the app's check). A cancelled
request (its client went away) loses its lines that have not started.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("aiayn.serve")
# run(key, lines, early) -> one result per line; called in the model thread, never on the event loop.
# It may call early(i, result) (from the thread that searched line i) once line i is done.
RunBatch = Callable[[Hashable, list[str], Callable[[int, Any], None]], list[Any]]


@dataclass(frozen=True)
class Limits:
    """The settings and limits of `aiayn serve` (data: flags set them, /v1/info shows them)."""

    beam: int = 4  # default beam size
    max_batch_tokens: int = 2048  # source tokens per batch
    max_wait_ms: float = 5.0  # how long a batch may wait to fill, after its oldest line or the last batch
    max_queue: int = 4096  # lines waiting for a batch (of all requests)
    max_lines: int = 1024  # lines in one request
    max_chars: int = 2000  # characters per line
    max_beam: int = 16  # the largest beam a request may ask for
    max_nbest: int = 16  # the most hypotheses per line a request may ask for
    max_work: int = 2_000_000  # work one request may ask for, in token slots (`aiayn.serve.batch.price`)
    max_share: float = 0.1  # of a batch's source tokens, the most one request takes while others wait
    max_client_lines: int = 2048  # lines one client (API key, else IP) may have in the server at once
    max_connections: int = 512  # open connections and requests in flight (more: 503, by `aiayn.serve.protocol`)
    max_body_memory_mib: int = 256  # request bodies over SMALL_BODY held at once, by Content-Length (more: 503)
    head_timeout_s: float = 10.0  # time to send a request line and headers (more: 408, connection closed)
    body_timeout_s: float = 30.0  # time to send a request body (more: 408)
    shutdown_timeout_s: int = 30  # on SIGTERM, how long requests in flight may finish

    @property
    def max_body(self) -> int:
        """The largest request body, in bytes: every line at its longest with each character escaped
        as JSON or a form may write it (12 bytes: "\\uXXXX" twice past U+FFFF, a form's %XX per UTF-8
        byte), plus the JSON's own overhead."""
        return self.max_lines * self.max_chars * 12 + SMALL_BODY

    def holds_largest_body(self) -> bool:
        """Whether max_body_memory_mib holds one body of `max_body` (else every large body is a 503)."""
        return self.max_body_memory_mib << 20 >= self.max_body


SMALL_BODY = 1 << 16  # a body this small is never refused for --max-body-memory (--max-connections bound them)


class QueueFull(Exception):
    """More lines are waiting than `max_queue` allows; the client should retry later."""


@dataclass(eq=False)
class Job:
    """One request: its lines, their costs in source tokens, and where the answers go."""

    key: Hashable
    lines: list[str]
    costs: list[int]
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)
    taken: int = 0  # lines already put in a batch (they are taken in order)
    results: list[Any] = field(default_factory=list)
    returned: int = 0
    turn: float = 0.0  # when the last batch with its lines ended (before: its arrival); least recent first

    def __post_init__(self) -> None:
        self.results = [None] * len(self.lines)
        self.turn = self.arrived


@dataclass
class Stats:
    """What the scheduler has done, for /metrics (read on the event loop)."""

    batches: int = 0
    lines: int = 0
    dropped: int = 0  # lines of cancelled requests never searched
    on_batch: Callable[[int, int, float], None] | None = None  # (lines, source tokens, seconds)
    on_drop: Callable[[int], None] | None = None  # (lines)


class Scheduler:
    """Merges the lines of concurrent jobs into batches and runs them one at a time in a model thread."""

    def __init__(self, run: RunBatch, max_batch_tokens: int = 2048, max_wait: float = 0.005,
                 max_queue: int = 4096, max_share: float = 0.1) -> None:
        self.run = run
        self.max_batch_tokens, self.max_wait, self.max_queue = max_batch_tokens, max_wait, max_queue
        self.max_share = max_share
        self.queue: deque[Job] = deque()
        self.waiting = 0  # lines in the queue not yet taken into a batch
        self.stats = Stats()
        self.busy = False  # a batch is running in the model thread
        # the previous batch: its key, when it ended (time.monotonic), and the lines a next batch
        # under that key waits for at most (see the module docstring)
        self.last_key: Hashable = None
        self.ended = 0.0
        self.expect = 1
        self.answered = 0  # lines of the requests the previous batch completed (their clients may come back)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="aiayn-model")  # the one thread that owns the model

    # ---------------------------------------------------------------- called by handlers

    def submit(self, key: Hashable, lines: Sequence[str], costs: Sequence[int]) -> Job:
        """Queues a request's lines; await `job.future` for their results, in order."""
        if self.waiting + len(lines) > self.max_queue:
            raise QueueFull(f"{self.waiting} lines are waiting, at most {self.max_queue}")
        loop = asyncio.get_running_loop()
        job = Job(key, list(lines), list(costs), loop.create_future())
        if not lines:
            job.future.set_result([])
            return job
        self.queue.append(job)
        self.waiting += len(lines)
        self._ensure_started()
        assert self._wake is not None
        self._wake.set()
        return job

    def cancel(self, job: Job) -> None:
        """Drops the lines of `job` that no batch has taken yet (its client went away)."""
        if job.future.done():
            return
        job.future.cancel()
        left = self._unqueue(job)
        self.stats.dropped += left
        if left and self.stats.on_drop is not None:
            self.stats.on_drop(left)

    def _unqueue(self, job: Job) -> int:
        """Removes `job` from the queue; returns how many of its lines had not been taken."""
        if job not in self.queue:
            return 0
        left = len(job.lines) - job.taken
        self.waiting -= left
        self.queue.remove(job)
        return left

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs `fn(*args)` in the model thread, between batches (loading, warm-up)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def close(self) -> None:
        """Ends the loop once the queue is empty and the running batch is back."""
        while self.queue or self.busy:
            await asyncio.sleep(0.01)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._pool.shutdown(wait=True)

    # ---------------------------------------------------------------- the loop

    def _ensure_started(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="aiayn-scheduler")

    def _ready(self, key: Hashable, after: float = float("-inf")) -> tuple[int, int]:
        """Lines and source tokens waiting under `key` (the most the next batch could hold), of the
        requests that arrived after `after` (time.monotonic)."""
        jobs = [j for j in self.queue if j.key == key and j.arrived > after]
        return sum(len(j.lines) - j.taken for j in jobs), sum(sum(j.costs[j.taken:]) for j in jobs)

    def _next(self) -> Job:
        """The job the next batch is for: the one served least recently (the oldest, first)."""
        return min(self.queue, key=lambda j: j.turn)

    def _takes(self, key: Hashable, capped: bool) -> float:
        """Source tokens the next batch under `key` could take now: each job's waiting tokens, at most
        its share (but a line) while others wait or, `capped`, the clients just answered may come back
        (so that a long request, alone for a moment after a batch, does not fill the next one)."""
        jobs = [j for j in self.queue if j.key == key]
        cap = self.max_batch_tokens * self.max_share if capped or len(self.queue) > 1 else float("inf")
        return sum(min(sum(j.costs[j.taken:]), max(cap, j.costs[j.taken])) for j in jobs)

    async def _fill(self) -> None:
        """Waits until the next job's batch is full, holds `expect` lines, or has waited
        `max_wait` seconds since that job arrived or the previous batch (of its key) ended."""
        assert self._wake is not None
        while self.queue:
            head = self._next()
            same = head.key == self.last_key  # only the clients of that batch are coming back
            left = max(head.turn, self.ended if same else 0.0) + self.max_wait - time.monotonic()
            lines = self._ready(head.key)[0]
            full = self._takes(head.key, capped=same and self.answered > 0) >= self.max_batch_tokens
            if left <= 0 or full or lines >= (self.expect if same else 1):
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                return

    def _cut(self) -> list[tuple[Job, int]]:
        """Takes (job, line index) pairs under the next job's key, one line of each job in turn
        (least recently served first), up to `max_batch_tokens` source tokens (a first line longer
        than that still goes, alone); while other jobs wait, a job takes at most `max_share` of them."""
        jobs = sorted(self.queue, key=lambda j: j.turn)
        jobs = [j for j in jobs if j.key == jobs[0].key]
        share = self.max_batch_tokens if len(self.queue) == 1 else self.max_batch_tokens * self.max_share
        batch: list[tuple[Job, int]] = []
        tokens, took = 0, dict.fromkeys(jobs, 0)
        while jobs:
            for job in list(jobs):  # one line of each, in turn
                cost = job.costs[job.taken]
                if (batch and tokens + cost > self.max_batch_tokens) or (took[job] and took[job] + cost > share):
                    jobs.remove(job)  # full, or its share is: the others may still fit a line
                    continue
                batch.append((job, job.taken))
                job.taken, tokens, took[job] = job.taken + 1, tokens + cost, took[job] + cost
                self.waiting -= 1
                if job.taken == len(job.lines):
                    jobs.remove(job)
                    self.queue.remove(job)  # all its lines are taken
        return batch

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            if not self.queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._fill()
                if self.queue:  # unless everything waiting was cancelled meanwhile
                    await self._run(self._cut())
            except Exception as e:  # a bug here must not leave requests waiting for ever
                log.exception("the scheduler failed; failing the requests waiting")
                for job in list(self.queue):
                    self._unqueue(job)
                    if not job.future.done():
                        job.future.set_exception(e)

    async def _run(self, batch: list[tuple[Job, int]]) -> None:
        key = batch[0][0].key
        lines = [job.lines[i] for job, i in batch]
        tokens = sum(job.costs[i] for job, i in batch)
        answers = Answers(batch)
        loop = asyncio.get_running_loop()

        def early(n: int, result: Any) -> None:  # in the thread that searched line n: to the event loop
            loop.call_soon_threadsafe(answers.give, n, result, True)

        self.busy = True
        began, start = time.monotonic(), time.perf_counter()
        try:
            results = await self.call(self.run, key, lines, early)
        except Exception as e:  # a fault in the search fails its requests, never the loop
            for job in {job for job, _ in batch}:
                self._unqueue(job)  # its lines still waiting go too
                if not job.future.done():
                    job.future.set_exception(e)
            return
        finally:
            self.busy = False
        self.stats.batches += 1
        self.stats.lines += len(lines)
        if self.stats.on_batch is not None:
            self.stats.on_batch(len(lines), tokens, time.perf_counter() - start)
        for n, result in enumerate(results):  # the lines not given early (blank ones, or all)
            answers.give(n, result, False)
        self.last_key, self.ended = key, time.monotonic()
        for job, _ in batch:  # served now: the requests that waited during the batch go first
            job.turn = self.ended
        self.expect, self.answered = self._expect(key, began, answers), answers.all

    def _expect(self, key: Hashable, began: float, answers: "Answers") -> int:
        """The lines the next batch under `key` waits for: those of the clients this batch answered,
        and those waiting now, where the lines that arrived while it ran (after `began`) count first
        as clients it answered early (a cancelled request's lines are no longer waiting)."""
        waiting, during = self._ready(key)[0], self._ready(key, after=began)[0]
        return max(1, answers.all + waiting - during + max(0, during - answers.early))


@dataclass
class Answers:
    """A running batch's answers, given on the event loop as each line is done (or at the end)."""

    batch: list[tuple[Job, int]]
    given: list[bool] = field(default_factory=list)
    all: int = 0  # lines of the requests the batch completed: their clients may send again
    early: int = 0  # of those, the lines of requests completed before the batch was back

    def __post_init__(self) -> None:
        self.given = [False] * len(self.batch)

    def give(self, n: int, result: Any, before_end: bool) -> None:
        """Line n of the batch is done: its request is answered once all its lines are (once each;
        a cancelled request, its client gone, is not answered)."""
        if self.given[n]:
            return
        self.given[n] = True
        job, i = self.batch[n]
        job.results[i] = result
        job.returned += 1
        if job.returned == len(job.lines) and not job.future.done():
            job.future.set_result(job.results)
            self.all += len(job.lines)
            self.early += len(job.lines) if before_end else 0
