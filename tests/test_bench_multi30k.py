"""bench/multi30k.sh asks the Python that runs aiayn whether bf16 is worth scoring on this CPU."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "multi30k.sh"


def has_fast_bf16(aiayn: str, path: str) -> subprocess.CompletedProcess:
    """Runs the script's `has_fast_bf16` alone, with $aiayn as the script would have it."""
    body = subprocess.run(["sed", "-n", "/^has_fast_bf16() {/,/^}/p", str(SCRIPT)], capture_output=True,
                          text=True, check=True).stdout
    assert body.strip().endswith("}")
    return subprocess.run([shutil.which("bash"), "-c", f"set -euo pipefail\n{body}\nhas_fast_bf16"], capture_output=True,
                          text=True, env={**os.environ, "aiayn": aiayn, "PATH": path}, timeout=120)


@pytest.mark.parametrize("form", ["python", "python -m aiayn", "script"])
def test_the_answer_comes_from_aiayns_python(form, tmp_path):
    from aiayn.kernels import cpu_has_fast_bf16

    script = tmp_path / "aiayn"  # as pip writes an entry point: its #! names the venv's Python
    script.write_text(f"#!{sys.executable}\nimport sys\n")
    script.chmod(0o755)
    aiayn = {"python": sys.executable, "python -m aiayn": f"{sys.executable} -m aiayn", "script": str(script)}[form]
    r = has_fast_bf16(aiayn, os.environ["PATH"])
    assert r.returncode == 0 and r.stdout == f"{int(cpu_has_fast_bf16())}\n" and r.stderr == ""


def test_an_unknown_aiayn_scores_bf16_and_says_why(tmp_path):
    r = has_fast_bf16("uv run aiayn", str(tmp_path))  # nothing on PATH
    assert r.returncode == 0 and r.stdout == "1\n"
    assert "could not ask aiayn's Python" in r.stderr


FAKE_AIAYN = """#!/usr/bin/env bash
# aiayn's commands as multi30k.sh calls them: train writes 10 epoch checkpoints, evaluate prints a score
echo "$*" >> "$FAKE_LOG"
case "$1" in
  train) while [ $# -gt 0 ]; do case "$1" in --config) [ -f "$2" ] || exit 3;; --out) out=$2;; esac; shift; done
         for i in 1 2 3 4 5 6 7 8 9 10; do mkdir -p "$out/step_$i"; echo {} > "$out/step_$i/config.json"; done ;;
  average) while [ $# -gt 0 ]; do [ "$1" = -o ] && mkdir -p "$2"; shift; done ;;
  evaluate) echo '{"bleu": 30.0}' ;;
esac
"""


def test_runs_from_another_directory_into_a_run_folder_with_odd_characters(tmp_path):
    fake = tmp_path / "aiayn"
    fake.write_text(FAKE_AIAYN)
    fake.chmod(0o755)
    run = tmp_path / "it's a run"
    r = subprocess.run(["bash", str(SCRIPT), "de", "en", "1", "1"], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "AIAYN": str(fake), "RUN": str(run), "FAKE_LOG": str(tmp_path / "log")},
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (run / "scores.jsonl").read_text().count("test_2016_flickr") >= 3
