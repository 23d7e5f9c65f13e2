"""Checkpoints: round trip, tied weights stored once, atomic writes under a full disk, loading that
trusts nothing (missing/corrupt files, config or tokenizer that does not fit), run-directory
resolution, pruning and weight averaging."""

from __future__ import annotations

import errno
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aiayn import checkpoint as ckpt
from aiayn.cli import main as cli_main
from aiayn.config import preset
from aiayn.errors import AiaynError
from aiayn.model import Transformer
from aiayn.tokenizer import Tokenizer, TokenizerPair

WORDS = "the a cat dog sees runs big small red house tree man woman child ball blue green eats".split()


def _lines(n: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (5,), generator=g).tolist()) for _ in range(n)]


@pytest.fixture(scope="module")
def tok() -> TokenizerPair:
    t = Tokenizer.train(_lines(200, 0), 300)
    return TokenizerPair(t, t, joint=True)


def _model(tok: TokenizerPair, seed: int = 0, **over) -> Transformer:  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    v = tok.src.vocab_size
    return Transformer(preset("tiny", src_vocab_size=v, tgt_vocab_size=v, **over))


def _save(path: Path, model: Transformer, tok: TokenizerPair, step: int = 1, state=None) -> None:  # type: ignore[no-untyped-def]
    """A training run's save (`in_run`: its step checkpoints are what a failed save leaves)."""
    ckpt.save_checkpoint(path, model, tok, {"train": {"seed": 1}, "step": step}, state, in_run=True)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_round_trip_restores_weights_config_tokenizer_and_state(tmp_path, tok):
    m = _model(tok)
    state = {"step": 7, "rng": [torch.get_rng_state()], "position": 3, "python": (3, tuple(range(5)), None)}
    _save(tmp_path / "c", m, tok, step=7, state=state)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["config.json", "model.safetensors", "spm.model",
                                                                  "trainer_state.pt"]
    c = ckpt.load_checkpoint(tmp_path / "c", with_trainer_state=True)
    assert _same_weights(c.model, m) and not c.model.training
    assert c.model_config == m.cfg and c.config["step"] == 7
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert set(cfg) >= {"model", "train", "tokenizer", "versions", "step"}
    assert cfg["versions"]["torch"] == torch.__version__ and cfg["tokenizer"]["src_sha256"] == tok.src.sha256()
    assert c.tokenizers.src == tok.src and c.tokenizers.joint
    assert c.trainer_state["position"] == 3 and torch.equal(c.trainer_state["rng"][0], state["rng"][0])
    assert c.trainer_state["python"] == state["python"]
    assert ckpt.load_checkpoint(tmp_path / "c").trainer_state is None


def test_tied_weights_are_stored_once_and_retied(tmp_path, tok):
    m = _model(tok)
    _save(tmp_path / "c", m, tok)
    stored = load_file(str(tmp_path / "c" / "model.safetensors"))
    tied = [k for k in stored if k in ("src_embed.weight", "tgt_embed.weight")]
    assert len(tied) == 1  # one tensor for the shared source/target embedding (and the output projection)
    c = ckpt.load_checkpoint(tmp_path / "c")
    assert c.model.src_embed.weight is c.model.tgt_embed.weight and c.model.output_weight is c.model.tgt_embed.weight
    # untied models keep separate tensors
    u = _model(tok, share_embeddings=False, tie_output=False)
    _save(tmp_path / "u", u, tok)
    assert {"src_embed.weight", "tgt_embed.weight", "out_proj.weight"} <= set(load_file(str(tmp_path / "u" / "model.safetensors")))
    assert _same_weights(ckpt.load_checkpoint(tmp_path / "u").model, u)


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("target", ["same", "new"])
def test_full_disk_leaves_previous_checkpoint_intact(tmp_path, tok, monkeypatch, target):
    run = tmp_path / "run"
    _save(run / "step_1", _model(tok, 0), tok, step=1, state={"step": 1})
    before = _tree(run / "step_1")

    def full_disk(tensors, filename, metadata=None):  # type: ignore[no-untyped-def]
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)  # a partial file, then the disk fills up
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(ckpt, "save_file", full_disk)
    dest = run / ("step_1" if target == "same" else "step_2")
    with pytest.raises(AiaynError, match="No space left on device.*previous checkpoint is intact"):
        _save(dest, _model(tok, 1), tok, step=2, state={"step": 2})
    assert _tree(run / "step_1") == before
    assert sorted(p.name for p in run.iterdir()) == ["step_1"]  # no half-written or temporary directory left
    assert ckpt.resolve_checkpoint(run) == run / "step_1"
    monkeypatch.undo()
    assert _same_weights(ckpt.load_checkpoint(run).model, _model(tok, 0))


