"""The fast decoding path: the beam-shared cross-attention cache, the growing self-attention
buffer, and inference linears on packed weights that follow every change of the weights."""

import copy

import pytest
import torch
import torch.nn.functional as F

from aiayn import cache as cache_module
from aiayn import kernels, step
from aiayn.config import preset
from aiayn.kernels import inference_linear
from aiayn.model import Transformer
from aiayn.search import beam_search, greedy_search

V = 30


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add waiting on a busy machine (10x slower seen)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(preset("tiny", src_vocab_size=V, tgt_vocab_size=V)).eval()


def sources() -> torch.Tensor:
    src = torch.randint(4, V, (3, 5), generator=torch.Generator().manual_seed(3))
    src[1, 3:] = 0  # padding
    return src


def test_beam_rows_share_cross_attention_and_match_uncached_decoding():
    model, src = tiny(), sources()
    K, steps = 4, 40
    tgt = torch.randint(4, V, (3 * K, steps), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        keep = src.ne(0)
        memory = model.encode(src, keep)
        cache = model.new_cache(memory, keep)
        cache.reorder(torch.arange(3).repeat_interleave(K), beam=K)  # K rows per sentence, as beam search
        assert cache.beam == K and cache.layers[0].cross_k.size(0) == 3  # one copy per sentence
        cross = cache.layers[0].cross_k
        perm = torch.tensor([1, 0, 3, 2])  # beams swap inside every sentence: no source-side copy
        order = (torch.arange(3).repeat_interleave(K) * K).view(3, K) + perm
        hist = torch.zeros(3 * K, 0, dtype=torch.long)
        got = []
        for t in range(steps):
            got.append(model.decode(tgt[:, t : t + 1], None, cache=cache)[:, -1])
            hist = torch.cat([hist, tgt[:, t : t + 1]], 1)
            if t == 35:
                cache.reorder(order.view(-1))
                hist = hist[order.view(-1)]
                got = [g[order.view(-1)] for g in got]
        assert cache.layers[0].cross_k is cross
        rows = torch.arange(3).repeat_interleave(K)
        full = model.decode(hist, memory[rows], keep[rows])  # (3K, steps, V)
        assert torch.allclose(torch.stack(got, 1), full, atol=1e-4)

        # the second sentence leaves: its source side is dropped, the rest still decodes exactly
        kept = torch.cat([torch.arange(K), torch.arange(2 * K, 3 * K)])
        cache.reorder(kept)
        assert cache.layers[0].cross_k.size(0) == 2 and cache.src_keep.size(0) == 2
        nxt = torch.randint(4, V, (2 * K, 1))
        step = model.decode(nxt, None, cache=cache)[:, -1]
        want = model.decode(torch.cat([hist[kept], nxt], 1), memory[rows[kept]], keep[rows[kept]])[:, -1]
        assert torch.allclose(step, want, atol=1e-4)


def test_inference_linear_packs_frozen_weights_only_and_follows_their_updates():
    model = tiny()
    lin = model.decoder.layers[0].ff.w1
    x = torch.randn(7, lin.in_features)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)  # updates without a version bump
    for _ in range(2):  # trainable weights: plain F.linear even under no_grad, never a stale copy
        with torch.no_grad():
            assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
        model.train()
        model.loss(sources(), sources(), sources()).backward()
        opt.step()
        model.eval()
    assert id(lin.weight) not in kernels._PACKED  # trainable: never packed
    model.requires_grad_(False)
    with torch.no_grad():
        before = lin(x)
        if kernels._PACKING[torch.float32]:  # a frozen weight is packed (where oneDNN can), once
            assert id(lin.weight) in kernels._PACKED, "a frozen weight took the unpacked path"
            packed = kernels._PACKED[id(lin.weight)][2]
            lin(x)
            assert kernels._PACKED[id(lin.weight)][2] is packed
        assert torch.allclose(before, F.linear(x, lin.weight, lin.bias), atol=1e-5)
        assert torch.allclose(model.project(x[:, :32]), x[:, :32] @ model.output_weight.t(), atol=1e-5)
        fused = inference_linear(x - 0.5, lin.weight, lin.bias, relu=True)
        assert torch.allclose(fused, F.relu(F.linear(x - 0.5, lin.weight, lin.bias)), atol=1e-5)
        assert fused.eq(0).any()
    model.load_state_dict(tiny(seed=5).state_dict())  # in place: the packed copy is rebuilt
    with torch.no_grad():
        after = lin(x)
        if kernels._PACKING[torch.float32]:
            assert kernels._PACKED[id(lin.weight)][2] is not packed
        assert not torch.allclose(before, after)
        assert torch.allclose(after, F.linear(x, lin.weight, lin.bias), atol=1e-5)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # computes in the autocast dtype
            y = inference_linear(x, lin.weight, lin.bias)
        assert y.dtype == torch.bfloat16
        assert torch.allclose(y.float(), after, atol=0.05)
    copy.deepcopy(model)  # nothing opaque is stored on the module


