"""From a cold review of the core (model, search, cache, step): properties held against an
independent reading of the paper, and the bugs it found."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aiayn.config import ModelConfig
from aiayn.model import Transformer
from aiayn.search import beam_search, greedy_search

BOS, EOS = 1, 2


def _model(seed: int) -> Transformer:
    """A tiny random model with random LayerNorm parameters and biases (zeros hide mistakes)."""
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(src_vocab_size=23, tgt_vocab_size=23, d_model=16, n_heads=4, encoder_layers=2,
                                    decoder_layers=2, d_ff=32, dropout=0.0)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    return model


def test_a_source_without_tokens_decodes_alike_cached_uncached_and_in_the_loss():
    """A row of padding only: its cross-attention has no key to see (attention is then uniform over
    the masked keys). The cache and the loss hold zeros at the padding there, the uncached decoder
    held the key/value projection's bias, so `use_cache=False` and `forward` gave other results than
    search's cache and `loss` (greedy differed in 7 of 20 random models)."""
    src = torch.tensor([[5, 6, 7], [0, 0, 0]])
    tgt_in = torch.tensor([[1, 8, 9, 4], [1, 10, 0, 0]])
    tgt_out = torch.tensor([[8, 9, 4, 2], [10, 2, 0, 0]])
    for seed in range(8):
        model = _model(seed)
        with torch.no_grad():
            keep = src.ne(0)
            memory = model.encode(src, keep)
            cached = model.decode(tgt_in[:, :1], None, cache=model.new_cache(memory, keep))
            uncached = model.decode(tgt_in[:, :1], memory, keep)
            assert torch.allclose(cached, uncached, atol=1e-5), seed
            want = F.cross_entropy(model(src, tgt_in).flatten(0, 1), tgt_out.flatten(), ignore_index=0,
                                   label_smoothing=0.1)
            assert torch.allclose(model.loss(src, tgt_in, tgt_out, label_smoothing=0.1), want, atol=1e-5), seed
        assert greedy_search(model, src, BOS, EOS, max_len_b=6) == greedy_search(model, src, BOS, EOS, max_len_b=6,
                                                                                use_cache=False), seed
        a = beam_search(model, src, BOS, EOS, beam=3, nbest=3, max_len_b=6)
        b = beam_search(model, src, BOS, EOS, beam=3, nbest=3, max_len_b=6, use_cache=False)
        assert [[t for t, _ in h] for h in a] == [[t for t, _ in h] for h in b], seed


# --- properties that held in the review, pinned against an independent reading of the paper --------

