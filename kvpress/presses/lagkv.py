"""LagKV: score each token against the tokens that follow it, from the cached keys and values alone.

Liang et al. 2025, "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are Important"
(arXiv:2504.04704): after the attention sinks, the held tokens (in position order) are cut into partitions
of `lag_size`; each partition is scored against the next one, its "lag": keys (and values) are scaled by the
per-channel min and max of the next partition's, and a token whose scaled vector spreads widely across its
channels (a high standard deviation) is one the local statistics do not explain, so it is kept. Scores are
a softmax within each partition, keys' plus values'. The last full partition and the shorter tail have no
lag and stay. No query and no attention, so it runs with any attention kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress.presses.base import BasePress, Observation

# the sinks and the partitions without a lag rank above every scored token (keys' plus values' softmax: at most
# 2), newest highest: UNSCORED + their rank, whole numbers that float32 tells apart up to 2^24 tokens
UNSCORED = 3.0


@dataclass
class LagKVPress(BasePress):
    """Keep the tokens least explained by the statistics of the partition after them.

    Parameters:
        compression_ratio / max_tokens: the budget (see `BasePress`).
        lag_size: tokens per partition (default 128); the last full partition and the tail (up to
            2 x lag_size - 1 tokens) are always kept, newest first when the budget is smaller.
        n_sink: leading tokens always kept (default 4).
    """

    lag_size: int = 128
    n_sink: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.lag_size, bool) or not isinstance(self.lag_size, int) or self.lag_size < 1:
            raise ValueError(f"lag_size must be a positive integer, got {self.lag_size!r}")
        super().__post_init__()

    def score(self, obs: Observation) -> torch.Tensor:
        layer = obs.layer
        b, h, n = obs.keys.shape[:3]
        order = layer.position_order()[..., :n]  # [B, H, n] slots by position, padding and holes last
        held = layer.held()
        scores = torch.empty(b, h, n, device=obs.keys.device)
        for row in range(b):
            m = int(held[row])
            ranked = torch.full((h, n), -1.0, device=scores.device)  # padding and holes: below every token
            ranked[:, :m] = UNSCORED + torch.arange(m, device=scores.device)  # newest highest
            body = m - self.n_sink
            parts = body // self.lag_size
            if parts >= 2:  # partitions 0 .. parts - 2 have a lag
                idx = order[row, :, self.n_sink : self.n_sink + parts * self.lag_size]  # [H, parts * L]
                k = _lag_scores(obs.keys[row].gather(1, idx[..., None].expand(-1, -1, obs.keys.shape[-1])), parts)
                v = _lag_scores(obs.values[row].gather(1, idx[..., None].expand(-1, -1, obs.values.shape[-1])),
                                parts)  # fmt: skip
                ranked[:, self.n_sink : self.n_sink + (parts - 1) * self.lag_size] = k + v
            scores[row] = torch.empty_like(ranked).scatter_(-1, order[row], ranked)
        return scores


def _lag_scores(x: torch.Tensor, parts: int) -> torch.Tensor:
    """`[H, (parts - 1) * L]`: for `x` `[H, parts * L, d]` in position order, each partition's tokens scaled by
    the next partition's per-channel min and max, their spread across channels, softmaxed within the partition."""
    h, _, d = x.shape
    blocks = x.float().view(h, parts, -1, d)
    ref, scored = blocks[:, 1:], blocks[:, :-1]
    low, high = ref.amin(dim=2, keepdim=True), ref.amax(dim=2, keepdim=True)
    spread = ((scored - low) / (high - low).clamp_min(1e-6)).std(dim=-1)  # [H, parts - 1, L]
    return spread.softmax(dim=-1).flatten(1)
