"""`kvpress sweep`: quality vs kept KV memory for many (press, ratio) pairs, one prefill per example.

Prefill attention is full: within the prefill forward a press only evicts after a layer's attention,
so no layer's output depends on the press. One recorded prefill per example (the full cache plus
each layer's queries) therefore serves every configuration: each press is applied to a copy of the
recorded cache exactly as it would have been inside the forward, then the question is answered from
that compressed cache (`kvpress.recording`). Presses with `rerotate=True` need a live prefill
(`--prefill-chunk-size`) and are refused without one; KVzip's reconstruction pass runs once per example and
serves every ratio.

Writes, under `--out`: `results.jsonl` (one line per example and configuration, appended as it goes:
an interrupted sweep resumes where it stopped), `summary.json` / `summary.csv` (mean score, its
retention against the full cache on the same examples, kept KV bytes and empty answers per task, press, ratio),
`table.md`, `plot.png` (score vs kept KV memory per press) and, with several tasks, `heatmap.png` (retention per
press and task, one panel per ratio); `--replot` redraws both from a finished sweep's rows (`plots.py`).
A score is the task's: mostly the fraction of expected strings in the answer (see `eval/tasks/`). An answer row
records its budget (`answer_tokens`, the task's `ANSWER_TOKENS`), whether that budget cut it (`cut`), and the
answer's fidelity: the full cache's answer is fed after the prompt tokens the cache does not hold (the question)
over each configuration's cache, nothing more evicted, and `answer_top1` / `answer_kl` are the top-1 agreement and
mean KL(full || compressed) of the next-token distributions where they predict its tokens (`answer_positions` of
them; `reference_cut`: whether the budget cut that answer), a measure of what a press changes that does not hang on
the model answering right (`paired.py --metric`; the summary averages both over a cell whose every row has them: not
a press that recalls evicted tokens, nor rows written before the fields were, which a resumed sweep keeps). When a
task's budget changes, a resumed sweep (or `--refresh`, which re-measures every such row in the directory and
nothing else) answers again only where the new budget could change the row (`is_final`); the old row is dropped once
its new one is written. A resumed sweep refuses a directory measured with another model, length, seed or mode.

Perplexity tasks cannot share a prefill: each token is predicted from the cache compressed so far.
They run one live chunked pass per (document, configuration) (`tasks/perplexity.py`); a row records
`ppl`, `score` = exp(-mean NLL) = 1 / ppl (higher is better, so retention = ppl_full / ppl) and the
kept / full KV bytes at the end of the document. The summary pools the NLL of all documents. (Their
full bytes are computed, keys and values only, as no full cache is built; answer rows measure the
recorded full cache, per-slot positions included, ~1% more.)

Continuation tasks (`tasks/continuation.py`) share the recorded prefill too: the real tokens that follow the
context are fed over each compressed cache with nothing more evicted, and a row records the top-1 agreement
of their next-token distributions with the full cache's (`score`) and the mean KL(full || compressed) (`kl`,
in nats; the summary averages it over examples).

Data-parallel: under `accelerate launch --multi_gpu --num_processes N` on GPUs, or
`torchrun --nproc_per_node N -m kvpress.eval.sweep ...` on CPUs (any launcher that sets WORLD_SIZE;
accelerate's `PartialState` joins the processes), process r takes the examples i with i % N == r
and appends to `results.rank{r}.jsonl`; process 0 writes the summary of all of them once every
process is done.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import io
import json
import math
import os
import sys
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

import kvpress
from kvpress.engine import maybe_installed
from kvpress.eval.memory import full_cache_bytes, peak_memory, reset_cuda_peak
from kvpress.eval.plots import intervals, plot_sweep, score_intervals
from kvpress.eval.tasks import (
    ANSWER_TOKENS,
    DEFAULT_TASKS,
    MIN_LENGTHS,
    SCORING,
    TASKS,
    UNAVAILABLE,
    Continuation,
    Document,
    built_now,
    check_data,
    row_version,
    scored_now,
    task_examples,
    task_version,
)
from kvpress.eval.tasks.perplexity import CHUNK, chunked_nll
from kvpress.files import check_writable, held_alone, write_text_whole, write_whole
from kvpress.models import DEFAULT_MODEL, PACKAGED_MODELS, cache_dir
from kvpress.patches.cache import scratch
from kvpress.pipeline import answer_ids_from_cache, check_chunk_size, prefill_context, split_prompt
from kvpress.presses import parse_press_spec, resolve_default, spec_before_loading
from kvpress.recording import compress_recording, record_prefill


def configurations(presses: list[str], ratios: list[float]) -> list[tuple[str, float]]:
    """("none", 0.0) (the full cache: every press at r = 0) plus every (press, r > 0); a press that quantizes
    (`kv_bits`) also at r = 0 when the ratios include it (quantization alone)."""
    quantized = set()
    for name in presses:
        _, params = parse_press_spec(resolve_default(name))  # a press name, optionally with parameters
        if {"compression_ratio", "max_tokens"} & set(params):
            raise ValueError(f"{name!r}: a sweep sets the budget from --ratios; leave it out of the press name")
        if params.get("kv_bits") is not None:
            quantized.add(name)
    for ratio in ratios:
        if not 0 <= ratio < 1:
            raise ValueError(f"ratios must be in [0, 1), got {ratio}")
    for kind, given in (("presses", presses), ("ratios", ratios)):
        twice = sorted({str(x) for x in given if given.count(x) > 1})
        if twice:
            raise ValueError(f"{kind} given twice: {', '.join(twice)} (each is measured once)")
    idle = [name for name in presses if name not in quantized and not any(ratio > 0 for ratio in ratios)]
    if idle:
        raise ValueError(f"ratios {ratios} hold no ratio > 0 for {', '.join(idle)} (r = 0 is the full cache, measured "
                         "once for all presses): add one")  # fmt: skip
    return [("none", 0.0)] + [(name, ratio) for name in presses for ratio in ratios
                              if ratio > 0 or name in quantized]  # fmt: skip


def check_tasks(tasks: list[str]) -> None:
    for task in tasks:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; choose one of: {', '.join(sorted(TASKS))}")


def check_plan(presses: list[str], tasks: list[str], query_aware: bool, prefill_chunk_size: int | None) -> None:
    """Refuse presses that cannot run these tasks this way: each is built (a bad parameter named), one that reads
    the question needs `query_aware` and tasks that ask one (not the continuation and perplexity tasks), the
    perplexity tasks take neither a press scoring the whole context nor chunks of their own."""
    chunked = [task for task in tasks if task.startswith("perplexity")]  # fed in chunks through the press
    built = {name: kvpress.press_from_name(name, compression_ratio=0.5) for name in presses}
    same = [(a, b) for i, a in enumerate(presses) for b in presses[i + 1 :] if repr(built[a]) == repr(built[b])]
    if same:  # (another name, or its parameters in another order: the rows would be measured twice)
        raise ValueError(f"{same[0][0]!r} and {same[0][1]!r} are the same press: give it once")
    whole = [name for name, press in built.items() if press.needs_whole_context]
    asking = [name for name, press in built.items() if press.needs_question]
    if asking and not query_aware:
        raise ValueError(f"{asking} score by the question: sweep them with --query-aware")
    questionless = _questionless(tasks)
    if asking and questionless:
        raise ValueError(f"{asking} score by the question, and the tasks {questionless} ask none (a text scored as it "
                         "goes on): sweep them separately")  # fmt: skip
    if chunked and whole:
        raise ValueError(f"{whole} score a context once it is all cached; the perplexity tasks {chunked} feed "
                         "documents in chunks through the press: sweep them separately")  # fmt: skip
    check_chunk_size(prefill_chunk_size)
    rerotating = [name for name, press in built.items() if press.rerotate]
    if rerotating and not prefill_chunk_size:  # (refused only once the model loaded and the first prefill ran)
        raise ValueError(f"{rerotating} re-rotate keys (rerotate=True), which a press applied to the sweep's "
                         "recorded prefill cannot: sweep them with --prefill-chunk-size (a live prefill), or without "
                         "rerotate")  # fmt: skip
    if chunked and prefill_chunk_size:
        raise ValueError(f"the perplexity tasks {chunked} feed documents {CHUNK} tokens a forward already: sweep "
                         "them without --prefill-chunk-size")  # fmt: skip


def _questionless(tasks: list[str]) -> list[str]:
    """The tasks of `tasks` that ask no question: a text scored as it goes on (continuation, perplexity)."""
    return [task for task in tasks if task.startswith(("continuation", "perplexity"))]


def check_settings_used(presses: list[str], tasks: list[str], query_aware: bool, prefill_chunk_size: int | None):
    """For a new directory, refuse a setting no row of the plan would use, which settings.json would record and
    every later run of the directory take: --query-aware with only question-free tasks (their rows are the same
    without it), a --prefill-chunk-size no press prefills with (each scores the whole context)."""
    questionless = _questionless(tasks)
    if query_aware and len(questionless) == len(tasks):
        raise ValueError(f"--query-aware prefills a question with the context, and the tasks {questionless} ask none "
                         "(a text scored as it goes on): sweep them without it")  # fmt: skip
    built = [kvpress.press_from_name(name, compression_ratio=0.5) for name in presses]
    if prefill_chunk_size and built and all(press.refuses_chunks for press in built):
        raise ValueError(f"--prefill-chunk-size {prefill_chunk_size}: none of {presses} prefills in chunks (each "
                         "scores the whole context: its rows use the recorded prefill), so the size would be recorded "
                         "and ignored: drop it")  # fmt: skip


MIN_LENGTH = 64  # context tokens: room for a task's fact and its filler


def check_sizes(examples: int, length: int, seed: int, tasks: list[str]) -> None:
    """Refuse example counts, context lengths and seeds `tasks` cannot be drawn with (before a model loads): a
    length below `MIN_LENGTH` or below a task's own floor (`MIN_LENGTHS`: the multi-needle tasks and common_words
    need 128)."""
    for name, value, least in (("examples", examples, 1), ("length", length, MIN_LENGTH), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    short = [task for task in tasks if length < MIN_LENGTHS.get(task, 0)]
    if short:
        least = max(MIN_LENGTHS[task] for task in short)
        floors = ", ".join(f"{task} ({MIN_LENGTHS[task]})" for task in short)
        raise ValueError(f"length {length} is below the shortest context these tasks build, in tokens: {floors}; "
                         f"give --length {least} or more, or leave them out")  # fmt: skip


def run_sweep(
    model: nn.Module,
    tokenizer,
    presses: list[str],
    ratios: list[float],
    tasks: list[str],
    out: str | Path,
    examples: int = 16,
    length: int = 1024,
    seed: int = 0,
    query_aware: bool = False,
    progress: bool = True,
    prefill_chunk_size: int | None = None,
) -> list[dict]:
    """Run (or resume) a sweep and write its files; returns the summary rows. Rows of these tasks and
    configurations that a changed answer budget could change (`is_final`) are measured again; a run that would
    measure again, on a task's new examples, only some of the configurations holding rows of its older builder is
    refused (`check_older_rows`: the rest would be left unpaired).

    `prefill_chunk_size`: each press that evicts as tokens are cached prefills the context live, that many tokens
    a forward, instead of being applied to one recorded prefill, and so does KVzip, which scores each chunk (other
    presses that score the whole context, and no press, still use the recording: their rows say
    `prefill_chunk_size` None)."""
    configs = configurations(presses, ratios)
    check_tasks(tasks)
    check_sizes(examples, length, seed, tasks)
    check_plan(presses, tasks, query_aware, prefill_chunk_size)
    out = Path(out)
    check_spellings(out, presses)
    out.mkdir(parents=True, exist_ok=True)
    rank, world, state = _shard()
    with holding(out, rank):
        if state is not None:  # every process waits for process 0 to hold the directory (refused, it never comes)
            state.wait_for_everyone()
        settings = {"examples": examples, "length": length, "seed": seed, "query_aware": query_aware,
                    "perplexity_chunk": CHUNK, "model": model_name(model), "prefill_chunk_size": prefill_chunk_size}
        _check_resume(out, settings)
        check_older_rows(out, configs, tasks, examples)
        if rank == 0:
            _repair(out)
            plan = dict(zip(PLAN_KEYS, (presses, ratios, tasks, world), strict=True))
            # (written whole: half written, no resume could read it)
            write_text_whole(out / "settings.json", json.dumps({**settings, **plan}))
        done = {key for key, row in current_rows(out).items() if is_final(row)}

        def todo(task: str, i: int) -> list[tuple[str, float]]:
            return [(name, r) for name, r in configs if (task, i, name, r) not in done]

        counts = dict.fromkeys(tasks, examples)
        _measure(model, tokenizer, out, counts, todo, (length, seed), (query_aware, prefill_chunk_size), progress,
                 rank, world)  # fmt: skip
        if state is not None:
            state.wait_for_everyone()
        if rank != 0:
            return []
        _compact(out)
        return write_summary(out)


def check_spellings(out: Path, presses: list[str]) -> None:
    """Refuse a press that `out` holds rows of under another name (an alias, its parameters in another order or
    given at their defaults): rows are keyed by the name, so it would be measured again and listed twice."""
    found = {row["press"] for row in current_rows(out).values()}
    held = sorted(found - {"none", *presses})
    if not held:
        return

    def built(name: str) -> str | None:
        try:
            return repr(kvpress.press_from_name(name, compression_ratio=0.5))
        except (ValueError, TypeError, OSError):  # (a press no longer built, a head pattern file gone: not this run's)
            return None

    mine = {built(name): name for name in presses}
    for name in held:
        twin = mine.get(built(name))  # (this run's presses all build: check_plan)
        if twin is not None and twin not in found:  # (both names held already: the run goes on with either)
            raise ValueError(f"{out} holds rows of {name!r}, the same press as {twin!r}: give it as {name!r} (rows are "
                             f"keyed by the name; named {twin!r} it would be measured again and listed twice)")


def check_older_rows(out: Path, configs: list[tuple[str, float]], tasks: list[str], examples: int) -> None:
    """Refuse a run that would measure again, on a task's current examples, only some of the configurations a
    directory holds rows of an older builder for (`task_version`): the others' rows of those examples would be left
    without a full cache (or a partner) of their version to pair with, and drop out of every comparison."""
    wanted, left = set(configs), {}
    for (task, i, press, ratio), row in current_rows(out).items():
        if task in tasks and i < examples and not built_now(row) and (press, ratio) not in wanted:
            left.setdefault(task, set()).add((press, ratio))
    if left:
        said = "; ".join(f"{task}: " + ", ".join(f"{press} r={ratio}" for press, ratio in sorted(pairs))
                         for task, pairs in sorted(left.items()))  # fmt: skip
        raise ValueError(f"{out} holds rows made by an older version of their task's builder for configurations this "
                         f"run leaves out ({said}): measuring those examples again for this run's presses alone would "
                         f"leave theirs unpaired. Run `kvpress sweep --refresh --out {out}` (every such row), or name "
                         "them too, or leave the task out")  # fmt: skip


def refresh_sweep(model: nn.Module, tokenizer, out: str | Path, progress: bool = True) -> list[dict]:
    """Re-measure the rows of the sweep in `out` that a changed answer budget (`ANSWER_TOKENS`) could change
    (`is_final`), with `out`'s settings (settings.json, which names the model); nothing else runs.
    Returns the new summary. A row is replaced once its new one is written, so an interrupted refresh
    resumes where it stopped. A task's examples are rebuilt with the largest count its rows were drawn from."""
    out = Path(out)
    if _shard()[1] > 1:
        raise ValueError("refresh_sweep runs in one process")
    settings_path = out / "settings.json"
    if not settings_path.exists():
        raise FileNotFoundError(f"{out} holds no sweep (no settings.json)")
    settings = json.loads(settings_path.read_text())
    if named_model(settings.get("model", model_name(model))) != model_name(model):
        raise ValueError(f"{out} was measured with {settings['model']!r}, not {model_name(model)!r}")
    with holding(out):
        return _refreshed(model, tokenizer, out, settings, progress)


