"""A reference model on `torch.nn.Transformer` that takes aiayn's weights (tests and benchmarks).

It shares aiayn's embedding, positional encoding and output projection, so that any difference in
logits comes from the encoder/decoder stacks. nn.Transformer's masks use the opposite polarity
(True = blocked); the conversion happens here, at the boundary.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from aiayn.model import Transformer


class TorchReference(nn.Module):
    def __init__(self, model: Transformer) -> None:
        super().__init__()
        cfg = model.cfg
        self.cfg, self.model = cfg, model

        def layer(kind):  # type: ignore[no-untyped-def]
            return kind(
                cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.dropout, cfg.activation,
                layer_norm_eps=cfg.layer_norm_eps, batch_first=True, norm_first=cfg.norm_first,
            )

        norm = (lambda: nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)) if cfg.norm_first else (lambda: None)
        self.tf = nn.Transformer(
            cfg.d_model, cfg.n_heads, batch_first=True,
            custom_encoder=nn.TransformerEncoder(layer(nn.TransformerEncoderLayer), cfg.encoder_layers, norm=norm(),
                                                 enable_nested_tensor=False),
            custom_decoder=nn.TransformerDecoder(layer(nn.TransformerDecoderLayer), cfg.decoder_layers, norm=norm()),
        )
        for mha in self.modules():  # attention dropout as in aiayn (nn.Transformer reuses `dropout`)
            if isinstance(mha, nn.MultiheadAttention):
                mha.dropout = cfg.attention_dropout
        for one in [*self.tf.encoder.layers, *self.tf.decoder.layers]:
            # nn's layers also apply `dropout` inside the feed-forward network, after the activation;
            # aiayn applies `activation_dropout` there (0 by default: none, and no work for it)
            one.dropout = nn.Dropout(cfg.activation_dropout) if cfg.activation_dropout else nn.Identity()
        self.copy_weights()

    @torch.no_grad()
    def copy_weights(self) -> None:
        m, tf = self.model, self.tf
        for ours, theirs in zip(m.encoder.layers, tf.encoder.layers):
            theirs.self_attn.in_proj_weight.copy_(ours.self_attn.qkv_proj.weight)
            theirs.self_attn.in_proj_bias.copy_(ours.self_attn.qkv_proj.bias)
            self._common(ours, theirs, ("norm1", "norm2"))
        for ours, theirs in zip(m.decoder.layers, tf.decoder.layers):
            theirs.self_attn.in_proj_weight.copy_(ours.self_attn.qkv_proj.weight)
            theirs.self_attn.in_proj_bias.copy_(ours.self_attn.qkv_proj.bias)
            theirs.multihead_attn.in_proj_weight.copy_(torch.cat([ours.cross_attn.q_proj.weight, ours.cross_attn.kv_proj.weight]))
            theirs.multihead_attn.in_proj_bias.copy_(torch.cat([ours.cross_attn.q_proj.bias, ours.cross_attn.kv_proj.bias]))
            theirs.multihead_attn.out_proj.load_state_dict(ours.cross_attn.out_proj.state_dict())
            self._common(ours, theirs, ("norm1", "norm2", "norm3"))
        if m.cfg.norm_first:
            tf.encoder.norm.load_state_dict(m.encoder.norm.state_dict())
            tf.decoder.norm.load_state_dict(m.decoder.norm.state_dict())

    @staticmethod
    def _common(ours, theirs, norms) -> None:  # type: ignore[no-untyped-def]
        theirs.self_attn.out_proj.load_state_dict(ours.self_attn.out_proj.state_dict())
        theirs.linear1.load_state_dict(ours.ff.w1.state_dict())
        theirs.linear2.load_state_dict(ours.ff.w2.state_dict())
        for n in norms:
            getattr(theirs, n).load_state_dict(getattr(ours, n).state_dict())

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        m = self.model
        src_pad, tgt_pad = src.eq(self.cfg.pad_id), tgt_in.eq(self.cfg.pad_id)  # True = blocked
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.size(1), dtype=torch.bool, device=src.device)
        h = self.tf(
            m.embed(src, m.src_embed), m.embed(tgt_in, m.tgt_embed),
            tgt_mask=causal, src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad, tgt_is_causal=True,
        )
        return m.project(h)


def count_weight_requests(monkeypatch) -> list[bool]:
    """From now on, `need_weights` of every `aiayn.kernels.attention` call, in order (a spy)."""
    import aiayn.kernels

    calls: list[bool] = []
    attention = aiayn.kernels.attention

    def counted(q, k, v, mask, is_causal, p, training, need_weights=False, bias=None):
        calls.append(need_weights)
        return attention(q, k, v, mask, is_causal, p, training, need_weights, bias)

    monkeypatch.setattr(aiayn.kernels, "attention", counted)
    return calls
