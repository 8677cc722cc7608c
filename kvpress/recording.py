"""A recorded prefill: the full cache plus each layer's queries, and the press applied to it afterwards.

Within a prefill forward a press only evicts after a layer's attention, so no layer's output depends on
the press: applying the press to the recorded full cache, layer by layer, leaves exactly the cache a
live prefill under the press would have left. The sweep uses this to serve every (press, ratio) from
one prefill; presses that score the context with a pass of their own (KVzip's reconstruction) need the
whole context cached first, so they always go this way (`BasePress.prepare`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import DynamicCache

from kvpress.engine import SCORING, QueryRecorder, Recording, compress_layers, observe
from kvpress.presses.base import BasePress

__all__ = ["QueryRecorder", "Recording", "compress_recording", "record_prefill"]


@torch.no_grad()
def record_prefill(
    model: nn.Module,
    ids: torch.Tensor,
    cache: DynamicCache | None = None,
    next_ids: torch.Tensor | None = None,
    keep_hidden: bool = False,
) -> Recording:
    """Prefill `ids` into `cache` (a new one by default) with nothing evicted, recording the queries
    (`next_ids`: the prompt tokens that follow, see `Recording`) and, with `keep_hidden`, each layer's input
    hidden states (what presses with `needs_hidden`, KVzap, score from)."""
    recorder = QueryRecorder(keep_hidden)
    cache = DynamicCache(config=model.config) if cache is None else cache
    with observe(model, recorder):
        model(ids, cache=cache, use_cache=True, logits_to_keep=1)  # no logits needed: a 4K prompt's are 0.8-2.5 GB
    return Recording(cache, recorder.queries, ids, next_ids, hidden=recorder.hidden)


@torch.no_grad()
def compress_recording(
    model: nn.Module, recording: Recording, press: BasePress, tokenizer=None, in_place: bool = False
) -> DynamicCache:
    """The cache `press` would have left after the recorded prefill: a copy (the recording is not
    changed), or `recording.cache` itself with `in_place=True`. `tokenizer` is for presses that write a
    prompt of their own (KVzip's repeat request)."""
    if not isinstance(recording, Recording):
        raise TypeError(f"recording must be a kvpress Recording (record_prefill(model, ids)), got "
                        f"{type(recording).__name__}")  # fmt: skip
    if not isinstance(press, BasePress):
        raise TypeError(f"press must be a kvpress press (kvpress.press_from_name('snapkv', compression_ratio=0.5), "
                        f"...), got {press!r}")  # fmt: skip
    if not isinstance(in_place, bool):
        raise TypeError(f"in_place must be True or False, got {in_place!r}")
    if press.rerotate:
        raise ValueError("presses applied to a recorded prefill cannot re-rotate keys; rerotate=True needs a live one")
    if recording.compressed:
        raise ValueError("this recording's cache was compressed in place (compress_recording(..., in_place=True)): it "
                         "no longer holds the prefill its queries were recorded over, so a press applied to it again "
                         "would not leave what a live prefill leaves; record the prefill again")  # fmt: skip
    press(model)  # validates the press for this model (a head pattern for another model is refused here)
    if press.needs_hidden and not recording.hidden:
        raise ValueError(f"{type(press).__name__} scores from the hidden states, which this recording did not keep: "
                         "record it with record_prefill(..., keep_hidden=True)")  # fmt: skip
    ids = None if recording.ids.is_floating_point() else recording.ids
    with SCORING:  # the press holds the recording's scores until it has evicted by them
        try:
            press.prepare(model, recording, tokenizer)
            cache = recording.cache if in_place else copy.deepcopy(recording.cache)
            recording.compressed = in_place
            compress_layers(press, cache, recording.queries, recording.hidden, ids)
        finally:
            press.forget(recording.cache)
    return cache