def _refreshed(model: nn.Module, tokenizer, out: Path, settings: dict, progress: bool) -> list[dict]:
    """`refresh_sweep` once its directory is held."""
    _repair(out)
    current = current_rows(out)
    wanted: dict = {}
    for (task, i, press, ratio), row in current.items():
        if not is_final(row):
            wanted.setdefault((task, i), []).append((press, ratio))
    refreshed = {task for task, _ in wanted}
    counts: dict = {}
    for (task, i, _, _), row in current.items():
        if task in refreshed:
            counts[task] = max(counts.get(task, 0), row.get("examples", 0), i + 1)

    def todo(task: str, i: int) -> list[tuple[str, float]]:
        return wanted.get((task, i), [])

    mode = (settings["query_aware"], settings.get("prefill_chunk_size"))
    _measure(model, tokenizer, out, counts, todo, (settings["length"], settings["seed"]), mode, progress, 0, 1)
    _compact(out)
    return write_summary(out)


def rescore_sweep(out: str | Path, tokenizer, builders: dict | None = None) -> dict[str, int]:
    """Score again every answer row of the sweep in `out` scored by an older matching rule (`scored_now`) from the
    answer it records, its example rebuilt with `out`'s settings (length, seed) and `tokenizer` (the model's that
    measured it); nothing is measured. `builders`: (task, builder version) -> a generator `(tokenizer, n, length,
    seed)`, each task's of today by default (`TASKS`), where the caller has an older one. Rows whose builder or data
    is not at hand are left as they are and counted (`left`, by task). Rewrites the result files and the summary."""
    out = Path(out)
    settings = json.loads((out / "settings.json").read_text())
    with holding(out):
        return _rescored(out, tokenizer, settings, builders)


