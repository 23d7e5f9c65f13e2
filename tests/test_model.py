"""The model pinned against torch.nn.Transformer, the paper's formulas and its invariances."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

import aiayn.kernels
from aiayn.cache import LayerCache
from aiayn.config import PRESETS, ConfigError, ModelConfig, preset
from aiayn.errors import AiaynError
from aiayn.kernels import Packed
from aiayn.model import PositionalEncoding, Transformer, sinusoidal_table
from reference import TorchReference, count_weight_requests

V = 50


def tiny(**kw) -> Transformer:
    return Transformer(preset("tiny", src_vocab_size=V, tgt_vocab_size=V, **kw)).eval()


def padded_batch(src_vocab: int = V, tgt_vocab: int = V) -> tuple[torch.Tensor, torch.Tensor]:
    """Source and target with padding in different rows and amounts (row 2 of src unpadded)."""
    src = torch.randint(4, src_vocab, (3, 7))
    src[0, 5:] = 0
    src[1, 3:] = 0
    tgt = torch.randint(4, tgt_vocab, (3, 6))
    tgt[0, 4:] = 0
    tgt[2, 2:] = 0
    return src, tgt


# --- equivalence with torch.nn.Transformer --------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        dict(norm_first=False),
        dict(norm_first=True),
        dict(activation="gelu"),
        dict(activation="gelu", norm_first=True),
        dict(share_embeddings=False, tie_output=False, src_vocab_size=37, tgt_vocab_size=61),
        dict(share_embeddings=False, tie_output=True, src_vocab_size=45, tgt_vocab_size=V),
    ],
    ids=["post-norm", "pre-norm", "gelu", "gelu-pre-norm", "separate-untied", "separate-tied"],
)
def test_matches_torch_transformer_with_padding(overrides):
    cfg = preset("tiny", **{"src_vocab_size": V, "tgt_vocab_size": V, "dropout": 0.1, **overrides})
    model = Transformer(cfg).eval()
    with torch.no_grad():  # non-zero biases and norms, so that a mis-copied one cannot hide
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    ref = TorchReference(model).eval()
    src, tgt = padded_batch(cfg.src_vocab_size, cfg.tgt_vocab_size)
    with torch.no_grad():
        ours, theirs = model(src, tgt), ref(src, tgt)
    real = tgt.ne(0)
    assert ours.shape == (3, 6, cfg.tgt_vocab_size)
    assert torch.allclose(ours[real], theirs[real], atol=1e-5, rtol=0)


def test_reference_feed_forward_dropout_is_aiayns_activation_dropout():
    """nn.Transformer's layers apply their `dropout` inside the feed-forward network too; aiayn applies
    `activation_dropout` there (0 by default). The reference does aiayn's work, no more: with residual
    and embedding dropout off, training mode leaves nothing to drop (old: 0.1 inside the FFN)."""
    torch.manual_seed(0)
    cfg = preset("tiny", src_vocab_size=V, tgt_vocab_size=V, dropout=0.1)  # activation_dropout 0
    model = Transformer(cfg)
    ref = TorchReference(model).train()
    layers = [*ref.tf.encoder.layers, *ref.tf.decoder.layers]
    for layer in layers:  # the residual dropouts (aiayn's `dropout`) off: only the feed-forward's is left
        for name in ("dropout1", "dropout2", "dropout3"):
            if hasattr(layer, name):
                setattr(layer, name, torch.nn.Identity())
    model.cfg = dataclasses.replace(cfg, dropout=0.0)  # and the embeddings'
    src, tgt = padded_batch()
    with torch.no_grad():
        trained = ref(src, tgt)
        assert torch.allclose(trained, ref.eval()(src, tgt), atol=1e-5, rtol=0)
    with_it = TorchReference(Transformer(preset("tiny", src_vocab_size=V, tgt_vocab_size=V, activation_dropout=0.2)))
    assert {layer.dropout.p for layer in [*with_it.tf.encoder.layers, *with_it.tf.decoder.layers]} == {0.2}


@pytest.mark.parametrize("norm_first", [False, True])
def test_fused_attention_path_matches_torch_transformer(norm_first, monkeypatch):
    """With the explicit CPU attention switched off, `F.scaled_dot_product_attention` runs everywhere."""
    monkeypatch.setattr(aiayn.kernels, "EXPLICIT_ATTENTION_MAX_KEYS", 0)
    monkeypatch.setattr(aiayn.kernels, "ATTENTION_BY_RUNS", False)  # one call per layer (runs: one per run)
    called = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: called.append(1) or sdpa(*a, **k))
    model = tiny(norm_first=norm_first)
    ref = TorchReference(model).eval()
    src, tgt = padded_batch()
    with torch.no_grad():
        ours = model(src, tgt)
        assert len(called) == model.cfg.encoder_layers + 2 * model.cfg.decoder_layers  # every attention
        theirs = ref(src, tgt)
        memory = model.encode(src)
        cache = model.new_cache(memory, src.ne(0))
        steps = torch.cat([model.decode(tgt[:, t : t + 1], None, cache=cache) for t in range(tgt.size(1))], 1)
    real = tgt.ne(0)
    assert torch.allclose(ours[real], theirs[real], atol=1e-5, rtol=0)
    assert torch.allclose(steps[real], ours[real], atol=1e-5)


def _both_attention_paths(model: Transformer, src, tgt, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's logits with every attention on the explicit path, then with every one fused;
    counts the fused kernel's calls to prove which path ran."""
    monkeypatch.setattr(aiayn.kernels, "ATTENTION_BY_RUNS", False)  # the encoder's too take the path chosen
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    every = model.cfg.encoder_layers + 2 * model.cfg.decoder_layers
    out = []
    for max_keys, want_calls in ((10**9, 0), (0, every)):  # explicit for any key length, then never
        monkeypatch.setattr(aiayn.kernels, "EXPLICIT_ATTENTION_MAX_KEYS", max_keys)
        calls.clear()
        with torch.no_grad():
            out.append(model(src, tgt))
        assert len(calls) == want_calls
    return out[0], out[1]


