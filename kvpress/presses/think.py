"""ThinK: thinner keys. Each head drops the key channels its queries barely use, on top of any token eviction.

Xu et al. 2024, "ThinK: Thinner Key Cache by Query-Driven Pruning" (arXiv:2407.21018, ICLR 2025): a head's keys
have a few channels of large magnitude and many that add little to q.k. Channel j of a head scores
||Q_w[:, j]|| x ||K[:, j]|| (the Frobenius norm of its rank-one share of Q_w K^T; Q_w: the last queries, K: the
kept keys), and the lowest `key_channel_ratio` of the channels leave the key cache; queries meet the keys on the
channels kept, with the model's own scale. Values are untouched, so the cache shrinks by half that ratio. The
paper (LLaMA and Mistral on LongBench and needles) reports over 20% less memory than token eviction alone at
comparable accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from kvpress.counts import floor_share
from kvpress.patches import model_access
from kvpress.presses.base import BasePress, Observation
from kvpress.presses.head_budget import HeadwisePress
from kvpress.presses.wrapping import WrapsPress, wrapped_chain


@dataclass
class ThinKPress(WrapsPress, BasePress):
    """The tokens another press keeps, with each KV head's least used key channels dropped.

    Parameters:
        press: the press that chooses the tokens (SnapKV in `think`); its budget, sinks and window are used as they
            are. A per-head press (AdaKV, DuoAttention) is refused: its per-head storage keeps every channel; so is
            one that reads every key channel (ExpectedAttention rotates its query statistics over all of them: its
            first eviction while decoding, over thinned keys, failed; a frozen answer never reaches one).
        key_channel_ratio: the fraction of each head's key channels pruned (default 0.4, a setting the paper
            reports; not tuned here): keys keep d - floor(d x ratio) channels. On SmolLM2 it lost more than
            evicting tokens for the same bytes (eval/results/README.md, "ThinK"): a baseline, not a default.
        query_window: the last queries whose channel norms score the channels (default 32; not tuned here).

    The channels are chosen once per layer, at its first eviction step (the prefill; with chunks, the first
    chunk), per row and KV head (the queries of its group together; a padded row's padding queries left out), and
    every key cached later keeps the same channels (the paper keeps the newest keys whole; here the cache stays one
    tensor of one width). In a chunked prefill of a left-padded batch they are chosen once every row holds real
    keys, for all rows at once (one width): a row that holds real keys sooner chooses later than alone. The layer
    stores the keys narrower (`PressedLayer.prune_key_channels`): memory saved, nothing masked. At
    compression_ratio 0 nothing is pruned (every press is the identity there). Not with
    `kv_bits` or `rerotate`, and it cannot itself be wrapped (a wrapper would not call its pruning).
    """

    wrappable: ClassVar[bool] = False
    shrinks_kept_tokens: ClassVar[bool] = True  # (the keys it keeps lose channels)

    press: BasePress | None = None
    key_channel_ratio: float = 0.4
    query_window: int = 32

    def __post_init__(self) -> None:
        self.adopt_press(refused=(HeadwisePress,))
        if self.press.per_head:
            raise TypeError(f"ThinKPress thins dense layers' keys; {type(self.press).__name__} moves layers to "
                            "per-head storage, which keeps every channel")  # fmt: skip
        ratio = self.key_channel_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
            raise ValueError(f"key_channel_ratio must be a fraction in [0, 1), got {ratio!r}")
        window = self.query_window
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"query_window must be a positive integer, got {window!r}")
        rotating = [type(p).__name__ for p in wrapped_chain(self.press) if p.reads_every_key_channel]
        if rotating:
            raise TypeError(f"ThinKPress hands its press the key channels kept; {rotating[0]} reads every "
                            "channel (it rotates query statistics with the model's RoPE frequencies): wrap another "
                            "press")  # fmt: skip
        if self.kv_bits is not None or self.press.rerotate:
            raise ValueError("ThinKPress stores keys with fewer channels: the wrapped press cannot also set kv_bits "
                             "or rerotate")  # fmt: skip
        super().__post_init__()

    def check_model(self, model: nn.Module) -> None:
        super().check_model(model)
        dim = model_access.head_dim(model)
        if self.key_channel_ratio > 0 and floor_share(dim, self.key_channel_ratio) == 0:
            raise ValueError(f"key_channel_ratio={self.key_channel_ratio} prunes none of the {dim} key channels of "
                             f"{type(model).__name__}'s heads (floor({dim} x {self.key_channel_ratio}) = 0): use at "
                             f"least 1/{dim} = {1 / dim:.4g}, or the wrapped press alone")  # fmt: skip

    def score(self, obs: Observation) -> torch.Tensor:
        return self.press.score(obs)

    def ranked_scores(self, obs: Observation, budgets: torch.Tensor, per_head_scale: bool = False) -> torch.Tensor:
        return self.press.ranked_scores(obs, budgets, per_head_scale)

    def after_eviction(self, obs: Observation) -> None:
        self.press.after_eviction(obs)
        layer = obs.layer
        if layer.key_channels is not None or layer.n == 0 or self.compression_ratio == 0:
            return  # every decoding step after the first eviction; r = 0 keeps everything, channels too
        if layer.padded and min(layer.held().tolist()) == 0:
            return  # a row that holds only padding yet (a first chunk): chosen once every row holds real keys
        keys = layer.held_kv()[0]
        dim = keys.shape[-1]
        kept = dim - floor_share(dim, self.key_channel_ratio)
        if kept == dim:
            return
        w = min(self.query_window, obs.q_len)  # a row's real queries are its last ones (left padding before them)
        real = torch.arange(w) >= w - torch.tensor(layer.seen_list()).clamp(max=w)[:, None]  # [B, w]
        scores = channel_scores(obs.query[:, :, -w:], keys, layer.valid, real.to(keys.device))
        layer.prune_key_channels(scores.topk(kept, dim=-1).indices.sort(dim=-1).values)


def channel_scores(query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor | None = None,
                   real: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`[B, Hkv, D]` ||Q[:, j]|| x ||K[:, j]|| per channel j: `query` `[B, Hq, w, D]` (the query heads of each KV head
    together; queries not `real` `[B, w]`, a padded row's padding, left out), `keys` `[B, Hkv, n, D]` (slots not
    `valid` left out)."""
    b, hq, w, d = query.shape
    hkv = keys.shape[1]
    query = query.float() if real is None else query.float() * real[:, None, :, None]
    q_norm = query.reshape(b, hkv, (hq // hkv) * w, d).norm(dim=2)
    k = keys.float() if valid is None else keys.float() * valid[..., None]
    return q_norm * k.norm(dim=2)