def _rescored(out: Path, tokenizer, settings: dict, builders: dict | None) -> dict[str, int]:
    """`rescore_sweep` once its directory is held."""
    builders = {(task, task_version(task)): make for task, make in TASKS.items()} | (builders or {})
    _repair(out)
    paths = sorted(out.glob("results*.jsonl"))
    rows = {path: [json.loads(line) for line in path.read_text().splitlines() if line.strip()] for path in paths}
    stale = [row for path in paths for row in rows[path] if not scored_now(row)]
    counts: dict[tuple, int] = {}
    for row in stale:
        key = (row["task"], row_version(row))
        counts[key] = max(counts.get(key, 0), row["example"] + 1, row.get("examples", 0))
    examples, left = {}, {}
    for (task, version), n in counts.items():
        try:
            examples[task, version] = builders[task, version](tokenizer, n, settings["length"], settings["seed"])
        except (KeyError, ValueError, ImportError, OSError):  # (an older builder, or data that cannot be had)
            left[task] = left.get(task, 0) + sum(r["task"] == task and row_version(r) == version for r in stale)
    changed = 0
    for row in stale:
        built = examples.get((row["task"], row_version(row)))
        if built is not None:
            score = built[row["example"]].score(row["answer"])
            changed += score != row["score"]
            row.update(score=score, scoring=SCORING)
    for path in paths:
        write_text_whole(path, "".join(json.dumps(row) + "\n" for row in rows[path]))
    write_summary(out)
    done = len(stale) - sum(left.values())
    return {"rescored": done, "changed": changed, **{f"left {task}": n for task, n in left.items()}}


