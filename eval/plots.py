"""The plots of a sweep directory: `plot.png` (score vs kept KV bytes, one panel per task) and, when the
sweep has several tasks, `heatmap.png` (retention of the full cache's score, press x task, one panel per
ratio, each cell annotated with its number).

Styles: each press gets its own colour and marker, assigned over the sorted names of the presses in the
figure (`press_styles`: no two share both); the default press (the sweep's model's, `default_for`) is red,
thick (beneath the others, which stay visible where they match it) and labelled "(default)"; the full cache
is black: a star at its kept bytes and a dashed line at its score. The legend sits below the panels, never
over the data.

Bands are 95% intervals over a cell's examples, from the rows in `results*.jsonl` (summary.json and table.md
carry them too; `confidence.py`): where every score of the cell is 0 or 1, Wilson's interval for a proportion
(right at 0 and 1 and at few examples, where the normal one collapses to a point); otherwise (fractions: partial
credit, top-1 agreement) Student's t interval, mean +- t(n - 1) sd / sqrt(n), clipped to [0, 1], or where every
score is the same fraction, `confidence.no_spread_interval` (t collapsed to a point there). Perplexity pools
the NLL of all documents (NLL sum / token sum, a ratio of sums): its standard error is the ratio estimator's,
sqrt(sum (nll_i - r tokens_i)^2 / (n (n - 1))) / mean tokens, and the band exp(r +- t(n - 1) se). Otherwise a
cell of one example has no band. With more than `BANDS_FOR_ALL`
presses in a figure, only the default press and the full cache get bands (a dozen overlapping bands hide
the curves); the heatmap then reads better than the curves. Cells measured on fewer examples than their task's
widest (a sweep widened and stopped part way, `partial_cells`) are marked: a range of n in the panel's title, a
'*' in the heatmap.

Replot an existing sweep without running it again: `python -m kvpress.eval.sweep --replot --out DIR`.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

from kvpress.eval.confidence import mean_half_width, no_spread_interval, t_quantile, wilson
from kvpress.presses import DEFAULT_PRESS
from kvpress.presses.defaults import default_for

FULL = "none"  # the full cache's press name in a sweep
DEFAULT_COLOUR = "#d62728"
FULL_COLOUR = "black"
# qualitative and readable on white: tab10 without its red (the default press's), then darker and lighter
# tab20 / tab20b shades; 20 colours x 12 markers (no star: the full cache's): 240 distinct pairs, the marker
# moving one step more every 60 presses (colour and marker indices cycling together repeat after 60)
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
           "#393b79", "#637939", "#8c6d31", "#7b4173", "#6b6ecf", "#e7ba52", "#aec7e8", "#98df8a", "#ffbb78",
           "#c5b0d5", "#c49c94")  # fmt: skip
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "p", "h", "d")
BANDS_FOR_ALL = 6  # up to this many presses in a figure, each gets its band; beyond, the emphasised ones only


def is_default(press: str, default: str = DEFAULT_PRESS) -> bool:
    """Whether the spec `press` names `default` (its parameters in any order)."""
    return _canonical(press) == _canonical(default)


def _canonical(spec: str) -> tuple[str, frozenset]:
    name, *pairs = spec.lower().split(":")
    return name, frozenset(pairs)


def press_styles(presses: Iterable[str], default: str = DEFAULT_PRESS) -> dict[str, dict]:
    """Line style (colour, marker, width, label...) of each press: the default press red and thick, the full
    cache black with a star, the others the i-th colour and marker in sorted order (distinct pairs)."""
    presses = list(presses)
    styles = {}
    others = sorted({p for p in presses if p != FULL and not is_default(p, default)})
    for i, press in enumerate(others):
        marker = MARKERS[(i + i // 60) % len(MARKERS)]
        styles[press] = dict(color=COLOURS[i % len(COLOURS)], marker=marker, linewidth=1.4, markersize=5, zorder=3,
                             label=press)  # fmt: skip
    for press in presses:
        if press == FULL:
            styles[press] = dict(color=FULL_COLOUR, marker="*", linewidth=1.2, markersize=13, zorder=6,
                                 label="full cache (none)")  # fmt: skip
        elif is_default(press, default):
            styles[press] = dict(color=DEFAULT_COLOUR, marker="o", linewidth=3.2, markersize=8, zorder=2.5,
                                 label=f"{press} (default)")  # fmt: skip
    return styles


def intervals(rows: list[dict]) -> dict[tuple[str, str, float], tuple[float, float]]:
    """95% interval of each (task, press, ratio) cell from its example rows: of the score, or of the pooled
    perplexity for perplexity rows (see the module's docstring). The full cache's continuation rows have none: their
    top-1 agreement is with themselves, 1 by construction (Wilson's interval gave it [0.34, 1] at 2 examples)."""
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["task"], r["press"], r["ratio"]), []).append(r)
    out = {}
    for key, members in cells.items():
        if key[1] == FULL and "kl" in members[0]:  # (the full cache's top-1 agreement with itself: 1, no interval)
            continue
        n = len(members)
        scores = [m.get("score") for m in members]
        if "nll_sum" not in members[0] and all(s in (0, 1) for s in scores):
            out[key] = wilson(sum(scores), n)
            continue
        if n < 2:
            continue
        if "nll_sum" in members[0]:
            nll, tokens = [m["nll_sum"] for m in members], [m["tokens"] for m in members]
            rate = sum(nll) / sum(tokens)
            spread = sum((a - rate * t) ** 2 for a, t in zip(nll, tokens, strict=True)) / (n * (n - 1))
            se = math.sqrt(spread) / statistics.fmean(tokens)
            t = t_quantile(n - 1)
            out[key] = (math.exp(rate - t * se), math.exp(rate + t * se))
        else:
            mean, half = statistics.fmean(scores), mean_half_width(scores)
            out[key] = no_spread_interval(mean, n, 0.0, 1.0) if half == 0 else (max(0.0, mean - half),
                                                                                min(1.0, mean + half))  # fmt: skip
    return out


