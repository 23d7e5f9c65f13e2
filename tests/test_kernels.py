"""The training-side speed paths of `aiayn.kernels` compute what the plain torch calls compute."""

import pytest
import torch
import torch.nn.functional as F

from aiayn import kernels, step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_smoothed_cross_entropy_equals_torchs_loss_and_gradient(dtype, eps):
    torch.manual_seed(0)
    rows = 3 * (kernels._LOSS_BLOCK // 301) + 5  # several row blocks and a partial one
    logits = (4 * torch.randn(rows, 301)).to(dtype).requires_grad_()
    labels = torch.randint(0, 301, (rows,))
    weights = torch.rand(rows)  # a gradient that differs per row
    got = kernels.smoothed_cross_entropy(logits, labels, eps)
    assert got.dtype == torch.float32 and got.shape == (rows,)
    (got * weights).sum().backward()
    ours, logits.grad = logits.grad, None
    want = F.cross_entropy(logits.float(), labels, label_smoothing=eps, reduction="none")
    (want * weights).sum().backward()
    torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-5)
    assert ours.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(ours, logits.grad, **tol)


def test_smoothed_cross_entropy_under_autocast_takes_bf16_logits_and_gives_bf16_gradients():
    torch.manual_seed(0)
    h = torch.randn(40, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (40,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(h, w)
        loss = kernels.smoothed_cross_entropy(logits, labels, 0.1).mean()
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    loss.backward()
    want = F.cross_entropy(logits.float(), labels, label_smoothing=0.1)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    assert h.grad is not None and torch.isfinite(h.grad).all()


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_dropout_zeroes_a_fraction_p_and_scales_the_rest(p):
    torch.manual_seed(0)
    x = torch.rand(1001, 999) + 1.0  # no zeros of its own; an odd element count
    y = kernels.dropout(x, p, training=True)
    dropped = y.eq(0)
    n = x.numel()
    assert abs(dropped.float().mean().item() - p) < 4 * (p * (1 - p) / n) ** 0.5  # within 4 sigma
    keep = 1 - round(p * 2**16) / 2**16  # P(keep), within 2^-17 of 1 - p
    torch.testing.assert_close(y[~dropped], x[~dropped] / keep)  # the expectation is exactly x
    # each quarter of the 64-bit draws is its own coin: no column phase drops more than another
    phases = [dropped.flatten()[i::4].float().mean().item() for i in range(4)]
    assert max(phases) - min(phases) < 0.01


def test_dropout_probability_is_p_to_within_2_to_the_minus_17(monkeypatch):
    # every 16-bit value once: the fraction dropped is exactly round(p * 2^16) / 2^16
    values = torch.arange(-(2**15), 2**15, dtype=torch.int16)
    monkeypatch.setattr(torch.Tensor, "random_", lambda self, *a: self.copy_(values.view(torch.int64)))
    for p in (0.1, 0.3, 0.5):
        y = kernels.dropout(torch.ones(2**16), p, training=True)
        assert y.eq(0).sum().item() == round(p * 2**16)
        assert abs(y.eq(0).float().mean().item() - p) <= 2**-17


def test_dropout_gradient_is_the_mask_times_the_scale():
    torch.manual_seed(0)
    # float32 draws cast to bf16: no exact zeros (torch 2.11's bf16 randn gives ~0.6% of them, and a
    # zero input hides whether it was kept)
    x = torch.randn(64, 33).to(torch.bfloat16).requires_grad_()
    y = kernels.dropout(x, 0.2, training=True)
    y.sum().backward()
    mask = y.detach().ne(0)
    torch.testing.assert_close(x.grad, (mask.to(x.dtype) * (2**16 / (2**16 - round(0.2 * 2**16)))).to(x.dtype))


def test_dropout_is_the_identity_in_eval_and_repeatable_under_a_seed():
    x = torch.randn(10, 10)
    assert kernels.dropout(x, 0.5, training=False) is x
    assert kernels.dropout(x, 0.0, training=True) is x
    torch.manual_seed(3)
    a = kernels.dropout(x, 0.5, training=True)
    torch.manual_seed(3)
    assert torch.equal(a, kernels.dropout(x, 0.5, training=True))
    assert kernels.dropout(x, 1.0, training=True).eq(0).all()


def test_loss_reductions_and_a_wrong_one():
    from aiayn.config import preset
    from aiayn.model import Transformer

    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=30, tgt_vocab_size=30)).eval()
    src = torch.tensor([[5, 6, 7, 3], [8, 9, 3, 0]])
    tgt_in = torch.tensor([[1, 10, 11, 12], [1, 13, 0, 0]])
    tgt_out = torch.tensor([[10, 11, 12, 3], [13, 3, 0, 0]])
    per_token = model.loss(src, tgt_in, tgt_out, label_smoothing=0.1, reduction="none")
    logits = model(src, tgt_in)
    want = F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), label_smoothing=0.1, reduction="none")
    torch.testing.assert_close(per_token, want[tgt_out.flatten() != 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.loss(src, tgt_in, tgt_out, 0.1, "sum"), per_token.sum())
    with pytest.raises(ValueError, match="reduction"):
        model.loss(src, tgt_in, tgt_out, reduction="max")


def test_dropout_near_one_or_out_of_range_behaves_as_torchs():
    x = torch.ones(1000)
    assert kernels.dropout(x, 1 - 1e-12, training=True).eq(0).all()  # not x * 1e12
    with pytest.raises(ValueError):
        kernels.dropout(x, -0.1, training=True)


def test_compiled_code_takes_torchs_own_loss(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels._SmoothedCrossEntropy, "apply", lambda *a: calls.append(a))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    logits = torch.randn(4, 5)
    out = kernels.smoothed_cross_entropy(logits, torch.zeros(4, dtype=torch.long), 0.1)
    assert out.shape == (4,) and not calls


def test_a_gpu_takes_the_loss_in_a_few_large_blocks():
    """Off the CPU a block holds up to 2^28 logits: the base model's 25k tokens x 37k words in 4."""
    gpu, cpu = torch.device("meta"), torch.device("cpu")
    assert len(list(kernels._row_blocks(25_000, 37_000, gpu))) == 4
    assert len(list(kernels._row_blocks(25_000, 37_000, cpu))) == 25_000 // (2**19 // 37_000) + 1


def test_the_loss_in_one_block_equals_torchs(monkeypatch):
    """The GPU's large blocks, here as one block on the CPU: the same loss and gradient as torch's."""
    monkeypatch.setattr(kernels, "_LOSS_BLOCK", 2**40)
    torch.manual_seed(0)
    logits = (4 * torch.randn(500, 301)).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 301, (500,))
    got = kernels.smoothed_cross_entropy(logits, labels, 0.1)
    got.sum().backward()
    ours, logits.grad = logits.grad, None
    want = F.cross_entropy(logits.float(), labels, label_smoothing=0.1, reduction="none")
    want.sum().backward()
    torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ours, logits.grad, rtol=1e-2, atol=1e-3)


