"""KVzip: scores are the peak attention of a reconstruction pass; the context is compressed once cached."""

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress import KVzipPress
from kvpress.eval.bench_core import kvzip_scoring_peak
from kvpress.eval.sweep import run_sweep
from kvpress.patches import blocked_attention as blocked
from kvpress.presses import kvzip
from kvpress.presses.kvzip import LEAD_IN, reconstruction_scores
from kvpress.presses.prepared import PromptAttention
from kvpress.recording import compress_recording, record_prefill
from tiny import left_padded, prompt, tiny_model

REPEAT = torch.tensor([[5, 6, 7]])


class _Tokenizer:
    """Stands in for a tokenizer: every repeat request is the tokens 5, 6, 7."""

    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        return SimpleNamespace(input_ids=REPEAT.clone())


def _plain(ratio: float) -> KVzipPress:
    """KVzip as in the paper's per-layer form: every layer keeps the same number, no window."""
    return KVzipPress(ratio, window_size=0, global_budget=0.0)


@pytest.mark.parametrize("with_output", [True, False])
@pytest.mark.parametrize("family", ["llama", "mistral-window", "gemma3"])  # windows of 16 and 8: 40 tokens pass them
def test_scores_are_the_peak_attention_of_the_reconstruction(family, with_output, monkeypatch):
    """Both ways of scoring: the full-attention layers' weights computed once, with the attention's output
    (`PromptAttention.weights_block`), and the observer computing them itself (what sliding-window layers do)."""
    model = tiny_model(family, attn="eager")
    ids = prompt(1, 40)
    recording = record_prefill(model, ids)
    before = copy.deepcopy(recording.cache)
    calls = []
    original = blocked.attention_with_mass
    monkeypatch.setattr(blocked, "attention_with_mass", lambda *a, **k: calls.append(a[-1]) or original(*a, **k))
    scores = reconstruction_scores(model, recording.cache, ids, REPEAT, chunk_size=64, piece_size=7,
                                   from_output=with_output)  # one pass
    full_layers = [i for i, layer in enumerate(recording.cache.layers) if getattr(layer, "window", None) is None]
    assert len(calls) == (len(full_layers) * 7 if with_output else 0)  # 43 tokens in 7 pieces: one call a piece
    assert all(peak is not None for peak in calls)  # each gave the peaks too
    for layer, kept in zip(recording.cache.layers, before.layers, strict=True):  # the cache is left as it was
        assert torch.equal(layer.keys, kept.keys) and layer.get_seq_length() == kept.get_seq_length() == 40
    full = torch.cat([ids, REPEAT, ids], dim=-1)
    attentions = model(full, output_attentions=True).attentions  # [1, Hq, L, L] per layer
    assert sorted(scores) == sorted(recording.queries)  # every compressible layer (gemma3: the global one too)
    for idx, peak in scores.items():
        hkv = peak.shape[1]
        expected = attentions[idx][:, :, 40:, :40].amax(dim=2)  # [1, Hq, 40]
        expected = expected.view(1, hkv, -1, 40).amax(dim=2)  # max over the query heads of each KV group
        torch.testing.assert_close(peak, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("piece_size", [None, 5])
def test_long_contexts_are_rebuilt_a_chunk_a_pass_in_the_cache_itself_which_is_put_back(piece_size, monkeypatch):
    """A pass of 27 tokens (the request, a lead-in of 8, a chunk of 16) over a cache of 40, fed in one forward or in
    pieces of 5 (2 first, then 5 at a time): in its last piece each layer drops the pass right after its attention."""
    model = tiny_model("llama", attn="eager")
    ids = prompt(1, 40)
    recording = record_prefill(model, ids)
    cache = recording.cache
    before = copy.deepcopy(cache)
    held = []  # at each layer's observation: the layer, the tokens each layer holds, whether it is the caller's cache
    observed = PromptAttention.__call__

    def watch(self, obs):
        held.append((obs.layer_idx, [layer.n for layer in cache.layers], obs.layer is cache.layers[obs.layer_idx]))
        return observed(self, obs)

    monkeypatch.setattr(PromptAttention, "__call__", watch)
    scores = reconstruction_scores(model, cache, ids, REPEAT, chunk_size=16, piece_size=piece_size)
    monkeypatch.undo()
    assert all(same for *_, same in held)  # no copy of the cache
    passes = [19, 27, 19]  # the request (3) and the chunks 0-16 (no lead-in), 16-32 and 32-40 (a lead-in of 8)
    ends = {19: [19], 27: [27]} if piece_size is None else {19: [4, 9, 14, 19], 27: [2, 7, 12, 17, 22, 27]}
    fed = [(40 + begin, 40 + end, end == p) for p in passes for begin, end in zip([0, *ends[p]], ends[p], strict=False)]
    layers = len(cache.layers)
    assert len(held) == len(fed) * layers
    for i, (idx, ns, _) in enumerate(held):
        start, end, last = fed[i // layers]
        assert ns[idx] == end  # the observed layer holds the context, the pass so far and this piece
        assert all(n == (40 if last else end) for n in ns[:idx])  # before it: dropped in a pass's last piece
        assert all(n == start for n in ns[idx + 1 :])  # after it: what the pass's earlier pieces left
    assert max(max(ns) for _, ns, _ in held) == 40 + 3 + LEAD_IN + 16  # the context plus one pass, never two
    if piece_size is None:  # one forward a pass: the context plus one layer's pass at a time
        assert max(sum(ns) for _, ns, _ in held) == 40 * layers + 3 + LEAD_IN + 16
    expected = None  # the peak over three passes, each over the context alone: the request, a lead-in, a chunk
    for start in (0, 16, 32):
        fed = torch.cat([REPEAT, ids[:, max(0, start - LEAD_IN) : start + 16]], dim=-1)
        attentions = model(torch.cat([ids, fed], dim=-1), output_attentions=True).attentions
        peaks = {idx: a[:, :, 40:, :40].amax(dim=2).view(1, 2, -1, 40).amax(dim=2) for idx, a in enumerate(attentions)}
        expected = peaks if expected is None else {i: torch.maximum(expected[i], p) for i, p in peaks.items()}
    for idx, peak in scores.items():
        torch.testing.assert_close(peak, expected[idx], atol=1e-5, rtol=1e-4)
    for layer, kept in zip(cache.layers, before.layers, strict=True):  # put back exactly
        assert torch.equal(layer.keys, kept.keys) and torch.equal(layer.values, kept.values)
        assert layer.n == layer.seen == layer.keys.shape[2] == 40 and torch.equal(layer.pos, kept.pos)
        assert torch.equal(layer.real_seen, kept.real_seen) and layer.pending == 0

    def fail_in_second_pass(self, obs):  # in layer 1's attention, which holds the pass so far
        if obs.layer_idx == 1 and cache.layers[1].n > 40 + 3 + 16:
            raise RuntimeError("boom")
        return observed(self, obs)

    monkeypatch.setattr(PromptAttention, "__call__", fail_in_second_pass)
    with pytest.raises(RuntimeError, match="boom"):
        reconstruction_scores(model, cache, ids, REPEAT, chunk_size=16, piece_size=piece_size)
    monkeypatch.undo()
    for layer, kept in zip(cache.layers, before.layers, strict=True):  # put back when a forward raised too
        assert torch.equal(layer.keys, kept.keys) and layer.n == layer.seen == 40 and layer.pending == 0
    assert model(ids[:, -1:], cache=cache).logits.isfinite().all()  # and it can be continued
    # what `make bench` reports: the cache's peak over the full cache's bytes, one layer's 43-token pass on top
    assert kvzip_scoring_peak(model, _Tokenizer(), ids) == pytest.approx((40 * layers + 43) / (40 * layers), rel=0.01)


def test_compressed_once_cached_keeping_the_top_scores():
    model = tiny_model("llama")
    ids = prompt(1, 40)
    recording = record_prefill(model, ids)
    fed = []
    hook = model.register_forward_pre_hook(lambda m, a, k: fed.append(1), with_kwargs=True)
    try:
        caches = {r: compress_recording(model, recording, _plain(r), _Tokenizer()) for r in (0.5, 0.75)}
    finally:
        hook.remove()
    assert len(fed) == 1  # one reconstruction pass serves every ratio (kept in the recording's memo)
    scores = next(iter(recording.memo.values()))
    for r, cache in caches.items():
        for idx, layer in enumerate(cache.layers):
            assert layer.n == 40 - int(40 * r)
            kept = layer.pos[0].sort(dim=-1).values  # positions kept per KV head
            best = scores[idx][0].topk(layer.n, dim=-1).indices.sort(dim=-1).values
            assert torch.equal(kept.long(), best)


def test_refuses_without_a_tokenizer():
    model = tiny_model("llama")
    ids = prompt(1, 40)
    press = KVzipPress(0.5)
    with pytest.raises(ValueError, match=r"with press\(model, tokenizer=tokenizer\)"):
        with press(model):
            model(ids, cache=DynamicCache(config=model.config))
    with pytest.raises(ValueError, match="pass tokenizer="):
        compress_recording(model, record_prefill(model, ids), press)
    with pytest.raises(ValueError, match="feed documents in chunks through the press: sweep them separately"):
        run_sweep(model, None, ["snapkv", "chunkkv:inner=kvzip"], [0.5], ["needle_noise", "perplexity"], "/nonexistent")
    with pytest.raises(ValueError, match="reconstruction_chunk must be a positive integer"):
        KVzipPress(0.5, reconstruction_chunk=0)
    with pytest.raises(ValueError, match="prompt must be a non-empty repeat request"):
        KVzipPress(0.5, prompt="  ")
    with pytest.raises(ValueError, match="keeps the tokens generated after it: decode_slack has nothing to cut"):
        kvpress.press_from_name("adakv:inner=kvzip:decode_slack=0.5", compression_ratio=0.5)  # nothing reads it


def test_generate_compresses_the_context_with_kvzip():
    model, tokenizer = kvpress.load_model()
    context = "The grass is green. The sky is blue. " * 20 + "The pass key is 71432. " + "The sun is yellow. " * 20
    cache = DynamicCache(config=model.config)
    answer = kvpress.generate(model, tokenizer, context, "What is the pass key? The pass key is", chat_template=False,
                              press=_plain(0.75), cache=cache, max_new_tokens=6)  # fmt: skip
    n = len(tokenizer(context + "\n\n").input_ids)
    question = len(tokenizer("What is the pass key? The pass key is", add_special_tokens=False).input_ids)
    assert cache.layers[0].n == n - int(n * 0.75) + question - 1 + 6  # compressed context, then question and answer
    assert "71432" in answer


def test_global_budget_moves_tokens_to_the_layers_that_score_higher():
    model = tiny_model("llama", num_hidden_layers=4)
    ids = prompt(1, 60)
    recording = record_prefill(model, ids)
    held = {}
    for g in (0.0, 0.5, 1.0):
        cache = compress_recording(model, recording, KVzipPress(0.5, global_budget=g, window_size=0), _Tokenizer())
        held[g] = [layer.n for layer in cache.layers]
    assert held[0.0] == [30] * 4
    for g in (0.5, 1.0):
        assert len(set(held[g])) > 1 and abs(sum(held[g]) - 120) <= 4  # the total stays the budget (floors)
        assert min(held[g]) >= 30 * (1 - g) - 1  # each layer keeps (1 - g) of its even share
    scores = next(iter(recording.memo.values()))
    threshold = torch.cat([s.flatten() for s in scores.values()]).topk(240).values[-1]  # 30 x 2 heads x 4
    above = [int((s >= threshold).sum()) / 2 for s in scores.values()]  # the global top-k, per layer and head
    assert held[1.0] == [int(a) for a in above]
    with pytest.raises(ValueError, match=r"global_budget must be a fraction in \[0, 1\]"):
        KVzipPress(0.5, global_budget=1.5)


def test_assisted_decoding_is_refused_by_name():
    """Prompt lookup feeds draft tokens and crops the rejected ones: KVzip had scored them (its later-chunk scoring),
    and the next forward raised an internal consistency error even at r = 0."""
    model = tiny_model("llama")
    ids = prompt(1, 12).repeat(1, 4)  # (a repeated text: prompt lookup finds drafts in it)
    with pytest.raises(ValueError, match="assisted or prompt-lookup decoding crops rejected draft tokens"):
        with KVzipPress(0.0)(model, tokenizer=_Tokenizer()):
            model.generate(ids, max_new_tokens=20, do_sample=False, prompt_lookup_num_tokens=3, pad_token_id=0)


def test_a_left_padded_batch_is_refused_naming_its_padding():
    """The refusal read 'layer 0 holds 39 of 39 tokens', which names nothing wrong."""
    model = tiny_model("llama")
    ids, mask = left_padded([prompt(1, 40)[0], prompt(1, 20, seed=2)[0]])
    with pytest.raises(ValueError, match="its rows are left-padded: give KVzip one prompt"):
        with KVzipPress(0.5)(model, tokenizer=_Tokenizer()):
            model(ids, attention_mask=mask, cache=DynamicCache(config=model.config))


def test_a_prompt_repeated_in_a_batch_splits_its_layers_as_alone():
    """Beams and num_return_sequences prefill one prompt in several rows: the global top-k counted one row's budget
    over every row's scores, so the layers split otherwise than alone (logits 0.06 apart)."""
    model = tiny_model("llama", num_hidden_layers=4)
    ids = prompt(1, 60)
    held = {}
    for rows in (1, 3):
        recording = record_prefill(model, ids.repeat(rows, 1))
        cache = compress_recording(model, recording, KVzipPress(0.5, global_budget=1.0, window_size=0), _Tokenizer())
        held[rows] = [layer.n for layer in cache.layers]
    assert held[3] == held[1] and len(set(held[1])) > 1


def test_global_budget_spreads_over_the_full_attention_layers_alone():
    """A sliding layer holds its window alone: given a larger share it could not use it, while each full-attention
    layer's share multiplied the whole context's budget (a 3-layer Gemma 3 kept 216 tokens for 108). The
    full-attention layers share theirs; each sliding layer keeps its even share of its window."""
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention", "full_attention"]
    model = tiny_model("gemma3", num_hidden_layers=5, layer_types=types)
    recording = record_prefill(model, prompt(1, 60))
    even = compress_recording(model, recording, KVzipPress(0.5, global_budget=0.0, window_size=0), _Tokenizer())
    spread = compress_recording(model, recording, KVzipPress(0.5, global_budget=1.0, window_size=0), _Tokenizer())
    evens, spreads = [layer.n for layer in even.layers], [layer.n for layer in spread.layers]
    full = [i for i, kind in enumerate(types) if kind == "full_attention"]
    assert [spreads[i] for i in (0, 2)] == [evens[i] for i in (0, 2)] == [4, 4]  # half of the 7 a window holds
    assert len({spreads[i] for i in full}) > 1 and abs(sum(spreads[i] for i in full) - 90) <= 3  # 3 x 30 (floors)


def test_normalize_layers_spreads_the_budget_by_each_heads_shape_not_its_scale():
    model = tiny_model("llama", num_hidden_layers=4)
    ids = prompt(1, 60)
    recording = record_prefill(model, ids)

    def held(normalize_layers: bool) -> list[int]:
        press = KVzipPress(0.5, global_budget=1.0, window_size=0, normalize_layers=normalize_layers)
        return [layer.n for layer in compress_recording(model, recording, press, _Tokenizer()).layers]

    scaled, raw = held(True), held(False)
    scores = next(iter(recording.memo.values()))
    peaked = torch.cat([(s / s.amax(-1, keepdim=True)).flatten() for s in scores.values()])
    threshold = peaked.topk(240).values[-1]  # 30 x 2 heads x 4 layers, in units of each head's own peak
    assert scaled == [int((s / s.amax(-1, keepdim=True) >= threshold).sum()) // 2 for s in scores.values()]
    assert scaled != raw
    scores[1] = scores[1] * 1000  # layer 1 louder: raw ranking hands it the budget, the scaled one does not move
    assert held(True) == scaled
    assert held(False)[1] == 60 and raw[1] < 60
    with pytest.raises(ValueError, match="normalize_layers must be true or false"):
        KVzipPress(0.5, normalize_layers="yes")
    with pytest.raises(ValueError, match="needs global_budget > 0"):
        KVzipPress(0.5, normalize_layers=True, global_budget=0.0)


def test_value_norm_weights_each_score_by_its_value():
    model = tiny_model("llama")
    ids = prompt(1, 40)
    recording = record_prefill(model, ids)
    press = KVzipPress(0.5, window_size=0, global_budget=0.0, value_norm=True)
    cache = compress_recording(model, recording, press, _Tokenizer())
    scores = next(iter(recording.memo.values()))
    for idx, layer in enumerate(cache.layers):
        weighted = scores[idx][0] * recording.cache.layers[idx].values[0].norm(dim=-1)  # [Hkv, 40]
        kept = layer.pos[0].sort(dim=-1).values.long()
        assert torch.equal(kept, weighted.topk(20, dim=-1).indices.sort(dim=-1).values)
        assert not torch.equal(kept, scores[idx][0].topk(20, dim=-1).indices.sort(dim=-1).values)
    with pytest.raises(ValueError, match="value_norm must be true or false"):
        KVzipPress(0.5, value_norm="yes")


def test_a_piece_size_that_is_not_a_positive_count_is_refused():
    model = tiny_model("llama", attn="eager")
    ids = prompt(1, 20)
    recording = record_prefill(model, ids)
    for bad in (0, -3, 2.5, True, "whole"):
        with pytest.raises(ValueError, match=r"piece_size must be a positive number of tokens, None .* or .auto., got"):
            reconstruction_scores(model, recording.cache, ids, REPEAT, piece_size=bad)


def test_a_pass_is_one_forward_where_a_tokens_keys_and_values_outweigh_its_activations(monkeypatch):
    """`piece_size="auto"`: the tiny Llama's token holds 2 layers x 2 KV heads x 16 x 2 = 128 values of keys and
    values against 3 x 128 of MLP activations: pieces; with an intermediate size of 32, one forward a pass."""
    monkeypatch.setattr(kvzip, "PIECE", 5)
    for overrides, forwards in (({}, 4 + 6 + 4), ({"intermediate_size": 32}, 3)):  # passes of 19, 27, 19 tokens
        model = tiny_model("llama", attn="eager", **overrides)
        assert kvzip.pass_pieces(model) == (5 if not overrides else None)
        ids = prompt(1, 40)
        recording = record_prefill(model, ids)
        calls = []
        hook = model.register_forward_pre_hook(lambda module, args, calls=calls: calls.append(1))
        try:
            reconstruction_scores(model, recording.cache, ids, REPEAT, chunk_size=16)
        finally:
            hook.remove()
        assert len(calls) == forwards


def test_a_plain_forward_under_a_whole_context_press_returns_what_it_was_asked():
    """A prompt's forward runs as all but its last token, then the press scores and evicts, then the last: a plain
    `model(ids)` gave the last token's logits alone (`[1, 1, V]`); now every token's, the first n - 1 those of no press
    (computed before the eviction), `logits_to_keep` and return_dict=False as asked. What two forwards cannot join is
    refused by name, and a prompt given as embeddings to a press that reads its token ids is refused (raw torch
    errors before)."""
    model = tiny_model("llama")
    ids = prompt(length=40)
    full = model(ids).logits
    press = KVzipPress(compression_ratio=0.5)
    with press(model, tokenizer=_Tokenizer()):
        out = model(ids)
        assert out.logits.shape == full.shape
        torch.testing.assert_close(out.logits[:, :-1], full[:, :-1])
        last = model(ids, logits_to_keep=1).logits
        assert last.shape == (1, 1, full.shape[-1]) and torch.equal(last[:, -1], out.logits[:, -1])
        assert not torch.allclose(last[:, -1], full[:, -1])  # the last token read the compressed cache
        three = model(ids, logits_to_keep=3, return_dict=False)[0]
        torch.testing.assert_close(three, out.logits[:, -3:])
        for name in ("labels", "output_hidden_states", "output_attentions"):
            value = ids if name == "labels" else True
            with pytest.raises(ValueError, match=f"KVzipPress scores a prompt in two forwards .*whose {name} it "
                                                 "cannot join: .*inside frozen\\(\\)"):  # fmt: skip
                model(ids, **{name: value})
        embeds = model.get_input_embeddings()(ids)
        with pytest.raises(ValueError, match="KVzipPress scores a prompt from its token ids .* feed input_ids, not "
                                             "inputs_embeds"):  # fmt: skip
            model(inputs_embeds=embeds)
    with kvpress.SnapKVPress(compression_ratio=0.5, window_size=4)(model):  # a press scoring as tokens are cached: fine
        assert model(inputs_embeds=embeds).logits.shape == full.shape


def test_the_scores_kept_on_the_press_hold_no_more_than_themselves():
    """The scores a KVzip press keeps for later chunks were views of the reconstruction pass's whole buffer (about
    2x them, on the press after generate returned) and its last ids a view of the whole prompt's; the ids fed since
    were kept one tensor a decoding step."""
    model = tiny_model("llama")
    press = _plain(0.5)
    with press(model, tokenizer=_Tokenizer()) as installed:
        model.generate(prompt(1, 200), max_new_tokens=130, do_sample=False, pad_token_id=0)
        scores = press.scores.values() if isinstance(press.scores, dict) else [press.scores]  # (to the block end)
        fed = installed._unscored.ids  # the ids fed since (they were one tensor a step, the first a view of the prompt)
        assert len(fed) < 64 and torch.cat(fed, dim=-1).shape[-1] == 130
        for tensor in [*scores, press._lead, *fed]:
            assert tensor.untyped_storage().nbytes() == tensor.nbytes


def test_a_failed_eviction_leaves_no_scores_on_the_press(monkeypatch):
    """KVzip keeps its scores for a later chunk once it has evicted; an eviction that raised left them on the press
    (no later chunk can follow a torn cache)."""
    import kvpress.engine as engine

    model = tiny_model("llama")
    press = KVzipPress(0.5, window_size=4)

    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(engine, "compress_layers", broken)
    with pytest.raises(KeyError, match="boom"), press(model, tokenizer=_Tokenizer()):
        model(prompt(1, 40))
    assert press.scores is None and press._lead is None
