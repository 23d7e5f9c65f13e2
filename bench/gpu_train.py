"""Training throughput on a GPU: aiayn's training step against `torch.nn.Transformer`, base and big.

For the paper's base and big shapes (Table 3) with a shared vocabulary of 37,000 (Section 5.1), in
bf16 autocast, at 8,000 and 25,000 target tokens per optimizer step (the paper's batches held about
25,000 source and 25,000 target tokens), one run times:
  * aiayn: `Trainer.train_step`, the very step `aiayn train` runs (the label-smoothed loss summed
    over real target tokens, fused Adam, autocast), eager as `aiayn train` runs it; with
    `--compile all` also its loss module `torch.compile`d;
  * nn.Transformer: bench/peer.py's (tests/reference.py's model: aiayn's embeddings, positions and
    tied projection around `torch.nn.Transformer`, the peer of bench/train_step.py too) with the same
    loss, optimizer and batches, eager and
    `torch.compile`d (loss included); the faster of the two is the peer of the ratio.
Batches are WMT-like: each step holds sentences of one length bucket (as length-sorted batching
gives), the buckets of the timed steps spread over a lognormal length distribution (median 24
subwords). A step that does not fit in memory is split into micro-batches (gradient accumulation,
as `--update-freq` does); the table says how many.

Tokens are real target tokens (end-of-sentence included, padding not), the loss's normaliser.
% of peak counts the useful FLOPs of a step (real tokens only, backward = 2x forward) against the
best bf16 matmul rate measured in the same run (an 8192^3 product on this card). The projection:
hours for the paper's 100k base and 300k big steps at 25,000 tokens per step.

    python bench/gpu_train.py --out runs/gpu-train             # on a GPU: about 3-4 minutes
    python bench/gpu_train.py --device cpu --quick --out DIR   # tiny shapes: a smoke run in seconds
    python bench/gpu_train.py --profile --sizes base --tokens 25000 --out DIR   # where a step's time goes

Batches are placed on the device before timing (the input pipeline is not measured); each step
reads its loss back to the host once, as `aiayn train` does. The tables are rewritten after each
row, so a run stopped by `timeout` keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peer.py, profiling.py, train_step.py

from aiayn.config import PRESETS, ModelConfig, TrainConfig, preset  # noqa: E402
from aiayn.data.text import Batch  # noqa: E402
from aiayn.model import Transformer  # noqa: E402
from aiayn.tokenizer import BOS_ID as BOS, EOS_ID as EOS, PAD_ID as PAD  # noqa: E402
from peer import PeerLoss, peak_matmul_flops, sync  # noqa: E402
from profiling import profiler, summary  # noqa: E402
from train_step import positive, step_flops  # noqa: E402

from aiayn.trainer import Dist, Trainer  # noqa: E402

PAPER_STEPS = {"base": 100_000, "big": 300_000}  # Section 5.2
PAPER_TOKENS = 25_000  # per step (Section 5.1)
# The targets at 25k tokens per step: share of the measured bf16 peak, speed-up over the peer.
TARGET_PEAK = {"base": 0.40, "big": 0.50}
TARGET_VS_PEER = 1.3
TARGET_BASE_HOURS = 1.0


# ------------------------------------------------------------------------------------------ batches


@dataclass
class Step:
    """The sentences of one optimizer step; `batches(m, device)` pads them into m micro-batches on the
    device, made once per layout (a few MB)."""

    src_lens: list[int]
    tgt_lens: list[int]  # real tokens of tgt_out (EOS included)
    seed: int
    vocab: int
    _made: dict[tuple[int, str], list[Batch]] = field(default_factory=dict, repr=False)

    @property
    def tokens(self) -> int:
        return sum(self.tgt_lens)

    def batches(self, micro: int, device: torch.device) -> list[Batch]:
        key = (micro, str(device))
        if key not in self._made:
            gen = torch.Generator().manual_seed(self.seed)
            cuts = _cuts(self.tgt_lens, micro)
            self._made[key] = [_pad(self.src_lens[a:b], self.tgt_lens[a:b], self.vocab, gen).to(device)
                               for a, b in zip(cuts, cuts[1:])]
        return self._made[key]


def _cuts(lens: list[int], parts: int) -> list[int]:
    """Boundaries splitting `lens` into `parts` contiguous runs of about equal sums."""
    total, cuts, acc = sum(lens), [0], 0
    for i, n in enumerate(lens):
        acc += n
        if len(cuts) < parts and acc >= total * len(cuts) / parts and i + 1 < len(lens):
            cuts.append(i + 1)
    return cuts + [len(lens)]


def _pad(src_lens: list[int], tgt_lens: list[int], vocab: int, gen: torch.Generator) -> Batch:
    """One right-padded batch of random words: src (B, S), tgt_in = BOS + words, tgt_out = words + EOS;
    with its loss packing found on the host (`Batch.of`, as collate does for `aiayn train`)."""
    B, S, T = len(src_lens), max(src_lens), max(tgt_lens)
    s_len, t_len = torch.tensor(src_lens), torch.tensor(tgt_lens)
    src = torch.randint(4, vocab, (B, S), generator=gen).masked_fill_(torch.arange(S) >= s_len[:, None], PAD)
    words = torch.randint(4, vocab, (B, T), generator=gen)
    pos = torch.arange(T)
    tgt_out = words.masked_fill(pos == (t_len - 1)[:, None], EOS).masked_fill_(pos >= t_len[:, None], PAD)
    tgt_in = torch.cat([torch.full((B, 1), BOS), words[:, :-1]], 1).masked_fill_(pos >= t_len[:, None], PAD)
    return Batch.of(src, tgt_in, tgt_out, list(range(B)), int(t_len.sum()), PAD)


def bucket_lengths(n: int, median: float = 24.0, sigma: float = 0.55, lo: int = 3, hi: int = 200) -> list[int]:
    """n bucket lengths at evenly spaced quantiles of a token-weighted lognormal (WMT-like subword
    sentence lengths): the steps of one run see short, typical and long sentences in proportion."""
    normal = statistics.NormalDist(math.log(median) + sigma**2, sigma)  # weighting by length shifts the mean
    return [min(hi, max(lo, round(math.exp(normal.inv_cdf((i + 0.5) / n))))) for i in range(n)]


def make_step(tokens: int, length: int, vocab: int, seed: int) -> Step:
    """Sentences of source length within 10% of `length`, targets about as long, until `tokens`
    target tokens; sorted by source length, as batching by length leaves them."""
    gen = torch.Generator().manual_seed(seed)
    src_lens: list[int] = []
    tgt_lens: list[int] = []
    total = 0
    while total < tokens:
        s = max(2, round(length * (1 + 0.1 * float(torch.rand((), generator=gen)))))
        t = max(2, round(s * (1 + 0.1 * float(torch.randn((), generator=gen)))))
        src_lens.append(s)
        tgt_lens.append(t)
        total += t
    order = sorted(range(len(src_lens)), key=src_lens.__getitem__)
    return Step([src_lens[i] for i in order], [tgt_lens[i] for i in order], seed, vocab)


# -------------------------------------------------------------------------------------- contenders


class Contender:
    """One model, optimizer and loss stepping over the shared steps; `micro` grows after an out-of-memory."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name, self.device, self.micro = name, device, 1
        self.compiled = name.endswith("+compile")
        self.warm_s = 0.0  # the warm-up steps' seconds, compilation included
        self.opt: torch.optim.Optimizer

    def step(self, batches: list[Batch]) -> float:
        """One optimizer update over the micro-batches; the loss per token (one host read)."""
        raise NotImplementedError

    def run(self, steps: list[Step]) -> float:
        """Seconds for `steps`, the device synchronised at both ends."""
        batches = [s.batches(self.micro, self.device) for s in steps]  # made (once) outside the timing
        sync(self.device)
        t0 = time.perf_counter()
        for b in batches:
            self.step(b)
        sync(self.device)
        return time.perf_counter() - t0

    def release(self) -> None:
        self.opt.zero_grad(set_to_none=True)


