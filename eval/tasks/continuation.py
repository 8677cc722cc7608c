"""Continuation fidelity: how closely a compressed cache predicts the real text that follows it.

An example is `length` tokens of prose from a random offset of a haystack (Paul Graham's essays, task
`continuation_essay`, or CPython's documentation, `continuation_pydoc`) and the `FOLLOWING` tokens after
them. The context is compressed without seeing what follows; the following tokens are then fed, teacher
forced, over the compressed cache and over the full one, and each of their next-token distributions is
compared: the row's score is the fraction of positions whose most likely token is the same (top-1
agreement, 1 for the full cache) and `kl` the mean KL divergence KL(full || compressed) in nats. Unlike an
answer, this does not hang on the model's skill: every model has a distribution to keep. Deterministic for
(tokenizer, seed, length, source).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvpress.eval.tasks.example import check_size
from kvpress.eval.tasks.needle import haystack_ids

FOLLOWING = 256
SOURCES = ("essay", "pydoc")


@dataclass(frozen=True)
class Continuation:
    """A context and the tokens that really follow it (token ids of the model's tokenizer)."""

    context_ids: tuple[int, ...]
    following_ids: tuple[int, ...]


MIN_LENGTH = 16  # context tokens: the shortest this task builds (a sweep checks it before loading)


def continuation_examples(tokenizer, n: int, length: int, seed: int, source: str = "essay") -> list[Continuation]:
    """`n` contexts of `length` tokens of `source`, each with the `FOLLOWING` tokens after it."""
    if source not in SOURCES:
        raise ValueError(f"unknown continuation source {source!r}; choose one of {SOURCES}")
    check_size(n, length, MIN_LENGTH)
    rng = random.Random(f"continuation-{source}-{seed}")
    examples = []
    for _ in range(n):
        ids = haystack_ids(tokenizer, source, length + FOLLOWING, rng)
        examples.append(Continuation(tuple(ids[:length]), tuple(ids[length:])))
    return examples
