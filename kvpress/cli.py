"""The `kvpress` command: `demo` (the main job), `generate`, `presses`, `calibrate-heads`, `train-scorer`,
`train-gates`, `lm-eval`, `sweep`."""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path

DEMO_FACT = "The secret code of the vault is 7319."
DEMO_QUESTION = "What is the secret code of the vault? Answer with the number only."
DEMO_ANSWER = "7319"


def demo_document(n_words: int = 600, depth: float = 0.7) -> str:
    """English text from CPython's documentation with `DEMO_FACT` hidden at `depth` (0 = start)."""
    from pydoc_data.topics import topics

    words = "\n\n".join(topics[k] for k in sorted(topics)).split()[:n_words]
    cut = int(len(words) * depth)
    return " ".join(words[:cut]) + "\n\n" + DEMO_FACT + "\n\n" + " ".join(words[cut:])


def _press(name: str | None, ratio: float | None, max_tokens: int | None, model=None):
    """The press `name` names at this budget (`default`: `model`'s default press), None for `none`."""
    import kvpress

    if name is None or name == "none":
        return None
    return kvpress.press_from_name(name, model, **_budget(name, ratio, max_tokens))


def _check_press(name: str, ratio: float | None, max_tokens: int | None, model_name: str | None):
    """The press `name` built before the model `model_name` loads, so that a bad spec is refused at once; `default`
    as that model's default press (a directory's is only parsed, and None returned: its default is known once it
    loads)."""
    from kvpress.presses import spec_before_loading

    spec = spec_before_loading(name, model_name)
    return None if spec is None else _press(spec, ratio, max_tokens)


def _budget(name: str, ratio: float | None, max_tokens: int | None) -> dict:
    """The budget keywords `--ratio` and `--max-tokens` give the press `name`: r = 0.5 when neither they nor
    `name`'s own parameters (`snapkv:max_tokens=100`, `sink-window:window=100`, `duo-attention:retrieval_fraction=0.3`
    without an inner press, whose budget the ratio would be; with one, the inner press's: `adakv:inner=sink-window:
    window=8`) set one."""
    from kvpress.presses import PRESSES, parse_press_spec, press_class, resolve_default

    base, params = parse_press_spec(resolve_default(name))
    inner = params.get("inner")
    if inner is None:
        own = press_class(base).budget_parameters
    else:  # the inner press's, where they reach it: duo-attention's factory keeps `window` for its streaming heads
        outer = {p.name for p in inspect.signature(PRESSES[base]).parameters.values() if p.kind is not p.VAR_KEYWORD}
        own = [p for p in press_class(inner).budget_parameters if p not in outer] if inner in PRESSES else ()
    if ratio is None and max_tokens is None and not {"compression_ratio", "max_tokens", *own} & set(params):
        ratio = 0.5
    return {key: value for key, value in (("compression_ratio", ratio), ("max_tokens", max_tokens))
            if value is not None}  # fmt: skip


def _answer(
    model, tokenizer, context: str, question: str, press, max_new_tokens: int, query_aware: bool = False,
    prefill_chunk_size: int | None = None,
) -> tuple[str, int, float]:
    """(answer, KV bytes held at the end, seconds)."""
    from transformers import DynamicCache

    import kvpress

    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    text = kvpress.generate(model, tokenizer, context, question, press, max_new_tokens=max_new_tokens, cache=cache,
                            query_aware=query_aware, prefill_chunk_size=prefill_chunk_size)  # fmt: skip
    return text, kvpress.cache_bytes(cache), time.perf_counter() - start


