"""bench/engines.py (aiayn against HF `generate` on the exported Marian model) runs end to end in the
form bench/gpu.sh runs it on a GPU (`--device`, `--quick`, `--json`), here on the CPU; not timed."""

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

import benches

BENCH = Path(__file__).resolve().parents[1] / "bench"
DATA = os.environ.get("AIAYN_DATA")
pytestmark = pytest.mark.skipif(not DATA or not Path(DATA, "multi30k").is_dir(), reason="AIAYN_DATA (Multi30k) not set")


def _bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # engines.py imports its batches from bench/decode.py
    return benches.load("engines.py")


def test_quick_run_on_a_device_prints_both_systems_bleu_and_agreement(capsys, monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    bench = _bench(monkeypatch)
    monkeypatch.setattr(bench, "cpu_has_fast_bf16", lambda: True)  # bf16 rows too, on any CPU
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--device", "cpu", "--quick", "--preset", "tiny", "--vocab-size", "1000", "--skip", "ct2",
                           "--threads", "1", "--max-tokens", "400", "--json", str(tmp_path / "rows.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "48 sentences of test_2016_flickr.de" in out and "device cpu;" in out
    for system in ("aiayn fp32", "aiayn bf16"):
        for mode in ("greedy", "beam 4"):
            assert re.search(rf"^\| {system} \| {mode} \| [\d.]+ \| [\d.]+ \| \d+ \| \d+\.\d\dx \| \d+\.\d\d \| \d+/48 \|$",
                             out, re.M), (system, mode)
    # the same search on the same weights in HF: greedy gives aiayn's tokens for every sentence
    assert re.search(r"^\| HF generate \([\d.]+\) \| greedy \| .* \| 48/48 \|$", out, re.M)
    assert re.search(r"^aiayn fp32 beam 4: faster than HF \d+\.\d\dx$", out, re.M)
    for system in ("aiayn fp32, Python step", "aiayn bf16, Python step"):  # each the same as its compiled row
        for mode in ("greedy", "beam 4"):
            assert re.search(rf"^\| {system} \| {mode} \| .* \| 48/48 \|$", out, re.M), (system, mode)
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert rows["device"] == "cpu" and rows["n"] == 48
    assert {(r["system"], r["search"]) for r in rows["rows"]} >= {("aiayn fp32", "beam 4"), ("aiayn bf16", "greedy"),
                                                                 ("aiayn fp32, Python step", "beam 4")}
    assert all(r["sentences_per_s"] > 0 and 0 <= r["identical"] <= 48 for r in rows["rows"])


def test_a_missing_peer_is_left_out_with_a_note(capsys, monkeypatch):
    bench = _bench(monkeypatch)
    real = importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--device", "cpu", "--n", "3", "--preset", "tiny", "--vocab-size", "1000",
                           "--skip", "ct2,bf16", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    got = capsys.readouterr()
    assert "transformers is not installed; skipping it (as --skip hf)" in got.err
    assert "HF generate" not in got.out and re.search(r"^\| aiayn fp32 \| beam 4 \|", got.out, re.M)


def test_the_python_step_row_turns_the_compiled_step_off_for_its_search_only(monkeypatch):
    bench = _bench(monkeypatch)
    seen = []

    def search(idx):
        seen.append(bench.step.COMPILED_STEPS)
        if idx == [1]:
            raise RuntimeError("out of memory")
        return [[5]]

    assert bench.python_step(search)([0]) == [[5]]
    with pytest.raises(RuntimeError):
        bench.python_step(search)([1])
    assert seen == [False, False] and bench.step.COMPILED_STEPS is True


@pytest.mark.parametrize("args, message", [
    (["--n", "0"], "--n: expected a number above 0"),  # ran all 1000 sentences
    (["--n", "-5"], "--n: expected a number above 0"),  # ran 995, or a negative count of them
    (["--beam", "0"], "--beam: expected a number above 0"),  # a traceback after the greedy timings
    (["--batch-size", "0"], "--batch-size: expected a number above 0"),
    (["--threads", "-1"], "--threads must be 0"),  # torch's traceback
    (["--skip", "hf,ct"], "--skip ct: not a part; give any of bf16,hf,ct2,int8,python-step"),  # ran ct2
    (["--device", "gpu"], "--device: cpu or cuda[:N], got 'gpu'"),
])
def test_bad_arguments_are_one_line_errors_before_any_work(args, message, capsys, monkeypatch):
    bench = _bench(monkeypatch)
    monkeypatch.setattr(bench, "multi30k_paths", lambda *a: pytest.fail("started the run"))
    with pytest.raises(SystemExit) as e:
        bench.main(["--preset", "tiny", "--vocab-size", "1000", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_path_that_is_no_checkpoint_is_a_one_line_error(monkeypatch, tmp_path):
    bench = _bench(monkeypatch)
    with pytest.raises(SystemExit) as e:  # was AiaynError's traceback
        bench.main(["--checkpoint", str(tmp_path), "--n", "2"])
    assert str(e.value).startswith("engines.py: error: ") and "holds no checkpoint" in str(e.value)


def test_aiayns_alpha_0_row_is_counted_against_aiayn_fp32_not_itself(monkeypatch):
    bench = _bench(monkeypatch)  # it printed n/n, identical to itself, under "identical to aiayn fp32"
    assert bench.reference_row("aiayn fp32, alpha 0") == "aiayn fp32"
    assert bench.reference_row("HF generate, alpha 0") == "aiayn fp32, alpha 0"
    assert bench.reference_row("aiayn bf16, Python step") == "aiayn bf16"
    assert bench.reference_row("HF generate (5.0)") == "aiayn fp32"


def test_n_past_the_end_of_the_test_set_counts_the_sentences_there_are(capsys, monkeypatch):
    bench = _bench(monkeypatch)
    real = bench.read_lines
    monkeypatch.setattr(bench, "read_lines", lambda path: real(path)[:3])  # a test set of 3 sentences
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--n", "30", "--preset", "tiny", "--vocab-size", "1000", "--skip", "hf,ct2,bf16,python-step",
                           "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "3 sentences of test_2016_flickr.de" in out  # it said 30, and sentences/s counted 30 of them
    m = re.search(r"^\| aiayn fp32 \| greedy \| ([\d.]+) \| ([\d.]+) \| .* \| (\d+)/(\d+) \|$", out, re.M)
    assert m and m.group(3, 4) == ("3", "3")
    seconds, per_s = float(m.group(1)), float(m.group(2))  # as printed: 2 and 1 decimals
    assert 3 / (seconds + 0.005) - 0.05 <= per_s <= 3 / max(seconds - 0.005, 1e-9) + 0.05


def test_hf_beam_search_stops_as_aiayns_default_rule(monkeypatch):
    """HF's beam search in the benches follows aiayn's default stopping rule ("best": transformers'
    early_stopping=False, as the HF export sets it); it was given True, a search that stops sooner."""
    transformers = pytest.importorskip("transformers")
    from aiayn.search import DEFAULT_STOP_RULE

    seen = []
    real = transformers.MarianMTModel.generate
    monkeypatch.setattr(transformers.MarianMTModel, "generate",
                        lambda self, *a, **kw: seen.append(kw.get("early_stopping")) or real(self, *a, **kw))
    bench = _bench(monkeypatch)
    assert bench.main(["--n", "4", "--preset", "tiny", "--vocab-size", "1000", "--skip", "ct2,bf16,python-step,int8",
                       "--threads", "1"]) == 0
    assert (DEFAULT_STOP_RULE == "first") in seen and True not in seen  # (greedy: None)
