"""`aiayn train`'s run handling (the --out lock, the signals that stop it), from a cold review."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from test_train import _cache, corpus, tiny_args  # noqa: F401 (fixtures: the tokenizer cache in tmp, a tiny corpus)


def _run_doing(at: int, action: str, argv: list[str], on_save: str = "") -> subprocess.CompletedProcess:
    """`aiayn train argv` in a process of its own that runs `action` (Python, with os, signal, sys, time
    and pty imported) as step `at` begins, and `on_save` at each checkpoint save from then on."""
    script = f"""
import os, pty, signal, sys, time
from aiayn import checkpoint, trainer
from aiayn.cli import main

step, save = trainer.Trainer.train_step, checkpoint.save_checkpoint
calls = []

def train_step(self, batches):
    calls.append(1)
    if len(calls) == {at}:
{textwrap.indent(textwrap.dedent(action).strip(), " " * 8)}
    return step(self, batches)

def save_checkpoint(*args, **kwargs):
    if len(calls) >= {at}:
{textwrap.indent(textwrap.dedent(on_save).strip() or "pass", " " * 8)}
    return save(*args, **kwargs)

trainer.Trainer.train_step, checkpoint.save_checkpoint = train_step, save_checkpoint
sys.exit(main(sys.argv[1:]))
"""
    return subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=300)


def _saved_at_step_5(out: Path) -> None:
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 5 and (out / "step_5" / "trainer_state.pt").is_file()  # saved where it stopped


def test_a_terminal_closing_under_a_shell_still_saves_the_run(tmp_path, corpus):
    """A run in the foreground of an interactive shell whose terminal closes takes SIGHUP twice, the
    shell's and the kernel's as the shell exits, milliseconds apart: the second one, taken as a second
    Ctrl-C, killed the run in the middle of the save it had started for the first (exit -1, unsaved).
    Here: SIGHUP during step 5, and again while it saves."""
    out = tmp_path / "run"
    argv = tiny_args(corpus, out, "--max-steps", "1000", "--save-every", "1000", "--log-every", "1")
    hangup = "os.kill(os.getpid(), signal.SIGHUP)"
    done = _run_doing(5, hangup, argv, on_save=hangup)
    assert done.returncode == 128 + signal.SIGHUP, done.stderr
    _saved_at_step_5(out)
    assert "to resume, run: " in done.stdout
    assert sorted(p.name for p in Path(out).iterdir() if p.name.startswith("step_")) == ["step_5"]


def test_ctrl_c_on_a_run_piped_to_tee_still_saves_it(tmp_path, corpus):
    """`aiayn train ... |& tee log`, then Ctrl-C: the tee ended at once, and the progress bar's next write met
    the broken pipe, which ended the run before it saved, with exit 0 (the steps since the last checkpoint lost,
    a script told it finished). Here: during step 5 stdout and stderr become a pipe whose reader is gone (the
    same keystroke reaches the whole pipeline), and SIGINT comes."""
    out = tmp_path / "run"
    argv = tiny_args(corpus, out, "--max-steps", "1000", "--save-every", "1000", "--log-every", "1")
    done = _run_doing(5, """
        read, write = os.pipe()
        os.close(read)  # the tee, gone
        os.dup2(write, 1)
        os.dup2(write, 2)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.1)  # past the progress bar's interval: it writes after this step
    """, argv)
    assert done.returncode == 128 + signal.SIGINT, done.stderr
    _saved_at_step_5(out)


def test_a_disowned_run_trains_on_once_its_terminal_is_gone(tmp_path, corpus):
    """A run left in the background (`& disown`) of a terminal that then closed: the progress bar went quiet,
    but the first validation line met "Input/output error" and ended the run before the epoch's checkpoint.
    Here: after step 3 its output is a terminal that closes and sends it nothing (no job of the shell's, no
    SIGHUP), every write EIO."""
    out = tmp_path / "run"
    argv = tiny_args(corpus, out, "--max-epochs", "2", "--log-every", "1")
    done = _run_doing(3, """
        master, slave = pty.openpty()
        os.dup2(slave, 1)
        os.dup2(slave, 2)
        os.close(slave)
        os.close(master)  # the terminal closes
    """, argv)
    assert done.returncode == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["kind"] == "valid"] == [1, 2]
    last = records[-1]["step"]
    assert (out / f"step_{last}" / "trainer_state.pt").is_file()
