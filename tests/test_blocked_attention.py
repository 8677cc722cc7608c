"""A chunk over a compressed dense layer on the CPU runs in blocks of queries that share their KV head
(`patches/blocked_attention.py`): the same logits as transformers' sdpa path with the layer's whole mask. A press
that reads the attention mass (H2O) gets it from the attention's own weights: the same logits, scores and kept
tokens as when it computes the weights again after sdpa."""

import pytest
import torch
from transformers import DynamicCache

from kvpress import AdaKVPress, DuoAttentionPress, HeavyHitterPress, PressedLayer, SnapKVPress
from kvpress.patches import blocked_attention as blocked
from kvpress.patches.intercept import layer_mask
from tiny import prompt, tiny_model, tiny_pattern


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("holes", [False, True])
def test_the_mask_of_a_block_of_rows_is_that_block_of_the_whole_mask(window, holes):
    layer = PressedLayer(window=window)
    old = torch.randn(2, 3, 9, 4)
    layer.update(old, old)  # not driven: committed at once (a sliding layer keeps its last window - 1)
    layer.driven = True
    new = torch.randn(2, 3, 7, 4)
    layer.update(new, new)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, :3] = False  # the second row's first new tokens are padding
    layer.commit(valid if holes else None)
    whole = layer_mask(layer, 7, 2, torch.float32, additive=False)
    width = layer.n - 7
    for s, e in ((0, 3), (3, 6), (6, 7), (2, 5)):
        part = layer_mask(layer, 7, 2, torch.float32, additive=False, rows=(s, e))
        expected = whole[..., s:e, : width + e]
        assert part.shape[-2:] == expected.shape[-2:] and torch.equal(part.expand_as(expected), expected)
        assert not whole[..., s:e, width + e :].any()  # what a block leaves out, its queries could not see


PRESSES = {"dense": lambda: SnapKVPress(compression_ratio=0.5, window_size=4),
           "head-wise": lambda: AdaKVPress(SnapKVPress(compression_ratio=0.5, window_size=4))}  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral-window", "gemma3"])
