"""Property tests over generated cases: presses x parameters x prompt lengths x padding x families x sdpa/eager.

Each case is drawn from a seeded generator (`random.Random(SEED + i)`), so a failure names a case that can be
run again alone. For every case: building the press and generating with it either works or raises a
documented `ValueError`/`TypeError` (a refusal that names the problem); when it works, every compressible
layer counts the tokens seen (positions stay right), holds no more than the press's budget of what it would
hold without the press, and a sliding-window layer holds no more than its window; r = 0 gives exactly the
tokens of no press. Bad parameter values are refused when the press is built, never later.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import DynamicCache

from kvpress.patches.cache import PressedLayer
from kvpress.patches.head_cache import HeadwiseLayer
from kvpress.patterns import config_hash
from kvpress.presses import BUDGET_PARAMETERS, press_from_name, press_names, press_parameters
from tiny import left_padded, prompt, tiny_model

SEED = 18_000
CASES = 120
FAMILIES = ["llama", "llama3", "qwen2", "qwen3", "mistral", "mistral-window", "phi3", "gemma3"]
# KVzip and Lookahead score the whole context in a pass of their own: tests/test_kvzip.py, test_lookahead.py
PRESSES = [n for n in press_names() if not press_from_name(n, compression_ratio=0.5).needs_whole_context]
NEW_TOKENS = 6
# values drawn for a parameter, by the type of its default (None: left at its default)
SMALL_INTS = {"window_size": (0, 12), "kernel_size": (0, 3), "n_sink": (0, 6), "window": (1, 12),
              "chunk": (1, 64), "chunk_size": (1, 12), "seed": (0, 9), "similarity_window": (2, 40),
              "span_size": (1, 40), "recall_every": (0, 4)}  # fmt: skip
ODD = {"kernel_size"}  # drawn as 2 k + 1
ALWAYS = {"window_size"}  # its default (64) would outgrow these prompts
FLOATS = {"alpha_safeguard": (0.0, 1.0), "first_stage_ratio": (0.0, 1.0), "recall_fraction": (0.0, 1.0),
          "decode_slack": (0.0, 0.3), "beta": (1.0, 30.0)}  # fmt: skip


def _pattern(model, rng: random.Random) -> dict:
    config = model.config.get_text_config(decoder=True)
    scores = [[rng.random() for _ in range(config.num_key_value_heads)] for _ in range(config.num_hidden_layers)]
    return {"model": "tiny", "config_hash": config_hash(model), "scores": scores}


def _case(i: int) -> dict:
    rng = random.Random(SEED + i)
    family, attn, name = rng.choice(FAMILIES), rng.choice(["sdpa", "eager"]), rng.choice(PRESSES)
    params: dict = {}
    for param, default in press_parameters(name).items():
        if param in BUDGET_PARAMETERS or (param not in ALWAYS and rng.random() < 0.4):
            continue
        if name == "sink-window" and param == "window":
            continue  # its window is its budget: drawn below as one
        if param in SMALL_INTS:
            params[param] = rng.randint(*SMALL_INTS[param]) * (2 if param in ODD else 1) + (param in ODD)
        elif param in FLOATS:
            params[param] = round(rng.uniform(*FLOATS[param]), 3)
        elif isinstance(default, bool) and param != "rerotate":
            params[param] = rng.random() < 0.5
    if name == "sink-window" and rng.random() < 0.3:
        params["rerotate"] = True
    if rng.random() < 0.3:
        budget = {"max_tokens": rng.choice([1, 4, 9, 30])}
    else:
        budget = {"compression_ratio": rng.choice([0.0, 0.0, 0.25, 0.5, 0.75, 0.9])}
    if name == "duo-attention":
        budget = {"compression_ratio": budget.get("compression_ratio", 0.5)}
        params = {k: v for k, v in params.items() if k in ("n_sink", "window")}
    lengths = [rng.randint(1, 50)] + ([rng.randint(1, 50)] if rng.random() < 0.35 else [])
    return {"family": family, "attn": attn, "name": name, "params": params, "budget": budget,
            "lengths": lengths, "seed": rng.randrange(1000), "rng": rng}  # fmt: skip


def _inputs(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of these lengths, left-padded to the longest."""
    return left_padded([prompt(1, n, seed=seed + row)[0] for row, n in enumerate(lengths)])


