"""Files written whole or not at all: a run killed mid-write leaves the file as it was (or none), never half of one
that a later run would read (or that replaced a good one)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def write_whole(path: str | Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` to a temporary file beside `path`, then that file in place of `path` (one rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_whole(path: str | Path, text: str) -> None:
    """`text` written to `path` whole (`write_whole`)."""
    write_whole(path, lambda tmp: tmp.write_text(text))
