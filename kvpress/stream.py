"""`kvpress.stream`: read a token stream of any length through a bounded cache, scoring every token.

StreamingLLM's evaluation (Xiao et al. 2023): the text is fed in chunks, each chunk attends to what
the press kept of the past, and the negative log-likelihood of every token is yielded, so perplexity
can be followed over millions of tokens with the memory of a few thousand.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedTokenizerBase

from kvpress.patches import model_access
from kvpress.patches.user_warnings import warn
from kvpress.pipeline import check_no_outer_press, check_press, check_token_ids
from kvpress.presses.base import BasePress


def stream_ids(tokenizer, text_or_ids) -> torch.Tensor:
    """The stream as a 1-D tensor of token ids."""
    if isinstance(text_or_ids, str):
        if not text_or_ids:
            raise ValueError("the text to stream is empty")
        if not callable(tokenizer):
            raise TypeError(f"a text is streamed as the tokenizer's token ids: give the model's tokenizer (or token "
                            f"ids in place of the text), got tokenizer={tokenizer!r}")  # fmt: skip
        ids = tokenizer(text_or_ids, return_tensors="pt").input_ids[0]
    else:
        try:
            ids = torch.as_tensor(text_or_ids)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"the stream is a text or its token ids (a tensor, array or sequence of integers), got "
                            f"{type(text_or_ids).__name__}") from None  # fmt: skip
        if not (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):  # (those: check_token_ids)
            ids = ids.long()  # (int32 ids, numpy's: the loss takes int64 targets)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() < 2:
        raise ValueError(f"stream needs at least 2 tokens (a text, or a 1-D sequence of token ids), got shape "
                         f"{tuple(ids.shape)}")  # fmt: skip
    return ids


def stream(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase | None,
    text_or_ids: str | torch.Tensor | Sequence[int],
    press: BasePress | None = None,
    chunk: int = 64,
    limit: int | None = None,
    cache: DynamicCache | None = None,
    progress: bool = True,
) -> Iterator[torch.Tensor]:
    """An iterator yielding, chunk by chunk, the negative log-likelihood (nats, fp32) of each token of the stream.
    Its arguments are checked when it is called; the press is installed for each of its forwards only, so while
    the iterator waits (or is left unfinished) the model is as it was, for the caller's forwards and other presses.

    Parameters:
        press: what bounds the cache, typically `SinkWindowPress(n_sink=4, window=W, rerotate=True)`;
            any press that scores tokens as they are cached works (it evicts after every chunk); one that
            scores a whole prompt in a pass of its own (KVzip, ...) is refused. None keeps the full cache,
            which is only possible while the stream fits the model's `max_position_embeddings`; a press without
            `rerotate=True` streams past them with a warning (the positions it never saw: StreamingLLM's
            measure of why re-rotation matters).
        chunk: tokens fed per forward; within a chunk each token also sees the chunk's earlier tokens.
        limit: read at most this many tokens of the stream.
        cache: a `DynamicCache` to use, so the caller can inspect it between chunks.

    The first token has no prediction: the NLLs cover tokens 1..N-1, in order. Over long streams,
    copy them into one preallocated tensor (or floats) rather than keeping every small tensor: those
    between the large per-chunk logits fragment the heap and the process memory creeps up.
    """
    model_access.check_is_model(model)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    check_press(press)
    if press is None:
        check_no_outer_press(model, "kvpress.stream", "the stream")
    if press is not None and press.needs_whole_context:
        raise ValueError(f"{type(press).__name__} compresses a whole prompt once, in a pass over all of it: a stream "
                         "fed chunk by chunk needs a press that scores tokens as they are cached (sink-window, "
                         "snapkv, kvzap, ...)")  # fmt: skip
    if cache is not None and not isinstance(cache, DynamicCache):
        raise TypeError(f"cache must be None or an empty transformers DynamicCache, got {type(cache).__name__}")
    if not isinstance(progress, bool):
        raise ValueError(f"progress must be True or False, got {progress!r}")
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError(f"cache= already holds {cache.get_seq_length()} tokens: a stream starts from an empty "
                         "cache (its NLLs would be conditioned on the earlier text); pass an empty DynamicCache")
    ids = stream_ids(tokenizer, text_or_ids)
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 2:
            raise ValueError(f"limit must be an integer of at least 2 tokens, got {limit!r}")
        ids = ids[:limit]
    check_token_ids(model, ids, "the stream's token ids")
    max_positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if press is None and max_positions is not None and ids.numel() > max_positions:
        raise ValueError(
            f"a full cache cannot stream {ids.numel()} tokens: the model has {max_positions} positions; "
            "pass a press (for example SinkWindowPress(window=..., rerotate=True)) or limit="
        )
    if press is not None and not press.rerotate and max_positions is not None and ids.numel() > max_positions:
        warn(f"{type(press).__name__} without rerotate=True streams {ids.numel()} tokens at their own "
             f"positions, past the model's {max_positions}: the tokens after them run at positions it never "
             "saw (StreamingLLM's point: perplexity climbs); rerotate=True keeps every position within "
             "the cache")  # fmt: skip
    installation = press(model) if press is not None else None  # (refuses a model kvpress cannot intercept)
    cache = DynamicCache(config=model.config) if cache is None else cache
    return _nlls(model, ids.to(model.device), installation, chunk, cache, progress)


@torch.no_grad()  # not inference_mode: a `cache=` given stays usable outside it
def _nlls(model, ids: torch.Tensor, installation, chunk: int, cache: DynamicCache, progress: bool
          ) -> Iterator[torch.Tensor]:  # fmt: skip
    """`stream`'s generator, once its arguments were checked. The press is installed for each of its own forwards
    only: while it is suspended at a `yield` (or left unfinished), the model is as it was."""
    bar = None
    if progress:
        from tqdm.auto import tqdm

        press = installation.press if installation is not None else None
        bar = tqdm(total=ids.numel(), unit="tok", desc=f"stream {type(press).__name__ if press else 'full'}")
    previous = None  # logits of the last token of the previous chunk
    try:
        for start in range(0, ids.numel(), chunk):
            piece = ids[start : start + chunk]
            with installation if installation is not None else contextlib.nullcontext():
                logits = model(piece[None], cache=cache, use_cache=True).logits[0].float()
            if previous is not None:
                logits_for = torch.cat([previous[None], logits[:-1]])
                targets = piece
            else:
                logits_for, targets = logits[:-1], piece[1:]
            previous = logits[-1]
            if bar is not None:
                bar.update(piece.numel())
            yield F.cross_entropy(logits_for, targets, reduction="none")
    finally:
        if bar is not None:
            bar.close()
