"""Chunk-level selection: keep whole spans of tokens, so a number or a name is never cut in half.

ChunkKV, Liu et al. 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient
Long-Context LLM Inference" (arXiv:2502.00299): tokens are grouped into fixed-size chunks (10 in the
paper) by position, a chunk is scored by the scores of its tokens, and whole chunks are kept; at
equal memory this beats token-level SnapKV/PyramidKV on LongBench, NIAH and GSM8K. Here every token
takes the mean score of its chunk (a mean, so chunks thinned by earlier eviction compete fairly), and
the wrapped press's budget, sinks and window apply as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpress.presses.base import BasePress, Observation
from kvpress.presses.criticalkv import CriticalKVPress
from kvpress.presses.head_budget import HeadwisePress
from kvpress.presses.wrapping import WrapsPress, inner_flag


@dataclass
class ChunkPress(WrapsPress, BasePress):
    """Wrap a token-level press: its scores averaged over chunks of `chunk_size` consecutive positions.

    Parameters:
        press: the press that scores tokens (SnapKV, H2O, Knorm, ...); its budget, sinks, window and
            per-layer scales are used as they are.
        chunk_size: tokens per chunk (default 10, as in the paper).
    """

    press: BasePress | None = None
    chunk_size: int = 10
    chooses_by_position = inner_flag("chooses_by_position")  # (chunks of positions over the wrapped press's scores)

    def __post_init__(self) -> None:
        self.adopt_press(refused=(HeadwisePress, ChunkPress, CriticalKVPress))  # CriticalKV ranks in two stages
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {self.chunk_size!r}")
        self.rerotate, self.layer_scales = self.press.rerotate, self.press.layer_scales
        super().__post_init__()

    def score(self, obs: Observation) -> torch.Tensor:
        segment = obs.layer.pos.long() // self.chunk_size
        return segment_mean(self.press.score(obs), segment, obs.layer.valid, obs.layer.seen // self.chunk_size + 1)


def segment_mean(scores: torch.Tensor, segment: torch.Tensor, valid: torch.Tensor | None = None,
                 n_segments: int | None = None) -> torch.Tensor:  # fmt: skip
    """`[B, H, n]` each slot's score replaced by the mean over the held (`valid`) slots of its segment (`segment`
    `[B, H, n]`, ids >= 0), plus 1e-6 of its own: whole segments first, the tokens' own order within each.
    `n_segments`: more than the largest id, where the caller knows it (else it is read from the device)."""
    # float64: the tokens' own order within a segment (1e-6 of their scores) must survive the segment's mean,
    # which float32 rounds away (ties then fall to slot order, and a padded batch would differ from a row alone)
    scores = scores.double()
    weight = torch.ones_like(scores) if valid is None else valid.double()
    scores = scores.masked_fill(weight == 0, 0.0)
    n_segments = int(segment.max()) + 1 if n_segments is None else n_segments
    total = scores.new_zeros(*scores.shape[:2], n_segments).scatter_add_(-1, segment, scores)
    count = scores.new_zeros(*scores.shape[:2], n_segments).scatter_add_(-1, segment, weight)
    mean = total / count.clamp_min(1.0)
    return mean.gather(-1, segment) + 1e-6 * scores
