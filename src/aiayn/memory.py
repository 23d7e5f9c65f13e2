"""Keeping a long-running process flat in memory on the CPU (training runs, the server).

Two things grow a PyTorch process that computes on ever-new tensor shapes, as training on
variable-length batches and decoding do, without any tensor leaking:

- oneDNN (bf16 matmuls, the packed inference GEMMs) keeps a compiled kernel per shape in two caches
  of 1024 entries, ideep's and its own. Shapes rarely repeat, so the caches mostly hold kernels that
  will not run again, and they pin heap pages between the tensors. Both capacities are read when
  oneDNN first runs: `cap_onednn_caches` must come before the first bf16 matmul.
- glibc's malloc keeps freed memory for reuse instead of returning it, and tensors of ever-new
  sizes leave it in pieces it cannot reuse well. `HeapTrimmer` gives it back (`malloc_trim`) when
  the resident size has grown a quarter beyond what a step needs, so a steady run pays for a trim
  now and then instead of at every step (a trim at every step costs a noticeable share of it;
  docs/wmt14.md has the figures).

A job that decodes and then ends wants the opposite of the second point: `keep_freed_memory`.

And on a GPU, where memory is fixed: `batch_fits` turns running out of device memory in training
into one line naming the flag that sizes the batch (--max-tokens), instead of a traceback.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from aiayn.errors import AiaynError

if TYPE_CHECKING:  # torch itself is imported where it is used: `aiayn serve --help` loads this module
    import torch

# 64 entries each: measured flat at the same speed (bench/serve.py --rss; bench/scale.py for training).
ONEDNN_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}


def cap_onednn_caches() -> None:
    """Cap oneDNN's per-shape kernel caches, unless the user set them."""
    for name, value in ONEDNN_CACHES.items():
        os.environ.setdefault(name, value)


def status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status ("RssAnon", "VmHWM", ...) in bytes;
    0 where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return 0


def physical_bytes() -> int:
    """This machine's physical memory in bytes; 0 where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def resident_anon_bytes() -> int:
    """This process's anonymous resident memory (RssAnon: what it owns, not file pages)."""
    return status_bytes("RssAnon")


def _glibc(name: str, argtypes: list):
    """glibc's function `name` (returning int) with its argument types, or None where the C library
    has none (musl, macOS)."""
    try:
        f = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    f.argtypes, f.restype = argtypes, ctypes.c_int
    return f


def _malloc_trim():
    """glibc's malloc_trim, or None."""
    return _glibc("malloc_trim", [ctypes.c_size_t])


# glibc's mallopt parameters (malloc.h) with what keep_freed_memory sets, and the names under which a
# user may have set them already: the old environment variables and GLIBC_TUNABLES.
_MALLOC_KEEP = (("MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold", -3, 32 * 2**20),
                ("MALLOC_TRIM_THRESHOLD_", "glibc.malloc.trim_threshold", -1, 2**30))


def keep_freed_memory() -> bool:
    """Have glibc's malloc serve blocks up to 32 MiB from its heap and keep up to 1 GiB of what is
    freed there for the next ones, for a job that decodes (`aiayn translate`, `aiayn evaluate`).

    By default glibc hands larger blocks (from 128 KiB, raised as such blocks are freed) straight to
    and from the kernel and gives back the top of its heap past twice that: decoding allocates
    activations of new sizes at every step, and each fresh page costs a page fault (3-5% of an int8
    search, docs/speed.md). The resident size then stays near its peak, which barely moves. A
    setting the user made (either name) wins; the server, which must stay flat for days, keeps
    glibc's defaults. Returns whether mallopt took every value it was given (False without glibc)."""
    mallopt = _glibc("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is None:
        return False
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    ok = True
    for env_name, tunable, param, value in _MALLOC_KEEP:
        if env_name not in os.environ and tunable not in tunables:
            ok = mallopt(param, value) == 1 and ok  # mallopt returns 1 on success
    return ok


class HeapTrimmer:
    """Call `step()` once per training step. It returns freed heap memory to the system when the
    anonymous resident size is `growth` times what one step needs: the most it has been at the end
    of the first step after a trim (or after the first step of all), when the heap holds just what
    a step left behind."""

    def __init__(self, growth: float = 1.25) -> None:
        self.growth = growth
        self.trim = _malloc_trim()
        self.need = 0  # bytes: the largest end-of-step size right after a trim
        self.fresh = True  # the next step is the first after a trim
        self.trims = 0

    def step(self) -> None:
        if self.trim is None:
            return
        now = resident_anon_bytes()
        if self.fresh:
            self.need, self.fresh = max(self.need, now), False
        elif now > self.growth * self.need:
            self.trim(0)
            self.trims += 1
            self.fresh = True


# Out-of-memory errors raised as a plain RuntimeError, not the allocator's type: CUDA libraries' and the
# CPU allocator's ("DefaultCPUAllocator: can't allocate memory").
_OOM_WORDS = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed", "can't allocate memory")


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` is running out of memory, on the CPU or a GPU, whatever raised it (one test for
    `batch_fits` and the command line's last line)."""
    import torch

    text = str(e).lower()
    return isinstance(e, (MemoryError, torch.cuda.OutOfMemoryError)) or any(w in text for w in _OOM_WORDS)


@contextlib.contextmanager
def batch_fits(max_tokens: int, device: torch.device) -> Iterator[None]:
    """Training inside the block: running out of `device` memory (`torch.OutOfMemoryError`, CUDA's
    included, or a CUDA library's allocation failure) becomes one `AiaynError` naming --max-tokens,
    with the first line of what was said. Under torchrun only the rank that ran out says so; the
    others stop when the collective they wait in times out (NCCL's timeout)."""
    import torch

    try:
        yield
    except (torch.cuda.OutOfMemoryError, RuntimeError) as e:  # the first: torch.OutOfMemoryError
        if not out_of_memory(e):
            raise
        said = str(e).strip().splitlines()
        # CUDA's message is one long line: "CUDA out of memory. Tried to allocate 3.73 GiB. GPU 0 has ..."
        what = ". ".join(said[0].split(". ")[:2]).rstrip(".") if said else "out of memory"
        raise AiaynError(f"--max-tokens {max_tokens}: out of memory on {device} ({what}); lower --max-tokens "
                         "and raise --update-freq (or set --tokens-per-update) to keep the tokens per step") from None
