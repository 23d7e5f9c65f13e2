"""Data parallelism is gradient accumulation by other means: torchrun with 2 CPU processes (gloo)
gives the same losses and weights as one process that accumulates the same batches per step, with
--update-freq above 1 too (DDP's no_sync path), and across two "machines" (two torchrun agents
meeting at a c10d rendezvous on 127.0.0.1, each reading its own prepared copy of the data). Only
rank 0 writes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from test_train import make_corpus, tiny_args, train_cli

import aiayn
from aiayn.data import prepare as P

STEPS = 6
# Adam's update m / (sqrt(v) + eps) does not see a constant factor on the gradient while eps is tiny,
# so a sync that drops the world size from the gradient's scale would train just the same. With an
# eps far above the gradients (~1e-2 here) the update is proportional to the gradient, as SGD with
# momentum: every factor shows in the weights and, from step 2, in the losses.
EXTRA = ["--max-steps", str(STEPS), "--log-every", "1", "--save-every", "0", "--adam-eps", "1", "--lr-factor", "50"]


def _losses(run: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs if r["kind"] == "train"]
    assert len(steps) == len(set(steps)), "each step logged once (rank 0 only)"
    return {r["step"]: r["loss"] for r in recs if r["kind"] == "train"}


def _env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            "TMPDIR": str(tmp_path / "tmp"),  # torchrun leaves a torchelastic_* log folder in the temp dir
            "PYTHON_COLORS": "0"}  # plain traceback lines for _our_frames (Python 3.13 may colour them)


def _assert_same_training(one: Path, two: Path) -> None:
    l1, l2 = _losses(one), _losses(two)
    assert sorted(l1) == sorted(l2) == list(range(1, STEPS + 1))
    for s in l1:
        assert abs(l1[s] - l2[s]) < 1e-4 * max(1.0, abs(l1[s])), (s, l1[s], l2[s])
    assert l1[STEPS] < l1[1]  # the runs did train
    w1 = load_file(str(one / f"step_{STEPS}" / "model.safetensors"))
    w2 = load_file(str(two / f"step_{STEPS}" / "model.safetensors"))
    # Matrices only: key biases get no gradient (softmax ignores them). With eps = 1 Adam no longer
    # blows the rounding of near-zero gradients (summed in another order) up to a visible step.
    for k in (k for k in w1 if w1[k].dim() == 2):
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-3, atol=1e-4)


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args, "-m", "aiayn"]


def test_two_ranks_match_one_process_with_update_freq_2(tmp_path):
    corpus = make_corpus(tmp_path / "data", n_train=120)
    one = tmp_path / "one"
    train_cli(tiny_args(corpus, one, *EXTRA, "--update-freq", "2"))

    two = tmp_path / "two"
    cmd = _torchrun("--standalone", "--nproc_per_node", "2") + tiny_args(corpus, two, *EXTRA)
    res = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=600)  # generous: slow shared CI
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("parameters;") == 1  # only rank 0 reports
    assert "device cpu x2" in res.stdout
    assert "broadcast_buffers" not in res.stderr  # torch 2.13's FutureWarning, from every rank of every run
    _assert_same_training(one, two)
    # only rank 0 wrote: one run directory layout, no per-rank files
    names = sorted(p.name for p in two.iterdir())
    # data: the prepared text; best/: --max-steps stops mid-epoch, and the stop is validated
    assert names == ["best", "data", "metrics.jsonl", f"step_{STEPS}", "train.json"], names


def test_update_freq_under_ddp_matches_one_process_accumulating_all(tmp_path):
    """2 ranks x --update-freq 2: two batches accumulated under no_sync, then one synchronised."""
    corpus = make_corpus(tmp_path / "data", n_train=120)
    one = tmp_path / "one"
    train_cli(tiny_args(corpus, one, *EXTRA, "--update-freq", "4"))
    two = tmp_path / "two"
    cmd = _torchrun("--standalone", "--nproc_per_node", "2") + tiny_args(corpus, two, *EXTRA, "--update-freq", "2")
    res = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "max 160 tokens x 2 batches x 2 ranks per step" in res.stdout
    _assert_same_training(one, two)  # 4 gradients: ((a+b)+c)+d against (a+b)+(c+d)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_machines_match_one_process(tmp_path):
    corpus = make_corpus(tmp_path / "data", n_train=120)
    inputs = P.Inputs(*(Path(corpus[k]) for k in ("train_src", "train_tgt", "valid_src", "valid_tgt")))
    bins = [P.prepare(inputs, tmp_path / f"machine{i}" / "bin", P.Settings(vocab_size=300), 1, log=lambda m: None)
            for i in range(2)]  # each machine prepares its own copy
    one = tmp_path / "one"
    data_bin = ["--data-bin", str(bins[0])]
    train_cli(_drop_text(tiny_args(corpus, one, *EXTRA, "--update-freq", "2")) + data_bin)

    two = tmp_path / "two"
    rdzv = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
            f"127.0.0.1:{_free_port()}", "--rdzv_id", "aiayn-test"]
    env = _env(tmp_path)
    procs = []
    for i in range(2):
        cmd = _torchrun(*rdzv) + _drop_text(tiny_args(corpus, two, *EXTRA)) + ["--data-bin", str(bins[i])]
        log = open(tmp_path / f"machine{i}.log", "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    for proc, log in procs:
        rc = proc.wait(timeout=600)
        log.close()
        assert rc == 0, "".join(p.read_text()[-3000:] for p in tmp_path.glob("machine*.log"))
    printed = "".join((tmp_path / f"machine{i}.log").read_text() for i in range(2))
    assert printed.count("parameters;") == 1 and "device cpu x2" in printed
    _assert_same_training(one, two)


def _drop_text(args: list[str]) -> list[str]:
    """tiny_args without the four text-file flags (the runs read --data-bin)."""
    out = list(args)
    for flag in ("--train-src", "--train-tgt", "--valid-src", "--valid-tgt"):
        i = out.index(flag)
        del out[i : i + 2]
    return out


def test_fewer_batches_than_ranks_is_a_clear_error_not_a_hang(tmp_path):
    corpus = make_corpus(tmp_path / "data", n_train=3)  # 3 short pairs: one batch for two ranks
    cmd = _torchrun("--standalone", "--nproc_per_node", "2") + tiny_args(corpus, tmp_path / "r", *EXTRA)
    res = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert "the data makes 1 batches, fewer than the 2 processes; lower --max-tokens or use fewer processes" in res.stderr


def _two_machines(tmp_path: Path, outs: list[Path], extra: list[str], name: str,
                  timeout: float = 300, bare: bool = False) -> list[tuple[int, str]]:
    """Two torchrun agents (--nnodes 2, one process each) on 127.0.0.1, machine i writing to outs[i];
    returns each one's exit status and what it printed. Bounded: a hang kills both and fails. `bare`:
    `train --out OUT` and `extra` alone, without the tiny run's flags."""
    corpus = make_corpus(tmp_path / "data", n_train=120)
    rdzv = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
            f"127.0.0.1:{_free_port()}", "--rdzv_id", f"aiayn-{name}"]
    procs = []
    for i in range(2):
        log = open(tmp_path / f"{name}{i}.log", "w")
        args = ["train", "--out", str(outs[i]), *extra] if bare else tiny_args(corpus, outs[i], *extra)
        cmd = _torchrun(*rdzv) + args
        procs.append((subprocess.Popen(cmd, env=_env(tmp_path), stdout=log, stderr=subprocess.STDOUT), log))
    try:
        codes = [proc.wait(timeout=timeout) for proc, _ in procs]
    except subprocess.TimeoutExpired:
        for proc, _ in procs:
            proc.kill()
        raise AssertionError(f"{name}: hung; " + "".join((tmp_path / f"{name}{i}.log").read_text()[-2000:] for i in range(2)))
    finally:
        for _, log in procs:
            log.close()
    return [(code, (tmp_path / f"{name}{i}.log").read_text()) for i, code in enumerate(codes)]