class Aiayn(Contender):
    """`Trainer.train_step`, as `aiayn train` runs it."""

    def __init__(self, name: str, cfg: ModelConfig, device: torch.device, precision: str, seed: int) -> None:
        super().__init__(name, device)
        torch.manual_seed(seed)  # every contender starts from the same weights
        # compiled: as `aiayn train --compile` (`compile_layers`); the whole model did not finish
        # compiling in 70 s on the H200's host
        self.trainer = Trainer(Transformer(cfg), TrainConfig(compile=self.compiled), Dist(0, 1, device), precision)
        self.opt = self.trainer.opt

    def step(self, batches: list[Batch]) -> float:
        return self.trainer.train_step(batches)[0]


class Peer(Contender):
    """nn.Transformer (`PeerLoss`) with the step of `Trainer.train_step`: summed loss per micro-batch,
    gradients scaled to the mean over the step's tokens, fused Adam, one host read of the loss."""

    def __init__(self, name: str, cfg: ModelConfig, device: torch.device, precision: str, seed: int) -> None:
        super().__init__(name, device)
        torch.manual_seed(seed)
        tc = TrainConfig()  # the paper's recipe: label smoothing 0.1, Adam (0.9, 0.98, 1e-9)
        self.peer = PeerLoss(Transformer(cfg), tc.label_smoothing).to(device).train()
        self.loss_fn = torch.compile(self.peer, dynamic=True) if self.compiled else self.peer
        self.params = [p for p in self.peer.parameters() if p.requires_grad]
        self.opt = torch.optim.Adam(self.params, lr=1e-4, betas=(tc.adam_beta1, tc.adam_beta2), eps=tc.adam_eps,
                                    fused=device.type in ("cpu", "cuda"))
        self.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]

    def step(self, batches: list[Batch]) -> float:
        self.opt.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for b in batches:
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
                loss = self.loss_fn(b.src, b.tgt_in, b.tgt_out)
            loss.backward()
            total += loss.detach().double()
        tokens = sum(b.n_tgt_tokens for b in batches)
        torch._foreach_mul_([p.grad for p in self.params if p.grad is not None], 1.0 / tokens)
        self.opt.step()
        return float(total) / tokens