def test_second_derivatives_of_the_fused_loss_are_refused_not_wrong():
    logits = torch.randn(3, 7, requires_grad=True)
    loss = kernels.smoothed_cross_entropy(logits, torch.tensor([1, 2, 3]), 0.1).sum()
    (g,) = torch.autograd.grad(loss, logits, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fully_masked_row_gets_uniform_weights_under_autocast(dtype):
    # the additive mask is built in the dtype the scores are computed in: float32 inputs under bf16
    # autocast must not get float32's lowest value, which is -inf in bf16 (NaN weights)
    q, k, v = (torch.randn(2, 2, 3, 4, dtype=dtype) for _ in range(3))
    mask = torch.tensor([[True, False, True], [False, False, False]])[:, None, None, :]  # (B, 1, 1, S)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, w = kernels._explicit_attention(q, k, v, mask, False, 0.0, False)
    assert torch.isfinite(w).all()
    torch.testing.assert_close(w[1].float(), torch.full((2, 3, 3), 1 / 3), atol=4e-3, rtol=0)
    assert w[0, ..., 1].eq(0).all()


def test_attention_in_float64_stays_float64():
    # the float32 softmax is for low precision; float64 weights must not be rounded through it
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 3, 8, dtype=torch.float64) for _ in range(3))
    _, w = kernels._explicit_attention(q, k, v, None, True, 0.0, False)
    want = torch.softmax((q @ k.transpose(-2, -1) / 8**0.5).masked_fill(~torch.ones(3, 3).tril().bool(), -1e300), -1)
    torch.testing.assert_close(w, want, rtol=1e-13, atol=1e-15)


