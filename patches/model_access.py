"""What kvpress needs to know about a model family, read from transformers' modeling code."""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator

import torch
from accelerate.utils import align_module_device, has_offloaded_params
from torch import nn
from transformers.cache_utils import (
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvpress.patches import rope


def drop_quantizer(model: nn.Module) -> None:
    """Forget how `model`'s weights were stored (a GGUF file's quantizer, once they are dequantised to plain floats),
    so that `save_pretrained` writes them as they are."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


RUNS_ON = "'sdpa', 'eager' or 'flash_attention_2'"  # the attention implementations a press runs on, for messages


def runs_attention(implementation) -> bool:
    """Whether a press runs on the attention implementation named `implementation`: sdpa, eager, flash-attn's."""
    return implementation in ("sdpa", "eager") or (isinstance(implementation, str)
                                                   and implementation.startswith("flash_attention"))  # fmt: skip


def check_is_model(model: nn.Module) -> None:
    """Raise TypeError unless `model` is a transformers PreTrainedModel (what a function given no press reads)."""
    if isinstance(getattr(model, "_orig_mod", None), nn.Module):  # (it passes attribute lookups to the model)
        raise TypeError(f"kvpress needs the transformers model itself, got torch.compile's wrapper of a "
                        f"{type(model._orig_mod).__name__} (a press on it compressed nothing): give the model it wraps "
                        "(`compiled._orig_mod`; the compiled one may be called inside a press's block), or compile "
                        "in place with model.compile()")  # fmt: skip
    if getattr(model, "config", None) is None or not hasattr(model, "_can_set_attn_implementation"):
        raise TypeError(f"kvpress needs a transformers PreTrainedModel, got {type(model).__name__}")


def check_supported(model: nn.Module) -> None:
    """Raise TypeError unless `model` is a decoder-only transformers model using `AttentionInterface`."""
    check_is_model(model)
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise TypeError(f"{type(model).__name__} is an encoder-decoder model; kvpress supports decoder-only models")
    own_cache = getattr(model, "_supports_default_dynamic_cache", None)
    if own_cache is not None and not own_cache():  # (MiniMax: its forward refuses any other cache class)
        raise TypeError(f"{type(model).__name__} keeps its keys and values in a cache class of its own, not in "
                        "transformers' DynamicCache, whose layers kvpress compresses: not supported")  # fmt: skip
    if not model._can_set_attn_implementation():
        raise TypeError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, "
            "so kvpress cannot intercept it"
        )
    if not attention_modules(model):
        raise TypeError(f"{type(model).__name__} has no attention module kvpress recognizes (a `self_attn` or "
                        "`attention` module with an integer `layer_idx`, as Llama's): not supported")  # fmt: skip
    towers = [key for key in getattr(config, "sub_configs", {}) if key not in ("text_config", "decoder")
              and getattr(config, key, None) is not None]  # fmt: skip
    if towers:  # its attention implementation is set for every sub-model: the tower's attention would be routed too
        raise TypeError(f"{type(model).__name__} holds other models besides its text decoder ({', '.join(towers)}); "
                        "kvpress compresses a text decoder's cache: load the text model alone (its ForCausalLM "
                        "class on the text config)")  # fmt: skip
    shared = _kv_reusing_layers(config.get_text_config())
    if shared:  # (Gemma 3n, Gemma 4, Mistral Large 4: a reusing layer attends over another layer's keys)
        raise TypeError(f"{type(model).__name__} reuses earlier layers' keys and values in {shared} of its layers "
                        "(kv_sharing_modes): kvpress compresses each layer's own cache, and a reusing layer "
                        "would attend over another layer's compressed slots with a mask made for the whole cache: "
                        "not supported")  # fmt: skip


def _kv_reusing_layers(config) -> int:
    """How many layers of a text config read another layer's keys and values instead of caching their own."""
    try:
        modes = getattr(config, "kv_sharing_modes", None) or ()
    except (ValueError, TypeError, IndexError):  # (a config whose sharing does not add up: its count says enough)
        modes = ()
    reusing = sum(1 for mode in modes if isinstance(mode, str) and mode.startswith("reuse"))
    return reusing or getattr(config, "num_kv_shared_layers", 0) or 0


def attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """The self-attention modules by layer index."""
    found = {}
    for name, module in model.named_modules():
        if name.endswith(("self_attn", "attention")) and isinstance(getattr(module, "layer_idx", None), int):
            found[module.layer_idx] = module
    return found


def text_config(model: nn.Module):
    return model.config.get_text_config(decoder=True)


