"""The answer budget in each task's lm-eval YAML (`max_gen_toks`) is written from `ANSWER_TOKENS`, its one
source, so the sweep and lm-eval give a task the same budget:

    python -m kvpress.eval.tasks.yaml_budgets           # rewrite the YAMLs that differ
    python -m kvpress.eval.tasks.yaml_budgets --check   # list them and exit 1 (the tests do this)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from kvpress.eval.tasks import ANSWER_TOKENS

TASKS_DIR = Path(__file__).resolve().parent
_TASK = re.compile(r"^dataset_kwargs:\n  task: (\w+)$", re.M)
_BUDGET = re.compile(r"^(  max_gen_toks: )(\d+)$", re.M)


def written_budgets() -> dict[Path, str]:
    """Each task YAML with an answer budget, and its text with the budget `ANSWER_TOKENS` gives its task."""
    out = {}
    for path in sorted(TASKS_DIR.glob("kvpress_*.yaml")):
        text = path.read_text()
        task, budget = _TASK.search(text), _BUDGET.search(text)
        if budget is None:
            continue
        if task is None or task.group(1) not in ANSWER_TOKENS:
            raise ValueError(f"{path.name} sets max_gen_toks for a task without an entry in ANSWER_TOKENS")
        start, end = budget.span(2)
        out[path] = text[:start] + str(ANSWER_TOKENS[task.group(1)]) + text[end:]
    return out


def stale() -> list[Path]:
    """The YAMLs whose `max_gen_toks` is not their task's `ANSWER_TOKENS`."""
    return [path for path, text in written_budgets().items() if path.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    paths = stale()
    if "--check" in argv:
        for path in paths:
            print(f"{path.name}: max_gen_toks differs from ANSWER_TOKENS", file=sys.stderr)
        return 1 if paths else 0
    for path, text in written_budgets().items():
        if path in paths:
            path.write_text(text)
            print(f"wrote {path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