@pytest.mark.parametrize("norm_first", [False, True])
def test_explicit_attention_path_equals_the_fused_one(norm_first, monkeypatch):
    model = tiny(norm_first=norm_first)
    src, tgt = padded_batch()
    real = tgt.ne(0)
    explicit, fused = _both_attention_paths(model, src, tgt, monkeypatch)
    assert torch.allclose(explicit[real], fused[real], atol=1e-5, rtol=0)
    # the comparison can fail: an explicit path without the 1/sqrt(d_head) scale is caught
    good = aiayn.kernels._explicit_attention
    monkeypatch.setattr(aiayn.kernels, "_explicit_attention",
                        lambda q, *rest: good(q * math.sqrt(q.size(-1)), *rest))
    explicit, fused = _both_attention_paths(model, src, tgt, monkeypatch)
    assert not torch.allclose(explicit[real], fused[real], atol=1e-5, rtol=0)


def _encode_both_ways(model: Transformer, src: torch.Tensor, monkeypatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The encoder's output with its self-attention over the padded layout (gathers), then run by
    run (`Packed.runs`), and how many fused calls the runs made."""
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    out = []
    for by_runs in (False, True):
        monkeypatch.setattr(aiayn.kernels, "ATTENTION_BY_RUNS", by_runs)
        calls.clear()
        with torch.no_grad():
            out.append(model.encode(src))
    return out[0], out[1], len(calls)


@pytest.mark.parametrize("lengths", [[7, 7, 5, 5, 5, 2], [3, 7, 3, 1, 6, 6], [4, 0, 4, 7]],
                         ids=["sorted", "unsorted", "an-empty-row"])
def test_encoder_attention_by_runs_equals_the_padded_one(lengths, monkeypatch):
    """Search's encoder attends run by run of equal lengths, without padding: what the padded,
    masked attention computes, at every real position (zeros at the padding either way)."""
    model = tiny(d_model=64)  # heads of 16: `RUNS_MIN_HEAD`
    src = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        src[i, :n] = torch.randint(4, V, (n,))
    padded, by_runs, calls = _encode_both_ways(model, src, monkeypatch)
    runs = sum(1 for i, n in enumerate(lengths) if n and (i == 0 or lengths[i - 1] != n))
    assert calls == runs * model.cfg.encoder_layers  # the runs ran: one fused call per run and layer
    assert aiayn.kernels.Packed.from_keep(src.ne(0)).runs() == [
        (sum(lengths[:i]), len(list(g)), n) for i, n, g in _runs_of(lengths)]
    assert torch.allclose(by_runs, padded, atol=1e-5, rtol=0)
    assert not by_runs[src.eq(0)].any()


def _runs_of(lengths: list[int]) -> list[tuple[int, int, list[int]]]:
    """(index of the first sentence, length, the run) of each run of equal non-zero lengths."""
    out, i = [], 0
    while i < len(lengths):
        j = i
        while j < len(lengths) and lengths[j] == lengths[i]:
            j += 1
        if lengths[i]:
            out.append((i, lengths[i], lengths[i:j]))
        i = j
    return out


@pytest.mark.parametrize("d_head", [16, 64])
def test_encoder_attention_by_runs_does_not_depend_on_the_thread_count(d_head, monkeypatch):
    """Search's results must not depend on `--workers` (each worker's share of the threads): the
    fused kernel that attends by runs gives the same bits on one thread and on two (at d_head 8 it
    does not in torch 2.13, which keeps the gathers there: `RUNS_MIN_HEAD`)."""
    model = Transformer(preset("tiny", src_vocab_size=V, tgt_vocab_size=V, d_model=4 * d_head, n_heads=4)).eval()
    src = torch.randint(4, V, (6, 19))
    for i in range(6):
        src[i, 9 + 2 * i:] = 0  # odd lengths 9-19: where d_head 8 differs
    calls = []
    runs = aiayn.kernels._attention_by_runs
    monkeypatch.setattr(aiayn.kernels, "_attention_by_runs", lambda *a: calls.append(1) or runs(*a))
    threads, out = torch.get_num_threads(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            with torch.no_grad():
                out.append(model.encode(src))
    finally:
        torch.set_num_threads(threads)
    assert calls and torch.equal(out[0], out[1])


def test_encoder_attention_by_runs_is_checked(monkeypatch):
    """The comparison above can fail: runs that attend across sentence boundaries are caught."""
    model = tiny(d_model=64)  # heads of 16: `RUNS_MIN_HEAD`
    src = torch.randint(4, V, (4, 6))
    src[2:, 4:] = 0
    good = aiayn.kernels._attention_by_runs
    monkeypatch.setattr(aiayn.kernels, "_attention_by_runs",
                        lambda qkv, runs, H: good(qkv, [(0, 1, qkv.size(0))], H))  # all tokens one sentence
    padded, by_runs, _ = _encode_both_ways(model, src, monkeypatch)
    assert not torch.allclose(by_runs, padded, atol=1e-5, rtol=0)


def test_loss_equals_full_cross_entropy():
    """`Transformer.loss` (projection at real positions only) equals cross-entropy over full logits."""
    model = tiny(dropout=0.0)
    src, tgt_in = padded_batch()
    tgt_out = torch.cat([tgt_in[:, 1:], torch.zeros(3, 1, dtype=torch.long)], 1)
    tgt_out[1, -1] = 3  # the unpadded row ends with EOS
    logits = model(src, tgt_in)
    for ls in (0.0, 0.1):
        want = F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=0, label_smoothing=ls)
        assert torch.allclose(model.loss(src, tgt_in, tgt_out, label_smoothing=ls), want, atol=1e-6)
        n = int(tgt_out.ne(0).sum())
        got_sum = model.loss(src, tgt_in, tgt_out, label_smoothing=ls, reduction="sum")
        assert torch.allclose(got_sum, want * n, atol=1e-5)


def test_packed_round_trip():
    keep = torch.tensor([[True, True, False], [True, False, False]])
    x = torch.arange(12.0).view(2, 3, 2)
    packed = Packed.from_keep(keep)
    assert torch.equal(packed.pack(x), torch.tensor([[0.0, 1.0], [2.0, 3.0], [6.0, 7.0]]))
    assert torch.equal(packed.unpack(packed.pack(x)), x * keep[..., None])


@pytest.mark.parametrize("by_sentence", [False, True])
def test_packed_heads_and_merge_are_the_padded_layouts_split(by_sentence):
    """`Packed.heads` (one gather) is the projections spread over the padded positions with zeros,
    split into heads, in either layout; `merge_heads` takes a head-major result back to the real
    tokens. Twice on one batch (the second reuses the gather's index), and for every n."""
    keep = torch.tensor([[True, True, True, False], [True, False, False, False], [True, True, True, True]])
    p = Packed.from_keep(keep)
    H, dh = 2, 3
    for n in (1, 2, 3, 2):
        x = torch.randn(int(keep.sum()), n * H * dh)
        spread = p.unpack(x).view(3, 4, n, H, dh)  # (B, T, n, H, dh)
        want = spread.permute((2, 0, 3, 1, 4) if by_sentence else (2, 3, 0, 1, 4))
        got = p.heads(x, n, H, by_sentence=by_sentence)
        assert len(got) == n and all(torch.equal(g, w) and g.is_contiguous() for g, w in zip(got, want))
    ctx = torch.randn(H, 3, 4, dh)
    assert torch.equal(p.merge_heads(ctx), p.pack(ctx.permute(1, 2, 0, 3).reshape(3, 4, H * dh)))


@pytest.mark.parametrize("cross", [False, True])
def test_attention_over_packed_tokens_is_the_padded_layouts(cross):
    """`kernels.packed_attention` gives the padded layout's outputs and gradients at the real
    tokens, and without autograd (heads gathered straight from the real tokens, head-major) bitwise
    what it gives with; a query whose keys are all padding (a sentence without source tokens)
    averages zeros there."""
    from aiayn.model import MultiHeadAttention

    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, 0.0, cross=cross)
    keep = torch.tensor([[True] * 5, [True, True, True, False, False], [True, False, False, False, False]])
    mem_keep = torch.tensor([[True] * 4, [True, True, False, False], [False] * 4]) if cross else keep
    x = torch.randn(3, 5, 16, requires_grad=True)
    mem = (torch.randn(3, 4, 16) * mem_keep[..., None]).requires_grad_() if cross else None
    p, mp = Packed.from_keep(keep), Packed.from_keep(mem_keep)
    want = p.pack(mha(x, mem, mem_keep, is_causal=not cross)[0])
    got = mha(p.pack(x), None if mem is None else mp.pack(mem), mem_keep, is_causal=not cross, packed=p,
              mem_packed=mp if cross else None)[0]
    real = slice(0, 8) if cross else slice(None)  # (cross) the third sentence (row 8) has no source token
    torch.testing.assert_close(got[real], want[real], rtol=1e-6, atol=1e-6)
    if cross:
        assert torch.equal(got[8:].detach(), mha.out_proj.bias.detach()[None])
    grads = [torch.autograd.grad(y[real].square().sum(), [x, mha.out_proj.weight] + ([mem] if cross else []))
             for y in (want, got)]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # without autograd the heads go head-major (Packed.heads): bitwise the same
        fast = mha(p.pack(x), None if mem is None else mp.pack(mem), mem_keep, is_causal=not cross, packed=p,
                   mem_packed=mp if cross else None)[0]
    assert torch.equal(fast, got.detach())