_OURS = f'File "{Path(aiayn.__file__).parent}{os.sep}'  # a traceback frame in aiayn's own code


def _our_frames(printed: str) -> list[str]:
    return [x for x in printed.splitlines() if x.strip().startswith(_OURS)]


def _went_well(machine: tuple[int, str]) -> bool:
    """A machine's run exited 0 with no error line and no traceback frame of aiayn's. torchrun's own
    agent may still complain after the run: the machine hosting the rendezvous store can leave
    first, and the other's agent then reports (with a C++ stack, or a traceback of its own) that it
    could not close the rendezvous, which touches neither the run nor the exit status."""
    code, printed = machine
    return code == 0 and "aiayn train: error" not in printed and not _our_frames(printed)


def test_our_check_of_a_machine_ignores_torchruns_late_rendezvous_complaints():
    late = ("stopped: reached --max-steps 3; step 3\n[W1126 TCPStore.cpp:115] [c10d] recvVector failed\n"
            "frame #0: c10::Error::Error(c10::SourceLocation)\nThe node 'localhost_1_0' has failed to shutdown "
            "the rendezvous 'aiayn-first' due to an error of type RendezvousConnectionError.\nTraceback (most "
            'recent call last):\n  File "/venv/torch/distributed/elastic/agent/server/api.py", line 1008\n')
    assert _went_well((0, late))
    assert not _went_well((1, late))
    assert not _went_well((0, late + "aiayn train: error: --resume: no checkpoint\n"))
    ours = f'Traceback (most recent call last):\n  File "{Path(aiayn.__file__).parent / "trainer.py"}", line 1\n'
    assert not _went_well((0, ours))


