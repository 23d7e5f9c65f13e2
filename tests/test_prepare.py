"""`aiayn prepare` and the prepared directory: the arrays hold what the tokenizer says; the output is a
function of the inputs and settings only (byte-identical twice, whatever the worker count); bad input
is one line naming file and line; a killed run leaves nothing `train` accepts; memory stays bounded."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train import make_corpus

from aiayn import cli
from aiayn.data import bindata, prepare as P
from aiayn.data.bindata import open_prepared
from aiayn.data.text import collate, read_parallel
from aiayn.errors import AiaynError

SETTINGS = P.Settings(vocab_size=300, max_len=20)


def _prep(paths: dict[str, str], out: Path, settings: P.Settings = SETTINGS, workers: int = 1) -> Path:
    inputs = P.Inputs(*(Path(paths[k]) for k in ("train_src", "train_tgt", "valid_src", "valid_tgt")))
    return P.prepare(inputs, out, settings, workers, log=lambda m: None)


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture()
def corpus(tmp_path) -> dict[str, str]:
    return make_corpus(tmp_path / "data", n_train=300, n_valid=20)


def test_arrays_hold_the_tokenizer_ids_and_the_manifest_counts_them(tmp_path, corpus):
    out = _prep(corpus, tmp_path / "bin")
    d = open_prepared(out)
    src, tgt = read_parallel(corpus["train_src"], corpus["train_tgt"])
    want = [(d.tokenizers.src.encode(s), d.tokenizers.tgt.encode(t)) for s, t in zip(src, tgt)]
    kept = [p for p in want if max(len(p[0]), len(p[1])) <= 20]  # --long skip at --max-len 20
    assert 0 < len(kept) < len(want)
    assert [d.train.pair(i) for i in range(len(d.train))] == kept
    assert d.train.src.tokens.dtype == np.uint16 and d.train.src.offsets.dtype == np.int64  # 300 ids need 2 bytes
    assert d.train.src.lengths.dtype == np.uint8  # lengths up to 20
    split = d.manifest["splits"]["train"]
    assert (split["lines"], split["pairs"], split["skipped"]) == (300, len(kept), 300 - len(kept))
    assert split["src_tokens"] == sum(len(s) for s, _ in kept)
    assert d.manifest["inputs"]["train_src"]["sha256"] == hashlib.sha256(Path(corpus["train_src"]).read_bytes()).hexdigest()
    assert d.manifest["tokenizer"]["src_sha256"] == d.tokenizers.src.sha256()
    assert d.manifest["format"] == bindata.FORMAT and d.manifest["version"] == bindata.VERSION
    # validation pairs are truncated, not skipped, and stay aligned with the text kept for BLEU
    vs, vt = d.valid_text()
    assert (vs, vt) == read_parallel(corpus["valid_src"], corpus["valid_tgt"])
    assert d.valid is not None and len(d.valid) == 20
    assert d.valid.pair(3) == (d.tokenizers.src.encode(vs[3])[:20], d.tokenizers.tgt.encode(vt[3])[:20])


def test_truncate_counts_and_cuts(tmp_path, corpus):
    d = open_prepared(_prep(corpus, tmp_path / "bin", P.Settings(vocab_size=300, max_len=4, long="truncate")))
    assert len(d.train) == 300 and d.manifest["splits"]["train"]["truncated"] > 0
    assert int(d.train.src.lengths.max()) == 4


def test_collate_from_the_memory_map_equals_data_collate(tmp_path, corpus):
    d = open_prepared(_prep(corpus, tmp_path / "bin"))
    examples = [d.train.pair(i) for i in range(len(d.train))]
    rows = [5, 0, 17, 3]
    a, b = d.train.collate(np.array(rows), max_len=20), collate(examples, rows)
    for name in ("src", "tgt_in", "tgt_out"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.indices, a.n_tgt_tokens) == (b.indices, b.n_tgt_tokens)
    c = d.train.collate(np.array(rows), max_len=2)  # a shorter --max-len at train time cuts each side
    assert c.src.shape[1] <= 2 and c.tgt_out.shape[1] <= 3
    assert a.packing is not None  # training's loss runs on the real tokens it names
    v = d.train.collate(np.array(rows), max_len=20, packing=False)  # validation's full forward: none made
    assert v.packing is None and torch.equal(v.tgt_out, a.tgt_out)


def test_twice_gives_byte_identical_output_whatever_the_worker_count(tmp_path, corpus, monkeypatch):
    monkeypatch.setattr(P, "CHUNK_PAIRS", 7)  # 300 pairs: 43 chunks, so order and offset joins count
    a = _tree(_prep(corpus, tmp_path / "a", workers=1))
    b = _tree(_prep(corpus, tmp_path / "elsewhere" / "b", workers=3))
    assert a == b
    d = open_prepared(tmp_path / "elsewhere" / "b")  # every pair, those across chunk borders too, as encoded alone
    src, tgt = read_parallel(corpus["train_src"], corpus["train_tgt"])
    want = [(d.tokenizers.src.encode(s), d.tokenizers.tgt.encode(t)) for s, t in zip(src, tgt)]
    assert [d.train.pair(i) for i in range(len(d.train))] == [p for p in want if max(map(len, p)) <= 20]
    gz = {k: v for k, v in corpus.items()}
    for k in ("train_src", "train_tgt"):
        gz[k] = str(tmp_path / f"{k}.gz")
        Path(gz[k]).write_bytes(gzip.compress(Path(corpus[k]).read_bytes()))
    c = _tree(_prep(gz, tmp_path / "c"))  # gzip input: the same arrays and tokenizer (the manifest names other files)
    assert {k: v for k, v in c.items() if k != "manifest.json"} == {k: v for k, v in a.items() if k != "manifest.json"}


def test_the_sentencepiece_sample_is_seeded(tmp_path, corpus):
    src, tgt = Path(corpus["train_src"]), Path(corpus["train_tgt"])
    one = P.scan_parallel(src, tgt, 50, seed=1).sample
    assert one == P.scan_parallel(src, tgt, 50, seed=1).sample and len(one) == 50
    assert one != P.scan_parallel(src, tgt, 50, seed=2).sample
    pairs = list(zip(*read_parallel(src, tgt)))
    assert set(one) <= set(pairs)
    assert P.scan_parallel(src, tgt, 10_000, seed=1).sample == pairs  # a small corpus is used whole


def test_a_second_run_on_the_same_inputs_only_checks(tmp_path, corpus):
    out = _prep(corpus, tmp_path / "bin")
    before = (out / "manifest.json").stat().st_mtime_ns
    messages: list[str] = []
    inputs = P.Inputs(*(Path(corpus[k]) for k in ("train_src", "train_tgt", "valid_src", "valid_tgt")))
    P.prepare(inputs, out, SETTINGS, 1, log=messages.append)
    assert messages == [f"{out}: already prepared from these files and settings"]
    assert (out / "manifest.json").stat().st_mtime_ns == before
    P.prepare(inputs, out, P.Settings(vocab_size=290, max_len=20), 1, log=messages.append)  # new settings: replaced
    assert open_prepared(out).manifest["settings"]["vocab_size"] == 290
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]


def _cli(capsys, *argv: str) -> tuple[int, str]:
    rc = cli.main(["prepare", *argv])
    return rc, capsys.readouterr().err


def test_bad_input_is_one_line_naming_file_and_line(tmp_path, corpus, capsys):
    out = str(tmp_path / "bin")
    base = ["--out", out, "--vocab-size", "300", "--workers", "1"]
    rc, err = _cli(capsys, "--train-src", str(tmp_path / "nope"), "--train-tgt", corpus["train_tgt"], *base)
    assert rc == 2 and err == f"aiayn prepare: error: --train-src {tmp_path / 'nope'}: no such file\n"
    rc, err = _cli(capsys, "--train-src", str(tmp_path), "--train-tgt", corpus["train_tgt"], *base)  # was "no such file"
    assert rc == 2 and err.startswith(f"aiayn prepare: error: --train-src {tmp_path}: is a directory, expected a text file")
    short = tmp_path / "short.tgt"
    short.write_text("eins\nzwei\n")
    rc, err = _cli(capsys, "--train-src", corpus["train_src"], "--train-tgt", str(short), *base)
    assert rc == 2 and err.count("\n") == 1
    assert f"{corpus['train_src']} has 300 lines but {short} has 2; a parallel corpus needs" in err
    bad = tmp_path / "bad.tgt"
    lines = Path(corpus["train_tgt"]).read_bytes().split(b"\n")
    lines[41] = b"gr\xfcn"  # Latin-1, not UTF-8, on line 42
    bad.write_bytes(gzip.compress(b"\n".join(lines)))
    rc, err = _cli(capsys, "--train-src", corpus["train_src"], "--train-tgt", str(bad), *base)
    assert rc == 2 and err == (f"aiayn prepare: error: {bad}:42: invalid UTF-8 (byte 0xfc at column 3); "
                               "convert the file to UTF-8\n")
    blank = tmp_path / "blank.tgt"
    lines[41] = b"  "
    blank.write_bytes(b"\n".join(lines))
    rc, err = _cli(capsys, "--train-src", corpus["train_src"], "--train-tgt", str(blank), *base)
    assert rc == 2 and f"{blank}:42: blank line; remove the pair from both files" in err and err.count("\n") == 1
    rc, err = _cli(capsys, "--train-src", corpus["train_src"], "--train-tgt", corpus["train_tgt"], "--valid-src",
                   corpus["valid_src"], *base)
    assert rc == 2 and "pass both --valid-src and --valid-tgt, or neither" in err
    assert not Path(out).exists() and not list(tmp_path.glob(".bin.*"))  # nothing left behind


def test_an_out_directory_with_other_files_is_refused(tmp_path, corpus, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    rc, err = _cli(capsys, "--train-src", corpus["train_src"], "--train-tgt", corpus["train_tgt"], "--out", str(out))
    assert rc == 2 and "holds files that `aiayn prepare` did not write" in err
    assert (out / "notes.txt").read_text() == "keep me"


def test_a_killed_prepare_leaves_nothing_train_accepts_and_a_rerun_finishes(tmp_path, corpus):
    out = tmp_path / "bin"
    script = (  # SIGKILL itself after the training arrays are written, before the rename
        "import os, signal, sys\n"
        "from aiayn.data import bindata\n"
        "close = bindata.SplitWriter.close\n"
        "def die(self):\n"
        "    close(self)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "bindata.SplitWriter.close = die\n"
        "from aiayn.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = ["prepare", "--train-src", corpus["train_src"], "--train-tgt", corpus["train_tgt"], "--valid-src",
            corpus["valid_src"], "--valid-tgt", corpus["valid_tgt"], "--out", str(out), "--vocab-size", "300",
            "--max-len", "20", "--workers", "1"]
    proc = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    assert not out.exists()
    (tmp,) = tmp_path.glob(".bin.prepare-*")  # the killed run's work, under a name no one passes to train
    with pytest.raises(AiaynError, match="not a prepared data directory"):
        open_prepared(tmp)
    assert cli.main(argv) == 0
    assert not tmp.exists()  # cleaned up: it was marked as prepare's own
    assert _tree(out) == _tree(_prep(corpus, tmp_path / "clean"))


def test_open_prepared_refuses_what_prepare_did_not_finish(tmp_path, corpus):
    with pytest.raises(AiaynError, match=r"--data-bin .*nowhere: no such directory"):
        open_prepared(tmp_path / "nowhere")
    out = _prep(corpus, tmp_path / "bin")
    with open(out / "train.tgt.tokens", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(AiaynError, match=r"train.tgt.tokens is \d+ bytes, the manifest says \d+; prepare the data again"):
        open_prepared(out)
    m = json.loads((out / "manifest.json").read_text())
    m["version"] = 99
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(AiaynError, match="format version 99"):
        open_prepared(out)


def test_workers_get_a_bounded_window_of_chunks():
    """The encoder never reads far ahead of what it has written: memory does not grow with the corpus."""
    read = []

    def tasks():
        for i in range(100):
            read.append(i)
            yield i

    it = P._ordered_map(abs, tasks(), 2, lambda: None, ())
    assert next(it) == 0
    assert len(read) <= 2 * 2 + 1
    assert list(it) == list(range(1, 100))


@pytest.mark.parametrize("gz", [False, True])
def test_iter_lines_reads_what_read_lines_reads_and_fails_alike(tmp_path, gz):
    from aiayn.files import iter_lines, read_lines

    def write(name: str, data: bytes) -> Path:
        p = tmp_path / name
        p.write_bytes(gzip.compress(data) if gz else data)
        return p

    tricky = write("t", "\ufeffEin Hund.\r\nZwei\u2028Katzen\x1c.\n\ufeffdrei\nno newline".encode())
    assert list(iter_lines(tricky)) == read_lines(tricky) == ["Ein Hund.", "Zwei\u2028Katzen\x1c.", "\ufeffdrei",
                                                              "no newline"]
    bad = write("b", "one\ntwo\nthr\u00e9e".encode("latin-1"))
    with pytest.raises(AiaynError) as a:
        list(iter_lines(bad))
    with pytest.raises(AiaynError) as b:
        read_lines(bad)
    assert str(a.value) == str(b.value) == f"{bad}:3: invalid UTF-8 (byte 0xe9 at column 4); convert the file to UTF-8"


def test_scan_reports_blank_lines_as_read_parallel_does(tmp_path):
    src, tgt = tmp_path / "s", tmp_path / "t"
    src.write_text("a\nb\nc\nd\n")
    tgt.write_text("A\n\nC\n \n")
    with pytest.raises(AiaynError) as a:
        P.scan_parallel(src, tgt, 10, 1)
    with pytest.raises(AiaynError) as b:
        read_parallel(src, tgt)
    assert str(a.value) == str(b.value) and "t:2: blank line (2 blank lines in all)" in str(a.value)
    tgt.write_text("\n \n")
    with pytest.raises(AiaynError, match=r"t: file is empty"):
        P.scan_parallel(src, tgt, 10, 1)


def test_a_temporary_of_another_machine_is_left_alone_unless_abandoned(tmp_path, corpus):
    """A process id means nothing on another machine sharing the folder: its live work in progress
    stays; work whose mark nobody touched for an hour is removed."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # a pid dead here, maybe alive on the machine that wrote the name
    live = tmp_path / f".bin.prepare-{proc.pid}"
    gone = tmp_path / ".bin.prepare-othermachine-4242-0a1b2c3d"
    for d in (live, gone):
        d.mkdir()
        (d / P.TMP_MARK).touch()
        (d / "train.src.tokens").write_bytes(b"\0\0")
    old = os.path.getmtime(gone / P.TMP_MARK) - 3600
    os.utime(gone / P.TMP_MARK, (old, old))
    _prep(corpus, tmp_path / "bin")
    assert (live / "train.src.tokens").is_file()
    assert not gone.exists()


