"""Sliding-window layers: compressed like full-attention layers while the context fits the window; past the
window, bounded as transformers bounds them (the last `window - 1` tokens), with each query's window exact."""

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress import AdaKVPress, SnapKVPress
from kvpress.patches.cache import PressedLayer
from kvpress.patches.intercept import layer_mask
from tiny import left_padded, prompt, tiny_model

# every layer a sliding one (Mistral-7B-v0.1's form, Qwen2's use_sliding_window), and Gemma3's mix
WINDOWED = {
    "mistral-window": {},
    "qwen2": {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0},
    "gemma3": {},
}


def _windowed(family: str, attn: str = "sdpa", **kw):
    return tiny_model(family, attn, **{**WINDOWED[family], **kw})


def _sliding_layers(cache) -> list[PressedLayer]:
    return [layer for layer in cache.layers if getattr(layer, "window", None) is not None]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", list(WINDOWED))
def test_keeping_everything_past_the_window_is_identity(family, attn):
    """r = 0 runs the window itself: a prompt more than twice the window, fed whole or in chunks of 7."""
    model = _windowed(family, attn)
    ids = prompt(1, 40)
    kw = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    with SnapKVPress(compression_ratio=0.0, window_size=4)(model):
        pressed = model.generate(ids, **kw)
    assert torch.equal(pressed, model.generate(ids, **kw))
    caches = [DynamicCache(config=model.config) for _ in range(2)]
    with SnapKVPress(compression_ratio=0.0, window_size=4)(model):
        for start in range(0, 40, 7):
            chunked = model(ids[:, start : start + 7], cache=caches[0]).logits
    for start in range(0, 40, 7):
        plain = model(ids[:, start : start + 7], cache=caches[1]).logits
    torch.testing.assert_close(chunked, plain, atol=1e-5, rtol=1e-4)
    for layer in _sliding_layers(caches[0]):
        assert layer.n == layer.window - 1 and bool((layer.pos == torch.arange(40 - layer.n, 40)).all())


def test_inside_the_window_a_sliding_layer_is_compressed_to_its_budget():
    model = tiny_model("mistral-window", sliding_window=64)
    cache = DynamicCache(config=model.config)
    with SnapKVPress(compression_ratio=0.5, window_size=4)(model):
        model(prompt(1, 40), cache=cache)
    assert [layer.n for layer in _sliding_layers(cache)] == [20, 20]


@pytest.mark.parametrize("family", list(WINDOWED))
@pytest.mark.parametrize("press", [SnapKVPress(0.5, window_size=4), AdaKVPress(SnapKVPress(0.5, window_size=4))])
def test_past_the_window_the_budget_is_taken_from_what_the_layer_holds(family, press):
    """A sliding layer never holds more than `window - 1` tokens, nor more than the press's budget of them
    (per head; AdaKV: on average over heads), at prefill and at every decoding step; what it holds is inside
    the window."""
    model = _windowed(family)
    cache = DynamicCache(config=model.config)
    steps = []

    def watch(module, args, kwargs, out):
        layer = cache.layers[module.layer_idx]
        if getattr(layer, "window", None) is not None:
            held = layer.held() if isinstance(layer, PressedLayer) else layer.held().float().mean(-1)  # per head
            steps.append((float(held.max()), layer.window, layer.seen))

    hooks = [layer.self_attn.register_forward_hook(watch, with_kwargs=True) for layer in model.model.layers]
    try:
        with press(model):
            model.generate(prompt(1, 40), cache=cache, max_new_tokens=20, do_sample=False, pad_token_id=0)
    finally:
        for hook in hooks:
            hook.remove()
    assert steps and all(held <= press.budget_of(min(seen, window - 1)) for held, window, seen in steps)
    assert all(held <= window - 1 for held, window, _ in steps)
    for layer in cache.layers:
        if getattr(layer, "window", None) is None:
            continue
        if isinstance(layer, PressedLayer):
            pos = layer.pos[layer.valid] if layer.valid is not None else layer.pos
            assert bool((pos > layer.seen - layer.window).all())
        else:  # per-head storage
            for i in range(layer.batch * layer.heads):
                assert bool((layer.slot("pos", 0, i) > layer.seen - layer.window).all())


