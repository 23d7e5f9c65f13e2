"""The copy task: a tiny Transformer learns to copy (or reverse) random symbol strings.

A quick, self-contained proof that the model, the loss and greedy search work together; `aiayn demo`
runs it while no translation data is at hand, and the tests use it as an overfitting check.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from aiayn.config import preset
from aiayn.model import Transformer
from aiayn.search import greedy_search

PAD, BOS, EOS, FIRST = 0, 1, 2, 3


def make_batch(gen: torch.Generator, batch: int, vocab: int, max_len: int, reverse: bool):
    """Random strings of symbols FIRST..vocab-1, lengths 1..max_len, right-padded.

    Returns src (B, S), tgt_in (B, T) starting with BOS, tgt_out (B, T) ending with EOS."""
    lengths = torch.randint(1, max_len + 1, (batch,), generator=gen)
    src = torch.full((batch, max_len), PAD)
    tgt_in = torch.full((batch, max_len + 1), PAD)
    tgt_out = torch.full((batch, max_len + 1), PAD)
    for i, n in enumerate(lengths.tolist()):
        seq = torch.randint(FIRST, vocab, (n,), generator=gen)
        out = seq.flip(0) if reverse else seq
        src[i, :n] = seq
        tgt_in[i, 0], tgt_in[i, 1 : n + 1] = BOS, out
        tgt_out[i, :n], tgt_out[i, n] = out, EOS
    return src, tgt_in, tgt_out


def train_copy(reverse: bool = False, steps: int = 1000, seed: int = 0, vocab: int = 13, max_len: int = 10,
               log=None) -> tuple[Transformer, float]:  # type: ignore[no-untyped-def]
    """Trains a tiny model and returns it with its greedy exact-match accuracy on 200 new strings."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    cfg = preset("tiny", src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=64, d_ff=128, dropout=0.0)
    model = Transformer(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    warmup = 100
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.3 * cfg.d_model**-0.5 * min((s + 1) ** -0.5, (s + 1) * warmup**-1.5)
    )
    for step in range(steps):
        src, tgt_in, tgt_out = make_batch(gen, 64, vocab, max_len, reverse)
        logits = model(src, tgt_in)
        loss = F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if log and (step + 1) % 100 == 0:
            log(f"step {step + 1:4d}  loss {loss.item():.4f}")
    model.eval()
    src, _, tgt_out = make_batch(gen, 200, vocab, max_len, reverse)
    hyps = greedy_search(model, src, BOS, EOS, max_len_a=1.0, max_len_b=2)
    refs = [[t for t in row.tolist() if t not in (PAD, EOS)] for row in tgt_out]
    return model, sum(h == r for h, r in zip(hyps, refs)) / len(refs)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=1000, help="training steps per task")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    for reverse in (False, True):
        name = "reversed copy" if reverse else "copy"
        print(f"== {name} task: tiny Transformer, {args.steps} steps")
        t0 = time.perf_counter()
        model, acc = train_copy(reverse, args.steps, args.seed, log=print)
        print(f"{name}: greedy exact-match accuracy {acc:.1%} after {time.perf_counter() - t0:.0f}s "
              f"({model.num_parameters():,} parameters)")
        gen = torch.Generator().manual_seed(args.seed + 1)
        src, _, _ = make_batch(gen, 3, 13, 10, reverse)
        for row, hyp in zip(src.tolist(), greedy_search(model, src, BOS, EOS)):
            print("  in ", [t for t in row if t != PAD], "\n  out", hyp)
    return 0
