"""KVzip chunk by chunk: each later forward of several tokens (a chunk of a chunked prefill, a new turn) is
scored by a reconstruction pass over the cache compressed so far, and the budget of every token seen holds."""

import contextvars
import threading
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress import AdaKVPress, KVzipPress, engine
from kvpress.patches.head_cache import HeadwiseLayer
from kvpress.pipeline import prefill_context
from kvpress.presses.kvzip import LEAD_IN
from tiny import prompt, tiny_model

REPEAT = torch.tensor([[5, 6, 7]])


class _Tokenizer:
    """Stands in for a tokenizer: every repeat request is the tokens 5, 6, 7."""

    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        return SimpleNamespace(input_ids=REPEAT.clone())


def _peaks(model, context: torch.Tensor, fed: torch.Tensor) -> dict[int, torch.Tensor]:
    """Per layer `[1, Hkv, n]`: the largest attention any token of `fed` pays each of `context`'s n tokens (over
    the query heads of a KV group), from the model's own attention over `context` then `fed`, no cache."""
    n, hkv = context.shape[1], model.config.num_key_value_heads
    attentions = model(torch.cat([context, fed], dim=-1), output_attentions=True).attentions
    return {idx: a[:, :, n:, :n].amax(dim=2).view(1, hkv, -1, n).amax(dim=2) for idx, a in enumerate(attentions)}


def test_a_later_chunk_is_rebuilt_after_its_lead_in_and_each_token_keeps_its_best_score():
    """Nothing evicted (r = 0), so the scores can be read off the model's plain attention: the first chunk but its
    last token is rebuilt over itself; the second forward rebuilds that last token and its own tokens but its last,
    after the request and the LEAD_IN ids before them, over everything seen; a token keeps its larger score."""
    model = tiny_model("llama", attn="eager")
    ids = prompt(1, 32)
    press = KVzipPress(0.0, window_size=0, global_budget=0.0, reconstruction_chunk=64)
    cache = DynamicCache(config=model.config)
    with press(model, tokenizer=_Tokenizer()):
        model(ids[:, :16], cache=cache)
        first = {idx: s.clone() for idx, s in press.scores.items()}
        model(ids[:, 16:], cache=cache)
        scored = press.scores  # (the press forgets them as the block ends)
    expected_first = _peaks(model, ids[:, :15], torch.cat([REPEAT, ids[:, :15]], dim=-1))
    again = _peaks(model, ids[:, :31], torch.cat([REPEAT, ids[:, 15 - LEAD_IN : 15], ids[:, 15:31]], dim=-1))
    for idx, scores in scored.items():
        torch.testing.assert_close(first[idx], expected_first[idx], atol=1e-5, rtol=1e-4)
        expected = again[idx].clone()
        expected[..., :15] = torch.maximum(expected[..., :15], expected_first[idx])
        torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-4)
    assert all(layer.n == layer.seen == 32 for layer in cache.layers)


@pytest.mark.parametrize("family", ["llama", "mistral-window"])  # mistral-window: 16-token windows
def test_every_chunk_is_compressed_to_the_budget_of_every_token_seen_keeping_the_top_scores(family):
    """r = 0.5, no window, no sinks, even layers: after each forward of 16 tokens a full-attention layer holds the
    budget of the tokens scored (all seen but the forward's last) plus that last token, and what it holds are the
    best-scored of those tokens; a frozen turn is kept whole, then scored with the next turn."""
    model = tiny_model(family)
    ids = prompt(1, 64)
    press = KVzipPress(0.5, window_size=0, global_budget=0.0, reconstruction_chunk=8)
    cache = DynamicCache(config=model.config)
    with press(model, tokenizer=_Tokenizer()) as installed:
        for start in (0, 16, 32):
            model(ids[:, start : start + 16], cache=cache)
            seen = start + 16
            for idx, scores in press.scores.items():
                layer = cache.layers[idx]
                assert layer.seen == seen and scores.shape[-1] == seen - 1
                if layer.window is not None:
                    continue  # keeps what its window holds, within the same budget
                budget = press.budget_of(seen - 1)
                assert layer.n == budget + 1 and int(layer.pos[0, 0, -1]) == seen - 1  # the forward's last token
                held = layer.pos[0, :, :-1].long().sort(dim=-1).values
                best = scores[0].topk(budget, dim=-1).indices.sort(dim=-1).values
                assert torch.equal(held, best)
        with installed.frozen():
            model(ids[:, 48:56], cache=cache)
        assert all(layer.seen == 56 for layer in cache.layers)
        whole = [layer.n for layer in cache.layers]
        model(ids[:, 56:], cache=cache)  # the frozen turn's tokens are scored with this one
        for idx, scores in press.scores.items():
            layer = cache.layers[idx]
            assert scores.shape[-1] == 63 and layer.seen == 64
            if layer.window is None:
                assert layer.n == press.budget_of(63) + 1 < whole[idx] + 8
    assert press.scores is None  # (forgotten as the block ends: no later chunk can follow outside it)