@pytest.mark.parametrize("beam", [2, 4])
def test_beam_search_is_unchanged_by_grad_mode(beam):
    """Frozen (packed weights) and trainable (F.linear, autograd through the cache): same results."""
    model, src = tiny(), sources()
    model.requires_grad_(False)
    fast = beam_search(model, src, 2, 3, beam=beam, nbest=beam, max_len_b=6)
    with torch.enable_grad():
        model.requires_grad_(True)
        plain = beam_search.__wrapped__(model, src, 2, 3, beam=beam, nbest=beam, max_len_b=6)  # type: ignore[attr-defined]
    assert [[t for t, _ in h] for h in fast] == [[t for t, _ in h] for h in plain]


def test_rows_move_in_place_when_few_move_and_give_the_selection_whatever_it_is():
    from aiayn.cache import _keep_rows, moves

    def mv(idx, rows):
        m = moves(torch.tensor(idx), rows)
        return None if m is None else (m[0].tolist(), m[1].tolist())

    assert mv([0, 4, 2], 5) == ([1], [4])  # row 1 left, the last row takes its place
    assert mv([0, 1, 2], 5) == ([], [])  # the last rows left
    assert mv([0, 2, 3], 4) is None  # most rows move up: a copy is cheaper
    assert mv([1, 0], 2) is None
    assert mv([0, 1, 2], 2) is None  # more rows than there are
    g = torch.Generator().manual_seed(2)
    for _ in range(100):  # any selection, duplicates and swaps too, done in place equals the copy
        rows = int(torch.randint(1, 9, (1,), generator=g))
        idx = torch.randint(0, rows, (int(torch.randint(1, rows + 1, (1,), generator=g)),), generator=g)
        dst = idx.ne(torch.arange(idx.numel())).nonzero().squeeze(1)
        x = torch.randn(rows, 3, generator=g)
        want = x[idx]
        assert torch.equal(_keep_rows(x, idx, (dst, idx[dst])), want)


