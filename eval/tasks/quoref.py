"""Question answering on real text: Quoref's Wikipedia passages and questions, padded with other passages.

Quoref (Dasigi et al. 2019, arXiv:1908.05803) asks questions whose answers take coreference across a passage
("What is the first name of the person who doubted ...?"), answered by spans of it. BIG-bench ships 6,500 of
them (`natural_instructions/subtask002_quoref_answer_generation`, 2,942 passages of ~450 tokens). An example
is built as RULER builds its QA task: the question's passage among other passages of the set (distractors,
drawn at random, none sharing the question's passage) up to `length` tokens, at a random place; the question
is asked after them; the score is the fraction of the answer's spans in the generated text (most answers are
one span).

The data is read at run time from BIG-bench's source package on PyPI, fetched once as a file from the package
index, checked against a fixed sha256 and never built or installed (no code of it runs); only the task's
JSON is kept, under `$KVPRESS_CACHE/bigbench/quoref.json` (~14 MB). That package (bigbench 1.0.0) was taken
off PyPI in December 2026: a machine without the JSON cached cannot build this task, and says so (`fetch`).
"""

from __future__ import annotations

import hashlib
import json
import random
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

from kvpress.eval.tasks.example import Example, check_size, drawn_one_at_a_time, placed_among
from kvpress.models import cache_dir

SDIST = ("https://files.pythonhosted.org/packages/95/f8/c019b3579df548a04cac12342cfcb878e50ddf6cfcd7fddba8cfc721c157/"
         "bigbench-1.0.0.tar.gz")  # fmt: skip
SHA256 = "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"
MEMBER = "bigbench-1.0.0/bigbench/benchmark_tasks/natural_instructions/subtask002_quoref_answer_generation/task.json"
QUESTION = "Answer the question with names or phrases from the passages above.\nQuestion: {question}\nAnswer:"


def quoref_items(path: Path | None = None) -> list[dict]:
    """Every question as {"passage", "question", "answers"} (from the cache, fetched there first if absent)."""
    path = path or cache_dir() / "bigbench" / "quoref.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        sdist = path.with_suffix(".tar.gz.part")
        try:
            fetch(SDIST, sdist, SHA256)
            items = parse_task(extract_member(sdist, MEMBER))
        finally:
            sdist.unlink(missing_ok=True)
        path.write_text(json.dumps(items))
    return json.loads(path.read_text())


def fetch(url: str, dest: Path, sha256: str) -> None:
    """Download `url` to `dest`, refusing it (and removing it) unless its sha256 is `sha256`; a download that
    fails raises ValueError naming the address and what to do instead."""
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=180) as response, dest.open("wb") as sink:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                sink.write(chunk)
    except (urllib.error.URLError, ConnectionError, TimeoutError) as err:  # (HTTP errors are URLErrors)
        dest.unlink(missing_ok=True)
        raise ValueError(
            f"qa_quoref's data could not be fetched from {url}: {err}. Its source, BIG-bench 1.0.0's package, "
            "is no longer on PyPI (only bigbench 0.0.1 is listed there since December 2026): copy quoref.json "
            f"from a machine that has it to {cache_dir() / 'bigbench'}, or leave qa_quoref out of the tasks"
        ) from err
    if digest.hexdigest() != sha256:
        dest.unlink()
        raise ValueError(f"{url} has sha256 {digest.hexdigest()}, expected {sha256}: refused")


def extract_member(archive: Path, member: str) -> dict:
    """The JSON file `member` of the tar.gz `archive` (read as a stream: nothing else is unpacked)."""
    with tarfile.open(archive, mode="r|gz") as tar:
        for info in tar:
            if info.name == member:
                return json.load(tar.extractfile(info))
    raise ValueError(f"{archive} holds no {member}")


def parse_task(task: dict) -> list[dict]:
    """BIG-bench's examples ("Passage: ...\\nQuestion: ...", a list of answer spans ending in '.') as items."""
    items = []
    for example in task["examples"]:
        passage, sep, question = example["input"].partition("\nQuestion:")
        if not sep or not passage.startswith("Passage:"):
            raise ValueError(f"a Quoref example not in the form 'Passage: ...\\nQuestion: ...': "
                             f"{example['input'][:80]!r}")
        answers = [a.strip().removesuffix(".").strip() for a in example["target"]]
        items.append({"passage": passage.removeprefix("Passage:").strip(), "question": question.strip(),
                      "answers": [a for a in answers if a]})  # fmt: skip
    return items


MIN_LENGTH = 64  # context tokens: the shortest this task builds (a sweep checks it before loading)


def quoref_examples(tokenizer, n: int, length: int, seed: int, items: list[dict] | None = None) -> list[Example]:
    """`n` examples of at most `length` tokens (within a passage of it): a question's passage placed at random
    among distractor passages."""
    check_size(n, length, MIN_LENGTH)
    items = quoref_items() if items is None else items
    passages = sorted({item["passage"] for item in items})
    rng = random.Random(f"quoref-{seed}")
    pool = [item for item in items if item["answers"]]
    if n > len(pool):
        raise ValueError(f"n={n} is more than the {len(pool)} questions")
    out = []
    for item in drawn_one_at_a_time(rng, pool, n):
        context = placed_among(tokenizer, rng, item["passage"], rng.sample(passages, len(passages)), length)
        out.append(Example(context="\n\n".join(context), question=QUESTION.format(question=item["question"]),
                           answers=tuple(item["answers"])))  # fmt: skip
    return out
