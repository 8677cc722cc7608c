"""Long-document perplexity, scored in chunks as StreamingLLM does (Xiao et al. 2023).

A document is `length` tokens of prose from a random offset of a haystack: Paul Graham's essays
("essay", task `perplexity`) or CPython's documentation ("pydoc", task `perplexity_pydoc`). It is
fed in chunks of `CHUNK` tokens with the press installed and one cache, so every token is predicted
from the compressed cache of everything before its chunk plus the chunk's earlier tokens, and the
cache holds (1 - r) of the tokens seen after every chunk. The negative log-likelihood is summed over
every predicted token (all but the first). Deterministic for (tokenizer, seed, length, source).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvpress.eval.tasks.example import check_size
from kvpress.eval.tasks.needle import haystack_ids
from kvpress.presses.base import BasePress
from kvpress.stream import stream

CHUNK = 128
SOURCES = ("essay", "pydoc")


@dataclass(frozen=True)
class Document:
    """A text whose every token is scored (no question, no answer)."""

    text: str


MIN_LENGTH = 16  # context tokens: the shortest this task builds (a sweep checks it before loading)


def perplexity_documents(tokenizer, n: int, length: int, seed: int, source: str = "essay") -> list[Document]:
    """`n` documents of about `length` tokens of `source` ("essay" or "pydoc"), each from a random offset."""
    if source not in SOURCES:
        raise ValueError(f"unknown perplexity source {source!r}; choose one of {SOURCES}")
    check_size(n, length, MIN_LENGTH)
    rng = random.Random(f"perplexity-{source}-{seed}")
    return [Document(tokenizer.decode(haystack_ids(tokenizer, source, length, rng)).strip()) for _ in range(n)]


@torch.inference_mode()
def chunked_nll(
    model, ids: torch.Tensor, press: BasePress | None = None, chunk: int = CHUNK, cache: DynamicCache | None = None
) -> tuple[float, int]:
    """(summed NLL in nats, number of tokens predicted) of the 1-D token ids `ids` fed in chunks of `chunk`
    with `press` installed (None: the full cache). Pass `cache=` to inspect what was kept at the end."""
    total, count = 0.0, 0
    for piece in stream(model, None, ids, press=press, chunk=chunk, cache=cache, progress=False):
        total += float(piece.double().sum())
        count += piece.numel()
    return total, count
