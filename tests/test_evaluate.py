"""`corpus_scores` and `aiayn evaluate`: sacreBLEU numbers and signatures, the three input modes,
one-line errors for misaligned or incomplete input."""

import json
import os
import random
from pathlib import Path

import pytest
import sacrebleu
import torch

from aiayn import cli
from aiayn.checkpoint import save_checkpoint
from aiayn.config import preset
from aiayn.errors import AiaynError
from aiayn.evaluate import corpus_scores
from aiayn.model import Transformer
from aiayn.tokenizer import Tokenizer, TokenizerPair
from aiayn.translator import Translator

HYPS = ["The cat sat on the mat .", "a dog runs in the park", "Two men play football ."]
REFS = ["The cat sat on the mat .", "A dog is running in the park", "two men are playing soccer ."]
FAST = ["--beam", "2", "--max-len-a", "0", "--max-len-b", "4"]


def write(path: Path, lines) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_corpus_scores_match_sacrebleu():
    s = corpus_scores(HYPS, REFS)
    assert s["bleu"] == round(sacrebleu.corpus_bleu(HYPS, [REFS]).score, 2)
    assert s["chrf"] == round(sacrebleu.corpus_chrf(HYPS, [REFS]).score, 2)
    assert s["bleu_lc"] == round(sacrebleu.corpus_bleu(HYPS, [REFS], lowercase=True).score, 2)
    assert s["bleu_lc"] > s["bleu"]  # "a dog"/"A dog" and "Two"/"two" only match lowercased
    assert "case:mixed" in s["bleu_signature"] and "case:lc" in s["bleu_lc_signature"]
    assert s["n"] == 3
    assert corpus_scores(REFS, REFS)["bleu"] == 100.0


def test_corpus_scores_rejects_misaligned():
    with pytest.raises(AiaynError, match="2 hypotheses but 3 references"):
        corpus_scores(HYPS[:2], REFS)
    with pytest.raises(ValueError):  # still a ValueError for library callers
        corpus_scores([], [])


