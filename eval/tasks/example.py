"""One task example: a context to compress, a question asked after it, and the strings a right answer holds."""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass


def check_size(n: int, length: int, least: int) -> None:
    """Refuse `n` examples of `length` tokens a generator cannot build (its floor: `least`, its `MIN_LENGTH`)."""
    if n < 1 or length < least:
        raise ValueError(f"need n >= 1 and length >= {least}, got n={n}, length={length}")


@dataclass(frozen=True)
class Example:
    context: str
    question: str
    answers: tuple[str, ...]

    def score(self, text: str) -> float:
        """The fraction of `answers` found in the generated `text` (RULER's string-match-all)."""
        return sum(answer in text for answer in self.answers) / len(self.answers)


def without_thousands_separators(text: str) -> str:
    """`text` with each comma between digits that a group of three digits follows removed ("12,345" -> "12345")."""
    return re.sub(r"(?<=\d),(?=\d{3})", "", text)


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


def token_count(tokenizer, text: str) -> int:
    """How many tokens `text` takes in a context (no special tokens)."""
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def placed_among(
    tokenizer, rng: random.Random, text: str, others: Iterable[str], length: int, extra: int = 2
) -> list[str]:
    """`text` and as many of `others` (taken in their order) as fit in `length` tokens with `extra` tokens each
    for a separator, each put at a random place among those before it (`rng`): RULER's QA context, a question's
    passage among distractors. It stops at the first of `others` that does not fit."""
    size = token_count(tokenizer, text)
    out = [text]
    for other in others:
        if other == text:
            continue
        more = token_count(tokenizer, other) + extra
        if size + more > length:
            break
        out.insert(rng.randrange(len(out) + 1), other)
        size += more
    return out
