"""The press API: a press decides, per layer and KV head, which cached tokens stay.

A press is a dataclass with a budget (`compression_ratio` or `max_tokens`) and a `score()`:
higher scores stay. `with press(model):` installs it; after each attention call the engine
(`kvpress.engine.evict`) hands the press an `Observation`, and when a row holds more real tokens than
its budget it ranks the held slots by the press's scores and the layer evicts the lowest (freeing
their storage).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import threading
import types
import typing
import weakref
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from kvpress.counts import floor_share
from kvpress.engine import Installable, Observation, same_value
from kvpress.patches import kv_quantization as quant
from kvpress.patches.cache import PressedLayer
from kvpress.patches.head_cache import HeadwiseLayer
from kvpress.patches.user_warnings import warn


@functools.lru_cache(maxsize=256)
def normalised(shares: tuple[float, ...]) -> tuple[float, ...]:
    """Positive per-layer `shares` scaled to average 1."""
    return tuple(s * len(shares) / sum(shares) for s in shares)


@functools.lru_cache(maxsize=256)
def shares_within(shares: tuple[float, ...], compression_ratio: float | None = None) -> tuple[float, ...]:
    """Per-layer budget `shares` (average 1) with none above the whole context at `compression_ratio` (a share of
    1 / (1 - r)): what a capped layer cannot hold goes to the others in proportion to their shares (water-filling),
    so the layers together keep the budget. Returned as given where no layer is over (or r is None or 0)."""
    if not compression_ratio or max(shares) <= 1 / (1 - compression_ratio):
        return shares
    n, cap, capped = len(shares), 1 / (1 - compression_ratio), set()
    norm = normalised(shares)
    while True:
        free = [i for i in range(n) if i not in capped]
        m = (n - len(capped) * cap) / sum(norm[i] for i in free)  # (mean 1 <= cap: some layer stays free)
        over = {i for i in free if norm[i] * m > cap}
        if not over:
            return tuple(cap if i in capped else s * m for i, s in enumerate(norm))
        capped |= over


def plain_number(value):
    """A numpy (or other `numbers`-registered) scalar as the Python int or float it holds (np.int64(4) -> 4), so
    that a budget taken from a numpy sweep passes the checks of an int or float field; anything else as it is."""
    if type(value) in (int, float, bool) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


class PlainNumbers:
    """A dataclass whose fields take numpy scalars as the Python numbers they hold (`plain_number`), as it is built
    and when a field is set later (`press.max_tokens = np.int64(256)`)."""

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, plain_number(value))


# `check_budget` syncs a wrapper's budget with the press it wraps (and a window press's with its window): one thread
# at a time, so a press installed on two models at once reads one budget (re-entrant: a wrapper checks its press)
BUDGET_LOCK = threading.RLock()


def _check_ratio(value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, nn.Module):  # (`SnapKVPress(model)`: its first field is the ratio)
        raise TypeError(f"compression_ratio must be a number in [0, 1), got a {type(value).__name__}: a press is "
                        "built with its budget, then applied to the model (`with SnapKVPress(0.5)(model):`)")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"compression_ratio must be a number in [0, 1), got {value!r}")
    if not 0 <= value < 1:
        raise ValueError(f"compression_ratio must be in [0, 1) (the fraction of cached tokens removed), got {value}")


def check_field_types(obj) -> None:
    """Raise unless every init field of the dataclass `obj` holds a value of its annotated type: an int
    field takes no bool, a float field a finite int or float, a tuple field its element type; types that
    are not plain (a press, a dict, a callable) are left to the class. Ranges stay with each class."""
    hints = _type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if not f.init or f.name not in hints:
            continue
        value, hint = getattr(obj, f.name), hints[f.name]
        allowed = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        if not any(_fits(value, t) for t in allowed):
            names = " or ".join("None" if t is type(None) else getattr(t, "__name__", str(t)) for t in allowed)
            kind = ValueError if isinstance(value, float) and not math.isfinite(value) else TypeError
            raise kind(f"{type(obj).__name__}: {f.name} must be {names}"
                       f"{' (finite)' if float in allowed else ''}, got {value!r}")  # fmt: skip


_type_hints = functools.cache(typing.get_type_hints)  # per class: presses are built per example in sweeps


def _fits(value, kind) -> bool:
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if typing.get_origin(kind) is tuple:
        element = typing.get_args(kind)[0]
        return isinstance(value, tuple) and all(_fits(v, element) for v in value)
    return isinstance(value, kind) if isinstance(kind, type) else True


def scaled_to_peak(scores: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """`scores` `[..., n]` (float) divided by each row's largest finite |score| (over `valid` slots only when
    given): a positive number, so each row's order is unchanged and rows compare by shape, not scale."""
    counted = scores.isfinite() if valid is None else scores.isfinite() & valid
    peak = scores.abs().masked_fill(~counted, 0.0).amax(dim=-1, keepdim=True)
    return scores / peak.clamp_min(torch.finfo(scores.dtype).tiny)


