"""Memory recorded next to every result: peak resident memory of this process, on a GPU the peak
allocated CUDA memory (reset per measurement with `reset_cuda_peak`), and the bytes a full KV cache
would hold (`full_cache_bytes`); `page_in` makes a memory-mapped model's weights resident first; `steady_malloc`
sets glibc's malloc as it settles in a process that has run a while (for timing after a memory measurement).
`TensorPeak` counts the most tensor bytes alive at once on any device: a CPU's stand-in for CUDA's peak."""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import resource
import sys

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from kvpress.patches import blocked_attention
from kvpress.patches.model_access import head_dim, kv_heads, layer_types


def page_in(model: nn.Module) -> None:
    """Read every weight of `model` once, so that a checkpoint loaded as a memory-mapped file is resident before
    process memory is measured. Otherwise the embedding matrix is read row by row as new tokens arrive, and the
    resident memory grows with the text read: ~6 MB per 1,024 new tokens on Qwen2.5-0.5B (its untied embedding,
    151,936 rows of 3.5 KB), weights, not activations or cache."""
    with torch.inference_mode():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            tensor.sum()


def unread_weight_bytes(model: nn.Module) -> int:
    """The bytes of `model`'s weights a decoding step does not read: an input embedding that is not also the output
    head (the step reads one row of it; a tied one is read whole by the head). 0 when tied."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and head.weight is embedding.weight:
        return 0
    return embedding.weight.numel() * embedding.weight.element_size()


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD_MAX = 32 << 20  # the most glibc's dynamic mmap threshold rises to (64-bit builds)


def steady_malloc() -> None:
    """Set glibc's malloc as it settles in a process that has freed a large block: blocks up to 32 MB come from
    the heap and freed ones are reused (mmap threshold 32 MB, trim threshold 64 MB, where glibc's dynamic
    thresholds end up). A benchmark child fixes the mmap threshold at 1 MB for a stable memory high-water mark
    (`bench_long.CHILD_ENV`); timed under that, every block over 1 MB is mapped afresh and each page faulted in
    on first touch, so a no-press decode step, whose `DynamicCache` copies every layer's keys and values to grow
    them, takes about twice its time, and a press's step, written in place, does not. Raises RuntimeError where
    the C library has no glibc `mallopt`."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) or not mallopt(
            M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_MAX):  # fmt: skip
        raise RuntimeError("steady_malloc needs glibc's mallopt (Linux): this C library has none, or refused it")


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
    """Bytes a plain `DynamicCache` of `model` would hold after `tokens` tokens (a sliding layer holds the last
    `sliding_window - 1`, what the next token can see, as transformers' `DynamicSlidingWindowLayer` keeps)."""
    config = model.config.get_text_config(decoder=True)
    per_token = 2 * kv_heads(model) * head_dim(model) * torch.finfo(model.dtype).bits // 8
    types = layer_types(model)
    window = getattr(config, "sliding_window", None)
    held = tokens if window is None else min(tokens, window - 1)
    return sum(per_token * (tokens if t == "full_attention" else held) for t in types)


class TensorPeak(TorchDispatchMode):
    """Inside: `peak`, the most bytes of tensor storage alive at once among the storages created inside (each
    counted once, however many views share it): what CUDA's allocator reports as `max_memory_allocated` above what
    was allocated before, without its rounding to blocks or what a kernel allocates inside an operator (a library's
    workspace). On the CPU, with the GPU's attention paths (`bench_gpu.gpu_paths`), it stands in for a GPU's peak
    where none is lent. Every operator runs through it (several times slower)."""

    SWEEP_EVERY = 8  # operators between two sweeps of the storages freed since (and before any new peak)

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = self._ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                 if isinstance(t, torch.Tensor) and not t.is_meta}  # fmt: skip
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
                storage = tensor.untyped_storage()
                ptr, known = storage.data_ptr(), self.live.get(storage.data_ptr())
                if ptr in given and known is None:  # a view of (or written into) an input made before: not new
                    continue
                if ptr and (known is None or known[0].expired()):  # new (an address freed and given out again too)
                    self.current += storage.nbytes() - (known[1] if known else 0)
                    self.live[ptr] = (StorageWeakRef(storage), storage.nbytes())
        self._ops += 1
        if self.current > self.peak or self._ops % self.SWEEP_EVERY == 0:
            for ptr in [p for p, (ref, _) in self.live.items() if ref.expired()]:
                self.current -= self.live.pop(ptr)[1]
            self.peak = max(self.peak, self.current)
        return out

    def __enter__(self):
        # torch's causal biases are tensor subclasses, which cannot be made inside a dispatch mode: made outside it
        self._bias = blocked_attention.causal_lower_right
        blocked_attention.causal_lower_right = _outside_modes(self._bias)
        return super().__enter__()

    def __exit__(self, *exc):
        blocked_attention.causal_lower_right = self._bias
        return super().__exit__(*exc)


def _outside_modes(make):
    def made(*args):
        with _disable_current_modes():
            return make(*args)

    return made
