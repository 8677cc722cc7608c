"""Learned files shipped per model (KVzap's scorers, NAtS's gates): safetensors files named after the model,
with metadata `model`, `config_hash` (the architecture they were trained on, as head patterns have) and
`training` (JSON: the command's settings and the held-out fit). One reader, finder and writer for every kind;
`what` names the kind in messages ("scorer", "gates") and `how` says how to make one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import safe_open, save_file
from torch import nn

from kvpress.files import packaged_or_path, read_tensors, write_whole
from kvpress.patches import model_access
from kvpress.patterns import config_hash


def packaged(folder: Path) -> list[str]:
    """Model names with a file shipped in `folder`."""
    return sorted(p.stem for p in folder.glob("*.safetensors"))


def read(source: str | Path, folder: Path, what: str, how: str,
         tensors: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], dict[str, str], dict]:  # fmt: skip
    """`(tensors, metadata, training)` of the packaged file named `source` (a model name) or of the file at that
    path; a clear error when it is missing, unreadable, or lacks one of `tensors` or the metadata."""
    names = packaged(folder)
    path = packaged_or_path(source, folder / f"{source}.safetensors" if str(source) in names else None, what)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {str(source)!r} is neither a safetensors file nor a packaged {what} "
                                f"({', '.join(names)}); {how}")  # fmt: skip
    try:
        found = read_tensors(path)
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
        training = json.loads(meta.get("training", "{}"))
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"{what} {path} is not a readable safetensors file: {error}; {how}") from error
    missing = [k for k in tensors if k not in found] + [k for k in ("model", "config_hash") if k not in meta]
    if missing:
        raise ValueError(f"{what} {path} lacks {missing}; {how}")
    return found, meta, training


def find(model: nn.Module, folder: Path, load, what: str, how: str):
    """`load(name)` of the packaged file trained for `model`'s architecture (by config hash), or a clear error. A
    file named after the model alone comes before its variants (`smollm2-135m` before `smollm2-135m-mass`, which
    is read by its name)."""
    wanted = config_hash(model)
    for name in sorted(packaged(folder), key=lambda n: (len(n), n)):
        found = load(folder / f"{name}.safetensors")  # (by its path: a file here of that name is none of its business)
        if found.config_hash == wanted:
            return found
    names = ", ".join(packaged(folder)) or "none"
    raise ValueError(f"no packaged {what} fits this {type(model).__name__} (config hash {wanted}; packaged: {names}); "
                     f"{how} and pass {what}='{what}.safetensors'")  # fmt: skip


def architecture(model: nn.Module) -> tuple[int, int, int]:
    """`(layers, hidden size, KV heads)` of `model`: the leading dimensions of a learned per-model weight."""
    config = model_access.text_config(model)
    return config.num_hidden_layers, config.hidden_size, model_access.kv_heads(model)


def check_fits(model: nn.Module, what: str, trained_for: str, trained_hash: str, shape: tuple, how: str,
               per_head: tuple[int, ...] = ()) -> None:  # fmt: skip
    """Raise ValueError unless a file trained for `trained_for` (its config hash and weight `shape`) fits `model`,
    whose weight is `architecture(model)` followed by `per_head`."""
    wanted = (*architecture(model), *per_head)
    if trained_hash != config_hash(model) or tuple(shape) != wanted:
        raise ValueError(f"this {what} was trained for {trained_for!r} (config hash {trained_hash}, shape "
                         f"{tuple(shape)}), not for this {type(model).__name__} (config hash {config_hash(model)}, "
                         f"{tuple(wanted)}); {how}")  # fmt: skip


def write(path: str | Path, tensors: dict[str, torch.Tensor], model: str, trained_hash: str, training: dict,
          **meta: str) -> None:  # fmt: skip
    """Write `tensors` (floating ones as fp32, others as they are) with the metadata `read` expects, plus `meta`."""
    meta = {"model": model, "config_hash": trained_hash, "training": json.dumps(training), **meta}
    tensors = {k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    write_whole(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))  # (a killed run: the old file)
