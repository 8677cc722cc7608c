"""The `kv-press-text-generation` pipeline: one question gives `kvpress.generate`'s answer; many questions
share one compressed context, each answered as if alone."""

import pytest
import torch
from transformers import DynamicCache, pipeline

import kvpress
from kvpress import SnapKVPress
from tiny import CONTEXT, QUESTION

QUESTIONS = [QUESTION, "Where is the bicycle?"]


def test_one_question_is_kvpress_generate_and_many_share_the_context(tokenized):
    model, tokenizer = tokenized
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    press = SnapKVPress(0.5, window_size=4)
    expected = [kvpress.generate(model, tokenizer, CONTEXT, q, press=press, max_new_tokens=8) for q in QUESTIONS]
    assert pipe(CONTEXT, question=QUESTIONS[0], press=press, max_new_tokens=8) == {"answer": expected[0]}
    cache = DynamicCache(config=model.config)
    out = pipe(CONTEXT, questions=QUESTIONS, press=press, max_new_tokens=8, cache=cache)
    assert out == {"answers": expected}
    context_tokens = kvpress.pipeline.split_prompt(tokenizer, CONTEXT, QUESTIONS[0])[0].shape[1]
    assert cache.get_seq_length() == context_tokens  # the compressed context alone is left in cache=
    assert all(layer.n < context_tokens for layer in cache.layers)
    prefixed = pipe(CONTEXT, question=QUESTIONS[0], press=press, max_new_tokens=8, answer_prefix="The code is")
    assert isinstance(prefixed["answer"], str)
    assert model.config._attn_implementation == "sdpa"


def test_arguments_given_when_built_hold_for_every_call(tokenized):
    """transformers merges a call's arguments over the built ones: a call must not put defaults over them."""
    model, tokenizer = tokenized
    press = SnapKVPress(0.5, window_size=4)
    built = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, press=press, max_new_tokens=3)
    expected = kvpress.generate(model, tokenizer, CONTEXT, QUESTION, press=press, max_new_tokens=3)
    assert built(CONTEXT, question=QUESTION) == {"answer": expected}
    longer = kvpress.generate(model, tokenizer, CONTEXT, QUESTION, press=press, max_new_tokens=6)
    assert built(CONTEXT, question=QUESTION, max_new_tokens=6) == {"answer": longer}  # a call's own overrides
    full = kvpress.generate(model, tokenizer, CONTEXT, QUESTION, max_new_tokens=3)
    assert built(CONTEXT, question=QUESTION, press=None) == {"answer": full}
    asks = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, questions=QUESTIONS,
                    max_new_tokens=3)  # fmt: skip
    assert len(asks(CONTEXT)["answers"]) == 2
    assert set(asks(CONTEXT, question=QUESTION)) == {"answer"}  # a call's question replaces the built questions
    with pytest.raises(ValueError, match="takes cache= at a call"):
        pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, cache=DynamicCache(config=model.config))
    with pytest.raises(ValueError, match="give question= or questions="):
        pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)(CONTEXT)
    with pytest.raises(TypeError, match="takes no argument temperature"):
        pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, temperature=0.5)


