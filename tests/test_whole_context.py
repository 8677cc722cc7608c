"""Presses that score the whole context (KVzip, Lookahead, SpecAttn, AdaKV over them, the default press) inside
`with press(model, tokenizer=...): model.generate(...)`: scored and evicted at the end of the prefill, before
the first token is decoded, with the same tokens as `kvpress.generate(..., query_aware=True)`."""

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress import AdaKVPress, KVzipPress, LookaheadPress, SnapKVPress, SpecAttnPress
from kvpress.pipeline import split_prompt
from tiny import CONTEXT, QUESTION, prompt

PRESSES = {
    "kvzip": lambda: KVzipPress(0.5, reconstruction_chunk=8, window_size=4),
    "adakv-kvzip": lambda: AdaKVPress(KVzipPress(0.5, window_size=4)),
    "lookahead": lambda: LookaheadPress(0.5, window_size=4, lookahead=3),
    "specattn": lambda: SpecAttnPress(0.5, skip_every=2, window_size=4, lookahead=3),  # the draft skips layer 1
    "default": lambda: kvpress.press_from_name(kvpress.DEFAULT_PRESS, compression_ratio=0.5),
    "default-4bit": lambda: kvpress.press_from_name(kvpress.DEFAULT_PRESS, compression_ratio=0.5, kv_bits=4),
}


def _prompt(tokenizer) -> torch.Tensor:
    return torch.cat(split_prompt(tokenizer, CONTEXT, QUESTION, chat_template=False), dim=-1)


