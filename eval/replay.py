"""Re-measure a sample of a committed sweep's rows and compare them with what was written: a change that
must not change behaviour (a refactor) keeps every answer and every kept byte.

    python -m kvpress.eval.replay --sweep eval/results/sweep-tasks --rows 12 --out eval/results/replay/sweep-tasks.jsonl

The sample takes rows of every press of the sweep in turn (a seeded shuffle within each press), answer
tasks only (perplexity rows are not replayed). Each row is measured as the sweep measured it: the same
example drawn with the sweep's settings, one recorded prefill, the press applied, the same answer budget.
Results are written as they come, and a second run resumes where the first stopped (a row of the file replays the
same sweep row, as the sweep wrote it, under the same settings, or it is measured again: one file can take several
sweeps' replays, and the summary counts this run's sample only).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import kvpress
from kvpress.eval.sweep import PLAN_KEYS, answer_rows, append_row, current_rows, read_rows
from kvpress.eval.tasks import ANSWER_TOKENS, Document, built_now, task_examples

FIELDS = ("answer", "kept_bytes", "score")


def sample_rows(rows: list[dict], n: int, seed: int = 0) -> list[dict]:
    """`n` rows taken from each press in turn, the presses in a seeded order (each press's rows shuffled)."""
    by_press: dict[str, list[dict]] = {}
    for row in sorted(rows, key=lambda r: (r["press"], r["ratio"], r["task"], r["example"])):
        by_press.setdefault(row["press"], []).append(row)
    rng = random.Random(seed)
    for members in by_press.values():
        rng.shuffle(members)
    order = sorted(by_press)
    rng.shuffle(order)
    by_press = {press: by_press[press] for press in order}
    picked: list[dict] = []
    while len(picked) < n and any(by_press.values()):
        for members in by_press.values():
            if members and len(picked) < n:
                picked.append(members.pop())
    return picked


def replayable(sweep: Path, presses: list[str] | None = None) -> list[dict]:
    """The rows of `sweep` with an answer to replay (of `presses` only, when given); a press with none, or no row
    at all, is refused (a replay of nothing would pass)."""
    answered = [row for row in current_rows(sweep).values() if row["task"] in ANSWER_TOKENS]
    names = sorted({row["press"] for row in answered})
    unknown = sorted(set(presses or ()) - set(names))
    if unknown or not answered:
        raise ValueError(f"{sweep} holds no answer rows of {', '.join(unknown) or 'any press'} to replay (perplexity "
                         f"and continuation rows have none); its presses with answers: {', '.join(names) or 'none'}")
    rows = [row for row in answered if presses is None or row["press"] in presses]
    stale = sorted({row["task"] for row in rows if not built_now(row)})
    if stale:  # their examples are not the ones the builders make now: a replay would differ for that alone
        print(f"kvpress replay: {sweep}'s rows of {', '.join(stale)} were measured on an older version of their "
              "builder (eval/tasks.TASK_VERSIONS): left out (replay them with the code that measured them, or "
              "--refresh the sweep first)", file=sys.stderr)  # fmt: skip
        rows = [row for row in rows if built_now(row)]
        if not rows:
            raise ValueError(f"{sweep} holds no answer rows of the builders' current versions to replay")
    return rows


def _shaping(settings: dict) -> dict:
    """What of a sweep's settings shapes a row: all but the plan and the number of examples (drawn prefix-stable,
    a run of more examples holds the same first ones: a replay file was measured again after a sweep resumed with
    another --examples)."""
    return {key: value for key, value in settings.items() if key not in (*PLAN_KEYS, "examples")}


def replay(model, tokenizer, sweep: Path, n: int, out: Path, seed: int = 0, progress: bool = True,
           presses: list[str] | None = None) -> list[dict]:  # fmt: skip
    """Re-measure `n` sampled rows of `sweep` (of `presses` only, when given) into `out` (JSON lines, resumed);
    returns the sample's replayed rows, in its order. A row of `out` is this sample's when it replays the same row
    (task, example, press, ratio and what the sweep wrote for it) of a sweep of the same settings: one of another
    sweep, or of this one before it was measured again, is measured anew."""
    settings = json.loads((sweep / "settings.json").read_text())
    settings = {key: value for key, value in settings.items() if key not in PLAN_KEYS}  # (what shapes a row)
    rows = replayable(sweep, presses)
    done = read_rows(out, "kvpress replay")
    out.parent.mkdir(parents=True, exist_ok=True)
    replayed = []
    for row in sample_rows(rows, n, seed):
        key = (row["task"], row["example"], row["press"], row["ratio"])
        same_row = [r for r in done if (r["task"], r["example"], r["press"], r["ratio"]) == key
                    and all(r[f"was_{f}"] == row[f] for f in FIELDS)
                    and _shaping(r.get("settings", settings)) == _shaping(settings)]  # fmt: skip
        if same_row:
            replayed.append(same_row[-1])
            continue
        count = max(row.get("examples", 0), settings["examples"], row["example"] + 1)
        example = task_examples(row["task"], tokenizer, count, settings["length"], settings["seed"])[row["example"]]
        if isinstance(example, Document):
            continue
        budget = row.get("answer_tokens", ANSWER_TOKENS[row["task"]])
        new = next(answer_rows(model, tokenizer, example, [(row["press"], row["ratio"])], budget,
                                settings["query_aware"], False, settings.get("prefill_chunk_size")))  # fmt: skip
        result = {"task": row["task"], "example": row["example"], "press": row["press"], "ratio": row["ratio"],
                  **{f"was_{f}": row[f] for f in FIELDS}, **{f"now_{f}": new[f] for f in FIELDS},
                  "same": all(row[f] == new[f] for f in FIELDS), "settings": settings}  # fmt: skip
        append_row(out, result)
        replayed.append(result)
        if progress:
            mark = "same" if result["same"] else "DIFFERENT"
            print(f"{mark:9s} {row['press']}@{row['ratio']} {row['task']} #{row['example']}: {new['answer']!r}")
    return replayed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", required=True, help="a sweep directory (its settings.json names the model)")
    parser.add_argument("--rows", type=int, default=12, help="rows to replay (default 12)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample (default 0)")
    parser.add_argument("--presses", help="replay these presses only (comma-separated, as the sweep names them)")
    parser.add_argument("--out", required=True, help="JSON lines to write (resumed if it exists)")
    args = parser.parse_args(argv)
    if args.rows < 1:
        parser.error(f"--rows must be a positive number, got {args.rows}")
    sweep = Path(args.sweep)
    if not (sweep / "settings.json").exists():
        parser.error(f"{sweep} holds no sweep (no settings.json)")
    name = json.loads((sweep / "settings.json").read_text()).get("model")
    presses = args.presses.split(",") if args.presses else None
    try:
        replayable(sweep, presses)  # before the model loads
    except ValueError as err:
        parser.error(str(err))
    model, tokenizer = kvpress.load_model(None if name in (None, "smollm2-135m") else name)
    rows = replay(model, tokenizer, sweep, args.rows, Path(args.out), args.seed, presses=presses)
    same = sum(r["same"] for r in rows)
    print(f"{same} of {len(rows)} replayed rows give the same answer, kept bytes and score")
    return 0 if same == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
