"""GPU benchmark (`make bench-gpu`): CUDA peak memory, cache, prefill and decode per press at 16K and 32K tokens,
with sdpa and, where flash-attn is installed, flash_attention_2 (dense and head-wise layers alike).

The configurations are `bench_long`'s (each press paired with a no-press run of the same length, a one-chunk run
for the bound, transformers' `prefill_chunk_size`), measured in one process: CUDA's allocator counts each run's
peak on its own (`torch.cuda.reset_peak_memory_stats`), so no run needs a process of its own. A row's peak is
`max_memory_allocated` above what was allocated before it (the model and nothing else); its times are taken
after `torch.cuda.synchronize()`. A configuration that raises is a row with its `error` (printed, kept in
`gpu.jsonl`, left out of the ratios): one broken path does not hide the others' numbers.

`--config DIR` builds the model from a directory holding a config.json (and tokenizer files) with random
weights: where the weights cannot travel (a lent GPU machine with no network), memory and time depend on the
architecture alone, so a packaged model's config stands in for it; what a press keeps then differs from the real
model's, its budget does not. Without it the packaged model loads (`kvpress.load_model`).

Writes `gpu.jsonl` (rows as they finish; a rerun measures only the configurations it lacks on this device, each
press with its no-press run again: `bench_long.pending`), `gpu.json`
(`bench_long.summary` per attention implementation, with each press's peak against its cache + no press's
activations at the same length) and `gpu.md` under `--out`. Without CUDA it measures nothing: it says so, and
summarises the rows `gpu.jsonl` already holds. `--profile` keeps each generation's top operators in its row.
`--attn sdpa-blocked` (its own table) runs sdpa with a chunk over a compressed layer in blocks of queries on CUDA
too, as `blocked_attention` does on the CPU: what those blocks save or cost on a GPU.
`--no-cudnn` runs every generation, no press's too, with cuDNN's attention off (a press's forwards always run so,
`patches/sdpa_backends.py`): the ratios then measure the press alone, not torch's choice of kernel for a plain
cache (its own table, `<attn> without cuDNN`).
`--no-varlen` runs head-wise layers' attention pair by pair (a call per (row, KV head)) where on CUDA it is one
variable-length call (`patches/headwise_attention.py`): what that call saves (its own table, `<attn> pair by pair`).
Before its runs on CUDA it checks the call against the pair-by-pair path on random head-wise layers (bf16, a
decoding step and a chunk) and writes the largest difference to `varlen_check.json`.
`--cpu-stand-in` (no GPU lent): the same runs on the CPU with the GPU's attention paths (`gpu_paths`: no blocks of
queries; bottom-right causal calls) and, for the peak, the most tensor bytes alive at once (`memory.TensorPeak`)
instead of CUDA's allocator: its own table (`<attn> (CPU stand-in)`), whose times are the CPU's, slowed by the
counting (read its memory columns only). It counts the tensors operators return, not what a kernel or the allocator
holds besides: at 16K, CUDA's peak was the stand-in's within 0.2 MB for AdaKV and SnapKV, and 32-43 MB above it
for no press, DuoAttention, the default and KVzip (eval/results/README.md, "On a GPU")."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import sys
import traceback
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

import kvpress
from kvpress.engine import maybe_installed
from kvpress.eval.bench_core import long_ids
from kvpress.eval.bench_long import _key as long_key
from kvpress.eval.bench_long import configurations, markdown, pending, run_settings, stamped_generate, summary
from kvpress.eval.memory import TensorPeak, unread_weight_bytes
from kvpress.eval.sweep import append_row, read_rows
from kvpress.files import write_text_whole
from kvpress.patches import blocked_attention as blocked
from kvpress.patches import headwise_attention as headwise
from kvpress.patches import sdpa_backends

PLAN = {"qwen2.5-0.5b": (16384, 32768)}  # model -> context lengths (Qwen2.5-0.5B has 32K positions)
PRESSES = "snapkv,adakv,duo-attention,default,h2o,kvzip"  # dense, head-wise, DuoAttention, the default, H2O, KVzip
IMPLEMENTATIONS = ("sdpa", "flash_attention_2")
# on request only: sdpa with a chunk over a compressed layer in blocks of queries on CUDA too (`blocked_attention`
# runs them on the CPU only: whether its blocks save memory or cost time on a GPU is what this measures)
VARIANTS = {"sdpa-blocked": "sdpa"}
RESULTS = Path(__file__).parent / "results"


def load(name: str, config_dir: str | None, attn: str, dtype: torch.dtype, device: str):
    """`(model, tokenizer)` on `device`: the packaged model, or `config_dir`'s architecture with random weights."""
    attn = VARIANTS.get(attn, attn)
    if config_dir is None:
        model, tokenizer = kvpress.load_model(name, dtype=dtype, attn_implementation=attn)
        return model.to(device).eval(), tokenizer
    config = AutoConfig.from_pretrained(config_dir, local_files_only=True)  # (a name not a directory: no hub)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return model.eval(), AutoTokenizer.from_pretrained(config_dir, local_files_only=True)