def test_float16_scores_are_scaled_before_they_can_overflow():
    # q.k = 40 * 40 * 64 = 102400 > float16's 65504, while q.k / sqrt(64) = 12800 fits
    q = k = v = torch.full((1, 1, 2, 64), 40.0, dtype=torch.float16)
    for mask in (None, torch.tensor([True, False])[None, None, None, :]):
        out, w = kernels._explicit_attention(q, k, v, mask, False, 0.0, False)
        assert torch.isfinite(w).all() and torch.isfinite(out).all()


def test_dropout_with_a_p_that_16_bit_coins_cannot_hold_is_torchs():
    # round(0.01 * 2^16) / 2^16 is 0.0100098: 0.1% off p, so torch's own dropout runs
    x = torch.ones(10_000)
    torch.manual_seed(3)
    got = kernels.dropout(x, 0.01, training=True)
    torch.manual_seed(3)
    assert torch.equal(got, F.dropout(x, 0.01, training=True))


def test_loss_packing_is_where_the_loss_finds_the_real_tokens_also_for_unlabelled_positions():
    """`LossPacking.of` (run on the host by collate) holds what the loss would find on the device; a
    target position with an input but no label (tgt_out pad) is decoded, not scored; the loss given
    the packing is bitwise the loss that finds it, gradients too."""
    from aiayn.config import preset
    from aiayn.model import Transformer

    src = torch.tensor([[5, 6, 7, 3], [8, 9, 3, 0]])
    tgt_in = torch.tensor([[1, 10, 11, 12], [1, 13, 14, 0]])
    tgt_out = torch.tensor([[10, 11, 12, 3], [13, 3, 0, 0]])  # row 2, position 2: an input, no label
    p = kernels.LossPacking.of(src, tgt_in, tgt_out, 0)
    assert p.src.idx.tolist() == [0, 1, 2, 3, 4, 5, 6] and (p.src.B, p.src.T) == (2, 4)
    assert p.tgt.idx.tolist() == [0, 1, 2, 3, 4, 5, 6] and p.labelled is not None
    assert p.labelled.tolist() == [0, 1, 2, 3, 4, 5]
    assert kernels.LossPacking.of(src, tgt_out, tgt_out, 0).labelled is None  # right-padded: all scored
    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=30, tgt_vocab_size=30)).eval()
    want = F.cross_entropy(model(src, tgt_in).flatten(0, 1), tgt_out.flatten(), label_smoothing=0.1, reduction="none")
    for bf16 in (False, True):  # bitwise in fp32 and under bf16 autocast
        losses, grads = [], []
        for packing in (None, p):
            model.zero_grad()
            with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                loss = model.loss(src, tgt_in, tgt_out, 0.1, "none", packing=packing)
            loss.sum().backward()
            losses.append(loss.detach())
            grads.append([q.grad.clone() for q in model.parameters() if q.grad is not None])
        if not bf16:
            torch.testing.assert_close(losses[1], want[tgt_out.flatten() != 0], rtol=1e-5, atol=1e-5)
        assert torch.equal(losses[0], losses[1]) and all(torch.equal(a, b) for a, b in zip(*grads)), bf16


