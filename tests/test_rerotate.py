"""Re-rotation (StreamingLLM positions): exact, and lets generation run far past max positions."""

import pytest
import torch
from transformers import DynamicCache

from kvpress import HeavyHitterPress, SinkWindowPress
from kvpress.patches.rope import rerotate
from tiny import LLAMA3_ROPE, prompt, tiny_model

ROPE = {
    "default": {},
    "linear": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    "llama3": {"rope_parameters": LLAMA3_ROPE},
}


def _rotated_keys(model, keys, positions):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = model.model.rotary_emb(keys, positions[None])
    return apply_rotary_pos_emb(keys, keys, cos, sin)[1]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("rope", list(ROPE))
def test_rerotation_is_exact(family, rope):
    model = tiny_model(family, **ROPE[rope])
    torch.manual_seed(0)
    raw = torch.randn(1, 2, 50, 16)
    start = torch.arange(100, 150)
    target = torch.randint(0, 400, (50,))
    delta = (target - start).expand(1, 2, 50)
    moved = rerotate(_rotated_keys(model, raw, start), delta, model.model.rotary_emb.inv_freq)
    assert (moved - _rotated_keys(model, raw, target)).abs().max() < 1e-4


def _positions_seen(model):
    seen = []
    hook = model.model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(int(kw["position_ids"].max())), with_kwargs=True
    )
    return seen, hook


@pytest.mark.parametrize(
    "press",
    [
        SinkWindowPress(n_sink=4, window=12, rerotate=True),
        HeavyHitterPress(max_tokens=16, window=6, rerotate=True),
    ],
)
def test_generation_runs_10x_past_max_positions(press):
    model = tiny_model("llama", max_position_embeddings=32)
    cache = DynamicCache(config=model.config)
    seen, hook = _positions_seen(model)
    try:
        with press(model):
            out = model.generate(prompt(1, 20), cache=cache, max_new_tokens=320, min_new_tokens=320, do_sample=False)
    finally:
        hook.remove()
    assert out.shape[1] == 340
    assert max(seen) < 32  # the model never saw a position it was not trained for
    assert all(layer.n <= 17 for layer in cache.layers)
    assert cache.get_seq_length() == 339
    rot = cache.layers[0].slots["rot"][..., : cache.layers[0].n]
    assert sorted(rot[0, 0].tolist()) == list(range(16))  # keys sit at positions 0..15 inside the cache


def test_without_rerotate_positions_keep_counting():
    model = tiny_model("llama", max_position_embeddings=512)
    seen, hook = _positions_seen(model)
    try:
        with SinkWindowPress(n_sink=4, window=12)(model):
            model.generate(prompt(1, 20), max_new_tokens=40, min_new_tokens=40, do_sample=False)
    finally:
        hook.remove()
    assert max(seen) == 58  # the 40th new token is never fed back


def test_rerotated_sink_window_step_equals_fresh_forward_positions():
    """After re-rotation, the next step equals attention with keys at in-cache positions 0..n-1."""
    model = tiny_model("llama", num_hidden_layers=1)
    ids = prompt(1, 30)
    cache = DynamicCache(config=model.config)
    with SinkWindowPress(n_sink=2, window=8, rerotate=True)(model):
        model(ids[:, :29], cache=cache)
        layer = cache.layers[0]
        keys_in_cache = layer.keys[:, :, : layer.n].clone()
        logits = model(ids[:, 29:], cache=cache).logits[0, -1]
    # with one layer, kept keys are projections of the input embeddings: recompute them at 0..9
    attn = model.model.layers[0].self_attn
    hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    kept = list(range(2)) + list(range(21, 29))
    raw = attn.k_proj(hidden[:, kept]).view(1, 10, -1, 16).transpose(1, 2)
    expected = _rotated_keys(model, raw, torch.arange(10))
    assert (keys_in_cache - expected).abs().max() < 1e-4
    # and the new token sat at position 10: same logits as a fresh run over the kept tokens
    fresh = model(ids[:, kept + [29]]).logits[0, -1]
    assert (logits - fresh).abs().max() < 1e-4


def test_a_cache_compressed_without_rerotation_is_moved_to_its_ranks_when_a_rerotating_press_continues_it():
    """Its held keys stayed at their true positions while the new token ran at its rank (the logits 2e-3 off both
    readings, and every later step read that token's key rotated wrong): the keys move to their ranks first. (One
    layer: its keys are projections of the embeddings, so a fresh run of the held tokens is the reference.)"""
    model = tiny_model("llama", num_hidden_layers=1)
    ids = prompt(1, 32)
    cache = DynamicCache(config=model.config)
    with SinkWindowPress(n_sink=4, window=12)(model):  # keys at their true positions 0..3, 18..29
        model(ids[:, :30], cache=cache)
    with SinkWindowPress(n_sink=4, window=12, rerotate=True)(model):
        first = model(ids[:, 30:31], cache=cache).logits[0, -1]
        second = model(ids[:, 31:32], cache=cache).logits[0, -1]
    held = [0, 1, 2, 3, *range(18, 30)]
    assert (first - model(ids[:, [*held, 30]]).logits[0, -1]).abs().max() < 1e-5  # at 0..15, the new one at 16
    now = [0, 1, 2, 3, *range(19, 31)]  # after the step's eviction
    assert (second - model(ids[:, [*now, 31]]).logits[0, -1]).abs().max() < 1e-5
    from kvpress import KnormPress

    two = tiny_model("llama")  # layers of other budgets: one position for every layer's new token fits none
    cache = DynamicCache(config=two.config)
    with KnormPress(compression_ratio=0.5, layer_scales=(1.0, 1.5))(two):
        two(ids[:, :30], cache=cache)
    with pytest.raises(ValueError, match="layers hold different numbers of tokens .* cannot continue it"):
        with SinkWindowPress(n_sink=4, window=12, rerotate=True)(two):
            two(ids[:, 30:31], cache=cache)


