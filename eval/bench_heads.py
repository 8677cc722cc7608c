"""Head-wise budgets on needle tasks: AdaKV vs SnapKV, DuoAttention vs SinkWindow at equal bytes.

Default model, offline needle tasks (`kvpress.eval.tasks.needle`: a noise haystack and a pydoc prose
haystack, ~1K tokens, seeds 1000+, not the calibration's), the question asked as a plain completion.
Every press compresses the context without the question (query-agnostic: `name@ratio`); SnapKV and
AdaKV(SnapKV) also with the question prefilled with the context (`name@ratio+question`, observation
window 16 tokens, about the question: with the default 64 the window is mostly haystack, and both
answered 0 of the first 5 noise examples at r = 0.5). For each: accuracy with its Wilson 95% interval and n,
and the KV bytes held at the end (context + question + answer) relative to the full cache.
Writes `eval/results/heads.json`. Run: `make bench-heads` (or `python -m kvpress.eval.bench_heads`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import kvpress
from kvpress.cli import check_counts
from kvpress.eval.confidence import wilson
from kvpress.eval.sweep import configurations
from kvpress.eval.tasks.needle import HAYSTACKS, needle_examples
from kvpress.files import check_writable, write_text_whole

CONFIGS = {
    "snapkv": lambda r: kvpress.SnapKVPress(compression_ratio=r),
    "adakv-snapkv": lambda r: kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=r)),
    "sink-window": lambda r: kvpress.SinkWindowPress(compression_ratio=r),
    "duo-attention": lambda r: kvpress.DuoAttentionPress(compression_ratio=r),
}


QUERY_AWARE = {
    "snapkv": lambda r: kvpress.SnapKVPress(compression_ratio=r, window_size=16),
    "adakv-snapkv": lambda r: kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=r, window_size=16)),
}


def answer(model, tokenizer, example, press, query_aware: bool = False) -> tuple[bool, int, str]:
    cache = DynamicCache(config=model.config)
    text = kvpress.generate(
        model, tokenizer, example.context, example.question, press, max_new_tokens=8, cache=cache,
        chat_template=False, query_aware=query_aware,
    )  # fmt: skip
    return example.score(text) == 1.0, kvpress.cache_bytes(cache), text


def cell(correct: int, n: int, kept_bytes: float) -> dict:
    """One configuration's result: its accuracy over `n` examples with Wilson's 95% interval, and its kept bytes."""
    return {"accuracy": round(correct / n, 3), "accuracy_interval": [round(b, 3) for b in wilson(correct, n)],
            "n": n, "kept_bytes": round(kept_bytes, 3)}  # fmt: skip


@torch.inference_mode()
def run(args: argparse.Namespace) -> dict:
    model, tokenizer = kvpress.load_model(args.model)
    result = {"model": args.model or kvpress.models.DEFAULT_MODEL, "examples": args.examples, "length": args.length,
              "seed": args.seed, "ratios": args.ratios, "tasks": {}}  # fmt: skip
    start = time.perf_counter()
    for haystack in HAYSTACKS:
        examples = needle_examples(tokenizer, args.examples, args.length, args.seed, haystack)
        rows: dict = {}
        for i, example in enumerate(examples):
            ok, full_bytes, _ = answer(model, tokenizer, example, None)
            rows.setdefault("full", {"correct": 0, "bytes": 1.0})["correct"] += ok
            for ratio in args.ratios:
                runs = [(name, False) for name in CONFIGS] + [(name, True) for name in QUERY_AWARE]
                for name, aware in runs:
                    make = QUERY_AWARE[name] if aware else CONFIGS[name]
                    ok, kept, _ = answer(model, tokenizer, example, make(ratio), aware)
                    row = rows.setdefault(f"{name}@{ratio}{'+question' if aware else ''}", {"correct": 0, "bytes": 0.0})
                    row["correct"] += ok
                    row["bytes"] += kept / full_bytes / args.examples
            done = ", ".join(f"{k} {v['correct']}" for k, v in rows.items())
            print(f"{haystack} {i + 1}/{args.examples} ({time.perf_counter() - start:.0f} s): {done}", flush=True)
        result["tasks"][haystack] = {k: cell(v["correct"], args.examples, v["bytes"]) for k, v in rows.items()}
    result["seconds"] = round(time.perf_counter() - start)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help=kvpress.models.MODEL_HELP)
    parser.add_argument("--examples", type=int, default=16)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--ratios", default=[0.5, 0.75], type=lambda s: [float(x) for x in s.split(",")])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "heads.json"))
    args = parser.parse_args(argv)
    try:
        check_counts(args, {"examples": 1, "length": 100, "seed": 0})
        configurations(["snapkv"], args.ratios)  # ratios in [0, 1), each once
        check_writable(args.out, "--out")  # (before the runs, not after them)
    except ValueError as err:
        parser.error(str(err))
    result = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_text_whole(args.out, json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["tasks"], indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
