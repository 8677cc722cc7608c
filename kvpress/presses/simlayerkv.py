"""SimLayerKV: "lazy" layers, whose last query looks only at the first and the most recent tokens, keep only those.

Zhang et al. 2024, "SimLayerKV: A Simple Framework for Layer-Level KV Cache Reduction" (arXiv:2410.13846): in some
layers the attention of the newest token falls almost entirely on the initial tokens and a recent window, and
those "lazy" layers can drop the rest of their cache with little loss; the other layers keep it all. The paper
marks a layer lazy when that attention mass passes a per-model threshold (0.65-0.9), so its compression is an
outcome; with 4-bit KIVI, 5x compression at a 1.2% drop on LongBench (LLaMA2-7B, LLaMA3-8B, Mistral-7B).

Here the budget decides instead: once the prompt is cached, every layer's laziness (the last `n_last` queries'
attention on the `n_sink` first and `window_size` most recent tokens, averaged over heads and queries) ranks
the layers, and the laziest become lazy, one after the other, until the cache fits the budget (the total of the
layers' budgets); a lazy layer keeps its sinks and window, the others everything. Each row of a batch has its own
plan, as it would alone (a layer lazy in one row may keep everything in another). If the budget is below every
layer's sinks and window, every layer keeps those (over budget, with the warning every press gives). As in the
paper, nothing is evicted while decoding: lazy layers grow from their window, and the kept fraction falls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from kvpress.engine import Observation
from kvpress.patches.user_warnings import warn
from kvpress.presses.base import BasePress


@dataclass
class SimLayerKVPress(BasePress):
    """Keep only the sinks and the recent window in the laziest layers, as many as the budget needs; the rest whole.

    Parameters:
        compression_ratio / max_tokens: the budget over all layers together (see `BasePress`).
        n_sink: initial tokens a lazy layer keeps (default 4, as in the paper).
        window_size: most recent tokens a lazy layer keeps (default 64; the paper keeps 1,024 of long contexts).
        n_last: last prompt queries whose attention measures a layer's laziness (default 1, as the paper's code).
    """

    needs_whole_context: ClassVar[bool] = True
    wrappable: ClassVar[bool] = False  # its layer plan is its own budget

    n_sink: int = 4
    window_size: int = 64
    n_last: int = 1
    lazy: dict[int, list[bool]] | None = field(default=None, init=False, repr=False, compare=False)  # per row

    def __post_init__(self) -> None:
        if isinstance(self.n_last, bool) or not isinstance(self.n_last, int) or self.n_last < 1:
            raise ValueError(f"n_last must be a positive integer, got {self.n_last!r}")
        if self.layer_scales is not None:
            raise ValueError("SimLayerKVPress decides each layer's budget itself: layer_scales is not its parameter")
        super().__post_init__()

    def prepare(self, model: nn.Module, recording, tokenizer=None) -> None:
        """Per row, rank the recorded layers by laziness and make the laziest lazy until the row's budget holds."""
        laziness, spans = {}, {}
        for idx, (module, query) in recording.queries.items():
            layer = recording.cache.layers[idx]
            obs = Observation(module, query, *layer.held_kv(), layer)
            laziness[idx] = self._laziness(obs)
            spans[idx] = layer.span_list()
        rows = len(next(iter(spans.values()), []))
        self.lazy = {idx: [False] * rows for idx in spans}
        for row in range(rows):
            span = {idx: n[row] for idx, n in spans.items()}
            budget = sum(self.kept_share(n) for n in span.values())  # (over all layers: no layer's own floor)
            kept = sum(span.values())
            for idx in sorted(span, key=lambda i: -laziness[i][row]):
                if kept <= budget:
                    break
                self.lazy[idx][row] = True
                kept -= span[idx] - min(span[idx], self.n_sink + self.window_size)
            if kept > budget and not self.__dict__.get("_said_lazy"):
                self.__dict__["_said_lazy"] = True  # (once per press, as its budget's other warnings)
                warn(f"SimLayerKVPress keeps {kept} tokens over all layers where its budget allows "
                     f"{budget}: every layer is lazy and keeps its {self.n_sink} sinks and window of "
                     f"{self.window_size}")  # fmt: skip

    def _laziness(self, obs: Observation) -> list[float]:
        """Per row, the last `n_last` queries' attention mass on the sinks and the recent window, averaged."""
        w = min(self.n_last, obs.q_len)
        probs = obs.attention_probs(obs.q_len - w, obs.q_len)  # [B, Hkv, g, w, m]
        pos = obs.layer.pos[..., : probs.shape[-1]].long()
        start = (obs.layer.real_seen - self.window_size)[:, None, None].to(pos.device)
        local = ((pos < self.n_sink) | (pos >= start))[:, :, None, None, :]
        return (probs * local).sum(-1).mean(dim=(1, 2, 3)).tolist()

    def score(self, obs: Observation) -> torch.Tensor:
        # a lazy layer keeps its protected sinks and window; where the sinks left a sliding window, the most recent
        # tokens before it take their share (all scored alike before: the slots' layout chose, so a row of a batch
        # kept other tokens than alone)
        return obs.layer.pos[..., : obs.keys.shape[2]].float()

    def row_budgets(self, layer_idx: int, n_layers: int, spans: list[int]) -> list[int]:
        lazy = (self.lazy or {}).get(layer_idx)
        if lazy is None:  # not planned (a layer the recording did not see): as any press
            return super().row_budgets(layer_idx, n_layers, spans)
        return [self.budget_of(n, 0.0 if is_lazy else math.inf) for n, is_lazy in zip(spans, lazy, strict=True)]

    def budget_of(self, seen: int, scale: float = 1.0) -> int:
        if scale == math.inf:  # a layer that is not lazy keeps everything
            return seen
        if scale == 0.0:  # a lazy layer: its sinks and window
            return min(seen, self.n_sink + self.window_size)
        return super().budget_of(seen, scale)
