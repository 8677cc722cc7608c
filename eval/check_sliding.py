"""Sliding-window layers on a real model: past the window, r = 0 equals no press token for token, a press
holds its budget of what a sliding layer would hold (`window - 1`), and the demo's fact is still answered.

    python -m kvpress.eval.check_sliding [--model gemma-3-270m] [--ratios 0.5,0.75]

Writes `eval/results/sliding-<model>.json`: the prompt's length, the window, and per ratio the cache bytes
as a share of no press's, the most tokens a sliding and a full-attention layer hold (None: every layer slides),
and the answer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import DynamicCache

import kvpress
from kvpress import SnapKVPress
from kvpress.cli import DEMO_ANSWER, DEMO_QUESTION, demo_document
from kvpress.files import write_text_whole

RESULTS = Path(__file__).resolve().parent / "results"


def _run(model, ids: torch.Tensor, press=None) -> tuple[torch.Tensor, DynamicCache]:
    cache = DynamicCache(config=model.config)
    with kvpress.engine.maybe_installed(press, model):
        out = model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False)
    return out[0, ids.shape[1] :], cache


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--ratios", default="0.5,0.75")
    parser.add_argument("--words", type=int, default=900, help="words of the demo document (past the window)")
    args = parser.parse_args(argv)
    try:
        ratios = [float(r) for r in args.ratios.split(",")]
    except ValueError:
        parser.error(f"--ratios must be comma-separated numbers, got {args.ratios!r}")
    bad = [r for r in ratios if not 0 <= r < 1]
    if bad:
        parser.error(f"--ratios must lie in [0, 1), got {bad}")
    if args.words < 1:
        parser.error(f"--words must be positive, got {args.words}")
    model, tokenizer = kvpress.load_model(args.model)
    window = kvpress.patches.model_access.sliding_window(model)
    if window is None:
        raise ValueError(f"{args.model} has no sliding-window layers")
    text = demo_document(n_words=args.words) + "\n\nQuestion: " + DEMO_QUESTION + "\nAnswer:"
    ids = tokenizer(text, return_tensors="pt").input_ids
    plain, full = _run(model, ids)
    zero, _ = _run(model, ids, SnapKVPress(0.0))
    result = {"model": args.model, "prompt_tokens": ids.shape[1], "window": window,
              "ratio_0_identical": torch.equal(plain, zero), "full_cache_bytes": kvpress.cache_bytes(full),
              "answer_no_press": tokenizer.decode(plain, skip_special_tokens=True), "ratios": {}}  # fmt: skip
    for ratio in ratios:
        answer, cache = _run(model, ids, SnapKVPress(ratio))
        text = tokenizer.decode(answer, skip_special_tokens=True)
        result["ratios"][ratio] = {
            "bytes_share": kvpress.cache_bytes(cache) / result["full_cache_bytes"],
            "sliding_layer_max_held": max(layer.n for layer in cache.layers if layer.window is not None),
            "full_layer_max_held": max((layer.n for layer in cache.layers if layer.window is None),
                                       default=None),  # (None: every layer slides, as Mistral-7B-v0.1's)
            "answer": text,
            "fact_kept": DEMO_ANSWER in text,
        }
    out = RESULTS / f"sliding-{Path(args.model).name or args.model}.json"  # (a local directory: its name)
    write_text_whole(out, json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