def test_the_mask_of_a_compressed_sliding_layer_hides_what_is_behind_each_query():
    layer = PressedLayer(window=4)
    keys = torch.zeros(1, 1, 6, 2)
    layer.update(keys, keys)  # not driven: committed at once, positions 0..5, then trimmed to the last 3
    assert layer.n == 3 and layer.pos.flatten().tolist() == [3, 4, 5]
    layer.driven = True
    layer.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    layer.commit(None)  # 6 slots: positions 3..8, the last three are this forward's queries
    mask = layer_mask(layer, 3, 1, torch.float32, additive=False)[0, 0]
    pos = torch.arange(3, 9)
    expected = (pos[None] <= pos[3:, None]) & (pos[None] > pos[3:, None] - 4)
    assert torch.equal(mask, expected)


def test_a_cache_filled_without_a_press_is_taken_over_past_its_window():
    """A plain sliding cache (transformers' own layers, past the window) continued inside a press at r = 0
    answers as continuing it plainly."""
    model = _windowed("mistral-window")
    ids = prompt(1, 40)
    plain, adopted = DynamicCache(config=model.config), DynamicCache(config=model.config)
    model(ids[:, :30], cache=plain)
    model(ids[:, :30], cache=adopted)
    expected = model(ids[:, 30:], cache=plain).logits
    with SnapKVPress(compression_ratio=0.0)(model):
        got = model(ids[:, 30:], cache=adopted).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", list(WINDOWED))
def test_a_padded_cache_filled_without_a_press_is_taken_over_past_its_window(family):
    """The same with a left-padded batch: the press learns which held slots are padding from the 2D mask of the
    tokens seen, of which a sliding layer holds only the last (it took the first ones' marks and positions)."""
    model = _windowed(family)
    rows = [prompt(1, 30, seed=1)[0], prompt(1, 22, seed=2)[0]]
    ids, mask = left_padded(rows)
    new = prompt(2, 6, seed=3)
    whole = torch.cat([mask, torch.ones_like(new)], 1)
    plain, adopted = DynamicCache(config=model.config), DynamicCache(config=model.config)
    model(ids, attention_mask=mask, cache=plain)
    model(ids, attention_mask=mask, cache=adopted)
    expected = model(new, attention_mask=whole, cache=plain).logits
    with SnapKVPress(compression_ratio=0.0)(model):
        got = model(new, attention_mask=whole, cache=adopted).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_a_compressed_sliding_cache_refuses_several_tokens_outside_its_press():
    model = _windowed("mistral-window")
    cache = DynamicCache(config=model.config)
    with SnapKVPress(compression_ratio=0.5, window_size=4)(model):
        model(prompt(1, 12), cache=cache)
    model(prompt(1, 1, seed=1), cache=cache)  # one token sees every held slot: fine
    with pytest.raises(RuntimeError, match="inside `with press"):
        model(prompt(1, 4, seed=2), cache=cache)


