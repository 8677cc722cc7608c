"""Core benchmark: prefill overhead, decode step time and kept bytes of each press on the default model.

Every ratio is measured side by side in one run (runs alternate, each side first every other round, medians
taken), because the machine is shared and noisy. Writes `eval/results/core.json`:

    {"prefill_overhead": {press: t_press / t_none}, "generate_prefill_overhead": {press: t / t_none of
     `model.generate` of one token inside the press, whole-context presses (KVzip's pass) included},
     "decode_step_ratio": {press: step time at
     4K context with r=0.75 / full-cache step time}, "kept_bytes_ratio": {press: kept / full bytes},
     "varlen_vs_dense_decode": AdaKV(SnapKV) step time / SnapKV step time (same tokens kept per layer:
     per-head variable-length storage and attention vs one dense tensor; steps interleaved, each side first
     every other step), "kvzip_scoring_peak_ratio": the
     most bytes the cache holds while KVzip scores the decode context (its reconstruction passes) / the
     context's full-cache bytes, "kvzip_pass_ratio": KVzip's scoring of the decode context with the
     attention weights computed once, for the output and the scores / computed again for the scores
     (`reconstruction_scores(from_output=False)`), alternating}

`varlen_vs_dense_decode` compares SnapKV and AdaKV(SnapKV) at `--ratio` whatever `--presses` lists. `--measure`
runs some parts only (a part left out leaves its keys out).

Run: `make bench` (or `python -m kvpress.eval.bench_core --help`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DynamicCache

import kvpress
from kvpress.cli import check_counts
from kvpress.engine import maybe_installed, observe
from kvpress.files import check_writable, write_text_whole
from kvpress.presses.kvzip import reconstruction_scores
from kvpress.recording import record_prefill

PRESSES = ("snapkv", "h2o", "sink-window", "knorm", "random", "adakv", "duo-attention", "snapkv:kv_bits=4",
           "adakv:kv_bits=4", "default")  # default: the model's own (`resolve_default`), the main road
MEASURES = ("prefill", "generate", "varlen", "kvzip", "decode")  # the parts of a run, in order (`--measure`)


def long_ids(tokenizer, n_tokens: int) -> torch.Tensor:
    """`[1, n_tokens]` ids of English text from CPython's own documentation (on every machine)."""
    from pydoc_data.topics import topics

    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 1:
        raise ValueError(f"a long text's length must be a positive number of tokens, got {n_tokens!r}")
    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :n_tokens]
    if ids.shape[1] < n_tokens:
        raise ValueError(f"the text has only {ids.shape[1]} tokens, fewer than {n_tokens}")
    return ids


def timed_forward(model, ids: torch.Tensor, cache: DynamicCache, press=None) -> float:
    """Seconds of one forward of `ids` on `cache`, with `press` installed if given (installing it is not timed: a
    user installs once for a whole generation)."""
    with maybe_installed(press, model):
        start = time.perf_counter()
        model(ids, cache=cache, use_cache=True)
        return time.perf_counter() - start


def prefill(model, ids: torch.Tensor, press=None) -> tuple[DynamicCache, float]:
    cache = DynamicCache(config=model.config)
    return cache, timed_forward(model, ids, cache, press)


def timed_generate(model, tokenizer, ids: torch.Tensor, press=None) -> float:
    """Seconds of `model.generate` of one token after the prompt `ids` (its prefill, and the press's eviction or
    scoring pass), inside `press(model, tokenizer=tokenizer)` when given (installing it is not timed): the user's
    main road."""
    with maybe_installed(press, model, tokenizer):
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                       pad_token_id=tokenizer.eos_token_id)  # fmt: skip
        return time.perf_counter() - start


def side_by_side(rounds: int, first: Callable[[], float], second: Callable[[], float], warm_up: int = 0
                 ) -> tuple[list[float], list[float]]:  # fmt: skip
    """The seconds of `rounds` runs of `first` and of `second`, alternating, each run first every other round (a
    fixed order would add its order's effect to the ratio); the first `warm_up` rounds are left out."""
    times: tuple[list[float], list[float]] = ([], [])
    for round_ in range(rounds):
        for side in (0, 1) if round_ % 2 == 0 else (1, 0):
            t = (first, second)[side]()
            if round_ >= warm_up:
                times[side].append(t)
    return times