def model_name(model: nn.Module) -> str:
    """How `kvpress.load_model` names the model (`named_model` of its config's path)."""
    return named_model(getattr(model.config, "name_or_path", "") or "unnamed")


def named_model(name_or_path: str) -> str:
    """A packaged model's name (e.g. smollm2-135m) for its converted directory or its name, else the path (made
    absolute where it is a local one, so that a sweep resumed from elsewhere, or by another spelling, matches)."""
    path = Path(name_or_path)
    if path.name in PACKAGED_MODELS and path.parent == cache_dir():
        return path.name
    return str(path.resolve()) if path.exists() else str(path)


def is_final(row: dict) -> bool:
    """Whether the task's current answer budget could not change `row`: greedy decoding makes a longer
    answer begin with the shorter one, so an answer that ended on an end of sequence stands (a full score under a
    shorter budget does not: more text can turn a number into a longer one, or join an answer to another option
    of the question: `example.holds`). A row that lacks
    `answer_tokens` or `cut` (an older sweep's) counts as cut, with an unknown (zero) budget. A row with answer
    fidelity under another budget stands only if the full cache's answer it was measured along ended on an end of
    sequence (`reference_cut` False): else that answer, hence the fidelity, changes with the budget. A row made by
    another version of its task's builder (`task_version`; rows without one: 1) is measured again, on the examples
    the builder makes now."""
    if not built_now(row):  # made by another version of the task's builder
        return False
    if "answer" not in row:  # perplexity and continuation rows
        return True
    budget = ANSWER_TOKENS[row["task"]]
    if row.get("answer_tokens", 0) > budget:  # the budget shrank: the answer may be longer than it allows
        return False
    if "answer_top1" in row and row.get("answer_tokens", 0) != budget and row.get("reference_cut", True):
        return False
    if not row.get("cut", True):
        return True
    return row.get("answer_tokens", 0) == budget


def _check_resume(out: Path, settings: dict) -> None:
    """Refuse to add rows to a directory measured with another model, context length, seed, mode or perplexity
    chunk."""
    path = out / "settings.json"
    if not path.exists():
        return
    before = json.loads(path.read_text())
    before.setdefault("prefill_chunk_size", None)  # sweeps from before chunks prefilled in one forward
    if "model" in before:  # (a local path, written as typed before paths were made absolute)
        before["model"] = named_model(before["model"])
    for key in ("model", "length", "seed", "query_aware", "prefill_chunk_size", "perplexity_chunk"):
        if key in before and before[key] != settings[key]:
            raise ValueError(f"{out} holds a sweep with {key}={before[key]!r}, not {settings[key]!r}: "
                             "use another --out")  # fmt: skip


def current_rows(out: Path) -> dict[tuple, dict]:
    """The row that stands for each (task, example, press, ratio) in `out`: a final one over one that is
    not (its re-measurement), else the last written."""
    return {key: row for key, (_, row) in _standing(out).items()}


def _standing(out: Path) -> dict[tuple, tuple[tuple[Path, int], dict]]:
    """For each key, ((file, line number), row) of the row that stands (`current_rows`)."""
    chosen: dict = {}
    for path in sorted(out.glob("results*.jsonl")):
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                if n == len(lines) - 1:  # torn by an interrupted write: not a row (`_repair` drops it)
                    continue
                raise ValueError(f"{path}, line {n + 1}, is not a result row ({err}); a row torn by an interrupted "
                                 "write is only ever the last one: fix or delete that line") from None  # fmt: skip
            key = (row["task"], row["example"], row["press"], row["ratio"])
            if key not in chosen or is_final(row) or not is_final(chosen[key][1]):
                chosen[key] = ((path, n), row)
    return chosen


def _repair(out: Path) -> None:
    for path in sorted(out.glob("results*.jsonl")):
        repair_last_row(path, "kvpress sweep")


def lock_name(rank: int) -> str:
    """The lock file of a sweep directory that process `rank` of a sweep holds while it writes there (`held_alone`):
    one sweep (or refresh, or rescore) at a time, each of its processes on its own."""
    return ".lock" if rank == 0 else f".lock.rank{rank}"


def holding(out: Path, rank: int = 0):
    """The block in which process `rank` of a sweep (or a refresh, or a rescore) holds the directory `out`
    (`held_alone` on `lock_name(rank)`)."""
    return held_alone(out / lock_name(rank), f"the sweep directory {out}")


PLAN_KEYS = ("presses", "ratios", "tasks", "processes")  # settings.json's keys of the last run's plan, not of its rows


def repair_last_row(path: Path, who: str) -> None:
    """Drop the last row of the JSON-lines file `path` where an interrupted write left it torn (no end of line,
    or not JSON), so it is measured again and the next row does not land on it; `who` says so."""
    text = path.read_text()
    if not text or text.endswith("\n") and _parses(text.splitlines()[-1]):
        return
    lines = text.splitlines()
    print(f"{who}: {path}: the last row was torn by an interrupted write; it is measured again", file=sys.stderr)
    write_text_whole(path, "".join(line + "\n" for line in lines[:-1]))


def read_rows(path: Path, who: str) -> list[dict]:
    """The rows of the JSON-lines file `path` that a run resumes from (none where it does not exist yet), its torn
    last row dropped (`repair_last_row`); any other line that is not a row raises ValueError."""
    if not path.exists():
        return []
    repair_last_row(path, who)
    rows = []
    for n, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}, line {n + 1}, is not a result row ({err}): fix or delete that line") from None
    return rows


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return not line.strip()  # an empty line is no row, not a torn one
    return True


