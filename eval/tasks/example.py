"""One task example: a context to compress, a question asked after it, and the strings a right answer holds."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    context: str
    question: str
    answers: tuple[str, ...]

    def score(self, text: str) -> float:
        """The fraction of `answers` found in the generated `text` (RULER's string-match-all)."""
        return sum(answer in text for answer in self.answers) / len(self.answers)


def drawn_one_at_a_time(rng: random.Random, pool: list, n: int) -> Iterator:
    """`n` items of `pool`, no two the same, drawn one after the other with `rng` (which may draw more between
    them): the i-th does not depend on `n`, so a sweep resumed or widened with another count keeps its examples."""
    used: set[int] = set()
    for _ in range(n):
        pick = rng.randrange(len(pool))
        while pick in used:
            pick = rng.randrange(len(pool))
        used.add(pick)
        yield pool[pick]