def test_a_rerotated_cache_refuses_a_forward_outside_its_press():
    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    with SinkWindowPress(n_sink=4, window=12, rerotate=True)(model):
        model.generate(prompt(1, 20), cache=cache, max_new_tokens=8, do_sample=False)
    before = [layer.n for layer in cache.layers]
    with pytest.raises(RuntimeError, match="re-rotated .* continue it inside `with press"):
        model.generate(prompt(1, 20), cache=cache, max_new_tokens=2, do_sample=False)
    assert [layer.n for layer in cache.layers] == before  # refused before anything was appended


def test_interleaved_rope_is_refused_where_keys_would_be_moved_as_half_split_ones():
    """Cohere rotates interleaved feature pairs: moving its keys as transformers' half-split ones corrupts them."""
    from transformers import AutoModelForCausalLM, CohereConfig

    from kvpress import ExpectedAttentionPress

    config = CohereConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    torch.manual_seed(0)
    cohere = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    for press in (SinkWindowPress(max_tokens=16, rerotate=True), ExpectedAttentionPress(compression_ratio=0.5)):
        with pytest.raises(TypeError, match="CohereForCausalLM does not rotate its keys in transformers' half-split"):
            with press(cohere):
                pass
    assert cohere.config._attn_implementation == "sdpa"
    with SinkWindowPress(max_tokens=16)(cohere):  # no re-rotation: positions kept, nothing moved
        cohere(prompt(1, 24), cache=DynamicCache(config=cohere.config))


def test_bf16_keys_re_rotated_round_after_round_stay_near_a_fresh_run():
    """Each eviction round moves the held keys again: in bf16 arithmetic the roundings piled up (11% off a fresh
    run of the kept tokens after 420 steps, decode_slack=0); computed in fp32 and rounded once, under 5%."""
    from transformers import AutoModelForCausalLM

    from tiny import CONFIGS

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS["llama"](), attn_implementation="sdpa", dtype=torch.bfloat16)
    ids = prompt(1, 24)
    cache = DynamicCache(config=model.config)
    with SinkWindowPress(n_sink=4, window=200, rerotate=True, decode_slack=0.0)(model):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=420,
                             min_new_tokens=420, do_sample=False, pad_token_id=0)  # fmt: skip
    layer = cache.layers[0]
    order = layer.pos[0, 0].long().argsort()
    fresh = DynamicCache(config=model.config)
    model(out[0, layer.pos[0, 0].long()[order]][None], cache=fresh)
    held, expected = layer.keys[0, :, : layer.n][:, order].double(), fresh.layers[0].keys[0].double()
    error = (held - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert error[:, 4:].mean() < 0.05


def test_the_layout_check_leaves_a_dynamic_rope_alone():
    """A dynamic RoPE that ran past its original length keeps its stretched frequencies: the check calls none of
    the model's rotary code (calling it swapped them back, and the check then refused the model)."""
    model = tiny_model("llama", max_position_embeddings=128,
                       rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})  # fmt: skip
    model(prompt(1, 300))
    stretched = model.model.rotary_emb.inv_freq.clone()
    with SinkWindowPress(n_sink=4, window=12, rerotate=True)(model):
        pass
    assert torch.equal(model.model.rotary_emb.inv_freq, stretched)


def test_a_dynamic_rope_streams_in_chunks_and_refuses_a_forward_past_its_length():
    """A one-piece prefill past a dynamic RoPE's length rotated its keys with stretched frequencies and the cache
    moved them with the original ones (keys 0.8 off, logits 2.6e-3): refused; in chunks within it, exact (one layer:
    a fresh run of the held tokens at 0..n is the reference), also after a forward past it stretched them first."""
    model = tiny_model("llama", num_hidden_layers=1, max_position_embeddings=128,
                       rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})  # fmt: skip
    ids = prompt(1, 201)
    with pytest.raises(ValueError, match="reaches position 199; the model keeps its own frequencies only while a "
                                         "forward stays below position 127"):  # fmt: skip
        with SinkWindowPress(n_sink=4, window=28, rerotate=True)(model):
            model(ids[:, :200], cache=DynamicCache(config=model.config))
    model(prompt(1, 300))  # stretched before the press is installed
    cache = DynamicCache(config=model.config)
    with SinkWindowPress(n_sink=4, window=28, rerotate=True, decode_slack=0.0)(model):
        for start in range(0, 200, 32):
            model(ids[:, start : min(start + 32, 200)], cache=cache)
        logits = model(ids[:, 200:], cache=cache).logits[0, -1]
    fresh = model(ids[:, [0, 1, 2, 3, *range(200 - 28, 201)]]).logits[0, -1]
    assert (logits - fresh).abs().max() < 1e-5


def test_latent_keys_are_refused_where_they_would_be_moved():
    """DeepSeek-V3 (MLA) caches latents, not rotated keys, and rotates interleaved pairs (`rope_interleave`)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from tiny import COMMON

    config = DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, q_lora_rank=None, kv_lora_rank=16,
                              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                              num_experts_per_tok=2, first_k_dense_replace=2, moe_intermediate_size=32, n_group=1,
                              topk_group=1)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(TypeError, match="does not rotate its keys in transformers' half-split"):
        with SinkWindowPress(n_sink=4, window=12, rerotate=True)(model):
            pass
