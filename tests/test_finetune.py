"""`aiayn train --init-from`: fine-tuning an imported Marian model on a slice of Multi30k.

The run starts from the checkpoint's weights, tokenizers and shape (the text is encoded with its
tokenizers, not new ones), its validation loss falls below the imported model's, and a run killed
with SIGKILL mid-run and resumed ends with the same weights, bitwise, as a run never interrupted.
The run keeps the checkpoint's language pair and refuses the options the checkpoint decides.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers")

import marian_models as mm  # noqa: E402
from test_train import make_corpus, train_cli  # noqa: E402

from aiayn.checkpoint import load_checkpoint  # noqa: E402
from aiayn.cli import main  # noqa: E402
from aiayn.errors import AiaynError  # noqa: E402
from aiayn.importer import import_marian  # noqa: E402
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID  # noqa: E402


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> Path:
    if not mm.have_data():
        pytest.skip("Multi30k is not in AIAYN_DATA")
    return import_marian(mm.FIXTURE, tmp_path_factory.mktemp("ft") / "imported", warn=pytest.fail)


@pytest.fixture(scope="module")
def imported_en_fr(tmp_path_factory) -> Path:
    """The fixture imported as an en->fr model (it needs no Multi30k: the tests below train on words)."""
    return import_marian(mm.FIXTURE, tmp_path_factory.mktemp("enfr") / "imported", warn=pytest.fail, src="en", tgt="fr")


def _word_args(imported: Path, tmp_path: Path, out: Path, *extra: str) -> list[str]:
    """A one-step fine-tuning on make_corpus's word pairs (seconds)."""
    files = make_corpus(tmp_path / "words", n_train=40, n_valid=4)
    return ["train", "--init-from", str(imported), "--train-src", files["train_src"], "--train-tgt", files["train_tgt"],
            "--max-steps", "1", "--precision", "fp32", "--threads", "1", "--valid-bleu", "0", "--out", str(out), *extra]


@pytest.fixture()
def slice_files(tmp_path) -> dict[str, str]:
    """800 training pairs the fixture never saw (it was trained on the first 10,000) and 100 of val."""
    paths = {}
    for split, name, start, n in (("train", "train", 20000, 800), ("val", "valid", 0, 100)):
        for side, lang in (("src", "de"), ("tgt", "en")):
            p = tmp_path / f"{name}.{lang}"
            p.write_text("\n".join(mm.multi30k(split, lang, start + n)[start:]) + "\n", encoding="utf-8")
            paths[f"{name}_{side}"] = str(p)
    return paths


def _args(imported: Path, files: dict[str, str], out: Path, *extra: str) -> list[str]:
    return ["train", "--init-from", str(imported), "--train-src", files["train_src"], "--train-tgt",
            files["train_tgt"], "--valid-src", files["valid_src"], "--valid-tgt", files["valid_tgt"],
            "--max-tokens", "1200", "--warmup", "20", "--lr-factor", "0.05", "--precision", "fp32", "--threads", "1",
            "--valid-bleu", "0", "--out", str(out), *extra]


def _nll(ckpt: Path, files: dict[str, str]) -> float:
    """Mean per-token negative log-likelihood of the validation pairs (no label smoothing)."""
    ck = load_checkpoint(ckpt)
    src_lines = Path(files["valid_src"]).read_text(encoding="utf-8").splitlines()
    tgt_lines = Path(files["valid_tgt"]).read_text(encoding="utf-8").splitlines()
    total, count = 0.0, 0
    with torch.no_grad():
        for s, t in zip(src_lines, tgt_lines):
            src = torch.tensor([ck.tokenizers.src.encode(s) + [EOS_ID]])
            tgt = ck.tokenizers.tgt.encode(t)
            loss = ck.model.loss(src, torch.tensor([[BOS_ID] + tgt]), torch.tensor([tgt + [EOS_ID]]), reduction="sum")
            total, count = total + float(loss), count + len(tgt) + 1
    return total / count


def test_fine_tuning_keeps_the_tokenizer_and_lowers_validation_loss(imported, slice_files, tmp_path):
    out = tmp_path / "run"
    summary = train_cli(_args(imported, slice_files, out, "--max-epochs", "3", "--dropout", "0.1"))
    ft, start = load_checkpoint(summary["checkpoint"]), load_checkpoint(imported)
    assert ft.model_config == start.model_config.replace(dropout=0.1)
    assert (ft.tokenizers.src, ft.tokenizers.tgt) == (start.tokenizers.src, start.tokenizers.tgt)
    before, after = _nll(imported, slice_files), _nll(Path(summary["checkpoint"]), slice_files)
    print(f"validation nll {before:.3f} -> {after:.3f}")
    assert after < before - 0.05
    valid = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"valid"' in x]
    assert valid[-1]["nll"] < before


