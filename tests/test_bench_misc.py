"""bench/serve.py, bench/paper_bleu.py and bench/scale.py on bad input: one-line errors before any
work, and figures labelled with what was measured; none of them times anything here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import benches

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flags, message", [
    (["--clients", "1,x"], "--clients takes comma-separated whole numbers above 0, got '1,x'"),  # ValueError
    (["--clients", "0"], "--clients takes"),  # IndexError at the first level, after minutes of set-up
    (["--few", "0"], "--few takes a number above 0"),  # the same
    (["--direct", "0"], "--direct takes a number above 0"),  # StatisticsError after every level
    (["--fair-clients", "0"], "--fair-clients takes a number above 0"),  # IndexError at the very end
    (["--fairness", "-1"], "--fairness takes 0 or more"),
])
def test_serve_bench_refuses_bad_counts_before_any_work(flags, message, capsys, monkeypatch):
    pytest.importorskip("httpx")
    bench = benches.load("serve.py")
    monkeypatch.setattr(bench, "read_lines", lambda *a: pytest.fail("started the run"))
    with pytest.raises(SystemExit) as e:
        bench.main(["--checkpoint", "ckpt", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_serve_bench_says_why_aiayn_translate_failed(tmp_path):
    pytest.importorskip("httpx")
    bench = benches.load("serve.py")
    with pytest.raises(SystemExit) as e:  # was CalledProcessError's traceback, the reason left in its stderr
        bench.cli_translations(str(tmp_path / "nothing"), ["Ein Hund."])
    assert str(e.value) == f"aiayn translate: error: checkpoint {tmp_path / 'nothing'} does not exist; pass a " \
                           "checkpoint or run directory"


def test_paper_bleu_keeps_empty_translations_at_the_end(tmp_path, capsys):
    pytest.importorskip("sacremoses")
    pb = benches.load("paper_bleu.py")
    hyps, refs = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyps.write_text("Ein Hund läuft.\n\n", encoding="utf-8")  # the second sentence's translation is empty
    refs.write_text("Ein Hund läuft.\nZwei Katzen.\n", encoding="utf-8")
    assert pb.main([str(hyps), str(refs)]) == 0  # it said "hyp.txt has 1 lines but ref.txt has 2"
    assert capsys.readouterr().out.startswith("sacreBLEU (detokenized, 13a): ")


def test_paper_bleu_names_a_missing_file_in_one_line(tmp_path, capsys):
    pb = benches.load("paper_bleu.py")
    (tmp_path / "ref.txt").write_text("Ein Hund.\n", encoding="utf-8")
    assert pb.main([str(tmp_path / "hyp.txt"), str(tmp_path / "ref.txt")]) == 2  # was FileNotFoundError's traceback
    assert capsys.readouterr().err == f"{tmp_path / 'hyp.txt'}: no such file\n"


@pytest.mark.parametrize("flags, message", [
    (["--pairs", "300", "--small", "1000"], "--small and --old take at most --pairs (300) pairs"),
    (["--pairs", "300", "--small", "300", "--old", "200", "500"], "--small and --old take at most --pairs (300)"),
    (["--pairs", "300", "--small", "300", "--steps", "0"], "take numbers above 0"),
])
def test_scale_bench_refuses_sizes_above_its_corpus(flags, message, tmp_path):
    """A smaller corpus is the head of the --pairs one: asked for more, it measured --pairs pairs under
    the larger size's label (prepare's pairs/s too)."""
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), "--work", str(tmp_path / "w"), *flags],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and message in res.stderr and not (tmp_path / "w").exists()


def test_scale_bench_marks_a_failed_run_in_its_table():
    scale = benches.load("scale.py")
    failed = {"rc": 2, "wall_s": 3.1, "load_avg": 1.0, "rss_main": 200, "rss_tree": 200, "pss_tree": 150,
              "rss_anon": 140, "first_step_s": None}
    assert scale.table_row("train --data-bin 300", failed) == \
        "| train --data-bin | 300 | failed (exit 2; see its log in --work) | | | | |"  # was 3.1 s, first step None
    done = {k: v for k, v in failed.items() if k != "first_step_s"} | {"rc": 0}
    assert scale.table_row("prepare 300", done) == "| prepare | 300 | 3.1 |  | 200 / 200 / 150 | 140 | 1.0 |"


def test_serve_bench_percentiles_are_nearest_rank():
    """round() rounds halves to even: the median of 5 latencies was the 2nd smallest, not the 3rd."""
    pytest.importorskip("httpx")
    percentile = benches.load("serve.py").percentile
    assert percentile([5.0, 1.0, 4.0, 2.0, 3.0], 50) == 3.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0
    assert percentile([1.0, 2.0], 1) == 1.0 and percentile([1.0, 2.0], 100) == 2.0

