"""`make bench-chat`: multi-turn recall on real chats at equal working-cache bytes.

Each example is a Chit Chat Challenge conversation (`eval/tasks/chat_recall.py`) fed round by round
to a `kvpress.ChatSession` (scripted replies, so every configuration sees the same history); two
facts are planted in early rounds and the last turn asks for one of them. Configurations:
- full cache;
- `RoundPolicy` (top-k relevant past rounds + the most recent one, the rest offloaded to a host store);
- `RoundPolicy(inner=SnapKV)`: each finished round also compressed once (FlowKV);
- SinkWindow and "recompress everything every turn" (SnapKV over the whole cache at each turn), both
  with a token budget equal, per example, to what RoundPolicy holds per layer at the last turn.
Reported per configuration (`summarize`): accuracy with its 95% interval (Wilson) and n, its difference from the
full cache's over the same chats with its interval (Student's t) and its ratio to it, working-cache bytes at the
last turn and averaged over turns (ratio to the full cache of the same chat; RoundPolicy's host store
reported separately), tokens fed per turn, and how often a round policy selected the asked round (Wilson). Writes
`eval/results/chat[-MODEL].json`; each chat's rows go to `<out>.jsonl` as it finishes, so that a stopped run with
the same settings resumes from them (other settings are refused: another file, `--out`); once the result is written
the `.jsonl` is removed (the rows are in the result), so the next run measures anew.

`--watershed` instead measures, per layer, how often the round-level attention of the question's
tokens ranks the asked fact's round first (seeds apart from the reported ones): the rule behind
`watershed_layer="auto"`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

import kvpress
from kvpress.engine import Observation, observe
from kvpress.eval.confidence import mean_half_width, wilson
from kvpress.eval.paired import difference_interval
from kvpress.eval.sweep import append_row, read_rows
from kvpress.eval.tasks.chat_recall import ChatExample, chat_recall_examples
from kvpress.files import check_writable, write_text_whole
from kvpress.patches import model_access
from kvpress.recording import QueryRecorder
from kvpress.rounds import choose_watershed, round_relevance

OUT = Path(__file__).parent / "results"


def run_chat(model, tokenizer, example: ChatExample, press, max_new_tokens: int = 24) -> dict:
    """Play `example` through a session with `press`; score the answer, count bytes and tokens fed."""
    policy = press if isinstance(press, kvpress.RoundPolicy) else None  # a round policy, or a press
    session = kvpress.ChatSession(model, tokenizer, press=None if policy else press, round_policy=policy,
                                  max_new_tokens=max_new_tokens)  # fmt: skip
    fed: list[int] = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["input_ids"].shape[1]), with_kwargs=True)
    per_turn, tokens = [], []
    try:
        for user, reply in example.rounds:
            fed.clear()
            session.send(user, reply=reply)
            per_turn.append(kvpress.cache_bytes(session.cache))
            tokens.append(sum(fed))
        fed.clear()
        answer = session.send(example.question)
        tokens.append(sum(fed))
    finally:
        hook.remove()
    per_turn.append(kvpress.cache_bytes(session.cache))
    full_layers = [layer for layer in session.cache.layers if getattr(layer, "n", None) is not None]
    return {
        "score": example.score(answer),
        "answer": answer,
        "bytes_last": per_turn[-1],
        "bytes_per_turn": per_turn,
        "store_bytes": session.store.nbytes() if session.store is not None else 0,
        "tokens_fed_per_turn": tokens,
        "history_tokens": session.cache.get_seq_length(),
        "held_per_layer": sum(layer.n for layer in full_layers) / max(1, len(full_layers)),
        "selected": list(getattr(press, "selected", [])),
        "fact_round": example.fact_round,
    }


def configurations(top_k: int) -> dict:
    return {
        "round": lambda budget: kvpress.RoundPolicy(top_k_rounds=top_k, keep_recent_rounds=1),
        "round+snapkv": lambda budget: kvpress.RoundPolicy(
            top_k_rounds=top_k, keep_recent_rounds=1, inner=kvpress.SnapKVPress(compression_ratio=0.5, window_size=16)
        ),
        "sink-window": lambda budget: kvpress.SinkWindowPress(max_tokens=budget),
        "recompress-every-turn": lambda budget: kvpress.SnapKVPress(max_tokens=budget, window_size=16),
    }


def chat_rows(model, tokenizer, example: ChatExample, top_k: int) -> dict[str, dict]:
    """One chat played through every configuration: its row per configuration name (`run_chat`'s, plus the
    working bytes as ratios to the full cache's)."""
    configs = configurations(top_k)
    full = run_chat(model, tokenizer, example, None)
    rows = {"full": full, "round": run_chat(model, tokenizer, example, configs["round"](None))}
    budget = max(48, round(rows["round"]["held_per_layer"]))  # equal working bytes at the last turn
    for name in ("round+snapkv", "sink-window", "recompress-every-turn"):
        rows[name] = run_chat(model, tokenizer, example, configs[name](budget))
    for row in rows.values():
        turns = zip(row["bytes_per_turn"], full["bytes_per_turn"], strict=True)
        row["bytes_ratio_last"] = row["bytes_last"] / full["bytes_last"]
        row["bytes_ratio_mean"] = sum(b / f for b, f in turns) / len(full["bytes_per_turn"])
    return rows


def logged(log: Path, settings: dict | None) -> list[dict]:
    """The rows of `log` (none where there is none yet); a log begun with other settings is refused."""
    rows = read_rows(log, "kvpress bench-chat")
    if rows and rows[0] != {"settings": settings}:
        raise ValueError(f"{log} holds a run with other settings ({json.dumps(rows[0])}; this one: "
                         f"{json.dumps(settings)}): remove it or choose another --out")  # fmt: skip
    return rows


def _resumed(log: Path, settings: dict | None) -> dict[int, dict[str, dict]]:
    """The chats `log` holds (`read_rows`: a row torn by the stop is dropped), whose first row must be `settings`;
    a new log begun where there is none."""
    rows = logged(log, settings)
    if not rows:
        log.parent.mkdir(parents=True, exist_ok=True)
        append_row(log, {"settings": settings})
        return {}
    done = {row["example"]: row["rows"] for row in rows[1:]}
    if done:
        print(f"resumed {len(done)} chats from {log}", flush=True)
    return done


def bench(examples: list[ChatExample], play: Callable[[ChatExample], dict[str, dict]], log: Path | None = None,
          settings: dict | None = None) -> dict:  # fmt: skip
    """Every example's rows (`play(example)`, e.g. `chat_rows`) and the summary per configuration. With `log`, each
    example's rows are appended to it as they come (its first row `{"settings": settings}`) and a log of the same
    settings is resumed from (one of other settings is refused); the caller removes it once the result is written."""
    done = _resumed(log, settings) if log is not None else {}
    beyond = sorted(i for i in done if i >= len(examples))
    if beyond:  # (they would be left out of the result, and the log that holds them removed)
        raise ValueError(f"{log} holds chats {beyond[0]}..{beyond[-1]} of a run of more examples than "
                         f"{len(examples)}: run with --examples {beyond[-1] + 1} or more, or remove it")  # fmt: skip
    rows: dict[str, list[dict]] = {}
    for i, example in enumerate(examples):
        start = time.time()
        played = done.get(i)
        if played is None:
            played = play(example)
            if log is not None:
                append_row(log, {"example": i, "rows": played})
            print(f"example {i}: " + ", ".join(f"{n} {r['score']:.0f}" for n, r in played.items())
                  + f" ({time.time() - start:.0f} s)", flush=True)  # fmt: skip
        for name, row in played.items():
            rows.setdefault(name, []).append(row)
    return {"summary": summarize(rows), "rows": rows}


def summarize(rows: dict[str, list[dict]]) -> dict[str, dict]:
    """Per configuration, from its rows (one a chat, in the full cache's order): accuracy with its Wilson 95% interval
    and n, its difference from the full cache's on the same chats (mean of the per-chat differences, Student's t 95%
    interval as `paired.difference_interval`: clipped to [-1, 1], and where every chat moved alike, none included,
    `confidence.no_spread_interval`'s) and retention (accuracy / the full cache's),
    bytes and tokens fed, and for a round policy how often it selected the asked round (Wilson interval)."""
    full = rows["full"]
    full_acc = sum(r["score"] for r in full) / len(full)
    summary = {}
    for name, members in rows.items():
        scores = [r["score"] for r in members]
        acc, differences = sum(scores) / len(members), [s - f["score"] for s, f in zip(scores, full, strict=True)]
        gap, half = sum(differences) / len(differences), mean_half_width(differences)
        store = [r["store_bytes"] / f["bytes_last"] for r, f in zip(members, full, strict=True)]
        selected = sum(r["fact_round"] in r["selected"] for r in members) if name.startswith("round") else None
        interval = None if name == "full" or math.isnan(half) else difference_interval(gap, half, "score", len(scores))
        summary[name] = {
            "accuracy": round(acc, 4),
            "accuracy_interval": [round(x, 4) for x in wilson(sum(scores), len(members))],
            "n": len(members),
            "minus_full": None if name == "full" else round(gap, 4),  # (the full cache against itself: nothing)
            "minus_full_interval": None if interval is None else [round(x, 4) for x in interval],
            "retention": round(acc / full_acc, 4) if full_acc else None,
            "working_bytes_last": round(sum(r["bytes_ratio_last"] for r in members) / len(members), 4),
            "working_bytes_mean_over_turns": round(sum(r["bytes_ratio_mean"] for r in members) / len(members), 4),
            "store_bytes_last": round(sum(store) / len(store), 4),
            "tokens_fed_per_turn": round(sum(sum(r["tokens_fed_per_turn"]) / len(r["tokens_fed_per_turn"])
                                             for r in members) / len(members), 1),  # fmt: skip
            "fact_round_selected": None if selected is None else round(selected / len(members), 4),
            "fact_round_selected_interval": (None if selected is None else
                                             [round(x, 4) for x in wilson(selected, len(members))]),  # fmt: skip
        }
    return summary


@torch.inference_mode()
def watershed(model, tokenizer, examples: list[ChatExample]) -> list[float]:
    """Per layer: the fraction of examples where the question's round-level attention ranks the asked
    fact's round first among the past rounds (full cache, every round present)."""

    n_layers = model_access.text_config(model).num_hidden_layers
    hits = [0] * n_layers
    for example in examples:
        session = kvpress.ChatSession(model, tokenizer, max_new_tokens=1)
        for user, reply in example.rounds:
            session.send(user, reply=reply)
        spans = session.round_spans()[:-1]
        messages = session.messages + [{"role": "user", "content": example.question}]
        new = session.new_tokens(messages)
        queries = session.user_text_span(messages, new)
        ids = torch.tensor([new])
        recorder = QueryRecorder()
        with observe(model, recorder):
            model(input_ids=ids, cache=session.cache, use_cache=True, logits_to_keep=1)
        for idx, (module, query) in recorder.queries.items():
            layer = session.cache.layers[idx]
            obs = Observation(module, query, *layer.held_kv(), layer)
            relevance = round_relevance(obs, spans, queries)
            hits[idx] += int(max(range(len(spans)), key=relevance.__getitem__) == example.fact_round)
    return [h / len(examples) for h in hits]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help=kvpress.models.MODEL_HELP)
    parser.add_argument("--examples", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--top-k", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--watershed", action="store_true", help="measure the watershed rule instead")
    parser.add_argument("--out", default=None, help="JSON output (default eval/results/chat[-MODEL].json)")
    args = parser.parse_args(argv)
    if args.out is not None and Path(args.out).suffix == ".jsonl":  # (its rows are kept beside it, in OUT.jsonl)
        parser.error(f"--out is the JSON result, kept apart from the rows a run writes as it goes (<out>.jsonl): "
                     f"name it otherwise than {args.out}")  # fmt: skip
    suffix = f"-{args.model}" if args.model else ""
    out = Path(args.out or OUT / f"{'watershed' if args.watershed else 'chat'}{suffix}.json")
    # a chat is drawn on its own (`chat_recall_examples`), so a run of more examples extends one of fewer
    settings = {"model": args.model or "smollm2-135m", "seed": args.seed, "rounds": args.rounds,
                "top_k_rounds": args.top_k}  # fmt: skip
    try:  # before the model loads: the chats are drawn without it, and the policy is checked as it is built
        examples = chat_recall_examples(args.examples, args.rounds, args.seed)
        kvpress.RoundPolicy(top_k_rounds=args.top_k)
        check_writable(out, "--out")  # (before the runs, not after them)
        if not args.watershed:
            logged(out.with_suffix(".jsonl"), settings)  # (a log of other settings)
    except ValueError as error:
        parser.error(str(error))
    model, tokenizer = kvpress.load_model(args.model)
    if args.watershed:
        rates = watershed(model, tokenizer, examples)
        result = {"model": args.model or "smollm2-135m", "seed": args.seed, "examples": args.examples,
                  "fact_round_ranked_first_per_layer": [round(r, 4) for r in rates],
                  "watershed": choose_watershed(rates)}  # fmt: skip
    else:
        play = lambda example: chat_rows(model, tokenizer, example, args.top_k)  # noqa: E731
        result = {**settings, "examples": args.examples, **bench(examples, play, out.with_suffix(".jsonl"), settings)}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_whole(out, json.dumps(result, indent=1) + "\n")
    if not args.watershed:  # the run is whole: its rows are in `out`, and the next run measures anew
        out.with_suffix(".jsonl").unlink()
    print(json.dumps(result.get("summary", result), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
