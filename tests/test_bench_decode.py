"""bench/decode.py runs end to end on a tiny random model and prints like-for-like ratios; not timed."""

import os
import re
from pathlib import Path

import pytest
import torch

import benches

BENCH = Path(__file__).resolve().parents[1] / "bench" / "decode.py"
DATA = os.environ.get("AIAYN_DATA")
needs_data = pytest.mark.skipif(  # the bench reads Multi30k sentences; the work counter needs none
    not DATA or not Path(DATA, "multi30k").is_dir(), reason="AIAYN_DATA (Multi30k) not set")


def _bench():
    return benches.load("decode.py")


@needs_data
def test_tiny_run_prints_every_system_and_the_ratios(capsys, monkeypatch):
    pytest.importorskip("transformers")
    bench = _bench()
    monkeypatch.setattr(bench, "cpu_has_fast_bf16", lambda: True)  # bf16 rows too, on any CPU
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
    # the work behind the ratios, counted after the timings
    assert re.search(r"^  aiayn beam 4: \d+\.\d G$", out, re.M)
    m = re.search(r"^  aiayn beam 4, no cache: \d+\.\d G, (\d+\.\d\d)x aiayn's$", out, re.M)
    assert m and float(m.group(1)) > 1.0
    assert re.search(r"^  HF Marian beam 4: \d+\.\d G, \d+\.\d\dx aiayn's$", out, re.M)


@needs_data
def test_bf16_is_skipped_where_the_cpu_has_no_bf16_kernels(capsys, monkeypatch):
    bench = _bench()
    monkeypatch.setattr(bench, "cpu_has_fast_bf16", lambda: False)  # an AVX2-only CPU: bf16 is 100x slower
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--preset", "tiny", "--vocab-size", "1000", "--n", "2", "--skip", "ct2,hf,uncached,work",
                           "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    got = capsys.readouterr()
    assert "slow fallback code" in got.err and "skipping bf16" in got.err
    assert re.search(r"^\| aiayn beam 4 \|", got.out, re.M) and "bf16 |" not in got.out


def test_linear_work_counts_each_linear_once():
    from aiayn.kernels import Linear, inference_linear

    bench = _bench()
    layer = Linear(16, 32)  # trainable: inference_linear falls back to F.linear, which must not count again
    x = torch.randn(3, 5, 16)
    with bench.counting_linear_macs() as total:
        layer(x)
        torch.nn.functional.linear(x[0], layer.weight)  # torch's own linear counts too
    assert total[0] == 3 * 5 * 16 * 32 + 5 * 16 * 32
    import aiayn.kernels

    assert aiayn.kernels.inference_linear is inference_linear  # put back afterwards
    assert torch.nn.functional.linear is torch._C._nn.linear


@pytest.mark.slow  # eight worker processes, each importing torch or ctranslate2
@needs_data
def test_isolated_run_prints_the_four_engines_with_memory(tmp_path, capsys, monkeypatch):
    """`--isolated` on a small saved checkpoint: every engine in its own process, one row each per
    search, peak RSS whole and above the engine's imports, and the int8 speed ratios."""
    pytest.importorskip("ctranslate2")
    import gzip

    monkeypatch.syspath_prepend(str(BENCH.parent))  # as when run as a script: bench/isolated.py beside it

    from aiayn.checkpoint import save_checkpoint
    from aiayn.config import preset
    from aiayn.model import Transformer
    from aiayn.tokenizer import Tokenizer, TokenizerPair

    m30k = Path(DATA, "multi30k")
    lines = [x for lang in ("de", "en") for x in gzip.open(m30k / f"train.{lang}.gz", "rt").read().splitlines()[:500]]
    tok = Tokenizer.train(lines, 500)
    torch.manual_seed(0)
    cfg = preset("tiny", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, max_positions=256)
    save_checkpoint(tmp_path / "ckpt", Transformer(cfg).eval(), TokenizerPair(tok, tok, joint=True),
                    {"train": {"src": "de", "tgt": "en"}, "step": 0})
    assert _bench().main(["--isolated", "--checkpoint", str(tmp_path / "ckpt"), "--n", "6", "--repeat", "1",
                          "--isa", "native", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    peak = {}
    for engine in ("aiayn fp32", "aiayn int8", "ct2 fp32", "ct2 int8"):
        for search in ("greedy", "beam 4"):
            m = re.search(rf"^\| {engine} \| native \| {search} \|( [\d.]+ \|){{4}} \d+/6 \| (\d+) \| -?\d+ \|$",
                          out, re.M)
            assert m, (engine, search)
            peak[engine] = int(m.group(2))
    # each worker's own peak, not the parent's image it was forked from (torch alone is ~200 MB)
    assert peak["ct2 int8"] < 150 < peak["aiayn int8"]
    assert re.search(r"^  native beam 4  [\d.]+x  fastest: [\d.]+x$", out, re.M)


@pytest.mark.parametrize("flags", [["--repeat", "0"], ["--n", "0"], ["--n", "-3"]])
def test_a_bad_count_is_a_one_line_usage_error(flags, capsys):
    with pytest.raises(SystemExit) as e:
        benches.load("decode.py").main(["--skip", "hf,ct2,bf16,uncached,work", *flags])
    assert e.value.code == 2 and "--repeat and --n" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--checkpoint", "{tmp}", "--threads", "-2"], "--threads of 0 or more"),  # the workers' tracebacks
    (["--checkpoint", "{tmp}", "--beam", "0"], "--beam above 0"),  # checked before the checkpoint
    (["--checkpoint", "{tmp}"], "--checkpoint: {tmp} holds no checkpoint"),  # AiaynError's traceback
])
def test_isolated_refuses_bad_values_in_one_line_before_any_worker(flags, message, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))
    spawned = []
    monkeypatch.setattr("subprocess.run", lambda *a, **k: spawned.append(a))
    with pytest.raises(SystemExit) as e:
        _bench().main(["--isolated", "--n", "2", "--isa", "native", *(f.format(tmp=tmp_path) for f in flags)])
    assert message.format(tmp=tmp_path) in str(e.value) and not spawned


@needs_data
def test_hf_beam_search_stops_as_aiayns_default_rule(monkeypatch):
    """As bench/engines.py's (tests/test_bench_engines.py): HF's beam search was given early_stopping=True."""
    transformers = pytest.importorskip("transformers")
    from aiayn.search import DEFAULT_STOP_RULE

    seen = []
    real = transformers.MarianMTModel.generate
    monkeypatch.setattr(transformers.MarianMTModel, "generate",
                        lambda self, *a, **kw: seen.append(kw.get("early_stopping")) or real(self, *a, **kw))
    assert _bench().main(["--preset", "tiny", "--vocab-size", "1000", "--n", "3", "--skip", "ct2,bf16,uncached,work",
                          "--threads", "1"]) == 0
    assert (DEFAULT_STOP_RULE == "first") in seen and True not in seen


def test_an_unknown_skip_part_is_refused_before_any_work(capsys, monkeypatch):
    """`--skip hf,ct` (a typo) was ignored: CTranslate2 ran after all."""
    bench = _bench()
    monkeypatch.setattr(bench, "build", lambda args: pytest.fail("started the run"))
    with pytest.raises(SystemExit) as e:
        bench.main(["--skip", "hf,ct"])
    assert e.value.code == 2 and "--skip ct: not a part; give any of bf16,ct2,hf,uncached,work" in capsys.readouterr().err