def test_overwrite_replaces_a_checkpoint_only_when_complete(tmp_path, tok):
    _save(tmp_path / "best", _model(tok, 0), tok)
    _save(tmp_path / "best", _model(tok, 1), tok)
    assert _same_weights(ckpt.load_checkpoint(tmp_path / "best").model, _model(tok, 1))
    assert [p.name for p in tmp_path.iterdir()] == ["best"]


def test_half_written_checkpoint_is_never_taken_as_latest(tmp_path, tok):
    _save(tmp_path / "step_5", _model(tok), tok, step=5)
    # what a kill during a save leaves behind: a temporary directory, and a step dir without config.json
    (tmp_path / ".tmp-step_9-deadbeef").mkdir()
    (tmp_path / ".tmp-step_9-deadbeef" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "step_7").mkdir()
    assert [s for s, _ in ckpt.step_checkpoints(tmp_path)] == [5]
    assert ckpt.resolve_checkpoint(tmp_path) == tmp_path / "step_5"
    ckpt.remove_stale_temporaries(tmp_path)
    assert not (tmp_path / ".tmp-step_9-deadbeef").exists()


def test_a_kill_between_the_two_renames_of_a_replace_loses_nothing(tmp_path, tok):
    _save(tmp_path / "best", _model(tok), tok, step=5)
    # killed after the old best/ was moved aside and before the new one was moved in
    os.rename(tmp_path / "best", tmp_path / ".tmp-old-best-0123abcd")
    (tmp_path / ".tmp-best-89abcdef").mkdir()  # the new one, unfinished
    _save(tmp_path / "step_7", _model(tok), tok, step=7)
    (tmp_path / "step_7").rename(tmp_path / ".tmp-old-step_7-00000000")  # replaced, and the successor is there
    _save(tmp_path / "step_7", _model(tok, seed=1), tok, step=7)
    ckpt.remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "step_7"]
    assert ckpt.load_checkpoint(tmp_path / "best").config["step"] == 5


def test_resolve_prefers_best_then_newest_step(tmp_path, tok):
    m = _model(tok)
    for s in (2, 10, 4):
        _save(tmp_path / f"step_{s}", m, tok, step=s)
    assert ckpt.resolve_checkpoint(tmp_path) == tmp_path / "step_10"  # numeric, not lexical, order
    _save(tmp_path / "best", m, tok)
    assert ckpt.resolve_checkpoint(tmp_path) == tmp_path / "best"
    assert ckpt.resolve_checkpoint(tmp_path / "step_4") == tmp_path / "step_4"
    ckpt.prune_checkpoints(tmp_path, keep_last=2)
    assert [s for s, _ in ckpt.step_checkpoints(tmp_path)] == [4, 10] and (tmp_path / "best").is_dir()
    (tmp_path / "empty").mkdir()
    with pytest.raises(AiaynError, match="holds no checkpoint"):
        ckpt.resolve_checkpoint(tmp_path / "empty")
    with pytest.raises(AiaynError, match="does not exist"):
        ckpt.load_checkpoint(tmp_path / "nope")
    (tmp_path / "in.txt").write_text("a file")
    with pytest.raises(AiaynError, match="in.txt is a file, not a folder"):
        ckpt.load_checkpoint(tmp_path / "in.txt")


def test_a_kill_while_pruning_leaves_no_half_deleted_checkpoint(tmp_path, tok, monkeypatch):
    m = _model(tok)
    for s in (1, 2, 3):
        _save(tmp_path / f"step_{s}", m, tok, step=s)

    def killed(path, *args, **kwargs):  # the process dies after removing one file
        next(p for p in sorted(Path(path).iterdir()) if p.name != "config.json").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.prune_checkpoints(tmp_path, keep_last=2)
    monkeypatch.undo()
    # the half-deleted step_1 is out of sight: no average, resolve or resume can pick it up
    assert [s for s, _ in ckpt.step_checkpoints(tmp_path)] == [2, 3]
    ckpt.remove_stale_temporaries(tmp_path)  # what the next `aiayn train` does first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3"]


@pytest.fixture()
def saved(tmp_path, tok) -> Path:
    _save(tmp_path / "c", _model(tok), tok, state={"step": 1})
    return tmp_path / "c"


