"""The training mechanism: one optimizer update (`Trainer`), where it runs (`Dist`), in what
precision, how batches reach the device (`Prefetch`: built, with where their real tokens sit,
and pinned on a background thread), validation, and the RNG states of exact resume. `aiayn.train`
drives it with the loop; the flags live in `aiayn.train_options`, the run directory and resume
policy in `aiayn.rundir`.

The loss of an update is the sum of label-smoothed token losses over all its batches (every
accumulated batch and every rank) divided by the number of target tokens (Section 5.4), so gradient
accumulation and data parallelism give the same update as one big batch.

Precision: bf16 or fp16 autocast; fp16 scales the loss (GradScaler), and an update whose gradients
overflowed is skipped and not counted (`Trainer.step` counts applied updates only).

Distributed: under `torchrun`, DDP sums the gradients of the ranks; `Dist` holds the few
collectives the run needs besides (stop decisions, one-line errors on every rank, rank 0's answers).
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import threading
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple, Protocol, TypeVar, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from aiayn import kernels, memory
from aiayn.config import TrainConfig, learning_rate
from aiayn.errors import AiaynError
from aiayn.model import Transformer

if TYPE_CHECKING:  # for the checker only: the trainer imports the data path where it uses it
    from aiayn.data.corpus import Corpus
    from aiayn.data.text import Batch

Autocast = Callable[[], contextlib.AbstractContextManager[Any]]  # a fresh autocast (or no-op) context
T = TypeVar("T")

# ---------------------------------------------------------------------------------------- the loss


class LossInputs(Protocol):
    """What the loss reads of a batch: `aiayn.data.text.Batch`, or `_Pairs` inside DDP's forward."""

    @property
    def src(self) -> Tensor: ...  # (B, S)
    @property
    def tgt_in(self) -> Tensor: ...  # (B, T)
    @property
    def tgt_out(self) -> Tensor: ...  # (B, T)
    @property
    def packing(self) -> kernels.LossPacking | None: ...  # where the real tokens are, found on the host


def loss_sum(model: Transformer, batch: LossInputs, label_smoothing: float) -> Tensor:
    """Sum of label-smoothed cross entropies over the non-pad target tokens of one batch (Section 5.4).

    The one place the training loss is computed; the caller divides by the token count. The model
    computes it itself (`Transformer.loss`: projection and softmax only at real target tokens).
    """
    return model.loss(batch.src, batch.tgt_in, batch.tgt_out, label_smoothing=label_smoothing, reduction="sum",
                      packing=batch.packing)


class _LossModule(torch.nn.Module):
    """The loss as `forward`: DDP synchronises gradients only for what runs through `forward`."""

    def __init__(self, model: Transformer, label_smoothing: float) -> None:
        super().__init__()
        self.model, self.label_smoothing = model, label_smoothing

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor, packing: kernels.LossPacking | None = None
                ) -> Tensor:
        return loss_sum(self.model, _Pairs(src, tgt_in, tgt_out, packing), self.label_smoothing)


class _Pairs(NamedTuple):
    src: Tensor  # (B, S)
    tgt_in: Tensor  # (B, T)
    tgt_out: Tensor  # (B, T)
    packing: kernels.LossPacking | None


# ----------------------------------------------------------------------------------- where it runs


@dataclass
class Dist:
    """Where this process runs (its rank of `world`, its device) and the collectives the run needs
    besides DDP's; with one process each is a plain call."""

    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    local: int = 0  # rank on this machine (torchrun's LOCAL_RANK): 0 is the machine's first process

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def any(self, *flags: bool) -> list[bool]:
        """Each flag True on every rank if it is True on any rank (stop decisions must agree): one
        all-reduce and one host read for all of them."""
        if self.world == 1:
            return list(flags)
        t = torch.tensor([1.0 if f else 0.0 for f in flags], device=self.device)  # (F,)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [x > 0 for x in t.tolist()]

    def sum_(self, t: Tensor) -> Tensor:
        """`t` summed over the ranks, in place (one all-reduce, no host read)."""
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def agree(self, fn: Callable[[], T]) -> T:
        """fn() on every rank; if it raises AiaynError on any rank, every rank raises that one line
        (a check that fails on one machine only must not leave the others waiting in a collective).
        `fn` itself must hold no collective."""
        result: T | None = None
        error = None
        try:
            result = fn()
        except AiaynError as e:
            error = str(e)
        if self.world > 1:
            errors: list[str | None] = [None] * self.world
            dist.all_gather_object(errors, error)
            rank, error = next(((r, e) for r, e in enumerate(errors) if e), (self.rank, None))
            if error and rank != self.rank:
                error = f"rank {rank}: {error}"
        if error:
            raise AiaynError(error)
        return cast(T, result)

    def from_main(self, fn: Callable[[], T]) -> T:
        """fn() run by rank 0 alone, its result (pickled) or its AiaynError on every rank."""
        payload: list[Any] = [None]
        if self.main:
            try:
                payload = [(fn(), None)]
            except AiaynError as e:
                payload = [(None, str(e))]
        if self.world > 1:
            dist.broadcast_object_list(payload, src=0, device=self.device)
        result, error = payload[0]
        if error:
            raise AiaynError(error if self.main else f"rank 0: {error}")
        return cast(T, result)


