"""A RoundPolicy in a ChatSession: whole rounds selected, offloaded to a store, recalled, compressed once."""

import copy

import pytest
import torch

import kvpress
from kvpress.patches.cache import SPARE, SPARE_MIN, PressedLayer

TURNS = [
    ("My locker code is 48213. Please remember it.", "Sure, I will remember your locker code."),
    ("I went hiking last weekend in the mountains.", "That sounds lovely, how was the weather?"),
    ("It rained a lot but we had fun anyway.", "Rain can make a hike memorable."),
    ("My sister is visiting next month.", "How nice, what are you planning to do?"),
]


@pytest.fixture(scope="module")
def default_model():
    return kvpress.load_model()


def _positions(layer: PressedLayer) -> set[int]:
    return set(layer.pos[0, 0].tolist())


def _expected(session, press, span_of_turn) -> set[int]:
    """Prefix + selected rounds + the recent round + the current turn, as positions."""
    rounds = session.rounds[:-1]  # the finished rounds when the last turn began
    keep = set(range(session.prefix_tokens))
    for r in [*press.selected, len(rounds) - 1]:
        keep |= set(range(max(rounds[r].start, session.prefix_tokens), rounds[r].end))
    return keep | set(range(*span_of_turn))


def test_working_cache_holds_only_the_selected_rounds(default_model):
    model, tokenizer = default_model
    press = kvpress.RoundPress(top_k_rounds=1, keep_recent_rounds=1, watershed_layer=15)
    session = kvpress.ChatSession(model, tokenizer, round_policy=press, max_new_tokens=6)
    for user, reply in TURNS:
        assert session.send(user, reply=reply) == reply
    fed = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        session.send("What is my locker code?")
    finally:
        hook.remove()
    assert fed[0] < 25 and all(q == 1 for q in fed[1:])  # the history is never re-encoded
    assert len(press.selected) == 1 and press.selected[0] < len(TURNS) - 1
    last = session.rounds[-1]
    expected = _expected(session, press, (last.start, last.end))
    layers = session.cache.layers
    assert all(_positions(layer) == expected for layer in layers[16:])  # after the watershed: the selection
    assert all(_positions(layer) == set(range(last.end)) for layer in layers[:16])  # up to it: everything
    config = model.config
    slot_bytes = config.num_key_value_heads * (2 * config.head_dim * 4 + 4)  # fp32 keys + values, int32 position
    row_counters = 2 * 8 * len(layers)  # real_seen and shift, int64 per row
    capacity = [layer.keys.shape[-2] for layer in layers]  # the slots held, and decoding's room for more
    assert kvpress.cache_bytes(session.cache) == sum(capacity) * slot_bytes + row_counters
    assert all(c - layer.n <= max(SPARE_MIN, layer.n * SPARE) for c, layer in zip(capacity, layers, strict=True))
    assert sum(layer.n for layer in layers) < 0.85 * last.end * len(layers)  # a full cache holds them all
    assert len(session.store) == len(session.rounds) * (config.num_hidden_layers - 16)  # the layers after layer 15


def test_a_recalled_round_is_exactly_what_left(default_model):
    model, tokenizer = default_model
    press = kvpress.RoundPress(top_k_rounds=0, keep_recent_rounds=1, watershed_layer=15)
    session = kvpress.ChatSession(model, tokenizer, round_policy=press, max_new_tokens=4)
    session.send(*TURNS[0][:1], reply=TURNS[0][1])
    before = copy.deepcopy(session.cache)  # round 0 is held everywhere
    span = (session.prefix_tokens, session.rounds[0].end)
    for user, reply in TURNS[1:3]:
        session.send(user, reply=reply)  # top_k = 0: round 0 leaves the working cache
    assert not any(span[0] in _positions(layer) for layer in session.cache.layers[16:])
    assert all(span[0] in _positions(layer) for layer in session.cache.layers[:16])
    recalled, never_left = copy.deepcopy(session.cache), copy.deepcopy(session.cache)
    for i, (layer, old) in enumerate(zip(recalled.layers, before.layers, strict=True)):
        if i <= 15:
            continue
        layer.insert(session.store.get(i, 0))
        old_round = old.copy_slots((old.pos[0, 0] >= span[0]) & (old.pos[0, 0] < span[1]))
        never_left.layers[i].insert(old_round)
        assert torch.equal(layer.keys, never_left.layers[i].keys) and torch.equal(layer.pos, never_left.layers[i].pos)
    ids = torch.tensor([tokenizer("What is my locker code?", add_special_tokens=False).input_ids])
    with torch.inference_mode():
        a = model(input_ids=ids, cache=recalled, use_cache=True).logits
        b = model(input_ids=ids, cache=never_left, use_cache=True).logits
    assert torch.equal(a, b)


