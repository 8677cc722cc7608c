"""RULER's multi-needle variants (Hsieh et al. 2024) in a prose haystack (CPython's documentation).

Needles read "One of the special magic numbers for {word} is: {number}." (7-digit numbers), each at
its own random depth:
- "multikey": 4 needles for 4 words; the question asks for one word's number.
- "multivalue": 4 needles for one word; the question asks for all 4 numbers.
- "multiquery": 4 needles for 4 words; the question asks for the numbers of 2 of them.
Scored by the fraction of the asked numbers in the answer. Deterministic for (tokenizer, seed, length).
"""

from __future__ import annotations

import random

from kvpress.eval.tasks.example import Example, check_size
from kvpress.eval.tasks.needle import haystack_ids, insert_at_depths

KINDS = ("multikey", "multivalue", "multiquery")
WORDS = ("apple", "river", "lantern", "violin", "harbor", "meadow", "falcon", "copper", "glacier", "orchid",
         "compass", "thunder", "marble", "pepper", "saddle", "quartz")  # fmt: skip


MIN_LENGTH = 128  # context tokens: the shortest this task builds (a sweep checks it before loading)


def multi_needle_examples(tokenizer, n: int, length: int, seed: int, kind: str = "multikey") -> list[Example]:
    """`n` examples of about `length` tokens with 4 needles of `kind` (see the module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"unknown multi-needle kind {kind!r}; choose one of {KINDS}")
    check_size(n, length, MIN_LENGTH)
    rng = random.Random(f"{kind}-{seed}")
    out = []
    for _ in range(n):
        words = rng.sample(WORDS, 4) if kind != "multivalue" else [rng.choice(WORDS)] * 4
        numbers = [str(rng.randint(1_000_000, 9_999_999)) for _ in range(4)]
        needles = [f"One of the special magic numbers for {w} is: {x}." for w, x in zip(words, numbers, strict=True)]
        context = insert_at_depths(tokenizer, haystack_ids(tokenizer, "pydoc", length, rng), needles, rng)
        if kind == "multikey":
            i = rng.randrange(4)
            asked, answers = words[i], (numbers[i],)
            question = f"What is the special magic number for {asked}? The special magic number for {asked} is"
        elif kind == "multivalue":
            question = (f"What are all the special magic numbers for {words[0]}? The special magic numbers for "
                        f"{words[0]} are")  # fmt: skip
            answers = tuple(numbers)
        else:
            picked = sorted(rng.sample(range(4), 2))
            names = " and ".join(words[i] for i in picked)
            question = f"What are the special magic numbers for {names}? The special magic numbers for {names} are"
            answers = tuple(numbers[i] for i in picked)
        out.append(Example(context=context, question=question, answers=answers))
    return out
