"""A pressed forward on CUDA runs sdpa without cuDNN's attention while another backend is enabled
(`patches/sdpa_backends.py`: cuDNN builds a graph for every new key length, and compressed layers make many); the
user's flags are back afterwards, error or not. The switches hold on a CPU build, so the rule is checked here; the
forward is made to look as if it ran on CUDA."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvpress import AdaKVPress, SnapKVPress
from kvpress.patches import sdpa_backends
from kvpress.patches.model_access import attention_modules
from tiny import prompt, tiny_model

ALL = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION]


def test_on_cuda_cudnn_is_set_aside_and_put_back():
    with sdpa_kernel(ALL):
        with sdpa_backends.without_cudnn("cuda"):
            assert not torch.backends.cuda.cudnn_sdp_enabled()
            assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
            assert torch.backends.cuda.math_sdp_enabled()
        assert torch.backends.cuda.cudnn_sdp_enabled()
        with pytest.raises(KeyError), sdpa_backends.without_cudnn(torch.device("cuda", 0)):
            raise KeyError("escapes")
        assert set(sdpa_backends.enabled_backends()) >= set(ALL)


def test_the_users_choice_is_kept():
    with sdpa_kernel([SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION]):  # their choice among the others: math only
        with sdpa_backends.without_cudnn("cuda"):
            assert sdpa_backends.enabled_backends() == [SDPBackend.MATH]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):  # cuDNN alone: nothing else could run, left as it is
        with sdpa_backends.without_cudnn("cuda"):
            assert sdpa_backends.enabled_backends() == [SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(ALL), sdpa_backends.without_cudnn("cpu"):  # the CPU never picks cuDNN: nothing touched
        assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.parametrize("press", [SnapKVPress(compression_ratio=0.5, window_size=4),
                                   AdaKVPress(SnapKVPress(compression_ratio=0.5, window_size=4))],
                         ids=["dense", "head-wise"])  # fmt: skip
def test_a_pressed_forward_on_cuda_runs_without_cudnn(monkeypatch, press):
    model = tiny_model()
    seen = []
    hooks = [m.register_forward_pre_hook(lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
             for m in attention_modules(model).values()]  # fmt: skip
    try:
        with sdpa_kernel(ALL):
            with press(model):
                model(prompt())  # on the CPU: left alone
                assert seen and all(seen)
                seen.clear()
                monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda")))
                model(prompt())
                assert seen and not any(seen)
                hooks.append(model.model.layers[1].register_forward_hook(lambda *_: (_ for _ in ()).throw(
                    RuntimeError("boom"))))  # fmt: skip
                with pytest.raises(RuntimeError, match="boom"):
                    model(prompt())
                assert torch.backends.cuda.cudnn_sdp_enabled()  # back after the error
            assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        for hook in hooks:  # the tiny model is shared with other tests
            hook.remove()


def test_priority_names_the_enabled_backends_in_torchs_order():
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH], set_priority=True):
        assert sdpa_backends.priority() == ["CUDNN_ATTENTION", "MATH"]
    with sdpa_kernel([SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION], set_priority=True):
        assert sdpa_backends.priority() == ["MATH", "CUDNN_ATTENTION"]


def test_overlapping_blocks_put_cudnn_back_when_the_last_leaves():
    """Two threads' pressed forwards overlapping: the first to leave must not turn cuDNN back on under the second."""
    with sdpa_kernel(ALL):
        first, second = sdpa_backends.without_cudnn("cuda"), sdpa_backends.without_cudnn("cuda")
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        assert not torch.backends.cuda.cudnn_sdp_enabled()  # the second is still inside
        second.__exit__(None, None, None)
        assert torch.backends.cuda.cudnn_sdp_enabled()


def test_each_entry_looks_again_and_only_the_backends_cuda_runs_count():
    """A block entered after the flags changed under an outer one sets cuDNN aside too; cuDNN chosen alone with the
    setters (OVERRIDEABLE, which CUDA never picks, still on) is left as it is."""
    with sdpa_kernel(ALL), sdpa_backends.without_cudnn("cuda"):
        with sdpa_kernel([SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION]), sdpa_backends.without_cudnn("cuda"):
            assert not torch.backends.cuda.cudnn_sdp_enabled()
    flags = {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")() for name in ("flash", "mem_efficient", "math")}
    try:
        for name in flags:
            getattr(torch.backends.cuda, f"enable_{name}_sdp")(False)
        with sdpa_backends.without_cudnn("cuda"):
            assert torch.backends.cuda.cudnn_sdp_enabled()  # nothing else for CUDA to run
    finally:
        for name, on in flags.items():
            getattr(torch.backends.cuda, f"enable_{name}_sdp")(on)
