"""Installing a press patches one model for one block and leaves it exactly as it was."""

import copy

import pytest
import torch
from transformers import DynamicCache, StaticCache, T5Config, T5ForConditionalGeneration
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

import kvpress
from kvpress import AdaKVPress, HeavyHitterPress, SnapKVPress
from tiny import CONFIGS, prompt, tiny_model


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
    with pytest.raises(TypeError, match="StaticCache.*cache_implementation unset or 'dynamic'"), \
            SnapKVPress(compression_ratio=0.5)(model):
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
    # with a cache given too: generate re-fed the whole text each step, the press compressed a cache nothing read,
    # and the answer was the uncompressed model's, without a word
    with pytest.raises(ValueError, match="use_cache=True"), SnapKVPress(compression_ratio=0.5)(model):
        model.generate(prompt(1, 40), cache=DynamicCache(config=model.config), use_cache=False, max_new_tokens=2,
                       do_sample=False, pad_token_id=0)  # fmt: skip


def test_gradient_checkpointing_in_training_mode_is_refused_by_name():
    """transformers hands each checkpointed layer cache=None: the attention then said 'the cache seen by the
    attention is not the one the press prepared; pass it by keyword', though none was passed. In eval mode the
    press runs."""
    with torch.inference_mode(False), torch.enable_grad():
        model = tiny_model("llama", intermediate_size=80)  # (its own: checkpointing is switched off after)
        model.activation_checkpointing_enable()
        model.train()
        try:
            ids = prompt(1, 30)
            with pytest.raises(ValueError, match="gradient checkpointing in training mode"):
                with SnapKVPress(compression_ratio=0.5, window_size=4)(model):
                    model(ids, labels=ids)
            model(ids, labels=ids).loss.backward()  # the model is as it was
            model.eval()
            cache = DynamicCache(config=model.config)
            with SnapKVPress(compression_ratio=0.5, window_size=4)(model):
                model(ids, cache=cache)
            assert cache.layers[0].n == 15
        finally:
            model.activation_checkpointing_disable()
            model.eval()


def test_presses_run_with_autograd_enabled():
    """A forward with gradients on (training code, a probe) compresses as under no_grad, and a decoding step over
    the compressed layers (head-wise ones too) runs; logits keep their grad. A backward through the prefill gives
    the gradients of the model without a press (the eviction comes after its attention); one through a later forward
    raises a clear error (it attended to slots the press gathered without autograd and later steps overwrite in
    place: torch's own error named an in-place AsStrided after 2 steps, and a gradient into the kept tokens was
    silently missing), pressed or plain after the block."""
    with torch.inference_mode(False), torch.enable_grad():
        model = tiny_model("llama", intermediate_size=96)  # parameters made outside inference mode
        ids = prompt(1, 40)
        model(ids, cache=DynamicCache(config=model.config)).logits.sum().backward()
        plain = {name: p.grad.clone() for name, p in model.named_parameters()}
        for press in (HeavyHitterPress(compression_ratio=0.5), AdaKVPress(HeavyHitterPress(compression_ratio=0.5))):
            cache = DynamicCache(config=model.config)
            model.zero_grad()
            with press(model):
                logits = model(ids, cache=cache).logits
                steps = [model(ids[:, i : i + 1], cache=cache).logits for i in range(3)]  # over compressed layers
            assert logits.requires_grad and sum(layer.n if hasattr(layer, "n") else 0 for layer in cache.layers) < 80
            logits.sum().backward()
            assert all(torch.allclose(p.grad, plain[name], atol=1e-6) for name, p in model.named_parameters())
            for step in steps:
                assert step.requires_grad
                with pytest.raises(RuntimeError, match="no gradient flows through a compressed cache"):
                    step.sum().backward()
        # only the last layer's value projection trained (its query carries no gradient): refused alike (it was
        # not, and the held tokens' share of the gradient was silently dropped)
        last = f"layers.{model.config.num_hidden_layers - 1}.self_attn.v_proj"
        for name, p in model.named_parameters():
            p.requires_grad_(last in name)
        cache = DynamicCache(config=model.config)
        with SnapKVPress(compression_ratio=0.5, window_size=4)(model):
            model(ids, cache=cache)
            step = model(ids[:, :1], cache=cache).logits
        with pytest.raises(RuntimeError, match="no gradient flows through a compressed cache"):
            step.sum().backward()
        for p in model.parameters():
            p.requires_grad_(True)
        # slots written without autograd (a prefill under no_grad) are constants: a backward through later forwards
        # gives their gradients, also once a later step has written into the storage in place (it was refused,
        # or torch's in-place error before that)
        cache = DynamicCache(config=model.config)
        press = SnapKVPress(compression_ratio=0.5, window_size=4)
        with press(model):
            with torch.no_grad():
                model(ids, cache=cache)
            again = copy.deepcopy(cache)
            model.zero_grad()
            model(ids[:, :2], cache=again).logits.sum().backward()  # alone
            alone = {name: p.grad.clone() for name, p in model.named_parameters()}
            first = model(ids[:, :2], cache=cache).logits
            model(ids[:, 2:3], cache=cache)  # (appended in place into the storage `first` attended to)
        model.zero_grad()
        first.sum().backward()
        assert all(torch.equal(p.grad, alone[name]) for name, p in model.named_parameters())
        dense = DynamicCache(config=model.config)  # a plain forward over a compressed cache, after the block
        with HeavyHitterPress(compression_ratio=0.5)(model):
            model(ids, cache=dense)
        after = model(ids[:, :1], cache=dense).logits
        model(ids[:, 1:2], cache=dense)  # (writes in place into what `after` attended to)
        with pytest.raises(RuntimeError, match="no gradient flows through a compressed cache"):
            after.sum().backward()


