"""`Translator` and `aiayn translate`: line preservation on awkward input, streaming, Ctrl-C,
n-best output, truncation notes, user errors. A tiny random-weight model and a SentencePiece model
trained here on synthetic text; search lengths are kept short so that everything is quick."""

import os
import random
import select
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiayn import cli
from aiayn.checkpoint import save_checkpoint
from aiayn.config import preset
from aiayn.errors import AiaynError
from aiayn.model import Transformer
from aiayn.tokenizer import EOS_ID, Tokenizer, TokenizerPair
from aiayn.translator import Translator, map_batches, one_line

WORDS = "a man woman dog runs the in on blue red street child plays ball with two people are sitting Mann Hund läuft".split()
FAST = dict(max_len_a=0.0, max_len_b=4)  # at most 4 target tokens: a random model rarely stops by itself
FAST_FLAGS = ["--max-len-a", "0", "--max-len-b", "4"]


@pytest.fixture(scope="module")
def parts():
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(300)]
    tok = Tokenizer.train(lines, 300)
    torch.manual_seed(0)
    cfg = preset("tiny", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, max_positions=64)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # make EOS likely enough that output lengths vary
        model.tgt_embed.weight[EOS_ID] *= 4
    return model, TokenizerPair(tok, tok, joint=True)


@pytest.fixture(scope="module")
def ckpt(parts, tmp_path_factory):
    model, toks = parts
    path = tmp_path_factory.mktemp("ckpt") / "best"
    save_checkpoint(path, model, toks, {"train": {}, "step": 1})
    return path


@pytest.fixture(scope="module")
def translator(parts):
    model, toks = parts
    return Translator(model, toks)


def aiayn(*argv, **kw):
    # a generous limit: CI machines are slow and shared
    return subprocess.run([sys.executable, "-m", "aiayn", *argv], capture_output=True, timeout=600, **kw)


AWKWARD = [
    "a man runs",
    "",
    "   \t ",
    " ".join(["dog"] * 2000),  # far more than max_positions = 64 source tokens
    "two people 😀🎉 are sitting",
    "Mann läuft, Ελληνικά, русский, 中文, عربى",
    "the child plays",
]


def test_awkward_input_keeps_every_line_in_order(ckpt, translator, tmp_path):
    src = tmp_path / "in.txt"
    src.write_bytes("\r\n".join(AWKWARD).encode("utf-8") + b"\r\n")  # Windows line endings
    out = tmp_path / "out.txt"
    r = aiayn("translate", "--checkpoint", str(ckpt), "--input", str(src), "--output", str(out),
              "--beam", "2", *FAST_FLAGS)
    assert r.returncode == 0, r.stderr
    got = out.read_bytes().decode("utf-8").split("\n")
    assert got[-1] == "" and len(got) - 1 == len(AWKWARD)
    got = got[:-1]
    assert got[1] == "" and got[2] == ""  # empty and blank lines give empty lines
    assert got == translator.translate(AWKWARD, beam=2, **FAST)
    assert all("\r" not in g for g in got)
    stderr = r.stderr.decode()
    assert "line 4:" in stderr and "first 63 tokens" in stderr  # the long line is truncated, said so (63 + EOS = 64)
    assert stderr.count("\n") == 1


def test_truncation_note_names_the_line(parts):
    notes = []
    t = Translator(*parts, max_src_tokens=5, note=notes.append)
    out = t.translate(["a man", "a b c d e f g h i j k"], beam=1, **FAST)
    assert len(out) == 2
    assert len(notes) == 1 and notes[0].startswith("line 2:")


def test_empty_outputs_for_blank_inputs(translator):
    assert translator.translate(["", " ", "\t"], beam=4) == ["", "", ""]
    assert translator.translate([]) == []
    # n-best: N entries for a blank line too, so that the flat list splits back into lines
    out = translator.translate(["", "a man runs", " "], beam=2, nbest=2, **FAST)
    assert len(out) == 6 and out[:2] == ["", ""] and out[4:] == ["", ""]


