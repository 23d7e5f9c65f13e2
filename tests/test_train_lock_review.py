"""`aiayn train`'s run handling (the --out lock, the signals that stop it), from a cold review."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from test_train import _cache, corpus, tiny_args  # noqa: F401 (fixtures: the tokenizer cache in tmp, a tiny corpus)

# The run, in a process of its own: SIGHUP during step 5 (the shell's, to its jobs, as the terminal closes),
# and a second one while it saves (the kernel's, to the terminal's last foreground job, once the shell exits).
_TWO_HANGUPS = """
import os, signal, sys
from aiayn import checkpoint, trainer
from aiayn.cli import main

step, save = trainer.Trainer.train_step, checkpoint.save_checkpoint
calls = []

def train_step(self, batches):
    calls.append(1)
    if len(calls) == 5:
        os.kill(os.getpid(), signal.SIGHUP)
    return step(self, batches)

def save_checkpoint(*args, **kwargs):
    if len(calls) >= 5:
        os.kill(os.getpid(), signal.SIGHUP)
    return save(*args, **kwargs)

trainer.Trainer.train_step, checkpoint.save_checkpoint = train_step, save_checkpoint
sys.exit(main(sys.argv[1:]))
"""


def test_a_terminal_closing_under_a_shell_still_saves_the_run(tmp_path, corpus):
    """A run in the foreground of an interactive shell whose terminal closes takes SIGHUP twice, the
    shell's and the kernel's as the shell exits, milliseconds apart: the second one, taken as a second
    Ctrl-C, killed the run in the middle of the save it had started for the first (exit -1, unsaved)."""
    out = tmp_path / "run"
    argv = tiny_args(corpus, out, "--max-steps", "1000", "--save-every", "1000", "--log-every", "1")
    done = subprocess.run([sys.executable, "-c", _TWO_HANGUPS, *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 128 + signal.SIGHUP, done.stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 5 and (out / "step_5" / "trainer_state.pt").is_file()  # saved where it stopped
    assert "to resume, run: " in done.stdout
    assert sorted(p.name for p in Path(out).iterdir() if p.name.startswith("step_")) == ["step_5"]


# The run, in a process of its own: Ctrl-C during step 5 ends the `tee` its output goes to as well (the same
# keystroke reaches the whole pipeline), so that its stdout and stderr are pipes whose reader is gone.
_CTRL_C_UNDER_TEE = """
import os, signal, sys, time
from aiayn import trainer
from aiayn.cli import main

step = trainer.Trainer.train_step
calls = []

def train_step(self, batches):
    calls.append(1)
    if len(calls) == 5:
        read, write = os.pipe()
        os.close(read)  # the tee, gone
        os.dup2(write, 1)
        os.dup2(write, 2)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.1)  # past the progress bar's interval: it writes after this step
    return step(self, batches)

trainer.Trainer.train_step = train_step
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_on_a_run_piped_to_tee_still_saves_it(tmp_path, corpus):
    """`aiayn train ... |& tee log`, then Ctrl-C: the tee ended at once, and the progress bar's next write met
    the broken pipe, which ended the run before it saved, with exit 0 (the steps since the last checkpoint lost,
    a script told it finished)."""
    out = tmp_path / "run"
    argv = tiny_args(corpus, out, "--max-steps", "1000", "--save-every", "1000", "--log-every", "1")
    done = subprocess.run([sys.executable, "-c", _CTRL_C_UNDER_TEE, *argv], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 128 + signal.SIGINT, done.stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 5 and (out / "step_5" / "trainer_state.pt").is_file()  # saved where it stopped


# The run, in a process of its own, after step 3 on a terminal that closes and sends it nothing (`aiayn train ... &
# disown`, or `setsid`: no job of the shell's, no SIGHUP): its output is a hung-up terminal, every write EIO.
_TERMINAL_GONE_QUIETLY = """
import os, pty, sys
from aiayn import trainer
from aiayn.cli import main

step = trainer.Trainer.train_step
calls = []

def train_step(self, batches):
    calls.append(1)
    if len(calls) == 3:
        master, slave = pty.openpty()
        os.dup2(slave, 1)
        os.dup2(slave, 2)
        os.close(slave)
        os.close(master)  # the terminal closes
    return step(self, batches)

trainer.Trainer.train_step = train_step
sys.exit(main(sys.argv[1:]))
"""


def test_a_disowned_run_trains_on_once_its_terminal_is_gone(tmp_path, corpus):
    """A run left in the background (`& disown`) of a terminal that then closed: the progress bar went quiet,
    but the first validation line met "Input/output error" and ended the run before the epoch's checkpoint."""
    out = tmp_path / "run"
    argv = tiny_args(corpus, out, "--max-epochs", "2", "--log-every", "1")
    done = subprocess.run([sys.executable, "-c", _TERMINAL_GONE_QUIETLY, *argv], capture_output=True, timeout=300)
    assert done.returncode == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["kind"] == "valid"] == [1, 2]
    last = records[-1]["step"]
    assert (out / f"step_{last}" / "trainer_state.pt").is_file()
