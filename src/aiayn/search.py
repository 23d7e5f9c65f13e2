"""Decoding: greedy search on the model's `encode`/`decode` with the key/value cache."""

from __future__ import annotations

import torch
from torch import Tensor

from aiayn.model import Transformer


@torch.no_grad()
def greedy_search(model: Transformer, src: Tensor, bos_id: int, eos_id: int, max_len_a: float = 1.0,
                  max_len_b: int = 50) -> list[list[int]]:
    """Greedy search for a batch of right-padded sources (B, S); returns token ids without BOS/EOS.

    At most `max_len_a * source_length + max_len_b` tokens per sentence.
    """
    src_keep = src.ne(model.cfg.pad_id)
    lengths = src_keep.sum(1)
    limit = (lengths.float() * max_len_a + max_len_b).long()  # (B,)
    memory = model.encode(src, src_keep)
    cache = model.new_cache(memory, src_keep)
    B = src.size(0)
    alive = torch.arange(B, device=src.device)  # original row of each live hypothesis
    tokens = torch.full((B, 1), bos_id, dtype=torch.long, device=src.device)
    out: list[list[int]] = [[] for _ in range(B)]
    for step in range(int(limit.max().item()) if B else 0):
        next_tok = model.decode(tokens[:, -1:], None, cache=cache)[:, -1].argmax(-1)  # (b,)
        done = next_tok.eq(eos_id) | limit[alive].le(step + 1)
        for row, tok, d in zip(alive.tolist(), next_tok.tolist(), done.tolist()):
            if tok != eos_id:
                out[row].append(tok)
        if bool(done.all()):
            break
        if bool(done.any()):  # finished sentences leave the batch and stop costing compute
            keep = (~done).nonzero().squeeze(1)
            cache.reorder(keep)
            alive, next_tok, tokens = alive[keep], next_tok[keep], tokens[keep]
        tokens = torch.cat([tokens, next_tok[:, None]], dim=1)
    return out
