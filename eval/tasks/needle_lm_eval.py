"""lm-eval hooks of the needle task YAMLs (`kvpress_needle_*.yaml`): `custom_dataset` and `process_results`.

lm-eval loads this file by path, so it imports the generator through the installed package.
"""

from __future__ import annotations

from kvpress.eval.tasks.needle import needle_examples


def _tokenizer(kwargs: dict):
    """The tokenizer named by the task metadata (lm-eval merges `model_args` into it): `tokenizer` or
    `pretrained`, where "default" or a packaged name resolves offline through kvpress."""
    from transformers import AutoTokenizer

    from kvpress.models import resolve_model_path

    name = kwargs.get("tokenizer") or kwargs.get("pretrained") or "default"
    if not isinstance(name, str):
        return name  # a tokenizer object passed in the metadata
    return AutoTokenizer.from_pretrained(resolve_model_path(None if name == "default" else name), local_files_only=True)


def dataset(haystack: str = "noise", length: int = 1024, n: int = 32, seed: int = 0, **kwargs) -> dict:
    """lm-eval's `custom_dataset`: `{"test": Dataset}` of `needle_examples` (metadata picks length, n, seed)."""
    import datasets

    examples = needle_examples(_tokenizer(kwargs), int(n), int(length), int(seed), haystack)
    rows = [{"context": e.context, "question": e.question, "answer": e.answer} for e in examples]
    return {"test": datasets.Dataset.from_list(rows)}


def process_results(doc: dict, results: list[str]) -> dict:
    """1 when the generated text contains the needle's number."""
    return {"acc": float(doc["answer"] in results[0])}