def test_a_cache_filled_under_inference_mode_goes_on_outside_it(tmp_path):
    """A pressed cache filled under torch.inference_mode() (`kvpress.stream`'s was) is continued outside it, with
    the press or without, dense or head-wise, as one filled under no_grad (torch refused the in-place writes into
    inference tensors: 'Inplace update to inference tensor outside InferenceMode', the layers torn)."""
    with torch.inference_mode(False):  # (the tests run inside inference mode: conftest)
        _filled_in_inference_mode(tmp_path)


def _filled_in_inference_mode(tmp) -> None:
    model = tiny_model("llama")
    ids = prompt(1, 80)
    for press in (SnapKVPress(compression_ratio=0.5, window_size=4), AdaKVPress(SnapKVPress(compression_ratio=0.5))):
        answers = []
        for mode in (torch.inference_mode, torch.no_grad):
            cache = DynamicCache(config=model.config)
            with mode(), press(model):
                out = model.generate(ids, cache=cache, max_new_tokens=3, do_sample=False, pad_token_id=0)
            more = torch.cat([out, out.new_tensor([[5, 6]])], dim=1)
            with torch.no_grad(), press(model):
                answers.append(model.generate(more, cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=0))
        assert torch.equal(*answers)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode(), SnapKVPress(compression_ratio=0.5, window_size=4)(model):
        model(ids, cache=cache)
    with torch.no_grad():
        model(ids[:, :1], cache=cache)  # a plain forward, outside the press
        model(ids[:, 1:2], cache=cache)
    assert [layer.seen for layer in cache.layers] == [82, 82]
    for press in (SnapKVPress(compression_ratio=0.5, window_size=4), AdaKVPress(SnapKVPress(compression_ratio=0.5))):
        saved = tmp / f"{type(press).__name__}.safetensors"  # a saved cache loaded under inference mode
        cache = DynamicCache(config=model.config)
        with torch.no_grad(), press(model):
            model(ids, cache=cache)
        kvpress.save_cache(cache, saved, model)
        with torch.inference_mode():
            cache = kvpress.load_cache(saved, model)
        with torch.no_grad(), press(model):
            model(ids[:, :1], cache=cache)
        assert [layer.seen for layer in cache.layers] == [81, 81]
    cache = DynamicCache(config=model.config)  # re-rotated keys: rotated in place before any layer's update
    rerotating = kvpress.SinkWindowPress(n_sink=4, window=16, rerotate=True)
    with torch.inference_mode(), rerotating(model):
        model(ids, cache=cache)
    with torch.no_grad(), rerotating(model):
        model(ids[:, :1], cache=cache)
    assert [layer.seen for layer in cache.layers] == [81, 81]
    cache = DynamicCache(config=model.config)
    sink = kvpress.SinkWindowPress(n_sink=4, window=16)
    list(kvpress.stream(model, None, ids[0, :64], press=sink, cache=cache, chunk=16, progress=False))
    with torch.no_grad(), sink(model):
        model(ids[:, 64:65], cache=cache)
    assert [layer.seen for layer in cache.layers] == [65, 65]


def test_a_compiled_wrapper_is_refused_by_name():
    """torch.compile's wrapper passes attribute lookups to the model, so a press installed on it was taken, and
    its generate kept the whole cache (the wrapper's forward never reaches the press); it is refused, naming what
    works: the model it wraps (called compiled inside the block), or model.compile()."""
    model = tiny_model("llama")
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(TypeError, match=r"torch.compile's wrapper of a LlamaForCausalLM.*_orig_mod"):
        SnapKVPress(compression_ratio=0.5)(compiled).__enter__()
    assert _snapshot(model) == _snapshot(tiny_model("llama")) and not _registered()