@pytest.mark.parametrize("name", list(PRESSES))
def test_inside_generate_equals_kvpress_generate_query_aware(tokenized, name):
    model, tokenizer = tokenized
    expected = kvpress.generate(model, tokenizer, CONTEXT, QUESTION, press=PRESSES[name](), query_aware=True,
                                chat_template=False, max_new_tokens=8)  # fmt: skip
    ids = _prompt(tokenizer)
    cache = DynamicCache(config=model.config)
    with PRESSES[name]()(model, tokenizer=tokenizer):
        out = model.generate(ids, cache=cache, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip() == expected
    # the prompt but its last token was compressed once; the last token and the answer were appended
    full = ids.shape[1] - 1
    for layer in cache.layers:
        held = sum(layer.lengths) / layer.heads if isinstance(layer, kvpress.HeadwiseLayer) else layer.n
        assert held < full * 0.75 + 8


def test_a_whole_context_press_needs_the_tokenizer_and_does_not_rerotate(tokenized):
    model, tokenizer = tokenized
    with pytest.raises(ValueError, match=r"with press\(model, tokenizer=tokenizer\)"), KVzipPress(0.5)(model):
        pass
    with pytest.raises(ValueError, match="KVzipPress scores the whole context once .* it cannot re-rotate keys"):
        KVzipPress(0.5, rerotate=True)  # (refused as it is built: kvpress.generate said it needed a live prefill)
    assert model.config._attn_implementation == "sdpa"


def test_observers_inside_an_active_press_see_the_forwards_and_nothing_is_evicted(tokenized):
    model, tokenizer = tokenized
    ids = _prompt(tokenizer)
    seen, cache = [], DynamicCache(config=model.config)
    with SnapKVPress(0.5, window_size=4)(model):
        with kvpress.observe(model, lambda obs: seen.append(obs.layer_idx)):
            model(ids, cache=cache)
        assert seen == [0, 1, 2] and all(layer.n == ids.shape[1] for layer in cache.layers)
        model(ids[:, :1], cache=cache)  # eviction resumes after the block
    assert all(layer.n < ids.shape[1] for layer in cache.layers)


def test_a_padded_batch_is_refused_by_a_reconstruction_pass(tokenized):
    model, tokenizer = tokenized
    ids = _prompt(tokenizer).repeat(2, 1)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with pytest.raises(ValueError, match="no padding"), PRESSES["kvzip"]()(model, tokenizer=tokenizer):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("name", ["lookahead"])
def test_a_chunked_prefill_or_a_new_turn_is_refused_and_a_frozen_turn_kept_whole(tokenized, name):
    """Nothing scores tokens fed after the compressed prompt in several-token forwards (the second chunk of
    prefill_chunk_size, a new turn) but KVzip, alone or under AdaKV (tests/test_kvzip_chunks.py): refused by name
    rather than kept whole past the budget; inside frozen() a new turn is kept whole, as asked."""
    model, tokenizer = tokenized
    ids = _prompt(tokenizer)
    cache = DynamicCache(config=model.config)
    with pytest.raises(ValueError, match=r"adds 16 tokens to a cache already holding 16 seen .*prefill_chunk_size"):
        with PRESSES[name]()(model, tokenizer=tokenizer):
            model.generate(ids[:, :32], cache=cache, max_new_tokens=2, do_sample=False, pad_token_id=0,
                           prefill_chunk_size=16)  # fmt: skip
    cache = DynamicCache(config=model.config)
    with PRESSES[name]()(model, tokenizer=tokenizer) as installed:
        model(ids[:, :-8], cache=cache)
        held = [layer.get_seq_length() for layer in cache.layers]
        with installed.frozen():
            model(ids[:, -8:], cache=cache)
        with pytest.raises(ValueError, match="a new turn"):
            model(ids[:, -8:], cache=cache)
    assert model.config._attn_implementation == "sdpa"
    for layer in cache.layers:
        n = sum(layer.lengths) / layer.heads if isinstance(layer, kvpress.HeadwiseLayer) else layer.n
        assert n < ids.shape[1] - 8 and layer.seen == ids.shape[1]  # compressed prompt + the whole frozen turn
    assert held == [ids.shape[1] - 8] * len(held)  # positions count tokens seen


def test_prefills_that_only_fill_a_cache_compute_no_logits_but_the_last():
    """A recorded prefill and `prefill_context` want the cache: the output head runs on one position, not all
    (a 4K prompt's logits are 0.8 GB on SmolLM2, 2.5 GB on Qwen2.5)."""
    from kvpress.pipeline import prefill_context
    from kvpress.recording import record_prefill
    from tiny import prompt, tiny_model

    model = tiny_model("llama")
    rows = []
    handle = model.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[1]))
    try:
        record_prefill(model, prompt(1, 30))
        prefill_context(model, prompt(1, 30), SnapKVPress(0.5), DynamicCache(config=model.config))
    finally:
        handle.remove()
    assert rows == [1, 1]


def _held_tensors(press, path: str = "press") -> list[str]:
    """Where `press` (and any press it wraps) holds a tensor: its fields, through dicts, lists and tuples."""
    found = []

    def walk(value, where):
        if isinstance(value, torch.Tensor):
            found.append(where)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{where}[{key!r}]")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{where}[{i}]")
        elif isinstance(value, kvpress.BasePress):
            found.extend(_held_tensors(value, where))

    for name, value in vars(press).items():
        walk(value, f"{path}.{name}")
    return found


@pytest.mark.parametrize("name", [*PRESSES, "shotkv"])
def test_a_press_forgets_the_prompt_it_scored(tokenized, name):
    """A press that scores the whole prompt kept its scores (KVzip), draft (Lookahead, SpecAttn) or shots (ShotKV),
    O(prompt) tensors, on the press after the block, and through the decode (an audit found them held): they go
    once it has evicted, or as the block ends where later chunks are scored by them (KVzip)."""
    from kvpress.recording import compress_recording, record_prefill

    model, tokenizer = tokenized
    press = (kvpress.press_from_name("shotkv", compression_ratio=0.5, window_size=4) if name == "shotkv"
             else PRESSES[name]())  # fmt: skip
    ids = tokenizer(f"Question: {CONTEXT}\n\nQuestion: {QUESTION}", return_tensors="pt").input_ids
    later_chunks = press.scores_later_chunks
    with press(model, tokenizer=tokenizer):
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        held = _held_tensors(press)
        assert bool(held) == later_chunks, held  # (KVzip scores a later chunk by them: kept to the block's end)
    assert _held_tensors(press) == []
    recording = record_prefill(model, ids[:, :-1], next_ids=ids[:, -1:], keep_hidden=press.needs_hidden)
    compress_recording(model, recording, press, tokenizer)
    assert _held_tensors(press) == []


