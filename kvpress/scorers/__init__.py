"""Learned scorers: per-layer linear models that predict KVzip's score of a token from its hidden state.

A scorer is a safetensors file made by `kvpress train-scorer` (see `kvpress.train_scorer`): tensors `weight`
`[L, d, H]` and `bias` `[L, H]` (layer, hidden size, KV heads; the prediction is the log of KVzip's score),
`layer_profile` `[R, L]` (how KVzip's ranking of all layers' scores together spreads the budget across layers
at each of the compression ratios `profile_ratios` `[R]`: each layer's share of the global top-k over the
average layer's, averaged over texts), optionally `mass_weight` `[L, 2, H]` (a scorer trained with the
attention mass: the weights of the log of the attention a token has received, summed over the queries and query
heads that saw it, and of the log of how many queries saw it, added to the hidden state's prediction), optionally
`word_edges` `[V, 2]` uint8 (per token id of the model's vocabulary, whether its text starts and ends with an ASCII
letter or digit: `kvpress.words`, read by `KVzapPress(whole_words=True)`) and metadata
`model`, `config_hash` (the architecture it was trained on, as head patterns have) and `training` (JSON: the
command's settings and the held-out fit). `KVzapPress` reads
one; the packaged scorers live next to this file, `load_scorer("smollm2-135m")` reads one by model name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from kvpress import shipped

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
    mass_weight: torch.Tensor | None = None  # [L, 2, H] weights of log attention mass and log queries seen
    word_edges: torch.Tensor | None = None  # [V, 2] uint8 per token id: starts / ends with a letter or digit

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

        m = self.mass_weight
        if m is not None and (m.shape != (w.shape[0], 2, w.shape[2]) or not bool(m.isfinite().all())):
            raise ValueError(f"scorer {self.model!r}: mass_weight must be finite, [layers, 2, kv_heads] = "
                             f"{[w.shape[0], 2, w.shape[2]]}, got {list(m.shape)}; {_HOW}")  # fmt: skip
        e = self.word_edges
        if e is not None and (e.dim() != 2 or e.shape[1] != 2 or e.shape[0] < 1 or e.dtype != torch.uint8
                              or not bool((e <= 1).all())):  # fmt: skip
            raise ValueError(f"scorer {self.model!r}: word_edges must be [vocab, 2] uint8 of 0 and 1, got "
                             f"{list(e.shape)} {e.dtype}; {_HOW} --update-words")  # fmt: skip

    def layer_shares(self, ratio: float) -> torch.Tensor:
        """`[L]` each layer's budget share at compression ratio `ratio`: the profile interpolated linearly between
        its ratios (every layer 1 at r = 0; the last ratio's profile beyond it)."""
        if self.layer_profile is None:
            raise ValueError(f"scorer {self.model!r} has no layer profile; {_HOW}")
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
            raise ValueError(f"ratio must be a compression ratio in [0, 1), got {ratio!r}")
        ratios = [0.0, *self.profile_ratios.tolist()]
        rows = torch.cat([torch.ones(1, self.layer_profile.shape[1]), self.layer_profile.float()])
        if ratio >= ratios[-1]:
            return rows[-1]
        i = max(j for j, r in enumerate(ratios) if r <= ratio)
        t = (ratio - ratios[i]) / (ratios[i + 1] - ratios[i])
        return (1 - t) * rows[i] + t * rows[i + 1]

    def check(self, model: nn.Module) -> None:
        """Raise ValueError unless this scorer was trained for `model`'s architecture (and its word table is of
        `model`'s vocabulary)."""
        shipped.check_fits(model, "scorer", self.model, self.config_hash, self.weight.shape, _HOW)
        rows = model.get_input_embeddings().num_embeddings
        if self.word_edges is not None and self.word_edges.shape[0] != rows:
            raise ValueError(f"scorer {self.model!r}: its word table has {self.word_edges.shape[0]} token ids, the "
                             f"model's vocabulary {rows}; {_HOW} --update-words")  # fmt: skip


def packaged() -> list[str]:
    """Model names with a scorer shipped in the package."""
    return shipped.packaged(_HERE)


def load_scorer(scorer: str | Path | Scorer) -> Scorer:
    """A scorer from a `Scorer`, a safetensors path, or the name of a packaged scorer."""
    if isinstance(scorer, Scorer):
        return scorer
    tensors, meta, training = shipped.read(scorer, _HERE, "scorer", _HOW, ("weight", "bias"))
    return Scorer(meta["model"], meta["config_hash"], tensors["weight"].float(), tensors["bias"].float(), training,
                  tensors.get("layer_profile"), tensors.get("profile_ratios"), tensors.get("mass_weight"),
                  tensors.get("word_edges"))  # fmt: skip


def find_scorer(model: nn.Module) -> Scorer:
    """The packaged scorer trained for `model`'s architecture (by config hash), or a clear error."""
    return shipped.find(model, _HERE, load_scorer, "scorer", _HOW)


def save_scorer(scorer: Scorer, path: str | Path) -> None:
    tensors = {"weight": scorer.weight, "bias": scorer.bias}
    if scorer.layer_profile is not None:
        tensors.update(layer_profile=scorer.layer_profile, profile_ratios=scorer.profile_ratios)
    if scorer.mass_weight is not None:
        tensors.update(mass_weight=scorer.mass_weight)
    if scorer.word_edges is not None:
        tensors.update(word_edges=scorer.word_edges)
    shipped.write(path, tensors, scorer.model, scorer.config_hash, scorer.training)
