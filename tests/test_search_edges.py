"""Edge cases of decoding found by adversarial testing: each test failed before its fix."""

import copy
import math

import pytest
import torch

from aiayn import cache as cache_mod
from aiayn.config import preset
from aiayn.model import Transformer

BOS = 2


def tiny(vocab: int = 20, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(preset("tiny", src_vocab_size=vocab, tgt_vocab_size=vocab)).eval()


@pytest.mark.parametrize("frozen_source_side", [False, True])
@pytest.mark.parametrize("reorder_grad", [True, False])
def test_a_cache_reordered_with_gradients_on_still_backpropagates(reorder_grad, frozen_source_side):
    """Cached decoding with autograd on (`LayerCache.append` keeps gradients) and a greedy-style
    reorder (a finished row's place taken by the last one), with gradients on or under no_grad: the
    source side was moved in place, overwriting cross-attention keys that the earlier steps saved
    for backward, so `backward` failed ("modified by an inplace operation"). Keys that require
    grad are copied, as without moves. So are keys that need none (a frozen encoder and cross-attention
    key/value projection, the rest of the decoder trained): q @ k^T saves k for q's gradient."""
    model = tiny()
    if frozen_source_side:  # (the embeddings too: shared, they would carry gradients into the keys)
        for name, p in model.named_parameters():
            if name.startswith("encoder") or "embed" in name or "cross_attn.kv_proj" in name:
                p.requires_grad_(False)
    src = torch.randint(4, 20, (3, 5), generator=torch.Generator().manual_seed(1))
    keep = src.ne(0)
    grads = []
    for in_place in (True, False):
        cache_mod.IN_PLACE = in_place
        try:
            model.zero_grad()
            cache = model.new_cache(model.encode(src, keep), keep)
            first = model.decode(torch.full((3, 1), BOS), None, cache=cache)
            with torch.set_grad_enabled(reorder_grad):
                cache.reorder(torch.tensor([2, 1]))  # row 0 finished; row 2 takes its place
            second = model.decode(torch.full((2, 1), 5), None, cache=cache)
            (first.sum() + second.sum()).backward()
        finally:
            cache_mod.IN_PLACE = True
        grads.append(model.decoder.layers[0].cross_attn.q_proj.weight.grad.clone())
    assert torch.equal(grads[0], grads[1])


def test_a_frozen_weight_with_a_trainable_bias_keeps_the_bias_gradient():
    """`kernels.inference_linear` packs a frozen weight (oneDNN) and detached the bias with it, so a
    trainable bias beside a frozen weight (fine-tuning the biases only) silently got no gradient
    when the input needed none: the output did not even require grad."""
    from aiayn import kernels

    torch.manual_seed(0)
    lin = kernels.Linear(8, 16)
    lin.weight.requires_grad_(False)
    x = torch.randn(4, 8)
    lin(x).square().sum().backward()  # failed: the output did not require grad
    bias = lin.bias.detach().clone().requires_grad_()
    torch.nn.functional.linear(x, lin.weight, bias).square().sum().backward()
    assert torch.allclose(lin.bias.grad, bias.grad, atol=1e-6)
    with torch.no_grad():  # without gradients the packed path still runs, with the same results
        assert torch.allclose(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-6)


@pytest.mark.parametrize("tie_output", [True, False])
def test_int8_keeps_the_output_bias(tie_output):
    """An imported Marian model has a bias on its projection to the vocabulary (final_logits_bias,
    `output_bias`); `quantize_int8` packed that projection without it and the int8 call takes no
    other, so `--precision int8` searched on logits without the bias."""
    from aiayn.kernels import quantize_int8
    from aiayn.search import greedy_search

    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=20, tgt_vocab_size=20, output_bias=True, tie_output=tie_output))
    model.eval().requires_grad_(False)
    with torch.no_grad():
        model.out_bias.copy_(torch.randn(20) * 5)
        model.out_bias[9] = 40.0  # token 9 wins every step with the bias, rarely without it
    h = torch.randn(3, model.cfg.d_model)
    want = model.project(h)
    int8 = quantize_int8(copy.deepcopy(model))
    assert (int8.project(h) - want).abs().max() < 0.2  # int8 rounding, not the bias (up to 40) missing
    src = torch.randint(4, 20, (2, 5), generator=torch.Generator().manual_seed(1))
    assert greedy_search(int8, src, BOS, 3, max_len_b=3) == [[9] * 8] * 2