def test_inside_generate_with_prefill_chunk_size_and_in_kvpress_generate(tokenized):
    """transformers' `prefill_chunk_size` inside model.generate and `kvpress.generate(..., prefill_chunk_size=)`:
    every chunk is scored, the cache ends near the budget of the whole prompt; a chunk as long as the prompt is
    the one-forward compression."""
    model, tokenizer = tokenized
    ids = prompt(1, 64)
    outputs, caches = {}, {}
    press = KVzipPress(0.5, reconstruction_chunk=16, window_size=4, global_budget=0.0)
    for chunk in (16, 64, None):
        cache = DynamicCache(config=model.config)
        with press(model, tokenizer=tokenizer):
            out = model.generate(ids, cache=cache, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                 pad_token_id=0, prefill_chunk_size=chunk)  # fmt: skip
        outputs[chunk], caches[chunk] = out[0, 64:], cache
    for layer in caches[16].layers:  # the budget of the prompt but its last token, that token, 3 generated
        assert layer.seen == 64 + 3 and layer.n == press.budget_of(63) + 1 + 3
    assert torch.equal(outputs[64], outputs[None])
    for one, whole in zip(caches[64].layers, caches[None].layers, strict=True):
        assert torch.equal(one.pos, whole.pos)
    text = kvpress.generate(model, tokenizer, "a b c d e f g h " * 8, "what?", press=KVzipPress(0.5, window_size=4),
                            chat_template=False, max_new_tokens=3, prefill_chunk_size=16)  # fmt: skip
    assert isinstance(text, str)
    cache = DynamicCache(config=model.config)
    prefill_context(model, ids, press, cache, tokenizer, prefill_chunk_size=16)
    assert all(layer.seen == 64 and layer.n == press.budget_of(63) + 1 for layer in cache.layers)


