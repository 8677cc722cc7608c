"""HeavyHitterPress (H2O): each cached token's score is the attention it received from every query."""

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress import AdaKVPress, HeavyHitterPress
from tiny import prompt, tiny_model


@pytest.mark.parametrize("headwise", [False, True])
def test_a_question_read_frozen_adds_its_attention_as_one_forward_does(headwise):
    """Read inside frozen() (nothing evicted), a question's queries count as any other: the accumulated scores
    equal one forward's over context and question, so when decoding evicts again the question competes on them."""
    model = tiny_model("llama")
    ids = prompt(1, 50, seed=4)

    def make():
        press = HeavyHitterPress(max_tokens=64)  # above 50: nothing is evicted, only scored
        return AdaKVPress(press) if headwise else press

    whole, split = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with make()(model):
        model(ids, cache=whole)
    with make()(model) as installed:
        model(ids[:, :40], cache=split)
        with installed.frozen():
            model(ids[:, 40:], cache=split)
    for a, b in zip(whole.layers, split.layers, strict=True):
        if isinstance(a, kvpress.HeadwiseLayer):
            a, b = a.as_dense(), b.as_dense()
        got = b.slot("h2o_attention")[..., : b.n]
        assert bool((got[..., 40:] > 0).all())  # (0 before: the question's tokens were the first evicted)
        torch.testing.assert_close(got, a.slot("h2o_attention")[..., : a.n], atol=1e-5, rtol=1e-4)