def test_nbest_format_and_order(ckpt, tmp_path):
    r = aiayn("translate", "--checkpoint", str(ckpt), "--beam", "3", "--nbest", "3", *FAST_FLAGS,
              input="a man runs\n\nthe dog\n".encode())
    assert r.returncode == 0, r.stderr
    rows = [line.split(" ||| ") for line in r.stdout.decode().splitlines()]
    assert [int(i) for i, _, _ in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # N lines for every input line
    assert rows[3:6] == [["1", "", "0.0000"]] * 3  # the empty line
    for first in (0, 6):
        scores = [float(s) for _, _, s in rows[first:first + 3]]
        assert scores == sorted(scores, reverse=True)


def _translating(ckpt, *flags, sigint=signal.SIG_DFL):
    """`aiayn translate` as a child with pipes on stdin/stdout/stderr, `flags` after the checkpoint.

    A child inherits an ignored SIGINT (pytest started as a background job of a script has one), and
    Python then keeps ignoring it: its disposition is set explicitly, whatever the runner's is."""
    argv = [sys.executable, "-m", "aiayn", "translate", "--checkpoint", str(ckpt), *flags, *FAST_FLAGS]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))


def _read_lines(proc, n=1, timeout=300.0):  # generous: includes start-up on a slow CI
    """Exactly n lines from the child's stdout, read unbuffered, failing if they do not come."""
    fd, data = proc.stdout.fileno(), b""
    while data.count(b"\n") < n:
        ready, _, _ = select.select([fd], [], [], timeout)
        assert ready, "no output within the timeout: the translator did not stream"
        chunk = os.read(fd, 1 << 16)
        assert chunk, f"stdout closed early; stderr: {proc.stderr.read()!r}"
        data += chunk
    assert data.count(b"\n") == n and data.endswith(b"\n")
    return data


def test_stdin_streams_line_by_line(ckpt, translator):
    proc = _translating(ckpt, "--beam", "2")
    try:
        # each answer arrives while stdin is still open: the pipe is not read to the end first
        for line in ("a man runs", "two dogs", ""):
            proc.stdin.write((line + "\n").encode())
            proc.stdin.flush()
            assert _read_lines(proc).decode().rstrip("\n") == translator.translate([line], beam=2, **FAST)[0]
        proc.stdin.close()
        assert proc.wait(timeout=300) == 0
    finally:
        proc.kill()


@pytest.mark.parametrize("pause", [0.0, 0.3])  # at once (maybe still writing), and while waiting for input
def test_ctrl_c_keeps_finished_lines_and_exits_130(ckpt, pause):
    proc = _translating(ckpt, "--beam", "2")
    try:
        proc.stdin.write(b"a man runs\nthe dog\n")
        proc.stdin.flush()
        _read_lines(proc, 2)  # both lines are done; the translator now waits for more input
        time.sleep(pause)
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=300)
        assert proc.returncode == 130
        assert rest == b""  # nothing half-written after the two finished lines
        assert b"interrupted" in err and b"first 2 input line(s)" in err
    finally:
        proc.kill()


def test_ctrl_c_during_a_search_on_workers_keeps_whole_chunks(ckpt):
    # the second chunk is being searched on 2 workers (or was just written) when Ctrl-C comes:
    # either way the output holds whole chunks only, and the message counts them exactly
    n = 200
    lines = b"".join(f"a man runs {i} with the dog in the street\n".encode() for i in range(n))
    proc = _translating(ckpt, "--beam", "3", "--workers", "2", "--max-tokens", "64", "--chunk-lines", str(n))
    try:
        proc.stdin.write(lines)
        proc.stdin.flush()
        first = _read_lines(proc, n)
        proc.stdin.write(lines)
        proc.stdin.flush()
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=300)
        assert proc.returncode == 130, err
        done = (first + rest).count(b"\n")
        assert done in (n, 2 * n) and (first + rest).endswith(b"\n")
        assert f"first {done} input line(s)".encode() in err
    finally:
        proc.kill()


def test_an_ignored_sigint_stays_ignored(ckpt):
    proc = _translating(ckpt, "--beam", "2", sigint=signal.SIG_IGN)
    try:
        proc.stdin.write(b"a man runs\n")
        proc.stdin.flush()
        _read_lines(proc, 1)
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(b"the dog\n", timeout=300)
        assert proc.returncode == 0, err
        assert rest.count(b"\n") == 1  # the line sent after the signal is translated too
    finally:
        proc.kill()