def kvzip_pass_ratio(model, tokenizer, ids: torch.Tensor, repeats: int) -> float:
    """Median seconds of KVzip's scoring of the context `ids` with the weights computed once, over the median with
    them computed a second time for the scores (the two alternate, each first every other round)."""
    recording = record_prefill(model, ids)
    request = tokenizer(kvpress.KVzipPress.prompt, add_special_tokens=False, return_tensors="pt").input_ids

    def timed(once: bool) -> float:
        start = time.perf_counter()
        reconstruction_scores(model, recording.cache, ids, request, from_output=once)
        return time.perf_counter() - start

    once, twice = side_by_side(repeats, lambda: timed(True), lambda: timed(False))
    return statistics.median(once) / statistics.median(twice)


def kvzip_scoring_peak(model, tokenizer, ids: torch.Tensor) -> float:
    """The most bytes the cache holds while KVzip scores the context `ids` (sampled at every layer's observation of
    its reconstruction passes, which run in the cache itself: the observed layer then holds its pass), over the
    context's full-cache bytes."""
    recording = record_prefill(model, ids)
    full = kvpress.cache_bytes(recording.cache)
    peak = [full]
    with observe(model, lambda obs: peak.append(kvpress.cache_bytes(recording.cache))):  # before KVzip's own
        kvpress.KVzipPress(compression_ratio=0.5).prepare(model, recording, tokenizer)
    return max(peak) / full


