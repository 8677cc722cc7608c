"""KeyDiff: keep the keys least like the others.

Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments" (arXiv:2504.15364): distinctive keys tend to receive high attention,
so a key's score is minus its cosine similarity to the anchor: the mean of the keys its head holds, each
scaled to unit length first (a few keys of large norm would pull a plain mean). No attention is computed,
so it runs with any attention kernel.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpress.presses.base import BasePress, Observation


@dataclass
class KeyDiffPress(BasePress):
    """Keep the keys least similar to their head's mean unit key. Parameters: the budget (see `BasePress`)."""

    def score(self, obs: Observation) -> torch.Tensor:
        keys = F.normalize(obs.keys.float(), dim=-1)
        valid = obs.layer.valid  # padding and evicted holes must not pull the anchor
        weight = torch.ones_like(keys[..., 0]) if valid is None else valid.float()
        anchor = (keys * weight[..., None]).sum(2, keepdim=True) / weight.sum(2)[..., None, None].clamp_min(1)
        return -F.cosine_similarity(keys, anchor, dim=-1)
