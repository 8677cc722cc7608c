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

from kvpress.counts import check_whole


def word_edges(tokenizer, vocab: int) -> torch.Tensor:
    """`[vocab, 2]` uint8 per token id: (its text starts with an ASCII letter or digit, it ends with one); ids the
    tokenizer does not have (a model's embedding may have spare rows) are 0."""
    check_whole(vocab=(vocab, 1))
    edges = torch.zeros(vocab, 2, dtype=torch.uint8)
    # each token decoded after an anchor, the anchor's text cut off: decoded alone, a SentencePiece token's leading
    # space ("▁the") is stripped by decoders that strip the text's first space (Llama 2's, Metaspace), and every
    # word would seem to continue the one before it
    anchor = tokenizer(".", add_special_tokens=False).input_ids
    lead = len(tokenizer.decode(anchor))
    for i in range(min(vocab, len(tokenizer))):
        text = tokenizer.decode([*anchor, i])[lead:]
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
    before = None
    if held_pos.shape[-1]:  # the slot held just before the first new token (slot 0 of m = 1: no search)
        slot = None if held_pos.shape[-1] == 1 else (held_pos == new_pos[..., :1] - 1).float().argmax(-1, True)
        before = tuple(t[..., 0] if slot is None else t.gather(-1, slot)[..., 0]
                       for t in (held_pos, held_starts, held_ends))  # fmt: skip
    return _joined(edges, ids, new_pos, before)


def next_word_starts(
    edges: torch.Tensor, ids: torch.Tensor, new: torch.Tensor, pos: torch.Tensor, starts: torch.Tensor,
    ends: torch.Tensor, heads: int, alone: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`word_starts` over packed storage (a head-wise layer: every (row, KV head) pair in a segment of one tensor per
    kind of state), without views per pair: `ids` `[B, q]`, `new` `[B * heads, q]` the slots each pair put them in,
    the slot before a pair's first holding its previous token if still held, unless `alone` `[B * heads]` (bool)
    marks the pair as holding only the new ones (None: no pair does); `pos`, `starts`, `ends` the per-slot
    positions, word starts and endings. Returns the new slots' word starts and endings, `[B * heads * q]` each."""
    b, q = ids.shape
    new_pos = pos.index_select(0, new.reshape(-1)).view(b, heads, q)
    before = new[:, 0] - 1 if alone is None else (new[:, 0] - 1).clamp_min(0)  # (alone: another pair's slot)
    held = [t.index_select(0, before).view(b, heads) for t in (pos, starts, ends)]
    if alone is not None:
        held[0] = held[0].masked_fill(alone.view(b, heads), -2)  # -2: no position is one before the first new one
    word, end = _joined(edges, ids, new_pos, tuple(held))
    return word.reshape(-1), end.reshape(-1)


def _joined(edges: torch.Tensor, ids: torch.Tensor, new_pos: torch.Tensor,
            before: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`word_starts` given the token held just before the first new one (`before`: its position, word start and
    ending `[B, H]` each; a position other than one before the first new token's: not held), or None. Written
    out of place, in few tensor calls: a head-wise layer runs it in every layer at every decoding step."""
    flags = edges.index_select(0, ids.reshape(-1).to(edges.device).clamp(0, edges.shape[0] - 1))
    flags = flags.view(*ids.shape, 2).to(new_pos.device) > 0  # [B, q, 2]
    begins, ends = flags[..., 0], flags[..., 1]
    b, h, q = new_pos.shape
    values = new_pos.to(torch.float32, copy=True)  # never the caller's tensor (new_pos may be a view of a layer)
    if before is not None:  # the first new token takes the word start of the one before it where it continues it
        prev_pos, prev_start, prev_end = before
        first = ((prev_pos == new_pos[..., 0] - 1) & (prev_end > 0) & begins[:, :1])[..., None]  # [B, H, 1]
        if q > 1:
            first = torch.cat([first, first.new_zeros(b, h, q - 1)], dim=-1)
        values = torch.where(first, prev_start[..., None].float(), values)
    if q > 1:  # a token joining the one before it: -1, so the running max carries its word's start
        joins = torch.cat([begins.new_zeros(b, 1), begins[:, 1:] & ends[:, :-1]], dim=-1)
        values = values.masked_fill(joins[:, None], -1.0).cummax(-1).values
    return values, ends[:, None].expand(b, h, q).float()


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
