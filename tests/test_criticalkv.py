"""CriticalKVPress: a share of the budget by attention alone, the rest by attention x ||v W_O||_1."""

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress import CriticalKVPress, KnormPress, SnapKVPress
from kvpress.presses.criticalkv import projected_value_norms
from tiny import prompt, tiny_model


def _seen(model, ids, inner):
    """{layer: (attention scores [Hkv, n], projected value norms [Hkv, n], values, o_proj weight)} with no press."""
    seen = {}

    def record(obs):
        seen[obs.layer_idx] = (inner.score(obs)[0].float(), projected_value_norms(obs)[0], obs.values[0].float(),
                               obs.module.o_proj.weight.float())  # fmt: skip

    with kvpress.observe(model, record):
        model(ids, cache=DynamicCache(config=model.config))
    return seen


def test_value_norms_are_those_of_each_query_heads_output_projection():
    model = tiny_model("qwen2")  # 4 query heads over 2 KV heads
    seen = _seen(model, prompt(1, 20), SnapKVPress(0.5, window_size=4))
    for _, norms, values, weight in seen.values():
        d = values.shape[-1]
        for kv in range(values.shape[0]):
            expected = sum((values[kv] @ weight[:, h * d : (h + 1) * d].T).abs().sum(-1) for h in (2 * kv, 2 * kv + 1))
            torch.testing.assert_close(norms[kv], expected / 2, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_first_stage_by_attention_then_by_weighted_attention(ratio):
    model = tiny_model("llama")
    ids = prompt(1, 40)
    inner = SnapKVPress(compression_ratio=0.5, window_size=2, kernel_size=1)
    seen = _seen(model, ids, inner)
    cache = DynamicCache(config=model.config)
    with CriticalKVPress(inner, first_stage_ratio=ratio)(model):
        model(ids, cache=cache)
    for idx, layer in enumerate(cache.layers):
        attention, norms, _, _ = seen[idx]
        for head in range(attention.shape[0]):
            first = attention[head].clone()
            first[-2:] = float("inf")  # the window
            chosen = set(first.topk(int(20 * ratio)).indices.tolist()) | {38, 39}
            second = (attention[head] + 1e-4) * norms[head]
            second[list(chosen)] = -float("inf")
            chosen |= set(second.topk(20 - len(chosen)).indices.tolist())
            assert sorted(layer.pos[0, head, : layer.n].long().tolist()) == sorted(chosen)


def test_decoding_keeps_the_budget_and_adakv_spreads_it():
    model = tiny_model("qwen2")
    cache = DynamicCache(config=model.config)
    with CriticalKVPress(SnapKVPress(max_tokens=16, window_size=2))(model):
        model.generate(prompt(1, 30), cache=cache, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert all(layer.n <= 16 and layer.seen == 41 for layer in cache.layers)
    cache = DynamicCache(config=model.config)
    press = kvpress.press_from_name("adakv:inner=criticalkv:window_size=2", compression_ratio=0.5)
    with press(model):
        model.generate(prompt(1, 30), cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert all(sum(layer.lengths) <= 2 * 17 for layer in cache.layers)  # 2 heads x (34 // 2) tokens


def test_refuses_scores_that_are_not_attention_and_bad_parameters():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="KnormPress gave negative"):
        with CriticalKVPress(KnormPress(0.5))(model):
            model(prompt(1, 20), cache=DynamicCache(config=model.config))
    with pytest.raises(ValueError, match="first_stage_ratio"):
        CriticalKVPress(SnapKVPress(0.5), first_stage_ratio=1.5)
    with pytest.raises(ValueError, match="epsilon"):
        CriticalKVPress(SnapKVPress(0.5), epsilon=-1.0)


def test_wrappers_keep_its_two_stages_or_refuse_it():
    from kvpress import ChunkPress, ExpectedAttentionPress, PyramidKVPress, SimLayerKVPress

    critical = CriticalKVPress(SnapKVPress(0.5, window_size=2))
    with pytest.raises(TypeError, match="wraps a token-level press"):
        ChunkPress(critical)
    with pytest.raises(ValueError, match="use_vnorm=False"):
        CriticalKVPress(ExpectedAttentionPress(0.5))
    for weighed, name in ((kvpress.KVzipPress(0.5, value_norm=True), "KVzipPress value_norm=False"),
                          (ChunkPress(kvpress.KVzipPress(0.5, value_norm=True)), "KVzipPress value_norm=False")):
        with pytest.raises(ValueError, match=name):  # its value norm would count twice
            CriticalKVPress(weighed)
    with pytest.raises(ValueError, match="CriticalKVPress inside CriticalKVPress"):
        CriticalKVPress(CriticalKVPress(SnapKVPress(0.5)))
    with pytest.raises(TypeError, match="cannot wrap SimLayerKVPress"):
        CriticalKVPress(SimLayerKVPress(0.5))
    # the same refusals through a wrapper between them (it only passes scores on)
    with pytest.raises(TypeError, match="it wraps a CriticalKVPress, which ChunkPress cannot wrap either"):
        ChunkPress(PyramidKVPress(CriticalKVPress(SnapKVPress(0.5))))  # its first stage would be skipped
    with pytest.raises(ValueError, match="give ExpectedAttentionPress use_vnorm=False"):
        CriticalKVPress(ChunkPress(ExpectedAttentionPress(0.5)))  # the value norm counted twice
    with pytest.raises(ValueError, match="the wrapped SnapKVPress cannot set its own"):
        PyramidKVPress(CriticalKVPress(SnapKVPress(0.5, layer_scales=(3, 1))))  # its scales replaced silently
    model = tiny_model("llama")
    ids = prompt(1, 40)
    pyramid = PyramidKVPress(critical, beta=1.0)  # beta 1: every layer the same budget, so the same tokens
    caches = []
    for press in (critical, pyramid):
        cache = DynamicCache(config=model.config)
        with press(model):
            model(ids, cache=cache)
        caches.append(cache)
    for a, b in zip(*(c.layers for c in caches), strict=True):
        assert torch.equal(a.pos[..., : a.n].sort(-1).values, b.pos[..., : b.n].sort(-1).values)
