"""`files.check_output_path`: the one check of an output's path that `translate --output`,
`plot -o`, `evaluate --save-hyps` and export's OUT make before any work. Each had its own copy,
its own wording, and its own gaps (plot said a folder as -o, or a file on the way, only after
drawing; translate and export a folder that could not be written in only once the model was
loaded or converted)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aiayn.checkpoint import save_checkpoint
from aiayn.cli import main
from aiayn.config import preset
from aiayn.errors import AiaynError
from aiayn.files import check_output_path, write_output_bytes
from aiayn.model import Transformer
from aiayn.tokenizer import Tokenizer, TokenizerPair

import lexicon

FAST = ["--beam", "1", "--max-len-a", "0", "--max-len-b", "3"]


def _refused(path: Path | str, flag: str = "-o", folder: bool = False) -> str:
    with pytest.raises(AiaynError) as e:
        check_output_path(path, flag, folder=folder)
    return str(e.value)


def _no_write(monkeypatch, *paths: Path) -> None:
    """`os.access` says `paths` may not be written (the tests may run as root, whom modes do not stop)."""
    real = os.access
    denied = {os.fspath(p) for p in paths}
    monkeypatch.setattr(os, "access", lambda p, mode, **k: not (os.fspath(p) in denied and mode & os.W_OK)
                        and real(p, mode, **k))


def test_each_case_is_one_line_naming_the_flag_and_the_path(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("keep")
    (tmp_path / "broken").symlink_to(tmp_path / "gone")
    cases = {
        tmp_path: f"-o {tmp_path}: is a folder; give a file's path (in it, or elsewhere)",
        tmp_path / "typo" / "sub" / "a.png": f"-o {tmp_path / 'typo' / 'sub' / 'a.png'}: no folder "
                                             f"{tmp_path / 'typo' / 'sub'}; make it first, or choose another path",
        afile / "a.png": f"-o {afile / 'a.png'}: {afile} is a file, not a folder; choose another path",
        afile / "x" / "a.png": f"-o {afile / 'x' / 'a.png'}: {afile} is a file, not a folder; choose another path",
        tmp_path / "broken" / "a.png": f"-o {tmp_path / 'broken' / 'a.png'}: {tmp_path / 'broken'} is a symbolic "
                                       f"link to nothing ({tmp_path / 'gone'}); choose another path",
        tmp_path / "broken" / "x" / "a.png": f"-o {tmp_path / 'broken' / 'x' / 'a.png'}: {tmp_path / 'broken'} is a "
                                             f"symbolic link to nothing ({tmp_path / 'gone'}); choose another path",
    }
    for path, message in cases.items():
        assert _refused(path) == message
    check_output_path(tmp_path / "new.png", "-o")  # a new file in a folder that is there
    check_output_path(afile, "-o")  # a file of the user's, replaced
    check_output_path(os.devnull, "-o")  # a device, written into
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "broken"]  # nothing made on the way


def test_a_place_that_may_not_be_written_is_refused(tmp_path, monkeypatch):
    old = tmp_path / "old.txt"
    old.write_text("keep")
    _no_write(monkeypatch, tmp_path)
    assert _refused(tmp_path / "new.txt", "--output") == (f"--output {tmp_path / 'new.txt'}: cannot write in {tmp_path} "
                                                          "(no permission); choose another path")
    check_output_path(old, "--output")  # a writable file in it: written in place
    _no_write(monkeypatch, old)
    assert _refused(old, "--output") == f"--output {old}: cannot write it (no permission); choose another path"
    assert old.read_text() == "keep"


def test_a_folder_output_may_be_there_and_may_be_new_under_missing_folders(tmp_path, monkeypatch):
    """Export's OUT: a folder replaced whole, made with the folders above it as `mkdir -p` would."""
    afile = tmp_path / "afile"
    afile.write_text("keep")
    check_output_path(tmp_path, "OUT", folder=True)
    check_output_path(tmp_path / "a" / "b" / "out", "OUT", folder=True)
    assert _refused(afile, "OUT", folder=True) == f"OUT {afile}: is not a folder; choose another path"
    assert _refused(afile / "a" / "out", "OUT", folder=True) == (f"OUT {afile / 'a' / 'out'}: {afile} is a file, "
                                                                 "not a folder; choose another path")
    _no_write(monkeypatch, tmp_path)
    assert _refused(tmp_path / "a" / "out", "OUT", folder=True) == (
        f"OUT {tmp_path / 'a' / 'out'}: cannot write in {tmp_path} (no permission); choose another path")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_a_users_new_file_is_written_in_no_folder_made_for_it(tmp_path):
    """`plot -o` and `evaluate --save-hyps` write through `write_output_bytes`, which made any missing
    folders (`mkdir -p`): a folder removed after the check came back, a typo's with it."""
    with pytest.raises(FileNotFoundError):
        write_output_bytes(tmp_path / "typo" / "a.png", b"x")
    assert list(tmp_path.iterdir()) == []
    write_output_bytes(tmp_path / "a.png", b"x")
    assert (tmp_path / "a.png").read_bytes() == b"x"


