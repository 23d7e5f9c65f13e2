"""A long run stays flat in memory: oneDNN's kernel caches are capped and freed heap memory is given
back once the process has grown a quarter beyond what a training step needs."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aiayn import memory
from test_train import make_corpus, tiny_args, train_cli


class _Fake:
    """A resident size the test sets, and a malloc_trim that counts its calls and shrinks it."""

    def __init__(self, monkeypatch) -> None:
        self.now, self.calls = 0, 0
        monkeypatch.setattr(memory, "resident_anon_bytes", lambda: self.now)

    def trim(self, pad: int) -> int:
        assert pad == 0
        self.calls += 1
        self.now = 100
        return 1


def test_trims_only_past_a_quarter_more_than_a_step_needs(monkeypatch):
    fake = _Fake(monkeypatch)
    heap = memory.HeapTrimmer(growth=1.25)
    heap.trim = fake.trim
    for now in (400, 450, 500):  # what the first step left; then within a quarter of it
        fake.now = now
        heap.step()
    assert fake.calls == 0 and heap.need == 400
    fake.now = 501
    heap.step()
    assert fake.calls == 1
    fake.now = 300  # the first step after the trim: a step needs less than the first one showed
    heap.step()
    assert heap.need == 400 and fake.calls == 1
    fake.now = 480  # the need is the largest seen, so the threshold does not fall
    heap.step()
    assert fake.calls == 1
    for _ in range(3):  # nor does it climb with each trim: it is the need, not the size before the trim
        fake.now = 501
        heap.step()
        heap.step()  # the first after the trim reads 100 (the fake's trim), which sets nothing new
    assert fake.calls == 4 and heap.need == 400


def test_no_malloc_trim_means_nothing_to_do(monkeypatch):
    fake = _Fake(monkeypatch)
    heap = memory.HeapTrimmer()
    heap.trim = None
    fake.now = 10**12
    heap.step()
    heap.step()
    assert heap.trims == 0


def test_the_oneDNN_caches_are_capped_unless_the_user_set_them(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    memory.cap_onednn_caches()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"


def test_training_caps_the_caches_and_gives_the_heap_back_as_it_grows(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    sizes = iter(range(1, 10**6))
    monkeypatch.setattr(memory, "resident_anon_bytes", lambda: 2 ** next(sizes))
    trims = []
    monkeypatch.setattr(memory, "_malloc_trim", lambda: trims.append)
    paths = make_corpus(tmp_path / "data")
    train_cli(tiny_args(paths, tmp_path / "run", "--max-steps", "4"))
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == os.environ["LRU_CACHE_CAPACITY"] == "64"
    assert trims == [0, 0]  # a doubling size every step: steps 2 and 4 trim, 1 and 3 follow a trim


class _Built(Exception):
    """Raised by the spy once the model is being built: the test has what it needs."""


def _caps_when_the_model_is_built(monkeypatch) -> list[dict[str, str | None]]:
    """oneDNN reads its cache capacities once, at its first kernel, so reading the environment back
    afterwards proves nothing: this records them when a Transformer is built (before any kernel
    runs) and stops the command there."""
    from aiayn.model import Transformer

    seen: list[dict[str, str | None]] = []

    def spy(self, *args, **kwargs):
        seen.append({k: os.environ.get(k) for k in memory.ONEDNN_CACHES})
        raise _Built

    monkeypatch.setattr(Transformer, "__init__", spy)
    return seen


def test_training_caps_the_caches_before_it_builds_the_model(tmp_path, monkeypatch):
    seen = _caps_when_the_model_is_built(monkeypatch)
    paths = make_corpus(tmp_path / "data")
    with pytest.raises(_Built):
        train_cli(tiny_args(paths, tmp_path / "run", "--max-steps", "1"))
    assert seen == [memory.ONEDNN_CACHES]


def test_the_server_caps_the_caches_before_it_loads_the_model(tmp_path_factory, monkeypatch):
    pytest.importorskip("fastapi")
    from serve_model import tiny_checkpoint

    from aiayn.cli import build_parser
    from aiayn.serve.cli import run

    ckpt = tiny_checkpoint(tmp_path_factory.getbasetemp())  # shared with the serve tests
    seen = _caps_when_the_model_is_built(monkeypatch)
    with pytest.raises(_Built):
        run(build_parser("serve").parse_args(["serve", "--checkpoint", str(ckpt), "--port", "0"]))
    assert seen == [memory.ONEDNN_CACHES]


# What CUDA's caching allocator says, one long line (torch 2.x).
CUDA_OOM = ("CUDA out of memory. Tried to allocate 3.73 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
            "1.20 GiB is free. Including non-PyTorch memory, this process has 77.98 GiB memory in use. See "
            "documentation for Memory Management (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")


def test_running_out_of_device_memory_in_training_is_one_line_naming_max_tokens(tmp_path, monkeypatch, capsys):
    """A batch too large for the GPU (tests/test_cuda.py makes a real one there) is a flag to lower,
    not a traceback: here the first step raises what CUDA's allocator raises."""
    import torch

    from aiayn.cli import main as cli_main
    from aiayn.trainer import Trainer

    def out_of_memory(self, batches):
        raise torch.cuda.OutOfMemoryError(CUDA_OOM)

    monkeypatch.setattr(Trainer, "train_step", out_of_memory)
    paths = make_corpus(tmp_path / "data")
    assert cli_main(tiny_args(paths, tmp_path / "run", "--max-steps", "2")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("aiayn train: error: --max-tokens 160: out of memory on cpu (CUDA out of memory. Tried to "
                       "allocate 3.73 GiB); lower --max-tokens and raise --update-freq (or set --tokens-per-update) "
                       "to keep the tokens per step")
    assert not any("Traceback" in line for line in err)


def test_other_errors_pass_through_the_out_of_memory_hint():
    import torch

    with pytest.raises(ValueError, match="not memory"):
        with memory.batch_fits(4096, torch.device("cpu")):
            raise ValueError("not memory")
    with pytest.raises(memory.AiaynError, match=r"^--max-tokens 4096: out of memory on cpu \(out of memory\)"):
        with memory.batch_fits(4096, torch.device("cpu")):
            raise torch.cuda.OutOfMemoryError("")
    with pytest.raises(RuntimeError, match="shape mismatch"):  # a RuntimeError of another kind stays one
        with memory.batch_fits(4096, torch.device("cpu")):
            raise RuntimeError("shape mismatch")
    # a CUDA library's allocation failure is a plain RuntimeError: the same one line
    for said in ("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
                 "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"):
        with pytest.raises(memory.AiaynError, match=r"^--max-tokens 4096: out of memory on cpu \(CUDA error: "):
            with memory.batch_fits(4096, torch.device("cpu")):
                raise RuntimeError(said)


class _FakeLibc:
    def __init__(self, calls):
        self.calls = calls

        def mallopt(param, value):
            calls.append((param, value))
            return 1

        self.mallopt = mallopt


def test_keep_freed_memory_sets_both_thresholds_unless_the_environment_does(monkeypatch):
    calls = []
    monkeypatch.setattr(memory.ctypes, "CDLL", lambda name: _FakeLibc(calls))
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    assert memory.keep_freed_memory()
    assert sorted(calls) == [(-3, 32 * 2**20), (-1, 2**30)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    calls.clear()
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")  # the user's own setting wins
    assert memory.keep_freed_memory()
    assert calls == [(-3, 32 * 2**20)]
    calls.clear()
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=131072")  # and under its newer name
    assert memory.keep_freed_memory()
    assert calls == [(-1, 2**30)]


def test_keep_freed_memory_without_glibc_is_a_no(monkeypatch):
    def no_libc(name):
        raise OSError("no C library")

    monkeypatch.setattr(memory.ctypes, "CDLL", no_libc)
    assert memory.keep_freed_memory() is False


def test_keep_freed_memory_takes_in_a_real_process():
    """In a fresh process on this glibc: applied, and blocks freed and taken again are served from the
    heap without new page faults; by default glibc gives the heap's top back to the kernel (past
    twice the largest block freed so far) and every round faults its pages in again."""
    if not hasattr(ctypes.CDLL(None), "mallopt"):
        pytest.skip("no glibc mallopt in this C library")
    code = (
        "import ctypes, resource, sys\n"
        "from aiayn import memory\n"
        "ok = memory.keep_freed_memory() if sys.argv[1] == 'keep' else True\n"
        "libc = ctypes.CDLL(None)\n"
        "libc.malloc.restype = ctypes.c_void_p; libc.malloc.argtypes = [ctypes.c_size_t]\n"
        "libc.free.argtypes = [ctypes.c_void_p]\n"
        "n = 16 * 2**20\n"
        "def round():\n"
        "    ps = [libc.malloc(n) for _ in range(3)]\n"
        "    for p in ps: ctypes.memset(p, 1, n)\n"
        "    for p in ps: libc.free(p)\n"
        "round(); round()\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "for _ in range(3): round()\n"
        "print(ok, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"), env.get("PYTHONPATH", "")])
    faults = {}
    for mode in ("keep", "default"):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, env=env, check=True)
        ok, n = out.stdout.split()
        assert ok == "True"
        faults[mode] = int(n)
    assert faults["keep"] < 1000 < faults["default"], faults  # a round touches 12288 pages of 4 KiB


def test_training_out_of_the_cpus_memory_names_max_tokens():
    """The CPU allocator's error (a plain RuntimeError) is out of memory as CUDA's is: one test of what
    running out looks like serves `batch_fits` and the command line's last line (`memory.out_of_memory`)."""
    from aiayn.errors import AiaynError
    from aiayn.memory import batch_fits

    with pytest.raises(AiaynError, match=r"^--max-tokens 4096: out of memory on cpu \(.*can't allocate memory"):
        with batch_fits(4096, torch.device("cpu")):
            torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: past the address space, refused even where memory is overcommitted