def cmd_demo(args: argparse.Namespace) -> int:
    import kvpress

    model, tokenizer = kvpress.load_model(args.model)
    context = demo_document()
    n_tokens = sum(t.shape[1] for t in kvpress.pipeline.split_prompt(tokenizer, context, DEMO_QUESTION))
    print(f"document: {n_tokens} tokens of Python documentation; hidden fact: {DEMO_FACT!r}")
    print(f"question: {DEMO_QUESTION}\n")
    names = [kvpress.resolve_default(name, model) for name in args.presses.split(",")]
    w = max(len(name) for name in ["press", *names])
    print(f"{'press':{w}s} {'ratio':>5s} {'KV bytes':>12s} {'kept':>6s} {'seconds':>7s}  answer")
    full_text, full_bytes, seconds = _answer(model, tokenizer, context, DEMO_QUESTION, None, args.max_new_tokens)
    print(f"{'none':{w}s} {0:5.2f} {full_bytes:12,d} {1:6.0%} {seconds:7.1f}  {full_text!r}")
    for name in names:
        press = _press(name, args.ratio, None)
        text, kept, seconds = _answer(model, tokenizer, context, DEMO_QUESTION, press, args.max_new_tokens)
        mark = "" if DEMO_ANSWER in text else "  (fact lost)"
        print(f"{name:{w}s} {_ratio_cell(press)} {kept:12,d} {kept / full_bytes:6.0%} {seconds:7.1f}  {text!r}{mark}")
    print("\nthe first press inside model.generate (context and question in one prompt, compressed in the "
          "prefill):\n  with press(model, tokenizer=tokenizer): model.generate(ids)")  # fmt: skip
    press = _press(names[0], args.ratio, None)
    text, kept, seconds = _generate_inside(model, tokenizer, context, press, args.max_new_tokens)
    mark = "" if DEMO_ANSWER in text else "  (fact lost)"
    print(f"{names[0]:{w}s} {_ratio_cell(press)} {kept:12,d} {kept / full_bytes:6.0%} {seconds:7.1f}  {text!r}{mark}")
    return 0


def _ratio_cell(press) -> str:
    """The demo table's ratio column: the press's compression ratio, or '-' for a fixed token budget."""
    ratio = getattr(press, "compression_ratio", None)
    return f"{'-':>5s}" if ratio is None else f"{ratio:5.2f}"


def _generate_inside(model, tokenizer, context: str, press, max_new_tokens: int) -> tuple[str, int, float]:
    """(answer, KV bytes held at the end, seconds) of `model.generate` on the whole prompt inside `press`."""
    import torch
    from transformers import DynamicCache

    import kvpress
    from kvpress.engine import maybe_installed

    ids = torch.cat(kvpress.pipeline.split_prompt(tokenizer, context, DEMO_QUESTION), dim=-1).to(model.device)
    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    with maybe_installed(press, model, tokenizer):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=max_new_tokens,
                             **kvpress.pipeline.greedy(tokenizer))  # fmt: skip
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
    return text, kvpress.cache_bytes(cache), time.perf_counter() - start


def _spec(args: argparse.Namespace, model=None) -> str:
    """The press spec `--press`, `--ratio` and `--max-tokens` name, budget included (what a saved cache records);
    no `--press` (or `default`) is `model`'s default press."""
    from kvpress.presses import resolve_default

    if args.press == "none":
        return "none"
    name = args.press or "default"
    budget = "".join(f":{key}={value}" for key, value in _budget(name, args.ratio, args.max_tokens).items())
    return resolve_default(name + budget, model)


def cmd_generate(args: argparse.Namespace) -> int:
    import kvpress

    path = Path(args.context_file)
    if not path.is_file():
        print(f"kvpress generate: --context-file {path} does not exist", file=sys.stderr)
        return 2
    model, tokenizer = kvpress.load_model(args.model)
    spec = _spec(args, model)
    if args.load_cache:
        spec = kvpress.saved_cache.read_metadata(args.load_cache)["press"] or "none"  # continued by its own press
    press = None if spec == "none" else kvpress.press_from_name(spec)
    if args.save_cache or args.load_cache:
        text, kv_bytes, seconds = _answer_saved(model, tokenizer, path.read_text(), args, press, spec)
    else:
        text, kv_bytes, seconds = _answer(model, tokenizer, path.read_text(), args.question, press,
                                          args.max_new_tokens, args.query_aware, args.prefill_chunk_size)  # fmt: skip
    print(text)
    print(f"[{spec}: {kv_bytes:,d} KV bytes held, {seconds:.1f} s]", file=sys.stderr)
    return 0


