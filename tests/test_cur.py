"""CURPress: exact leverage scores of keys and values (the CUR decomposition's row choice), their product
pooled by position, sinks kept."""

import pytest
import torch
from transformers import DynamicCache

from kvpress import CURPress
from kvpress.presses.cur import leverage_scores
from tiny import prompt, tiny_model


def test_leverage_is_the_diagonal_of_the_hat_matrix_and_ignores_invalid_rows():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 30, 8, generator=g, dtype=torch.float64)
    hat = x @ torch.linalg.pinv(x.transpose(-1, -2) @ x) @ x.transpose(-1, -2)
    torch.testing.assert_close(leverage_scores(x).double(), hat.diagonal(dim1=-2, dim2=-1), rtol=1e-4, atol=1e-5)
    valid = torch.ones(2, 3, 30, dtype=torch.bool)
    valid[..., :5] = False
    masked = leverage_scores(x, valid)
    assert bool((masked[..., :5] == 0).all())
    torch.testing.assert_close(masked[..., 5:], leverage_scores(x[..., 5:, :]), rtol=1e-4, atol=1e-5)
    assert torch.allclose(masked.sum(-1), torch.full((2, 3), 8.0), atol=1e-3)  # leverages sum to the rank


def test_keeps_the_highest_pooled_leverage_products_and_the_sinks():
    model = tiny_model("llama")
    ids = prompt(1, 40)
    seen = {}
    cache = DynamicCache(config=model.config)
    model(ids, cache=cache)
    for idx, layer in enumerate(cache.layers):
        k, v = layer.keys[..., :40, :], layer.values[..., :40, :]
        seen[idx] = leverage_scores(k) * leverage_scores(v)  # kernel_size=1: no pooling
    cache = DynamicCache(config=model.config)
    with CURPress(compression_ratio=0.5, kernel_size=1, n_sink=2)(model):
        model(ids, cache=cache)
    for idx, layer in enumerate(cache.layers):
        scores = seen[idx][0].clone()
        scores[:, :2] = float("inf")
        expected = scores.topk(20, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(layer.pos[0, :, : layer.n].long().sort(dim=-1).values, expected)


def test_bad_parameters_are_refused_by_name():
    with pytest.raises(ValueError, match="leverage must be one of kv_product"):
        CURPress(0.5, leverage="keys")
    with pytest.raises(ValueError, match="kernel_size"):
        CURPress(0.5, kernel_size=4)


def test_leverage_holds_on_keys_with_outlier_channels():
    """Real keys have a few channels thousands of times larger than the rest: the leverages still sum to the rank
    (in float32 on the raw Gram matrix they summed to 13.6 of 63 here, and SmolLM2's 4K keys failed Cholesky)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 4096, 64, generator=g)
    x[..., :3] *= 1e4
    x[..., 10] = x[..., 11]  # rank 63
    assert abs(float(leverage_scores(x).sum()) - 63) < 0.05