def test_hyp_file_mode_json_and_text(tmp_path, capsys):
    hyp, ref = write(tmp_path / "hyp.txt", HYPS), write(tmp_path / "ref.txt", REFS)
    assert cli.main(["evaluate", "--hyp-file", hyp, "--ref-file", ref, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert {k: got[k] for k in ("bleu", "bleu_lc", "chrf", "n")} == {
        k: v for k, v in corpus_scores(HYPS, REFS).items() if k in ("bleu", "bleu_lc", "chrf", "n")}
    assert cli.main(["evaluate", "--hyp-file", hyp, "--ref-file", ref]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"BLEU = {got['bleu']:.2f}  (nrefs:1|case:mixed|eff:no|tok:13a")
    assert "BLEU (lowercased)" in text and "chrF2 = " in text


def test_several_reference_files_are_several_references_per_line(tmp_path, capsys):
    """--ref-file A B scores as sacreBLEU does with two references a line; a second file of another
    length is named."""
    other = ["A dog runs through the snow.", "Two people are walking.", "A woman sings on stage."]
    hyp, ref, ref2 = write(tmp_path / "hyp.txt", HYPS), write(tmp_path / "ref.txt", REFS), write(tmp_path / "r2.txt", other)
    assert cli.main(["evaluate", "--hyp-file", hyp, "--ref-file", ref, ref2, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["bleu"] == round(sacrebleu.corpus_bleu(HYPS, [REFS, other]).score, 2) != corpus_scores(HYPS, REFS)["bleu"]
    assert got["chrf"] == round(sacrebleu.corpus_chrf(HYPS, [REFS, other]).score, 2)
    assert "nrefs:2" in got["bleu_signature"] and got["reference_files"] == [ref, ref2] and got["references"] == ref
    assert cli.main(["evaluate", "--hyp-file", hyp, "--ref-file", ref, "--ref-file", ref2, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bleu"] == got["bleu"]  # the flag again: one more file, not another
    short = write(tmp_path / "short.txt", other[:2])
    assert cli.main(["evaluate", "--hyp-file", hyp, "--ref-file", ref, short]) == 2
    assert f"but {short} has 2 references" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--hyp-file", "H", "--ref-file", "R3"], "has 2 hypotheses but"),
    (["--hyp-file", "H"], "--ref-file"),
    (["--ref-file", "R3"], "--checkpoint"),
    (["--checkpoint", "C", "--data", "multi30k"], "--src and --tgt"),
    (["--hyp-file", "/nonexistent/h.txt", "--ref-file", "R3"], "/nonexistent/h.txt"),
    (["--hyp-file", "H", "--ref-file", "R3", "--save-hyps", "S"], "--save-hyps saves the translations a --checkpoint"),
])
def test_user_errors_are_one_line(argv, words, tmp_path, capsys):
    files = {"H": write(tmp_path / "h.txt", HYPS[:2]), "R3": write(tmp_path / "r.txt", REFS), "C": str(tmp_path)}
    assert cli.main(["evaluate", *[files.get(a, a) for a in argv]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    rng = random.Random(0)
    words = "a man woman dog runs the in on blue red street child plays ball Mann Hund läuft ein".split()
    tok = Tokenizer.train([" ".join(rng.choice(words) for _ in range(8)) for _ in range(200)], 300)
    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size)).eval()
    path = tmp_path_factory.mktemp("run") / "best"
    save_checkpoint(path, model, TokenizerPair(tok, tok, joint=True), {"train": {}, "step": 1})
    return path


def test_src_file_mode_translates_then_scores(ckpt, tmp_path, capsys):
    src = ["ein Mann läuft", "", "the blue dog"]
    s, r, h = write(tmp_path / "s.txt", src), write(tmp_path / "r.txt", REFS), tmp_path / "hyps.txt"
    assert cli.main(["evaluate", "--checkpoint", str(ckpt), "--src-file", s, "--ref-file", r, "--json",
                     "--save-hyps", str(h), *FAST]) == 0
    got = json.loads(capsys.readouterr().out)
    hyps = Translator.from_checkpoint(ckpt).translate(src, beam=2, max_len_a=0.0, max_len_b=4)
    assert h.read_text(encoding="utf-8").split("\n")[:-1] == hyps
    assert got["bleu"] == corpus_scores(hyps, REFS)["bleu"] and got["chrf"] == corpus_scores(hyps, REFS)["chrf"]
    assert got["beam"] == 2 and got["precision"] == "fp32"


def test_notes_while_translating_name_evaluate(ckpt, tmp_path, capsys):
    """A source line past the model's positions is cut, and said so by the command that runs: the
    note said "aiayn translate" under evaluate."""
    src = ["ein Mann läuft", " ".join(["Hund"] * 400)]
    s, r = write(tmp_path / "s.txt", src), write(tmp_path / "r.txt", REFS[:2])
    assert cli.main(["evaluate", "--checkpoint", str(ckpt), "--src-file", s, "--ref-file", r, *FAST]) == 0
    err = capsys.readouterr().err
    assert "aiayn evaluate: line 2:" in err and "aiayn translate" not in err, err


@pytest.mark.skipif(not os.path.isdir(os.path.join(os.environ.get("AIAYN_DATA", ""), "multi30k")),
                    reason="needs AIAYN_DATA (the Multi30k data root)")
def test_multi30k_mode(ckpt, capsys):
    argv = ["evaluate", "--checkpoint", str(ckpt), "--data", "multi30k", "--src", "de", "--tgt", "en",
            "--split", "test_2016_flickr", "--json", "--beam", "1", "--max-len-a", "0", "--max-len-b", "2"]
    assert cli.main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["n"] == 1000 and got["source"].endswith("test_2016_flickr.de.gz")
    assert got["references"].endswith("test_2016_flickr.en.gz")


@pytest.mark.skipif(not os.path.isdir(os.path.join(os.environ.get("AIAYN_DATA", ""), "multi30k")),
                    reason="needs AIAYN_DATA (the Multi30k data root)")
def test_multi30k_the_wrong_way_round_is_refused(ckpt, tmp_path, capsys):
    """A Multi30k checkpoint scored on the other direction came out near 0 BLEU without a word."""
    import shutil

    run = tmp_path / "de-en"
    shutil.copytree(ckpt, run)
    cfg = json.loads((run / "config.json").read_text())
    cfg["train"].update(data="multi30k", src="de", tgt="en")
    (run / "config.json").write_text(json.dumps(cfg))
    argv = ["evaluate", "--checkpoint", str(run), "--data", "multi30k", "--src", "en", "--tgt", "de", "--beam", "1"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (f"aiayn evaluate: error: {run} translates de to en (trained on Multi30k), "
                                       "not en to de; use --src de --tgt en\n")
    cfg["train"] = {"src": "de", "tgt": "en"}  # an import's: its pair from the Marian directory
    cfg["imported_from"] = {"kind": "marian", "source": "opus-mt-de-en"}
    (run / "config.json").write_text(json.dumps(cfg))
    assert cli.main(argv) == 2
    assert "translates de to en (imported), not en to de" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.isdir(os.path.join(os.environ.get("AIAYN_DATA", ""), "multi30k")),
                    reason="needs AIAYN_DATA (the Multi30k data root)")
def test_multi30k_the_wrong_way_round_is_refused_for_an_export_too(tmp_path, capsys):
    """A CTranslate2 export records its checkpoint's languages and corpus (aiayn.json): evaluate
    --engine ctranslate2 refuses the other direction before loading it, as for the checkpoint."""
    export = tmp_path / "ct2"
    export.mkdir()
    (export / "aiayn.json").write_text(json.dumps({"train": {"src": "de", "tgt": "en", "data": "multi30k"}}))
    (export / "model.bin").write_bytes(b"")
    argv = ["evaluate", "--engine", "ctranslate2", "--checkpoint", str(export), "--data", "multi30k",
            "--src", "en", "--tgt", "de", "--beam", "1"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (f"aiayn evaluate: error: {export} translates de to en (trained on Multi30k), "
                                       "not en to de; use --src de --tgt en\n")


def test_an_all_empty_hypothesis_file_is_scored(tmp_path, capsys):
    h, r = write(tmp_path / "h.txt", [""]), write(tmp_path / "r.txt", ["A dog runs ."])
    assert cli.main(["evaluate", "--hyp-file", h, "--ref-file", r, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["n"] == 1 and got["bleu"] == 0.0
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    assert cli.main(["evaluate", "--hyp-file", str(empty), "--ref-file", r]) == 2
    assert "file is empty" in capsys.readouterr().err


def test_save_hyps_is_checked_before_translating(ckpt, tmp_path, capsys, monkeypatch):
    from aiayn.translator import Translator

    searched = []
    for name in ("translate", "search"):  # a spy: nothing may be translated before the error
        real = getattr(Translator, name)
        monkeypatch.setattr(Translator, name, lambda self, *a, _real=real, _name=name, **k:
                            searched.append(_name) or _real(self, *a, **k))
    s, r = write(tmp_path / "s.txt", ["ein Mann"]), write(tmp_path / "r.txt", ["a man"])
    for target, words in ((r, "is also an input file"), (s, "is also an input file"),
                          (str(tmp_path), "is a folder"), (str(tmp_path / "no" / "h.txt"), "no folder"),
                          ("-", "the scores go to standard output")):
        assert cli.main(["evaluate", "--checkpoint", str(ckpt), "--src-file", s, "--ref-file", r,
                         "--save-hyps", target, *FAST]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
    assert searched == []
    assert Path(r).read_text() == "a man\n" and Path(s).read_text() == "ein Mann\n"
    assert cli.main(["evaluate", "--checkpoint", str(ckpt), "--src-file", s, "--ref-file", r, "--save-hyps",
                     str(tmp_path / "h.txt"), *FAST]) == 0
    assert searched  # the spy sees a translation when there is one


def test_save_hyps_writes_through_a_link_and_into_a_fifo(ckpt, tmp_path, capsys):
    """--save-hyps treats the user's file as `translate --output` does: a link is written through
    (it stays a link), a FIFO is written into (not replaced by a file); a plain file is replaced."""
    import threading

    s, r = write(tmp_path / "s.txt", ["ein Mann", "der Hund"]), write(tmp_path / "r.txt", ["a man", "the dog"])
    target, link = tmp_path / "target.txt", tmp_path / "link.txt"
    target.write_text("old\n")
    link.symlink_to(target)
    argv = ["evaluate", "--checkpoint", str(ckpt), "--src-file", s, "--ref-file", r, *FAST, "--save-hyps"]
    assert cli.main([*argv, str(link)]) == 0
    assert link.is_symlink() and len(target.read_text().splitlines()) == 2
    fifo, got = tmp_path / "fifo", []
    os.mkfifo(fifo)
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    assert cli.main([*argv, str(fifo)]) == 0
    reader.join(timeout=60)
    assert fifo.is_fifo() and len(got[0].splitlines()) == 2


@pytest.mark.parametrize("flags", [["--beam", "1"], ["--precision", "int8"], ["--engine", "ctranslate2"],
                                   ["--tgt-lang", "de", "--alpha", "1.0"]])
def test_translation_flags_with_a_hyp_file_are_refused_not_ignored(flags, tmp_path, capsys):
    """Nothing is translated with --hyp-file: a search or precision flag was ignored, and the score
    read as that setting's. Flags that only say where and how fast (--device, --workers) pass."""
    h, r = write(tmp_path / "h.txt", HYPS), write(tmp_path / "r.txt", REFS)
    assert cli.main(["evaluate", "--hyp-file", h, "--ref-file", r, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "drop them" in err
    assert all(f in err for f in flags if f.startswith("--")), err
    assert cli.main(["evaluate", "--hyp-file", h, "--ref-file", r, "--beam", "4", "--workers", "2"]) == 0


def test_scoring_a_file_needs_no_device(tmp_path, capsys):
    """--hyp-file scores text: --device (say cuda on a machine without one) has nothing to run on."""
    h, r = write(tmp_path / "h.txt", HYPS), write(tmp_path / "r.txt", REFS)
    assert cli.main(["evaluate", "--hyp-file", h, "--ref-file", r, "--device", "cuda", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bleu"] == corpus_scores(HYPS, REFS)["bleu"]


def test_a_length_penalty_that_overflows_is_refused_before_loading(ckpt, tmp_path, capsys):
    s, r = write(tmp_path / "s.txt", ["ein Mann"]), write(tmp_path / "r.txt", ["a man"])
    assert cli.main(["evaluate", "--checkpoint", str(ckpt), "--src-file", s, "--ref-file", r, "--alpha", "1000"]) == 2
    err = capsys.readouterr().err
    assert "--alpha must be between 0 and 10" in err and err.count("\n") == 1


def test_save_hyps_in_a_folder_that_takes_no_new_file_writes_in_place(ckpt, tmp_path, capsys, monkeypatch):
    """A writable file of the user's in a folder where no file can be added (no temporary beside it)
    is written in place, as translate --output writes it; before, the temporary's failure refused it."""
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    s, r = write(tmp_path / "s.txt", ["ein Mann"]), write(tmp_path / "r.txt", ["a man"])
    target = tmp_path / "hyps.txt"
    target.write_text("old\n")
    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    assert cli.main(["evaluate", "--checkpoint", str(ckpt), "--src-file", s, "--ref-file", r, *FAST,
                     "--save-hyps", str(target)]) == 0
    assert target.read_text() != "old\n" and len(target.read_text().splitlines()) == 1


def test_save_hyps_on_a_full_disk_leaves_the_old_file_and_nothing_beside_it(ckpt, tmp_path, capsys, monkeypatch):
    """A disk that fills when the translations are flushed: one line, the old file as it was, and
    no hidden `.hyps.txt.*.partial` left in the folder (the failed commit was not cleaned up)."""
    import errno

    from aiayn import files

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    s, r = write(tmp_path / "s.txt", ["ein Mann"]), write(tmp_path / "r.txt", ["a man"])
    target = tmp_path / "hyps.txt"
    target.write_text("old\n")
    monkeypatch.setattr(files.os, "fsync", full)
    assert cli.main(["evaluate", "--checkpoint", str(ckpt), "--src-file", s, "--ref-file", r, *FAST,
                     "--save-hyps", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hyps.txt", "r.txt", "s.txt"]


def test_save_hyps_over_a_file_shared_through_a_group_keeps_its_group(ckpt, tmp_path, capsys):
    """The new file put in place of the user's takes its group as well as its mode; before, a file
    chgrp'd to a team's group came back in the user's own group, unreadable to the team."""
    new_gid = os.stat(write(tmp_path / "probe.txt", ["x"])).st_gid
    others = [g for g in ([1, 2] if os.geteuid() == 0 else os.getgroups()) if g != new_gid]
    if not others:
        pytest.skip("needs a second group to give the file")
    s, r = write(tmp_path / "s.txt", ["ein Mann"]), write(tmp_path / "r.txt", ["a man"])
    target = tmp_path / "hyps.txt"
    target.write_text("old\n")
    os.chown(target, -1, others[0])
    os.chmod(target, 0o640)
    assert cli.main(["evaluate", "--checkpoint", str(ckpt), "--src-file", s, "--ref-file", r, *FAST,
                     "--save-hyps", str(target)]) == 0
    st = os.stat(target)
    assert target.read_text() != "old\n" and (st.st_gid, st.st_mode & 0o7777) == (others[0], 0o640)


def test_an_empty_file_name_is_refused_naming_its_flag(ckpt, tmp_path, capsys):
    """`--save-hyps "$OUT"` with OUT unset: the translations went unsaved, exit 0, without a word; an
    empty --hyp-file/--src-file/--checkpoint read as a missing flag, an empty --ref-file as the folder "."."""
    s, r = write(tmp_path / "s.txt", ["ein Mann"]), write(tmp_path / "r.txt", ["a man"])
    for argv, flag in ((["--checkpoint", str(ckpt), "--src-file", s, "--ref-file", r, *FAST, "--save-hyps", ""],
                        "--save-hyps"),
                       (["--hyp-file", "", "--ref-file", r], "--hyp-file"),
                       (["--hyp-file", r, "--ref-file", r, ""], "--ref-file"),
                       (["--checkpoint", str(ckpt), "--src-file", "", "--ref-file", r], "--src-file"),
                       (["--checkpoint", "", "--src-file", s, "--ref-file", r], "--checkpoint")):
        assert cli.main(["evaluate", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{flag} '': an empty name" in err, err


def test_tokenized_hypotheses_are_warned_about_once_in_aiayns_words(tmp_path, capsys, caplog):
    """100 hypotheses ending in " ." made sacreBLEU warn twice (once per BLEU) that the data looked
    tokenized, advising a `force` parameter that `aiayn evaluate` has no flag for. One warning now says
    what it means: a final " ." costs nothing (13a splits it off anyway), other tokenization does."""
    refs = [f"A dog runs to tree {i}." for i in range(120)]
    h, r = write(tmp_path / "h.txt", [x[:-1] + " ." for x in refs]), write(tmp_path / "r.txt", refs)
    assert cli.main(["evaluate", "--hyp-file", h, "--ref-file", r]) == 0
    out, err = capsys.readouterr()
    assert "BLEU = 100.00" in out  # the final " ." costs nothing
    assert len(err.strip().splitlines()) == 1 and "warning: 120 of the 120 hypotheses" in err, err
    assert "detokenize" in err and "force" not in err
    assert not [rec for rec in caplog.records if rec.name.startswith("sacrebleu")]
    assert cli.main(["evaluate", "--hyp-file", h, "--ref-file", h, "--json"]) == 0  # references tokenized too
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "120 hypotheses and 120 references" in err, err
    short = write(tmp_path / "s.txt", [x[:-1] + " ." for x in refs[:99]] + refs[99:])  # sacreBLEU's 100
    assert cli.main(["evaluate", "--hyp-file", short, "--ref-file", r]) == 0
    assert capsys.readouterr().err == ""


def _multi30k_run(ckpt, tmp_path):
    """A copy of `ckpt` that says it was trained on Multi30k de->en."""
    import shutil

    run = tmp_path / "de-en"
    shutil.copytree(ckpt, run)
    cfg = json.loads((run / "config.json").read_text())
    cfg["train"].update(data="multi30k", src="de", tgt="en")
    (run / "config.json").write_text(json.dumps(cfg))
    return run


def test_the_wrong_direction_is_refused_before_its_files_are_looked_for(ckpt, tmp_path, capsys, monkeypatch):
    """The direction was checked after the files: without the data at hand it downloaded the other
    direction's files first (offline: a download error), or said they were missing, not what was wrong."""
    import aiayn.data.text

    run = _multi30k_run(ckpt, tmp_path)
    monkeypatch.delenv("AIAYN_DATA", raising=False)
    monkeypatch.setattr(aiayn.data.text, "download_multi30k",
                        lambda *a, **k: pytest.fail("downloaded the files of a direction it then refused"))
    (tmp_path / "empty" / "multi30k").mkdir(parents=True)
    for where in ([], ["--data-dir", str(tmp_path / "empty")]):
        argv = ["evaluate", "--checkpoint", str(run), "--data", "multi30k", "--src", "en", "--tgt", "de", *where]
        assert cli.main(argv) == 2
        assert capsys.readouterr().err == (f"aiayn evaluate: error: {run} translates de to en (trained on Multi30k), "
                                           "not en to de; use --src de --tgt en\n")


@pytest.mark.parametrize("extra,flags", [
    (["--src", "en", "--tgt", "de"], "--src, --tgt pick"),
    (["--split", "val"], "--split picks"),
    (["--data-dir", "D"], "--data-dir picks"),
])
def test_data_flags_without_data_are_refused_not_ignored(ckpt, tmp_path, capsys, extra, flags):
    """--src/--tgt/--split/--data-dir beside --src-file or --hyp-file did nothing, without a word: `--src en
    --tgt de` read as a check that the checkpoint translates en to de, and was none."""
    s, r = write(tmp_path / "s.txt", ["ein Mann"]), write(tmp_path / "r.txt", ["a man"])
    extra = [str(tmp_path) if a == "D" else a for a in extra]
    for argv in (["--checkpoint", str(ckpt), "--src-file", s, "--ref-file", r, *FAST], ["--hyp-file", r, "--ref-file", r]):
        assert cli.main(["evaluate", *argv, *extra]) == 2, argv
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and flags in err and "add --data multi30k, or drop them" in err, err


def test_a_closed_standard_output_is_refused_before_translating(ckpt, tmp_path, capsys, monkeypatch):
    """`aiayn evaluate ... >&-` translated everything, then printed the scores nowhere and exited 0."""
    import sys

    import aiayn.translate

    s, r = write(tmp_path / "s.txt", ["ein Mann"]), write(tmp_path / "r.txt", ["a man"])
    monkeypatch.setattr(aiayn.translate, "load_translator", lambda *a: pytest.fail("translated for nobody"))
    monkeypatch.setattr(sys, "stdout", None)
    for argv in (["--checkpoint", str(ckpt), "--src-file", s, "--ref-file", r], ["--hyp-file", r, "--ref-file", r]):
        assert cli.main(["evaluate", *argv]) == 2
        err = capsys.readouterr().err
        assert err == "aiayn evaluate: error: standard output is closed; the scores are printed there: redirect it " \
                      "to a file instead\n"


def test_a_standard_output_that_cannot_take_the_scores_says_so(ckpt, tmp_path, capsys, monkeypatch):
    """`> /dev/full` was `error: No space left on device`, naming neither standard output nor the
    translations --save-hyps had saved."""
    import errno
    import sys

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def flush(self):
            pass

    s, r, h = write(tmp_path / "s.txt", ["ein Mann"]), write(tmp_path / "r.txt", ["a man"]), tmp_path / "h.txt"
    monkeypatch.setattr(sys, "stdout", Full())
    assert cli.main(["evaluate", "--hyp-file", r, "--ref-file", r]) == 2
    assert capsys.readouterr().err == ("aiayn evaluate: error: standard output: cannot write the scores "
                                       "(No space left on device)\n")
    assert cli.main(["evaluate", "--checkpoint", str(ckpt), "--src-file", s, "--ref-file", r, *FAST, "--json",
                     "--save-hyps", str(h)]) == 2
    assert capsys.readouterr().err == ("aiayn evaluate: error: standard output: cannot write the scores "
                                       f"(No space left on device); the translations are saved in {h}\n")
    assert h.read_text(encoding="utf-8").count("\n") == 1


def test_an_empty_target_language_is_refused(ckpt, tmp_path, capsys):
    """`--tgt-lang "$LANG"` with LANG unset was taken for no --tgt-lang at all."""
    s, r = write(tmp_path / "s.txt", ["ein Mann"]), write(tmp_path / "r.txt", ["a man"])
    assert cli.main(["evaluate", "--checkpoint", str(ckpt), "--src-file", s, "--ref-file", r, *FAST,
                     "--tgt-lang", ""]) == 2
    assert "--tgt-lang '': an empty name (an unset shell variable?)" in capsys.readouterr().err


def test_a_dash_reads_standard_input(ckpt, tmp_path):
    """`aiayn translate ... | aiayn evaluate --hyp-file - --ref-file R` was "-: no such file"; a --save-hyps
    that is the file standard input reads is refused as any input is, before it is written over."""
    import subprocess
    import sys

    h, r = write(tmp_path / "h.txt", HYPS), write(tmp_path / "r.txt", REFS)

    def evaluate(*argv, stdin):
        with open(stdin, "rb") as f:
            return subprocess.run([sys.executable, "-m", "aiayn", "evaluate", *argv], stdin=f, capture_output=True,
                                  text=True, timeout=600)

    got = evaluate("--hyp-file", "-", "--ref-file", r, "--json", stdin=h)
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["bleu"] == corpus_scores(HYPS, REFS)["bleu"]
    got = evaluate("--hyp-file", h, "--ref-file", "-", stdin=write(tmp_path / "r2.txt", REFS[:2]))
    assert got.returncode == 2 and got.stderr == (f"aiayn evaluate: error: {h} has 3 hypotheses but standard input has 2 "
                                                  "references; the files must be line-aligned\n")
    got = evaluate("--hyp-file", "-", "--ref-file", "-", stdin=h)
    assert got.returncode == 2 and "- (standard input) can be one of the files only" in got.stderr
    s = write(tmp_path / "s.txt", ["ein Mann", "der Hund", "ein Kind"])
    got = evaluate("--checkpoint", str(ckpt), "--src-file", "-", "--ref-file", r, *FAST, "--save-hyps", s, stdin=s)
    assert got.returncode == 2 and "s.txt: is also an input file" in got.stderr
    assert Path(s).read_text(encoding="utf-8") == "ein Mann\nder Hund\nein Kind\n"