@pytest.mark.parametrize("name", kvpress.presses.press_names())
def test_a_press_pickles_fresh_and_used(tokenized, name):
    """Presses keep weak tables by attention module (KVzap, NAtS, ExpectedAttention, DuoAttention) and KVzip a weak
    reference to the cache it scored: pickling raised on them (an audit); they are left out and come back empty,
    and a loaded press compresses as the press it was pickled from."""
    import pickle

    from tiny import tiny_pattern

    model, tokenizer = tokenized
    allowed = kvpress.press_parameters(name)  # a window below the 40-token context's budget: a press that compresses
    own = {key: 8 for key in ("window_size", "window")
           if key in allowed and key not in kvpress.press_class(name).budget_parameters}  # (sink-window's: its budget)
    own |= {"head_pattern": tiny_pattern(model)} if name == "duo-attention" else {}  # (none is packaged for it)
    press = kvpress.press_from_name(name, compression_ratio=0.5, **own)
    run = lambda p: kvpress.generate(model, tokenizer, f"Question: {CONTEXT}", f"Question: {QUESTION}",  # noqa: E731
                                     press=p, query_aware=True, chat_template=False, max_new_tokens=4)  # fmt: skip
    fresh = pickle.loads(pickle.dumps(press))
    answer = run(press)
    assert run(fresh) == answer and run(pickle.loads(pickle.dumps(press))) == answer  # (pickled after a run)
    assert repr(fresh) == repr(press)


def test_a_block_ending_in_another_thread_leaves_a_draft_being_evicted_by():
    """One Lookahead press on two models: a block of the second ends (it scored nothing) while the first's eviction
    is between two layers. The end forgot the press's draft outside the scoring lock, and the first raised at its
    next layer (a review of stop 80)."""
    import threading

    from tiny import tiny_model

    models = tiny_model("llama"), tiny_model("qwen2")
    press = kvpress.press_from_name("lookahead", compression_ratio=0.5, window_size=4)
    scoring, ended, errors = threading.Event(), threading.Event(), []
    real = press.score

    def score(obs):
        if obs.layer_idx == 1 and not scoring.is_set():
            scoring.set()
            ended.wait(2)  # (the other block ends meanwhile, or waits for this eviction to end)
        return real(obs)

    press.score = score
    ender = type("Ender", (), {"eos_token_id": None})()

    def first():
        try:
            with torch.inference_mode(), press(models[0], tokenizer=ender):
                models[0].generate(prompt(1, 40, seed=1), max_new_tokens=3, do_sample=False, pad_token_id=0)
        except Exception as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    thread = threading.Thread(target=first)
    thread.start()
    scoring.wait(10)
    with press(models[1], tokenizer=ender):
        pass
    ended.set()
    thread.join()
    assert errors == []


def test_lookahead_runs_on_a_model_with_sliding_window_layers_past_the_window():
    """Its check that the layer holds the whole prompt took every slot seen; a sliding-window layer holds its
    window alone (a review of stop 80: Mistral's and Gemma 3's refused a 40-token prompt)."""
    from tiny import tiny_model

    for family in ("mistral-window", "gemma3"):
        model = tiny_model(family)
        press = kvpress.press_from_name("lookahead", compression_ratio=0.5, window_size=4)
        with press(model, tokenizer=type("Ender", (), {"eos_token_id": None})()):
            out = model.generate(prompt(1, 40, seed=1), max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert out.shape[1] == 44

