"""`aiayn import`, `aiayn average` and their --out/-o checks on damaged input: one line naming the
file and what is wrong, never a traceback, and no model of a garbled config.json's size allocated.

The Marian directories are copies of the kept fixture (tests/data/marian-tiny), each with one file
damaged; nothing is downloaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import marian_models as mm
from aiayn import checkpoint as ckpt
from aiayn.cli import main
from aiayn.config import preset
from aiayn.model import Transformer
from aiayn.tokenizer import Tokenizer, TokenizerPair

DEEP = "[" * 100_000 + "]" * 100_000  # JSON nested past Python's recursion limit


def _marian(tmp_path: Path) -> Path:
    d = tmp_path / "marian"
    shutil.copytree(mm.FIXTURE, d)
    return d


def _one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("file", ["config.json", "vocab.json", "tokenizer_config.json"])
def test_a_marian_json_file_nested_too_deep_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        file: str) -> None:
    """A RecursionError traceback, where any other unreadable JSON was one line naming the file."""
    d = _marian(tmp_path)
    (d / file).write_text(DEEP, encoding="utf-8")
    err = _one_line_error(["import", "--from", "marian", str(d), "--out", str(tmp_path / "out")], capsys)
    assert f"{file}: cannot read it as JSON" in err, err
    assert not (tmp_path / "out").exists()


def test_an_empty_pytorch_model_bin_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """torch.load of an empty file raises an EOFError without a message: taking its first line was an
    IndexError traceback."""
    d = _marian(tmp_path)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"")
    err = _one_line_error(["import", "--from", "marian", str(d), "--out", str(tmp_path / "out")], capsys)
    assert "pytorch_model.bin: cannot load it as tensors only (EOFError)" in err, err


def test_a_config_json_size_far_off_the_weights_is_refused_before_a_model_is_allocated(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The model was built at config.json's sizes before any was checked against the weights: a few
    digits too many in encoder_ffn_dim allocated gigabytes (here past any machine's memory: a
    RuntimeError traceback) only to refuse the shapes afterwards."""
    d = _marian(tmp_path)
    cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
    cfg["encoder_ffn_dim"] = cfg["decoder_ffn_dim"] = 10**15
    (d / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    err = _one_line_error(["import", "--from", "marian", str(d), "--out", str(tmp_path / "out")], capsys)
    assert "fc1.weight has shape (64, 32), config.json says (1000000000000000, 32)" in err, err


def test_an_out_whose_config_json_is_nested_too_deep_is_refused_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--out's config.json is read to tell an earlier import: nested too deep, that was a traceback."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(DEEP, encoding="utf-8")
    err = _one_line_error(["import", "--from", "marian", str(mm.FIXTURE), "--out", str(out)], capsys)
    assert "is not an earlier import" in err, err
    assert (out / "config.json").read_text(encoding="utf-8") == DEEP


def test_an_average_output_whose_config_json_is_nested_too_deep_is_refused_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """-o's config.json is read to tell an earlier average: nested too deep, that was a traceback."""
    t = Tokenizer.train([f"the cat {w} sees a dog" for w in "red big small blue green".split()] * 20, 280)
    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=t.vocab_size, tgt_vocab_size=t.vocab_size))
    run = tmp_path / "run"
    ckpt.save_checkpoint(run / "step_1", model, TokenizerPair(t, t, joint=True), {"train": {}, "step": 1})
    out = tmp_path / "avg"
    out.mkdir()
    (out / "config.json").write_text(DEEP, encoding="utf-8")
    err = _one_line_error(["average", "--checkpoint", str(run), "-n", "1", "-o", str(out)], capsys)
    assert "is not an earlier average" in err, err
    assert (out / "config.json").read_text(encoding="utf-8") == DEEP


def _run_dir(tmp_path: Path) -> Path:
    """A training run's folder as `aiayn train` leaves it: train.json and a step checkpoint."""
    t = Tokenizer.train([f"the cat {w} sees a dog" for w in "red big small blue green".split()] * 20, 280)
    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=t.vocab_size, tgt_vocab_size=t.vocab_size))
    run = tmp_path / "run"
    for step in (1, 2):
        ckpt.save_checkpoint(run / f"step_{step}", model, TokenizerPair(t, t, joint=True), {"train": {}, "step": step})
    (run / "train.json").write_text("{}", encoding="utf-8")
    return run


def test_an_average_or_import_named_as_a_runs_checkpoint_is_refused(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`average -o RUN/best` and `import --out RUN/best` (or RUN/step_N) were written: translate --checkpoint
    RUN then read them as the run's best, and the run's next best replaced them whole. Export refused it."""
    run = _run_dir(tmp_path)
    err = _one_line_error(["average", "--checkpoint", str(run), "-n", "1", "-o", str(run / "best")], capsys)
    assert err == (f"aiayn average: error: -o {run / 'best'}: {run} is a training run, where best names a checkpoint "
                   "of the run (translate and train --resume would read this one as the run's); choose another name")
    err = _one_line_error(["average", "--checkpoint", str(run), "-n", "1", "-o", str(run / "step_1" / "avg")], capsys)  # (step_2 averaged)
    assert "is inside" in err and "a checkpoint of the training run" in err, err
    for name in ("best", "step_7"):
        err = _one_line_error(["import", "--from", "marian", str(mm.FIXTURE), "--out", str(run / name)], capsys)
        assert err.startswith(f"aiayn import: error: --out {run / name}: {run} is a training run, where {name} names"), err
        assert not (run / name).exists()
    assert main(["average", "--checkpoint", str(run), "-n", "1", "-o", str(run / "averaged")]) == 0  # the README's


def test_an_empty_import_name_is_refused_not_the_current_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`aiayn import --from marian "$MODEL"` with MODEL unset imported the current folder."""
    monkeypatch.chdir(mm.FIXTURE)
    err = _one_line_error(["import", "--from", "marian", "", "--out", str(tmp_path / "out")], capsys)
    assert err == ("aiayn import: error: DIR_OR_NAME '': an empty name (an unset shell variable?); name the Marian "
                   "model and the folder to write")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["translate", "--checkpoint", "{m}"], ["train", "--init-from", "{m}", "--out", "{o}"]])
def test_a_hugging_face_marian_folder_given_as_a_checkpoint_says_to_import_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    """It said "config.json has no "model" section; it is not an aiayn checkpoint config" (export alone named it)."""
    args = [a.format(m=mm.FIXTURE, o=tmp_path / "out") for a in argv]
    err = _one_line_error(args, capsys)
    assert (f"error: {mm.FIXTURE} is a Hugging Face Marian model, not an aiayn checkpoint; import it first: aiayn "
            f"import --from marian {mm.FIXTURE} --out DIR, then give DIR") in err, err
    assert not (tmp_path / "out").exists()