def _cache_after_a_step():
    """A tiny model's cache of 4 sentences after one step, made under inference mode (as search makes it)."""
    model = tiny()
    src = torch.randint(4, V, (4, 5), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        keep = src.ne(0)
        cache = model.new_cache(model.encode(src, keep), keep)
        model.decode(torch.full((4, 1), 5), None, cache=cache)
    return cache


def test_a_cache_made_in_inference_mode_is_reordered_outside_it_by_a_copy():
    from aiayn.search import _survivors

    cache = _cache_after_a_step()
    rows = _survivors(torch.tensor([False, True, False, False]))  # [0, 3, 2]: row 3 moves in place
    cross = cache.layers[0].cross_k.clone()
    with torch.no_grad():
        cache.reorder(rows)
    assert torch.equal(cache.layers[0].cross_k, cross[rows])


@pytest.mark.parametrize("in_place", [True, False])
def test_cross_attention_values_keep_their_layout_when_sentences_leave(in_place):
    """The cache keeps the cross-attention values dimension by dimension on the CPU (`VALUES_BY_DIM`):
    a reorder, in place (inference mode) or by a copy (outside it), selects the sentences and keeps
    that layout, which the next step then reads as it is."""
    from aiayn.search import _survivors

    cache = _cache_after_a_step()
    rows = _survivors(torch.tensor([False, True, False, False]))  # [0, 3, 2]
    values = cache.layers[0].cross_v.clone()
    with torch.inference_mode() if in_place else torch.no_grad():
        cache.reorder(rows)
    got = cache.layers[0].cross_v
    assert torch.equal(got, values[rows]) and got.transpose(-1, -2).is_contiguous()


def test_greedy_survivors_keep_the_live_rows_and_fill_each_place_from_the_end():
    from aiayn.search import _survivors

    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        done = torch.rand(int(torch.randint(1, 12, (1,), generator=g)), generator=g) < 0.4
        keep = _survivors(done)
        n = keep.numel()
        assert sorted(keep.tolist()) == (~done).nonzero().squeeze(1).tolist()
        stay = ~done[:n]
        assert torch.equal(keep[stay], torch.arange(n)[stay])  # a live row before the new end stays put


def test_sentences_leaving_a_greedy_cache_move_only_the_rows_that_fill_their_places():
    """The cross-attention keys/values are kept in place (their storage is not copied) and the next
    step is bitwise that of a cache whose source side was copied instead."""
    from aiayn import cache as cache_mod
    from aiayn.search import _survivors

    model = tiny()
    src = torch.randint(4, V, (5, 6), generator=torch.Generator().manual_seed(5))
    src[2, 4:] = 0
    keep_src = src.ne(0)
    tok = torch.randint(4, V, (5, 3), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():  # as search runs: only there are rows moved in place
        memory = model.encode(src, keep_src)
        caches = [model.new_cache(memory, keep_src) for _ in range(2)]
        for c in caches:
            for t in range(2):
                model.decode(tok[:, t:t + 1], None, cache=c)
        rows = _survivors(torch.tensor([False, True, False, True, False]))  # [0, 4, 2]
        before = [c.layers[0].cross_k.data_ptr() for c in caches]
        outs = []
        for c, in_place in zip(caches, (False, True)):
            cache_mod.IN_PLACE = in_place
            try:
                c.reorder(rows)
            finally:
                cache_mod.IN_PLACE = True
            outs.append(model.decode(tok[rows, 2:3], None, cache=c))
        after = [c.layers[0].cross_k.data_ptr() for c in caches]
        assert after[1] == before[1] and after[0] != before[0]  # moved in place; copied
        assert torch.equal(outs[0], outs[1])
        assert torch.equal(caches[1].src_keep, keep_src[rows])


@pytest.mark.parametrize("int8", [False, True])
def test_layers_share_their_spare_buffers_and_decode_as_with_their_own(int8, monkeypatch):
    """A search cache's layers share one pair of spare buffers: L layers hold L + 1 buffers per
    tensor (keys, values), not 2L, and every step's keys stay intact: greedy and beam 3, through
    reorders and rows leaving, give bitwise what a cache whose layers keep spares of their own
    gives (int8 on the compiled step, whose appends get all layers' storage before the first runs;
    fp32 also picks the tokens of decoding without a cache)."""
    from aiayn.search import greedy_search

    torch.manual_seed(1)
    model = Transformer(preset("tiny", src_vocab_size=V, tgt_vocab_size=V, decoder_layers=3)).eval()
    model.requires_grad_(False)
    if int8:
        if kernels.int8_unavailable() is not None:
            pytest.skip("no FBGEMM int8 kernels in this torch")
        kernels.quantize_int8(model)
    made: list = []
    shared_cache = model.new_cache

    def own_spares(*args):
        made.append(shared_cache(*args))
        if own:
            for lc in made[-1].layers:
                lc.spare = [None, None]
        return made[-1]

    monkeypatch.setattr(model, "new_cache", own_spares)
    src = torch.randint(4, V, (4, 6), generator=torch.Generator().manual_seed(5))
    src[2, 4:] = 0
    for search, kw in ((greedy_search, {}), (beam_search, {"beam": 3, "nbest": 3})):
        runs = []
        for own in (False, True):
            with torch.inference_mode():
                runs.append(search(model, src, 2, 3, max_len_b=9, min_len=5, **kw))
            layers = made[-1].layers
            for i in (0, 1):  # keys, values: each layer's storage, and the spare(s)
                held = {t.untyped_storage().data_ptr() for t in [lc.flat[i] for lc in layers] + [lc.spare[i] for lc in layers]
                        if t is not None}
                assert len(held) == (2 if own else 1) * len(layers) + (0 if own else 1)
        assert runs[0] == runs[1]
        if not int8:
            with torch.inference_mode():
                plain = search(model, src, 2, 3, max_len_b=9, min_len=5, use_cache=False, **kw)
            ids = (lambda out: out) if search is greedy_search else (lambda out: [[t for t, _ in h] for h in out])
            assert ids(runs[0]) == ids(plain)


def _appends_of_layers(layers, rows, new, unit):
    """One step's appends for every layer: the compiled step's way (all `room`s first, then each
    layer's `append_kv`, then `appended`) if `unit`, else `LayerCache.append` layer by layer.
    Returns each layer's keys and values as the step reads them, right after its own append."""
    if not unit:
        return [tuple(x.detach().clone() for x in lc.append(k, v)) for lc, (k, v) in zip(layers, new)]
    R, H, T, d = new[0][0].shape
    rooms = [lc.room((R, H, T, d), new[0][0]) for lc in layers]
    pending = layers[0].pending
    out, seen = [], []
    for (old_k, old_v, store_k, store_v), (k, v) in zip(rooms, new):
        out.append((unit.append_kv(old_k, pending, k, store_k), unit.append_kv(old_v, pending, v, store_v)))
        seen.append(tuple(x.clone() for x in out[-1]))  # what that layer's attention reads, before the next layer writes
    for lc, kv in zip(layers, out):
        lc.appended(*kv)
    return seen


@pytest.mark.parametrize("seed", range(40))
def test_layers_sharing_spares_keep_their_keys_through_any_steps(seed):
    """Three layers sharing their spare buffers (`LayerCache`), through random steps: appends in
    place, reorders (rows dropped, duplicated, kept; greedy's in-place moves), several positions at
    once, buffers filling up, the compiled step's order of appends, inference mode or not, autograd.
    Every layer's keys stay exactly index_select + cat, and no buffer is held by two layers."""
    import contextlib
    import random

    from aiayn.cache import DecoderCache, LayerCache

    rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
    unit = step.compiled_step()
    H, d, R = 2, 4, rnd.randint(1, 6)
    spare: list = [None, None]
    layers = [LayerCache(torch.zeros(R, H, 1, d), torch.zeros(R, H, 1, d), spare=spare) for _ in range(3)]
    cache = DecoderCache(layers, torch.ones(R, 1, dtype=torch.bool))
    want: list = [None] * 3
    for s in range(rnd.randint(2, 24)):
        mode = rnd.choice(["inference", "inference", "no_grad", "grad"]) if s else "inference"
        ctx = {"inference": torch.inference_mode(), "no_grad": torch.no_grad()}.get(mode, contextlib.nullcontext())
        with ctx:
            order = None
            if s and R and rnd.random() < 0.5:
                n = rnd.randint(0 if rnd.random() < 0.1 else 1, R + 2)
                order = torch.randint(0, R, (n,), generator=g) if rnd.random() < 0.5 else torch.randperm(R, generator=g)[:n]
                cache.reorder(order)  # greedy's: rows moved in place where few move and every layer can
                R = order.numel()
            compiled = unit if mode != "grad" and rnd.random() < 0.5 else None
            T = 1 if compiled or rnd.random() < 0.7 else rnd.randint(2, 4)
            new = [(torch.randn(R, H, T, d, generator=g), torch.randn(R, H, T, d, generator=g)) for _ in layers]
            if mode == "grad":
                new = [(k.requires_grad_(), v) for k, v in new]
            for i, (k, v) in enumerate(new):
                old = want[i] if want[i] is not None else (torch.zeros(R, H, 0, d),) * 2
                if order is not None and want[i] is not None:
                    old = tuple(x.index_select(0, order) for x in old)
                want[i] = tuple(torch.cat([o, n.detach()], 2) for o, n in zip(old, (k, v)))
            seen = _appends_of_layers(layers, R, new, compiled)
            for i, lc in enumerate(layers):
                assert all(torch.equal(a, b) for a, b in zip(seen[i], want[i])), (s, i, "as read")
                assert torch.equal(lc.self_k.detach(), want[i][0]) and torch.equal(lc.self_v.detach(), want[i][1]), (s, i)
            held = [lc.flat[0].untyped_storage().data_ptr() for lc in layers if lc.flat[0] is not None and lc.flat[0].numel()]
            assert len(held) == len(set(held))
            assert spare[0] is None or spare[0].untyped_storage().data_ptr() not in held


def test_a_cache_of_no_rows_decodes_and_rows_must_match():
    """A batch of no sentences decodes to nothing (as before the time-major cache), and appending
    another number of rows than the cache holds, with no reorder between, is an error rather than
    one row's keys copied to all."""
    from aiayn.cache import LayerCache

    empty = LayerCache(torch.zeros(0, 2, 1, 3), torch.zeros(0, 2, 1, 3))
    for _ in range(3):
        k, v = empty.append(torch.zeros(0, 2, 1, 3), torch.zeros(0, 2, 1, 3))
    assert k.shape == (0, 2, 3, 3)
    one = LayerCache(torch.zeros(1, 2, 1, 3), torch.zeros(1, 2, 1, 3))
    one.append(torch.randn(1, 2, 1, 3), torch.randn(1, 2, 1, 3))
    with pytest.raises(ValueError, match="without a reorder"):
        one.append(torch.randn(3, 2, 1, 3), torch.randn(3, 2, 1, 3))


def test_greedy_moves_rows_of_every_layer_or_of_none():
    """A compiled step passes one selection of rows for all layers, so a reorder moves rows in
    place in every layer or in none: here one layer's buffer was made under inference mode and
    cannot be written outside it, so neither moves (both select at the next append)."""
    from aiayn.cache import DecoderCache, LayerCache

    unit = step.compiled_step()
    if not unit:
        pytest.skip("no compiled step in this torch")
    H, d, g = 2, 3, torch.Generator().manual_seed(0)
    layers = [LayerCache(torch.zeros(3, H, 1, d), torch.zeros(3, H, 1, d), spare=[None, None]) for _ in range(2)]
    cache = DecoderCache(layers, torch.ones(3, 1, dtype=torch.bool))
    want = []
    for i, lc in enumerate(layers):
        steps = [(torch.randn(3, H, 1, d, generator=g), torch.randn(3, H, 1, d, generator=g)) for _ in range(2)]
        with torch.no_grad():
            lc.append(*steps[0])  # the caller's tensors
        with torch.inference_mode() if i else torch.no_grad():
            lc.append(*steps[1])  # the layer's first buffer: an inference tensor in layer 1
        want.append([torch.cat([a, b], 2) for a, b in zip(*steps)])
    order = torch.tensor([2, 1])  # the first sentence finished: the last one takes its place
    with torch.no_grad():
        cache.reorder(order)
        new = [(torch.randn(2, H, 1, d, generator=g), torch.randn(2, H, 1, d, generator=g)) for _ in layers]
        seen = _appends_of_layers(layers, 2, new, unit)
    for (k, v), (wk, wv), (nk, nv) in zip(seen, want, new):
        assert torch.equal(k, torch.cat([wk[order], nk], 2)) and torch.equal(v, torch.cat([wv[order], nv], 2))


def _layout_flags(monkeypatch, on: bool) -> None:
    """`kernels.ONE_QUERY_KEYS_FIRST` and `cache.VALUES_BY_DIM` both on or both off (the layouts before)."""
    monkeypatch.setattr(kernels, "ONE_QUERY_KEYS_FIRST", on)
    monkeypatch.setattr(cache_module, "VALUES_BY_DIM", on)


@pytest.mark.parametrize("kind", ["python step", "float32", "int8"])
def test_sources_without_a_token_decode_as_with_the_old_layouts(monkeypatch, kind):
    """A batch of sources of no token, (B, 0): greedy, beam and uncached greedy give what they give
    with both flags off, on the Python step (a trainable model) and on the compiled float32 and
    int8 steps, which run every cached step here."""
    model = tiny()
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
    _layout_flags(monkeypatch, True)

    def searches():
        return (greedy_search(model, src, 1, 2, max_len_b=4, min_len=3),
                beam_search(model, src, 1, 2, beam=2, nbest=2, max_len_b=4, min_len=3),
                greedy_search(model, src, 1, 2, max_len_b=4, min_len=3, use_cache=False))

    got = searches()
    assert bool(ran) == (kind != "python step")
    _layout_flags(monkeypatch, False)
    want = searches()
    assert got[0] == want[0] and got[2] == want[2] and len(got[0]) == 2
    for g, w in zip(got[1], want[1], strict=True):
        assert [t for t, _ in g] == [t for t, _ in w]
        assert [s for _, s in g] == pytest.approx([s for _, s in w], abs=1e-5)
