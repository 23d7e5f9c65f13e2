"""The Multi30k download path, against a local HTTP server on 127.0.0.1 (nothing reaches the internet)."""

from __future__ import annotations

import functools
import os
import time
import gzip
import hashlib
import http.server
import re
import threading
from pathlib import Path
from typing import Iterator

import pytest

from aiayn import cli
from aiayn.data import text as data
from aiayn.data.text import multi30k_paths, read_parallel
from aiayn.errors import AiaynError

LINES = {"de": ["Ein Hund läuft.", "Zwei Katzen schlafen."], "en": ["A dog runs.", "Two cats sleep."]}


class _Server:
    def __init__(self, root: Path) -> None:
        self.requests: list[str] = []
        self.ranges: list[str | None] = []  # the Range header of each request
        self.cut_short = False
        self.garbled_length = False
        self.serve_ranges = False  # answer Range requests (http.server ignores them, as some servers do)
        self.hang_up_after: int | None = None  # bytes of the file sent before the connection drops
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                server.requests.append(self.path)
                server.ranges.append(self.headers.get("Range"))
                if server.cut_short:  # promise more bytes than are sent, then hang up
                    self.send_response(200)
                    self.send_header("Content-Length", "100000")
                    self.end_headers()
                    self.wfile.write(b"\x1f\x8b" + b"x" * 1000)
                    self.close_connection = True
                    return
                if server.serve_ranges or server.hang_up_after is not None:
                    return self._send(Path(self.translate_path(self.path)).read_bytes())
                super().do_GET()

            def _send(self, data: bytes) -> None:
                asked = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "") if server.serve_ranges else None
                start = int(asked[1]) if asked else 0
                if start and start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206 if asked else 200)
                if asked:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                end = len(data) if server.hang_up_after is None else max(start, server.hang_up_after)
                self.wfile.write(data[start:end])
                self.close_connection = True

            def send_header(self, keyword: str, value: str) -> None:
                if server.garbled_length and keyword == "Content-Length":
                    value = "abc"  # a broken mirror: the sha256 still decides
                super().send_header(keyword, value)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/task1/raw"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)  # a proxy must not see (or swallow) 127.0.0.1 requests


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Server]:
    """val.de.gz and val.en.gz of our own, their sha256 patched into the table; the cache in tmp_path."""
    _no_proxy(monkeypatch)
    raw = tmp_path / "www" / "task1" / "raw"
    raw.mkdir(parents=True)
    table = dict(data.MULTI30K_SHA256)
    for lang, lines in LINES.items():
        blob = gzip.compress("".join(s + "\n" for s in lines).encode(), mtime=0)
        (raw / f"val.{lang}.gz").write_bytes(blob)
        table[f"val.{lang}.gz"] = hashlib.sha256(blob).hexdigest()
    monkeypatch.setattr(data, "MULTI30K_SHA256", table)
    monkeypatch.delenv("AIAYN_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    server = _Server(tmp_path / "www")
    monkeypatch.setenv("AIAYN_MULTI30K_URL", server.url)
    yield server
    server.close()


def test_download_then_cache(served: _Server, tmp_path: Path) -> None:
    src, tgt = multi30k_paths("val", "de", "en")
    folder = tmp_path / "cache" / "aiayn" / "multi30k"
    assert (src, tgt) == (folder / "val.de.gz", folder / "val.en.gz")
    assert read_parallel(src, tgt) == (LINES["de"], LINES["en"])
    assert sorted(served.requests) == ["/task1/raw/val.de.gz", "/task1/raw/val.en.gz"]
    assert sorted(p.name for p in folder.iterdir()) == ["val.de.gz", "val.en.gz"]  # no .part files left

    assert multi30k_paths("val", "de", "en") == (src, tgt)
    assert len(served.requests) == 2  # the second call does not fetch


def test_a_damaged_cached_file_is_fetched_again(served: _Server, tmp_path: Path) -> None:
    src, _ = multi30k_paths("val", "de", "en")
    src.write_bytes(b"truncated")
    multi30k_paths("val", "de", "en")
    assert served.requests.count("/task1/raw/val.de.gz") == 2
    assert read_parallel(*multi30k_paths("val", "de", "en"))[0] == LINES["de"]


def test_checksum_mismatch_leaves_nothing(served: _Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(data.MULTI30K_SHA256, "val.de.gz", "0" * 64)
    with pytest.raises(AiaynError, match=r"val\.de\.gz: sha256 [0-9a-f]{16}\.\.\. does not match .*removed") as e:
        multi30k_paths("val", "de", "en")
    assert "\n" not in str(e.value)
    folder = tmp_path / "cache" / "aiayn" / "multi30k"
    assert list(folder.iterdir()) == []  # neither the bad file nor a temporary


def test_missing_on_server_is_a_clear_error(served: _Server, tmp_path: Path) -> None:
    with pytest.raises(AiaynError, match=r"could not download http://127\.0\.0\.1:\d+/task1/raw/train\.de\.gz .*--data-dir"):
        multi30k_paths("train", "de", "en")
    assert list((tmp_path / "cache" / "aiayn" / "multi30k").iterdir()) == []


def test_an_interrupted_transfer_leaves_no_finished_file(served: _Server, tmp_path: Path) -> None:
    """Only the part (kept for the next try, which goes on from it) where the transfer stopped."""
    served.cut_short = True
    with pytest.raises(AiaynError, match=r"could not download .*val\.de\.gz \(the transfer stopped 98998 bytes short\)"):
        multi30k_paths("val", "de", "en")
    assert [p.name for p in (tmp_path / "cache" / "aiayn" / "multi30k").iterdir()] == [".val.de.gz.resume.part"]
    served.cut_short = False  # (the server ignores Range: all of it again, and the garbage part is gone)
    assert read_parallel(*multi30k_paths("val", "de", "en")) == (LINES["de"], LINES["en"])
    assert sorted(p.name for p in (tmp_path / "cache" / "aiayn" / "multi30k").iterdir()) == ["val.de.gz", "val.en.gz"]


def test_cli_download_into_data_dir(served: _Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mydata"
    assert cli.main(["download", "--src", "de", "--tgt", "en", "--splits", "val", "--data-dir", str(out)]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == str(out / "multi30k")
    assert multi30k_paths("val", "de", "en", out) == (out / "multi30k" / "val.de.gz", out / "multi30k" / "val.en.gz")


def test_cli_download_bad_pair_is_one_line(served: _Server, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["download", "--src", "de", "--tgt", "ja"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tgt 'ja': Multi30k has en, de, fr, cs" in err
    assert cli.main(["download", "--splits", "test2017"]) == 2
    assert "train, val, test_2016_flickr" in capsys.readouterr().err
    assert served.requests == []


def test_the_real_files_pass_the_real_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared copy of Multi30k served as the public repository: the unpatched sums accept it."""
    root = os.environ.get("AIAYN_DATA")
    if not root or not Path(root, "multi30k").is_dir():
        pytest.skip("AIAYN_DATA (Multi30k) not set")
    www = tmp_path / "www" / "task1"
    www.mkdir(parents=True)
    (www / "raw").symlink_to(Path(root, "multi30k").resolve())
    monkeypatch.delenv("AIAYN_DATA")
    _no_proxy(monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    server = _Server(tmp_path / "www")
    monkeypatch.setenv("AIAYN_MULTI30K_URL", server.url)
    try:
        src, tgt = multi30k_paths("test_2016_flickr", "fr", "cs")
    finally:
        server.close()
    a, b = read_parallel(src, tgt)
    assert len(a) == len(b) == 1000


def test_a_garbled_content_length_or_a_bad_mirror_url(served: _Server, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    served.garbled_length = True
    src, _ = multi30k_paths("val", "de", "en")
    assert read_parallel(src, src)[0] == LINES["de"]
    monkeypatch.setenv("AIAYN_MULTI30K_URL", "http://[::1/x")
    with pytest.raises(AiaynError, match=r"could not download http://\[::1/x/val\.de\.gz \(Invalid IPv6 URL\)"):
        data.download_multi30k("val", "de", tmp_path / "elsewhere")


def test_no_network_is_one_clear_line(served: _Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A connection refused (nothing listens: as offline as a test may be), not only a 404."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/task1/raw"
    monkeypatch.setenv("AIAYN_MULTI30K_URL", url)
    assert cli.main(["download", "--splits", "val"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert (f"could not download {url}/val.de.gz ([Errno 111] Connection refused); check the connection, or get "
            "the files another way and pass --data-dir or set $AIAYN_DATA") in err, err
    assert list((tmp_path / "cache" / "aiayn" / "multi30k").iterdir()) == []  # no temporary left behind


def test_cli_download_goes_where_train_looks_under_aiayn_data(served: _Server, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """With $AIAYN_DATA set, `train --data multi30k` reads $AIAYN_DATA only, so `aiayn download`
    must fetch there (it filled the user cache, and train then said the files were missing)."""
    root = tmp_path / "shared"
    root.mkdir()
    monkeypatch.setenv("AIAYN_DATA", str(root))
    assert cli.main(["download", "--src", "de", "--tgt", "en", "--splits", "val"]) == 0
    assert capsys.readouterr().out.strip() == str(root / "multi30k")
    assert multi30k_paths("val", "de", "en") == (root / "multi30k" / "val.de.gz", root / "multi30k" / "val.en.gz")
    flat = tmp_path / "flat"  # a root that is the Multi30k folder itself: its files stay in sight
    flat.mkdir()
    for lang in ("de", "en"):
        (flat / f"train.{lang}.gz").write_bytes((root / "multi30k" / f"val.{lang}.gz").read_bytes())
    monkeypatch.setenv("AIAYN_DATA", str(flat))
    assert cli.main(["download", "--src", "de", "--tgt", "en", "--splits", "val"]) == 0
    assert capsys.readouterr().out.strip() == str(flat) and not (flat / "multi30k").exists()
    assert multi30k_paths("train", "de", "en")[0] == flat / "train.de.gz"


def test_what_a_killed_download_left_is_removed_by_the_next(served: _Server, tmp_path: Path) -> None:
    """kill -9 or SIGTERM leaves the partial file (WMT14's archives: up to ~1 GB each, every try):
    the next download removes those of dead processes and old ones, not a live process's, nor one
    written to within a minute (another container may share the host name, its pids unseen here)."""
    folder = tmp_path / "cache" / "aiayn" / "multi30k"
    folder.mkdir(parents=True)
    from aiayn.data.lock import _host

    dead = folder / f".val.de.gz-{_host()}-999999999-0000abcd.part"  # a pid no process has
    old = folder / ".val.de.gz.k2j_x9a1.part"  # mkstemp's name, untouched for ages
    live = folder / f".val.de.gz-{_host()}-{os.getppid()}-0000abcd.part"  # a live process's
    other = folder / f".val.en.gz-{_host()}-999999999-0000abcd.part"  # another file's: its own download's
    fresh = folder / f".val.de.gz-{_host()}-999999998-0000abcd.part"  # a dead pid's, written to just now
    for p in (dead, old, live, other, fresh):
        p.write_bytes(b"x" * 100)
    os.utime(old, (0, 0))
    minutes_ago = time.time() - 120
    for p in (dead, other):
        os.utime(p, (minutes_ago, minutes_ago))
    multi30k_paths("val", "de", "en")
    left = sorted(p.name for p in folder.iterdir())
    assert left == sorted([live.name, fresh.name, "val.de.gz", "val.en.gz"]), left


def test_an_interrupted_download_is_continued_with_a_range_request(served: _Server, tmp_path: Path) -> None:
    """A flaky link: what came before the connection dropped is kept, and the next try asks for the
    rest only (Range), still sha256-checked; a server that ignores Range sends it all again, and a
    kept part that is not the file's beginning is fetched again from the start."""
    folder = tmp_path / "dl"
    blob = (tmp_path / "www" / "task1" / "raw" / "val.de.gz").read_bytes()
    served.serve_ranges, served.hang_up_after = True, 20
    with pytest.raises(AiaynError, match=rf"could not download .*val\.de\.gz \(the transfer stopped {len(blob) - 20} "
                                         r"bytes short\); .*run it again: it goes on from the 20 bytes received") as e:
        data.download_multi30k("val", "de", folder)
    assert "\n" not in str(e.value)
    (part,) = folder.glob("*.part")
    assert part.read_bytes() == blob[:20]
    served.hang_up_after = None
    assert data.download_multi30k("val", "de", folder).read_bytes() == blob
    assert served.ranges[-1] == "bytes=20-" and [p.name for p in folder.iterdir()] == ["val.de.gz"]

    served.serve_ranges, served.hang_up_after = False, 20  # a server that ignores Range: all of it again
    with pytest.raises(AiaynError, match="goes on from the 20 bytes"):
        data.download_multi30k("val", "en", folder)
    served.hang_up_after = None
    en = data.download_multi30k("val", "en", folder)
    assert served.ranges[-1] == "bytes=20-" and read_parallel(folder / "val.de.gz", en) == (LINES["de"], LINES["en"])

    (folder / "val.en.gz").unlink()  # a part of another file, left by a killed process: resumed, sha256 wrong, redone
    from aiayn.data.lock import _host

    dead = folder / f".val.en.gz-{_host()}-999999999-0000abcd.part"
    dead.write_bytes(b"\x1f\x8b" + b"?" * 18)
    os.utime(dead, (time.time() - 120, time.time() - 120))
    served.serve_ranges = True
    served.ranges.clear()
    assert read_parallel(folder / "val.de.gz", data.download_multi30k("val", "en", folder))[1] == LINES["en"]
    assert served.ranges == ["bytes=20-", None] and sorted(p.name for p in folder.iterdir()) == ["val.de.gz",
                                                                                                  "val.en.gz"]


def test_a_kept_part_that_is_the_whole_file_is_not_fetched_again(served: _Server, tmp_path: Path) -> None:
    """Killed after the last byte, before the rename: the server answers 416 to the range past its
    end, and the part's sha256 says it is done."""
    folder = tmp_path / "dl"
    folder.mkdir()
    blob = (tmp_path / "www" / "task1" / "raw" / "val.de.gz").read_bytes()
    (folder / ".val.de.gz.resume.part").write_bytes(blob)
    served.serve_ranges = True
    assert data.download_multi30k("val", "de", folder).read_bytes() == blob
    assert served.ranges == [f"bytes={len(blob)}-"] and [p.name for p in folder.iterdir()] == ["val.de.gz"]
