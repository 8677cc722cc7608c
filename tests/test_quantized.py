"""Quantized and evicted: a press with `kv_bits` stores what it keeps in 8 or 4 bits (codes per slot, channel
ranges per layer and head), composed with dense and head-wise layers, live and recorded alike."""

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress import AdaKVPress, HeadwiseLayer, PressedLayer, SnapKVPress
from kvpress.patches import kv_quantization as quant
from kvpress.patches.cache import layer_tensors, tensor_bytes
from kvpress.pipeline import answer_ids_from_cache
from kvpress.recording import compress_recording, record_prefill
from kvpress.rounds import RoundPolicy
from tiny import prompt, tiny_model


def _keys_with_outlier_channels(n: int = 64, d: int = 16) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(2, 3, n, d)
    x[..., 3] = x[..., 3] * 20 + 40  # a key channel far from zero and wide (KIVI's outliers)
    return x


@pytest.mark.parametrize("bits, bound", [(8, 0.006), (4, 0.1)])
def test_codes_decode_close_to_what_they_encode(bits, bound):
    x = _keys_with_outlier_channels()
    stats = quant.fit(x)
    codes = quant.encode(x, stats, bits)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == quant.code_width(bits, 16) == 16 * bits // 8 + 2
    back = quant.decode(codes, stats, bits, torch.float32)
    error = (back - x).abs() / stats[..., 1:2, :]  # relative to each channel's half-range
    assert float(error.max()) < bound
    # without the channel ranges the outlier channel would swamp the others: every channel keeps its detail
    assert float((back - x)[..., :3].abs().mean()) < 0.2 * float(x[..., :3].abs().mean()) * (8 / bits) ** 2
    # one slot alone encodes as it does among others (eviction may move any slot anywhere)
    assert torch.equal(quant.encode(x[:, :, 5:6], stats, bits), codes[:, :, 5:6])


def test_bad_widths_are_refused():
    for bits in (3, 16, True, "4"):
        with pytest.raises(ValueError, match="kv_bits must be one of 8, 4"):
            SnapKVPress(0.5, kv_bits=bits)
    with pytest.raises(ValueError, match="needs an even head size"):
        quant.check_bits(4, 15)
    with pytest.raises(ValueError, match="rerotate=True re-rotates held keys"):
        SnapKVPress(0.5, kv_bits=4, rerotate=True)(tiny_model("llama"))
    with pytest.raises(ValueError, match="kv_bits are not supported there"):
        RoundPolicy(inner=SnapKVPress(0.5, kv_bits=8))
    with pytest.raises(ValueError, match="takes kv_bits from the wrapped press"):
        AdaKVPress(SnapKVPress(0.5), kv_bits=4)
    pyramid = kvpress.PyramidKVPress(0.5, kv_bits=4)  # no press given: its own SnapKV stores at that width
    assert pyramid.kv_bits == pyramid.press.kv_bits == 4
    # a quantized cache (a loaded one, or left by another press) continued by a re-rotating press: it re-rotated the
    # codes and failed on a raw size mismatch
    model = tiny_model("llama")
    cache = _prefilled(SnapKVPress(0.5, window_size=4, kv_bits=4), model, prompt(1, 40))
    with pytest.raises(ValueError, match=r"holds quantized keys \(kv_bits\), which KnormPress \(rerotate=True\)"):
        with kvpress.KnormPress(0.5, rerotate=True)(model):
            model(prompt(1, 1), cache=cache)


def _prefilled(press, model, ids) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with press(model):
        model(ids, cache=cache)
    return cache


@pytest.mark.parametrize("bits", [8, 4])
def test_cache_bytes_count_the_codes_scales_and_channel_ranges(bits):
    model = tiny_model("llama")
    b, n, d = 2, 40, model.config.head_dim
    dense = _prefilled(SnapKVPress(0.5, window_size=4), model, prompt(b, n))
    cache = _prefilled(SnapKVPress(0.5, window_size=4, kv_bits=bits), model, prompt(b, n))
    h = model.config.num_key_value_heads
    for plain, layer in zip(dense.layers, cache.layers, strict=True):
        assert layer.kv_bits == bits and layer.keys.dtype == torch.uint8 and layer.n == plain.n == n // 2
        per_slot = 2 * quant.code_width(bits, d) + 4  # key and value codes + the int32 position
        stats = b * h * 2 * d * 2  # the key channels' centres and half-ranges, fp16
        counters = 2 * b * 8  # real tokens seen and evicted per row, int64
        assert tensor_bytes(layer_tensors(layer)) == b * h * layer.n * per_slot + stats + counters
    # what a press keeps, quantized: at 4 bits the codes (scales included) take 1/7.5 of fp32 at head size 64
    assert 64 * 4 / quant.code_width(4, 64) > 7.5


