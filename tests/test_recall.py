"""RecallPress: the prompt's slots wait in a host store; a question read inside frozen() exchanges the least attended
held tokens for the stored spans it attends to most, one for one, so the working cache keeps its size."""

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress import AdaKVPress, KVzipPress, RecallPress, SnapKVPress
from kvpress.presses.recall import offloaded_bytes
from tiny import prompt, tiny_model


def _compressed(model, press, ids):
    cache = DynamicCache(config=model.config)
    with press(model):
        model(ids, cache=cache)
    return cache


def test_a_question_exchanges_held_tokens_for_stored_ones_and_the_cache_keeps_its_size():
    model = tiny_model("llama")
    ids, question = prompt(1, 60), prompt(1, 70)[:, 60:]
    full = DynamicCache(config=model.config)
    model(torch.cat([ids, question], dim=1), cache=full)
    press = RecallPress(SnapKVPress(0.5, window_size=2), span_size=4, recall_fraction=0.5)
    cache = _compressed(model, press, ids)
    before = [layer.pos[0, :, : layer.n].clone() for layer in cache.layers]
    working, stored = kvpress.cache_bytes(cache), offloaded_bytes(cache)
    assert stored > working and all(layer.offloaded is not None for layer in cache.layers)
    with press(model) as installed, installed.frozen():
        model(question, cache=cache)
    moved = 0
    for idx, layer in enumerate(cache.layers):
        pos = layer.pos[0, :, : layer.n].long()
        assert layer.n == 30 + 10 and layer.seen == 70
        for head in range(pos.shape[0]):
            assert len(set(pos[head].tolist())) == layer.n  # no position twice
            assert {58, 59} | set(range(60, 70)) <= set(pos[head].tolist())  # the window and the question stay
            context = (pos[head] < 60).nonzero().flatten()  # the question's own keys saw a compressed cache
            for name in ("keys", "values"):
                held, reference = getattr(layer, name)[0, head], getattr(full.layers[idx], name)[0, head]
                torch.testing.assert_close(held[context], reference[pos[head, context]])
            moved += len(set(pos[head].tolist()) - set(before[idx][head].tolist()) - set(range(60, 70)))
    assert moved > 0
    assert offloaded_bytes(cache) == stored


def test_the_question_forward_in_two_parts_gives_the_same_logits():
    model = tiny_model("qwen2")
    ids, question = prompt(1, 40), prompt(1, 48)[:, 40:]
    press = RecallPress(SnapKVPress(0.0), recall_fraction=0.5)  # r = 0: nothing evicted, nothing to recall
    cache = _compressed(model, press, ids)
    reference = DynamicCache(config=model.config)
    model(ids, cache=reference)
    expected = model(question, cache=reference).logits
    with press(model) as installed, installed.frozen():
        got = model(question, cache=cache).logits
        last = model(prompt(1, 52)[:, 48:], cache=cache, logits_to_keep=1).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert last.shape[1] == 1 and cache.layers[0].seen == 52


def test_refuses_presses_it_cannot_wrap_and_bad_parameters():
    with pytest.raises(TypeError, match="pass of its own"):
        RecallPress(KVzipPress(0.5))
    with pytest.raises(TypeError, match="token-level"):
        RecallPress(AdaKVPress(SnapKVPress(0.5)))
    with pytest.raises(ValueError, match="kv_bits"):
        RecallPress(SnapKVPress(0.5, kv_bits=8))
    with pytest.raises(ValueError, match="span_size"):
        RecallPress(SnapKVPress(0.5), span_size=0)
    with pytest.raises(ValueError, match="recall_fraction"):
        RecallPress(SnapKVPress(0.5), recall_fraction=1.5)
    with pytest.raises(ValueError, match="recall_fraction=0 recalls nothing"):
        RecallPress(SnapKVPress(0.5), recall_fraction=0, recall_every=8)


def test_a_cache_with_a_store_is_not_saved_without_it(tmp_path):
    model = tiny_model("llama")
    cache = _compressed(model, RecallPress(SnapKVPress(0.5)), prompt(1, 20))
    with pytest.raises(ValueError, match="RecallPress store"):
        kvpress.save_cache(cache, tmp_path / "c.safetensors", model)