@torch.inference_mode()
def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    model, tokenizer = kvpress.load_model(args.model)
    presses = {name: kvpress.press_from_name(kvpress.resolve_default(name, model), compression_ratio=args.ratio)
               for name in args.presses}  # fmt: skip
    result: dict = {
        "model": args.model or kvpress.models.DEFAULT_MODEL,
        "compression_ratio": args.ratio,
        "prefill_tokens": args.prefill_tokens,
        "decode_context": args.decode_context,
        "decode_steps": args.decode_steps,
        "varlen_steps": args.varlen_steps,
        "threads": torch.get_num_threads(),
        "prefill_overhead": {},
        "generate_prefill_overhead": {},
        "decode_step_ratio": {},
        "kept_bytes_ratio": {},
        "seconds": {},
    }

    # prefill overhead: press and no press alternate, medians of the paired runs
    ids = long_ids(tokenizer, args.prefill_tokens)
    prefill(model, ids[:, :64])  # warm-up
    for name, press in presses.items() if "prefill" in args.measure else ():
        base, pressed = side_by_side(args.repeats, lambda: prefill(model, ids)[1],
                                     lambda press=press: prefill(model, ids, press)[1])  # fmt: skip
        result["prefill_overhead"][name] = round(statistics.median(pressed) / statistics.median(base), 3)
        result["seconds"][f"prefill_{name}"] = round(statistics.median(pressed), 3)
        result["seconds"][f"prefill_none_vs_{name}"] = round(statistics.median(base), 3)
        print(f"prefill {args.prefill_tokens} tokens  {name:12s} overhead x{result['prefill_overhead'][name]}")

    # the main road: model.generate's prefill inside the press (whole-context presses included), alternating
    generated = args.generate_presses if "generate" in args.measure else ()
    for name in dict.fromkeys(kvpress.resolve_default(spec, model) for spec in generated):  # once each
        press = kvpress.press_from_name(name, compression_ratio=args.ratio)
        timed_generate(model, tokenizer, ids[:, :64], press)  # warm-up (a scorer's first load)
        base, pressed = side_by_side(args.repeats, lambda: timed_generate(model, tokenizer, ids),
                                     lambda press=press: timed_generate(model, tokenizer, ids, press))  # fmt: skip
        ratio = round(statistics.median(pressed) / statistics.median(base), 3)
        result["generate_prefill_overhead"][name] = ratio
        print(f"model.generate, {args.prefill_tokens} tokens  {name} overhead x{ratio}")

    # decode: one full cache and one compressed cache per press; steps alternate between them
    ids = long_ids(tokenizer, args.decode_context)
    token = ids[:, -1:]
    if "decode" in args.measure:
        full, _ = prefill(model, ids)
        result["full_bytes"] = full_bytes = kvpress.cache_bytes(full)
    if "varlen" in args.measure:  # variable-length vs dense attention, side by side
        sides = {name: kvpress.press_from_name(name, compression_ratio=args.ratio) for name in ("snapkv", "adakv")}
        caches = {name: prefill(model, ids, press)[0] for name, press in sides.items()}
        dense, varlen = side_by_side(args.varlen_steps + 2, *(
            lambda name=name: timed_forward(model, token, caches[name], sides[name]) for name in sides), warm_up=2)
        times = {"snapkv": dense, "adakv": varlen}
        ratio = statistics.median(times["adakv"]) / statistics.median(times["snapkv"])
        result["varlen_vs_dense_decode"] = round(ratio, 3)
        for name, side in times.items():
            result["seconds"][f"varlen_decode_step_{name}"] = round(statistics.median(side), 4)
        print(f"decode at {args.decode_context}: variable-length / dense step x{result['varlen_vs_dense_decode']}")
    if "kvzip" in args.measure:
        result["kvzip_scoring_peak_ratio"] = round(kvzip_scoring_peak(model, tokenizer, ids), 3)
        print(f"KVzip scoring at {args.decode_context}: the cache peaks at x{result['kvzip_scoring_peak_ratio']} "
              "of full")  # fmt: skip
        result["kvzip_pass_ratio"] = round(kvzip_pass_ratio(model, tokenizer, ids, args.repeats), 3)
        print(f"KVzip scoring at {args.decode_context}: weights computed once / twice x{result['kvzip_pass_ratio']}")
    for name, press in presses.items() if "decode" in args.measure else ():
        cache, _ = prefill(model, ids, press)
        result["kept_bytes_ratio"][name] = round(kvpress.cache_bytes(cache) / full_bytes, 4)
        base, pressed = side_by_side(args.decode_steps + 2, lambda: timed_forward(model, token, full),
                                     lambda cache=cache, press=press: timed_forward(model, token, cache, press),
                                     warm_up=2)  # fmt: skip (the first steps warm up)
        full.crop(-(args.decode_steps + 2))  # the full cache goes back to the context
        result["decode_step_ratio"][name] = round(statistics.median(pressed) / statistics.median(base), 3)
        result["seconds"][f"decode_step_{name}"] = round(statistics.median(pressed), 4)
        result["seconds"][f"decode_step_full_vs_{name}"] = round(statistics.median(base), 4)
        print(
            f"decode at {args.decode_context} {name:12s} step ratio x{result['decode_step_ratio'][name]}"
            f"  kept bytes {result['kept_bytes_ratio'][name]}"
        )
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help=kvpress.models.MODEL_HELP)
    parser.add_argument("--presses", default=",".join(PRESSES), type=lambda s: s.split(","))
    parser.add_argument("--generate-presses", default=f"default,{kvpress.DEFAULT_PRESS}", type=lambda s: s.split(","),
                        help="presses timed inside model.generate's prefill, whole-context ones included "
                             "(default: the model's default press and the one for any model)")
    parser.add_argument("--ratio", type=float, default=0.75)
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--decode-context", type=int, default=4096)
    parser.add_argument("--decode-steps", type=int, default=24)
    parser.add_argument("--varlen-steps", type=int, default=120,
                        help="decode steps of each side of varlen_vs_dense_decode (its two sides differ by a few "
                             "percent: more steps steady their medians)")
    parser.add_argument("--measure", default=",".join(MEASURES), type=lambda s: s.split(","),
                        help=f"the parts to run, comma-separated (default: all of {','.join(MEASURES)}; a part "
                             "left out leaves its keys out of the result): varlen_vs_dense_decode alone at 16K on "
                             "Qwen2.5 is `--model qwen2.5-0.5b --decode-context 16384 --measure varlen`")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "core.json"))
    args = parser.parse_args(argv)
    try:
        check_counts(args, {"repeats": 1, "decode_steps": 1, "varlen_steps": 1, "prefill_tokens": 1,
                            "decode_context": 1})  # fmt: skip
        check_writable(args.out, "--out")  # (before the runs, not after them)
    except ValueError as err:
        parser.error(str(err))
    unknown = [part for part in args.measure if part not in MEASURES]
    if unknown:
        parser.error(f"--measure takes parts among {', '.join(MEASURES)}, got {','.join(args.measure)!r}")
    for flag, names in (("--presses", args.presses), ("--generate-presses", args.generate_presses)):
        for name in names:
            try:
                kvpress.press_from_name(name, compression_ratio=args.ratio)
            except (TypeError, ValueError) as err:
                parser.error(f"{flag} {name!r}: {err}")
    result = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_text_whole(args.out, json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
