"""`aiayn train` as a user runs it, from a cold review: what two runs in one --out, and the --config
file behind a fine-tuning's refusal, do."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_train import _cache, corpus, tiny_args  # noqa: F401 (fixtures: the tokenizer cache in tmp, a tiny corpus)

from aiayn.cli import main as cli_main

STARTUP_S = 300.0  # generous: CI machines are slow and shared; the wait ends once the event happens


def test_a_second_train_in_a_running_runs_out_is_refused_and_leaves_the_first_alone(tmp_path, corpus, capsys):
    """The resume command run while the run still trained (a second terminal, a job started again by its
    scheduler) trained beside it: both wrote metrics.jsonl (steps interleaved and logged twice) and
    step_<N>/, and its clean-up of temporaries could take the checkpoint the first was writing."""
    out = tmp_path / "run"
    argv = tiny_args(corpus, out, "--max-steps", "100000", "--save-every", "3", "--log-every", "1")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "log.txt", "w") as log:
        first = subprocess.Popen([sys.executable, "-m", "aiayn", *argv], stdout=log, stderr=subprocess.STDOUT,
                                 env=env)
    try:
        end = time.time() + STARTUP_S
        while not list(out.glob("step_*")):
            assert first.poll() is None and time.time() < end, (tmp_path / "log.txt").read_text()
            time.sleep(0.05)
        assert cli_main(["train", "--out", str(out), "--resume", "--max-steps", "1"]) == 2
        err = capsys.readouterr().err
        assert err == (f"aiayn train: error: --out {out}: another aiayn train is running there; let it finish or "
                       "stop it (Ctrl-C saves it), then resume, or choose another --out\n")
        assert first.poll() is None  # still training
    finally:
        first.send_signal(signal.SIGINT)
        rc = first.wait(timeout=STARTUP_S)
    assert rc == 130, (tmp_path / "log.txt").read_text()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps == list(range(1, len(steps) + 1))  # one run's lines, each step once
    # the first one gone, the same command goes on (the kernel let the lock go)
    assert cli_main(["train", "--out", str(out), "--resume", "--max-steps", str(steps[-1] + 1)]) == 0


def test_a_config_files_model_option_that_differs_from_init_from_is_named_with_the_file(tmp_path, corpus, capsys):
    """A recipe for a model trained from scratch (configs/multi30k.toml's d_ff 1024, say) beside --init-from
    was refused as "--d-ff 1024 differs ...; drop the option": a flag the command did not hold."""
    base = tmp_path / "base"
    assert cli_main(tiny_args(corpus, base, "--max-steps", "1")) == 0  # a tiny model: d_model 32, d_ff 64
    capsys.readouterr()
    recipe = tmp_path / "recipe.toml"
    recipe.write_text("[model]\nd_ff = 1024\ndropout = 0.3\n", encoding="utf-8")
    out = tmp_path / "tuned"
    args = ["train", "--config", str(recipe), "--init-from", str(base), "--train-src", corpus["train_src"],
            "--train-tgt", corpus["train_tgt"], "--max-steps", "1", "--precision", "fp32", "--out", str(out)]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert err == (f"aiayn train: error: --config {recipe}: d_ff = 1024 differs from --init-from {base}'s 64: a "
                   "fine-tuned model keeps its shape; remove d_ff from the file\n")
    assert not out.exists()
    # a flag over the file's value is the command's own, and named as one
    assert cli_main(args + ["--d-ff", "128"]) == 2
    assert "error: --d-ff 128 differs from --init-from" in capsys.readouterr().err
    # the file's dropout is free, as a flag's is
    assert cli_main(args + ["--d-ff", "64"]) == 0
    assert json.loads((out / "train.json").read_text())["model"]["dropout"] == 0.3


def _start(tmp_path, corpus, out, **popen):
    """A real `aiayn train` in its own process, once it has saved its first checkpoint."""
    argv = tiny_args(corpus, out, "--max-steps", "100000", "--save-every", "3", "--log-every", "1")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "log.txt", "w") as log:
        run = subprocess.Popen([sys.executable, "-m", "aiayn", *argv], stdout=log, stderr=subprocess.STDOUT, env=env,
                               **popen)
    end = time.time() + STARTUP_S
    while not list(out.glob("step_*")):
        assert run.poll() is None and time.time() < end, (tmp_path / "log.txt").read_text()
        time.sleep(0.05)
    return run


def _train_steps(out) -> list[int]:
    """The train lines' steps so far (a last line still being written is left out)."""
    records = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            break
    return [r["step"] for r in records if r["kind"] == "train"]


def test_a_closed_terminal_saves_the_run_as_ctrl_c_does(tmp_path, corpus):
    """SIGHUP (the terminal a run was started from closed) ended the process at once, losing up to
    --save-every steps; translate and export already took it as Ctrl-C."""
    out = tmp_path / "run"
    run = _start(tmp_path, corpus, out)
    run.send_signal(signal.SIGHUP)
    assert run.wait(timeout=STARTUP_S) == 128 + signal.SIGHUP, (tmp_path / "log.txt").read_text()
    last = _train_steps(out)[-1]
    assert (out / f"step_{last}").is_dir()  # saved where it stopped
    assert "--resume" in (tmp_path / "log.txt").read_text()


def test_a_signal_ignored_at_start_stays_ignored(tmp_path, corpus):
    """A run started with Ctrl-C ignored (a script's background job) took it over anyway and stopped."""
    out = tmp_path / "run"
    run = _start(tmp_path, corpus, out, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        run.send_signal(signal.SIGINT)
        seen = len(_train_steps(out))
        end = time.time() + STARTUP_S
        while len(_train_steps(out)) < seen + 3:  # it trains on
            assert run.poll() is None and time.time() < end, (tmp_path / "log.txt").read_text()
            time.sleep(0.05)
    finally:
        run.send_signal(signal.SIGTERM)
        rc = run.wait(timeout=STARTUP_S)
    assert rc == 128 + signal.SIGTERM, (tmp_path / "log.txt").read_text()


def test_a_run_refused_by_the_lock_leaves_the_other_runs_new_out(tmp_path):
    """Two new runs into one --out at once: B saw no --out yet (a folder it would make), A made it and took
    the lock, B found it empty, was refused by the lock, and removed A's folder on its way out."""
    import pytest

    from aiayn.errors import AiaynError
    from aiayn.rundir import RunLock, open_run_dir, removed_if_left_empty
    from aiayn.trainer import Dist

    out, d = tmp_path / "run", Dist()
    with pytest.raises(AiaynError, match="another aiayn train is running there"):
        with removed_if_left_empty(out, True):  # B: --out is not there yet
            with RunLock(out, True) as a:  # A makes it and takes it meanwhile
                open_run_dir(out, False, d)
                a.take()
                open_run_dir(out, False, d)  # B finds it new and empty ...
                RunLock(out, True).take()  # ... and is refused
    assert out.is_dir()  # A's folder stays


def test_a_run_whose_terminal_closes_saves_and_exits_as_stopped(tmp_path, corpus):
    """The run's own terminal closed (SIGHUP and the terminal gone at once, as the kernel does it): the
    run saved, but its closing line met "Input/output error" and it exited 1 (2 with stderr elsewhere)."""
    import fcntl
    import pty
    import select
    import termios
    import threading

    master, slave = pty.openpty()
    out = tmp_path / "run"
    argv = tiny_args(corpus, out, "--max-steps", "100000", "--save-every", "3", "--log-every", "1")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}

    def own_terminal():  # the pty becomes the run's controlling terminal (it leads a new session)
        fcntl.ioctl(1, termios.TIOCSCTTY, 0)

    run = subprocess.Popen([sys.executable, "-m", "aiayn", *argv], stdin=slave, stdout=slave, stderr=slave, env=env,
                           start_new_session=True, preexec_fn=own_terminal)
    os.close(slave)
    stop, seen = threading.Event(), bytearray()

    def drain():  # a terminal shows what it is sent
        while not stop.is_set():
            if select.select([master], [], [], 0.05)[0]:
                try:
                    seen.extend(os.read(master, 65536))
                except OSError:
                    return

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        end = time.time() + STARTUP_S
        while not list(out.glob("step_*")):
            assert run.poll() is None and time.time() < end, seen.decode(errors="replace")
            time.sleep(0.05)
    finally:
        stop.set()
        reader.join()
        os.close(master)  # the terminal closes: the kernel hangs it up and sends SIGHUP
    assert run.wait(timeout=STARTUP_S) == 128 + signal.SIGHUP, seen.decode(errors="replace")
    last = _train_steps(out)[-1]
    assert (out / f"step_{last}").is_dir()  # saved where it stopped