def test_bad_calls_are_refused(tokenized):
    model, tokenizer = tokenized
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="not both"):
        pipe(CONTEXT, question="a", questions=["b"])
    with pytest.raises(ValueError, match="non-empty list"):
        pipe(CONTEXT, questions="a")
    with pytest.raises(TypeError, match="takes no argument temperature"):
        pipe(CONTEXT, question="a", temperature=0.5)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        pipe(CONTEXT, question="a", max_new_tokens=0)
    with pytest.raises(TypeError, match="answer_prefix is the text the answer starts with .*, got 5"):
        pipe(CONTEXT, question="a", answer_prefix=5)  # (the tokenizer's own error before)
    full = DynamicCache(config=model.config)
    model(torch.tensor([[5, 6]]), cache=full)
    with pytest.raises(ValueError, match="already holds 2 tokens"):
        pipe(CONTEXT, question="a", cache=full)
    with pytest.raises(ValueError, match="cache= receives one compressed context; 2 contexts were given"):
        pipe([CONTEXT, CONTEXT], question="a", cache=DynamicCache(config=model.config))
    with pytest.raises(ValueError, match=r"max_tokens=100000 is not smaller than the context \(\d+ tokens\)"):
        pipe(CONTEXT, question="a", press=SnapKVPress(max_tokens=100000, window_size=4))  # as kvpress.generate
    with pytest.raises(TypeError, match="press must be a kvpress press"):
        pipe(CONTEXT, question="a", press="snapkv")
    with pytest.raises(ValueError, match="chat_template must be True or False, got 'false'"):
        pipe(CONTEXT, question="a", chat_template="false")
    with pytest.raises(ValueError, match="LookaheadPress scores by the question"):  # before any prefill
        pipe(CONTEXT, question="a", press=kvpress.LookaheadPress(compression_ratio=0.5))
    with pytest.raises(TypeError, match="pass the question as question="):
        pipe(CONTEXT, "a")  # transformers' Pipeline would drop it
    with pytest.raises(ValueError, match="batch_size must be 1, got 2"):
        pipe([CONTEXT, CONTEXT], question="a", batch_size=2)
    batched = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, batch_size=2)
    with pytest.raises(ValueError, match="batch_size must be 1, got 2"):
        batched([CONTEXT, CONTEXT], question="a")
    assert len(batched([CONTEXT, CONTEXT], question="a", batch_size=1, max_new_tokens=2)) == 2  # not batched
    both = pipe([CONTEXT, "The bicycle is in the shed. " * 4], question=QUESTIONS[1], max_new_tokens=4)
    assert len(both) == 2 and all(isinstance(out["answer"], str) for out in both)  # one at a time, none lost


def test_generate_refuses_arguments_of_the_wrong_kind(tokenized):
    """kvpress.generate: a press that is not one, a bool flag given as text, a count that is not an integer."""
    model, tokenizer = tokenized
    for kwargs, error, said in ((dict(press="snapkv"), TypeError, "press must be a kvpress press"),
                                (dict(press=kvpress.RoundPolicy()), TypeError, "a RoundPolicy is a chat policy"),
                                (dict(press=SnapKVPress(0.5), query_aware="no"), ValueError,
                                 "query_aware must be True or False, got 'no'"),
                                (dict(max_new_tokens=2.5), ValueError, "max_new_tokens must be a positive integer"),
                                (dict(max_new_tokens=True), ValueError, "max_new_tokens must be a positive integer"),
                                (dict(chat_template="false"), ValueError, "chat_template must be True or False")):
        with pytest.raises(error, match=said):
            kvpress.generate(model, tokenizer, CONTEXT, QUESTION, **kwargs)


def test_split_prompt_under_a_template_that_trims_the_message(tokenized, monkeypatch):
    """A chat template that trims the message (Llama 3's) still cuts before the question; one that rewrites it is
    refused by name, not with a bare "substring not found"."""
    _, tokenizer = tokenized
    template = tokenizer.apply_chat_template

    def trimming(messages, **kwargs):
        return template([{**m, "content": m["content"].strip()} for m in messages], **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", trimming)
    head, tail = kvpress.pipeline.split_prompt(tokenizer, "Some document.", "What is the code?\n")
    assert tokenizer.decode(tail[0]).startswith("What is the code?")
    assert "What is the code" not in tokenizer.decode(head[0])
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda messages, **kwargs: template(
        [{**m, "content": m["content"].upper()} for m in messages], **kwargs))  # fmt: skip
    with pytest.raises(ValueError, match="chat template rewrites the question 'What is the code'"):
        kvpress.pipeline.split_prompt(tokenizer, "Some document.", "What is the code")


