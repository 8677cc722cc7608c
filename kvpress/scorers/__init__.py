"""Learned scorers: per-layer linear models that predict KVzip's score of a token from its hidden state.

A scorer is a safetensors file made by `kvpress train-scorer` (see `kvpress.train_scorer`): tensors `weight`
`[L, d, H]` and `bias` `[L, H]` (layer, hidden size, KV heads; the prediction is the log of KVzip's score),
`layer_profile` `[R, L]` (how KVzip's ranking of all layers' scores together spreads the budget across layers
at each of the compression ratios `profile_ratios` `[R]`: each layer's share of the global top-k over the
average layer's, averaged over texts) and metadata `model`, `config_hash` (the architecture it was trained on,
as head patterns have) and `training` (JSON: the command's settings and the held-out fit). `KVzapPress` reads
one; the packaged scorers live next to this file, `load_scorer("smollm2-135m")` reads one by model name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file
from torch import nn

from kvpress.patterns import config_hash

_HERE = Path(__file__).parent
_HOW = "make one with `kvpress train-scorer --model ... --out scorer.safetensors`"


@dataclass
class Scorer:
    """A learned scorer: `log KVzip score ~ hidden @ weight[layer] + bias[layer]`, per KV head."""

    model: str
    config_hash: str
    weight: torch.Tensor  # [L, d, H]
    bias: torch.Tensor  # [L, H]
    training: dict = field(default_factory=dict)
    layer_profile: torch.Tensor | None = None  # [R, L] layer shares of KVzip's global top-k at `profile_ratios`
    profile_ratios: torch.Tensor | None = None  # [R] increasing, in (0, 1)

    def __post_init__(self) -> None:
        w, b = self.weight, self.bias
        if w.dim() != 3 or b.dim() != 2 or b.shape != (w.shape[0], w.shape[2]):
            raise ValueError(f"scorer {self.model!r}: weight must be [layers, hidden, kv_heads] and bias [layers, "
                             f"kv_heads], got {tuple(w.shape)} and {tuple(b.shape)}; {_HOW}")  # fmt: skip
        if not (bool(w.isfinite().all()) and bool(b.isfinite().all())):
            raise ValueError(f"scorer {self.model!r} holds values that are not finite; {_HOW}")
        p, r = self.layer_profile, self.profile_ratios
        if (p is None) != (r is None):
            raise ValueError(f"scorer {self.model!r}: layer_profile and profile_ratios come together; {_HOW}")
        if p is not None and (p.dim() != 2 or r.dim() != 1 or p.shape != (r.numel(), w.shape[0])
                              or not bool((r[1:] > r[:-1]).all()) or not bool(((r > 0) & (r < 1)).all())
                              or not bool((p > 0).all()) or not bool(p.isfinite().all())):  # fmt: skip
            raise ValueError(f"scorer {self.model!r}: layer_profile must be [ratios, layers] of positive numbers at "
                             f"increasing profile_ratios in (0, 1); {_HOW}")  # fmt: skip

    def layer_shares(self, ratio: float) -> torch.Tensor:
        """`[L]` each layer's budget share at compression ratio `ratio`: the profile interpolated linearly between
        its ratios (every layer 1 at r = 0; the last ratio's profile beyond it)."""
        if self.layer_profile is None:
            raise ValueError(f"scorer {self.model!r} has no layer profile; {_HOW}")
        ratios = [0.0, *self.profile_ratios.tolist()]
        rows = torch.cat([torch.ones(1, self.layer_profile.shape[1]), self.layer_profile.float()])
        if ratio >= ratios[-1]:
            return rows[-1]
        i = max(j for j, r in enumerate(ratios) if r <= ratio)
        t = (ratio - ratios[i]) / (ratios[i + 1] - ratios[i])
        return (1 - t) * rows[i] + t * rows[i + 1]

    def check(self, model: nn.Module) -> None:
        """Raise ValueError unless this scorer was trained for `model`'s architecture."""
        config = model.config.get_text_config(decoder=True)
        shape = (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads)
        if self.config_hash != config_hash(model) or tuple(self.weight.shape) != shape:
            raise ValueError(
                f"this scorer was trained for {self.model!r} (config hash {self.config_hash}, layers x hidden x KV "
                f"heads {tuple(self.weight.shape)}), not for this {type(model).__name__} (config hash "
                f"{config_hash(model)}, {shape}); {_HOW}"
            )


def packaged() -> list[str]:
    """Model names with a scorer shipped in the package."""
    return sorted(p.stem for p in _HERE.glob("*.safetensors"))


def load_scorer(scorer: str | Path | Scorer) -> Scorer:
    """A scorer from a `Scorer`, a safetensors path, or the name of a packaged scorer."""
    if isinstance(scorer, Scorer):
        return scorer
    is_packaged = str(scorer) in packaged()
    path = _HERE / f"{scorer}.safetensors" if is_packaged else Path(scorer)
    if not path.is_file():
        raise FileNotFoundError(
            f"scorer {str(scorer)!r} is neither a safetensors file nor a packaged scorer ({', '.join(packaged())}); "
            f"{_HOW}"
        )
    try:
        tensors = load_file(path)
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
        training = json.loads(meta.get("training", "{}"))
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"scorer {path} is not a readable safetensors file: {error}; {_HOW}") from error
    missing = [k for k in ("weight", "bias") if k not in tensors]
    missing += [k for k in ("model", "config_hash") if k not in meta]
    if missing:
        raise ValueError(f"scorer {path} lacks {missing}; {_HOW}")
    return Scorer(meta["model"], meta["config_hash"], tensors["weight"].float(), tensors["bias"].float(), training,
                  tensors.get("layer_profile"), tensors.get("profile_ratios"))  # fmt: skip


def find_scorer(model: nn.Module) -> Scorer:
    """The packaged scorer trained for `model`'s architecture (by config hash), or a clear error."""
    wanted = config_hash(model)
    for name in packaged():
        scorer = load_scorer(name)
        if scorer.config_hash == wanted:
            return scorer
    raise ValueError(
        f"no packaged scorer fits this {type(model).__name__} (config hash {wanted}; packaged: "
        f"{', '.join(packaged()) or 'none'}); {_HOW} and pass scorer='scorer.safetensors'"
    )


def save_scorer(scorer: Scorer, path: str | Path) -> None:
    meta = {"model": scorer.model, "config_hash": scorer.config_hash, "training": json.dumps(scorer.training)}
    tensors = {"weight": scorer.weight.float().contiguous(), "bias": scorer.bias.float().contiguous()}
    if scorer.layer_profile is not None:
        tensors["layer_profile"] = scorer.layer_profile.float().contiguous()
        tensors["profile_ratios"] = scorer.profile_ratios.float().contiguous()
    save_file(tensors, str(path), metadata=meta)