def setup_distributed(device_pref: str) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    want_cuda = device_pref.startswith("cuda") or (device_pref == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise AiaynError("--device cuda: no CUDA device is available; use --device cpu")
    if world == 1:
        dev = torch.device(device_pref if device_pref.startswith("cuda") else ("cuda" if want_cuda else "cpu"))
        _check_gpu_index(dev.index, f"--device {device_pref}", "give --device cuda:N with N below that")
        return Dist(0, 1, dev)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if want_cuda:
        _check_gpu_index(local, f"LOCAL_RANK {local}", "run at most that many processes a machine "
                         "(torchrun --nproc-per-node)")
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if want_cuda else "gloo")
    return Dist(rank, world, dev, local)


def _check_gpu_index(index: int | None, what: str, remedy: str) -> None:
    """A GPU this machine lacks (cuda:N past its count: a run resumed on a smaller machine, more
    torchrun processes than GPUs) is one line here, not torch's traceback at the first tensor."""
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise AiaynError(f"{what}: this machine has {count} CUDA device(s), numbered from 0; {remedy}")


# --------------------------------------------------------------------------------------- precision


# fp16's first loss scale. The loss here is a sum over an update's target tokens (thousands), not a
# mean, so its gradients start ~10^3-10^4 times larger than a mean's: PyTorch's 2^16 overflows the
# first updates. 2^7 leaves them that much headroom (fairseq, which also sums, starts at 2^7 too).
FP16_INIT_SCALE = 2.0**7


def precision_context(precision: str, device: torch.device) -> tuple[Autocast, bool, str]:
    """(autocast context factory, use a GradScaler, resolved name). `auto` takes bf16 on the CPU only
    where oneDNN has bf16 kernels for it (`cpu_has_fast_bf16`; elsewhere bf16 is slower than fp32)."""
    if precision == "auto":
        if device.type == "cuda":
            precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            precision = "bf16" if kernels.cpu_has_fast_bf16() else "fp32"
    if precision == "fp32":
        return contextlib.nullcontext, False, "fp32"
    if precision == "fp16" and device.type != "cuda":
        raise AiaynError("--precision fp16 needs a CUDA device; use bf16 or fp32 on the CPU")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return (lambda: torch.autocast(device.type, dtype=dtype)), precision == "fp16", precision


# --------------------------------------------------------------------------------------- RNG state


def torch_seed(seed: int) -> int:
    """What torch.manual_seed gets for a 64-bit --seed. Torch's CPU generator (mt19937) keeps only
    the low 32 bits of its seed, so --seed 1 and --seed 4294967297 drew the same weights and dropout
    masks. From 2**32 up, the high half is folded into the low one, times an odd constant, so seeds
    that differ only above bit 32 differ there too (and CUDA's generator still gets all 64 bits).
    Below 2**32, negative seeds included (torch wraps them), the seed is passed as it is: such runs
    draw what they drew before."""
    if seed < 2**32:
        return seed
    s = seed % 2**64
    return s ^ ((s >> 32) * 0x9E3779B1) % 2**32


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --------------------------------------------------------------------------- batches to the device


class Prefetch:
    """The items of `items` built up to `ahead` in advance on a background thread: collating from the
    memory maps is host work the device need not wait for. With `pin`, each batch is put in
    page-locked memory, so that `Batch.to(cuda, non_blocking=True)` overlaps the copy with compute."""

    _END = object()

    def __init__(self, items: Iterator[list[Any]], pin: bool, ahead: int = 2) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=ahead)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(items, pin), daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _fill(self, items: Iterator[list[Any]], pin: bool) -> None:
        try:
            for item in items:
                if not self._put([b.pin_memory() for b in item] if pin else item):
                    return
            self._put(self._END)
        except BaseException as e:  # handed to the consumer, raised there
            self._put(e)

    def __iter__(self) -> "Prefetch":
        return self

    def __next__(self) -> list[Any]:
        item = self._queue.get()
        if item is self._END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return cast(list[Any], item)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


# -------------------------------------------------------------------------------------- the update