def test_loss_gradients_equal_full_cross_entropy():
    model = tiny(dropout=0.0)
    src, tgt_in = padded_batch()
    tgt_out = tgt_in.roll(-1, 1)
    tgt_out[:, -1] = 0
    model.loss(src, tgt_in, tgt_out, label_smoothing=0.1).backward()
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = model(src, tgt_in)
    F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=0, label_smoothing=0.1).backward()
    for a, p in zip(ours, model.parameters()):
        assert torch.allclose(a, p.grad, atol=1e-6)


# --- positional encoding --------------------------------------------------------------------------


def test_positional_encoding_row_one():
    table = sinusoidal_table(5, 8)
    want = torch.tensor([0.8415, 0.5403, 0.0998, 0.9950, 0.0100, 1.0000, 0.0010, 1.0000])
    assert table.shape == (5, 8)
    assert torch.allclose(table[1], want, atol=5e-5)
    assert torch.equal(table[0], torch.tensor([0.0, 1.0] * 4))


def test_positional_encoding_equals_formula():
    table = sinusoidal_table(40, 16)
    for pos in (0, 3, 39):
        for i in range(8):
            angle = pos / 10000 ** (2 * i / 16)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_positional_encoding_extends_for_longer_input():
    model = Transformer(preset("tiny", src_vocab_size=V, tgt_vocab_size=V, max_positions=8)).eval()
    src = torch.randint(4, V, (2, 20))
    tgt = torch.randint(4, V, (2, 30))
    with torch.no_grad():
        logits = model(src, tgt)
    assert logits.shape == (2, 30, V) and torch.isfinite(logits).all()
    assert model.pos.table.size(0) >= 30
    assert torch.allclose(model.pos.table[:30], sinusoidal_table(30, 32), atol=0)
    x = torch.zeros(1, 12, 32)
    assert torch.allclose(PositionalEncoding(32, 4)(x)[0], sinusoidal_table(12, 32))
    # an offset (cached decoding) reads the right rows
    assert torch.allclose(PositionalEncoding(32, 4)(x[:, :2], offset=10)[0], sinusoidal_table(12, 32)[10:])