# ------------------------------------------------------------------------------ the four commands


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """An untrained tiny checkpoint: nothing here gets as far as loading it."""
    path = tmp_path_factory.mktemp("out") / "ckpt"
    tok = Tokenizer.train([f"{w} {v}" for w in lexicon.SRC for v in lexicon.TGT], 300)
    model = Transformer(preset("tiny", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size))
    save_checkpoint(path, model, TokenizerPair(tok, tok, joint=True), {"train": {}, "step": 1})
    return path


@pytest.fixture
def no_work(monkeypatch):
    """No model is loaded and no picture drawn: each refusal comes before any work."""
    import aiayn.checkpoint
    import aiayn.plot
    import aiayn.translate

    monkeypatch.setattr(aiayn.checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr(aiayn.translate, "load_translator", lambda *a, **k: pytest.fail("the model was loaded"))
    for name in ("lr_schedule_figure", "positional_encoding_figure", "save_figure"):
        monkeypatch.setattr(aiayn.plot, name, lambda *a, **k: pytest.fail("the picture was drawn"))


def _commands(ckpt: Path, src: Path, out: Path) -> list[tuple[list[str], str]]:
    return [(["translate", "--checkpoint", str(ckpt), "--input", str(src), "--output", str(out), *FAST], "--output"),
            (["plot", "lr-schedule", "-o", f"{out}.png"], "-o"),
            (["evaluate", "--checkpoint", str(ckpt), "--src-file", str(src), "--ref-file", str(src), *FAST,
              "--save-hyps", str(out)], "--save-hyps"),
            (["export", "--checkpoint", str(ckpt), "--to", "ctranslate2", str(out)], "OUT")]


def test_the_four_commands_refuse_a_file_on_the_way_in_one_wording(ckpt, tmp_path, no_work, capsys):
    """It was `X: cannot write (Not a directory) (--output)`, `-o X: cannot write (File exists)` once
    the picture was drawn, `P: no such directory (--save-hyps)`, `cannot write to X: P is a file ...`."""
    src = tmp_path / "in.txt"
    src.write_text("ein Mann\n")
    afile = tmp_path / "afile"
    afile.write_text("keep")
    for argv, flag in _commands(ckpt, src, afile / "out"):
        assert main(argv) == 2, argv
        out = argv[argv.index(flag) + 1] if flag != "OUT" else argv[-1]
        assert capsys.readouterr().err == (f"aiayn {argv[0]}: error: {flag} {out}: {afile} is a file, not a folder; "
                                           "choose another path\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "in.txt"] and afile.read_text() == "keep"


def test_the_four_commands_refuse_a_folder_that_takes_no_file_before_any_work(ckpt, tmp_path, no_work, monkeypatch,
                                                                              capsys):
    """translate and plot said so once the model was loaded or the picture drawn; export once the
    model was loaded and converted."""
    src = tmp_path / "in.txt"
    src.write_text("ein Mann\n")
    shut = tmp_path / "shut"
    shut.mkdir()
    _no_write(monkeypatch, shut)
    for argv, flag in _commands(ckpt, src, shut / "out"):
        assert main(argv) == 2, argv
        out = argv[argv.index(flag) + 1] if flag != "OUT" else argv[-1]
        assert capsys.readouterr().err == (f"aiayn {argv[0]}: error: {flag} {out}: cannot write in {shut} "
                                           "(no permission); choose another path\n")
    assert list(shut.iterdir()) == []


def test_plot_refuses_a_folder_as_its_output_before_drawing(tmp_path, no_work, capsys):
    (tmp_path / "d.png").mkdir()
    assert main(["plot", "lr-schedule", "-o", str(tmp_path / "d.png")]) == 2
    assert capsys.readouterr().err == (f"aiayn plot: error: -o {tmp_path / 'd.png'}: is a folder; give a file's path "
                                       "(in it, or elsewhere)\n")
