"""AdaKV: spend a layer's budget across its KV heads where the scores say it matters most.

Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient
LLM Inference" (arXiv:2407.11550): with the same total budget per layer, a global top-k of the
scores across heads (instead of a top-k per head) lowers the attention-output loss; a safeguard keeps
a minimum per head. RULER-4K, Llama-3.1-8B at 25% of the cache: SnapKV 81.8 -> 88.1 with Ada-KV.

Here the kept tokens of each head live in storage of their own size (`HeadwiseLayer`), so the
memory is really freed (NVIDIA kvpress's AdaKV only masks).

`normalize=True` divides each head's scores by that head's largest before the global top-k, so heads
compete by the shape of their scores and not by their scale. Attention-based scores (SnapKV: each head's
window attention sums to the window size) share a scale already; KVzip's peak attention does not (a head
that copies sharply can peak near 1 on every token it copies). On SmolLM2-135M's needle haystacks (tuning
seeds 1 / 2 / 3, r = 0.75) AdaKV(KVzip, value-weighted) kept the prose needle and lost the noise one
(0.31 / 0.33 / 0.38 against the full cache's 0.81 / 0.88 / 0.69); with `normalize=True` it kept both
(noise 0.94 / 0.81 / 0.69, prose 0.94 / 0.75 / 0.69 against 0.94 / 0.81 / 0.81). The largest is taken
over every token the head holds, its window included: over the evictable ones only, the noise needle
was lost again (r = 0.5: 0.38 / 0.62 against 0.75 / 0.88).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvpress.patches import model_access
from kvpress.patches.head_cache import HeadwiseLayer
from kvpress.presses.base import BasePress, Observation
from kvpress.presses.head_budget import HeadwisePress, allocate, head_observation, observe_every_head
from kvpress.presses.wrapping import WrapsPress, inner_flag


@dataclass
class HeadSharePress(WrapsPress, HeadwisePress):
    """A layer's budget (the wrapped press's, per head on average) shared among its KV heads by `allocate_heads`;
    each head keeps its best-scored tokens. The base of AdaKV (a global top-k) and TAPPA (query self-similarity).

    Parameters:
        press: the press that scores tokens (SnapKV, H2O, Knorm, PyramidKV, ...); its budget
            (`compression_ratio` or `max_tokens`, per layer and head on average), sinks, window and
            per-layer scales are used as they are.
        alpha_safeguard: each head keeps at least this fraction of its even share (default 0.2).
    """

    press: BasePress | None = None
    alpha_safeguard: float = 0.2

    def __post_init__(self) -> None:
        self.adopt_press(refused=(HeadwisePress,))
        if self.press.rerotate:
            raise ValueError(f"{type(self).__name__} gives heads different budgets: the wrapped press cannot use "
                             "rerotate=True")  # fmt: skip
        if not isinstance(self.alpha_safeguard, (int, float)) or not 0 <= self.alpha_safeguard <= 1:
            raise ValueError(f"alpha_safeguard must be a fraction in [0, 1], got {self.alpha_safeguard!r}")
        super().__post_init__()

    scale_heads = False  # divide each head's scores by its peak before they are ranked (`ranked_scores`)
    # a later chunk is scored by the wrapped press (KVzip's pass reads the head-wise layers padded) and each row
    # re-allocated over its heads (`evict_heads`, from `compress_layers`)
    scores_later_chunks = inner_flag("scores_later_chunks")

    def prepare_chunk(self, model: nn.Module, cache, ids: torch.Tensor, tokenizer=None) -> None:
        self.press.prepare_chunk(model, cache, ids, tokenizer)

    def allocate_heads(self, scores: torch.Tensor, per_head: torch.Tensor, query: torch.Tensor,
                       query_valid: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """`[B, H, n]` bool: the slots each head keeps, `per_head[b] * H` in all for row b, given the ranked
        scores (`-inf`: not held, `+inf`: protected) and the queries of the forward `[B, Hq, q, D]` (`query_valid`
        `[B, q]`: False for padding; None: all real)."""
        raise NotImplementedError

    def score(self, obs: Observation) -> torch.Tensor:
        return self.press.score(obs)

    # ----- prefill: a dense layer becomes head-wise ---------------------------------------------------
    def select(self, obs: Observation) -> torch.Tensor | None:
        layer = obs.layer
        budget = torch.tensor(self.row_budgets(obs.layer_idx, obs.n_layers, layer.span_list()))
        held = layer.held()
        if not bool((held > budget).any()):
            return None
        per_head = torch.minimum(held, self.target(budget, obs.q_len))
        scores = self.press.ranked_scores(obs, budget, per_head_scale=self.scale_heads)
        valid = layer.valid
        return self.allocate_heads(scores, per_head, obs.query, None if valid is None else valid[:, 0, -obs.q_len :])

    # ----- afterwards: every head grows; rows over budget are re-allocated ------------------------------
    def observe_heads(
        self, module: nn.Module, query: torch.Tensor, layer: HeadwiseLayer, hidden=None, ids=None, mass=None
    ) -> None:
        observe_every_head(self.press, module, query, layer, hidden, ids, mass)

    def evict_heads(self, module: nn.Module, query: torch.Tensor, layer: HeadwiseLayer) -> None:
        h, where = layer.heads, (model_access.layer_index(module), model_access.layer_count(module))
        budgets = self.row_budgets(*where, layer.span_list())
        over = [row for row, b in enumerate(budgets) if sum(layer.lengths[row * h : (row + 1) * h]) > b * h]
        if not over:
            return  # the common decoding step: under budget, decided on plain integers (nothing read back)
        budget = torch.tensor(budgets)
        target = self.target(budget, query.shape[2])
        for row in over:
            per_head = []
            for head in range(layer.heads):
                obs, _ = head_observation(module, query, layer, row, head)
                ranked = self.press.ranked_scores(obs, budget[row : row + 1], per_head_scale=self.scale_heads)
                per_head.append(ranked[0, 0])
            n = max(s.shape[0] for s in per_head)
            padded = torch.full((1, layer.heads, n), float("-inf"), device=per_head[0].device)
            for head, s in enumerate(per_head):
                padded[0, head, : s.shape[0]] = s
            layer.keep_marked(row, self.allocate_heads(padded, target[row : row + 1], query[row : row + 1])[0])


@dataclass
class AdaKVPress(HeadSharePress):
    """Wrap a score-based press: same budget per layer, spread across KV heads by a global top-k.

    Parameters:
        press: the press that scores tokens (SnapKV, H2O, Knorm, PyramidKV, ...); its budget
            (`compression_ratio` or `max_tokens`, per layer and head on average), sinks, window and
            per-layer scales are used as they are.
        alpha_safeguard: each head keeps at least this fraction of its even share (default 0.2).
        normalize: divide each head's scores by its largest absolute score over the tokens it holds (window
            and sinks included) before they compete across heads (default False; see above).
    """

    normalize: bool = False
    reads_queries = inner_flag("reads_queries")  # its allocation does not read them

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        super().__post_init__()

    @property
    def scale_heads(self) -> bool:
        return self.normalize

    def allocate_heads(self, scores, per_head, query, query_valid=None) -> torch.Tensor:
        heads = scores.shape[1]
        return allocate(scores, per_head * heads, (per_head * self.alpha_safeguard).long())