def _answer_saved(model, tokenizer, context: str, args: argparse.Namespace, press, spec: str):
    """`_answer` through a saved cache: the compressed context is written to `--save-cache`, or read from
    `--load-cache` (the same context's, checked by its length) instead of being prefilled."""
    import torch
    from transformers import DynamicCache

    import kvpress
    from kvpress.pipeline import answer_from_cache, check_compresses, prefill_context, split_prompt

    ctx_ids, q_ids = split_prompt(tokenizer, context, args.question)
    check_compresses(press, ctx_ids.shape[1])  # as kvpress.generate: a budget that holds the whole context
    start = time.perf_counter()
    if args.load_cache:
        cache = kvpress.load_cache(args.load_cache, model)
        if cache.get_seq_length() != ctx_ids.shape[1]:
            raise ValueError(f"--load-cache {args.load_cache} holds a context of {cache.get_seq_length()} tokens; "
                             f"--context-file has {ctx_ids.shape[1]}: give the document it was saved from")  # fmt: skip
    else:
        cache = DynamicCache(config=model.config)
        prefill_context(model, ctx_ids, press, cache, tokenizer, prefill_chunk_size=args.prefill_chunk_size)
        kvpress.save_cache(cache, args.save_cache, model, press=spec)
    ids = torch.cat([ctx_ids, q_ids], dim=-1)
    text = answer_from_cache(model, tokenizer, ids, cache, press, args.max_new_tokens)
    return text, kvpress.cache_bytes(cache), time.perf_counter() - start


def cmd_calibrate_heads(args: argparse.Namespace) -> int:
    import kvpress
    from kvpress.calibrate_heads import calibrate_heads
    from kvpress.patterns import save_pattern

    model, tokenizer = kvpress.load_model(args.model)
    name = args.model or kvpress.models.DEFAULT_MODEL
    pattern = calibrate_heads(model, tokenizer, name, **_trainer_args(calibrate_heads, args))
    save_pattern(pattern, args.out)
    flat = sorted(((s, layer, head) for layer, row in enumerate(pattern["scores"]) for head, s in enumerate(row)))
    top = ", ".join(f"L{layer}H{head} {s:.3f}" for s, layer, head in reversed(flat[-5:]))
    print(f"wrote {args.out}: {pattern['layers']} layers x {pattern['kv_heads']} KV heads; passkey accuracy "
          f"{pattern['passkey_accuracy']:.0%}; top heads: {top}")
    return 0


def cmd_train_scorer(args: argparse.Namespace) -> int:
    import kvpress
    from kvpress.scorers import load_scorer, save_scorer
    from kvpress.train_scorer import PROFILE_RATIOS, profile_scorer, train_scorer
    from kvpress.words import word_edges

    model, tokenizer = kvpress.load_model(args.model)
    name = args.model or kvpress.models.DEFAULT_MODEL
    if args.update_profile:
        scorer = profile_scorer(model, tokenizer, load_scorer(args.out))
        save_scorer(scorer, args.out)
        print(f"wrote {args.out}: layer profile at ratios {list(PROFILE_RATIOS)} on "
              f"{scorer.training['profile_texts']} training texts")  # (what profile_scorer read)
        return 0
    if args.update_words:
        scorer = load_scorer(args.out)
        scorer.check(model)
        scorer.word_edges = word_edges(tokenizer, model.get_input_embeddings().num_embeddings)
        scorer.__post_init__()
        save_scorer(scorer, args.out)
        joined = int(scorer.word_edges.all(-1).sum())
        print(f"wrote {args.out}: word table of {scorer.word_edges.shape[0]} token ids ({joined} can sit inside a "
              "word)")
        return 0
    scorer = train_scorer(model, tokenizer, name, **_trainer_args(train_scorer, args))
    save_scorer(scorer, args.out)
    fit = scorer.training["test"]
    print(f"wrote {args.out}: {scorer.weight.shape[0]} layers x {scorer.weight.shape[2]} KV heads; on "
          f"{args.held_out} test texts: R^2 of log scores {fit['r2_log_score']:.3f}, Spearman {fit['spearman']:.3f}, "
          f"KVzip's kept tokens kept at r = 0.5: {fit['kept_agreement_r0.5']:.1%}, at r = 0.75: "
          f"{fit['kept_agreement_r0.75']:.1%}")  # fmt: skip
    return 0


