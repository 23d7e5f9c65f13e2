"""`aiayn train --data-bin`: one data path (the raw-text flags train through the same arrays), exact
resume mid-epoch from a prepared directory, and a resume that refuses data that changed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_train import make_corpus, tiny_args, train_cli, weights

from aiayn.data import prepare as P
from aiayn.cli import main as cli_main
from aiayn.config import TrainConfig
from aiayn.data.corpus import open_corpus
from aiayn.errors import AiaynError


@pytest.fixture()
def corpus(tmp_path) -> dict[str, str]:
    return make_corpus(tmp_path / "data", n_train=120)


def _prepare(corpus: dict[str, str], out: Path, **settings) -> Path:  # type: ignore[no-untyped-def]
    inputs = P.Inputs(*(Path(corpus[k]) for k in ("train_src", "train_tgt", "valid_src", "valid_tgt")))
    return P.prepare(inputs, out, P.Settings(**{"vocab_size": 300, **settings}), workers=1, log=lambda m: None)


def _bin_args(data: Path, out: Path, *extra: str) -> list[str]:
    """tiny_args with --data-bin instead of the four text files."""
    args = tiny_args({k: "x" for k in ("train_src", "train_tgt", "valid_src", "valid_tgt")}, out, *extra)
    for flag in ("--train-src", "--train-tgt", "--valid-src", "--valid-tgt"):
        i = args.index(flag)
        del args[i : i + 2]
    return args + ["--data-bin", str(data)]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_raw_text_and_data_bin_are_one_path(tmp_path, corpus):
    data = _prepare(corpus, tmp_path / "bin")
    train_cli(_bin_args(data, tmp_path / "a", "--max-steps", "5"))
    train_cli(tiny_args(corpus, tmp_path / "b", "--max-steps", "5"))
    assert _same(weights(tmp_path / "a", 5), weights(tmp_path / "b", 5))
    # the raw text was prepared in the run directory, byte for byte what `aiayn prepare` writes
    assert {p.name: p.read_bytes() for p in (tmp_path / "b" / "data").iterdir()} == \
           {p.name: p.read_bytes() for p in data.iterdir()}


def test_resume_mid_epoch_from_data_bin_is_exact(tmp_path, corpus):
    data = _prepare(corpus, tmp_path / "bin")
    extra = ["--save-every", "1", "--dropout", "0.1", "--log-every", "1"]
    train_cli(_bin_args(data, tmp_path / "ref", "--max-steps", "7", *extra))
    train_cli(_bin_args(data, tmp_path / "run", "--max-steps", "3", *extra))
    s = train_cli(_bin_args(data, tmp_path / "run", "--max-steps", "7", *extra, "--resume"))
    assert s["step"] == 7
    state = torch.load(tmp_path / "run" / "step_3" / "trainer_state.pt", weights_only=False)
    assert state["position"] > 0  # step 3 is inside the first epoch
    assert _same(weights(tmp_path / "ref", 7), weights(tmp_path / "run", 7))


def test_resume_refuses_a_data_directory_that_changed(tmp_path, corpus, capsys):
    data = _prepare(corpus, tmp_path / "bin")
    run = tmp_path / "run"
    assert cli_main(_bin_args(data, run, "--max-steps", "2", "--save-every", "1")) == 0
    _prepare(corpus, data, max_len=20)  # the same files prepared otherwise: a new manifest
    capsys.readouterr()
    assert cli_main(_bin_args(data, run, "--max-steps", "4", "--resume")) == 2
    err = capsys.readouterr().err
    assert f"{data}: the data changed since {run / 'step_2'} was written" in err and err.count("\n") == 1
    # raw text: an edited training file is prepared again, and the resume refuses it the same way
    raw = tmp_path / "raw"
    assert cli_main(tiny_args(corpus, raw, "--max-steps", "2", "--save-every", "1")) == 0
    Path(corpus["train_tgt"]).write_text(Path(corpus["train_tgt"]).read_text().replace("katze", "kater"))
    capsys.readouterr()
    assert cli_main(tiny_args(corpus, raw, "--max-steps", "4", "--resume")) == 2
    err = capsys.readouterr().err
    assert f"{corpus['train_tgt']} is not what {raw / 'data'} was prepared from (the data changed since" in err
    assert (raw / "data" / "manifest.json").is_file()  # refused, not replaced: the run was trained on it


def test_a_shorter_max_len_at_train_time_skips_or_truncates_from_the_arrays(tmp_path, corpus):
    data = _prepare(corpus, tmp_path / "bin")  # --max-len 256: everything kept
    full = open_corpus(data, TrainConfig(max_tokens=160))
    assert full.n_train_pairs == 120
    short = open_corpus(data, TrainConfig(max_tokens=160, max_len=12))
    lens = np.maximum(full.train.src.lengths, full.train.tgt.lengths)
    assert short.n_train_pairs == int((lens <= 12).sum()) < 120
    assert sorted(short.plan.order.tolist()) == np.flatnonzero(lens <= 12).tolist()
    cut = open_corpus(data, TrainConfig(max_tokens=160, max_len=12, long="truncate"))
    assert cut.n_train_pairs == 120
    rows = np.flatnonzero(lens > 12)[:3]
    b = cut.train.collate(rows, 12)
    assert b.src.shape[1] <= 12 and b.tgt_in.shape[1] <= 13


def test_data_bin_errors_are_one_line(tmp_path, corpus, capsys):
    assert cli_main(_bin_args(tmp_path / "nowhere", tmp_path / "r", "--max-steps", "1")) == 2
    err = capsys.readouterr().err
    assert f"--data-bin {tmp_path / 'nowhere'}: no such directory" in err and err.count("\n") == 1
    half = tmp_path / ".bin.prepare-1"  # what a killed prepare leaves
    half.mkdir()
    assert cli_main(_bin_args(half, tmp_path / "r", "--max-steps", "1")) == 2
    assert "not a prepared data directory (no manifest.json)" in capsys.readouterr().err


def test_source_eos_widens_eight_bit_lengths(tmp_path, corpus):
    """A directory prepared with --max-len 255 or less keeps its lengths in 8 bits; with an EOS on
    every source, a 255-token source is 256 tokens in a batch, not 0 (the sum wrapped): a
    --max-tokens below that is refused, and no batch holds more than --max-tokens."""
    src = Path(corpus["train_src"]).read_text().splitlines()
    src[5] = " ".join(["hund katze"] * 200)  # far past 255 tokens: truncated to 255
    Path(corpus["train_src"]).write_text("\n".join(src) + "\n")
    data = _prepare(corpus, tmp_path / "bin", max_len=255, long="truncate")
    assert open_corpus(data, TrainConfig(max_tokens=300, max_len=255, long="truncate")).train.src.lengths.dtype == np.uint8
    with pytest.raises(AiaynError, match="max-tokens"):
        open_corpus(data, TrainConfig(max_tokens=255, max_len=255, long="truncate"), source_eos=True)
    c = open_corpus(data, TrainConfig(max_tokens=300, max_len=255, long="truncate"), source_eos=True)
    from aiayn.data.batching import epoch_batches
    assert max(c.train.collate(b, 255, True).src.numel() for b in epoch_batches(c.plan, 1, 1)) <= 300


def test_resume_follows_a_data_directory_that_moved(tmp_path, corpus):
    """--data-bin may name another place on resume (the directory moved, or the same one by another
    path): its manifest's sha256 is what must not change, and it is checked."""
    data = _prepare(corpus, tmp_path / "bin")
    extra = ["--save-every", "1", "--dropout", "0.1"]
    train_cli(_bin_args(data, tmp_path / "ref", "--max-steps", "4", *extra))
    train_cli(_bin_args(data, tmp_path / "run", "--max-steps", "2", *extra))
    moved = data.rename(tmp_path / "moved")
    s = train_cli(_bin_args(moved, tmp_path / "run", "--max-steps", "4", *extra, "--resume"))
    assert s["step"] == 4 and _same(weights(tmp_path / "ref", 4), weights(tmp_path / "run", 4))


