"""The default press: what a user gets without choosing, per model, and why.

`defaults.json` (next to this file) is the one place the choice is written: `any` is the press for a model
with no entry of its own (it must need no file made for a model), `models` the press chosen for each packaged
model, found by its architecture hash (as head patterns and scorers are), each with the reason and the
results it was chosen on. The rule (issue 19): a sweep on tuning seeds ranks presses by their worst cell, then
their mean (`python -m kvpress.eval.ranking`); among presses level with the leader within its intervals, the
one that needs no second pass over the prompt (its prefill inside `model.generate` near no press's) is chosen,
unless the report seed refutes the tie (then the leader: SmolLM2 at 4K, where KVzap lost the essay needles).
`default` as a press name (CLI, sweeps, lm-eval's `press=`, `press_from_name`) means the model's default press,
its parameters after colons kept: `default:kv_bits=4` (`kvpress.presses.resolve_default`, beside the spec grammar).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from torch import nn

from kvpress.patterns import config_hash

_FILE = Path(__file__).with_name("defaults.json")
NAME = "default"


@functools.cache
def _table() -> dict:
    return json.loads(_FILE.read_text())


def default_press(model: nn.Module | None = None) -> str:
    """The default press spec for `model` (by architecture hash), or the one for any model when it has no entry
    of its own or is not given."""
    if model is not None:
        wanted = config_hash(model)
        for entry in _table()["models"].values():
            if entry["config_hash"] == wanted:
                return entry["press"]
    return _table()["any"]["press"]


def default_for(name: str | None) -> str | None:
    """The default press spec of the packaged model `name` (as sweeps name models), None for another name."""
    entry = _table()["models"].get(name)
    return None if entry is None else entry["press"]


DEFAULT_PRESS = default_press()  # the press for any model (the `any` entry)
