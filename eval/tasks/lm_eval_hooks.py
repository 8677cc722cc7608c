"""lm-eval hooks of kvpress's task YAMLs (`kvpress_*.yaml`): `custom_dataset` and `process_results`.

lm-eval loads this file by path, so it imports the generators through the installed package.
"""

from __future__ import annotations

from kvpress.eval.tasks import task_examples


def _tokenizer(kwargs: dict):
    """The tokenizer named by the task metadata (lm-eval merges `model_args` into it): `tokenizer` or
    `pretrained`, where "default" or a packaged name resolves offline through kvpress."""
    from transformers import AutoTokenizer

    from kvpress.models import resolve_model_path

    name = kwargs.get("tokenizer") or kwargs.get("pretrained") or "default"
    if not isinstance(name, str):
        return name  # a tokenizer object passed in the metadata
    return AutoTokenizer.from_pretrained(resolve_model_path(None if name == "default" else name), local_files_only=True)


def dataset(task: str, length: int = 1024, n: int = 32, seed: int = 0, **kwargs) -> dict:
    """lm-eval's `custom_dataset`: `{"test": Dataset}` of kvpress task `task` (metadata: length, n, seed)."""
    import datasets

    examples = task_examples(task, _tokenizer(kwargs), int(n), int(length), int(seed))
    rows = [{"context": e.context, "question": e.question, "answers": list(e.answers)} for e in examples]
    return {"test": datasets.Dataset.from_list(rows)}


def process_results(doc: dict, results: list[str]) -> dict:
    """The fraction of the expected strings found in the generated text."""
    return {"score": sum(answer in results[0] for answer in doc["answers"]) / len(doc["answers"])}