@pytest.mark.parametrize("family", ["mistral-window", "gemma3"])
def test_past_the_window_a_cache_compressed_head_by_head_is_refused_outside_its_press(family):
    """Past the window each head of a layer compressed head by head drops other slots (holes), which transformers'
    own mask attends: a plain step there is refused (its logits moved by up to 0.07 before, without a word); a cache
    whose heads hold the same slots (SinkWindow) goes on plainly past the window, as inside its press."""
    import copy

    from kvpress import KnormPress, SinkWindowPress

    model, ids = _windowed(family), prompt(1, 40)
    window = model.config.sliding_window
    cache = DynamicCache(config=model.config)
    with KnormPress(compression_ratio=0.5)(model):
        model(ids[:, :12], cache=cache)
    for t in range(12, window - 1):  # within the window (Mistral's 16), one token at a time is fine
        model(ids[:, t : t + 1], cache=cache)
    with pytest.raises(RuntimeError, match="compressed head by head"):  # the step where trimming starts
        model(ids[:, max(12, window - 1) : max(12, window - 1) + 1], cache=cache)
    press = SinkWindowPress(n_sink=2, window=6)
    same = DynamicCache(config=model.config)
    with press(model):
        model(ids[:, :12], cache=same)
    inside = copy.deepcopy(same)
    steps = {}
    for name, c in (("plain", same), ("inside", inside)):
        logits = []
        for t in range(12, 30):  # past every window
            if name == "plain":
                logits.append(model(ids[:, t : t + 1], cache=c).logits)
            else:
                with press(model) as installed, installed.frozen():
                    logits.append(model(ids[:, t : t + 1], cache=c).logits)
        steps[name] = torch.cat(logits, 1)
    torch.testing.assert_close(steps["plain"], steps["inside"], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("padded", [False, True])
def test_past_the_window_each_head_drops_its_leaving_slots_by_a_view_and_the_others_become_holes(padded):
    """Each head's real slots older than the last `window - 1` tokens of its row leave: those before the layer's
    earliest staying slot by a view of the same storage (nothing copied), the rest marked not valid. Over 60 steps
    every head holds exactly its reference's keys and positions (a left-padded row: 3 tokens behind the other), and
    the storage is copied only when decoding grows it."""
    torch.manual_seed(0)
    window, b, hkv, n, d = 12, 2, 3, 11, 8
    layer = PressedLayer(window)
    layer.driven = True
    layer.update(torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d))
    real = torch.ones(b, n, dtype=torch.bool)
    real[1, :3] = not padded
    layer.commit(real if padded else None)
    keep = torch.rand(b, hkv, n) < torch.tensor([0.3, 0.6, 1.0])[None, :, None]  # heads keeping fewer: holes
    keep[..., -1] = True
    keep &= real[:, None]
    layer.keep(torch.arange(n).expand(b, hkv, n), keep)
    pairs = [(row, head) for row in range(b) for head in range(hkv)]
    ref = {p: (layer.keys[p][keep[p]], layer.pos[p][keep[p]]) for p in pairs}
    storages = set()
    for _ in range(60):
        new_k = torch.randn(b, hkv, 1, d)
        layer.update(new_k, torch.randn(b, hkv, 1, d))
        layer.commit(None)
        storage = layer.keys.untyped_storage().data_ptr()
        layer.trim_window()
        layer.trim_window()  # again in the same forward: nothing left to drop
        assert layer.keys.untyped_storage().data_ptr() == storage  # trimming copied nothing
        storages.add(storage)
        held = layer.valid if layer.valid is not None else torch.ones(b, hkv, layer.n, dtype=torch.bool)
        keys, seen = layer.held_kv()[0], layer.seen_list()
        for p in pairs:
            k, pos = ref[p]
            k, pos = torch.cat([k, new_k[p]]), torch.cat([pos, torch.tensor([seen[p[0]] - 1], dtype=torch.int32)])
            low = seen[p[0]] - (window - 1)
            ref[p] = k[pos >= low], pos[pos >= low]
            assert torch.equal(layer.pos[p][held[p]], ref[p][1]) and torch.equal(keys[p][held[p]], ref[p][0])
        assert layer.n <= 2 * (window - 1)
    assert layer.held().tolist() == [window - 1] * b  # the head keeping every token
    assert len(storages) <= 60 // 4  # a copy now and then


@pytest.mark.parametrize("family", ["mistral-window", "gemma3"])
def test_a_window_layer_decodes_with_autograd_on(family):
    """A plain `model(...)` call runs with grad on: a window layer's held slots are views made under the eviction's
    no_grad, which autograd refused to write into (RuntimeError at the second step); the steps equal no_grad's."""
    from kvpress import KnormPress

    with torch.inference_mode(False):  # (a model of its own, made outside inference mode)
        model = tiny_model(family, initializer_range=0.021)
    logits = {}
    for grad in (False, True):
        cache, steps = DynamicCache(config=model.config), []
        with torch.inference_mode(False), torch.set_grad_enabled(grad), KnormPress(0.3)(model):
            token = model(prompt(1, 40), cache=cache).logits[:, -1:].argmax(-1)
            for _ in range(5):
                out = model(token, cache=cache).logits[:, -1]
                steps.append(out.detach())
                token = out.argmax(-1, keepdim=True)
        logits[grad] = torch.stack(steps)
    assert torch.allclose(logits[True], logits[False], atol=1e-5)


def test_a_prefill_past_the_window_frees_the_storage_its_leaving_slots_held():
    """The slots leaving a sliding layer left by views of the prefill's storage: a 200-token prompt's every key and
    value stayed allocated behind the window's 15 until the layer next grew (13.8x its held bytes; KnormPress
    max_tokens=64 evicts nothing there). A cut larger than what stays is copied; cache_bytes counts the storage."""
    from kvpress import KnormPress

    model = _windowed("mistral-window")
    cache = DynamicCache(config=model.config)
    with KnormPress(max_tokens=64)(model):
        model(prompt(1, 200), cache=cache)
    for layer in _sliding_layers(cache):
        held = layer.keys[:, :, : layer.n]
        assert layer.n == 15 and layer.keys.untyped_storage().nbytes() <= 2 * held.nbytes
    assert kvpress.cache_bytes(cache) < 3 * sum(layer.n for layer in cache.layers) * 2 * 2 * 16 * 4