def measure(model, tokenizer, config: dict, profiled: bool = False) -> dict:
    """One configuration: generate `steps + 1` tokens after `length` tokens of text, with its press installed;
    peak memory above what was allocated before (CUDA), cache bytes, prefill seconds, median decode step; with
    `profiled`, the whole generation runs under torch's profiler (its times then include the profiler's cost) and
    `profile` holds its top operators (`_top`)."""
    device = model.device
    cuda = device.type == "cuda"
    stand_in = bool(config.get("stand_in"))
    ids = long_ids(tokenizer, config["length"]).to(device)
    spec = config["spec"]
    press = None if spec == "none" else kvpress.press_from_name(spec, compression_ratio=config["ratio"])
    cache = DynamicCache(config=model.config)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with torch.inference_mode(), maybe_installed(press, model, tokenizer), (
        profile(activities=activities) if profiled else contextlib.nullcontext()
    ) as prof, gpu_paths(stand_in), blocks_on(device.type if config.get("attn") == "sdpa-blocked" else None), (
        sdpa_backends.without_cudnn(device) if config.get("no_cudnn") else contextlib.nullcontext()
    ), pair_by_pair(bool(config.get("no_varlen"))), (TensorPeak() if stand_in else contextlib.nullcontext()) as counted:
        prefill, steps = stamped_generate(model, tokenizer, ids, cache, config["steps"], config["chunk"])
        peak = torch.cuda.max_memory_allocated() - base if cuda else counted.peak if stand_in else None
        kept = kvpress.cache_bytes(cache)
    return {**config, "peak_above_model_bytes": peak, "cache_bytes": kept,
            "profile": _top(prof, cuda) if profiled else None,
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "unread_weight_bytes": unread_weight_bytes(model),
            "prefill_seconds": prefill, "decode_step_seconds": statistics.median(steps),
            "device": torch.cuda.get_device_name(device) if cuda else "cpu (stand-in)" if stand_in else "cpu",
            "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version() if cuda else None,  # cuDNN >= 9.15.1 on sm90: its sdpa first
            "sdpa_priority": sdpa_backends.priority(),  # outside a press's forwards (those run without cuDNN's)
            "no_cudnn": bool(config.get("no_cudnn")), "no_varlen": bool(config.get("no_varlen"))}  # fmt: skip


def gpu_paths(on: bool = True) -> contextlib.AbstractContextManager:
    """Inside (when `on`): the attention takes on every device the paths it takes on a GPU (`blocked_attention`
    runs no chunk in blocks; chunks over slots all visible are bottom-right causal calls); put back after."""
    return _set(blocked, "DEVICES", () if on else blocked.DEVICES)


