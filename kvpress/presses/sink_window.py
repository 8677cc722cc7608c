"""Sink + window: keep the first `n_sink` tokens and the most recent ones.

StreamingLLM, Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks"
(arXiv:2309.17453): 4 sink tokens plus a recent window keep perplexity stable over millions of
tokens, provided keys are re-rotated to positions inside the cache (`rerotate=True`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvpress.presses.base import BasePress, Observation


@dataclass
class SinkWindowPress(BasePress):
    """Keep `n_sink` attention sinks plus the most recent tokens.

    Parameters:
        compression_ratio / max_tokens: the budget (see `BasePress`); or `window`:
        window: recent tokens kept besides the sinks; sets `max_tokens = n_sink + window` (default None: the
            budget is given instead).
        n_sink: leading tokens always kept (default 4, as in the paper).
        rerotate: re-rotate kept keys to positions inside the cache, as StreamingLLM does.
    """

    budget_parameters: ClassVar[tuple[str, ...]] = ("window",)
    chooses_by_position: ClassVar[bool] = True

    n_sink: int = 4
    window: int | None = None

    def __post_init__(self) -> None:
        self._check_window()
        if self.window is not None:
            if self.max_tokens is not None or self.compression_ratio is not None:
                raise ValueError("SinkWindowPress takes window= or a budget (compression_ratio / max_tokens), not both")
            self.max_tokens = self.__dict__["_from_window"] = self.n_sink + self.window
        super().__post_init__()

    def _check_window(self) -> None:
        if isinstance(self.n_sink, bool) or not isinstance(self.n_sink, int) or self.n_sink < 0:
            raise ValueError(f"n_sink must be a non-negative integer, got {self.n_sink!r}")  # before max_tokens uses it
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                        or self.window < 1):  # fmt: skip
            raise ValueError(f"window must be a positive integer, got {self.window!r}")

    def _share_budget(self) -> None:
        """A press built with `window` keeps n_sink + window tokens, as set now (`window` or `n_sink` set since it
        was built move its budget); its max_tokens set apart from them is refused (`BasePress.check_budget`)."""
        self._check_window()
        if self.window is not None:
            if self.max_tokens not in (self.n_sink + self.window, self.__dict__.get("_from_window")):
                raise ValueError(f"SinkWindowPress built with window= takes its budget from it (max_tokens = "
                                 f"n_sink + window = {self.n_sink + self.window}), got max_tokens={self.max_tokens}: "
                                 "set window, not max_tokens")  # fmt: skip
            self.max_tokens = self.__dict__["_from_window"] = self.n_sink + self.window

    def score(self, obs: Observation) -> torch.Tensor:
        return obs.layer.pos.float()


StreamingLLMPress = SinkWindowPress
