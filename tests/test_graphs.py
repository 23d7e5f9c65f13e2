"""Search's decoder step on fixed-size buffers (`aiayn.graphs`), run here without capture: the same
steps that a GPU replays as CUDA graphs must compute what the eager step computes, through beam
search's reorders, sentences leaving the batch and the buffers growing. tests/test_cuda.py checks
the captured graphs on a GPU."""

from __future__ import annotations

import copy

import pytest
import torch

from aiayn import graphs
from aiayn.config import preset
from aiayn.copytask import BOS, EOS, make_batch, train_copy
from aiayn.model import Transformer
from aiayn.search import beam_search, greedy_search

V = 300


@pytest.fixture()
def on_cpu(monkeypatch):
    monkeypatch.setitem(graphs.ENABLED, "cpu", True)


def random_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = preset("tiny", src_vocab_size=V, tgt_vocab_size=V, dropout=0.0)
    return Transformer(cfg).eval().requires_grad_(False)


def sources(n: int = 10, seed: int = 1) -> torch.Tensor:
    """Right-padded sources of 3..19 tokens. Shape: (n, S)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 20, (n,), generator=g)
    src = torch.zeros(n, int(lengths.max()), dtype=torch.long)
    for i, n_i in enumerate(lengths.tolist()):
        src[i, :n_i] = torch.randint(4, V, (n_i,), generator=g)
    return src


def run_steps(model: Transformer, src: torch.Tensor, steps: int, beam: int, seed: int = 2) -> list[torch.Tensor]:
    """Teacher-forced decoder steps on the cache with beam search's moves: the first step one row per
    sentence, then `beam` rows with random parents, and sentences leaving at steps 7 and 21.
    Returns each step's hidden states."""
    g = torch.Generator().manual_seed(seed)
    keep = src.ne(0)
    outs = []
    with torch.inference_mode():
        cache = model.new_cache(model.encode(src, keep), keep)
        n, R = src.size(0), 1
        for t in range(steps):
            tokens = torch.randint(4, V, (n * R, 1), generator=g)
            outs.append(model.decode(tokens, None, cache=cache, project=False)[:, 0].clone())
            if t in (7, 40):
                n -= 3  # the last three sentences are done
            parents = torch.randint(0, R, (n, beam), generator=g) + torch.arange(n)[:, None] * R
            cache.reorder(parents.view(-1), beam=beam)
            R = beam
    return outs


@pytest.mark.parametrize("beam", [1, 4])
def test_graph_steps_compute_the_eager_steps(on_cpu, monkeypatch, beam):
    """70 steps (the first eager, then buffers of 32, 64 and 128 positions), with reorders and
    sentences leaving: each step's hidden states within 1e-5 of the eager step's, and the graphs
    were used."""
    model, src = random_model(), sources()
    got = run_steps(model, src, 70, beam)
    shapes = {(k.group, k.capacity) for k in graphs.for_model(model).graphs}
    assert shapes == {(beam, 32), (beam, 64), (beam, 128)}
    monkeypatch.setitem(graphs.ENABLED, "cpu", False)
    want = run_steps(random_model(), src, 70, beam)
    for t, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, t
        assert (a - b).abs().max().item() < 1e-5, t


@pytest.fixture(scope="module")
def copy_model() -> Transformer:
    model, accuracy = train_copy(steps=400, seed=0)
    assert accuracy > 0.9
    return model.requires_grad_(False)


def test_searches_on_graphs_give_the_eager_searches_tokens(on_cpu, monkeypatch, copy_model):
    """Greedy and beam 4 (4-best) on a trained model: the same tokens as the eager searches, scores
    within 1e-5."""
    src, _, _ = make_batch(torch.Generator().manual_seed(7), 48, 13, 10, False)
    model = copy.deepcopy(copy_model)
    greedy, beam = greedy_search(model, src, BOS, EOS), beam_search(model, src, BOS, EOS, 4, 0.6, nbest=4)
    assert graphs.for_model(model).graphs, "no graph was used"
    monkeypatch.setitem(graphs.ENABLED, "cpu", False)
    assert greedy == greedy_search(copy_model, src, BOS, EOS)
    want = beam_search(copy_model, src, BOS, EOS, 4, 0.6, nbest=4)
    assert [[h[0] for h in s] for s in beam] == [[h[0] for h in s] for s in want]
    assert max(abs(a[1] - b[1]) for s, w in zip(beam, want) for a, b in zip(s, w)) < 1e-5


def test_a_graph_held_by_one_search_leaves_another_on_the_eager_step(on_cpu, monkeypatch):
    """Two searches stepping in turn on one model: the first holds the graph, the second goes on
    without it, and both compute what they compute alone."""
    model, src = random_model(), sources(n=6)

    def start():
        keep = src.ne(0)
        return model.new_cache(model.encode(src, keep), keep)

    tokens = torch.randint(4, V, (6, 12), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        a, b = start(), start()
        both = [(model.decode(tokens[:, t:t + 1], None, cache=a, project=False).clone(),
                 model.decode(tokens[:, t:t + 1], None, cache=b, project=False).clone()) for t in range(12)]
        alone = start()
        solo = [model.decode(tokens[:, t:t + 1], None, cache=alone, project=False).clone() for t in range(12)]
    for (x, y), z in zip(both, solo):
        assert (x - z).abs().max() < 1e-5 and (y - z).abs().max() < 1e-5


def test_no_graph_under_autocast_in_training_with_autograd_or_unfrozen_weights(on_cpu):
    model, src = random_model(), sources(n=4)
    keep = src.ne(0)

    def steps() -> None:  # the first step always runs eagerly: three steps
        cache = model.new_cache(model.encode(src, keep), keep)
        for _ in range(3):
            model.decode(torch.full((4, 1), BOS), None, cache=cache)

    with torch.no_grad():  # outside inference mode
        steps()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        steps()
    model.train()
    with torch.inference_mode():
        steps()
    model.eval().requires_grad_(True)  # a model being trained (as validation searches it): its weights not frozen
    with torch.inference_mode():
        steps()
    assert not graphs.for_model(model).graphs
    model.requires_grad_(False)
    with torch.inference_mode():
        steps()
    assert graphs.for_model(model).graphs
