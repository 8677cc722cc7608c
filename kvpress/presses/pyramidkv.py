"""PyramidKV: per-layer budgets that shrink from the lowest layer to the highest, over any scorer.

Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling"
(arXiv:2406.02069): attention spreads widely in lower layers and concentrates in higher ones, so
lower layers get more of the budget. With an average budget k, the top layer keeps k / beta, the
bottom one 2k - k / beta, and the layers in between follow the line; the total equals the uniform one (each
layer's share rounded down: up to one token a layer less). Where the line asks a bottom layer for more than its
context (at small compression ratios), it keeps the context and the layers above share the rest (`shares_within`).
The paper scores with SnapKV (the default here); any token-level press can score instead
(`PyramidKVPress(KnormPress(compression_ratio=0.5))`, `pyramidkv:inner=knorm`). Models with sliding-window
layers (Gemma 3) are refused: their windowed layers cannot take the larger shares the pyramid gives them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kvpress.patches import model_access
from kvpress.presses.base import BasePress, shares_within
from kvpress.presses.head_budget import HeadwisePress
from kvpress.presses.snapkv import SnapKVPress
from kvpress.presses.wrapping import WrapsPress, inner_flag, wrapped_chain


@dataclass
class PyramidKVPress(WrapsPress, BasePress):
    """A linear pyramid of per-layer budgets over a token-level press's scores (SnapKV by default).

    Parameters:
        press: the press that scores tokens (its budget, sinks and window are used; it must not set
            `layer_scales`). Or, as in the paper, SnapKV built from the arguments below:
        compression_ratio / max_tokens, rerotate, decode_slack, kv_bits: the average budget and the storage
            width (see `BasePress`); each layer keeps at least its protected window.
        window_size, kernel_size, n_sink: SnapKV's (defaults 64, 5, 0).
        beta: steepness; the top layer keeps 1/beta of the average budget (default 20, as in the paper).
    """

    press: BasePress | None = None
    beta: float = 20.0
    window_size: int | None = None
    kernel_size: int | None = None
    n_sink: int | None = None
    chooses_by_position = inner_flag("chooses_by_position")  # (per-layer budgets over the wrapped press's scores)

    def __post_init__(self) -> None:
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or self.beta < 1:
            raise ValueError(f"beta must be a number >= 1 (1: every layer the same), got {self.beta!r}")
        if self.layer_scales is not None:
            raise ValueError("PyramidKVPress sets the per-layer budgets itself; use layer_scales with another press")
        snapkv = {k: v for k in ("window_size", "kernel_size", "n_sink") if (v := getattr(self, k)) is not None}
        if self.press is None and not isinstance(self.compression_ratio, BasePress):  # the paper's: SnapKV
            self.press = SnapKVPress(compression_ratio=self.compression_ratio, max_tokens=self.max_tokens,
                                     rerotate=self.rerotate, decode_slack=self.decode_slack, kv_bits=self.kv_bits,
                                     **snapkv)  # fmt: skip
            self.compression_ratio = self.max_tokens = self.kv_bits = None
            self.rerotate, self.decode_slack = False, BasePress.decode_slack  # held by its SnapKV
            self.window_size = self.kernel_size = self.n_sink = None  # held by the SnapKV built from them
        elif snapkv:
            raise ValueError(f"PyramidKVPress takes {', '.join(snapkv)} for its own SnapKV only; set them on the "
                             "wrapped press")  # fmt: skip
        self.adopt_press(refused=(HeadwisePress, PyramidKVPress))
        own = [p for p in wrapped_chain(self.press) if p.layer_scales is not None or getattr(p, "global_budget", 0)]
        if own:  # (through a wrapper too: CriticalKV keeps its inner press's scales there)
            name = type(own[0]).__name__
            raise ValueError(f"PyramidKVPress sets the per-layer budgets itself: the wrapped {name} "
                             "cannot set its own (layer_scales, or KVzip's / KVzap's global_budget > 0)")  # fmt: skip
        self.rerotate = self.press.rerotate
        super().__post_init__()

    def check_model(self, model) -> None:
        """Refuse a model with sliding-window layers: a layer's share multiplies its own budget, and a sliding layer
        cannot take more than its window, so the pyramid's total would fall short and its full-attention layers,
        the only ones that reach far back, would keep a small share of theirs (1/beta at the top)."""
        if model_access.has_sliding_layers(model):
            raise ValueError(f"PyramidKVPress spreads one budget over layers that hold the whole context; "
                             f"{type(model).__name__} has layers of other kinds "
                             f"({model_access.other_layer_kinds(model)}), which cannot take a larger share: "
                             "use its press without the pyramid")  # fmt: skip
        super().check_model(model)

    def score(self, obs):
        return self.press.score(obs)

    def ranked_scores(self, obs, budgets, per_head_scale: bool = False):
        return self.press.ranked_scores(obs, budgets, per_head_scale)  # the wrapped press's own (CriticalKV's stages)

    def layer_scale(self, layer_idx: int, n_layers: int) -> float:
        """The pyramid's share of layer `layer_idx`, within what the layer holds (`shares_within`: at a small
        compression ratio the bottom layers keep their whole context and the layers above share the rest)."""
        return shares_within(pyramid(self.beta, n_layers), self.compression_ratio)[layer_idx]


@functools.lru_cache(maxsize=64)
def pyramid(beta: float, n_layers: int) -> tuple[float, ...]:
    """The line of per-layer shares from 2 - 1/beta (the bottom layer) to 1/beta (the top one), average 1."""
    if n_layers == 1:
        return (1.0,)
    top = 1.0 / beta
    bottom = 2.0 - top
    return tuple(bottom - (bottom - top) * i / (n_layers - 1) for i in range(n_layers))
