"""A tiny trained de->en checkpoint for the server's tests: word-by-word translation of a toy
vocabulary, learnt in a few seconds, so translations are real words and attention is near-diagonal.

Saved once per test session under pytest's base temporary folder and reused by every serve test file."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from aiayn.checkpoint import save_checkpoint
from aiayn.config import preset
from aiayn.model import Transformer
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, TokenizerPair

DE_EN = {"ein": "a", "Mann": "man", "Frau": "woman", "Hund": "dog", "Kind": "child", "läuft": "runs",
         "spielt": "plays", "sitzt": "sits", "auf": "on", "der": "the", "Straße": "street", "im": "in the",
         "Park": "park", "mit": "with", "Ball": "ball", "rot": "red", "blau": "blue", "und": "and"}


def sentence(rng: random.Random) -> tuple[str, str]:
    words = [rng.choice(list(DE_EN)) for _ in range(rng.randint(2, 7))]
    return " ".join(words), " ".join(DE_EN[w] for w in words)


def _batch(pairs: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    S = max(len(s) for s, _ in pairs)
    T = max(len(t) for _, t in pairs) + 1
    src = torch.full((len(pairs), S), PAD_ID)
    tgt_in = torch.full((len(pairs), T), PAD_ID)
    tgt_out = torch.full((len(pairs), T), PAD_ID)
    for i, (s, t) in enumerate(pairs):
        src[i, :len(s)] = torch.tensor(s)
        tgt_in[i, :len(t) + 1] = torch.tensor([BOS_ID] + t)
        tgt_out[i, :len(t) + 1] = torch.tensor(t + [EOS_ID])
    return src, tgt_in, tgt_out


def train_tiny(path: Path, steps: int = 600, reverse: bool = False) -> Path:
    """de->en, or en->de with `reverse` (a second pair for the servers of several models)."""
    rng = random.Random(0)
    corpus = [sentence(rng) for _ in range(2000)]
    if reverse:
        corpus = [(t, s) for s, t in corpus]
    tok = Tokenizer.train([s for pair in corpus for s in pair], 360)
    torch.manual_seed(0)
    cfg = preset("tiny", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, max_positions=64)
    model = Transformer(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    data = [(tok.encode(s), tok.encode(t)) for s, t in corpus]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in range(steps):
            src, tgt_in, tgt_out = _batch(rng.sample(data, 32))
            loss = model.loss(src, tgt_in, tgt_out)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    save_checkpoint(path, model.eval(), TokenizerPair(tok, tok, joint=True),
                    {"train": {"src": "en" if reverse else "de", "tgt": "de" if reverse else "en"}, "step": steps})
    return path


def tiny_checkpoint(base: Path, reverse: bool = False) -> Path:
    """The session's de->en checkpoint, or its en->de twin (each trained on first use)."""
    path = base / ("serve-tiny-en-de" if reverse else "serve-tiny") / "best"
    if not (path / "config.json").is_file():
        train_tiny(path, reverse=reverse)
    return path
