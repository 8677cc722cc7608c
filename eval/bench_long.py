"""Long-context benchmark (`make bench-long`): peak memory, cache bytes, prefill and decode time per press at
4K-16K tokens, every configuration in its own process.

For each model and context length, each (press, ratio) runs `model.generate` of `--decode-steps` tokens after
a prompt of English text (CPython's documentation), inside `with press(model, tokenizer=tokenizer):`, with
transformers' `prefill_chunk_size` when `--chunk` is given (presses that score the whole prompt and cannot score
later chunks refuse chunks: they run unchunked, and their row says so; KVzip scores each chunk). Right before it,
the same generation with no press runs in its own process too, so each ratio to no press comes from two
neighbouring runs on this shared machine. A child process
reports: the resident memory above the loaded model at its peak (the kernel's high-water mark, reset once
every weight was read: `eval/memory.page_in`), the cache bytes after generating, the seconds to the first token
(the prefill, a press's scoring pass included) and the median decode step.

Rows are appended to `--out`'s `long.jsonl` as they finish, and a rerun skips what is there: a long run resumes
where it stopped. A pair is measured whole (`pending`): a press still to run runs right after its own no-press run
again, never beside one of an earlier session. `long.json` holds, per (model, length, press, ratio): memory, cache,
prefill and decode step as ratios to the paired no-press run, and the decode byte limit: a step reads the weights
(all but an input embedding the output head does not share, of which it reads one row) and the kept cache, so
(weights read + kept KV bytes) / (weights read + full KV bytes) is the smallest step ratio eviction can give if a
step only read bytes (a no-press step also copies its growing cache, and the CPU's attention is not bound by reads: a
measured step ratio can fall below it).
`long.png` plots the memory and decode ratios against the context length; `long.md` is the table of `long.json`.

With chunks, each model also runs one chunk alone with no press (`pairs_with` "one-chunk", `ONE_CHUNK_RUNS`
times): its peak is one chunk's activations and cache, so a chunked press's peak is set against `bound` = its own
cache + the median of those peaks (what a prefill that evicts after every chunk should stay within). Children run
with glibc's mmap threshold fixed at 1 MB (`MALLOC_MMAP_THRESHOLD_`): freed tensors then leave the process at once;
without it the high-water mark of three identical no-press runs wandered from 234 to 512 MB (Qwen2.5-0.5B, 4K).
Once the prefill ends, a child sets malloc as a process that has run a while has it and times the decode steps
under that (`eval/memory.steady_malloc` says why; rows of `decode_malloc` "steady", and rows without it, measured
before, are not reused). The prefill is still timed under the fixed threshold, which slows a press's prefill more
than no press's (SmolLM2 at 4K: 0.93 against 0.83 in a probe), so its ratio errs high.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

import kvpress
from kvpress.engine import maybe_installed
from kvpress.eval.bench_core import long_ids
from kvpress.eval.memory import page_in, steady_malloc, unread_weight_bytes
from kvpress.eval.sweep import append_row, read_rows
from kvpress.files import write_text_whole
from kvpress.models import PACKAGED_MODELS
from kvpress.presses.defaults import default_for

PLAN = {"qwen2.5-0.5b": (4096, 8192, 16384), "smollm2-135m": (4096, 8192)}  # model -> context lengths
PRESSES = "snapkv,adakv,duo-attention,default,h2o"  # dense, head-wise, DuoAttention, the default, H2O
RESULTS = Path(__file__).parent / "results"
CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "1048576"}  # tensors freed go back to the system: a stable high-water mark
DECODE_MALLOC = "steady"  # decode steps timed under `steady_malloc` (rows without it were timed under CHILD_ENV's)
ONE_CHUNK_RUNS = 3  # the bound's one-chunk peak is the median of this many runs (one run's moved 18-27% between runs)
PARENT = "KVPRESS_BENCH_PARENT"  # the parent's pid, in a child's environment (`die_with_parent`)


def die_with_parent(parent: int) -> None:
    """In a child measuring one configuration: end when the run that started it ends, however it ends (a parent
    killed with SIGKILL left its child measuring for minutes, competing for the cores with the run resumed next).
    Linux: the kernel sends the child SIGKILL when its parent dies; a parent gone before that was asked, the child
    ends now. Elsewhere nothing is done."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # (not Linux)
        return
    if parent and os.getppid() != parent:
        os._exit(1)


