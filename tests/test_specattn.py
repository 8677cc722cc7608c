"""SpecAttn: a layer-skipped draft of the answer scores the context; each layer reads its closest drafted layer."""

import copy
import threading

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress import SpecAttnPress
from kvpress.patches import model_access
from kvpress.presses.lookahead import draft_attention
from kvpress.presses.specattn import layers_to_skip, window_profile
from kvpress.recording import compress_recording, record_prefill
from tiny import prompt, tiny_model


def _recording(model, length=40):
    ids = prompt(1, length + 1, seed=3)
    return record_prefill(model, ids[:, :length], next_ids=ids[:, length:])


def test_the_draft_skips_layers_and_each_layer_reads_its_closest_drafted_pair():
    model = tiny_model("llama", num_hidden_layers=5)
    assert layers_to_skip(5, 2) == {1, 3} and layers_to_skip(9, 4) == {3, 7} and layers_to_skip(5, 0) == set()
    recording = _recording(model)
    before = copy.deepcopy(recording.cache)
    ran = []
    hooks = [m.register_forward_hook(lambda m, *_: ran.append(m.layer_idx))
             for m in model_access.attention_modules(model).values()]  # fmt: skip
    try:
        press = SpecAttnPress(0.5, skip_every=2, lookahead=3, window_size=4)
        press.prepare(model, recording)
    finally:
        for hook in hooks:
            hook.remove()
    assert set(ran) == {0, 2, 4}  # layers 1 and 3 never ran in the draft
    assert all("forward" not in vars(layer) for layer in model_access.decoder_layers(model))  # restored
    for layer, kept in zip(recording.cache.layers, before.layers, strict=True):  # drafted in it, then dropped
        assert torch.equal(layer.keys, kept.keys) and layer.n == layer.seen == 40
    draft = draft_attention(model, recording, 3, skip=frozenset({1, 3}))
    assert set(draft) == {0, 2, 4}
    rows = {d: (total / count)[0] for d, (total, count) in draft.items()}  # [Hkv, n] per drafted layer
    for idx in range(5):
        profile = window_profile(recording, idx, 4)[0]
        for head in range(profile.shape[0]):
            got = press.scores[idx][0, head]
            if idx in rows:
                assert torch.equal(got, rows[idx][head])  # a drafted pair reads itself
            pairs = [(d, h) for d in rows for h in range(rows[d].shape[0])]
            kl = [float((profile[head] * (profile[head].log() - window_profile(recording, d, 4)[0, h].log())).sum())
                  for d, h in pairs]  # fmt: skip
            d, h = pairs[min(range(len(kl)), key=kl.__getitem__)]
            assert torch.equal(got, rows[d][h])


def test_layers_are_skipped_for_the_drafting_thread_only():
    """The draft skips layers on the model itself: another thread's forward meanwhile runs the whole model."""
    model = tiny_model("llama", num_hidden_layers=5)
    ids = prompt(1, 12, seed=4)
    whole, elsewhere = model(ids).logits, []

    def other() -> None:
        with torch.inference_mode():  # (a thread starts outside the tests' inference mode)
            elsewhere.append(model(ids).logits)

    with model_access.skipped_layers(model, {1, 3}):
        drafted = model(ids).logits
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert not torch.allclose(drafted, whole) and torch.equal(elsewhere[0], whole)
    assert all("forward" not in vars(layer) for layer in model_access.decoder_layers(model))


def test_drafting_with_every_layer_is_lookaheads_draft():
    model = tiny_model("llama", num_hidden_layers=3)
    recording = _recording(model)
    press = SpecAttnPress(0.5, skip_every=0, lookahead=2)
    press.prepare(model, recording)
    for idx, (total, count) in draft_attention(model, recording, 2).items():
        assert torch.equal(press.scores[idx], total / count)


def test_generate_query_aware_keeps_the_budget_and_refusals():
    model = tiny_model("llama", num_hidden_layers=4)
    recording = _recording(model)
    cache = compress_recording(model, recording, SpecAttnPress(0.5, window_size=4, lookahead=2))
    assert all(layer.n == 20 for layer in cache.layers)
    with pytest.raises(ValueError, match="use query_aware=True"):
        compress_recording(model, record_prefill(model, prompt(1, 40)), SpecAttnPress(0.5))
    with pytest.raises(ValueError, match="skip_every must be 0 .skip none. or an integer >= 2"):
        SpecAttnPress(0.5, skip_every=1)
    with pytest.raises(ValueError, match="window_size must be a positive integer .its queries pair the layers"):
        SpecAttnPress(0.5, window_size=0)  # (no query to pair by: every layer read layer 0's draft)
    with pytest.raises(ValueError, match="skip_every=4 skips no layer of LlamaForCausalLM's 4 .* give 2 to 3"):
        with SpecAttnPress(0.5, skip_every=4)(model, tokenizer=object()):
            pass
    with pytest.raises(ValueError, match="SpecAttnPress pairs layers by their attention over the whole context"):
        with SpecAttnPress(0.5)(tiny_model("mistral-window"), tokenizer=object()):
            pass
    model, tokenizer = kvpress.load_model()
    out = DynamicCache(config=model.config)
    answer = kvpress.generate(model, tokenizer, "The pass key is 71432. " + "The sun is yellow. " * 30,
                              "What is the pass key?", press=kvpress.press_from_name("specattn", compression_ratio=0.5),
                              query_aware=True, chat_template=False, cache=out, max_new_tokens=3)  # fmt: skip
    assert isinstance(answer, str) and out.layers[0].n < out.layers[0].seen
