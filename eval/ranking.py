"""Rank the presses of a sweep by their worst cell, then their mean: the rule that chooses the default press.

    python -m kvpress.eval.ranking --out eval/results/sweep-4k-tuning --json ranking.json

A cell is a (task, ratio) of the sweep. In each, a press's scores are paired example by example with the full
cache's: the mean difference (press - full cache, in points of the sweep's 0-1 scores) and its 95% interval
(Student's t, as `kvpress.eval.paired`). A task whose full cache scores below `NEAR_CHANCE` is left out (it has too
few answers to lose; shown in the table's notes). A press's worst cell is its lowest mean difference (the table also
gives its mean over the tasks at each ratio), its mean the mean over the cells, whose interval pools the cells'
standard errors (`confidence.pooled_half_width`): a task's cells at several ratios hold the same examples, whose
differences move together (an example a press loses at r = 0.5 it mostly loses at 0.75 too), so their covariance
counts; tasks are independent (disjoint examples). Every interval is clipped to [-1, 1], what a difference of two
scores in [0, 1] can be, and where nothing varies (every difference the same) it is
`confidence.no_spread_interval`'s over the fewest examples of its cells (`paired.difference_interval`). Presses are
ranked by worst cell, then mean; only presses measured in every cell are ranked. The cells' ratios are those a press
evicts at (r > 0: a quantized press's r = 0 rows are not an eviction cell). A press paired with the full cache on
fewer of its examples in a cell than the full cache has (a sweep widened for some presses) is marked: it was not
measured on the same examples as the others (`--examples N` ranks every press on the first N). The model's default
press (`kvpress/presses/defaults.json`) is marked.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from kvpress.eval.confidence import pooled_half_width
from kvpress.eval.fidelity import NEAR_CHANCE
from kvpress.eval.paired import difference_interval, difference_stats, paired_examples
from kvpress.eval.plots import score_intervals
from kvpress.eval.sweep import summary_rows
from kvpress.presses.defaults import default_for


def ranking(rows: list[dict]) -> dict:
    """{"cells": the informative (task, ratio) cells, "left_out": {task: full score} of the near-chance tasks,
    "not_ranked": {press: the cells it was not measured in} of the presses left out of the ranking,
    "presses": one entry per ranked press (worst cell, mean, the mean over tasks at each ratio, each cell's paired
    difference), best first}."""
    full = [row for row in rows if row["press"] == "none"]
    ratios = sorted({row["ratio"] for row in rows if row["press"] != "none" and row["ratio"] > 0})
    full_score = {task: _mean([r["score"] for r in full if r["task"] == task])
                  for task in sorted({r["task"] for r in full})}  # fmt: skip
    left_out = {task: score for task, score in sorted(full_score.items()) if score < NEAR_CHANCE}
    kept = sorted(set(full_score) - set(left_out))
    cells = [(task, ratio) for task in kept for ratio in ratios]
    full_n = {task: sum(r["task"] == task for r in full) for task in full_score}
    presses, not_ranked = [], {}
    for press in sorted({row["press"] for row in rows} - {"none"}):
        pairs = paired_examples(full + [r for r in rows if r["press"] == press], "none", press)
        found = {cell: difference_stats(*cell, list(p.values()), "none", press, "score") for cell, p in pairs.items()}
        missing = [cell for cell in cells if cell not in found]
        if missing or not cells:
            not_ranked[press] = missing
            continue
        stats = [found[cell] for cell in cells]
        worst = min(stats, key=lambda s: s["difference"])
        mean = _mean([s["difference"] for s in stats])
        diffs = {cell: {e: b - a for e, (a, b) in pairs[cell].items()} for cell in cells}
        fewest = min(s["n"] for s in stats)  # (where nothing varies, the interval hangs on the fewest examples)
        low, high = difference_interval(  # nan: a cell of one example
            mean, pooled_half_width([[diffs[(task, ratio)] for ratio in ratios] for task in kept]), "score", fewest)
        by_ratio = []  # the mean over tasks at each ratio (tasks independent)
        for ratio in ratios:
            at = _mean([found[(task, ratio)]["difference"] for task in kept])
            at_low, at_high = difference_interval(at, pooled_half_width([[diffs[(task, ratio)]] for task in kept]),
                                                  "score", min(found[(task, ratio)]["n"] for task in kept))  # fmt: skip
            by_ratio.append({"ratio": ratio, "mean": at, "low": at_low, "high": at_high})
        fewer = [[s["task"], s["ratio"], s["n"]] for s in stats if s["n"] < full_n[s["task"]]]
        presses.append({"press": press, "worst": worst, "mean": mean, "mean_low": low,
                        "mean_high": high, "by_ratio": by_ratio, "cells": stats,
                        "fewer_examples": fewer})  # fmt: skip
    presses.sort(key=lambda p: (-p["worst"]["difference"], -p["mean"], p["press"]))
    bands = score_intervals(full)
    full_interval = {task: list(bands[task, "none", 0.0]) if (task, "none", 0.0) in bands else None
                     for task in full_score}  # (None: one example, or a top-1 agreement with itself, exact)
    return {"cells": cells, "left_out": left_out, "full": full_score, "full_n": full_n, "full_interval": full_interval,
            "presses": presses, "not_ranked": not_ranked}  # fmt: skip


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def table(result: dict, default: str | None = None) -> str:
    """The ranking as Markdown: one line per press, its worst cell, its mean and its mean at each ratio with
    intervals."""
    ratios = sorted({ratio for _, ratio in result["cells"]})
    lines = ["| rank | press | worst cell | worst: press - full (95% interval) | n | mean of cells (95% interval) |"
             + "".join(f" mean at r = {ratio} |" for ratio in ratios),
             "|---|---|---|---|---|---|" + "---|" * len(ratios)]  # fmt: skip
    for rank, p in enumerate(result["presses"], 1):
        w = p["worst"]
        name = f"{p['press']} (default)" if p["press"] == default else p["press"]
        name += " †" if p["fewer_examples"] else ""
        lines.append(f"| {rank} | {name} | {w['task']}, r = {w['ratio']} | {w['difference']:+.3f} "
                     f"{_interval(w['low'], w['high'])} | "
                     f"{w['n']} | {p['mean']:+.3f} {_interval(p['mean_low'], p['mean_high'])} |"
                     + "".join(f" {at['mean']:+.3f} {_interval(at['low'], at['high'])} |"
                               for at in p["by_ratio"]))  # fmt: skip
    full = ", ".join(f"{task} {score:.3f} {_band(result['full_interval'][task], result['full_n'][task])} "
                     f"(n = {result['full_n'][task]})"
                     for task, score in sorted(result["full"].items()))  # fmt: skip
    lines.append(f"\nfull cache: {full}; left out (full cache below {NEAR_CHANCE}): "
                 f"{', '.join(result['left_out']) or 'none'}")  # fmt: skip
    fewer = {p["press"]: p["fewer_examples"] for p in result["presses"] if p["fewer_examples"]}
    if fewer:
        least = min(n for cells in fewer.values() for _, _, n in cells)
        lines.append(f"† paired with the full cache on fewer of its examples in some cells (fewest {least}): not "
                     f"measured on the same examples as the others; --examples {least} ranks every press on the "
                     f"same ones ({', '.join(fewer)})")  # fmt: skip
    for press, missing in result["not_ranked"].items():
        cells = ", ".join(f"{task} r = {ratio}" for task, ratio in missing[:3]) + (", ..." if len(missing) > 3 else "")
        lines.append(f"not ranked: {press}, not measured in {len(missing)} of {len(result['cells'])} cells ({cells})")
    return "\n".join(lines)


def _band(interval: list[float] | None, n: int) -> str:
    """A full-cache score's 95% interval (Wilson's for 0/1 scores, `plots.intervals`), or why it has none."""
    if interval is None:
        return "(one example: no interval)" if n == 1 else "(its top-1 agreement with itself: exact)"
    return "[{:.2f}, {:.2f}]".format(*interval)


def _interval(low: float, high: float) -> str:
    return "(a cell of one example: no interval)" if math.isnan(low) else f"[{low:+.3f}, {high:+.3f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpress.eval.ranking", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--out", required=True, help="a sweep directory (with its full cache, ratio 0)")
    parser.add_argument("--tasks", help="the tasks ranked on (default: those of the sweep's last run, its "
                                        "settings.json; rows of other tasks in the directory are left out)")
    parser.add_argument("--examples", type=int, metavar="N",
                        help="rank on the first N examples of each task only (a sweep's examples are drawn prefix-"
                             "stable: a sweep widened for some presses, ranked at the width every press reached)")
    parser.add_argument("--json", help="also write the ranking to this file")
    args = parser.parse_args(argv)
    if args.examples is not None and args.examples < 1:
        parser.error(f"--examples must be at least 1 (the first N examples of each task), got {args.examples}")
    settings_path = Path(args.out) / "settings.json"
    settings = json.loads(settings_path.read_text()) if settings_path.exists() else {}
    tasks = args.tasks.split(",") if args.tasks else settings.get("tasks")
    every = summary_rows(args.out)
    unknown = sorted(set(args.tasks.split(",") if args.tasks else ()) - {row["task"] for row in every})
    if unknown:
        print(f"kvpress ranking: {args.out} holds no rows of tasks {', '.join(unknown)}; its tasks: "
              f"{', '.join(sorted({row['task'] for row in every}))}", file=sys.stderr)  # fmt: skip
        return 2
    rows = [row for row in every if (tasks is None or row["task"] in tasks)
            and (args.examples is None or row["example"] < args.examples)]  # fmt: skip
    if not any(row["press"] == "none" for row in rows):
        print(f"kvpress ranking: {args.out} holds no full-cache rows (ratio 0) of tasks {tasks} to pair with",
              file=sys.stderr)  # fmt: skip
        return 2
    result = ranking(rows)
    if not result["presses"]:
        print(f"kvpress ranking: no press of {args.out} was measured in every informative cell", file=sys.stderr)
        return 2
    print(table(result, default_for(settings.get("model"))))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
