"""kvpress: KV-cache compression for Hugging Face transformers that frees real memory.

    press = kvpress.SnapKVPress(compression_ratio=0.5)
    with press(model):
        model.generate(...)

Importing kvpress patches nothing (it registers the pipeline task `kv-press-text-generation`); entering a press
does, and leaving it restores the model.
"""

from kvpress import presses
from kvpress.chat import ChatSession, Round
from kvpress.engine import PressInstallation, observe
from kvpress.models import load_model
from kvpress.patches.cache import PressedLayer, cache_bytes
from kvpress.patches.head_cache import HeadwiseLayer
from kvpress.patches.user_warnings import KVPressWarning
from kvpress.pipeline import generate
from kvpress.presses import *  # noqa: F403  (every press class of the registry, and the registry's API)
from kvpress.presses.recall import offloaded_bytes
from kvpress.round_store import RoundStore
from kvpress.rounds import RoundPolicy, RoundPress
from kvpress.saved_cache import load_cache, save_cache
from kvpress.stream import stream
from kvpress.text_pipeline import KVPressTextGenerationPipeline  # registers the pipeline task on import

__all__ = presses.__all__ + [
    "ChatSession",
    "HeadwiseLayer",
    "KVPressTextGenerationPipeline",
    "KVPressWarning",
    "PressInstallation",
    "PressedLayer",
    "Round",
    "RoundPolicy",
    "RoundPress",
    "RoundStore",
    "cache_bytes",
    "generate",
    "load_cache",
    "load_model",
    "observe",
    "offloaded_bytes",
    "save_cache",
    "stream",
]
