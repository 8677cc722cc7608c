"""ThinKPress: each KV head's least used key channels leave the cache; queries meet the keys on the channels kept."""

import copy

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress import AdaKVPress, SnapKVPress, ThinKPress
from kvpress.patches.cache import PressedLayer
from kvpress.presses.think import channel_scores
from tiny import greedy_scores, left_padded, prompt, tiny_model

DEAD = [0, 1, 2, 3]  # rotary pairs (j, j + 8) of each 16-channel head whose keys are always zero


def _dead_channel_model(family: str = "llama", attn: str = "sdpa"):
    """A tiny model whose keys are zero on channels DEAD and DEAD + 8 of every KV head (zero before RoPE on both
    channels of a rotary pair, so zero after it): q.k does not depend on them."""
    model = copy.deepcopy(tiny_model(family, attn))
    d = 16
    for layer in model.model.layers:
        proj = layer.self_attn.k_proj
        rows = [h * d + j + off for h in range(proj.out_features // d) for j in DEAD for off in (0, d // 2)]
        with torch.no_grad():
            proj.weight[rows] = 0
            if proj.bias is not None:
                proj.bias[rows] = 0
    return model


def _generate(model, press, ids, cache):
    with press(model):
        return model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False, pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True)  # fmt: skip


@pytest.mark.parametrize("family, attn", [("llama", "sdpa"), ("qwen2", "sdpa"), ("llama", "eager")])
def test_it_drops_the_channels_queries_cannot_use_and_changes_nothing_else(family, attn):
    model = _dead_channel_model(family, attn)
    ids = prompt(1, 40)
    inner = SnapKVPress(compression_ratio=0.5, window_size=4)
    full_cache, thin_cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
    full = _generate(model, inner, ids, full_cache)
    thin = _generate(model, ThinKPress(inner, key_channel_ratio=0.5), ids, thin_cache)
    assert torch.equal(full.sequences, thin.sequences)
    for a, b in zip(full.scores, thin.scores, strict=True):  # every decoding step's logits, the same
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    kept = [j for j in range(16) if j % 8 not in DEAD]
    for full_layer, layer in zip(full_cache.layers, thin_cache.layers, strict=True):
        assert isinstance(layer, PressedLayer) and layer.keys.shape[-1] == 8  # stored narrower: memory saved
        assert layer.key_channels.tolist() == [[kept, kept]]
        assert layer.n == full_layer.n  # the same tokens as the press it wraps
        torch.testing.assert_close(layer.held_kv()[0], full_layer.held_kv()[0][..., kept])
    assert kvpress.cache_bytes(full_cache) - kvpress.cache_bytes(thin_cache) == sum(
        layer.keys[:, :, : layer.n].numel() * 4 - layer.key_channels.numel() * 8 for layer in thin_cache.layers
    )


def test_channel_scores_are_the_norms_of_each_channels_share_of_qk():
    g = torch.Generator().manual_seed(0)
    query, keys = torch.randn(2, 4, 3, 16, generator=g), torch.randn(2, 2, 10, 16, generator=g)
    valid = torch.rand(2, 2, 10, generator=g) > 0.3
    scores = channel_scores(query, keys, valid)
    for b in range(2):
        for h in range(2):
            q = query[b, 2 * h : 2 * h + 2].reshape(-1, 16)
            k = keys[b, h][valid[b, h]]
            expected = torch.stack([torch.outer(q[:, j], k[:, j]).norm() for j in range(16)])  # ||Q_j K_j^T||_F
            torch.testing.assert_close(scores[b, h], expected)


def test_the_same_thin_cache_from_a_recorded_prefill_and_a_live_one():
    model = tiny_model("llama")
    ids = prompt(1, 40)
    press = ThinKPress(SnapKVPress(compression_ratio=0.5, window_size=4), key_channel_ratio=0.25)
    live = DynamicCache(config=model.config)
    with press(model):
        model(ids, cache=live)
    recorded = kvpress.recording.record_prefill(model, ids)
    kvpress.engine.compress_layers(press, recorded.cache, recorded.queries)
    for a, b in zip(live.layers, recorded.cache.layers, strict=True):
        assert a.keys.shape[-1] == 12 and torch.equal(a.key_channels, b.key_channels)
        torch.testing.assert_close(a.held_kv()[0], b.held_kv()[0])


def test_a_padded_row_chunked_keeps_the_channels_it_keeps_alone():
    """Chunks of a left-padded batch: the short row's first chunks hold only padding, whose keys say nothing of its
    channels; they are chosen once every row holds real keys (they were chosen from the padding's zeros)."""
    model = tiny_model("llama")
    rows = [prompt(1, 37, seed=11)[0], prompt(1, 21, seed=12)[0]]  # 16 tokens of padding: two chunks of 8
    ids, mask = left_padded(rows)
    make = lambda: ThinKPress(SnapKVPress(compression_ratio=0.6, window_size=4))  # noqa: E731
    batch, cache = greedy_scores(model, ids, make(), new=2, mask=mask, chunk=8)
    alone, alone_cache = greedy_scores(model, rows[1][None], make(), new=2, chunk=8)
    for layer, single in zip(cache.layers, alone_cache.layers, strict=True):
        assert torch.equal(layer.key_channels[1], single.key_channels[0])
    torch.testing.assert_close(batch[:, 1], alone[:, 0], atol=1e-4, rtol=1e-4)


def test_a_padded_row_shorter_than_the_query_window_keeps_the_channels_it_keeps_alone():
    """A row of 20 tokens in a left-padded batch of 60: the last 32 queries (query_window) held 12 of its padding,
    whose queries weighed in its channels (they hid where padding's embedding is zero; padded with a real token
    here, as tokenizers that pad with end-of-sequence do)."""
    model = tiny_model("llama")
    rows = [prompt(1, 60, seed=5)[0], prompt(1, 20, seed=6)[0]]
    ids, mask = left_padded(rows)
    ids = ids.masked_fill(mask == 0, 2)
    make = lambda: ThinKPress(SnapKVPress(compression_ratio=0.5, window_size=4))  # noqa: E731
    batch, cache = greedy_scores(model, ids, make(), new=4, mask=mask)
    for row in range(2):
        alone, alone_cache = greedy_scores(model, rows[row][None], make(), new=4)
        for layer, single in zip(cache.layers, alone_cache.layers, strict=True):
            assert torch.equal(layer.key_channels[row], single.key_channels[0])
        torch.testing.assert_close(batch[:, row], alone[:, 0], atol=1e-4, rtol=1e-4)


def test_refusals():
    with pytest.raises(TypeError, match="per-head storage|token-level"):
        ThinKPress(AdaKVPress(SnapKVPress(0.5)))
    with pytest.raises(TypeError, match="cannot wrap ThinKPress"):
        AdaKVPress(ThinKPress(SnapKVPress(0.5)))
    with pytest.raises(ValueError, match="key_channel_ratio"):
        ThinKPress(SnapKVPress(0.5), key_channel_ratio=1.0)
    with pytest.raises(ValueError, match="kv_bits or rerotate"):
        ThinKPress(SnapKVPress(0.5, kv_bits=4))
    for inner in (kvpress.ExpectedAttentionPress(0.5), kvpress.ChunkPress(kvpress.ExpectedAttentionPress(0.5))):
        with pytest.raises(TypeError, match="ExpectedAttentionPress reads every channel"):  # (it crashed decoding)
            ThinKPress(inner)
    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    with ThinKPress(SnapKVPress(0.5, window_size=4))(model):
        model(prompt(1, 30), cache=cache)
    with pytest.raises(RuntimeError, match="inside `with press"):  # transformers' own attention cannot meet them
        model(prompt(1, 1), cache=cache)
    with pytest.raises(ValueError, match="already pruned"):
        cache.layers[0].prune_key_channels(cache.layers[0].key_channels)
