"""The caches users hand to generate are compressed in place and stay usable."""

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from kvpress import KnormPress, PressedLayer, SinkWindowPress, SnapKVPress
from kvpress.patches.cache import SPARE, SPARE_MIN
from tiny import left_padded, prompt, tiny_model


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_user_cache_compressed_in_place(keyword):
    model = tiny_model("llama")
    cache = DynamicCache()  # no config: layers are created lazily
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with SnapKVPress(compression_ratio=0.5, window_size=4)(model):
            out = model.generate(prompt(1, 40), max_new_tokens=4, do_sample=False, **{keyword: cache})
    assert out.shape[1] == 44
    assert all(isinstance(layer, PressedLayer) for layer in cache.layers)
    assert cache.get_seq_length() == 43
    assert all(layer.n == 43 - 43 // 2 for layer in cache.layers)


def test_existing_conversation_is_adopted_and_continues():
    model = tiny_model("llama")
    ids = prompt(1, 60)
    cache = DynamicCache(config=model.config)
    model(ids[:, :30], cache=cache)  # a first turn, no press
    with SinkWindowPress(n_sink=2, window=16)(model):
        out = model.generate(ids, cache=cache, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == 65
    assert all(layer.n == 18 for layer in cache.layers)
    assert cache.get_seq_length() == 64


def test_compressed_cache_continues_after_the_block():
    """Unpadded, a compressed cache keeps working with plain transformers (masks from get_mask_sizes)."""
    model = tiny_model("llama")
    ids = prompt(1, 50)
    cache = DynamicCache(config=model.config)
    with SinkWindowPress(n_sink=2, window=16)(model) as installed:
        model(ids[:, :40], cache=cache)
        with installed.frozen():
            inside = model(ids[:, 40:], cache=cache).logits
    cache2 = DynamicCache(config=model.config)
    with SinkWindowPress(n_sink=2, window=16)(model):
        model(ids[:, :40], cache=cache2)
    outside = model(ids[:, 40:], cache=cache2).logits  # plain transformers, no press
    assert (inside - outside).abs().max() < 1e-4


def test_padded_compressed_cache_refuses_plain_continuation():
    model = tiny_model("llama")
    ids = prompt(2, 30)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    cache = DynamicCache(config=model.config)
    with KnormPress(compression_ratio=0.5)(model):
        model(ids, attention_mask=mask, cache=cache)
    with pytest.raises(RuntimeError, match="continue it inside `with press"):
        model(ids[:, :1], cache=cache)


def test_crop_refused_after_eviction():
    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    with KnormPress(compression_ratio=0.5)(model):
        model(prompt(1, 20), cache=cache)
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cache.crop(-2)


def test_assisted_decoding_rolls_back_a_layer_with_room_as_transformers_does():
    """Prompt lookup crops the cache by the candidates it rejected (and by 0 when it took them all): under a press
    that evicts nothing the tokens are those of plain greedy decoding, though decoding left room in the storage."""
    model = tiny_model("llama")
    ids = prompt(1, 24).repeat(1, 2)  # repeated text: prompt lookup finds candidates
    kwargs = {"max_new_tokens": 30, "do_sample": False, "pad_token_id": 0}
    plain = model.generate(ids, **kwargs)
    cache = DynamicCache(config=model.config)
    with SnapKVPress(compression_ratio=0.0)(model):
        assert torch.equal(model.generate(ids, prompt_lookup_num_tokens=4, cache=cache, **kwargs), plain)
    layer = cache.layers[0]
    assert layer.n == layer.seen == plain.shape[1] - 1 and layer.pos[0, 0].tolist() == list(range(layer.n))


def test_crop_forgets_the_newest_tokens_and_counts_them():
    """crop(-k) forgets the k newest slots, not the storage's last (its room), and the real tokens counted; crop(0)
    does nothing; a padded row counts only its real tokens."""
    layer = PressedLayer()
    layer.driven = True  # (commits come from the caller, as from the intercept)
    keys = torch.randn(2, 1, 40, 4)
    layer.update(keys[:, :, :30], keys[:, :, :30])
    layer.commit(torch.tensor([[True] * 30, [False] * 5 + [True] * 25]))
    for t in range(30, 37):
        layer.update(keys[:, :, t : t + 1], keys[:, :, t : t + 1])
        layer.commit(None)
    assert layer.keys.shape[-2] > layer.n == 37  # room after the held slots
    layer.crop(0)
    assert layer.n == layer.seen == 37
    layer.crop(-4)
    assert layer.n == layer.seen == 33 and layer.real_seen.tolist() == [33, 28]
    layer.update(keys[:, :, 33:34], keys[:, :, 33:34] + 1)
    layer.commit(None)
    assert layer.pos[:, 0, -1].tolist() == [33, 28] and torch.equal(layer.values[:, :, 33], keys[:, :, 33] + 1)
    with pytest.raises(ValueError, match="minus the number of tokens"):
        layer.crop(3)


def test_frozen_appends_without_eviction():
    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    with KnormPress(compression_ratio=0.5)(model) as installed:
        model(prompt(1, 20), cache=cache)
        with installed.frozen():
            model(prompt(1, 10, seed=1), cache=cache)
    assert all(layer.n == 20 for layer in cache.layers)
    assert cache.get_seq_length() == 30


def test_beam_search_reorders_the_compressed_cache():
    model = tiny_model("llama")
    with SnapKVPress(compression_ratio=0.5, window_size=4)(model):
        out = model.generate(prompt(1, 30), num_beams=3, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, 38)


def test_accelerate_device_map(tmp_path):
    """Loaded with accelerate's device_map, each layer's cache stays on that layer's device."""
    tiny_model("llama").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, device_map={"": "cpu"}, dtype=torch.float32)
    cache = DynamicCache(config=model.config)
    with SnapKVPress(compression_ratio=0.5, window_size=4)(model):
        model.generate(prompt(1, 30), cache=cache, max_new_tokens=5, do_sample=False)
    for layer, block in zip(cache.layers, model.model.layers, strict=True):
        assert layer.keys.device == block.self_attn.k_proj.weight.device
        assert layer.slots["pos"].device == layer.keys.device


def test_adopted_padded_conversation_matches_rows_alone():
    """A padded first turn made without a press: the press learns its padding from the 2D mask."""
    model = tiny_model("llama")
    rows = [prompt(1, 30, seed=1)[0], prompt(1, 22, seed=2)[0]]
    ids, mask = left_padded(rows)
    press = SinkWindowPress(n_sink=2, window=12)
    cache = DynamicCache(config=model.config)
    model(ids[:, :20], attention_mask=mask[:, :20], cache=cache)
    with press(model):
        batch = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=10, do_sample=False)
    for i, r in enumerate(rows):
        with press(model):
            alone = model.generate(r[None], max_new_tokens=10, do_sample=False)
        assert torch.equal(batch[i, 30:], alone[0, len(r) :])


