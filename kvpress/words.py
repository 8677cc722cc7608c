"""Whole words: which cached tokens belong to one word, so a press can keep or evict a word whole.

A word here is a run of tokens joined without a space or punctuation between them: a token continues the word
before it when its text starts with an ASCII letter or digit and the previous token's text ends with one. The
digits of a number ("85452" is five tokens in SmolLM2's vocabulary, one per digit), the pieces of a rare name, a
long identifier: a press that keeps "854" of "85452" has kept a wrong number. `word_edges` reads the two facts per
token id from a tokenizer (once per model: `kvpress train-scorer --update-words` ships them with KVzap's scorer);
`word_starts` gives each new cached token the position its word starts at, and `max_over_words` scores each
token as the best-scored token of its word.
"""

from __future__ import annotations

import torch


def word_edges(tokenizer, vocab: int) -> torch.Tensor:
    """`[vocab, 2]` uint8 per token id: (its text starts with an ASCII letter or digit, it ends with one); ids the
    tokenizer does not have (a model's embedding may have spare rows) are 0."""
    if vocab < 1:
        raise ValueError(f"vocab must be at least 1, got {vocab}")
    edges = torch.zeros(vocab, 2, dtype=torch.uint8)
    for i in range(min(vocab, len(tokenizer))):
        text = tokenizer.decode([i])
        if text:
            edges[i, 0] = text[0].isascii() and text[0].isalnum()
            edges[i, 1] = text[-1].isascii() and text[-1].isalnum()
    return edges


def word_starts(
    edges: torch.Tensor, ids: torch.Tensor, new_pos: torch.Tensor, held_pos: torch.Tensor,
    held_starts: torch.Tensor, held_ends: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """For the `q` new tokens `ids` `[B, q]` cached at positions `new_pos` `[B, H, q]`: the position their word
    starts at `[B, H, q]`, and whether each ends with a letter or digit (a later token may continue it). The first
    new token continues the word of the token just before it when that one is still held (among `held_pos`
    `[B, H, m]`, with the word starts and endings stored for them); otherwise it starts a word."""
    ids = ids.to(edges.device).clamp(0, edges.shape[0] - 1)
    flags = edges[ids].bool().to(new_pos.device)  # [B, q, 2]
    begins, ends = flags[..., 0], flags[..., 1]
    b, h, q = new_pos.shape
    values = torch.empty(b, h, q, device=new_pos.device).copy_(new_pos)  # ours to write (new_pos may be a view)
    if q > 1:  # a token joining the one before it: -1, so the running max below carries its word's start
        values[..., 1:] = values[..., 1:].masked_fill((begins[:, 1:] & ends[:, :-1])[:, None], -1.0)
    if held_pos.shape[-1]:  # the slot held just before the first new token (slot 0 of m = 1: no search)
        slot = None if held_pos.shape[-1] == 1 else (held_pos == new_pos[..., :1] - 1).float().argmax(-1, True)
        prev_pos, prev_start, prev_end = (t[..., 0] if slot is None else t.gather(-1, slot)[..., 0]
                                          for t in (held_pos, held_starts, held_ends))  # fmt: skip
        first = (prev_pos == new_pos[..., 0] - 1) & (prev_end > 0) & begins[:, :1]
        values[..., 0] = torch.where(first, prev_start.float(), values[..., 0])
    if q > 1:
        values = values.cummax(-1).values
    return values, ends[:, None].expand(b, h, q).float()


def next_word_starts(
    edges: torch.Tensor, ids: torch.Tensor, new: torch.Tensor, pos: torch.Tensor, starts: torch.Tensor,
    ends: torch.Tensor, heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`word_starts` for one new token a row (a decoding step) over packed storage, in fewer tensor calls (it runs in
    every layer at every step): `ids` `[B, 1]`, `new` `[B * heads]` the slot each (row, KV head) put it in, the slot
    before it holding that pair's previous token if still held (each pair holds more than the new one); `pos`,
    `starts`, `ends` the per-slot positions, word starts and endings. Returns the new slots' word starts and endings,
    `[B * heads]` each."""
    flags = edges.index_select(0, ids.reshape(-1).to(edges.device).clamp(0, edges.shape[0] - 1))
    flags = flags.to(new.device).repeat_interleave(heads, 0)  # [B * heads, 2]
    before = new - 1
    new_pos = pos.index_select(0, new)
    joins = (pos.index_select(0, before) == new_pos - 1) & (ends.index_select(0, before) > 0) & (flags[:, 0] > 0)
    return torch.where(joins, starts.index_select(0, before), new_pos.float()), flags[:, 1].float()


def max_over_words(scores: torch.Tensor, starts: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """`[B, H, n]` each slot's score replaced by the best score of a valid slot of its word (`starts`: the position
    its word starts at, per slot); slots that are not `valid` keep their own score and lend it to no one."""
    index = starts.long()
    index = index - index.amin(-1, keepdim=True)
    source = scores if valid is None else scores.masked_fill(~valid, -torch.inf)
    best = torch.full((*scores.shape[:-1], int(index.max()) + 1), -torch.inf, dtype=scores.dtype,
                      device=scores.device)  # fmt: skip
    out = best.scatter_reduce(-1, index, source, "amax").gather(-1, index)
    return out if valid is None else torch.where(valid, out, scores)
