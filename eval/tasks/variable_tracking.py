"""Variable tracking (RULER, Hsieh et al. 2024): follow a chain of assignments hidden in a haystack.

"VAR ABCDE = 12345." then "VAR FGHIJ = VAR ABCDE." and so on (`hops` links), each statement at its own
random depth of a noise haystack, in order; the question asks for every variable holding the value.
Scored by the fraction of the chain's names in the answer. Deterministic for (tokenizer, seed, length).
"""

from __future__ import annotations

import random
import string

from kvpress.eval.tasks.example import Example
from kvpress.eval.tasks.needle import haystack_ids, insert_at_depths

MIN_LENGTH = 64  # context tokens: the shortest this task builds (a sweep checks it before loading)


def variable_tracking_examples(tokenizer, n: int, length: int, seed: int, hops: int = 4) -> list[Example]:
    """`n` examples of about `length` tokens with one chain of `hops + 1` variables."""
    if n < 1 or length < MIN_LENGTH or hops < 1:
        raise ValueError(f"need n >= 1, length >= {MIN_LENGTH} and hops >= 1, got n={n}, length={length}, hops={hops}")
    rng = random.Random(f"variable-tracking-{seed}")
    out = []
    for _ in range(n):
        value = str(rng.randint(10000, 99999))
        names: list[str] = []
        while len(names) < hops + 1:
            name = "".join(rng.choices(string.ascii_uppercase, k=5))
            if name not in names:
                names.append(name)
        links = zip(names[:-1], names[1:], strict=True)
        statements = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in links]
        context = insert_at_depths(tokenizer, haystack_ids(tokenizer, "noise", length, rng), statements, rng)
        question = (
            f"Question: Find all variables that are assigned the value {value} in the text above. Answer: "
            f"According to the chain of variable assignment in the text above, {hops + 1} variables are "
            f"assigned the value {value}, they are:"
        )
        out.append(Example(context=context, question=question, answers=tuple(names)))
    return out
