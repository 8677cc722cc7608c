"""Warnings said at the user's line, in a category of their own.

A press warns many frames deep, inside the model's forward that transformers' `generate` runs: `stacklevel` named a
line of kvpress, transformers or torch, and the warning could be filtered only by that module. `warn` names the
first frame outside them (the user's `model.generate(...)`, `kvpress.generate(...)`, `chat.send(...)`), in
`KVPressWarning`: `warnings.filterwarnings("ignore", category=kvpress.KVPressWarning)` silences kvpress alone.
"""

from __future__ import annotations

import sys
import warnings

# the modules whose frames are not the user's line (by module name: the same for a checkout and an installed wheel)
_INSIDE = ("kvpress", "transformers", "torch", "accelerate", "contextlib", "functools")


class KVPressWarning(UserWarning):
    """What kvpress warns of: a budget it cannot keep exactly, a forward it does not compress, and the like."""


def warn(message: str, once_per_line: bool = True) -> None:
    """Warn of `message` (a `KVPressWarning`) at the first frame outside kvpress, transformers, torch and the
    wrappers they run through (the console script's line under `kvpress ...`; a thread started on
    `model.generate` itself has no frame of the user's: its `threading` frame). `once_per_line=False`
    keeps no entry in Python's registry of warnings said: for a message its caller says once per thread, where the
    registry would keep one entry per thread for good."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").split(".")[0] in _INSIDE:
        frame = frame.f_back
    registry = frame.f_globals.setdefault("__warningregistry__", {}) if once_per_line else None
    # (no module_globals, as warnings.warn gives none: the loader of a module run as `python -m` refused to read
    # its source under the name __main__, and the warning raised ImportError)
    warnings.warn_explicit(message, KVPressWarning, frame.f_code.co_filename, frame.f_lineno,
                           module=frame.f_globals.get("__name__"), registry=registry)  # fmt: skip