@pytest.mark.parametrize("press", list(PRESSES))
def test_chunks_in_blocks_give_whole_mask_logits(family, press, monkeypatch):
    """A left-padded batch prefilled in chunks of 12, evicting after each chunk, blocks of 5 queries: the logits of
    one call with the whole mask (dense: transformers' sdpa path, KV heads repeated; head-wise: one sdpa call)."""
    model = tiny_model(family)
    ids = prompt(2, 40, seed=1)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0

    def run() -> torch.Tensor:
        cache = DynamicCache(config=model.config)
        with torch.no_grad(), PRESSES[press]()(model):
            chunks = [model(ids[:, s : s + 12], attention_mask=mask[:, : s + 12], cache=cache).logits
                      for s in range(0, 40, 12)]  # fmt: skip
        return torch.cat(chunks, dim=1)

    calls = []
    original = blocked.blocked_attention
    monkeypatch.setattr(blocked, "blocked_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.setattr(blocked, "QUERY_BLOCK", 5)
    got = run()
    assert calls or press == "head-wise"  # the dense layers' chunks ran in blocks (head-wise ones call it by name)
    monkeypatch.setattr(blocked, "applies", lambda *a: False)
    monkeypatch.setattr(blocked, "QUERY_BLOCK", 1000)
    expected = run()
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_a_layer_left_whole_runs_its_later_chunks_in_blocks(family, monkeypatch):
    """A press whose budget holds the whole prompt leaves every layer whole: a chunk after held tokens still runs
    in blocks sharing the KV heads (transformers' sdpa path would repeat every KV head over all the held tokens),
    with the logits of that path; the first chunk (nothing held) keeps transformers' own causal call."""
    model = tiny_model(family)
    ids = prompt(1, 40, seed=2)

    def run() -> torch.Tensor:
        cache = DynamicCache(config=model.config)
        with torch.no_grad(), SnapKVPress(max_tokens=100, window_size=4)(model):
            chunks = [model(ids[:, s : s + 12], cache=cache).logits for s in range(0, 40, 12)]
        assert all(not layer.compressed for layer in cache.layers if layer.window is None)  # (windows trim)
        return torch.cat(chunks, dim=1)

    calls = []
    original = blocked.blocked_attention
    monkeypatch.setattr(blocked, "blocked_attention", lambda *a, **k: calls.append(a[0].shape[2]) or original(*a, **k))
    monkeypatch.setattr(blocked, "QUERY_BLOCK", 5)
    got = run()
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    assert len(calls) == 3 * layers  # chunks 2-4 (12, 12 and 4 queries) in every layer; not chunk 1
    monkeypatch.setattr(blocked, "applies", lambda *a: False)
    expected = run()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


FUSED = {**{name: lambda model, make=make: make() for name, make in PRESSES.items()},
         "whole": lambda model: SnapKVPress(max_tokens=100, window_size=4),
         "duo-attention": lambda model: DuoAttentionPress(compression_ratio=0.5, head_pattern=tiny_pattern(model),
                                                          n_sink=2, window=4)}  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral-window", "gemma3"])
@pytest.mark.parametrize("press", list(FUSED))
@pytest.mark.parametrize("padded", [False, True])
def test_a_chunk_over_slots_all_visible_is_one_bottom_right_call_on_a_gpu(family, press, padded, monkeypatch):
    """Where blocks are left out (a GPU; the CPU stands in, `DEVICES` emptied), a chunk over held slots that are all
    visible to it (no padding, no holes, no sliding window) runs as one sdpa call with torch's bottom-right causal
    bias and the KV heads shared (transformers' path would repeat them over every held slot, with a [q, n] mask),
    in dense layers (compressed or left whole) and head-wise ones: the logits of the CPU's blocks. A padded batch's
    dense layers and sliding-window layers keep their masks."""
    model = tiny_model(family)
    ids = prompt(2, 40, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0 if padded else 1

    def run() -> torch.Tensor:
        cache = DynamicCache(config=model.config)
        with torch.no_grad(), FUSED[press](model)(model):
            chunks = [model(ids[:, s : s + 12], attention_mask=mask[:, : s + 12], cache=cache).logits
                      for s in range(0, 40, 12)]  # fmt: skip
        return torch.cat(chunks, dim=1)

    calls = []
    original = blocked.bottom_right_attention
    monkeypatch.setattr(blocked, "bottom_right_attention",
                        lambda *a, **k: calls.append(a[1].shape) or original(*a, **k))  # fmt: skip
    monkeypatch.setattr(blocked, "DEVICES", ())
    got = run()
    text = model.config.get_text_config(decoder=True)
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    full = sum(kind != "sliding_attention" for kind in kinds)
    if family == "mistral-window":  # every layer slides: none of them fuses
        assert not calls
    elif not padded:  # chunks 2-4 of every full-attention layer (head-wise: once per row and KV head)
        dense = [shape[1] == text.num_key_value_heads for shape in calls]
        per_layer = {"dense": 1, "whole": 1, "head-wise": 2 * text.num_key_value_heads}.get(press)
        assert len(calls) == 3 * full * per_layer if per_layer else any(dense) and not all(dense)
        assert all(dense) == (press in ("dense", "whole"))
    else:  # only head-wise storage (per row: no padding inside) fuses in a padded batch
        assert all(shape[0] == 1 and shape[1] == 1 for shape in calls)
        assert bool(calls) == (press in ("head-wise", "duo-attention"))
    monkeypatch.setattr(blocked, "DEVICES", ("cpu",))
    expected = run()
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral-window", "gemma3"])
@pytest.mark.parametrize("padded", [True, False])
def test_attention_mass_from_the_attention_weights(family, padded, monkeypatch):
    """H2O on a batch (left-padded: its layers hold holes) in chunks of 12, evicting after each, then decoding
    steps, blocks of 5 queries: the logits, the kept tokens and the accumulated scores of the path where the press
    computes the weights again after sdpa."""
    model = tiny_model(family)
    ids = prompt(2, 40, seed=2)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0 if padded else 1

    def run() -> tuple[torch.Tensor, DynamicCache]:
        cache = DynamicCache(config=model.config)
        logits = []
        with torch.no_grad(), HeavyHitterPress(compression_ratio=0.5, chunk=5)(model):
            for s in range(0, 40, 12):
                logits.append(model(ids[:, s : s + 12], attention_mask=mask[:, : s + 12], cache=cache).logits)
            step = mask
            for _ in range(3):  # decoding: one query a forward
                step = torch.cat([step, torch.ones_like(step[:, :1])], dim=1)
                token = logits[-1][:, -1:].argmax(-1)
                logits.append(model(token, attention_mask=step, cache=cache).logits)
        return torch.cat(logits, dim=1), cache

    calls = []
    original = blocked.attention_with_mass
    monkeypatch.setattr(blocked, "attention_with_mass", lambda *a, **k: calls.append(a[4]) or original(*a, **k))
    got, cache = run()
    assert set(calls) == ({5} if family != "mistral-window" else set())  # the press's chunk is the block
    # (a sliding-window layer's press sees only what stays in the window: the weights are computed again there)
    monkeypatch.setattr(HeavyHitterPress, "mass_block", lambda self: None)
    count = len(calls)
    expected, reference = run()
    assert len(calls) == count  # this run computed the weights after sdpa
    real = torch.cat([mask.bool(), torch.ones(2, 3, dtype=torch.bool)], dim=1)
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-4)
    for mine, theirs in zip(cache.layers, reference.layers, strict=True):
        assert torch.equal(mine.pos[..., : mine.n], theirs.pos[..., : theirs.n])  # the same tokens kept
        torch.testing.assert_close(mine.slots["h2o_attention"][..., : mine.n],
                                   theirs.slots["h2o_attention"][..., : theirs.n], atol=1e-5, rtol=1e-4)  # fmt: skip
