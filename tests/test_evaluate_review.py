"""From a cold review of `aiayn evaluate`: a reference stream that goes on slowly is refused once a
line more than the hypotheses has come, not after a whole MiB of it."""

import os
import threading

from aiayn import cli

HYPS = "a dog runs in the park\ntwo men play football\n"


def test_a_slow_endless_reference_stream_is_refused_once_its_extra_line_is_there(tmp_path, capsys):
    """The pipe holds three lines and stays open, as a followed log's does: a buffered read waited for
    1 MiB (days at a line a second) before the stream was called longer than the hypotheses."""
    h = tmp_path / "h.txt"
    h.write_text(HYPS, encoding="utf-8")
    r, w = os.pipe()
    os.write(w, b"a\nb\nc\n")
    rcs: list[int] = []
    run = threading.Thread(target=lambda: rcs.append(cli.main(["evaluate", "--hyp-file", str(h),
                                                               "--ref-file", f"/dev/fd/{r}"])), daemon=True)
    try:
        run.start()
        run.join(timeout=30)
        answered = not run.is_alive()
    finally:
        os.close(w)  # (the old code's wait ends here, at the end of the stream)
        run.join(timeout=30)
        os.close(r)
    assert answered, "still waiting for the rest of a stream whose extra line had come"
    assert rcs == [2]
    err = capsys.readouterr().err
    assert f"has 2 hypotheses but --ref-file /dev/fd/{r} has more than 2 references" in err and err.count("\n") == 1