def test_a_batch_takes_its_packing_to_pinned_memory_and_the_device(monkeypatch):
    from aiayn.data.text import collate

    b = collate([([5, 6], [7]), ([8], [9, 10])], [0, 1])
    assert b.packing is not None
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self) or self.clone())
    p = b.pin_memory().packing
    assert p is not None and len(pinned) == 5  # src, tgt_in, tgt_out and the two index tensors
    assert any(t is b.packing.src.idx for t in pinned) and any(t is b.packing.tgt.idx for t in pinned)
    assert torch.equal(p.tgt.idx, b.packing.tgt.idx)
    moved = b.to("cpu", non_blocking=True).packing
    assert moved is not None and torch.equal(moved.src.idx, b.packing.src.idx)


@pytest.mark.parametrize("shape", [(300, 1, 5), (64, 14, 14), (1024, 1, 1)])
def test_softmax_over_many_short_rows_is_spelled_out_and_equals_torchs(monkeypatch, shape):
    """Rows shorter than a vector register take torch's slow CPU path; `softmax_rows` spells those
    out (when there are many) within rounding of torch's, masked keys (the additive mask's lowest
    value) included, and the compiled step's copy is bitwise it, on either side of the row count."""
    monkeypatch.setattr(kernels, "SHORT_ROW", 16)  # as on AVX-512, whatever this CPU has
    unit = step.compiled_step()  # (before torch.softmax is spied on: TorchScript would compile the spy)
    seen = []
    real = torch.softmax
    monkeypatch.setattr(torch, "softmax", lambda *a, **k: (seen.append(a[0].shape), real(*a, **k))[1])
    x = torch.randn(shape) * 4
    x.view(-1, shape[-1])[::3, -1] = torch.finfo(torch.float32).min  # a masked key in every third row
    x.view(-1, shape[-1])[1::7] = torch.finfo(torch.float32).min  # and rows with every key masked
    got = kernels.softmax_rows(x, torch.float32)
    assert not seen  # spelled out
    want = real(x, -1)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5) and torch.allclose(got.sum(-1), torch.ones(shape[:-1]))
    few = x.reshape(-1, shape[-1])[: kernels.SHORT_ROWS_MIN - 1]
    assert torch.equal(kernels.softmax_rows(few, torch.float32), real(few, -1)) and seen  # too few rows: torch's
    if unit and hasattr(unit, "softmax_rows"):
        for rows in (x, few):
            assert torch.equal(unit.softmax_rows(rows, 16, kernels.SHORT_ROWS_MIN), kernels.softmax_rows(rows, torch.float32))


def test_softmax_rows_of_no_keys_is_empty_as_torchs():
    empty = torch.empty(100, 0)
    assert kernels.softmax_rows(empty, torch.float32).shape == (100, 0)
    unit = step.compiled_step()
    if unit and hasattr(unit, "softmax_rows"):
        assert unit.softmax_rows(empty, 16, 1).shape == (100, 0)


def test_softmax_rows_leaves_long_rows_autograd_and_other_dtypes_to_torch(monkeypatch):
    monkeypatch.setattr(kernels, "SHORT_ROW", 16)
    long = torch.randn(256, 16)
    assert torch.equal(kernels.softmax_rows(long, torch.float32), torch.softmax(long, -1))
    half = torch.randn(256, 5, dtype=torch.bfloat16)
    assert torch.equal(kernels.softmax_rows(half, torch.float32), torch.softmax(half, -1, dtype=torch.float32))
    x = torch.randn(256, 5, requires_grad=True)
    kernels.softmax_rows(x, torch.float32)[:, 0].sum().backward()
    y = x.detach().clone().requires_grad_()
    torch.softmax(y, -1)[:, 0].sum().backward()
    assert torch.equal(x.grad, y.grad)


