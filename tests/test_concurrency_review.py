"""The torch `Translator` used from several threads at once and with several workers, from a cold
review: a thread of the caller's keeps torch's full thread count, whatever searches ran meanwhile."""

import threading

import torch

from aiayn.translator import map_batches


def test_a_thread_that_starts_while_workers_search_takes_the_full_thread_count():
    """A worker's `torch.set_num_threads(share)` also set torch's process-wide count, which a thread
    takes at its first operation: a thread of the caller's (a web server's, say) that began while
    another thread's search ran kept 1 of 2 threads for good, and searched on one thread from then on."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        running, release = threading.Barrier(3), threading.Event()
        seen: dict = {}

        def search(x):
            seen[x] = torch.get_num_threads()  # a worker's own share
            running.wait(10)
            assert release.wait(10)
            return x

        def other():  # a new thread's first operation, while the workers search
            seen["other"] = torch.get_num_threads()

        caller = threading.Thread(target=lambda: seen.setdefault("out", map_batches(search, [0, 1], workers=2)))
        caller.start()
        running.wait(10)
        late = threading.Thread(target=other)
        late.start()
        late.join()
        release.set()
        caller.join(30)
        assert seen == {0: 1, 1: 1, "other": 2, "out": [0, 1]}
    finally:
        torch.set_num_threads(threads)