# the fields a press declares to protect tokens (see `sink_count`, `recent_count`): checked by BasePress
PROTECTED_FIELDS = ("n_sink", "window_size")
_WEAK_TABLES = "_kvpress_weak_tables"  # (`BasePress.__getstate__`: the names of the weak tables left out)


@dataclass
class BasePress(PlainNumbers, Installable):
    """Base of every press.

    Parameters:
        compression_ratio: fraction r in [0, 1) of each row's cached tokens removed (r = 0: no eviction).
        max_tokens: a fixed budget of tokens per layer and KV head instead. Exactly one of the two.
        rerotate: re-rotate kept keys to positions inside the cache (StreamingLLM), so the model never
            sees a position beyond the cache size and can run past `max_position_embeddings` (default False).
        layer_scales: optional relative budgets per layer (normalised to average 1): layers keep
            different numbers of tokens, the total staying that of the budget (each share rounded down: up to one
            token a layer less; with compression_ratio, a layer whose share is more than its whole context keeps
            it all and the others share the rest, `shares_within`; with max_tokens such a layer keeps its
            context, said once, and the total is less). Refused on a model with sliding-window layers beside
            full-attention ones (a sliding layer holds its window alone: the total would not be the budget).
        decode_slack: while decoding, a row over its budget is cut to `budget - decode_slack * budget`
            tokens at once, so scoring and copying run every few steps instead of every step (the cache
            never exceeds its budget; default 0.02). 0 evicts one token per step. A press that scores the whole context
            (`needs_whole_context`: KVzip, ...) compresses it once and keeps the tokens generated after it,
            so it takes no decode_slack.
        kv_bits: store the kept keys and values in 8 or 4 bits (None: in the model's dtype), once the press
            has chosen them: each channel normalised by its range, then each slot with a scale of its own
            (`kvpress.patches.kv_quantization`, after KIVI). Eviction and quantization multiply: r = 0.75 at
            4 bits keeps about 1/28 of a full fp32 cache (measured, head size 64).
    """

    # `needs_whole_context` (from `Installable`): True for presses that score the context with a pass of their
    # own once it is all cached (KVzip): applied to a recorded prefill (`kvpress.recording`), or at the end of
    # a live prefill (`PressInstallation.run_forward`), never inside a layer's forward.
    # True for presses that score by the question (Lookahead drafts its answer): query-aware prefills only.
    needs_question: ClassVar[bool] = False
    # False for presses that cannot sit inside a wrapper (AdaKV, PyramidKV, ...): they plan layers themselves
    # (SimLayerKV) or exchange slots between forwards (RecallPress)
    wrappable: ClassVar[bool] = True
    # True for presses whose scores need every key and query channel in RoPE's layout (ExpectedAttention rotates
    # query statistics with the model's frequencies): ThinK, which hands its press the channels it keeps, refuses them
    reads_every_key_channel: ClassVar[bool] = False
    # True for presses that choose by position alone, reading no key, value or query (SinkWindow, Random; ChunkKV,
    # PyramidKV, ShotKV over one): the only ones that run where the cache holds multi-head latent attention's latents
    # (DeepSeek-V2/V3), not keys
    chooses_by_position: ClassVar[bool] = False
    # the press's own parameters that set its budget in place of compression_ratio / max_tokens (SinkWindow's
    # window): a spec that gives one has its budget (the CLI adds no ratio beside it)
    budget_parameters: ClassVar[tuple[str, ...]] = ()
    # True for presses that also shrink the tokens they keep (ThinK prunes key channels): a budget that keeps every
    # token still compresses (`keeps_whole`)
    shrinks_kept_tokens: ClassVar[bool] = False

    compression_ratio: float | None = None
    max_tokens: int | None = None
    rerotate: bool = False
    decode_slack: float = 0.02
    layer_scales: tuple[float, ...] | None = None
    kv_bits: int | None = None

    def __post_init__(self) -> None:
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in PROTECTED_FIELDS:  # before anything reads them (the max_tokens check below)
            value = getattr(self, name, 0)
            if value is None and defaults.get(name) is None:  # a wrapper's field for the press it builds (PyramidKV's)
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        _check_ratio(self.compression_ratio)
        if self.kv_bits is not None:
            quant.check_bits(self.kv_bits)
        if self.layer_scales is not None:
            if isinstance(self.layer_scales, (str, bytes)) or not hasattr(self.layer_scales, "__iter__"):
                raise ValueError(f"layer_scales must be a list of positive numbers, one per layer, got "
                                 f"{self.layer_scales!r} (a press spec cannot give a list: pass it in Python)")
            if isinstance(self.layer_scales, (dict, set, frozenset)):  # (a dict's keys, a set in no order)
                raise ValueError(f"layer_scales must be a list of positive numbers in layer order, got "
                                 f"{self.layer_scales!r}")  # fmt: skip
            self.layer_scales = tuple(plain_number(x) for x in self.layer_scales)
            if not self.layer_scales or any(isinstance(x, bool) or not isinstance(x, (int, float)) or
                                            not math.isfinite(x) or x <= 0 for x in self.layer_scales):  # fmt: skip
                raise ValueError(f"layer_scales must be positive numbers (finite), one per layer, got "
                                 f"{self.layer_scales!r}")  # fmt: skip
            if min(self.layer_scales) < 1e-9 * max(self.layer_scales):  # (shares of 5e-324 divided by zero)
                raise ValueError(f"layer_scales must each be at least 1e-9 of the largest (a layer of a smaller share "
                                 f"keeps one token at any length), got {self.layer_scales!r}")  # fmt: skip
        if not isinstance(self.decode_slack, (int, float)) or not 0 <= self.decode_slack < 1:
            raise ValueError(f"decode_slack must be a fraction in [0, 1), got {self.decode_slack!r}")
        if type(self).needs_whole_context is True and self.decode_slack != BasePress.decode_slack:
            raise ValueError(f"{type(self).__name__} compresses the whole context once and keeps the tokens "
                             f"generated after it: decode_slack has nothing to cut, got {self.decode_slack!r} (a "
                             "press that scores while decoding, such as kvzap, bounds a long generation)")  # fmt: skip
        if type(self).needs_whole_context is True and self.rerotate:
            raise ValueError(f"{type(self).__name__} scores the whole context once it is cached, with a pass of its "
                             "own: it cannot re-rotate keys (rerotate=True needs a press that evicts as the prefill "
                             "runs, such as sink-window)")  # fmt: skip
        self._check_budget_values()
        check_field_types(self)  # after the checks above, whose messages name the allowed range
        self.__dict__["_built_with"] = self._settings()  # (`check_budget`: what the checks above passed)

    def __getstate__(self) -> dict:
        """Pickled without what it keeps by model or cache (weak tables of a model's modules, a weak reference to
        the cache it scored: neither pickles), which come back empty: a loaded press computes them again."""
        state = dict(self.__dict__)
        weak = [name for name, value in state.items() if isinstance(value, weakref.WeakKeyDictionary)]
        state.update({name: None for name, value in state.items() if isinstance(value, weakref.ref)})
        return {**{name: value for name, value in state.items() if name not in weak}, _WEAK_TABLES: weak}

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        self.__dict__.update({name: weakref.WeakKeyDictionary() for name in state.pop(_WEAK_TABLES, ())}, **state)

    def _settings(self) -> dict:
        """The init fields but the budget (and `budget_parameters`, checked with it by `_share_budget`): what
        `__post_init__` checks once (`check_budget` checks them again where they moved)."""
        budget = ("compression_ratio", "max_tokens", *type(self).budget_parameters)
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init and f.name not in budget}

    def _check_moved_settings(self) -> None:
        """Check again the settings set since the press was built (`press.window_size = 8` between runs), as they
        were checked then: a press of the same fields is built, its refusal raised, and what it made of them taken
        (`_take_rebuilt`). Its budget is the press's where the press took it from a setting (SinkWindow's window) or
        from the press it wraps, which also gives it the settings it takes from that press but those moved on it."""
        built = self.__dict__.get("_built_with", {})
        moved = [name for name, value in self._settings().items()
                 if name in built and not same_value(value, built[name])]  # fmt: skip
        if not moved:
            return
        derived = {"compression_ratio": None, "max_tokens": None}  # (a budget the rebuilt press sets itself)
        if "_press_settings" in self.__dict__:  # a wrapper (`wrapping.take_settings`)
            derived |= {f.name: f.default for f in dataclasses.fields(BasePress) if f.name not in moved}
        elif not any(getattr(self, name) is not None for name in type(self).budget_parameters):
            derived = {}
        try:
            rebuilt = dataclasses.replace(self, **derived)
        except (TypeError, ValueError) as error:
            given = ", ".join(f"{name}={getattr(self, name)!r}" for name in moved)
            raise type(error)(f"{type(self).__name__} was given {given} after it was built: {error}") from None
        self._take_rebuilt(rebuilt, moved)
        self.__dict__["_built_with"] = self._settings()

    def _take_rebuilt(self, rebuilt: BasePress, moved: list[str]) -> None:
        """Take the moved settings as the press built of them holds them (`layer_scales` given as a generator: a
        tuple); a press that derives state of its own from a setting takes that too."""
        for name in moved:
            setattr(self, name, getattr(rebuilt, name))

    def _check_budget_values(self) -> None:
        """Exactly one of compression_ratio (in [0, 1)) and max_tokens (a positive integer, at least the
        protected tokens)."""
        _check_ratio(self.compression_ratio)
        if (self.compression_ratio is None) == (self.max_tokens is None):
            raise ValueError(
                f"{type(self).__name__} takes exactly one of compression_ratio (a fraction in [0, 1)) or "
                f"max_tokens (a token budget), got compression_ratio={self.compression_ratio}, "
                f"max_tokens={self.max_tokens}"
            )
        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
                raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
            protected = self.sink_count() + self.recent_count(self.max_tokens)
            if self.max_tokens < protected:
                raise ValueError(
                    f"max_tokens={self.max_tokens} is smaller than the protected tokens of {type(self).__name__} "
                    f"({self.sink_count()} sinks + a window of {self.recent_count(self.max_tokens)}); "
                    f"use max_tokens >= {protected} or a smaller window"
                )

    def check_budget(self) -> None:
        """Check the budget again as the press is installed or applied: it may have been set since the press was
        built (`press.compression_ratio = 0.75` between runs, as a tuning loop does), and a value out of range is
        refused as at construction (to switch between compression_ratio and max_tokens, build a new press:
        `dataclasses.replace(press, compression_ratio=None, max_tokens=256)`)."""
        with BUDGET_LOCK:
            self._check_moved_settings()
            self._share_budget()
            self._check_budget_values()

    def _share_budget(self) -> None:
        """Before `check_budget` checks the values (under its lock): bring the budget in line with what it derives
        from (a wrapped press's, a window's). Nothing for most presses."""

    # ----- what a press defines -----------------------------------------------------------------------
    def score(self, obs: Observation) -> torch.Tensor:
        """Importance of each held slot, `[B, Hkv, n]`: the lowest are evicted."""
        raise NotImplementedError

    def observe(self, obs: Observation) -> None:
        """Called after every attention call, before any eviction (accumulating presses override it)."""

    def observe_headwise(self, module: nn.Module, query: torch.Tensor, layer: HeadwiseLayer,
                         hidden: torch.Tensor | None, ids: torch.Tensor | None,
                         mass: torch.Tensor | None) -> None:  # fmt: skip
        """Optional: `observe` every (row, KV head) of a head-wise layer (`HeadwiseLayer`) in one call, its state in
        `layer.state(name)`; `mass`: the packed attention mass (`headwise_attention`) or None. A press that does
        not define it is observed one head's view at a time (`head_budget.observe_every_head`)."""
        raise NotImplementedError

    def after_eviction(self, obs: Observation) -> None:
        """Called after each eviction step of a dense layer (`obs.layer` holds what stays; per-head presses
        replace the layer instead): ThinK prunes key channels here."""

    def observe_frozen(self, obs: Observation) -> None:
        """Called after every attention call inside `frozen()` for presses with `observes_frozen` (nothing is
        evicted there): `observe` by default."""
        self.observe(obs)

    def mass_block(self) -> int | None:
        """Queries a block when this press reads `Observation.attention_mass` (the attention then computes it with
        its output, from its weights, instead of sdpa's fused kernel); None when it does not (the default)."""
        return None

    def prepare(self, model: nn.Module, recording, tokenizer=None) -> None:
        """Called before this press is applied to a recorded prefill (`kvpress.recording.Recording`);
        presses with `needs_whole_context` run their own pass over the context here."""

    def forget(self, cache=None) -> None:
        """Drop what `prepare` kept of a prompt (scores, a draft: O(prompt) tensors) once nothing reads it: after
        the eviction, or as the block that installed the press ends where it scores later chunks by it (KVzip).
        `cache`: the cache the caller scored last (None: none); what the press keeps for another cache still alive
        (the same press scoring in another block, on another model) stays. Nothing for presses that keep none."""

    def sink_count(self) -> int:
        """Leading tokens always kept (attention sinks): the press's `n_sink` field where it has one."""
        return getattr(self, "n_sink", 0)

    def recent_count(self, budget):
        """Most recent tokens always kept, for a budget `budget` (an int, or a tensor of per-row budgets): the
        press's `window_size` field where it has one."""
        return getattr(self, "window_size", 0)

    def check_model(self, model: nn.Module) -> None:
        """Raise when this press cannot run on `model` (called when the press is installed)."""

    @property
    def spreads_over_layers(self) -> bool:
        """Whether layers keep shares of the budget set before a prompt is seen (`layer_scales`): a share multiplies
        the layer's own budget, so where sliding-window layers hold their window alone the layers' total is not the
        budget (refused there as the press is installed)."""
        return self.layer_scales is not None

    def layer_scale(self, layer_idx: int, n_layers: int) -> float:
        """Budget of layer `layer_idx` relative to the average layer (1.0: every layer the same)."""
        if self.layer_scales is None:
            return 1.0
        if len(self.layer_scales) != n_layers:
            raise ValueError(f"layer_scales has {len(self.layer_scales)} entries but the model has {n_layers} layers")
        return shares_within(normalised(self.layer_scales), self.compression_ratio)[layer_idx]

    # ----- budgets ------------------------------------------------------------------------------------
    def keeps_whole(self, tokens: int) -> str | None:
        """Why a context of `tokens` tokens would be kept whole, nothing compressed (None: it is compressed, or may
        be): a `max_tokens` that holds it, a `compression_ratio` > 0 too small to remove one of its tokens, or
        protected sinks and window that cover it. Said only where every layer keeps one share of the budget and kept
        tokens stay as they are (no `kv_bits`, no channels pruned: those compress all the same). The budget is read
        as it stands (`check_budget` first: a wrapper's is its press's)."""
        self.check_budget()
        if self.kv_bits is not None or self.shrinks_kept_tokens or self.spreads_over_layers or \
                type(self).row_budgets is not BasePress.row_budgets:  # fmt: skip
            return None
        if self.max_tokens is not None and self.max_tokens >= tokens:
            return (f"max_tokens={self.max_tokens} is not smaller than the context ({tokens} tokens): use a smaller "
                    "max_tokens or a compression_ratio")  # fmt: skip
        if self.compression_ratio and not floor_share(tokens, self.compression_ratio):
            return (f"compression_ratio={self.compression_ratio} removes floor({tokens} x {self.compression_ratio}) "
                    f"= 0 of the context's {tokens} tokens: use a larger ratio")  # fmt: skip
        if self.compression_ratio or self.max_tokens is not None:  # (r = 0 keeps everything as asked)
            keep = self.kept_share(tokens)
            if self.sink_count() + self.recent_count(keep) >= tokens:
                return (f"{type(self).__name__} always keeps its {self.sink_count()} sinks and window of "
                        f"{self.recent_count(keep)}, the whole context of {tokens} tokens: use a smaller window "
                        "(its window_size or window parameter, n_sink)")  # fmt: skip
        return None

    def row_budgets(self, layer_idx: int, n_layers: int, spans: list[int]) -> list[int]:
        """Tokens each row may keep in layer `layer_idx` of `n_layers`, for rows that would hold `spans` tokens
        with no press (host integers): `budget_of` at the layer's share (`layer_scale`). A press whose plan differs
        between rows (SimLayerKV's lazy layers, chosen per prompt) gives its own."""
        scale = self.layer_scale(layer_idx, n_layers)
        if len(set(spans)) == 1:  # (an unpadded batch: one budget for every row, the per-step check's case)
            return [self.budget_of(spans[0], scale)] * len(spans)
        return [self.budget_of(n, scale) for n in spans]

    def budget_of(self, seen: int, scale: float = 1.0) -> int:
        """Tokens a row that would hold `seen` tokens with no press may keep in a layer of share `scale`: its share
        of the budget (`kept_share`), or its protected sinks and window where they are more."""
        keep = self.kept_share(seen, scale)
        floor = min(seen, self.sink_count() + self.recent_count(keep))
        if max(keep, floor) == 0 < seen:  # a layer's share rounded to nothing, and nothing protected: keep one
            keep = 1
            if not self.__dict__.get("_said_zero"):
                self.__dict__["_said_zero"] = True
                warn(f"{type(self).__name__}: a layer's share of the budget ({scale:.3g} of it) rounds to no "
                     f"token of {seen}: it keeps one (a larger budget keeps each layer's share)")
        if floor > keep and not self.__dict__.get("_said_floor"):
            self.__dict__["_said_floor"] = True  # once per press: it holds for every later step alike
            warn(
                f"{type(self).__name__} keeps {floor} of {seen} tokens where its budget allows {keep}: its "
                f"{self.sink_count()} sinks and window of {self.recent_count(keep)} are always kept (a smaller "
                "window, or a larger budget, keeps to the budget)"
            )
        return max(keep, floor)

    def kept_share(self, seen: int, scale: float = 1.0) -> int:
        """A layer of share `scale`'s part of the budget for a row that would hold `seen` tokens with no press,
        before its protected tokens (`budget_of`)."""
        if self.max_tokens is not None:
            keep = min(seen, math.floor(self.max_tokens * scale))
            if self.max_tokens <= seen < math.floor(self.max_tokens * scale) and not self.__dict__.get("_said_share"):
                self.__dict__["_said_share"] = True
                warn(f"{type(self).__name__}: a layer's share of max_tokens={self.max_tokens} "
                     f"({math.floor(self.max_tokens * scale)} tokens) is more than the {seen} it holds: it "
                     "keeps them all, so the layers keep less than the budget in total")
        else:
            keep = seen - floor_share(seen, self.compression_ratio)
            if scale != 1.0 and self.compression_ratio:  # r = 0 keeps everything, in every layer
                keep = min(seen, math.floor(keep * scale))
        return keep

    def target(self, budget: torch.Tensor, q_len: int) -> torch.Tensor:
        """What a row over `budget` is cut to: the budget at prefill, `decode_slack` below it when decoding."""
        if q_len > 1 or not self.decode_slack:
            return budget
        floor = torch.minimum(budget, torch.as_tensor(self.sink_count() + self.recent_count(budget)))
        return torch.maximum(budget - (budget * self.decode_slack).long(), floor)

    def ranked_scores(self, obs: Observation, budgets: torch.Tensor, per_head_scale: bool = False) -> torch.Tensor:
        """`score()` as eviction ranks it: protected tokens (sinks, recent window) +inf, padding and holes -inf.
        `per_head_scale` first divides each head's scores by its largest finite |score| over the tokens it
        holds (a positive number: each head's own order is unchanged, only comparisons across heads)."""
        return self.protect(obs, self.score(obs), budgets, per_head_scale)

    def protect(self, obs: Observation, scores: torch.Tensor, budgets: torch.Tensor,
                per_head_scale: bool = False) -> torch.Tensor:  # fmt: skip
        """`scores` `[B, H, n]` of `obs`'s slots made into eviction ranks (see `ranked_scores`)."""
        layer = obs.layer
        scores = scores if scores.dtype == torch.float64 else scores.float()  # float64 when a press needs it
        valid = layer.valid
        if per_head_scale:
            scores = scaled_to_peak(scores, valid)
        scores = scores.masked_fill(self._protected(layer, budgets), math.inf)
        return scores if valid is None else scores.masked_fill(~valid, -math.inf)

    def _protected(self, layer: PressedLayer, budgets: torch.Tensor) -> torch.Tensor:
        """`[B, H, n]` True for the sinks and the recent window of each row (`budgets` `[B]` on the host)."""
        pos = layer.pos
        recent = self.recent_count(budgets.cpu())
        if isinstance(recent, torch.Tensor):  # a window that depends on the budget (H2O's half)
            same = recent.numel() == 1 or bool((recent == recent[0]).all())
            recent = int(recent[0]) if same else recent.to(pos.device, non_blocking=True)
        recent_start = layer.real_seen - recent
        return (pos < self.sink_count()) | (pos >= recent_start[:, None, None])