def cmd_train_gates(args: argparse.Namespace) -> int:
    import kvpress
    from kvpress.gates import save_gates
    from kvpress.train_gates import train_gates

    model, tokenizer = kvpress.load_model(args.model)
    name = args.model or kvpress.models.DEFAULT_MODEL
    gates = train_gates(model, tokenizer, name, **_trainer_args(train_gates, args))
    save_gates(gates, args.out)
    fit = gates.training["test"]
    print(f"wrote {args.out}: {gates.weight.shape[0]} layers x {gates.weight.shape[2]} KV heads; on {args.held_out} "
          f"test texts, averaged over layers: output error {fit['error']:.4f} with the learned roles, "
          f"{fit['shuffled_error']:.4f} with them shuffled; cache held {fit['held']:.3f}")  # fmt: skip
    return 0


def cmd_presses(args: argparse.Namespace) -> int:
    from kvpress.presses import press_table

    print(press_table())
    return 0


# a trainer's (or calibration's) arguments that are not its command's flags
_NOT_FLAGS = ("model", "tokenizer", "name", "log", "progress")


def _trainer(sub, command: str, fn, help: str, out: str = "the safetensors file to write", **helps: str
             ) -> argparse.ArgumentParser:  # fmt: skip
    """The subcommand `command` that runs the trainer (or calibration) `fn`: `--model`, `--out` (`out`: its help),
    and a flag per keyword of `fn`, its default and type from `fn`'s signature (`helps`: their help texts; texts
    and tokens have theirs)."""
    from kvpress.models import MODEL_HELP

    helps = {"texts": "training texts", "tokens": "tokens per text", **helps}
    parser = sub.add_parser(command, help=help)
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    parser.add_argument("--out", required=True, help=out)
    for param in inspect.signature(fn).parameters.values():
        if param.name in _NOT_FLAGS:
            continue
        flag = f"--{param.name.replace('_', '-')}"
        if isinstance(param.default, bool):  # --flag / --no-flag (argparse's type=bool would read "False" as true)
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=param.default,
                                help=helps.get(param.name))  # fmt: skip
        else:
            parser.add_argument(flag, type=type(param.default), default=param.default, help=helps.get(param.name))
    return parser


def _trainer_args(fn, args: argparse.Namespace) -> dict:
    """The keywords of the trainer `fn` from its command's flags (see `_trainer`)."""
    return {name: getattr(args, name) for name in inspect.signature(fn).parameters if name not in _NOT_FLAGS}


def _check_update(args: argparse.Namespace) -> None:
    """`train-scorer --update-profile` and `--update-words` change the scorer in --out and train nothing: one at a
    time, and no training flag beside them."""
    from kvpress.train_scorer import train_scorer

    if args.update_profile and args.update_words:
        raise ValueError("--update-profile and --update-words: give one (run the command twice for both)")
    if args.update_profile or args.update_words:
        flag = "--update-profile" if args.update_profile else "--update-words"
        given = [f"--{name.replace('_', '-')}" for name, value in _trainer_args(train_scorer, args).items()
                 if value != inspect.signature(train_scorer).parameters[name].default]  # fmt: skip
        if given:
            raise ValueError(f"{flag} trains nothing, so {', '.join(given)} would be ignored: drop them")
        from kvpress.scorers import load_scorer

        load_scorer(args.out)  # the scorer it changes: read (and checked) before the model loads


