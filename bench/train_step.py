"""Training-step speed: aiayn against a `torch.nn.Transformer` model on the same weights and batches.

One run measures, for the `small` and `base` shapes in fp32 and in bf16 autocast, the target tokens
per second of forward + backward + optimizer step on identical batches of variable-length, padded
sentences, for:
  * aiayn (`Transformer.loss`: projection and loss at real target positions only), and
  * the peer: bench/peer.py's (`tests/reference.py`'s nn.Transformer model with the same embedding,
    positional encoding and output projection, dropout where aiayn has it; full logits,
    `F.cross_entropy(ignore_index=pad)`; bench/gpu_train.py's peer too), eager and `torch.compile`d
    (loss included); the faster of the two is the peer of the ratio.
It also measures the machine's peak matmul FLOP/s (fp32 and bf16) in the same run and reports each
model's share of it, counting the useful FLOPs of the step (real tokens only, 3x the forward pass).
On a CPU for which oneDNN has no bf16 kernels (AVX2 only) it times fp32 alone unless --precisions says otherwise.

    python bench/train_step.py            # the full table (several minutes on 2 cores)
    python bench/train_step.py --quick    # tiny shapes, a few steps: a smoke run in seconds

Timings alternate between the contenders round by round and keep each one's best round, so that
load from other processes on a shared machine disturbs the ratio as little as possible.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peer.py

from aiayn.config import PRESETS, ModelConfig, preset  # noqa: E402
from aiayn.kernels import SLOW_BF16, cpu_has_fast_bf16  # noqa: E402
from aiayn.model import Transformer  # noqa: E402
from aiayn.tokenizer import BOS_ID as BOS, EOS_ID as EOS, PAD_ID as PAD  # noqa: E402
from peer import PeerLoss, peak_matmul_flops  # noqa: E402


@dataclass
class Batch:
    src: torch.Tensor  # (B, S)
    tgt_in: torch.Tensor  # (B, T)
    tgt_out: torch.Tensor  # (B, T)
    src_lens: list[int]
    tgt_lens: list[int]  # real tokens of tgt_out (EOS included)


def make_batches(n: int, batch: int, vocab: int, mean_len: float, max_len: int, seed: int) -> list[Batch]:
    """Sentence-like batches: lengths spread around `mean_len` (roughly Multi30k's), padded to the
    longest in the batch, target lengths correlated with source lengths."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        src_len = (torch.randn(batch, generator=gen) * mean_len / 3 + mean_len).round().clamp(3, max_len).long()
        tgt_len = (src_len.float() * (1 + 0.15 * torch.randn(batch, generator=gen))).round().clamp(3, max_len).long()
        S, T = int(src_len.max()), int(tgt_len.max()) + 1
        src = torch.full((batch, S), PAD)
        tgt_in = torch.full((batch, T), PAD)
        tgt_out = torch.full((batch, T), PAD)
        for i, (s, t) in enumerate(zip(src_len.tolist(), tgt_len.tolist())):
            src[i, :s] = torch.randint(4, vocab, (s,), generator=gen)
            words = torch.randint(4, vocab, (t,), generator=gen)
            tgt_in[i, 0], tgt_in[i, 1 : t + 1] = BOS, words
            tgt_out[i, :t], tgt_out[i, t] = words, EOS
        out.append(Batch(src, tgt_in, tgt_out, src_len.tolist(), [t + 1 for t in tgt_len.tolist()]))
    return out


def step_flops(cfg: ModelConfig, b: Batch) -> float:
    """Useful FLOPs of one training step (3x forward: backward costs two forwards), real tokens only."""
    d, f, V = cfg.d_model, cfg.d_ff, cfg.tgt_vocab_size
    fwd = 0.0
    for s, t in zip(b.src_lens, b.tgt_lens):
        enc = cfg.encoder_layers * (2 * s * (4 * d * d + 2 * d * f) + 4 * s * s * d)
        dec = cfg.decoder_layers * (2 * t * (6 * d * d + 2 * d * f) + 2 * s * 2 * d * d + 2 * t * t * d + 4 * t * s * d)
        fwd += enc + dec + 2 * t * d * V
    return 3 * fwd


class Contender:
    """One model + optimizer + loss function, stepping over the shared batches."""

    def __init__(self, name: str, cfg: ModelConfig, kind: str, bf16: bool, seed: int) -> None:
        torch.manual_seed(seed)  # every contender starts from the same weights
        self.name, self.bf16 = name, bf16
        model = Transformer(cfg).train()
        if kind == "aiayn":
            self.module: torch.nn.Module = model
            self.loss_fn = lambda b: model.loss(b.src, b.tgt_in, b.tgt_out, label_smoothing=0.1)
        else:
            peer = PeerLoss(model, 0.1, reduction="mean").train()
            self.module = peer
            fn = torch.compile(peer, dynamic=True) if kind == "compiled" else peer
            self.loss_fn = lambda b: fn(b.src, b.tgt_in, b.tgt_out)
        params = [p for p in self.module.parameters() if p.requires_grad]
        # the fused (one-kernel) Adam for both: the optimizer is common work, not what is compared
        self.opt = torch.optim.Adam(params, lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
        self.best = float("inf")

    def step(self, b: Batch) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.loss_fn(b)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def run(self, batches: list[Batch]) -> float:
        t0 = time.perf_counter()
        for b in batches:
            self.step(b)
        return time.perf_counter() - t0


def profile_table(c: Contender, batches: list[Batch], top: int, title: str) -> str:
    """The `top` ops by self CPU time per step of one pass over `batches`, as a Markdown table.

    The profiler's own overhead is included, so the total is a little above an unprofiled step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        c.run(batches)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops)
    lines = [f"profile of aiayn, {title}: self time per step, {len(batches)} steps",
             "| op | ms | share |", "|---|---:|---:|"]
    for e in ops[:top]:
        lines.append(f"| `{e.key}` | {e.self_cpu_time_total / 1e3 / len(batches):.1f} | "
                     f"{e.self_cpu_time_total / total:.1%} |")
    lines.append(f"| total | {total / 1e3 / len(batches):.1f} | |")
    return "\n".join(lines)


def positive(kind: type = int):  # type: ignore[no-untyped-def]
    """An argparse type: a number above zero, so that a bad value is a one-line usage error, not a
    division by zero or an empty batch's traceback later."""
    def parse(text: str):  # type: ignore[no-untyped-def]
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a number above 0, got {text!r}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes and few steps: a smoke run in seconds")
    p.add_argument("--sizes", default="small,base", help="comma-separated presets")
    p.add_argument("--precisions", default=None,
                   help="comma-separated: fp32, bf16 (default both; fp32 alone on a CPU without oneDNN bf16 kernels)")
    p.add_argument("--vocab", type=positive(), default=8000, help="joint vocabulary size")
    p.add_argument("--batch", type=positive(), default=64, help="sentences per batch")
    p.add_argument("--mean-len", type=positive(float), default=14.0, help="mean sentence length in tokens")
    p.add_argument("--steps", type=positive(), default=8, help="timed steps per round (one pass over the batches)")
    p.add_argument("--rounds", type=positive(), default=3, help="alternating rounds; each contender keeps its best")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd nn.Transformer")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after each row, print aiayn's N costliest ops per step (torch.profiler, self time)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = args.sizes.split(",")
    if not set(sizes) <= set(PRESETS):
        p.error(f"--sizes takes a comma-separated list of {', '.join(PRESETS)}, got {args.sizes!r}")
    if args.vocab <= EOS:
        p.error(f"--vocab must be above {EOS}: ids 0-{EOS} are the special tokens")
    overrides: dict = dict(src_vocab_size=args.vocab, tgt_vocab_size=args.vocab)
    if args.quick:
        sizes, args.steps, args.rounds = ["tiny"], 2, 1
        overrides = dict(src_vocab_size=500, tgt_vocab_size=500)
        args.batch, args.mean_len = 8, 6.0

    if args.precisions is None:
        fast = cpu_has_fast_bf16()
        args.precisions = "fp32,bf16" if fast else "fp32"
        if not fast:
            print(f"note: {SLOW_BF16}; timing fp32 only (--precisions fp32,bf16 times both)")
    precisions = args.precisions.split(",")
    if not set(precisions) <= {"fp32", "bf16"}:
        p.error(f"--precisions takes fp32 and/or bf16, got {args.precisions!r}")
    n_mm = 256 if args.quick else 1024
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    cpu = torch.device("cpu")
    peak = {prec: peak_matmul_flops(cpu, dtypes[prec], n_mm, 3 if args.quick else 10) for prec in precisions}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; peak matmul ({n_mm}^3): "
          + ", ".join(f"{prec} {peak[prec] / 1e9:.1f} GFLOP/s" for prec in precisions))
    print(f"batches: {args.batch} sentences, mean length {args.mean_len:g}, vocab {overrides['tgt_vocab_size']}, "
          f"{args.steps} steps x {args.rounds} rounds; tokens = real target tokens")
    rows = []
    for size in sizes:
        cfg = preset(size, **overrides)
        batches = make_batches(args.steps + 2, args.batch, cfg.tgt_vocab_size, args.mean_len,
                               max(4, 4 * int(args.mean_len)), args.seed)
        warm, timed = batches[:2], batches[2:]
        tokens = sum(sum(b.tgt_lens) for b in timed)
        flops = sum(step_flops(cfg, b) for b in timed)
        for prec in precisions:
            kinds = ["aiayn", "eager"] + ([] if args.no_compile else ["compiled"])
            cs = [Contender(k, cfg, k, prec == "bf16", args.seed) for k in kinds]
            for c in cs:
                t0 = time.perf_counter()
                c.run(warm)  # first steps: allocator warm-up, and compilation for the compiled peer
                if c.name == "compiled":
                    print(f"  ({size} {prec}: compiling nn.Transformer took {time.perf_counter() - t0:.0f}s)")
            for _ in range(args.rounds):
                for c in cs:
                    c.best = min(c.best, c.run(timed))
            tps = {c.name: tokens / c.best for c in cs}
            peer = max((k for k in tps if k != "aiayn"), key=tps.get)  # type: ignore[arg-type]
            # the peak again after each row, keeping the best: a busy moment must not inflate the shares
            peak[prec] = max(peak[prec], peak_matmul_flops(cpu, dtypes[prec], n_mm, 3 if args.quick else 10))
            if args.profile:
                print(profile_table(cs[0], timed, args.profile, f"{size} {prec}"), flush=True)
            rows.append((size, prec, tps, peer, flops / min(c.best for c in cs if c.name == "aiayn"),
                         flops / min(c.best for c in cs if c.name == peer)))
            print(f"{size:5s} {prec}: aiayn {tps['aiayn']:8.0f} tok/s | nn.Transformer eager {tps['eager']:8.0f}"
                  + ("" if "compiled" not in tps else f", compiled {tps['compiled']:8.0f}") + " tok/s", flush=True)

    print("\npeak matmul, best seen in the run: " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in peak.items()))
    print("| shape | precision | aiayn tok/s | nn.Transformer tok/s (peer) | ratio | aiayn % of peak | peer % of peak |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for size, prec, tps, peer, flops_s, peer_flops_s in rows:
        print(f"| {size} | {prec} | {tps['aiayn']:.0f} | {tps[peer]:.0f} ({peer}) | {tps['aiayn'] / tps[peer]:.2f}x "
              f"| {flops_s / peak[prec]:.1%} | {peer_flops_s / peak[prec]:.1%} |")
    for size, prec, tps, peer, _, _ in rows:
        print(f"ratio {size} {prec}: aiayn / nn.Transformer ({peer}) = {tps['aiayn'] / tps[peer]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
