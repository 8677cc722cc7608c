"""SimLayerKVPress: once the prompt is cached, the laziest layers (attention of the last query on the sinks and the
recent window) keep only those, as many layers as the budget needs; the others keep everything."""

import pytest
import torch
from transformers import DynamicCache

from kvpress import SimLayerKVPress
from kvpress.recording import compress_recording, record_prefill
from tiny import greedy_scores, left_padded, prompt, tiny_model


def _laziness(model, ids, n_sink, window):
    recording = record_prefill(model, ids)
    out = {}
    for idx, (module, query) in recording.queries.items():
        keys = recording.cache.layers[idx].keys
        logits = (query[0, :, -1:] @ keys[0].repeat_interleave(2, dim=0).transpose(-1, -2)) * module.scaling
        probs = logits.softmax(-1)[:, 0]  # [Hq, n]
        n = probs.shape[-1]
        local = torch.zeros(n, dtype=torch.bool)
        local[:n_sink] = local[n - window :] = True
        out[idx] = float(probs[:, local].sum(-1).mean())
    return recording, out


@pytest.mark.parametrize("ratio", [0.3, 0.6])
def test_the_laziest_layers_keep_sinks_and_window_until_the_budget_holds(ratio):
    model = tiny_model("llama", num_hidden_layers=4)
    recording, laziness = _laziness(model, prompt(1, 80), 2, 6)
    press = SimLayerKVPress(compression_ratio=ratio, n_sink=2, window_size=6)
    cache = compress_recording(model, recording, press)
    order = sorted(laziness, key=lambda i: -laziness[i])
    budget = 4 * (80 - int(80 * ratio))
    k = next(k for k in range(5) if (4 - k) * 80 + k * 8 <= budget)  # the fewest lazy layers that fit
    assert sorted(i for i, lazy in press.lazy.items() if lazy[0]) == sorted(order[:k])
    for idx, layer in enumerate(cache.layers):
        expected = [0, 1, *range(74, 80)] if idx in order[:k] else list(range(80))
        for head in range(layer.keys.shape[1]):
            assert sorted(layer.pos[0, head, : layer.n].tolist()) == expected
    assert sum(layer.n for layer in cache.layers) <= budget


def test_inside_generate_without_a_tokenizer_lazy_layers_grow_from_their_window():
    model = tiny_model("qwen2", num_hidden_layers=4)
    cache = DynamicCache(config=model.config)
    press = SimLayerKVPress(compression_ratio=0.5, n_sink=2, window_size=6)
    with press(model):
        model.generate(prompt(1, 60), cache=cache, max_new_tokens=5, do_sample=False, pad_token_id=0)
    lazy = [idx for idx, is_lazy in press.lazy.items() if is_lazy[0]]
    assert lazy and all(cache.layers[idx].n == 8 + 1 + 4 for idx in lazy)  # + the last prompt token, 4 generated
    assert all(cache.layers[idx].n == 64 for idx in range(4) if idx not in lazy)


def test_each_row_of_a_batch_has_the_plan_it_has_alone():
    """Lazy layers are chosen per row (by that row's attention and budget): a left-padded batch and an unpadded one
    give each row the tokens it gets alone (one plan for the whole batch, from every row's attention averaged and
    the longest row's span, gave the rows other layers)."""
    model = tiny_model("llama", num_hidden_layers=6)
    press = SimLayerKVPress(compression_ratio=0.3, n_sink=2, window_size=6)
    settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    rows = [prompt(1, 96, seed=1)[0], prompt(1, 40, seed=2)[0], prompt(1, 60, seed=3)[0]]
    with press(model):
        alone = [model.generate(row[None], **settings)[0, len(row) :] for row in rows]
        plans = []
        for row in rows:
            model.generate(row[None], **{**settings, "max_new_tokens": 1})
            plans.append(sorted(idx for idx, lazy in press.lazy.items() if lazy[0]))
        ids, mask = left_padded(rows)
        padded = model.generate(ids, attention_mask=mask, **settings)[:, 96:]
        assert [sorted(idx for idx, lazy in press.lazy.items() if lazy[i]) for i in range(3)] == plans
        even = model.generate(torch.stack([rows[0], prompt(1, 96, seed=4)[0]]), **settings)[:, 96:]
    assert len({tuple(plan) for plan in plans}) > 1, "every row chose the same layers: the test shows nothing"
    assert all(torch.equal(padded[i], alone[i]) for i in range(3))
    assert torch.equal(even[0], alone[0])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_on_sliding_layers_a_lazy_layer_keeps_the_latest_tokens_in_a_batch_as_alone(attn):
    """Where a sliding window's sinks have left, a lazy layer's budget (sinks + window) takes the latest tokens
    before its window: every token scored alike before, so the slots' layout chose, and the longest row of a
    left-padded batch kept position 32 over 33 where alone it kept 33 (logits 0.5 apart)."""
    model = tiny_model("gemma3", attn)
    rows = [prompt(1, 40, seed=1)[0], prompt(1, 27, seed=2)[0]]
    ids, mask = left_padded(rows)
    make = lambda: SimLayerKVPress(compression_ratio=0.5, n_sink=2, window_size=4)  # noqa: E731
    batch, cache = greedy_scores(model, ids, make(), new=6, mask=mask)
    for i, row in enumerate(rows):
        alone, single = greedy_scores(model, row[None], make(), new=6)
        assert (alone[:, 0] - batch[:, i]).nan_to_num(0.0).abs().max() <= 1e-5
        for layer in single.layers:
            if layer.window is not None:  # what the next token sees: the last window - 1 real tokens, in order
                last = layer.seen - 1
                assert sorted(layer.pos[0, 0, : layer.n].tolist()) == list(range(last - layer.n + 1, last + 1))


def test_bad_parameters_are_refused_by_name():
    with pytest.raises(ValueError, match="n_last"):
        SimLayerKVPress(0.5, n_last=0)
    with pytest.raises(ValueError, match="layer_scales"):
        SimLayerKVPress(0.5, layer_scales=(1.0, 2.0))
