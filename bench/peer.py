"""The peer of the training benches (bench/train_step.py, bench/gpu_train.py), in one place so that
they cannot drift apart: `torch.nn.Transformer` on aiayn's weights, trained the usual way, and the
machine's matmul peak that both report shares of.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # reference.py

from aiayn.model import Transformer  # noqa: E402
from aiayn.tokenizer import PAD_ID as PAD  # noqa: E402
from reference import TorchReference  # noqa: E402


class PeerLoss(nn.Module):
    """nn.Transformer (tests/reference.py: aiayn's embeddings, positions and tied projection around it,
    each kind of dropout where aiayn has it) and the label-smoothed cross-entropy over every padded
    position, padding ignored: the usual way to train it. aiayn's own encoder and decoder are frozen:
    the peer does not use them, and its optimizer must not step them."""

    def __init__(self, model: Transformer, label_smoothing: float, reduction: str = "sum") -> None:
        super().__init__()
        self.ref, self.label_smoothing, self.reduction = TorchReference(model), label_smoothing, reduction
        for p in [*model.encoder.parameters(), *model.decoder.parameters()]:
            p.requires_grad_(False)

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> Tensor:
        """Shape: src (B, S), tgt_in and tgt_out (B, T) -> the loss, float32 ("sum" or "mean" over real tokens)."""
        logits = self.ref(src, tgt_in)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), tgt_out.flatten(), ignore_index=PAD,
                               label_smoothing=self.label_smoothing, reduction=self.reduction)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_matmul_flops(device: torch.device, dtype: torch.dtype, n: int, reps: int, inner: int = 1,
                      typical: bool = False) -> float:
    """FLOP/s of an (n x n) @ (n x n) product on random data, the machine's practical peak: the best
    of `reps` timings (each the mean of `inner` products, the device synchronised around them), or with
    `typical` their median (a GPU's clock wanders more than its best moment says)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=gen).to(dtype)
    b = torch.randn(n, n, device=device, generator=gen).to(dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            a @ b
        sync(device)
        times.append((time.perf_counter() - t0) / inner)
    return 2 * n**3 / (statistics.median(times) if typical else min(times))
