"""A chunk's attention over a compressed layer on the CPU: the query heads share their KV head, and the
queries go `QUERY_BLOCK` at a time (dense layers through the intercept; head-wise ones per KV head).

Over a compressed layer a mask is always passed (held slots are not the token positions transformers' causal
mask assumes), and with a mask transformers' sdpa path repeats each KV head for its g query heads (a g-times
copy of every held key and value), and torch's CPU kernel turns the boolean mask into a float one the size of
the scores. Here torch shares the KV head (`enable_gqa`) and each block of queries meets only the slots it can
see (the held ones, and the new ones up to its last query), with a mask of that block's rows: neither copy
grows past one block's. Measured by `make bench-long` (eval/results/README.md, "Long contexts").

CPU only: on CUDA, sdpa with a mask and `enable_gqa` leaves the fused kernels, so that call keeps
transformers' path. So do calls with anything this plain sdpa call does not express (softcapping, attention
sinks, a position bias, dropout).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

QUERY_BLOCK = 256  # queries a call: 128 saved 1 MB more at 5,120 slots and took 16% longer


def applies(module: nn.Module, query: torch.Tensor, kwargs: dict) -> bool:
    """Whether a chunk of `query` can run here instead of transformers' sdpa path."""
    plain = all(kwargs.get(name) is None for name in ("softcap", "s_aux", "position_bias"))
    return (query.device.type == "cpu" and query.shape[2] > 1 and plain and not kwargs.get("dropout")
            and not module.training and not kwargs.get("output_attentions"))  # fmt: skip


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