def test_decoding_recalls_every_few_tokens_and_keeps_the_budget():
    model = tiny_model("llama")
    ids = prompt(1, 60)
    press = RecallPress(SnapKVPress(max_tokens=20, window_size=2), span_size=4, recall_every=3)
    cache = DynamicCache(config=model.config)
    steps = []
    original = press._recall
    press._recall = lambda obs: (steps.append((obs.layer_idx, obs.layer.seen)), original(obs))
    with press(model):
        model.generate(ids, cache=cache, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert sorted({seen for _, seen in steps}) == [63, 66]  # tokens 61..67 decoded; every third one recalls
    assert all(layer.n <= 20 and layer.seen == 67 for layer in cache.layers)
    padded = torch.ones(2, 30, dtype=torch.long)
    padded[0, :5] = 0
    with pytest.raises(ValueError, match="without padding"), press(model):
        model(prompt(2, 30), attention_mask=padded, cache=DynamicCache(config=model.config))


def test_scratch_puts_exchanged_slots_and_the_store_back_and_a_two_token_question_recalls():
    from kvpress.patches.cache import scratch

    model = tiny_model("llama")
    press = RecallPress(SnapKVPress(0.5, window_size=2), span_size=4, recall_fraction=0.5)
    cache = _compressed(model, press, prompt(1, 60))
    before = [(layer.pos[..., : layer.n].clone(), layer.keys[..., : layer.n, :].clone()) for layer in cache.layers]
    with scratch(cache), press(model) as installed, installed.frozen():
        model(prompt(1, 62)[:, 60:], cache=cache)  # two tokens: a one-token head, then the last
        moved = [set(layer.pos[0, 0, : layer.n].tolist()) - set(pos[0, 0].tolist()) - {60, 61}
                 for layer, (pos, _) in zip(cache.layers, before, strict=True)]  # fmt: skip
    assert any(moved)
    for layer, (pos, keys) in zip(cache.layers, before, strict=True):
        assert torch.equal(layer.pos[..., : layer.n], pos) and torch.equal(layer.keys[..., : layer.n, :], keys)
    with scratch(cache), press(model) as installed, installed.frozen():  # the store is unread again: one token recalls
        model(prompt(1, 61)[:, 60:], cache=cache)
        assert any(set(layer.pos[0, 0, : layer.n].tolist()) - set(pos[0, 0].tolist()) - {60}
                   for layer, (pos, _) in zip(cache.layers, before, strict=True))  # fmt: skip
    stored = offloaded_bytes(cache)
    with scratch(cache), RecallPress(SnapKVPress(0.0))(model):  # read as a prompt (nothing evicted): its tokens go
        model(prompt(1, 70)[:, 60:], cache=cache)  # to the store, and leave it with the scratch
        assert offloaded_bytes(cache) > stored
    assert offloaded_bytes(cache) == stored
    for layer, (pos, keys) in zip(cache.layers, before, strict=True):
        assert torch.equal(layer.pos[..., : layer.n], pos) and torch.equal(layer.keys[..., : layer.n, :], keys)
    plain = _compressed(model, SnapKVPress(0.5), prompt(1, 60))
    held = [(layer.pos[..., : layer.n].clone(), layer.keys[..., : layer.n, :].clone()) for layer in plain.layers]
    with scratch(plain), RecallPress(SnapKVPress(0.0))(model):  # a store begun inside goes with it (nothing evicted)
        model(prompt(1, 70)[:, 60:], cache=plain)
        assert offloaded_bytes(plain) > 0
    assert offloaded_bytes(plain) == 0 and all(layer.offloaded is None for layer in plain.layers)
    for layer, (pos, keys) in zip(plain.layers, held, strict=True):
        assert torch.equal(layer.pos[..., : layer.n], pos) and torch.equal(layer.keys[..., : layer.n, :], keys)


def test_it_cannot_be_wrapped_and_its_store_does_not_outlive_the_prompt():
    with pytest.raises(TypeError, match="cannot wrap RecallPress"):
        AdaKVPress(RecallPress(SnapKVPress(0.5)))
    with pytest.raises(TypeError, match="cannot wrap RecallPress"):
        kvpress.press_from_name("chunkkv:inner=recall", compression_ratio=0.5)
    model = tiny_model("llama")
    press = RecallPress(SnapKVPress(0.5))
    cache = _compressed(model, press, prompt(1, 20))
    with pytest.raises(ValueError, match="beam"):
        cache.reorder_cache(torch.tensor([0]))
    cache.reset()
    assert all(layer.offloaded is None for layer in cache.layers)
    cache = _compressed(model, press, prompt(1, 20))
    with pytest.raises(ValueError, match="labels"), press(model) as installed, installed.frozen():
        model(prompt(1, 24)[:, 20:], cache=cache, labels=prompt(1, 24)[:, 20:])
    for keep in (1, 3):  # a question read in two forwards still answers as a tuple where one is asked for
        outputs = {}
        for as_dict in (True, False):
            cache = _compressed(model, press, prompt(1, 20))
            with press(model) as installed, installed.frozen():
                outputs[as_dict] = model(prompt(1, 24)[:, 20:], cache=cache, logits_to_keep=keep, return_dict=as_dict)
        assert isinstance(outputs[False], tuple) and torch.equal(outputs[False][0], outputs[True].logits)