def kv_heads(model: nn.Module) -> int:
    """The KV heads of each attention layer (the attention heads where the config names none: GPT-NeoX, OPT)."""
    return _kv_heads_of(text_config(model))


def _kv_heads_of(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def caches_latents(model: nn.Module) -> bool:
    """Whether `model`'s cache holds multi-head latent attention's latents (DeepSeek-V2/V3, MiniCPM3: one compressed
    "head" a layer, expanded to its attention heads after the cache) instead of each KV head's keys and values."""
    return any(hasattr(module, "kv_lora_rank") for module in attention_modules(model).values())


def cached_value_shape(model: nn.Module) -> tuple[int, int]:
    """(heads, size) of what each attention layer caches as values: its KV heads and head size, or where the cache
    holds latents, the one head of each token's rotated key part (DeepSeek-V3 caches its latent as keys and that
    part as values)."""
    if caches_latents(model):
        return 1, next(iter(attention_modules(model).values())).qk_rope_head_dim
    return kv_heads(model), head_dim(model)


def check_reads_keys(model: nn.Module, who: str) -> None:
    """Raise TypeError where `model`'s cache holds latents (`caches_latents`): `who` reads each head's keys, values or
    queries (or budgets each KV head), which such a cache does not hold."""
    if caches_latents(model):
        raise TypeError(f"{type(model).__name__} caches multi-head latent attention's latents (one compressed head a "
                        "layer, expanded to its attention heads after the cache), not each head's keys and values: "
                        f"{who} reads each head's keys, values or queries (or budgets each KV head), which it cannot "
                        "there; only presses that choose by position alone run on it (SinkWindowPress, RandomPress, "
                        "and ChunkKV, PyramidKV or ShotKV over them)")


def head_dim(model: nn.Module) -> int:
    """The size of one attention head's keys."""
    config = text_config(model)
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def cache_keyword(model: nn.Module) -> str:
    """The keyword this transformers version's forward takes the cache under."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_cache(model: nn.Module) -> DynamicCache:
    return DynamicCache(config=model.config)


def complete_layers(cache: DynamicCache, model: nn.Module) -> None:
    """Create the layers a lazily-built DynamicCache has not made yet, with the model's layer types."""
    n_layers = text_config(model).num_hidden_layers
    if len(cache.layers) < n_layers:
        cache.layers.extend(new_cache(model).layers[len(cache.layers) : n_layers])


def seen_tokens(layer) -> int | None:
    """Tokens a cache layer has taken, or None for a layer that keeps no count of them (transformers 5.24's
    linear-attention layers: recurrent and convolution states)."""
    count = getattr(layer, "get_seq_length", None)
    return None if count is None else count()


def holds_state(layer) -> bool:
    """Whether a cache layer holds anything of a forward: tokens, or a linear-attention layer's states (transformers'
    `has_previous_state`, which a forward sets and `reset()` clears)."""
    seen = seen_tokens(layer)
    return bool(seen) if seen is not None else any(getattr(layer, "has_previous_state", {}).values())


def is_plain_layer(layer) -> bool:
    """A layer of transformers' own that a `PressedLayer` takes over: full attention or a sliding window."""
    return type(layer) in (DynamicLayer, DynamicSlidingWindowLayer)


def compressible_layers(model: nn.Module) -> list[int]:
    """The layers whose cache a press can compress: the full-attention and sliding-window ones (`layer_types`)."""
    return [i for i, kind in enumerate(layer_types(model)) if kind in ("full_attention", "sliding_attention")]


def inner_attention(model: nn.Module, implementation: str, module: nn.Module):
    """The attention function `implementation` resolves to for `module` (eager is per model family)."""
    if implementation == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[implementation]  # (sdpa too: a user's own registration of it is what runs)


def decoder(model: nn.Module) -> nn.Module:
    """The decoder: `model.get_decoder()`, or `model.model` where that returns the model itself (Llama 4's text
    model names a `base_model_prefix` it has no attribute for)."""
    found = model.get_decoder() if hasattr(model, "get_decoder") else model
    inner = getattr(model, "model", None)
    return inner if found is model and isinstance(inner, nn.Module) else found


def rotary_embedding(model: nn.Module) -> nn.Module:
    """The rotary embedding module of the decoder (shared by all layers)."""
    rotary = getattr(decoder(model), "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        raise TypeError(f"{type(model).__name__} has no rotary embedding kvpress can re-rotate keys with")
    return rotary


def inv_freq(model: nn.Module) -> torch.Tensor:
    return rotary_embedding(model).inv_freq


def dynamic_rope_length(model: nn.Module) -> int | None:
    """The positions a dynamic RoPE rotates with its own frequencies (a forward past them stretches them, and one
    below them sets them back); None for any other RoPE."""
    rotary = rotary_embedding(model)
    return int(rotary.original_max_seq_len) if getattr(rotary, "rope_type", None) == "dynamic" else None


def rerotation_inv_freq(model: nn.Module) -> torch.Tensor:
    """The frequencies re-rotated keys move with: a dynamic RoPE's own (its stretched ones, left by a forward past
    its length before the press was installed, are not what the positions inside a cache rotate with)."""
    rotary = rotary_embedding(model)
    return rotary.original_inv_freq if dynamic_rope_length(model) is not None else rotary.inv_freq


def check_half_split_rope(model: nn.Module, layer_idx: int | None = None) -> None:
    """Raise TypeError unless `model` rotates its keys as `rope.rerotate` and `rope.average_rotation` do
    (transformers' half-split layout, as Llama): a random key its own `apply_rotary_pos_emb` rotates to position 12,
    against the one it rotates to 5 moved on by 7, both with the layer's `inv_freq` (the model's rotary module is
    not called: a dynamic one would change its frequencies). Interleaved pairs (Cohere, GLM) differ, and moving
    their keys as half-split ones would corrupt them. The rotation is called as the families call it: over the rotated
    features, the rest of the head kept (the whole head in Llama; Phi, StableLM, Persimmon split them off before
    calling it, GPT-NeoX's own rotation does), or with cos and sin of half the width (GPT-OSS). `layer_idx`: default
    the first attention layer."""
    modules = attention_modules(model)
    unrotated = unrotated_layers(model)
    if unrotated:  # (SmolLM3's every 4th layer: its held keys re-rotated as the others' were 0.67 off)
        raise TypeError(f"{type(model).__name__} rotates no key in its layers {unrotated} (no RoPE there), and its "
                        "other layers' keys with RoPE: kvpress moves every layer's keys alike, so rerotate=True and "
                        "ExpectedAttentionPress are not supported on it")  # fmt: skip
    layer_idx = min(modules) if layer_idx is None else layer_idx  # (Qwen3-Next's layer 0 is a linear one)
    freqs = layer_inv_freq(model, layer_idx).float()  # refuses a model without RoPE
    apply = getattr(sys.modules[type(modules[layer_idx]).__module__], "apply_rotary_pos_emb", None)
    key = torch.randn(1, 1, 1, head_dim(model), generator=torch.Generator().manual_seed(0)).to(freqs.device)
    rotated = 2 * freqs.numel()

    def split_first(position: int) -> torch.Tensor:  # (the whole head where every feature is rotated)
        angles = torch.cat([position * freqs, position * freqs])[None, None]  # [1, 1, rotated features]
        part = key[..., :rotated]
        return torch.cat([apply(part, part, angles.cos(), angles.sin())[1], key[..., rotated:]], dim=-1)

    def half_width(position: int) -> torch.Tensor:
        angles = (position * freqs)[None, None]
        return apply(key, key, angles.cos(), angles.sin())[1]

    # DeepSeek-V3's rotation is another function (`rope_interleave`), and its cache holds latents (MLA), not keys
    latent = getattr(text_config(model), "rope_interleave", False) or caches_latents(model)
    same = False
    for at in (split_first, half_width) if apply is not None and not latent else ():
        try:
            moved = rope.rerotate(at(5), torch.full((1, 1, 1), 7, device=key.device), freqs)
            same = torch.allclose(moved, at(12), rtol=1e-3, atol=1e-4)
        except (RuntimeError, TypeError, IndexError):  # (its rotation does not take cos and sin of that width)
            continue
        break  # (the first call it takes decides)
    if not same:
        raise TypeError(f"{type(model).__name__} does not rotate its keys in transformers' half-split RoPE layout "
                        "(as Llama, Qwen2, Mistral do), which kvpress re-rotates keys in: rerotate=True and "
                        "ExpectedAttentionPress are not supported on it")  # fmt: skip


class _KeysSeen(Exception):
    def __init__(self, keys: torch.Tensor):
        super().__init__("the probe's keys")
        self.keys = keys


class _KeyProbe:
    """Stands in for the cache in one attention module's forward: what it is given to cache is raised back."""

    def update(self, keys: torch.Tensor, *args, **kwargs):
        raise _KeysSeen(keys)


def unrotated_layers(model: nn.Module) -> list[int]:
    """The attention layers that rotate no key: those whose `use_rope` is off (SmolLM3, Llama 4), and those whose
    keys the layer caches the same at two positions (EXAONE 4's, Afmoe's, Flint's full-attention layers beside
    sliding ones skip RoPE on a condition of their own): each module's own forward is run on one token, with the
    cos and sin of positions 0 and 7, up to its cache's update, which hands the keys back (its attention is not
    run; a module whose forward takes neither width, or cannot run alone, is taken as rotating), on the layer's
    execution device, an offloaded layer's weights brought in for it and sent back."""
    modules = attention_modules(model)
    found = {i for i, module in modules.items() if not getattr(module, "use_rope", True)}
    config = text_config(model)
    generator = torch.Generator().manual_seed(0)
    layered = _has_layers(model)
    for i, module in modules.items() if not caches_latents(model) else ():
        if i in found:
            continue
        try:
            freqs = layer_inv_freq(model, i).float()
        except TypeError:  # (no RoPE at all: not this check's to say)
            return sorted(found)
        # on the layer's execution device, in its compute dtype (an offloaded layer's weights wait on `meta`, a
        # quantized one's are integers), its offloaded weights brought in for the probe and sent back after it
        device = execution_device(model, i) if layered else next(module.parameters()).device
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point() and p.device.type != "meta"),
                     next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32))  # fmt: skip
        layer = decoder_layers(model)[i] if layered else module
        hidden = torch.randn(1, 1, config.hidden_size, generator=generator).to(device, dtype)
        keyword = "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"
        with align_module_device(layer) if has_offloaded_params(layer) else contextlib.nullcontext():
            for width in (2, 1):  # (the rotated features' cos and sin; GPT-OSS takes half of them)
                keys = []
                for position in (0, 7):
                    angles = (position * freqs).repeat(width)[None, None].to(device, dtype)
                    try:
                        with torch.no_grad():
                            module.forward(hidden, position_embeddings=(angles.cos(), angles.sin()),
                                           attention_mask=None, **{keyword: _KeyProbe()})  # fmt: skip
                    except _KeysSeen as seen:
                        keys.append(seen.keys)
                    except Exception:  # (not this width, or not callable alone)
                        break
                if len(keys) == 2:
                    if torch.equal(*keys):
                        found.add(i)
                    break
    return sorted(found)


