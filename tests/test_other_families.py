"""Families beyond the tested ones: each runs correctly or is refused by name for its real reason (an audit of 40
architectures found the ones here crashing deep inside kvpress, or refused for a reason that was not theirs)."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import kvpress
from kvpress import (
    AdaKVPress,
    ChunkPress,
    DuoAttentionPress,
    KnormPress,
    KVzapPress,
    PyramidKVPress,
    RandomPress,
    RoundPolicy,
    SinkWindowPress,
    SnapKVPress,
)
from kvpress.patterns import config_hash

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
MLA = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
           num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           first_k_dense_replace=1, n_shared_experts=1, topk_group=1, n_group=1)  # fmt: skip


def build(model_type: str, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**SMALL, **kw})
    attn = "eager" if model_type in ("mpt", "gpt_oss") else "sdpa"  # (they have no sdpa path)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).eval()


IDS = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))


def test_a_latent_cache_takes_presses_that_choose_by_position_and_refuses_the_others_by_name(tmp_path):
    """DeepSeek-V3 caches one latent a layer (keys [B, 1, n, kv_lora_rank]), not each head's keys: SnapKV failed on
    a raw reshape, Knorm on a gather, DuoAttention on an index. Sink-window and random run; r = 0 is no press; a
    saved cache is refused no more (it read 4 KV heads of size 8 where the cache holds 1)."""
    model = build("deepseek_v3", **MLA)
    for press in (SnapKVPress(compression_ratio=0.5, window_size=4), KnormPress(compression_ratio=0.5),
                  AdaKVPress(SnapKVPress(compression_ratio=0.5, window_size=4))):  # fmt: skip
        with pytest.raises(TypeError, match=rf"caches multi-head latent attention's latents.*{type(press).__name__}"):
            with press(model):
                pass
    with pytest.raises(TypeError, match="caches multi-head latent attention's latents.*RoundPolicy reads"):
        RoundPolicy(inner=SnapKVPress(compression_ratio=0.5, window_size=4)).check_model(model)  # (a chat's)
    plain = model.generate(IDS, max_new_tokens=6, do_sample=False, pad_token_id=0)
    sink, rand = SinkWindowPress(compression_ratio=0.0), RandomPress(compression_ratio=0.0)
    for press in (sink, rand, ChunkPress(SinkWindowPress(compression_ratio=0.0)), PyramidKVPress(rand)):
        with press(model):  # (wrappers choose by position over a press that does: they were refused)
            assert torch.equal(model.generate(IDS, max_new_tokens=6, do_sample=False, pad_token_id=0), plain)
    for press in (ChunkPress(SnapKVPress(compression_ratio=0.5)), KVzapPress(compression_ratio=0.5)):
        with pytest.raises(TypeError, match="caches multi-head latent attention's latents"):  # (KVzap: no scorer fit)
            with press(model):
                pass
    press, cache = SinkWindowPress(compression_ratio=0.5), DynamicCache(config=model.config)
    with press(model):
        model(IDS, cache=cache)
    assert [layer.n for layer in cache.layers] == [20, 20]
    kvpress.save_cache(cache, tmp_path / "c.safetensors", model, press="sink-window:compression_ratio=0.5")
    loaded = kvpress.load_cache(tmp_path / "c.safetensors", model)
    with press(model):
        assert torch.equal(model(IDS[:, :1], cache=loaded).logits, model(IDS[:, :1], cache=cache).logits)


def test_a_config_without_num_key_value_heads_has_as_many_as_attention_heads(tmp_path):
    """GPT-NeoX's config names no `num_key_value_heads`: DuoAttention (its pattern's shape) and save_cache failed on
    an AttributeError; each KV head is an attention head."""
    model = build("gpt_neox", rotary_pct=0.25)
    pattern = {"model": "tiny", "config_hash": config_hash(model), "scores": [[1.0, 0.0, 0.5, 0.2]] * 2}
    cache = DynamicCache(config=model.config)
    with DuoAttentionPress(head_pattern=pattern, retrieval_fraction=0.5, n_sink=1, window=4)(model):
        model(IDS, cache=cache)
    kvpress.save_cache(cache, tmp_path / "c.safetensors", model)
    assert len(kvpress.load_cache(tmp_path / "c.safetensors", model).layers) == 2


def test_a_hybrid_cache_is_given_to_generate_chats_and_is_refused_a_save_by_its_layer_class(tmp_path):
    """Qwen3-Next's cache holds a linear-attention layer (recurrent states) beside the attention one: kvpress.generate
    given `cache=` and save_cache failed on its missing `get_seq_length`, and a chat turn interrupted without a press
    lost its exception to that AttributeError (now: the session ends, its recurrent states cannot be cropped back);
    a cache whose forward raised after the linear layer's states changed was taken by kvpress.generate as empty."""
    model = build("qwen3_next", num_key_value_heads=2, head_dim=16, linear_num_value_heads=2, linear_num_key_heads=2,
                  linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=32,
                  layer_types=["linear_attention", "full_attention"], vocab_size=49152)  # fmt: skip
    with torch.no_grad():  # (a context fed in two forwards carries its recurrent state: as in one)
        cache = DynamicCache(config=model.config)
        model(IDS[:, :30], cache=cache)
        assert torch.allclose(model(IDS[:, 30:], cache=cache).logits[:, -1], model(IDS).logits[:, -1], atol=1e-5)
    from transformers import AutoTokenizer

    from kvpress.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(), local_files_only=True)
    press = SnapKVPress(compression_ratio=0.5, window_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (transformers says its linear-attention kernels fall back to PyTorch)
        answer = kvpress.generate(model, tokenizer, "The bicycle is in the blue shed. " * 4, "Where?", press=press,
                                  max_new_tokens=3, cache=DynamicCache(config=model.config))  # fmt: skip
        assert isinstance(answer, str)
        cache = DynamicCache(config=model.config)
        with press(model):
            model(IDS, cache=cache)
        with pytest.raises(ValueError, match="a LinearAttentionLayer cache layer cannot be saved"):
            kvpress.save_cache(cache, tmp_path / "c.safetensors", model)
        cache = DynamicCache(config=model.config)  # a forward that raised past the linear layer, before attention
        hook = model.model.layers[1].register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("x")))
        with pytest.raises(RuntimeError, match="x"):
            model(IDS, cache=cache)
        hook.remove()
        with pytest.raises(ValueError, match="already holds a linear-attention layer's states"):  # (taken as empty)
            kvpress.generate(model, tokenizer, "The bicycle.", "Where?", press=press, max_new_tokens=2, cache=cache)
        cache.reset()  # (transformers' own API: empty again, taken)
        kvpress.generate(model, tokenizer, "The bicycle.", "Where?", press=press, max_new_tokens=2, cache=cache)

        class Interrupting:
            def put(self, _):
                raise KeyboardInterrupt("stop")

            def end(self):
                pass

        session = kvpress.ChatSession(model, tokenizer, max_new_tokens=4)
        session.send("The bicycle is in the blue shed.", reply="Noted.")
        with pytest.raises(KeyboardInterrupt, match="stop"):
            session.send("Where?", streamer=Interrupting())
        with pytest.raises(RuntimeError, match="cannot go on .interrupted mid-turn by KeyboardInterrupt"):
            session.send("Thanks")


