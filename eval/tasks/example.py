"""One task example: a context to compress, a question asked after it, and the strings a right answer holds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    context: str
    question: str
    answers: tuple[str, ...]

    def score(self, text: str) -> float:
        """The fraction of `answers` found in the generated `text` (RULER's string-match-all)."""
        return sum(answer in text for answer in self.answers) / len(self.answers)