def test_two_machines_with_their_own_out_prepare_train_and_resume_together(tmp_path):
    """Machines that share no --out: each prepares the raw text itself, only rank 0's --out holds
    checkpoints, and --resume continues from rank 0's newest on both (the state reaches rank 1):
    the same losses and weights as one process that never stopped."""
    corpus = make_corpus(tmp_path / "data", n_train=120)
    one = tmp_path / "one"
    train_cli(tiny_args(corpus, one, *EXTRA, "--update-freq", "2"))

    outs = [tmp_path / "machine0" / "run", tmp_path / "machine1" / "run"]
    half = ["--max-steps", str(STEPS // 2), *EXTRA[2:]]  # the run's own settings, a shorter stop
    first = _two_machines(tmp_path, outs, half, "first")
    assert all(map(_went_well, first)), "".join(p[-3000:] for _, p in first)
    assert (outs[0] / f"step_{STEPS // 2}").is_dir() and not (outs[1] / f"step_{STEPS // 2}").exists()
    again = _two_machines(tmp_path, outs, [*EXTRA, "--resume"], "again")
    assert all(map(_went_well, again)), "".join(p[-3000:] for _, p in again)
    assert f"resuming from {outs[0] / f'step_{STEPS // 2}'}" in again[0][1]
    _assert_same_training(one, outs[0])


def test_two_machines_without_a_checkpoint_start_again_together_on_rank_0s_train_json(tmp_path):
    """`--out RUN --resume` with no checkpoint in RUN starts the run again on the settings of RUN/train.json.
    Machines that share no --out have it on rank 0's alone: the other started from the defaults (another
    model, no training data) and the run failed. Rank 0's settings reach every rank: the same run again."""
    outs = [tmp_path / "machine0" / "run", tmp_path / "machine1" / "run"]
    first = _two_machines(tmp_path, outs, ["--max-steps", "2", "--log-every", "1", "--save-every", "0"], "first")
    assert all(map(_went_well, first)), "".join(p[-3000:] for _, p in first)
    assert not (outs[1] / "train.json").exists()
    before = load_file(str(outs[0] / "step_2" / "model.safetensors"))
    for name in ("step_2", "best"):  # as if killed before its first checkpoint
        shutil.rmtree(outs[0] / name, ignore_errors=True)
    again = _two_machines(tmp_path, outs, ["--resume"], "again", bare=True)
    assert all(map(_went_well, again)), "".join(p[-3000:] for _, p in again)
    assert "nothing to resume" in again[0][1] and "stopped: reached --max-steps 2" in again[0][1], again[0][1][-3000:]
    after = load_file(str(outs[0] / "step_2" / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_two_machines_that_cannot_resume_together_refuse_on_every_rank_in_one_line(tmp_path):
    """Rank 0 decides what to resume from; a refusal there is one line on every rank, never a hang."""
    outs = [tmp_path / "machine0" / "run", tmp_path / "machine1" / "run"]
    half = ["--max-steps", "2", "--log-every", "1", "--save-every", "0"]
    first = _two_machines(tmp_path, outs, half, "first")
    assert all(map(_went_well, first)), "".join(p[-3000:] for _, p in first)
    (outs[0] / "step_2" / "trainer_state.pt").write_bytes(b"not a trainer state")
    again = _two_machines(tmp_path, outs, [*EXTRA, "--resume"], "again")
    for code, printed in again:  # (torchrun's own agent reports a failed child with a traceback of its own)
        assert code != 0 and not _our_frames(printed), printed[-3000:]
        errors = [line for line in printed.splitlines() if "aiayn train: error:" in line]
        assert len(errors) == 1 and "trainer_state.pt" in errors[0], printed[-3000:]


def test_a_signal_to_another_rank_gives_rank_0_the_hint_to_resume(tmp_path, monkeypatch, capsys):
    """SIGTERM to rank 1 alone (a scheduler, `kill`) stops every rank at the same step, as it should,
    but rank 0, which alone prints, gave no "to resume, run: ..." (it looked at its own signal only).
    Simulated in one process: the ranks' agreement reports another rank's signal at step 3."""
    from aiayn.cli import main as cli_main
    from aiayn.trainer import Dist

    corpus = make_corpus(tmp_path / "data", n_train=120)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    real, calls = Dist.any, []

    def any_rank(self: Dist, *flags: bool) -> list[bool]:
        calls.append(flags)
        flags = (True, *flags[1:]) if len(flags) == 2 and len(calls) == 3 else flags  # (signal, out of time)
        return real(self, *flags)

    monkeypatch.setattr(Dist, "any", any_rank)
    out = tmp_path / "run"
    assert cli_main(tiny_args(corpus, out, "--max-steps", "10", "--save-every", "0")) == 0  # (this rank had none)
    text = capsys.readouterr().out
    assert f"stopped: interrupted by a signal; step 3; last checkpoint {out / 'step_3'}" in text, text
    assert "to resume, run: aiayn train " in text, text
