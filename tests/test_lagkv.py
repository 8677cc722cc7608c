"""LagKVPress: partitions in position order scored by the next partition's per-channel range; the sinks, the
last full partition and the tail kept."""

import pytest
import torch
from transformers import DynamicCache

from kvpress import LagKVPress
from kvpress.presses.lagkv import _lag_scores
from tiny import prompt, tiny_model


def test_lag_scores_scale_by_the_next_partition_and_softmax_within_each():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 12, 5, generator=g)  # 2 heads, 3 partitions of 4
    got = _lag_scores(x, 3).view(2, 2, 4)
    ref = x[:, 4:8]
    expected = ((x[:, 0:4] - ref.amin(1, keepdim=True)) / (ref.amax(1, keepdim=True) - ref.amin(1, keepdim=True)))
    torch.testing.assert_close(got[:, 0], expected.std(-1).softmax(-1))
    torch.testing.assert_close(got.sum(-1), torch.ones(2, 2))


def test_keeps_sinks_and_unlagged_tail_and_the_best_lagged_tokens():
    model = tiny_model("llama")
    ids = prompt(1, 50)  # 2 sinks, then 6 partitions of 8: 5 lagged (positions 2-41), the last one kept
    plain = DynamicCache(config=model.config)
    model(ids, cache=plain)
    cache = DynamicCache(config=model.config)
    with LagKVPress(max_tokens=30, lag_size=8, n_sink=2)(model):
        model(ids, cache=cache)
    for layer, full in zip(cache.layers, plain.layers, strict=True):
        k, v = full.keys[0, :, 2:50], full.values[0, :, 2:50]
        lagged = _lag_scores(k, 6) + _lag_scores(v, 6)  # [H, 40]: positions 2..41 scored
        best = lagged.topk(30 - 2 - 8, dim=-1).indices + 2
        for head in range(k.shape[0]):
            kept = set(layer.pos[0, head, : layer.n].long().tolist())
            assert kept == {0, 1, *range(42, 50), *best[head].tolist()}


def test_too_short_to_score_keeps_the_newest():
    model = tiny_model("qwen2")
    cache = DynamicCache(config=model.config)
    with LagKVPress(max_tokens=10, lag_size=32, n_sink=1)(model):
        model(prompt(1, 40), cache=cache)
    for layer in cache.layers:
        assert set(layer.pos[0, 0, : layer.n].long().tolist()) == {0, *range(31, 40)}


def test_the_newest_unscored_tokens_stay_at_long_contexts():
    # ranked by 1e4 + rank / n before, float32 told the tail's ranks apart only up to about 1,000 tokens: past
    # that, ties cut the newest tokens in no order
    model = tiny_model("llama", max_position_embeddings=4096)
    cache = DynamicCache(config=model.config)
    with LagKVPress(max_tokens=100, lag_size=4096, n_sink=4)(model):  # 4,092 tokens after the sinks: none lagged
        model(prompt(1, 4096), cache=cache)
    for layer in cache.layers:
        for head in range(layer.keys.shape[1]):
            assert set(layer.pos[0, head, : layer.n].long().tolist()) == {*range(4), *range(4000, 4096)}


def test_bad_parameters_are_refused_by_name():
    with pytest.raises(ValueError, match="lag_size"):
        LagKVPress(0.5, lag_size=0)