def make_contender(name: str, cfg: ModelConfig, device: torch.device, precision: str, seed: int) -> Contender:
    kind = Aiayn if name.startswith("aiayn") else Peer
    return kind(name, cfg, device, precision, seed)


def reset_peak(device: torch.device) -> None:
    """Start the peak-memory count afresh (a GPU's; nothing to count on the CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float:
    """GiB at the peak since `reset_peak` (NaN on the CPU: not measured)."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan


def failure(e: Exception) -> str:
    """A row's note for a contender that raised: the exception's first line."""
    return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


# ------------------------------------------------------------------------------------------- report


@dataclass
class Row:
    size: str
    tokens: int  # per step (target tokens asked for; `tok_s` counts the real ones)
    name: str
    micro: int = 0
    step_ms: float = math.nan
    tok_s: float = math.nan
    tflops: float = math.nan
    peak_gib: float = math.nan
    warm_s: float = 0.0  # warm-up steps, compilation included
    note: str = ""


def peer_of(rows: list[Row], size: str, tokens: int) -> Row | None:
    """The faster nn.Transformer row (eager or compiled) of a size and step."""
    peers = [r for r in rows if r.size == size and r.tokens == tokens and r.name.startswith("nn.") and r.tok_s == r.tok_s]
    return max(peers, key=lambda r: r.tok_s, default=None)


def aiayn_of(rows: list[Row], size: str, tokens: int) -> Row | None:
    """aiayn's faster row (eager, or compiled where it ran) of a size and step."""
    ours = [r for r in rows if r.size == size and r.tokens == tokens and r.name.startswith("aiayn") and r.tok_s == r.tok_s]
    return max(ours, key=lambda r: r.tok_s, default=None)