@pytest.mark.parametrize("press", [
    lambda bits: SnapKVPress(0.5, window_size=4, kv_bits=bits),
    lambda bits: kvpress.H2OPress(0.5, kv_bits=bits),
    lambda bits: AdaKVPress(SnapKVPress(0.5, window_size=4, kv_bits=bits)),
], ids=["snapkv", "h2o", "adakv"])  # fmt: skip
def test_a_recorded_prefill_keeps_the_codes_a_live_one_keeps(tokenized, press):
    """The sweep's path (record, then compress) and model.generate under the press give the same tokens."""
    model, tokenizer = tokenized
    ids = prompt(1, 48)
    recording = record_prefill(model, ids[:, :-1])
    cache = compress_recording(model, recording, press(4))
    live = DynamicCache(config=model.config)
    with press(4)(model):
        model(ids[:, :-1], cache=live)
    for a, b in zip(cache.layers, live.layers, strict=True):
        assert a.kv_bits == b.kv_bits == 4
        if isinstance(a, HeadwiseLayer):
            assert a.lengths == b.lengths and torch.equal(a.store["keys"], b.store["keys"])
        else:
            assert torch.equal(a.keys[:, :, : a.n], b.keys[:, :, : b.n])
    recorded = answer_ids_from_cache(model, tokenizer, ids, cache, press(4), max_new_tokens=6)
    assert torch.equal(answer_ids_from_cache(model, tokenizer, ids, live, press(4), max_new_tokens=6), recorded)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral-window", "gemma3"])
def test_8_bits_barely_move_the_next_token_distribution(family):
    """At r = 0 (nothing evicted) an 8-bit cache's next-token logits stay next to the full cache's, 4 bits
    further off but bounded; the layers hold codes and keep decoding (dense and head-wise)."""
    model = tiny_model(family)
    ids = prompt(1, 48)
    logits = {}
    for bits in (None, 8, 4):
        for name, make in (("dense", SnapKVPress), ("headwise", lambda **kw: AdaKVPress(SnapKVPress(**kw)))):
            cache = DynamicCache(config=model.config)
            with make(compression_ratio=0.0, kv_bits=bits)(model):
                model(ids[:, :-8], cache=cache)
                for t in range(8, 0, -1):  # decoded one token at a time over the quantized cache
                    out = model(ids[:, -t:][:, :1], cache=cache).logits[0, -1]
            logits[bits, name] = out.log_softmax(-1)
            if bits is not None:
                assert all(layer.kv_bits == bits for layer in cache.layers if isinstance(layer, PressedLayer))
    for name in ("dense", "headwise"):
        full = logits[None, name]
        gap8, gap4 = ((logits[b, name] - full).abs().max() for b in (8, 4))
        assert gap8 < 0.02 * full.abs().max() and gap4 < 0.25 * full.abs().max()
        assert gap8 < gap4


def test_quantized_head_wise_layers_continue_decoding_and_free_memory():
    model = tiny_model("qwen2")
    ids = prompt(2, 48)
    caches = {bits: DynamicCache(config=model.config) for bits in (None, 4)}
    for bits, cache in caches.items():
        with AdaKVPress(SnapKVPress(0.5, window_size=4, kv_bits=bits))(model):
            model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=6, do_sample=False,
                           pad_token_id=0)  # fmt: skip
    layer = caches[4].layers[0]
    assert isinstance(layer, HeadwiseLayer) and layer.kv_bits == 4 and layer.store["keys"].dtype == torch.uint8
    assert layer.lengths == caches[None].layers[0].lengths  # the same slots were kept, as codes
    assert kvpress.cache_bytes(caches[4]) < 0.45 * kvpress.cache_bytes(caches[None])  # head size 16: 10 B vs 64 B


def test_few_slots_huge_values_and_a_reset_stay_exact_enough():
    x = _keys_with_outlier_channels(n=3)
    stats = quant.fit(x)  # three slots say too little of a channel's range: taken as they are
    assert torch.equal(stats[..., 0, :], torch.zeros_like(stats[..., 0, :])) and bool((stats[..., 1, :] == 1).all())
    huge = torch.full((1, 1, 2, 16), 1e6)
    back = quant.decode(quant.encode(huge, None, 4), None, 4, torch.float32)
    assert bool(back.isfinite().all())  # the scale saturates in fp16, it never becomes inf (0 * inf = NaN)
    model = tiny_model("llama")
    cache = _prefilled(SnapKVPress(0.5, window_size=4, kv_bits=4), model, prompt(1, 40))
    cache.reset()  # a new prompt in the same cache: dense until the press quantizes it, with its own ranges
    assert all(layer.kv_bits is None and layer.key_stats is None for layer in cache.layers)
    with SnapKVPress(0.5, window_size=4, kv_bits=4)(model):
        model(prompt(2, 40)[:1], cache=cache)
    assert all(layer.kv_bits == 4 and layer.n == 20 for layer in cache.layers)


def test_a_reset_head_wise_layer_is_dense_until_a_press_quantizes_the_next_prompt():
    """`cache.reset()` empties a quantized head-wise layer: the next prompt is stored as its press says (full
    precision without kv_bits, 8 bits with kv_bits=8), not in the 4 bits of the prompt before."""
    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    with AdaKVPress(SnapKVPress(0.5, window_size=4, kv_bits=4))(model):
        model(prompt(1, 40), cache=cache)
    for bits in (None, 8):
        cache.reset()
        with AdaKVPress(SnapKVPress(0.5, window_size=4, kv_bits=bits))(model):
            model(prompt(1, 40, seed=1), cache=cache)
        assert [layer.kv_bits for layer in cache.layers] == [bits] * len(cache.layers)
        dtype = torch.float32 if bits is None else torch.uint8
        assert all(isinstance(layer, HeadwiseLayer) and layer.store["keys"].dtype == dtype for layer in cache.layers)