@pytest.mark.parametrize("question", ["assistant", "s", "\n"])
def test_split_prompt_cuts_where_the_question_goes_not_where_its_text_recurs(tokenized, question):
    """A question whose text the template also writes after the message (SmolLM2's "assistant" header) was cut
    there, inside a token, and the question itself compressed with the context."""
    _, tokenizer = tokenized
    head, tail = kvpress.pipeline.split_prompt(tokenizer, "Some document.", question)
    assert tokenizer.decode(head[0]).endswith("Some document.\n\n")
    whole = tokenizer.apply_chat_template([{"role": "user", "content": f"Some document.\n\n{question}"}],
                                          add_generation_prompt=True, tokenize=False)  # fmt: skip
    assert tokenizer.decode(torch.cat([head, tail], dim=-1)[0]) == whole


def test_a_query_aware_budget_is_set_against_the_context_and_question_it_compresses(tokenized):
    """Query-aware, the question is compressed with the context: a budget of the context's length compresses."""
    model, tokenizer = tokenized
    context_tokens = kvpress.pipeline.split_prompt(tokenizer, CONTEXT, QUESTION)[0].shape[1]
    press = SnapKVPress(max_tokens=context_tokens, window_size=4)
    with pytest.raises(ValueError, match="is not smaller than the context"):
        kvpress.generate(model, tokenizer, CONTEXT, QUESTION, press=press, max_new_tokens=2)
    assert isinstance(kvpress.generate(model, tokenizer, CONTEXT, QUESTION, press=press, max_new_tokens=2,
                                       query_aware=True), str)  # fmt: skip


def test_kvpress_own_generate_calls_hold_whatever_the_generation_config_says(tokenized):
    """kvpress.generate, the pipeline and a chat run one greedy sequence over the cache they prefilled: a model whose
    generation_config says use_cache=False fed the whole prompt again at every step over that cache (another
    answer, the cache past its budget; a chat's second turn raised), and num_beams=3 raised."""
    model, tokenizer = tokenized
    press = SnapKVPress(0.5, window_size=4)
    cache = DynamicCache(config=model.config)
    expected = kvpress.generate(model, tokenizer, CONTEXT, QUESTION, press=press, max_new_tokens=6, cache=cache)
    held = [layer.n for layer in cache.layers]
    chat = kvpress.ChatSession(model, tokenizer, max_new_tokens=4)
    turns = [chat.send("My name is Ada."), chat.send("What is my name?")]
    saved = model.generation_config
    try:
        for settings in ({"use_cache": False}, {"num_beams": 3, "num_return_sequences": 2}):
            model.generation_config = saved.__class__(**{**saved.to_dict(), **settings})
            cache = DynamicCache(config=model.config)
            assert kvpress.generate(model, tokenizer, CONTEXT, QUESTION, press=press, max_new_tokens=6,
                                    cache=cache) == expected, settings  # fmt: skip
            assert [layer.n for layer in cache.layers] == held, settings
            pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
            assert pipe(CONTEXT, question=QUESTION, press=press, max_new_tokens=6) == {"answer": expected}
            chat = kvpress.ChatSession(model, tokenizer, max_new_tokens=4)
            assert [chat.send("My name is Ada."), chat.send("What is my name?")] == turns, settings
    finally:
        model.generation_config = saved


def test_an_answer_past_the_models_positions_is_refused_as_a_chat_turn_is(tokenized):
    """kvpress.generate and the pipeline generated past the model's positions (512 here) with only transformers'
    'friendly reminder', where a chat turn was refused: refused alike, before the prefill, unless the press
    re-rotates its keys into the cache's positions."""
    model, tokenizer = tokenized
    with pytest.raises(ValueError, match=r"the prompt \(\d+ tokens\) and its answer would reach position \d+, past "
                                         r"the model's 512 positions; use a press with rerotate=True"):  # fmt: skip
        kvpress.generate(model, tokenizer, CONTEXT, QUESTION, press=SnapKVPress(0.5, window_size=8), max_new_tokens=600)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="a question and its answer would reach position .* past the model's 512"):
        pipe(CONTEXT, question=QUESTION, press=SnapKVPress(0.5, window_size=8), max_new_tokens=600)
    rerotating = kvpress.SinkWindowPress(n_sink=4, window=16, rerotate=True)
    kvpress.pipeline.check_positions(model, 600, rerotating, "an answer", "...")  # (taken)
