"""A recorded prefill: the full cache plus each layer's queries, and the press applied to it afterwards.

Within a prefill forward a press only evicts after a layer's attention, so no layer's output depends on
the press: applying the press to the recorded full cache, layer by layer, leaves exactly the cache a
live prefill under the press would have left. The sweep uses this to serve every (press, ratio) from
one prefill; presses that score the context with a pass of their own (KVzip's reconstruction) need the
whole context cached first, so they always go this way (`BasePress.prepare`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache

from kvpress.engine import Observation, evict, observe, within_window
from kvpress.presses.base import BasePress


class QueryRecorder:
    """An observer (`kvpress.engine.observe`) that keeps each layer's attention module and the queries of the
    forwards it sees (the latest forward's per layer)."""

    def __init__(self) -> None:
        self.queries: dict[int, tuple[nn.Module, torch.Tensor]] = {}

    def __call__(self, obs: Observation) -> None:
        self.queries[obs.layer_idx] = (obs.module, obs.query)


@dataclass
class Recording:
    """A full prefill of `ids` `[1, n]`: its cache and, per compressible layer, the attention module and
    its queries. `next_ids` are the prompt tokens the caller feeds after compression (the prompt's last
    token when the question was prefilled too; none when only a context was), for presses that draft
    the answer (Lookahead). `memo` keeps what presses derive from the recording alone (KVzip's scores),
    so every ratio of a sweep reuses it."""

    cache: DynamicCache
    queries: dict[int, tuple[nn.Module, torch.Tensor]]
    ids: torch.Tensor
    next_ids: torch.Tensor | None = None
    memo: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.ids.shape[1]


@torch.no_grad()
def record_prefill(
    model: nn.Module, ids: torch.Tensor, cache: DynamicCache | None = None, next_ids: torch.Tensor | None = None
) -> Recording:
    """Prefill `ids` into `cache` (a new one by default) with nothing evicted, recording the queries
    (`next_ids`: the prompt tokens that follow, see `Recording`)."""
    recorder = QueryRecorder()
    cache = DynamicCache(config=model.config) if cache is None else cache
    with observe(model, recorder):
        model(ids, cache=cache, use_cache=True)
    return Recording(cache, recorder.queries, ids, next_ids)


@torch.no_grad()
def compress_recording(
    model: nn.Module, recording: Recording, press: BasePress, tokenizer=None, in_place: bool = False
) -> DynamicCache:
    """The cache `press` would have left after the recorded prefill: a copy (the recording is not
    changed), or `recording.cache` itself with `in_place=True`. `tokenizer` is for presses that write a
    prompt of their own (KVzip's repeat request)."""
    if press.rerotate:
        raise ValueError("presses applied to a recorded prefill cannot re-rotate keys; rerotate=True needs a live one")
    press(model)  # validates the press for this model (a head pattern for another model is refused here)
    press.prepare(model, recording, tokenizer)
    cache = recording.cache if in_place else copy.deepcopy(recording.cache)
    for idx, (module, query) in recording.queries.items():
        layer = cache.layers[idx]
        obs = Observation(module, query, layer.keys[:, :, : layer.n], layer.values[:, :, : layer.n], layer)
        replacement = evict(press, within_window(obs))  # what the live intercept calls after this layer's attention
        if replacement is not None:  # a head-wise press moved the layer to per-head storage
            cache.layers[idx] = replacement
    return cache
