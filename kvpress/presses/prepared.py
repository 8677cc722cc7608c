"""What presses that score in `prepare` share (KVzip's reconstruction, Lookahead's draft): an observer of
the attention new queries pay the cached prompt, and the errors when such a press is used unprepared."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpress.engine import Observation
from kvpress.presses.base import BasePress

QUERY_CHUNK = 128  # queries whose attention is computed at once (all 512: the 4K KVzip peak 148 MB higher)


@dataclass
class PromptAttention:
    """An observer (`kvpress.engine.observe`): per compressible layer, the attention the queries fed while it
    observes pay each of the first `n_prompt` slots, over the query heads of each KV group: the largest
    (`peaks`, `[B, Hkv, n_prompt]`) and the sum with the number of (query, head) pairs that paid it (`sums`)."""

    n_prompt: int
    peaks: dict[int, torch.Tensor] = field(default_factory=dict)
    sums: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)

    def __call__(self, obs: Observation) -> None:
        peak, total, count = None, None, 0
        for start in range(0, obs.q_len, QUERY_CHUNK):  # the attention matrix a chunk of queries at a time
            probs = self._on_prompt(obs, obs.attention_probs(start, min(start + QUERY_CHUNK, obs.q_len)))
            chunk_peak, chunk_total = probs.amax(dim=(2, 3)), probs.sum(dim=(2, 3))
            peak = chunk_peak if peak is None else torch.maximum(peak, chunk_peak)
            total = chunk_total if total is None else total + chunk_total
            count += probs.shape[2] * probs.shape[3]
        if obs.layer_idx in self.peaks:
            peak = torch.maximum(self.peaks[obs.layer_idx], peak)
            total, count = total + self.sums[obs.layer_idx][0], count + self.sums[obs.layer_idx][1]
        self.peaks[obs.layer_idx], self.sums[obs.layer_idx] = peak, (total, count)

    def _on_prompt(self, obs: Observation, probs: torch.Tensor) -> torch.Tensor:
        """`probs` `[B, Hkv, g, w, m]` over the first m slots, cut (or gathered) to the prompt's tokens."""
        if obs.layer.window is None:  # nothing evicted: the first slots are the prompt's tokens
            return probs[..., : self.n_prompt]
        # a sliding-window layer holds the prompt's last tokens: each slot to its prompt position
        pos = obs.layer.pos.long()[..., : probs.shape[-1]][:, :, None, None].expand_as(probs)
        paid = probs.masked_fill(pos >= self.n_prompt, 0)
        out = probs.new_zeros(*probs.shape[:-1], self.n_prompt)
        return out.scatter_add_(-1, pos.clamp(max=self.n_prompt - 1), paid)


def at_held_slots(per_token: torch.Tensor, obs: Observation) -> torch.Tensor:
    """Scores `[B, Hkv, n_prompt]` of a prepared prompt's tokens, for the slots `obs`'s layer holds (a
    sliding-window layer holds only the prompt's last tokens)."""
    if obs.layer.window is None:
        return per_token
    return per_token.gather(-1, obs.layer.pos.long().to(per_token.device))


def check_prepared(press: BasePress, tokens: int | None, obs: Observation, scored_by: str, call: str) -> None:
    """Raise unless `press` was prepared (`tokens`: the prompt length it scored, None if not prepared) on
    exactly the tokens `obs`'s layer holds. `scored_by` names its pass, `call` the way to compress with it."""
    name = type(press).__name__
    if tokens is None:
        raise RuntimeError(
            f"{name} scores by {scored_by} once the whole context is cached, so it cannot evict inside a "
            f"forward; compress with {call}, kvpress.recording.compress_recording, or `with press(model, "
            "tokenizer=tokenizer)`, which scores at the end of the prefill"
        )
    if obs.layer.seen != tokens or obs.keys.shape[2] != int(obs.layer.span.max()):
        raise RuntimeError(
            f"{name} scored a prompt of {tokens} tokens but layer {obs.layer_idx} now holds {obs.keys.shape[2]} "
            f"of {obs.layer.seen}; it compresses the prompt it was prepared on, not later tokens"
        )
