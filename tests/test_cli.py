"""The `aiayn` executable's entry point (`aiayn.cli.entry`), as the console script and
`python -m aiayn` run it."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parent.parent / "src")


def _at_exit(args: list[str]) -> subprocess.CompletedProcess:
    """Runs `entry` with `args`; an atexit hook (run before the interpreter's last collection)
    prints how many objects are frozen out of the garbage collector."""
    code = ("import atexit, gc, sys\n"
            "atexit.register(lambda: print('frozen', gc.get_freeze_count(), file=sys.stderr))\n"
            f"sys.argv[1:] = {args!r}\n"
            "from aiayn.cli import entry\n"
            "entry()\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})


def test_the_executable_freezes_what_is_alive_before_the_interpreter_shuts_down(tmp_path):
    """The interpreter's last garbage collection went over every object torch and the model left
    (1-2 s after each command); frozen, it skips them. The exit status is main's."""
    done = _at_exit(["plot", "lr-schedule", "--steps", "100", "--warmup", "10", "-o", str(tmp_path / "lr.png")])
    assert done.returncode == 0, done.stderr
    frozen = int(done.stderr.split("frozen ")[-1].split()[0])
    assert frozen > 10_000, done.stderr  # torch's modules and objects
    bad = _at_exit(["translate", "--checkpoint", "/nonexistent"])
    assert bad.returncode == 2 and "frozen" in bad.stderr
    assert _at_exit(["--version"]).returncode == 0


def test_python_dash_m_runs_the_entry_point():
    done = subprocess.run([sys.executable, "-m", "aiayn", "--version"], capture_output=True, text=True,
                          env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("aiayn ")


def _help(command: str, capsys, *more: str) -> str:
    from aiayn.cli import main

    try:
        main([command, *more, "--help"])
    except SystemExit as e:
        assert e.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_help_gives_no_default_of_none_after_the_one_it_states(capsys):
    """ArgumentDefaultsHelpFormatter appended "(default: None)" to options whose default is found at
    run time, after their help had said which ("model size (default: the --config file's preset,
    else small) (default: None)"); real defaults are still shown."""
    assert "else small) --" in _help("train", capsys)  # --preset, then the next option
    assert "source language) as one batch and join them with the line's own spacing --" in _help("translate", capsys)
    assert "else the download cache) --" in _help("evaluate", capsys)
    assert "source_lang) --tgt" in _help("import", capsys)
    serve = _help("serve", capsys)
    assert "no key asked --" in serve and "(CORS off) " in serve and "(default: )" not in serve
    assert "(default: 127.0.0.1)" in serve and "(default: 4)" in serve
    for picture in ("lr-schedule", "attention", "positional-encoding", "curves"):  # plot's own subcommands
        assert "(default: None)" not in _help("plot", capsys, picture), picture
    assert "(default: 4000)" in _help("plot", capsys, "lr-schedule")


BIG = 10**400  # a config file's 400 digits: TOML and JSON read them as an int


def test_numbers_past_float_or_64_bits_are_config_errors_not_overflows():
    """A float field given an int past float's range raised OverflowError from math.isfinite; an int
    field past 64 bits (--max-steps, --max-epochs, --tokens-per-update) passed, then overflowed in
    tqdm's or the update-frequency arithmetic once the data was prepared."""
    import pytest

    from aiayn.config import ConfigError, ModelConfig, TrainConfig

    with pytest.raises(ConfigError, match="dropout must be a finite number"):
        ModelConfig(dropout=BIG)
    for name in ("lr_factor", "max_minutes", "clip_norm"):
        with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')} must be a finite number"):
            TrainConfig(**{name: BIG})
    for name in ("max_steps", "max_epochs", "tokens_per_update", "save_every"):
        with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')} must be a whole number that fits in 64 bits"):
            TrainConfig(**{name: 2**64})
        TrainConfig(**{name: 2**64 - 1})
    TrainConfig(seed=-(2**63))
    with pytest.raises(ConfigError, match="d_ff must be a whole number that fits in 64 bits"):
        ModelConfig(d_ff=2**64)


def test_a_config_file_with_huge_numbers_is_a_one_line_error(tmp_path, capsys):
    from aiayn.cli import main

    for i, text in enumerate((f"[model]\ndropout = {BIG}\n", f"[train]\nlr_factor = {BIG}\n",
                              f"[train]\nmax_steps = {BIG}\n", f'{{"train": {{"max_minutes": {BIG}}}}}')):
        cfg = tmp_path / (f"c{i}.json" if text.startswith("{") else f"c{i}.toml")
        cfg.write_text(text, encoding="utf-8")
        assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "run"),
                     "--train-src", str(tmp_path / "none.de"), "--train-tgt", str(tmp_path / "none.en")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and ("finite number" in err or "fits in 64 bits" in err), err
    assert not (tmp_path / "run").exists()


def test_a_digit_too_many_layers_is_refused_at_once(tmp_path, capsys):
    """--encoder-layers 1000000 built a million layers on the meta device one by one (6 ms each:
    hours) before the size check could refuse the model."""
    import time

    import pytest

    from aiayn.cli import main
    from aiayn.config import MAX_LAYERS, ConfigError, ModelConfig

    with pytest.raises(ConfigError, match=f"decoder_layers must be between 1 and {MAX_LAYERS:,}"):
        ModelConfig(decoder_layers=MAX_LAYERS + 1)
    ModelConfig(encoder_layers=MAX_LAYERS, decoder_layers=MAX_LAYERS)
    t0 = time.perf_counter()
    assert main(["train", "--encoder-layers", "1000000", "--out", str(tmp_path / "run"),
                 "--train-src", str(tmp_path / "none.de"), "--train-tgt", str(tmp_path / "none.en")]) == 2
    assert time.perf_counter() - t0 < 30
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "encoder_layers must be between 1 and 1,000" in err, err


def test_a_checkpoint_config_with_huge_numbers_is_a_one_line_error(tmp_path_factory, tmp_path, capsys):
    """config.json is read with the same checks: a 400-digit dropout was an OverflowError traceback
    from `aiayn translate`, a million layers a search that never began (the meta model's layers)."""
    import json
    import shutil

    from aiayn.cli import main
    from serve_model import tiny_checkpoint

    for field, value, words in (("dropout", BIG, "dropout must be a finite number"),
                                ("encoder_layers", 10**6, "encoder_layers must be between 1 and 1,000")):
        ck = tmp_path / field
        shutil.copytree(tiny_checkpoint(tmp_path_factory.getbasetemp()), ck)
        cfg = json.loads((ck / "config.json").read_text())
        cfg["model"][field] = value
        (ck / "config.json").write_text(json.dumps(cfg))
        src = tmp_path / "in.txt"
        src.write_text("ein Hund.\n", encoding="utf-8")
        assert main(["translate", "--checkpoint", str(ck), "--input", str(src)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "invalid model config" in err and words in err, err


def test_an_empty_path_option_is_refused_naming_its_flag(tmp_path, capsys):
    """`--init-from "$BASE"` with BASE unset trained from scratch and an empty --valid-src without
    validation, both without a word (an empty name was taken for a flag not given); --out '' was '.'."""
    import pytest

    from aiayn.cli import main
    from aiayn.config import PATH_FIELDS, ConfigError, TrainConfig

    for name in PATH_FIELDS:
        with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')} is an empty name"):
            TrainConfig(**{name: ""})
    for flag in ("--init-from", "--valid-src", "--out", "--data-dir"):
        args = ["train", "--out", str(tmp_path / "run"), "--train-src", str(tmp_path / "a.de"),
                "--train-tgt", str(tmp_path / "a.en"), flag, ""]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{flag} is an empty name (an unset shell variable?)" in err, err
    assert not (tmp_path / "run").exists()


def test_a_device_that_is_not_cuda_n_is_refused_by_the_config(monkeypatch):
    """"cuda:x" (or "cuda:", "cuda:-1") passed the check of "auto, cpu or cuda[:N]"; on a machine with
    a GPU torch.device() then raised RuntimeError('Invalid device string') as a traceback."""
    import pytest
    import torch

    from aiayn.config import ConfigError, TrainConfig
    from aiayn.trainer import setup_distributed

    for device in ("cuda:x", "cuda:", "cuda:-1", "cuda:01", "cuda:1\n"):
        with pytest.raises(ConfigError, match=r"--device must be auto, cpu or cuda\[:N\]"):
            TrainConfig(device=device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 13)  # (a GPU past the count is refused: test_core_review)
    for device in ("cuda", "cuda:0", "cuda:12"):
        assert setup_distributed(TrainConfig(device=device).device).device == torch.device(device)


def _closing_line(args: list[str], stdout: object) -> subprocess.CompletedProcess:
    """Runs `python -m aiayn ARGS` buffered (as outside a test: no PYTHONUNBUFFERED) with `stdout`."""
    return subprocess.run([sys.executable, "-m", "aiayn", *args], stdout=stdout, stderr=subprocess.PIPE, text=True,
                          timeout=300, env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})


def test_a_closing_line_to_a_reader_gone_or_a_full_disk_is_handled_by_every_command(tmp_path):
    """The line a command ends with (`plot` its file, `average`, `import`, `prepare` theirs) sat in
    Python's buffer until the interpreter's last flush: with the reader gone (`| true`) that printed
    "Exception ignored ... BrokenPipeError" and exited 120, and on a full disk the same with OSError.
    main flushes it: a gone reader is a quiet 0, a full disk one line naming standard output."""
    args = ["plot", "lr-schedule", "--steps", "100", "--warmup", "10", "-o", str(tmp_path / "lr.png")]
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the command writes
    with os.fdopen(w, "w") as gone:
        done = _closing_line(args, gone)
    assert (done.returncode, done.stderr) == (0, "")
    with open("/dev/full", "w") as full:
        done = _closing_line(args, full)
    assert done.returncode == 2 and done.stderr == (
        "aiayn plot: error: standard output: cannot write (No space left on device)\n")
    assert (tmp_path / "lr.png").is_file()


def _raising(monkeypatch, command: str, make_error) -> None:
    """`command`'s run raises what `make_error()` raises (its arguments parse as usual)."""
    import importlib

    from aiayn.cli import COMMANDS

    def run(args):
        make_error()

    monkeypatch.setattr(importlib.import_module(COMMANDS[command][0]), "run", run)


def test_running_out_of_memory_is_one_line_naming_the_flags_that_size_it(monkeypatch, capsys):
    import torch

    from aiayn.cli import main

    # torch's own allocator error: 1 PiB, past x86-64's 47-bit address space, fails even where memory is overcommitted
    _raising(monkeypatch, "translate", lambda: torch.empty(2**50, dtype=torch.uint8))
    assert main(["translate", "--checkpoint", "x"]) == 2
    err = capsys.readouterr().err
    assert err == ("aiayn translate: error: out of memory (1048576.0 GiB asked for); lower --max-tokens, --batch-size "
                   "or --beam, or free memory\n")

    def gpu():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity ...")

    _raising(monkeypatch, "train", gpu)
    assert main(["train"]) == 2
    assert capsys.readouterr().err.startswith("aiayn train: error: out of memory (20.00 GiB asked for); lower --max-tokens")

    def python():
        raise MemoryError

    _raising(monkeypatch, "plot", python)
    assert main(["plot", "lr-schedule"]) == 2
    assert capsys.readouterr().err == "aiayn plot: error: out of memory; free memory, or give it less at once\n"


def test_another_runtime_error_is_not_called_out_of_memory(monkeypatch):
    from aiayn.cli import main

    def broken():
        raise RuntimeError("shape mismatch")

    _raising(monkeypatch, "translate", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        main(["translate", "--checkpoint", "x"])