def test_positional_encoding_not_in_state_dict():
    model = tiny()
    assert not any("pos" in k or "table" in k for k in model.state_dict())
    assert all(p is not model.pos.table for p in model.parameters())


# --- invariances ----------------------------------------------------------------------------------


def test_causality():
    model = tiny()
    src = torch.randint(4, V, (2, 7))
    tgt = torch.randint(4, V, (2, 8))
    changed = tgt.clone()
    changed[:, 5] = (tgt[:, 5] + 1 - 4) % (V - 4) + 4
    with torch.no_grad():
        a, b = model(src, tgt), model(src, changed)
    assert torch.allclose(a[:, :5], b[:, :5], atol=1e-6)
    assert not torch.allclose(a[:, 5:], b[:, 5:], atol=1e-3)  # ...but does change those at and after t


def test_padding_invariance():
    model = tiny()
    src, tgt = padded_batch()
    more_src = torch.cat([src, torch.zeros(3, 4, dtype=torch.long)], 1)
    more_tgt = torch.cat([tgt, torch.zeros(3, 5, dtype=torch.long)], 1)
    real = tgt.ne(0)
    with torch.no_grad():
        base = model(src, tgt)
        for s, t in ((more_src, tgt), (src, more_tgt), (more_src, more_tgt)):
            out = model(s, t)[:, : tgt.size(1)]
            assert torch.allclose(out[real], base[real], atol=1e-5)


def test_batch_invariance():
    """A sentence's logits do not depend on the other sentences of its batch."""
    model = tiny()
    src, tgt = padded_batch()
    with torch.no_grad():
        full = model(src, tgt)
        alone = model(src[1:2, :3], tgt[1:2])
    assert torch.allclose(full[1], alone[0], atol=1e-5)


