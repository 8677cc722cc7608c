"""NAtS gates: per layer and KV head, a linear map from the hidden state entering a layer's attention to a
token's role, trained by `kvpress train-gates` (see `kvpress.train_gates`) and read by `NAtSPress`.

A gates file is a safetensors file with tensors `weight` `[L, d, H, 3]` and `bias` `[L, H, 3]` (layer, hidden
size, KV heads, the logits of the roles in `ROLES` order) and metadata `window` (the sliding-window role's span,
in tokens), `model`, `config_hash` and `training` (`kvpress.shipped`). The packaged gates live next to this
file; `load_gates("smollm2-135m")` reads one by model name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from kvpress import shipped

ROLES = ("global", "local", "window")  # kept to the end; kept until the next global token; kept `window` tokens
_HERE = Path(__file__).parent
_HOW = "make them with `kvpress train-gates --model ... --out gates.safetensors`"


@dataclass
class Gates:
    """NAtS's learned roles: `softmax(hidden @ weight[layer] + bias[layer])` over `ROLES`, per KV head."""

    model: str
    config_hash: str
    weight: torch.Tensor  # [L, d, H, 3]
    bias: torch.Tensor  # [L, H, 3]
    window: int
    training: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        w, b = self.weight, self.bias
        if w.dim() != 4 or w.shape[-1] != len(ROLES) or b.shape != (w.shape[0], *w.shape[2:]):
            raise ValueError(f"gates {self.model!r}: weight must be [layers, hidden, kv_heads, 3] and bias [layers, "
                             f"kv_heads, 3], got {tuple(w.shape)} and {tuple(b.shape)}; {_HOW}")  # fmt: skip
        if not (bool(w.isfinite().all()) and bool(b.isfinite().all())):
            raise ValueError(f"gates {self.model!r} hold values that are not finite; {_HOW}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"gates {self.model!r}: window must be a positive integer, got {self.window!r}; {_HOW}")

    def roles(self, layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
        """`[B, q, H, 3]` each token's role probabilities (`ROLES` order) from its hidden states `[B, q, d]`."""
        weight, bias = self.weight[layer_idx], self.bias[layer_idx]
        if weight.device != hidden.device:
            self.weight, self.bias = self.weight.to(hidden.device), self.bias.to(hidden.device)
            weight, bias = self.weight[layer_idx], self.bias[layer_idx]
        d, heads = weight.shape[:2]
        logits = hidden.float() @ weight.float().reshape(d, heads * len(ROLES))  # (gates given in half precision)
        return (logits.view(*hidden.shape[:-1], heads, len(ROLES)) + bias.float()).softmax(dim=-1)

    def check(self, model: nn.Module) -> None:
        """Raise ValueError unless these gates were trained for `model`'s architecture."""
        shipped.check_fits(model, "gates", self.model, self.config_hash, self.weight.shape, _HOW, (len(ROLES),))


def packaged() -> list[str]:
    """Model names with gates shipped in the package."""
    return shipped.packaged(_HERE)


def load_gates(gates: str | Path | Gates) -> Gates:
    """Gates from a `Gates`, a safetensors path, or the name of packaged gates."""
    if isinstance(gates, Gates):
        return gates
    tensors, meta, training = shipped.read(gates, _HERE, "gates", _HOW, ("weight", "bias"))
    if not meta.get("window", "").isdigit():
        raise ValueError(f"gates {gates} lack a window (a positive integer in their metadata); {_HOW}")
    return Gates(meta["model"], meta["config_hash"], tensors["weight"].float(), tensors["bias"].float(),
                 int(meta["window"]), training)  # fmt: skip


def find_gates(model: nn.Module) -> Gates:
    """The packaged gates trained for `model`'s architecture (by config hash), or a clear error."""
    return shipped.find(model, _HERE, load_gates, "gates", _HOW)


def save_gates(gates: Gates, path: str | Path) -> None:
    shipped.write(path, {"weight": gates.weight, "bias": gates.bias}, gates.model, gates.config_hash, gates.training,
                  window=str(gates.window))  # fmt: skip