def test_the_log_counts_pairs_truncated_at_train_time_and_skipped_when_prepared(tmp_path, corpus):
    """Data prepared with --max-len 20 (skipping) and trained with --max-len 10 --long truncate: the
    log said "0 of N truncated" although the arrays' longer pairs are cut at batching time."""
    data = _prepare(corpus, tmp_path / "bin", max_len=20)
    c = open_corpus(data, TrainConfig(max_tokens=160, max_len=10, long="truncate"))
    lines = c.data.manifest["splits"]["train"]["lines"]
    skipped = lines - c.n_train_pairs
    cut = int((np.maximum(c.train.src.lengths, c.train.tgt.lengths) > 10).sum())
    assert cut > 0 and skipped > 0
    line = c.describe(TrainConfig(max_len=10, long="truncate"))
    assert f"({cut:,} of {lines:,} truncated, {skipped:,} skipped as longer than 10 tokens)" in line, line
    c = open_corpus(data, TrainConfig(max_tokens=160, max_len=10))
    assert f"({lines - c.n_train_pairs:,} of {lines:,} skipped as longer than 10 tokens)" in c.describe(
        TrainConfig(max_len=10))


@pytest.mark.parametrize("damage", ["no files", "bad dtype", "offsets", "lengths", "no settings", "no splits"])
def test_a_damaged_prepared_directory_is_one_line_at_open(tmp_path, corpus, damage):
    """A manifest edited by hand, or index arrays of the right size but wrong content, gave a KeyError,
    TypeError or an IndexError hours into training; now one line when the directory is opened."""
    import json

    data = _prepare(corpus, tmp_path / "bin")
    manifest = json.loads((data / "manifest.json").read_text())
    if damage == "no files":
        del manifest["files"]
    if damage == "bad dtype":
        manifest["files"]["train.src.tokens"]["dtype"] = "zz"
    if damage in ("no settings", "no splits"):  # (were a KeyError traceback)
        del manifest[damage.split()[1]]
    (data / "manifest.json").write_text(json.dumps(manifest))
    if damage in ("offsets", "lengths"):
        f = data / f"train.tgt.{damage}"
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 0x40  # the last sentence: past the end of the tokens
        f.write_bytes(bytes(raw))
    with pytest.raises(AiaynError, match="prepare the data again") as e:
        open_corpus(data, TrainConfig(max_tokens=160))
    assert "\n" not in str(e.value)


