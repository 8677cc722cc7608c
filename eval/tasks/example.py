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

    def __post_init__(self) -> None:
        if isinstance(self.answers, str) or not self.answers or not all(
                isinstance(a, str) and a.strip() for a in self.answers):  # fmt: skip
            raise ValueError(f"an example's answers are a non-empty tuple of non-blank strings, got {self.answers!r}")

    def score(self, text: str) -> float:
        """The fraction of `answers` the generated `text` names (RULER's string-match-all, matched by `holds`)."""
        return sum(holds(answer, text, self.question) for answer in self.answers) / len(self.answers)


def without_thousands_separators(text: str) -> str:
    """`text` with each comma between digits that a group of exactly three digits follows removed ("12,345" ->
    "12345"; "1234567,2345678", two numbers listed, stays)."""
    return re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)


# marks that a longer name repeats ("C++" is not in "C+++"); brackets, quotes and periods close pairs and sentences
# ("Queen (band))", "the U.S..") and do not
_RUNS = "+#*=~^|"


def holds(answer: str, text: str, question: str = "") -> bool:
    """Whether the reply `text` names `answer`, the one matching rule of every string-match score: without case or
    thousands separators ("12,345" is 12345), runs of whitespace as one space; as a whole word or number, not inside a
    longer one ("42" is not in "1423" nor "10" in "10.5", "John" not in "Johnson", "C++" not in "C+++": a substring
    match credited a needle's key inside a longer number). Where the question itself holds the answer (HotpotQA's
    comparisons, "Which was first, A or B?"), an occurrence joined by "or", "and", "/" or "&" to another phrase of the
    question names both options and does not count ("A or B", "B or A", "both A and B", an echo of the question; "A
    was first" counts). An echo of a question that names the answer otherwise is not told from an answer."""
    answer, text, question = (re.sub(r"\s+", " ", without_thousands_separators(t).lower()) for t in
                              (answer.strip(), text, question))  # fmt: skip
    if not answer:
        return False
    word = re.compile(r"\w")
    first, last = (r"\w" if word.match(c) else re.escape(c) if c in _RUNS else "" for c in (answer[0], answer[-1]))
    pattern = ((rf"(?<!{first})" if first else "") + (r"(?<!\d\.)" if answer[0].isdigit() else "")
               + re.escape(answer)  # (a comma between digits left by the separators' removal lists numbers)
               + (rf"(?!{last})" if last else "") + (r"(?!\.\d)" if answer[-1].isdigit() else ""))
    asked = answer in question
    return any(not (asked and _joined_to_another(text, m.start(), m.end(), answer, question))
               for m in re.finditer(pattern, text))  # fmt: skip


_AFTER = re.compile(r" ?(?:(?:or|and)\b|[/&]) ?([^.,;:?!\n]+)")
_BEFORE = re.compile(r"([^.,;:?!\n]+?) ?(?:\b(?:or|and)|[/&]) ?$")


def _joined_to_another(text: str, start: int, end: int, answer: str, question: str) -> bool:
    """Whether `text[start:end]` is joined by or / and / "/" / "&" to a phrase of `question` (of 4 or more
    characters, not within the answer): the words right after the conjunction, or right before it (up to 3 words
    between it and the answer that the question puts before the answer too)."""
    phrases = []
    if after := _AFTER.match(text, end):
        words = after.group(1).split()
        phrases += [" ".join(words[:k]) for k in range(1, len(words) + 1)]
    head = text[:start].rstrip().split(" ")
    for gap in range(min(4, len(head))):  # (words the question puts before the answer too: "the film A or the film B")
        if gap and " ".join([*head[len(head) - gap :], answer]) not in question:
            break
        if before := _BEFORE.search(" ".join(head[: len(head) - gap])):
            words = before.group(1).split()
            phrases += [" ".join(words[-k:]) for k in range(1, len(words) + 1)]
    return any(len(phrase) >= 4 and phrase in question and phrase not in answer for phrase in phrases)


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
