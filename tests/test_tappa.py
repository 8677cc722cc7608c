"""TAPPAPress: a layer's budget spread across its KV heads by 1 - the q-similarity of each head's queries."""

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

import kvpress
from kvpress import SnapKVPress, TAPPAPress
from kvpress.presses.tappa import q_similarity, split_budget
from tiny import prompt, tiny_model


def test_q_similarity_is_the_mean_cosine_over_pairs_of_real_queries():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g)
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[1, :2] = False  # left padding
    got = q_similarity(q, 2, valid)
    for b in range(2):
        real = q[b][:, valid[b]]
        for kv in range(2):
            sims = []
            for h in (2 * kv, 2 * kv + 1):
                n = real.shape[1]
                pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
                sims += [F.cosine_similarity(real[h, i], real[h, j], dim=0) for i, j in pairs]
            assert abs(float(got[b, kv]) - float(torch.stack(sims).mean())) < 1e-5


def test_split_budget_keeps_floors_caps_and_the_total():
    budgets = split_budget(torch.tensor([40]), torch.tensor([[1.0, 3.0, 0.0, 4.0]]), torch.tensor([[2, 2, 2, 2]]),
                           torch.tensor([[30, 30, 30, 10]]))  # fmt: skip
    assert budgets.tolist() == [[8, 20, 2, 10]]  # 8 floor + 32 by weight; head 3 capped at 10, its 8 to heads 0 and 1
    assert split_budget(torch.tensor([100]), torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.long),
                        torch.tensor([[5, 7]])).tolist() == [[5, 7]]  # fmt: skip


def test_heads_with_less_similar_queries_keep_more_and_the_layer_keeps_its_budget():
    model = tiny_model("llama", num_key_value_heads=4)
    ids = prompt(1, 60)
    sims = {}
    with kvpress.observe(model, lambda obs: sims.__setitem__(obs.layer_idx, q_similarity(obs.query[:, :, -16:], 4))):
        model(ids, cache=DynamicCache(config=model.config))
    cache = DynamicCache(config=model.config)
    with TAPPAPress(SnapKVPress(0.5, window_size=2), similarity_window=16, alpha_safeguard=0.0)(model):
        model(ids, cache=cache)
    for idx, layer in enumerate(cache.layers):
        weights = 1 - sims[idx][0].double()
        expected = split_budget(torch.tensor([120]), weights[None], torch.full((1, 4), 2), torch.full((1, 4), 60))
        assert layer.lengths == expected[0].tolist() and sum(layer.lengths) == 4 * 30
    assert any(len(set(layer.lengths)) > 1 for layer in cache.layers)  # not an even split


def test_decoding_keeps_the_budget_and_the_heads_shares():
    model = tiny_model("qwen2")
    cache = DynamicCache(config=model.config)
    with TAPPAPress(SnapKVPress(max_tokens=16, window_size=2), similarity_window=8)(model):
        model.generate(prompt(1, 40), cache=cache, max_new_tokens=10, do_sample=False, pad_token_id=0)
    for layer in cache.layers:
        assert sum(layer.lengths) <= 2 * 16 and layer.seen == 49


def test_bad_parameters_are_refused_by_name():
    with pytest.raises(ValueError, match="similarity_window"):
        TAPPAPress(SnapKVPress(0.5), similarity_window=1)
    with pytest.raises(ValueError, match="alpha_safeguard"):
        TAPPAPress(SnapKVPress(0.5), alpha_safeguard=2.0)
