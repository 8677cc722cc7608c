"""Head-wise budgets (AdaKV, DuoAttention): per-head storage that frees memory, and attention over it."""

import contextlib
import dataclasses

import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from kvpress import (
    AdaKVPress,
    DuoAttentionPress,
    HeadwiseLayer,
    HeavyHitterPress,
    KnormPress,
    PressedLayer,
    PyramidKVPress,
    SnapKVPress,
    cache_bytes,
    press_from_name,
)
from kvpress.patches.headwise_attention import headwise_attention
from kvpress.presses.head_budget import allocate, descending_rank
from tiny import greedy_scores, left_padded, prompt, tiny_model, tiny_pattern


# ----- storage and attention ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "phi3"])
@pytest.mark.parametrize("ratio", [0.5, 0.75])
def test_adakv_frees_memory_per_head(family, ratio):
    model = tiny_model(family, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    ids = prompt(1, 256)
    full = DynamicCache(config=model.config)
    model(ids, cache=full)
    cache = DynamicCache(config=model.config)
    with AdaKVPress(SnapKVPress(compression_ratio=ratio, window_size=16))(model):
        model(ids, cache=cache)
    kept = cache_bytes(cache) / cache_bytes(full)
    assert kept <= (1 - ratio) + 0.01, kept  # the index overhead: 4 bytes of position per 512 of keys+values
    for layer in cache.layers:
        assert isinstance(layer, HeadwiseLayer)
        assert sum(layer.lengths) == 2 * round(256 * (1 - ratio))  # the layer's total budget, spread
        keys = layer.store["keys"]  # packed tight after the prefill: no padding, no spare room
        assert keys.shape[0] == sum(layer.lengths) and keys.untyped_storage().nbytes() == keys.numel() * 4
    assert any(len(set(layer.lengths)) > 1 for layer in cache.layers)  # heads really differ


@pytest.mark.parametrize("mass_block", [None, 2])
@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("softcap", [None, 20.0])
# a chunk in blocks (the CPU), bottom-right causal per (row, KV head) or one variable-length call (CUDA)
@pytest.mark.parametrize("gpu_path", [None, "bottom_right", "varlen"])
def test_varlen_attention_equals_masked_dense(q_len, softcap, mass_block, gpu_path, monkeypatch, request):
    from kvpress.patches import blocked_attention

    calls = request.getfixturevalue("varlen_on_cpu") if gpu_path == "varlen" else []  # (its check runs here)
    biases = []
    if gpu_path:  # the CUDA branch, run on the CPU: torch materialises the bias there, the mask is the same
        monkeypatch.setattr(blocked_attention, "DEVICES", ())
        bias = blocked_attention.causal_lower_right
        monkeypatch.setattr(blocked_attention, "causal_lower_right", lambda *a: biases.append(a) or bias(*a))
    torch.manual_seed(0)
    b, hkv, g, n, d = 2, 3, 2, 40, 16
    dense = PressedLayer()
    keys, values = torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d)
    dense.update(keys, values)
    keep = torch.rand(b, hkv, n) < torch.tensor([0.2, 0.5, 0.9])[None, :, None]  # very different lengths
    layer = HeadwiseLayer.from_dense(dense, keep)
    new_k, new_v = torch.randn(b, hkv, q_len, d), torch.randn(b, hkv, q_len, d)
    query = torch.randn(b, hkv * g, q_len, d)
    layer.driven = True
    layer.update(new_k, new_v)
    layer.commit()
    module = torch.nn.Module()
    module.scaling, module.attn_logit_softcapping = d**-0.5, softcap
    out, mass = headwise_attention(module, query, layer, mass_block, softcap)

    all_k = torch.cat([keys, new_k], 2).repeat_interleave(g, 1)
    all_v = torch.cat([values, new_v], 2).repeat_interleave(g, 1)
    causal = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    mask = torch.cat([keep[:, :, None].expand(b, hkv, q_len, n), causal.expand(b, hkv, q_len, q_len)], -1)
    mask = mask.repeat_interleave(g, 1)
    logits = query @ all_k.transpose(-1, -2) * d**-0.5
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    probs = logits.masked_fill(~mask, float("-inf")).softmax(-1)
    ref = probs @ all_v
    assert out.shape == (b, q_len, hkv * g, d)
    assert (out - ref.transpose(1, 2)).abs().max() <= 1e-5
    # the CUDA branches ran where they apply (no soft-capping, no mass): one variable-length call for every (row,
    # KV head), causal for a chunk, else a chunk's bottom-right call per pair
    plain = not softcap and mass_block is None
    varlen = gpu_path == "varlen" and plain
    assert calls == ([{"sequences": b * hkv, "causal": q_len > 1}] if varlen else [])
    assert len(biases) == (b * hkv if gpu_path and not varlen and q_len > 1 and plain else 0)
    if mass_block is None:
        assert mass is None
        return
    # the mass: each held slot's weight from its KV head's g query heads and every query, packed as the storage
    received = probs.view(b, hkv, g, q_len, n + q_len).sum(dim=(2, 3))
    held = torch.cat([keep, torch.ones(b, hkv, q_len, dtype=torch.bool)], -1)
    assert mass.shape == (layer.bounds[-1],)
    for i in range(b * hkv):
        row, head = divmod(i, hkv)
        start = layer.bounds[i]
        got = mass[start : start + layer.lengths[i]]
        assert torch.allclose(got, received[row, head][held[row, head]], atol=1e-5)


def test_a_chunks_window_rows_see_exactly_the_window():
    """A query at position p of a sliding-window layer of window w sees positions p - w + 1 .. p (transformers'
    sliding mask), on the CPU's blocked path too."""
    from kvpress.patches.headwise_attention import _window_rows

    rows = _window_rows(torch.arange(10), 4, 3, (0, 6))  # 4 held slots, a chunk of 6, window 3
    assert rows.shape == (6, 10)
    for r in range(6):
        assert rows[r].nonzero().flatten().tolist() == [p for p in range(10) if 4 + r - 3 < p <= 4 + r]


def test_a_half_precision_decoding_step_takes_its_softmax_in_fp32_as_eager_does():
    """A bf16 step's softmax ran in bf16 (transformers' eager attention runs it in fp32, then casts): the mass H2O
    accumulates is the fp32 weights', not their bf16 rounding (1e-4 off before); the output matches eager's bf16
    computation (it did before too on the CPU, whose bf16 softmax computes in fp32 and rounds once)."""
    torch.manual_seed(0)
    b, hkv, g, n, d = 1, 2, 2, 300, 16
    dense = PressedLayer()
    keys, values = torch.randn(b, hkv, n, d).bfloat16(), torch.randn(b, hkv, n, d).bfloat16()
    dense.update(keys, values)
    layer = HeadwiseLayer.from_dense(dense, torch.ones(b, hkv, n, dtype=torch.bool))
    new_k, new_v = torch.randn(b, hkv, 1, d).bfloat16(), torch.randn(b, hkv, 1, d).bfloat16()
    query = torch.randn(b, hkv * g, 1, d).bfloat16()
    layer.driven = True
    layer.update(new_k, new_v)
    layer.commit()
    module = torch.nn.Module()
    module.scaling, module.attn_logit_softcapping = d**-0.5, None
    out, mass = headwise_attention(module, query, layer, mass_block=1)
    all_k = torch.cat([keys, new_k], 2).repeat_interleave(g, 1)
    all_v = torch.cat([values, new_v], 2).repeat_interleave(g, 1)
    logits = (query * d**-0.5) @ all_k.transpose(-1, -2)  # bf16, as eager
    exact = logits.softmax(-1, dtype=torch.float32)
    assert torch.equal(out.transpose(1, 2), exact.bfloat16() @ all_v)
    received = exact.view(b, hkv, g, n + 1).sum(2)[0]
    for head in range(hkv):
        got = mass[layer.bounds[head] : layer.bounds[head] + layer.lengths[head]]
        assert torch.allclose(got, received[head], atol=1e-6), (got - received[head]).abs().max()