def _compact(out: Path) -> None:
    """Rewrite the result files without the rows that another row of the same key replaced."""
    keep = {where for where, _ in _standing(out).values()}
    for path in sorted(out.glob("results*.jsonl")):
        lines = path.read_text().splitlines()
        kept = [line for n, line in enumerate(lines) if (path, n) in keep]
        if len(kept) < len(lines):
            write_text_whole(path, "".join(line + "\n" for line in kept))


def _measure(model, tokenizer, out: Path, counts: dict, todo, drawn: tuple, mode: tuple, progress, rank, world):
    """Append a row for each (task, example i, configuration in `todo(task, i)`) of this process's examples;
    `counts` maps each task to how many examples to draw, `drawn` is (context length, seed), `mode` is
    (query_aware, prefill_chunk_size)."""
    query_aware, chunk = mode
    from tqdm.auto import tqdm

    results_path = out / ("results.jsonl" if world == 1 else f"results.rank{rank}.jsonl")
    for task, count in counts.items():
        items = task_examples(task, tokenizer, count, *drawn)
        mine = [(i, example) for i, example in enumerate(items) if i % world == rank]
        for i, example in tqdm(mine, desc=f"{task} [{rank}/{world}]", disable=not progress):
            configs = todo(task, i)
            if not configs:
                continue
            if isinstance(example, Document):
                rows = _perplexity_rows(model, tokenizer, example, configs, progress)
            elif isinstance(example, Continuation):
                rows = continuation_rows(model, tokenizer, example, configs, progress, chunk)
            else:
                rows = answer_rows(model, tokenizer, example, configs, ANSWER_TOKENS[task], query_aware,
                                   progress, chunk)  # fmt: skip
            for row in rows:
                append_row(results_path, {"task": task, "example": i, "examples": count,
                                          "task_version": task_version(task), **row})  # fmt: skip


def append_row(path: Path, row: dict) -> None:
    """Append one row to `path`, opened for it: a file replaced while the sweep runs (a checkout, a stash) takes
    the row, where a file held open would pass it to the replaced copy, which nobody reads."""
    with path.open("a") as sink:
        sink.write(json.dumps(row) + "\n")


def answer_rows(model, tokenizer, example, todo, answer_tokens: int, query_aware: bool, progress: bool,
                chunk: int | None = None):  # fmt: skip
    """One recorded prefill of the example's context, then one row per configuration in `todo` (with `chunk`, a
    press that evicts as tokens are cached prefills live instead: `_compressed`). Each row also holds the answer's
    fidelity: the full cache's answer is fed after the prompt tokens the cache does not hold (the question; with
    `query_aware`, the prompt's last token) over the configuration's cache, nothing more evicted, and `answer_top1` /
    `answer_kl` are the top-1 agreement and mean KL(full || compressed) of the next-token distributions at the
    positions that predict its tokens. A press that recalls evicted tokens (`recalls`) has no such fields: fed the
    answer at once it would recall by the answer's own queries, not as it does while it generates."""
    from tqdm.auto import tqdm

    ctx, question = split_prompt(tokenizer, example.context, example.question, chat_template=False)
    ids = torch.cat([ctx, question], dim=-1).to(model.device)
    hidden = any(kvpress.press_from_name(name, compression_ratio=0.5).needs_hidden for name, _ in todo
                 if name != "none")  # fmt: skip
    if query_aware:  # the question too; the answer is generated from its last token
        recording = record_prefill(model, ids[:, :-1], next_ids=ids[:, -1:], keep_hidden=hidden)
    else:
        recording = record_prefill(model, ctx.to(model.device), keep_hidden=hidden)
    full_bytes = kvpress.cache_bytes(recording.cache)
    full_answer = _reference_answer(model, tokenizer, ids, recording, answer_tokens)
    tail = ids.shape[1] - recording.ids.shape[1]  # the prompt tokens the recorded cache does not hold
    fed = torch.cat([ids[:, -tail:], full_answer[None, :-1]], dim=-1)  # the last one predicts nothing asked for
    reference = fed_logp(model, tokenizer, None, recording.cache, fed)[tail - 1 :]
    for name, ratio in tqdm(todo, desc="configurations", leave=False, disable=not progress):
        reset_cuda_peak()
        press = None if name == "none" else kvpress.press_from_name(name, compression_ratio=ratio)
        cache, chunked = _compressed(model, tokenizer, recording, press, chunk)
        kept = kvpress.cache_bytes(cache)
        fidelity = {}
        if press is None or not press.recalls:
            logp = reference if press is None else fed_logp(model, tokenizer, press, cache, fed)[tail - 1 :]
            top1, kl = agreement(reference, logp)
            fidelity = {"answer_top1": top1, "answer_kl": kl, "answer_positions": reference.shape[0],
                        "reference_cut": _cut(full_answer, answer_tokens, model)}  # fmt: skip
        working = copy.deepcopy(cache) if press is None else cache
        new = answer_ids_from_cache(model, tokenizer, ids, working, press, answer_tokens)
        text = tokenizer.decode(new, skip_special_tokens=True).strip()
        stored = {"offloaded_bytes": kvpress.offloaded_bytes(cache)} if kvpress.offloaded_bytes(cache) else {}
        yield {"press": name, "ratio": ratio, "score": example.score(text), "scoring": SCORING, "kept_bytes": kept,
               "full_bytes": full_bytes, "answer": text, "answer_tokens": answer_tokens,
               "cut": _cut(new, answer_tokens, model), **fidelity, **stored, **chunked, **peak_memory()}  # fmt: skip


def _reference_answer(model, tokenizer, ids: torch.Tensor, recording, answer_tokens: int) -> torch.Tensor:
    """The full cache's answer to `ids` (token ids `[k]`), what each row's fidelity is measured along; generated
    apart from the rows' answers (`answer_ids_from_cache` here is called once per row)."""
    return kvpress.pipeline.answer_ids_from_cache(model, tokenizer, ids, copy.deepcopy(recording.cache), None,
                                                  answer_tokens)  # fmt: skip


