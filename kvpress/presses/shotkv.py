"""ShotKV: in a few-shot prompt, keep or drop whole solved examples, ranked by the attention they get.

Liu et al. 2025, "Can LLMs Maintain Fundamental Abilities under KV Cache Compression?" (arXiv:2502.01941):
arithmetic and reasoning lose most under compression (17-43%), and token-level eviction breaks the
demonstrations it cuts into; ShotKV compresses the prefill at shot granularity (a shot is kept or dropped as a
whole, ranked by the attention it receives) and decoding separately, and keeps many-shot GSM8K accuracy where
token-level presses collapse.

Here the shots are the spans between occurrences of `shot_marker` in the prompt (found with the model's
tokenizer once the prompt is cached); each token takes the mean of the wrapped press's scores over its shot (the
text before the first marker is one span, the question after the last another), so whole shots are kept in
order of their mean score and only the shot at the edge of the budget is cut. Decoding is not compressed by this
press (as every press that ranks a whole prompt), which is the paper's separate decoding budget at its largest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from kvpress.presses.base import BasePress, Observation
from kvpress.presses.chunk import ChunkPress, segment_mean
from kvpress.presses.criticalkv import CriticalKVPress
from kvpress.presses.head_budget import HeadwisePress
from kvpress.presses.wrapping import WrapsPress, inner_flag


@dataclass
class ShotKVPress(WrapsPress, BasePress):
    """Wrap a token-level press: its scores averaged over the shots of a few-shot prompt, so shots stay whole.

    Parameters:
        press: the press that scores tokens (SnapKV by default in `shotkv`); its budget, sinks, window and
            per-layer scales are used as they are.
        shot_marker: the text that begins every shot (default "Question:", as the arithmetic task writes them);
            a prompt without it is refused.
    """

    needs_whole_context: ClassVar[bool] = True
    needs_tokenizer: ClassVar[bool] = True
    needs_token_ids: ClassVar[bool] = True

    press: BasePress | None = None
    shot_marker: str = "Question:"
    shots: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    chooses_by_position = inner_flag("chooses_by_position")  # (shots of positions over the wrapped press's scores)

    def __post_init__(self) -> None:
        self.adopt_press(refused=(HeadwisePress, ChunkPress, ShotKVPress, CriticalKVPress))
        if not isinstance(self.shot_marker, str) or not self.shot_marker.strip():
            raise ValueError(f"shot_marker must be a non-empty text, got {self.shot_marker!r}")
        self.rerotate, self.layer_scales = self.press.rerotate, self.press.layer_scales
        super().__post_init__()

    def prepare(self, model: nn.Module, recording, tokenizer=None) -> None:
        """Find the shots of the recorded prompt (`shots[i]`: the shot of token position i)."""
        if tokenizer is None:
            raise ValueError("ShotKVPress finds its shot marker with the model's tokenizer: pass tokenizer=")
        self.press.prepare(model, recording, tokenizer)
        if recording.ids.shape[0] != 1:
            raise ValueError(f"ShotKVPress finds the shots of one prompt at a time, got a batch of "
                             f"{recording.ids.shape[0]}")  # fmt: skip
        self.shots = shot_ids(recording.ids[0], tokenizer, self.shot_marker)

    def forget(self, cache=None) -> None:
        self.shots = None
        super().forget(cache)

    def score(self, obs: Observation) -> torch.Tensor:
        if self.shots is None:
            raise RuntimeError("ShotKVPress finds the shots of a whole prompt first: apply it to a prefill")
        pos = obs.layer.pos.long()
        shots = self.shots.to(pos.device)
        segment = shots[pos.clamp(max=shots.numel() - 1)]  # slots past the prompt (none at the prefill): the last
        return segment_mean(self.press.score(obs), segment, obs.layer.valid, shots.numel() + 1)


def shot_ids(ids: torch.Tensor, tokenizer, marker: str) -> torch.Tensor:
    """`[n]` for each token of `ids`, how many occurrences of `marker` begin at or before it (0: before the first).
    The marker is matched as tokenized alone and after a space or a blank line (BPE joins them differently)."""
    variants = {tuple(tokenizer(text, add_special_tokens=False).input_ids[-k:])
                for text in (marker, " " + marker, "\n\n" + marker)
                for k in [len(tokenizer(marker.strip(), add_special_tokens=False).input_ids)]}  # fmt: skip
    tokens = ids.tolist()
    starts = torch.zeros(len(tokens), dtype=torch.long)
    for pattern in variants:
        k = len(pattern)
        for i in range(len(tokens) - k + 1):
            if tuple(tokens[i : i + k]) == pattern:
                starts[i] = 1
    if not bool(starts.any()):
        raise ValueError(f"ShotKVPress found no shot marker {marker!r} in the prompt: give the text that begins "
                         "each shot as shot_marker")  # fmt: skip
    return starts.cumsum(0)
