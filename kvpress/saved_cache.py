"""Save a compressed cache and load it later, in another process: `save_cache(cache, path)`, `load_cache(path, model)`.

One safetensors file: every layer's keys, values, slot positions, per-head storage and press state
(`kvpress.patches.cache_io`), and in its metadata the model's architecture hash, its layers' attention kinds and
window (a cache loads only into a model of the same architecture), the press spec it was made with (if given), and
the versions of kvpress, torch and transformers that wrote it. Nothing is pickled.
"""

from __future__ import annotations

import json
import os
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import DynamicCache

from kvpress.files import check_writable, read_tensors, write_whole
from kvpress.patches import model_access
from kvpress.patches.cache_io import check_savable, layer_from_state, layer_state
from kvpress.patterns import config_hash
from kvpress.presses import press_from_name, resolve_default

FORMAT = 1


def save_cache(cache: DynamicCache, path: str | Path, model: nn.Module, press: str | None = None) -> None:
    """Write `cache` (made by `model`, compressed by the press spec `press` if given, budget included; `default` is
    recorded as the press it names for `model`) to the safetensors file `path`."""
    if not isinstance(cache, DynamicCache):
        raise TypeError(f"save_cache saves a DynamicCache, got {type(cache).__name__}")
    check_writable(_check_path(path), "save_cache's path", makes_directories=False)
    model_access.check_is_model(model)
    if press is not None and press != "none":  # a spec the loaded cache can be continued with, budget included
        if not isinstance(press, str):
            raise TypeError(f"press= is the spec of the press that compressed the cache, such as "
                            f"'snapkv:compression_ratio=0.5' (or None), got {press!r}")  # fmt: skip
        press = resolve_default(press, model)  # what `default` names for this model, not for the one loading it
        press_from_name(press)  # refuses an unknown name or parameter, or a spec without its budget
    if any(getattr(layer, "offloaded", None) is not None for layer in cache.layers):
        raise ValueError("this cache keeps a RecallPress store of evicted spans, which save_cache does not write: "
                         "the loaded cache could not recall them (compress with its inner press to save)")  # fmt: skip
    kinds = model_access.layer_types(model)
    if len(cache.layers) != len(kinds):
        raise ValueError(f"this cache has {len(cache.layers)} layers and this {type(model).__name__} {len(kinds)}: "
                         "save a cache with the model that made it")  # fmt: skip
    for layer in cache.layers:  # (before reading their shapes: a linear-attention layer holds no keys)
        check_savable(layer)
    shape = model_access.cached_value_shape(model)
    held = {_kv_shape(layer, shape) for layer in cache.layers}
    if held != {shape}:  # (it was written, loaded, and its next forward failed on a raw size mismatch)
        holds = " and ".join(f"{h} KV heads of size {d}" for h, d in sorted(held))
        raise ValueError(f"this cache's layers hold {holds} and this {type(model).__name__} {shape[0]} of size "
                         f"{shape[1]}: save a cache with the model that made it")  # fmt: skip
    lengths = sorted({layer.get_seq_length() for layer in cache.layers})
    if len(lengths) > 1:  # (a plain cache keeps no record of a forward that raised after some layers ran)
        raise ValueError(f"this cache's layers have seen different numbers of tokens ({lengths[0]} to {lengths[-1]}): "
                         "a forward that raised left it half-updated; it cannot be saved")  # fmt: skip
    tensors, layers, seen = {}, [], set()
    for i, layer in enumerate(cache.layers):
        named, fields = layer_state(layer, f"layer{i}")
        for key, t in named.items():  # safetensors refuses tensors that share memory: those are copied
            shared = t.numel() and t.untyped_storage().data_ptr() in seen
            seen.add(t.untyped_storage().data_ptr())
            tensors[key] = t.clone() if shared else t
        layers.append(fields)
    meta = {"format": FORMAT, "config_hash": config_hash(model), "model": type(model).__name__, "press": press,
            "dtype": str(_dtype(model)), "layer_types": kinds, "sliding_window": model_access.sliding_window(model),
            "layers": layers, "weights": weight_sample(model),
            "versions": {p: version(p) for p in ("kvpress", "torch", "transformers")}}  # fmt: skip
    tensors = {k: t.cpu() for k, t in tensors.items()}
    write_whole(path, lambda tmp: save_file(tensors, str(tmp), metadata={"kvpress": json.dumps(meta)}))


def weight_sample(model: nn.Module, count: int = 8) -> dict[str, list[float]]:
    """`count` values of each of `model`'s weights, evenly spaced in it, by name: what tells checkpoints of one
    architecture apart (a fine-tune moves nearly every weight, a base and its instruct model all of them). Weights
    waiting on `meta` (a layer accelerate offloads) are left out."""
    out = {}
    for name, weight in model.named_parameters():
        if weight.device.type == "meta" or not weight.numel():
            continue
        flat = weight.detach().reshape(-1)
        at = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)  # (whole numbers)
        out[name] = flat[at].float().cpu().tolist()
    return out


def _kv_shape(layer, default: tuple[int, int]) -> tuple[int, int]:
    """The KV heads a cache layer holds and their size (its values' `[B, H, n, D]`: a head-wise layer's placeholder
    has them too; keys may be thinned or codes), or `default` for a layer that holds nothing yet or holds codes."""
    values = getattr(layer, "values", None)
    if values is None or values.dim() != 4:
        return default
    if getattr(layer, "kv_bits", None) is not None and values.dtype == torch.uint8:  # (codes: their size is not D)
        return values.shape[1], default[1]
    return values.shape[1], values.shape[-1]