@pytest.mark.parametrize("shape", [(64, 8, 1, 12, 32), (3, 2, 1, 5, 8), (4, 2, 1, 13, 32), (2, 2, 3, 4, 8), (5, 1, 1, 1, 4)])
def test_the_values_weighed_by_one_query_are_summed_where_bmm_would_loop(shape):
    """One query over fewer than SMALL_BMM key x value products takes torch's scalar bmm loop;
    `weigh_values` multiplies and sums there instead: equal to `p @ v` within rounding, the same
    for strided values (a cache's view), and torch's own result everywhere else."""
    B, H, T, S, dh = shape
    g = torch.Generator().manual_seed(0)
    p = torch.rand(B, H, T, S, generator=g).softmax(-1)
    v = torch.randn(B, H, S + 3, dh, generator=g)[:, :, :S]  # strided, as a view into a buffer
    got = kernels.weigh_values(p, v)
    torch.testing.assert_close(got, p @ v, rtol=1e-6, atol=1e-6)
    spelled = T == 1 and S * dh < kernels.SMALL_BMM
    assert torch.equal(got, p @ v) or spelled  # the other products are torch's, bitwise
    unit = step.compiled_step()
    if unit and hasattr(unit, "attend"):  # the compiled step's attention takes the same branch
        q, k = torch.randn(B, H, T, dh, generator=g), torch.randn(B, H, S, dh, generator=g)
        scores = torch.bmm(q.reshape(B * H, T, dh) * 0.5, k.reshape(B * H, S, dh).transpose(1, 2))
        want = kernels.weigh_values(kernels.softmax_rows(scores, torch.float32).view(B, H, T, S), v)
        assert torch.equal(unit.attend(q, k, v, None, 0.5, kernels.SHORT_ROW, kernels.SHORT_ROWS_MIN,
                                       kernels.SMALL_BMM, False), want)


def _compiled_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
    """The compiled step's `attend` with keys first (float32 settings), or None where this torch compiles none."""
    unit = step.compiled_step()
    if not (unit and hasattr(unit, "attend")):
        return None
    B, H, _, dh = q.shape
    bias = None if mask is None else kernels._mask_bias(mask, B, H, torch.float32)
    return unit.attend(q, k, v, bias, dh ** -0.5, kernels.SHORT_ROW, kernels.SHORT_ROWS_MIN, kernels.SMALL_BMM, True)


@pytest.mark.parametrize("masked", [False, True])
def test_one_query_over_contiguous_keys_scores_as_keys_times_query(monkeypatch, masked):
    """A decoding step's cross-attention (one query per head, keys stored row by row) computes its
    scores as `k @ q` (`_one_query_scores`): equal to `q @ k^T` within rounding, and the compiled
    step's `attend` bitwise equal to the Python path. Time-major keys (a view, as the self-attention
    cache's), several queries, autograd and bf16 keep `q @ k^T`."""
    g = torch.Generator().manual_seed(0)
    B, H, S, dh = 5, 4, 13, 16
    q, k, v = (torch.randn(B, H, n, dh, generator=g) for n in (1, S, S))
    keep = torch.rand(B, S, generator=g) > 0.3
    keep[:, 0] = True
    mask = keep[:, None, None, :] if masked else None
    calls = []
    real = kernels._one_query_scores
    monkeypatch.setattr(kernels, "_one_query_scores", lambda *a: calls.append(1) or real(*a))
    got, _ = kernels.attention(q, k, v, mask, False, 0.0, False)
    assert calls == [1]
    monkeypatch.setattr(kernels, "ONE_QUERY_KEYS_FIRST", False)
    want, _ = kernels.attention(q, k, v, mask, False, 0.0, False)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(kernels, "ONE_QUERY_KEYS_FIRST", True)
    compiled = _compiled_attend(q, k, v, mask)
    assert compiled is None or torch.equal(compiled, got)
    time_major = torch.randn(S, B, H, dh, generator=g).permute(1, 2, 0, 3)  # (B, H, S, dh), a strided view
    kernels.attention(q, time_major, v, mask, False, 0.0, False)
    kernels.attention(torch.randn(B, H, 2, dh, generator=g), k, v, mask, False, 0.0, False)
    kernels.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, False, 0.0, False)
    kernels.attention(q.requires_grad_(), k, v, mask, False, 0.0, False)
    assert calls == [1]


