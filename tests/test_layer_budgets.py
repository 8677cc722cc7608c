"""Per-layer budgets (PyramidKV, layer_scales): layers of different lengths on sdpa and eager."""

import warnings

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress import KnormPress, PyramidKVPress, SnapKVPress, cache_bytes
from tiny import prompt, tiny_model


def test_pyramid_scales_average_one_and_decrease():
    press = PyramidKVPress(compression_ratio=0.5, beta=4)
    scales = [press.layer_scale(i, 8) for i in range(8)]
    assert abs(sum(scales) / 8 - 1) < 1e-9
    assert scales == sorted(scales, reverse=True)
    assert abs(scales[-1] - 0.25) < 1e-9 and abs(scales[0] - 1.75) < 1e-9


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_layers_of_different_lengths_generate(attn, family):
    model = tiny_model(family, attn, num_hidden_layers=4)
    cache = DynamicCache(config=model.config)
    press = PyramidKVPress(compression_ratio=0.5, window_size=4, beta=4)
    with press(model):
        out = model.generate(prompt(2, 64), cache=cache, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert out.shape == (2, 80)
    lengths = [layer.n for layer in cache.layers]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1]


def test_a_pyramid_refuses_sliding_window_layers():
    """A sliding layer cannot take a larger share: the pyramid's total fell short and its full-attention layer (the
    only one reaching far back) kept 4 of 77 tokens where SnapKV alone kept 39."""
    for family in ("gemma3", "mistral-window"):
        with pytest.raises(ValueError, match=r"PyramidKVPress .* has layers of other kinds \(sliding_attention\)"):
            with PyramidKVPress(compression_ratio=0.5, window_size=4)(tiny_model(family)):
                pass


def test_fixed_layer_shares_refuse_sliding_window_layers_beside_others():
    """A share multiplies a layer's own budget, and a sliding layer holds its window alone: Knorm with layer_scales
    (1, 1, 2) on a 3-layer Gemma 3 kept 77 tokens of 200 where its budget at r = 0.75 is 54 (the full-attention layer
    took twice the whole context's budget). Refused as the press is installed, through a wrapper and for KVzap's
    scorer profile too; layers of one kind (every one sliding) take them."""
    from kvpress import KVzapPress
    from kvpress.presses.chunk import ChunkPress
    from tiny import tiny_scorer

    gemma = tiny_model("gemma3")
    for press in (KnormPress(0.75, layer_scales=(1, 1, 2)), ChunkPress(KnormPress(0.75, layer_scales=(1, 1, 2))),
                  KVzapPress(0.75, global_budget=0.5, scorer=tiny_scorer(gemma))):  # fmt: skip
        refusal = r"has layers of several kinds \(full_attention, sliding_attention\)"
        with pytest.raises(ValueError, match=refusal), press(gemma):
            pass
    with KVzapPress(0.75, global_budget=0.0, scorer=tiny_scorer(gemma))(gemma):  # (no profile: even shares)
        pass
    with KnormPress(0.75, layer_scales=(1, 3))(tiny_model("mistral-window")):  # every layer slides: same spans
        pass