@pytest.mark.parametrize("family", ["llama", "mistral-window", "gemma3"])
@pytest.mark.parametrize("make", ["adakv", "duo", "adakv-h2o"])
def test_one_varlen_call_gives_the_logits_of_the_loop(family, make, request):
    """Generation through head-wise layers (a left-padded batch, the prompt in chunks, evictions while decoding)
    gives the same logits with every layer's attention as one variable-length call (CUDA's path, run through the
    stand-in) as pair by pair; the call runs where it applies: not for a chunk over a sliding window, not where the
    press reads the attention mass (H2O, outside sliding windows)."""
    model = tiny_model(family)
    presses = {"adakv": lambda: AdaKVPress(SnapKVPress(0.5, window_size=4)),
               "duo": lambda: DuoAttentionPress(compression_ratio=0.6, head_pattern=tiny_pattern(model), window=8),
               "adakv-h2o": lambda: AdaKVPress(HeavyHitterPress(0.5, window=4))}  # fmt: skip
    ids, mask = left_padded([prompt(1, 60, seed=1)[0], prompt(1, 41, seed=2)[0]])
    loop, _ = greedy_scores(model, ids, presses[make](), new=12, mask=mask, chunk=24)
    calls = request.getfixturevalue("varlen_on_cpu")
    varlen, cache = greedy_scores(model, ids, presses[make](), new=12, mask=mask, chunk=24)
    assert any(isinstance(layer, HeadwiseLayer) for layer in cache.layers)
    assert (loop - varlen).nan_to_num(0.0).abs().max() <= 1e-4
    # decoding steps: one call a layer (H2O's only over sliding windows, where it reads no mass); chunks: over
    # layers without a window (gemma3 has one, mistral-window none), never for H2O (the loop computes its weights)
    assert any(not c["causal"] for c in calls) == (make != "adakv-h2o" or family != "llama")
    assert any(c["causal"] for c in calls) == (make != "adakv-h2o" and family != "mistral-window")


@pytest.mark.parametrize("broken", ["raises", "reads the spare slots"])
def test_a_kernel_that_fails_the_check_is_named_and_the_pairs_attend(broken, varlen_on_cpu, monkeypatch):
    """Where torch's variable-length kernel raises or answers wrong on the check's small case, a warning names it and
    head-wise layers attend pair by pair there: the same output as where no such kernel runs."""
    from kvpress.patches import headwise_attention as hw
    from tiny import flash_varlen_stand_in

    def kernel(query, keys, values, cu_q, cu_k, max_q, max_k, causal, scale, used_k):
        if broken == "raises":
            raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")
        whole = (cu_k[1:] - cu_k[:-1]).to(torch.int32)  # the segments' spare room read as held slots
        return flash_varlen_stand_in(query, keys, values, cu_q, cu_k, max_q, int(whole.max()), causal, scale, whole)

    monkeypatch.setattr(hw, "flash_varlen", kernel)
    hw._flash_runs_on.cache_clear()
    torch.manual_seed(0)
    dense = PressedLayer()
    dense.update(torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16))
    layer = HeadwiseLayer.from_dense(dense, torch.rand(1, 2, 30) < 0.5)
    layer.driven = True
    layer.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
    layer.commit()
    module = torch.nn.Module()
    module.scaling, module.attn_logit_softcapping = 0.25, None
    query = torch.randn(1, 4, 1, 16)
    said = "Ampere" if broken == "raises" else "differs from the pairs'"
    with pytest.warns(UserWarning, match=f"variable-length flash kernel failed kvpress's check on cpu .*{said}"):
        out, _ = headwise_attention(module, query, layer)
    monkeypatch.setattr(hw, "VARLEN_DEVICES", ())
    assert torch.equal(out, headwise_attention(module, query, layer)[0])


def test_an_observer_reads_a_headwise_layer_as_a_padded_dense_one():
    """`HeadwiseLayer.as_dense()`: each (row, KV head) left-padded, so every pair's newest slots are the last; the
    attention an observer computes over it (KVzip's per-position peaks) is the real one over each head's slots."""
    from kvpress.engine import Observation
    from kvpress.presses.prepared import PromptAttention

    torch.manual_seed(0)
    b, hkv, g, n, d, q = 2, 3, 2, 40, 16, 5
    dense = PressedLayer()
    keys, values = torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d)
    dense.update(keys, values)
    keep = torch.rand(b, hkv, n) < torch.tensor([0.2, 0.5, 0.9])[None, :, None]
    layer = HeadwiseLayer.from_dense(dense, keep)
    new_k, new_v = torch.randn(b, hkv, q, d), torch.randn(b, hkv, q, d)
    layer.driven = True
    layer.update(new_k, new_v)
    layer.commit()
    view = layer.as_dense()
    assert view.keys.shape == (b, hkv, max(layer.lengths), d) and view.seen == n + q
    assert torch.equal(view.keys[:, :, -q:], new_k) and bool((view.pos[:, :, -q:] == n + torch.arange(q)).all())
    module = torch.nn.Module()
    module.scaling, module.attn_logit_softcapping, module.layer_idx = d**-0.5, None, 0
    query = torch.randn(b, hkv * g, q, d)
    observer = PromptAttention(n_prompt=n, by_position=True)
    observer(Observation(module, query, view.keys, view.values, view))
    all_k = torch.cat([keys, new_k], 2).repeat_interleave(g, 1)
    causal = torch.ones(q, q, dtype=torch.bool).tril()
    mask = torch.cat([keep[:, :, None].expand(b, hkv, q, n), causal.expand(b, hkv, q, q)], -1).repeat_interleave(g, 1)
    probs = (query @ all_k.transpose(-1, -2) * d**-0.5).masked_fill(~mask, float("-inf")).softmax(-1)
    expected = probs[..., :n].view(b, hkv, g, q, n).amax(dim=(2, 3))  # 0 where a head no longer holds the token
    torch.testing.assert_close(observer.peaks[0], expected, atol=1e-5, rtol=1e-4)


def test_packed_storage_appends_and_evicts_in_place_then_packs_tight():
    torch.manual_seed(0)
    b, hkv, g, n, d = 2, 3, 2, 200, 8
    dense = PressedLayer()
    dense.update(torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d))
    keep = torch.rand(b, hkv, n) < torch.tensor([0.2, 0.5, 0.9])[None, :, None]
    layer = HeadwiseLayer.from_dense(dense, keep)
    layer.driven = True
    pairs = [(row, head) for row in range(b) for head in range(hkv)]
    ref = {p: (*layer.pair(*p), layer.slot("pos", *p).clone()) for p in pairs}
    assert layer.bounds[-1] == sum(layer.lengths)  # tight after the prefill
    module = torch.nn.Module()
    module.scaling, module.attn_logit_softcapping = d**-0.5, None

    def step():
        new_k, new_v = torch.randn(b, hkv, 1, d), torch.randn(b, hkv, 1, d)
        seen = layer.real_seen.clone()
        layer.update(new_k, new_v)
        layer.commit()
        for row, head in pairs:
            k, v, pos = ref[row, head]
            ref[row, head] = (torch.cat([k, new_k[row, head]]), torch.cat([v, new_v[row, head]]),
                              torch.cat([pos, seen[row : row + 1].int()]))  # fmt: skip
        query = torch.randn(b, hkv * g, 1, d)
        out, _ = headwise_attention(module, query, layer)
        for row, head in pairs:
            k, v, pos = ref[row, head]
            group = query[row, head * g : (head + 1) * g, 0]
            expected = (group @ k.T * d**-0.5).softmax(-1) @ v
            assert (out[row, 0, head * g : (head + 1) * g] - expected).abs().max() <= 1e-5
            assert torch.equal(layer.slot("pos", row, head), pos) and torch.equal(layer.pair(row, head)[0], k)

    step()
    bounds = list(layer.bounds)
    assert all(hi - lo - held >= 7 for lo, hi, held in zip(bounds, bounds[1:], layer.lengths, strict=False))
    step()
    assert layer.bounds == bounds  # appended into the room, nothing moved
    for row, head in pairs:  # evict every other slot, in place: spare slots keep stale (finite) tokens
        index = torch.arange(0, layer.lengths[row * hkv + head], 2)
        layer.keep(row, head, index)
        ref[row, head] = tuple(t[index] for t in ref[row, head])
    assert layer.bounds == bounds
    step()  # stale slots do not leak into the attention
    layer.compact()
    assert layer.bounds[-1] == sum(layer.lengths) < bounds[-1]  # packed tight again
    step()


