"""Head patterns: per-(layer, KV head) retrieval scores that DuoAttention-style presses read.

A pattern is a JSON file made by `kvpress calibrate-heads` (see `kvpress.calibrate_heads`):
`{"model": name, "config_hash": ..., "layers": L, "kv_heads": H, "method": ..., "scores": [[...H] * L],
"retrieval_fraction": suggested fraction}`. Higher score: more of a retrieval head. The packaged
patterns live next to this file; `load_pattern("smollm2-135m")` reads one by model name.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from torch import nn

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
    """A short hash of the architecture fields of `model`'s text config (what a head pattern depends on)."""
    config = model.config.get_text_config(decoder=True).to_dict()
    fields = {key: config.get(key) for key in _HASHED}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def packaged() -> list[str]:
    """Model names with a pattern shipped in the package."""
    return sorted(p.stem for p in _HERE.glob("*.json"))


def load_pattern(pattern: str | Path | dict) -> dict:
    """A pattern from a dict, a JSON file path, or the name of a packaged pattern."""
    if isinstance(pattern, dict):
        data = pattern
    else:
        path = _HERE / f"{pattern}.json" if str(pattern) in packaged() else Path(pattern)
        if not path.exists():
            raise FileNotFoundError(
                f"head pattern {str(pattern)!r} is neither a JSON file nor a packaged pattern ({', '.join(packaged())})"
            )
        data = json.loads(path.read_text())
    missing = [key for key in ("model", "config_hash", "scores") if key not in data]
    if missing:
        raise ValueError(f"head pattern lacks {missing}; make one with `kvpress calibrate-heads`")
    return data


def find_pattern(model: nn.Module) -> dict:
    """The packaged pattern made for `model`'s architecture (by config hash), or a clear error."""
    wanted = config_hash(model)
    for name in packaged():
        pattern = load_pattern(name)
        if pattern["config_hash"] == wanted:
            return pattern
    raise ValueError(
        f"no packaged head pattern fits this {type(model).__name__} (config hash {wanted}; packaged: "
        f"{', '.join(packaged())}); make one with `kvpress calibrate-heads --model ... --out pattern.json` "
        "and pass head_pattern='pattern.json'"
    )


def check_pattern(pattern: dict, model: nn.Module) -> None:
    """Raise ValueError unless `pattern` was made for a model with `model`'s architecture."""
    config = model.config.get_text_config(decoder=True)
    shape = (config.num_hidden_layers, config.num_key_value_heads)
    scores = pattern["scores"]
    found = (len(scores), len(scores[0]) if scores else 0)
    if pattern["config_hash"] != config_hash(model) or found != shape:
        raise ValueError(
            f"this head pattern was made for {pattern['model']!r} (config hash {pattern['config_hash']}, "
            f"{found[0]} layers x {found[1]} KV heads), not for this {type(model).__name__} (config hash "
            f"{config_hash(model)}, {shape[0]} x {shape[1]}); make one with `kvpress calibrate-heads --model ...`"
        )


def save_pattern(pattern: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(pattern, indent=1) + "\n")