def _has_layers(model: nn.Module) -> bool:
    try:
        decoder_layers(model)
    except TypeError:
        return False
    return True


def layer_inv_freq(model: nn.Module, layer_idx: int) -> torch.Tensor:
    """The RoPE frequencies layer `layer_idx` rotates with: its layer type's where the rotary embedding keeps one
    per type (Gemma3's local and global layers), else the shared ones."""
    rotary = getattr(decoder(model), "rotary_emb", None)
    per_type = getattr(rotary, f"{layer_types(model)[layer_idx]}_inv_freq", None)
    return per_type if per_type is not None else inv_freq(model)


def layer_types(model: nn.Module) -> list[str]:
    """Each decoder layer's attention kind as transformers' cache sees it: "full_attention" where the cache
    makes a plain `DynamicLayer`, "sliding_attention" where it makes a `DynamicSlidingWindowLayer` for a
    sliding window, else the kind the config names (chunked attention, linear attention, ...), which a press
    leaves alone. The cache, not `config.layer_types` alone, decides: Mistral's `sliding_window` makes every
    layer a sliding one without a `layer_types` entry."""
    config = text_config(model)
    declared, _ = get_layer_types_and_kwargs(config)
    made = new_cache(model).layers
    kinds = []
    for i in range(config.num_hidden_layers):
        named = declared[i] if i < len(declared) else "full_attention"
        if i >= len(made) or type(made[i]) is DynamicLayer:  # a layer the cache makes lazily is a plain one
            kinds.append("full_attention")
        elif type(made[i]) is DynamicSlidingWindowLayer and named == "sliding_attention":
            kinds.append("sliding_attention")
        else:
            kinds.append(named if named not in ("full_attention", "sliding_attention") else "other")
    return kinds


