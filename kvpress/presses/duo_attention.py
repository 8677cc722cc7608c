"""DuoAttention: retrieval heads keep the whole context, streaming heads only sinks and a recent window.

Xiao et al. 2024, "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming
Heads" (arXiv:2410.10819): a few heads retrieve from the whole context, the others only need
attention sinks and recent tokens; 2.55x (MHA) / 1.67x (GQA) less memory at equal accuracy. Which
heads retrieve is learned offline: here a head pattern made by `kvpress calibrate-heads` ranks the
(layer, KV head) pairs, and the top ones are retrieval heads. Streaming heads stay bounded while
decoding; retrieval heads keep growing. Each head's tokens live in storage of their own size.

A budget policy over any scorer: with `press=` (`duo-attention:inner=snapkv:retrieval_fraction=0.5`), the
retrieval heads keep what that press keeps of them at its own budget, instead of everything.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from kvpress.counts import floor_share
from kvpress.patches import kv_quantization as quant
from kvpress.patches import model_access
from kvpress.patches.head_cache import HeadwiseLayer
from kvpress.patches.user_warnings import warn
from kvpress.patterns import check_pattern, find_pattern, load_pattern
from kvpress.presses.base import BasePress, Observation, _check_ratio, check_field_types
from kvpress.presses.head_budget import HeadwisePress, descending_rank, head_observation, observe_every_head
from kvpress.presses.wrapping import check_settings, inner_flag, take_settings


@dataclass
class DuoAttentionPress(HeadwisePress):
    """Retrieval heads (by a head pattern) keep everything; streaming heads keep `n_sink` + `window`.

    Parameters:
        compression_ratio: fraction of the context's cache removed; the number of retrieval heads is
            chosen per row so that the kept bytes match it (given the context length, and on a model with
            sliding-window layers which of them the retrieval heads are in: such a head holds at most the
            window; see `retrieval_heads`), once: at the first
            forward where the row's budget holds more than a streaming head's `n_sink + window` (before that
            the row keeps everything; each row of a padded batch splits when it would alone). A context fed
            in chunks keeps that split, so later chunks are kept at the first split's share (below 1 - r). Or:
        retrieval_fraction: a fixed fraction of the (layer, KV head) pairs kept whole (rounded half up: 0.75 of 6
            pairs is 5, where Python's round gave 4, and 0.25 of 6 gave 2). Exactly one of the two.
        head_pattern: "auto" (default: the packaged pattern made for the model's architecture), a packaged
            pattern's model name ("smollm2-135m", "qwen2.5-0.5b"), a JSON path, or a dict; a pattern made
            for another architecture is refused when the press is installed.
        n_sink, window: what a streaming head keeps (defaults 4 and 64): the first `n_sink` positions (on a
            sliding-window layer, those its window still holds) and the last `window` tokens.
        press: a token-level press that compresses the retrieval heads, each at that press's budget (its
            `compression_ratio` or `max_tokens`, its sinks and window), during prefill and decoding
            (default None: retrieval heads keep everything). Needs `retrieval_fraction`.
    """

    budget_parameters: ClassVar[tuple[str, ...]] = ("retrieval_fraction",)

    head_pattern: str | dict = "auto"
    retrieval_fraction: float | None = None
    n_sink: int = 4
    window: int = 64
    press: BasePress | None = None

    def __post_init__(self) -> None:
        if self.press is None and isinstance(self.compression_ratio, BasePress):  # DuoAttentionPress(SnapKVPress(...))
            self.press, self.compression_ratio = self.compression_ratio, None
        if self.press is not None:
            if not isinstance(self.press, BasePress) or self.press.per_head or self.press.needs_whole_context \
                    or not self.press.wrappable:  # fmt: skip
                raise TypeError(f"DuoAttentionPress's press scores its retrieval heads: a token-level press that "
                                f"evicts inside a forward (SnapKV, H2O, Knorm, ...), got {self.press!r}")  # fmt: skip
            if self.compression_ratio is not None:
                raise ValueError("with press=, DuoAttentionPress takes retrieval_fraction (the retrieval heads keep "
                                 "what the press keeps at its own budget), not compression_ratio")  # fmt: skip
            if self.retrieval_fraction is None:
                raise ValueError("with press=, DuoAttentionPress needs retrieval_fraction, the share of KV heads that "
                                 "are retrieval heads (the press's own budget is what they keep)")  # fmt: skip
            if self.press.rerotate or self.press.layer_scales is not None:
                raise ValueError("DuoAttentionPress's press cannot re-rotate keys or set layer_scales")
            if self.press.kv_bits is not None:  # the whole layer is stored at one width: the inner press's
                if self.kv_bits not in (None, self.press.kv_bits):
                    raise ValueError(f"DuoAttentionPress has kv_bits={self.kv_bits}, its press "
                                     f"kv_bits={self.press.kv_bits}: give it once")  # fmt: skip
                self.kv_bits = self.press.kv_bits
        if self.layer_scales is not None or self.rerotate or self.decode_slack != BasePress.decode_slack:
            raise ValueError("DuoAttentionPress budgets heads, not layers or decoding steps (a streaming head keeps "
                             "n_sink + window, a retrieval head everything or what its press= keeps): it takes no "
                             "layer_scales, rerotate or decode_slack (give decode_slack to its press=), got "
                             f"layer_scales={self.layer_scales!r}, rerotate={self.rerotate!r}, "
                             f"decode_slack={self.decode_slack!r}")  # fmt: skip
        if self.kv_bits is not None:
            quant.check_bits(self.kv_bits)
        self._check_budget_values()
        for name in ("n_sink", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "n_sink" else 1):
                kind = "non-negative" if name == "n_sink" else "positive"
                raise ValueError(f"{name} must be a {kind} integer, got {value!r}")
        check_field_types(self)
        if self.press is not None:
            take_settings(self)  # (checked again as it installs: `_check_budget_values`)
        self.pattern = None if self.head_pattern == "auto" else load_pattern(self.head_pattern)
        # per model (by its attention modules): each head's rank and the (layer, KV head) pairs ranked
        self._plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.__dict__["_built_with"] = self._settings()  # (`BasePress.check_budget`: checked again where they move)

    def _take_rebuilt(self, rebuilt: BasePress, moved: list[str]) -> None:
        super()._take_rebuilt(rebuilt, moved)
        self.pattern = rebuilt.pattern  # (a head_pattern moved: its file read again)

    def _check_budget_values(self) -> None:
        """Exactly one of compression_ratio (in [0, 1)) and retrieval_fraction (in [0, 1]), no max_tokens (when built,
        and again as the press installs: `BasePress.check_budget`); its press's own budget is checked too."""
        if self.max_tokens is not None:
            raise ValueError("DuoAttentionPress takes compression_ratio or retrieval_fraction, not max_tokens")
        if (self.compression_ratio is None) == (self.retrieval_fraction is None):
            raise ValueError(
                "DuoAttentionPress takes exactly one of compression_ratio (a fraction in [0, 1)) or "
                f"retrieval_fraction (in [0, 1]), got {self.compression_ratio!r} and {self.retrieval_fraction!r}"
            )
        _check_ratio(self.compression_ratio)
        f = self.retrieval_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1):
            raise ValueError(f"retrieval_fraction must be a fraction in [0, 1], got {f!r}")
        if self.press is not None:
            self.press.check_budget()
            check_settings(self)

    def check_model(self, model: nn.Module) -> None:
        if self.press is not None:
            self.press.check_model(model)
        pattern = find_pattern(model) if self.head_pattern == "auto" else self.pattern  # "auto": this model's own
        check_pattern(pattern, model)
        scores = torch.tensor(pattern["scores"], dtype=torch.float64)
        full = torch.zeros(scores.shape[0], dtype=torch.bool)
        full[model_access.compressible_layers(model)] = True
        scores[~full] = -torch.inf  # layers a press leaves alone (chunked attention, ...): rank only the others
        order = scores.flatten().argsort(descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel())).view_as(scores)
        total = int(full.sum()) * scores.shape[1]  # the (layer, KV head) pairs a budget is spread over
        window, kinds = model_access.sliding_window(model), model_access.layer_types(model)
        # each of those pairs' window (inf: a full-attention layer), from the first to be a retrieval head on
        windows = torch.tensor([window if kinds[i // scores.shape[1]] == "sliding_attention" else math.inf
                                for i in order[:total].tolist()], dtype=torch.float64)  # fmt: skip
        plan = (rank, windows)
        for module in model_access.attention_modules(model).values():  # one press may serve several models
            self._plans[module] = plan

    UNDECIDED = HeadwiseLayer.UNDECIDED  # the head budget of a row whose split waits (a longer context, a new prompt)

    needs_hidden = inner_flag("needs_hidden")  # its retrieval heads' press's
    observes_frozen = inner_flag("observes_frozen")

    def sink_count(self) -> int:
        return self.n_sink

    def recent_count(self, budget):
        return self.window

    def retrieval_heads(self, real_seen: list[int], windows: torch.Tensor) -> torch.Tensor:
        """`[B]` on the host: how many of the (layer, KV head) pairs keep the whole context for rows that have seen
        `real_seen` real tokens; `windows`: each pair's sliding window (inf: full attention), in rank order.
        With `compression_ratio`: the count whose pairs hold, all together, the closest to what a dense press would
        keep of every pair (ties: more retrieval heads). A pair of a sliding-window layer holds at most its window
        (a streaming head: the sinks still in it and its last `window` tokens), so which pairs retrieve changes what
        a retrieval head costs."""
        if self.retrieval_fraction is not None:
            pairs = floor_share(2 * len(windows), self.retrieval_fraction)  # (round half up: 4.5 of 6 pairs is 5)
            return torch.full((len(real_seen),), (pairs + 1) // 2)
        counts = []
        for n in real_seen:
            spans = (windows - 1).clamp(max=n)  # what a retrieval head holds
            sinks = self.n_sink - (n - (windows - 1)).clamp(0, self.n_sink)  # (past a window the sinks leave it)
            streams = torch.minimum(spans, sinks + self.window)  # what a streaming head holds
            target = float((spans - floor_share(spans, self.compression_ratio)).sum())
            kept = torch.cat([spans.new_zeros(1), (spans - streams).cumsum(0)]) + streams.sum()  # with 0, 1, ... pairs
            gap = (kept - target).abs()
            counts.append(len(windows) - int(gap.flip(0).argmin()))  # the last of the closest
        return torch.tensor(counts)

    def select(self, obs: Observation) -> torch.Tensor | None:
        layer = obs.layer
        stream = self.n_sink + self.window
        held = layer.held()  # on the host, as every count below: a step that changes nothing reads nothing back
        if obs.q_len == 1 and not self.__dict__.get("_said_whole"):
            self._say_whole(layer.seen_list())
        if self.press is None and not bool((held > stream).any()):
            return None
        seen = layer.seen_list()
        ready = torch.tensor(self._ready(seen))
        if not bool(ready.any()):
            return None  # the split is decided once per row: wait until a row's budget holds more than a stream
        retrieval = self._retrieval(obs.module, seen)
        budget, target = self._targets(obs) if self.press is not None else (None, held)
        # per row: its streaming heads keep all they hold (no more than a stream's), its retrieval heads too
        keeps_all = (((held <= stream) | retrieval.all(-1)) & (~retrieval.any(-1) | (target >= held))) | ~ready
        if layer.valid is None and bool(keeps_all.all()):
            return None  # nothing evicted: the layer stays dense
        pos = layer.pos
        streaming = (pos < self.n_sink) | (pos >= (layer.real_seen - self.window)[:, None, None])
        whole = torch.ones_like(streaming) if self.press is None else self._scored(obs, budget, target)
        # a row not ready yet keeps every head whole (its split comes later, in `evict_heads`)
        retrieval = retrieval | ~ready[:, None]
        return torch.where(retrieval.to(pos.device, non_blocking=True)[:, :, None], whole, streaming)

    def keeps_whole(self, tokens: int) -> str | None:
        """As `BasePress.keeps_whole`, and (without `press=`) a context a streaming head holds whole, or with
        `compression_ratio` one whose budget is not more than a streaming head's: its heads wait to split (`_ready`),
        keeping everything."""
        if (why := super().keeps_whole(tokens)) is not None or self.kv_bits is not None or self.press is not None:
            return why
        if tokens <= self.n_sink + self.window:
            return (f"DuoAttentionPress's streaming heads keep their {self.n_sink} sinks and window of {self.window}, "
                    f"the whole context of {tokens} tokens: use a smaller window")  # fmt: skip
        if self._ready([tokens])[0]:
            return None
        return (f"DuoAttentionPress's budget at compression_ratio={self.compression_ratio} "
                f"({tokens - floor_share(tokens, self.compression_ratio)} of the context's {tokens} tokens) is not "
                f"more than a streaming head's n_sink + window ({self.n_sink + self.window}): its heads split only "
                "once a row's budget holds more, and every head keeps the whole context until then (a smaller window, "
                "or retrieval_fraction, splits them)")  # fmt: skip

    def _ready(self, seen: list[int]) -> list[bool]:
        """Per row that has seen `seen` real tokens: whether its heads split now (with `compression_ratio`, once
        its budget holds more than a streaming head's `n_sink + window`; with `retrieval_fraction`, always)."""
        if self.compression_ratio is None:
            return [True] * len(seen)
        return [n - floor_share(n, self.compression_ratio) > self.n_sink + self.window for n in seen]

    def _say_whole(self, seen: list[int]) -> None:
        """Say once per press that a row decodes unsplit, keeping everything (a chunk's row that splits at a later
        chunk is not said: only a decoding step's)."""
        ready = self._ready(seen)
        if not all(ready):
            self.__dict__["_said_whole"] = True  # as BasePress says its protected tokens over the budget
            n = seen[ready.index(False)]
            warn(f"DuoAttentionPress keeps all {n} tokens of a row: its budget at compression_ratio="
                 f"{self.compression_ratio} ({n - floor_share(n, self.compression_ratio)}) is not more than a "
                 f"streaming head's n_sink + window ({self.n_sink + self.window}); its heads split once the "
                 "row's budget holds more (a longer context, or a smaller window)")  # fmt: skip

    def _targets(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor]:
        """`[B]` on the host: the press's budget for each row of `obs`, and what a head over it is cut to."""
        budget = torch.tensor(self.press.row_budgets(obs.layer_idx, obs.n_layers, obs.layer.span_list()))
        return budget, torch.minimum(obs.layer.held(), self.press.target(budget, obs.q_len))

    def _scored(self, obs: Observation, budget=None, target=None) -> torch.Tensor:
        """`[B, H, n]` what `press` keeps of every head at its budget (each head its own top-k)."""
        if budget is None:
            budget, target = self._targets(obs)
        scores = self.press.ranked_scores(obs, budget)
        rank = descending_rank(scores)
        return (rank < target.to(rank.device, non_blocking=True)[:, None, None]) & (scores > -math.inf)

    def observe(self, obs: Observation) -> None:
        if self.press is not None:
            self.press.observe(obs)

    def observe_heads(
        self, module: nn.Module, query: torch.Tensor, layer: HeadwiseLayer, hidden=None, ids=None, mass=None
    ) -> None:
        if self.press is not None:  # retrieval heads: the press's state
            retrieval = [tuple(pair) for pair in (layer.head_budget < 0).nonzero().tolist()]
            observe_every_head(self.press, module, query, layer, hidden, ids, mass, retrieval)

    def head_budgets(self, obs: Observation) -> torch.Tensor:
        """Streaming heads stay bounded from now on; -1: a retrieval head; `UNDECIDED`: a row not split yet."""
        return self._budgets(obs.module, obs.layer.seen_list())

    def _budgets(self, module: nn.Module, seen: list[int]) -> torch.Tensor:
        """`[B, H]` on the host: the head budgets (see `head_budgets`) of rows that have seen `seen` real tokens."""
        budgets = torch.where(self._retrieval(module, seen), -1, self.n_sink + self.window)
        return torch.where(torch.tensor(self._ready(seen))[:, None], budgets, self.UNDECIDED)

    def head_rank(self, model: nn.Module) -> torch.Tensor:
        """`[layers, KV heads]` each head's rank for `model` (0: the first to be a retrieval head), once the
        press was installed on it."""
        rank, _ = self._plans[model_access.attention_modules(model)[model_access.compressible_layers(model)[0]]]
        return rank

    def _retrieval(self, module: nn.Module, real_seen: list[int]) -> torch.Tensor:
        """`[B, H]` on the host: True for the retrieval heads of the layer of attention module `module`, for rows
        that have seen `real_seen` real tokens."""
        rank, windows = self._plans[module]
        return rank[model_access.layer_index(module)][None] < self.retrieval_heads(real_seen, windows)[:, None]

    def evict_heads(self, module: nn.Module, query: torch.Tensor, layer: HeadwiseLayer) -> None:
        undecided = [row for row in range(layer.batch) if int(layer.head_budget[row, 0]) == self.UNDECIDED]
        if undecided:  # (on the host) a row that waited for a longer context splits its heads when it is ready
            seen = layer.seen_list()
            for row in undecided:  # (`_budgets` keeps it undecided until then)
                layer.head_budget[row] = self._budgets(module, [seen[row]])[0]
        if self.press is not None:  # retrieval heads over the press's budget: its top-k of each head
            budgets = self.press.row_budgets(model_access.layer_index(module), model_access.layer_count(module),
                                             layer.span_list())  # fmt: skip
            for row, head in (layer.head_budget == -1).nonzero().tolist():
                if layer.lengths[row * layer.heads + head] > budgets[row]:
                    obs, _ = head_observation(module, query, layer, row, head)
                    budget, target = self._targets(obs)  # a head holds no padding: it keeps exactly `target`
                    kept = self._scored(obs, budget, target)[0, 0]
                    order = (~kept).to(torch.uint8).argsort(stable=True)  # the kept slots first, in order
                    layer.keep(row, head, order[: int(target[0])])
        # a streaming head's sinks are its first slots (the first positions), those a sliding window still holds
        sinks = [self.n_sink - min(max(n - (layer.window - 1), 0), self.n_sink) if layer.window else self.n_sink
                 for n in layer.seen_list()]  # fmt: skip
        streaming = (layer.head_budget >= 0).flatten().nonzero().flatten().tolist()
        for first in sorted(set(sinks)):  # (one call for rows alike: all of them but in a padded batch)
            over = [i for i in streaming if sinks[i // layer.heads] == first and layer.lengths[i] > first + self.window]
            layer.keep_ends(over, first, self.window)