lines_strategy = st.lists(
    st.text(alphabet=st.characters(blacklist_characters="\n", blacklist_categories=("Cs",)), max_size=30)
    | st.sampled_from(["", " ", "a man", "the blue dog runs in the street", "😀"]),
    max_size=6,
)


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=lines_strategy)
def test_translate_preserves_line_count_and_order(translator, lines):
    out = translator.translate(lines, beam=1, max_tokens=64, **FAST)
    assert len(out) == len(lines)
    assert out == [translator.translate([line], beam=1, **FAST)[0] for line in lines]
    assert all("\n" not in o for o in out)


def test_bf16_precision_translates(parts):
    t = Translator(*parts, precision="bf16")
    out = t.translate(["a man runs", "", "the dog plays with a ball"], beam=2, **FAST)
    assert len(out) == 3 and out[1] == ""


@pytest.mark.parametrize("fast", [True, False])
def test_bf16_on_a_cpu_without_bf16_kernels_says_so(parts, monkeypatch, capsys, fast):
    """bf16 without oneDNN's bf16 kernels (an AVX2-only CPU) is 10-100x slower than fp32: say so once,
    on stderr and not through `note`, which the server turns into refusing a line."""
    import aiayn.kernels

    monkeypatch.setattr(aiayn.kernels, "cpu_has_fast_bf16", lambda: fast)
    notes: list[str] = []
    Translator(*parts, precision="fp32", note=notes.append)
    assert capsys.readouterr().err == ""
    Translator(*parts, precision="bf16", note=notes.append)
    err = capsys.readouterr().err
    assert notes == []
    assert err == "" if fast else (err.count("\n") == 1 and "slow fallback code" in err and "--precision fp32" in err)


def test_output_is_always_one_line():
    assert one_line("a\nb\r\nc\u2028d") == "a b  c d"


@pytest.mark.parametrize("flags, words", [
    (["--beam", "0"], "--beam"),
    (["--nbest", "5", "--beam", "4"], "--nbest"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--alpha", "-1"], "--alpha"),
    (["--alpha", "nan"], "--alpha"),
    (["--alpha", "inf"], "--alpha"),
    (["--max-len-a", "nan"], "--max-len-a"),
    (["--max-len-a", "inf"], "--max-len-a"),
    (["--workers", "-1"], "--workers"),
    (["--input", "/nonexistent/in.txt"], "/nonexistent/in.txt"),
])
def test_bad_flags_are_one_line_errors(flags, words, capsys, ckpt):
    assert cli.main(["translate", "--checkpoint", str(ckpt), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err


def test_missing_checkpoint_and_bad_utf8(tmp_path, capsys):
    assert cli.main(["translate", "--checkpoint", str(tmp_path / "nope"), "--input", os.devnull]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(AiaynError, match="--precision"):
        Translator(Transformer(preset("tiny", src_vocab_size=300, tgt_vocab_size=300)), None, precision="fp16")


def test_invalid_utf8_names_the_line(ckpt, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"a man\nthe \xff dog\n")
    r = aiayn("translate", "--checkpoint", str(ckpt), "--input", str(bad), *FAST_FLAGS)
    assert r.returncode == 2
    assert f"{bad}:2: invalid UTF-8" in r.stderr.decode()
    assert r.stderr.decode().count("\n") == 1


@pytest.mark.parametrize("beam", [1, 3])
def test_workers_change_the_time_not_the_translations(translator, beam):
    rng = random.Random(1)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 14))) for _ in range(60)] + ["", "a"]
    threads = torch.get_num_threads()
    one = translator.search(lines, beam=beam, nbest=beam, max_tokens=40, workers=1, **FAST)  # many small batches
    for w in (2, 3):  # repr: the exact scores, and greedy's nan equals nan
        assert repr(translator.search(lines, beam=beam, nbest=beam, max_tokens=40, workers=w, **FAST)) == repr(one)
    assert torch.get_num_threads() == threads


