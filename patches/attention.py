"""The attention intercept: an `AttentionInterface` function and its `AttentionMaskInterface` partner.

The mask function does not build a mask: it returns a `MaskInfo` that keeps the 2D padding mask and
builds transformers' standard mask only if a layer asks for it (layers the press has not compressed
yet, or layers it leaves alone such as Gemma3's sliding-window ones). A compressed layer's mask is
built from that layer's own slots, so layers of different lengths work on sdpa and eager alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from kvpress.patches.cache import PressedLayer


@dataclass
class MaskInfo:
    """What the mask interface was asked for, kept until a layer needs it."""

    build: Callable[..., torch.Tensor | None]
    kwargs: dict
    _standard: list = field(default_factory=list)

    @property
    def padding(self) -> torch.Tensor | None:
        mask = self.kwargs.get("attention_mask")
        return mask if mask is not None and mask.dim() == 2 else None

    def new_valid(self, q_len: int) -> torch.Tensor | None:
        """`[B, q]` True for the real tokens among the last `q_len`, or None when none is padding."""
        padding = self.padding
        if padding is None:
            return None
        new = padding[:, -q_len:].bool()
        return None if bool(new.all()) else new

    def standard(self) -> torch.Tensor | None:
        """transformers' own mask for these arguments (built once)."""
        if not self._standard:
            self._standard.append(self.build(**self.kwargs))
        return self._standard[0]


def layer_mask(layer: PressedLayer, q_len: int, n_rep: int, dtype: torch.dtype, additive: bool):
    """The mask of a compressed layer: held slots visible where valid, causal among the new tokens.

    Bool (sdpa) or additive float (eager); None when nothing is hidden. A query always sees its
    own slot, so padding queries stay finite.
    """
    n, device = layer.n, layer.keys.device
    valid = layer.valid
    if valid is None and q_len == 1:
        return None
    causal = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    if valid is None:
        old = torch.ones(q_len, n - q_len, dtype=torch.bool, device=device)
        mask = torch.cat([old, causal], dim=-1)[None, None]
    else:
        b, h = valid.shape[:2]
        old = valid[:, :, None, : n - q_len].expand(b, h, q_len, n - q_len)
        new = causal & valid[:, :, None, n - q_len :] | torch.eye(q_len, dtype=torch.bool, device=device)
        mask = torch.cat([old, new], dim=-1).repeat_interleave(n_rep, dim=1)
    if additive:
        return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask


def register(name: str, attention_fn: Callable, original_mask_fn: Callable) -> None:
    """Register `attention_fn` and a `MaskInfo`-returning mask function under `name`."""

    def mask_fn(**kwargs):
        return MaskInfo(original_mask_fn, kwargs)

    AttentionInterface.register(name, attention_fn)
    AttentionMaskInterface.register(name, mask_fn)


def unregister(name: str) -> None:
    AttentionInterface._global_mapping.pop(name, None)
    AttentionMaskInterface._global_mapping.pop(name, None)


def original_mask_function(implementation: str) -> Callable:
    return AttentionMaskInterface._global_mapping[implementation]
