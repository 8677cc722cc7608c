"""Heavy hitters: keep the tokens that have received the most attention, plus a recent window.

H2O, Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models" (arXiv:2306.14048): half heavy hitters, half recent tokens matches the full cache
on many tasks. The score accumulates, per KV head, the attention each cached token receives from
every query: at prefill and at every decoding step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvpress.presses.base import BasePress, Observation

_SCORE = "h2o_attention"


@dataclass
class HeavyHitterPress(BasePress):
    """Keep the heaviest accumulated-attention tokens plus the most recent ones.

    Parameters:
        compression_ratio / max_tokens: the budget (see `BasePress`).
        window: recent tokens always kept; None (default) gives half the budget, as in the paper.
        chunk: queries whose attention weights are computed at once (default 64): one block's weights take
            4 x query heads x chunk x held tokens bytes. The attention itself is computed from these weights
            (`Observation.attention_mass`), so the press adds no second pass over the keys.
    """

    window: int | None = None
    chunk: int = 64
    # every query counts: a question read inside frozen() adds its attention too, so when eviction resumes its tokens
    # hold their mass and the older tokens the mass the question gave them (they held 0 and went first)
    observes_frozen: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.window is not None and (not isinstance(self.window, int) or self.window < 0):
            raise ValueError(f"window must be a non-negative integer or None, got {self.window!r}")
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"chunk must be a positive integer (queries scored at once), got {self.chunk!r}")
        super().__post_init__()

    def recent_count(self, budget):
        return budget // 2 if self.window is None else self.window

    def mass_block(self) -> int:
        return self.chunk

    def observe(self, obs: Observation) -> None:
        obs.layer.slot(_SCORE).add_(obs.attention_mass(self.chunk))

    def score(self, obs: Observation) -> torch.Tensor:
        return obs.layer.slot(_SCORE)


H2OPress = HeavyHitterPress
