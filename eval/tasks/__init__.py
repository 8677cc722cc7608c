"""Offline task generators: data made locally from a seed, never downloaded.

`TASKS` maps a task name to a generator `(tokenizer, n, length, seed) -> list[Example]`; an example
has `context`, `question`, `answer` and `correct(text)`.
"""

from __future__ import annotations

from kvpress.eval.tasks.needle import Example, needle_examples

TASKS = {
    "needle_noise": lambda tokenizer, n, length, seed: needle_examples(tokenizer, n, length, seed, "noise"),
    "needle_pydoc": lambda tokenizer, n, length, seed: needle_examples(tokenizer, n, length, seed, "pydoc"),
}


def task_examples(name: str, tokenizer, n: int, length: int, seed: int) -> list[Example]:
    """`n` examples of task `name` with contexts of about `length` tokens."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(sorted(TASKS))}")
    return TASKS[name](tokenizer, n, length, seed)


__all__ = ["Example", "TASKS", "task_examples"]
