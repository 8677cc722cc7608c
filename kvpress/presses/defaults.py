"""The default press: what a user gets without choosing, per model, and why.

`defaults.json` (next to this file) is the one place the choice is written: `any` is the press for a model
with no entry of its own (it must need no file made for a model), `models` the press chosen for each packaged
model, found by its architecture hash (as head patterns and scorers are), each with the reason and the
results it was chosen on. The rule (issue 19): a sweep on tuning seeds ranks presses by their worst cell, then
their mean (`python -m kvpress.eval.ranking`); among presses level with the leader within its intervals, the
one that needs no second pass over the prompt (its prefill inside `model.generate` near no press's) is chosen,
unless the report seed refutes the tie (then the leader: SmolLM2 at 4K, where KVzap lost the essay needles).
`default` as a press name (CLI, sweeps, lm-eval's `press=`, `press_from_name`) means the model's default press,
its parameters after colons kept: `default:kv_bits=4`.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from torch import nn

from kvpress.models import DEFAULT_MODEL
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


def resolve_default(spec: str, model: nn.Module | None = None, keywords: dict | None = None) -> str:
    """`spec` with a leading `default` replaced by `model`'s default press (`with_default`, `keywords` the parameters
    given beside the spec); any other spec unchanged."""
    if not isinstance(spec, str) or spec.partition(":")[0] != NAME:
        return spec
    return with_default(spec, default_press(model), keywords)


def with_default(spec: str, default: str, keywords: dict | None = None) -> str:
    """`spec` (`default`, then parameters or none) as the press spec `default`, each parameter given after `default`
    or in `keywords` (given beside the spec: `press_from_name("default", model, n_sink=8)`; left out of the spec
    returned) in place of the default's own of that name (`default:n_sink=8` over a default with n_sink=4). Given
    `inner`, the default's own parameters that the press with that inner press takes no more (its old inner press's:
    KVzap's `scorer` under `default:inner=snapkv`) are left out; every parameter given is kept (and checked)."""
    keywords = keywords or {}
    _, sep, rest = spec.partition(":")
    given = rest.split(":") if sep else []  # (an empty one stays, for `parse_press_spec` to refuse)
    names = {pair.partition("=")[0] for pair in given} | set(keywords)
    base, *pairs = default.split(":")
    pairs = [pair for pair in pairs if pair.partition("=")[0] not in names]
    if "inner" in names:
        from kvpress.presses import parse_press_spec, press_parameters  # (that module imports this one)

        inner = keywords["inner"] if "inner" in keywords else parse_press_spec(":".join([base, *given]))[1]["inner"]
        taken = press_parameters(base, inner if isinstance(inner, str) else None)
        pairs = [pair for pair in pairs if pair.partition("=")[0] in taken]
    return ":".join([base, *pairs, *given])


def default_before_loading(spec: str, model_name: str | None, keywords: dict | None = None) -> str | None:
    """`spec` resolved before the model `model_name` (a packaged name, a directory, None: the default model) loads,
    to check it early: as that packaged model's default press (`keywords` as in `with_default`), or None for a
    directory (whose default depends on its architecture, known once it loads); any spec but `default` unchanged."""
    if not isinstance(spec, str) or spec.partition(":")[0] != NAME:
        return spec
    default = default_for(model_name or DEFAULT_MODEL)
    return None if default is None else with_default(spec, default, keywords)


DEFAULT_PRESS = default_press()  # the press for any model (the `any` entry)