def test_slots_copied_dropped_and_inserted_come_back_in_place():
    layer = PressedLayer()
    keys, values = torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4)
    layer.update(keys, values)
    chosen = torch.zeros(10, dtype=torch.bool)
    chosen[3:6] = True
    part = layer.copy_slots(chosen)
    layer.drop_slots(chosen)
    assert (layer.n, layer.seen, layer.get_seq_length()) == (7, 10, 10) and 4 not in layer.pos[0, 0].tolist()
    assert int(layer.shift[0]) == 3
    layer.insert(part)
    assert layer.n == 10 and torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    assert layer.pos[0, 0].tolist() == list(range(10)) and int(layer.shift[0]) == 0
    with pytest.raises(ValueError, match="slots to insert carry"):
        layer.insert({"keys": part["keys"], "values": part["values"]})


def test_slot_masks_and_duplicate_inserts_are_refused():
    layer = PressedLayer()
    layer.update(torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4))
    held = layer.copy_slots(torch.ones(6, dtype=torch.bool))
    with pytest.raises(ValueError, match="already held"):
        layer.insert(held)
    with pytest.raises(ValueError, match="bool mask of the 6 held slots"):
        layer.drop_slots(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="bool mask of the 6 held slots"):
        layer.copy_slots(torch.ones(3, dtype=torch.bool))
    assert layer.n == 6