def test_the_shape_is_the_checkpoints(imported, slice_files, tmp_path):
    with pytest.raises(AiaynError, match="--d-model 64 differs from --init-from"):
        train_cli(_args(imported, slice_files, tmp_path / "run", "--d-model", "64"))


def test_fine_tuning_keeps_the_checkpoints_language_pair(imported_en_fr, tmp_path):
    # the run's src/tgt name its pair for serve, sentence splitting and export: not TrainConfig's de/en
    out = tmp_path / "run"
    assert main(_word_args(imported_en_fr, tmp_path, out)) == 0
    for config in (json.loads((out / "step_1" / "config.json").read_text())["train"],
                   json.loads((out / "train.json").read_text())["train"]):
        assert (config["src"], config["tgt"]) == ("en", "fr")
    assert main(_word_args(imported_en_fr, tmp_path, tmp_path / "given", "--src", "de", "--tgt", "en")) == 0
    assert json.loads((tmp_path / "given" / "train.json").read_text())["train"]["src"] == "de"  # given: kept


@pytest.mark.parametrize("extra", [["--preset", "base"], ["--vocab-size", "500"], ["--joint-vocab"],
                                   ["--spm-model-type", "bpe"]])
def test_options_the_checkpoint_decides_are_refused(imported_en_fr, tmp_path, capsys, extra):
    out = tmp_path / "run"
    assert main(_word_args(imported_en_fr, tmp_path, out, *extra)) == 2
    err = capsys.readouterr().err
    assert f"error: {extra[0]}" in err and "--init-from" in err and err.count("\n") == 1, err
    assert not out.exists()


def test_an_imported_models_fine_tuning_records_what_its_tokenizer_is(imported_en_fr, tmp_path):
    """An imported Marian model's config has no tokenizer settings: its fine-tuning records what its
    tokenizer is (two unigram vocabularies of 919), not the defaults (one joint bpe vocabulary of
    8000), and repeating those facts is taken."""
    out = tmp_path / "run"
    assert main(_word_args(imported_en_fr, tmp_path, out)) == 0
    recorded = json.loads((out / "train.json").read_text())["train"]
    assert (recorded["joint_vocab"], recorded["spm_model_type"], recorded["vocab_size"]) == (False, "unigram", 919)
    again = tmp_path / "again"
    assert main(_word_args(imported_en_fr, tmp_path, again, "--no-joint-vocab", "--spm-model-type", "unigram",
                           "--vocab-size", "919")) == 0


def test_a_recipe_that_repeats_the_checkpoints_own_settings_is_taken(imported_en_fr, tmp_path):
    """A run's recipe file (configs/multi30k.toml sets vocab_size and joint_vocab) fine-tuning that
    run: the values are the checkpoint's own, so nothing would be ignored; another value is refused."""
    import shutil

    from aiayn.config import TrainConfig
    from aiayn.train import _fine_tune_start

    own = tmp_path / "own"
    shutil.copytree(imported_en_fr, own)
    cfg = json.loads((own / "config.json").read_text())
    cfg["train"].update(vocab_size=500, joint_vocab=True, spm_model_type="bpe")
    (own / "config.json").write_text(json.dumps(cfg))
    given = {"vocab_size", "joint_vocab", "spm_model_type"}
    tc = TrainConfig(init_from=str(own), vocab_size=500, joint_vocab=True, spm_model_type="bpe")
    assert _fine_tune_start(str(own), "small", {}, tc, given)[2].path == own
    with pytest.raises(AiaynError, match="--vocab-size 400 .a flag, or the --config file's vocab_size. cannot be used"):
        _fine_tune_start(str(own), "small", {}, tc.replace(vocab_size=400), given)


def test_sigkill_then_resume_equals_an_uninterrupted_fine_tuning(imported, slice_files, tmp_path):
    steps = 12
    extra = ["--max-steps", str(steps), "--save-every", "2", "--log-every", "1", "--dropout", "0.1"]
    ref = tmp_path / "ref"
    train_cli(_args(imported, slice_files, ref, *extra))
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "aiayn", *_args(imported, slice_files, run, *extra, "--resume")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 300
    while proc.poll() is None and not list(run.glob("step_4")):  # killed after a few steps and checkpoints
        assert time.time() < deadline, log.read_text()
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run / f"step_{steps}").exists(), "the run finished before the kill"
    assert main(_args(imported, slice_files, run, *extra, "--resume")) == 0
    a = load_file(str(ref / f"step_{steps}" / "model.safetensors"))
    b = load_file(str(run / f"step_{steps}" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert PAD_ID == 0  # the imported model's pad row is ours: padding stays masked while fine-tuning
