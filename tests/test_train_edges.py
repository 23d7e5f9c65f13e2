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


@pytest.mark.parametrize("other", [["--data", "multi30k"], ["--data-bin", "prepared"]])
def test_two_corpora_are_refused_before_anything_is_written(tmp_path, corpus, capsys, other):
    """--data multi30k beside --train-src/--train-tgt trained on Multi30k (downloading it) and ignored
    the files; --data-bin beside them ignored them too."""
    out = tmp_path / "run"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1", *other)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and other[0] in err and "--train-src" in err and "give one of them" in err
    assert not out.exists() or not any(out.iterdir())


def test_text_files_given_as_flags_replace_the_config_files_corpus(tmp_path, corpus):
    """`--config configs/demo.toml --train-src ... --train-tgt ...`: flags override the file's values, its
    corpus included (it trained on Multi30k and ignored the files)."""
    cfg = tmp_path / "recipe.toml"
    cfg.write_text('[train]\ndata = "multi30k"\n', encoding="utf-8")
    out = tmp_path / "run"
    assert cli_main(tiny_args(corpus, out, "--config", str(cfg), "--max-steps", "1")) == 0
    saved = json.loads((out / "train.json").read_text(encoding="utf-8"))["train"]
    assert saved["data"] is None and saved["train_src"] == corpus["train_src"]


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


def test_a_trainer_state_that_does_not_fit_the_model_is_not_resumed_from(tmp_path, corpus, capsys):
    """A step_<N>/ whose trainer_state.pt is another model's (copied from another run): torch loads
    Adam's moments of any shape, and the fused step then ran past them (garbage weights, or a process
    killed). Such a checkpoint is refused like a damaged one: the run resumes from the one before."""
    import shutil

    out, other = tmp_path / "run", tmp_path / "other"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "2", "--save-every", "1", "--keep-last", "5")) == 0
    assert cli_main(tiny_args(corpus, other, "--max-steps", "1", "--d-model", "64")) == 0
    shutil.copy(other / "step_1" / "trainer_state.pt", out / "step_2" / "trainer_state.pt")
    capsys.readouterr()
    assert cli_main(tiny_args(corpus, out, "--max-steps", "3", "--save-every", "1", "--keep-last", "5", "--resume")) == 0
    said = capsys.readouterr().out
    assert f"warning: cannot resume from {out / 'step_2'}: {out / 'step_2' / 'trainer_state.pt'}" in said
    assert "does not fit the model" in said and f"resuming from {out / 'step_1'}" in said
    # the only checkpoint: one line naming the file
    shutil.rmtree(out / "step_1")
    shutil.copy(other / "step_1" / "trainer_state.pt", out / "step_3" / "trainer_state.pt")
    shutil.rmtree(out / "step_2")
    assert cli_main(tiny_args(corpus, out, "--max-steps", "4", "--resume")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"aiayn train: error: {out / 'step_3' / 'trainer_state.pt'} does not fit the model")
    assert err.count("\n") == 1


def test_a_diverged_loss_says_what_can_be_done(tmp_path, corpus, capsys):
    """The message said "lower --lr-factor ... and resume from an earlier checkpoint", but --resume
    refuses a new --lr-factor (it continues the run with its own settings)."""
    out = tmp_path / "run"
    args = tiny_args(corpus, out, "--max-steps", "20", "--save-every", "1", "--lr-factor", "1e9")
    assert cli_main(args) == 2
    err = capsys.readouterr().err.splitlines()[-1] + "\n"  # below the progress bar
    assert err.startswith("aiayn train: error: the loss became nan at step 2; ") and err.count("\n") == 1
    assert "--resume" not in err.replace("not --resume", "") and "--init-from" in err and "--out" in err
    assert "--precision fp32" not in err  # this run already trains in fp32


# Run as `python BEST_KILLER aiayn-args...`: `aiayn` that SIGKILLs itself inside its first write of best/.
BEST_KILLER = '''
import os, signal, sys
from pathlib import Path
import aiayn.checkpoint as C
from aiayn.cli import main

real_save = C.save_file
def save_file(tensors, path, *a, **kw):
    real_save(tensors, path, *a, **kw)
    if Path(path).parent.name.startswith(".tmp-best-"):
        os.kill(os.getpid(), signal.SIGKILL)
C.save_file = save_file
sys.exit(main(sys.argv[1:]))
'''


