"""kvpress's own files: written whole or not at all (a run killed mid-write leaves the file as it was, or none, never
half of one that a later run would read or that replaced a good one), and named without ambiguity."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file


def write_whole(path: str | Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` to a temporary file beside `path`, then that file in place of `path` (one rename). A symlink's
    target is the file replaced, an existing file keeps its mode, and what a killed writer left is removed."""
    path = Path(os.path.realpath(path))
    for stale in path.parent.glob(f".{path.name}.partial-*"):  # (a writer killed before it could remove its own)
        if not _alive(stale.name.rsplit("-", 1)[-1]):
            stale.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        write(tmp)
        if path.exists():
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _alive(pid: str) -> bool:
    """Whether process `pid` (digits of a temporary file's name) still runs (it may still be writing)."""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's)
        return True
    return True


def packaged_or_path(source: str | Path, packaged: Path | None, what: str) -> Path:
    """The file `source` names: `packaged` (the file shipped under that name, None when it names none) or the path
    `source`. A name that is both (a file `smollm2-135m` written here, beside the packaged scorer) is refused: the
    packaged one was read in its place without a word."""
    if not isinstance(source, (str, os.PathLike)) or not str(source):
        raise TypeError(f"{what} must be the name of a packaged {what} or a path to its file, got {source!r}")
    if packaged is None:
        return Path(source)
    if Path(source).is_file():
        raise ValueError(f"{what} {str(source)!r} names both a packaged {what} and the file {Path(source).resolve()}: "
                         f"give that file by its path ({Path(source).resolve()}) or rename it, or remove it to use the "
                         "packaged one")  # fmt: skip
    return packaged


def write_text_whole(path: str | Path, text: str) -> None:
    """`text` written to `path` whole (`write_whole`)."""
    write_whole(path, lambda tmp: tmp.write_text(text))


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file `path`, read into memory: safetensors' default memory map keeps about
    70 bytes a tensor after the tensors are gone (0.7 and 0.8: 14 MB over 10,000 loads of a 20-tensor file; read
    with `pread`, none)."""
    return load_file(str(path), backend="pread")
