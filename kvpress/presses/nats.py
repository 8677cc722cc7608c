"""NAtS: learned token roles decide how long each cached token stays.

Deng et al. 2025, "Neural Attention Search" (arXiv:2502.13251): every token takes one of three roles, learned end to
end with the model through a learnable attention mask: a global token is kept to the end, a local token until the
next global token arrives, a sliding-window token for a fixed number of following tokens; learned from scratch or by
fine-tuning, the roles shrink the KV cache and the inference cost with the model's performance kept (the paper's
abstract). Here the model stays frozen: per layer a linear gate reads the hidden state entering the attention and
gives each KV head the token's role probabilities, trained by `kvpress train-gates` to keep each layer's attention
output (through its output projection) while holding few tokens, with the roles' own hard mask (straight-through) on
text no task here uses, and shipped per model with its architecture hash. The paper keeps what the roles say; this
press ranks by the probability that a token's role still holds it, so it keeps the budget it is given (a ratio or a
token count) like every press.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from kvpress.gates import Gates, find_gates, load_gates
from kvpress.patches import model_access
from kvpress.presses.base import BasePress, Observation

_LOCAL, _WINDOW, _SURVIVE = "nats_local", "nats_window", "nats_survive"


@dataclass
class NAtSPress(BasePress):
    """Keep the tokens whose learned role most probably still holds them (global, local, sliding window).

    Parameters:
        compression_ratio / max_tokens: the budget (see `BasePress`); enforced at the prefill and while
            decoding (generated tokens get their roles too, and each new global token ends the earlier local ones).
        gates: "auto" (default: the packaged gates trained for the model's architecture), a packaged model name
            ("smollm2-135m", "qwen2.5-0.5b"), a safetensors path, or a `Gates`.
        n_sink: leading tokens always kept (default 0: the gates learn the sinks).
        window_size: last tokens always kept (default 16).

    A token is still held with probability p_global + p_local x P(no global token since it) + p_window x [the next
    query is within the gates' window of it, as in the mask they were trained with], from its role probabilities
    (fixed when it is cached) and those of every token after it (accumulated as they arrive); the score is -log of
    the complement (same order).
    """

    needs_hidden: ClassVar[bool] = True
    observes_frozen: ClassVar[bool] = True  # a question read inside frozen() gets its roles too

    gates: str | Gates = "auto"
    n_sink: int = 0
    window_size: int = 16
    _gates: weakref.WeakKeyDictionary = field(  # by attention module: a model's go with it
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.gates, (str, Gates)) or (isinstance(self.gates, str) and not self.gates):
            raise ValueError(f"gates must be 'auto', packaged gates' model name, a path or a Gates, got "
                             f"{self.gates!r}")  # fmt: skip
        super().__post_init__()

    def check_model(self, model: nn.Module) -> None:
        gates = find_gates(model) if self.gates == "auto" else load_gates(self.gates)
        gates.check(model)
        for idx, module in model_access.attention_modules(model).items():  # one press may serve several models
            self._gates[module] = (gates, idx)

    def observe(self, obs: Observation) -> None:
        """Give the new tokens (the last `hidden.shape[1]` held slots) their roles, and age the held ones."""
        if obs.hidden is None:
            raise ValueError("NAtSPress gives tokens roles from the hidden states entering each layer's "
                             "attention, which this path does not give (RoundPolicy's rounds): use another press "
                             "there")  # fmt: skip
        if obs.module not in self._gates:
            raise RuntimeError("NAtSPress was not installed on this model: enter `with press(model):` first")
        gates, idx = self._gates[obs.module]
        roles = gates.roles(idx, obs.hidden.to(obs.keys.device)).permute(0, 2, 1, 3)[:, obs.kv_heads]  # [B, H, q, 3]
        q = roles.shape[2]
        # log P(a token is not global) = log(p_local + p_window), exact where p_global rounds to 1; summed over the
        # tokens after each new one (within this forward), and over all of them (what every held slot adds)
        closing = (roles[..., 1] + roles[..., 2]).clamp_min(1e-30).log()
        after = closing.sum(-1, keepdim=True) - closing.cumsum(-1)
        layer = obs.layer
        survive = layer.slot(_SURVIVE)
        survive[..., : survive.shape[-1] - q] += closing.sum(-1, keepdim=True)
        survive[..., survive.shape[-1] - q :] = after
        layer.slot(_LOCAL)[..., -q:] = roles[..., 1]
        layer.slot(_WINDOW)[..., -q:] = roles[..., 2]

    def score(self, obs: Observation) -> torch.Tensor:
        """-log P(the token's role no longer holds it): the same order as the probability that it does, without
        the rounding of that probability to 1 that would tie the confident global tokens."""
        layer = obs.layer
        gates, _ = self._gates[obs.module]
        # the next query (position real_seen) sees a window token j while real_seen - j < window (the trained mask)
        gone = (layer.real_seen.to(layer.pos.device)[:, None, None] - layer.pos.long() >= gates.window).float()
        dropped = layer.slot(_LOCAL) * -torch.expm1(layer.slot(_SURVIVE)) + layer.slot(_WINDOW) * gone
        return -dropped.clamp_min(1e-30).log()
