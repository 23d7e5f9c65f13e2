"""The copy task: a tiny Transformer learns to copy (or reverse) random symbol strings.

A quick, self-contained proof that the model, the loss and greedy search work together; `aiayn demo`
runs it while no translation data is at hand, and the tests use it as an overfitting check.
The recipe (model size, steps, schedule) is tuned so that both tasks reach 100% greedy exact match
on fresh strings in well under a minute of CPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator

import torch

from aiayn.config import preset
from aiayn.errors import AiaynError
from aiayn.files import say
from aiayn.model import Transformer
from aiayn.search import greedy_search
from aiayn.trainer import torch_seed

PAD, BOS, EOS, FIRST = 0, 1, 2, 3


def make_batch(gen: torch.Generator, batch: int, vocab: int, max_len: int, reverse: bool):
    """Random strings of symbols FIRST..vocab-1, lengths 1..max_len, right-padded.

    Returns src (B, S), tgt_in (B, T) starting with BOS, tgt_out (B, T) ending with EOS, S = max_len,
    T = max_len + 1."""
    lengths = torch.randint(1, max_len + 1, (batch, 1), generator=gen)  # (B, 1)
    seq = torch.randint(FIRST, vocab, (batch, max_len), generator=gen)  # (B, S)
    pos = torch.arange(max_len + 1).expand(batch, -1)  # (B, T)
    real = pos[:, :max_len] < lengths  # (B, S)
    src = seq.masked_fill(~real, PAD)
    # reversed: position j of the output reads position n-1-j of the input
    out = seq.gather(1, (lengths - 1 - pos[:, :max_len]).clamp(min=0)) if reverse else seq
    out = torch.cat([out.masked_fill(~real, PAD), torch.full((batch, 1), PAD)], 1)  # (B, T)
    tgt_out = torch.where(pos == lengths, EOS, out)
    tgt_in = torch.cat([torch.full((batch, 1), BOS), out[:, :max_len]], 1)
    return src, tgt_in, tgt_out


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """A tiny model runs fastest on one thread (intra-op threads only add synchronisation)."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def exact_match(model: Transformer, gen: torch.Generator, n: int, vocab: int, max_len: int, reverse: bool) -> float:
    """Greedy exact-match accuracy on `n` fresh strings."""
    src, _, tgt_out = make_batch(gen, n, vocab, max_len, reverse)
    hyps = greedy_search(model, src, BOS, EOS, max_len_a=1.0, max_len_b=2)
    refs = [[t for t in row.tolist() if t not in (PAD, EOS)] for row in tgt_out]
    return sum(h == r for h, r in zip(hyps, refs)) / len(refs)


def train_copy(reverse: bool = False, steps: int = 600, seed: int = 0, vocab: int = 13, max_len: int = 10,
               batch: int = 64, lr: float = 3e-3, warmup: int = 50, d_model: int = 64, layers: int = 2,
               log: Callable[[str], None] | None = None) -> tuple[Transformer, float]:
    """Trains a tiny model and returns it with its greedy exact-match accuracy on 200 new strings.

    Adam with linear warm-up then cosine decay to zero: ending at a small learning rate is what
    turns ~97% into 100% exact match."""
    with _threads(1):
        torch.manual_seed(torch_seed(seed))  # torch's CPU generators keep 32 bits: the high ones folded in
        gen = torch.Generator().manual_seed(torch_seed(seed))
        cfg = preset("tiny", src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=d_model, d_ff=2 * d_model,
                     n_heads=4, encoder_layers=layers, decoder_layers=layers, dropout=0.0)
        model = Transformer(cfg).train()
        opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-9)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0))))
        )
        for step in range(steps):
            src, tgt_in, tgt_out = make_batch(gen, batch, vocab, max_len, reverse)
            loss = model.loss(src, tgt_in, tgt_out)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if log and (step + 1) % 100 == 0:
                log(f"step {step + 1:4d}  loss {loss.item():.4f}")
        model.eval()
        return model, exact_match(model, gen, 200, vocab, max_len, reverse)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=600, help="training steps per task")
    p.add_argument("--seed", type=int, default=0, help="random seed (64 bits): the same seed trains the same models")


def show(text: str) -> None:
    """A line of the demo on standard output at once (`aiayn demo | head -1` waited for both models)."""
    say(text, "; the demo prints its results there")


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise AiaynError(f"--steps must be at least 1, got {args.steps}")
    if not -(2**63) <= args.seed < 2**64:
        raise AiaynError(f"--seed must fit in 64 bits, got {args.seed}")
    if sys.stdout is None:  # (it trained both models to print nothing, exit 0)
        raise AiaynError("standard output is closed; the demo prints its results there: redirect it to a file instead")
    for reverse in (False, True):
        name = "reversed copy" if reverse else "copy"
        show(f"== {name} task: tiny Transformer, {args.steps} step{'s' if args.steps > 1 else ''}")
        t0 = time.perf_counter()
        model, acc = train_copy(reverse, args.steps, args.seed, log=show)
        show(f"{name}: greedy exact-match accuracy {acc:.1%} on 200 new strings after "
             f"{time.perf_counter() - t0:.0f}s ({model.num_parameters():,} parameters)")
        gen = torch.Generator().manual_seed(torch_seed(args.seed + 1))
        src, _, _ = make_batch(gen, 3, 13, 10, reverse)
        with _threads(1):
            hyps = greedy_search(model, src, BOS, EOS)
        for row, hyp in zip(src.tolist(), hyps):
            show(f"  in  {[t for t in row if t != PAD]}\n  out {hyp}")
    return 0
