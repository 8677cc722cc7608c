"""Installing a press patches one model for one block and leaves it exactly as it was."""

import pytest
import torch
from transformers import DynamicCache, StaticCache, T5Config, T5ForConditionalGeneration
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from kvpress import AdaKVPress, HeavyHitterPress, SnapKVPress
from tiny import prompt, tiny_model


def _snapshot(model):
    forwards = {name: getattr(m.forward, "__func__", m.forward) for name, m in model.named_modules()}
    hooks = {name: (len(m._forward_pre_hooks), len(m._forward_hooks)) for name, m in model.named_modules()}
    return forwards, hooks, model.config.to_dict()


def _registered():
    return {
        n
        for n in list(AttentionInterface._global_mapping) + list(AttentionMaskInterface._global_mapping)
        if n.startswith("kvpress")
    }


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_model_restored(attn):
    model = tiny_model("llama", attn)
    ids = prompt(1, 40)
    before, logits = _snapshot(model), model(ids).logits
    with SnapKVPress(compression_ratio=0.5, window_size=4)(model):
        assert model.config._attn_implementation.startswith("kvpress")
        model.generate(ids, max_new_tokens=5, do_sample=False)
    assert _snapshot(model) == before
    assert model.config._attn_implementation == attn
    assert torch.equal(model(ids).logits, logits)
    assert not _registered()


def test_restored_after_exception():
    model = tiny_model("llama")
    before = _snapshot(model)
    with pytest.raises(KeyError, match="boom"), SnapKVPress(compression_ratio=0.5)(model):
        model(prompt(1, 8))
        raise KeyError("boom")
    assert _snapshot(model) == before
    assert not _registered()


def test_restored_after_error_inside_forward():
    model = tiny_model("llama")
    before = _snapshot(model)
    with pytest.raises(TypeError, match="StaticCache"), SnapKVPress(compression_ratio=0.5)(model):
        model(prompt(1, 8), cache=StaticCache(config=model.config, max_cache_len=16))
    assert _snapshot(model) == before


def test_second_press_refused():
    model = tiny_model("llama")
    with SnapKVPress(compression_ratio=0.5)(model):
        with pytest.raises(RuntimeError, match="already active"):
            with SnapKVPress(compression_ratio=0.25)(model):
                pass
    assert model.config._attn_implementation == "sdpa"


def test_unsupported_models():
    with pytest.raises(TypeError, match="Linear"):
        SnapKVPress(compression_ratio=0.5)(torch.nn.Linear(2, 2))
    config = T5Config(vocab_size=32, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    with pytest.raises(TypeError, match="T5ForConditionalGeneration"):
        SnapKVPress(compression_ratio=0.5)(T5ForConditionalGeneration(config))
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 300}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 32, "patch_size": 16}  # fmt: skip
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4))
    before = _snapshot(model)
    with pytest.raises(TypeError, match=r"holds other models besides its text decoder \(vision_config\)"):
        SnapKVPress(compression_ratio=0.5)(model)  # its vision tower's attention would have been routed too
    assert _snapshot(model) == before
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    shared = Gemma4ForCausalLM(Gemma4TextConfig(**{**text, "num_hidden_layers": 3}, num_kv_shared_layers=1,
                                                layer_types=["full_attention"] * 3))  # fmt: skip
    before = _snapshot(shared)
    with pytest.raises(TypeError, match=r"reuses earlier layers' keys and values in 1 of its layers"):
        SnapKVPress(compression_ratio=0.5)(shared)  # its reusing layer would read the producer's compressed slots
    assert _snapshot(shared) == before
    from transformers.models.mistral_large4.configuration_mistral_large4 import MistralLarge4TextConfig

    from kvpress.patches.model_access import _kv_reusing_layers

    # (Mistral Large 4 shares through kv_source_layers, with no num_kv_shared_layers; too large to build here)
    assert _kv_reusing_layers(MistralLarge4TextConfig(num_hidden_layers=4, kv_source_layers=[0, 0, 2, 2])) == 2


