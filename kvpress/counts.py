"""Whole-number arguments (counts, sizes) checked as a function is called, named when refused: a float or a bool
gave raw TypeErrors deep inside (or, for a bool, ran as 1)."""

from __future__ import annotations


def check_whole(**least: tuple[object, int]) -> None:
    """Refuse each `name=(value, least)` whose value is not an integer of at least `least`, naming it."""
    for name, (value, bound) in least.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < bound:
            raise ValueError(f"{name} must be an integer >= {bound}, got {value!r}")
