"""Recall: evicted spans wait in host memory, and the spans a question needs come back into the working cache.

After Ltri-LLM (Tang et al. 2024, "Ltri-LLM: Streaming Long Context Inference for LLMs with Training-Free Dynamic
Triangular Attention Pattern", arXiv:2412.04757): attention over a long context is locally chunked, so the context
is cut into spans kept in an index outside the working memory, and the spans that match the current queries are
recalled. Query-agnostic compression must guess, before the question, what it will ask; recall corrects the
guess once the question is there, and working memory stays at the budget.

Here the wrapped press compresses the prompt as it would alone, while every prompt token's slots (keys, values,
positions, per-slot state) go to a `RoundStore` in host memory, by layer. When a question is read inside
`frozen()` (`kvpress.generate`, the pipeline, the sweeps), its queries are scored, per layer and KV head, against
every stored key; spans of `span_size` positions rank by the attention they get; the best spans' missing tokens are
exchanged, one for one, for the held tokens of the least attended spans (never the sinks, the recent window or the
question), at most `recall_fraction` of the held context per head. The question's last token then runs over the
exchanged cache (`Installable.recalls`), so the first answer token sees what was recalled; with `recall_every`,
decoding recalls again every that many tokens, by the current token's query. Simplifications against the paper:
spans are fixed runs of positions (not cut along the attention's local structure), and the index is the stored
keys themselves (exact, where the paper keeps a compact summary for 100K-token contexts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import Cache, DynamicCache

from kvpress.patches.cache import PressedLayer
from kvpress.presses.base import BasePress, Observation
from kvpress.presses.head_budget import HeadwisePress
from kvpress.presses.wrapping import WrapsPress
from kvpress.round_store import RoundStore

_UNPADDED = "RecallPress recalls into rows without padding: feed a padded batch one row at a time"


@dataclass
class RecallPress(WrapsPress, BasePress):
    """Compress with the wrapped press; when a question is read, swap in the stored spans it attends to most.

    Parameters:
        press: the token-level press that compresses the prompt (its budget, sinks, window and layer scales are
            used as they are; one that scores the whole context in a pass of its own, or a head-wise one, is
            refused).
        span_size: positions per span, the unit of recall (default 32).
        recall_fraction: at most this fraction of each head's held context is exchanged for recalled tokens when
            a question is read (default 0.25; 0: no recall). A pair is exchanged only where the recalled token's
            span outranks the dropped token's.
        recall_every: while decoding, recall again every this many tokens, ranked by the newest token's query
            (default 0: only when a question is read).
    """

    press: BasePress | None = None
    span_size: int = 32
    recall_fraction: float = 0.25
    recall_every: int = 0

    recalls: ClassVar[bool] = True
    observes_frozen: ClassVar[bool] = True
    wrappable: ClassVar[bool] = False  # it exchanges slots between forwards, under its own window

    def __post_init__(self) -> None:
        self.adopt_press(refused=(HeadwisePress,))
        if self.press.needs_whole_context:
            raise TypeError(f"RecallPress wraps a press that evicts inside the forward; {type(self.press).__name__} "
                            "scores the whole context in a pass of its own")  # fmt: skip
        if self.press.rerotate or self.press.kv_bits is not None:
            raise ValueError("RecallPress exchanges slots in place: its press cannot use rerotate=True or kv_bits")
        if isinstance(self.span_size, bool) or not isinstance(self.span_size, int) or self.span_size < 1:
            raise ValueError(f"span_size must be a positive integer, got {self.span_size!r}")
        f = self.recall_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
            raise ValueError(f"recall_fraction must be a fraction in [0, 1], got {f!r}")
        if isinstance(self.recall_every, bool) or not isinstance(self.recall_every, int) or self.recall_every < 0:
            raise ValueError(f"recall_every must be a non-negative integer (0: none while decoding), got "
                             f"{self.recall_every!r}")  # fmt: skip
        if self.recall_every and not f:
            raise ValueError(f"recall_every={self.recall_every} recalls recall_fraction of the held context, and "
                             "recall_fraction=0 recalls nothing: give a fraction > 0, or recall_every=0")  # fmt: skip
        super().__post_init__()

    def score(self, obs: Observation) -> torch.Tensor:
        return self.press.score(obs)

    def ranked_scores(self, obs: Observation, budgets: torch.Tensor, per_head_scale: bool = False) -> torch.Tensor:
        return self.press.ranked_scores(obs, budgets, per_head_scale)  # the wrapped press's own (CriticalKV's stages)

    def observe(self, obs: Observation) -> None:
        """A prompt's forward (or chunk): its tokens' slots go to the store before the press evicts."""
        self.press.observe(obs)
        layer = obs.layer
        if self._decoding_recall(obs):
            self._recall(obs)
        if obs.q_len < 2 or layer.window is not None:  # decoding steps are not stored; sliding layers forget
            return
        if layer.padded:
            raise ValueError(_UNPADDED)
        if layer.offloaded is None:
            layer.offloaded = SpanStore("cpu")
        new = torch.arange(layer.n, device=layer.keys.device) >= layer.n - obs.q_len
        layer.offloaded.put(obs.layer_idx, len(layer.offloaded), layer.copy_slots(new))
        layer.offloaded.unread = True

    def observe_frozen(self, obs: Observation) -> None:
        """A question read inside `frozen()`: recall the spans it attends to most."""
        if self.press.observes_frozen:
            self.press.observe_frozen(obs)
        store = obs.layer.offloaded
        question = store is not None and (obs.q_len >= 2 or store.unread)  # a one-token head of a split question too
        if (question and self.recall_fraction > 0) or self._decoding_recall(obs):
            self._recall(obs)
            store.unread = False

    def _decoding_recall(self, obs: Observation) -> bool:
        """Whether this decoding step recalls (every `recall_every` tokens seen)."""
        layer = obs.layer
        return (obs.q_len == 1 and self.recall_every > 0 and self.recall_fraction > 0 and layer.offloaded is not None
                and layer.seen % self.recall_every == 0)  # fmt: skip

    def _recall(self, obs: Observation) -> None:
        layer = obs.layer
        if layer.padded or layer.valid is not None:
            raise ValueError(_UNPADDED)
        q, device = obs.q_len, layer.keys.device
        n_old = layer.n - q  # the question's slots are the last q
        stored = {name: torch.cat([s[name] for s in layer.offloaded.spans(obs.layer_idx)], dim=2).to(device)
                  for name in ("keys", "values", *layer.slots)}  # fmt: skip
        relevance = _attention_over(obs, stored["keys"])  # [B, H, N]
        stored_pos, held_pos = stored["pos"].long(), layer.pos[..., :n_old].long()
        top = int(max(stored_pos.max(), layer.pos.max())) + 1
        held = torch.zeros(*held_pos.shape[:2], top, dtype=torch.bool, device=device).scatter_(-1, held_pos, True)
        missing = ~held.gather(-1, stored_pos)
        span = stored_pos // self.span_size
        span_score = torch.zeros(*span.shape[:2], int(span.max()) + 1, device=device).scatter_add_(-1, span, relevance)
        priority = span_score.gather(-1, span) + 1e-4 * relevance  # by span, then by token inside it
        by_pos = torch.full((*held_pos.shape[:2], top), math.inf, device=device).scatter_(-1, stored_pos, priority)
        seen = layer.seen - q
        recent = self.recent_count(self.budget_of(seen, self.layer_scale(obs.layer_idx, obs.n_layers)))
        protected = (held_pos < self.sink_count()) | (held_pos >= seen - recent)
        keep_priority = by_pos.gather(-1, held_pos).masked_fill(protected, math.inf)  # not stored: +inf too
        k = min(math.floor(self.recall_fraction * n_old), int(missing.sum(-1).min()),
                int(keep_priority.isfinite().sum(-1).min()))  # fmt: skip
        if k < 1:
            return
        recall_priority, recalled = priority.masked_fill(~missing, -math.inf).topk(k, dim=-1)
        drop_priority, dropped = keep_priority.topk(k, dim=-1, largest=False)
        exchange = recall_priority > drop_priority  # both sorted: the best recalled against the worst held
        slots = {name: t.gather(2, recalled if t.dim() == 3 else recalled[..., None].expand(*recalled.shape,
                                                                                            t.shape[-1]))
                 for name, t in stored.items()}  # fmt: skip
        layer.replace(dropped, slots, exchange)


class SpanStore(RoundStore):
    """A `RoundStore` of a prompt's spans that knows whether a question has read them yet (the first forward read
    inside `frozen()` after the prompt recalls, whatever its length)."""

    unread: bool = False

    def rewind_point(self) -> tuple[frozenset, bool]:
        """What `rewind` needs to forget every span stored from now on and whether a question has read them."""
        return frozenset(self._rounds), self.unread

    def rewind(self, point: tuple[frozenset, bool]) -> None:
        """Drop the spans stored since `rewind_point` gave `point` and put its `unread` back (`scratch`)."""
        kept, self.unread = point
        self._rounds = {key: slots for key, slots in self._rounds.items() if key in kept}


def _attention_over(obs: Observation, keys: torch.Tensor) -> torch.Tensor:
    """`[B, Hkv, N]` the softmax attention of `obs`'s new queries over `keys` `[B, Hkv, N, D]` (a context before
    them all), averaged over the queries and the query heads of each KV head."""
    return obs.grouped_logits(keys).softmax(dim=-1).mean(dim=2)


def offloaded_bytes(cache: DynamicCache) -> int:
    """Bytes a recalling press keeps outside the working cache (its stores), over every layer of `cache`."""
    if not isinstance(cache, Cache):
        raise TypeError(f"offloaded_bytes counts a transformers Cache (a DynamicCache), got {type(cache).__name__}")
    return sum(layer.offloaded.nbytes() for layer in cache.layers
               if isinstance(layer, PressedLayer) and layer.offloaded is not None)  # fmt: skip