def test_a_sliding_window_trims_each_head_in_place_and_repacks_now_and_then():
    """Past its window a head-wise sliding layer drops each head's slots older than the last `window - 1` tokens,
    a prefix per head, with nothing copied (each head's remaining slots stay where they are), and over many steps
    its storage stays bounded: the room a head freed at its front goes to the head before it, a repack gives every
    head room again when one runs out."""
    torch.manual_seed(0)
    window, b, hkv, n, d = 12, 2, 3, 11, 8
    dense = PressedLayer(window)
    dense.update(torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d))
    keep = torch.rand(b, hkv, n) < torch.tensor([0.3, 0.6, 1.0])[None, :, None]
    keep[..., -1] = True
    layer = HeadwiseLayer.from_dense(dense, keep)
    layer.driven = True
    pairs = [(row, head) for row in range(b) for head in range(hkv)]
    ref = {p: (layer.slot("keys", *p).clone(), layer.slot("pos", *p).clone()) for p in pairs}
    repacks, tops = 0, []
    for _ in range(60):
        new_k = torch.randn(b, hkv, 1, d)
        layer.update(new_k, torch.randn(b, hkv, 1, d))
        bounds = list(layer.bounds)
        layer.commit()
        repacks += layer.bounds != bounds
        where = {p: layer.slot("keys", *p).data_ptr() for p in pairs}
        layer.trim_window()
        low = layer.seen - (window - 1)
        for p in pairs:
            k, pos = ref[p]
            k, pos = torch.cat([k, new_k[p]]), torch.cat([pos, torch.tensor([layer.seen - 1], dtype=torch.int32)])
            dropped = int((pos < low).sum())
            ref[p] = k[dropped:], pos[dropped:]
            assert torch.equal(layer.slot("pos", *p), ref[p][1]) and torch.equal(layer.slot("keys", *p), ref[p][0])
            assert layer.slot("keys", *p).data_ptr() == where[p] + dropped * d * 4  # not moved: it starts later
        tops.append(layer.bounds[-1])
    assert all(layer.lengths[i] == window - 1 for i in range(b * hkv) if i % hkv == 2)  # the head keeping every token
    assert 1 <= repacks <= 12 and max(tops) <= 2 * (window - 1) * b * hkv  # bounded; a repack now and then


@pytest.mark.parametrize("pairs", [[4], [0, 5], [1, 2, 4], [0, 2, 3, 5]])  # slot ranges up to two pairs, an index after
def test_keep_ends_equals_keep_of_each_pair(pairs):
    torch.manual_seed(0)
    dense = PressedLayer()
    dense.update(torch.randn(2, 3, 40, 8), torch.randn(2, 3, 40, 8))
    keep, new = torch.rand(2, 3, 40) < 0.8, torch.randn(2, 2, 3, 1, 8)
    layers = [HeadwiseLayer.from_dense(dense, keep) for _ in range(2)]
    for layer in layers:
        layer.driven = True
        layer.update(*new)  # a decoding step's token: the layer makes room after every pair
        layer.commit()
    by_keep, by_ends = layers
    assert torch.equal(by_keep.store["keys"], by_ends.store["keys"]) and by_keep.bounds[1] > by_keep.lengths[0]
    for i in pairs:
        n = by_keep.lengths[i]
        by_keep.keep(*divmod(i, 3), torch.cat([torch.arange(2), torch.arange(n - 5, n)]))
    by_ends.keep_ends(pairs, 2, 5)
    assert by_ends.lengths == by_keep.lengths and {by_keep.lengths[i] for i in pairs} == {7}
    for i in range(6):  # every pair holds the same slots, those trimmed and those not
        for name in by_keep.store:
            assert torch.equal(by_ends.slot(name, *divmod(i, 3)), by_keep.slot(name, *divmod(i, 3)))
    with pytest.raises(ValueError, match=rf"pairs \[{pairs[0]}\] hold \[7\]"):  # no more than 2 + 5 held
        by_ends.keep_ends(pairs[:1], 2, 5)


@pytest.mark.parametrize("drop", ["none", "one each", "random", "all of a head", "a narrower mask"])
def test_keep_marked_equals_keep_of_each_head(drop):
    """`keep_marked` keeps what `keep` head by head keeps, for every row and kind of state, moving only the slots
    behind a head's first evicted one; marks past what a head holds are refused, nothing moved."""
    torch.manual_seed(0)
    dense = PressedLayer()
    dense.update(torch.randn(2, 3, 40, 8), torch.randn(2, 3, 40, 8))
    chosen, new = torch.rand(2, 3, 40) < 0.8, torch.randn(2, 2, 3, 1, 8)
    layers = [HeadwiseLayer.from_dense(dense, chosen) for _ in range(2)]
    score = torch.rand(layers[0].bounds[-1] + 100)
    for layer in layers:
        layer.driven = True
        layer.update(*new)
        layer.commit()
        layer.state("score").copy_(score[: layer.bounds[-1]])  # a press's state moves with its slots
    by_head, marked = layers
    n = max(by_head.lengths[3:])
    held = torch.arange(n) < torch.tensor(by_head.lengths[3:])[:, None]  # row 1's heads
    keep = {"none": held, "one each": held & (torch.arange(n) != 5), "random": held & (torch.rand(3, n) < 0.7),
            "all of a head": held & (torch.arange(3) != 1)[:, None],
            "a narrower mask": held[:, : n - 4]}[drop]  # fmt: skip
    for head in range(3):
        by_head.keep(1, head, keep[head].nonzero().squeeze(-1))
    untouched = {name: t[: marked.bounds[3]].clone() for name, t in marked.store.items()}
    marked.keep_marked(1, keep)
    assert marked.lengths == by_head.lengths and marked.lengths[3:] == keep.sum(-1).tolist()  # (slots past a narrower
    # mask's width are not kept)
    for i in range(6):
        for name in by_head.store:
            assert torch.equal(marked.slot(name, *divmod(i, 3)), by_head.slot(name, *divmod(i, 3)))
    assert all(torch.equal(marked.store[name][: marked.bounds[3]], t) for name, t in untouched.items())  # row 0
    past = torch.zeros(3, n + 1, dtype=torch.bool)
    past[0, marked.lengths[3]] = True
    before = {name: t.clone() for name, t in marked.store.items()}
    with pytest.raises(ValueError, match="past what the heads of row 1 hold"):
        marked.keep_marked(1, past)
    with pytest.raises(ValueError, match=r"bool \[heads=3, n\] mask"):
        marked.keep_marked(1, keep[:2])
    with pytest.raises(ValueError, match="row must be one of this layer's rows, 0 to 1, got 2"):
        marked.keep_marked(2, keep)
    assert all(torch.equal(marked.store[name], t) for name, t in before.items())


