"""A newcomer's first commands, from a cold review: what the Makefile installs on a fresh machine
(read from `make -n`, nothing installed)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make_dry_run(tmp_path: Path, *args: str) -> list[str]:
    """The commands `make` would run on a machine with no venv yet (a fresh VENV path)."""
    res = subprocess.run(["make", "-n", "-f", str(ROOT / "Makefile"), f"VENV={tmp_path / 'venv'}", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout.splitlines()


@needs_make
def test_make_install_can_take_torch_from_the_cpu_index(tmp_path):
    # PyPI's Linux torch==2.13.0 requires cuda-toolkit and nvidia-* (gigabytes): the pin alone is the CPU
    # build only where pip's index holds it (CI's machines); TORCH_INDEX takes it from PyTorch's CPU index
    torch_line = [line for line in make_dry_run(tmp_path, "install") if "torch==" in line]
    assert len(torch_line) == 1 and "--index-url" not in torch_line[0], torch_line
    url = "https://download.pytorch.org/whl/cpu"
    torch_line = [line for line in make_dry_run(tmp_path, "install", f"TORCH_INDEX={url}") if "torch==" in line]
    assert len(torch_line) == 1 and f"--index-url {url}" in torch_line[0], torch_line


@needs_make
def test_make_bench_installs_what_bench_decode_imports(tmp_path):
    # bench/decode.py imports transformers and ctranslate2, which `install` leaves out: a fresh
    # `make bench` ran the training bench for minutes, then stopped on ModuleNotFoundError
    lines = make_dry_run(tmp_path, "bench")
    decode = next(i for i, line in enumerate(lines) if "bench/decode.py" in line)
    installs = " ".join(line for line in lines[:decode] if "pip install" in line)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    chosen = {e for group in re.findall(r"-e '?\.\[([^\]]*)\]", installs) for e in group.split(",")}
    packages = {re.split(r"[<>=!~ ]", p)[0] for e in chosen for p in extras[e]}
    source = (ROOT / "bench" / "decode.py").read_text(encoding="utf-8")
    assert "import transformers" in source and "CT2Translator(" in source  # (else this test says nothing)
    assert {"transformers", "ctranslate2"} <= packages, installs


def test_curves_of_a_run_with_nothing_logged_yet_names_its_metrics_file(tmp_path, capsys):
    # `aiayn plot curves` in a run's first --log-every steps: the error said "the metrics file"
    from aiayn.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    assert main(["plot", "curves", "--checkpoint", str(run), "-o", str(tmp_path / "c.png")]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(run / "metrics.jsonl") in err and "--log-every" in err, err
    assert not (tmp_path / "c.png").exists()


@needs_make
def test_make_demo_suggests_plots_outside_the_folder_it_removes(tmp_path):
    # its "Next:" lines wrote runs/demo/attention.png and curves.png, which the next `make demo`'s
    # `rm -rf runs/demo` deleted: files the user made
    lines = make_dry_run(tmp_path, "demo")
    removed = [Path(line.split()[-1]) for line in lines if line.startswith("rm -rf ")]
    outputs = [Path(m) for line in lines for m in re.findall(r" -o (\S+)", line)]
    assert removed and outputs, lines
    assert not [o for o in outputs for r in removed if r == o or r in o.parents], (removed, outputs)


def test_a_png_too_many_pixels_in_all_is_refused_before_drawing(tmp_path, monkeypatch):
    # the limit was a side only (32768): an attention map of a base model's 48 heads and a long
    # sentence, under it on each side, took ~4-9 GB to draw
    from aiayn import plot
    from aiayn.errors import AiaynError

    fig, _ = plot.positional_encoding_figure(64, 10)  # 13 x 5 inches
    monkeypatch.setattr(plot, "MAX_AREA", 600_000)  # (1300 x 500 = 650,000 pixels at 100 dpi)
    with pytest.raises(AiaynError, match=r"1300 x 500 pixels, 1 million, more than 1 million; lower --dpi, draw less"):
        plot.save_figure(fig, tmp_path / "pe.png", dpi=100)
    assert not (tmp_path / "pe.png").exists()
    plot.save_figure(fig, tmp_path / "pe.svg", dpi=100)  # a vector picture has no pixels to hold
