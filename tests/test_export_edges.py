"""`aiayn export` as a user breaks it: OUT in or as a training run's checkpoint, an export or a
Marian model given for the checkpoint, empty names, a kill mid-export (SIGTERM, SIGKILL, Ctrl-C
between the two renames of a replace), and a standard output that is gone or full. Each is one
line, exit 2 (or the signal's status), and nothing of the user's is lost or left half-written."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aiayn.checkpoint import save_checkpoint
from aiayn.cli import main
from aiayn.config import preset
from aiayn.model import Transformer
from aiayn.tokenizer import Tokenizer, TokenizerPair

import lexicon


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """An untrained tiny checkpoint: what these tests need is its files, not its translations."""
    path = tmp_path_factory.mktemp("edges") / "ckpt"
    tok = Tokenizer.train([f"{w} {v}" for w in lexicon.SRC for v in lexicon.TGT], 300)
    model = Transformer(preset("tiny", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size))
    save_checkpoint(path, model, TokenizerPair(tok, tok, joint=True), {"train": {"src": "en", "tgt": "de"}, "step": 1})
    return path


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def _no_load(monkeypatch) -> None:
    import aiayn.checkpoint

    monkeypatch.setattr(aiayn.checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("the model was loaded"))


def _run_dir(run: Path, ckpt: Path, names: tuple[str, ...]) -> Path:
    """A training run's folder: its train.json, and copies of `ckpt` as its checkpoints `names`."""
    run.mkdir()
    (run / "train.json").write_text("{}")
    for name in names:
        shutil.copytree(ckpt, run / name)
    return run


@pytest.mark.parametrize("target", ["hf", "ctranslate2"])
def test_out_in_or_named_as_a_runs_checkpoint_is_refused(ckpt, tmp_path, capsys, monkeypatch, target):
    """Inside runs/x/best/, the export went when the run saved a better best/ (step_<N>/: pruned); as
    runs/x/best it was taken for the run's checkpoint: `translate --checkpoint runs/x` failed on it."""
    run = _run_dir(tmp_path / "run", ckpt, ("best", "step_5"))
    bare = _run_dir(tmp_path / "bare", ckpt, ("step_3",))  # no best/ yet
    _no_load(monkeypatch)
    for source, out, words in ((run, run / "best" / "hf", "is inside"), (run / "step_5", run / "step_5" / "x", "is inside"),
                               (run, run / "step_5" / "a" / "b", "is inside"), (bare, bare / "best", "names a checkpoint"),
                               (bare, bare / "step_9", "names a checkpoint")):
        assert main(["export", "--checkpoint", str(source), "--to", target, str(out)]) == 2
        err = _one_line(capsys)
        assert words in err and str(out) in err, err
        assert not out.exists()
    assert sorted(p.name for p in (run / "best").iterdir()) == sorted(p.name for p in ckpt.iterdir())


def test_an_export_beside_a_runs_checkpoints_is_taken(ckpt, tmp_path, capsys):
    pytest.importorskip("ctranslate2")
    run = _run_dir(tmp_path / "run", ckpt, ("best",))
    assert main(["export", "--checkpoint", str(run), "--to", "ctranslate2", str(run / "ct2")]) == 0
    assert (run / "ct2" / "aiayn.json").is_file()
    other = tmp_path / "exports"  # `best` elsewhere is a name like any other
    assert main(["export", "--checkpoint", str(run), "--to", "ctranslate2", str(other / "best")]) == 0


def test_an_export_or_a_marian_model_given_as_the_checkpoint_says_what_to_give(ckpt, tmp_path, capsys):
    """It was `config.json has no "model" section; it is not an aiayn checkpoint config`."""
    pytest.importorskip("ctranslate2")
    pytest.importorskip("transformers")
    for target in ("hf", "ctranslate2"):
        assert main(["export", "--checkpoint", str(ckpt), "--to", target, str(tmp_path / target)]) == 0
    capsys.readouterr()
    for given, words in (("hf", "is an aiayn export to Hugging Face"), ("ctranslate2", "is an aiayn export to CTranslate2")):
        assert main(["export", "--checkpoint", str(tmp_path / given), "--to", "hf", str(tmp_path / "again")]) == 2
        err = _one_line(capsys)
        assert words in err and f"made from ({ckpt})" in err, err
    opus = tmp_path / "opus"
    opus.mkdir()
    (opus / "config.json").write_text(json.dumps({"model_type": "marian", "d_model": 512}))
    assert main(["export", "--checkpoint", str(opus), "--to", "ctranslate2", str(tmp_path / "again")]) == 2
    assert "is a Hugging Face Marian model" in _one_line(capsys)
    assert not (tmp_path / "again").exists()


