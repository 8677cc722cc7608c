"""ExpectedAttentionPress: the closed-form expected attention of the coming queries (RoPE averaged over the
next positions), and the rotation algebra it rests on."""

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress import ExpectedAttentionPress
from kvpress.patches import model_access
from kvpress.patches.rope import average_rotation, rerotate
from tiny import prompt, tiny_model


def test_averaged_rotation_is_the_mean_of_the_rotations_and_moves_a_covariance():
    g = torch.Generator().manual_seed(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    x = torch.randn(5, 8, generator=g, dtype=torch.float64)
    shifts = torch.tensor([1, 2, 7])
    rotated = [rerotate(x[None, None], torch.full((1, 1, 5), int(s)), inv_freq)[0, 0] for s in shifts]
    torch.testing.assert_close(average_rotation(x, shifts, inv_freq), torch.stack(rotated).mean(0))
    # one shift: R S R^T is the covariance of the rotated samples
    samples = torch.randn(200, 8, generator=g, dtype=torch.float64)
    one = torch.tensor([3])
    cov = samples.T.cov(correction=0)
    moved = average_rotation(average_rotation(cov, one, inv_freq).T, one, inv_freq)
    turned = rerotate(samples[None, None], torch.full((1, 1, 200), 3), inv_freq)[0, 0]
    torch.testing.assert_close(moved, turned.T.cov(correction=0))


def test_one_future_position_without_covariance_is_the_attention_of_the_query_one_step_ahead():
    """At a decoding step (one query), n_future_positions=1 and no covariance: the expected attention is the
    softmax attention of that query rotated one position on, averaged over its KV group, times ||v||."""
    model = tiny_model("llama")
    press = ExpectedAttentionPress(max_tokens=64, n_future_positions=1, n_sink=0, use_covariance=False)
    press.check_model(model)
    got = {}

    def record(obs):
        if obs.q_len == 1:
            got[obs.layer_idx] = (press.score(obs), obs)

    cache = DynamicCache(config=model.config)
    ids = prompt(1, 20)
    model(ids[:, :-1], cache=cache)
    with kvpress.observe(model, record):
        model(ids[:, -1:], cache=cache)
    inv_freq = model_access.layer_inv_freq(model, 0)
    for score, obs in got.values():
        b, hq, _, d = obs.query.shape
        query = rerotate(obs.query.float(), torch.ones(b, hq, 1, dtype=torch.long), inv_freq)
        logits = query @ obs.keys.float().repeat_interleave(hq // obs.keys.shape[1], 1).transpose(-1, -2)
        probs = (logits[:, :, 0] * model_access.attention_scaling(obs.module)).softmax(-1)
        expected = probs.view(b, obs.keys.shape[1], -1, probs.shape[-1]).mean(2) * obs.values.float().norm(dim=-1)
        torch.testing.assert_close(score, expected)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prefill_and_decoding_keep_the_budget(arch):
    model = tiny_model(arch)
    cache = DynamicCache(config=model.config)
    with ExpectedAttentionPress(max_tokens=20)(model):
        model.generate(prompt(2, 40), cache=cache, max_new_tokens=8, do_sample=False, pad_token_id=0)
    full = [i for i, kind in enumerate(model_access.layer_types(model)) if kind == "full_attention"]
    assert all(cache.layers[i].n == 20 and cache.layers[i].seen == 47 for i in full)


def test_bad_parameters_are_refused_by_name():
    for kwargs, name in [({"n_future_positions": 0}, "n_future_positions"), ({"n_sink": -1}, "n_sink"),
                         ({"use_vnorm": 1}, "use_vnorm"), ({"epsilon": -0.1}, "epsilon")]:  # fmt: skip
        with pytest.raises((TypeError, ValueError), match=name):
            ExpectedAttentionPress(0.5, **kwargs)
