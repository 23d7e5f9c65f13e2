"""A small model trained in seconds on a synthetic task: translate words through a fixed lexicon,
in reverse order. Its translations are confident, as a real model's are, so exports and int8
copies can be held to choosing the same tokens (tests/test_export.py, tests/test_int8.py), except
CTranslate2's int8 on CPUs without VNNI (`ct2_int8_drifts`)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from aiayn.checkpoint import save_checkpoint
from aiayn.config import preset
from aiayn.data.text import collate
from aiayn.model import Transformer
from aiayn.tokenizer import EOS_ID, PAD_ID, Tokenizer, TokenizerPair

SRC = "a dog cat man woman runs jumps red blue big small the in on park street ball plays with girl boy sits".split()
TGT = ("ein hund katze mann frau rennt springt rot blau gross klein der im auf park strasse ball spielt mit "
       "maedchen junge sitzt").split()
LEXICON = dict(zip(SRC, TGT))


def ct2_int8_drifts() -> bool:
    """Whether CTranslate2's int8 may stray from its fp32 on this CPU. Without VNNI it adds pairs of
    u8 x s8 products in saturating 16 bits on 8-bit weights (aiayn keeps 7-bit weights for this;
    docs/speed.md), so its translations come out close to fp32's rather than equal (an AVX2-only
    AMD Zen 3: 9 of 16 sentences identical, chrF 88 against fp32's). Equality is expected only
    where it was seen: AVX-512 VNNI (AVX-VNNI CPUs have not been measured)."""
    info = Path("/proc/cpuinfo")
    return not (info.exists() and "avx512_vnni" in info.read_text().split())


def pairs(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """n (source, target) sentences of 2-9 words."""
    out = []
    for _ in range(n):
        s = [rng.choice(SRC) for _ in range(rng.randint(2, 9))]
        out.append((" ".join(s), " ".join(LEXICON[w] for w in reversed(s))))
    return out


def reference(line: str) -> str:
    """The right translation of a source line."""
    return " ".join(LEXICON[w] for w in reversed(line.split()))


def train(out: Path, d_model: int, d_ff: int, steps: int, lr: float, n_lines: int,
          train_meta: dict[str, Any]) -> tuple[Transformer, TokenizerPair, list[str]]:
    """Train on one thread (seeded), save the checkpoint to `out`; the model (eval), its tokenizers
    and `n_lines` held-out source lines. The source ends with EOS, as aiayn trains it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        rng = random.Random(0)
        data = pairs(rng, 3000)
        tok = Tokenizer.train([s for s, _ in data] + [t for _, t in data], 400)
        pair = TokenizerPair(tok, tok, joint=True)
        V = tok.vocab_size
        examples = [(tok.encode(s) + [EOS_ID], tok.encode(t)) for s, t in data]
        cfg = preset("tiny", src_vocab_size=V, tgt_vocab_size=V, d_model=d_model, d_ff=d_ff, max_positions=128)
        model = Transformer(cfg)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        for _ in range(steps):
            b = collate(examples, rng.sample(range(len(examples)), 64))
            loss = F.cross_entropy(model(b.src, b.tgt_in).flatten(0, 1), b.tgt_out.flatten(), ignore_index=PAD_ID)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        save_checkpoint(out, model, pair, {"train": train_meta, "step": steps})
        return model, pair, [s for s, _ in pairs(random.Random(1), n_lines)]
    finally:
        torch.set_num_threads(threads)
