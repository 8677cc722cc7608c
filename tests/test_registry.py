"""One registry: press names, parameters, the spec grammar and the README's table all come from the classes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvpress
from kvpress.presses import (
    BUDGET_PARAMETERS,
    PRESSES,
    aliases,
    parse_press_spec,
    press_class,
    press_from_name,
    press_names,
    press_parameters,
    press_table,
)

README = Path(__file__).resolve().parent.parent / "README.md"


def _other_value(default):
    """A valid value other than `default` for the parameters every press checks the same way."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 2  # keeps odd kernels odd
    if isinstance(default, float):
        return default + 0.1 if default < 0.8 else default + 2.0
    return None


def _values(press, param) -> list:
    """The values of `param` on `press` and on the press it wraps."""
    return [vars(p)[param] for p in (press, getattr(press, "press", None)) if p is not None and param in vars(p)]


@pytest.mark.parametrize("name", press_names())
def test_every_parameter_reaches_the_press(name):
    checked = 0
    for param, default in press_parameters(name).items():
        value = _other_value(default)
        if param in BUDGET_PARAMETERS or value is None:
            continue
        if name == "kvzip" and param in ("global_budget",):
            value = 0.25
        press = press_from_name(f"{name}:{param}={value}", compression_ratio=0.5)
        assert value in _values(press, param), (name, param)
        checked += 1
    own = [p for p in press_parameters(name) if p not in BUDGET_PARAMETERS]
    assert checked or not own or name == "duo-attention"


def test_unknown_parameter_names_the_allowed_ones():
    with pytest.raises(ValueError, match="press 'knorm' takes no parameter window_size; its parameters: compression"):
        press_from_name("knorm:window_size=4", compression_ratio=0.5)
    with pytest.raises(ValueError, match="takes no parameter lookahead"):
        press_from_name("adakv:inner=kvzip:lookahead=3", compression_ratio=0.5)
    assert press_from_name("adakv:inner=lookahead:lookahead=3", compression_ratio=0.5).press.lookahead == 3


def test_names_aliases_and_classes():
    assert set(press_names()) | {a for n in press_names() for a in aliases(n)} == set(PRESSES)
    assert aliases("h2o") == ["heavy-hitter"] and aliases("sink-window") == ["streaming-llm"]
    for name in press_names():
        assert isinstance(press_from_name(name, compression_ratio=0.5), press_class(name))
        assert getattr(kvpress, press_class(name).__name__) is press_class(name)  # exported


def test_readme_table_is_the_registry():
    text = README.read_text()
    table = re.search(r"<!-- presses -->\n(.*?)\n<!-- /presses -->", text, re.S)
    assert table, "README.md needs the press table between <!-- presses --> and <!-- /presses -->"
    assert table.group(1) == press_table(), "regenerate it: kvpress presses"


def test_spec_grammar():
    assert parse_press_spec("snapkv:window_size=16:kernel_size=3") == ("snapkv", {"window_size": 16, "kernel_size": 3})


def _annotated(name: str) -> dict[str, tuple]:
    """Each parameter of the press named `name` (its factory's and its class's) with its annotated types."""
    import typing

    hints = {**typing.get_type_hints(press_class(name)), **typing.get_type_hints(PRESSES[name])}
    return {param: typing.get_args(hints[param]) or (hints[param],) for param in press_parameters(name)
            if param in hints}  # fmt: skip


@pytest.mark.parametrize("name", press_names())
def test_wrong_types_and_non_finite_numbers_are_refused_when_built(name):
    """Derived from the annotations: an int parameter refuses True, a float one refuses NaN and infinity."""
    checked = 0
    for param, kinds in _annotated(name).items():
        if param in ("compression_ratio", "max_tokens") or param not in press_parameters(name):
            continue
        bad = [True] if int in kinds and bool not in kinds else []
        bad += [float("nan"), float("inf")] if float in kinds else []
        for value in bad:
            with pytest.raises((TypeError, ValueError), match=param):
                press_from_name(name, compression_ratio=0.5, **{param: value})
            checked += 1
    assert checked or name in ("knorm", "keydiff")
    with pytest.raises(ValueError, match="compression_ratio"):
        press_from_name(name, compression_ratio=float("nan"))


def test_press_names_must_be_text():
    with pytest.raises(TypeError, match="a press is named by a string"):
        press_from_name(None)
    with pytest.raises(TypeError, match="second argument is the model .* got 0.5: give the budget by name"):
        press_from_name("snapkv", 0.5, max_tokens=256)  # (the 0.5 is not a ratio: it was dropped)


def test_command_help_lists_the_models_and_tasks_there_are(capsys):
    """The --model help named 'SmolLM2-135M', which --model refuses, and no packaged name; --tasks named none."""
    from kvpress.cli import main
    from kvpress.eval.tasks import TASKS
    from kvpress.models import DEFAULT_MODEL, PACKAGED_MODELS

    for argv in (["generate", "--help"], ["sweep", "--help"], ["train-scorer", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        said = " ".join(capsys.readouterr().out.split())  # (argparse wraps its lines)
        assert all(name in said for name in PACKAGED_MODELS) and f"default {DEFAULT_MODEL}" in said, argv
        assert argv[0] != "sweep" or all(f"{task}," in said or f"{task} (" in said for task in TASKS)
