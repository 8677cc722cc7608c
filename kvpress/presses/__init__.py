"""The presses: one policy a file."""

from kvpress.presses.adakv import AdaKVPress
from kvpress.presses.base import BasePress, Observation
from kvpress.presses.chunk import ChunkPress
from kvpress.presses.duo_attention import DuoAttentionPress
from kvpress.presses.head_budget import HeadwisePress
from kvpress.presses.heavy_hitter import H2OPress, HeavyHitterPress
from kvpress.presses.knorm import KnormPress
from kvpress.presses.pyramidkv import PyramidKVPress
from kvpress.presses.random_press import RandomPress
from kvpress.presses.round import RoundPress
from kvpress.presses.sink_window import SinkWindowPress, StreamingLLMPress
from kvpress.presses.snapkv import SnapKVPress


def _adakv(alpha_safeguard: float = 0.2, inner: str = "snapkv", **kwargs) -> AdaKVPress:
    """AdaKV around the press named `inner` (SnapKV by default), built from the remaining arguments."""
    return AdaKVPress(press_from_name(inner, **kwargs), alpha_safeguard=alpha_safeguard)


def _chunkkv(chunk_size: int = 10, inner: str = "snapkv", **kwargs) -> ChunkPress:
    """ChunkKV around the press named `inner` (SnapKV by default), built from the remaining arguments."""
    return ChunkPress(press_from_name(inner, **kwargs), chunk_size=chunk_size)


PRESSES = {
    "adakv": _adakv,
    "chunkkv": _chunkkv,
    "duo-attention": DuoAttentionPress,
    "snapkv": SnapKVPress,
    "h2o": HeavyHitterPress,
    "heavy-hitter": HeavyHitterPress,
    "sink-window": SinkWindowPress,
    "streaming-llm": SinkWindowPress,
    "knorm": KnormPress,
    "pyramidkv": PyramidKVPress,
    "random": RandomPress,
}


def press_from_name(name: str, **kwargs) -> BasePress:
    """Build a press by its CLI name (see `PRESSES`)."""
    if name not in PRESSES:
        raise ValueError(f"unknown press {name!r}; choose one of: {', '.join(sorted(PRESSES))}")
    return PRESSES[name](**kwargs)


__all__ = [
    "AdaKVPress",
    "ChunkPress",
    "DuoAttentionPress",
    "HeadwisePress",
    "BasePress",
    "Observation",
    "HeavyHitterPress",
    "H2OPress",
    "KnormPress",
    "PyramidKVPress",
    "RandomPress",
    "RoundPress",
    "SinkWindowPress",
    "StreamingLLMPress",
    "SnapKVPress",
    "PRESSES",
    "press_from_name",
]