def _status(field: str) -> int:
    """A `/proc/self/status` memory field in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def measure(config: dict, model=None, tokenizer=None) -> dict:
    """One configuration in this process: load the model (unless given), reset the memory high-water mark,
    generate."""
    torch.manual_seed(0)
    if model is None:
        model, tokenizer = kvpress.load_model(config["model"])
    ids = long_ids(tokenizer, config["length"])
    spec = config["spec"]
    press = None if spec == "none" else kvpress.press_from_name(spec, compression_ratio=config["ratio"])
    cache = DynamicCache(config=model.config)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    page_in(model)  # every weight resident: a memory-mapped file is otherwise read as it is used
    with torch.inference_mode():  # kernels and allocator warmed
        model(ids[:, :16], cache=DynamicCache(config=model.config))
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the loaded model
    base = _status("VmRSS")
    with torch.inference_mode(), maybe_installed(press, model, tokenizer):
        steady = config.get("decode_malloc") == DECODE_MALLOC
        prefill, steps = stamped_generate(model, tokenizer, ids, cache, config["steps"], config["chunk"],
                                          after_prefill=steady_malloc if steady else None)  # fmt: skip
    return {**config, "peak_above_model_bytes": _status("VmHWM") - base, "cache_bytes": kvpress.cache_bytes(cache),
            "weight_bytes": weights, "unread_weight_bytes": unread_weight_bytes(model), "prefill_seconds": prefill,
            "decode_step_seconds": statistics.median(steps), "threads": torch.get_num_threads()}  # fmt: skip


def stamped_generate(model, tokenizer, ids: torch.Tensor, cache, steps: int, chunk: int | None,
                     after_prefill: Callable[[], None] | None = None) -> tuple[float, list[float]]:  # fmt: skip
    """`model.generate` of `steps + 1` tokens after `ids` into `cache` (the caller installs the press), with
    `prefill_chunk_size=chunk`: the seconds to the first token (the prefill) and of each decode step, each time
    taken once the device has finished its work. `after_prefill` is called once the prefill is timed, before the
    first decode step starts."""
    stamps: list[float] = []  # when each step started (the first once `after_prefill` returned), then the last's end
    prefill_end = 0.0
    cuda = ids.device.type == "cuda"

    class Stamp(StoppingCriteria):  # called once per generated token: the first call ends the prefill
        def __call__(self, input_ids, scores, **kwargs):
            nonlocal prefill_end
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            if not stamps:
                prefill_end = now
                if after_prefill is not None:
                    after_prefill()
                    now = time.perf_counter()
            stamps.append(now)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=steps + 1,
                   min_new_tokens=steps + 1, do_sample=False, pad_token_id=tokenizer.eos_token_id,
                   prefill_chunk_size=chunk, stopping_criteria=StoppingCriteriaList([Stamp()]))  # fmt: skip
    return prefill_end - start, [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def _key(row: dict) -> tuple:
    """What makes a run the same run: a row measured with another chunk size, decode timed under another
    malloc setting, or another press behind the same name (`default` after the model's default changed) is not
    reused."""
    return (row["model"], row["length"], row["press"], row.get("spec"), row["ratio"], row.get("pairs_with"),
            row["steps"], row.get("chunk"), row.get("decode_malloc"), row.get("repeat"))


def _run(row: dict) -> tuple:
    """The run a row measured, whichever press its name stood for (`summary` keeps the latest)."""
    return _key({**row, "spec": None})


def run_settings(ratios: str, decode_steps: int, chunk: int) -> list[float]:
    """`--ratios` read, `--decode-steps` and `--chunk` checked (bench-long's and bench-gpu's), each refusal naming
    its flag and value."""
    if decode_steps < 2:
        raise ValueError(f"--decode-steps must be at least 2, got {decode_steps}")
    if chunk < 0:
        raise ValueError(f"--chunk must be a token count >= 0 (0: no chunked prefill), got {chunk}")
    try:
        return [float(r) for r in ratios.split(",")]
    except ValueError:
        raise ValueError(f"--ratios must be fractions separated by commas, got {ratios!r}") from None


def configurations(plan: dict, presses: list[str], ratios: list[float], chunk, steps: int,
                   decode_malloc: str | None = None, one_chunk_runs: int = 1) -> list[dict]:  # fmt: skip
    """In run order: per model its one-chunk runs (with `chunk`; numbered by `repeat` when more than one), then
    for each length and (press, ratio), the no-press run it pairs with, then it. `spec` is the press run
    (`default`: the model's own); a pair whose press scores the whole prompt and refuses later chunks runs
    unchunked, its no-press run too. `decode_malloc` ("steady": `measure` times the decode under `steady_malloc`)
    is written into each run where given."""
    if isinstance(one_chunk_runs, bool) or not isinstance(one_chunk_runs, int) or one_chunk_runs < 1:
        raise ValueError(f"one_chunk_runs must be a whole number >= 1, got {one_chunk_runs!r}")
    for name, given in (("presses", presses), ("ratios", ratios)):  # (each would run, and be appended, twice)
        twice = sorted({str(x) for x in given if list(given).count(x) > 1})
        if twice:
            raise ValueError(f"--{name} lists {', '.join(twice)} more than once")
    runs = []
    timing = {} if decode_malloc is None else {"decode_malloc": decode_malloc}
    for model, lengths in plan.items():
        for repeat in range(one_chunk_runs if chunk else 0):
            numbered = {"repeat": repeat} if one_chunk_runs > 1 else {}
            runs.append({"model": model, "length": chunk, "chunk": chunk, "steps": steps, "press": "none",
                         "spec": "none", "ratio": 0.0, "pairs_with": "one-chunk", **timing, **numbered})  # fmt: skip
        for press in presses:
            spec = (default_for(model) or kvpress.DEFAULT_PRESS) if press == "default" else press
            # each ratio built here: a bad one is refused before anything runs, not in a child after its pair's
            built = [kvpress.press_from_name(spec, compression_ratio=r) for r in ratios]
            whole = built[0].refuses_chunks  # KVzip scores each chunk
            for length in lengths:
                for ratio in ratios:
                    common = {"model": model, "length": length, "chunk": None if whole else chunk, "steps": steps,
                              **timing}  # fmt: skip
                    runs.append({**common, "press": "none", "spec": "none", "ratio": 0.0,
                                 "pairs_with": f"{press}@{ratio}"})  # fmt: skip
                    runs.append({**common, "press": press, "spec": spec, "ratio": ratio, "pairs_with": None})
    return sorted(runs, key=lambda r: (list(plan).index(r["model"]), r["length"]))  # stable: pairs stay together


def summary(rows: list[dict]) -> list[dict]:
    """Per press row with its paired no-press row: the ratios and the decode byte limit; for a chunked press, its
    peak against its cache + the median peak of the one-chunk runs of its model and chunk."""
    by_key = {_key(r): r for r in rows}
    chunks: dict[tuple, list[int]] = {}
    for r in rows:
        if r.get("pairs_with") == "one-chunk":
            chunks.setdefault(_pool(r), []).append(r["peak_above_model_bytes"])
    latest = {_run(r): i for i, r in enumerate(rows)}
    out = []
    for i, row in enumerate(rows):
        if row["press"] == "none" or latest[_run(row)] != i:  # (measured again since: the default press changed)
            continue
        none = by_key.get(_key(_partner(row)))
        if none is None:
            continue
        unread = row.get("unread_weight_bytes")  # (None: a row measured before it was recorded)
        w = row["weight_bytes"] - (unread or 0)  # what a decoding step reads of the weights
        out.append({
            "model": row["model"], "length": row["length"], "press": row["press"], "ratio": row["ratio"],
            "spec": row["spec"], "chunk": row["chunk"],
            "memory_ratio": _ratio(row["peak_above_model_bytes"], none["peak_above_model_bytes"]),
            "peak_above_model_mb": row["peak_above_model_bytes"] / 2**20,
            "none_peak_above_model_mb": none["peak_above_model_bytes"] / 2**20,
            "cache_ratio": row["cache_bytes"] / none["cache_bytes"], "cache_mb": row["cache_bytes"] / 2**20,
            "prefill_ratio": row["prefill_seconds"] / none["prefill_seconds"],
            "decode_step_ratio": row["decode_step_seconds"] / none["decode_step_seconds"],
            "decode_byte_limit": (w + row["cache_bytes"]) / (w + none["cache_bytes"]),
        })  # fmt: skip
        if unread is None:  # its limit counts every weight as read, an untied input embedding too: said in the row
            out[-1]["limit_counts_every_weight"] = True
        ones = chunks.get(_pool(row))
        if row["chunk"] and ones:
            bound = row["cache_bytes"] + statistics.median(ones)
            out[-1].update(bound_mb=bound / 2**20, peak_over_bound=row["peak_above_model_bytes"] / bound,
                           one_chunk_runs=len(ones))  # fmt: skip
    return out


def parse_models(text: str) -> dict[str, tuple[int, ...]]:
    """`--models` (model:length,length;model:...) as the plan: each model once, each length once and positive, each
    model a packaged name or a local directory (checked here, not in a child after other models' runs)."""
    plan: dict[str, tuple[int, ...]] = {}
    for part in text.split(";"):
        name, colon, lengths = part.partition(":")
        if not colon or not name or not lengths:
            raise ValueError(f"{part!r} is not model:length,length")
        if name in plan:
            raise ValueError(f"{name} is named twice: give its lengths once ({name}:4096,8192)")
        try:
            values = tuple(int(n) for n in lengths.split(","))
        except ValueError:
            raise ValueError(f"{name}'s lengths {lengths!r} are not whole numbers") from None
        if min(values) < 1 or len(set(values)) < len(values):
            raise ValueError(f"{name}'s lengths must be positive and each given once, got {lengths}")
        if name not in PACKAGED_MODELS and not (Path(name).expanduser() / "config.json").exists():
            raise ValueError(f"{name} is neither a packaged model ({', '.join(PACKAGED_MODELS)}) nor a local "
                             "directory with a config.json")  # fmt: skip
        plan[name] = values
    return plan


def mixed_settings(rows: list[dict], runs: list[dict]) -> list[str]:
    """The planned runs `rows` (of `--out`) already hold with other decode steps or decode malloc setting: their
    summaries would stand side by side in long.md with nothing to tell them apart (a chunk size is its column)."""
    def same(r: dict) -> tuple:
        return r["model"], r["length"], r["press"], r["ratio"], r.get("chunk")

    planned = {same(run): (run["steps"], run.get("decode_malloc")) for run in runs}
    return sorted({f"{r['model']} {r['length']} {r['press']}@{r['ratio']} (decode steps {r['steps']}, malloc "
                   f"{r.get('decode_malloc')})" for r in rows if same(r) in planned
                   and planned[same(r)] != (r["steps"], r.get("decode_malloc"))})  # fmt: skip


def _partner(run: dict) -> dict:
    """The no-press run a press run pairs with (same model, length, chunk, steps and settings)."""
    return {**run, "press": "none", "spec": "none", "ratio": 0.0, "pairs_with": f"{run['press']}@{run['ratio']}"}


def _pool(row: dict) -> tuple:
    """The one-chunk runs a row's bound takes the median of: its model's, of its chunk size, decode steps and
    malloc setting."""
    return row["model"], row["chunk"], row["steps"], row.get("decode_malloc")


def pending(runs: list[dict], done: Callable[[dict], bool], key: Callable[[dict], tuple] = _key) -> list[dict]:
    """The runs of `runs` still to measure: those not `done`, and the no-press run each of those press runs pairs
    with, done or not, so a pair is always measured side by side (a no-press run of an earlier session, or of
    another press behind the same name, is never its partner)."""
    partners = {key(_partner(run)) for run in runs if run["press"] != "none" and not done(run)}
    return [run for run in runs if not done(run) or key(run) in partners]


def _ratio(a: float, b: float) -> float | None:
    """a / b, or None when b is 0 (a process whose resident memory never rose above the loaded model: freed
    memory reused, as in a test process)."""
    return a / b if b else None


def markdown(table: list[dict]) -> str:
    """`summary`'s rows as a Markdown table, by model, length, press and ratio."""
    lines = ["| model | tokens | press | r | peak above model, MB (no press) | peak / no press | peak / bound | "
             "cache / no press | prefill / no press | decode step / no press | byte limit |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in sorted(table, key=lambda r: (r["model"], r["length"], r["press"], r["ratio"])):
        bound = f"{r['peak_over_bound']:.2f}" if "peak_over_bound" in r else "- (unchunked)"
        memory = "-" if r["memory_ratio"] is None else f"{r['memory_ratio']:.2f}"
        lines.append(f"| {r['model']} | {r['length']} | {r['press']} | {r['ratio']} | {r['peak_above_model_mb']:.0f} "
                     f"({r['none_peak_above_model_mb']:.0f}) | {memory} | {bound} | "
                     f"{r['cache_ratio']:.3f} | {r['prefill_ratio']:.2f} | {r['decode_step_ratio']:.2f} | "
                     f"{r['decode_byte_limit']:.3f}{' *' if r.get('limit_counts_every_weight') else ''} |")  # fmt: skip
    if any(r.get("limit_counts_every_weight") for r in table):
        lines.append("\n\\* a row measured before `unread_weight_bytes` was recorded: its limit counts every weight as "
                     "read a step, an untied input embedding too")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'kvpress[plot]'): no plot written", file=sys.stderr)
        return None
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 7), squeeze=False)
    for j, model in enumerate(models):
        mine = [r for r in rows if r["model"] == model]
        for (press, ratio) in sorted({(r["press"], r["ratio"]) for r in mine}):
            line = sorted((r for r in mine if r["press"] == press and r["ratio"] == ratio), key=lambda r: r["length"])
            xs = [r["length"] for r in line]
            label = f"{press}, r = {ratio}"
            axes[0][j].plot(xs, [math.nan if r["memory_ratio"] is None else r["memory_ratio"] for r in line],
                            marker="o", label=label)  # fmt: skip
            drawn = axes[1][j].plot(xs, [r["decode_step_ratio"] for r in line], marker="o", label=label)
            axes[1][j].plot(xs, [r["decode_byte_limit"] for r in line], linestyle=":", color=drawn[0].get_color())
        axes[0][j].set_title(f"{model}: peak memory above the model / no press")
        axes[1][j].set_title(f"{model}: decode step / no press (dotted: byte limit)")
        for ax in axes[:, j]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context tokens")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpress.eval.bench_long", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--models", help="model:length,length;model:... (default: "
                        + ";".join(f"{m}:{','.join(map(str, ls))}" for m, ls in PLAN.items()) + ")")  # fmt: skip
    parser.add_argument("--presses", default=PRESSES, help=f"(default: {PRESSES})")
    parser.add_argument("--ratios", default="0.5,0.75")
    parser.add_argument("--chunk", type=int, default=1024, help="prefill_chunk_size (0: none; default 1024)")
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--out", default=str(RESULTS), help="directory of long.jsonl, long.json, long.png")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one configuration, as JSON: run by the parent
    args = parser.parse_args(argv)
    if args.child:
        die_with_parent(int(os.environ.get(PARENT, "0")))
        print(json.dumps(measure(json.loads(args.child))))
        return 0
    try:
        try:
            plan = PLAN if not args.models else parse_models(args.models)
        except ValueError as err:
            raise ValueError(f"{err} (--models is model:length,length;model:...)") from None
        ratios = run_settings(args.ratios, args.decode_steps, args.chunk)
        runs = configurations(plan, args.presses.split(","), ratios, args.chunk or None, args.decode_steps,
                              DECODE_MALLOC, ONE_CHUNK_RUNS)  # fmt: skip
    except ValueError as err:
        print(f"kvpress bench-long: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "long.jsonl"
    rows = read_rows(jsonl, "kvpress bench-long")
    mixed = mixed_settings(rows, runs)
    if mixed:
        print(f"kvpress bench-long: {jsonl} holds {'; '.join(mixed[:3])}{' ...' if len(mixed) > 3 else ''}, not "
              f"decode steps {args.decode_steps}, malloc {DECODE_MALLOC}: give the same --decode-steps (a malloc "
              "setting of another version: another --out)", file=sys.stderr)  # fmt: skip
        return 2
    done = {_key(r) for r in rows}
    for config in pending(runs, lambda run: _key(run) in done):
        proc = subprocess.run([sys.executable, "-m", "kvpress.eval.bench_long", "--child", json.dumps(config)],
                              capture_output=True, text=True,
                              env={**os.environ, **CHILD_ENV, PARENT: str(os.getpid())})  # fmt: skip
        if proc.returncode != 0:
            print(f"kvpress bench-long: {config} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
            return 1
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        append_row(jsonl, row)
        print(f"{row['model']} {row['length']:>6} {row['press']:>40s} r={row['ratio']:<5} "
              f"peak +{row['peak_above_model_bytes'] / 2**20:8.1f} MB  cache {row['cache_bytes'] / 2**20:7.1f} MB  "
              f"prefill {row['prefill_seconds']:7.1f} s  step {row['decode_step_seconds'] * 1000:7.1f} ms")  # fmt: skip
    table = summary(rows)
    write_text_whole(out / "long.json", json.dumps(table, indent=2) + "\n")
    write_text_whole(out / "long.md", markdown(table))
    written = plot(table, out / "long.png") if table else None
    print(f"wrote {out / 'long.json'}" + (f", {written}" if written else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
