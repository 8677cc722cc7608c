"""kvpress's own files: written whole or not at all (a run killed mid-write leaves the file as it was, or none, never
half of one that a later run would read or that replaced a good one), and named without ambiguity."""

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


def packaged_or_path(source: str | Path, packaged: Path | None, what: str) -> Path:
    """The file `source` names: `packaged` (the file shipped under that name, None when it names none) or the path
    `source`. A name that is both (a file `smollm2-135m` written here, beside the packaged scorer) is refused: the
    packaged one was read in its place without a word."""
    if packaged is None:
        return Path(source)
    if Path(source).is_file():
        raise ValueError(f"{what} {str(source)!r} names both a packaged {what} and the file {Path(source).resolve()}: "
                         f"give the file as ./{source} (or rename it), or remove it to use the packaged one")
    return packaged


def write_text_whole(path: str | Path, text: str) -> None:
    """`text` written to `path` whole (`write_whole`)."""
    write_whole(path, lambda tmp: tmp.write_text(text))