def pair_by_pair(on: bool = True) -> contextlib.AbstractContextManager:
    """Inside (when `on`): a head-wise layer's attention runs a call per (row, KV head) on every device, not one
    variable-length call (`headwise_attention.VARLEN_DEVICES`); put back after."""
    return _set(headwise, "VARLEN_DEVICES", () if on else headwise.VARLEN_DEVICES)


def blocks_on(device_type: str | None) -> contextlib.AbstractContextManager:
    """Inside: `blocked_attention` also runs a chunk in blocks on `device_type` (None: as it is); put back after."""
    return _set(blocked, "DEVICES", blocked.DEVICES if device_type is None else (*blocked.DEVICES, device_type))


@contextlib.contextmanager
def _set(module, name: str, value):
    """Inside: `module.name` is `value`; put back after, also when an exception escapes."""
    before = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, before)


def _top(prof, cuda: bool, top: int = 15) -> dict:
    """The `top` operators of a profiled run by their own device time (on a GPU) and by their own CPU time (where
    a sync or a copy to the host shows as the CPU waiting): calls and microseconds per operator."""

    def row(e) -> dict:
        return {"op": e.key, "calls": e.count, "cpu_us": e.self_cpu_time_total,
                "device_us": e.self_device_time_total if cuda else None}  # fmt: skip

    events = prof.key_averages()
    by_cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    by_device = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:top] if cuda else []
    return {"by_cpu": [row(e) for e in by_cpu], "by_device": [row(e) for e in by_device]}