def test_slots_inserted_where_heads_hold_other_positions_go_in_each_heads_order():
    """Heads (and rows) that kept other positions: each takes the inserted slots in its own position order (all
    followed head 0's order before), and a slot another head already holds is refused (only head 0 was looked at)."""
    torch.manual_seed(0)
    layer = PressedLayer()
    keys = torch.randn(2, 2, 8, 4)
    layer.update(keys, keys.clone())
    layer.keep(torch.tensor([[[0, 1, 2, 3], [0, 1, 6, 7]], [[4, 5, 6, 7], [0, 2, 4, 6]]]))
    extra = {"keys": torch.randn(2, 2, 2, 4), "values": torch.randn(2, 2, 2, 4),
             "pos": torch.tensor([[[5, 4], [3, 2]], [[1, 0], [7, 5]]], dtype=torch.int32)}  # fmt: skip
    layer.insert(extra)
    assert layer.pos.tolist() == [[[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 6, 7]],
                                  [[0, 1, 4, 5, 6, 7], [0, 2, 4, 5, 6, 7]]]  # fmt: skip
    assert torch.equal(layer.keys[1, 1, 3], extra["keys"][1, 1, 1]) and layer.n == 6  # position 5: row 1, head 1
    assert layer.shift.tolist() == [2, 2]
    again = {name: t[:, :, :1] for name, t in extra.items()}
    again["pos"] = torch.tensor([[[8], [6]], [[8], [8]]], dtype=torch.int32)  # row 0, head 1 holds 6
    with pytest.raises(ValueError, match="already held"):
        layer.insert(again)
    assert layer.n == 6


def test_decoding_grows_the_storage_with_spare_room_not_a_copy_a_step():
    """A layer that keeps every decoded token copies its slots once every `n * SPARE` steps (at least
    `SPARE_MIN`), not at every step; the room it holds beyond its slots stays within that share; an eviction
    (`keep`) leaves that room after what it keeps, so the next step appends in place."""
    torch.manual_seed(0)
    layer = PressedLayer()
    keys = torch.randn(1, 2, 300, 4)
    layer.update(keys[:, :, :200], keys[:, :, :200] + 1)
    storages = set()
    for t in range(200, 300):
        layer.update(keys[:, :, t : t + 1], keys[:, :, t : t + 1] + 1)
        storages.add(layer.keys.untyped_storage().data_ptr())
        assert layer.keys.shape[-2] - layer.n <= max(SPARE_MIN, layer.n * SPARE)
        assert layer.slots["pos"].shape[-1] == layer.keys.shape[-2]  # the per-slot tensors grow with the keys
    assert torch.equal(layer.keys[:, :, : layer.n], keys) and torch.equal(layer.values[:, :, : layer.n], keys + 1)
    assert layer.pos[0, 0].tolist() == list(range(300))
    assert len(storages) <= 100 // 4  # growths of 1, 2, 4, ... then 6-9 slots
    layer.keep(torch.arange(50, 300).expand(1, 2, -1))
    assert 250 < layer.keys.shape[-2] <= 250 + max(SPARE_MIN, 250 * SPARE)
    storage = layer.keys.untyped_storage().data_ptr()
    layer.update(keys[:, :, :1], keys[:, :, :1])
    assert layer.n == 251 and layer.keys.untyped_storage().data_ptr() == storage


def test_a_press_evicting_every_few_steps_copies_the_layer_once_an_eviction():
    """Decoding under a budget that grows a slot every 4 steps (r = 0.75), cut 4 slots below it when exceeded
    (`decode_slack`): after the first evictions the storage changes only at an eviction, never at the steps between
    that find the layer full, and it holds at most the budget and `SPARE`'s room."""
    torch.manual_seed(0)
    layer = PressedLayer()
    keys = torch.randn(1, 2, 600, 4)
    layer.update(keys[:, :, :400], keys[:, :, :400])
    layer.keep(torch.arange(300, 400).expand(1, 2, -1), capacity=100)
    growths = evictions = 0
    for t in range(400, 600):
        budget = t // 4
        storage = layer.keys.untyped_storage().data_ptr()
        layer.update(keys[:, :, t : t + 1], keys[:, :, t : t + 1])
        growths += layer.keys.untyped_storage().data_ptr() != storage
        if layer.n > budget:
            layer.keep(torch.arange(layer.n - budget + 4, layer.n).expand(1, 2, -1), capacity=budget)
            evictions += 1
        assert layer.keys.shape[-2] <= budget + max(SPARE_MIN, budget * SPARE) + 1
    assert torch.equal(layer.keys[:, :, : layer.n], keys[:, :, 600 - layer.n :])
    assert evictions >= 30 and growths <= 4  # the room ramps up over the first evictions (each grew twice before)