def test_encode_and_cache_skip_padding_with_the_same_values():
    """Search's encoder and cross-attention keys/values run on real source tokens only, and give
    what the padded layout gives there (zeros at the padding, which is masked)."""
    model = tiny()
    src, _ = padded_batch()
    keep = src.ne(0)
    rows: list[int] = []
    count = lambda m, i, o: rows.append(i[0].numel() // i[0].size(-1))  # noqa: E731
    hooks = [model.encoder.layers[0].ff.register_forward_hook(count),
             model.decoder.layers[1].cross_attn.kv_proj.register_forward_hook(count)]
    with torch.no_grad():
        memory = model.encode(src, keep)
        cache = model.new_cache(memory, keep)
        for h in hooks:
            h.remove()
        padded = model.encoder(model.embed(src, model.src_embed), keep)  # (B, S, d) every position
        k, v = model.decoder.layers[1].cross_attn.project_kv(padded)
    assert rows == [int(keep.sum())] * 2  # 15 real tokens, not 3 * 7
    assert torch.allclose(memory[keep], padded[keep], atol=1e-6) and memory[~keep].eq(0).all()
    m = keep[:, None, :, None]  # (B, 1, S, 1)
    assert torch.allclose(cache.layers[1].cross_k * m, k * m, atol=1e-6)
    assert torch.allclose(cache.layers[1].cross_v * m, v * m, atol=1e-6)
    for t in (cache.layers[1].cross_k, cache.layers[1].cross_v):
        assert t.masked_select(~m).eq(0).all()  # zeros at the padding
    # keys row by row, values dimension by dimension (`cache.VALUES_BY_DIM`), each in one block
    assert cache.layers[1].cross_k.is_contiguous() and cache.layers[1].cross_v.transpose(-1, -2).is_contiguous()


@pytest.mark.parametrize("norm_first", [False, True])
def test_cached_decoding_equals_full_decoding(norm_first):
    model = tiny(norm_first=norm_first)
    src, _ = padded_batch()
    tgt = torch.randint(4, V, (3, 6))
    with torch.no_grad():
        src_keep = src.ne(0)
        memory = model.encode(src, src_keep)
        full = model.decode(tgt, memory, src_keep)
        cache = model.new_cache(memory, src_keep)
        steps = [model.decode(tgt[:, t : t + 1], None, cache=cache) for t in range(tgt.size(1))]
        assert cache.length == 6
        assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
        # several tokens at a time after a cached prefix
        cache = model.new_cache(memory, src_keep)
        first = model.decode(tgt[:, :2], None, cache=cache)
        rest = model.decode(tgt[:, 2:], None, cache=cache)
        assert torch.allclose(torch.cat([first, rest], 1), full, atol=1e-5)


def test_cached_decoding_after_reorder():
    model = tiny()
    src, _ = padded_batch()
    tgt = torch.randint(4, V, (3, 5))
    order = torch.tensor([2, 0, 0])  # beam search duplicates and drops rows
    with torch.no_grad():
        src_keep = src.ne(0)
        memory = model.encode(src, src_keep)
        cache = model.new_cache(memory, src_keep)
        for t in range(3):
            model.decode(tgt[:, t : t + 1], None, cache=cache)
        cache.reorder(order)
        new = torch.randint(4, V, (3, 2))
        got = torch.cat([model.decode(new[:, t : t + 1], None, cache=cache) for t in range(2)], 1)
        want_tgt = torch.cat([tgt[order, :3], new], 1)
        want = model.decode(want_tgt, memory[order], src_keep[order])[:, 3:]
    assert torch.allclose(got, want, atol=1e-5)


def _compiled_append(cache: LayerCache, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What search's compiled int8 step does with a layer's cache: `room`, the compiled append, `appended`."""
    from aiayn import step

    old_k, old_v, store_k, store_v = cache.room(k.shape, k)
    unit = step.compiled_step()
    got = unit.append_kv(old_k, cache.pending, k, store_k), unit.append_kv(old_v, cache.pending, v, store_v)
    cache.appended(*got)
    return got


@pytest.mark.parametrize("how", ["append", "compiled"])
def test_layer_cache_appends_in_place_takes_turns_to_reorder_and_keeps_values(how):
    """Appends with and without reorders (rows duplicated, dropped, shrinking) give exactly
    index_select + cat, time-major: an append without a reorder writes into the keys' own buffer, a
    reorder copies into the other buffer (never into the one it reads); nothing new is made once
    the buffers are big enough; the same for the compiled step's appends (`LayerCache.room`, `appended`)."""
    g = torch.Generator().manual_seed(0)
    H, d = 2, 3
    k0, v0 = torch.randn(6, H, 1, d, generator=g), torch.randn(6, H, 1, d, generator=g)
    cache = LayerCache(torch.zeros(6, H, 1, d), torch.zeros(6, H, 1, d))
    append = cache.append if how == "append" else lambda k, v: _compiled_append(cache, k, v)
    ref_k, ref_v = append(k0, v0)
    ref_k, ref_v = ref_k.clone(), ref_v.clone()
    storages, reordered = [], []
    rows = 6
    for step in range(16):
        if step % 3 == 2 and rows > 2:
            rows -= 1  # a sentence left the batch
        order = torch.randint(0, ref_k.size(0), (rows,), generator=g) if step % 4 == 0 else torch.arange(rows)
        if step % 4 == 0 or order.numel() != ref_k.size(0):
            cache.reorder_rows(order)
        reordered.append(cache.pending is not None)
        k, v = torch.randn(rows, H, 1, d, generator=g), torch.randn(rows, H, 1, d, generator=g)
        got_k, got_v = append(k, v)
        ref_k = torch.cat([ref_k.index_select(0, order), k], 2)
        ref_v = torch.cat([ref_v.index_select(0, order), v], 2)
        assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
        assert all(x.permute(2, 0, 1, 3).is_contiguous() for x in (got_k, got_v))  # (t, R, H, d) in memory
        storages.append(got_k.untyped_storage().data_ptr())
    assert any(reordered) and not all(reordered)
    # fresh buffers are made only to grow (room for 8 more positions each time): 16 steps, few buffers
    assert len(set(storages)) <= 4
    steps = list(zip(storages, storages[1:], reordered[1:]))
    assert all(after != before for before, after, moved in steps if moved)  # never into the buffer it reads
    in_place = [after == before for before, after, moved in steps if not moved]
    assert sum(in_place) >= len(in_place) - 2  # in place but where the buffer was full (16 steps: twice at most)


@pytest.mark.parametrize("how", ["append", "compiled"])
def test_layer_cache_appends_in_place_under_inference_mode(how):
    """Search runs under inference mode, where views record no `_base`: appends without reorders
    still write into the same buffer (the cache keeps its storage itself), and a reorder copies
    into a second one."""
    H, d, rows = 2, 3, 4
    with torch.inference_mode():
        cache = LayerCache(torch.zeros(rows, H, 1, d), torch.zeros(rows, H, 1, d))
        append = cache.append if how == "append" else lambda k, v: _compiled_append(cache, k, v)
        storages = []
        for _ in range(8):
            got_k, _ = append(torch.randn(rows, H, 1, d), torch.randn(rows, H, 1, d))
            storages.append(got_k.untyped_storage().data_ptr())
        assert len(set(storages[1:])) == 1  # the first step's keys are the caller's; then one buffer
        cache.reorder_rows(torch.tensor([1, 0, 3, 2]))
        got_k, _ = append(torch.randn(rows, H, 1, d), torch.randn(rows, H, 1, d))
        assert got_k.untyped_storage().data_ptr() != storages[-1]
        assert cache.spare[0] is not None and cache.spare[0].untyped_storage().data_ptr() == storages[-1]


@pytest.mark.parametrize("how", ["append", "compiled"])
@torch.inference_mode()  # as search runs: only there are rows moved in place
def test_layer_cache_moves_greedy_rows_in_place(how):
    """Greedy's reorders (finished rows' places taken by the last live ones: `search._survivors`,
    `cache.moves`) copy only the moved rows, within the keys' own buffer, and the appends after
    them stay in place: one buffer throughout, and the keys exactly index_select + cat."""
    from aiayn.cache import moves
    from aiayn.search import _survivors

    g = torch.Generator().manual_seed(3)
    H, d, rows = 2, 3, 6
    cache = LayerCache(torch.zeros(rows, H, 1, d), torch.zeros(rows, H, 1, d))
    append = cache.append if how == "append" else lambda k, v: _compiled_append(cache, k, v)
    ref_k, ref_v = (x.clone() for x in append(torch.randn(rows, H, 1, d, generator=g), torch.randn(rows, H, 1, d, generator=g)))
    storages = []
    for step in range(7):
        order = torch.arange(rows)
        if step in (2, 4):  # a sentence leaves, its place taken by the last
            done = torch.zeros(rows, dtype=torch.bool)
            done[1 if step == 2 else 0] = True
            order = _survivors(done)
            cache.reorder_rows(order, moves(order, rows))
            assert cache.pending is None
            rows = order.numel()
        k, v = torch.randn(rows, H, 1, d, generator=g), torch.randn(rows, H, 1, d, generator=g)
        got_k, got_v = append(k, v)
        ref_k = torch.cat([ref_k.index_select(0, order), k], 2)
        ref_v = torch.cat([ref_v.index_select(0, order), v], 2)
        assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
        storages.append(got_k.untyped_storage().data_ptr())
    assert len(set(storages)) == 1  # (room for 8 more positions than the first copy: 7 steps fit)


def test_layer_cache_sizes_its_storage_from_the_new_keys():
    """The self-attention keys may have another shape per position than the cross-attention's
    (a cache made by hand): storage is sized from the keys appended."""
    cache = LayerCache(torch.zeros(2, 1, 1, 4), torch.zeros(2, 1, 1, 4))
    want = torch.zeros(2, 2, 0, 3)
    for _ in range(40):  # past the 8 spare positions of a buffer sized from the cross keys
        k = torch.randn(2, 2, 1, 3)
        want = torch.cat([want, k], 2)
        got, _ = cache.append(k, k)
    assert torch.equal(got, want)


@pytest.mark.parametrize("int8", [False, True])
def test_a_cache_stepped_in_inference_mode_goes_on_outside_it(int8):
    """Buffers made under inference mode cannot be written outside it: a cache stepped there and
    continued under no_grad takes new storage (and gives the same states as one step by step)."""
    from aiayn.kernels import quantize_int8

    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=20, tgt_vocab_size=20)).eval().requires_grad_(False)
    if int8:
        quantize_int8(model)
    src = torch.randint(4, 20, (3, 5), generator=torch.Generator().manual_seed(1))
    keep = src.ne(0)
    got, want = [], []
    for modes in ([torch.inference_mode] * 3 + [torch.no_grad] * 3, [torch.no_grad] * 6):
        out = got if modes[0] is torch.inference_mode else want
        with modes[0]():
            cache = model.new_cache(model.encode(src, keep), keep)
        for step, mode in enumerate(modes):
            with mode():
                out.append(model.decode(torch.full((3, 1), 5 + step), None, cache=cache, project=False).clone())
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_fully_padded_source_row_gives_no_nan():
    model = tiny()
    model.train()  # dropout paths too
    src, tgt = padded_batch()
    src[1] = 0
    logits = model(src, tgt)
    assert torch.isfinite(logits).all()
    logits.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    with torch.no_grad():
        w = model.eval().attention_weights(src, tgt)
    assert all(torch.isfinite(x).all() for ws in w.values() for x in ws)