def score_intervals(rows: list[dict]) -> dict[tuple[str, str, float], tuple[float, float]]:
    """`intervals` as bounds of the score: a perplexity cell's is the inverse of its perplexity's (score = 1 / ppl)."""
    perplexity = {(r["task"], r["press"], r["ratio"]) for r in rows if "nll_sum" in r}
    return {key: (1 / high, 1 / low) if key in perplexity else (low, high)
            for key, (low, high) in intervals(rows).items()}  # fmt: skip


def plot_sweep(summary: list[dict], rows: list[dict], out: str | Path) -> list[Path]:
    """Write `plot.png` and, with several tasks, `heatmap.png` into `out`; the paths written (none without
    matplotlib). `rows` are the example rows, for the bands (may be empty). The default press marked is the
    sweep's model's (its settings.json), else `DEFAULT_PRESS`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'kvpress[plot]'): no plot written", file=sys.stderr)
        return []
    out = Path(out)
    settings = out / "settings.json"
    model = json.loads(settings.read_text()).get("model") if settings.exists() else None
    default = default_for(model) or DEFAULT_PRESS
    written = [_curves(plt, summary, intervals(rows), out / "plot.png", default)]
    heatmap = out / "heatmap.png"
    if len({s["task"] for s in summary}) > 1:
        written.append(_heatmap(plt, summary, heatmap, default))
    elif heatmap.exists():
        heatmap.unlink()  # left by an earlier sweep of this directory with more tasks
    return written


def partial_cells(summary: list[dict]) -> set[tuple[str, str, float]]:
    """The (press, task, ratio) cells measured on fewer examples than the task's widest cell (a sweep that was
    widened and stopped part way): the plots mark them."""
    widest: dict[str, int] = {}
    for s in summary:
        widest[s["task"]] = max(widest.get(s["task"], 0), s["examples"])
    return {(s["press"], s["task"], s["ratio"]) for s in summary if s["examples"] < widest[s["task"]]}


def _order(presses: Iterable[str], default: str) -> list[str]:
    """Legend order: full cache, default press, the others sorted."""
    return sorted(set(presses), key=lambda p: (p != FULL, not is_default(p, default), p))


def _wrap(label: str, width: int = 44) -> str:
    """Break a long press spec at its colons."""
    lines = [""]
    for i, part in enumerate(label.split(":")):
        if i and len(lines[-1]) + 1 + len(part) > width:
            lines[-1] += ":"
            lines.append("  " + part)
        else:
            lines[-1] += (":" if i else "") + part
    return "\n".join(lines)


def _curves(plt, summary: list[dict], bands: dict, path: Path, default: str) -> Path:
    import matplotlib.ticker

    tasks = sorted({s["task"] for s in summary})
    presses = _order((s["press"] for s in summary), default)
    styles = press_styles(presses, default)
    labels = [_wrap(styles[p]["label"]) for p in presses]
    label_inches = 0.075 * max(len(line) for label in labels for line in label.splitlines()) + 0.6
    across = len(tasks) if len(tasks) <= 3 else math.ceil(len(tasks) / 2)  # 4 tasks: 2 x 2, 5 or 6: 2 x 3
    down = math.ceil(len(tasks) / across)
    width = max(4.6 * across, 2 * label_inches)
    ncol = max(1, min(len(presses), int(width // label_inches)))
    rows_of_legend = math.ceil(sum(label.count("\n") + 1 for label in labels) / ncol)
    fig, axes = plt.subplots(down, across, figsize=(width, 3.8 * down + 0.6 + 0.2 * rows_of_legend), squeeze=False,
                             layout="constrained")  # fmt: skip
    for ax in axes.flat[len(tasks) :]:
        ax.set_visible(False)
    handles = {}
    banded = {p for p in presses if len(presses) - 1 <= BANDS_FOR_ALL or p == FULL or is_default(p, default)}
    for ax, task in zip(axes.flat, tasks, strict=False):  # more axes than tasks: the rest are hidden
        cells = {s["press"]: [] for s in summary if s["task"] == task}
        for s in summary:
            if s["task"] == task:
                cells[s["press"]].append(s)
        ppl = cells[next(iter(cells))][0]["ppl"] is not None
        key = "ppl" if ppl else "score"
        full = cells.get(FULL, [None])[0]
        for press in [p for p in presses if p in cells]:
            style = styles[press]
            points = sorted((s["kept_bytes_ratio"], s[key], bands.get((task, press, s["ratio"]))) for s in cells[press])
            if press != FULL and full is not None:
                points.append((full["kept_bytes_ratio"], full[key], bands.get((task, FULL, full["ratio"]))))
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            if press == FULL:
                ax.axhline(full[key], color=FULL_COLOUR, linestyle="--", linewidth=1, zorder=1)
            (line,) = ax.plot(xs, ys, color=style["color"], marker=style["marker"], linewidth=style["linewidth"],
                              markersize=style["markersize"], zorder=style["zorder"], linestyle="none"
                              if press == FULL else "-")  # fmt: skip
            handles.setdefault(press, line)
            if press in banded and any(p[2] for p in points):
                lows = [p[2][0] if p[2] else p[1] for p in points]
                highs = [p[2][1] if p[2] else p[1] for p in points]
                if press == FULL:
                    ax.axhspan(lows[0], highs[0], color=FULL_COLOUR, alpha=0.05, linewidth=0, zorder=0)
                else:
                    alpha = 0.15 if is_default(press, default) else 0.06
                    ax.fill_between(xs, lows, highs, color=style["color"], alpha=alpha,
                                    linewidth=0, zorder=style["zorder"] - 1)  # fmt: skip
        counts = sorted({s["examples"] for rows in cells.values() for s in rows})
        examples = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"  # partial cells: a range
        ax.set_title(f"{task} ({examples} examples{' a cell' if len(counts) > 1 else ''})")
        ax.set_xlabel("kept KV bytes / full")
        if ppl:
            ax.set(ylabel="perplexity (lower is better)", yscale="log")
            plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")  # 30, not 3 x 10^1
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(plain)
        else:
            ax.set(ylabel="score", ylim=(-0.03, 1.03))
        ax.set_xlim(0, 1.05)
        ax.grid(alpha=0.3)
    which = "" if len(banded) == len(presses) else " of the default press and the full cache"
    fig.suptitle(f"score vs kept KV memory (bands: 95% interval over the examples{which})", fontsize=11)
    fig.legend([handles[p] for p in presses if p in handles], [lb for p, lb in zip(presses, labels, strict=True)
               if p in handles], loc="outside lower center", ncol=ncol, fontsize=8, frameon=False)  # fmt: skip
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def heatmap_order(summary: list[dict]) -> list[str]:
    """The heatmap's presses, best first: by the mean of their retentions as coloured, clipped to [0, 1] (unclipped,
    a near-chance full cache's retentions of 3.0 put a press second that ranks seventh), then by name."""
    presses = sorted({s["press"] for s in summary} - {FULL})
    kept = {p: [min(max(s["retention"], 0.0), 1.0) for s in summary if s["press"] == p and s["retention"] is not None]
            for p in presses}  # fmt: skip
    return sorted(presses, key=lambda p: (-statistics.fmean(kept[p]) if kept[p] else 0.0, p))


