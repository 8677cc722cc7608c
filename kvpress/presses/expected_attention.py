"""Expected Attention: score each cached token by the attention future queries are expected to pay it.

Devoto et al. 2025, "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries
Distribution" (arXiv:2510.00636): queries of a layer are close to Gaussian, so the attention a key will
receive from the next queries has a closed form. With the queries' mean mu and covariance S moved to the
coming positions by the average RoPE rotation R over the next `n_future_positions`, a key k's expected
logit is (R mu) . k s + k^T (R S R^T) k s^2 / 2 (s: the attention scale; E[exp(x)] of a Gaussian x); its
softmax over the held keys, averaged over the query heads of a KV group, times the value's norm (what the
pair adds to the output) is the score. The queries seen are the forward's (the prompt's at prefill), so no
observation window and no second pass; it evicts inside the prefill and while decoding. NVIDIA kvpress's
own press; here written from the paper's formula.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from kvpress.patches import model_access
from kvpress.patches.rope import average_rotation, rerotate
from kvpress.presses.base import BasePress, Observation


@dataclass
class ExpectedAttentionPress(BasePress):
    """Keep the tokens the next queries are expected to attend to most (a Gaussian model of the queries).

    Parameters:
        compression_ratio / max_tokens: the budget (see `BasePress`).
        n_future_positions: how many coming positions the expected query is averaged over (default 512).
        n_sink: leading tokens always kept and left out of the query statistics (default 4).
        use_covariance: add the covariance term k^T S k s^2 / 2 (default True; False: the rotated mean only).
        use_vnorm: weight each score by its value's L2 norm (default True).
        epsilon: added to the expected attention before the value norm weighs it (default 0).

    Statistics come from the queries of the forward that cached the tokens: at a decoding step one query, so
    the mean only (no covariance from one sample).
    """

    reads_every_key_channel: ClassVar[bool] = True  # (its rotation is RoPE's, over the head's every channel)

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    _freqs: weakref.WeakKeyDictionary = field(  # by attention module: a model's go with it
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        value = self.n_future_positions
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"n_future_positions must be a positive integer, got {value!r}")
        for name in ("use_covariance", "use_vnorm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.epsilon, bool) or not isinstance(self.epsilon, (int, float)) or not self.epsilon >= 0:
            raise ValueError(f"epsilon must be a non-negative number, got {self.epsilon!r}")
        super().__post_init__()

    def check_model(self, model: nn.Module) -> None:
        model_access.check_half_split_rope(model)  # refuses a model without RoPE, or with its pairs interleaved
        for idx, module in model_access.attention_modules(model).items():  # one press may serve several models
            self._freqs[module] = model_access.layer_inv_freq(model, idx)  # refuses a model without RoPE

    def score(self, obs: Observation) -> torch.Tensor:
        if obs.module not in self._freqs:
            raise RuntimeError("ExpectedAttentionPress was not installed on this model: enter `with press(model):`")
        inv_freq = self._freqs[obs.module]
        b, hq, q, d = obs.query.shape
        hkv, n = obs.keys.shape[1], obs.keys.shape[2]
        g = hq // hkv
        pos = obs.layer.pos[..., n - q : n].long().to(obs.query.device)  # [B, Hkv, q] the new tokens' positions
        counted = pos >= self.n_sink
        if obs.layer.valid is not None:
            counted = counted & obs.layer.valid[..., n - q : n]
        counted = torch.where(counted.any(-1, keepdim=True), counted, torch.ones_like(counted))  # all sinks: all
        # every query moved to the newest position, so the statistics describe one position's queries
        delta = (pos.amax(-1, keepdim=True) - pos)[:, :, None].expand(b, hkv, g, q)
        queries = rerotate(obs.query.float().view(b, hkv, g, q, d), delta, inv_freq)
        weight = counted[:, :, None, :, None].float()  # [B, Hkv, 1, q, 1]
        count = weight.sum(-2)  # [B, Hkv, 1, 1]
        mean = (queries * weight).sum(-2) / count  # [B, Hkv, g, D]
        ahead = torch.arange(1, self.n_future_positions + 1, device=queries.device)
        keys = obs.keys.float()
        scale = model_access.attention_scaling(obs.module)
        logits = torch.einsum("bhgd,bhnd->bhgn", average_rotation(mean, ahead, inv_freq), keys) * scale
        if self.use_covariance and q > 1:
            centred = (queries - mean[..., None, :]) * weight
            cov = centred.transpose(-1, -2) @ centred / count[..., None]  # [B, Hkv, g, D, D]
            cov = average_rotation(average_rotation(cov, ahead, inv_freq).transpose(-1, -2), ahead, inv_freq)
            logits = logits + 0.5 * scale**2 * ((keys[:, :, None] @ cov) * keys[:, :, None]).sum(-1)
        if obs.layer.valid is not None:
            logits = logits.masked_fill(~obs.layer.valid[:, :, None, :n], float("-inf"))
        scores = logits.softmax(dim=-1).mean(dim=2) + self.epsilon  # [B, Hkv, n]
        return scores * obs.values.float().norm(dim=-1) if self.use_vnorm else scores
