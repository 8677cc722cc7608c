"""Attention by blocks of queries, for what transformers' sdpa path does at a cost.

`blocked_attention`: a chunk's attention over a compressed layer on the CPU: the query heads share their KV
head, and the queries go `QUERY_BLOCK` at a time (dense layers through the intercept; head-wise ones per KV head).

Over a compressed layer a mask is always passed (held slots are not the token positions transformers' causal
mask assumes), and with a mask transformers' sdpa path repeats each KV head for its g query heads (a g-times
copy of every held key and value), and torch's CPU kernel turns the boolean mask into a float one the size of
the scores. Here torch shares the KV head (`enable_gqa`) and each block of queries meets only the slots it can
see (the held ones, and the new ones up to its last query), with a mask of that block's rows: neither copy
grows past one block's. Measured by `make bench-long` (eval/results/README.md, "Long contexts").

CPU only (`DEVICES`): on CUDA, sdpa with a mask and `enable_gqa` leaves the fused kernels for its math one, which
holds every weight (torch 2.11 on an H200); `bench_gpu --attn sdpa-blocked` measures the blocks on CUDA (H200, 16K
tokens: the default press's peak 478 MB against 148 without them). So do calls with anything this plain sdpa call
does not express (softcapping, attention sinks, a position bias, dropout).

`bottom_right_attention`: a chunk where blocks are left out (a GPU) over slots all visible to it (no padding, no
holes, no sliding window), dense or head-wise: one sdpa call with torch's bottom-right causal bias
(`causal_lower_right`: every held slot visible, the new ones causal) and the KV heads shared, which torch runs in its
flash kernel with no mask and no copy of the keys. transformers' path over such a chunk repeats each KV head g times
over every held slot and builds a `[q, n]` mask: a layer left whole (DuoAttention's, a layer under budget) held as
much as no press's call for it (`bench_gpu --cpu-stand-in`, eval/results/README.md, "On a GPU"). A chunk over a
padded batch's dense layer, or a sliding window's, keeps transformers' path and its mask there.

`attention_with_mass`: the attention computed from its weights, a few queries at a time, for a press that reads
the weights themselves (H2O accumulates the attention each slot receives): the weights are computed once, for
the output and the press, instead of once by sdpa and again by the press. Any device; softcapping included.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

QUERY_BLOCK = 256  # queries a call: 128 saved 1 MB more at 5,120 slots and took 16% longer
DEVICES = ("cpu",)  # the device types a chunk runs in blocks on (see above)


def weighable(module: nn.Module, kwargs: dict) -> bool:
    """Whether an attention call is softmax(scaled, soft-capped logits + mask) @ values and nothing more: no
    attention sinks, position bias or dropout, and nobody asks transformers for the weights."""
    return (all(kwargs.get(name) is None for name in ("s_aux", "position_bias")) and not kwargs.get("dropout")
            and not module.training and not kwargs.get("output_attentions"))  # fmt: skip


def _plain_chunk(module: nn.Module, query: torch.Tensor, kwargs: dict) -> bool:
    """Whether an attention call is a chunk (several queries) this module's plain sdpa calls can run: no
    soft-capping, and nothing else they do not express (`weighable`)."""
    return query.shape[2] > 1 and kwargs.get("softcap") is None and weighable(module, kwargs)


def applies(module: nn.Module, query: torch.Tensor, kwargs: dict) -> bool:
    """Whether a chunk of `query` can run in `blocked_attention` instead of transformers' sdpa path."""
    return query.device.type in DEVICES and _plain_chunk(module, query, kwargs)


def fuses(module: nn.Module, query: torch.Tensor, kwargs: dict) -> bool:
    """Whether a chunk of `query` over slots all visible to it runs as `bottom_right_attention` (a device that
    `DEVICES` leaves out)."""
    return query.device.type not in DEVICES and _plain_chunk(module, query, kwargs)


def bottom_right_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           scaling: float | None = None) -> torch.Tensor:  # fmt: skip
    """Attention of `query` `[B, Hq, q, D]` (the newest `q` slots of `key`/`value` `[B, Hkv, n, D]`): every older
    slot visible, the new ones causal, the KV heads shared; `[B, Hq, q, Dv]` (sdpa's layout)."""
    q, n = query.shape[2], key.shape[2]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(q, n), scale=scaling,
                                          enable_gqa=query.shape[1] != key.shape[1])  # fmt: skip