def table(rows: list[Row], peak: float, precision: str = "bf16") -> str:
    lines = ["| model | tokens/step | contender | micro-batches | step ms | target tok/s | TFLOP/s "
             f"| % of {precision} peak "
             "| vs peer | peak GiB | warm-up s |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        peer = peer_of(rows, r.size, r.tokens)
        vs = f"{r.tok_s / peer.tok_s:.2f}x" if peer and r.tok_s == r.tok_s else ""
        gib = f"{r.peak_gib:.1f}" if r.peak_gib == r.peak_gib else "-"
        if r.tok_s != r.tok_s:
            lines.append(f"| {r.size} | {r.tokens:,} | {r.name} |" + " |" * 7 + f" {r.note} |")  # in the last column
            continue
        lines.append(f"| {r.size} | {r.tokens:,} | {r.name} | {r.micro} | {r.step_ms:.1f} | {r.tok_s:,.0f} | "
                     f"{r.tflops:.3g} | {r.tflops * 1e12 / peak:.1%} | {vs} | {gib} | {r.warm_s:.0f} |")
    return "\n".join(lines)


def verdicts(rows: list[Row], peak: float, precision: str = "bf16") -> list[str]:
    """The issue's targets at 25k tokens per step, each as a ratio where >= 1 meets it; the share is of the
    peak measured in the run's precision (the targets are set for bf16)."""
    out = []
    for size, want in TARGET_PEAK.items():
        ours, peer = aiayn_of(rows, size, PAPER_TOKENS), peer_of(rows, size, PAPER_TOKENS)
        if ours is None:
            continue
        share = ours.tflops * 1e12 / peak
        out.append(f"target {size} 25k: {ours.name} at {share:.1%} of the {precision} peak, needs {want:.0%}: "
                   f"ratio {share / want:.2f} ({'met' if share >= want else 'NOT met'})")
        if peer is not None:
            speedup = ours.tok_s / peer.tok_s
            verdict = "met" if speedup >= TARGET_VS_PEER else "NOT met"
            if ours.name.endswith("+compile") and not peer.name.endswith("+compile"):
                verdict += ", against the eager peer: the compiled one did not run"
            out.append(f"target {size} 25k: {ours.name} / {peer.name} = {speedup:.2f}x, needs {TARGET_VS_PEER}x: "
                       f"ratio {speedup / TARGET_VS_PEER:.2f} ({verdict})")
        hours = PAPER_STEPS[size] * PAPER_TOKENS / ours.tok_s / 3600
        line = f"projection {size}: the paper's {PAPER_STEPS[size] // 1000}k steps at 25k tokens: {hours:.2f} h on this card"
        if size == "base":
            line += (f", needs <= {TARGET_BASE_HOURS:g} h: ratio {TARGET_BASE_HOURS / hours:.2f} "
                     f"({'met' if hours <= TARGET_BASE_HOURS else 'NOT met'})")
        out.append(line)
    return out


def write(out: Path | None, header: list[str], rows: list[Row], peak: float, done: bool,
          precision: str = "bf16") -> None:
    """gpu_train.md and gpu_train.json in `out`, rewritten after each row."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    md = "\n".join([*header, "", table(rows, peak, precision), "", *verdicts(rows, peak, precision)]) + "\n"
    if not done:
        md += "\n(partial: the run did not finish)\n"
    (out / "gpu_train.md").write_text(md)
    data = {"header": header, "peak_bf16_flops": peak, "done": done, "verdicts": verdicts(rows, peak, precision),
            "rows": [{k: (None if isinstance(v, float) and v != v else v) for k, v in vars(r).items()} for r in rows]}
    (out / "gpu_train.json").write_text(json.dumps(data, indent=1) + "\n")


# --------------------------------------------------------------------------------------------- main


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--quick", action="store_true", help="tiny shapes, few steps: a smoke run in seconds")
    p.add_argument("--sizes", default="base,big", help="comma-separated presets")
    p.add_argument("--tokens", default="25000,8000", help="comma-separated target tokens per optimizer step")
    p.add_argument("--vocab", type=positive(), default=37000, help="shared vocabulary size (the paper's en-de BPE)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"], help="autocast precision")
    p.add_argument("--compile", default="all", choices=["none", "peer", "aiayn", "all"],
                   help="torch.compile both models (all, the default: aiayn's layers first), nn.Transformer (peer), "
                        "aiayn's layers (aiayn), or neither")
    p.add_argument("--steps", type=positive(), default=6, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens there)")
    p.add_argument("--rounds", type=positive(), default=2, help="rounds alternating the contenders; each keeps its best")
    p.add_argument("--micro", type=positive(), default=1, help="micro-batches per step to start with (doubled on out-of-memory)")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="start no new contender after this many seconds (0: no limit); the rest is marked skipped")
    p.add_argument("--out", type=Path, default=None, help="folder for gpu_train.md and gpu_train.json")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true",
                   help="profile aiayn's step at the first of --sizes and --tokens instead (gpu_profile.md): "
                        "compiled as `aiayn train --compile` with --compile aiayn, else eager")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.tokens, args.vocab = "tiny", "400,150", 500
        args.steps, args.warmup, args.rounds = 2, 1, 1
    check(p, args)
    return args


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Bad values as one-line usage errors, before the peak is measured and the rows are written."""
    if not set(args.sizes.split(",")) <= set(PRESETS):
        p.error(f"--sizes takes a comma-separated list of {', '.join(PRESETS)}, got {args.sizes!r}")
    if not all(t.isdigit() and int(t) > 0 for t in args.tokens.split(",")):
        p.error(f"--tokens takes comma-separated whole numbers above 0, got {args.tokens!r}")
    if args.vocab <= EOS:
        p.error(f"--vocab must be above {EOS}: ids 0-{EOS} are the special tokens")
    if args.warmup < 0:
        p.error(f"--warmup must be 0 or more, got {args.warmup}")
    try:
        torch.device(args.device)
    except RuntimeError:
        p.error(f"--device: cuda or cpu, got {args.device!r}")


def phases(compile_mode: str) -> list[list[str]]:
    """The contenders in the order they run: the eager pair (aiayn as `aiayn train` runs it, and
    nn.Transformer) for every size first, then the compiled ones, which spend most of the run's time
    compiling, aiayn's first (its layers compile in 30-50 s on an H200's host; the whole
    nn.Transformer had not finished in 90 s): what --budget-s leaves out is the least needed."""
    names = [["aiayn", "nn.Transformer"]]
    if compile_mode in ("aiayn", "all"):
        names.append(["aiayn+compile"])
    if compile_mode in ("peer", "all"):
        names.append(["nn.Transformer+compile"])
    return names


def fitting(c: Contender, steps: list[Step]) -> float:
    """Seconds for `steps`; on running out of memory, the micro-batches double and the steps run again
    (up to 64 micro-batches). The peak memory counts the attempt that fitted, not the failed ones."""
    while True:
        reset_peak(c.device)
        try:
            return c.run(steps)
        except torch.OutOfMemoryError:
            if c.micro >= 64:
                raise
        # here, outside the handler, the exception's frames and the tensors they held are gone
        c.release()
        torch.cuda.empty_cache()
        c.micro *= 2
        print(f"  {c.name}: out of memory; {c.micro} micro-batches per step", flush=True)


def warm(c: Contender, steps: list[Step]) -> None:
    """Untimed steps: compilation, the allocator's first blocks, the micro-batches that fit."""
    c.warm_s = fitting(c, steps)


def make_steps(tokens: int, args: argparse.Namespace) -> tuple[list[Step], list[Step]]:
    """(warm-up, timed) steps of `tokens` target tokens each, the same for every size and contender.
    The warm-up takes the timed steps longest first (attention's memory grows with the length at
    equal tokens), then the shortest and the others: what fits there fits in the timed rounds, and
    a compiled model has seen several shapes."""
    timed = [make_step(tokens, n, args.vocab, args.seed + i) for i, n in enumerate(bucket_lengths(args.steps))]
    order = [len(timed) - 1, 0, *range(1, len(timed) - 1)]
    return [timed[i] for i in order[: args.warmup]], timed


def measure(names: list[str], size: str, args: argparse.Namespace, device: torch.device,
            all_steps: dict[int, Any], rows: dict[tuple[str, int, str], Row], report: Any, over_budget: Any) -> None:
    """Fill the rows of `names` at one size, for every step size; a contender is built (and compiled)
    once for all step sizes, and none is built once --budget-s is spent."""
    cfg = preset(size, src_vocab_size=args.vocab, tgt_vocab_size=args.vocab)
    contenders: dict[str, Contender] = {}
    for tokens, (warmup, timed) in all_steps.items():
        live: list[tuple[Contender, Row]] = []
        for name in names:
            row = rows[size, tokens, name]
            if name not in contenders and over_budget():
                row.note = "skipped: --budget-s spent"
                continue
            try:
                if name not in contenders:
                    contenders[name] = make_contender(name, cfg, device, args.precision, args.seed)
                contenders[name].micro = args.micro  # the split that fitted a bigger step may not be needed here
                warm(contenders[name], warmup)
                live.append((contenders[name], row))
            except Exception as e:  # one contender failing must not cost the others' rows
                row.note = failure(e)
                print(f"  {size} {tokens}: {name} {row.note}", flush=True)
            report()
        time_rounds(live, timed, args.rounds, device, cfg)
        report()
    for c in contenders.values():
        c.release()
    contenders.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_rounds(live: list[tuple[Contender, Row]], timed: list[Step], rounds: int, device: torch.device,
                cfg: ModelConfig) -> None:
    """Each contender's best of `rounds` passes over the timed steps (taking turns), into its row with
    the micro-batches and peak memory of that round. A contender that raises (out of memory at 64
    micro-batches, a compiled model failing on a new shape) gets the error as its row's note."""
    best: dict[int, tuple[float, int, float]] = {}  # id(c) -> (seconds, micro-batches, peak GiB)
    for _ in range(rounds):
        for c, row in live:
            if row.note:
                continue  # failed in an earlier round
            try:
                sec = fitting(c, timed)
            except Exception as e:  # one contender failing must not cost the others' rows
                row.note = failure(e)
                print(f"  {row.size} {row.tokens}: {c.name} {row.note}", flush=True)
                c.release()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            if id(c) not in best or sec < best[id(c)][0]:
                best[id(c)] = (sec, c.micro, peak_gib(device))
    flops, real = sum(step_flops(cfg, s) for s in timed), sum(s.tokens for s in timed)
    for c, row in live:
        if row.note or id(c) not in best:
            continue
        sec, row.micro, row.peak_gib = best[id(c)]
        row.warm_s = c.warm_s
        row.step_ms, row.tok_s, row.tflops = 1e3 * sec / len(timed), real / sec, flops / sec / 1e12
        print(f"{row.size} {row.tokens:>6}: {c.name:24s} {row.tok_s:12,.0f} tok/s  {row.tflops:7.3g} TFLOP/s  "
              f"{row.micro} micro", flush=True)


def profile(args: argparse.Namespace, device: torch.device) -> int:
    """`--profile`: aiayn's step at the first size and step size under torch.profiler, once warm
    (bench/profiling.py says what is reported), eager, or compiled with `--compile aiayn` (the
    warm-up compiles; a step's time left outside the compiled layers shows there). Written to
    OUT/gpu_profile.md."""
    size, tokens = args.sizes.split(",")[0], int(args.tokens.split(",")[0])
    cfg = preset(size, src_vocab_size=args.vocab, tgt_vocab_size=args.vocab)
    warmup, timed = make_steps(tokens, args)
    name = "aiayn+compile" if args.compile == "aiayn" else "aiayn"
    c = make_contender(name, cfg, device, args.precision, args.seed)
    warm(c, warmup)
    fitting(c, timed)  # every timed shape seen once (attention backends, the allocator)
    plain = fitting(c, timed)
    with profiler(device) as prof:
        wall = fitting(c, timed)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    text = (f"# Profile: aiayn's training step\n\n{card}, torch {torch.__version__}; {c.micro} micro-batches a step\n\n"
            + summary(prof, wall, f"{name} {size}, {tokens:,} tokens/step, {args.precision}, "
                      f"{'compiled' if c.compiled else 'eager'}, {len(timed)} steps (warm-up {c.warm_s:.0f} s)",
                      per=len(timed), plain_s=plain))
    print(text, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_profile.md").write_text(text, encoding="utf-8")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench/gpu_train.py: --device cuda, but torch sees no CUDA device; use --device cpu --quick", file=sys.stderr)
        return 2
    if args.profile:
        return profile(args, device)
    started = time.perf_counter()
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    n_mm = 256 if device.type == "cpu" else 8192
    peak = peak_matmul_flops(device, dtype, n_mm, reps=10, inner=5, typical=True)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    header = [f"# Training throughput: aiayn vs nn.Transformer, {args.precision} ({card})", "",
              f"torch {torch.__version__}, CUDA {torch.version.cuda}; {card}; {args.precision} matmul peak "
              f"({n_mm}^3, measured in this run): {peak / 1e12:.3g} TFLOP/s",
              f"vocab {args.vocab:,} shared; {args.warmup} warm-up + {args.steps} timed steps x {args.rounds} rounds; "
              "tokens = real target tokens (EOS included); step = one optimizer update"]
    print("\n".join(header), flush=True)
    sizes, steps = args.sizes.split(","), [int(t) for t in args.tokens.split(",")]
    order = [n for phase in phases(args.compile) for n in phase]
    table_rows = {(size, t, n): Row(size, t, n) for size in sizes for t in steps for n in order}
    rows = list(table_rows.values())  # in the table's order: size, step, contender

    def report() -> None:
        write(args.out, header, rows, peak, done=False, precision=args.precision)

    def over_budget() -> bool:
        return bool(args.budget_s) and time.perf_counter() - started > args.budget_s

    all_steps = {t: make_steps(t, args) for t in steps}
    for phase in phases(args.compile):
        for size in sizes:
            measure(phase, size, args, device, all_steps, table_rows, report, over_budget)
    again = peak_matmul_flops(device, dtype, n_mm, reps=10, inner=5, typical=True)  # the card may run faster warm: keep the best
    peak = max(peak, again)
    header[2] += f" (again at the end: {again / 1e12:.3g})"
    write(args.out, header, rows, peak, done=True, precision=args.precision)
    print("\n" + table(rows, peak, args.precision) + "\n\n" + "\n".join(verdicts(rows, peak, args.precision)))
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    return 0 if all(r.tok_s == r.tok_s for r in rows if not r.note.startswith("skipped")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