def test_recall_brings_a_round_back_into_the_working_cache(default_model):
    model, tokenizer = default_model
    press = kvpress.RoundPress(top_k_rounds=1, keep_recent_rounds=1, watershed_layer=15)
    session = kvpress.ChatSession(model, tokenizer, round_policy=press, max_new_tokens=4)
    for user, reply in TURNS:
        session.send(user, reply=reply)
    chosen_before = press.selected
    stored = {r: session.store.get(16, r) for r in range(len(TURNS))}
    session.send("What is my locker code?")
    held = _positions(session.cache.layers[16])
    for r in press.selected:  # a round chosen now is held, whether it stayed or came back from the store
        assert set(stored[r]["pos"][0, 0].tolist()) <= held
    assert press.selected != chosen_before or press.selected  # the selection ran this turn


def test_inner_compresses_each_round_once(default_model):
    model, tokenizer = default_model
    inner = kvpress.SnapKVPress(compression_ratio=0.5, window_size=4)
    press = kvpress.RoundPress(top_k_rounds=8, keep_recent_rounds=1, inner=inner, watershed_layer=15)
    session = kvpress.ChatSession(model, tokenizer, round_policy=press, max_new_tokens=4)
    session.send(TURNS[0][0], reply=TURNS[0][1])
    span = (session.prefix_tokens, session.rounds[0].end)
    first = [sorted(p for p in _positions(layer) if span[0] <= p < span[1]) for layer in session.cache.layers]
    assert all(abs(len(kept) - (span[1] - span[0]) / 2) <= 1 for kept in first)
    for user, reply in TURNS[1:]:
        session.send(user, reply=reply)
    later = [sorted(p for p in _positions(layer) if span[0] <= p < span[1]) for layer in session.cache.layers]
    assert later == first  # never compressed again


def test_offload_none_keeps_no_store(default_model):
    model, tokenizer = default_model
    press = kvpress.RoundPress(top_k_rounds=0, keep_recent_rounds=1, offload="none", watershed_layer=15)
    session = kvpress.ChatSession(model, tokenizer, round_policy=press, max_new_tokens=4)
    for user, reply in TURNS[:3]:
        session.send(user, reply=reply)
    assert session.store is not None and len(session.store) == 0
    upper = session.cache.layers[16:]
    assert min(min(_positions(layer) - set(range(session.prefix_tokens))) for layer in upper) >= session.rounds[1].start


def test_round_press_errors(default_model):
    model, tokenizer = default_model
    with pytest.raises(ValueError, match="top_k_rounds must be a non-negative integer"):
        kvpress.RoundPress(top_k_rounds=-1)
    with pytest.raises(ValueError, match="offload must be one of"):
        kvpress.RoundPress(offload="gpu")
    with pytest.raises(ValueError, match="keeps whole rounds"):
        kvpress.RoundPress(compression_ratio=0.5)
    with pytest.raises(TypeError, match="inner must be a token-level press"):
        kvpress.RoundPress(inner=kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=0.5)))
    for name in ("kvzip", "simlayerkv", "recall", "think"):  # a pass or a store of their own: refused, not run wrong
        with pytest.raises(ValueError, match="cannot score a round's slots in place"):
            kvpress.RoundPress(inner=kvpress.press_from_name(name, compression_ratio=0.5))
    with pytest.raises(RuntimeError, match=r"use it through kvpress.ChatSession\(model, tokenizer, round_policy="):
        with kvpress.RoundPress()(model):
            model(torch.tensor([[1, 2, 3]]))
    session = kvpress.ChatSession(model, tokenizer, round_policy=kvpress.RoundPress(watershed_layer=99),
                                  max_new_tokens=4)
    with pytest.raises(ValueError, match="watershed_layer=99 is not a full-attention layer .* with layers after it"):
        session.send("Hello.")
    assert session.messages == [] and session.rounds == [] and session.cache.get_seq_length() == 0
    session.round_policy = kvpress.RoundPress(watershed_layer=15)
    session.send("Hello.", reply="Hi!")
    with pytest.raises(ValueError, match="the reply is empty"):
        session.send("Hello again.", reply=" ")
    assert len(session.rounds) == 1