@pytest.mark.parametrize("masked", [False, True])
def test_one_query_over_no_keys_scores_as_before(monkeypatch, masked):
    """One query per head over 0 keys: the masked `k @ q` sizes its mask as (B*H, 0, 1) without
    a view's -1, which 0 elements leave ambiguous; the compiled `attend` alike."""
    B, H, dh = 3, 2, 8
    q, k, v = torch.randn(B, H, 1, dh), torch.randn(B, H, 0, dh), torch.randn(B, H, 0, dh)
    mask = torch.ones(B, 1, 1, 0, dtype=torch.bool) if masked else None
    got, _ = kernels.attention(q, k, v, mask, False, 0.0, False)
    monkeypatch.setattr(kernels, "ONE_QUERY_KEYS_FIRST", False)
    want, _ = kernels.attention(q, k, v, mask, False, 0.0, False)
    assert got.shape == (B, H, 1, dh) and torch.equal(got, want)
    compiled = _compiled_attend(q, k, v, mask)
    assert compiled is None or torch.equal(compiled, want)


def test_weigh_values_leaves_autograd_and_other_dtypes_to_torch():
    p = torch.rand(4, 2, 1, 5).softmax(-1)
    v = torch.randn(4, 2, 5, 8)
    assert torch.equal(kernels.weigh_values(p.double(), v.double()), p.double() @ v.double())
    vg = v.clone().requires_grad_()
    got = kernels.weigh_values(p, vg)
    assert torch.equal(got, p @ vg)
    got.sum().backward()
    assert vg.grad is not None


@pytest.fixture()
def cudnn_attention_restored(monkeypatch):
    """aiayn's first attention off the CPU switches cuDNN's SDPA backend off for the process: each
    test starts before that first call and leaves the switch as it found it."""
    monkeypatch.setattr(kernels, "_cudnn_attention_off", False)
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(*a, **k):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*a, **k)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    yield seen
    torch.backends.cuda.enable_cudnn_sdp(was)


def test_attention_off_the_cpu_never_takes_cudnn(cudnn_attention_restored):
    """cuDNN's attention builds a graph per new shape; aiayn's shapes change every batch and search
    step (on an H200 it made bf16 search 13-23x slower than fp32). Meta tensors stand for a GPU here:
    what counts is the backend switch seen inside the SDPA call."""
    seen = cudnn_attention_restored
    q = torch.randn(2, 4, 3, 8, device="meta")
    k = torch.randn(2, 4, 300, 8, device="meta")  # past the CPU's spelled-out path too
    for keys in (q, k):
        out, _ = kernels.attention(q, keys, keys, None, False, 0.0, False)
        assert out.shape == q.shape
    assert seen == [False, False] and not torch.backends.cuda.cudnn_sdp_enabled()  # off once, for good
    torch.backends.cuda.enable_cudnn_sdp(True)  # a program's own choice after that stands
    kernels.attention(q, k, k, None, False, 0.0, False)
    assert seen[-1] and torch.backends.cuda.cudnn_sdp_enabled()


def test_the_cpus_attention_leaves_cudnn_alone(cudnn_attention_restored):
    seen = cudnn_attention_restored
    cpu = torch.randn(2, 4, 300, 8)
    kernels.attention(cpu, cpu, cpu, None, False, 0.0, False)
    assert seen == [True] and torch.backends.cuda.cudnn_sdp_enabled()


def test_compiled_attention_off_the_cpu_never_takes_cudnn(cudnn_attention_restored, monkeypatch):
    seen = cudnn_attention_restored
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the traced path: `sdpa_kernel`
    q = torch.randn(2, 4, 300, 8, device="meta")
    kernels.attention(q, q, q, None, False, 0.0, False)
    assert seen == [False] and torch.backends.cuda.cudnn_sdp_enabled()  # inside the graph only


def test_every_device_takes_aiayns_loss_even_one_without_autocast():
    """Off the CPU too the loss is the row-block function (on a GPU torch's call cost more memory
    and time); a device without autocast (meta here) runs it with no autocast to switch off."""
    logits = torch.randn(4, 5, device="meta", requires_grad=True)
    out = kernels.smoothed_cross_entropy(logits, torch.zeros(4, dtype=torch.long, device="meta"), 0.1)
    assert out.shape == (4,) and out.grad_fn is not None and "SmoothedCrossEntropy" in type(out.grad_fn).__name__
