"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

Section 3.1 stacks, 3.2 attention, 3.3 feed-forward, 3.4 embeddings and softmax, 3.5 positional
encoding. Masks follow one convention everywhere: bool, True = may attend, the polarity that
`F.scaled_dot_product_attention` takes. Padding masks travel as (B, S) and are broadcast inside
attention only.

Targets are right-padded, so in decoder self-attention the causal mask already hides every pad key
from every real query; the decoder therefore runs the causal path (`is_causal`) and takes an
explicit target padding mask only when one is given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn import kernels, step
from aiayn.cache import DecoderCache, LayerCache, cached_values, ungroup
from aiayn.config import ModelConfig
from aiayn.kernels import Layers, Linear, LossPacking, Packed


def sinusoidal_table(max_len: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(...) (Section 3.5).

    Shape: (max_len, d_model), float32.
    """
    pos = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)  # (L, 1)
    inv_freq = torch.pow(10000.0, -torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (d/2,)
    angles = pos * inv_freq  # (L, d/2)
    table = torch.empty(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)
    return table.float()


class PositionalEncoding(nn.Module):
    """Adds the fixed sinusoidal encoding (Section 3.5); a buffer that is not saved with the weights.

    The table grows when a longer sequence than `max_len` comes, instead of failing.
    """

    def __init__(self, d_model: int, max_len: int) -> None:
        super().__init__()
        self.d_model = d_model
        here = torch.empty(0).device  # where a `with torch.device(...)` block builds the model
        if here.type == "meta":  # shapes only (checks of sizes): computing it there imports torch's compiler
            table = torch.empty(max_len, d_model)
        else:
            with torch.device("cpu"):
                table = sinusoidal_table(max_len, d_model).to(here)
        self.register_buffer("table", table, persistent=False)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        """Shape: x (B, T, d_model) -> (B, T, d_model); positions start at `offset`."""
        end, table = offset + x.size(1), self.table  # read once: another search thread may grow it meanwhile
        if end > table.size(0):
            self.table: Tensor = (table := sinusoidal_table(max(end, 2 * table.size(0)), self.d_model).to(table.device))
        return x + table[offset:end].to(x.dtype)


class Embedding(nn.Module):
    """Token embedding multiplied by sqrt(d_model) (Section 3.4; by 1 without `cfg.scale_embedding`, as Marian can)."""

    def __init__(self, vocab_size: int, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, cfg.d_model))
        self.pad_id, self.scale = cfg.pad_id, math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0
        if self.weight.is_meta:  # shapes only (a checkpoint's check): meta's normal_ imports torch's compiler
            return
        # N(0, d^-1/2): unit-variance inputs after scaling, and unit-scale logits when tied.
        nn.init.normal_(self.weight, mean=0.0, std=cfg.d_model**-0.5)
        with torch.no_grad():
            self.weight[cfg.pad_id].zero_()

    def forward(self, tokens: Tensor) -> Tensor:
        """Shape: tokens (B, T) -> (B, T, d_model)."""
        return F.embedding(tokens, self.weight, self.pad_id) * self.scale


def _key_mask(keep: Tensor | None) -> Tensor | None:
    """(B, S) True = real -> (B, 1, 1, S), broadcast over heads and queries."""
    return None if keep is None else keep[:, None, None, :]


class MultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention (Section 3.2.2); the dot-product itself (3.2.1) runs in
    `kernels.attention`, on `F.scaled_dot_product_attention` or, where that is slower, spelled out.

    Self-attention uses one fused QKV projection; cross-attention a Q projection and a fused KV one.
    `need_weights` returns the attention probabilities too (for plots).
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float, cross: bool) -> None:
        super().__init__()
        self.n_heads, self.d_head, self.cross, self.dropout = n_heads, d_model // n_heads, cross, dropout
        if cross:
            self.q_proj = Linear(d_model, d_model)
            self.kv_proj = Linear(d_model, 2 * d_model)
        else:
            self.qkv_proj = Linear(d_model, 3 * d_model)
        self.out_proj = Linear(d_model, d_model)

    def _heads(self, x: Tensor, n: int) -> tuple[Tensor, ...]:
        """(B, T, n*d_model) -> n tensors of (B, H, T, d_head)."""
        B, T, _ = x.shape
        return x.view(B, T, n, self.n_heads, self.d_head).permute(2, 0, 3, 1, 4).unbind(0)

    def project_kv(self, memory: Tensor, packed: Packed | None = None, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Cross-attention keys/values, once per sentence; zeros at the padding (`packed`, or `keep` (B, S) False) as cached."""
        kv = self.kv_proj(memory)  # (B, S, 2d), or (N_src, 2d) when packed; then (B, H, S, d_head) each
        kv = kv.masked_fill(~keep[:, :, None], 0.0) if packed is None and keep is not None and keep.dim() == 2 else kv
        k, v = self._heads(kv, 2) if packed is None else packed.heads(kv, 2, self.n_heads, by_sentence=True)
        return k, v

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        key_keep: Tensor | None = None,
        is_causal: bool = False,
        cache: LayerCache | None = None,
        need_weights: bool = False,
        packed: Packed | None = None,
        mem_packed: Packed | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Shape: x (B, T, d); memory (B, S, d); key_keep (B, S) or (B, T, S) bool -> (B, T, d).

        With `packed` (`mem_packed`), x (memory) holds only the real tokens, (N, d), and so does
        the output (`kernels.packed_attention`; no weights, no cache)."""
        if packed is not None:
            assert cache is None and not need_weights, "packed tokens: no cache, no weights (plots run padded)"
            return self.out_proj(kernels.packed_attention(self, x, memory, key_keep, is_causal, packed, mem_packed)), None
        B, T, D = x.shape
        if self.cross:
            q = self._heads(self.q_proj(x), 1)[0]  # (B, H, T, d_head)
            if cache is not None:  # a sentence's beam rows share its keys: q (N, H, G*T, d_head)
                q, k, v = cache.cross(q)
            else:
                assert memory is not None, "cross-attention needs the encoder output or a cache"
                k, v = self.project_kv(memory, mem_packed, key_keep)
        else:
            q, k, v = self._heads(self.qkv_proj(x), 3)
            if cache is not None:
                k, v = cache.append(k, v)  # (B, H, t+T, d_head)
        mask = None if key_keep is None else (key_keep[:, None] if key_keep.dim() == 3 else _key_mask(key_keep))
        p = self.dropout if self.training else 0.0
        ctx, weights = kernels.attention(q, k, v, mask, is_causal, p, self.training, need_weights)  # (B, H, T, d_head)
        if weights is not None and mask is not None:  # plots: a query with no key to see attends to nothing
            weights = weights.masked_fill(~mask.any(-1, keepdim=True), 0.0)
        if self.cross and cache is not None:  # back to one row per hypothesis, (B, H, T, .)
            ctx = ungroup(ctx, B, T)
            weights = None if weights is None else ungroup(weights, B, T)
        ctx = ctx.transpose(1, 2).reshape(B, T, D)
        return self.out_proj(ctx), weights


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (Section 3.3); GELU or swish (Marian's) as an option."""

    def __init__(self, d_model: int, d_ff: int, dropout: float, activation: str) -> None:
        super().__init__()
        self.w1, self.w2 = Linear(d_model, d_ff), Linear(d_ff, d_model)
        self.act = F.relu if activation == "relu" else F.gelu if activation == "gelu" else F.silu  # silu: swish
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        if self.act is F.relu and not self.training:  # inference: ReLU fused into the first GEMM
            return self.w2(kernels.inference_linear(x, self.w1.weight, self.w1.bias, relu=True))
        return self.w2(kernels.dropout(self.act(self.w1(x)), self.dropout, self.training))


class _Sublayers(nn.Module):
    """Residual + LayerNorm around each sublayer: post-norm LN(x + Dropout(f(x))) as in Section 5.4,
    or pre-norm x + Dropout(f(LN(x)))."""

    norm_first: bool
    dropout: float

    def _residual(self, x: Tensor, norm: nn.LayerNorm, f: Callable[[Tensor], Tensor]) -> Tensor:
        if self.norm_first:
            return x + kernels.dropout(f(norm(x)), self.dropout, self.training)
        return norm(x + kernels.dropout(f(x), self.dropout, self.training))


class EncoderLayer(_Sublayers):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm_first, self.dropout = cfg.norm_first, cfg.dropout
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, cross=False)
        self.ff = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout, cfg.activation)
        self.norm1 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.norm2 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)

    def forward(
        self, x: Tensor, src_keep: Tensor | None, weights: list | None = None, packed: Packed | None = None
    ) -> Tensor:
        """Shape: x (B, S, d) (or (N, d) when packed), src_keep (B, S) -> like x."""

        def attend(h: Tensor) -> Tensor:
            out, w = self.self_attn(h, key_keep=src_keep, need_weights=weights is not None, packed=packed)
            if weights is not None:
                weights.append(w)
            return out

        x = self._residual(x, self.norm1, attend)
        return self._residual(x, self.norm2, self.ff)


