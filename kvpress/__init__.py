"""kvpress: KV-cache compression for Hugging Face transformers that frees real memory.

    press = kvpress.SnapKVPress(compression_ratio=0.5)
    with press(model):
        model.generate(...)

Importing kvpress patches nothing; entering a press does, and leaving it restores the model.
"""

from kvpress.chat import ChatSession, Round
from kvpress.models import load_model
from kvpress.patches.cache import PressedLayer, cache_bytes
from kvpress.patches.head_cache import HeadwiseLayer
from kvpress.pipeline import generate
from kvpress.presses import (
    DEFAULT_PRESS,
    PRESSES,
    AdaKVPress,
    BasePress,
    ChunkPress,
    DuoAttentionPress,
    H2OPress,
    HeavyHitterPress,
    KnormPress,
    KVzipPress,
    LookaheadPress,
    Observation,
    PyramidKVPress,
    RandomPress,
    RoundPress,
    SinkWindowPress,
    SnapKVPress,
    StreamingLLMPress,
    press_from_name,
)
from kvpress.round_store import RoundStore
from kvpress.stream import stream

__all__ = [
    "DEFAULT_PRESS",
    "AdaKVPress",
    "BasePress",
    "ChunkPress",
    "DuoAttentionPress",
    "HeadwiseLayer",
    "ChatSession",
    "H2OPress",
    "HeavyHitterPress",
    "KnormPress",
    "KVzipPress",
    "LookaheadPress",
    "Observation",
    "PRESSES",
    "PressedLayer",
    "PyramidKVPress",
    "RandomPress",
    "RoundPress",
    "Round",
    "RoundStore",
    "SinkWindowPress",
    "SnapKVPress",
    "StreamingLLMPress",
    "cache_bytes",
    "generate",
    "load_model",
    "press_from_name",
    "stream",
]
