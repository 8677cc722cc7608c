"""Random eviction: the baseline every scorer must beat.

The score is a hash of (seed, layer, KV head, token position), so a row gives the same choice
alone or inside a padded batch, and runs repeat exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvpress.presses.base import BasePress, Observation

_MASK = (1 << 31) - 1


@dataclass
class RandomPress(BasePress):
    """Evict uniformly at random. Parameters: the budget (see `BasePress`); `seed` (default 0)."""

    chooses_by_position: ClassVar[bool] = True

    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**31:
            raise ValueError(f"seed must be an integer in [0, 2**31), got {self.seed!r}")  # (hashed in int64)
        super().__post_init__()

    def score(self, obs: Observation) -> torch.Tensor:
        pos = obs.layer.pos.long()
        first = obs.kv_heads.start or 0  # a head-wise view holds one head: its own index, not 0
        head = torch.arange(first, first + pos.shape[1], device=pos.device)[None, :, None]
        x = (pos * 1_000_003 + head * 7919 + obs.layer_idx * 104_729 + self.seed * 15_485_863) & _MASK
        for _ in range(3):  # a few rounds of an integer mixing function
            x = ((x ^ (x >> 13)) * 1_103_515_245 + 12_345) & _MASK
        return x.float() / _MASK
