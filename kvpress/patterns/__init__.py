"""Head patterns: per-(layer, KV head) retrieval scores that DuoAttention-style presses read.

A pattern is a JSON file made by `kvpress calibrate-heads` (see `kvpress.calibrate_heads`):
`{"model": name, "config_hash": ..., "layers": L, "kv_heads": H, "method": ..., "scores": [[...H] * L],
"retrieval_fraction": suggested fraction}`. Higher score: more of a retrieval head. The packaged
patterns live next to this file; `load_pattern("smollm2-135m")` reads one by model name.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from torch import nn

from kvpress.files import packaged_or_path, write_text_whole
from kvpress.patches import model_access

_HERE = Path(__file__).parent
_HASHED = (
    "model_type",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_size",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "rope_parameters",
)


def config_hash(model: nn.Module) -> str:
    """A short hash of the architecture fields of `model`'s text config (what a head pattern depends on), and where
    some layer is not a full-attention one (a sliding window, chunked attention, ...), each layer's kind and the
    sliding window (a pattern, scorer or cache of the same shape with every layer over the whole context was taken
    without a word; models whose layers are all full-attention ones hash as before 2026-12-07, the others not)."""
    config = model.config.get_text_config(decoder=True).to_dict()
    fields = {key: config.get(key) for key in _HASHED}
    if model_access.has_sliding_layers(model):
        fields |= {"layer_types": model_access.layer_types(model), "sliding_window": model_access.sliding_window(model)}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def packaged() -> list[str]:
    """Model names with a pattern shipped in the package."""
    return sorted(p.stem for p in _HERE.glob("*.json"))


_HOW = "make one with `kvpress calibrate-heads --model ... --out pattern.json`"


def _reject_constant(literal: str) -> float:
    raise ValueError(f"{literal} is not a number JSON allows (scores must be finite)")


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _problem(data: object) -> str | None:
    """What is wrong with pattern `data`, or None when it is well formed."""
    if not isinstance(data, dict):
        return f"it is a {type(data).__name__}, not a JSON object"
    missing = [key for key in ("model", "config_hash", "scores") if key not in data]
    if missing:
        return f"it lacks the keys {missing}"
    for key in ("model", "config_hash"):
        if not isinstance(data[key], str):
            return f"{key} must be a string, got {data[key]!r}"
    scores = data["scores"]
    if not isinstance(scores, list) or not scores or not all(isinstance(row, list) and row for row in scores):
        return "scores must be a non-empty list (one per layer) of non-empty lists (one number per KV head)"
    if len({len(row) for row in scores}) > 1:
        return f"scores is ragged: layers have {sorted({len(row) for row in scores})} KV heads, not one count"
    for layer, row in enumerate(scores):
        for head, x in enumerate(row):
            if not _is_real(x):
                return f"scores[{layer}][{head}] is {x!r}, not a finite real number"
    for key, size in (("layers", len(scores)), ("kv_heads", len(scores[0]))):
        if key in data and (isinstance(data[key], bool) or data[key] != size):
            return f"{key} is {data[key]!r} but scores has {size}"
    fraction = data.get("retrieval_fraction", 0)
    if not _is_real(fraction) or not 0 <= fraction <= 1:
        return f"retrieval_fraction must be in [0, 1], got {fraction!r}"
    return None


def _check(data: object, name: str) -> None:
    if (problem := _problem(data)) is not None:
        raise ValueError(f"head pattern {name} is malformed: {problem}; {_HOW}")


def _named(pattern: dict) -> str:
    """How a pattern given as a dict is named in a message: by its model, where it names one."""
    return f"{pattern['model']!r} (a dict)" if "model" in pattern else "given as a dict"


def load_pattern(pattern: str | Path | dict) -> dict:
    """A validated pattern from a dict, a JSON file path, or the name of a packaged pattern."""
    if isinstance(pattern, dict):
        name, data = _named(pattern), pattern
    else:
        is_packaged = str(pattern) in packaged()
        path = packaged_or_path(pattern, _HERE / f"{pattern}.json" if is_packaged else None, "head pattern")
        name = f"{str(pattern)!r} ({path})" if is_packaged else str(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"head pattern {str(pattern)!r} is neither a JSON file nor a packaged pattern "
                f"({', '.join(packaged())}); {_HOW}"
            )
        try:
            data = json.loads(path.read_text(), parse_constant=_reject_constant)
        except (ValueError, RecursionError) as error:  # bad JSON, NaN, not UTF-8, too deep
            where = f" at line {error.lineno}, column {error.colno}" if isinstance(error, json.JSONDecodeError) else ""
            raise ValueError(f"head pattern {name} is not valid JSON{where}: {error}; {_HOW}") from error
    _check(data, name)
    return data


def find_pattern(model: nn.Module) -> dict:
    """The packaged pattern made for `model`'s architecture (by config hash), or a clear error."""
    wanted = config_hash(model)
    for name in packaged():
        pattern = load_pattern(_HERE / f"{name}.json")  # (by path: a file here of that name is not it)
        if pattern["config_hash"] == wanted:
            return pattern
    raise ValueError(
        f"no packaged head pattern fits this {type(model).__name__} (config hash {wanted}; packaged: "
        f"{', '.join(packaged())}); make one with `kvpress calibrate-heads --model ... --out pattern.json` "
        "and pass head_pattern='pattern.json'"
    )


def check_pattern(pattern: dict, model: nn.Module) -> None:
    """Raise ValueError unless `pattern` is well formed and was made for a model with `model`'s architecture."""
    _check(pattern, _named(pattern) if isinstance(pattern, dict) else "(not a dict)")
    shape = (model_access.text_config(model).num_hidden_layers, model_access.kv_heads(model))
    scores = pattern["scores"]
    found = (len(scores), len(scores[0]))
    if pattern["config_hash"] != config_hash(model) or found != shape:
        raise ValueError(
            f"this head pattern was made for {pattern['model']!r} (config hash {pattern['config_hash']}, "
            f"{found[0]} layers x {found[1]} KV heads), not for this {type(model).__name__} (config hash "
            f"{config_hash(model)}, {shape[0]} x {shape[1]}); {_HOW}"
        )


def save_pattern(pattern: dict, path: str | Path) -> None:
    """Write `pattern` to `path` whole (a calibration killed as it writes leaves the old pattern)."""
    write_text_whole(path, json.dumps(pattern, indent=1) + "\n")
