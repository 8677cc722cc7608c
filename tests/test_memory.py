"""The cache really shrinks: bytes are summed over every tensor the cache keeps."""

import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from kvpress import (
    HeavyHitterPress,
    KnormPress,
    PressedLayer,
    SinkWindowPress,
    SnapKVPress,
    cache_bytes,
)
from kvpress.patches import model_access
from kvpress.patches.cache import tensor_bytes
from tiny import live_presses, prompt, tiny_model

WINDOW = 16
# the presses that evict inside a forward with the same budget in every layer (per-layer budgets keep each
# layer's window even where its share is smaller, so their total can exceed the bound below)
PRESSES = {name: lambda r, make=make: make(compression_ratio=r)
           for name, make in live_presses(window_size=WINDOW).items()
           if all(make(compression_ratio=0.5).layer_scale(i, 2) == 1.0 for i in range(2))}  # fmt: skip


def _model():
    # head_dim 64 like the default model, so the per-slot index overhead is realistic
    return tiny_model("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)


def _prefill(model, ids, press=None):
    cache = DynamicCache(config=model.config)
    if press is None:
        model(ids, cache=cache)
    else:
        with press(model):
            model(ids, cache=cache)
    return cache


def test_views_count_whole_storage():
    big = torch.zeros(10, 100)
    assert tensor_bytes([big[:, :5]]) == big.numel() * 4
    assert tensor_bytes([big, big[1:]]) == big.numel() * 4


@pytest.mark.parametrize("name", list(PRESSES))
@pytest.mark.parametrize("ratio", [0.5, 0.75])
def test_prefill_bytes(name, ratio):
    model = _model()
    ids = prompt(1, 256)
    full = cache_bytes(_prefill(model, ids))
    cache = _prefill(model, ids, PRESSES[name](ratio))
    per_token = full / 256
    kept = cache_bytes(cache)
    assert kept <= (1 - ratio) * full + WINDOW * per_token, (kept, full)
    assert kept < 0.7 * full if ratio == 0.5 else kept < 0.45 * full
    for layer in cache.layers:  # storage itself is small: no masked full-size tensor behind a view
        assert isinstance(layer, PressedLayer)
        assert layer.keys.untyped_storage().nbytes() == layer.keys.numel() * 4
        assert layer.keys.shape[-2] == round(256 * (1 - ratio))


class _Record(LogitsProcessor):
    def __init__(self, cache):
        self.cache, self.sizes, self.bytes = cache, [], []

    def __call__(self, input_ids, scores):
        self.sizes.append(max(layer.n for layer in self.cache.layers))
        self.bytes.append(cache_bytes(self.cache))
        return scores


@pytest.mark.parametrize("name", ["snapkv", "h2o", "sink-window", "knorm"])
def test_decode_budget_held_for_200_steps(name):
    model = tiny_model("llama")
    budget = 32
    press = {
        "snapkv": SnapKVPress(max_tokens=budget, window_size=8),
        "h2o": HeavyHitterPress(max_tokens=budget),
        "sink-window": SinkWindowPress(max_tokens=budget),
        "knorm": KnormPress(max_tokens=budget),
    }[name]
    cache = DynamicCache(config=model.config)
    record = _Record(cache)
    with press(model):
        out = model.generate(
            prompt(1, 48),
            cache=cache,
            max_new_tokens=200,
            min_new_tokens=200,
            do_sample=False,
            logits_processor=LogitsProcessorList([record]),
        )
    assert out.shape[1] == 248
    assert len(record.sizes) == 200
    assert max(record.sizes) == budget
    assert max(record.bytes) <= min(record.bytes) * (budget + 1) / budget  # one spare slot at most
    assert cache.get_seq_length() == 247  # positions keep counting


@pytest.mark.parametrize("slack", [0.0, 0.1])
def test_ratio_budget_grows_with_decoding(slack):
    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    record = _Record(cache)
    with SnapKVPress(compression_ratio=0.5, window_size=4, decode_slack=slack)(model):
        model.generate(
            prompt(1, 40),
            cache=cache,
            max_new_tokens=60,
            min_new_tokens=60,
            do_sample=False,
            logits_processor=LogitsProcessorList([record]),
        )
    assert cache.get_seq_length() == 99
    for step, size in enumerate(record.sizes):
        seen = 40 + step
        budget = seen - seen // 2
        assert budget - int(budget * slack) - 1 <= size <= budget
    if slack == 0:
        assert record.sizes == [40 + s - (40 + s) // 2 for s in range(60)]
    else:  # a row over its budget is cut to budget - floor(budget x slack) at once, then grows: few cuts
        cuts = [step for step in range(1, 60) if record.sizes[step] <= record.sizes[step - 1]]
        assert 0 < len(cuts) < 20
        for step in cuts:
            budget = (40 + step) - (40 + step) // 2
            assert record.sizes[step] == budget - int(budget * slack), step


def test_decode_slack_validated():
    with pytest.raises(ValueError, match=r"decode_slack must be a fraction in \[0, 1\)"):
        SnapKVPress(compression_ratio=0.5, decode_slack=1.5)
    # a large slack cuts to the protected tokens at most (8 of a budget of 10), and a prefill to the budget itself
    press = SnapKVPress(compression_ratio=0.5, window_size=8, decode_slack=0.9)
    assert press.target(torch.tensor([10]), 1).tolist() == [8] and press.target(torch.tensor([10]), 5).tolist() == [10]


@pytest.mark.parametrize(
    "press, seen, expected",
    [
        (SnapKVPress(compression_ratio=0.37), [10, 100, 1000], [10, 64, 630]),  # floor: the 64-token window
        (HeavyHitterPress(compression_ratio=0.9), [10, 1000], [1, 100]),
        (SinkWindowPress(compression_ratio=0.99), [3, 1000], [3, 10]),
        (SnapKVPress(max_tokens=100), [50, 1000], [50, 100]),
        # 90 x 0.7 is 62.99999999999999 in binary floating point: 27 kept, not 28 (the ratio read as written)
        (KnormPress(compression_ratio=0.7), [90, 100, 170], [27, 30, 51]),
        (KnormPress(compression_ratio=0.57), [100], [43]),
        (KnormPress(max_tokens=100, layer_scales=(1, 3)), [1000], [50]),
    ],
)
def test_budget_values(press, seen, expected):
    scale = press.layer_scale(0, 2) if press.layer_scales else 1.0
    assert press.row_budgets(0, 2, seen) == expected
    assert [press.budget_of(n, scale) for n in seen] == expected


@pytest.mark.parametrize("name", list(PRESSES))
def test_chunked_prefill_holds_the_budget_after_every_chunk(name):
    """transformers' `prefill_chunk_size` inside model.generate: each chunk's forward evicts, so the cache never
    holds more than the budget of the tokens seen plus one chunk (and after each forward, the budget itself)."""
    model = _model()
    budget, chunk = 24, 16
    press = live_presses(window_size=8)[name](max_tokens=budget)
    cache = DynamicCache(config=model.config)
    held = []
    module = model_access.attention_modules(model)[0]
    hook = module.register_forward_hook(lambda *_: held.append((cache.layers[0].n, cache.layers[0].seen)))
    try:
        with press(model):
            model.generate(prompt(1, 100), cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=0,
                           prefill_chunk_size=chunk)  # fmt: skip
    finally:
        hook.remove()
    assert [seen for _, seen in held[:7]] == [16, 32, 48, 64, 80, 96, 100]  # 7 chunks, then decoding
    assert all(n <= min(seen, budget) for n, seen in held)  # evicted within each chunk's forward


def test_prefill_context_in_chunks_holds_the_budget_after_every_chunk_and_refuses_whole_context_presses():
    """kvpress.generate's prefill with prefill_chunk_size: each chunk's forward evicts, as inside model.generate;
    a chunk as long as the prompt is the one-forward prefill; presses scoring the whole context are refused but
    KVzip and AdaKV over it (tests/test_kvzip_chunks.py)."""
    from kvpress import AdaKVPress, press_from_name
    from kvpress.pipeline import prefill_context

    model = _model()
    ids = prompt(1, 100)
    press = SnapKVPress(max_tokens=24, window_size=8)
    held = []
    cache = DynamicCache(config=model.config)
    hook = model_access.attention_modules(model)[0].register_forward_hook(
        lambda *_: held.append((cache.layers[0].n, cache.layers[0].seen)))  # fmt: skip
    try:
        prefill_context(model, ids, press, cache, prefill_chunk_size=16)
    finally:
        hook.remove()
    assert [seen for _, seen in held] == [16, 32, 48, 64, 80, 96, 100] and all(n <= 24 for n, _ in held)
    one, whole = DynamicCache(config=model.config), DynamicCache(config=model.config)
    prefill_context(model, ids, press, one, prefill_chunk_size=100)
    prefill_context(model, ids, press, whole)
    assert torch.equal(one.layers[0].keys, whole.layers[0].keys)
    with pytest.raises(ValueError, match="AdaKVPress over LookaheadPress .* cannot prefill in chunks .* KVzipPress"):
        lookahead = AdaKVPress(press_from_name("lookahead", compression_ratio=0.5))
        prefill_context(model, ids, lookahead, DynamicCache(config=model.config), prefill_chunk_size=16)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="prefill_chunk_size must be a positive number"):
            prefill_context(model, ids, press, DynamicCache(config=model.config), prefill_chunk_size=bad)
