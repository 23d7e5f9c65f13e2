"""Damaged checkpoints, odd configs and odd text: each gives one line naming the file (or flag)
and what to do, never a traceback, and never loads weights that are not weights."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from aiayn import checkpoint as ckpt
from aiayn import copytask
from aiayn.cli import main as cli_main
from aiayn.config import ConfigError, ModelConfig, preset
from aiayn.errors import AiaynError
from aiayn.model import Transformer
from aiayn.tokenizer import Tokenizer, TokenizerPair

WORDS = "the a cat dog sees runs big small red house tree man woman child ball blue green eats".split()


@pytest.fixture(scope="module")
def tok() -> TokenizerPair:
    lines = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(5)) for i in range(200)]
    t = Tokenizer.train(lines, 300)
    return TokenizerPair(t, t, joint=True)


@pytest.fixture
def good(tmp_path: Path, tok: TokenizerPair) -> Path:
    torch.manual_seed(0)
    v = tok.src.vocab_size
    model = Transformer(preset("tiny", src_vocab_size=v, tgt_vocab_size=v))
    ckpt.save_checkpoint(tmp_path / "c", model, tok, {"train": {"seed": 1, "src": "de", "tgt": "en"}, "step": 1})
    return tmp_path / "c"


def _edit_config(path: Path, **model: object) -> None:
    cfg = json.loads((path / ckpt.CONFIG).read_text())
    cfg["model"].update(model)
    (path / ckpt.CONFIG).write_text(json.dumps(cfg))


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_weights_that_are_not_floating_point_are_refused(good: Path, dtype: torch.dtype) -> None:
    weights = load_file(str(good / ckpt.WEIGHTS))
    save_file({k: v.to(dtype) for k, v in weights.items()}, str(good / ckpt.WEIGHTS))
    with pytest.raises(AiaynError, match=r"model\.safetensors: tensor .* not floating point"):
        ckpt.load_checkpoint(good)


def test_half_precision_weights_still_load(good: Path) -> None:
    weights = load_file(str(good / ckpt.WEIGHTS))
    save_file({k: v.half() for k, v in weights.items()}, str(good / ckpt.WEIGHTS))
    c = ckpt.load_checkpoint(good)
    k = next(iter(weights))
    assert torch.equal(c.model.state_dict()[k], weights[k].half().float())


def test_a_size_far_off_the_weights_is_reported_before_the_model_is_allocated(good: Path) -> None:
    _edit_config(good, d_ff=10**12)  # 10^12 x 32 floats: no memory holds it
    with pytest.raises(AiaynError, match=r"model\.safetensors: tensor .* has shape .* needs .*1000000000000"):
        ckpt.load_checkpoint(good)


def test_a_size_torch_cannot_index_names_config_json(good: Path) -> None:
    _edit_config(good, d_model=10**400)
    with pytest.raises(AiaynError, match=r"config\.json: invalid model config"):
        ckpt.load_checkpoint(good)


def test_config_json_nested_too_deep_is_corrupt(good: Path) -> None:
    (good / ckpt.CONFIG).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(AiaynError, match=r"config\.json is corrupt"):
        ckpt.load_checkpoint(good)


def test_config_json_with_a_number_past_pythons_digit_limit_is_corrupt(good: Path) -> None:
    """Over 4,300 digits json.loads raises a plain ValueError (not a decode error): a traceback."""
    text = (good / ckpt.CONFIG).read_text()
    (good / ckpt.CONFIG).write_text(text.replace('"max_positions": ', '"max_positions": ' + "9" * 5000 + ", \"x\": ", 1))
    with pytest.raises(AiaynError, match=r"config\.json is corrupt \(Exceeds the limit"):
        ckpt.load_checkpoint(good)


def test_export_record_nested_too_deep_is_a_value_error(tmp_path: Path) -> None:
    (tmp_path / ckpt.EXPORT_MARKER).write_text("{\"a\": " * 100_000 + "1" + "}" * 100_000)
    with pytest.raises(ValueError, match="aiayn.json"):
        ckpt.recorded_config(tmp_path)


@pytest.mark.parametrize("train", [[1], "de-en", 3])
def test_a_train_section_that_is_not_an_object_is_one_line(good: Path, tmp_path: Path, train: object,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    cfg = json.loads((good / ckpt.CONFIG).read_text())
    cfg["train"] = train
    (good / ckpt.CONFIG).write_text(json.dumps(cfg))
    with pytest.raises(AiaynError, match=r"config\.json: \"train\" must be an object"):
        ckpt.load_checkpoint(good)
    # export reads train.src/tgt as an object (an AttributeError before)
    assert cli_main(["export", "--checkpoint", str(good), "--to", "ctranslate2", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "must be an object" in err, err


def test_a_checkpoint_without_train_section_still_loads(good: Path) -> None:
    cfg = json.loads((good / ckpt.CONFIG).read_text())
    del cfg["train"]
    (good / ckpt.CONFIG).write_text(json.dumps(cfg))
    assert ckpt.load_checkpoint(good).model_config.d_model == 32


@pytest.mark.parametrize("eps", [0.0, -1.0])
def test_layer_norm_eps_must_be_positive(eps: float) -> None:
    with pytest.raises(ConfigError, match="layer_norm_eps must be positive"):
        ModelConfig(layer_norm_eps=eps)
    assert ModelConfig.from_dict(ModelConfig(layer_norm_eps=1e-6).to_dict()).layer_norm_eps == 1e-6


def test_demo_takes_the_largest_seed_it_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    assert copytask.run(argparse.Namespace(steps=1, seed=2**64 - 1)) == 0
    assert "exact-match" in capsys.readouterr().out


def test_tokenizer_on_only_over_long_lines_says_what_to_do() -> None:
    with pytest.raises(AiaynError, match="every line is longer than .* one a line"):
        Tokenizer.train(["x" * 5000, "a b " * 1500], 300)


def test_loading_a_checkpoint_does_not_import_torchs_compiler(good: Path) -> None:
    """The shapes check builds the model on the meta device, where torch runs some ops (arange,
    normal_) through its compiler's references: importing torch._dynamo cost every translate,
    evaluate and serve start 2 s. The model's own init skips meta tensors."""
    import subprocess
    import sys

    code = ("import sys\nfrom aiayn.checkpoint import load_checkpoint\n"
            f"load_checkpoint({str(good)!r})\nprint('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["False"], done.stdout + done.stderr


def test_encode_batch_takes_any_iterable_of_texts(tok: TokenizerPair) -> None:
    """Its texts are read twice (encoded, then looked up where a piece is unknown): an iterator came
    back empty the second time, and so did the whole batch."""
    lines = ["the cat sees a dog", "", "red house"]
    assert tok.src.encode_batch(iter(lines)) == tok.src.encode_batch(lines) == [tok.src.encode(t) for t in lines]


@pytest.mark.parametrize("before", ["nothing", "this one", "an earlier step"])
def test_a_full_disk_message_says_what_is_left(tmp_path: Path, tok: TokenizerPair, monkeypatch: pytest.MonkeyPatch,
                                               before: str) -> None:
    """The first checkpoint of a run, on a full disk, said "the previous checkpoint is intact" where
    there was none (nothing to resume from: the message sent the user looking for it)."""
    import errno
    import os

    torch.manual_seed(0)
    v = tok.src.vocab_size
    model = Transformer(preset("tiny", src_vocab_size=v, tgt_vocab_size=v))
    run = tmp_path / "run"
    if before != "nothing":
        ckpt.save_checkpoint(run / ("step_2" if before == "this one" else "step_1"), model, tok, {"train": {}, "step": 1})

    def full_disk(*a: object, **kw: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt, "save_file", full_disk)
    with pytest.raises(AiaynError) as e:
        ckpt.save_checkpoint(run / "step_2", model, tok, {"train": {}, "step": 2}, in_run=True)  # as a run saves
    msg = str(e.value)
    assert msg.startswith(f"could not write checkpoint {run / 'step_2'}: No space left on device; ")
    assert msg.endswith("; free space or choose another --out")
    if before == "nothing":
        assert "previous checkpoint" not in msg and "there is no earlier checkpoint" in msg, msg
    else:
        assert "the previous checkpoint is intact" in msg, msg


@pytest.mark.parametrize("where", ["beside step checkpoints", "a new path", "an empty folder", "an earlier average"])
def test_a_full_disk_while_averaging_says_what_is_left(tmp_path: Path, tok: TokenizerPair,
                                                       monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                       where: str) -> None:
    """`aiayn average -o run/avg` on a full disk said "the previous checkpoint is intact" because step
    checkpoints sat beside -o: there was no previous average, and nothing was written."""
    import errno
    import os

    torch.manual_seed(0)
    v = tok.src.vocab_size
    model = Transformer(preset("tiny", src_vocab_size=v, tgt_vocab_size=v))
    run = tmp_path / "run"
    ckpt.save_checkpoint(run / "step_1", model, tok, {"train": {}, "step": 1})
    out = run / "avg" if where == "beside step checkpoints" else tmp_path / "avg"
    if where == "an empty folder":
        out.mkdir()
    if where == "an earlier average":
        assert cli_main(["average", "--checkpoint", str(run), "-n", "1", "-o", str(out)]) == 0
    capsys.readouterr()

    def full_disk(*a: object, **kw: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt, "save_file", full_disk)
    assert cli_main(["average", "--checkpoint", str(run), "-n", "1", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and err.rstrip().endswith("choose another -o"), err
    if where == "an earlier average":
        assert "the previous checkpoint is intact" in err and (out / ckpt.CONFIG).is_file(), err
    else:
        assert "nothing was written" in err and "previous checkpoint" not in err and "no earlier" not in err, err


def test_an_interrupted_average_leaves_no_temporaries(tmp_path: Path, tok: TokenizerPair,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while `aiayn average` wrote its output left `.tmp-avg-*` beside -o for good (only
    an OSError removed it); a kill's leftovers (a torn write, and the earlier average moved aside
    between the two renames) stayed too, the earlier average hidden among them. The next average to
    that -o removes them, putting the earlier average back first; names it did not write stay."""
    torch.manual_seed(0)
    v = tok.src.vocab_size
    model = Transformer(preset("tiny", src_vocab_size=v, tgt_vocab_size=v))
    run, out = tmp_path / "run", tmp_path / "avgs" / "avg"
    ckpt.save_checkpoint(run / "step_1", model, tok, {"train": {}, "step": 1})
    argv = ["average", "--checkpoint", str(run), "-n", "1", "-o", str(out)]

    def ctrl_c(*a: object, **kw: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(ckpt, "save_file", ctrl_c)
        assert cli_main(argv) == 130
    assert list(out.parent.iterdir()) == []
    assert cli_main(argv) == 0
    earlier = out.parent / ".tmp-old-avg-0123abcd"  # what a kill between write_dir_atomic's renames leaves
    out.rename(earlier)
    torn = out.parent / ".tmp-avg-89abcdef"  # a kill mid-write
    torn.mkdir()
    (torn / ckpt.WEIGHTS).write_bytes(b"torn")
    for name in (".tmp-notes", ".tmp-avg-notes", ".tmp-other-0123abcd"):  # not ours
        (out.parent / name).mkdir()
    assert ckpt.resolve_checkpoint(out.parent / ".tmp-old-avg-0123abcd")  # the earlier average is hidden there
    restored: list[bool] = []
    real = ckpt.average_checkpoints
    monkeypatch.setattr(ckpt, "average_checkpoints", lambda p, o: restored.append(Path(o, ckpt.CONFIG).is_file())
                        or real(p, o))
    assert cli_main(argv) == 0
    assert restored == [True]  # back in place before the new one replaced it
    assert sorted(p.name for p in out.parent.iterdir()) == [".tmp-avg-notes", ".tmp-notes", ".tmp-other-0123abcd", "avg"]


def test_an_average_to_old_x_leaves_the_earlier_average_to_x_moved_aside(tmp_path: Path) -> None:
    """`.tmp-old-avg-*` is both a killed write's temporary of -o old-avg and the earlier average to
    -o avg moved aside (a kill between `write_dir_atomic`'s renames). `average -o old-avg` removed it,
    and with it the only copy of avg, which the next `average -o avg` would have put back."""
    aside = tmp_path / ".tmp-old-avg-0123abcd"
    aside.mkdir()
    (aside / ckpt.CONFIG).write_text(json.dumps({"averaged_from": []}))
    own_old = tmp_path / ".tmp-old-old-avg-89abcdef"  # old-avg's own earlier average, moved aside: goes back
    own_old.mkdir()
    (own_old / ckpt.CONFIG).write_text(json.dumps({"averaged_from": []}))
    ckpt._remove_average_leftovers(tmp_path / "old-avg")
    assert aside.is_dir() and (tmp_path / "old-avg" / ckpt.CONFIG).is_file() and not own_old.exists()
    ckpt._remove_average_leftovers(tmp_path / "avg")
    assert (tmp_path / "avg" / ckpt.CONFIG).is_file() and not aside.exists()


# `aiayn average` to argv[4] of argv[3]'s newest checkpoint, held mid-write (weights written, the rest not)
# until the file argv[2] appears; argv[1] says it got there. Bounded: it goes on by itself after 120 s.
_HELD_AVERAGE = """
import sys, time
from pathlib import Path
import aiayn.checkpoint as ckpt
from aiayn.cli import main
ready, go, run, out = sys.argv[1:]
real = ckpt.save_file
def held(*a, **kw):
    real(*a, **kw)
    Path(ready).touch()
    end = time.time() + 120
    while not Path(go).exists() and time.time() < end:
        time.sleep(0.05)
ckpt.save_file = held
sys.exit(main(["average", "--checkpoint", run, "-n", "1", "-o", out]))
"""


def _until(done: Callable[[], bool], timeout: float = 120) -> None:
    end = time.time() + timeout
    while not done() and time.time() < end:
        time.sleep(0.05)


def test_two_averages_to_one_output_at_once_take_turns(tmp_path: Path, tok: TokenizerPair) -> None:
    """Two `aiayn average -o X` at once: the second removed the first's temporary as a killed one's
    leftover, and the first, writing on into a folder made anew, put a checkpoint without weights at X.
    The second now waits for the first, then replaces its average: both succeed, and X is the second's."""
    v = tok.src.vocab_size
    run, out, ready, go = tmp_path / "run", tmp_path / "avgs" / "avg", tmp_path / "ready", tmp_path / "go"
    for step in (1, 2):
        torch.manual_seed(step)
        model = Transformer(preset("tiny", src_vocab_size=v, tgt_vocab_size=v))
        ckpt.save_checkpoint(run / f"step_{step}", model, tok, {"train": {}, "step": step})
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with open(logs[0], "w") as log:
            held = [sys.executable, "-c", _HELD_AVERAGE, str(ready), str(go), str(run), str(out)]
            procs.append(subprocess.Popen(held, stdout=log, stderr=subprocess.STDOUT))
        _until(lambda: ready.exists() or procs[0].poll() is not None)
        assert ready.exists(), logs[0].read_text()
        with open(logs[1], "w") as log:
            average = [sys.executable, "-m", "aiayn", "average", "--checkpoint", str(run), "-n", "2", "-o", str(out)]
            procs.append(subprocess.Popen(average, stdout=log, stderr=subprocess.STDOUT))
        _until(lambda: "waiting for" in logs[1].read_text() or procs[1].poll() is not None)
        go.touch()
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    printed = "".join(log.read_text() for log in logs)
    assert codes == [0, 0], printed
    assert "aiayn average: waiting for " in logs[1].read_text(), printed
    assert sorted(p.name for p in out.parent.iterdir()) == ["avg"]  # no temporary, no lock
    assert json.loads((out / ckpt.CONFIG).read_text())["averaged_from"] == [str(run / "step_1"), str(run / "step_2")]
    ckpt.load_checkpoint(out)