def test_descending_rank_equals_argsort_of_argsort():
    torch.manual_seed(0)
    scores = torch.randn(2, 3, 50)
    scores[0, 0, :10] = float("inf")  # ties, as protected slots give
    scores[1, 2, 20:] = float("-inf")
    rank = descending_rank(scores)
    order = scores.argsort(dim=-1, descending=True, stable=True)
    assert torch.equal(rank, order.argsort(dim=-1))
    assert torch.equal(rank.sort(dim=-1).values, torch.arange(50).expand(2, 3, 50))  # a permutation per row
    assert rank[0, 0, :10].tolist() == list(range(10))  # ties: the first slot (the earlier position) first


@dataclasses.dataclass
class _Flat(SnapKVPress):
    """Every token scores the same: which ones stay is the tie-break alone."""

    def score(self, obs):
        return torch.zeros(obs.keys.shape[:3])


@pytest.mark.parametrize("make", [lambda: _Flat(0.5, window_size=2), lambda: _Flat(max_tokens=12, window_size=2,
                                                                                  decode_slack=0.0),
                                  lambda: AdaKVPress(_Flat(0.5, window_size=2))],
                         ids=["dense", "dense-decoding", "adakv"])  # fmt: skip
def test_tied_scores_keep_the_tokens_a_row_keeps_alone(make):
    """Exact ties (NAtS at its floor, KVzap's whole words, CUR within head_dim tokens) were ranked by the slots'
    layout: `topk` chose among them by the tensor's length (a padded batch's) and order (decoding steps move the
    newest slot into a hole), and head-wise ranks by an unstable sort. Ties now go to the earlier position, in a
    batch as alone, at the prefill and while decoding (max_tokens=12, no slack: one slot a step)."""
    model = tiny_model("llama")
    rows = [prompt(1, 40, seed=1)[0], prompt(1, 25, seed=2)[0]]
    ids, mask = left_padded(rows)
    _, cache = greedy_scores(model, ids, make(), new=6, mask=mask)
    for row, tokens in enumerate(rows):
        _, alone = greedy_scores(model, tokens[None], make(), new=6)
        for layer, single in zip(cache.layers, alone.layers, strict=True):
            for head in range(model.config.num_key_value_heads):
                if isinstance(layer, HeadwiseLayer):
                    held, kept = layer.slot("pos", row, head), single.slot("pos", 0, head)
                else:
                    valid = layer.valid[row, head] if layer.valid is not None else slice(None)
                    held, kept = layer.pos[row, head][valid], single.pos[0, head]
                assert held.sort().values.tolist() == kept.sort().values.tolist()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("inner", ["snapkv", "h2o"])
def test_adakv_without_freedom_equals_the_dense_press(attn, family, inner):
    """alpha_safeguard=1 gives every head its even share: the same tokens as the dense press, so 40 steps
    of generation (decode-time eviction included) must give the same logits through per-head storage."""
    model = tiny_model(family, attn)
    make = {"snapkv": lambda: SnapKVPress(0.5, window_size=8), "h2o": lambda: HeavyHitterPress(0.5, window=8)}[inner]
    dense, _ = greedy_scores(model, prompt(1, 96), make(), new=40)
    headwise, cache = greedy_scores(model, prompt(1, 96), AdaKVPress(make(), alpha_safeguard=1.0), new=40)
    assert any(isinstance(layer, HeadwiseLayer) for layer in cache.layers)
    assert (dense - headwise).nan_to_num(0.0).abs().max() <= 1e-5  # -inf - -inf: the masked EOS