class DecoderLayer(_Sublayers):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm_first, self.dropout = cfg.norm_first, cfg.dropout
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, cross=False)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout, cross=True)
        self.ff = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout, cfg.activation)
        self.norm1 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.norm2 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.norm3 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None,
        src_keep: Tensor | None,
        self_keep: Tensor | None,
        is_causal: bool,
        cache: LayerCache | None = None,
        weights: dict[str, list] | None = None,
        packed: Packed | None = None,
        mem_packed: Packed | None = None,
    ) -> Tensor:
        """Shape: x (B, T, d), memory (B, S, d), src_keep (B, S), self_keep (B, T, t) or None -> (B, T, d).
        x and memory may be packed, (N, d), with `packed` / `mem_packed`."""
        want = {} if weights is None else weights  # only the kinds it has a list for are computed

        def self_attend(h: Tensor) -> Tensor:
            out, w = self.self_attn(h, key_keep=self_keep, is_causal=is_causal, cache=cache,
                                    need_weights="self" in want, packed=packed)
            if w is not None:
                want["self"].append(w)
            return out

        def cross_attend(h: Tensor) -> Tensor:
            out, w = self.cross_attn(h, memory, key_keep=src_keep, cache=cache, need_weights="cross" in want,
                                     packed=packed, mem_packed=mem_packed)
            if w is not None:
                want["cross"].append(w)
            return out

        x = self._residual(x, self.norm1, self_attend)
        x = self._residual(x, self.norm2, cross_attend)
        return self._residual(x, self.norm3, self.ff)