def test_two_prepares_at_once_on_one_folder_give_one_result(tmp_path, corpus):
    """The same command on two machines against one shared folder: one prepares, the other waits and
    finds it done; nothing is replaced under it, nothing is left behind."""
    out = tmp_path / "shared" / "bin"
    argv = ["-m", "aiayn", "prepare", "--train-src", corpus["train_src"], "--train-tgt", corpus["train_tgt"],
            "--valid-src", corpus["valid_src"], "--valid-tgt", corpus["valid_tgt"], "--out", str(out),
            "--vocab-size", "300", "--max-len", "20", "--workers", "1"]
    procs = [subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    said = [err for _, err in results]
    assert sum("prepared meanwhile by another process" in e or "already prepared" in e for e in said) == 1, said
    assert sorted(p.name for p in out.parent.iterdir()) == ["bin"]
    assert _tree(out) == _tree(_prep(corpus, tmp_path / "clean"))


def test_on_resume_renamed_inputs_of_the_same_bytes_keep_the_prepared_data(tmp_path, corpus):
    """replace=False (a resumed run) compares the four inputs' bytes only: names may change."""
    out = _prep(corpus, tmp_path / "bin")
    manifest = (out / "manifest.json").read_bytes()
    renamed = tmp_path / "renamed.src"
    renamed.write_bytes(Path(corpus["train_src"]).read_bytes())
    inputs = P.Inputs(renamed, *(Path(corpus[k]) for k in ("train_tgt", "valid_src", "valid_tgt")))
    messages: list[str] = []
    P.prepare(inputs, out, SETTINGS, 1, log=messages.append, replace=False)
    assert messages == [f"{out}: already prepared from these files and settings"]
    assert (out / "manifest.json").read_bytes() == manifest
    swapped = P.Inputs(Path(corpus["train_tgt"]), Path(corpus["train_src"]), Path(corpus["valid_src"]),
                       Path(corpus["valid_tgt"]))  # the same bytes in other roles: other data
    with pytest.raises(AiaynError, match=f"{corpus['train_tgt']} is not what {out} was prepared from"):
        P.prepare(swapped, out, SETTINGS, 1, log=messages.append, replace=False)


def test_out_dot_prepares_into_the_current_empty_folder(tmp_path, corpus, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    _prep(corpus, Path("."))
    assert open_prepared(here).manifest["splits"]["train"]["lines"] == 300
    assert not [p.name for p in here.iterdir() if p.name.startswith(".")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "here"]  # no lock or temporary left


def test_a_validation_pair_of_other_lengths_is_refused_before_any_work(tmp_path, corpus):
    short = tmp_path / "short.tgt"
    short.write_text("".join(Path(corpus["valid_tgt"]).read_text().splitlines(keepends=True)[:-1]))
    messages: list[str] = []
    inputs = P.Inputs(Path(corpus["train_src"]), Path(corpus["train_tgt"]), Path(corpus["valid_src"]), short)
    with pytest.raises(AiaynError, match=f"{corpus['valid_src']} has 20 lines but {short} has 19"):
        P.prepare(inputs, tmp_path / "bin", SETTINGS, 1, log=messages.append)
    assert messages == []  # neither scanned nor trained SentencePiece
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "short.tgt"]


def test_ctrl_c_with_workers_is_one_line_and_exit_130(tmp_path, corpus):
    """Ctrl-C reaches the whole process group: the workers leave it to the parent, which tears the
    pool down and says one line. The workers hold their first chunk until the signal has come."""
    started = tmp_path / "started"
    started.mkdir()
    script = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if started ignoring it\n"
        "from aiayn.data import prepare\n"
        "prepare.CHUNK_PAIRS = 50\n"
        "def held(chunk):\n"
        f"    open(os.path.join({str(started)!r}, str(os.getpid())), 'w').close()\n"
        "    time.sleep(120)\n"
        "prepare._encode_chunk = held\n"
        "from aiayn.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = ["prepare", "--train-src", corpus["train_src"], "--train-tgt", corpus["train_tgt"], "--out",
            str(tmp_path / "bin"), "--vocab-size", "300", "--workers", "2"]
    proc = subprocess.Popen([sys.executable, "-c", script, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(list(started.iterdir())) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(list(started.iterdir())) == 2, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert err.split("processes\n", 1)[1] == "aiayn prepare: interrupted\n", err  # after "encoding with 2 processes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "started"]


def test_out_after_a_link_and_dotdot_is_where_the_os_puts_it(tmp_path, monkeypatch):
    """--out link/../x is beside the link's target, as the shell and the OS read it (a textual
    normalisation would put it beside the link)."""
    (tmp_path / "far" / "inner").mkdir(parents=True)
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "link").symlink_to(tmp_path / "far" / "inner")
    monkeypatch.chdir(tmp_path / "here")
    c = make_corpus(tmp_path / "text", n_train=60)
    corpus = [Path(c[k]) for k in ("train_src", "train_tgt", "valid_src", "valid_tgt")]
    out = P.prepare(P.Inputs(*corpus), "link/../x", P.Settings(vocab_size=300), workers=1, log=lambda m: None)
    assert (tmp_path / "far" / "x" / "manifest.json").is_file() and not (tmp_path / "here" / "x").exists()
    assert out.resolve() == (tmp_path / "far" / "x").resolve()


def test_a_folder_with_another_tools_manifest_is_refused_and_kept(tmp_path, corpus, capsys, monkeypatch):
    """`manifest.json` is a common name: a folder holding one of another tool's is not an earlier
    output to replace, nor is a prepared folder the user added a file to (before: both were deleted).
    Refused before the inputs are hashed (gigabytes for WMT14)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "manifest.json").write_text('{"name": "my web app"}')
    (mine / "notes.txt").write_text("keep me")
    with monkeypatch.context() as m:
        m.setattr(P.Inputs, "digests", lambda self: pytest.fail("hashed the inputs of a refused --out"))
        rc, err = _cli(capsys, "--train-src", corpus["train_src"], "--train-tgt", corpus["train_tgt"], "--out", str(mine))
    assert rc == 2 and "holds files that `aiayn prepare` did not write" in err
    assert sorted(p.name for p in mine.iterdir()) == ["manifest.json", "notes.txt"]
    out = _prep(corpus, tmp_path / "bin")
    (out / "README").write_text("mine")
    assert _prep(corpus, out) == out  # up to date: left as it is, the user's file too
    with pytest.raises(AiaynError, match="holds files that `aiayn prepare` did not write"):
        _prep(corpus, out, P.Settings(vocab_size=290, max_len=20))  # would replace it: refused
    assert (out / "README").read_text() == "mine" and open_prepared(out).manifest["settings"]["vocab_size"] == 300


def test_out_as_a_link_replaces_its_target_and_keeps_the_link(tmp_path, corpus):
    """A link to a folder on a bigger disk is a common --out; it was renamed aside with the old
    output, a directory put in its place, and the run failed on `rmtree` of the link."""
    (tmp_path / "big").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "big")
    _prep(corpus, tmp_path / "link")
    _prep(corpus, tmp_path / "link", P.Settings(vocab_size=290, max_len=20))  # an earlier output, replaced
    assert (tmp_path / "link").is_symlink() and open_prepared(tmp_path / "big").manifest["settings"]["vocab_size"] == 290
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big", "data", "link"]  # nothing left aside


def test_a_killed_prepare_of_an_out_named_with_brackets_is_cleaned_up(tmp_path, corpus):
    """The temporaries of --out "data[v2]" are found by a glob: the brackets are not a pattern."""
    out = tmp_path / "data[v2]"
    left = tmp_path / ".data[v2].prepare-nohost-999999999-00000000"
    left.mkdir()
    (left / P.TMP_MARK).touch()
    os.utime(left / P.TMP_MARK, (0, 0))  # untouched for ages: abandoned
    assert P.leftovers(out) == {left.name: True}
    _prep(corpus, out)
    assert not left.exists() and (out / "manifest.json").is_file()


def test_data_and_text_files_together_are_refused(tmp_path, corpus, capsys):
    """`--data multi30k --train-src mine.de ...` prepared Multi30k and ignored the files without a word
    (train refuses the same flags together)."""
    out = tmp_path / "bin"
    rc, err = _cli(capsys, "--data", "multi30k", "--data-dir", str(tmp_path / "nowhere"), "--train-src",
                   corpus["train_src"], "--train-tgt", corpus["train_tgt"], "--out", str(out))
    assert rc == 2 and err == ("aiayn prepare: error: --data multi30k and --train-src --train-tgt each name the "
                               "training corpus; give one of them\n")
    assert not out.exists()


_DIE_AT = {  # SIGKILL itself at a point of the run: where `prepare` has its temporaries in some state
    "manifest": "P.fsync_path = lambda p: os.kill(os.getpid(), signal.SIGKILL)\n",  # mark gone, manifest written
    "aside": (  # between _replace's renames: the earlier output moved aside, the new one not yet in place
        "rename = os.rename\n"
        "def ren(a, b):\n"
        "    rename(a, b)\n"
        "    if '.old-' in str(b):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "P.os.rename = ren\n"),
}


def _killed(where: str, corpus: dict[str, str], out: Path, vocab: int) -> None:
    script = ("import os, signal, sys\nfrom aiayn.data import prepare as P\n" + _DIE_AT[where]
              + "from aiayn.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    argv = ["prepare", "--train-src", corpus["train_src"], "--train-tgt", corpus["train_tgt"], "--valid-src",
            corpus["valid_src"], "--valid-tgt", corpus["valid_tgt"], "--out", str(out), "--vocab-size", str(vocab),
            "--max-len", "20", "--workers", "1"]
    proc = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr


def test_what_a_killed_prepare_left_is_removed_by_any_later_run(tmp_path, corpus):
    """kill -9 at any point leaves nothing for good: a run that finds --out up to date removes the
    killed run's lock and temporary too (it returned at once, and they stayed), and so are a finished
    temporary whose mark was already removed and an earlier output moved aside (neither was ever
    found). What prepare did not write stays."""
    out = _prep(corpus, tmp_path / "bin")
    mine = tmp_path / ".bin.prepare-notes"  # a user's folder of a name like ours, without our mark
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    _killed("manifest", corpus, out, 299)
    assert sorted(p.name for p in tmp_path.glob(".bin.*"))[:2] == [".bin.lock", ".bin.prepare-notes"]
    assert len(list(tmp_path.glob(".bin.prepare-*"))) == 2
    _prep(corpus, out)  # up to date
    assert sorted(p.name for p in tmp_path.glob(".bin*")) == [".bin.prepare-notes"]
    _killed("aside", corpus, out, 299)
    assert not out.exists() and len(list(tmp_path.glob(".bin.old-*"))) == 1
    _prep(corpus, out)
    assert sorted(p.name for p in tmp_path.glob(".bin*")) == [".bin.prepare-notes"]
    assert _tree(out) == _tree(_prep(corpus, tmp_path / "clean"))
    assert (mine / "notes.txt").read_text() == "keep me"


def test_lines_ended_by_a_carriage_return_alone_are_named_as_such(tmp_path):
    """A file with classic-Mac line ends (\\r alone) reads as one line: prepare said "s has 1 lines but t
    has 3", or, both so, to raise --max-len or split the text into sentences. Now the file, the line and
    the line ends; a stray \\r inside a sentence of data that prepares is still text."""
    src, tgt = tmp_path / "s", tmp_path / "t"
    src.write_bytes(b"ein hund\rzwei katzen\rdrei\r")
    tgt.write_text("a dog\ntwo cats\nthree\n")
    for scan in (lambda: P.scan_parallel(src, tgt, 10, 1), lambda: read_parallel(src, tgt)):
        with pytest.raises(AiaynError, match=r"^\S+s:1: a carriage return \(\\r\) inside the line: the file's "
                                             r"lines end in \\r alone .*; convert its line ends to \\n$"):
            scan()
    tgt.write_bytes(b"a dog\rtwo cats\rthree\r")
    for scan in (lambda: P.scan_parallel(src, tgt, 10, 1), lambda: read_parallel(src, tgt)):
        with pytest.raises(AiaynError, match=r"s:1: a carriage return"):
            scan()
    src.write_bytes(b"ein\rhund\nzwei katzen\ndrei\n")
    tgt.write_text("a dog\ntwo cats\nthree\n")
    assert P.scan_parallel(src, tgt, 10, 1).lines == 3 and read_parallel(src, tgt)[0][0] == "ein\rhund"
    src.write_bytes(b"ein\rhund\n")  # a one-sentence pair with a stray \r is text too (review)
    tgt.write_text("a dog\n")
    assert P.scan_parallel(src, tgt, 10, 1).lines == 1 and read_parallel(src, tgt)[0] == ["ein\rhund"]
