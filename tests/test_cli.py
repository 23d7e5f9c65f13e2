"""The `aiayn` executable's entry point (`aiayn.cli.entry`), as the console script and
`python -m aiayn` run it."""
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parent.parent / "src")


def _at_exit(args: list[str]) -> subprocess.CompletedProcess:
    """Runs `entry` with `args`; an atexit hook (run before the interpreter's last collection)
    prints how many objects are frozen out of the garbage collector."""
    code = ("import atexit, gc, sys\n"
            "atexit.register(lambda: print('frozen', gc.get_freeze_count(), file=sys.stderr))\n"
            f"sys.argv[1:] = {args!r}\n"
            "from aiayn.cli import entry\n"
            "entry()\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})


def test_the_executable_freezes_what_is_alive_before_the_interpreter_shuts_down(tmp_path):
    """The interpreter's last garbage collection went over every object torch and the model left
    (1-2 s after each command); frozen, it skips them. The exit status is main's."""
    done = _at_exit(["plot", "lr-schedule", "--steps", "100", "--warmup", "10", "-o", str(tmp_path / "lr.png")])
    assert done.returncode == 0, done.stderr
    frozen = int(done.stderr.split("frozen ")[-1].split()[0])
    assert frozen > 10_000, done.stderr  # torch's modules and objects
    bad = _at_exit(["translate", "--checkpoint", "/nonexistent"])
    assert bad.returncode == 2 and "frozen" in bad.stderr
    assert _at_exit(["--version"]).returncode == 0


def test_python_dash_m_runs_the_entry_point():
    done = subprocess.run([sys.executable, "-m", "aiayn", "--version"], capture_output=True, text=True,
                          env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("aiayn ")
