"""`Observation`: what a press (or an observer) sees after one attention call of one layer.

The engine builds it from the intercept's arguments: the post-RoPE queries of the forward and every key
and value the layer holds after the update, so a scorer is a few lines (`attention_probs` handles GQA,
softcap, padding and causality).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvpress.patches import model_access
from kvpress.patches.cache import PressedLayer


@dataclass
class Observation:
    """What a press sees after one attention call of one layer."""

    module: nn.Module
    query: torch.Tensor  # [B, Hq, q, D] post-RoPE queries of this forward
    keys: torch.Tensor  # [B, Hkv, n, D] every held key, the q new ones last
    values: torch.Tensor  # [B, Hkv, n, Dv]
    layer: PressedLayer

    @property
    def q_len(self) -> int:
        return self.query.shape[2]

    @property
    def layer_idx(self) -> int:
        return model_access.layer_index(self.module)

    @property
    def n_layers(self) -> int:
        return model_access.layer_count(self.module)

    def attention_probs(self, start: int, stop: int) -> torch.Tensor:
        """Softmax attention of the new queries `start:stop` over the slots they can see, fp32.

        Returns `[B, Hkv, g, w, m]`: the query heads grouped by the KV head they share (GQA), and the
        first `m = n_old + stop` slots (later new tokens are in these queries' future). Masked like the
        real attention: padding and holes excluded, causal among the new tokens.
        """
        b, hq, _, d = self.query.shape
        hkv = self.keys.shape[1]
        g, w = hq // hkv, stop - start
        n_old = self.keys.shape[2] - self.q_len
        m = n_old + stop
        q = self.query[:, :, start:stop].reshape(b, hkv, g * w, d).float() * model_access.attention_scaling(self.module)
        logits = q @ self.keys[:, :, :m].float().transpose(-1, -2)
        softcap = model_access.logit_softcap(self.module)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        logits = logits.view(b, hkv, g, w, m)
        valid = self.layer.valid
        if w > 1 or valid is not None:
            slot = torch.arange(m, device=logits.device)
            query_slot = n_old + torch.arange(start, stop, device=logits.device)[:, None]
            visible = slot <= query_slot  # [w, m], causal
            if valid is not None:
                visible = visible & valid[:, :, None, None, :m] | (slot == query_slot)
            logits.masked_fill_(~visible, float("-inf"))
        return logits.softmax(dim=-1)
