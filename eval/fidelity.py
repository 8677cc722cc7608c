"""`python -m kvpress.eval.fidelity`: the fidelity check of the sweeps in eval/results, as one table.

For each model and task (needle, variable tracking, arithmetic): the full cache's score (its 95% interval and n),
then, at
r = 0.5 and 0.75, the retention (score / full score) of the default press when these sweeps ran (`MARKED`;
today's defaults, chosen on 4K sweeps and per model, are not in them),
of the best query-agnostic press and of the best query-aware one, each against its target: the best
query-agnostic press keeps >= 98% at r = 0.5 and >= 90% at r = 0.75, the best query-aware one >= 98%
at r = 0.75. Reads the sweeps' `summary.json`; writes `eval/results/fidelity.md` and `fidelity.json`.
A task whose full cache scores 0 has no retention (shown as "-"); one whose full cache scores below
`NEAR_CHANCE` is marked so and not checked against the targets (one lucky answer in 8 moves it by 100%). A best
press's retention is the highest of dozens measured on the same 8-16 examples: a point value that flatters it (the
sweeps' paired files give each press's interval).

A second table ranks the query-agnostic presses measured on every checked cell (both models, every task
not near chance, r = 0.5 and 0.75) by their worst cell, then their mean: the default press should lead it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
TASKS = ("needle_noise", "needle_pydoc", "variable_tracking", "arithmetic")
# model -> (query-agnostic sweep directories, query-aware sweep directories)
SWEEPS = {
    "SmolLM2-135M": (("sweep", "sweep-tasks"), ("sweep-query-aware",)),
    "Qwen2.5-0.5B": (("sweep-qwen2.5-0.5b", "sweep-tasks-qwen2.5-0.5b"), ("sweep-query-aware-qwen2.5-0.5b",)),
}
NEAR_CHANCE = 0.25
# the default press when these 1,024-token sweeps ran (issue 7), which the tables mark: `kvpress.DEFAULT_PRESS` has
# moved on since (sinks added) and each model has its own (`kvpress.presses.defaults`), measured at 4K
MARKED = "adakv:normalize=true:inner=kvzip:value_norm=true"


def _rows(dirs: tuple[str, ...], results: Path) -> list[dict]:
    rows = []
    for name in dirs:
        path = results / name / "summary.json"
        if path.exists():  # a missing one is named by `missing` (main says so, in fidelity.md too)
            rows += [r for r in json.loads(path.read_text()) if r["task"] in TASKS]
    return rows


def missing(results: Path = RESULTS) -> list[str]:
    """The sweep directories of `SWEEPS` that hold no summary.json under `results` (their rows are not in the
    table)."""
    return [name for dirs in SWEEPS.values() for group in dirs for name in group
            if not (results / name / "summary.json").exists()]  # fmt: skip


def _full_rows(rows: list[dict]) -> dict[str, dict]:
    """Each task's full-cache row; a ValueError where two sweeps of one model's group measured the task (each
    retention is against its own sweep's full cache: the table would mix them)."""
    full: dict[str, dict] = {}
    for r in rows:
        if r["press"] == "none":
            if r["task"] in full:
                raise ValueError(f"task {r['task']} has two full-cache rows in one model's sweeps of SWEEPS: "
                                 "a task is measured by one sweep of each group")
            full[r["task"]] = r
    return full


def _best(rows: list[dict], task: str, ratio: float) -> tuple[str, float] | None:
    """The press with the highest retention on `task` at `ratio` (ties: the first by name)."""
    found = sorted((r for r in rows if r["task"] == task and r["ratio"] == ratio and r["retention"] is not None),
                   key=lambda r: (-r["retention"], r["press"]))  # fmt: skip
    return (found[0]["press"], found[0]["retention"]) if found else None


def fidelity(results: Path = RESULTS) -> list[dict]:
    """One row per (model, task): full score and the retentions of the default / best presses."""
    table = []
    for model, (agnostic_dirs, aware_dirs) in SWEEPS.items():
        agnostic, aware = _rows(agnostic_dirs, results), _rows(aware_dirs, results)
        fulls = _full_rows(agnostic)
        _full_rows(aware)
        for task in TASKS:
            full = fulls.get(task)
            if full is None:
                continue
            row = {"model": model, "task": task, "full": full["score"], "full_low": full.get("low"),
                   "full_high": full.get("high"), "full_n": full.get("examples")}  # fmt: skip
            for ratio in (0.5, 0.75):
                default = next((r["retention"] for r in agnostic if r["task"] == task and r["press"] == MARKED
                                and r["ratio"] == ratio), None)  # fmt: skip
                row[f"default@{ratio}"] = default
                row[f"agnostic@{ratio}"] = _best(agnostic, task, ratio)
                row[f"aware@{ratio}"] = _best(aware, task, ratio)
            table.append(row)
    return table


def ranking(results: Path = RESULTS) -> list[dict]:
    """The query-agnostic presses measured on every checked cell (model, task not near chance, r = 0.5 and
    0.75), best first by their worst retention, then their mean."""
    cells, retention = set(), {}
    for model, (agnostic_dirs, _) in SWEEPS.items():
        rows = _rows(agnostic_dirs, results)
        full = {task: r["score"] for task, r in _full_rows(rows).items()}
        for r in rows:
            if full.get(r["task"], 0.0) >= NEAR_CHANCE and r["ratio"] in (0.5, 0.75) and r["retention"] is not None:
                cell = (model, r["task"], r["ratio"])
                cells.add(cell)
                retention.setdefault(r["press"], {})[cell] = r["retention"]
    ranked = [{"press": press, "worst": min(by_cell.values()), "mean": sum(by_cell.values()) / len(by_cell)}
              for press, by_cell in retention.items() if by_cell.keys() == cells]  # fmt: skip
    return sorted(ranked, key=lambda r: (-r["worst"], -r["mean"], r["press"]))


def _cell(value, target: float | None = None) -> str:
    if value is None:
        return "-"
    press, retention = value if isinstance(value, tuple) else (None, value)
    mark = "" if target is None else (" ✓" if retention >= target else " ✗")
    return f"{retention:.0%}{mark}" + (f" ({press})" if press else "")


def markdown(table: list[dict]) -> str:
    head = ("| model | task | full cache | default press r=0.5 | default r=0.75 | best query-agnostic r=0.5 (>= 98%) "
            "| best query-agnostic r=0.75 (>= 90%) | best query-aware r=0.75 (>= 98%) |")  # fmt: skip
    lines = [head, "|" + "---|" * 8]
    for r in table:
        checked = r["full"] >= NEAR_CHANCE
        low, high = (0.98, 0.90) if checked else (None, None)
        band = f" [{r['full_low']:.3f}, {r['full_high']:.3f}]" if r.get("full_low") is not None else ""
        n = f", n = {r['full_n']}" if r.get("full_n") else ""
        full = f"{r['full']:.3f}{band}{n}" + ("" if checked else " (near chance)")
        lines.append(
            f"| {r['model']} | {r['task']} | {full} | {_cell(r['default@0.5'])} | {_cell(r['default@0.75'])} "
            f"| {_cell(r['agnostic@0.5'], low)} | {_cell(r['agnostic@0.75'], high)} | {_cell(r['aware@0.75'], low)} |"
        )
    return "\n".join(lines) + "\n"


def ranking_markdown(ranked: list[dict]) -> str:
    lines = ["| query-agnostic press (every checked cell) | worst cell | mean |", "|---|---|---|"]
    for r in ranked:
        mark = " (default)" if r["press"] == MARKED else ""
        lines.append(f"| {r['press']}{mark} | {r['worst']:.0%} | {r['mean']:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(RESULTS), help="the directory holding the sweeps")
    args = parser.parse_args(argv)
    results = Path(args.results)
    table = fidelity(results)
    if not table:
        print(f"no sweep summaries under {results} (expected {', '.join(sorted(SWEEPS))}'s sweep directories)")
        return 2
    ranked = ranking(results)
    (results / "fidelity.json").write_text(json.dumps({"tasks": table, "ranking": ranked}, indent=1) + "\n")
    text = markdown(table) + "\n" + ranking_markdown(ranked)
    if missing(results):
        text += f"\nmissing (no summary.json, not in the tables): {', '.join(missing(results))}\n"
        print(f"kvpress fidelity: no summary.json in {', '.join(missing(results))}", file=sys.stderr)
    (results / "fidelity.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
