"""TOVAPress: the last query's attention, averaged over the layer's heads, decides; every head keeps the same
tokens, at the prefill and at each decoding step."""

import torch
from transformers import DynamicCache

import kvpress
from kvpress import TOVAPress
from tiny import left_padded, prompt, tiny_model


def _mean_last_attention(model, ids):
    """{layer: [n]} the last query's attention over the prompt, averaged over every query head (no press)."""
    seen = {}

    def record(obs):
        seen[obs.layer_idx] = obs.attention_probs(obs.q_len - 1, obs.q_len)[0, :, :, 0].mean(dim=(0, 1))

    with kvpress.observe(model, record):
        model(ids, cache=DynamicCache(config=model.config))
    return seen


def test_every_head_keeps_the_tokens_the_last_query_attends_to_most():
    model = tiny_model("llama")
    ids = prompt(1, 40)
    expected = _mean_last_attention(model, ids)
    cache = DynamicCache(config=model.config)
    with TOVAPress(compression_ratio=0.5, window_size=0)(model):
        model(ids, cache=cache)
    for idx, layer in enumerate(cache.layers):
        top = expected[idx].topk(20).indices.sort().values
        for head in range(layer.keys.shape[1]):
            assert torch.equal(layer.pos[0, head, : layer.n].long().sort().values, top)


def test_decoding_keeps_the_budget_and_heads_aligned():
    model = tiny_model("qwen2")
    cache = DynamicCache(config=model.config)
    with TOVAPress(max_tokens=16)(model):
        model.generate(prompt(1, 30), cache=cache, max_new_tokens=12, do_sample=False, pad_token_id=0)
    for layer in cache.layers:
        pos = layer.pos[0, :, : layer.n].long().sort(dim=-1).values
        assert layer.n == 16 and layer.seen == 41 and bool((pos == pos[:1]).all())
        assert int(pos[0, -1]) == 40  # the newest token (window_size=1) stays


def test_heads_holding_other_tokens_behind_holes_are_scored_apart_in_a_padded_batch():
    """Under CriticalKV a padded row's heads keep different tokens, and the slots they evicted stay as holes with
    their positions: compared by slot positions alone the heads looked the same and were scored together, where
    alone each head is scored by its own queries (rows of 23 and 12 differed from their 6th and 3rd tokens)."""
    model = tiny_model("llama")
    rows = [prompt(1, n, seed=s)[0] for n, s in ((60, 1), (23, 2), (41, 3), (12, 4))]
    ids, mask = left_padded(rows)
    settings = {"max_new_tokens": 30, "min_new_tokens": 30, "do_sample": False, "pad_token_id": 0}
    make = lambda: kvpress.CriticalKVPress(TOVAPress(compression_ratio=0.5))  # noqa: E731
    with make()(model):
        batch = model.generate(ids, attention_mask=mask, **settings)[:, ids.shape[1] :]
    for row, tokens in zip(rows, batch, strict=True):
        with make()(model):
            assert torch.equal(model.generate(row[None], **settings)[0, len(row) :], tokens)
