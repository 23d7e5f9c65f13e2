"""Self-attention run by run (`Packed.runs`, `kernels._attention_by_runs`) against the padded, masked
attention, in the cases a cold review of it checked: precisions, keeps that are not a prefix, empty
rows, one sentence per run, the loss under no_grad, and the modes that must not take it."""

import pytest
import torch

import aiayn.kernels
from aiayn.config import preset
from aiayn.kernels import Packed, packed_attention
from aiayn.model import Transformer

V = 50


def tiny(**kw) -> Transformer:
    """A tiny model with heads of 16 dimensions (the runs need at least `RUNS_MIN_HEAD`)."""
    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=V, tgt_vocab_size=V, d_model=64, **kw)).eval()
    with torch.no_grad():  # non-zero biases: a bias read at the wrong row cannot hide
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _keep(kind: str) -> torch.Tensor:
    """(B, S) keeps: padding in the middle with empty rows, or one run per sentence."""
    g = torch.Generator().manual_seed(1)
    if kind == "middle":
        keep = torch.rand(7, 11, generator=g) > 0.4
        keep[2] = False
        keep[5] = False
        return keep
    lengths = list(range(1, 20))  # nineteen runs of one sentence
    return torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]


def _both(fn, monkeypatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """fn() with the padded attention, then run by run, and how many times the runs ran."""
    calls = []
    runs = aiayn.kernels._attention_by_runs
    monkeypatch.setattr(aiayn.kernels, "_attention_by_runs", lambda *a: calls.append(1) or runs(*a))
    out = []
    for by_runs in (False, True):
        monkeypatch.setattr(aiayn.kernels, "ATTENTION_BY_RUNS", by_runs)
        calls.clear()
        out.append(fn())
    return out[0], out[1], len(calls)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("kind", ["middle", "one-per-run"])
def test_attention_by_runs_equals_the_padded_one(precision, kind, monkeypatch):
    """One self-attention's context (before its output projection, where int8 would round the two
    apart) is the padded one's at every real token; under inference mode as under no_grad."""
    model = tiny()
    if precision == "int8":
        if (why := aiayn.kernels.int8_unavailable()) is not None:
            pytest.skip(why)
        model.requires_grad_(False)
        aiayn.kernels.quantize_int8(model)
    keep = _keep(kind)
    packed = Packed.from_keep(keep)
    x = torch.randn(packed.idx.numel(), model.cfg.d_model)
    mha = model.encoder.layers[0].self_attn

    def ctx(mode=torch.no_grad) -> torch.Tensor:
        with mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            return packed_attention(mha, x, None, keep, False, packed, None).float()

    padded, by_runs, calls = _both(ctx, monkeypatch)
    assert calls == (0 if precision == "bf16" else 1)  # bf16 keeps the gathers (slower by runs)
    tol = 2e-2 if precision == "bf16" else 1e-5
    assert torch.allclose(by_runs, padded, atol=tol, rtol=0)
    _, inference, _ = _both(lambda: ctx(torch.inference_mode), monkeypatch)
    assert torch.equal(inference, by_runs)


def test_encoder_and_loss_under_no_grad_equal_the_padded_ones(monkeypatch):
    """Search's encoder (padding mid-sentence, empty rows) and validation's loss (whose source
    is packed even without padding) give what the padded attention gives."""
    model = tiny()
    keep = _keep("middle")
    src = torch.randint(4, V, keep.shape)
    with torch.no_grad():
        padded, by_runs, calls = _both(lambda: model.encode(src, keep), monkeypatch)
    assert calls == model.cfg.encoder_layers
    assert torch.allclose(by_runs[keep], padded[keep], atol=1e-5, rtol=0) and not by_runs[~keep].any()
    tgt = torch.randint(4, V, (7, 6))
    tgt[1, 3:] = 0
    for s in (src.masked_fill(~keep, 0), torch.randint(4, V, (7, 5))):  # mid-sentence padding, none
        with torch.no_grad():
            padded, by_runs, calls = _both(lambda: model.loss(s, tgt[:, :-1], tgt[:, 1:], reduction="none"),
                                           monkeypatch)
        assert calls == model.cfg.encoder_layers
        assert torch.allclose(by_runs, padded, atol=1e-5, rtol=0)


def test_training_mode_never_attends_by_runs(monkeypatch):
    """A model (or one attention) in train() mode under no_grad keeps its attention dropout: the
    runs, which have none, are not taken."""
    model = tiny(dropout=0.0, attention_dropout=0.5)
    keep = _keep("middle")
    src = torch.randint(4, V, keep.shape)
    model.train()
    with torch.no_grad():
        a, b, calls = _both(lambda: model.encode(src, keep), monkeypatch)
    assert calls == 0 and not torch.equal(a, b)  # dropout: two draws differ
    model.eval()
    model.encoder.layers[1].self_attn.train()
    with torch.no_grad():
        _, _, calls = _both(lambda: model.encode(src, keep), monkeypatch)
    assert calls == 1  # layer 0 only