def compile_layers(model: Transformer) -> None:
    """torch.compile each encoder and decoder layer in place (regional compilation; the weights and
    their names stay as they are): the element-wise work between the GEMMs fuses, one compiled graph
    serves every layer of a stack, and any number of tokens (dynamic shapes), so it compiles once,
    in a fraction of the whole model's time. The embeddings, the loss and the optimizer stay eager."""
    for layer in [*model.encoder.layers, *model.decoder.layers]:
        layer.compile(dynamic=True)


class Trainer:
    """Holds the model, optimizer and position; `train_step` is one optimizer update. `step` counts
    the updates applied: an fp16 update whose gradients overflowed is skipped by the scaler, and it
    advances neither `step` nor the learning-rate schedule (it counts in `skipped`)."""

    def __init__(self, model: Transformer, tc: TrainConfig, d: Dist, precision: str = "fp32") -> None:
        self.tc, self.d = tc, d
        self.heap = memory.HeapTrimmer()  # batches of ever-new shapes leave the heap in pieces
        self.base = model.to(d.device)
        if tc.compile:
            compile_layers(self.base)
        self.model: torch.nn.Module = _LossModule(self.base, tc.label_smoothing)
        if d.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            # broadcast_buffers=False: the positional table is a buffer that grows per rank on demand.
            # torch 2.13 deprecates it for forward_sync_buffers=False, which still syncs buffers at
            # init (its own warning says to keep broadcast_buffers for rank-local buffers), and
            # printed that on every rank of every run
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "`broadcast_buffers` is deprecated", FutureWarning)
                self.model = DDP(self.model, broadcast_buffers=False,
                                 device_ids=[d.device.index] if d.device.type == "cuda" else None)
        # fused: one kernel updates every parameter (faster than the per-tensor loop, and still
        # elementwise, so bitwise deterministic on the CPU); available on CPU and CUDA.
        self.opt = torch.optim.Adam(self.base.parameters(), lr=0.0, betas=(tc.adam_beta1, tc.adam_beta2), eps=tc.adam_eps,
                                    fused=d.device.type in ("cpu", "cuda"))
        self.autocast, use_scaler, self.precision = precision_context(precision, d.device)
        self.scaler = torch.amp.GradScaler(d.device.type, init_scale=FP16_INIT_SCALE) if use_scaler else None
        self.step = 0
        self.skipped = 0  # fp16 updates skipped for overflowed gradients
        self.applied = True  # whether the last train_step updated the weights

    def lr(self, step: int) -> float:
        tc = self.tc
        return learning_rate(step, self.base.cfg.d_model, tc.warmup, tc.lr_factor, tc.cooldown, tc.max_steps)

    def train_step(self, batches: list[Batch]) -> tuple[float, int]:
        """One update from `batches` (this rank's share); returns (loss per target token, tokens) of the
        whole update over all ranks. The host waits for the device once per update, not per batch:
        the loss is summed on the device (in float64, as Python's float summed it before) and read,
        with the token count, after one all-reduce."""
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.d.device)
        tokens = 0
        for i, batch in enumerate(batches):
            batch = batch.to(self.d.device, non_blocking=True)  # from pinned memory on CUDA (`Prefetch`)
            sync = i == len(batches) - 1 or self.d.world == 1
            no_sync = getattr(self.model, "no_sync", None)  # DistributedDataParallel's
            ctx = no_sync() if not sync and no_sync is not None else contextlib.nullcontext()
            with ctx:
                with self.autocast():
                    loss = self.model(batch.src, batch.tgt_in, batch.tgt_out, batch.packing)
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss_sum += loss.detach().double()
            tokens += int(batch.n_tgt_tokens)  # counted on the host by collate: no device read
        # a fill, not a copy from the host (which would wait for the device)
        count = torch.full((), float(tokens), dtype=torch.float64, device=self.d.device)
        total_loss, all_tokens_f = self.d.sum_(torch.stack([loss_sum, count])).tolist()  # the one host read
        all_tokens = int(all_tokens_f)
        for g in self.opt.param_groups:
            g["lr"] = self.lr(self.step + 1)
        if self.scaler:
            self.scaler.unscale_(self.opt)
        # DDP averaged the gradient sums over ranks; turn them into the mean over all target tokens.
        scale = self.d.world / max(all_tokens, 1)
        torch._foreach_mul_([p.grad for p in self.base.parameters() if p.grad is not None], scale)  # one launch
        if self.tc.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.base.parameters(), self.tc.clip_norm)
        if self.scaler:
            scale = self.scaler.get_scale()
            self.scaler.step(self.opt)  # skipped if the gradients hold an inf or NaN
            self.scaler.update()  # which then lowers the scale: that is how a skip shows
            self.applied = self.scaler.get_scale() >= scale
        else:
            self.opt.step()
            self.applied = True
        if self.applied:
            self.step += 1
        else:
            self.skipped += 1
        self.heap.step()
        return total_loss / max(all_tokens, 1), all_tokens

    def state(self) -> dict[str, Any]:
        return {"optimizer": self.opt.state_dict(), "scaler": self.scaler.state_dict() if self.scaler else None,
                "step": self.step, "skipped": self.skipped}

    def load_state(self, state: dict[str, Any]) -> None:
        self.opt.load_state_dict(state["optimizer"])
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        self.skipped = int(state.get("skipped", 0))


