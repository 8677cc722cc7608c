"""KVzap: KVzip's scores predicted from the hidden states, in the forward that caches them.

Jeblick et al. 2026, "KVzap: Fast, Adaptive, and Faithful KV Cache Pruning" (arXiv:2601.07891): KVzip
(arXiv:2505.23416) scores a cached token by the attention the model pays it while repeating the context,
which costs a second pass and cannot score tokens generated later. KVzap trains, once per model, a small
model per layer that reads the hidden state entering a layer's attention and predicts the log of that
token's KVzip score for each KV head; at run time the prediction is one matrix product per layer, for the
prompt's tokens and for every generated one (the paper: 2-4x compression with negligible loss on Qwen3-8B,
Llama-3.1-8B and Qwen3-32B; its linear and 2-layer models score alike). The scorers here are linear, trained
by `kvpress train-scorer` on text no task here uses and shipped per model with its architecture hash.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from kvpress.patches import model_access
from kvpress.patches.head_cache import HeadwiseLayer
from kvpress.presses.base import BasePress, Observation, shares_within
from kvpress.presses.head_budget import head_observation
from kvpress.presses.snapkv import check_kernel_size, pool_by_position
from kvpress.scorers import Scorer, find_scorer, load_scorer
from kvpress.words import max_over_words, next_word_starts, word_starts

_SCORE = "kvzap"
_MASS = "kvzap_mass"
_WORD = "kvzap_word"  # per slot: the position its word starts at (whole_words)
_WORD_END = "kvzap_word_end"  # per slot: 1 where its text ends with a letter or digit (the next token may join it)
MASS_FLOOR = 1e-8  # attention mass below it counts as it (in training too: `kvpress.train_scorer`)
MASS_BLOCK = 64  # queries whose attention weights a scorer with mass features sums at once (as H2O's chunk)


@dataclass
class KVzapPress(BasePress):
    """Keep the tokens a learned per-layer model predicts KVzip would keep, scored as they are cached.

    Parameters:
        compression_ratio / max_tokens: the budget (see `BasePress`); enforced at the prefill and while
            decoding, so long generations are compressed by the same rule.
        scorer: "auto" (default: the packaged scorer trained for the model's architecture), a packaged
            scorer's model name ("smollm2-135m", "qwen2.5-0.5b"), a safetensors path, or a `Scorer`.
        n_sink: leading tokens always kept (default 0, as KVzipPress).
        window_size: last tokens always kept (default 16, as KVzipPress).
        value_norm: weight each predicted score by the L2 norm of the token's value (default False), as
            `KVzipPress(value_norm=True)` does.
        global_budget: the fraction g in [0, 1] of the budget spread across layers as KVzip's `global_budget`
            spreads it (default 0: every layer keeps the same number; KVzipPress's default is 0.5): each layer
            keeps (1 - g) + g x its share of KVzip's ranking of all layers' scores together, read from the
            scorer's layer profile (measured at training, per compression ratio, interpolated between), since a
            live prefill evicts each layer before the next one has scores (a layer whose share is more than
            its context keeps it, the others sharing the rest: `shares_within`). Needs compression_ratio (the
            profile is per ratio), not max_tokens; refused, as `layer_scales` are, on a model with sliding-window
            layers beside full-attention ones.
        kernel_size: width of the pooling of the scores over neighbouring positions (default 1: none; odd), as
            SnapKV pools its attention, so a kept token's neighbours (the rest of a number, of a name) stay with it.
        pool: "mean" (default: SnapKV's average) or "max" (a token scores as its best neighbour). Neither kept more
            of SmolLM2's essay needles at r = 0.75 (max pooling fewer: eval/results/README.md, "KVzap pooled").
        whole_words: each token scores as the best-scored token of its word (default False; `kvpress.words`: tokens
            joined without a space or punctuation, such as the digits of a number), so a word is kept or evicted
            whole: where KVzap kept "854" of the needle "85452". Needs the token ids (a forward given embeddings is
            refused) and the scorer's word table (`kvpress train-scorer --update-words`; the packaged scorers have it).

    A scorer trained with the attention mass (`kvpress train-scorer --attention-mass`: `Scorer.mass_weight`) adds, per
    KV head, the log of the attention the token has received so far (summed over the queries and query heads that saw
    it, as H2O accumulates it; the attention then runs in blocks that give its weights, `mass_block`) and the log of
    how many queries saw it: the part of KVzip's score a token's own hidden state cannot tell (how much the rest of
    the context looks at it). Those two terms change as later tokens arrive; the hidden state's part does not.

    The hidden state's part of a token's score is fixed when it is cached, so the press needs the hidden states the
    intercept hands it: live forwards and recorded prefills have them; RoundPolicy's rounds, compressed at the end
    of their turn, do not (refused as its `inner`).
    """

    needs_hidden: ClassVar[bool] = True
    observes_frozen: ClassVar[bool] = True  # a question read inside frozen() gets its scores too

    scorer: str | Scorer = "auto"
    n_sink: int = 0
    window_size: int = 16
    value_norm: bool = False
    global_budget: float = 0.0
    kernel_size: int = 1
    pool: str = "mean"
    whole_words: bool = False
    _weights: weakref.WeakKeyDictionary = field(  # by attention module: a model's go with it
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False, compare=False)
    _edges: weakref.WeakKeyDictionary = field(  # by attention module: a model's go with it
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False, compare=False)
    _shares: tuple[float, ...] | None = field(default=None, init=False, repr=False, compare=False)  # layer scales
    _uses_mass: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.scorer, (str, Scorer)) or (isinstance(self.scorer, str) and not self.scorer):
            raise ValueError(f"scorer must be 'auto', a packaged scorer's name, a path or a Scorer, got "
                             f"{self.scorer!r}")  # fmt: skip
        for name in ("value_norm", "whole_words"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        g = self.global_budget
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g <= 1:
            raise ValueError(f"global_budget must be a fraction in [0, 1], got {g!r}")
        check_kernel_size(self.kernel_size, self.pool)
        if g and self.max_tokens is not None:
            raise ValueError("KVzapPress's global_budget spreads a compression ratio's budget across layers by the "
                             "scorer's profile, measured per ratio: use compression_ratio, or global_budget=0 with "
                             "max_tokens")  # fmt: skip
        if g and self.layer_scales is not None:
            raise ValueError("KVzapPress sets layer budgets from its scorer (global_budget > 0); pass global_budget=0 "
                             "to give layer_scales yourself")  # fmt: skip
        super().__post_init__()

    def check_model(self, model: nn.Module) -> None:
        scorer = find_scorer(model) if self.scorer == "auto" else load_scorer(self.scorer)
        scorer.check(model)
        if self.whole_words and scorer.word_edges is None:
            raise ValueError(f"KVzapPress(whole_words=True) reads which tokens join into words from its scorer, and "
                             f"scorer {scorer.model!r} has no word table: add it with `kvpress train-scorer --model "
                             f"... --out SCORER --update-words`")  # fmt: skip
        for idx, module in model_access.attention_modules(model).items():  # one press may serve several models
            mass = None if scorer.mass_weight is None else scorer.mass_weight[idx]
            self._weights[module] = (scorer.weight[idx], scorer.bias[idx], mass)
            if self.whole_words:
                self._edges[module] = scorer.word_edges
        self._uses_mass = scorer.mass_weight is not None
        if self.global_budget:  # layer budgets: of the model it was installed on last, once (not at every step)
            g = self.global_budget
            shares = (1 - g) + g * scorer.layer_shares(self.compression_ratio)
            scales = tuple(float(share * len(shares) / shares.sum()) for share in shares)
            self._shares = shares_within(scales, self.compression_ratio)

    @property
    def spreads_over_layers(self) -> bool:
        return self.layer_scales is not None or bool(self.global_budget)  # (its scorer's profile of layers)

    def layer_scale(self, layer_idx: int, n_layers: int) -> float:
        if self._shares is None:
            return super().layer_scale(layer_idx, n_layers)
        if len(self._shares) != n_layers:
            raise ValueError(f"KVzapPress's layer budgets (global_budget) are those of the model it was installed on "
                             f"last ({len(self._shares)} layers), not of this one ({n_layers}): use one press per "
                             "model")  # fmt: skip
        return self._shares[layer_idx]

    def observe(self, obs: Observation) -> None:
        """Predict the scores of the new tokens (the last `hidden.shape[1]` held slots) from their hidden states."""
        weight, bias, mass = self._layer_weights(obs.module, obs.hidden, obs.keys.device)
        if mass is not None:
            obs.layer.slot(_MASS).add_(obs.attention_mass(MASS_BLOCK))
        predicted = self._predict(obs.hidden, weight, bias)[:, obs.kv_heads]  # [B, H, q]
        q = predicted.shape[-1]
        slot = obs.layer.slot(_SCORE)
        slot[..., slot.shape[-1] - q :] = predicted
        if self.whole_words:
            starts, ends = obs.layer.slot(_WORD), obs.layer.slot(_WORD_END)
            n = starts.shape[-1]
            pos = obs.layer.pos[..., :n]
            starts[..., n - q :], ends[..., n - q :] = word_starts(
                self._word_edges(obs.module, obs.ids, obs.keys.device), obs.ids[:, -q:], pos[..., n - q :],
                pos[..., : n - q], starts[..., : n - q], ends[..., : n - q])  # fmt: skip

    def observe_headwise(self, module: nn.Module, query: torch.Tensor, layer: HeadwiseLayer,
                         hidden: torch.Tensor | None, ids: torch.Tensor | None,
                         mass: torch.Tensor | None) -> None:  # fmt: skip
        """`observe` for every (row, KV head) of a head-wise layer at once: one prediction for the layer, the new
        tokens' words joined per pair to the slot each holds just before them, the attention mass the head-wise
        attention computed (per pair here only where it did not: a sliding-window layer)."""
        weight, bias, mass_weight = self._layer_weights(module, hidden, layer.device)
        q = query.shape[2]
        new = layer.newest(q)  # [B, H, q]
        flat = new.view(-1)  # (flat index ops: advanced indexing costs more, in every layer at every step)
        layer.state(_SCORE).index_copy_(0, flat, self._predict(hidden, weight, bias).reshape(-1))
        if mass_weight is not None:
            if mass is None:
                mass = torch.zeros_like(layer.state(_MASS))
                for i in range(layer.batch * layer.heads):
                    obs, _ = head_observation(module, query, layer, i // layer.heads, i % layer.heads)
                    mass[layer.bounds[i] : layer.bounds[i] + layer.lengths[i]] = obs.attention_mass(MASS_BLOCK)[0, 0]
            layer.state(_MASS).add_(mass)
        if self.whole_words:
            starts, ends = layer.state(_WORD), layer.state(_WORD_END)
            # a pair holding only the new tokens has no slot before them (the one there is another pair's)
            alone = None if min(layer.lengths) > q else layer.held().view(-1).to(layer.device) <= q
            word, end = next_word_starts(self._word_edges(module, ids, layer.device), ids, new.view(-1, q),
                                         layer.store["pos"], starts, ends, layer.heads, alone)  # fmt: skip
            starts.index_copy_(0, flat, word)
            ends.index_copy_(0, flat, end)

    def _layer_weights(self, module: nn.Module, hidden: torch.Tensor | None, device: torch.device) -> tuple:
        """The scorer's (weight, bias, mass weights or None) of `module`'s layer, on `device`."""
        if hidden is None:
            raise ValueError("KVzapPress scores tokens from the hidden states entering each layer's attention, which "
                             "this path does not give (RoundPolicy's rounds): use another press there")  # fmt: skip
        if module not in self._weights:
            raise RuntimeError("KVzapPress was not installed on this model: enter `with press(model):` first")
        weight, bias, mass = self._weights[module]
        if weight.device != device:
            weight, bias = weight.to(device), bias.to(device)
            mass = None if mass is None else mass.to(device)
            self._weights[module] = (weight, bias, mass)
        return weight, bias, mass

    @staticmethod
    def _predict(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """`[B, H, q]` the predicted scores of every KV head from the hidden states `[B, q, d]`."""
        return (hidden.to(weight.device, torch.float32) @ weight + bias).exp().transpose(1, 2)

    def _word_edges(self, module: nn.Module, ids: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """The scorer's word table on `device`; refuses a forward without token ids."""
        if ids is None:
            raise ValueError("KVzapPress(whole_words=True) groups tokens into words by their ids, which this "
                             "forward did not give (it was given inputs_embeds): pass input_ids, or whole_words=False")
        edges = self._edges[module]
        if edges.device != device:
            edges = self._edges[module] = edges.to(device)
        return edges

    def mass_block(self) -> int | None:
        return MASS_BLOCK if self._uses_mass else None

    def score(self, obs: Observation) -> torch.Tensor:
        scores = obs.layer.slot(_SCORE)
        mass = self._weights[obs.module][2] if obs.module in self._weights else None
        if mass is not None:  # [2, H]: the weights of log mass received and log queries that saw the token
            a, c = (w[obs.kv_heads][None, :, None] for w in mass)
            layer = obs.layer
            seen = (layer.real_seen.to(layer.pos.device)[:, None, None] - layer.pos).clamp_min(1).float()
            scores = scores * layer.slot(_MASS).clamp_min(MASS_FLOOR).pow(a) * seen.pow(c)
        if self.value_norm:
            scores = scores * obs.values.float().norm(dim=-1)
        if self.whole_words:
            valid = obs.layer.valid
            valid = None if valid is None else valid[..., : scores.shape[-1]]
            scores = max_over_words(scores, obs.layer.slot(_WORD), valid)
        return pool_by_position(scores, obs.layer, self.kernel_size, self.pool)
