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
    with pytest.raises(TypeError, match="the message is a string .*, got list"):  # ('the message is empty' before)
        session.send([{"role": "user", "content": "Hello."}])
    with pytest.raises(TypeError, match="the reply is a string .*, got int"):
        session.send("Hello.", reply=5)
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


def _forcing(model, token: int, at_step: int):
    """A hook making the `at_step`-th forward's logits pick `token` (0: the first)."""
    calls = []

    def force(module, args, output):
        calls.append(1)
        if len(calls) == at_step + 1:
            output[..., token] += 1000.0
        return output

    return model.lm_head.register_forward_hook(force)


def test_an_answer_ending_on_a_stop_token_the_template_does_not_write_goes_on(tokenized):
    """Qwen2.5 may stop on <|endoftext|> where its template closes a turn with <|im_end|>: that stop token is
    left unfed and the template's end of turn follows, as after a recorded reply."""
    model, tokenizer = tokenized
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [eos, endoftext]
    hook = _forcing(model, endoftext, at_step=2)
    try:
        session = kvpress.ChatSession(model, tokenizer, max_new_tokens=6)
        answer = session.send("Hello there.")
    finally:
        hook.remove()
        model.generation_config.eos_token_id = eos
    assert len(tokenizer(answer, add_special_tokens=False).input_ids) == 2 and "<|endoftext|>" not in answer
    reference = kvpress.ChatSession(model, tokenizer, max_new_tokens=6)
    reference.send("Hello there.", reply=answer)
    assert session.send("And then?") == reference.send("And then?")
    assert session.cache.get_seq_length() == reference.cache.get_seq_length()


def test_an_answer_the_template_cannot_write_back_is_kept_and_said_at_once(tokenized):
    model, tokenizer = tokenized
    hook = _forcing(model, tokenizer.convert_tokens_to_ids("<|endoftext|>"), at_step=0)  # a special token inside
    try:
        session = kvpress.ChatSession(model, tokenizer, max_new_tokens=4)
        with pytest.warns(UserWarning, match="not what the chat template writes for it"):
            answer = session.send("Hello there.")
    finally:
        hook.remove()
    assert session.messages[-1] == {"role": "assistant", "content": answer} and answer
    with pytest.raises(RuntimeError, match="cannot go on .*not what the chat template writes.*start a new one"):
        session.send("And then?")


def test_a_model_error_on_a_sliding_window_layer_past_its_window_stops_the_session():
    """A sliding-window layer past its window keeps no earlier tokens to crop back to: the session stops."""
    from transformers import AutoTokenizer

    from kvpress.models import resolve_model_path
    from tiny import tiny_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(), local_files_only=True)
    model = tiny_model("gemma3", vocab_size=len(tokenizer))  # window 8
    session = kvpress.ChatSession(model, tokenizer, max_new_tokens=4)
    session.send("Hello there, this is a first message.", reply="Hi!")
    calls = []

    def fail(module, args, output):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")

    hook = model.model.layers[2].register_forward_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="boom"):  # the model's error, not the crop's
            session.send("What did I say?")
    finally:
        hook.remove()
    with pytest.raises(RuntimeError, match="interrupted mid-turn by RuntimeError: boom; the cache could not be crop"):
        session.send("Again?")
