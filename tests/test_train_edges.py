"""Edges of the training mechanism: options that would be silently ignored, and what they leave."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aiayn.cli import main as cli_main
from test_train import _cache, corpus, tiny_args  # noqa: F401 (fixtures: the tokenizer cache in tmp, a tiny corpus)


def _without_validation(args: list[str]) -> list[str]:
    out = list(args)
    for flag in ("--valid-src", "--valid-tgt"):
        i = out.index(flag)
        del out[i : i + 2]
    return out


@pytest.mark.parametrize("how", ["valid-bleu 0", "no validation set"])
def test_patience_without_validation_bleu_is_refused_before_anything_is_written(tmp_path, corpus, capsys, how):
    """--patience counts epochs without a better validation BLEU; where none is scored it never stopped
    the run (a `--patience 1 --valid-bleu 0` run trained all its epochs)."""
    out = tmp_path / "run"
    args = tiny_args(corpus, out, "--max-epochs", "3", "--patience", "1")
    args = args + ["--valid-bleu", "0"] if how == "valid-bleu 0" else _without_validation(args)
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("aiayn train: error: --patience 1 counts epochs without a better validation BLEU")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists() or not any(out.iterdir())


def test_patience_is_refused_on_resume_with_valid_bleu_0(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "2", "--patience", "2")) == 0
    capsys.readouterr()
    assert cli_main(tiny_args(corpus, out, "--max-steps", "4", "--patience", "2", "--valid-bleu", "0", "--resume")) == 2
    assert "--patience 2 counts epochs without a better validation BLEU" in capsys.readouterr().err
    # the run's saved --patience applies without the flag: the message names the value that undoes it
    assert cli_main(tiny_args(corpus, out, "--max-steps", "4", "--valid-bleu", "0", "--resume")) == 2
    assert "or --patience 0" in capsys.readouterr().err
    assert sorted(p.name for p in out.glob("step_*")) == ["step_2"]


def test_an_update_freq_that_tokens_per_update_would_override_is_refused(tmp_path, corpus, capsys):
    """--tokens-per-update derives --update-freq; a --update-freq given beside it (a flag over a --config
    file that sets tokens_per_update, as the WMT14 recipes do) was silently replaced."""
    cfg = tmp_path / "recipe.toml"
    cfg.write_text("[train]\ntokens_per_update = 640\n", encoding="utf-8")
    out = tmp_path / "run"
    assert cli_main(tiny_args(corpus, out, "--config", str(cfg), "--update-freq", "2", "--max-steps", "1")) == 2
    err = capsys.readouterr().err
    assert err == ("aiayn train: error: --update-freq 2 disagrees with --tokens-per-update 640, which sets it to 4 "
                   "here (640 / (1 processes x --max-tokens 160)); drop one of them\n")
    assert not (out / "data").exists() and not list(out.glob("step_*"))
    # the value it derives may be given (a run's train.json holds both), and then it is the run's
    assert cli_main(tiny_args(corpus, out, "--config", str(cfg), "--update-freq", "4", "--max-steps", "1")) == 0
    assert json.loads((out / "train.json").read_text(encoding="utf-8"))["train"]["update_freq"] == 4
    assert cli_main(["train", "--config", str(out / "train.json"), "--max-steps", "2", "--resume"]) == 0
    assert (out / "step_2").is_dir()
    # a run's train.json as the recipe of a new run on larger batches: its update_freq was derived, not given
    other = tmp_path / "other"
    assert cli_main(["train", "--config", str(out / "train.json"), "--out", str(other), "--max-tokens", "320",
                     "--max-steps", "1"]) == 0, capsys.readouterr().err
    assert json.loads((other / "train.json").read_text(encoding="utf-8"))["train"]["update_freq"] == 2


def test_every_64_bit_seed_seeds_the_other_ranks(tmp_path, corpus, monkeypatch):
    """--seed takes any 64-bit value; rank r seeds its dropout with seed + 1000 r, which for a seed near
    2^64 overflowed torch.manual_seed on every rank but 0 (a traceback under torchrun)."""
    from aiayn import train as T
    from aiayn.trainer import Dist

    class Rank1(Dist):  # seeds as rank 1 does; writes as rank 0, alone (no process group)
        main = property(lambda self: True)  # type: ignore[assignment]

    monkeypatch.setattr(T, "setup_distributed", lambda device: Rank1(rank=1, world=1))
    batches = T.rank_batches
    monkeypatch.setattr(T, "rank_batches", lambda plan, seed, epoch, rank, world, uf: batches(plan, seed, epoch, 0, world, uf))
    seed = str(2**64 - 1)
    assert cli_main(tiny_args(corpus, tmp_path / "run", "--max-steps", "1", "--seed", seed)) == 0


def test_metrics_lines_stay_json_when_the_loss_is_not_finite(tmp_path):
    """A diverged step's loss (NaN, inf) is logged as null: NaN is not JSON (jq refuses the line),
    and `aiayn plot` skips the value either way."""
    import json
    from aiayn.plot import read_metrics
    from aiayn.train import TrainLog

    log = TrainLog(tmp_path / "metrics.jsonl", True)
    log.write({"kind": "train", "step": 1, "loss": float("nan"), "lr": float("inf"), "tokens": 5})
    line = (tmp_path / "metrics.jsonl").read_text().strip()

    def refuse(name):
        raise ValueError(name)
    assert json.loads(line, parse_constant=refuse) == {"kind": "train", "step": 1, "loss": None, "lr": None, "tokens": 5}
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["loss"] is None
