"""CriticalKV: keep the tokens whose loss would move the attention output most, not only the most attended.

Feng et al. 2025, "Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective"
(arXiv:2502.03805): a head's output is sum_i a_i v_i W_O; evicting a set of tokens perturbs it by at most a bound
that falls with the kept attention mass s and with sum over kept tokens of a_i ||v_i W_O||_1. So selection runs in
two stages: first a share of the budget goes to the highest attention alone (to keep s large), then the rest to
the highest a_i ||v_i W_O||_1, the value's norm after the head's slice of the output projection. The paper: lower
output perturbation in over 92% of Llama heads, and SnapKV's and AdaKV's losses on LongBench and needles cut;
RULER-4K at 20% of the cache (their release): SnapKV 39.0, AdaKV 46.0, AdaKV with CriticalKV 62.9.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpress.patches import model_access
from kvpress.presses.base import BasePress, Observation
from kvpress.presses.head_budget import HeadwisePress, descending_rank
from kvpress.presses.wrapping import WrapsPress, wrapped_chain


@dataclass
class CriticalKVPress(WrapsPress, BasePress):
    """Keep the most attended tokens first, then the ones whose projected values move the output most.

    Parameters:
        press: the press whose scores are read as attention weights (non-negative): SnapKV (the paper's, and the
            default of `criticalkv`), TOVA, H2O, or ExpectedAttention with `use_vnorm=False` (its value norm
            would count twice). Its budget, sinks, window and layer scales are used as they are.
        first_stage_ratio: the share of each head's budget chosen by the attention alone (default 0.5, as in
            the paper); the rest by attention x ||v W_O||_1 (averaged over the query heads of the KV group).
            The wrapped press's protected tokens (its sinks and window) rank first and count in that share, as
            in NVIDIA kvpress: where they fill it (SnapKV's window of 64 against a budget of 100 and the default
            0.5), the first stage is them alone and the rest goes to the second.
        epsilon: added to the attention before it is weighted (default 1e-4), so an unattended token with a
            large value still ranks above an unattended small one.

    Wrapped by AdaKV (`adakv:inner=criticalkv`) the two stages run per head, as the paper's CriticalAdaKV: each
    head keeps its first stage (`first_stage_ratio` of its even share, ranked above any second-stage token), which
    then acts as its safeguard. ChunkKV and ShotKV, which average raw scores, refuse it.
    """

    press: BasePress | None = None
    first_stage_ratio: float = 0.5
    epsilon: float = 1e-4

    def __post_init__(self) -> None:
        self.adopt_press(refused=(HeadwisePress,))
        chain = wrapped_chain(self.press)  # (through wrappers too)
        weighed = [(p, name) for p in chain for name in ("use_vnorm", "value_norm") if getattr(p, name, False) is True]
        if weighed:
            raise ValueError(f"CriticalKVPress weighs attention by the projected value norm itself: give "
                             f"{type(weighed[0][0]).__name__} {weighed[0][1]}=False")  # fmt: skip
        if any(isinstance(p, CriticalKVPress) for p in chain):
            raise ValueError("CriticalKVPress inside CriticalKVPress weighs by the projected value norm twice")
        ratio = self.first_stage_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
            raise ValueError(f"first_stage_ratio must be a fraction in [0, 1], got {ratio!r}")
        eps = self.epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
            raise ValueError(f"epsilon must be a non-negative number, got {eps!r}")
        self.rerotate = self.press.rerotate
        super().__post_init__()

    def score(self, obs: Observation) -> torch.Tensor:
        """The second stage alone: (attention + epsilon) x the projected value's L1 norm."""
        return self._weighted(obs, self._attention(obs))

    def ranked_scores(self, obs: Observation, budgets: torch.Tensor, per_head_scale: bool = False) -> torch.Tensor:
        attention = self._attention(obs)
        first = self.protect(obs, attention, budgets)  # the wrapped press's own ranking
        ranked = self.protect(obs, self._weighted(obs, attention), budgets, per_head_scale)
        quota = (budgets.to(first.device, non_blocking=True).double() * self.first_stage_ratio).long()  # [B]
        rank = descending_rank(first)
        chosen = (rank < quota[:, None, None]) & ranked.isfinite()  # protected (+inf) tokens rank first anyway
        return ranked.masked_fill(chosen, torch.finfo(ranked.dtype).max)  # below the protected ones' +inf

    def _attention(self, obs: Observation) -> torch.Tensor:
        scores = self.press.score(obs).float()
        if self.__dict__.get("_signs_checked"):  # the first scores tell (a read of the device, once)
            return scores
        self.__dict__["_signs_checked"] = True
        valid = obs.layer.valid
        counted = scores if valid is None else scores[valid[..., : scores.shape[-1]]]
        if bool((counted < 0).any()):
            raise ValueError(f"CriticalKVPress reads its press's scores as attention weights, but "
                             f"{type(self.press).__name__} gave negative ones: wrap an attention-based press "
                             "(SnapKV, TOVA, H2O, ExpectedAttention)")  # fmt: skip
        return scores

    def _weighted(self, obs: Observation, attention: torch.Tensor) -> torch.Tensor:
        return (attention + self.epsilon) * projected_value_norms(obs)


def projected_value_norms(obs: Observation) -> torch.Tensor:
    """`[B, Hkv, n]` ||v W_O^h||_1 of each held value, averaged over the query heads h of its KV group (W_O^h: the
    columns of the output projection that head h's output meets)."""
    weight, groups = model_access.output_projection(obs.module)
    values = obs.values.float()
    dim = values.shape[-1]
    kv_heads = weight.shape[1] // (dim * groups)
    w = weight.float().view(weight.shape[0], kv_heads, groups, dim)[:, obs.kv_heads]  # [hidden, Hkv, g, D]
    norms = torch.zeros(values.shape[:-1], device=values.device)
    for j in range(groups):  # one query head of each group at a time: [B, Hkv, n, hidden] stays small
        norms += (values @ w[:, :, j].permute(1, 2, 0)).abs().sum(-1)
    return norms / groups
