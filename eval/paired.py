"""Paired differences between configurations of one sweep: what a variant of a press changes, example by example.

    python -m kvpress.eval.paired --out eval/results/sweep-quantized --pair snapkv snapkv:kv_bits=4

For each `--pair A B`, each task and each ratio both were measured at, on the examples both answered: the mean score
of A and of B, the mean of B - A with its 95% interval (Student's t, t(n - 1) sd / sqrt(n), `confidence.py`, clipped
to [-1, 1] for a score or a top-1 agreement, which lie in [0, 1]; where every difference is the same, 0 when no
score changed, `confidence.no_spread_interval`, as t collapses to a point there) and how many
examples' scores changed, then the same pooled over tasks (every example of every task counted once). Scores are the
sweep's (0 to 1; points = 100 x). `--metric` pairs another field of the rows instead: an answer row's `answer_top1`
or `answer_kl` (its fidelity to the full cache's answer, which does not hang on the model answering right) or a
continuation row's `kl`; rows without the field are left out. A KL is in nats and lower is closer to the full cache:
there a negative B - A favours B.
Prints a Markdown table; `--json` writes the rows too. `--also DIR` adds the rows of another sweep of the same
examples (model, length, seed), its presses named `press@DIR's name`: a query-aware sweep against a query-agnostic
one, `--also eval/results/sweep-recall-query-aware-qwen2.5-0.5b --pair recall:inner=snapkv
snapkv@sweep-recall-query-aware-qwen2.5-0.5b`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from kvpress.eval.confidence import mean_half_width, no_spread_interval
from kvpress.eval.sweep import summary_rows
from kvpress.eval.tasks import row_version
from kvpress.patches.user_warnings import warn

# the row fields a pair can be compared on (`sweep.py`), each with the range of its values where it has one (a score
# and a top-1 agreement lie in [0, 1]; a KL has no upper bound): a difference's interval is clipped to what the
# difference can be, as a cell's score interval is to [0, 1] (`plots.intervals`)
METRICS: dict[str, tuple[float, float] | None] = {"score": (0.0, 1.0), "answer_top1": (0.0, 1.0), "answer_kl": None,
                                                  "kl": None}  # fmt: skip


def paired_examples(rows: list[dict], base: str, variant: str, metric: str = "score") -> dict[tuple, dict]:
    """Per (task, ratio) both were measured at: {(example, task_version): (A's `metric`, B's)} for the examples
    both answered with it. The full cache ("none", measured at r = 0 only) pairs at every ratio of the other press."""
    if "none" in (base, variant):
        ratios = {row["ratio"] for row in rows if row["press"] in (base, variant) and row["press"] != "none"}
        rows = [row for row in rows if row["press"] != "none"] + [
            {**row, "ratio": ratio} for row in rows if row["press"] == "none" for ratio in sorted(ratios)]
    scores: dict[tuple, dict[str, float]] = {}
    for row in rows:
        if row["press"] in (base, variant) and metric in row:
            # (rows of two versions of a task's builder hold different examples under one number: never paired)
            key = (row["task"], row["ratio"], row["example"], row_version(row))
            scores.setdefault(key, {})[row["press"]] = row[metric]
    versions: dict[tuple, dict[int, set]] = {}  # per (task, ratio, example): the presses measured on each version
    for (task, ratio, example, version), pair in scores.items():
        versions.setdefault((task, ratio, example), {})[version] = set(pair)
    apart = sum(1 for found in versions.values() if all(len(p) == 1 for p in found.values())
                and set().union(*found.values()) == {base, variant})  # fmt: skip
    if apart:
        warn(f"{apart} examples measured with {base} and {variant} on different versions of their task's "
             "builder (task_version) are not paired: their examples differ")  # fmt: skip
    cells: dict[tuple, dict[tuple, tuple[float, float]]] = {}
    for (task, ratio, example, version), pair in sorted(scores.items()):
        if base in pair and variant in pair:
            cells.setdefault((task, ratio), {})[(example, version)] = (pair[base], pair[variant])
    return cells


def paired_rows(rows: list[dict], base: str, variant: str, metric: str = "score") -> list[dict]:
    """One row per (task, ratio) and per ratio over all tasks ("all"): n, mean A, mean B, mean B - A and its
    95% interval of the rows' `metric`, for the examples both `base` and `variant` answered with it
    (`paired_examples`)."""
    cells: dict[tuple, list[tuple[float, float]]] = {}
    for (task, ratio), pairs in paired_examples(rows, base, variant, metric).items():
        cells[(task, ratio)] = list(pairs.values())
        cells.setdefault(("all", ratio), []).extend(pairs.values())
    return [difference_stats(task, ratio, pairs, base, variant, metric)
            for (task, ratio), pairs in sorted(cells.items())]


def difference_stats(task: str, ratio: float, pairs: list[tuple[float, float]], base: str, variant: str,
                     metric: str) -> dict:  # fmt: skip
    """A paired row of `pairs` (A's value, B's) of one cell: n, the means, B - A with its 95% interval (t, clipped to
    what a difference of `metric` can be: `difference_interval`), how many changed."""
    diffs = [b - a for a, b in pairs]
    n = len(diffs)
    mean = statistics.fmean(diffs)
    low, high = difference_interval(mean, mean_half_width(diffs), metric, n)
    return {"base": base, "variant": variant, "metric": metric, "task": task, "ratio": ratio, "n": n,
            "changed": sum(d != 0 for d in diffs),
            "base_score": statistics.fmean(a for a, _ in pairs),
            "variant_score": statistics.fmean(b for _, b in pairs),
            "difference": mean, "low": low, "high": high}  # fmt: skip


def difference_interval(mean: float, half: float, metric: str, n: int) -> tuple[float, float]:
    """mean -/+ half, clipped to the differences `metric` allows: [-1, 1] for a value in [0, 1] (a t interval
    of a difference near -1 reaches past it), unbounded for a KL (`METRICS`). A half width of 0 (every one of the
    `n` differences the same, 0 where no score changed) has the interval `confidence.no_spread_interval` gives in
    that range (t's collapsed to a point); a KL's stays a point."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    low, high = mean - half, mean + half
    bounds = METRICS[metric]
    if bounds is None or math.isnan(half):
        return low, high
    span = bounds[1] - bounds[0]
    if half == 0:
        return no_spread_interval(mean, n, -span, span)
    return max(low, -span), min(high, span)


def table(rows: list[dict]) -> str:
    metric = rows[0].get("metric", "score") if rows else "score"
    lines = [f"| A | B | task | r | n | A: {metric} | B: {metric} | B - A (95% interval) | {metric} changed |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        none = "(one example: no interval)" if r["n"] < 2 else "(a value is not finite: no interval)"
        interval = f"{r['difference']:+.3f} " + (none if math.isnan(r["low"]) else
                                                 f"[{r['low']:+.3f}, {r['high']:+.3f}]")  # fmt: skip
        lines.append(f"| {r['base']} | {r['variant']} | {r['task']} | {r['ratio']} | {r['n']} | "
                     f"{r['base_score']:.3f} | {r['variant_score']:.3f} | {interval} | {r['changed']} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpress.eval.paired", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--out", required=True, help="a sweep directory")
    parser.add_argument("--pair", nargs=2, action="append", required=True, metavar=("A", "B"),
                        help="a press and its variant, named as the sweep wrote them (repeatable)")
    parser.add_argument("--also", action="append", default=[], metavar="DIR",
                        help="another sweep of the same examples, its presses named press@DIR (repeatable)")
    parser.add_argument("--metric", choices=list(METRICS), default="score",
                        help="what is paired: the score (default), or an answer row's fidelity to the full cache's "
                             "answer (answer_top1, answer_kl), or a continuation row's kl")  # fmt: skip
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    rows = summary_rows(args.out)
    for other in map(Path, args.also):
        if _examples(other) != _examples(Path(args.out)):
            print(f"kvpress paired: {other} and {args.out} are not sweeps of the same examples (model, length, seed)",
                  file=sys.stderr)  # fmt: skip
            return 2
        rows += [{**r, "press": f"{r['press']}@{other.name}"} for r in summary_rows(other)]
    if not rows:
        print(f"kvpress paired: {args.out} holds no result rows", file=sys.stderr)
        return 2
    result = []
    for base, variant in args.pair:
        found = paired_rows(rows, base, variant, args.metric)
        if not found:
            print(f"kvpress paired: no example of {args.out} has both {base!r} and {variant!r} with {args.metric}",
                  file=sys.stderr)  # fmt: skip
            return 2
        result += found
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _examples(out: Path) -> tuple:
    """What makes two sweeps' examples the same: model, context length and seed (their settings.json)."""
    settings = json.loads((out / "settings.json").read_text()) if (out / "settings.json").exists() else {}
    return settings.get("model"), settings.get("length"), settings.get("seed")


if __name__ == "__main__":
    sys.exit(main())