class Encoder(nn.Module):
    """N identical layers (Section 3.1); a final LayerNorm when pre-norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layers = Layers(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if cfg.norm_first else None

    def forward(
        self, x: Tensor, src_keep: Tensor | None, weights: list | None = None, packed: Packed | None = None
    ) -> Tensor:
        for layer in self.layers:
            x = layer(x, src_keep, weights, packed)
        return x if self.norm is None else self.norm(x)


class Decoder(nn.Module):
    """N identical layers with masked self-attention and cross-attention (Section 3.1)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layers = Layers(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if cfg.norm_first else None

    def forward(self, x: Tensor, memory: Tensor | None, src_keep: Tensor | None, self_keep: Tensor | None,
                is_causal: bool, cache: DecoderCache | None = None, weights: dict[str, list] | None = None,
                packed: Packed | None = None, mem_packed: Packed | None = None) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, src_keep, self_keep, is_causal, None if cache is None else cache.layers[i], weights,
                      packed, mem_packed)
        return x if self.norm is None else self.norm(x)


class Transformer(nn.Module):
    """The encoder-decoder model: `forward` for training, `encode`/`decode` for search.

    Shape:
        src: (B, S) token ids, right-padded with `pad_id`.
        tgt_in: (B, T) target ids shifted right (starting with BOS), right-padded.
        returns logits (B, T, tgt_vocab_size).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tgt_embed = Embedding(cfg.tgt_vocab_size, cfg)
        self.src_embed = self.tgt_embed if cfg.share_embeddings else Embedding(cfg.src_vocab_size, cfg)
        self.pos = PositionalEncoding(cfg.d_model, cfg.max_positions)
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.out_proj = None if cfg.tie_output else Linear(cfg.d_model, cfg.tgt_vocab_size, bias=False)
        self.out_bias = nn.Parameter(torch.zeros(cfg.tgt_vocab_size)) if cfg.output_bias else None  # Marian's
        self._init_linear()

    def _init_linear(self) -> None:
        # Xavier-uniform matrices and zero biases, as in the reference implementation (tensor2tensor).
        for name, p in self.named_parameters():
            if "embed" in name or p.is_meta:
                continue
            if p.dim() == 2:
                nn.init.xavier_uniform_(p)
            elif name.endswith("bias") and "norm" not in name:
                nn.init.zeros_(p)

    @property
    def output_weight(self) -> Tensor:
        return self.tgt_embed.weight if self.out_proj is None else self.out_proj.weight

    def num_parameters(self) -> int:
        """Distinct trainable parameters (tied weights counted once)."""
        return sum(p.numel() for p in self.parameters())

    def embed(self, tokens: Tensor, table: Embedding, offset: int = 0) -> Tensor:
        """Scaled embedding + positional encoding + dropout (Sections 3.4, 3.5, 5.4)."""
        x = table(tokens)  # (B, T, d)
        if torch.is_autocast_enabled(x.device.type):
            # Under autocast the residual stream runs in the low-precision dtype: every linear layer
            # would cast its input to it anyway, and LayerNorm keeps its statistics in float32.
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return kernels.dropout(self.pos(x, offset), self.cfg.dropout, self.training)

    def encode(self, src: Tensor, src_keep: Tensor | None = None, weights: list | None = None) -> Tensor:
        """Shape: src (B, S) -> memory (B, S, d_model), zeros at the padding when there is some.

        The position-wise layers run on the real tokens only (`Packed`): the sentences of a batch
        that search gets from a server are of any length, and their padding would cost up to half
        of the encoder's time. With `weights` (plots) the padded layout is kept."""
        if src_keep is None:
            src_keep = src.ne(self.cfg.pad_id)
        x = self.embed(src, self.src_embed)  # (B, S, d)
        packed = None if weights is not None else Packed.if_padded(src_keep)
        if packed is None:
            return self.encoder(x, src_keep, weights)
        return packed.unpack(self.encoder(packed.pack(x), src_keep, packed=packed))

    def new_cache(self, memory: Tensor, src_keep: Tensor) -> DecoderCache:
        """A decoding cache with cross-attention keys/values computed once from `memory`, at its
        real tokens only (the keys/values at the padding are zeros, and masked)."""
        packed = Packed.if_padded(src_keep)
        mem = memory if packed is None else packed.pack(memory)  # (B, S, d) or (N_src, d)
        layers = []
        spare: list[Tensor | None] = [None, None]  # the layers share their spare buffers (`LayerCache`)
        for layer in self.decoder.layers:
            k, v = layer.cross_attn.project_kv(mem, packed)  # (B, H, S, d_head) each
            layers.append(LayerCache(k.contiguous(), cached_values(v), spare=spare))  # one layout, read at every step
        return DecoderCache(layers, src_keep)

    def decode(self, tgt: Tensor, memory: Tensor | None, src_keep: Tensor | None = None, tgt_keep: Tensor | None = None,
               cache: DecoderCache | None = None, weights: dict[str, list] | None = None, project: bool = True) -> Tensor:
        """Decoder hidden states projected to logits.

        Without a cache, `tgt` (B, T) is the whole prefix. With a cache, `tgt` holds only the new
        tokens (B, T_new), placed after the `cache.length` tokens decoded so far; `memory` may then
        be None (cross-attention reads the cached keys/values) and `src_keep` defaults to the cache's
        (one row per sentence: the cache's `beam` rows of a sentence share it).
        `tgt_keep` (B, T) is an optional target padding mask for left- or mid-padded targets.

        Shape: -> logits (B, T, tgt_vocab) (or hidden states (B, T, d_model) when project=False).
        """
        offset = 0 if cache is None else cache.length
        if cache is not None and src_keep is None:
            src_keep = cache.src_keep
        T = tgt.size(1)
        self_keep, is_causal = None, False
        if tgt_keep is not None or (offset > 0 and T > 1):
            total = offset + T
            causal = torch.ones(T, total, dtype=torch.bool, device=tgt.device).tril(offset)  # (T, t+T)
            keep = causal.expand(tgt.size(0), T, total)
            if tgt_keep is not None:
                keep = keep & tgt_keep[:, None, -total:]
            self_keep = keep
        elif T > 1:
            is_causal = True
        x = self.embed(tgt, self.tgt_embed, offset)
        if cache is not None and T == 1 and self_keep is None and weights is None and src_keep is not None \
                and src_keep.dim() == 2:  # search's steps: the same operations, fewer calls
            h = step.decoder_step(self.decoder, x[:, 0], cache, src_keep)[:, None]
        else:
            h = self.decoder(x, memory, src_keep, self_keep, is_causal, cache, weights)
        if cache is not None:
            cache.length += T
        return self.project(h) if project else h

    def project(self, h: Tensor) -> Tensor:
        """Pre-softmax linear transformation (tied to the target embedding by default)."""
        return kernels.inference_linear(h, self.output_weight, self.out_bias)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Shape: src (B, S), tgt_in (B, T) -> logits (B, T, tgt_vocab)."""
        src_keep = src.ne(self.cfg.pad_id)
        memory = self.encode(src, src_keep)
        return self.decode(tgt_in, memory, src_keep)

    def loss(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor, label_smoothing: float = 0.0, reduction: str = "mean",
             packing: LossPacking | None = None) -> Tensor:
        """Training loss: cross-entropy (with label smoothing, Section 5.4) over real target tokens.

        Equal to `F.cross_entropy(forward(src, tgt_in) over (B*T), tgt_out, ignore_index=pad_id,
        label_smoothing=...)` for right-padded batches, but faster: the position-wise layers run on
        real tokens only (`Packed`), and the vocabulary projection and softmax only where `tgt_out`
        is not padding. `reduction` is "mean" (over real tokens), "sum" or "none" (one loss per
        real target token, in the order of `tgt_out[tgt_out != pad]`). `packing`: where the real
        tokens are (`LossPacking.of` these tensors), found on the host by collate; else found here.

        Shape: src (B, S), tgt_in (B, T), tgt_out (B, T) -> scalar float32 ((N,) for "none").
        """
        p = LossPacking.of(src, tgt_in, tgt_out, self.cfg.pad_id) if packing is None else packing
        src_keep = src.ne(self.cfg.pad_id)  # (B, S)
        memory = self.encoder(p.src.pack(self.embed(src, self.src_embed)), src_keep, packed=p.src)  # (N_src, d)
        x = p.tgt.pack(self.embed(tgt_in, self.tgt_embed))  # (N_tgt, d)
        h = self.decoder(x, memory, src_keep, None, tgt_in.size(1) > 1, packed=p.tgt, mem_packed=p.src)
        h, labels = p.targets(h, tgt_out)  # (N, d), (N,): N = real target tokens
        logits = self.project(h)  # (N, V)
        # The softmax in float32 (bf16 has too few mantissa bits for ~10^4 classes), fused with the loss.
        losses = kernels.smoothed_cross_entropy(logits, labels, label_smoothing)  # (N,)
        reduce: dict[str, Callable[[Tensor], Tensor]] = {"mean": Tensor.mean, "sum": Tensor.sum, "none": lambda t: t}
        if reduction not in reduce:
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', not {reduction!r}")
        return reduce[reduction](losses)

    def attention_weights(self, src: Tensor, tgt_in: Tensor, kinds: Sequence[str] = ("encoder", "decoder_self", "cross")
                          ) -> dict[str, list]:
        """Attention probabilities per kind, lists over layers of (B, H, T_q, T_k); only `kinds` are computed."""
        src_keep = src.ne(self.cfg.pad_id)
        enc: list[Tensor] = []
        dec: dict[str, list] = {k: [] for k, kind in (("self", "decoder_self"), ("cross", "cross")) if kind in kinds}
        memory = self.encode(src, src_keep, weights=enc if "encoder" in kinds else None)
        self.decode(tgt_in, memory, src_keep, tgt_keep=tgt_in.ne(self.cfg.pad_id), weights=dec)
        return {"encoder": enc, "decoder_self": dec.get("self", []), "cross": dec.get("cross", [])}
