import pytest
import torch

from aiayn.config import preset
from aiayn.model import Transformer
from reference import TorchReference


@pytest.mark.parametrize("norm_first", [False, True])
def test_matches_torch_transformer_with_padding(norm_first):
    cfg = preset("tiny", src_vocab_size=50, tgt_vocab_size=50, norm_first=norm_first, dropout=0.1)
    model = Transformer(cfg).eval()
    ref = TorchReference(model).eval()
    src = torch.randint(4, 50, (3, 7))
    src[0, 5:] = 0
    src[1, 3:] = 0
    tgt = torch.randint(4, 50, (3, 6))
    tgt[0, 4:] = 0
    tgt[2, 2:] = 0
    with torch.no_grad():
        ours, theirs = model(src, tgt), ref(src, tgt)
    real = tgt.ne(0)
    assert torch.allclose(ours[real], theirs[real], atol=1e-5, rtol=0)