def test_a_kill_while_best_is_written_loses_no_best_checkpoint(tmp_path, corpus):
    """The step checkpoint (which records the new best BLEU) was written before best/: killed in
    between, the resumed run never wrote best/ again, so the best model was lost once pruned (here
    best/ was missing altogether, and `translate --checkpoint RUN` took the last step instead)."""
    import os
    import signal
    import subprocess
    import sys

    from safetensors.torch import load_file

    from test_train import train_cli

    ref, run = tmp_path / "ref", tmp_path / "run"
    extra = ["--max-epochs", "1", "--save-every", "0", "--keep-last", "1"]
    train_cli(tiny_args(corpus, ref, *extra))
    killer = tmp_path / "killer.py"
    killer.write_text(BEST_KILLER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = tiny_args(corpus, run, *extra, "--resume")
    rc = subprocess.run([sys.executable, str(killer), *argv], env=env, capture_output=True, timeout=600).returncode
    assert rc == -signal.SIGKILL and list(run.glob(".tmp-best-*"))
    assert cli_main(argv) == 0
    a, b = load_file(str(ref / "best" / "model.safetensors")), load_file(str(run / "best" / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_a_fine_tuning_runs_train_json_records_the_checkpoints_settings_and_is_a_recipe(tmp_path, corpus, capsys):
    """--init-from decides the preset and the tokenizer options, but the run recorded the defaults
    (preset small, vocab_size 8000) in train.json and its checkpoints: wrong, and its own train.json
    as --config (as the docs offer) was then refused ("--preset small ... cannot be used with --init-from")."""
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    assert cli_main(tiny_args(corpus, base, "--max-steps", "1")) == 0
    args = [a for a in tiny_args(corpus, tuned, "--max-steps", "1", "--init-from", str(base / "step_1"))]
    for flag in ("--preset", "--vocab-size"):  # the checkpoint decides them
        i = args.index(flag)
        del args[i : i + 2]
    assert cli_main(args) == 0
    for saved in (json.loads((tuned / "train.json").read_text(encoding="utf-8")),
                  json.loads((tuned / "step_1" / "config.json").read_text(encoding="utf-8"))):
        assert (saved["preset"], saved["train"]["vocab_size"]) == ("tiny", 300)
    capsys.readouterr()
    again = ["train", "--config", str(tuned / "train.json"), "--out", str(tmp_path / "again"), "--max-steps", "1"]
    assert cli_main(again) == 0, capsys.readouterr().err


_KILLED_WRITING_TRAIN_JSON = """
import resource, signal, sys
from aiayn import train as T
from aiayn.cli import main

truncate = T.TrainLog.truncate_after


def then_cut(self, step):  # the next write past 100 bytes of any file kills the process (SIGXFSZ): train.json's
    truncate(self, step)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # (Python ignores it: the write would raise EFBIG instead)
T.TrainLog.truncate_after = then_cut
sys.exit(main(sys.argv[1:]))
"""


def test_a_run_killed_while_writing_train_json_can_be_resumed(tmp_path, corpus, capsys):
    """train.json was written in place: a kill mid-write (here the file-size limit's SIGXFSZ, as a
    full disk or a SIGKILL leaves it) left 100 bytes of it, and every --resume then refused the run
    ("was not written by aiayn train (not readable JSON ...)"). It is written beside and renamed."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "run"
    args = tiny_args(corpus, out, "--max-steps", "1")
    killed = subprocess.run([sys.executable, "-c", _KILLED_WRITING_TRAIN_JSON, *args], capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -signal.SIGXFSZ, killed.stderr
    assert not (out / "train.json").exists() or json.loads((out / "train.json").read_text(encoding="utf-8"))
    assert cli_main([*args, "--resume"]) == 0, capsys.readouterr().err
    assert json.loads((out / "train.json").read_text(encoding="utf-8"))["train"]["max_steps"] == 1
    assert (out / "step_1").is_dir() and not list(out.glob(".train.json.*"))  # the torn temporary is gone


def test_a_read_only_out_on_resume_says_what_to_do(tmp_path, corpus):
    """`aiayn train --resume --out DIR` with DIR read-only prepared the data and loaded the checkpoint,
    then stopped at "aiayn train: error: DIR/metrics.jsonl.tmp: Permission denied", no hint given."""
    import os
    import shutil
    import subprocess
    import sys

    out = tmp_path / "run"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1")) == 0
    argv = [sys.executable, "-m", "aiayn", *tiny_args(corpus, out, "--max-steps", "2", "--resume")]
    if os.geteuid() == 0:  # root writes anywhere: take away the capabilities that let it
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv to drop CAP_DAC_OVERRIDE")
        caps = "-dac_override,-dac_read_search,-fowner"
        argv = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", *argv]
    out.chmod(0o555)
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    finally:
        out.chmod(0o755)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == (
        f"aiayn train: error: --out {out} is not writable (Permission denied): a run writes its checkpoints "
        f"there; make it writable (chmod u+w {out}) or copy the run to a folder you can write (cp -r {out} NEW) "
        "and resume there with --out NEW"), r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["best", "data", "metrics.jsonl", "step_1", "train.json"]


@pytest.mark.parametrize("flag", ["--train-src", "--train-tgt", "--valid-src", "--valid-tgt"])
def test_a_folder_given_as_a_corpus_file_is_named_as_one(tmp_path, corpus, capsys, flag):
    """`--train-src SOMEDIR` said "--train-src SOMEDIR: no such file", which sent the user looking
    for a missing file."""
    out, folder = tmp_path / "run", tmp_path / "texts"
    folder.mkdir()
    args = tiny_args(corpus, out, "--max-steps", "1")
    args[args.index(flag) + 1] = str(folder)
    assert cli_main(args) == 2
    assert capsys.readouterr().err == (f"aiayn train: error: {flag} {folder}: is a directory, expected a text file "
                                       "(one sentence a line); give the file's path\n")
    assert not list(out.glob("step_*"))


def test_a_named_pipe_given_as_a_corpus_file_is_refused_at_once(tmp_path, corpus, capsys):
    """Opening a FIFO no one writes to waits for ever (the check opened it); a corpus is read twice."""
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    args = tiny_args(corpus, tmp_path / "run", "--max-steps", "1")
    args[args.index("--train-src") + 1] = str(fifo)
    assert cli_main(args) == 2
    assert capsys.readouterr().err == (f"aiayn train: error: --train-src {fifo}: not a regular file (a pipe or a "
                                       "device?); give a file's path: a corpus is read more than once\n")


def test_an_unreadable_corpus_file_names_its_flag(tmp_path, corpus):
    """An unreadable --train-tgt ended in "FILE: Permission denied" (an OSError from hashing it),
    naming neither the flag nor that it is an input."""
    import os
    import shutil
    import subprocess
    import sys

    Path(corpus["train_tgt"]).chmod(0)
    argv = [sys.executable, "-m", "aiayn", *tiny_args(corpus, tmp_path / "run", "--max-steps", "1")]
    if os.geteuid() == 0:  # root reads anything: take away the capabilities that let it
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv to drop CAP_DAC_OVERRIDE")
        caps = "-dac_override,-dac_read_search,-fowner"
        argv = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", *argv]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert r.returncode == 2 and r.stderr == (f"aiayn train: error: --train-tgt {corpus['train_tgt']}: cannot read "
                                              "(Permission denied)\n"), r.stderr


def test_an_empty_config_name_is_refused(tmp_path, corpus, capsys):
    """`--config "$RECIPE"` with RECIPE unset trained on the defaults, the recipe ignored without a word
    ("" was taken for no --config)."""
    out = tmp_path / "run"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1", "--config", "")) == 2
    assert capsys.readouterr().err == ("aiayn train: error: --config is an empty name (an unset shell variable?); "
                                       "give a file or leave it out\n")
    assert not out.exists()


def test_a_metrics_file_that_cannot_be_read_on_resume_is_one_line_before_loading(tmp_path, corpus, capsys):
    """--resume reads metrics.jsonl (dropping lines past the checkpoint): one it could not read stopped
    the run after the checkpoint and the data were loaded, with "RUN/metrics.jsonl: Is a directory"
    (or "Permission denied") and no hint. (A read-only one is fine: it is replaced, as train.json is.)"""
    out = tmp_path / "run"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1")) == 0
    (out / "train.json").chmod(0o444)
    (out / "metrics.jsonl").chmod(0o444)
    assert cli_main(tiny_args(corpus, out, "--max-steps", "2", "--resume")) == 0
    assert (out / "step_2").is_dir() and '"step": 2' in (out / "metrics.jsonl").read_text(encoding="utf-8")
    (out / "metrics.jsonl").unlink()
    (out / "metrics.jsonl").mkdir()
    capsys.readouterr()
    assert cli_main(tiny_args(corpus, out, "--max-steps", "3", "--resume")) == 2
    said = capsys.readouterr()
    assert said.err == (f"aiayn train: error: {out / 'metrics.jsonl'}: cannot read it (Is a directory); --resume keeps "
                        "the run's metrics there: make it a readable file, or move it away to start the metrics "
                        "afresh\n")
    assert "resuming from" not in said.out and not (out / "step_3").exists()


def test_the_run_says_when_it_keeps_no_best_checkpoint(tmp_path, corpus, capsys):
    """The docs and --help said a run keeps best/; best/ is the best validation BLEU's, so a run that
    scores none (--valid-bleu 0, as configs/multi30k-gpu.toml) writes none: now said in the log, --help
    and docs/training.md."""
    import argparse

    from aiayn.train import add_arguments

    out = tmp_path / "run"
    assert cli_main(tiny_args(corpus, out, "--max-epochs", "1", "--valid-bleu", "0")) == 0
    said = capsys.readouterr().out
    assert ("no best/ checkpoint: it is kept by validation BLEU, and none is scored (--valid-bleu 0); the run keeps "
            "its last 5 step_<N>/") in said
    assert not (out / "best").exists() and list(out.glob("step_*"))
    scored = tmp_path / "scored"
    assert cli_main(tiny_args(corpus, scored, "--max-epochs", "1")) == 0
    assert "no best/" not in capsys.readouterr().out and (scored / "best").is_dir()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    helps = " ".join(parser.format_help().split())
    assert "step checkpoints kept (plus best/, where validation BLEU is scored)" in helps
    assert "(0: loss only, and no best/)" in helps


def test_seeds_that_differ_only_above_bit_32_draw_other_weights(tmp_path, corpus, monkeypatch):
    """torch's CPU generator keeps the low 32 bits of its seed: --seed 1 and --seed 4294967297 drew the
    same initial weights and dropout masks. A seed below 2^32 draws what it drew before, and a resumed
    run of a large seed still ends with the weights of an uninterrupted one."""
    import torch
    from safetensors.torch import load_file

    from aiayn import train as T

    built, real = [], T.Transformer

    def keep(cfg):  # the weights each run starts from
        model = real(cfg)
        built.append({k: v.clone() for k, v in model.state_dict().items()})
        return model

    monkeypatch.setattr(T, "Transformer", keep)
    for seed in ("1", str(2**32 + 1)):
        assert cli_main(tiny_args(corpus, tmp_path / seed, "--max-steps", "2", "--seed", seed)) == 0
    assert any(not built[0][k].equal(built[1][k]) for k in built[0])
    from aiayn.trainer import torch_seed

    assert [torch_seed(s) for s in (0, 1, 2**32 - 1)] == [0, 1, 2**32 - 1]
    assert [torch_seed(s) for s in (-1, -12345)] == [-1, -12345]  # torch wraps them, as it always did
    torch.manual_seed(1)
    first = torch.rand(3)
    torch.manual_seed(torch_seed(2**32 + 1))
    assert not torch.rand(3).equal(first)
    big = str(2**32 + 1)
    resumed = tmp_path / "resumed"
    assert cli_main(tiny_args(corpus, resumed, "--max-steps", "1", "--seed", big)) == 0
    assert cli_main(tiny_args(corpus, resumed, "--max-steps", "2", "--seed", big, "--resume")) == 0
    a = load_file(str(tmp_path / big / "step_2" / "model.safetensors"))
    b = load_file(str(resumed / "step_2" / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


@pytest.mark.parametrize("suffix, text", [(".toml", "[train]\nmax_steps = " + "9" * 5000 + "\n"),
                                          (".json", '{"max_steps": ' + "9" * 5000 + "}")])
def test_a_config_number_past_pythons_digit_limit_is_one_line(tmp_path: Path, capsys, suffix: str, text: str) -> None:
    """Over 4,300 digits Python will not read an int: a ValueError traceback (not a decode error)."""
    cfg = tmp_path / f"c{suffix}"
    cfg.write_text(text)
    assert cli_main(["train", "--config", str(cfg), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a number of more than 4,300 digits; give one that fits its option" in err
    assert not (tmp_path / "run").exists()


def test_train_help_gives_no_default_of_none(capsys) -> None:
    """Options not given by default (--train-src, --valid-src, ...) said "(default: None)"."""
    with pytest.raises(SystemExit):
        cli_main(["train", "--help"])
    out = capsys.readouterr().out
    assert "(default: None)" not in out and "(default: 256 for small; see --preset)" in out


def test_own_files_without_a_language_pair_are_warned_of_the_default_one(tmp_path, corpus, capsys):
    """An own corpus trained without --src/--tgt recorded de -> en without a word: serve announced it."""
    assert cli_main(tiny_args(corpus, tmp_path / "a", "--max-steps", "1")) == 0
    assert "warning: the run records its language pair as de -> en (the defaults)" in capsys.readouterr().out
    assert cli_main(tiny_args(corpus, tmp_path / "b", "--max-steps", "1", "--src", "en", "--tgt", "fr")) == 0
    assert "language pair" not in capsys.readouterr().out


@pytest.mark.parametrize("route", ["--out", "--config train.json"])
def test_a_run_that_recorded_empty_paths_resumes(tmp_path, corpus, capsys, route):
    """A run written before "" was refused recorded "" for the paths not given (--init-from "$BASE"
    with BASE unset): every checkpoint then failed to resume ("invalid train config ...; resume from
    another checkpoint", which no other could help). "" meant "not given" to the code that wrote it."""
    out = tmp_path / "run"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "2", "--save-every", "1")) == 0
    for f in [*out.glob("*/config.json"), out / "train.json"]:
        cfg = json.loads(f.read_text())
        cfg["train"].update(init_from="", data_bin="", out="")
        f.write_text(json.dumps(cfg))
    capsys.readouterr()
    config = ["--config", str(out / "train.json")] if route.startswith("--config") else []  # resume_command's form
    assert cli_main(["train", *config, "--out", str(out), "--resume", "--max-steps", "3"]) == 0, capsys.readouterr().err
    assert (out / "step_3").is_dir() and f"resuming from {out / 'step_2'}" in capsys.readouterr().out
    saved = json.loads((out / "step_3" / "config.json").read_text())["train"]
    assert (saved["init_from"], saved["data_bin"], saved["out"]) == (None, None, str(out))


def test_a_bad_train_option_in_a_config_file_names_the_file(tmp_path, corpus, capsys):
    """`max_steps = -1` in a --config file (or a run's own train.json holding "" for a path) was
    reported as a flag the command did not hold: '--max-steps must be ...', no file named."""
    out, recipe = tmp_path / "run", tmp_path / "recipe.toml"
    recipe.write_text("[train]\nmax_steps = -1\n")
    assert cli_main(tiny_args(corpus, out, "--config", str(recipe))) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"aiayn train: error: --config {recipe}: --max-steps must be 0 (off) or positive")
    assert err.count("\n") == 1 and not out.exists()
    # a flag over the file's value is the flag's to answer for
    assert cli_main(tiny_args(corpus, out, "--config", str(recipe), "--max-steps", "-2")) == 2
    assert capsys.readouterr().err.startswith("aiayn train: error: --max-steps must be 0 (off) or positive, got -2")


@pytest.mark.parametrize("line", [b"[1]\n", b'{"kind": "train", "step": "3"}\n', b"\xff\n", b"a note of mine\n"])
def test_a_metrics_line_that_is_no_record_is_one_line_before_loading(tmp_path, corpus, capsys, line):
    """--resume rewrites metrics.jsonl, dropping lines past the checkpoint: a line that is JSON but no
    object (or a step that is no number) was an AttributeError (TypeError) traceback after the data was
    loaded, invalid UTF-8 a UnicodeDecodeError, and a line that is not JSON was deleted without a word."""
    out = tmp_path / "run"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1")) == 0
    with open(out / "metrics.jsonl", "ab") as f:
        f.write(line)
    before = (out / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert cli_main(tiny_args(corpus, out, "--max-steps", "2", "--resume")) == 2
    said = capsys.readouterr()
    assert said.err.startswith(f"aiayn train: error: {out / 'metrics.jsonl'}: ") and said.err.count("\n") == 1, said.err
    assert "move the file away to start the metrics afresh" in said.err or "move it away" in said.err
    assert "resuming from" not in said.out and not (out / "step_2").exists()
    assert (out / "metrics.jsonl").read_bytes() == before


def test_a_blank_line_in_metrics_does_not_stop_a_resume(tmp_path, corpus, capsys):
    """A blank line (a hand edit, "...}\n\n") holds no record: the check before loading refused it,
    where the resume itself and `plot curves` pass over it."""
    out = tmp_path / "run"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1")) == 0
    with open(out / "metrics.jsonl", "a") as f:
        f.write("\n  \n")
    capsys.readouterr()
    assert cli_main(tiny_args(corpus, out, "--max-steps", "2", "--resume")) == 0, capsys.readouterr().err
    assert (out / "step_2").is_dir()


def test_a_run_started_with_relative_paths_resumes_from_another_folder(tmp_path, corpus, capsys, monkeypatch):
    """The data paths were recorded as typed: a run started in one folder with `--train-src data/train.src`
    and resumed from another (`aiayn train --out DIR --resume`, which the docs say is enough) stopped at
    "--train-src data/train.src: no such file", a flag it was not given."""
    monkeypatch.chdir(tmp_path)
    relative = {k: str(Path(v).relative_to(tmp_path)) for k, v in corpus.items()}
    out = tmp_path / "run"
    assert cli_main(tiny_args(relative, out, "--max-steps", "1")) == 0
    saved = json.loads((out / "step_1" / "config.json").read_text())["train"]
    assert saved["train_src"] == corpus["train_src"] == str(tmp_path / relative["train_src"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert cli_main(["train", "--out", str(out), "--resume", "--max-steps", "2"]) == 0, capsys.readouterr().err
    assert (out / "step_2").is_dir()


def test_another_kind_of_corpus_on_resume_is_refused(tmp_path, corpus, capsys):
    """The data paths may be given anew on --resume (files moved), but a --data-bin run given
    --train-src/--train-tgt trained on its --data-bin without a word, and recorded both corpora in its
    checkpoints; the same for a text-files run given --data-bin."""
    out = tmp_path / "run"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1")) == 0
    capsys.readouterr()
    assert cli_main(["train", "--out", str(out), "--resume", "--max-steps", "2", "--data-bin", str(tmp_path / "bin")]) == 2
    said = capsys.readouterr()
    assert said.err == (f"aiayn train: error: --data-bin {tmp_path / 'bin'}: the run trains on its --train-src "
                        f"{corpus['train_src']}; --resume continues on the run's own corpus (a moved file may be given "
                        "anew, not another corpus): drop --data-bin, or start a new run with another --out\n")
    assert not (out / "step_2").exists()
    # the run's own kind of corpus, moved, is taken
    moved = {k: str(Path(v).rename(tmp_path / f"moved-{Path(v).name}")) for k, v in corpus.items()}
    assert cli_main(tiny_args(moved, out, "--max-steps", "2", "--resume")) == 0
    assert (out / "step_2").is_dir()


def test_init_from_on_resume_is_compared_as_a_folder_not_as_text(tmp_path, corpus, capsys, monkeypatch):
    """`--init-from base/step_1` resumed with `./base/step_1/` or its absolute path was refused as
    another run's ("--init-from ./base/step_1/ differs from the run's base/step_1"): the same folder."""
    monkeypatch.chdir(tmp_path)
    assert cli_main(tiny_args(corpus, tmp_path / "base", "--max-steps", "2", "--save-every", "1")) == 0
    tuned = tiny_args(corpus, tmp_path / "tuned", "--init-from", "base/step_1")
    assert cli_main([*tuned, "--max-steps", "1"]) == 0
    for n, same in enumerate(("./base/step_1/", str(tmp_path / "base" / "step_1"), "base//step_1"), 2):
        assert cli_main([*tuned[:-1], same, "--max-steps", str(n), "--resume"]) == 0, capsys.readouterr().err
    saved = json.loads((tmp_path / "tuned" / "train.json").read_text(encoding="utf-8"))["train"]["init_from"]
    assert saved == str(tmp_path / "base" / "step_1")  # absolute, as the data paths: a resume from elsewhere compares it
    capsys.readouterr()
    assert cli_main([*tuned[:-1], "base/step_2", "--max-steps", "5", "--resume"]) == 2  # another checkpoint still is refused
    assert "--init-from base/step_2 differs from the run's" in capsys.readouterr().err


@pytest.mark.parametrize("when", ["the last step", "the final validation", "the last epoch's validation"])
def test_a_signal_as_the_run_ends_gives_no_hint_to_resume(tmp_path, corpus, capsys, monkeypatch, when):
    """Ctrl-C as a run met its limit printed "to resume, run: ..." and exited 130, though the resume
    takes no step; at the last step of --max-steps it also skipped the final validation, so that the
    run never kept best/ (nor a valid record) for its final model: the resume did not write it either."""
    import os
    import signal

    from aiayn import checkpoint as ckpt
    from aiayn import train as T
    from aiayn import trainer as TR

    def interrupt() -> None:
        os.kill(os.getpid(), signal.SIGINT)  # the Stopper's handler takes it (in this, the main thread)

    if when == "the last step":
        step = TR.Trainer.train_step
        monkeypatch.setattr(TR.Trainer, "train_step", lambda self, b: (step(self, b), self.step == 5 and interrupt())[0])
    else:
        validate = T.validate
        monkeypatch.setattr(T, "validate", lambda *a, **kw: (validate(*a, **kw), interrupt())[0])
    limit = ["--max-epochs", "1"] if when == "the last epoch's validation" else ["--max-steps", "5"]
    out = tmp_path / "run"
    assert cli_main(tiny_args(corpus, out, *limit, "--save-every", "0")) == 0
    text = capsys.readouterr().out
    assert "to resume" not in text and f"stopped: reached {' '.join(limit)};" in text, text
    final = 5 if limit[0] == "--max-steps" else ckpt.step_checkpoints(out)[-1][0]
    valid = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"valid"' in x]
    assert [r["step"] for r in valid] == [final] and (out / "best").is_dir()


@pytest.mark.parametrize("flag", ["--src", "--tgt"])
@pytest.mark.parametrize("code", ["", " ", "de en", "de\n"])
def test_an_empty_or_blank_language_code_is_refused_before_anything_is_written(tmp_path, corpus, capsys, flag, code):
    """`--src ""` (an unset shell variable) trained a whole run, whose checkpoints `serve` then refused
    ("config.json names no source and target language"); "de en" was recorded as a language."""
    out = tmp_path / "run"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1", flag, code)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"aiayn train: error: {flag} must be a language code") and err.count("\n") == 1, err
    assert not out.exists()
    config = tmp_path / "recipe.toml"  # the same from a --config file, named with it
    config.write_text(f"{flag[2:]} = {json.dumps(code)}\n", encoding="utf-8")
    args = tiny_args(corpus, out, "--max-steps", "1")
    assert cli_main([*args[:1], "--config", str(config), *args[1:]]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"aiayn train: error: --config {config}: {flag} must be a language code"), err
    assert not out.exists()


def test_a_run_that_recorded_an_empty_language_resumes(tmp_path, corpus, capsys):
    """A run from before "" was refused may have recorded src "": it resumes, with the default pair."""
    out = tmp_path / "run"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1", "--save-every", "1")) == 0
    for f in [*out.glob("*/config.json"), out / "train.json"]:
        cfg = json.loads(f.read_text())
        cfg["train"].update(src="", tgt="")
        f.write_text(json.dumps(cfg))
    capsys.readouterr()
    assert cli_main(["train", "--out", str(out), "--resume", "--max-steps", "2"]) == 0, capsys.readouterr().err
    saved = json.loads((out / "step_2" / "config.json").read_text())["train"]
    assert (saved["src"], saved["tgt"]) == ("de", "en")


@pytest.mark.parametrize("where", ["a metrics line", "metrics.jsonl rewritten on resume", "train.json"])
def test_a_full_disk_at_the_runs_own_files_is_one_line_naming_the_file(tmp_path, corpus, capsys, monkeypatch, where):
    """The checkpoints' writes said what was left and what to do on a full disk, but metrics.jsonl and
    train.json stopped the run with a bare "aiayn train: error: No space left on device" (the resume's
    rewrite of metrics.jsonl also left its metrics.jsonl.tmp behind)."""
    import builtins
    import errno
    import os

    from aiayn import files
    from aiayn import train as T

    def full(*a: object, **kw: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    out = tmp_path / "run"
    args = tiny_args(corpus, out, "--max-steps", "2", "--save-every", "1", "--log-every", "1")
    if where != "a metrics line":
        assert cli_main(args) == 0
        args = [*args[:-6], "--max-steps", "3", "--resume"]
    capsys.readouterr()
    with monkeypatch.context() as m:
        if where == "a metrics line":
            m.setattr(T, "open", lambda path, *a, **kw: full() if Path(path).name == "metrics.jsonl" else builtins.open(
                path, *a, **kw), raising=False)
        elif where == "train.json":
            m.setattr(T, "atomic_write_bytes", lambda path, data: full() if Path(path).name == "train.json" else
                      files.atomic_write_bytes(path, data))
        else:
            real = Path.write_text
            m.setattr(Path, "write_text", lambda self, *a, **kw: (real(self, "torn"), full()) if self.name.endswith(
                ".tmp") else real(self, *a, **kw))
        assert cli_main(args) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    file = out / ("train.json" if where == "train.json" else "metrics.jsonl")
    assert err == (f"aiayn train: error: could not write {file} (No space left on device); free space, then run the "
                   "same command with --resume (it continues from the last checkpoint)"), err
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))
    assert cli_main(args if "--resume" in args else [*args, "--resume"]) == 0  # and so it does


@pytest.mark.parametrize("text", ["max_tokens = 100\n[train]\nmax_tokens = 200\n",
                                  "d_model = 64\n[model]\nd_model = 32\n",
                                  "[model]\nseed = 3\n[train]\nseed = 4\n"])
def test_an_option_set_twice_in_a_config_file_is_refused(tmp_path, corpus, capsys, text):
    """A key at the top level and again in [train] or [model] (tables that are read as one) with
    another value: the later one won without a word."""
    config = tmp_path / "recipe.toml"
    config.write_text(text, encoding="utf-8")
    out = tmp_path / "run"
    args = tiny_args(corpus, out, "--max-steps", "1")
    assert cli_main([*args[:1], "--config", str(config), *args[1:]]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"aiayn train: error: --config {config}: ") and " is set twice, to " in err, err
    assert err.count("\n") == 1 and not out.exists()
    config.write_text("max_tokens = 160\n[train]\nmax_tokens = 160\n", encoding="utf-8")  # the same value twice: fine
    assert cli_main([*args[:1], "--config", str(config), *args[1:]]) == 0


@pytest.mark.parametrize("why", ["a missing data file", "a pair Multi30k lacks", "--tokens-per-update", "--data-bin"])
def test_a_run_refused_after_making_out_leaves_no_folder_behind(tmp_path, corpus, capsys, why):
    """Refusals found once --out was made (the data, the size of a step) left it behind, empty, with the
    parents it made: a refused run leaves the file system as it found it (an --out already there stays)."""
    out = tmp_path / "new" / "run"
    tiny = ["--preset", "tiny", "--out", str(out)]
    args = {"a missing data file": tiny_args({**corpus, "train_src": str(tmp_path / "missing.src")}, out),
            "a pair Multi30k lacks": ["train", "--data", "multi30k", "--src", "de", "--tgt", "ja", *tiny],
            "--tokens-per-update": tiny_args(corpus, out, "--tokens-per-update", "100"),
            "--data-bin": ["train", "--data-bin", str(tmp_path / "none"), *tiny]}[why]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("aiayn train: error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "new").exists()
    out.mkdir(parents=True)  # the user's own (empty) folder
    assert cli_main(args) == 2
    assert out.is_dir() and not any(out.iterdir())


def test_resume_with_only_out_starts_a_run_left_without_checkpoint_on_its_train_json(tmp_path, corpus, capsys):
    """A run stopped before its first checkpoint (a second Ctrl-C during its final validation, a kill)
    leaves train.json with every setting; `--out RUN --resume` said "nothing to resume ... starting a new
    run" and failed on "no training data": the new start takes the settings recorded there."""
    import shutil

    from test_train import weights

    out = tmp_path / "run"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1")) == 0
    first = weights(out, 1)
    for name in ("step_1", "best"):
        shutil.rmtree(out / name)
    capsys.readouterr()
    assert cli_main(["train", "--out", str(out), "--resume"]) == 0, capsys.readouterr().err
    again = weights(out, 1)
    assert first.keys() == again.keys() and all(first[k].equal(again[k]) for k in first)  # every setting the same


def test_fine_tuning_keeps_pairs_within_the_checkpoints_table_of_positions(tmp_path, corpus, capsys):
    """A model whose table holds P positions (an imported Marian model's max_position_embeddings)
    translates sources of P tokens with their EOS, and an export decodes at most P: fine-tuned with the
    default --max-len 256, it trained on positions it never translates, without a word. The default is
    capped at P - 1 with a note; a --max-len given past it is refused."""
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    assert cli_main(tiny_args(corpus, base, "--max-steps", "1", "--max-positions", "9", "--max-len", "8")) == 0
    args = tiny_args(corpus, tuned, "--max-steps", "1", "--init-from", str(base / "step_1"))
    for flag in ("--preset", "--vocab-size"):  # the checkpoint decides them
        i = args.index(flag)
        del args[i : i + 2]
    capsys.readouterr()
    assert cli_main([*args, "--max-len", "20"]) == 2
    assert capsys.readouterr().err == (f"aiayn train: error: --max-len 20: --init-from {base / 'step_1'} has a table of "
                                       "9 positions, which holds pairs of at most 8 tokens a side (the source's EOS, "
                                       "the target's BOS); give --max-len 8 or less\n")
    assert not tuned.exists()
    assert cli_main(args) == 0
    text = capsys.readouterr().out
    assert "note: --max-len 8, not 256: " in text and "as longer than 8 tokens" in text, text
    assert json.loads((tuned / "train.json").read_text(encoding="utf-8"))["train"]["max_len"] == 8


def test_a_new_run_past_its_table_of_positions_is_refused(tmp_path, corpus, capsys):
    """--max-positions 9 with the default --max-len 256 trained on positions translate never reads (it
    cuts a source at 9 tokens with its EOS) and an export cannot represent, without a word; a fine-tuning
    keeps its pairs within them (above). Refused before anything is written, naming both flags."""
    out = tmp_path / "run"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1", "--max-positions", "9")) == 2
    assert capsys.readouterr().err == ("aiayn train: error: --max-len 256 is past --max-positions 9: a table of 9 "
                                       "positions holds pairs of at most 8 tokens a side (the source's EOS, the "
                                       "target's BOS), as translate and an export read them; give --max-len 8 or "
                                       "less, or --max-positions 257 or more\n")
    assert not out.exists()
    assert cli_main(tiny_args(corpus, out, "--max-steps", "1", "--max-positions", "9", "--max-len", "8")) == 0


def test_a_resume_right_after_a_kill_mid_save_resumes_the_checkpoint_moved_aside(tmp_path, corpus, capsys):
    """A kill between `write_dir_atomic`'s two renames leaves the checkpoint being replaced as
    `.tmp-old-step_N-*` and no step_N/; --resume listed the checkpoints before putting it back, said
    "nothing to resume" and started the run again from step 0 over it."""
    out = tmp_path / "run"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "2", "--valid-bleu", "0")) == 0
    (out / "step_2").rename(out / ".tmp-old-step_2-0123abcd")
    capsys.readouterr()
    assert cli_main(["train", "--out", str(out), "--resume", "--max-steps", "3"]) == 0
    text = capsys.readouterr().out
    assert f"resuming from {out / 'step_2'}" in text and "nothing to resume" not in text, text
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("step_", ".tmp"))) == ["step_2", "step_3"]