def test_missing_files_are_named(saved):
    (saved / "model.safetensors").unlink()
    with pytest.raises(AiaynError, match=r"model\.safetensors is missing"):
        ckpt.load_checkpoint(saved)
    (saved / "spm.model").unlink()
    with pytest.raises(AiaynError, match="no tokenizer found"):
        ckpt.load_checkpoint(saved)
    (saved / "config.json").unlink()
    with pytest.raises(AiaynError, match="holds no checkpoint"):
        ckpt.load_checkpoint(saved)


def test_corrupt_files_give_one_clear_error(saved):
    w = saved / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(AiaynError, match="corrupt or truncated"):
        ckpt.load_checkpoint(saved)
    w.write_bytes(b"\xff" * 64)
    with pytest.raises(AiaynError, match="corrupt or truncated"):
        ckpt.load_checkpoint(saved)
    w.write_bytes(data)
    (saved / "config.json").write_text("{not json")
    with pytest.raises(AiaynError, match=r"config\.json is corrupt"):
        ckpt.load_checkpoint(saved)


def test_config_that_does_not_fit_the_weights(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["model"]["d_ff"] = 128
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AiaynError, match=r"has shape .* config does not fit the weights"):
        ckpt.load_checkpoint(saved)
    cfg["model"]["d_ff"] = 64
    cfg["model"]["encoder_layers"] = 3
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AiaynError, match="config does not fit the weights"):
        ckpt.load_checkpoint(saved)
    cfg["model"]["encoder_layers"] = 1
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AiaynError, match="tensors the model does not have"):
        ckpt.load_checkpoint(saved)
    cfg["model"]["n_heads"] = 5
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AiaynError, match="invalid model config"):
        ckpt.load_checkpoint(saved)


@pytest.mark.parametrize("field, value, words", [
    ("d_model", "abc", "d_model must be a whole number"),
    ("max_positions", 10.5, "max_positions must be a whole number"),
    ("n_heads", 4.0, "n_heads must be a whole number"),
    ("pad_id", 0.0, "pad_id must be a whole number"),
    ("norm_first", 0, "norm_first must be true or false"),
    ("dropout", "0.1", "dropout must be a finite number"),
    ("activation", 1, "activation must be a string"),
])
def test_config_values_of_the_wrong_type(saved, field, value, words):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["model"][field] = value
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AiaynError, match=words):
        ckpt.load_checkpoint(saved)


def test_a_tokenizer_section_that_is_not_an_object(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["tokenizer"] = [1]
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AiaynError, match='"tokenizer" must be an object'):
        ckpt.load_checkpoint(saved)


def test_tokenizer_that_does_not_fit_the_model(saved):
    other = Tokenizer.train(_lines(200, 1) + ["quick brown fox jumps over lazy"] * 20, 320)
    assert other.vocab_size != 300
    other.save(saved / "spm.model")
    with pytest.raises(AiaynError, match="tokenizer has .* pieces but the model's src_vocab_size"):
        ckpt.load_checkpoint(saved)
    same_size = Tokenizer.train(_lines(200, 2), 300)
    assert same_size.vocab_size == 300 and same_size.sha256() != json.loads((saved / "config.json").read_text())["tokenizer"]["src_sha256"]
    same_size.save(saved / "spm.model")
    with pytest.raises(AiaynError, match="not the one this model was trained with"):
        ckpt.load_checkpoint(saved)


class _Boom:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {_Boom.marker}",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_trainer_state_never_runs_code(saved, tmp_path):
    _Boom.marker = tmp_path / "pwned"  # type: ignore[attr-defined]
    with open(saved / "trainer_state.pt", "wb") as f:
        pickle.dump({"step": _Boom()}, f)
    with pytest.raises(AiaynError, match="corrupt or holds more than tensors"):
        ckpt.load_checkpoint(saved, with_trainer_state=True)
    assert not (tmp_path / "pwned").exists()
    torch.save({"step": 1, "obj": Path("x")}, saved / "trainer_state.pt")  # an arbitrary object, pickled by torch
    with pytest.raises(AiaynError, match="corrupt or holds more than tensors"):
        ckpt.load_checkpoint(saved, with_trainer_state=True)
    (saved / "trainer_state.pt").unlink()
    with pytest.raises(AiaynError, match="trainer_state.pt is missing"):
        ckpt.load_checkpoint(saved, with_trainer_state=True)


