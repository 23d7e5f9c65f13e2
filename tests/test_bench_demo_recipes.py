"""bench/demo_recipes.py: one line per candidate run in the picture, and the table of docs/demo.md
read from each run's metrics.jsonl, train.json and log."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import benches

ROOT = Path(__file__).resolve().parents[1]


def fake_run(folder: Path, d_model: int, bleus: list[float], precision: str) -> Path:
    folder.mkdir(parents=True)
    model = {"d_model": d_model, "encoder_layers": 3, "decoder_layers": 3, "d_ff": 4 * d_model, "dropout": 0.1}
    train = {"vocab_size": 5000, "max_tokens": 2048, "warmup": 300, "lr_factor": 0.5}
    (folder / "train.json").write_text(json.dumps({"preset": "small", "model": model, "train": train}))
    recs = [{"kind": "train", "step": 1, "loss": 9.0, "elapsed_s": 1.0}]
    recs += [{"kind": "valid", "step": 100 * (i + 1), "bleu": b, "elapsed_s": 60.0 * (i + 1)} for i, b in enumerate(bleus)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (folder / "train.log").write_text(f"device cpu x1, precision {precision}, max 2048 tokens\n"
                                      f"stopped: reached --max-minutes 4.5; step {100 * len(bleus) + 7}; last ...\n")
    return folder


def test_picture_and_table(tmp_path):
    runs = [fake_run(tmp_path / "demo-small", 192, [10.0, 31.5, 30.25], "bf16"),
            fake_run(tmp_path / "demo-wide", 256, [5.0, 20.0], "fp32")]
    (runs[1] / "train.log").rename(tmp_path / "demo-wide.log")  # the log beside the run is read too
    out = tmp_path / "recipes.png"
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "demo_recipes.py"), *map(str, runs), "-o", str(out)],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=120)
    assert res.returncode == 0, res.stderr
    assert out.stat().st_size > 10_000
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in res.stdout.splitlines() if line.startswith("| ") and "---" not in line}
    assert rows["small"] == ["d192 3+3 ff768 drop 0.1, vocab 5000, 2048 tok, warmup 300, lr x0.5", "bf16", "307",
                             "30.25 (3.00)", "31.50"]
    assert rows["wide"][1:] == ["fp32", "207", "20.00 (2.00)", "20.00"]


def test_the_default_picture_is_the_repos_from_any_directory(tmp_path, monkeypatch, capsys):
    bench = benches.load("demo_recipes.py")
    run = fake_run(tmp_path / "demo-small", 192, [10.0, 31.5], "bf16")
    saved = []
    monkeypatch.setattr(bench, "save_figure", lambda fig, path: saved.append(Path(path)) or path)
    monkeypatch.chdir(tmp_path)  # it wrote tmp_path/docs/demo-recipes.png, a folder of its own making
    assert bench.main([str(run)]) == 0
    assert saved == [ROOT / "docs" / "demo-recipes.png"] and not (tmp_path / "docs").exists()


def test_a_run_without_its_files_is_a_one_line_error(tmp_path):
    bench = benches.load("demo_recipes.py")
    run = fake_run(tmp_path / "demo-small", 192, [10.0, 31.5], "bf16")
    (run / "train.json").unlink()
    with pytest.raises(SystemExit) as e:  # was FileNotFoundError's traceback
        bench.main([str(run), "-o", str(tmp_path / "x.png")])
    assert str(e.value) == f"demo_recipes.py: error: {run / 'train.json'}: cannot read it (No such file or " \
                           "directory); pass a run directory of `aiayn train`"
    with pytest.raises(SystemExit) as e:  # was AiaynError's traceback
        bench.main([str(tmp_path / "nothing"), "-o", str(tmp_path / "x.png")])
    assert str(e.value).startswith(f"demo_recipes.py: error: {tmp_path / 'nothing' / 'metrics.jsonl'}: cannot read")
    assert not (tmp_path / "x.png").exists()