def _check_generate(args: argparse.Namespace) -> None:
    """Refuse `kvpress generate` flags that cannot go together, before a model loads."""
    for flag in ("press", "load_cache", "save_cache", "context_file"):  # (an empty one was taken as not given)
        value = getattr(args, flag)
        if value is not None and not value.strip():
            raise ValueError(f"--{flag.replace('_', '-')} is empty: give a value or leave the option out")
    if args.ratio is not None and args.max_tokens is not None:
        raise ValueError("--ratio and --max-tokens: give one budget")
    context = Path(args.context_file)
    if context.exists() and not context.is_file():
        raise ValueError(f"--context-file {context} is not a file")
    if context.is_file():
        try:
            text = context.read_text()
        except UnicodeDecodeError as err:
            raise ValueError(f"--context-file {context} is not UTF-8 text ({err.reason} at byte {err.start})") from None
        if not text.strip():
            raise ValueError(f"--context-file {context} holds no text")
    if args.save_cache and args.load_cache:
        raise ValueError("--save-cache and --load-cache: give one (a cache is saved once, then loaded)")
    if (args.save_cache or args.load_cache) and args.query_aware:
        raise ValueError("a saved cache holds the context compressed without the question: drop --query-aware")
    if args.load_cache and (args.press or args.ratio is not None or args.max_tokens is not None):
        raise ValueError("--load-cache continues the cache with the press it was saved with: drop --press, "
                         "--ratio and --max-tokens")  # fmt: skip
    if args.load_cache and args.prefill_chunk_size is not None:
        raise ValueError("--load-cache answers from a cache already prefilled: drop --prefill-chunk-size")
    if not args.question.strip():
        raise ValueError("--question is empty: ask something")
    from kvpress.pipeline import check_chunk_size

    check_chunk_size(args.prefill_chunk_size)  # (a size no chunk can have, before the model loads)
    if args.press == "none" and (args.ratio is not None or args.max_tokens is not None or args.query_aware):
        raise ValueError("--press none keeps the whole cache: drop --ratio, --max-tokens and --query-aware, or name "
                         "a press")  # fmt: skip
    if args.load_cache:
        from kvpress.saved_cache import read_metadata

        read_metadata(args.load_cache)  # a missing or foreign file is named before the model loads
    elif args.press != "none":
        press = _check_press(args.press or "default", args.ratio, args.max_tokens, args.model)
        if press is not None and press.needs_question and not args.query_aware and not args.save_cache:
            raise ValueError(f"{type(press).__name__} scores by the question: add --query-aware")
        check_chunk_size(args.prefill_chunk_size, press)  # (a press that cannot prefill in chunks, named)
        if args.save_cache and press is not None and press.needs_question:
            raise ValueError(f"--save-cache: {type(press).__name__} scores by the question, and a saved cache holds "
                             "the context compressed without it: save the cache of another press")  # fmt: skip
        if args.save_cache and press is not None and press.recalls:
            raise ValueError(f"--save-cache: {type(press).__name__} keeps its evicted tokens in host memory, which a "
                             "saved cache does not hold: save the cache of its inner press")  # fmt: skip


COUNTS = {"max_new_tokens": 1, "max_tokens": 1, "examples": 1, "length": 100, "seed": 0, "texts": 1, "held_out": 1,
          "tokens": 64, "window": 1, "epochs": 1}  # the least value of each count flag a command takes


def check_counts(args: argparse.Namespace, least: dict[str, int] = COUNTS) -> None:
    """Refuse counts no command can run with, naming the flag and the allowed values (`least`: flag name -> the
    least value; flags a command lacks are skipped). Used by the benchmarks' parsers too."""
    for name, bound in least.items():
        value = getattr(args, name, None)
        if value is not None and value < bound:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {bound}, got {value}")


