"""KeyDiff's anchor is the mean of its head's keys scaled to unit length (the paper's), not their plain mean."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from kvpress import KeyDiffPress


def test_the_anchor_is_the_mean_unit_key():
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 40, 8)
    keys[:, :, :4] *= 50  # a few keys of large norm: they would pull a plain mean their way
    scores = KeyDiffPress(compression_ratio=0.5).score(SimpleNamespace(keys=keys, layer=SimpleNamespace(valid=None)))
    anchor = F.normalize(keys, dim=-1).mean(2, keepdim=True)
    assert torch.allclose(scores, -F.cosine_similarity(keys, anchor, dim=-1), atol=1e-6)
    plain = -F.cosine_similarity(keys, keys.mean(2, keepdim=True), dim=-1)
    assert not torch.equal(scores.topk(20).indices.sort().values, plain.topk(20).indices.sort().values)
