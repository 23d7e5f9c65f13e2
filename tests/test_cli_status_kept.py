"""`aiayn.cli.main` flushes a command's last lines itself: a reader gone by then must not turn the
command's own exit status (130 after Ctrl-C, 128+N after a signal) into a success."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = str(Path(__file__).resolve().parent.parent / "src")


def test_a_reader_gone_at_the_closing_flush_keeps_the_commands_exit_status(tmp_path):
    """`aiayn translate ... | head` stopped by Ctrl-C or a group SIGTERM returns 130 (143) with lines
    still buffered; the flush in main then met the closed pipe and main returned 0."""
    (tmp_path / "stopped_cmd.py").write_text(textwrap.dedent("""
        import sys
        def add_arguments(p): pass
        def run(args):
            print("a line still in Python's buffer")  # (stdout is a pipe: block-buffered)
            return 130
    """), encoding="utf-8")
    driver = ("import sys; from aiayn import cli; cli.COMMANDS['stopped'] = ('stopped_cmd', 'x'); "
              "sys.exit(cli.main(['stopped']))")
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the command writes
    with os.fdopen(w, "w") as gone:
        done = subprocess.run([sys.executable, "-c", driver], stdout=gone, stderr=subprocess.PIPE, text=True,
                              timeout=120, env={"PYTHONPATH": f"{SRC}:{tmp_path}", "PATH": "/usr/bin:/bin"})
    assert (done.returncode, done.stderr) == (130, "")
