"""kvpress's own files: written whole or not at all (a run killed mid-write leaves the file as it was, or none, never
half of one that a later run would read or that replaced a good one), and named without ambiguity."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file


def write_whole(path: str | Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` to a temporary file beside `path`, then that file in place of `path` (one rename, after the file
    reached the disk: a system that stops between the two leaves the old file or the new one, not an empty one). A
    symlink's target is the file replaced, an existing file keeps its mode, and what a killed writer left is
    removed."""
    path = Path(os.path.realpath(path))
    for stale in path.parent.glob(f".{path.name}.partial-*"):  # (a writer killed before it could remove its own)
        if not _alive(stale.name.rsplit("-", 1)[-1]):
            stale.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        _create_alone(tmp)
        write(tmp)
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())
        if path.exists():
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _create_alone(tmp: Path) -> None:
    """Create the empty file `tmp`, never through a symbolic link or into a file left there (`O_EXCL`: a link another
    user planted at this predictable name had its target overwritten); what is there is removed first (a link itself,
    not its target)."""
    for _ in range(2):
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return
        except FileExistsError:
            os.unlink(tmp)
    raise FileExistsError(f"{tmp} came back after it was removed: another process writes there")


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


@contextlib.contextmanager
def held_alone(lock: str | Path, what: str) -> Iterator[None]:
    """Run the block holding the lock file `lock` (made if missing, never removed: removing it would let two
    processes hold two files of one name); another process holding it is refused at once with a ValueError naming
    `what` and its pid. The system releases the lock when the process ends, however it ends. Where the system has
    no `fcntl` (Windows), nothing is locked."""
    try:
        import fcntl
    except ImportError:  # (not POSIX)
        yield
        return
    try:  # (never through a symbolic link: its target would be truncated, the pid written in it)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as error:
        if not os.path.islink(lock):
            raise
        raise ValueError(f"{lock} is a symbolic link: {what} takes its lock in a file of its own (remove the link)"
                         ) from error  # fmt: skip
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            who = "another call of this process" if holder == str(os.getpid()) else "another process"
            raise ValueError(f"{what} is in use by {who} (pid {holder}, holding {lock}): its rows would be lost to "
                             "one rewrite or the other; wait for it to end, or use another directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # (releases the lock)


def check_writable(path: str | Path, name: str, directory: bool = False, makes_directories: bool = True) -> None:
    """Raise ValueError unless this process can write the file `path` (`directory`: the directory `path`), its
    missing directories made on the way (`makes_directories=False`: for a writer that makes none, the file's
    directory must exist), so that a run finds out before its compute, not after it; `name` names the option (or
    argument) in the message."""
    if not str(path):  # (Path("") is the working directory)
        raise ValueError(f"{name} is empty: give the {'directory' if directory else 'file'} to write")
    target = Path(os.path.realpath(path))  # (where a symbolic link leads: what is written)
    if Path(path).is_symlink() and not target.exists() and directory:
        raise ValueError(f"{name} {path} is a symbolic link to {target}, which does not exist: create it, or give "
                         "another directory")  # fmt: skip
    if directory and target.exists() and not target.is_dir():
        raise ValueError(f"{name} {path} is a file: give a directory (made if missing)")
    if not directory and target.is_dir():
        raise ValueError(f"{name} {path} is a directory: give the file to write")
    existing = target if directory else target.parent
    if not makes_directories and not existing.is_dir():
        what = "is not a directory" if existing.exists() else "does not exist"
        raise ValueError(f"{name} {path}: its directory {what}: create it first")
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{name} {path}: cannot write there ({existing} is not a directory this process can write "
                         "in)")  # fmt: skip


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