def test_rerotate_refused_with_sliding_layers():
    with pytest.raises(ValueError, match="rerotate=True is not supported on Gemma3ForCausalLM"):
        SnapKVPress(compression_ratio=0.5, rerotate=True)(tiny_model("gemma3"))


def test_use_cache_false_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="use_cache=True"), SnapKVPress(compression_ratio=0.5)(model):
        model(prompt(1, 8), use_cache=False)


def test_presses_run_with_autograd_enabled():
    """A forward with gradients on (training code, a probe) compresses as under no_grad, and a decoding step over
    the compressed layers (head-wise ones too) runs; logits keep their grad."""
    with torch.inference_mode(False), torch.enable_grad():
        model = tiny_model("llama", intermediate_size=96)  # parameters made outside inference mode
        ids = prompt(1, 40)
        for press in (HeavyHitterPress(compression_ratio=0.5), AdaKVPress(HeavyHitterPress(compression_ratio=0.5))):
            cache = DynamicCache(config=model.config)
            with press(model):
                logits = model(ids, cache=cache).logits
                step = model(ids[:, -1:], cache=cache).logits  # a decoding step over the compressed layers
            assert logits.requires_grad and sum(layer.n if hasattr(layer, "n") else 0 for layer in cache.layers) < 80
            assert step.requires_grad
            (logits.sum() + step.sum()).backward()


def test_restored_when_the_restore_is_interrupted(monkeypatch):
    """Ctrl-C while the exit waits for another thread's forward (or a step of the restore that raises): every other
    step of the restore still runs, then the interrupt goes on."""
    import threading

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    model = tiny_model("llama")
    before = _snapshot(model)
    with pytest.raises(KeyboardInterrupt), SnapKVPress(compression_ratio=0.5)(model):
        model(prompt(1, 8), cache=DynamicCache(config=model.config))
        monkeypatch.setattr(threading.Condition, "wait_for", interrupted)
    assert _snapshot(model) == before and not _registered()
    monkeypatch.undo()
    with SnapKVPress(compression_ratio=0.5)(model):  # not "a press is already active"
        model(prompt(1, 8), cache=DynamicCache(config=model.config))


def test_a_refused_forward_leaves_the_cache_as_it_was():
    """A press refused before its forward runs (here: a dense press on a head-wise cache) does not leave the cache
    marked as one a press drives: a forward outside any press is then refused as any compressed cache's is."""
    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    with AdaKVPress(SnapKVPress(compression_ratio=0.5, window_size=4))(model):
        model(prompt(1, 40), cache=cache)
    with pytest.raises(ValueError, match="SnapKVPress cannot continue it"), SnapKVPress(compression_ratio=0.5)(model):
        model(prompt(1, 4, seed=1), cache=cache)
    assert not any(getattr(layer, "driven", True) for layer in cache.layers)
    with pytest.raises(RuntimeError, match="continue it inside `with press"):  # (it attended to itself alone)
        model(prompt(1, 1, seed=2), cache=cache)


def test_the_decoder_called_alone_under_an_active_press_is_said_uncompressed():
    """The press acts through the model's forward: `model.model(...)` (for hidden states, say) filled a plain cache
    without a word. It is said once per installation; the model's own forward is not."""
    import warnings

    model, ids = tiny_model("llama"), prompt(length=40)
    with warnings.catch_warnings(record=True) as said, SnapKVPress(compression_ratio=0.5, window_size=4)(model):
        warnings.simplefilter("always")
        cache = DynamicCache(config=model.config)
        model(ids, cache=cache, use_cache=True)
        assert not said and cache.layers[0].n == 20
        alone = model.model(ids, use_cache=True).past_key_values
        model.model(ids, use_cache=True)
    assert alone.get_seq_length() == 40  # not compressed, as said
    outside = [w for w in said if "outside the model's own forward" in str(w.message)]
    assert len(outside) == 1 and "Call the model itself" in str(outside[0].message)
