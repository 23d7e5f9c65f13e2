"""Edge cases of decoding found by adversarial testing: each test failed before its fix."""

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
