"""lm-eval hooks of kvpress's task YAMLs (`kvpress_*.yaml`): `custom_dataset` and the `process_results`
of each scoring rule (the same functions the sweep's examples score with).

lm-eval loads this file by path, so it imports the generators through the installed package.
"""

from __future__ import annotations

import difflib
import hashlib
import inspect

from kvpress.eval.tasks import Document, Example, task_examples
from kvpress.eval.tasks.arithmetic import first_number_score
from kvpress.eval.tasks.chat_recall import whole_number_score
from kvpress.eval.tasks.common_words import top_words_score
from kvpress.eval.tasks.ruler_qa import any_answer_score
from kvpress.models import load_tokenizer
from kvpress.presses import all_press_parameters

TOKENIZER_KEYS = ("tokenizer", "pretrained")  # where `_tokenizer` looks, in order
TOKENIZED_BY = "tokenized_by"  # the field of each row naming the tokenizer its length was counted with
_PROBE = "Needle 4096: the quick brown fox, naïve café — 3.14159?\n\tEnd of 'text' (übung) 日本語."


def tokenizer_fingerprint(tokenizer) -> str:
    """A short name for how `tokenizer` counts tokens (its base vocabulary's size and its ids of a probe text): equal
    for two copies of one tokenizer (one given a pad token too), different for another model's. A task's rows carry
    it (`TOKENIZED_BY`), so a run whose model tokenizes otherwise than the tokenizer the rows were cut to length with
    can be refused."""
    ids = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
    return hashlib.sha1(f"{tokenizer.vocab_size}:{ids}".encode()).hexdigest()[:12]


def _tokenizer(kwargs: dict):
    """The tokenizer named by the task metadata (lm-eval merges `model_args` into it): `tokenizer` or
    `pretrained`, where "default" or a packaged name resolves offline through kvpress."""
    name = next((kwargs[key] for key in TOKENIZER_KEYS if kwargs.get(key)), "default")
    if not isinstance(name, str):
        return name  # a tokenizer object passed in the metadata
    return load_tokenizer(None if name == "default" else name)


def _whole(name: str, value) -> int:
    """A metadata count as an int: an int or its digits (`--metadata '{"n": "32"}'`); 2.9 or true is refused,
    not truncated."""
    if isinstance(value, str) and value.isdigit():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"task metadata {name} must be a whole number, got {value!r}")
    return value


def dataset(task: str, length: int = 1024, n: int = 32, seed: int = 0, **kwargs) -> dict:
    """lm-eval's `custom_dataset`: `{"test": Dataset}` of kvpress task `task` (metadata: length, n, seed).
    Rows have `context`, `question`, `answers`, or `text` for the perplexity tasks, and `tokenized_by`: the
    fingerprint of the tokenizer `length` was counted with (the bridge refuses a model that tokenizes otherwise)."""
    import datasets

    _check_keys(kwargs)
    n, length, seed = (_whole(name, value) for name, value in (("n", n), ("length", length), ("seed", seed)))
    tokenizer = _tokenizer(kwargs)
    items = task_examples(task, tokenizer, n, length, seed)
    if not isinstance(items[0], Document | Example):
        raise ValueError(f"kvpress task {task!r} has no lm-eval form: its examples are {type(items[0]).__name__}s, "
                         "measured by `kvpress sweep`")  # fmt: skip
    if isinstance(items[0], Document):
        rows = [{"text": d.text} for d in items]
    else:
        rows = [{"context": e.context, "question": e.question, "answers": list(e.answers)} for e in items]
    fingerprint = tokenizer_fingerprint(tokenizer)
    rows = [{**row, TOKENIZED_BY: fingerprint} for row in rows]
    return {"test": datasets.Dataset.from_list(rows)}


def metadata_keys() -> tuple[str, ...]:
    """The metadata keys that shape a task's examples (`dataset`'s parameters): length, n, seed."""
    return tuple(p for p in inspect.signature(dataset).parameters if p not in ("task", "kwargs"))


def _check_keys(kwargs: dict) -> None:
    """Refuse a metadata key that looks like a misspelling of one the tasks read (`lenght`, `Seed`, `tokeniser`),
    which would leave the default in its place. Other keys pass: lm-eval merges the model's `model_args` into the
    metadata, so any model's (and any press's) arguments arrive here."""
    read = [*metadata_keys(), *TOKENIZER_KEYS]
    for key in kwargs:
        if key in read or key in all_press_parameters():
            continue
        close = difflib.get_close_matches(key.lower(), read, n=1, cutoff=0.8)
        if close:
            raise ValueError(f"task metadata {key!r} is not one kvpress tasks read; did you mean {close[0]!r}? "
                             f"They read {', '.join(read)}")


def process_results(doc: dict, results: list[str]) -> dict:
    """The fraction of the expected strings the generated text names (`Example.score`)."""
    return {"score": Example("", doc["question"], tuple(doc["answers"])).score(results[0])}


def process_any_answer(doc: dict, results: list[str]) -> dict:
    """1 when the generated text names any one of the reference answers (RULER's QA tasks: `ruler_qa.any_answer_score`,
    matched by `example.holds`)."""
    return {"score": any_answer_score(tuple(doc["answers"]), results[0], doc["question"])}


def process_whole_number(doc: dict, results: list[str]) -> dict:
    """1 when the expected number appears whole in the generated text (the chat-recall task)."""
    return {"score": whole_number_score(doc["answers"][0], results[0])}


def process_first_number(doc: dict, results: list[str]) -> dict:
    """1 when the first number of the generated text is the expected one (the arithmetic task)."""
    return {"score": first_number_score(tuple(doc["answers"]), results[0])}


def process_top_words(doc: dict, results: list[str]) -> dict:
    """The fraction of the expected words among the first words named (the common-words task)."""
    return {"score": top_words_score(tuple(doc["answers"]), results[0])}