# --- training plumbing ----------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [dict(), dict(share_embeddings=False, tie_output=False, norm_first=True)])
def test_gradients_reach_every_parameter(overrides):
    model = tiny(**overrides).train()
    src, tgt = padded_batch()
    tgt_out = tgt.roll(-1, 1)
    model.loss(src, tgt, tgt_out.masked_fill(tgt.eq(0), 0), label_smoothing=0.1).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_state_dict_round_trip(tmp_path):
    model = tiny(norm_first=True)
    torch.save(model.state_dict(), tmp_path / "m.pt")
    other = tiny(norm_first=True)
    other.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    src, tgt = padded_batch()
    with torch.no_grad():
        assert torch.equal(model(src, tgt), other(src, tgt))
    assert model.state_dict().keys() == other.state_dict().keys()


def test_tied_weights_are_one_tensor():
    model = tiny()
    assert model.src_embed.weight is model.tgt_embed.weight is model.output_weight
    untied = tiny(share_embeddings=False, tie_output=False)
    ws = (untied.src_embed.weight, untied.tgt_embed.weight, untied.output_weight)
    assert len({id(w) for w in ws}) == 3


def test_initial_logits_at_unit_scale():
    """A tied output projection must not blow the initial logits up by sqrt(d_model)."""
    model = Transformer(preset("small", src_vocab_size=1000, tgt_vocab_size=1000)).eval()
    src, tgt = torch.randint(4, 1000, (4, 12)), torch.randint(4, 1000, (4, 10))
    with torch.no_grad():
        std = model(src, tgt).std().item()
    assert 0.5 < std < 2.0, std
    # the initial loss on unrelated targets is close to that of a uniform guess, log(V)
    loss = model.loss(src, tgt, torch.randint(4, 1000, (4, 10))).item()
    assert abs(loss - math.log(1000)) < 1.0