def test_chat_recall_examples_are_deterministic_and_plant_the_asked_fact():
    from kvpress.eval.tasks.chat_recall import chat_recall_examples

    first, again, other = (chat_recall_examples(3, rounds=6, seed=s) for s in (1, 1, 2))
    assert first == again and first != other
    for example in first:
        assert len(example.rounds) == 6 and example.fact_round < 3
        assert example.answer in example.rounds[example.fact_round][0]
        assert example.score(f"It is {example.answer}.") == 1.0 and example.score("I don't know.") == 0.0
    with pytest.raises(ValueError, match="need n >= 1"):
        chat_recall_examples(0)


def test_the_user_text_span_excludes_the_template(default_model):
    model, tokenizer = default_model
    session = kvpress.ChatSession(model, tokenizer, system="Be brief.")
    for text in ("What is my locker code?", "Hello you"):
        messages = session.messages + [{"role": "user", "content": text}]
        new = session.new_tokens(messages)
        start, stop = session.user_text_span(messages, new)
        assert tokenizer.decode(new[start:stop]) == text
        session.send(text, reply="Noted.")


def test_chat_recall_as_one_prompt_task(default_model):
    from kvpress.eval.tasks import task_examples

    _, tokenizer = default_model
    examples = task_examples("chat_recall", tokenizer, 2, 1024, 0)
    assert examples == task_examples("chat_recall", tokenizer, 2, 1024, 0)
    for example in examples:
        assert example.answers[0] in example.context and example.question.startswith("User: What is my")
        assert len(tokenizer(example.context).input_ids) <= 1024
        assert example.score(f"It is {example.answers[0]}.") == 1.0 and example.score(f"9{example.answers[0]}") == 0.0


def test_round_policy_is_the_sessions_not_a_press(default_model):
    model, tokenizer = default_model
    with pytest.raises(TypeError, match="pass it as round_policy="):
        kvpress.ChatSession(model, tokenizer, press=kvpress.RoundPolicy())
    with pytest.raises(ValueError, match="not both"):
        kvpress.ChatSession(model, tokenizer, press=kvpress.SnapKVPress(compression_ratio=0.5),
                            round_policy=kvpress.RoundPolicy())  # fmt: skip
    assert kvpress.RoundPress is kvpress.RoundPolicy


def test_a_cache_a_press_left_that_a_later_turn_cannot_continue_is_refused_before_the_turn(tokenized):
    """A press changed between turns: a cache whose keys a rerotate=True press re-rotated ran later turns at their
    true positions under a press that does not re-rotate, or a round policy (the cache holds 40 keys at positions
    0..39; the next token ran at 51); a round policy's inner press met per-slot scores it cannot compress only after
    the turn ran, and the session was lost. Both are refused before the turn, and the session goes on."""
    model, tokenizer = tokenized
    first = "Hello there, my name is Ada and I live in a small blue house near the river."
    later = [(kvpress.SinkWindowPress(max_tokens=40), None, "SinkWindowPress does not re-rotate"),
             (None, kvpress.RoundPolicy(watershed_layer=1), "an observer .* does not re-rotate"),
             (None, kvpress.RoundPolicy(watershed_layer=1, inner=kvpress.SnapKVPress(compression_ratio=0.5)),
              r"per-slot \['rot'\] .* inner=SnapKVPress cannot compress a round of it")]  # fmt: skip
    for press, policy, refusal in later:
        session = kvpress.ChatSession(model, tokenizer, press=kvpress.SinkWindowPress(max_tokens=40, rerotate=True),
                                      max_new_tokens=3)  # fmt: skip
        session.send(first)
        held, seen = session.cache.layers[0].n, session.cache.get_seq_length()
        session.press, session.round_policy = press, policy
        for _ in range(2):  # refused, the session unchanged, and refused alike again (not "cannot go on")
            with pytest.raises(ValueError, match=refusal):
                session.send("What is my name?")
            assert (session.cache.layers[0].n, session.cache.get_seq_length(), len(session.rounds)) == (held, seen, 1)
        session.press, session.round_policy = kvpress.SinkWindowPress(max_tokens=40, rerotate=True), None
        session.send("What is my name?")
        assert len(session.rounds) == 2
    session = kvpress.ChatSession(model, tokenizer, press=kvpress.HeavyHitterPress(compression_ratio=0.3),
                                  max_new_tokens=3)  # fmt: skip
    session.send(first)
    session.press = None
    session.round_policy = kvpress.RoundPolicy(watershed_layer=1, inner=kvpress.SnapKVPress(compression_ratio=0.5))
    with pytest.raises(ValueError, match=r"per-slot \['h2o_attention'\]"):
        session.send("What is my name?")
    session.round_policy, session.press = None, kvpress.HeavyHitterPress(compression_ratio=0.3)
    session.send("What is my name?")