def test_average_of_last_n_checkpoints(tmp_path, tok, capsys):
    run = tmp_path / "run"
    models = [_model(tok, s) for s in range(4)]
    for i, m in enumerate(models):
        _save(run / f"step_{(i + 1) * 10}", m, tok, step=(i + 1) * 10)
    assert cli_main(["average", "--checkpoint", str(run), "-n", "3", "-o", str(tmp_path / "avg")]) == 0
    assert "averaged 3 checkpoints (step_20, step_30, step_40)" in capsys.readouterr().out
    avg = ckpt.load_checkpoint(tmp_path / "avg")
    for k, v in avg.model.state_dict().items():
        want = sum(m.state_dict()[k] for m in models[1:]) / 3
        torch.testing.assert_close(v, want, rtol=0, atol=1e-6)
    assert avg.model.src_embed.weight is avg.model.tgt_embed.weight
    assert len(avg.config["averaged_from"]) == 3
    # --inputs averages exactly the given directories
    assert cli_main(["average", "--inputs", str(run / "step_10"), str(run / "step_40"), "-o", str(tmp_path / "a2")]) == 0
    a2 = ckpt.load_checkpoint(tmp_path / "a2").model.state_dict()
    torch.testing.assert_close(a2["encoder.layers.0.ff.w1.weight"],
                               (models[0].state_dict()["encoder.layers.0.ff.w1.weight"]
                                + models[3].state_dict()["encoder.layers.0.ff.w1.weight"]) / 2, rtol=0, atol=1e-6)


def test_only_a_runs_own_step_names_are_checkpoints_and_average_takes_none(tmp_path, tok, capsys):
    """A run names its checkpoints step_<N> without leading zeros: a user's step_05 is not one (it
    would be resumed from, and pruned), and `average -o RUN/step_N` is refused (the run would take
    the average for a checkpoint of its own)."""
    run = tmp_path / "run"
    for name in ("step_5", "step_05", "step_0"):
        _save(run / name, _model(tok), tok, step=5)
    assert [p.name for _, p in ckpt.step_checkpoints(run)] == ["step_0", "step_5"]
    assert cli_main(["average", "--checkpoint", str(run), "-n", "2", "-o", str(run / "step_7")]) == 2
    err = capsys.readouterr().err
    assert "step_<N> is how aiayn train names its checkpoints" in err and err.count("\n") == 1
    assert not (run / "step_7").exists()