def blocked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      rows_mask: Callable[..., torch.Tensor], scaling: float | None = None,
                      ) -> torch.Tensor:  # fmt: skip
    """Attention of `query` `[B, Hq, q, D]` (the newest `q` slots of `key`/`value` `[B, Hkv, n, D]`) in blocks;
    `rows_mask(rows=(s, e))` is the bool mask of queries `s:e` over the first `n - q + e` slots. `[B, q, Hq, Dv]`."""
    q, n = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    out = query.new_empty(*query.shape[:3], value.shape[-1])
    for s in range(0, q, QUERY_BLOCK):
        e = min(q, s + QUERY_BLOCK)
        width = n - q + e  # the held slots and the new ones up to query e - 1
        mask = rows_mask(rows=(s, e))
        out[:, :, s:e] = F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, :width], value[:, :, :width],
                                                        attn_mask=mask, scale=scaling, enable_gqa=gqa)  # fmt: skip
    return out.transpose(1, 2).contiguous()


def attention_with_mass(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        rows_mask: Callable[..., torch.Tensor] | None, block: int, scaling: float | None = None,
                        softcap: float | None = None, peak: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Attention of `query` `[B, Hq, q, D]` (the newest `q` slots of `key`/`value` `[B, Hkv, n, D]`) from its
    weights, `block` queries at a time, and the attention mass: `[B, Hkv, n]` fp32, the weight each slot received,
    summed over the queries and the query heads that share its KV head. `rows_mask(rows=(s, e))`: the bool mask
    of queries `s:e` over the first `n - q + e` slots, `[B or 1, Hkv or 1, e - s, n - q + e]`; None: every held
    slot visible, the new ones causally. Logits in the model's dtype, weights in fp32. `peak`: a `[B, Hkv, n]` fp32
    tensor raised in place to the largest weight each slot received from those queries and heads (KVzip's score).
    Returns (`[B, q, Hq, Dv]`, mass)."""
    b, hq, q, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    g = hq // hkv
    scale = d**-0.5 if scaling is None else scaling
    grouped = query.view(b, hkv, g, q, d)  # query head kv * g + j shares KV head kv
    out = value.new_empty(b, hkv, g, q, value.shape[-1])
    mass = torch.zeros(b, hkv, n, dtype=torch.float32, device=query.device)
    size = b * hkv * g * min(block, q) * n  # one block's logits and weights: two buffers the blocks reuse
    logits_buffer = query.new_empty(size)
    weights_buffer = torch.empty(size, dtype=torch.float32, device=query.device)
    for s in range(0, q, block):
        e = min(q, s + block)
        w, width = e - s, n - q + e
        shape, used = (b, hkv, g * w, width), b * hkv * g * w * width
        logits = torch.matmul(grouped[:, :, :, s:e].reshape(b, hkv, g * w, d) * scale,
                              key[:, :, :width].transpose(-1, -2), out=logits_buffer[:used].view(shape))  # fmt: skip
        if softcap:
            logits.div_(softcap).tanh_().mul_(softcap)
        if rows_mask is None:  # causal: only the block's own corner hides anything
            corner = torch.ones(w, w, dtype=torch.bool, device=query.device).triu(1)
            logits.view(b, hkv, g, w, width)[..., width - w :].masked_fill_(corner, float("-inf"))
        else:
            hidden = ~rows_mask(rows=(s, e))
            c = 0  # a decoding step's one row is masked whole (finding where to start would read the device)
            if w > 1:  # a block of a chunk: masked from the first column with something hidden on
                hidden_cols = hidden.flatten(0, -2).any(dim=0).nonzero()
                c = int(hidden_cols[0]) if len(hidden_cols) else None
            if c is not None:
                logits.view(b, hkv, g, w, width)[..., c:].masked_fill_(hidden[:, :, None, :, c:], float("-inf"))
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32, out=weights_buffer[:used].view(shape))
        mass[..., :width] += weights.sum(dim=-2)
        if peak is not None:
            peak[..., :width] = torch.maximum(peak[..., :width], weights.amax(dim=-2))
        out[:, :, :, s:e] = (weights.to(value.dtype) @ value[:, :, :width]).view(b, hkv, g, w, -1)
    return out.view(b, hq, q, -1).transpose(1, 2).contiguous(), mass