def test_a_softcap_the_model_never_applies_is_not_applied_by_presses_or_head_wise_attention():
    """Gemma 3 keeps `attn_logit_softcapping` from its config but never hands it to its attention: the presses'
    scores and the head-wise attention capped the logits anyway (AdaKV at even shares then left SnapKV by 2e-3);
    Gemma 2 hands it over, and kvpress applies it there."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    from kvpress.patches import model_access

    capped, plain = tiny_model("gemma3", "eager", attn_logit_softcapping=1.0), tiny_model("gemma3", "eager")
    ids = prompt(1, 96)
    assert torch.equal(capped(ids[:, :40]).logits, plain(ids[:, :40]).logits)  # (the model ignores it)
    dense, _ = greedy_scores(capped, ids, SnapKVPress(0.5, window_size=8), new=10)
    headwise, _ = greedy_scores(capped, ids, AdaKVPress(SnapKVPress(0.5, window_size=8), alpha_safeguard=1.0), new=10)
    assert (dense - headwise).nan_to_num(0.0).abs().max() <= 1e-5
    assert model_access.logit_softcap(capped.model.layers[0].self_attn) is None
    gemma2 = AutoModelForCausalLM.from_config(Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, attn_logit_softcapping=50.0))  # fmt: skip
    assert model_access.logit_softcap(gemma2.model.layers[0].self_attn) == 50.0

    class NoCap(torch.nn.Module):  # hands softcap=None over (as videoprism's attention does)
        attn_logit_softcapping = 50.0

        def forward(self, attend):
            return attend(softcap=None)

    assert model_access.logit_softcap(NoCap()) is None


def _loud_first_head(cls):
    """`cls` whose first KV head scores 1000 times louder: the same order within every head."""

    class Loud(cls):
        def score(self, obs):
            scores = super().score(obs)
            return scores * torch.tensor([1000.0] + [1.0] * (scores.shape[1] - 1))[None, :, None]

    return Loud


def _kept(model, ids, press):
    cache = DynamicCache(config=model.config)
    with press(model):
        model(ids, cache=cache)
    return [[layer.slot("pos", 0, h).tolist() for h in range(layer.heads)] for layer in cache.layers]


@pytest.mark.parametrize("inner", [SnapKVPress, KnormPress])  # positive scores; negative (minus the key norm)
def test_adakv_normalize_makes_heads_compete_by_shape_not_scale(inner):
    """With normalize=True a head whose scores are 1000 times louder keeps exactly what it kept before;
    without, one head gets the whole budget above the other head's safeguard (0.2 x 64 slots). Each head's
    own order is kept: with even shares (alpha_safeguard=1) normalizing changes nothing."""
    model = tiny_model("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    ids = prompt(1, 128)
    kwargs = {"window_size": 8} if inner is SnapKVPress else {}
    plain, loud = inner(0.5, **kwargs), _loud_first_head(inner)(0.5, **kwargs)
    normalized = _kept(model, ids, AdaKVPress(plain, normalize=True))
    assert _kept(model, ids, AdaKVPress(loud, normalize=True)) == normalized
    raw = _kept(model, ids, AdaKVPress(loud))
    split = [116, 12] if inner is SnapKVPress else [12, 116]  # louder: positive scores win, negative lose
    assert all([len(h) for h in heads] == split for heads in raw)
    assert raw != normalized
    even = _kept(model, ids, AdaKVPress(plain, alpha_safeguard=1.0, normalize=True))
    assert even == _kept(model, ids, AdaKVPress(plain, alpha_safeguard=1.0))
    # while decoding, rows over budget are re-allocated one head at a time: scaled the same way
    budget = {"window_size": 4} if inner is SnapKVPress else {}
    runs = [greedy_scores(model, prompt(1, 64), AdaKVPress(make(max_tokens=24, **budget), normalize=True), new=30)
            for make in (inner, _loud_first_head(inner))]  # fmt: skip
    (plain_logits, plain_cache), (loud_logits, loud_cache) = runs
    assert torch.equal(plain_logits, loud_logits)
    assert [layer.lengths for layer in plain_cache.layers] == [layer.lengths for layer in loud_cache.layers]
    with pytest.raises(ValueError, match="normalize must be true or false"):
        AdaKVPress(plain, normalize="yes")


@pytest.mark.parametrize("family", ["llama", "mistral-window", "gemma3"])  # sliding windows: each row its own
@pytest.mark.parametrize("make", ["adakv", "duo", "duo-short", "duo-snapkv"])
def test_padded_batch_rows_equal_rows_alone(make, family):
    """Each row of a left-padded batch gets what it gets alone; "duo-short": a row too short for DuoAttention to
    split its heads at r = 0.6 (20 tokens: its budget, 8, is under a streaming head's 12) splits them 11 steps
    later, as it does alone, while the long row splits in the prefill, as it does alone."""
    model = tiny_model(family)
    if make == "adakv":
        press = AdaKVPress(SnapKVPress(0.5, window_size=8))
    elif make.startswith("duo") and make != "duo-snapkv":
        press = DuoAttentionPress(compression_ratio=0.6, head_pattern=tiny_pattern(model), window=8)
    else:
        press = DuoAttentionPress(retrieval_fraction=0.5, head_pattern=tiny_pattern(model), window=8,
                                  press=SnapKVPress(0.5, window_size=8))  # fmt: skip
    length = 20 if make == "duo-short" else 70
    a, b = prompt(1, 96, seed=1), prompt(1, length, seed=2)
    batch, mask = left_padded([a[0], b[0]])
    together, cache = greedy_scores(model, batch, press, mask=mask)
    alone_a, _ = greedy_scores(model, a, press)
    alone_b, cache_b = greedy_scores(model, b, press)
    assert (together[:, 0] - alone_a[:, 0]).nan_to_num(0.0).abs().max() <= 1e-5
    assert (together[:, 1] - alone_b[:, 0]).nan_to_num(0.0).abs().max() <= 1e-5
    for layer, layer_b in zip(cache.layers, cache_b.layers, strict=True):
        if isinstance(layer, HeadwiseLayer):  # padding never stored: row 1 holds what the row alone holds
            assert layer.lengths[layer.heads :] == layer_b.lengths


def test_adakv_keeps_its_budget_while_decoding():
    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    totals = []

    class Record(LogitsProcessor):
        def __call__(self, input_ids, scores):
            totals.append(max(sum(layer.lengths) for layer in cache.layers))
            return scores

    with AdaKVPress(SnapKVPress(max_tokens=24, window_size=4))(model):
        model.generate(
            prompt(1, 64), cache=cache, max_new_tokens=100, min_new_tokens=100, do_sample=False,
            logits_processor=LogitsProcessorList([Record()]),
        )  # fmt: skip
    assert max(totals) <= 2 * 24 and min(totals) >= 2 * 24 - 2
    assert cache.get_seq_length() == 163


def test_allocate_global_topk_with_floor():
    scores = torch.tensor([[[9.0, 8, 7, 6], [1, 0.5, 0.2, 0.1]]])
    keep = allocate(scores, torch.tensor([4]), torch.tensor([1]))
    assert keep.tolist() == [[[True, True, True, False], [True, False, False, False]]]
    keep = allocate(scores, torch.tensor([4]), torch.tensor([0]))
    assert keep[0, 0].all() and not keep[0, 1].any()


def test_adakv_wraps_per_layer_budgets():
    model = tiny_model("llama", num_hidden_layers=4)
    _, cache = greedy_scores(model, prompt(1, 128), AdaKVPress(PyramidKVPress(0.5, window_size=4, beta=4)), new=1)
    totals = [sum(layer.lengths) for layer in cache.layers]
    assert totals == sorted(totals, reverse=True) and totals[0] > totals[-1]


# ----- DuoAttention ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_duo_streaming_heads_stay_bounded(attn):
    """Streaming heads hold their 4 sinks and the last 16 tokens, whatever the row; retrieval heads everything."""
    model = tiny_model("llama", attn, num_hidden_layers=4)
    press = DuoAttentionPress(retrieval_fraction=0.5, head_pattern=tiny_pattern(model), n_sink=4, window=16)
    ids = prompt(2, 96)
    scores, cache = greedy_scores(model, ids, press, new=50)
    fed = torch.cat([ids, scores[:-1].argmax(-1).T], dim=1)  # the last token generated is not fed back
    full = DynamicCache(config=model.config)
    model(fed, cache=full)  # the first layer's keys depend on the tokens alone: the same under any press
    streaming = retrieval = 0
    for i, layer in enumerate(cache.layers):
        rank = press.head_rank(model)[i]
        if not isinstance(layer, HeadwiseLayer):  # every head of it retrieves: it stays dense
            assert bool((rank < 4).all()) and layer.n == 96 + 49
            retrieval += 2 * 2
            continue
        for pair, n in enumerate(layer.lengths):
            row, head = divmod(pair, layer.heads)
            pos = layer.slot("pos", row, head).long()
            if rank[head] < 4:  # half of the 8 (layer, head) pairs
                retrieval += 1
                assert n == 96 + 49 and pos.tolist() == list(range(145))
            else:
                streaming += 1
                assert n == 20 and pos.tolist() == [0, 1, 2, 3, *range(145 - 16, 145)]
            if i == 0:
                torch.testing.assert_close(layer.slot("keys", row, head), full.layers[0].keys[row, head, pos])
                torch.testing.assert_close(layer.slot("values", row, head), full.layers[0].values[row, head, pos])
    assert streaming == retrieval == 8


@pytest.mark.parametrize("chunk", [None, 24])
def test_duo_streaming_heads_on_a_sliding_window_keep_no_stale_sinks(chunk):
    """On sliding-window layers (16 tokens) past the window the sinks are gone: a streaming head holds its last 8
    tokens (not the window's oldest 4 as sinks), a retrieval head the last 15, the prompt fed whole or in chunks."""
    model = tiny_model("mistral-window")
    press = DuoAttentionPress(retrieval_fraction=0.5, head_pattern=tiny_pattern(model), n_sink=4, window=8)
    _, cache = greedy_scores(model, prompt(1, 96), press, new=20, chunk=chunk)
    held = {n: [] for n in ("streaming", "retrieval")}
    for i, layer in enumerate(cache.layers):
        for head, rank in enumerate(press.head_rank(model)[i].tolist()):
            kind = "retrieval" if rank < 2 else "streaming"  # half of the 4 (layer, head) pairs
            pos = layer.slot("pos", 0, head) if isinstance(layer, HeadwiseLayer) else layer.pos[0, head]  # (dense:
            held[kind].append(pos.tolist())  # every head of the layer retrieves)
    seen = 96 + 19
    assert held["streaming"] and all(pos == list(range(seen - 8, seen)) for pos in held["streaming"])
    assert held["retrieval"] and all(pos == list(range(seen - 15, seen)) for pos in held["retrieval"])


@pytest.mark.parametrize("inner", ["snapkv", "h2o"])
def test_duo_over_a_scorer(inner):
    """With press=, retrieval heads keep what that press keeps of them, at its budget, while decoding too."""
    model = tiny_model("llama", num_hidden_layers=4)
    scorer = SnapKVPress(max_tokens=32, window_size=4) if inner == "snapkv" else HeavyHitterPress(max_tokens=32)
    press = DuoAttentionPress(retrieval_fraction=0.5, head_pattern=tiny_pattern(model), n_sink=4, window=16,
                              press=scorer)
    ids = prompt(1, 96)
    _, prefilled = greedy_scores(model, ids, press, new=1)
    dense = DynamicCache(config=model.config)
    with scorer(model):
        model(ids, cache=dense)
    _, decoded = greedy_scores(model, ids, press, new=50)
    for i, (layer, after) in enumerate(zip(prefilled.layers, decoded.layers, strict=True)):
        for head in range(layer.heads):
            kept = sorted(layer.slot("pos", 0, head).tolist())
            if press.head_rank(model)[i][head] < 4:  # a retrieval head: the scorer's own choice, then its budget
                assert kept == sorted(dense.layers[i].pos[0, head].tolist())
                assert 32 - 2 <= after.lengths[head] <= 32
            else:
                assert kept == [0, 1, 2, 3, *range(80, 96)] and after.lengths[head] == 20
    with pytest.raises(ValueError, match="takes retrieval_fraction"):
        DuoAttentionPress(compression_ratio=0.5, press=SnapKVPress(0.5))
    with pytest.raises(ValueError, match="needs retrieval_fraction"):  # (the budget went to the inner press)
        press_from_name("duo-attention:inner=snapkv", compression_ratio=0.5)
    with pytest.raises(TypeError, match="token-level press"):
        DuoAttentionPress(retrieval_fraction=0.5, press=AdaKVPress(SnapKVPress(0.5)))


def test_output_attentions_is_refused_where_layers_are_compressed_head_by_head():
    """Head-wise layers return no attention weights: transformers' list skipped them without a word (three layers
    gave one entry, the third layer's). Refused from the press's first forward (whose layers are still dense), not
    part way through a generation. A dense press returns every layer's."""
    model = tiny_model("llama", "eager")
    ids = prompt(1, 40)
    with pytest.raises(ValueError, match="output_attentions under a press that compresses head by head"):
        with AdaKVPress(SnapKVPress(0.5, window_size=4))(model):
            model(ids, cache=DynamicCache(config=model.config), output_attentions=True)
    cache = DynamicCache(config=model.config)
    with SnapKVPress(0.5, window_size=4)(model):
        model(ids, cache=cache)
        out = model(ids[:, :1], cache=cache, output_attentions=True)
    assert len(out.attentions) == model.config.num_hidden_layers and out.attentions[0].shape[-1] == 21


def test_duo_retrieval_fraction_rounds_half_up():
    """Python's round halves to even: 0.25 of 6 pairs gave 2 retrieval heads, 0.75 of them 4, where 5 keeps more."""
    windows = torch.full((6,), float("inf"))
    got = {f: int(DuoAttentionPress(retrieval_fraction=f).retrieval_heads([10], windows)[0]) for f in (0.25, 0.75, 0.7)}
    assert got == {0.25: 2, 0.75: 5, 0.7: 4}


def test_duo_compression_ratio_sets_the_bytes():
    model = tiny_model("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4)
    ids = prompt(1, 400)
    full = DynamicCache(config=model.config)
    model(ids, cache=full)
    for ratio in (0.5, 0.75):
        cache = DynamicCache(config=model.config)
        with DuoAttentionPress(compression_ratio=ratio, head_pattern=tiny_pattern(model), window=16)(model):
            model(ids, cache=cache)
        kept = cache_bytes(cache) / cache_bytes(full)
        assert abs(kept - (1 - ratio)) < 1 / 8 + 0.02, kept  # one (layer, head) pair of 8 is the granularity


@pytest.mark.parametrize("first", ["full", "sliding"])
def test_duo_compression_ratio_counts_what_a_sliding_layer_holds(first):
    """On Gemma3's mixed layers a retrieval head of a sliding layer holds at most its window (7 tokens here), one of
    the full layer everything (120): the count of retrieval heads is chosen on what they hold, whichever layers the
    pattern ranks first, so the tokens held come within half of a full-layer head's difference of what a dense
    press keeps of every layer."""
    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    model = tiny_model("gemma3", num_hidden_layers=6, layer_types=kinds)
    pattern = tiny_pattern(model)
    pattern["scores"] = [[2.0 + h / 4 if (kind == "full_attention") == (first == "full") else h / 4 for h in range(2)]
                         for kind in kinds]  # fmt: skip
    cache = DynamicCache(config=model.config)
    with DuoAttentionPress(compression_ratio=0.5, head_pattern=pattern, n_sink=2, window=4)(model):
        model(prompt(1, 120), cache=cache)
    held = sum(sum(layer.lengths) if isinstance(layer, HeadwiseLayer) else layer.n * 2 for layer in cache.layers)
    target = 10 * (7 - 7 // 2) + 2 * (120 - 60)  # what SnapKV at r = 0.5 keeps of each of the 12 heads
    assert abs(held - target) <= (120 - 6) / 2, held  # the old count (from the context length alone): 292 or 70


def test_duo_fed_in_chunks_splits_heads_once_the_budget_allows():
    model = tiny_model("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4)
    ids = prompt(1, 400)
    full = DynamicCache(config=model.config)
    model(ids, cache=full)
    cache = DynamicCache(config=model.config)
    with DuoAttentionPress(compression_ratio=0.5, head_pattern=tiny_pattern(model), window=16)(model):
        for start in range(0, 400, 32):  # the first chunk's budget (16) is below a streaming head's 20
            model(ids[:, start : start + 32], cache=cache)
    kept = cache_bytes(cache) / cache_bytes(full)
    assert 0.25 < kept <= 0.5 + 1 / 8, kept  # not every head streaming (the split waited for a real budget)


def test_duo_keeping_a_whole_context_its_budget_cannot_split_says_so_once():
    """At r = 0.9 a 250-token row's budget (25) is not more than a streaming head's 68: it keeps everything (1.0 of
    the bytes where r = 0.9 promises 0.1), which it did without a word. Said at a decoding step (a chunk's row that
    splits at a later chunk is not said)."""
    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    with pytest.warns(UserWarning, match=r"DuoAttentionPress keeps all 251 tokens of a row: its budget at "
                                         r"compression_ratio=0.9 \(26\) is not more than a streaming head's") as said:
        with DuoAttentionPress(compression_ratio=0.9, head_pattern=tiny_pattern(model))(model):
            model.generate(prompt(1, 250), cache=cache, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert len([w for w in said if "keeps all" in str(w.message)]) == 1
    assert all(layer.n == 252 for layer in cache.layers)  # (the last token is generated, not cached)


def test_head_pattern_for_another_model_is_refused():
    llama, qwen = tiny_model("llama"), tiny_model("qwen2", num_hidden_layers=3)
    press = DuoAttentionPress(compression_ratio=0.5, head_pattern=tiny_pattern(qwen))
    with pytest.raises(ValueError, match="made for 'tiny'.*not for this LlamaForCausalLM"):
        press(llama)
    assert llama.config._attn_implementation == "sdpa"


# ----- errors ----------------------------------------------------------------------------------------------------
def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="wraps a token-level press"):
        AdaKVPress()
    with pytest.raises(TypeError, match=r"got <class .*SnapKVPress'>: build one first, AdaKVPress\(SnapKVPress\("):
        AdaKVPress(SnapKVPress)  # (the class: said as 'got None' before)
    with pytest.raises(TypeError, match="wraps a token-level press such as SnapKVPress, got 0.5"):
        AdaKVPress(0.5)
    with pytest.raises(ValueError, match="rerotate"):
        AdaKVPress(SnapKVPress(0.5, rerotate=True))
    with pytest.raises(ValueError, match="alpha_safeguard"):
        AdaKVPress(SnapKVPress(0.5), alpha_safeguard=2)
    with pytest.raises(ValueError, match="exactly one of compression_ratio"):
        DuoAttentionPress()
    with pytest.raises(ValueError, match="not max_tokens"):
        DuoAttentionPress(max_tokens=10)
    with pytest.raises(ValueError, match="retrieval_fraction must be"):
        DuoAttentionPress(retrieval_fraction=1.5)
    for unused in (dict(decode_slack=0.5), dict(layer_scales=(1.0, 2.0)), dict(rerotate=True)):  # nothing reads them
        with pytest.raises(ValueError, match="it takes no layer_scales, rerotate or decode_slack"):
            DuoAttentionPress(compression_ratio=0.5, **unused)
    with pytest.raises(ValueError, match="kv_bits must be one of"):
        DuoAttentionPress(compression_ratio=0.5, kv_bits=3)
    with pytest.raises(FileNotFoundError, match="neither a JSON file nor a packaged pattern"):
        DuoAttentionPress(compression_ratio=0.5, head_pattern="no-such-model")
    assert isinstance(press_from_name("adakv", compression_ratio=0.5, window_size=8).press, SnapKVPress)
    assert isinstance(AdaKVPress(KnormPress(0.5)).press, KnormPress)  # the press as the first argument


def test_headwise_cache_needs_its_press():
    model = tiny_model("llama")
    ids = prompt(1, 64)
    cache = DynamicCache(config=model.config)
    with AdaKVPress(SnapKVPress(0.5, window_size=8))(model):
        model(ids, cache=cache)
    with pytest.raises(RuntimeError, match="continue it inside `with press"):
        model(ids[:, :1], cache=cache)
    with SnapKVPress(0.5)(model), pytest.raises(ValueError, match="SnapKVPress cannot continue it"):
        model(ids[:, :1], cache=cache)
    assert model.config._attn_implementation == "sdpa"


def test_beam_search_reorders_headwise_rows():
    model = tiny_model("llama")
    ids = prompt(2, 64)
    outs = []
    for press in (SnapKVPress(0.5, window_size=8), AdaKVPress(SnapKVPress(0.5, window_size=8), alpha_safeguard=1.0)):
        with press(model):
            out = model.generate(ids, max_new_tokens=12, num_beams=3, num_return_sequences=2, do_sample=False)
        outs.append(out)
    assert outs[0].shape == (4, 76) and torch.equal(outs[0], outs[1])


def test_padding_after_headwise_compression_is_refused_before_any_change():
    model = tiny_model("llama")
    ids = prompt(2, 64)
    cache = DynamicCache(config=model.config)
    press = AdaKVPress(SnapKVPress(0.5, window_size=8))
    with press(model):
        model(ids, cache=cache)
        before = [list(layer.lengths) for layer in cache.layers]
        mask = torch.ones(2, 68, dtype=torch.long)
        mask[1, -2] = 0
        with pytest.raises(ValueError, match="padding only in its first forward"):
            model(prompt(2, 4), attention_mask=mask, cache=cache)
        assert [layer.lengths for layer in cache.layers] == before and cache.get_seq_length() == 64


def test_duo_auto_pattern_needs_a_packaged_one_for_the_model():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="no packaged head pattern fits this LlamaForCausalLM.*calibrate-heads"):
        DuoAttentionPress(compression_ratio=0.5)(model)


def test_a_forward_that_raised_half_way_leaves_a_refused_cache():
    model = tiny_model("llama")

    class Failing(SnapKVPress):
        def score(self, obs):
            if obs.layer_idx == 0:  # layer 0 holds the prompt, layer 1 never sees it
                raise MemoryError("simulated")
            return super().score(obs)

    cache = DynamicCache(config=model.config)
    with AdaKVPress(Failing(0.5, window_size=8))(model), pytest.raises(MemoryError):
        model(prompt(1, 64), cache=cache)
    with AdaKVPress(SnapKVPress(0.5, window_size=8))(model):
        with pytest.raises(ValueError, match="left inconsistent by a forward that raised"):
            model(prompt(1, 1), cache=cache)
    assert model.config._attn_implementation == "sdpa"


def test_headwise_cache_refuses_another_headwise_press_and_resets():
    model = tiny_model("llama")
    ids = prompt(1, 64)
    cache = DynamicCache(config=model.config)
    ada = AdaKVPress(SnapKVPress(0.5, window_size=8))
    with ada(model):
        model(ids, cache=cache)
    assert not any(layer.is_croppable for layer in cache.layers)
    duo = DuoAttentionPress(compression_ratio=0.5, head_pattern=tiny_pattern(model), window=8)
    with duo(model), pytest.raises(ValueError, match="made by AdaKVPress; DuoAttentionPress cannot continue it"):
        model(ids[:, :1], cache=cache)
    cache.reset()  # an emptied head-wise cache takes a new prompt: the same logits as a fresh cache
    assert all(t.untyped_storage().nbytes() == 0 for layer in cache.layers for t in layer.store.values())  # freed
    with ada(model):
        again = model(ids, cache=cache).logits
    with ada(model):
        fresh = model(ids, cache=DynamicCache(config=model.config)).logits
    assert torch.allclose(again, fresh, atol=1e-5)


def test_a_reset_headwise_cache_takes_another_batch_size_padding_or_press():
    """An emptied head-wise cache starts its next prompt as a fresh cache does: another batch size (an
    index_copy_ error inside its commit before), a left-padded prompt (refused as padding past the first forward)
    or another press (refused as made by AdaKVPress); without a press it says what to do."""
    model = tiny_model("llama")
    ada = AdaKVPress(SnapKVPress(0.5, window_size=8))
    ids, mask = left_padded([prompt(1, 64, seed=3)[0], prompt(1, 50, seed=4)[0], prompt(1, 58, seed=6)[0]])
    duo = DuoAttentionPress(compression_ratio=0.5, head_pattern=tiny_pattern(model), window=8)
    cache = DynamicCache(config=model.config)
    with ada(model):
        model(prompt(2, 64), cache=cache)
    for press, kwargs in ((ada, {"input_ids": ids, "attention_mask": mask}), (ada, {"input_ids": ids[:1]}),
                          (duo, {"input_ids": ids[:1]})):  # fmt: skip
        cache.reset()
        with press(model):
            again = model(**kwargs, cache=cache).logits
        with press(model):
            fresh = model(**kwargs, cache=DynamicCache(config=model.config)).logits
        assert torch.equal(again, fresh)
    cache.reset()
    with pytest.raises(RuntimeError, match="emptied.*use a new DynamicCache"):
        model(ids[:1], cache=cache)


def test_a_chunked_padded_batch_that_cannot_go_head_wise_is_told_why():
    """A left-padded row's padding reaching a chunk after the layers went head-wise is refused, naming the chunks."""
    model = tiny_model("llama")
    ids, mask = left_padded([prompt(1, 37, seed=11)[0], prompt(1, 21, seed=12)[0]])
    with pytest.raises(ValueError, match="padding only in its first forward.*prefill_chunk_size.*longest padding"):
        greedy_scores(model, ids, AdaKVPress(SnapKVPress(0.6, window_size=4)), new=1, mask=mask, chunk=8)


def test_a_reset_duo_cache_splits_its_heads_for_the_next_prompt():
    """DuoAttention's split depends on the prompt's length: after `reset` the next prompt is split anew (it kept
    the first prompt's, and truncated heads a fresh cache keeps whole)."""
    model = tiny_model("llama")
    duo = DuoAttentionPress(compression_ratio=0.5, head_pattern=tiny_pattern(model), window=8)
    cache = DynamicCache(config=model.config)
    with duo(model):
        model(prompt(1, 40, seed=5), cache=cache)
    cache.reset()
    ids = prompt(1, 64, seed=3)
    kwargs = {"max_new_tokens": 8, "do_sample": False, "output_scores": True, "return_dict_in_generate": True}
    with duo(model):
        again = torch.stack(model.generate(ids, cache=cache, **kwargs).scores)
        fresh_cache = DynamicCache(config=model.config)
        fresh = torch.stack(model.generate(ids, cache=fresh_cache, **kwargs).scores)
    held = lambda c: [getattr(layer, "lengths", None) or [layer.n] * layer.keys.shape[1] for layer in c.layers]  # noqa: E731
    assert held(cache) == held(fresh_cache)
    torch.testing.assert_close(again, fresh)


def test_one_auto_duo_press_serves_two_architectures_at_once(monkeypatch):
    """head_pattern="auto" finds each model's own pattern; installing the press on a second architecture while it
    is installed on the first (before the first splits its heads) leaves the first one's heads as they were."""
    import kvpress.presses.duo_attention as duo

    small, large = tiny_model("llama"), tiny_model("llama", num_hidden_layers=4, num_key_value_heads=4)
    monkeypatch.setattr(duo, "find_pattern", lambda model: tiny_pattern(model, seed=model.config.num_hidden_layers))
    ids = prompt(1, 96)

    def small_run(press, meanwhile=None):
        cache = DynamicCache(config=small.config)
        with press(small):
            if meanwhile is not None:
                meanwhile()
            small(ids[:, :-1], cache=cache)  # the small model's heads are split here
            out = small.generate(ids, cache=cache, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
        return torch.stack(out.scores)

    shared = DuoAttentionPress(0.5, n_sink=2, window=8)
    large_alone = greedy_scores(large, ids, DuoAttentionPress(0.5, n_sink=2, window=8))[0]
    large_shared = []
    small_shared = small_run(shared, lambda: large_shared.append(greedy_scores(large, ids, shared)[0]))
    assert torch.equal(large_shared[0], large_alone)
    assert torch.equal(small_shared, small_run(DuoAttentionPress(0.5, n_sink=2, window=8)))


def test_a_scratch_pass_over_a_headwise_layer_drops_what_it_appended_without_copying_what_is_held():
    """`scratch` (KVzip's pass over a head-wise cache) rewinds a head-wise layer of full attention: each pair's held
    slots as they were, the appended ones dropped and their room packed away, also when a forward raises midway."""
    from kvpress.patches.cache import _appends_only, scratch

    torch.manual_seed(0)
    dense = PressedLayer()
    dense.update(torch.randn(1, 2, 30, 8), torch.randn(1, 2, 30, 8))
    layer = HeadwiseLayer.from_dense(dense, torch.rand(1, 2, 30) < torch.tensor([0.3, 0.8])[None, :, None])
    layer.driven = True
    layer.window = 16  # a sliding window drops what leaves it: copied on entry instead
    assert not _appends_only(layer)
    layer.window = None
    assert _appends_only(layer)  # rewound, not copied
    cache = DynamicCache()
    cache.layers = [layer]
    before = ([t.clone() for pair in ((0, 0), (0, 1)) for t in layer.pair(*pair)], list(layer.lengths), layer.seen)
    for fail in (False, True):
        with pytest.raises(RuntimeError) if fail else contextlib.nullcontext(), scratch(cache):
            for _ in range(3):  # more than the spare room: the storage grows
                layer.update(torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8))
                layer.commit()
            assert layer.seen == 30 + 48 and layer.lengths == [n + 48 for n in before[1]]
            if fail:
                layer.update(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))  # left pending
                raise RuntimeError("a forward raised")
        held = [t for pair in ((0, 0), (0, 1)) for t in layer.pair(*pair)]
        assert all(torch.equal(a, b) for a, b in zip(held, before[0], strict=True))
        assert (layer.lengths, layer.seen, layer.pending) == (before[1], before[2], 0)
        assert layer.store["keys"].shape[0] <= sum(layer.lengths) + 2 * sum(max(8, n // 32) for n in layer.lengths) + 2


def test_crop_of_nothing_is_a_no_op_and_every_tensor_is_counted():
    """transformers calls `crop(0)` as a no-op (its deferred stop check): a compressed layer, dense or head-wise,
    takes it; `tensors()` (cache_bytes) holds every tensor a head-wise layer keeps, its segment offsets too."""
    model = tiny_model("mistral-window")
    cache = DynamicCache(config=model.config)
    with AdaKVPress(SnapKVPress(0.5, window_size=4))(model):
        model(prompt(1, 40), cache=cache)
        model(prompt(1, 1, seed=2), cache=cache)
    layer = cache.layers[0]
    assert isinstance(layer, HeadwiseLayer)
    seen = cache.get_seq_length()
    cache.crop(0)
    assert cache.get_seq_length() == seen
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        layer.crop(-1)
    kept = {id(t) for t in layer.tensors()}
    held = [name for name, t in vars(layer).items() if isinstance(t, torch.Tensor) and t.numel()
            and name not in ("keys", "values") and id(t) not in kept]  # (keys/values: empty placeholders)
    assert held == []
    dense = DynamicCache(config=model.config)
    with SnapKVPress(0.5, window_size=4)(model):
        model(prompt(1, 40), cache=dense)
    dense.layers[0].crop(0)


def test_a_chunk_over_a_head_wise_layer_makes_each_blocks_mask_alone(monkeypatch):
    """A chunk's mask is made block by block (a block's rows over the slots it sees), never whole per (row, KV
    head): at 8K new tokens over 64K held a whole one was ~600 MB a pair, more than a block's weights."""
    from kvpress.patches import blocked_attention as blocked

    model = tiny_model("llama")
    monkeypatch.setattr(blocked, "QUERY_BLOCK", 4)
    seen = []
    run = blocked.blocked_attention

    def recording(query, key, value, rows_mask, scaling=None):
        seen.extend(rows_mask(rows=(s, min(query.shape[2], s + 4))) for s in range(0, query.shape[2], 4))
        return run(query, key, value, rows_mask, scaling)

    monkeypatch.setattr(blocked, "blocked_attention", recording)
    cache = DynamicCache(config=model.config)
    with AdaKVPress(SnapKVPress(0.5, window_size=4))(model):
        model(prompt(1, 40), cache=cache)
        model(prompt(1, 10, seed=3), cache=cache)  # a chunk of 10 over the head-wise layers
    assert seen and all(mask.untyped_storage().nbytes() == mask.numel() for mask in seen)  # no larger mask behind
    assert {mask.shape[0] for mask in seen} == {4, 2}


def test_what_the_head_wise_attention_does_not_compute_is_refused():
    """Dropout (a model in training mode) and a window layer left untrimmed are refused, not silently skipped."""
    with torch.inference_mode(False):
        model = tiny_model("llama", attention_dropout=0.5)
    cache = DynamicCache(config=model.config)
    with AdaKVPress(SnapKVPress(0.5, window_size=4))(model):
        model(prompt(1, 40), cache=cache)  # eval: head-wise layers made
        model.train()
        try:
            with pytest.raises(ValueError, match="head-wise compressed layers do not support dropout"):
                model(prompt(1, 1, seed=2), cache=cache)
        finally:
            model.eval()
    from kvpress.patches.intercept import headwise_unsupported

    assert headwise_unsupported({"s_aux": torch.randn(4), "position_bias": None, "dropout": 0.0}) == ["s_aux"]
    assert headwise_unsupported({"position_bias": torch.zeros(2, 2), "dropout": 0.1}) == ["position_bias", "dropout"]
    windowed = tiny_model("mistral-window")
    cache = DynamicCache(config=windowed.config)
    with AdaKVPress(SnapKVPress(0.5, window_size=4))(windowed):
        windowed(prompt(1, 40), cache=cache)
        layer = cache.layers[0]
        layer.window = 2  # (as if a trim had been skipped)
        with pytest.raises(RuntimeError, match="past its window of 2: it was not trimmed"):
            windowed(prompt(1, 1, seed=2), cache=cache)
