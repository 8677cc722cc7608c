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
        """The fraction of `answers` the generated `text` names (RULER's string-match-all, matched by `holds`)."""
        return sum(holds(answer, text, self.question) for answer in self.answers) / len(self.answers)


def without_thousands_separators(text: str) -> str:
    """`text` with each comma between digits that a group of three digits follows removed ("12,345" -> "12345")."""
    return re.sub(r"(?<=\d),(?=\d{3})", "", text)


ECHO = 8  # characters of the question around an answer that a reply copies with it: an echo, not an answer


def holds(answer: str, text: str, question: str = "") -> bool:
    """Whether the reply `text` names `answer`, the one matching rule of every string-match score: without case or
    thousands separators ("12,345" is 12345), runs of whitespace as one space; as a whole word or number, not inside a
    longer one ("42" is not in "1423" nor "10" in "10.5", "John" not in "Johnson": a substring match credited a
    needle's key inside a longer number), and not only where the reply copies the question around it: where the
    question holds the answer, an occurrence with `ECHO` or more characters of the question's own text about it is
    an echo ("Which was first, A or B?" answered "A or B" names both: HotpotQA's comparison questions)."""
    answer, text, question = (re.sub(r"\s+", " ", without_thousands_separators(t).lower()) for t in
                              (answer.strip(), text, question))  # fmt: skip
    if not answer:
        return False
    word = re.compile(r"\w")
    pattern = ((r"(?<!\w)" if word.match(answer[0]) else "") + (r"(?<!\d[.,])" if answer[0].isdigit() else "")
               + re.escape(answer)
               + (r"(?!\w)" if word.match(answer[-1]) else "") + (r"(?![.,]\d)" if answer[-1].isdigit() else ""))
    asked = [m.start() for m in re.finditer(re.escape(answer), question)]
    return any(all(_copied(text, m.start(), question, at, len(answer)) < ECHO for at in asked)
               for m in re.finditer(pattern, text))  # fmt: skip


def _copied(text: str, start: int, question: str, at: int, size: int) -> int:
    """How many characters around `text[start : start + size]` equal those around `question[at : at + size]`."""
    before = 0
    while before < min(start, at) and text[start - before - 1] == question[at - before - 1]:
        before += 1
    after, tail, asked_tail = 0, text[start + size :], question[at + size :]
    while after < min(len(tail), len(asked_tail)) and tail[after] == asked_tail[after]:
        after += 1
    return before + after


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
