"""TAPPA: heads whose queries stay alike over time attend predictably and need little cache; the others get the rest.

Yang et al. 2026, "Why Attention Patterns Exist: A Unifying Temporal Perspective Analysis" (arXiv:2601.21709,
Temporal Attention Pattern Predictability Analysis): a head's attention is predictable (sinks, diagonals,
periodic stripes) when its queries change little from step to step, and effectively random (retrieval) when
they do; the q-similarity, the mean cosine between the queries of the prompt's last tokens over every pair, tells
them apart with no calibration run. The paper's KV compression gives budgets in proportion to 1 - q-similarity
(on Qwen2.5 at a 512-token budget, up to +11.3 points of LongBench average over Expected Attention alone).

The paper spreads the budget across layers (built on CAKE); here it is spread across the KV heads of each layer,
so every layer still evicts inside its own forward: per layer, head h gets a safeguard share plus the rest in
proportion to 1 - q-similarity of its query heads (post-RoPE, averaged over the KV group), and keeps its
best tokens by the wrapped press's scores. While decoding (one query: no similarity), a layer over its budget is
cut in proportion to what each head holds, so the prefill's shares stay; a later chunk of several tokens
re-allocates by its own queries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpress.presses.adakv import HeadSharePress
from kvpress.presses.head_budget import descending_rank


@dataclass
class TAPPAPress(HeadSharePress):
    """Wrap a score-based press: a layer's budget spread across its KV heads by 1 - the q-similarity of each.

    Parameters:
        press: the press that ranks tokens inside each head (SnapKV by default in `tappa`); its budget,
            sinks, window and per-layer scales are used as they are.
        similarity_window: the last queries of a forward whose pairwise cosines give the q-similarity
            (default 32, as in the paper).
        alpha_safeguard: each head keeps at least this fraction of its even share (default 0.2), and never
            fewer than its protected tokens (sinks, window).
    """

    similarity_window: int = 32

    def __post_init__(self) -> None:
        w = self.similarity_window
        if isinstance(w, bool) or not isinstance(w, int) or w < 2:
            raise ValueError(f"similarity_window must be an integer >= 2 (pairs of queries), got {w!r}")
        super().__post_init__()

    def allocate_heads(self, scores, per_head, query, query_valid=None) -> torch.Tensor:
        h = scores.shape[1]
        per_head = per_head.to(scores.device, non_blocking=True)
        held = (scores > -math.inf).sum(-1)  # [B, H]
        if query.shape[2] >= 2:
            w = self.similarity_window
            valid = None if query_valid is None else query_valid[:, -w:]
            weights = (1 - q_similarity(query[:, :, -w:], h, valid)).clamp_min(1e-6)
        else:  # a decoding step: keep the shares the heads hold
            weights = held.double().clamp_min(1e-6)
        floor = torch.maximum((per_head * self.alpha_safeguard).long()[:, None], (scores == math.inf).sum(-1))
        budgets = split_budget(per_head.to(held.device) * h, weights, floor.minimum(held), held)
        rank = descending_rank(scores)
        return (rank < budgets[..., None]) & (scores > -math.inf)


def q_similarity(query: torch.Tensor, kv_heads: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """`[B, Hkv]` the mean cosine over every pair of distinct queries in `query` `[B, Hq, w, D]`, averaged over the
    query heads of each KV head; `valid` `[B, w]` leaves padding out. A row with fewer than two real queries: 0."""
    b, hq, w, _ = query.shape
    unit = F.normalize(query.float(), dim=-1)
    cosines = unit @ unit.transpose(-1, -2)  # [B, Hq, w, w]
    real = torch.ones(b, w, dtype=torch.bool, device=query.device) if valid is None else valid.to(query.device)
    pairs = (real[:, :, None] & real[:, None, :]) & ~torch.eye(w, dtype=torch.bool, device=query.device)
    mean = (cosines * pairs[:, None]).sum(dim=(-1, -2)) / pairs.sum(dim=(-1, -2)).clamp_min(1)[:, None]
    return mean.view(b, kv_heads, hq // kv_heads).mean(-1)


def split_budget(total: torch.Tensor, weights: torch.Tensor, floor: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """`[B, H]` integer budgets summing to `total[b]` (or to what the heads hold, if less): each head `floor` plus
    the rest in proportion to `weights`, none above `cap` (what a head holds; its excess goes to the others)."""
    total = torch.minimum(total.long(), cap.sum(-1))
    budgets = floor.double()
    for _ in range(weights.shape[-1]):  # water-filling: a head at its cap drops out, the rest share its excess
        room = (cap - budgets) > 0
        left = (total - budgets.sum(-1)).clamp_min(0)
        w = weights.double() * room
        share = left[:, None] * w / w.sum(-1, keepdim=True).clamp_min(1e-12)
        budgets = torch.minimum(budgets + share, cap.double())
        if bool((budgets.sum(-1) >= total - 1e-6).all()):
            break
    whole = budgets.floor().long()
    short = total - whole.sum(-1)  # [B] handed one each to the heads with the largest remainders and room left
    remainder = (budgets - whole).masked_fill(whole >= cap, -1.0)
    order = descending_rank(remainder)
    return whole + ((order < short[:, None]) & (whole < cap)).long()
