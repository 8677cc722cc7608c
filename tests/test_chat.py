"""ChatSession: the history is encoded once, each turn feeds only its new tokens."""

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

import kvpress


@pytest.fixture(scope="module")
def default_model():
    return kvpress.load_model()


def _fed(model):
    fed = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["input_ids"].shape[1]), with_kwargs=True)
    return fed, hook


def test_turns_feed_only_new_tokens_and_match_a_full_reencode(default_model):
    model, tokenizer = default_model
    session = kvpress.ChatSession(model, tokenizer, max_new_tokens=12)
    session.send("My name is Ada. Say hello.")
    fed, hook = _fed(model)
    try:
        answer = session.send("What is my name?")
    finally:
        hook.remove()
    history = tokenizer.apply_chat_template(session.messages[:-1], add_generation_prompt=True, tokenize=False)
    full = tokenizer(history, add_special_tokens=False, return_tensors="pt").input_ids
    assert fed[0] < 30 < full.shape[1]  # the second turn fed its own tokens only
    reference = model.generate(full, max_new_tokens=12, do_sample=False)
    assert answer == tokenizer.decode(reference[0, full.shape[1] :], skip_special_tokens=True)
    assert [r.start for r in session.rounds] == [0, session.rounds[0].end]
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]


def _state(session):
    return (list(session.messages), list(session.rounds), session.cache.get_seq_length())


def test_errors_leave_the_session_unchanged(default_model):
    model, tokenizer = default_model
    session = kvpress.ChatSession(model, tokenizer, max_new_tokens=4)
    session.send("Hello.")
    before = _state(session)
    with pytest.raises(ValueError, match="the message is empty"):
        session.send("   ")
    with pytest.raises(ValueError, match=r"past the model's 8192 positions"):
        session.send("Tell me a story.", max_new_tokens=9000)
    session.press = kvpress.KVzipPress(compression_ratio=0.5)  # set between turns: checked at the next send
    with pytest.raises(ValueError, match="KVzipPress compresses the first prompt of a cache.*a chat's later turns"):
        session.send("Tell me a story.")
    session.press = None
    assert _state(session) == before
    with pytest.raises(TypeError, match="press must be a kvpress press"):
        kvpress.ChatSession(model, tokenizer, press="snapkv")
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer, got True"):
        kvpress.ChatSession(model, tokenizer, max_new_tokens=True)
    with pytest.raises(ValueError, match="LookaheadPress compresses the first prompt of a cache"):
        kvpress.ChatSession(model, tokenizer, press=kvpress.press_from_name("lookahead", compression_ratio=0.5))


class _Collect(BaseStreamer):
    def __init__(self):
        self.tokens = []

    def put(self, value):
        self.tokens.extend(torch.as_tensor(value).flatten().tolist())

    def end(self):
        self.tokens.append("end")


def test_streaming_and_a_bounded_cache(default_model):
    model, tokenizer = default_model
    press = kvpress.SinkWindowPress(n_sink=4, window=60, rerotate=True)
    session = kvpress.ChatSession(model, tokenizer, press=press, max_new_tokens=8, system="Be brief.")
    streamer = _Collect()
    for text in ["Hi there.", "What is two plus two?", "And three plus three?"]:
        session.send(text, streamer=streamer)
    assert streamer.tokens[-1] == "end" and len(streamer.tokens) > 8
    assert all(layer.n <= 64 for layer in session.cache.layers)
    assert session.messages[0] == {"role": "system", "content": "Be brief."}
    assert len(session.rounds) == 3


def _send_failing(model, session, text: str, at_call: int) -> None:
    """`session.send(text)` with layer 5 raising at its `at_call`-th forward (mid-turn)."""
    calls = []

    def fail(module, args, output):
        calls.append(1)
        if len(calls) == at_call:
            raise RuntimeError("boom")

    hook = model.model.layers[5].register_forward_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            session.send(text)
    finally:
        hook.remove()


def test_a_model_error_mid_turn_leaves_a_full_cache_session_unchanged(default_model):
    model, tokenizer = default_model
    session = kvpress.ChatSession(model, tokenizer, max_new_tokens=4)
    session.send("Hello.", reply="Hi!")
    before = _state(session)
    _send_failing(model, session, "What did I say?", at_call=3)
    assert _state(session) == before
    reference = kvpress.ChatSession(model, tokenizer, max_new_tokens=4)
    reference.send("Hello.", reply="Hi!")
    assert session.send("What did I say?") == reference.send("What did I say?")


def test_a_model_error_mid_turn_with_a_press_stops_the_session(default_model):
    model, tokenizer = default_model
    session = kvpress.ChatSession(model, tokenizer, press=kvpress.SinkWindowPress(max_tokens=40), max_new_tokens=4)
    session.send("Hello.", reply="Hi!")
    _send_failing(model, session, "What did I say?", at_call=1)
    with pytest.raises(RuntimeError, match="interrupted mid-turn .*boom.*start a new one"):
        session.send("Hello again.")
