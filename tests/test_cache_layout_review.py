"""Search's cross-attention over its cache in the layouts `kernels.ONE_QUERY_KEYS_FIRST` and
`cache.VALUES_BY_DIM` choose, at the edges: sources without a token (no keys at all) decode as they
do with both flags off, on the Python step and on the compiled ones."""

import pytest
import torch

from aiayn import cache, kernels, step
from aiayn.config import preset
from aiayn.model import Transformer
from aiayn.search import beam_search, greedy_search

V = 30


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add waiting on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _flags(monkeypatch, on: bool) -> None:
    monkeypatch.setattr(kernels, "ONE_QUERY_KEYS_FIRST", on)
    monkeypatch.setattr(cache, "VALUES_BY_DIM", on)


@pytest.mark.parametrize("masked", [False, True])
def test_one_query_over_no_keys_scores_as_before(monkeypatch, masked):
    """One query per head over 0 keys: the masked `k @ q` sizes its mask as (B*H, 0, 1) without
    a view's -1, which 0 elements leave ambiguous; the compiled `attend` alike."""
    B, H, dh = 3, 2, 8
    q, k, v = torch.randn(B, H, 1, dh), torch.randn(B, H, 0, dh), torch.randn(B, H, 0, dh)
    mask = torch.ones(B, 1, 1, 0, dtype=torch.bool) if masked else None
    _flags(monkeypatch, True)
    got, _ = kernels.attention(q, k, v, mask, False, 0.0, False)
    _flags(monkeypatch, False)
    want, _ = kernels.attention(q, k, v, mask, False, 0.0, False)
    assert got.shape == (B, H, 1, dh) and torch.equal(got, want)
    unit = step.compiled_step()
    if unit and hasattr(unit, "attend"):
        bias = None if mask is None else kernels._mask_bias(mask, B, H, torch.float32)
        compiled = unit.attend(q, k, v, bias, dh ** -0.5, kernels.SHORT_ROW, kernels.SHORT_ROWS_MIN,
                               kernels.SMALL_BMM, True)
        assert torch.equal(compiled, want)


@pytest.mark.parametrize("kind", ["python step", "float32", "int8"])
def test_sources_without_a_token_decode_as_with_the_old_layouts(monkeypatch, kind):
    """A batch of sources of no token, (B, 0): greedy, beam and uncached greedy give what they give
    with both flags off, on the Python step (a trainable model) and on the compiled float32 and
    int8 steps, which run every cached step here."""
    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=V, tgt_vocab_size=V)).eval()
    if kind != "python step":
        model.requires_grad_(False)
    if kind == "int8":
        if kernels.int8_unavailable() is not None:
            pytest.skip("no FBGEMM int8 kernels in this torch")
        kernels.quantize_int8(model)
    ran: list[int] = []
    run = step._StepPlan.run
    monkeypatch.setattr(step._StepPlan, "run", lambda *a: (ran.append(1), run(*a))[1])
    src = torch.zeros(2, 0, dtype=torch.long)
    _flags(monkeypatch, True)

    def searches():
        return (greedy_search(model, src, 1, 2, max_len_b=4, min_len=3),
                beam_search(model, src, 1, 2, beam=2, nbest=2, max_len_b=4, min_len=3),
                greedy_search(model, src, 1, 2, max_len_b=4, min_len=3, use_cache=False))

    got = searches()
    assert bool(ran) == (kind != "python step")
    _flags(monkeypatch, False)
    want = searches()
    assert got[0] == want[0] and got[2] == want[2] and len(got[0]) == 2
    for g, w in zip(got[1], want[1], strict=True):
        assert [t for t, _ in g] == [t for t, _ in w]
        assert [s for _, s in g] == pytest.approx([s for _, s in w], abs=1e-5)
