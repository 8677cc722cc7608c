"""ChunkPress: whole chunks of consecutive positions kept; chunk_size=1 is the wrapped press."""

import pytest
import torch
from transformers import DynamicCache

import kvpress
from tiny import prompt, tiny_model


def _kept(press, model, ids) -> list[list[set[int]]]:
    cache = DynamicCache(config=model.config)
    with torch.inference_mode(), press(model):
        model(ids, cache=cache, use_cache=True)
    return [[set(p.tolist()) for p in layer.pos[0]] for layer in cache.layers]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_whole_chunks_are_kept(family):
    model = tiny_model(family)
    ids = prompt(1, 120)
    inner = kvpress.SnapKVPress(compression_ratio=0.5, window_size=8)
    for layer in _kept(kvpress.ChunkPress(inner, chunk_size=10), model, ids):
        for head in layer:
            assert len(head) == 60
            selected = {p for p in head if p < 120 - 8}  # outside the protected window
            partial = [c for c in range(12) if 0 < len({p for p in selected if p // 10 == c}) < 10]
            assert len(partial) <= 2  # at most the chunk cut by the budget and the one cut by the window
    token_level = _kept(inner, model, ids)
    assert _kept(kvpress.ChunkPress(inner, chunk_size=1), model, ids) == token_level
    assert _kept(kvpress.ChunkPress(inner, chunk_size=10), model, ids) != token_level


def test_chunk_press_arguments():
    with pytest.raises(TypeError, match="wraps a token-level press"):
        kvpress.ChunkPress(kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=0.5)))
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        kvpress.ChunkPress(kvpress.SnapKVPress(compression_ratio=0.5), chunk_size=0)
    with pytest.raises(ValueError, match="takes its budget from the wrapped press"):
        kvpress.ChunkPress(press=kvpress.SnapKVPress(compression_ratio=0.5), compression_ratio=0.5)
    press = kvpress.press_from_name("chunkkv", compression_ratio=0.25, window_size=4)
    assert isinstance(press.press, kvpress.SnapKVPress) and press.compression_ratio == 0.25


def test_press_specs_carry_parameters():
    press = kvpress.press_from_name("chunkkv:inner=knorm:chunk_size=5", compression_ratio=0.5)
    assert isinstance(press.press, kvpress.KnormPress) and press.chunk_size == 5
    assert kvpress.press_from_name("snapkv:window_size=16", max_tokens=64).window_size == 16
    with pytest.raises(ValueError, match="key=value after the name"):
        kvpress.press_from_name("snapkv:window_size", compression_ratio=0.5)
    with pytest.raises(ValueError, match="unknown press 'nope'"):
        kvpress.press_from_name("nope:x=1")
    with pytest.raises(ValueError, match="given twice"):
        kvpress.press_from_name("snapkv:window_size=16:window_size=8", compression_ratio=0.5)
    with pytest.raises(ValueError, match=r"\['window_size'\] are given both"):
        kvpress.press_from_name("snapkv:window_size=16", compression_ratio=0.5, window_size=8)
    assert kvpress.press_from_name("snapkv:max_tokens=64", compression_ratio=None, max_tokens=None).max_tokens == 64
    with pytest.raises(ValueError, match="takes decode_slack from the wrapped press"):
        kvpress.ChunkPress(kvpress.SnapKVPress(compression_ratio=0.5), decode_slack=0.5)