def has_sliding_layers(model: nn.Module) -> bool:
    """Whether some layer of `model` is not a full-attention one (a sliding window, chunked or linear attention)."""
    return any(t != "full_attention" for t in layer_types(model))


def other_layer_kinds(model: nn.Module) -> str:
    """The kinds of `model`'s layers other than full-attention ones, for a message ("sliding_attention, ...")."""
    return ", ".join(sorted({t for t in layer_types(model) if t != "full_attention"}))


def sliding_window(model: nn.Module) -> int | None:
    """The window of the model's sliding-window layers (None: it has none)."""
    if "sliding_attention" not in layer_types(model):
        return None
    return text_config(model).sliding_window


def attention_scaling(module: nn.Module) -> float:
    """The factor an attention module multiplies its query-key products by."""
    return float(module.scaling)


def logit_softcap(module: nn.Module) -> float | None:
    """The tanh cap an attention module applies to its logits (Gemma 2's `attn_logit_softcapping`), or None: only
    where its forward hands it to the attention function (Gemma 3 keeps the attribute from its config and never
    passes it, so its attention is not capped)."""
    cap = getattr(module, "attn_logit_softcapping", None) or None
    return cap if cap is not None and _passes_softcap(type(module)) else None


@functools.cache
def _passes_softcap(cls: type) -> bool:
    """Whether an attention class's forward passes `softcap=` (other than None) to the attention function (its source
    read once; a class whose source cannot be read is taken at its attribute's word). The attention itself takes the
    cap from its call (`headwise_attention`'s `softcap`); the presses' scores, built outside it, from here."""
    try:
        return re.search(r"softcap\s*=\s*(?!None\b)", inspect.getsource(cls.forward)) is not None
    except (OSError, TypeError):
        return True