def available(attn: str) -> str | None:
    """Why `attn` cannot run here, or None."""
    if attn.startswith("flash_attention") and importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed (pip install 'kvpress[flash]' on a machine with CUDA)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpress.eval.bench_gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model", default=next(iter(PLAN)), help=f"packaged model (default {next(iter(PLAN))})")
    parser.add_argument("--lengths", default=",".join(map(str, PLAN[next(iter(PLAN))])))
    parser.add_argument("--presses", default=PRESSES, help=f"(default: {PRESSES})")
    parser.add_argument("--ratios", default="0.5,0.75")
    parser.add_argument("--attn", default=",".join(IMPLEMENTATIONS),
                        help=f"of {', '.join((*IMPLEMENTATIONS, *VARIANTS))} (default: {', '.join(IMPLEMENTATIONS)})")
    parser.add_argument("--chunk", type=int, default=1024, help="prefill_chunk_size (0: none; default 1024)")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--profile", action="store_true", help="profile each generation: its top operators")
    parser.add_argument("--no-cudnn", action="store_true", help="no press's generations without cuDNN's sdpa too")
    parser.add_argument("--no-varlen", action="store_true",
                        help="head-wise layers attend pair by pair, not in one variable-length call (see above)")
    parser.add_argument("--cpu-stand-in", action="store_true",
                        help="no GPU: the GPU's paths on the CPU, tensor bytes counted (see above)")
    parser.add_argument("--config", help="a directory with config.json and tokenizer: random weights (see above)")
    parser.add_argument("--out", default=str(RESULTS), help="directory of gpu.jsonl, gpu.json, gpu.md")
    args = parser.parse_args(argv)
    try:
        attns = args.attn.split(",")
        unknown = [a for a in attns if a not in (*IMPLEMENTATIONS, *VARIANTS)]
        if unknown:
            raise ValueError(f"--attn {','.join(unknown)} is not one of {', '.join((*IMPLEMENTATIONS, *VARIANTS))}")
        if args.cpu_stand_in and args.no_cudnn:
            raise ValueError("--no-cudnn is a CUDA switch: a --cpu-stand-in run has no cuDNN to leave out")
        if args.cpu_stand_in and args.no_varlen:
            raise ValueError("--no-varlen is a CUDA switch: a --cpu-stand-in run attends pair by pair already")
        if args.config is not None and not (Path(args.config) / "config.json").is_file():
            raise ValueError(f"--config {args.config} is not a directory with a config.json (and a tokenizer)")
        ratios = run_settings(args.ratios, args.decode_steps, args.chunk)
        if not all(n.isdigit() for n in args.lengths.split(",")):
            raise ValueError(f"--lengths must be token counts separated by commas, got {args.lengths!r}")
        plan = {args.model: tuple(int(n) for n in args.lengths.split(","))}
        runs = configurations(plan, args.presses.split(","), ratios, args.chunk or None, args.decode_steps)
    except ValueError as err:
        print(f"kvpress bench-gpu: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    jsonl = out / "gpu.jsonl"
    rows = read_rows(jsonl, "kvpress bench-gpu")
    done = {_key(r) for r in rows if "error" not in r}
    random = args.config is not None
    cuda = torch.cuda.is_available()
    here = "cpu (stand-in)" if args.cpu_stand_in else torch.cuda.get_device_name() if cuda else None  # rows' device
    mode = {"random_weights": random, "no_cudnn": args.no_cudnn, "stand_in": args.cpu_stand_in,
            "no_varlen": args.no_varlen, "profiled": args.profile, "device": here}  # fmt: skip
    configs = [{**c, "attn": a, **mode} for a in attns for c in runs]
    todo = pending(configs, lambda c: _key(c) in done, _key)
    if todo and not cuda and not args.cpu_stand_in:
        if rows:
            write(out, rows, {})
        summarised = f"; {out / 'gpu.json'} summarises gpu.jsonl" if rows else ""
        print(f"kvpress bench-gpu: no CUDA device here; {len(todo)} configurations are not measured (it measures "
              f"CUDA memory; on CPUs: make bench-long, or --cpu-stand-in){summarised}", file=sys.stderr)  # fmt: skip
        return 2
    out.mkdir(parents=True, exist_ok=True)
    if todo and not args.cpu_stand_in:
        check = headwise.check_one_call(torch.device("cuda"))
        (out / "varlen_check.json").write_text(json.dumps(check, indent=2) + "\n")
        print(f"one variable-length call against pair by pair: {check}")
    skipped = {}
    for attn in attns:
        mine = [c for c in todo if c["attn"] == attn]
        why = available(attn)
        if why is not None:
            skipped[attn] = why
            print(f"{attn}: not measured: {why}")
            continue
        if not mine:
            continue
        device = "cpu" if args.cpu_stand_in else "cuda"
        model, tokenizer = load(args.model, args.config, attn, torch.bfloat16, device)
        if not args.cpu_stand_in:  # kernels warmed at the longest length (warmed at 1K, the first 16K run took
            # 1.36 s against 0.3 after)
            warm = {"spec": "none", "ratio": 0.0, "chunk": args.chunk or None, "steps": 2, **mode}
            measure(model, tokenizer, {**warm, "length": max(plan[args.model])})
        for config in mine:
            try:
                row = measure(model, tokenizer, config, profiled=args.profile)
            except Exception as error:  # kept as a row and printed: the other configurations still run
                row = {**config, "error": f"{type(error).__name__}: {error}",
                       "traceback": traceback.format_exc()[-2000:]}  # fmt: skip
                print(row["traceback"], file=sys.stderr)
            rows.append(row)
            append_row(jsonl, row)
            print(f"{attn} {row['length']:>6} {row['press']:>40s} r={row['ratio']:<5} " + (
                f"ERROR {row['error']}" if "error" in row else
                f"peak +{row['peak_above_model_bytes'] / 2**20:8.1f} MB  cache {row['cache_bytes'] / 2**20:7.1f}"
                f" MB  prefill {row['prefill_seconds']:6.2f} s  step {row['decode_step_seconds'] * 1000:6.1f} ms"))
        del model
        torch.cuda.empty_cache()
    errors = write(out, rows, skipped)
    print(f"wrote {out / 'gpu.json'}; {len(errors)} configurations failed, skipped: {skipped or 'none'}")
    return 1 if errors else 0


def _key(row: dict) -> tuple:
    """`bench_long`'s key of a run, and the attention implementation, weights, cuDNN switch, a CPU standing in,
    head-wise attention (pair by pair), profiler and device it ran with (a lent machine may be another card)."""
    return (*long_key(row), row["attn"], row.get("random_weights", False), row.get("no_cudnn", False),
            row.get("stand_in", False), row.get("no_varlen", False), bool(row.get("profiled")), row.get("device"))


def _table(row: dict) -> str:
    """The table a row belongs to: its attention implementation, whether no press ran without cuDNN too, whether a
    CPU stood in for the GPU, whether head-wise layers attended pair by pair, and whether the profiler ran."""
    return row["attn"] + (" without cuDNN" if row.get("no_cudnn") else "") + (" (CPU stand-in)" if row.get(
        "stand_in") else "") + (" pair by pair" if row.get("no_varlen") else "") + (
        " profiled" if row.get("profiled") else "")


def write(out: Path, rows: list[dict], skipped: dict) -> list[dict]:
    """`gpu.json` (per attention implementation, `bench_long.summary` of its rows, which pairs a press with the
    no-press run of its own configuration) and `gpu.md` from `rows`; returns the configurations that failed and
    were not measured since."""
    measured = [r for r in rows if "error" not in r]
    cards, weights = {}, {}  # the devices and weights of each table's rows: a table of several is split by them
    for r in measured:
        cards.setdefault(_table(r), set()).add(r.get("device"))
        weights.setdefault(_table(r), set()).add(r.get("random_weights", False))
    named = {id(r): _table(r) + (f" on {r.get('device')}" if len(cards[_table(r)]) > 1 else "") + (
        (" random weights" if r.get("random_weights", False) else " real weights")
        if len(weights[_table(r)]) > 1 else "") for r in measured}  # fmt: skip
    tables = {a: [_same_length(t) for t in summary([r for r in measured if named[id(r)] == a])]
              for a in sorted(set(named.values()))}  # fmt: skip
    measured = {_key(r) for r in rows if "error" not in r}  # a failure a later run measured is no failure
    errors = [{k: r[k] for k in ("attn", "length", "press", "ratio", "error")} for r in rows
              if "error" in r and _key(r) not in measured]  # fmt: skip
    devices = sorted({r["device"] for r in rows if "device" in r})
    result = {"devices": devices, "random_weights": sorted({r.get("random_weights", False) for r in rows}),
              "skipped": skipped, "errors": errors, "tables": tables}  # fmt: skip
    write_text_whole(out / "gpu.json", json.dumps(result, indent=2) + "\n")
    write_text_whole(out / "gpu.md", "".join(f"### {a}\n\n{markdown(t)}\n{_same_length_md(t)}\n"
                                             for a, t in tables.items() if t))  # fmt: skip
    return errors


def _same_length(row: dict) -> dict:
    """`row` with the bound at its own length: its cache plus what no press's prefill held above its cache at that
    length (a chunk's activations grow with the context the chunk attends to; `bound_mb` takes one chunk alone)."""
    none_cache_mb = row["cache_mb"] / row["cache_ratio"]
    bound = row["cache_mb"] + row["none_peak_above_model_mb"] - none_cache_mb
    return {**row, "length_bound_mb": bound, "peak_over_length_bound": row["peak_above_model_mb"] / bound}


def _same_length_md(table: list[dict]) -> str:
    lines = ["| tokens | press | r | peak, MB | cache + no press's activations at this length, MB | peak / that |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in sorted(table, key=lambda r: (r["length"], r["press"], r["ratio"])):
        lines.append(f"| {r['length']} | {r['press']} | {r['ratio']} | {r['peak_above_model_mb']:.0f} | "
                     f"{r['length_bound_mb']:.0f} | {r['peak_over_length_bound']:.2f} |")  # fmt: skip
    return "\n".join(lines) + "\n"

if __name__ == "__main__":
    sys.exit(main())
