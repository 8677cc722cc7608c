"""Lookahead: score the context by the attention of the answer the model is about to write.

Wang et al. 2025, "Lookahead Q-Cache: Achieving More Consistent KV Cache Eviction via Pseudo Query"
(arXiv:2505.20334, EMNLP 2025): prefill queries (SnapKV's observation window) are a proxy for the
decoding queries; a few greedily drafted answer tokens are a closer one. Their queries join the
observation window (LAQ++: window and lookahead together) and the pooled attention they pay decides
what stays; 1-4 points over SnapKV on LongBench at small budgets, near-lossless needle retrieval.
SpecKV (Galim et al. 2025, arXiv:2506.08373) drafts with a smaller model; here the model drafts
itself from the full cache, before anything is evicted.

Query-aware by construction: the draft answers the prompt's question, so the compressed cache serves
that question (`kvpress.generate(..., query_aware=True)`, the lm-eval bridge's `query_aware=true`,
`kvpress sweep --query-aware`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from kvpress.engine import observe
from kvpress.patches import model_access
from kvpress.patches.cache import draft_view, scratch
from kvpress.presses.base import Observation
from kvpress.presses.prepared import PromptAttention, at_held_slots, check_prepared
from kvpress.presses.snapkv import SnapKVPress, pool_by_position

QUERY_AWARE_ONLY = (
    "LookaheadPress drafts the answer to the prompt's question, so the question must be prefilled with the "
    "context: use query_aware=True (kvpress.generate, kvpress generate --query-aware, the lm-eval bridge's "
    "query_aware=true, kvpress sweep --query-aware)"
)


@dataclass
class LookaheadPress(SnapKVPress):
    """SnapKV whose observation window also holds `lookahead` drafted answer tokens.

    Parameters:
        compression_ratio / max_tokens: the budget (see `BasePress`).
        lookahead: answer tokens drafted greedily from the full cache (default 8); their queries, the
            prompt's last token's and the window's are averaged alike. The draft stops early at
            end-of-sequence (each row of a batch at its own).
        window_size: last prompt tokens in the observation window, always kept (default 16: the question).
        kernel_size: average pooling over neighbouring tokens (default 5), as in SnapKV.
        n_sink: leading tokens always kept (default 0).

    The draft starts from the prompt's last token, which the caller feeds after compression
    (`Recording.next_ids`); without it (a query-agnostic prefill: no question yet) the press refuses.
    Cost: `lookahead` decoding steps over the full cache before it is compressed (in the cache itself,
    which drops them after: it holds `lookahead` + 1 tokens more, no copy).

    Defaults chosen on tuning seeds 1 and 2 (eval/results/notes/tuning.md): on SmolLM2's needles
    Lookahead kept the full cache's score at r = 0.5 and 0.75 alone, in ChunkKV and in AdaKV, with
    kernel 5 or 1.
    """

    needs_whole_context: ClassVar[bool] = True
    needs_tokenizer: ClassVar[bool] = True
    needs_token_ids: ClassVar[bool] = True
    needs_question: ClassVar[bool] = True

    lookahead: int = 8
    window_size: int = 16
    draft: dict[int, tuple[torch.Tensor, int]] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.lookahead, bool) or not isinstance(self.lookahead, int) or self.lookahead < 1:
            raise ValueError(f"lookahead must be a positive integer, got {self.lookahead!r}")
        super().__post_init__()

    def prepare(self, model: nn.Module, recording, tokenizer=None) -> None:
        """Draft the answer from the recorded full cache (once per recording, kept in `recording.memo`)."""
        if recording.next_ids is None:
            raise ValueError(QUERY_AWARE_ONLY)
        key = ("lookahead", self.lookahead)
        if key not in recording.memo:
            recording.memo[key] = draft_attention(model, recording, self.lookahead, tokenizer)
        self.draft = recording.memo[key]

    def forget(self, cache=None) -> None:
        self.draft = None

    def score(self, obs: Observation) -> torch.Tensor:
        tokens = None if self.draft is None else self.draft[obs.layer_idx][0].shape[-1]
        check_prepared(self, tokens, obs, "a draft of the answer", "kvpress.generate(..., query_aware=True)")
        total, count = self.draft[obs.layer_idx]
        w = min(self.window_size, obs.q_len)
        window = obs.attention_probs(obs.q_len - w, obs.q_len)  # [B, Hkv, g, w, n]
        mean = (window.sum(dim=(2, 3)) + at_held_slots(total, obs)) / (window.shape[2] * w + count[obs.rows])
        return pool_by_position(mean, obs.layer, self.kernel_size)


@torch.no_grad()
def draft_attention(model: nn.Module, recording, steps: int, tokenizer=None,
                    skip: frozenset[int] = frozenset()) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Feed `recording.next_ids`, then up to `steps` greedy tokens, over the recorded cache (which drops them
    after: no copy); per compressible layer, the attention those queries paid the recorded tokens, summed, and
    per row how many (query, head) pairs paid it (`PromptAttention.sums`, counts `[B, 1, 1]`). Each row of a
    padded batch drafts as it would alone: from the position after its real tokens, and until its own
    end-of-sequence (a row that ended adds nothing more). `skip`: decoder layers the draft does not run (a
    layer-skipped draft of the model itself, `model_access.skipped_layers`): they have no entry."""
    fed = recording.next_ids
    observer = PromptAttention(n_prompt=recording.tokens, live=torch.ones(fed.shape[0], dtype=torch.bool))
    eos = tokenizer.eos_token_id if tokenizer is not None else model.config.eos_token_id
    eos = torch.tensor(sorted(set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}), dtype=torch.long)
    counted = next(layer for layer in recording.cache.layers if getattr(layer, "real_seen", None) is not None)
    first = counted.real_seen[:, None].to(fed.device, copy=True)  # each row's next position (a copy: commits add)
    cache = draft_view(recording.cache, set(skip)) if skip else recording.cache
    with observe(model, observer), scratch(cache) as work, model_access.skipped_layers(model, skip):
        for step in range(steps + 1):
            logits = model(fed, cache=work, use_cache=True, logits_to_keep=1, position_ids=first + step).logits
            fed = logits[:, -1].argmax(dim=-1, keepdim=True)
            observer.live = observer.live & ~torch.isin(fed.flatten().cpu(), eos)  # (read: a draft is a prefill's)
            if step == steps or not bool(observer.live.any()):
                break
    return observer.sums