@torch.no_grad()
def fed_logp(model, tokenizer, press, cache: DynamicCache, ids: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities `[n, vocab]` (float32) at each of the `n` tokens of `ids` (`[1, n]`) fed over
    `cache` with `press` installed and nothing evicted (None: no press); `cache` is left as it was (`scratch`)."""
    installation = maybe_installed(press, model, tokenizer)
    with installation as installed, installed.frozen() if installed else contextlib.nullcontext(), scratch(cache):
        return model(ids, cache=cache, use_cache=True).logits[0].float().log_softmax(-1)


def agreement(reference: torch.Tensor, logp: torch.Tensor) -> tuple[float, float]:
    """Top-1 agreement and mean KL(reference || logp), in nats, of two `[n, vocab]` log-probability rows."""
    kl = (reference.exp() * (reference - logp)).sum(-1)
    return float((logp.argmax(-1) == reference.argmax(-1)).float().mean()), float(kl.mean())


def _compressed(model, tokenizer, recording, press, chunk: int | None) -> tuple[DynamicCache, dict]:
    """The cache `press` leaves of the recorded prefill (None: the recording's own), and the row field
    `prefill_chunk_size` when the sweep chunks: with `chunk`, a press that evicts as tokens are cached prefills
    the recording's tokens live, `chunk` tokens a forward, into a new cache (KVzip too: it scores each chunk)."""
    if chunk is None or press is None or press.refuses_chunks:
        cache = recording.cache if press is None else compress_recording(model, recording, press, tokenizer)
        return cache, {} if chunk is None else {"prefill_chunk_size": None}
    cache = DynamicCache(config=model.config)
    prefill_context(model, recording.ids, press, cache, tokenizer, prefill_chunk_size=chunk)
    return cache, {"prefill_chunk_size": chunk}


@torch.no_grad()
def continuation_rows(model, tokenizer, example: Continuation, todo, progress: bool, chunk: int | None = None):
    """One recorded prefill of the context, then one row per configuration in `todo`: top-1 agreement (the
    score) and mean KL(full || compressed) of the next-token distributions over the following tokens, fed
    over the compressed cache with nothing more evicted (`tasks/continuation.py`); `chunk` as `answer_rows`."""
    from tqdm.auto import tqdm

    ctx = torch.tensor([example.context_ids], device=model.device)
    following = torch.tensor([example.following_ids], device=model.device)
    hidden = any(kvpress.press_from_name(name, compression_ratio=0.5).needs_hidden for name, _ in todo
                 if name != "none")  # fmt: skip
    recording = record_prefill(model, ctx, keep_hidden=hidden)
    full_bytes = kvpress.cache_bytes(recording.cache)
    reference = fed_logp(model, tokenizer, None, recording.cache, following)
    for name, ratio in tqdm(todo, desc="configurations", leave=False, disable=not progress):
        reset_cuda_peak()
        press = None if name == "none" else kvpress.press_from_name(name, compression_ratio=ratio)
        cache, chunked = _compressed(model, tokenizer, recording, press, chunk)
        kept = kvpress.cache_bytes(cache)
        logp = reference if press is None else fed_logp(model, tokenizer, press, cache, following)
        top1, kl = agreement(reference, logp)  # the full cache's own: 1 and 0, without feeding it again
        yield {"press": name, "ratio": ratio, "score": top1, "kl": kl,
               "tokens": following.shape[1], "kept_bytes": kept, "full_bytes": full_bytes, **chunked,
               **peak_memory()}  # fmt: skip


def _cut(new: torch.Tensor, budget: int, model) -> bool:
    """Whether the answer budget, not an end of sequence, ended the answer `new`."""
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    return new.numel() >= budget and int(new[-1]) not in eos


def _perplexity_rows(model, tokenizer, document: Document, todo, progress: bool):
    """One live chunked pass of `document` per configuration in `todo` (see the module docstring)."""
    from tqdm.auto import tqdm

    ids = tokenizer(document.text, return_tensors="pt").input_ids[0].to(model.device)
    for name, ratio in tqdm(todo, desc="configurations", leave=False, disable=not progress):
        reset_cuda_peak()
        press = None if name == "none" else kvpress.press_from_name(name, compression_ratio=ratio)
        cache = DynamicCache(config=model.config)
        nll, tokens = chunked_nll(model, ids, press, CHUNK, cache)
        yield {"press": name, "ratio": ratio, "score": math.exp(-nll / tokens), "ppl": math.exp(nll / tokens),
               "nll_sum": nll, "tokens": tokens, "kept_bytes": kvpress.cache_bytes(cache),
               "full_bytes": full_cache_bytes(model, ids.numel()), **peak_memory()}  # fmt: skip


def _shard():
    """(rank, world size, accelerate state or None) of this process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1, None
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())  # gloo on CPUs, NCCL on GPUs
    return state.process_index, state.num_processes, state


def write_summary(out: Path) -> list[dict]:
    """Aggregate `results.jsonl` into summary.json / summary.csv / table.md / plot.png (+ heatmap.png)."""
    summary, rows = summarise(out)
    older = sum(not scored_now(row) for row in rows)
    if older:
        print(f"kvpress sweep: {older} answer rows in {out} were scored by an older matching rule (`kvpress sweep "
              f"--rescore {out}` scores them again)", file=sys.stderr)  # fmt: skip
    write_text_whole(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    table = io.StringIO()
    writer = csv.DictWriter(table, fieldnames=list(summary[0]))
    writer.writeheader()
    writer.writerows(summary)
    write_whole(out / "summary.csv", lambda tmp: tmp.write_text(table.getvalue(), newline=""))  # (csv's \r\n)
    write_text_whole(out / "table.md", _table(summary))
    plot_sweep(summary, rows, out)
    return summary


def summary_rows(out: str | Path) -> list[dict]:
    """The rows a sweep's summary aggregates, and so every tool that reads its rows (paired, ranking, plots): each
    key's standing row (`current_rows`), less those of an older builder in a cell that holds current ones."""
    return _one_builder_a_cell(list(current_rows(Path(out)).values()))


def summarise(out: Path) -> tuple[list[dict], list[dict]]:
    """(the summary rows, one per task, press and ratio; the result rows they aggregate) of the sweep in `out`."""
    rows = summary_rows(out)
    if not rows:
        raise ValueError(_no_rows(out))
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["task"], r["press"], r["ratio"]), []).append(r)
    bands, score_bands = intervals(rows), score_intervals(rows)
    summary = []
    for (task, press, ratio), members in sorted(groups.items()):
        score = _score(members)
        paired = _same_examples(members, groups.get((task, "none", 0.0), []))  # (a sweep widened for some presses)
        retention = _score(paired[0]) / _score(paired[1]) if paired[1] and _score(paired[1]) else None
        low, high = score_bands.get((task, press, ratio), (None, None))
        ppl = "nll_sum" in members[0]
        ppl_band = bands.get((task, press, ratio), (None, None)) if ppl else (None, None)
        summary.append({
            "task": task, "press": press, "ratio": ratio, "examples": len(members), "score": round(score, 4),
            "low": None if low is None else round(low, 4), "high": None if high is None else round(high, 4),
            "ppl": round(1 / score, 4) if ppl else None,
            "ppl_low": None if ppl_band[0] is None else round(ppl_band[0], 4),
            "ppl_high": None if ppl_band[1] is None else round(ppl_band[1], 4),
            **{field: _mean_of(members, field) for field in ("kl", "answer_top1", "answer_kl")},
            "retention": None if retention is None else round(retention, 4),
            "empty": sum(not m["answer"].strip() for m in members) if "answer" in members[0] else None,
            "kept_bytes_ratio": round(sum(m["kept_bytes"] / m["full_bytes"] for m in members) / len(members), 4),
            "peak_rss_bytes": max((m.get("peak_rss_bytes", 0) for m in members), default=0),
        })  # fmt: skip
    return summary, rows


