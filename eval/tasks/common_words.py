"""Common-words extraction (RULER's CWE, Hsieh et al. 2024): name the most frequent words of a long list.

The context is a numbered list ("1. harbor", "2. pencil", ...) of about `length` tokens, shuffled:
`top` common words appear c times each (together about half the list), many rare words 1 to c // 3
times each.
The question asks for the `top` most common words. Score: the fraction of them among the first `top`
distinct list words the answer names (words outside the list are ignored), so an answer that lists
every word it saw gains nothing. Words come from the fixed list `WORDS` (plain English nouns, none a
substring of another). Deterministic for (tokenizer, seed, length).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from kvpress.eval.tasks.example import Example

_NOUNS = """
anchor apron arrow attic badge bakery balcony ballot bamboo banner barrel basket beacon beaver blanket
blossom bonnet bottle bracelet bridge bucket buffalo bullet bundle butter button cabin cable cactus
camera candle canyon carpet carrot castle cellar cherry chimney circus cliff closet clover cobweb coffee
collar comet copper cottage cotton crayon cricket crystal cushion dagger desert diamond dolphin donkey
dragon drawer eagle elbow engine falcon feather fiddle fountain fossil garden garlic giraffe glacier
goblet gravel guitar hammer harbor helmet hammock honey hornet island jacket jungle kettle kitten ladder
lantern lemon lizard lobster magnet mango marble meadow mirror mitten monkey mosquito muffin mushroom
napkin needle nickel noodle oasis olive onion orchard ostrich oyster paddle palace parrot peanut pebble
pelican pencil pepper piano pillow pirate planet pocket pony potato pretzel puddle pumpkin puppet quilt
rabbit radish raven ribbon rocket saddle salmon sandal satchel scarf shovel silver skillet sparrow
spider sponge squirrel statue stove sugar sweater tablet teapot temple thimble thunder ticket tiger
tomato trumpet tulip turnip turtle umbrella valley velvet violin volcano waffle wagon walnut walrus
whistle willow window wizard yogurt zebra
""".split()
WORDS = tuple(sorted(w for w in set(_NOUNS) if not any(o != w and o in w for o in _NOUNS)))
_VOCABULARY = frozenset(WORDS)
QUESTION = ("Question: What are the {top} most common words in the list above? Answer: The {top} most common "
            "words in the list are:")  # fmt: skip


def top_words_score(answers: tuple[str, ...], text: str) -> float:
    """The fraction of `answers` among the first `len(answers)` distinct words of `WORDS` named in `text`."""
    named: list[str] = []
    for word in re.findall(r"[a-z]+", text.lower()):
        if word in _VOCABULARY and word not in named:
            named.append(word)
    return len(set(named[: len(answers)]) & set(answers)) / len(answers)


@dataclass(frozen=True)
class CommonWordsExample(Example):
    def score(self, text: str) -> float:
        """See `top_words_score`."""
        return top_words_score(self.answers, text)


def _counts(n_common: int, n_entries: int, top: int, rng: random.Random) -> dict[str, int]:
    """Word -> times listed: `top` words `n_common` times, rare words filling the rest of `n_entries`."""
    rare_max = max(1, n_common // 3)
    words = rng.sample(WORDS, len(WORDS))
    counts = {w: n_common for w in words[:top]}
    for w in words[top:]:
        remaining = n_entries - sum(counts.values())
        if remaining <= 0:
            break
        counts[w] = min(rng.randint(1, rare_max), remaining)
    return counts


def _listing(counts: dict[str, int], rng: random.Random) -> str:
    entries = [w for w, c in counts.items() for _ in range(c)]
    rng.shuffle(entries)
    return "\n".join(f"{i}. {w}" for i, w in enumerate(entries, 1))


def _entries(tokenizer, length: int) -> int:
    """How many list entries fill about `length` tokens of this tokenizer: sized on a probe list numbered as the
    real one is (an entry's number costs a token a digit in some vocabularies: sized on numbers up to 190, an 8K
    list ran 18% over), each probe as long as the last one found."""
    n = len(WORDS)
    for _ in range(3):
        probe = "\n".join(f"{i}. {WORDS[i % len(WORDS)]}" for i in range(1, n + 1))
        n = max(1, int(length * n / len(tokenizer(probe, add_special_tokens=False).input_ids)))
    return n


MIN_LENGTH = 128  # context tokens: the shortest this task builds (a sweep checks it before loading)


def common_words_examples(tokenizer, n: int, length: int, seed: int, top: int = 10) -> list[CommonWordsExample]:
    """`n` examples whose context lists words in about `length` tokens, `top` of them far more often."""
    if n < 1 or length < MIN_LENGTH or not 1 <= top <= 20:
        raise ValueError(f"need n >= 1, length >= {MIN_LENGTH} and 1 <= top <= 20, got n={n}, length={length}, "
                         f"top={top}")
    rng = random.Random(f"common-words-{seed}")
    n_entries = _entries(tokenizer, length)
    n_common = max(4, n_entries // (2 * top))  # the common words fill about half the list
    out = []
    for _ in range(n):
        counts = _counts(n_common, n_entries, top, rng)
        common = tuple(sorted(counts, key=counts.get, reverse=True)[:top])
        question = QUESTION.format(top=top)
        out.append(CommonWordsExample(context=_listing(counts, rng), question=question, answers=common))
    return out