@pytest.mark.parametrize("with_config", [True, False])
def test_scratch_puts_back_a_plain_cache_that_a_press_adopted_inside(with_config):
    from kvpress.patches.cache import Scratch, scratch

    model = tiny_model("llama")
    new = lambda: DynamicCache(config=model.config) if with_config else DynamicCache()  # noqa: E731
    cache, reference = new(), new()
    model(prompt(1, 20), cache=cache)
    model(prompt(1, 20), cache=reference)
    layers = list(cache.layers)
    with scratch(cache), SnapKVPress(0.5)(model):
        model(prompt(1, 25)[:, 20:], cache=cache)
        assert all(isinstance(layer, PressedLayer) for layer in cache.layers)  # adopted by the press
    assert all(a is b for a, b in zip(cache.layers, layers, strict=True)) and cache.get_seq_length() == 20
    torch.testing.assert_close(model(prompt(1, 25)[:, 20:], cache=cache).logits,
                               model(prompt(1, 25)[:, 20:], cache=reference).logits)  # fmt: skip
    empty = new()
    with scratch(empty), SnapKVPress(0.5)(model):
        model(prompt(1, 20), cache=empty)
    assert empty.get_seq_length() == 0 and not any(isinstance(layer, PressedLayer) for layer in empty.layers)
    with Scratch(cache) as pass_:  # a layer released mid-pass and replaced afterwards is the one put back on exit
        model(prompt(1, 25)[:, 20:], cache=cache)
        pass_.release(0)
        cache.layers[0] = PressedLayer()
    assert all(a is b for a, b in zip(cache.layers, layers, strict=True)) and cache.get_seq_length() == 25


@pytest.mark.parametrize("head_wise", [False, True])
def test_scratch_refuses_to_put_back_a_layer_a_press_evicted_from_inside(head_wise):
    """Rewinding drops what was appended: a press that evicts inside a scratch would leave other tokens in the held
    slots, so the exit raises, names the layers and marks the cache torn; frozen inside, the same press is fine."""
    from kvpress import AdaKVPress
    from kvpress.patches.cache import Scratch, scratch

    model = tiny_model("llama")
    make = lambda: AdaKVPress(SnapKVPress(0.5, window_size=4)) if head_wise else SnapKVPress(0.5, window_size=4)  # noqa: E731
    cache = DynamicCache(config=model.config)
    with make()(model):
        model(prompt(1, 40), cache=cache)
    held = [layer.held().clone() for layer in cache.layers]
    with make()(model) as installed, installed.frozen(), scratch(cache):
        model(prompt(1, 70)[:, 40:], cache=cache)
    assert cache.get_seq_length() == 40
    assert all(torch.equal(a.held(), b) for a, b in zip(cache.layers, held, strict=True))
    with pytest.raises(RuntimeError, match=r"layers \[0, 1.*evicted or rewrote held slots inside `scratch`"):
        with make()(model), scratch(cache):
            model(prompt(1, 70)[:, 40:], cache=cache)  # 30 more tokens: over the budget, so the press evicts
    assert all(layer.torn for layer in cache.layers)
    with pytest.raises(ValueError, match="or by `scratch`, which cannot undo an eviction inside"), make()(model):
        model(prompt(1, 41)[:, 40:], cache=cache)
    cache = DynamicCache(config=model.config)  # released mid-pass, then put back again as an error leaves: still torn
    with make()(model):
        model(prompt(1, 40), cache=cache)
    with pytest.raises(KeyError), make()(model), Scratch(cache) as pass_:
        model(prompt(1, 70)[:, 40:], cache=cache)
        pass_.release(0)
        raise KeyError("a later failure")
    assert all(layer.torn for layer in cache.layers)