def test_a_layer_share_that_rounds_to_nothing_keeps_a_token():
    model = tiny_model("llama", num_hidden_layers=4)
    press = PyramidKVPress(KnormPress(compression_ratio=0.9))  # top layer: 1/20 of 10 of 100 tokens
    cache = DynamicCache(config=model.config)
    with pytest.warns(UserWarning, match="a layer's share of the budget .* rounds to no token of 100: it keeps one"):
        with press(model):
            model.generate(prompt(1, 100), cache=cache, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert min(layer.n for layer in cache.layers) >= 1  # (the top layer kept nothing, its newest token neither)
    windowed = PyramidKVPress(SnapKVPress(0.9, window_size=4))  # its window keeps tokens already: not said
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert [windowed.budget_of(100, windowed.layer_scale(i, 4)) for i in range(4)] == [19, 13, 6, 4]
    assert not [w for w in said if "rounds to no token" in str(w.message)]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_whole_layer_after_a_compressed_one_gets_its_own_mask(attn):
    model = tiny_model("llama", attn, num_hidden_layers=2)
    ids = prompt(1, 40)
    press = KnormPress(compression_ratio=0.25, layer_scales=(0.2, 3.0))  # layer 1 may keep more than it saw
    cache = DynamicCache(config=model.config)
    with press(model) as installed:
        model(ids, cache=cache)
        assert [layer.n for layer in cache.layers] == [20, 40]  # transformers sizes its mask from layer 0
        with installed.frozen():
            logits = model(prompt(1, 5, seed=1), cache=cache).logits
    assert logits.shape == (1, 5, 128) and torch.isfinite(logits).all()  # was a mask size mismatch


def test_ratio_zero_keeps_every_layer_whole_whatever_its_share():
    """r = 0 is the identity in every layer: a share below 1 (PyramidKV's top layers) must not cut a layer."""
    model = tiny_model("llama", num_hidden_layers=4)
    for press in (PyramidKVPress(SnapKVPress(compression_ratio=0.0, window_size=4), beta=4),
                  KnormPress(compression_ratio=0.0, layer_scales=(4, 2, 1, 1))):  # fmt: skip
        cache = DynamicCache(config=model.config)
        with press(model):
            model(prompt(1, 40), cache=cache)
        assert [layer.n for layer in cache.layers] == [40] * 4


def test_pyramid_total_bytes_match_uniform():
    model = tiny_model("llama", num_hidden_layers=4)
    ids = prompt(1, 128)
    sizes = {}
    for name, press in {
        "uniform": SnapKVPress(compression_ratio=0.5, window_size=4),
        "pyramid": PyramidKVPress(compression_ratio=0.5, window_size=4, beta=4),
    }.items():
        cache = DynamicCache(config=model.config)
        with press(model):
            model(ids, cache=cache)
        sizes[name] = cache_bytes(cache)
    assert abs(sizes["pyramid"] - sizes["uniform"]) <= 0.02 * sizes["uniform"]


def test_layer_scales_general_and_validated():
    model = tiny_model("llama", num_hidden_layers=4)
    cache = DynamicCache(config=model.config)
    with KnormPress(max_tokens=20, layer_scales=(1, 1, 2, 4))(model):
        model(prompt(1, 100), cache=cache)
    assert [layer.n for layer in cache.layers] == [10, 10, 20, 40]
    with pytest.raises(ValueError, match="layer_scales has 3 entries but the model has 4 layers"):
        KnormPress(max_tokens=20, layer_scales=(1, 1, 2))(model)
    with pytest.raises(ValueError, match="layer_scales must be positive numbers"):
        KnormPress(max_tokens=20, layer_scales=(1, -1))
    for one in (1, "(1,2)"):  # (what a press spec gives: a number, a text)
        with pytest.raises(ValueError, match="layer_scales must be a list of positive numbers"):
            KnormPress(max_tokens=20, layer_scales=one)
    with pytest.raises(ValueError, match="rerotate=True needs the same budget in every layer"):
        PyramidKVPress(compression_ratio=0.5, rerotate=True)(model)


def test_pyramid_padded_batch_equals_rows_alone():
    model = tiny_model("llama", num_hidden_layers=4)
    rows = [prompt(1, 40, seed=1)[0], prompt(1, 27, seed=2)[0]]
    ids = torch.zeros(2, 40, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, 40 - len(r) :], mask[i, 40 - len(r) :] = r, 1
    press = PyramidKVPress(compression_ratio=0.5, window_size=4, beta=4)
    with press(model):
        batch = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    for i, r in enumerate(rows):
        with press(model):
            alone = model.generate(r[None], max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert torch.equal(batch[i, 40:], alone[0, len(r) :])


def test_pyramid_over_any_scorer():
    """PyramidKV is a budget policy: over Knorm, each layer keeps its pyramid share of Knorm's ranking."""
    model = tiny_model("llama", num_hidden_layers=4)
    ids = prompt(1, 64)
    press = kvpress.press_from_name("pyramidkv:inner=knorm:beta=4", compression_ratio=0.5)
    cache = DynamicCache(config=model.config)
    with press(model):
        model(ids, cache=cache)
    keys = DynamicCache(config=model.config)
    model(ids, cache=keys)
    for i, layer in enumerate(cache.layers):
        assert layer.n == press.budget_of(64, press.layer_scale(i, 4))
        norms = keys.layers[i].keys[0].norm(dim=-1)  # [H, n]: Knorm keeps the smallest
        expected = norms.argsort(dim=-1)[:, : layer.n].sort(dim=-1).values
        assert torch.equal(layer.pos[0].long().sort(dim=-1).values, expected)
    assert cache.layers[0].n > cache.layers[3].n
    with pytest.raises(ValueError, match="for its own SnapKV only"):
        PyramidKVPress(KnormPress(compression_ratio=0.5), window_size=8)


def test_layer_scales_must_be_finite():
    for bad in ((1.0, float("nan")), (1.0, float("inf")), (True, 1.0)):
        with pytest.raises(ValueError, match="layer_scales must be positive numbers"):
            KnormPress(compression_ratio=0.5, layer_scales=bad)


def test_shares_over_a_whole_context_go_to_the_other_layers():
    """At r = 0.1 PyramidKV's bottom layers would keep more than they hold: they keep it all and the layers above
    share the rest, so the total is the budget's (it removed 27% at r = 0.1 when the surplus was dropped)."""
    press = PyramidKVPress(SnapKVPress(compression_ratio=0.1, window_size=4))
    budgets = [press.budget_of(1000, press.layer_scale(i, 30)) for i in range(30)]
    assert budgets[0] == 1000 and budgets == sorted(budgets, reverse=True) and budgets[-1] < 900
    assert 30 * 900 - 30 <= sum(budgets) <= 30 * 900
    steep = PyramidKVPress(compression_ratio=0.5, beta=20)  # no share over 2: the line itself, to the last bit
    assert [steep.layer_scale(i, 30) for i in range(30)] == [1.95 - 1.9 * i / 29 for i in range(30)]
    scaled = KnormPress(compression_ratio=0.5, layer_scales=(1, 1, 2, 4))
    assert [scaled.layer_scale(i, 4) for i in range(4)] == [s * 4 / 8 for s in (1, 1, 2, 4)]
    knorm = KnormPress(max_tokens=50, layer_scales=(1, 3))  # a fixed budget cannot move: said
    import warnings

    with warnings.catch_warnings():  # a context under the budget loses nothing to the cap: nothing said
        warnings.simplefilter("error")
        assert knorm.budget_of(40, knorm.layer_scale(1, 2)) == KnormPress(max_tokens=50).budget_of(30) + 10 == 40
    with pytest.warns(UserWarning, match=r"share of max_tokens=50 \(75 tokens\) is more than the 60 it holds"):
        assert knorm.budget_of(60, knorm.layer_scale(1, 2)) == 60
