"""Memory recorded next to every result: peak resident memory of this process, on a GPU the peak
allocated CUDA memory (reset per measurement with `reset_cuda_peak`), and the bytes a full KV cache
would hold (`full_cache_bytes`); `page_in` makes a memory-mapped model's weights resident first."""

from __future__ import annotations

import itertools
import resource
import sys

import torch
from torch import nn

from kvpress.patches.model_access import layer_types


def page_in(model: nn.Module) -> None:
    """Read every weight of `model` once, so that a checkpoint loaded as a memory-mapped file is resident before
    process memory is measured. Otherwise the embedding matrix is read row by row as new tokens arrive, and the
    resident memory grows with the text read: ~6 MB per 1,024 new tokens on Qwen2.5-0.5B (its untied embedding,
    151,936 rows of 3.5 KB), weights, not activations or cache."""
    with torch.inference_mode():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            tensor.sum()


def reset_cuda_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_memory() -> dict:
    """`{"peak_rss_bytes": ...}` (the process's maximum so far), plus `peak_cuda_allocated_bytes` on a GPU."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    out = {"peak_rss_bytes": rss}
    if torch.cuda.is_available():
        out["peak_cuda_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return out


def full_cache_bytes(model, tokens: int) -> int:
    """Bytes a plain `DynamicCache` of `model` would hold after `tokens` tokens (sliding layers capped)."""
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_key_value_heads * head_dim * torch.finfo(model.dtype).bits // 8
    types = layer_types(model)
    window = getattr(config, "sliding_window", None) or tokens
    return sum(per_token * (tokens if t == "full_attention" else min(tokens, window)) for t in types)
