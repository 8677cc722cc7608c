"""Attention over a compressed cache equals dense attention with the evicted tokens masked out."""

import pytest
import torch
from transformers import DynamicCache

from kvpress import PressedLayer, SinkWindowPress, SnapKVPress
from kvpress.presses.base import Observation
from tiny import prompt, tiny_model


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_compressed_step_equals_masked_dense(family, attn):
    """Sink+window evicts the same tokens in every layer and head, so one 4D mask is the reference."""
    model = tiny_model(family, attn)
    ids = prompt(1, 41)
    n_sink, window = 3, 10
    cache = DynamicCache(config=model.config)
    with SinkWindowPress(n_sink=n_sink, window=window)(model):
        model(ids[:, :40], cache=cache)
        logits = model(ids[:, 40:], cache=cache).logits[0, -1]
    # reference: the whole sequence at once, the last query sees only the kept tokens (and itself)
    allowed = torch.ones(41, 41).tril().bool()
    kept = set(range(n_sink)) | set(range(40 - window, 41))
    allowed[40] = torch.tensor([j in kept for j in range(41)])
    mask = torch.zeros(1, 1, 41, 41).masked_fill(~allowed, torch.finfo(torch.float32).min)
    reference = model(ids, attention_mask=mask).logits[0, -1]
    assert (logits - reference).abs().max() < 1e-4


def test_attention_probs_match_eager_weights():
    model = tiny_model("llama", "eager")
    ids = prompt(1, 20)
    seen = {}

    def grab(module, args, kwargs, output):
        seen[module.layer_idx] = output[1]

    handle = model.model.layers[0].self_attn.register_forward_hook(grab, with_kwargs=True)
    try:
        cache = DynamicCache(config=model.config)
        captured = {}
        press = SnapKVPress(compression_ratio=0.0, window_size=4)
        original = press.observe

        def observe(obs: Observation):
            if obs.layer_idx == 0:
                captured["probs"] = obs.attention_probs(0, obs.q_len)
            original(obs)

        press.observe = observe
        with press(model):
            model(ids, cache=cache, output_attentions=True)
    finally:
        handle.remove()
    weights = seen[0]  # [B, Hq, q, n]
    probs = captured["probs"]  # [B, Hkv, g, q, n]
    b, hkv, g, q, n = probs.shape
    assert torch.allclose(probs.reshape(b, hkv * g, q, n), weights, atol=1e-5)
    assert isinstance(cache.layers[0], PressedLayer)
