"""Head-wise presses: each KV head keeps its own number of tokens, in storage of its own size.

A `HeadwisePress` decides, for a dense layer over budget, a keep mask per (row, KV head)
(`select`); the engine then replaces the layer by a `HeadwiseLayer` holding exactly the kept slots of
each head. Afterwards every forward appends to every head and `evict_heads` trims heads over budget.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import nn

from kvpress.engine import Observation
from kvpress.patches.head_cache import HeadwiseLayer
from kvpress.presses.base import BasePress


class HeadwisePress(BasePress):
    """Base of presses whose budgets differ per KV head (subclasses define `select` and `evict_heads`)."""

    per_head: ClassVar[bool] = True

    def select(self, obs: Observation) -> torch.Tensor | None:
        """`[B, H, n]` bool: the slots each (row, KV head) keeps; None when nothing is evicted."""
        raise NotImplementedError

    def evict_heads(self, module: nn.Module, query: torch.Tensor, layer: HeadwiseLayer) -> None:
        """Trim the heads of `layer` that exceed their budget after a forward appended `query`'s tokens."""
        raise NotImplementedError

    def head_budgets(self, obs: Observation) -> torch.Tensor | None:
        """`[B, H]` a budget each head of the new head-wise layer keeps to afterwards (-1: none), or None."""
        return None

    def observe_heads(
        self, module: nn.Module, query: torch.Tensor, layer: HeadwiseLayer, hidden: torch.Tensor | None = None,
        ids: torch.Tensor | None = None, mass: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """Per-head `observe` for presses that accumulate state over a head-wise layer (default: none); `mass`: the
        attention mass the head-wise attention computed (`headwise_attention`), or None."""


def observe_every_head(
    press: BasePress, module: nn.Module, query: torch.Tensor, layer: HeadwiseLayer, hidden=None, ids=None, mass=None,
    pairs: list[tuple[int, int]] | None = None,
) -> None:  # fmt: skip
    """`press.observe` over the (row, KV head) `pairs` of a head-wise layer (None: all of them): in one call where the
    press observes a head-wise layer whole (`observe_headwise`, which then covers every pair), else one view at a
    time (`head_observation`). On a sliding-window layer only the new tokens still held are observed (the last
    `window - 1`, as `engine.within_window` does for a dense layer)."""
    if type(press).observe is BasePress.observe:
        return
    if layer.window is not None and query.shape[2] >= layer.window:  # a long chunk: its oldest tokens left the window
        q = layer.window - 1
        query, hidden, ids = query[:, :, -q:], *(None if t is None else t[:, -q:] for t in (hidden, ids))
    if type(press).observe_headwise is not BasePress.observe_headwise:
        press.observe_headwise(module, query, layer, hidden, ids, mass)
        return
    if pairs is None:
        pairs = [(row, head) for row in range(layer.batch) for head in range(layer.heads)]
    for row, head in pairs:
        obs, view = head_observation(module, query, layer, row, head, hidden, ids, mass)
        press.observe(obs)
        layer.absorb(row, head, view)


def head_observation(
    module: nn.Module, query: torch.Tensor, layer: HeadwiseLayer, row: int, head: int, hidden=None, ids=None,
    mass=None,
):  # fmt: skip
    """An `Observation` of one (row, KV head) of a head-wise layer, and the one-head view it reads (`hidden`: the
    layer's input hidden states of the new tokens, `[B, q, d]`, or None; `ids`: their token ids, `[B, q]`, or
    None; `mass`: the layer's packed attention mass, `[slots]`, or None)."""
    g = query.shape[1] // layer.heads
    view = layer.view(row, head)
    hidden = None if hidden is None else hidden[row : row + 1]
    ids = None if ids is None else ids[row : row + 1]
    if mass is not None:
        i = row * layer.heads + head
        mass = mass[layer.bounds[i] : layer.bounds[i] + layer.lengths[i]][None, None]
    obs = Observation(module, query[row : row + 1, head * g : (head + 1) * g], view.keys, view.values, view,
                      hidden, slice(head, head + 1), slice(row, row + 1), mass=mass, ids=ids)  # fmt: skip
    return obs, view


def descending_rank(scores: torch.Tensor) -> torch.Tensor:
    """Each entry's rank along the last dimension in descending order (0: the largest; of equal entries the first,
    which is the earlier position: a dense layer's slots at the prefill, and a head-wise layer's, are in position
    order, so a padded row ranks ties as alone): `argsort().argsort()` as one sort and a scatter of the ranks into
    place (the inverse of the sort's permutation: the same ranks)."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, ranks)


def allocate(scores: torch.Tensor, total: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """Ada-KV's budget allocation: `[B, H, n]` bool keeping, per row, `total[b]` slots across all heads.

    Each head first keeps its `floor[b]` best slots (the safeguard), then the rest of the row's budget
    goes to the best remaining scores of any head (a global top-k). Slots scored -inf are never kept.
    """
    b, h, n = scores.shape
    available = scores > -math.inf
    rank = descending_rank(scores)
    floor = floor.to(scores.device, non_blocking=True)
    chosen = (rank < floor[:, None, None]) & available
    rest = scores.masked_fill(chosen, -math.inf).reshape(b, h * n)
    remaining = total.to(scores.device, non_blocking=True) - chosen.reshape(b, -1).sum(-1)
    flat_rank = descending_rank(rest)
    extra = (flat_rank < remaining[:, None]) & (rest > -math.inf)
    return chosen | extra.view(b, h, n)