def _generate(model, ids, mask, press=None, cache=None):
    kw = {"attention_mask": mask, "max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False,
          "pad_token_id": 0, "cache": cache}  # fmt: skip
    if press is None:
        return model.generate(ids, **kw)
    with press(model):
        return model.generate(ids, **kw)


def _check_layers(press, model, cache, lengths: list[int]) -> None:
    n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    seen = max(lengths) + NEW_TOKENS - 1  # the last token generated is not fed back
    for idx, layer in enumerate(cache.layers):
        if not isinstance(layer, (PressedLayer, HeadwiseLayer)):
            continue
        assert layer.seen == seen, f"layer {idx} counts {layer.seen} tokens, not {seen}"
        assert layer.real_seen.tolist() == [n + NEW_TOKENS - 1 for n in lengths], f"layer {idx}: real tokens per row"
        if isinstance(layer, HeadwiseLayer):
            held = layer.held().float().mean(-1)  # AdaKV moves budget between heads: the mean per head holds it
        else:
            held = layer.held()
        if layer.window is not None:
            assert int(layer.held().max()) <= layer.window - 1, f"sliding layer {idx} holds past its window"
        if type(press).__name__ == "DuoAttentionPress":
            continue  # its budget is a split of whole and streaming heads, checked in test_headwise
        budget = torch.tensor(press.row_budgets(idx, n_layers, layer.span_list()))
        assert bool((held.to(budget.device) <= budget).all()), f"layer {idx} holds {held.tolist()} > {budget.tolist()}"


@pytest.mark.parametrize("i", range(CASES))
def test_generated_case(i):
    case = _case(i)
    model = tiny_model(case["family"], case["attn"])
    kwargs = {**case["params"], **case["budget"]}
    if case["name"] == "duo-attention":
        kwargs["head_pattern"] = _pattern(model, case["rng"])
    try:
        press = press_from_name(case["name"], **kwargs)
    except (ValueError, TypeError) as refused:
        assert str(refused), "a refusal names the problem"
        pytest.skip(f"refused when built: {refused}")
    ids, mask = _inputs(case["lengths"], case["seed"])
    cache = DynamicCache(config=model.config)
    try:
        out = _generate(model, ids, mask, press, cache)
    except (ValueError, TypeError) as refused:  # documented refusals, e.g. rerotate=True on sliding layers
        assert str(refused)
        pytest.skip(f"refused: {refused}")
    _check_layers(press, model, cache, case["lengths"])
    if kwargs.get("compression_ratio") == 0.0:
        assert torch.equal(out, _generate(model, ids, mask)), "r = 0 changed the generated tokens"


def test_most_generated_cases_run():
    """The generator draws cases that mostly run (refusals are checked, but a run checks more)."""
    refused = 0
    for i in range(CASES):
        case = _case(i)
        try:
            press_from_name(case["name"], **case["params"], **case["budget"],
                            **({"head_pattern": {}} if case["name"] == "duo-attention" else {}))  # fmt: skip
        except (ValueError, TypeError):
            refused += 1
    assert refused <= CASES // 4, f"{refused} of {CASES} generated presses are refused when built"


BAD = [-1, True, 1.5, math.nan, math.inf, "3", None, [1]]


@pytest.mark.parametrize("i", range(32))
def test_bad_parameter_values_are_refused_when_the_press_is_built(i):
    """A parameter given a value of the wrong type, or out of its range, raises ValueError/TypeError at once."""
    rng = random.Random(SEED - 1 - i)
    name = rng.choice(PRESSES)
    params = [p for p, d in press_parameters(name).items() if p in SMALL_INTS or p in FLOATS]
    if not params:
        pytest.skip(f"{name} has no numeric parameter")
    param, value = rng.choice(params), rng.choice(BAD)
    if param in FLOATS and value in (-1,) and FLOATS[param][0] < 0:
        pytest.skip("a value in range")
    with pytest.raises((ValueError, TypeError), match=param):
        press_from_name(name, compression_ratio=0.5, **{param: value})