def _heatmap(plt, summary: list[dict], path: Path, default: str) -> Path:
    import matplotlib
    import numpy as np

    tasks = sorted({s["task"] for s in summary})
    ratios = sorted({s["ratio"] for s in summary if s["press"] != FULL})
    cell = {(s["press"], s["task"], s["ratio"]): s["retention"] for s in summary}
    partial = partial_cells(summary)
    presses = heatmap_order(summary)
    names = [_wrap(f"{p} (default)" if is_default(p, default) else p, 60) for p in presses]
    name_inches = 0.07 * max(len(line) for name in names for line in name.splitlines()) + 0.3
    height = 1.6 + 0.3 * sum(name.count("\n") + 1 for name in names)
    width = name_inches + len(ratios) * (0.75 * len(tasks) + 0.4) + 1
    fig, axes = plt.subplots(1, len(ratios), figsize=(width, height), squeeze=False, sharey=True, layout="constrained")
    for ax, ratio in zip(axes[0], ratios, strict=True):
        values = np.array([[cell.get((p, t, ratio)) for t in tasks] for p in presses], dtype=float)
        cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#eeeeee")  # not measured, or n/a
        image = ax.imshow(np.ma.masked_invalid(np.clip(values, 0, 1)), cmap=cmap, vmin=0, vmax=1, aspect="auto")
        for i, p in enumerate(presses):
            for j, t in enumerate(tasks):
                if (p, t, ratio) not in cell:
                    ax.text(j, i, "-", ha="center", va="center", fontsize=8, color="grey")
                    continue
                v = cell[(p, t, ratio)]
                text = ("n/a" if v is None else f"{v:.2f}") + ("*" if (p, t, ratio) in partial else "")
                dark = v is not None and v < 0.6
                ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if dark else "black")
        ax.set_title(f"ratio {ratio:g}", fontsize=10)
        ax.set_xticks(range(len(tasks)), [t.replace("_", "_\n", 1) for t in tasks], fontsize=8)
        ax.tick_params(length=0)
    axes[0][0].set_yticks(range(len(presses)), names, fontsize=8)
    for label, press in zip(axes[0][0].get_yticklabels(), presses, strict=True):
        if is_default(press, default):
            label.set_fontweight("bold")
            label.set_color(DEFAULT_COLOUR)
    fig.colorbar(image, ax=axes[0].tolist(), label="retention (score / full cache's)", shrink=0.8)
    fig.suptitle("retention of the full cache's score (perplexity: full ppl / ppl; '-' not measured, "
                 "'n/a' full cache scored 0, '*' fewer examples than the task's other cells)", fontsize=10)  # fmt: skip
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
