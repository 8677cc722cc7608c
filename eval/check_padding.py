"""Padded batches on a real model: each row of a left-padded batch gets, token for token, what it gets alone.

    python -m kvpress.eval.check_padding [--model smollm2-135m] [--presses default,snapkv,...] [--ratio 0.5]

Three prompts of different lengths (the demo document at 150, 300 and 450 words, with its question) are generated
greedily, each alone and the three together, left-padded, for every press of the registry and the model's default
(`default`); a row is equal when its tokens match the row alone's up to that one's end-of-sequence. A press that
refuses a padded batch (it scores a prompt whole, or one at a time) is recorded with its message. Writes
`eval/results/padding-<model>.json` after each press and resumes from it (a press already there is skipped; a file
measured with another ratio, token count or model is refused).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import kvpress
from kvpress.cli import DEMO_QUESTION, demo_document
from kvpress.files import write_text_whole
from kvpress.models import DEFAULT_MODEL
from kvpress.presses import press_from_name, press_names, resolve_default

RESULTS = Path(__file__).resolve().parent / "results"
WORDS = (150, 300, 450)


def _rows(press, model, tokenizer, texts: list[str], new: int) -> tuple[list[list[int]], list[list[int]]]:
    """The greedy tokens of each text alone, and of each row of the texts left-padded together."""
    settings = {"max_new_tokens": new, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    with press(model, tokenizer=tokenizer):
        alone = []
        for text in texts:
            ids = tokenizer(text, return_tensors="pt").input_ids
            alone.append(model.generate(ids, attention_mask=torch.ones_like(ids), **settings)[0, ids.shape[1] :])
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        together = model.generate(**batch, **settings)[:, batch.input_ids.shape[1] :]
    return [row.tolist() for row in alone], [row.tolist() for row in together]


def check(press, model, tokenizer, texts: list[str], new: int) -> dict:
    """One press's rows: equal or not, and where the first differs (None: equal)."""
    try:
        alone, together = _rows(press, model, tokenizer, texts, new)
    except ValueError as error:
        return {"refused": str(error)}
    # a row alone stops at its end-of-sequence; in the batch it is padded after it: compare up to it
    first = [next((i for i, (a, b) in enumerate(zip(row, other[: len(row)], strict=True)) if a != b), None)
             for row, other in zip(alone, together, strict=True)]  # fmt: skip
    return {"rows_equal": [f is None for f in first], "first_difference": first, "tokens": [len(r) for r in alone]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--presses", default=None, help="comma-separated specs (default: `default` and every press)")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--new", type=int, default=24, help="tokens generated per row")
    args = parser.parse_args(argv)
    if not 0 <= args.ratio < 1:
        parser.error(f"--ratio must be in [0, 1), got {args.ratio}")
    if args.new < 1:
        parser.error(f"--new must be a positive number of tokens, got {args.new}")
    specs = args.presses.split(",") if args.presses else ["default", *press_names()]
    for spec in specs:  # before the model loads (`default` names the model's press, known once it loads)
        if spec.split(":")[0] != "default":
            try:
                press_from_name(spec, compression_ratio=args.ratio)
            except (ValueError, TypeError) as error:
                parser.error(str(error))
    out = RESULTS / f"padding-{Path(args.model).name or args.model}.json"  # (a local directory: its name)
    settings = {"model": args.model, "ratio": args.ratio, "words": list(WORDS), "new_tokens": args.new}
    result = json.loads(out.read_text()) if out.exists() else {**settings, "presses": {}}
    other = {key: result.get(key) for key in settings if result.get(key) != settings[key]}
    if other:  # its presses were measured so: resuming would label them with this run's settings
        parser.error(f"{out} holds presses measured with {other}, not {({k: settings[k] for k in other})}: give the "
                     "same settings to resume it, or move it away")  # fmt: skip
    model, tokenizer = kvpress.load_model(args.model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    texts = [demo_document(n_words=n) + "\n\nQuestion: " + DEMO_QUESTION + "\nAnswer:" for n in WORDS]
    for spec in specs:
        if spec in result["presses"]:
            continue
        press = press_from_name(resolve_default(spec, model), compression_ratio=args.ratio)
        result["presses"][spec] = row = check(press, model, tokenizer, texts, args.new)
        write_text_whole(out, json.dumps(result, indent=1) + "\n")
        print(spec, row.get("rows_equal", row.get("refused")), flush=True)
    return result


if __name__ == "__main__":
    main()