def _check_path(path) -> str | Path:
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise TypeError(f"path must name a .safetensors file (a str or a path), got {path!r}")
    return path


def read_metadata(path: str | Path) -> dict:
    """The metadata of a saved cache (architecture hash, press spec, versions, layers)."""
    path = Path(_check_path(path))
    if path.is_dir():
        raise ValueError(f"saved cache {path} is a directory: name the .safetensors file save_cache wrote")
    if not path.is_file():
        raise FileNotFoundError(f"saved cache {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["kvpress"])
    except (SafetensorError, ValueError, KeyError, TypeError, OSError, RecursionError) as error:
        raise ValueError(f"{path} is not a cache saved by kvpress.save_cache (or it is damaged): {error}") from error
    if not isinstance(meta, dict):
        raise ValueError(f"{path} is not a cache saved by kvpress.save_cache: its metadata is not a JSON object")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is a saved cache of format {meta.get('format')!r}; this kvpress reads {FORMAT}")
    missing = [key for key in ("config_hash", "model", "press", "layers") if key not in meta]
    if missing or not isinstance(meta["layers"], list) or not all(isinstance(x, dict) for x in meta["layers"]):
        raise ValueError(f"saved cache {path} is damaged: its metadata " + (f"lacks {missing}" if missing else
                         "has no list of layers"))  # fmt: skip
    return meta


def load_cache(path: str | Path, model: nn.Module) -> DynamicCache:
    """The cache saved in `path`, for `model` (refused unless `model` has the architecture it was made with);
    each layer on the device of its attention module. Continue it inside the press that made it."""
    model_access.check_is_model(model)
    meta = read_metadata(path)
    if meta["config_hash"] != config_hash(model):
        since = (" (or the file was saved before 2026-12-07, when the hash of a model with other layers than "
                 "full-attention ones came to name them: save it again)") if model_access.has_sliding_layers(model) \
            else ""  # fmt: skip
        raise ValueError(
            f"{path} holds a cache of a {meta['model']} with architecture hash {meta['config_hash']}; this "
            f"{type(model).__name__} has {config_hash(model)}: a cache only continues the model that made it{since}"
        )
    made = {"layer_types": meta.get("layer_types"), "sliding_window": meta.get("sliding_window")}
    here = {"layer_types": model_access.layer_types(model), "sliding_window": model_access.sliding_window(model)}
    if "layer_types" in meta and made != here:  # (files written before the hash named layer kinds)
        raise ValueError(f"{path} holds a cache of a model whose layers attend as {_layers(made)}; this "
                         f"{type(model).__name__}'s attend as {_layers(here)}: a cache only continues the model "
                         "that made it")  # fmt: skip
    dtype = str(_dtype(model))
    if meta.get("dtype", dtype) != dtype:  # (files written before it was recorded: no check)
        raise ValueError(f"{path} holds a cache of a model in {meta['dtype']}; this one computes in {dtype}: "
                         f"load the model in {meta['dtype']} (its keys and values are kept as they were computed)")
    saved, ours = meta.get("weights"), weight_sample(model)  # (None: a file written before weights were sampled)
    if saved and ours:
        common = sorted(set(saved) & set(ours))
        other = next((name for name in common if saved[name] != ours[name]), None)
        if not common or other is not None:
            named = f"{other} differs" if other else "no weight is named alike"
            raise ValueError(f"{path} holds a cache made with other weights than this {type(model).__name__}'s (the "
                             f"same architecture; {named}): a cache only continues the weights that made it")
    try:
        tensors = read_tensors(path)
    except (SafetensorError, OSError, RuntimeError) as error:
        raise ValueError(f"saved cache {path} is damaged: {error}") from error
    if len(meta["layers"]) != len(model_access.layer_types(model)):
        raise ValueError(f"saved cache {path} holds {len(meta['layers'])} layers and this {type(model).__name__} has "
                         f"{len(model_access.layer_types(model))}: a cache only continues the model that made it")
    modules = model_access.attention_modules(model)
    cache = DynamicCache(config=model.config)
    cache.layers = []
    for i, fields in enumerate(meta["layers"]):
        device = model_access.execution_device(model, i) if i in modules else torch.device("cpu")
        try:
            cache.layers.append(layer_from_state(tensors, fields, f"layer{i}", device))
        except KeyError as error:
            raise ValueError(f"saved cache {path} is damaged: layer {i} lacks the tensor {error}") from error
        except (TypeError, AttributeError) as error:  # (fields of the wrong kind)
            raise ValueError(f"saved cache {path} is damaged: layer {i}'s fields do not parse ({error})") from error
    return cache


def _dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model's attention computes in (its first attention module's weights')."""
    module = next(iter(model_access.attention_modules(model).values()))
    return next(module.parameters()).dtype


def _layers(kinds: dict) -> str:
    """`layer_types` and `sliding_window` in a line: "full_attention x 2, sliding_attention x 4 (window 16)"."""
    runs: list[list] = []
    for kind in kinds["layer_types"]:
        if runs and runs[-1][0] == kind:
            runs[-1][1] += 1
        else:
            runs.append([kind, 1])
    window = f" (window {kinds['sliding_window']})" if kinds["sliding_window"] is not None else ""
    return ", ".join(f"{kind} x {count}" for kind, count in runs) + window