def test_empty_names_are_refused(ckpt, tmp_path, capsys, monkeypatch):
    """An unset shell variable: `--checkpoint ''` read the current folder, OUT '' was called the checkpoint."""
    _no_load(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert main(["export", "--checkpoint", "", "--to", "hf", "out"]) == 2
    assert "--checkpoint '': an empty name" in _one_line(capsys)
    assert main(["export", "--checkpoint", str(ckpt), "--to", "hf", ""]) == 2
    assert "OUT '': an empty name" in _one_line(capsys)


def test_a_file_on_the_way_to_out_is_refused_before_the_model_loads(ckpt, tmp_path, capsys, monkeypatch):
    """It was "cannot write to .../afile (File exists)", once the model was loaded and converted."""
    (tmp_path / "afile").write_text("keep")
    _no_load(monkeypatch)
    for out in ("afile/out", "afile/a/b"):
        assert main(["export", "--checkpoint", str(ckpt), "--to", "ctranslate2", str(tmp_path / out)]) == 2
        err = _one_line(capsys)
        assert f"{tmp_path / 'afile'} is a file, not a folder" in err, err
    assert (tmp_path / "afile").read_text() == "keep"


def test_the_export_names_its_checkpoint_by_its_full_path(ckpt, tmp_path, monkeypatch):
    """aiayn.json recorded `--checkpoint` as given, relative to a folder it does not name."""
    pytest.importorskip("ctranslate2")
    monkeypatch.chdir(ckpt.parent)
    assert main(["export", "--checkpoint", ckpt.name, "--to", "ctranslate2", str(tmp_path / "ct2")]) == 0
    assert json.loads((tmp_path / "ct2" / "aiayn.json").read_text())["aiayn_checkpoint"] == str(ckpt)


# ------------------------------------------------------------------------------------ kills


def _child(script: str, *args: str) -> subprocess.CompletedProcess:
    """`script` run by a new Python (signals that would end this one), without PYTHONUNBUFFERED: a
    user's standard output to a pipe or file is block-buffered."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_mid_export_leaves_no_half_export(ckpt, tmp_path, signum):
    """SIGTERM (a `kill`, `timeout`) or SIGHUP ended the export where it stood, its temporary folder
    beside OUT for good; now it is removed as after Ctrl-C, exit 128 + the signal."""
    pytest.importorskip("ctranslate2")
    out = tmp_path / "ct2"
    done = _child(f"""
        import os, signal, sys
        signal.signal({int(signum)}, signal.SIG_DFL)  # as in a terminal, even if started ignoring it (nohup)
        import aiayn.export as export
        from aiayn.cli import main
        write = export._write_marker
        def stop(tmp, info):
            write(tmp, info)
            os.kill(os.getpid(), {int(signum)})  # the last file is written, the folder not yet in place
        export._write_marker = stop
        sys.exit(main(["export", "--checkpoint", sys.argv[1], "--to", "ctranslate2", sys.argv[2]]))
        """, str(ckpt), str(out))
    assert done.returncode == 128 + signum, done.stderr
    assert done.stderr == f"aiayn export: stopped by {signal.Signals(signum).name}\n"
    assert sorted(os.listdir(tmp_path)) == []  # neither OUT nor its temporary


def test_a_kill_between_the_renames_of_a_replace_loses_neither_export(ckpt, tmp_path, capsys, monkeypatch):
    """Ctrl-C just after the earlier export was moved aside, before the new one took its place: the
    new one was deleted, OUT was gone, the earlier one hidden in .tmp-old-OUT. The two renames now
    finish first; the interrupt comes after."""
    pytest.importorskip("ctranslate2")
    out = tmp_path / "ct2"
    argv = ["export", "--checkpoint", str(ckpt), "--to", "ctranslate2", str(out)]
    assert main(argv) == 0
    rename = Path.rename

    def then_interrupt(self, target):  # type: ignore[no-untyped-def]
        moved = rename(self, target)
        if Path(target).name == ".tmp-old-ct2":
            os.kill(os.getpid(), signal.SIGINT)
        return moved

    monkeypatch.setattr(Path, "rename", then_interrupt)
    # Ctrl-C as in a terminal, even where the tests were started ignoring it (a background job of a script)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert main(argv) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    assert capsys.readouterr().err.endswith("aiayn export: interrupted\n")
    assert (out / "aiayn.json").is_file() and (out / "model.bin").is_file()
    assert sorted(os.listdir(tmp_path)) == ["ct2"]


def test_the_leftovers_of_a_killed_export_go_with_the_next_one(ckpt, tmp_path, capsys):
    """kill -9 left the temporary folder (a whole model's size) beside OUT for good, and a kill between
    the renames of a replace the earlier export in .tmp-old-OUT with OUT missing."""
    pytest.importorskip("ctranslate2")
    from aiayn.data.lock import parse_work_name, work_name

    out = tmp_path / "ct2"
    argv = ["export", "--checkpoint", str(ckpt), "--to", "ctranslate2", str(out)]
    assert main(argv) == 0
    host = parse_work_name(work_name("x"))[0]
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f".tmp-ct2-{host}-{gone.pid}-0123abcd"  # a process of this host that is no more
    elsewhere = tmp_path / f".tmp-ct2-otherhost-{gone.pid}-0123abcd"  # another machine's: cannot be asked
    theirs = tmp_path / ".tmp-ct2-notes"
    for d in (dead, elsewhere, theirs):
        d.mkdir()
        (d / "model.bin").write_text("half")
    os.rename(out, tmp_path / ".tmp-old-ct2")  # killed between the renames of a replace
    assert main(argv) == 0
    assert sorted(os.listdir(tmp_path)) == sorted(["ct2", elsewhere.name, theirs.name])
    assert (out / "aiayn.json").is_file()


# ------------------------------------------------------------------------------- standard output


@pytest.mark.parametrize("where", ["closed pipe", "full disk"])
def test_a_reader_gone_or_a_full_disk_after_the_export(ckpt, tmp_path, where):
    """The closing line was left to the interpreter's exit: `| head -0` and `> /dev/full` were
    "Exception ignored ... BrokenPipeError" (or OSError) and exit 120, after a complete export."""
    pytest.importorskip("ctranslate2")
    if where == "full disk" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    argv = [sys.executable, "-m", "aiayn", "export", "--checkpoint", str(ckpt), "--to", "ctranslate2",
            str(tmp_path / "ct2")]
    if where == "closed pipe":
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        p.stdout.close()  # the reader is gone before the line comes
        err = p.stderr.read().decode()
        assert p.wait(timeout=300) == 0 and err == "", err
    else:
        with open("/dev/full", "w") as full:
            done = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=300)
        assert done.returncode == 2
        assert done.stderr == ("aiayn export: error: standard output: cannot write (No space left on device); "
                               f"the export is complete in {tmp_path / 'ct2'}\n"), done.stderr
    assert (tmp_path / "ct2" / "aiayn.json").is_file()


def test_an_out_whose_aiayn_json_nests_too_deep_is_one_line(ckpt, tmp_path, capsys, monkeypatch):
    """A JSON array nested past Python's recursion limit was a RecursionError traceback."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "aiayn.json").write_text("[" * 200_000)
    _no_load(monkeypatch)
    assert main(["export", "--checkpoint", str(ckpt), "--to", "hf", str(out)]) == 2
    assert "is not an earlier aiayn export" in _one_line(capsys)
    assert (out / "aiayn.json").stat().st_size == 200_000
