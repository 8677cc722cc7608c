"""Which sdpa kernels a pressed forward may use on CUDA: cuDNN's attention set aside while another is enabled.

torch 2.13 built with cuDNN >= 9.15.1 tries cuDNN's attention first on sm90 and sm100 (Hopper and Blackwell
datacenter GPUs; `check_prefer_cudnn_attention` in torch's `sdp_utils.cpp`), and cuDNN builds an execution graph
for each problem it has not seen (batch, query and key lengths, strides, mask), cached per shape: tens of
milliseconds of host time each. A plain cache meets one new key length a decoding step; a compressed one meets many,
and new ones at every eviction (layers and heads hold different numbers of tokens: a head-wise chunk calls sdpa
once per head and block of queries over that head's own length). That fits what an H200 measured before this
module (eval/results/README.md, "On a GPU"): AdaKV's 16K prefill 97 s against 0.3 s with no press (hundreds of new
shapes), the default press's decoding step 0.9 s (a new key length per layer a step), AdaKV's step, which calls no
sdpa, 1.8x; and a no-press run whose shapes were not cached yet 36 ms a step slower than one whose were. Measured
since on an H200 (torch 2.11, cuDNN 9.19, cuDNN first): a sdpa call of a new key length 55 ms, 0.05 ms the second
time, 0.11 ms without cuDNN; AdaKV's 4K prefill 1.5 s inside this module's block against 29 s without it.

`without_cudnn(device)`: inside it, on a CUDA device, sdpa runs with every backend enabled now except cuDNN's
(flash for unmasked calls, memory-efficient or math for masked ones); the user's own choice among those is kept, a
choice of cuDNN alone is left as it is, and the flags are put back on exit, error or not. Other devices: nothing.
torch's switches are process-wide: another thread's sdpa calls during a pressed forward on CUDA run without cuDNN
too (another kernel for the same attention, within rounding), and cuDNN is back once the last pressed forward open
in any thread has left.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch.nn.attention import SDPBackend

_FLAGS = {  # backend -> whether it is enabled now (torch.backends.cuda's switches; they hold on any build)
    SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
    SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
    SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled,
    SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled,
}
_OVERRIDEABLE = getattr(torch._C, "_get_overrideable_sdp_enabled", None)
if hasattr(SDPBackend, "OVERRIDEABLE") and _OVERRIDEABLE is not None:  # a device's own (sdpa_kernel switches it too)
    _FLAGS[SDPBackend.OVERRIDEABLE] = _OVERRIDEABLE


def enabled_backends() -> list[SDPBackend]:
    """The sdpa backends enabled now."""
    return [backend for backend, on in _FLAGS.items() if on()]


def priority() -> list[str]:
    """The enabled backends in the order torch tries them (its order once its first sdpa call has set it)."""
    order = getattr(torch._C, "_get_sdp_priority_order", lambda: [])()
    enabled = enabled_backends()
    return [b.name for b in sorted(enabled, key=lambda b: order.index(int(b)) if int(b) in order else len(order))]


_HELD = 0  # pressed forwards inside `without_cudnn` now, in any thread
_RESTORE = False  # whether one of them turned cuDNN off (the last to leave turns it back on)
_LOCK = threading.Lock()
_OTHERS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)  # what CUDA runs besides


@contextlib.contextmanager
def without_cudnn(device: torch.device | str) -> Iterator[None]:
    """On CUDA, cuDNN's attention disabled inside the block when flash, memory-efficient or math attention is
    enabled (see above). Every entry looks again (the flags may have been changed since an outer one), and cuDNN
    comes back when the last block open, in any thread, leaves, if one of them turned it off and it is still off."""
    global _HELD, _RESTORE
    if torch.device(device).type != "cuda":
        yield
        return
    with _LOCK:
        enabled = enabled_backends()
        if SDPBackend.CUDNN_ATTENTION in enabled and any(backend in enabled for backend in _OTHERS):
            torch.backends.cuda.enable_cudnn_sdp(False)
            _RESTORE = True
        _HELD += 1
    try:
        yield
    finally:
        with _LOCK:
            _HELD -= 1
            if _HELD == 0 and _RESTORE:
                torch.backends.cuda.enable_cudnn_sdp(True)  # (a no-op where someone turned it back on meanwhile)
                _RESTORE = False
