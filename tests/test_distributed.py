"""torchrun with 2 CPU processes (gloo) gives the same losses and weights as one process that
accumulates the same 2 batches per step (--update-freq 2); only rank 0 writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file
from test_train import make_corpus, tiny_args, train_cli


def _losses(run) -> dict[int, float]:  # type: ignore[no-untyped-def]
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs if r["kind"] == "train"]
    assert len(steps) == len(set(steps)), "each step logged once (rank 0 only)"
    return {r["step"]: r["loss"] for r in recs if r["kind"] == "train"}


def test_two_ranks_match_one_process_with_update_freq_2(tmp_path):
    corpus = make_corpus(tmp_path / "data", n_train=120)
    steps = 6
    extra = ["--max-steps", str(steps), "--log-every", "1", "--save-every", "0"]
    one = tmp_path / "one"
    train_cli(tiny_args(corpus, one, *extra, "--update-freq", "2"))

    two = tmp_path / "two"
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
           "TMPDIR": str(tmp_path / "tmp")}  # torchrun leaves a torchelastic_* log folder in the temp dir
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "aiayn",
           *tiny_args(corpus, two, *extra)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)  # generous: slow shared CI
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("parameters;") == 1  # only rank 0 reports
    assert "device cpu x2" in res.stdout

    l1, l2 = _losses(one), _losses(two)
    assert sorted(l1) == sorted(l2) == list(range(1, steps + 1))
    for s in l1:
        assert abs(l1[s] - l2[s]) < 1e-4 * max(1.0, abs(l1[s])), (s, l1[s], l2[s])
    assert l1[steps] < l1[1]  # the runs did train
    w1 = load_file(str(one / f"step_{steps}" / "model.safetensors"))
    w2 = load_file(str(two / f"step_{steps}" / "model.safetensors"))
    for k in w1:  # matrices only: key biases get no gradient (softmax ignores them), so Adam amplifies noise there
        if w1[k].dim() == 2:
            torch.testing.assert_close(w1[k], w2[k], rtol=1e-3, atol=1e-4)
    # only rank 0 wrote: one run directory layout, no per-rank files
    names = sorted(p.name for p in two.iterdir())
    assert names == ["data", "metrics.jsonl", f"step_{steps}", "train.json"], names  # data: the prepared text
