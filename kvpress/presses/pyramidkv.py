"""PyramidKV: SnapKV scores with per-layer budgets that shrink from the lowest layer to the highest.

Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling"
(arXiv:2406.02069): attention spreads widely in lower layers and concentrates in higher ones, so
lower layers get more of the budget. With an average budget k, the top layer keeps k / beta, the
bottom one 2k - k / beta, and the layers in between follow the line; the total equals the uniform one.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpress.presses.snapkv import SnapKVPress


@dataclass
class PyramidKVPress(SnapKVPress):
    """SnapKV with a linear pyramid of per-layer budgets.

    Parameters:
        compression_ratio / max_tokens: the average budget (see `BasePress`); each layer keeps at least
            its protected window.
        beta: steepness; the top layer keeps 1/beta of the average budget (default 20, as in the paper).
        window_size, kernel_size: as in `SnapKVPress`.
    """

    beta: float = 20.0

    def __post_init__(self) -> None:
        if not isinstance(self.beta, (int, float)) or self.beta < 1:
            raise ValueError(f"beta must be a number >= 1 (1: every layer the same), got {self.beta!r}")
        if self.layer_scales is not None:
            raise ValueError("PyramidKVPress sets the per-layer budgets itself; use layer_scales with another press")
        super().__post_init__()

    def layer_scale(self, layer_idx: int, n_layers: int) -> float:
        if n_layers == 1:
            return 1.0
        top = 1.0 / self.beta
        bottom = 2.0 - top
        return bottom - (bottom - top) * layer_idx / (n_layers - 1)