def layer_index(module: nn.Module) -> int:
    """The decoder layer an attention module belongs to."""
    return module.layer_idx


def layer_count(module: nn.Module) -> int:
    """Decoder layers of the model an attention module belongs to."""
    return module.config.num_hidden_layers


def output_projection(module: nn.Module) -> tuple[torch.Tensor, int]:
    """An attention module's output projection weight `[hidden, query heads x head dim]` (its `o_proj`; `dense` in
    Phi, Persimmon and GPT-NeoX, `out_proj` in OPT) and how many query heads share a KV head."""
    projection = next((p for name in ("o_proj", "dense", "out_proj")
                       if isinstance(getattr(p := getattr(module, name, None), "weight", None), torch.Tensor)),
                      None)  # fmt: skip  (a Linear, or a wrapper of one that shows its weight: PEFT's)
    if projection is None:
        raise TypeError(f"{type(module).__name__} has no output projection kvpress knows (o_proj, dense, out_proj): "
                        "a press that weighs values by it cannot run on it")  # fmt: skip
    groups = getattr(module, "num_key_value_groups", None)
    if groups is None:  # (GPT-NeoX, OPT: every head its own keys and values)
        groups = module.config.num_attention_heads // _kv_heads_of(module.config)
    return projection.weight, groups


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder's layers, in order (the `layers` of `model.get_decoder()` in every supported family)."""
    layers = getattr(decoder(model), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) != text_config(model).num_hidden_layers:
        raise TypeError(f"{type(model).__name__}'s decoder has no `layers` list kvpress can skip layers of")
    return layers


def execution_device(model: nn.Module, layer_idx: int) -> torch.device:
    """Where attention layer `layer_idx` computes, hence where its cache lies: the execution device of accelerate's
    hook on its decoder layer where one is set (an offloaded layer's weights wait on `meta` between forwards), or on
    a module of its attention (`accelerate.cpu_offload` hooks each module that holds weights), else the device of its
    weights."""
    attention = attention_modules(model)[layer_idx]
    for module in (decoder_layers(model)[layer_idx], *attention.modules()):
        device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
        if device is not None:
            return torch.device(device)
    return next(attention.parameters()).device


@contextlib.contextmanager
def skipped_layers(model: nn.Module, skip: Iterable[int]) -> Iterator[None]:
    """Inside this block the decoder layers `skip` pass their hidden states through untouched (no attention, no
    MLP, no cache update) in the thread that entered it: the model runs as a layer-skipped draft of itself there,
    and as itself in any other thread. Each skipped layer's `forward` is an attribute of that instance while the
    block lasts; leaving it, error or not, removes them."""
    skip = sorted(set(skip))
    chosen = [decoder_layers(model)[i] for i in skip] if skip else []
    taken = [layer for layer in chosen if "forward" in vars(layer)]
    if taken:
        raise RuntimeError("a decoder layer's forward is already replaced (a skipped_layers block inside another?)")
    drafting = threading.get_ident()
    try:
        for layer in chosen:
            layer.forward = _passing_through_in(drafting, type(layer).forward.__get__(layer))
        yield
    finally:
        for layer in chosen:
            vars(layer).pop("forward", None)


def _passing_through_in(thread: int, forward: Callable) -> Callable:
    """A layer's `forward` that hands its hidden states back untouched in `thread`, and is `forward` elsewhere."""

    def skipped(hidden_states: torch.Tensor, *args, **kwargs):
        if threading.get_ident() == thread:
            return hidden_states
        return forward(hidden_states, *args, **kwargs)

    return skipped
