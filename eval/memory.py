"""Peak memory of this process, recorded next to every result: resident memory, and on a GPU the
peak allocated CUDA memory (reset per measurement with `reset_cuda_peak`)."""

from __future__ import annotations

import resource
import sys

import torch


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
