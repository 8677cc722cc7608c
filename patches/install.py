"""`PressInstallation`: installs a press on a model for the length of a `with` block.

On entry: registers the intercept under a name of its own, switches the model's attention
implementation to it and adds one forward pre-hook to the model (it finds or makes the cache and
turns its full-attention layers into `PressedLayer`s). On exit, error or not, all three are undone.
Importing kvpress patches nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from kvpress.cache import PressedLayer
from kvpress.head_cache import HeadwiseLayer
from kvpress.patches import attention, model_access, rope
from kvpress.patches.headwise_attention import headwise_attention
from kvpress.presses.base import BasePress, Observation
from kvpress.presses.head_budget import HeadwisePress

_PREFIX = "kvpress_"
_counter = itertools.count()
_DRIVEN = (PressedLayer, HeadwiseLayer)  # the cache layers an installed press drives


class PressInstallation:
    """The context `with press(model):` returns. `frozen()` pauses eviction inside it."""

    def __init__(self, model: nn.Module, press: BasePress) -> None:
        if not isinstance(press, BasePress):
            raise TypeError(f"press must be a kvpress press, got {type(press).__name__}")
        model_access.check_supported(model)
        press.check_model(model)
        if press.rerotate and model_access.has_sliding_layers(model):
            raise ValueError(
                f"rerotate=True is not supported on {type(model).__name__}: its sliding-window layers "
                "keep their own positions, so in-cache positions cannot be shared by all layers"
            )
        n_layers = model_access.text_config(model).num_hidden_layers
        scales = [press.layer_scale(i, n_layers) for i in range(n_layers)]  # raises on a length mismatch
        if press.rerotate and (isinstance(press, HeadwisePress) or any(abs(scale - 1.0) > 1e-9 for scale in scales)):
            raise ValueError(
                f"rerotate=True needs the same budget in every layer and head ({type(press).__name__} gives them "
                "different budgets, so in-cache positions would differ between them)"
            )
        self.model, self.press = model, press
        self.name = f"{_PREFIX}{next(_counter)}"
        self.compressing = True
        self.cache: DynamicCache | None = None
        self._caches: weakref.WeakSet = weakref.WeakSet()
        self._hook = None
        self._original: str | None = None
        self._inner: dict[int, object] = {}

    # ----- install / uninstall ----------------------------------------------------------------------
    def __enter__(self) -> PressInstallation:
        current = self.model.config._attn_implementation
        if current is not None and current.startswith(_PREFIX):
            raise RuntimeError(
                f"a press is already active on this {type(self.model).__name__}; leave its `with` block first"
            )
        if current not in ("sdpa", "eager") and not (current or "").startswith("flash_attention"):
            raise ValueError(
                f"attention implementation {current!r} is not supported; use 'sdpa', 'eager' or 'flash_attention_2'"
            )
        self._original = current
        self._modules = model_access.attention_modules(self.model)
        self._inner = {i: model_access.inner_attention(self.model, current, m) for i, m in self._modules.items()}
        self._cache_key = model_access.cache_keyword(self.model)
        self._inv_freq = model_access.inv_freq(self.model) if self.press.rerotate else None
        attention.register(self.name, self._attention, attention.original_mask_function(current))
        try:
            self.model.set_attn_implementation(self.name)
            self._hook = self.model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.model.config._attn_implementation == self.name:
            self.model.set_attn_implementation(self._original)
        attention.unregister(self.name)
        for cache in list(self._caches):
            for layer in cache.layers:
                if isinstance(layer, _DRIVEN):
                    layer.driven = False
        self.cache = None

    @contextlib.contextmanager
    def frozen(self):
        """Inside this block the cache grows without eviction (for example while a question is read)."""
        previous, self.compressing = self.compressing, False
        try:
            yield self
        finally:
            self.compressing = previous

    # ----- per forward --------------------------------------------------------------------------------
    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        cache = kwargs.get(self._cache_key, kwargs.get("past_key_values"))
        if cache is None:
            if kwargs.get("use_cache") is False:
                raise ValueError("a press compresses the KV cache: call the model with use_cache=True")
            cache = model_access.new_cache(self.model)
            kwargs[self._cache_key] = cache
        if not isinstance(cache, DynamicCache):
            raise TypeError(
                f"kvpress compresses a DynamicCache in place; got {type(cache).__name__}. "
                "Pass DynamicCache() or let generate make one."
            )
        model_access.complete_layers(cache, self.model)
        for i, layer in enumerate(cache.layers):
            if model_access.is_plain_full_layer(layer):
                cache.layers[i] = layer = PressedLayer.from_layer(layer)
            if isinstance(layer, _DRIVEN):
                layer.driven = True
        ours = [layer for layer in cache.layers if isinstance(layer, _DRIVEN)]
        if len({layer.seen for layer in ours}) > 1 or any(layer.pending for layer in ours):
            raise ValueError(
                "this cache was left inconsistent by a forward that raised half-way (its layers hold different "
                "numbers of tokens); it cannot be continued: start a new cache"
            )
        if any(isinstance(layer, HeadwiseLayer) for layer in ours):
            self._check_headwise(cache, args, kwargs)
        self.cache = cache
        self._caches.add(cache)
        if self.press.rerotate:
            kwargs["position_ids"] = self._cache_positions(cache, args, kwargs)
        return args, kwargs

    def _check_headwise(self, cache: DynamicCache, args: tuple, kwargs: dict) -> None:
        """Refuse, before any layer runs, a forward that a cache with head-wise layers cannot take."""
        makers = {layer.made_by for layer in cache.layers if isinstance(layer, HeadwiseLayer)}
        if not isinstance(self.press, HeadwisePress) or makers != {type(self.press).__name__}:
            raise ValueError(
                f"this cache holds head-wise compressed layers made by {', '.join(sorted(makers))}; "
                f"{type(self.press).__name__} cannot continue it (use the press that made it)"
            )
        q = _inputs(args, kwargs).shape[1]
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2 and not bool(mask[:, -q:].all()):
            raise ValueError(
                "a head-wise compressed cache takes padding only in its first forward (left padding of the prompt); "
                "this forward has padding tokens among its new tokens"
            )

    def _cache_positions(self, cache: DynamicCache, args: tuple, kwargs: dict) -> torch.Tensor:
        """Positions inside the cache for the new tokens: true positions minus the tokens evicted before."""
        inputs = _inputs(args, kwargs)
        q = inputs.shape[1]
        positions = kwargs.get("position_ids")
        if positions is None:
            mask = kwargs.get("attention_mask")
            if mask is not None and mask.dim() == 2:
                positions = (mask.long().cumsum(-1) - 1).clamp_min(0)[:, -q:]
            else:
                positions = torch.arange(q, device=inputs.device)[None] + cache.get_seq_length()
        layer = next(layer for layer in cache.layers if isinstance(layer, PressedLayer))
        if layer.shift is None:
            return positions
        return positions - layer.shift.to(positions.device)[:, None]

    def _attention(self, module: nn.Module, query, key, value, attention_mask, **kwargs):
        info = attention_mask if isinstance(attention_mask, attention.MaskInfo) else None
        inner = self._inner[module.layer_idx]
        layer = self.cache.layers[module.layer_idx] if self.cache is not None else None
        if not isinstance(layer, _DRIVEN):  # a layer the press leaves alone
            return inner(module, query, key, value, info.standard() if info else attention_mask, **kwargs)
        if info is None and attention_mask is not None:
            raise ValueError("kvpress builds its own masks: pass a 2D attention_mask, not a 4D one")
        q_len = query.shape[2]
        if layer.pending != q_len:
            raise RuntimeError(
                "the cache seen by the attention is not the one the press prepared; pass it by keyword "
                f"({self._cache_key}=...)"
            )
        if isinstance(layer, HeadwiseLayer):
            if kwargs.get("s_aux") is not None:
                raise ValueError("attention sinks (s_aux) are not supported by head-wise compressed layers")
            return self._headwise(module, query, layer), None
        if layer.adopted and info is not None and info.padding is not None:
            layer.adopt_padding(info.padding[:, : layer.seen - q_len])
        layer.commit(info.new_valid(q_len) if info is not None else None)
        standard = info.standard() if info is not None and not layer.compressed else None  # built only if used
        if not layer.compressed and not _sized_for_another_layer(standard, key):
            mask = standard  # slots still line up with tokens: transformers' own mask is right
        elif self._original.startswith("flash_attention") and "valid" not in layer.slots:
            mask = None  # flash aligns causal masks bottom-right: new tokens after every held slot
        else:  # flash cannot express holes in a padded batch: that call runs on sdpa
            fn = "sdpa" if self._original.startswith("flash_attention") else self._original
            inner = model_access.inner_attention(self.model, fn, module) if fn != self._original else inner
            n_rep = query.shape[1] // key.shape[1]
            mask = attention.layer_mask(layer, q_len, n_rep, query.dtype, additive=fn == "eager")
        out = inner(module, query, key, value, mask, **kwargs)
        if self.compressing:
            obs = Observation(module, query, key, value, layer)
            headwise = self.press.after_attention(obs, self._rerank if self.press.rerotate else None)
            if headwise is not None:  # a head-wise press replaced the layer by per-head storage
                headwise.driven = True
                self.cache.layers[module.layer_idx] = headwise
        return out

    def _headwise(self, module: nn.Module, query, layer: HeadwiseLayer) -> torch.Tensor:
        """Attention over a head-wise layer (per-head storage), then the press trims heads over budget."""
        layer.commit()
        out = headwise_attention(module, query, layer)
        if self.compressing:
            self.press.observe_heads(module, query, layer)
            self.press.evict_heads(module, query, layer)
        return out

    def _rerank(self, layer: PressedLayer) -> None:
        """Re-rotate held keys to their rank among the row's held real tokens (StreamingLLM positions)."""
        pos, valid = layer.pos.long(), layer.valid
        order = layer.position_order()
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(layer.n, device=pos.device).expand_as(order))
        current = layer.slots["rot"][..., : layer.n].long() if layer.rotated else pos
        delta = rank - current
        if valid is not None:
            delta = delta.masked_fill(~valid, 0)
        if bool(delta.any()):
            layer.keys[:, :, : layer.n] = rope.rerotate(layer.keys[:, :, : layer.n], delta, self._inv_freq)
        layer.set_rotation(rank)


def _inputs(args: tuple, kwargs: dict) -> torch.Tensor:
    """The new tokens of a forward: `input_ids`, or `inputs_embeds` when no ids are given."""
    inputs = kwargs.get("input_ids", args[0] if args else None)
    return inputs if inputs is not None else kwargs["inputs_embeds"]


def _sized_for_another_layer(mask, key: torch.Tensor) -> bool:
    """transformers sizes one mask per layer type from the first such layer; a full layer after a compressed
    one (per-layer budgets that leave a layer whole) holds more keys than that mask covers."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-1] != key.shape[-2]