def test_parameter_count_of_base_is_like_the_paper():
    """Base with a joint 37000 vocabulary: ~63M (the paper's Table 3 reports 65M)."""
    with torch.device("meta"):
        model = Transformer(preset("base", src_vocab_size=37000, tgt_vocab_size=37000))
    n = model.num_parameters()
    d, f = 512, 2048
    per_enc = 4 * d * d + 4 * d + 2 * d * f + f + d + 2 * 2 * d
    per_dec = 8 * d * d + 8 * d + 2 * d * f + f + d + 3 * 2 * d
    assert n == 37000 * d + 6 * per_enc + 6 * per_dec
    assert 60e6 < n < 66e6


# --- attention weights ----------------------------------------------------------------------------


def test_attention_weights_are_distributions():
    model = tiny()
    src, tgt = padded_batch()
    with torch.no_grad():
        w = model.attention_weights(src, tgt)
    cfg = model.cfg
    assert len(w["encoder"]) == cfg.encoder_layers and len(w["decoder_self"]) == cfg.decoder_layers
    assert w["encoder"][0].shape == (3, cfg.n_heads, 7, 7)
    assert w["decoder_self"][0].shape == (3, cfg.n_heads, 6, 6)
    assert w["cross"][0].shape == (3, cfg.n_heads, 6, 7)
    src_pad, tgt_pad = src.eq(0), tgt.eq(0)
    for layer in w["encoder"] + w["cross"]:
        real = layer.sum(-1)[:, :, : layer.size(2)]
        assert torch.allclose(real, torch.ones_like(real), atol=1e-5)
        assert (layer.masked_select(src_pad[:, None, None, :]) == 0).all()  # padding gets no attention
    for layer in w["decoder_self"]:
        rows = layer.sum(-1)  # (B, H, T)
        assert torch.allclose(rows[~tgt_pad[:, None].expand_as(rows)], torch.tensor(1.0), atol=1e-5)
        assert (layer.triu(1) == 0).all()  # no attention to later positions
        assert (layer.masked_select(tgt_pad[:, None, None, :]) == 0).all()