@pytest.mark.parametrize(("model_type", "kw", "reason"), [
    ("minimax", dict(num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"],
                     num_local_experts=2, num_experts_per_tok=1),
     "keeps its keys and values in a cache class of its own"),
    ("mpt", dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=512, expansion_ratio=2),
     "does not route attention through transformers' AttentionInterface"),
    ("dbrx", dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=512, attn_config={"kv_n_heads": 2, "rope_theta": 1e4},
                  ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 2, "moe_top_k": 1}),
     "has no attention module kvpress recognizes"),
    ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512), "has no attention module kvpress recognizes"),
])  # fmt: skip
def test_unsupported_families_are_refused_for_their_own_reason(model_type, kw, reason):
    """MiniMax failed at its first forward on transformers' cache-type error, about a cache the user never passed;
    MPT and DBRX were said to hold other models (their attn_config and ffn_config are settings); GPT-2 was said to
    have no attention module with a `layer_idx` (it has: kvpress finds them by name)."""
    model = build(model_type, **kw)
    with pytest.raises(TypeError, match=reason):
        with SnapKVPress(compression_ratio=0.5)(model):
            pass
    assert model.config._attn_implementation in ("sdpa", "eager")


def test_partial_and_half_width_rotations_are_re_rotated_and_their_output_projections_found():
    """Phi, StableLM and Persimmon rotate the first features alone (split off before the rotation), GPT-OSS with cos
    and sin half the head wide: the half-split check fed them a whole head and refused rerotate=True and
    ExpectedAttention for a layout they have. CriticalKV read `o_proj` (Phi's is `dense`, OPT's `out_proj`)."""
    phi = build("phi", num_key_value_heads=2, num_hidden_layers=1)
    nxt = torch.tensor([[7]])
    cache = DynamicCache(config=phi.config)
    with torch.no_grad(), SinkWindowPress(n_sink=4, window=12, rerotate=True)(phi):
        phi(IDS, cache=cache)
        pressed = phi(nxt, cache=cache).logits[:, -1]
    with torch.no_grad():  # (one layer: the held keys are those a run of the held tokens alone makes, at their ranks)
        fresh = phi(torch.cat([IDS[:, :4], IDS[:, -12:], nxt], dim=-1)).logits[:, -1]
    assert (pressed - fresh).abs().max() < 1e-5
    from kvpress.patches import model_access

    smol = build("smollm3", num_key_value_heads=2, num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0])
    with pytest.raises(TypeError, match=r"rotates no key in its layers \[3\]"):  # (its keys there were moved too)
        with SinkWindowPress(compression_ratio=0.5, rerotate=True)(smol):
            pass
    model_access.check_half_split_rope(build("gpt_oss", num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                             num_experts_per_tok=2, layer_types=["full_attention"] * 2))  # fmt: skip
    from kvpress.presses import press_from_name

    for family, kw in (("phi", {"num_key_value_heads": 2}), ("opt", {"ffn_dim": 128, "word_embed_proj_dim": 64}),
                       ("gpt_neox", {"rotary_pct": 0.25})):  # fmt: skip
        model = build(family, **kw)
        plain = model.generate(IDS, max_new_tokens=4, do_sample=False, pad_token_id=0)
        for spec in ("criticalkv:window_size=4", "expected-attention"):
            if family == "opt" and spec == "expected-attention":
                continue  # (learned positions: no RoPE to model the queries with, refused)
            with press_from_name(f"{spec}:compression_ratio=0.0")(model):
                assert torch.equal(model.generate(IDS, max_new_tokens=4, do_sample=False, pad_token_id=0), plain)
            cache = DynamicCache(config=model.config)
            with press_from_name(f"{spec}:compression_ratio=0.5")(model):
                model(IDS, cache=cache)
            assert cache.layers[0].n == 20


