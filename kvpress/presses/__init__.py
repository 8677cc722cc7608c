"""The presses: one policy a file."""

from kvpress.presses.base import BasePress, Observation
from kvpress.presses.heavy_hitter import H2OPress, HeavyHitterPress
from kvpress.presses.knorm import KnormPress
from kvpress.presses.pyramidkv import PyramidKVPress
from kvpress.presses.random_press import RandomPress
from kvpress.presses.sink_window import SinkWindowPress, StreamingLLMPress
from kvpress.presses.snapkv import SnapKVPress

PRESSES = {
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
    "BasePress",
    "Observation",
    "HeavyHitterPress",
    "H2OPress",
    "KnormPress",
    "PyramidKVPress",
    "RandomPress",
    "SinkWindowPress",
    "StreamingLLMPress",
    "SnapKVPress",
    "PRESSES",
    "press_from_name",
]