def test_a_policy_set_during_a_chat_stores_the_rounds_it_drops_and_brings_them_back(tokenized, monkeypatch):
    """Rounds finished before the policy was set were never stored (the store is filled as rounds end): at the
    policy's first turn they left the layers after the watershed for good, and a later turn ranking one of them
    first could not recall it. They are stored as they leave; a larger keep_recent_rounds brings back the rounds
    it now counts as recent."""
    model, tokenizer = tokenized
    session = kvpress.ChatSession(model, tokenizer, max_new_tokens=3)
    for user, reply in TURNS[:3]:
        session.send(user, reply=reply)
    plain = session.cache.layers[2]  # a plain layer: position i in slot i
    whole = {i: (plain.keys[0, :, i].clone(), plain.values[0, :, i].clone()) for i in range(plain.keys.shape[2])}
    policy = kvpress.RoundPolicy(top_k_rounds=1, keep_recent_rounds=1, watershed_layer=1)
    session.round_policy = policy
    ranks = {"first": 1}  # the candidate round ranked first at the next selection
    monkeypatch.setattr(kvpress.rounds, "round_relevance",
                        lambda obs, spans, _: [float(r == ranks["first"]) for r in range(len(spans))])  # fmt: skip
    session.send(TURNS[3][0], reply=TURNS[3][1])
    upper = session.cache.layers[2]
    start, end = max(session.rounds[0].start, session.prefix_tokens), session.rounds[0].end  # (after the prefix)

    def held():
        return upper.pos[0, 0, : upper.n].tolist()

    assert policy.selected == [1] and not any(start <= p < end for p in held())  # round 0 left
    ranks["first"] = 0
    session.send("What is my locker code?", reply="48213.")
    assert policy.selected == [0]
    round0 = [(i, int(p)) for i, p in enumerate(held()) if start <= p < end]
    assert len(round0) == end - start  # back whole, as it was
    for i, p in round0:
        keys, values = whole[p]
        assert torch.equal(upper.keys[0, :, i], keys) and torch.equal(upper.values[0, :, i], values)
    policy.keep_recent_rounds = 5  # every finished round is recent now: those dropped come back
    session.send("And my sister?", reply="She visits next month.")
    assert all(any(max(r.start, session.prefix_tokens) <= p < r.end for p in held()) for r in session.rounds[:-1])


def test_a_cache_compressed_head_by_head_is_refused_by_a_round_policy(tokenized):
    """A press compressing the history head by head leaves each KV head holding other tokens of each round: the
    policy drops and stores rounds by the first head's slots, so the other heads kept tokens of dropped rounds and
    lost some of the recent one. Refused before the turn; the chat goes on with its press."""
    model, tokenizer = tokenized
    press = kvpress.SnapKVPress(compression_ratio=0.3, window_size=4)
    session = kvpress.ChatSession(model, tokenizer, press=press, max_new_tokens=3)
    for user, reply in TURNS[:3]:
        session.send(user, reply=reply)
    session.press, session.round_policy = None, kvpress.RoundPolicy(top_k_rounds=0, watershed_layer=1)
    held = [layer.n for layer in session.cache.layers]
    with pytest.raises(ValueError, match="holds its rounds in different slots in different KV heads"):
        session.send(TURNS[3][0], reply=TURNS[3][1])
    assert [layer.n for layer in session.cache.layers] == held and len(session.rounds) == 3
    session.press, session.round_policy = press, None
    session.send(TURNS[3][0], reply=TURNS[3][1])
