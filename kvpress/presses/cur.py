"""CurDKV: keep the keys and values that span their head's space, by leverage scores (a CUR decomposition).

Sengupta et al. 2025, "Value-Guided KV Compression for LLMs via Approximated CUR Decomposition"
(arXiv:2509.15038): attention outputs are products with the keys and the values, so the tokens worth keeping
are the rows a CUR decomposition of each would pick: those of high leverage (row i of K, n x d, has leverage
k_i^T (K^T K)^-1 k_i, how much of the key space only it covers). A token's score is the product of its key's
and its value's leverage, averaged over neighbouring positions. No attention is computed, so it runs with any
attention kernel. Here the leverages are exact (a d x d Gram matrix per head), where the paper approximates
them with random projections.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress.presses.base import BasePress, Observation
from kvpress.presses.snapkv import check_kernel_size, pool_by_position

KINDS = ("kv_product", "kv_mean", "key", "value")


@dataclass
class CURPress(BasePress):
    """Keep the tokens whose keys and values have the highest leverage in their head.

    Parameters:
        compression_ratio / max_tokens: the budget (see `BasePress`).
        leverage: "kv_product" (default: key leverage x value leverage), "kv_mean", "key" or "value".
        kernel_size: width of the average over neighbouring positions (default 15, odd; 1: none).
        n_sink: leading tokens always kept (default 4).
    """

    leverage: str = "kv_product"
    kernel_size: int = 15
    n_sink: int = 4

    def __post_init__(self) -> None:
        if self.leverage not in KINDS:
            raise ValueError(f"leverage must be one of {', '.join(KINDS)}, got {self.leverage!r}")
        check_kernel_size(self.kernel_size)
        super().__post_init__()

    def score(self, obs: Observation) -> torch.Tensor:
        valid = obs.layer.valid
        valid = None if valid is None else valid[..., : obs.keys.shape[2]]
        if self.leverage == "key":
            scores = leverage_scores(obs.keys, valid)
        elif self.leverage == "value":
            scores = leverage_scores(obs.values, valid)
        else:
            k, v = leverage_scores(obs.keys, valid), leverage_scores(obs.values, valid)
            scores = k * v if self.leverage == "kv_product" else (k + v) / 2
        return pool_by_position(scores, obs.layer, self.kernel_size)


RIDGES = (1e-9, 1e-8, 1e-7, 1e-6)  # tried in turn for each head's Gram matrix (`leverage_scores`)


def leverage_scores(rows: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """`[B, H, n]` the leverage of each row of `rows` `[B, H, n, d]` among the `valid` ones (others score 0):
    r_i^T (R^T R)^-1 r_i, by a Cholesky solve on the Gram matrix. Real keys have a few channels thousands of times
    larger than the rest (in float32 the Gram matrix of SmolLM2's 4K-token keys was not even positive definite), so
    each channel is first scaled to unit norm (leverage does not change when columns are scaled) and the solve runs
    in float64 with a small ridge, grown tenfold (at most three times) where a head is still singular."""
    x = rows.double()
    if valid is not None:
        x = x * valid[..., None]
    x = x / x.norm(dim=-2, keepdim=True).clamp_min(1e-30)
    gram = x.transpose(-1, -2) @ x
    eye = torch.eye(x.shape[-1], device=x.device, dtype=x.dtype)
    # every ridge in one call, each head taking the smallest that factors (nothing read back from the device);
    # the largest always does for finite rows: the Gram matrix of unit columns plus 1e-6 I is positive definite
    ridges = torch.tensor(RIDGES, dtype=x.dtype).to(x.device, non_blocking=True)
    factors, info = torch.linalg.cholesky_ex(gram + ridges.view(-1, *[1] * gram.dim()) * eye)
    first = (info != 0).long().cumprod(0).sum(0).clamp(max=len(RIDGES) - 1)  # [B, H] the first that factors
    factor = factors.gather(0, first[None, ..., None, None].expand(1, *gram.shape))[0]
    solved = torch.cholesky_solve(x.transpose(-1, -2), factor)  # [B, H, d, n]
    return (x * solved.transpose(-1, -2)).sum(-1).float()