def _one_builder_a_cell(rows: list[dict]) -> list[dict]:
    """`rows` less those of an older builder of their task in a cell (task, press, ratio) that holds rows its
    builder makes now: a sweep resumed with fewer examples re-measures only those, and its cells averaged the
    rest of the older examples with them. A cell of older rows alone stays (what its directory measured)."""
    current = {(r["task"], r["press"], r["ratio"]) for r in rows if built_now(r)}
    return [r for r in rows if built_now(r) or (r["task"], r["press"], r["ratio"]) not in current]


def _same_examples(members: list[dict], full: list[dict]) -> tuple[list[dict], list[dict]]:
    """The rows of a cell and of the full cache on the examples (and task versions) both hold."""
    key = lambda row: (row["example"], row_version(row))  # noqa: E731
    both = {key(m) for m in members} & {key(f) for f in full}
    return [m for m in members if key(m) in both], [f for f in full if key(f) in both]


def _no_rows(out: str | Path) -> str:
    return f"{out} holds no result rows yet (a sweep stopped before its first): run the sweep again there, it resumes"


def _mean_of(rows: list[dict], field: str) -> float | None:
    """The mean of `field` over `rows`, None unless every row has it (another kind of row, or one measured before
    the field was recorded)."""
    return round(sum(r[field] for r in rows) / len(rows), 5) if all(field in r for r in rows) else None


def _score(rows: list[dict]) -> float:
    """Mean score; for perplexity rows exp(-mean NLL) over all their tokens (1 / the pooled perplexity)."""
    if "nll_sum" in rows[0]:
        return math.exp(-sum(r["nll_sum"] for r in rows) / sum(r["tokens"] for r in rows))
    return sum(r["score"] for r in rows) / len(rows)