def check_optimizer_state(opt_state: Any, model: torch.nn.Module) -> None:
    """Raises AiaynError (the reason) unless `opt_state` (Adam's state dict) holds moments shaped as
    `model`'s parameters, one for one: torch loads them whatever their shapes, and the fused step
    then runs past them (garbage weights, or a process killed)."""
    params = list(model.parameters())
    try:
        ids = [i for g in opt_state["param_groups"] for i in g["params"]]
        moments = [dict(opt_state["state"].get(i) or {}) for i in ids]
    except (TypeError, KeyError, AttributeError, ValueError):
        raise AiaynError("its optimizer state is not Adam's state dictionary") from None
    if len(ids) != len(params):
        raise AiaynError(f"its optimizer holds {len(ids)} parameters, the model {len(params)}")
    for n, (p, state) in enumerate(zip(params, moments)):
        for name, t in state.items():
            if isinstance(t, Tensor) and t.dim() and t.shape != p.shape:  # `step` is a scalar
                raise AiaynError(f"its optimizer's {name} of parameter {n} has shape {tuple(t.shape)}, "
                                 f"the model's {tuple(p.shape)}")


# -------------------------------------------------------------------------------------- validation


@torch.no_grad()
def validate(model: Transformer, corpus: Corpus, tc: TrainConfig, autocast: Autocast, device: torch.device) -> dict[str, float]:
    """Validation loss (label-smoothed and plain, per token) and greedy BLEU/chrF on the first
    `valid_bleu` validation sentences. Layers that `--compile` compiled run eagerly here: evaluation
    and search would compile them again for each of their modes and shapes (tens of seconds, and
    torch's limit on recompilations, past which training's own shapes would run eagerly)."""
    with torch.compiler.set_stance("force_eager"):
        return _validate(model, corpus, tc, autocast, device)


def _validate(model: Transformer, corpus: Corpus, tc: TrainConfig, autocast: Autocast, device: torch.device
              ) -> dict[str, float]:
    from aiayn.data.corpus import valid_batches
    from aiayn.evaluate import corpus_scores
    from aiayn.search import greedy_search
    from aiayn.tokenizer import BOS_ID, EOS_ID

    model.eval()
    out: dict[str, float] = {}
    if corpus.valid:
        loss = nll = 0.0
        tokens = 0
        for idx in valid_batches(corpus):
            # the full forward below needs no packing: none is made
            b = corpus.valid.collate(idx, tc.max_len, model.cfg.source_eos, packing=False).to(device)
            with autocast():
                logits = model(b.src, b.tgt_in).float().flatten(0, 1)
            tgt = b.tgt_out.flatten()
            loss += float(F.cross_entropy(logits, tgt, ignore_index=model.cfg.pad_id,
                                          label_smoothing=tc.label_smoothing, reduction="sum"))
            nll += float(F.cross_entropy(logits, tgt, ignore_index=model.cfg.pad_id, reduction="sum"))
            tokens += b.n_tgt_tokens
        out["loss"], out["nll"] = loss / max(tokens, 1), nll / max(tokens, 1)
    n = min(tc.valid_bleu, len(corpus.valid_src))
    if n:
        eos = [EOS_ID] if model.cfg.source_eos else []
        src_ids = [ids[: tc.max_len] + eos for ids in corpus.tokenizers.src.encode_batch(corpus.valid_src[:n])]
        order = sorted(range(n), key=lambda i: len(src_ids[i]))
        hyps = [""] * n
        step = 64
        for start in range(0, n, step):
            rows = order[start : start + step]
            width = max(1, max(len(src_ids[i]) for i in rows))
            src = torch.full((len(rows), width), model.cfg.pad_id, dtype=torch.long)
            for j, i in enumerate(rows):
                src[j, : len(src_ids[i])] = torch.tensor(src_ids[i], dtype=torch.long)
            with autocast():
                out_ids = greedy_search(model, src.to(device), BOS_ID, EOS_ID)
            for i, ids in zip(rows, out_ids):
                hyps[i] = corpus.tokenizers.tgt.decode(ids)
        scores = corpus_scores(hyps, corpus.valid_tgt[:n])
        out.update(bleu=scores["bleu"], bleu_lc=scores["bleu_lc"], chrf=scores["chrf"])
    return out
