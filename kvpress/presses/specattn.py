"""SpecAttn: the attention a cheap draft of the answer pays chooses the tokens the model keeps.

Shah 2025, "SpecAttn: Speculating Sparse Attention" (arXiv:2510.27641, NeurIPS 2025): in speculative decoding
the draft model has already computed attention over the context; each target layer reads the draft layer whose
attention is closest to its own in KL divergence, and the draft's weights (top-p) choose the keys the target
attends to: 78% fewer KV reads for +15% perplexity on PG-19.

Here the draft is the model itself with layers skipped (self-speculative: the two packaged models tokenize
differently, so neither can draft for the other). It skips every `skip_every`-th decoder layer (never the
first or the last), reads the full cache at the others, and writes `lookahead` tokens greedily after the prompt
(the answer to its question); by default it skips none, since on the 135M model any skipping lost a needle
(the class docstring). Each (layer, KV head) of the model is paired with the drafted (layer, KV head) whose
attention over the context is closest in KL divergence (from the prompt's last `window_size` queries, which the
prefill computed at every layer; a drafted pair is its own closest), and its tokens are scored by the attention
that pair's draft queries paid them. The budget (`compression_ratio` or `max_tokens`) replaces the paper's
top-p: `adakv:inner=specattn` spreads it across heads by these scores.

Query-aware, like Lookahead (which also averages in the question's own attention and pools neighbours): the
draft answers the prompt's question.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from kvpress.engine import Observation
from kvpress.patches import model_access
from kvpress.presses.base import BasePress
from kvpress.presses.lookahead import draft_attention
from kvpress.presses.prepared import check_prepared


@dataclass
class SpecAttnPress(BasePress):
    """Keep the tokens a draft of the answer attends to (the model itself, optionally with layers skipped: each
    layer then read through its closest drafted layer by KL divergence).

    Parameters:
        compression_ratio / max_tokens: the budget (see `BasePress`).
        skip_every: the draft skips every `skip_every`-th decoder layer, never the first or the last (4: a
            quarter of them; 2: half; default 0: none, the draft of Lookahead, scored by the draft alone).
        lookahead: answer tokens drafted greedily (default 8); the draft stops early at end-of-sequence.
        window_size: last prompt tokens always kept, whose queries also pair the layers (default 16).
        n_sink: leading tokens always kept (default 0).

    Needs the question prefilled with the context (query-aware: `kvpress.generate(..., query_aware=True)`,
    `kvpress sweep --query-aware`) and a model whose layers all attend to the whole context (no sliding
    window). Cost: `lookahead` + 1 draft steps over the full cache with the skipped layers' work left out, and
    the window's attention at every layer (the cache drops the draft's tokens after: no copy).

    Default chosen on tuning seed 1 (SmolLM2, needles in noise and in pydoc, 1,024 tokens, 16 examples,
    query-aware; `eval/results/sweep-specattn-tuning`): skipping every 2nd, 3rd or 4th layer kept the noise needle
    but lost the pydoc one (0.00-0.25 at r = 0.5-0.9) where the whole-model draft kept 0.94 at every ratio.
    """

    needs_whole_context: ClassVar[bool] = True
    needs_tokenizer: ClassVar[bool] = True
    needs_token_ids: ClassVar[bool] = True
    needs_question: ClassVar[bool] = True

    skip_every: int = 0
    lookahead: int = 8
    window_size: int = 16
    n_sink: int = 0
    scores: dict[int, torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.skip_every, bool) or not isinstance(self.skip_every, int) or self.skip_every == 1 \
                or self.skip_every < 0:  # fmt: skip
            raise ValueError(f"skip_every must be 0 (skip none) or an integer >= 2, got {self.skip_every!r}")
        if isinstance(self.lookahead, bool) or not isinstance(self.lookahead, int) or self.lookahead < 1:
            raise ValueError(f"lookahead must be a positive integer, got {self.lookahead!r}")
        if isinstance(self.window_size, int) and not isinstance(self.window_size, bool) and self.window_size < 1:
            raise ValueError(f"window_size must be a positive integer (its queries pair the layers), got "
                             f"{self.window_size!r}")  # fmt: skip
        super().__post_init__()

    def check_model(self, model: nn.Module) -> None:
        if model_access.has_sliding_layers(model):
            raise ValueError(f"SpecAttnPress pairs layers by their attention over the whole context; "
                             f"{type(model).__name__} has layers of other kinds "
                             f"({model_access.other_layer_kinds(model)})")  # fmt: skip
        n_layers = len(model_access.decoder_layers(model))  # refuses a decoder whose layers it cannot skip
        if self.skip_every and not layers_to_skip(n_layers, self.skip_every):
            fits = f"give 2 to {n_layers - 1}, or 0" if n_layers > 2 else "give 0"
            raise ValueError(f"skip_every={self.skip_every} skips no layer of {type(model).__name__}'s {n_layers} "
                             f"(never the first or the last): {fits} to skip none")  # fmt: skip

    def prepare(self, model: nn.Module, recording, tokenizer=None) -> None:
        """Draft the answer with layers skipped, then pair every layer with its closest drafted one (once per
        recording, kept in `recording.memo`)."""
        if recording.next_ids is None:
            raise ValueError("SpecAttnPress drafts the answer to the prompt's question, so the question must be "
                             "prefilled with the context: use query_aware=True (kvpress.generate, kvpress sweep "
                             "--query-aware, the lm-eval bridge's query_aware=true)")  # fmt: skip
        key = ("specattn", self.skip_every, self.lookahead, self.window_size)
        if key not in recording.memo:
            n_layers = len(model_access.decoder_layers(model))
            skip = layers_to_skip(n_layers, self.skip_every)
            draft = draft_attention(model, recording, self.lookahead, tokenizer, skip)
            profiles = {idx: window_profile(recording, idx, self.window_size) for idx in recording.queries}
            recording.memo[key] = paired_scores(profiles, {idx: total / count for idx, (total, count) in draft.items()})
        self.scores = recording.memo[key]

    def forget(self, cache=None) -> None:
        self.scores = None

    def score(self, obs: Observation) -> torch.Tensor:
        tokens = None if self.scores is None else self.scores[obs.layer_idx].shape[-1]
        check_prepared(self, tokens, obs, "a layer-skipped draft of the answer",
                       "kvpress.generate(..., query_aware=True)")  # fmt: skip
        return self.scores[obs.layer_idx]


def layers_to_skip(n_layers: int, every: int) -> frozenset[int]:
    """The decoder layers a draft with `skip_every=every` skips: every `every`-th, never the first or the last."""
    return frozenset(range(every - 1, n_layers - 1, every)) if every else frozenset()


def window_profile(recording, idx: int, window: int) -> torch.Tensor:
    """`[B, Hkv, n]`: the attention the prompt's last `window` recorded queries paid each context token at layer
    `idx`, averaged over them and the query heads of each KV head (a distribution per KV head)."""
    module, query = recording.queries[idx]
    layer = recording.cache.layers[idx]
    obs = Observation(module, query, *layer.held_kv(), layer)
    w = min(window, obs.q_len)
    return obs.attention_probs(obs.q_len - w, obs.q_len).mean(dim=(2, 3))


def paired_scores(profiles: dict[int, torch.Tensor], draft: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Per layer of `profiles`, `[B, Hkv, n]`: each KV head's scores are the `draft` scores of the drafted (layer,
    KV head) whose profile is closest to its own in KL divergence, KL(its profile || the drafted one's)."""
    drafted = sorted(draft)
    candidates = torch.cat([profiles[d] for d in drafted], dim=1)  # [B, D * Hkv, n]
    scores = torch.cat([draft[d] for d in drafted], dim=1)
    log_candidates = candidates.clamp_min(torch.finfo(candidates.dtype).tiny).log()
    out = {}
    for idx, p in profiles.items():
        log_p = p.clamp_min(torch.finfo(p.dtype).tiny).log()
        # KL(p || c) = sum p log p - sum p log c, for every pair of a head here and a drafted head
        kl = (p * log_p).sum(-1)[:, :, None] - p @ log_candidates.transpose(-1, -2)  # [B, Hkv, D * Hkv]
        nearest = kl.argmin(dim=-1)  # [B, Hkv]
        out[idx] = scores.gather(1, nearest[..., None].expand(-1, -1, scores.shape[-1]))
    return out