def test_attention_weights_computes_only_the_kinds_asked_for(monkeypatch):
    """The server's maps need cross-attention only: the encoder and decoder self-attention weights
    are then neither built nor returned (every `need_weights` call is counted)."""
    model = tiny()
    src, tgt = padded_batch()
    with torch.no_grad():
        full = model.attention_weights(src, tgt)
        calls = count_weight_requests(monkeypatch)
        w = model.attention_weights(src, tgt, kinds=("cross",))
    assert w["encoder"] == [] and w["decoder_self"] == [] and sum(calls) == model.cfg.decoder_layers
    for got, want in zip(w["cross"], full["cross"]):
        assert torch.allclose(got, want, atol=1e-6)


# --- configuration --------------------------------------------------------------------------------


def test_config_json_round_trip():
    cfg = preset("small", src_vocab_size=123, tgt_vocab_size=456, share_embeddings=False, activation="gelu")
    text = json.dumps(cfg.to_dict())  # as a checkpoint's config.json holds it
    again = ModelConfig.from_dict(json.loads(text))
    assert again == cfg and isinstance(again, ModelConfig)
    assert json.loads(text)["d_model"] == 256
    with pytest.raises(Exception):
        cfg.d_model = 3  # frozen


@pytest.mark.parametrize(
    "name, d_model, layers, heads, d_ff, dropout",
    [("base", 512, 6, 8, 2048, 0.1), ("big", 1024, 6, 16, 4096, 0.3), ("small", 256, 3, 4, 1024, 0.1)],
)
def test_presets_match_the_issue(name, d_model, layers, heads, d_ff, dropout):
    cfg = preset(name)
    assert (cfg.d_model, cfg.encoder_layers, cfg.decoder_layers, cfg.n_heads, cfg.d_ff, cfg.dropout) == (
        d_model, layers, layers, heads, d_ff, dropout)
    assert cfg.norm_first is False and cfg.activation == "relu" and cfg.share_embeddings and cfg.tie_output


def test_tiny_preset_is_small_and_presets_take_overrides():
    assert set(PRESETS) >= {"tiny", "small", "base", "big"}
    cfg = preset("tiny", src_vocab_size=77, tgt_vocab_size=77, norm_first=True)
    assert cfg.d_model <= 64 and cfg.src_vocab_size == 77 and cfg.norm_first
    assert Transformer(cfg).num_parameters() < 50_000


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(d_model=30, n_heads=4), "divisible"),
        (dict(d_model=0), "d_model"),
        (dict(encoder_layers=0), "encoder_layers"),
        (dict(dropout=1.0), "dropout"),
        (dict(activation="tanh"), "activation"),
        (dict(src_vocab_size=10, tgt_vocab_size=12), "share_embeddings"),
        (dict(pad_id=99, src_vocab_size=10, tgt_vocab_size=10), "pad_id"),
    ],
)
def test_config_validation(fields, words):
    with pytest.raises(AiaynError, match=words):
        ModelConfig(**fields)


def test_config_rejects_unknown_fields_and_presets():
    with pytest.raises(ConfigError, match="colour"):
        ModelConfig.from_dict({"colour": 1})
    with pytest.raises(ConfigError, match="huge"):
        preset("huge")


def test_bf16_autocast_stays_close_to_fp32():
    """Under bf16 autocast (the residual stream in bf16 too) the logits and the loss stay close."""
    model = Transformer(preset("small", src_vocab_size=1000, tgt_vocab_size=1000, encoder_layers=2,
                               decoder_layers=2)).eval()
    src, tgt = torch.randint(4, 1000, (4, 12)), torch.randint(4, 1000, (4, 10))
    tgt_out = torch.randint(4, 1000, (4, 10))
    with torch.no_grad():
        full, loss = model(src, tgt), model.loss(src, tgt, tgt_out)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            half, half_loss = model(src, tgt), model.loss(src, tgt, tgt_out)
    assert half.dtype == torch.bfloat16 and half_loss.dtype == torch.float32
    assert (half.float() - full).abs().max() < 0.1 * full.abs().max()
    assert abs(half_loss.item() - loss.item()) < 0.02 * loss.item()
