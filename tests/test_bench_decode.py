"""bench/decode.py runs end to end on a tiny random model and prints like-for-like ratios; not timed."""

import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "decode.py"
DATA = os.environ.get("AIAYN_DATA")
pytestmark = pytest.mark.skipif(
    not DATA or not Path(DATA, "multi30k").is_dir(), reason="AIAYN_DATA (Multi30k) not set")


def test_tiny_run_prints_every_system_and_the_ratios(capsys):
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("aiayn_bench_decode", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--preset", "tiny", "--vocab-size", "1000", "--n", "6", "--skip", "ct2",
                           "--threads", "1", "--repeat", "2", "--workers", "2", "--max-tokens", "24"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for system in ("aiayn greedy", "aiayn beam 4", "aiayn beam 4, 1 worker", "aiayn beam 4 bf16",
                   "aiayn beam 4 bf16, 1 worker", "aiayn beam 4 bf16, no cache",
                   "HF Marian beam 4", "HF Marian beam 4 bf16"):
        assert re.search(rf"^\| {re.escape(system)} \| [\d.]+ \| [\d.]+ \| \d+ \| \d+\.\d\dx \|$", out, re.M), system
    assert "greedy translations identical, aiayn vs HF Marian: 6/6" in out
    assert "beam 4 translations identical, cached vs uncached: 6/6" in out
    assert "beam 4 translations identical, 2 workers vs 1: 6/6" in out  # several batches at once
    assert "beam 4 bf16 translations identical, 2 workers vs 1: 6/6" in out
    assert re.search(r"aiayn beam 4 bf16: vs HF Marian bf16 \d+\.\d\dx \(fp32 \d+\.\d\dx\), "
                     r"vs no cache bf16 \d+\.\d\dx \(fp32 \d+\.\d\dx\)", out)