def test_map_batches_keeps_order_and_raises_and_restores_threads():
    threads = torch.get_num_threads()
    seen = []

    def square(x):
        seen.append(torch.get_num_threads())  # each worker runs on its share of the threads
        return x * x

    assert map_batches(square, list(range(9)), workers=3) == [x * x for x in range(9)]
    assert set(seen) == {max(1, threads // 3)}
    assert map_batches(square, [], workers=2) == []

    def boom(x):
        if x == 4:
            raise ValueError("batch 4")
        return x

    with pytest.raises(ValueError, match="batch 4"):
        map_batches(boom, list(range(8)), workers=2)
    assert torch.get_num_threads() == threads == _count_in_a_new_thread()


def test_overlapping_and_nested_map_batches_put_the_thread_count_back():
    # call A starts, call B starts, A ends, B ends: each must see (and leave) the original count
    threads = torch.get_num_threads()
    a_running, b_running, a_done = threading.Event(), threading.Event(), threading.Event()

    def in_a(x):
        a_running.set()
        assert b_running.wait(10)
        return map_batches(lambda y: y + x, [1, 2, 3], workers=2)  # nested, inside a worker

    def in_b(x):
        b_running.set()
        assert a_done.wait(10)
        return x

    def call_a(out):
        out["a"] = map_batches(in_a, [0, 1], workers=2)
        a_done.set()

    def call_b(out):
        assert a_running.wait(10)
        out["b"] = map_batches(in_b, [0, 1], workers=2)

    out: dict = {}
    callers = [threading.Thread(target=f, args=(out,)) for f in (call_a, call_b)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert out == {"a": [[1, 2, 3], [2, 3, 4]], "b": [0, 1]}
    assert torch.get_num_threads() == threads
    assert _count_in_a_new_thread() == threads  # new threads take torch's global count, not main's own


def _count_in_a_new_thread() -> int:
    seen: list = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    return seen[0]


def test_translator_search_runs_batches_on_workers(translator, monkeypatch):
    import aiayn.translator as tr

    names = set()
    real = tr.beam_search

    def spy(*args, **kw):
        names.add(threading.current_thread().name.split("_")[0])
        return real(*args, **kw)

    monkeypatch.setattr(tr, "beam_search", spy)
    lines = ["a man runs", "the dog plays with a ball in the street", "two people", "a child"]
    translator.search(lines, beam=2, max_tokens=8, workers=2, **FAST)
    assert names == {"aiayn-search"}
    names.clear()
    translator.search(lines, beam=2, max_tokens=8, workers=1, **FAST)
    assert names == {threading.main_thread().name}


def test_output_that_is_the_input_is_refused_and_the_input_kept(ckpt, tmp_path):
    text = b"a man runs\nthe dog\n"
    f = tmp_path / "same.txt"
    f.write_bytes(text)
    (tmp_path / "link.txt").symlink_to(f)
    for argv, stdin in ((["--input", str(f)], None), (["--input", str(tmp_path / "link.txt")], None), ([], f)):
        with open(stdin or os.devnull, "rb") as src:
            r = aiayn("translate", "--checkpoint", str(ckpt), *argv, "--output", str(f), *FAST_FLAGS, stdin=src)
        assert r.returncode == 2 and b"is also the input" in r.stderr and r.stderr.count(b"\n") == 1
        assert f.read_bytes() == text


def test_a_failed_start_leaves_the_old_output_as_it_was(tmp_path, capsys):
    out = tmp_path / "out.txt"
    out.write_text("earlier translations\n")
    assert cli.main(["translate", "--checkpoint", str(tmp_path / "nope"), "--input", os.devnull,
                     "--output", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert out.read_text() == "earlier translations\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("to_stdout", [False, True])
def test_a_full_disk_is_a_one_line_error(ckpt, to_stdout):
    with open("/dev/full", "wb") as full:
        argv = [] if to_stdout else ["--output", "/dev/full"]
        r = subprocess.run([sys.executable, "-m", "aiayn", "translate", "--checkpoint", str(ckpt), *argv, *FAST_FLAGS],
                           input=b"a man runs\n", stdout=full if to_stdout else subprocess.PIPE,
                           stderr=subprocess.PIPE, timeout=600)
    assert r.returncode == 2
    err = r.stderr.decode()
    assert err.count("\n") == 1 and "cannot write (No space left on device)" in err, err


class _FillsUp:
    """An output file on a disk that fills up at the write number `full` (1-based)."""

    def __init__(self, full):
        self.full, self.writes, self.data = full, 0, b""

    def write(self, data):
        import errno

        self.writes += 1
        if self.writes >= self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.data += data
        return len(data)

    def flush(self):
        pass

    def close(self):
        pass


def test_a_disk_full_after_some_chunks_says_how_many_lines_are_written(ckpt, tmp_path, monkeypatch, capsys):
    import aiayn.translate

    lines = ["a man runs", "the dog", "a woman sits", "", "the red ball", "a dog plays", "the man"]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    full = _FillsUp(3)  # chunks of 2 lines: the third write fails
    monkeypatch.setattr(aiayn.translate, "_open_output", lambda name: (full, None))
    argv = ["translate", "--checkpoint", str(ckpt), "--input", str(src), "--output", "out.txt", "--chunk-lines", "2"]
    assert cli.main(argv + FAST_FLAGS) == 2
    assert capsys.readouterr().err == ("aiayn translate: error: out.txt: cannot write (No space left on device); "
                                       "the first 4 input line(s) are translated and written\n")
    want = Translator.from_checkpoint(ckpt).translate(lines[:4], beam=4, max_len_a=0, max_len_b=4)
    assert full.data.decode("utf-8").splitlines() == want  # the 4 lines it names, exactly


def test_closed_standard_streams_are_one_line_errors(ckpt):
    for closed, words in ((1, "standard output is closed"), (0, "standard input is closed")):
        r = subprocess.run([sys.executable, "-m", "aiayn", "translate", "--checkpoint", str(ckpt)],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600,
                           preexec_fn=lambda fd=closed: os.close(fd))  # as `>&-` / `<&-` in a shell
        assert r.returncode == 2, r.stderr
        assert r.stderr.decode().count("\n") == 1 and words in r.stderr.decode()


def test_a_huge_length_factor_is_no_limit():
    from aiayn.search import _max_lengths

    keep = torch.ones(2, 3, dtype=torch.bool)
    assert _max_lengths(keep, 1e300, 50).tolist() == [2 ** 62] * 2  # not an int64 overflow to 1 token
    assert _max_lengths(keep, 1.5, 2).tolist() == [6, 6]


def test_ctrl_c_while_the_command_loads_exits_130(monkeypatch, capsys):
    def interrupted(command=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["translate", "--checkpoint", "x"]) == 130
    assert capsys.readouterr().err == "aiayn translate: interrupted\n"


def test_lines_before_invalid_utf8_are_written_and_counted(ckpt):
    r = aiayn("translate", "--checkpoint", str(ckpt), *FAST_FLAGS, input=b"a man runs\nthe dog\n\xff\nmore\n")
    assert r.returncode == 2
    assert len(r.stdout.decode().splitlines()) == 2  # the two good lines of the same chunk
    err = r.stderr.decode()
    assert err.count("\n") == 1 and "<stdin>:3: invalid UTF-8" in err and "the first 2 input line(s)" in err


def test_an_output_file_is_put_in_place_only_when_every_line_is_in(ckpt, tmp_path, translator):
    """--output FILE is written beside FILE and renamed over it at the end: a run that fails (or
    is stopped) leaves a FILE that was there as it was, its finished lines in FILE.partial (once
    FILE was emptied at the start and the old translations were lost); with no FILE before, they
    are in FILE. A success replaces FILE, keeping its mode; no temporary file is left behind."""
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_bytes(b"a man runs\nthe dog\n\xff\nmore\n")  # the bad line is found after one chunk of 2
    out.write_text("precious old translations\n")
    r = aiayn("translate", "--checkpoint", str(ckpt), *FAST_FLAGS, "--chunk-lines", "2", "--input", str(src),
              "--output", str(out))
    assert r.returncode == 2 and out.read_text() == "precious old translations\n"
    want = translator.translate(["a man runs", "the dog"], beam=4, **FAST)
    assert (tmp_path / "out.txt.partial").read_text().splitlines() == want
    assert r.stderr.decode().rstrip("\n").endswith(
        f"the first 2 input line(s) are translated and written to {out}.partial ({out} is as it was)")
    fresh = tmp_path / "fresh.txt"
    r = aiayn("translate", "--checkpoint", str(ckpt), *FAST_FLAGS, "--chunk-lines", "2", "--input", str(src),
              "--output", str(fresh))
    assert r.returncode == 2 and fresh.read_text().splitlines() == want
    assert r.stderr.decode().rstrip("\n").endswith("the first 2 input line(s) are translated and written")
    src.write_bytes(b"\xff\n")  # nothing translated: nothing kept, nothing added
    (tmp_path / "out.txt.partial").unlink()
    r = aiayn("translate", "--checkpoint", str(ckpt), *FAST_FLAGS, "--input", str(src), "--output", str(out))
    assert r.returncode == 2 and out.read_text() == "precious old translations\n"
    src.write_text("a man runs\nthe dog\n")
    out.chmod(0o640)
    r = aiayn("translate", "--checkpoint", str(ckpt), *FAST_FLAGS, "--input", str(src), "--output", str(out))
    assert r.returncode == 0 and out.read_text().splitlines() == want and (out.stat().st_mode & 0o777) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh.txt", "in.txt", "out.txt"]
    r = aiayn("translate", "--checkpoint", str(ckpt), *FAST_FLAGS, "--input", str(src), "--output", os.devnull)
    assert r.returncode == 0 and os.path.exists(os.devnull) and not os.path.isfile(os.devnull)  # a device stays one


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_run_keeps_an_existing_output_and_its_finished_lines(ckpt, tmp_path, translator, signum):
    """Ctrl-C, or a `kill` / `timeout` (SIGTERM, once the end without a word or a kept line), while
    --output over an existing FILE waits for input: FILE as it was, the lines done in FILE.partial."""
    out = tmp_path / "out.txt"
    out.write_text("precious\n")
    proc = _translating(ckpt, "--beam", "2", "--output", str(out))
    try:
        proc.stdin.write(b"a man runs\nthe dog\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 300
        while not any(p.name.endswith(".partial") and p.read_bytes().count(b"\n") == 2 for p in tmp_path.iterdir()):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum and out.read_text() == "precious\n"
    assert (tmp_path / "out.txt.partial").read_text().splitlines() == translator.translate(
        ["a man runs", "the dog"], beam=2, **FAST)
    how = "interrupted" if signum == signal.SIGINT else "stopped by SIGTERM"
    assert err.decode() == (f"aiayn translate: {how}; the first 2 input line(s) are translated and written to "
                            f"{out}.partial ({out} is as it was), line-aligned; rerun on the rest with `tail -n +3`\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt", "out.txt.partial"]


def test_outputs_that_a_new_file_would_not_stand_for_are_written_in_place(ckpt, tmp_path, translator):
    """A link, a file of two names and /dev/stdout are written as `open(FILE, "wb")` writes them:
    renamed over, the link would become a file, the other name keep the old text, and /dev/stdout
    (a link to the file behind the standard output) would lose what else was written there."""
    src = tmp_path / "in.txt"
    src.write_text("a man runs\n")
    want = translator.translate(["a man runs"], beam=4, **FAST)[0] + "\n"
    target, link, twin = tmp_path / "target.txt", tmp_path / "link.txt", tmp_path / "twin.txt"
    target.write_text("old\n")
    link.symlink_to(target)
    os.link(target, twin)
    for out in (link, target):
        r = aiayn("translate", "--checkpoint", str(ckpt), *FAST_FLAGS, "--input", str(src), "--output", str(out))
        assert r.returncode == 0 and link.is_symlink() and target.read_text() == twin.read_text() == want
    log = tmp_path / "log.txt"
    with open(log, "ab") as f:  # (appends after what the child wrote through its own opening)
        inode = os.fstat(f.fileno()).st_ino
        r = subprocess.run([sys.executable, "-m", "aiayn", "translate", "--checkpoint", str(ckpt), *FAST_FLAGS,
                            "--input", str(src), "--output", "/dev/stdout"], stdout=f, stderr=subprocess.PIPE)
        f.write(b"after\n")  # the same file still: what comes after is not written to a file renamed away
    assert r.returncode == 0 and log.stat().st_ino == inode and log.read_text() == want + "after\n"


def test_invisible_only_lines_are_blank(translator):
    lines = ["\x00", "\u200b", "\ufeff", " \u200b\t", "a man runs"]
    out = translator.translate(lines, beam=2, **FAST)
    assert out[:4] == ["", "", "", ""]


def test_an_os_error_no_module_reported_is_one_line_and_a_closed_pipe_is_quiet(monkeypatch, capsys):
    import errno

    import aiayn.copytask

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/some/file")

    monkeypatch.setattr(aiayn.copytask, "run", full)
    assert cli.main(["demo"]) == 2
    assert capsys.readouterr().err == "aiayn demo: error: /some/file: No space left on device\n"

    def gone(args):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(aiayn.copytask, "run", gone)
    monkeypatch.setattr(os, "dup2", lambda *a: None)  # leave pytest's stdout alone
    assert cli.main(["demo"]) == 0
    assert capsys.readouterr().err == ""


def test_a_ctranslate2_export_without_its_engine_says_so(tmp_path, capsys):
    for f in ("model.bin", "aiayn.json", "config.json"):
        (tmp_path / f).write_text("{}")
    assert cli.main(["translate", "--checkpoint", str(tmp_path), "--input", os.devnull]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a CTranslate2 export" in err and "--engine ctranslate2" in err


def test_translating_a_sample_mid_training_leaves_the_model_training(parts, ckpt):
    """`Translator(model)` translates in eval mode but gives the caller's model back as it was:
    training mode and trainable weights, so the next training step still updates every weight."""
    import copy
    import dataclasses

    # dropout on, so that a search left in training mode would give other translations
    model = Transformer(dataclasses.replace(parts[0].cfg, dropout=0.3, attention_dropout=0.3))
    model.load_state_dict(parts[0].state_dict())
    model.train().requires_grad_(True)
    lines = ["a man runs", "the dog plays with a ball"]
    t = Translator(model, parts[1])
    before = t.search(lines, beam=2, **FAST)
    got = [nb[0][0] for nb in before]
    assert all(m.training for m in model.modules())
    assert all(p.requires_grad for p in model.parameters())
    frozen = copy.deepcopy(model).eval().requires_grad_(False)
    assert got == Translator(frozen, parts[1]).translate(lines, beam=2, **FAST)  # eval mode: no dropout
    assert not frozen.training  # a caller's eval mode stays too
    src = torch.tensor([[5, 6, 7, EOS_ID]])
    model.loss(src, torch.tensor([[2, 5, 6]]), torch.tensor([[5, 6, EOS_ID]]), reduction="sum").backward()
    assert all(p.grad is not None for p in model.parameters() if p.dim() == 2)
    # a fused Adam step changes the weights in place without bumping their version: the next sample
    # must see the new weights, not a packed copy of the old ones
    torch.optim.Adam(model.parameters(), lr=0.05, fused=True).step()
    after = t.search(lines, beam=2, **FAST)
    assert after != before
    assert after == Translator(copy.deepcopy(model).requires_grad_(False), parts[1]).search(lines, beam=2, **FAST)
    # a Translator that loaded its own model freezes it, for speed
    assert not any(p.requires_grad for p in Translator.from_checkpoint(ckpt).model.parameters())


def test_search_never_switches_the_mode_of_a_model_the_caller_holds(parts, monkeypatch):
    """A frozen model left in training mode is searched in eval mode without its own flags being
    switched for the duration: another thread using it meanwhile (a second `search`, whose end
    would switch it back to training mid-search, or training itself) sees it as the caller left it."""
    import copy

    import aiayn.translator as tr

    model = copy.deepcopy(parts[0]).train().requires_grad_(False)
    seen = []
    real = tr.greedy_search
    monkeypatch.setattr(tr, "greedy_search", lambda m, *a, **k: seen.append((model.training, m.training)) or real(
        m, *a, **k))
    got = Translator(model, parts[1]).translate(["a man runs", "the dog plays"], beam=1, **FAST)
    assert seen and all(caller and not searched for caller, searched in seen), seen
    assert all(m.training for m in model.modules())
    assert got == Translator(copy.deepcopy(model).eval(), parts[1]).translate(["a man runs", "the dog plays"], beam=1,
                                                                              **FAST)


@pytest.mark.parametrize("frozen", [False, True])
def test_a_translator_on_another_device_leaves_the_callers_model_where_it_is(parts, frozen):
    """`Translator(model, device=D)` searches on D without moving the caller's model there (a model
    training on a GPU, translating a sample with the default device "cpu", stays on the GPU). The
    meta device stands in for the other device: nothing is computed, only where tensors live."""
    import copy

    model = copy.deepcopy(parts[0]).requires_grad_(not frozen)
    t = Translator(model, parts[1], device="meta")
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(b.device.type == "cpu" for b in model.buffers())
    from aiayn.translator import inference_view

    view = inference_view(t.model, t.device)
    assert all(p.device.type == "meta" and not p.requires_grad for p in view.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert [p.requires_grad for p in model.parameters()] == [not frozen] * len(list(model.parameters()))


def test_a_checkpoint_from_before_source_eos_translates_as_before(parts, tmp_path):
    """New models read the source with EOS at its end (fairseq's and Marian's convention); a
    checkpoint whose config has no `source_eos` was trained on bare sources and is fed as before."""
    import json

    from aiayn.search import greedy_search
    from aiayn.tokenizer import BOS_ID

    model, toks = parts
    line = "the dog plays with a ball"
    assert Translator(model, toks).encode([line, ""]) == [toks.src.encode(line) + [EOS_ID], []]
    path = tmp_path / "old"
    save_checkpoint(path, model, toks, {"train": {}, "step": 1})
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model"].pop("source_eos") is True
    (path / "config.json").write_text(json.dumps(cfg))
    old = Translator.from_checkpoint(path)
    assert old.model.cfg.source_eos is False
    assert old.encode([line]) == [toks.src.encode(line)]
    with torch.no_grad():
        bare = greedy_search(old.model, torch.tensor([toks.src.encode(line)]), BOS_ID, EOS_ID, 0.0, 4)
    assert old.translate([line], beam=1, **FAST) == [toks.tgt.decode(bare[0])]


def test_device_flag_picks_the_gpu_where_there_is_one_and_refuses_one_that_is_missing(monkeypatch):
    from aiayn.translate import inference_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert inference_device("auto") == inference_device("cpu") == torch.device("cpu")
    with pytest.raises(AiaynError, match=r"^--device cuda:1: no CUDA device is available; use --device cpu$"):
        inference_device("cuda:1")
    with pytest.raises(AiaynError, match=r"^--device tpu: expected auto, cpu, cuda or cuda:N$"):
        inference_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert inference_device("auto") == torch.device("cuda")
    assert inference_device("auto", "int8") == torch.device("cpu")  # int8 runs on the CPU only


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
@pytest.mark.parametrize("command", [
    ["translate", "--checkpoint", "CKPT", "--input", "IN"],
    ["evaluate", "--checkpoint", "CKPT", "--src-file", "IN", "--ref-file", "IN"],
    ["serve", "--checkpoint", "CKPT", "--port", "0"],
])
def test_translate_evaluate_and_serve_take_device(ckpt, tmp_path, capsys, command):
    src = tmp_path / "in.txt"
    src.write_text("a man runs\n")
    argv = [str(ckpt) if a == "CKPT" else str(src) if a == "IN" else a for a in command]
    assert cli.main([*argv, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.endswith("error: --device cuda: no CUDA device is available; use --device cpu\n") and err.count("\n") == 1
    if command[0] == "translate":  # and on the CPU, as asked
        assert cli.main([*argv, *FAST_FLAGS, "--device", "cpu", "--output", str(tmp_path / "out.txt")]) == 0
        assert len((tmp_path / "out.txt").read_text().splitlines()) == 1


def test_evaluating_restores_each_mode_and_leaves_an_eval_model_alone(monkeypatch):
    """`evaluating`: every submodule in eval mode inside, each one's own mode back after (a model in
    training with one layer frozen in eval), and a model already in eval mode throughout (a
    translator's, shared by server threads) gets no flag written at all."""
    from aiayn.translator import evaluating

    model = Transformer(preset("tiny", src_vocab_size=20, tgt_vocab_size=20)).train()
    model.decoder.layers[0].eval()
    before = [m.training for m in model.modules()]
    with evaluating(model):
        assert not any(m.training for m in model.modules())
    assert [m.training for m in model.modules()] == before
    model.eval()
    writes = []
    real = torch.nn.Module.__setattr__
    monkeypatch.setattr(torch.nn.Module, "__setattr__",
                        lambda self, name, value: (writes.append(name), real(self, name, value))[1])
    with evaluating(model):
        pass
    assert writes == []