def test_average_refuses_mixed_models_and_bad_input(tmp_path, tok, capsys):
    _save(tmp_path / "a", _model(tok), tok)
    _save(tmp_path / "b", _model(tok, d_ff=128), tok)
    assert cli_main(["average", "--inputs", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "different model config" in err and err.count("\n") == 1
    assert cli_main(["average", "--checkpoint", str(tmp_path / "a"), "-o", str(tmp_path / "o")]) == 2
    assert "holds no step_<N>/ checkpoints" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_average_never_replaces_what_is_not_an_earlier_average(tmp_path, tok, capsys, monkeypatch):
    run = tmp_path / "run"
    for step in (1, 2):
        _save(run / f"step_{step}", _model(tok, seed=step), tok, step=step, state={"step": step})
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep")
    afile = tmp_path / "afile"
    afile.write_text("keep")
    fake = tmp_path / "proj"  # a config.json of something else
    fake.mkdir()
    (fake / "config.json").write_text("{}")
    (fake / "notes.txt").write_text("keep")
    for out, words in ((precious, "is not an earlier average"), (fake, "is not an earlier average"),
                       (run, "one of the checkpoints being averaged"),
                       (run / "step_2", "one of the checkpoints being averaged"), (afile / "x", "cannot make the folder"),
                       (run / "step_2" / "avg", "is inside")):
        assert cli_main(["average", "--checkpoint", str(run), "-n", "2", "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
    assert (precious / "notes.txt").read_text() == "keep" and afile.read_text() == "keep"
    assert sorted(p.name for p in run.iterdir()) == ["step_1", "step_2"]
    other = tmp_path / "other" / "step_9"
    _save(other, _model(tok, seed=9), tok, step=9, state={"step": 9})
    assert cli_main(["average", "--inputs", str(run / "step_1"), "-o", str(other)]) == 2
    assert "step_<N> is how aiayn train names its checkpoints" in capsys.readouterr().err
    assert cli_main(["average", "--inputs", str(run / "step_1"), "-o", str(precious / "step_9_avg")]) == 0
    assert cli_main(["average", "--inputs", str(run / "step_1"), str(run / "step_1"), "-o", str(tmp_path / "a2")]) == 2
    assert f"--inputs: {run / 'step_1'} is named twice" in capsys.readouterr().err
    assert (fake / "notes.txt").read_text() == "keep"
    monkeypatch.chdir(run / "step_1")
    assert cli_main(["average", "--checkpoint", str(run), "-n", "2", "-o", "."]) == 2
    assert "the current directory" in capsys.readouterr().err
    avg = tmp_path / "avg"
    avg.mkdir()  # an empty folder is taken
    for _ in range(2):  # an earlier average is replaced
        assert cli_main(["average", "--checkpoint", str(run), "-n", "2", "-o", str(avg)]) == 0
    assert (avg / "config.json").is_file()
    # an earlier average with something else in it (an export of it, `aiayn export ... avg/ct2`): the
    # replace deleted that too
    (avg / "ct2").mkdir()
    (avg / "ct2" / "model.bin").write_text("keep")
    assert cli_main(["average", "--checkpoint", str(run), "-n", "2", "-o", str(avg)]) == 2
    assert capsys.readouterr().err == (f"aiayn average: error: -o {avg} holds ct2, which an average did not write "
                                       "(replacing the folder would delete it); move it away or choose a new path\n")
    assert (avg / "ct2" / "model.bin").read_text() == "keep"


def test_average_refuses_a_symlinked_output_and_leaves_it_as_it_was(tmp_path, tok, capsys):
    """-o LINK to an empty folder succeeded, leaving the link renamed .tmp-old-LINK-* and the folder empty."""
    run = tmp_path / "run"
    _save(run / "step_1", _model(tok), tok, step=1, state={"step": 1})
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    assert cli_main(["average", "--checkpoint", str(run), "-n", "1", "-o", str(link)]) == 2
    err = capsys.readouterr().err
    # one wording for average, export and import (`files.refuse_symlink_output`), naming the flag
    assert err == f"aiayn average: error: -o {link} is a symbolic link; name the folder it points to, or choose a new -o\n"
    assert link.is_symlink() and link.resolve() == real.resolve() and not any(real.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real", "run"]


def test_average_refuses_checkpoints_with_different_tokenizers(tmp_path, tok):
    other = Tokenizer.train(_lines(200, 1) + ["quick brown fox jumps over lazy"] * 20, tok.src.vocab_size)
    pair = TokenizerPair(other, other, joint=True)
    _save(tmp_path / "a", _model(tok), tok)
    _save(tmp_path / "b", _model(tok), pair)
    with pytest.raises(AiaynError, match="another src tokenizer"):
        ckpt.average_checkpoints([tmp_path / "a", tmp_path / "b"], tmp_path / "avg")


def test_a_full_disk_reported_by_safetensors_is_a_clear_error(tmp_path, tok, monkeypatch):
    from safetensors import SafetensorError

    _save(tmp_path / "c", _model(tok), tok)
    before = _tree(tmp_path / "c")

    def full(*a, **kw):
        raise SafetensorError("Error while serializing: I/O error: File too large")

    monkeypatch.setattr(ckpt, "save_file", full)
    with pytest.raises(AiaynError, match="could not write checkpoint .*File too large.*previous checkpoint is intact"):
        _save(tmp_path / "c", _model(tok, seed=1), tok)
    assert _tree(tmp_path / "c") == before
    assert [p.name for p in tmp_path.iterdir()] == ["c"]  # no temporary left


def test_checkpoint_files_get_the_usual_modes(tmp_path, tok):
    import stat

    _save(tmp_path / "c", _model(tok), tok, state={"step": 1})
    umask = os.umask(0)
    os.umask(umask)
    for f in (tmp_path / "c").iterdir():  # safetensors alone would make model.safetensors 0600
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f.name


def test_average_holds_one_checkpoint_at_a_time(tmp_path, tok, monkeypatch):
    """20 big checkpoints are ~17 GB: averaging keeps a running sum and one loaded checkpoint."""
    import gc
    import weakref

    for i in range(4):
        _save(tmp_path / f"step_{i + 1}", _model(tok, i), tok, step=i + 1)
    alive: list[weakref.ref[Transformer]] = []
    most: list[int] = []
    real = ckpt.load_checkpoint

    def counting(path: Path, *a: bool, **kw: bool) -> ckpt.Checkpoint:
        gc.collect()
        most.append(sum(r() is not None for r in alive))  # models still held when the next one loads
        c = real(path, *a, **kw)
        alive.append(weakref.ref(c.model))
        return c

    monkeypatch.setattr(ckpt, "load_checkpoint", counting)
    ckpt.average_checkpoints([tmp_path / f"step_{i + 1}" for i in range(4)], tmp_path / "avg")
    assert len(most) == 4 and max(most) == 0, most
