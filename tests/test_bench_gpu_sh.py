"""bench/gpu.sh in its dry mode (every step tiny on the CPU): the steps run, time out, fail and report
as the GPU run will; OUTDIR holds the few flat files a device call brings back. Nothing is measured."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu.sh"
CUDA_TESTS = ROOT / "tests" / "test_cuda.py"


def gpu_sh(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """bench/gpu.sh with `args`; `timeout` only guards against a hang (its steps have their own limits, of
    300 s: a busy 2-core machine took longer than 300 s for the whole of part 1)."""
    environment = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    environment.pop("GPU_SH_DRY", None)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=environment,
                          timeout=timeout, cwd=ROOT)


def steps(out: Path) -> dict[str, list[str]]:
    """summary.md's step rows: name -> [status, seconds, limit, note]."""
    rows = re.findall(r"^\| (\w+) \| (.+?) \| (\d+) \| (\d+) \| (.*) \|$", (out / "summary.md").read_text(), re.M)
    return {r[0]: list(r[1:]) for r in rows if r[0] != "step"}


def stub_tests(tmp_path: Path, body: str) -> str:
    path = tmp_path / "test_stub_cuda.py"
    path.write_text(f"import time\n\nimport pytest\n\npytestmark = pytest.mark.cuda\n\n\ndef test_stub():\n    {body}\n")
    return str(path)


@pytest.mark.slow
def test_part_1_runs_the_cuda_tests_and_the_training_bench(tmp_path):
    out = tmp_path / "out"
    # the CUDA test module skips itself without CUDA; a stand-in until helper gpu's module is merged
    env = {} if CUDA_TESTS.exists() else {"GPU_SH_CUDA_TESTS": stub_tests(tmp_path, "pass")}
    r = gpu_sh(str(out), "1", "--cpu-smoke", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    s = steps(out)
    assert list(s) == ["cuda_tests", "train_profile", "train_throughput"] and all(v[0] == "ok" for v in s.values())
    assert "dry run on the CPU" in (out / "summary.md").read_text()
    assert re.search(r"^torch \S+ CUDA \S+ \| no CUDA device$", (out / "summary.md").read_text(), re.M)
    files = {p.name for p in out.iterdir()}
    assert {"summary.md", "gpu.log", "cuda_tests.xml", "gpu_profile.md", "gpu_train.md", "gpu_train.json"} <= files
    assert "aten::" in (out / "gpu_profile.md").read_text()  # the profiler's operator table
    if CUDA_TESTS.exists():  # the dry run runs the CUDA module on the CPU: its reports are made
        assert {"cuda.md", "sdpa_kernels.md"} <= files
    assert len(files) <= 8 and all(p.is_file() for p in out.iterdir())  # what one device call brings back
    assert json.loads((out / "gpu_train.json").read_text())["done"]
    assert "| tiny | 400 | aiayn | 1 |" in r.stdout  # the tables end the output (a device call returns its tail)


@pytest.mark.slow
def test_a_step_that_times_out_or_fails_does_not_stop_the_others(tmp_path):
    out = tmp_path / "out"
    pid = tmp_path / "pid"  # the stub catches TERM, as `aiayn train` does: the KILL must still end it
    body = (f"import os, signal; open({str(pid)!r}, 'w').write(str(os.getpid())); "
            "signal.signal(signal.SIGTERM, lambda *a: None); time.sleep(60)")
    env = {"GPU_SH_CUDA_TESTS": stub_tests(tmp_path, body), "GPU_SH_T_CUDA_TESTS": "3", "GPU_SH_KILL_AFTER": "2",
           "GPU_TRAIN_FLAGS": "--precision fp8"}  # the bench refuses this at once
    out.mkdir()
    (out / "gpu_train.md").write_text("a table from an earlier run\n")
    r = gpu_sh(str(out), "1", "--cpu-smoke", env=env)
    assert r.returncode == 1
    s = steps(out)
    assert s["cuda_tests"][0] == "TIMED OUT after 3 s" and int(s["cuda_tests"][1]) < 30
    status = Path(f"/proc/{pid.read_text()}/status")  # the step is gone (or a zombie nobody reaped),
    assert not status.exists() or "State:\tZ" in status.read_text()  # not running beside the next one
    assert s["train_throughput"][0] == "FAILED (exit 2)"
    assert "invalid choice: 'fp8'" in (out / "gpu.log").read_text()
    assert not (out / "gpu_train.md").exists()  # no stale table passes for this run's


@pytest.mark.slow
def test_part_2_trains_averages_and_scores_a_tiny_multi30k(tmp_path):
    out = tmp_path / "out"
    recipe = ROOT / "configs" / "multi30k-gpu.toml"  # helper gpu's recipe; the CPU one stands in until merged
    env = {"GPU_SH_DRY": "1"} if recipe.exists() else {"GPU_SH_MULTI30K_CONFIG": "configs/multi30k.toml"}
    r = gpu_sh(str(out), "2", "--cpu-smoke", env=env)
    s = steps(out)
    assert list(s) == ["multi30k", "decode"]
    assert s["multi30k"][0] == "ok", (out / "gpu.log").read_text()[-3000:]
    score = json.loads((out / "multi30k.json").read_text())
    assert score["beam"] == 4 and score["bleu"] >= 0 and score["source"].endswith("test_2016_flickr.de")
    if re.search(r"^DECODE_WIRED=1$", SCRIPT.read_text(), re.M):
        assert s["decode"][0] == "ok" and r.returncode == 0
        assert "## aiayn fp32, beam 4: " in (out / "decode_profile.md").read_text()  # where a search's time goes
    else:  # not wired yet: the summary says so
        assert "PLACEHOLDER, not wired yet" in s["decode"][3]
    assert not any(p.is_dir() for p in out.iterdir())  # checkpoints stay out of OUTDIR


def test_bad_arguments_get_one_line(tmp_path):
    r = gpu_sh(str(tmp_path), "3")
    assert r.returncode == 2 and r.stderr.startswith("bench/gpu.sh: part must be 1, 2 or all, got '3'")
    r = gpu_sh()
    assert r.returncode == 2 and r.stderr.startswith("usage: bash bench/gpu.sh OUTDIR")


def test_without_cuda_the_real_run_stops_at_once(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = gpu_sh(str(tmp_path), "1")
    assert r.returncode == 2
    assert r.stderr.strip() == ("bench/gpu.sh: torch sees no CUDA device; GPU_SH_DRY=1 (or --cpu-smoke) runs the "
                                "steps on the CPU")
    assert "cuda_tests" not in (tmp_path / "summary.md").read_text()
