"""Memory recorded next to every result: peak resident memory of this process, on a GPU the peak
allocated CUDA memory (reset per measurement with `reset_cuda_peak`), and the bytes a full KV cache
would hold (`full_cache_bytes`)."""

from __future__ import annotations

import resource
import sys

import torch

from kvpress.patches.model_access import layer_types


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
