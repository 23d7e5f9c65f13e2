"""Nothing lost: a training run killed with SIGKILL at random moments (mid-step, mid-checkpoint-write)
and resumed each time ends with the same weights, bitwise, as a run never interrupted; SIGINT and
SIGTERM finish the step, write a checkpoint and print the command that resumes."""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train import make_corpus, tiny_args, train_cli

from aiayn.checkpoint import load_checkpoint


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


# Generous limits: CI machines are slow and shared; every wait below ends as soon as its event happens.
STARTUP_S, RUN_S = 300.0, 600.0


def _start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "w") as f:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "aiayn", *argv], stdout=f, stderr=subprocess.STDOUT, env=env)


def _wait_for(log: Path, text: str, proc: subprocess.Popen, timeout: float = STARTUP_S) -> bool:
    """Waits until the run prints `text` (its setup is done); False if it exited first."""
    end = time.time() + timeout
    while time.time() < end:
        if text in log.read_text(errors="replace"):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    raise AssertionError(f"no {text!r} in {log} after {timeout}s")


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _logged_steps(run: Path) -> list[int]:
    try:
        text = (run / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    return [int(m) for m in re.findall(r'"kind": "train", "step": (\d+)', text)]


def _train_losses(run: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs if r["kind"] == "train"]
    assert len(steps) == len(set(steps)), "a resumed run must not log a step twice"
    return {r["step"]: r["loss"] for r in recs if r["kind"] == "train"}


def test_sigkill_at_random_moments_then_resume_equals_an_uninterrupted_run(tmp_path):
    corpus = make_corpus(tmp_path / "data", n_train=120)
    steps = 36  # about two epochs, so a resume also crosses an epoch end with validation
    extra = ["--max-steps", str(steps), "--save-every", "1", "--keep-last", "2", "--dropout", "0.1", "--log-every", "1"]
    env = _env(tmp_path)
    ref = tmp_path / "ref"
    train_cli(tiny_args(corpus, ref, *extra))  # in this process, also one thread, fp32

    run = tmp_path / "run"
    argv = tiny_args(corpus, run, *extra, "--resume")
    rng = random.Random(20240601)
    kills, progress, torn = 0, [], 0
    for attempt in range(5):
        log = tmp_path / f"log{attempt}.txt"
        proc = _start(argv, log, env)
        if _wait_for(log, "device cpu", proc):
            # Kill a few steps further on, measured by the metrics log, plus a random fraction of the
            # step time measured meanwhile (a fixed delay would be many steps on a fast machine, so the
            # run could finish unkilled): the kill lands in a step, a checkpoint write or validation.
            target = max(_logged_steps(run), default=0) + rng.randint(1, 5)
            seen = [(time.monotonic(), max(_logged_steps(run), default=0))]  # (when, newest logged step)
            deadline = time.monotonic() + RUN_S
            while proc.poll() is None and seen[-1][1] < target:
                assert time.monotonic() < deadline, f"no step {target} logged after {RUN_S}s"
                now = max(_logged_steps(run), default=0)
                if now != seen[-1][1]:
                    seen.append((time.monotonic(), now))
                time.sleep(0.005)
            (t1, s1), (t2, s2) = seen[min(1, len(seen) - 1)], seen[-1]  # from the first new step on: no start-up
            step_s = (t2 - t1) / (s2 - s1) if s2 > s1 else 0.05
            time.sleep(rng.uniform(0.0, 1.5 * step_s))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
        proc.wait(timeout=RUN_S)
        torn += bool(list(run.glob(".tmp-*")))  # killed while writing a checkpoint
        done = [int(p.name[5:]) for p in run.glob("step_*") if (p / "config.json").exists()]
        progress.append(max(done, default=0))
    assert kills >= 4, f"only {kills} kills landed; progress {progress}"
    print(f"kills {kills}, checkpoints after each {progress}, {torn} during a checkpoint write")
    log = tmp_path / "final.txt"
    proc = _start(argv, log, env)
    assert proc.wait(timeout=RUN_S) == 0, log.read_text()
    assert load_checkpoint(run / f"step_{steps}").config["step"] == steps
    a = load_file(str(ref / f"step_{steps}" / "model.safetensors"))
    b = load_file(str(run / f"step_{steps}" / "model.safetensors"))
    assert _same(a, b), f"weights differ after kills at {progress}"
    # the optimizer state and the logged losses match too
    sa = load_checkpoint(ref / f"step_{steps}", with_trainer_state=True).trainer_state
    sb = load_checkpoint(run / f"step_{steps}", with_trainer_state=True).trainer_state
    for k, v in sa["optimizer"]["state"].items():
        assert torch.equal(v["exp_avg_sq"], sb["optimizer"]["state"][k]["exp_avg_sq"])
    assert (sa["epoch"], sa["position"]) == (sb["epoch"], sb["position"])
    assert _train_losses(run) == _train_losses(ref)
    assert not list(run.glob(".tmp-*"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_the_step_saves_and_says_how_to_resume(tmp_path, sig):
    corpus = make_corpus(tmp_path / "data", n_train=120)
    run = tmp_path / "run"
    steps = 400
    argv = tiny_args(corpus, run, "--max-steps", str(steps), "--save-every", "0", "--log-every", "1")
    env = _env(tmp_path)
    log = tmp_path / "log.txt"
    proc = _start(argv, log, env)
    assert _wait_for(log, "device cpu", proc)
    end = time.time() + STARTUP_S
    while max(_logged_steps(run), default=0) < 2 and proc.poll() is None:  # a signal in the middle of the run
        assert time.time() < end, f"no training step logged after {STARTUP_S}s"
        time.sleep(0.01)
    proc.send_signal(sig)
    rc = proc.wait(timeout=RUN_S)
    text = log.read_text()
    assert rc == 128 + sig, text
    name = signal.Signals(sig).name
    m = re.search(rf"stopped: interrupted by {name}; step (\d+); last checkpoint (\S+)", text)
    assert m, text
    step = int(m.group(1))
    assert 0 < step < steps and Path(m.group(2)) == run / f"step_{step}"
    state = load_checkpoint(run / f"step_{step}", with_trainer_state=True).trainer_state
    assert state["step"] == step
    cmd = re.search(r"to resume, run: (aiayn train .*)", text).group(1)
    words = shlex.split(cmd)
    assert words[:2] == ["aiayn", "train"] and words[-1] == "--resume" and words[2:-1] == argv[1:]
    # the printed command resumes from that step, and the run finishes
    tail = ["--max-steps", str(step + 3)]  # (a shorter limit, to keep the test quick)
    proc = _start(words[1:] + tail, tmp_path / "log2.txt", env)
    assert proc.wait(timeout=RUN_S) == 0, (tmp_path / "log2.txt").read_text()
    assert f"resuming from {run / f'step_{step}'}" in (tmp_path / "log2.txt").read_text()
    assert sorted(_train_losses(run)) == list(range(1, step + 4))


# Run as `python KILLER WHERE N aiayn-args...`: `aiayn` that SIGKILLs itself inside its N-th step checkpoint
# write, at WHERE: "fill" (after the weights, before the trainer state and config.json) or "fsync" (every
# file written and synced, the temporary directory not yet renamed into place).
KILLER = '''
import os, signal, sys
from pathlib import Path
import aiayn.checkpoint as C
from aiayn.cli import main

where, n, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
seen = [0]

def die_at(k):
    seen[0] += 1
    if seen[0] == k:
        os.kill(os.getpid(), signal.SIGKILL)

if where == "fill":
    real_save = C.save_file
    def save_file(tensors, path, *a, **kw):
        real_save(tensors, path, *a, **kw)
        if "step_" in Path(path).parent.name:  # a step checkpoint's weights, wherever they are written
            die_at(n)
    C.save_file = save_file
else:
    real_fsync = C.fsync_path
    def fsync_path(path):
        real_fsync(path)
        if "step_" in Path(path).name:  # a step checkpoint's folder, synced once its files are
            die_at(n)
    C.fsync_path = fsync_path
sys.exit(main(argv))
'''


def test_sigkill_inside_a_checkpoint_write_then_resume_equals_an_uninterrupted_run(tmp_path):
    """The random kills above land in a write only by chance; these two land inside one on purpose."""
    corpus = make_corpus(tmp_path / "data", n_train=120)
    steps = 8
    extra = ["--max-steps", str(steps), "--save-every", "1", "--keep-last", "2", "--dropout", "0.1", "--log-every", "1"]
    env = _env(tmp_path)
    ref = tmp_path / "ref"
    train_cli(tiny_args(corpus, ref, *extra))
    killer = tmp_path / "killer.py"
    killer.write_text(KILLER)
    run = tmp_path / "run"
    argv = tiny_args(corpus, run, *extra, "--resume")
    for where, n, written in (("fill", 3, 2), ("fsync", 2, 3)):  # the 3rd write of a fresh run; the 2nd after resuming
        log = tmp_path / f"{where}.txt"
        with open(log, "w") as f:
            rc = subprocess.run([sys.executable, str(killer), where, str(n), *argv], stdout=f, stderr=subprocess.STDOUT,
                                env=env, timeout=RUN_S).returncode
        assert rc == -signal.SIGKILL, log.read_text()
        torn = [p.name for p in run.glob(".tmp-step_*")]
        assert len(torn) == 1 and torn[0].startswith(f".tmp-step_{written + 1}-"), torn  # killed inside that write
        kept = [p.name for p in run.glob(".tmp-step_*/*")]
        assert ("config.json" in kept) == (where == "fsync") and "model.safetensors" in kept, kept
        assert max(int(p.name[5:]) for p in run.glob("step_*")) == written
    log = tmp_path / "final.txt"
    proc = _start(argv, log, env)
    assert proc.wait(timeout=RUN_S) == 0, log.read_text()
    a = load_file(str(ref / f"step_{steps}" / "model.safetensors"))
    b = load_file(str(run / f"step_{steps}" / "model.safetensors"))
    assert _same(a, b)
    assert _train_losses(run) == _train_losses(ref)
    assert not list(run.glob(".tmp-*"))  # the torn writes were cleared away