def test_an_attention_implementation_switched_inside_the_block_is_refused():
    """set_attn_implementation inside a press's block routed attention past the press: a forward compressed
    nothing, silently, and left the cache's layers pending ('left half-updated' at the next forward). The forward is
    refused, naming the switch, and the cache stays usable."""
    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    with SnapKVPress(compression_ratio=0.5, window_size=4)(model):
        model.set_attn_implementation("eager")
        with pytest.raises(RuntimeError, match="attention implementation was set to 'eager' inside the press"):
            model(prompt(1, 40), cache=cache)
    assert model.config._attn_implementation == "eager"  # (the caller's switch stands)
    model.set_attn_implementation("sdpa")
    with SnapKVPress(compression_ratio=0.5, window_size=4)(model):
        model(prompt(1, 40), cache=cache)
    assert [layer.n for layer in cache.layers] == [20, 20]


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


def _fresh(family: str = "llama"):
    """A tiny model of its own (not `tiny_model`'s shared one: these tests leave presses half-way on purpose)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIGS[family](), attn_implementation="sdpa", dtype=torch.float32).eval()


def test_press_blocks_left_out_of_order_leave_the_other_active():
    """Two sessions' generators, each inside `with press(model):` on its own model, closed in the order they began:
    leaving the first reset the caller's state to what it was before the first began, which switched the second off
    (its forwards ran uncompressed, without a word) and kept the first's state (and model) alive."""
    import gc
    import weakref

    from kvpress import KnormPress
    from kvpress.patches.intercept import _ACTIVE

    def session(model):
        cache = DynamicCache(config=model.config)
        with KnormPress(compression_ratio=0.5)(model):
            while True:
                model((yield cache), cache=cache)

    a, b = _fresh(), _fresh()
    first, second = session(a), session(b)
    next(first)
    cache = next(second)
    first.close()
    second.send(prompt(1, 40))
    assert [layer.n for layer in cache.layers] == [20, 20]
    second.close()
    assert _ACTIVE.get() is None
    gone = weakref.ref(a)
    del a, first
    gc.collect()
    assert gone() is None


def test_two_threads_entering_presses_on_one_model_let_one_in():
    """The check that no press is active and the switch that marks one were apart: two threads could both get in
    (each wrapping the model's forward, one left on the model afterwards). The second now waits and is refused."""
    import threading

    from kvpress.patches import intercept

    model = _fresh()
    inside, go, tried, refused = threading.Event(), threading.Event(), threading.Event(), []
    register = intercept.register

    def held(*args):  # the first install stops between the check and the switch until the second has tried
        if not inside.is_set():
            inside.set()
            go.wait(10)
        return register(*args)

    def enter(first: bool):
        try:
            with SnapKVPress(compression_ratio=0.5)(model):
                if first:
                    tried.wait(10)  # (in until the second has tried)
        except RuntimeError as error:
            refused.append(str(error))
        finally:
            if not first:
                tried.set()

    intercept.register = held
    try:
        threads = [threading.Thread(target=enter, args=(first,)) for first in (True, False)]
        threads[0].start()
        inside.wait(10)
        threads[1].start()
        threads[1].join(0.5)
        second_waited = threads[1].is_alive()
        go.set()
        for thread in threads:
            thread.join(10)
    finally:
        intercept.register = register
    assert second_waited and len(refused) == 1 and "a press is already active" in refused[0]
    assert "forward" not in vars(model) and model.config._attn_implementation == "sdpa"


def test_after_the_press_is_left_its_old_forward_runs_plainly_and_a_registered_sdpa_runs_inside():
    """A thread holding the model's wrapped forward (or a copy of the press's context) past the block's end drove
    the cache as if the press were on (its next step: 'left half-updated'); it runs plainly now. And a user's own
    registration of "sdpa" ran for no layer while a press was installed (transformers' sdpa ran instead)."""
    import contextvars

    from kvpress import KnormPress

    model, ids = _fresh(), prompt(1, 12)
    plain = model(ids).logits
    with KnormPress(compression_ratio=0.5)(model):
        wrapped, context = model.forward, contextvars.copy_context()
    cache = DynamicCache(config=model.config)
    out = context.run(wrapped, ids, cache=cache)
    assert torch.equal(out.logits, plain) and cache.get_seq_length() == 12
    context.run(wrapped, prompt(1, 1), cache=cache)  # (raised: 'left half-updated by a forward that raised')
    assert cache.get_seq_length() == 13 and type(cache.layers[0]).__name__ == "DynamicLayer"
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []

    def counted(module, *args, **kwargs):
        calls.append(module.layer_idx)
        return sdpa_attention_forward(module, *args, **kwargs)

    AttentionInterface.register("sdpa", counted)
    try:
        with KnormPress(compression_ratio=0.5)(model):
            model(ids[:, :4])  # (no eviction yet: the layers run the model's own attention)
    finally:
        AttentionInterface.register("sdpa", sdpa_attention_forward)
    assert calls == [0, 1]