def test_a_hybrid_models_other_layer_kinds_are_named_in_refusals():
    """Qwen3-Next's layer 0 is a linear-attention one: the half-split check looked at layer 0 (a bare KeyError: 0
    for ExpectedAttention and every rerotate=True), and the refusals said "sliding-window layers"."""
    model = build("qwen3_next", num_key_value_heads=2, head_dim=16, linear_num_value_heads=2, linear_num_key_heads=2,
                  linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=32,
                  layer_types=["linear_attention", "full_attention"])  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (its linear-attention kernels fall back to PyTorch)
        with pytest.raises(ValueError, match=r"layers of other kinds than full attention \(linear_attention\)"):
            with SinkWindowPress(compression_ratio=0.5, rerotate=True)(model):
                pass
        from kvpress.presses import ExpectedAttentionPress, PyramidKVPress

        with pytest.raises(ValueError, match=r"has layers of other kinds \(linear_attention\)"):
            with PyramidKVPress(SnapKVPress(compression_ratio=0.5))(model):
                pass
        cache = DynamicCache(config=model.config)
        with ExpectedAttentionPress(compression_ratio=0.5)(model):
            model(IDS, cache=cache)
        assert cache.layers[1].n == 20


def test_layers_whose_forward_skips_rope_are_found_by_their_keys_and_llama4s_decoder_by_its_model():
    """EXAONE 4's full-attention layers beside sliding ones skip RoPE on a condition of their own (no `use_rope`):
    ExpectedAttention rotated their query statistics as the other layers'. Llama 4's text model was said to have no
    rotary embedding (`get_decoder()` returns the model itself): its refusal now names its layout."""
    from kvpress.patches import model_access
    from kvpress.presses import ExpectedAttentionPress

    exaone = build("exaone4", num_key_value_heads=2, num_hidden_layers=4, sliding_window=8,
                   layer_types=["sliding_attention"] * 3 + ["full_attention"])  # fmt: skip
    assert model_access.unrotated_layers(exaone) == [3]
    with pytest.raises(TypeError, match=r"rotates no key in its layers \[3\]"):
        with ExpectedAttentionPress(compression_ratio=0.5)(exaone):
            pass
    assert model_access.unrotated_layers(build("llama")) == []
    llama4 = build("llama4_text", num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
                   intermediate_size_mlp=128)  # fmt: skip
    assert model_access.decoder_layers(llama4) is llama4.model.layers
    with pytest.raises(TypeError, match="does not rotate its keys in transformers' half-split RoPE layout"):
        model_access.check_half_split_rope(llama4)  # (a press refuses its chunked-attention layers first)


def test_layers_that_rotate_no_key_are_found_under_accelerates_offloading_which_is_left_as_it_was(tmp_path):
    """Offloaded weights wait on `meta`: the probe built its input there, failed, and took every layer as rotating
    (ExpectedAttention accepted on an offloaded EXAONE 4), and under `cpu_offload` left each q_proj's weights loaded.
    It runs on the layer's execution device, with an offloaded layer's weights brought in and sent back."""
    from accelerate import cpu_offload

    from kvpress.patches import model_access

    kw = dict(num_key_value_heads=2, num_hidden_layers=4, sliding_window=8,
              layer_types=["sliding_attention"] * 3 + ["full_attention"])  # fmt: skip
    build("exaone4", **kw).save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                  **{f"model.layers.{i}": "cpu" if i < 2 else "disk" for i in range(4)}}  # fmt: skip
    offloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map, dtype=torch.float32,
                                                     offload_folder=tmp_path / "offload").eval()  # fmt: skip
    hooked = build("exaone4", **kw)
    cpu_offload(hooked, execution_device=torch.device("cpu"))
    for model in (offloaded, hooked):
        where = [m.q_proj.weight.device.type for m in model_access.attention_modules(model).values()]
        assert model_access.unrotated_layers(model) == [3]
        assert [m.q_proj.weight.device.type for m in model_access.attention_modules(model).values()] == where
        with pytest.raises(TypeError, match=r"rotates no key in its layers \[3\]"):
            with SinkWindowPress(compression_ratio=0.5, rerotate=True)(model):
                pass
