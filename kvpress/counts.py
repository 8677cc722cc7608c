"""Whole numbers: arguments (counts, sizes) checked as a function is called, named when refused (a float or a bool
gave raw TypeErrors deep inside, or, for a bool, ran as 1); and the whole part of a share of a count."""

from __future__ import annotations

import math

import torch


def check_whole(**least: tuple[object, int]) -> None:
    """Refuse each `name=(value, least)` whose value is not an integer of at least `least`, naming it."""
    for name, (value, bound) in least.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < bound:
            raise ValueError(f"{name} must be an integer >= {bound}, got {value!r}")


def floor_share(n: int | torch.Tensor, fraction: float) -> int | torch.Tensor:
    """floor(n x fraction) of the decimal `fraction` as written: in binary floating point 90 x 0.7 is
    62.99999999999999, and a budget of compression_ratio=0.7 kept 28 of 90 tokens where it promises 27. `n` may be
    a tensor of counts (float64 floors of the same rounding back)."""
    if isinstance(n, torch.Tensor):
        return torch.round(n.double() * fraction, decimals=9).floor()
    return math.floor(round(n * fraction, 9))
