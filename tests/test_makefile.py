"""`make demo > demo.log 2>&1` keeps the whole job's output: the training log, the sentences and
their translations (a `tee /dev/stderr` once reopened the log file and truncated what training wrote)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

MAKEFILE = Path(__file__).resolve().parents[1] / "Makefile"

STUB = """#!/bin/sh
# stands in for aiayn: `train` logs on stdout and stderr, `translate` echoes its input
case "$1" in
  train) echo "stub train: model ready"; echo "stub train: progress" >&2; echo "stub train: stopped" ;;
  translate) while IFS= read -r line; do echo "EN: $line"; done ;;
esac
"""


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("redirect", ["> demo.log 2>&1", "> demo.log 2>> demo.log", "2>&1 | cat > demo.log"])
def test_make_demo_output_survives_a_redirect_to_a_file(tmp_path, redirect):
    stub = tmp_path / "aiayn"
    stub.write_text(STUB)
    stub.chmod(0o755)
    # the real recipe, with the stub for aiayn and `install` taken as done
    cmd = f"make -s -f {MAKEFILE} -o install AIAYN={stub} demo {redirect}"
    res = subprocess.run(cmd, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    log = (tmp_path / "demo.log").read_text()
    for want in ("stub train: model ready", "stub train: progress", "stub train: stopped",
                 "Zwei Hunde spielen im Schnee.", "EN: Zwei Hunde spielen im Schnee."):
        assert want in log, log
    assert log.count("EN: ") == 4, log