def test_a_model_with_a_press_installed_is_not_copied_and_a_shared_config_model_is_not_warned_about():
    import copy
    import warnings

    from kvpress import KnormPress

    model = _fresh()
    with KnormPress(compression_ratio=0.5)(model), pytest.raises(TypeError, match="cannot be copied or saved whole"):
        copy.deepcopy(model)  # (TypeError: cannot pickle 'generator' object)
    copy.deepcopy(model)
    twin = type(model)(model.config).eval()  # built on the same config object: runs plainly beside it, unsaid
    with warnings.catch_warnings(record=True) as said, KnormPress(compression_ratio=0.5)(model):
        warnings.simplefilter("always")
        twin(prompt(1, 8))
    assert not [w for w in said if "outside the model's own forward" in str(w.message)]


def test_a_forward_still_running_when_the_wait_runs_out_is_said():
    """The exit waits for other threads' forwards up to a limit (60 s), then restores the model under them: it
    said nothing."""
    model = _fresh()
    with SnapKVPress(compression_ratio=0.5)(model) as installed:
        intercept = installed.intercept
        intercept._forwards[-1] = 1  # (a forward of another thread, in flight)
        with pytest.warns(UserWarning, match=r"still running 0.05 s after the press's block ended"):
            intercept.uninstall(wait_s=0.05)
        intercept._forwards.clear()  # (it ended: the block's own exit restores nothing more)
    assert "forward" not in vars(model) and model.config._attn_implementation == "sdpa"


def test_an_install_that_fails_half_way_is_undone_and_the_next_one_runs():
    """The undo runs outside the install lock (it may wait for another thread's forward), and restores all."""
    model = _fresh()
    before = _snapshot(model)

    def refused(name):
        raise RuntimeError("switch refused")

    model.set_attn_implementation = refused
    with pytest.raises(RuntimeError, match="switch refused"), SnapKVPress(compression_ratio=0.5)(model):
        pass
    del model.set_attn_implementation
    assert _snapshot(model) == before and not _registered()
    with SnapKVPress(compression_ratio=0.5)(model):
        assert model.config._attn_implementation.startswith("kvpress")


def test_inputs_a_press_would_misread_are_refused_by_name():
    """1-D or list ids under a press raised IndexError or AttributeError inside the engine; a 2D attention mask
    shorter than the tokens seen + new raised inside the cache, a longer or wider one was read wrongly (its last
    columns taken as the new tokens' padding). Each is refused, naming the shape; the cache is left as it was."""
    model = tiny_model("llama")
    ids = prompt(1, 40)
    cache = DynamicCache(config=model.config)
    with SnapKVPress(compression_ratio=0.5, window_size=4)(model):
        with pytest.raises(ValueError, match=r"input_ids must be a \[batch, tokens\] tensor of token ids, got shape"):
            model(ids[0], cache=cache)
        with pytest.raises(ValueError, match="input_ids must be .*, got list"):
            model(ids[0].tolist(), cache=cache)
        for mask in (torch.ones(1, 30, dtype=torch.long), torch.ones(2, 40, dtype=torch.long),
                     torch.ones(1, 50, dtype=torch.long)):  # fmt: skip
            with pytest.raises(ValueError, match=rf"attention_mask must be \[batch, tokens seen \+ new\] = \[1, 40\]"
                                                 rf" .*, got \[{mask.shape[0]}, {mask.shape[1]}\]"):  # fmt: skip
                model(ids, attention_mask=mask, cache=cache)
        assert cache.get_seq_length() == 0
        model(ids, attention_mask=torch.ones(1, 40, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match=r"= \[1, 41\] .*, got \[1, 1\]"):  # (a step's mask covers every token)
            model(ids[:, :1], attention_mask=torch.ones(1, 1, dtype=torch.long), cache=cache)
        model(ids[:, :1], attention_mask=torch.ones(1, 41, dtype=torch.long), cache=cache)
    assert [layer.seen for layer in cache.layers] == [41, 41]