def _table(summary: list[dict]) -> str:
    tasks = sorted({s["task"] for s in summary})
    configs = sorted({(s["press"], s["ratio"]) for s in summary}, key=lambda c: (c[0] != "none", c))
    cell = {(s["task"], s["press"], s["ratio"]): s for s in summary}
    is_ppl = {t: any(s["task"] == t and s["ppl"] is not None for s in summary) for t in tasks}
    heads = [f"{t}: {'ppl, lower is better' if is_ppl[t] else 'score'} (kept bytes)" for t in tasks]
    lines = ["| press | ratio | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(tasks)]
    for press, ratio in configs:
        cells = []
        for t in tasks:
            s = cell.get((t, press, ratio))
            value = None if s is None else f"{s['ppl']:.2f}" if is_ppl[t] else f"{s['score']:.3f}"
            band = ("ppl_low", "ppl_high") if is_ppl[t] else ("low", "high")
            if s is not None and s.get(band[0]) is not None:  # 95% interval (of the perplexity, for its tasks)
                value += f" [{s[band[0]]:.2f}, {s[band[1]]:.2f}]"
            empty = f" empty={s['empty']}" if s is not None and s.get("empty") else ""  # the model answered nothing
            cells.append("" if s is None else f"{value} n={s['examples']}{empty} ({s['kept_bytes_ratio']:.3f})")
        lines.append(f"| {'full cache' if press == 'none' else press} | {ratio} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpress sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model", default=None, help=kvpress.models.MODEL_HELP)
    defaults = {"presses": "snapkv,adakv,sink-window,duo-attention,knorm,random,h2o", "ratios": "0,0.5,0.75,0.9",
                "tasks": ",".join(DEFAULT_TASKS), "examples": 16, "length": 1024, "seed": 0}  # fmt: skip
    parser.add_argument("--presses", help=f"(default: {defaults['presses']})")
    parser.add_argument("--ratios", help=f"(default: {defaults['ratios']})")
    left_out = "; ".join(f"{task}: {why}" for task, why in UNAVAILABLE.items())
    parser.add_argument("--tasks", help=f"comma-separated, of {', '.join(TASKS)} (default: every task but those a "
                                        f"fresh set-up cannot build; {left_out})")  # fmt: skip
    parser.add_argument("--examples", type=int, help=f"(default: {defaults['examples']})")
    parser.add_argument("--length", type=int, help=f"context tokens per example (default: {defaults['length']})")
    parser.add_argument("--seed", type=int, help=f"(default: {defaults['seed']})")
    parser.add_argument("--query-aware", action="store_true", help="prefill the question with the context")
    parser.add_argument("--prefill-chunk-size", type=int, default=None,
                        help="presses that evict as tokens are cached prefill live, this many tokens a forward "
                             "(default: applied to one recorded prefill)")  # fmt: skip
    parser.add_argument("--out", required=True, help="output directory (resumed if it holds results)")
    parser.add_argument("--refresh", action="store_true",
                        help="only re-measure the answers in --out that a changed answer budget could change, "
                             "with its settings and model")  # fmt: skip
    parser.add_argument("--replot", action="store_true",
                        help="only redraw the plots of --out from its rows (nothing measured)")
    parser.add_argument("--rescore", action="store_true",
                        help="only score again the answers in --out scored by an older matching rule (nothing "
                             "measured; its model's tokenizer rebuilds the examples)")  # fmt: skip
    args = parser.parse_args(argv)
    chosen = [f"--{name.replace('_', '-')}" for name in (*defaults, "query_aware", "prefill_chunk_size")
              if getattr(args, name) is not None and getattr(args, name) is not False]  # fmt: skip
    if args.replot:
        summary = Path(args.out) / "summary.json"
        if chosen or args.refresh or args.model or not summary.exists():
            print(f"kvpress sweep: --replot takes --out only, a directory with a summary.json ({args.out})",
                  file=sys.stderr)  # fmt: skip
            return 2
        written = plot_sweep(*summarise(Path(args.out)), args.out)  # (the rows as they stand, as a summary reads them)
        print("wrote " + ", ".join(map(str, written)))
        return 0
    if args.rescore:
        if chosen or args.refresh or args.model:
            print("kvpress sweep: --rescore takes --out only", file=sys.stderr)
            return 2
        return _rescore(args.out)
    if args.refresh:
        if chosen:
            print(f"kvpress sweep: --refresh takes --out and --model only, not {', '.join(chosen)}", file=sys.stderr)
            return 2
        return _refresh(args)
    try:
        taken = _resume_plan(args, defaults)
    except ValueError as err:  # (settings.json not JSON: JSONDecodeError is one)
        print(f"kvpress sweep: {Path(args.out) / 'settings.json'} cannot be read ({err})", file=sys.stderr)
        return 2
    if taken:
        print(f"kvpress sweep: {args.out} goes on with its last run's {', '.join(taken)}", file=sys.stderr)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    presses, tasks = args.presses.split(","), args.tasks.split(",")
    try:
        check_writable(args.out, "--out", directory=True)  # (made if missing, resumed if it holds a sweep)
        ratios = [_ratio(r) for r in args.ratios.split(",")]
        configurations(presses, ratios)
        check_tasks(tasks)  # before the model loads
        check_sizes(args.examples, args.length, args.seed, tasks)
        early = [spec_before_loading(name, args.model) for name in presses]  # (None: a directory's default)
        check_plan([name for name in early if name is not None], tasks, args.query_aware, args.prefill_chunk_size)
        if None not in early and not (Path(args.out) / "settings.json").exists():  # (a directory's own: bound)
            check_settings_used(early, tasks, args.query_aware, args.prefill_chunk_size)
        if None not in early:  # (a directory's default is named once it loads: run_sweep checks it then)
            check_spellings(Path(args.out), early)
            check_older_rows(Path(args.out), configurations(early, ratios), tasks, args.examples)
        check_data(tasks)
        settings = {"model": named_model(args.model or DEFAULT_MODEL), "length": args.length, "seed": args.seed,
                    "query_aware": args.query_aware, "prefill_chunk_size": args.prefill_chunk_size,
                    "perplexity_chunk": CHUNK}  # fmt: skip
        _check_resume(Path(args.out), settings)  # (run_sweep checks again, with the loaded model's own name)
    except (ValueError, TypeError) as err:
        print(f"kvpress sweep: {err}", file=sys.stderr)
        return 2
    model, tokenizer = kvpress.load_model(args.model)
    presses = [resolve_default(name, model) for name in presses]  # `default`: the model's own, named in the rows
    try:  # (what only the loaded model or a task's text shows: said as the checks above, not as a traceback)
        summary = run_sweep(model, tokenizer, presses, ratios, tasks, args.out, args.examples, args.length, args.seed,
                            args.query_aware, prefill_chunk_size=args.prefill_chunk_size)  # fmt: skip
    except (ValueError, TypeError) as err:
        if os.environ.get("KVPRESS_TRACEBACK"):
            raise
        print(f"kvpress sweep: {err} (KVPRESS_TRACEBACK=1 shows the whole traceback)", file=sys.stderr)
        return 2
    if summary:  # process 0 (or the only one)
        print(_table(summary))
        print(f"wrote {args.out}/results*.jsonl, summary.json, summary.csv, table.md, plot.png (+ heatmap.png)")
    return 0


def _resume_plan(args, defaults: dict) -> list[str]:
    """Fill what the command leaves out from `--out`'s settings.json (its last run's plan and settings), so that
    `kvpress sweep --out DIR` resumes DIR as it was run (the defaults widened it, or were refused as another
    length); returns the options taken."""
    path = Path(args.out) / "settings.json"
    if not path.is_file():
        return []
    held = json.loads(path.read_text())
    taken = []
    for name in (*defaults, "model", "prefill_chunk_size"):
        if getattr(args, name) is None and held.get(name) is not None:
            value = held[name]
            setattr(args, name, ",".join(map(str, value)) if isinstance(value, list) else value)
            taken.append(f"--{name.replace('_', '-')} {getattr(args, name)}")
    if not args.query_aware and held.get("query_aware"):
        args.query_aware = True
        taken.append("--query-aware")
    return taken


def _ratio(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--ratios takes comma-separated numbers in [0, 1) (0,0.5,0.75), got {text!r}") from None


def _rescore(out: str) -> int:
    settings_path = Path(out) / "settings.json"
    if not settings_path.exists():
        print(f"kvpress sweep: {out} holds no sweep (no settings.json)", file=sys.stderr)
        return 2
    name = json.loads(settings_path.read_text()).get("model", DEFAULT_MODEL)
    print(json.dumps(rescore_sweep(out, kvpress.models.load_tokenizer(name))))
    return 0


def _refresh(args) -> int:
    settings_path = Path(args.out) / "settings.json"
    if not settings_path.exists():
        print(f"kvpress sweep: {args.out} holds no sweep (no settings.json)", file=sys.stderr)
        return 2
    name = args.model or json.loads(settings_path.read_text()).get("model")
    if name is None:
        print(f"kvpress sweep: {settings_path} does not name its model: pass --model", file=sys.stderr)
        return 2
    if not current_rows(Path(args.out)):  # (before the model loads)
        print(f"kvpress sweep: {_no_rows(args.out)}", file=sys.stderr)
        return 2
    model, tokenizer = kvpress.load_model(name)
    summary = refresh_sweep(model, tokenizer, args.out)
    print(_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