def main(argv: list[str] | None = None) -> int:
    import kvpress

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("lm-eval", "sweep"):  # the eval bridge's commands parse their own arguments
        try:
            if argv[0] == "lm-eval":
                from kvpress.eval.lm_eval_bridge import main as eval_main
            else:
                from kvpress.eval.sweep import main as eval_main
        except ImportError as err:
            print(f"kvpress {argv[0]} needs the eval extra: pip install 'kvpress[eval]' ({err})", file=sys.stderr)
            return 2
        return eval_main(argv[1:])

    parser = argparse.ArgumentParser(prog="kvpress", description="KV-cache compression for transformers")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="answer a question about a long document with and without compression")
    demo.add_argument("--model", default=None, help=kvpress.models.MODEL_HELP)
    shown = "default,snapkv,h2o,sink-window,knorm,random"
    demo.add_argument("--presses", default=shown,
                      help=f"comma-separated press names, `default` the model's own (default: {shown})")
    demo.add_argument("--ratio", type=float, default=None,
                      help="compression ratio in [0, 1) (default 0.5 where a press spec sets no budget of its own)")
    demo.add_argument("--max-new-tokens", type=int, default=16)
    demo.set_defaults(fn=cmd_demo)

    gen = sub.add_parser("generate", help="answer --question about --context-file with a press")
    gen.add_argument("--press", default=None,
                     help=f"one of: none, default, {', '.join(sorted(kvpress.PRESSES))} (default: the model's "
                          "default press, kvpress/presses/defaults.json)")  # fmt: skip
    gen.add_argument("--query-aware", action="store_true",
                     help="compress the context with the question (it guides the scores; the cache serves it alone)")
    gen.add_argument("--ratio", type=float, default=None,
                     help="compression ratio in [0, 1) (default 0.5 where --press sets no budget of its own)")
    gen.add_argument("--max-tokens", type=int, default=None, help="a fixed token budget instead of --ratio")
    gen.add_argument("--context-file", required=True)
    gen.add_argument("--question", required=True)
    gen.add_argument("--model", default=None, help=kvpress.models.MODEL_HELP)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--prefill-chunk-size", type=int, default=None,
                     help="prefill the context this many tokens a forward, evicting after each (default: one forward)")
    gen.add_argument("--save-cache", default=None, help="write the compressed context's cache to this file")
    gen.add_argument("--load-cache", default=None,
                     help="answer from a cache --save-cache wrote for the same --context-file (its press is used)")
    gen.set_defaults(fn=cmd_generate)

    presses = sub.add_parser("presses", help="the presses, their parameters and defaults (the README's table)")
    presses.set_defaults(fn=cmd_presses)

    sub.add_parser("lm-eval", help="run lm-eval with --model kvpress (all lm-eval flags; kvpress tasks included)")
    sub.add_parser("sweep", help="score vs kept KV memory for presses x ratios, one prefill per example")
    from kvpress.calibrate_heads import calibrate_heads
    from kvpress.train_gates import train_gates
    from kvpress.train_scorer import train_scorer

    cal = _trainer(sub, "calibrate-heads", calibrate_heads, "find retrieval heads and write a head pattern for "
                   "DuoAttention", out="the JSON file to write", examples="passkey prompts",
                   length="tokens per passkey prompt")  # fmt: skip
    cal.set_defaults(fn=cmd_calibrate_heads)
    train = _trainer(sub, "train-scorer", train_scorer, "fit KVzapPress's per-layer scorers to KVzip's scores on "
                     "offline text", held_out="validation texts, and as many test texts",
                     attention_mass="also read the attention each token received, and how many queries saw it "
                                    "(Scorer.mass_weight)")  # fmt: skip
    train.add_argument("--update-profile", action="store_true",
                       help="only measure again the layer profile of the scorer in --out, on its own training texts")
    train.add_argument("--update-words", action="store_true",
                       help="only add to the scorer in --out the model's word table (KVzapPress's whole_words)")
    train.set_defaults(fn=cmd_train_scorer)
    gates = _trainer(sub, "train-gates", train_gates, "fit NAtSPress's per-layer role gates (model frozen) on "
                     "offline text", held_out="test texts", window="tokens the sliding-window role keeps a token for",
                     sparsity="weight of the cache held in the loss", lr="Adam's learning rate")  # fmt: skip
    gates.set_defaults(fn=cmd_train_gates)

    args = parser.parse_args(argv)
    try:
        check_counts(args)  # before any model loads
        if args.command == "demo":
            for name in args.presses.split(","):
                if name == "none":
                    raise ValueError("--presses none: the demo prints the full cache's row (none) before the presses' "
                                     "rows: name presses only")  # fmt: skip
                press = _check_press(name, args.ratio, None, args.model)  # validate before loading the model
                if press is not None and press.needs_question:
                    raise ValueError(f"--presses {name}: {type(press).__name__} scores by the question, and the "
                                     "demo compresses the document without it (kvpress generate --query-aware "
                                     "runs it)")  # fmt: skip
        elif args.command == "generate":
            _check_generate(args)
        elif args.command == "train-scorer" and (args.update_profile or args.update_words):
            _check_update(args)  # before the model loads
        elif args.command == "train-scorer":  # the trainer's own checks, before the model loads
            from kvpress.train_scorer import check_arguments, train_scorer

            check_arguments(**_trainer_args(train_scorer, args))  # (tokens past the training text)
        elif args.command == "train-gates":
            from kvpress.train_gates import check_arguments, train_gates

            check_arguments(**_trainer_args(train_gates, args))  # (lr, sparsity, tokens past the training text)
        from kvpress.files import check_writable

        for flag in ("out", "save_cache"):  # files written after the run (by writers that make no directory)
            if getattr(args, flag, None) is not None:
                check_writable(getattr(args, flag), f"--{flag.replace('_', '-')}", makes_directories=False)
        return args.fn(args)
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"kvpress {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
