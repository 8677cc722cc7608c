"""Knorm: keep the keys with the smallest L2 norm.

Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"
(arXiv:2406.11430): a low key norm goes with high attention, so the score is the negative norm.
Needs no attention scores at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress.presses.base import BasePress, Observation


@dataclass
class KnormPress(BasePress):
    """Keep the keys of smallest L2 norm. Parameters: the budget (see `BasePress`)."""

    def score(self, obs: Observation) -> torch.Tensor:
        return -obs.keys.float().norm(dim=-1)