def test_adakv_over_kvzip_scores_every_chunk_and_spreads_each_layers_budget_over_its_heads(tokenized):
    """AdaKV over KVzip chunk by chunk: each later forward is scored by KVzip's pass over the head-wise layers
    (read padded) and each layer keeps the budget of every token seen, spread over its heads by a global top-k of
    those scores (no safeguard), plus the forward's last token in every head; inside model.generate, a chunk as
    long as the prompt is the one-forward compression. The forwards run with autograd on, as a user may call them
    (the pass copies the head-wise layers it appends to)."""
    model = tiny_model("llama")
    heads = model.config.num_key_value_heads
    ids = prompt(1, 64)
    press = AdaKVPress(KVzipPress(0.5, window_size=0, global_budget=0.0, reconstruction_chunk=8), alpha_safeguard=0.0)
    cache = DynamicCache(config=model.config)
    with press(model, tokenizer=_Tokenizer()) as installed:
        for start in (0, 16, 32, 56):
            if start == 56:  # a turn read frozen is kept whole, then scored with the next one
                with installed.frozen():
                    model(ids[:, 48:56], cache=cache)
                assert all(sum(layer.lengths) == heads * (press.budget_of(47) + 1 + 8) for layer in cache.layers)
            model(ids[:, start : start + 16], cache=cache)
            seen = min(start + 16, 64)
            budget = press.budget_of(seen - 1)
            for idx, scores in press.press.scores.items():
                layer = cache.layers[idx]
                assert isinstance(layer, HeadwiseLayer) and layer.seen == seen and scores.shape == (1, heads, seen - 1)
                held = [layer.slot("pos", 0, h).long() for h in range(heads)]
                assert all(int(pos[-1]) == seen - 1 for pos in held)  # the forward's last token, in every head
                kept = {(h, int(p)) for h, pos in enumerate(held) for p in pos[:-1]}
                best = scores[0].flatten().topk(heads * budget).indices
                assert kept == {(int(i) // (seen - 1), int(i) % (seen - 1)) for i in best}
    model, tokenizer = tokenized
    caches = {}
    for chunk in (16, 64, None):
        caches[chunk] = DynamicCache(config=model.config)
        with AdaKVPress(KVzipPress(0.5, window_size=4))(model, tokenizer=tokenizer), torch.no_grad():
            model.generate(ids, cache=caches[chunk], max_new_tokens=3, do_sample=False, pad_token_id=0,
                           prefill_chunk_size=chunk)  # fmt: skip
    for one, whole in zip(caches[64].layers, caches[None].layers, strict=True):
        assert one.lengths == whole.lengths and torch.equal(one.store["pos"], whole.store["pos"])
    assert all(layer.seen == 66 and sum(layer.lengths) < 2 * heads * 33 for layer in caches[16].layers)
    text = kvpress.generate(model, tokenizer, "a b c d e f g h " * 8, "what?", press=AdaKVPress(KVzipPress(0.5)),
                            chat_template=False, max_new_tokens=3, prefill_chunk_size=16)  # fmt: skip
    assert isinstance(text, str)


@pytest.mark.parametrize("adakv", [False, True])
def test_a_live_prefill_keeps_no_queries_for_a_press_that_scores_from_its_pass(tokenized, monkeypatch, adakv):
    """KVzip (alone or under AdaKV) reads no queries: a live prefill keeps only their shape (no values, no memory),
    in one forward and chunk by chunk (KVzip alone), and compresses to the very slots it keeps when the queries are
    kept."""
    model, tokenizer = tokenized
    ids = prompt(1, 48)
    kept = []

    def make():
        return AdaKVPress(KVzipPress(0.5, window_size=4)) if adakv else KVzipPress(0.5, window_size=4)

    class Spy(engine.QueryRecorder):
        def __call__(self, obs):
            super().__call__(obs)
            kept.append(self.queries[obs.layer_idx][1])

    def run(chunk):
        cache = DynamicCache(config=model.config)
        with make()(model, tokenizer=tokenizer):
            model.generate(ids, cache=cache, max_new_tokens=2, do_sample=False, pad_token_id=0,
                           prefill_chunk_size=chunk)  # fmt: skip
        return [[layer.slot("pos", 0, h).clone() for h in range(layer.heads)] if isinstance(layer, HeadwiseLayer)
                else [layer.pos.clone()] for layer in cache.layers]  # fmt: skip

    monkeypatch.setattr(engine, "QueryRecorder", Spy)
    light = {chunk: run(chunk) for chunk in ((None,) if make().refuses_chunks else (16, None))}
    assert kept and all(q.stride(2) == 0 and q.isnan().all() and q.shape[2] >= 15 for q in kept)
    monkeypatch.setattr(KVzipPress, "reads_queries", True)
    kept.clear()
    for chunk, held in light.items():
        assert all(torch.equal(a, b) for x, y in zip(run(chunk), held, strict=True) for a, b in zip(x, y, strict=True))
    assert kept and all(q.stride(2) != 0 and not q.isnan().any() for q in kept)


def test_what_cannot_be_scored_later_is_refused(tokenized):
    """A press that scores the whole prompt and no later chunk (Lookahead, under AdaKV) refuses a later chunk;
    KVzip refuses one after embeddings were fed, or on a cache it did not compress in this block."""
    model, tokenizer = tokenized
    ids = prompt(1, 48)
    refused = r"AdaKVPress over LookaheadPress compresses the first prompt .* adds 16 tokens.* use KVzipPress \("
    with pytest.raises(ValueError, match=refused):
        with AdaKVPress(kvpress.press_from_name("lookahead", compression_ratio=0.5))(model, tokenizer=tokenizer):
            model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0, prefill_chunk_size=16)
    press = KVzipPress(0.5, window_size=4)
    cache = DynamicCache(config=model.config)
    with press(model, tokenizer=tokenizer):
        model(ids[:, :16], cache=cache)
        model(inputs_embeds=model.get_input_embeddings()(ids[:, 16:17]), cache=cache)
        refused = "a cache it did not compress in this block, or not last .*, or one fed embeddings"
        with pytest.raises(ValueError, match=refused):
            model(ids[:, 17:33], cache=cache)
    with press(model, tokenizer=tokenizer):
        with pytest.raises(ValueError, match="a cache it did not compress in this block"):
            model(ids[:, 17:33], cache=cache)  # compressed in the block before
        first, second = DynamicCache(config=model.config), DynamicCache(config=model.config)
        model(ids[:, :16], cache=first)
        model(ids[:, :16], cache=second)  # the press scored another cache since
        with pytest.raises(ValueError, match="a cache it did not compress in this block"):
            model(ids[:, 16:32], cache=first)
    with pytest.raises(ValueError, match="feed input_ids, not inputs_embeds"):
        with press(model, tokenizer=tokenizer):
            cache = DynamicCache(config=model.config)
            model(ids[:, :16], cache=cache)
            model(inputs_embeds=model.get_input_embeddings()(ids[:, 16:32]), cache=cache)
    assert model.config._attn_implementation == "sdpa"


def test_a_chunk_is_refused_once_another_thread_scored_its_prompt_meanwhile(monkeypatch):
    """The press keeps the ids it last scored (KVzip's lead-in) for the next chunk: a chunk whose first part ran
    while another thread's prompt was scored is refused, where it would be scored after the other's lead-in."""
    model = tiny_model("llama")
    ids = prompt(1, 48)
    first, second = DynamicCache(config=model.config), DynamicCache(config=model.config)
    ready, go, done, calls = threading.Event(), threading.Event(), threading.Event(), []

    def other_caller() -> None:
        try:
            with torch.inference_mode():  # (a thread starts outside the tests' inference mode)
                model(ids[:, :16], cache=DynamicCache(config=model.config))  # its state made while the caller evicts
                ready.set()
                go.wait(timeout=60)
                model(prompt(1, 20, seed=3), cache=second)  # another prompt: its lead-in is not the caller's
        finally:
            ready.set()
            done.set()

    class ScoringElsewhere(engine.QueryRecorder):  # the chunk's first part: the other thread scores its prompt
        def __call__(self, obs):
            if calls == ["chunk"]:
                calls.append("other")
                go.set()
                done.wait(timeout=60)
            return super().__call__(obs)

    with KVzipPress(0.5, window_size=4)(model, tokenizer=_Tokenizer()):
        other = threading.Thread(target=contextvars.copy_context().run, args=(other_caller,))
        other.start()
        ready.wait(timeout=60)
        model(ids[:, :16], cache=first)
        monkeypatch.setattr(engine, "QueryRecorder", ScoringElsewhere)
        calls.append("chunk")
        try:
            with pytest.raises(ValueError, match="another generation's prompt was scored meanwhile"):
                model(ids[:, 16:32], cache=first)
        finally:
            go.set()
            other.join()
    assert calls == ["chunk", "other"] and second.layers[0].n < 20  # the other thread's prompt was compressed
    with pytest.raises(RuntimeError, match="left half-updated"):  # the refused chunk's first part stays unscored
        model(ids[:, 32:33], cache=first)


def test_a_press_shared_by_two_models_refuses_a_chunk_after_scoring_the_other():
    """KVzip keeps the scores and last ids of the cache it scored last for that cache's next chunk: once the same
    press object scored a cache on another model, the first cache's next chunk is refused, not scored by them."""
    models = tiny_model("llama"), tiny_model("qwen2")
    press = KVzipPress(0.5, window_size=4)
    ids = prompt(1, 48)
    first = DynamicCache(config=models[0].config)
    with press(models[0], tokenizer=_Tokenizer()):
        models[0](ids[:, :16], cache=first)
        with press(models[1], tokenizer=_Tokenizer()):
            pass  # (a block that scored nothing forgets nothing: the first cache's scores stay for its next chunk)
        models[0](ids[:, 16:24], cache=first)
        with press(models[1], tokenizer=_Tokenizer()):
            models[1](prompt(1, 24, seed=3), cache=DynamicCache(config=models[1].config))  # as long: no shape tells
        with pytest.raises(ValueError, match="it has scored another since, or forgot them as that block ended"):
            models[0](ids[:, 24:40], cache=first)
    with pytest.raises(RuntimeError, match="left half-updated"):
        models[0](ids[:, 40:41], cache=first)


def test_a_chunk_stopped_after_its_first_part_leaves_its_cache_torn(monkeypatch):
    """Stopped between the chunk's first part and its scoring (waiting its turn, say), the cache holds tokens nothing
    scored, over the budget: it is marked torn. A forward refused before it fed anything leaves the cache usable."""
    model = tiny_model("llama")
    ids = prompt(1, 48)
    press = KVzipPress(0.5, window_size=4)

    class Interrupted:
        def __enter__(self):
            raise KeyboardInterrupt

        def __exit__(self, *exc):
            return False

    with press(model, tokenizer=_Tokenizer()):
        cache = DynamicCache(config=model.config)
        model(ids[:, :16], cache=cache)
        with pytest.raises(ValueError, match="feed input_ids"):  # refused before any layer ran: still usable
            model(inputs_embeds=model.get_input_embeddings()(ids[:, 16:32]), cache=cache)
        model(ids[:, 16:32], cache=cache)
        monkeypatch.setattr(engine, "SCORING", Interrupted())
        with pytest.raises(KeyboardInterrupt):
            model(ids[:, 32:40], cache=cache)
        monkeypatch.undo()  # (the block's end takes the lock too, to forget the scores)
    with pytest.raises(RuntimeError, match="left half-updated"):
        model(ids[:, 40:41], cache=cache)
