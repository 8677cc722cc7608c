"""Attention over a `HeadwiseLayer`: each (row, KV head) attends over its own variable-length slots.

Each KV head's query group is folded into one sequence of `g * q` queries (GQA without repeating
keys), and torch's `scaled_dot_product_attention` runs once per (row, KV head) over that head's
tensors: no padding, no mask over evicted slots. The `q` newest slots of every head are this
forward's tokens: causal among themselves. On a sliding-window layer a query also sees only the slots
less than `window` positions behind it. Returns transformers' layout `[B, q, Hq, D]`.

On a GPU, flash-attn's variable-length kernel would run all heads in one call; that path is not
built yet (it needs packed storage), so CUDA runs the same per-head sdpa.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpress.patches.head_cache import HeadwiseLayer


def headwise_attention(module: nn.Module, query: torch.Tensor, layer: HeadwiseLayer) -> torch.Tensor:
    """Attention of `query` `[B, Hq, q, D]` (post-RoPE) over `layer`, whose newest `q` slots per head
    are the query tokens; `[B, q, Hq, Dv]`."""
    b, hq, q, d = query.shape
    g = hq // layer.heads
    scale = float(module.scaling)
    softcap = getattr(module, "attn_logit_softcapping", None)
    out = query.new_empty(b, hq, q, layer.value_dim or d)
    causal = None
    for row in range(b):
        for head in range(layer.heads):
            keys, values = layer.pair(row, head)
            n = keys.shape[0]
            qs = query[row, head * g : (head + 1) * g].reshape(1, 1, g * q, d)
            mask = None
            if q > 1 and layer.window is not None:
                pos = layer.slot("pos", row, head).long()
                mask = (pos[None] <= pos[-q:, None]) & (pos[None] > pos[-q:, None] - layer.window)
                mask = mask.repeat(g, 1)
            elif q > 1:
                if causal is None or causal.shape[-1] != n:
                    causal = _fold_causal(q, n, g, query.device)
                mask = causal
            if softcap:
                logits = (qs @ keys.transpose(0, 1)[None, None]) * scale
                logits = torch.tanh(logits / softcap) * softcap
                if mask is not None:
                    logits = logits.masked_fill(~mask, float("-inf"))
                res = logits.float().softmax(-1).to(values.dtype) @ values[None, None]
            else:
                k, v = keys[None, None], values[None, None]
                res = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
            out[row, head * g : (head + 1) * g] = res.view(g, q, -1)
    return out.transpose(1, 2).contiguous()


def _fold_causal(q: int, n: int, g: int, device) -> torch.Tensor:
    """`[g * q, n]` bool: query i of each group sees the old slots and the new ones up to itself."""
    new = torch.ones(q, q, dtype=torch.bool, device=device).tril()
    old = torch.ones(q, n - q, dtype=torch.bool, device=device)
    return torch.cat([old, new], dim=-1).repeat(g, 1)
