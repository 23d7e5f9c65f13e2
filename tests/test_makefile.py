"""`make demo`: it trains with configs/demo.toml, prints each sentence beside its translation and the
commands to run next, and `make demo > demo.log 2>&1` keeps the whole job's output (a `tee
/dev/stderr` once reopened the log file and truncated what training wrote)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aiayn import train_options as TO
from aiayn.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
MAKEFILE = ROOT / "Makefile"

STUB = """#!/bin/sh
# stands in for aiayn: `train` makes its --out and logs on stdout and stderr, `translate` echoes its input
case "$1" in
  train) while [ "$#" -gt 0 ]; do
           [ "$1" = --out ] && mkdir -p "$2" && printf '%s\n' '{"kind": "valid", "step": 5, "bleu": 31.5}' \
             '{"kind": "valid", "step": 9, "bleu": 30.25}' > "$2/metrics.jsonl"; shift; done
         echo "stub train: model ready"; echo "stub train: progress" >&2; echo "stub train: stopped" ;;
  translate) while IFS= read -r line; do echo "EN: $line"; done ;;
esac
"""
SENTENCES = ["Ein Mann fährt mit dem Fahrrad eine Straße entlang.", "Zwei Hunde spielen im Schnee.",
             "Eine Frau in einem roten Kleid singt auf einer Bühne.", "Kinder spielen Fußball auf einer Wiese."]


def make_demo(tmp_path: Path, redirect: str) -> str:
    """The real recipe, with the stub for aiayn and `install` taken as done; returns demo.log."""
    stub = tmp_path / "aiayn"
    stub.write_text(STUB)
    stub.chmod(0o755)
    cmd = f"make -s -f {MAKEFILE} -o install AIAYN={stub} PY={sys.executable} demo {redirect}"
    res = subprocess.run(cmd, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return (tmp_path / "demo.log").read_text(encoding="utf-8")


needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


@needs_make
@pytest.mark.parametrize("redirect", ["> demo.log 2>&1", "> demo.log 2>> demo.log", "2>&1 | cat > demo.log"])
def test_make_demo_output_survives_a_redirect_to_a_file(tmp_path, redirect):
    log = make_demo(tmp_path, redirect)
    for want in ("stub train: model ready", "stub train: progress", "stub train: stopped",
                 "Zwei Hunde spielen im Schnee.", "EN: Zwei Hunde spielen im Schnee."):
        assert want in log, log
    assert log.count("EN: ") == 4, log


@needs_make
def test_make_demo_prints_each_sentence_beside_its_translation_aligned(tmp_path):
    lines = make_demo(tmp_path, "> demo.log 2>&1").splitlines()
    pairs = [line for line in lines if " ->  EN: " in line]
    assert [p.split("->")[0].strip() for p in pairs] == SENTENCES
    assert [p.split("->  ")[1] for p in pairs] == [f"EN: {s}" for s in SENTENCES]
    assert len({p.index("->") for p in pairs}) == 1, pairs  # one column, counted in characters (ä, ß)
    assert "runs/demo/best: validation BLEU 31.50 (step 5); its translations:" in lines  # the best, not the last


@needs_make
def test_make_demo_says_what_to_do_next_with_commands_that_parse(tmp_path):
    log = make_demo(tmp_path, "> demo.log 2>&1")
    stub = str(tmp_path / "aiayn")
    nxt = log[log.index("Next:"):].splitlines()[1:]
    commands = [shlex.split(line.split("#")[0].split("&&")[-1]) for line in nxt if stub in line]
    wanted = {("plot", "attention"), ("plot", "curves"), ("serve",)}
    assert {tuple(c[1:3]) if c[1] == "plot" else (c[1],) for c in commands} == wanted
    for c in commands:
        assert c[0] == stub
        args = build_parser(c[1]).parse_args(c[1:])  # the real command line takes them
        assert args.checkpoint == (["runs/demo"] if c[1] == "serve" else "runs/demo")  # serve: once per pair
    assert any("pip install -e '.[serve]'" in line for line in nxt)  # serve's packages first
    assert any(line.strip().startswith("make multi30k") for line in nxt)
    assert "http://127.0.0.1:8000/" in log


def test_make_demo_trains_with_its_own_recipe():
    recipe = MAKEFILE.read_text(encoding="utf-8").split("\ndemo:")[1].split("\n\n")[0]
    assert "--config configs/demo.toml" in recipe and "multi30k.toml" not in recipe
    args = build_parser("train").parse_args(["train", "--config", str(ROOT / "configs" / "demo.toml")])
    _, _, tc = TO.build_configs(args)
    assert tc.data == "multi30k" and tc.valid_bleu >= 1014  # scored on the whole of Multi30k val