def test_a_validation_text_changed_since_prepare_is_one_line_at_open(tmp_path, corpus):
    """valid.tgt.txt edited in a prepared directory (a line dropped) no longer matches the validation
    arrays: it opened, and the first validation, hours in, scored misaligned lines or failed; now one
    line when the directory is opened, from its sha256 in the manifest."""
    data = _prepare(corpus, tmp_path / "bin")
    f = data / "valid.tgt.txt"
    f.write_text("".join(f.read_text().splitlines(keepends=True)[1:]))
    with pytest.raises(AiaynError, match="valid.tgt.txt is not the validation text .* prepare the data again") as e:
        open_corpus(data, TrainConfig(max_tokens=160))
    assert "\n" not in str(e.value)


def test_validation_pairs_wider_than_max_tokens_are_scored_in_batches_of_their_own(tmp_path):
    """Validation pairs longer than any training pair and wider than --max-tokens were left out of the
    validation loss without a word; where all were, train logged 'valid loss 0.000, valid nll 0.000'.
    Now each is a batch of one (no gradients are kept), and every pair is scored."""
    d = tmp_path / "data"
    d.mkdir()
    words = "ein mann hund frau kind spielt auf dem im schnee".split()
    for name, n, k in (("tr", 200, 3), ("va", 10, 30)):
        for lang, shift in (("de", 0), ("en", 1)):
            (d / f"{name}.{lang}").write_text("".join(" ".join(words[(i + j + shift) % 10] for j in range(k)) + "\n"
                                                      for i in range(n)))
    inputs = P.Inputs(d / "tr.de", d / "tr.en", d / "va.de", d / "va.en")
    data = P.prepare(inputs, tmp_path / "bin", P.Settings(vocab_size=300), workers=1, log=lambda m: None)
    c = open_corpus(data, TrainConfig(max_tokens=40))
    assert c.valid is not None and c.valid_plan is not None
    assert sorted(c.valid_plan.order.tolist()) == list(range(len(c.valid)))  # every validation pair, once
    costs = np.maximum(c.valid.src.lengths, c.valid.tgt.lengths.astype(np.int64) + 1)
    assert costs.min() > 40 and len(c.valid_plan) == len(c.valid)  # each wider than 40: one a batch


def test_token_ids_past_the_vocabulary_or_another_tokenizer_are_one_line_at_open(tmp_path, corpus, capsys):
    """Token arrays damaged (ids past the vocabulary: an IndexError in the embedding at the first
    batch that holds one, a device-side assert on CUDA), or the tokenizer replaced by another one
    (silently other words): one line naming the file when the directory is opened."""
    import shutil

    data = _prepare(corpus, tmp_path / "bin")
    damaged = tmp_path / "damaged"
    shutil.copytree(data, damaged)
    tokens = np.memmap(damaged / "valid.src.tokens", dtype="<u2", mode="r+")
    tokens[::50] = 40000
    tokens.flush()
    del tokens
    assert cli_main(_bin_args(damaged, tmp_path / "r", "--max-steps", "1")) == 2
    err = capsys.readouterr().err
    assert (f"--data-bin {damaged}: valid.src.tokens holds id 40000, past the 300 pieces of its tokenizer (a damaged "
            "file, or arrays of another tokenizer); prepare the data again") in err and err.count("\n") == 1, err
    other = _prepare(corpus, tmp_path / "other", vocab_size=290)
    shutil.copy(other / "spm.model", data / "spm.model")
    with pytest.raises(AiaynError, match=r"spm.model is not the tokenizer .*bin was prepared with .*prepare the data "
                                         "again") as e:
        open_corpus(data, TrainConfig(max_tokens=160))
    assert "\n" not in str(e.value)