def test_a_model_built_under_inference_mode_searches():
    """A model loaded inside `torch.inference_mode()` (`Translator.from_checkpoint` in such a block)
    has inference tensors for weights, which have no version counter: packing them for the
    inference GEMMs (`kernels.packed_weight`) raised "Inference tensors do not track version counter"."""
    from aiayn.search import beam_search, greedy_search

    model = tiny().requires_grad_(False)
    src = torch.randint(4, 20, (2, 5), generator=torch.Generator().manual_seed(1))
    want = greedy_search(model, src, BOS, 3, max_len_b=4), beam_search(model, src, BOS, 3, max_len_b=4)
    with torch.inference_mode():
        built = Transformer(model.cfg).eval().requires_grad_(False)
        built.load_state_dict(model.state_dict())
        assert built.output_weight.is_inference()
        assert (greedy_search(built, src, BOS, 3, max_len_b=4), beam_search(built, src, BOS, 3, max_len_b=4)) == want


@pytest.mark.parametrize("b", [10 ** 30, 10 ** 400], ids=["1e30", "1e400"])
def test_a_length_limit_past_any_int64_is_no_limit(b):
    """`--max-len-b 1000000000000000000000000000000` (an int past 2**64) met a tensor in `_max_lengths`:
    OverflowError: int too big to convert; past float's range `_check`'s math.isinf raised one too."""
    from aiayn.search import beam_search, greedy_search

    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=20, tgt_vocab_size=20, output_bias=True)).eval()
    with torch.no_grad():
        model.out_bias[9] = 40.0  # token 9, EOS here, wins the first step: a search that ends whatever the limit
    src = torch.randint(4, 20, (2, 5), generator=torch.Generator().manual_seed(1))
    want = greedy_search(model, src, BOS, 9, max_len_b=50), beam_search(model, src, BOS, 9, max_len_b=50)
    assert (greedy_search(model, src, BOS, 9, max_len_b=b), beam_search(model, src, BOS, 9, max_len_b=b)) == want
    assert greedy_search(model, src, BOS, 9, max_len_a=float(10 ** 300), max_len_b=b) == want[0]


@pytest.mark.parametrize("a,b", [(math.inf, 50), (math.nan, 50), (-1.0, 50), (1.0, -1), (1.0, math.inf)])
def test_a_length_limit_that_is_no_number_is_refused(a, b):
    from aiayn.errors import AiaynError
    from aiayn.search import greedy_search

    with pytest.raises(AiaynError, match="maximum length a\\*len\\+b needs finite a >= 0 and b >= 0"):
        greedy_search(tiny(), torch.tensor([[5, 6]]), BOS, 3, max_len_a=a, max_len_b=b)


@pytest.mark.parametrize("kw", [{"beam": 2.5}, {"beam": True}, {"nbest": 1.5}, {"min_len": math.nan}, {"beam": "4"}])
def test_a_count_that_is_no_whole_number_is_refused(kw):
    """`Translator.translate(..., beam=2.5)` (the Python API; the CLI's flags are ints) was taken as 2 by the
    check and met a reshape or topk later."""
    from aiayn.errors import AiaynError
    from aiayn.search import beam_search

    flag = "--" + next(iter(kw)).replace("_", "-")
    with pytest.raises(AiaynError, match=f"{flag} must be a whole number, got "):
        beam_search(tiny(), torch.tensor([[5, 6]]), BOS, 3, **kw)