def _attend(mha, x, memory, keep):
    """Section 3.2: softmax(q k^T / sqrt(d_head)) v per head, keep (B, T, S) True = may attend."""
    B, T, D = x.shape
    H = mha.n_heads
    if mha.cross:
        q, (k, v) = F.linear(x, mha.q_proj.weight, mha.q_proj.bias), F.linear(
            memory, mha.kv_proj.weight, mha.kv_proj.bias).chunk(2, -1)
    else:
        q, k, v = F.linear(x, mha.qkv_proj.weight, mha.qkv_proj.bias).chunk(3, -1)
    q, k, v = (t.reshape(B, -1, H, D // H).transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2) / (D // H) ** 0.5).masked_fill(~keep[:, None], float("-inf"))
    out = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(B, T, D)
    return F.linear(out, mha.out_proj.weight, mha.out_proj.bias)


def _reference_logits(model: Transformer, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """The model of Sections 3.1-3.5 written out on `model`'s weights (sources of at least one token)."""
    cfg = model.cfg
    d, (B, S), T = cfg.d_model, src.shape, tgt.size(1)
    pos = torch.arange(max(S, T), dtype=torch.float64)[:, None] / 10000 ** (torch.arange(0, d, 2) / d)
    pe = torch.stack([pos.sin(), pos.cos()], -1).flatten(1).float()  # PE(p, 2i) = sin, PE(p, 2i+1) = cos
    scale = d**0.5 if cfg.scale_embedding else 1.0
    act = {"relu": torch.relu, "gelu": F.gelu, "swish": F.silu}[cfg.activation]

    def ffn(ff, h):
        return F.linear(act(F.linear(h, ff.w1.weight, ff.w1.bias)), ff.w2.weight, ff.w2.bias)

    def sub(norm, h, f):  # post-norm LN(x + f(x)) (Section 5.4) or pre-norm x + f(LN(x))
        return h + f(norm(h)) if cfg.norm_first else norm(h + f(h))

    keep = src.ne(cfg.pad_id)
    x = model.src_embed.weight[src] * scale + pe[:S]
    for la in model.encoder.layers:
        x = sub(la.norm1, x, lambda h, la=la: _attend(la.self_attn, h, None, keep[:, None, :].expand(B, S, S)))
        x = sub(la.norm2, x, lambda h, la=la: ffn(la.ff, h))
    memory = x if model.encoder.norm is None else model.encoder.norm(x)
    y = model.tgt_embed.weight[tgt] * scale + pe[:T]
    causal = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    for la in model.decoder.layers:
        y = sub(la.norm1, y, lambda h, la=la: _attend(la.self_attn, h, None, causal))
        y = sub(la.norm2, y, lambda h, la=la: _attend(la.cross_attn, h, memory, keep[:, None, :].expand(B, T, S)))
        y = sub(la.norm3, y, lambda h, la=la: ffn(la.ff, h))
    y = y if model.decoder.norm is None else model.decoder.norm(y)
    return y @ model.output_weight.T + (0 if model.out_bias is None else model.out_bias)


def _variant(seed: int, **kw) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**{**dict(src_vocab_size=23, tgt_vocab_size=23, d_model=16, n_heads=4,
                                              encoder_layers=2, decoder_layers=2, d_ff=32, dropout=0.0), **kw})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _batch(g: torch.Generator, B: int, S: int, V: int = 23) -> torch.Tensor:
    """Right-padded rows of 1..S tokens (the first S long)."""
    x = torch.randint(3, V, (B, S), generator=g)
    for i, n in enumerate(torch.randint(1, S + 1, (B,), generator=g).tolist()):
        x[i, S if i == 0 else n:] = 0
    return x


VARIANTS = [dict(), dict(norm_first=True), dict(activation="gelu", share_embeddings=False, src_vocab_size=29),
            dict(activation="swish", tie_output=False, scale_embedding=False, output_bias=True, norm_first=True)]


def test_forward_and_loss_are_the_paper_written_out():
    """Embeddings times sqrt(d_model), sinusoidal positions, multi-head attention with padding and
    causal masks, post- or pre-norm residuals, tied or untied projection: within float32 rounding of
    the model written out; the loss is label-smoothed cross entropy over the non-pad targets."""
    for seed, kw in enumerate(VARIANTS):
        model, g = _variant(seed, **kw), torch.Generator().manual_seed(seed)
        src, tgt = _batch(g, 4, 7, model.cfg.src_vocab_size), _batch(g, 4, 6)
        tgt[:, 0] = BOS
        with torch.no_grad():
            got, want = model(src, tgt), _reference_logits(model, src, tgt)
        real = tgt.ne(0)
        assert torch.allclose(got[real], want[real], atol=2e-5), kw
        out = torch.cat([tgt[:, 1:], torch.zeros(4, 1, dtype=torch.long)], 1)
        loss = model.loss(src, tgt, out, label_smoothing=0.1)
        assert torch.allclose(loss, F.cross_entropy(want.flatten(0, 1), out.flatten(), ignore_index=0,
                                                    label_smoothing=0.1), atol=2e-5), kw


def test_cached_decoding_in_any_chunks_and_after_reorders_is_uncached_decoding():
    """Positions continue at the cache's length (Section 3.5 offsets), whatever the chunks; rows
    permuted or dropped mid-way decode as their own uncached prefixes."""
    for seed, kw in enumerate(VARIANTS):
        model, g = _variant(seed, **kw), torch.Generator().manual_seed(seed)
        src, tgt = _batch(g, 3, 6, model.cfg.src_vocab_size), torch.randint(3, 23, (3, 8), generator=g)
        with torch.inference_mode():
            keep = src.ne(0)
            memory = model.encode(src, keep)
            full = model.decode(tgt, memory, keep)
            for chunks in ([1] * 8, [3, 1, 2, 2], [8], [1, 4, 3]):
                cache, pieces, at = model.new_cache(memory, keep), [], 0
                for n in chunks:
                    pieces.append(model.decode(tgt[:, at:at + n], None, cache=cache))
                    at += n
                assert torch.allclose(torch.cat(pieces, 1), full, atol=1e-5), (kw, chunks)
            for rows in ([2, 0, 1], [2, 0], [1, 1, 0]):
                cache = model.new_cache(memory, keep)
                for t in range(3):
                    model.decode(tgt[:, t:t + 1], None, cache=cache)
                cache.reorder(torch.tensor(rows))
                steps = torch.cat([model.decode(tgt[rows, t:t + 1], None, cache=cache) for t in range(3, 8)], 1)
                assert torch.allclose(steps, model.decode(tgt[rows], memory[rows], keep[rows])[:, 3:], atol=1e-5)


def _reference_search(model, src, K, alpha, a, b, min_len, stop):
    """One sentence's beam search as the module docstring of `aiayn.search` states it, on the
    uncached decoder, one hypothesis at a time: best 2K candidates; an EOS among the best K finishes
    (score / ((5 + len) / 6) ** alpha, len with EOS); the best K others live on; "first" stops at K
    finished, "best" when the best live one at its length cannot beat the K-th best finished; EOS
    forced at floor(a * len + b) tokens, forbidden before min_len; PAD and BOS never."""
    maxlen = max(1, int(src.ne(0).sum() * a + b))  # (floor: a, b and lengths are non-negative)
    memory = model.encode(src)
    live, finals, step = [([BOS], 0.0)], [], 0
    while True:
        tokens = torch.tensor([h for h, _ in live])
        lprobs = torch.log_softmax(model.decode(tokens, memory.expand(len(live), -1, -1))[:, -1], -1).double()
        lprobs[:, [0, BOS]] = float("-inf")
        if step >= maxlen:
            lprobs[:, [t for t in range(lprobs.size(1)) if t != EOS]] = float("-inf")
        elif step < min_len:
            lprobs[:, EOS] = float("-inf")
        cands = sorted(((sc + lprobs[r, t].item(), r, t) for r, (_, sc) in enumerate(live)
                        for t in range(lprobs.size(1))), key=lambda c: -c[0])[:2 * K]
        for s, r, t in cands[:K]:
            if t == EOS and s > float("-inf") and not (stop == "first" and len(finals) >= K):
                finals.append((live[r][0][1:], s / ((5 + step + 1) / 6) ** alpha))
        conts = sorted(((float("-inf") if t == EOS else s, r, t) for s, r, t in cands), key=lambda c: -c[0])[:K]
        best = sorted(finals, key=lambda f: -f[1])[:K]
        if stop == "first":
            done = len(finals) >= K
        else:
            done = len(best) == K and conts[0][0] / ((5 + step + 1) / 6) ** alpha <= best[-1][1]
        if done or conts[0][0] == float("-inf") or step >= maxlen:
            return best
        live, step = [(live[r][0] + [t], s) for s, r, t in conts], step + 1


def test_batched_beam_search_is_each_sentences_reference_search():
    """Batched, cached, sentences leaving and rows reordered: each sentence's n-best list (tokens,
    scores, order) is that of its own reference search alone, under both stopping rules."""
    import random

    rnd = random.Random(0)
    for trial in range(10):
        V = rnd.choice([6, 12, 23])
        model, g = _variant(trial, src_vocab_size=V, tgt_vocab_size=V), torch.Generator().manual_seed(trial)
        with torch.no_grad():
            model.tgt_embed.weight[EOS] *= rnd.choice([1, 2, 3])  # lengths that vary
        src = _batch(g, rnd.randint(1, 4), rnd.randint(1, 5), V)
        K, stop = rnd.randint(1, min(4, V - 3)), rnd.choice(["first", "best"])
        kw = dict(alpha=rnd.choice([0.0, 0.6, 2.0]), max_len_a=rnd.choice([0.0, 1.0]), max_len_b=rnd.choice([1, 3, 6]),
                  min_len=rnd.choice([0, 0, 2]))
        got = beam_search(model, src, BOS, EOS, beam=K, nbest=K, stop=stop, **kw)
        with torch.no_grad():
            for i, hyps in enumerate(got):
                want = _reference_search(model, src[i:i + 1, :int(src[i].ne(0).sum())], K, kw["alpha"],
                                         kw["max_len_a"], kw["max_len_b"], kw["min_len"], stop)
                assert [t for t, _ in hyps] == [t for t, _ in want], (trial, i)
                assert [s for _, s in hyps] == pytest.approx([s for _, s in want], abs=1e-4), (trial, i)


def test_a_gpu_this_machine_lacks_is_one_line(monkeypatch):
    """`train --device cuda:3` on a machine of one GPU (a run resumed on a smaller machine; more torchrun
    processes than GPUs) got torch's traceback at the first tensor; translate already said it in one line."""
    from aiayn import trainer
    from aiayn.errors import AiaynError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(AiaynError, match=r"--device cuda:3: this machine has 1 CUDA device\(s\), numbered from 0; "
                                         r"give --device cuda:N with N below that$"):
        trainer.setup_distributed("cuda:3")
    assert trainer.setup_distributed("cuda:0").device == torch.device("cuda", 0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(AiaynError, match=r"LOCAL_RANK 1: this machine has 1 CUDA device\(s\), numbered from 0; run at "
                                         r"most that many processes a machine \(torchrun --nproc-per-node\)$"):
        trainer.setup_distributed("cuda")


def test_positions_grown_by_two_threads_at_once_serve_each(monkeypatch):
    """Two search threads growing the positional table at once: one's larger table, then the other's
    smaller one, landed before the first read it back, and the first got too few positions (a shape
    error). The interleaving is made here by the module's own attribute write."""
    from torch import nn

    from aiayn.model import PositionalEncoding, sinusoidal_table

    pe = PositionalEncoding(8, 4)
    real = nn.Module.__setattr__

    def other_thread_lands_too(self, name, value):
        real(self, name, value)
        if name == "table" and value.size(0) == 300:  # the other thread's smaller table, assigned right after
            real(self, name, sinusoidal_table(200, 8))

    monkeypatch.setattr(PositionalEncoding, "__setattr__", other_thread_lands_too)
    out = pe(torch.zeros(1, 300, 8))
    assert torch.equal(out[0], sinusoidal_table(300, 8))
