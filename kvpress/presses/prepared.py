"""What presses that score in `prepare` share (KVzip's reconstruction, Lookahead's draft): an observer of
the attention new queries pay the cached prompt, and the errors when such a press is used unprepared."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpress.engine import Observation
from kvpress.presses.base import BasePress

BLOCK_FLOATS = 2**21  # attention weights computed at once, fp32 (8 MB): the queries of a block are as many as fit
# (128 queries over 4,601 slots, KVzip at 8K on Qwen2.5-0.5B: 33 MB of weights, a call 93 MB above its forward's)


@dataclass
class PromptAttention:
    """An observer (`kvpress.engine.observe`): per compressible layer, the attention the queries fed while it
    observes pay each of the first `n_prompt` slots, over the query heads of each KV group: the largest
    (`peaks`, `[B, Hkv, n_prompt]`) and the sum with the number of (query, head) pairs that paid it (`sums`).
    `by_position`: per position of the prompt's first `n_prompt` tokens instead, 0 where a layer no longer holds
    the token (a cache a press compressed before: KVzip scoring a later chunk). `from_output`: read them from the
    weights the attention computed its output with, where it can (`weights_block`); False: compute them again here,
    as for the layers where it cannot (what `make bench` compares against). `live`: `[B]` bool, the rows whose
    queries count now (a draft's rows that have not ended); with it the counts are per row (`[B, 1, 1]`)."""

    n_prompt: int
    by_position: bool = False
    from_output: bool = True
    peaks: dict[int, torch.Tensor] = field(default_factory=dict)
    sums: dict[int, tuple[torch.Tensor, int | torch.Tensor]] = field(default_factory=dict)
    live: torch.Tensor | None = None

    def weights_block(self, layer, query_heads: int) -> int | None:
        """Queries a block whose weights fit in `BLOCK_FLOATS`: the attention computes the weights with its output
        and hands this observer their peak and sum (`Observation.peak`, `.mass`; see `kvpress.engine.observe`)."""
        if not self.from_output:
            return None
        return max(1, BLOCK_FLOATS // (layer.keys.shape[0] * query_heads * max(layer.n, 1)))

    def __call__(self, obs: Observation) -> None:
        if self.from_output and obs.peak is not None and obs.mass is not None:  # computed with the attention's output
            g = obs.query.shape[1] // obs.keys.shape[1]
            self._add(obs, self._on_prompt(obs, obs.peak, "amax"), self._on_prompt(obs, obs.mass, "sum"), g * obs.q_len)
            return
        peak, total, count = None, None, 0
        rows = max(1, BLOCK_FLOATS // (obs.query.shape[0] * obs.query.shape[1] * obs.keys.shape[2]))
        for start in range(0, obs.q_len, rows):  # the attention matrix a block of queries at a time
            probs = obs.attention_probs(start, min(start + rows, obs.q_len))  # [B, Hkv, g, w, m slots]
            chunk_peak = self._on_prompt(obs, probs.amax(dim=(2, 3)), "amax")
            chunk_total = self._on_prompt(obs, probs.sum(dim=(2, 3)), "sum")
            peak = chunk_peak if peak is None else torch.maximum(peak, chunk_peak)
            total = chunk_total if total is None else total + chunk_total
            count += probs.shape[2] * probs.shape[3]
            del probs  # freed before the next block's are computed
        self._add(obs, peak, total, count)

    def _add(self, obs: Observation, peak: torch.Tensor, total: torch.Tensor, count: int) -> None:
        """Fold one forward's peak, sum and (query, head) count per prompt token into the layer's."""
        if self.live is not None:  # a row that is not live adds nothing
            live = self.live.to(total.device)[:, None, None]
            peak, total, count = peak * live, total * live, count * live.long()
        if obs.layer_idx in self.peaks:
            peak = torch.maximum(self.peaks[obs.layer_idx], peak)
            total, count = total + self.sums[obs.layer_idx][0], count + self.sums[obs.layer_idx][1]
        self.peaks[obs.layer_idx], self.sums[obs.layer_idx] = peak, (total, count)

    def _on_prompt(self, obs: Observation, per_slot: torch.Tensor, reduce: str) -> torch.Tensor:
        """`per_slot` `[B, Hkv, m]` over the first m slots, cut (or moved) to the prompt's tokens."""
        if obs.layer.window is None and not self.by_position:  # nothing evicted: the first slots are the prompt's
            return per_slot[..., : self.n_prompt].clone()  # (a view kept the pass's whole buffer, ~2x, on the press)
        # a sliding-window layer holds the prompt's last tokens (a compressed one some of them): each slot to its
        # prompt position (one slot a position; slots past the prompt add nothing)
        pos = obs.layer.pos.long()[..., : per_slot.shape[-1]]
        paid = per_slot.masked_fill(pos >= self.n_prompt, 0)
        out = per_slot.new_zeros(*per_slot.shape[:-1], self.n_prompt)
        return out.scatter_reduce_(-1, pos.clamp(max=self.n_prompt - 1), paid, reduce=reduce)


def at_held_slots(per_token: torch.Tensor, obs: Observation) -> torch.Tensor:
    """Scores `[B, Hkv, n_prompt]` of a prepared prompt's tokens, for the slots `obs`'s layer holds (a
    sliding-window layer holds only the prompt's last tokens; a layer compressed by an earlier chunk, some; a
    head-wise view, its own (row, KV head)'s)."""
    per_token = per_token[obs.rows, obs.kv_heads]
    if obs.layer.window is None and obs.keys.shape[2] == per_token.shape[-1]:  # every token held, in order
        return per_token
    return per_token.gather(-1, obs.layer.pos.long().to(per_token.device))


def check_prepared(
    press: BasePress, tokens: int | None, obs: Observation, scored_by: str, call: str, chunks: bool = False
) -> None:
    """Raise unless `press` was prepared (`tokens`: the prompt length it scored, None if not prepared) on
    exactly the tokens `obs`'s layer holds (`chunks`: on every token the layer has seen, some of them evicted by
    the press after an earlier chunk). `scored_by` names its pass, `call` the way to compress with it."""
    name = type(press).__name__
    if tokens is None:
        raise RuntimeError(
            f"{name} scores by {scored_by} once the whole context is cached, so it cannot evict inside a "
            f"forward; compress with {call}, kvpress.recording.compress_recording, or `with press(model, "
            "tokenizer=tokenizer)`, which scores at the end of the prefill"
        )
    held = obs.keys.shape[2]  # every slot seen (padding too), or on a sliding-window layer its longest row's window
    if obs.layer.seen != tokens or (not chunks and held not in (obs.layer.seen, int(obs.layer.span.max()))):
        raise RuntimeError(
            f"{name} scored a prompt of {tokens} tokens but layer {obs.layer_idx} now holds {obs.keys.shape[2]} "
            f"of {obs.layer.seen}; it compresses the prompt it was prepared on, not later tokens"
        )
