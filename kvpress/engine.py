"""The engine: the one place that applies a press to a cache layer, live or recorded.

    with press(model):            # PressInstallation: checks the press for the model, installs the intercept
        model.generate(...)       # after each layer's attention: evict(press, observation)

After each layer's attention the engine hands the press an `Observation`: the post-RoPE queries of the
forward and every key and value the layer holds, so a scorer is a few lines (`attention_probs` handles
GQA, softcap, padding and causality). `evict` is the only code that decides which slots a layer loses:
the live path (the intercept calls `PressInstallation.after_attention`) and the recorded path
(`kvpress.recording.compress_recording`) both call it. Observers (recordings, calibration probes, KVzip's
reconstruction pass) see every observation through `observe(model, *observers)` and evict nothing. The
transformers side (hooks, masks, cache layer classes) is `kvpress.patches`; this module decides, the
intercept executes.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, is_dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import DynamicCache

from kvpress.patches import intercept as intercept_module
from kvpress.patches import kv_quantization as quant
from kvpress.patches import model_access, rope
from kvpress.patches.cache import PressedLayer
from kvpress.patches.head_cache import HeadwiseLayer
from kvpress.patches.intercept import Intercept, active_handler, cache_positions, new_tokens, split_inputs, tear
from kvpress.patches.user_warnings import warn


def same_value(a, b) -> bool:
    """Whether a press's setting still holds what it held (tensors, and objects without a truth-valued ==, by
    identity)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # (a value whose == is not a truth value)
        return False


@dataclass
class Observation:
    """What a press sees after one attention call of one layer."""

    module: nn.Module
    query: torch.Tensor  # [B, Hq, q, D] post-RoPE queries of this forward
    keys: torch.Tensor  # [B, Hkv, n, D] every held key, the q new ones last
    values: torch.Tensor  # [B, Hkv, n, Dv]
    layer: PressedLayer
    hidden: torch.Tensor | None = None  # [B, q, d] the attention module's input hidden states of the new tokens
    kv_heads: slice = field(default_factory=lambda: slice(None))  # the KV heads `keys` holds (one: a head-wise view)
    rows: slice = field(default_factory=lambda: slice(None))  # the rows of the batch it holds (one: a head-wise view)
    mass: torch.Tensor | None = None  # [B, Hkv, n] fp32 the attention computed with its output (`attention_mass`)
    # [B, Hkv, n] fp32 the largest weight each slot received from the new queries and the query heads of its KV head,
    # computed with the output when an observer asked (`weights_block`, see `observe`); else None
    peak: torch.Tensor | None = None
    ids: torch.Tensor | None = None  # [B, q] the new tokens' ids (None where the forward was given embeddings)

    @property
    def q_len(self) -> int:
        return self.query.shape[2]

    @property
    def layer_idx(self) -> int:
        return model_access.layer_index(self.module)

    @property
    def n_layers(self) -> int:
        return model_access.layer_count(self.module)

    def grouped_logits(self, keys: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """`[B, Hkv, g * w, m]` fp32 logits of the new queries `start:stop` over `keys` `[B, Hkv, m, D]`, each query
        head with its KV head's keys (GQA), scaled and soft-capped as the model's attention does; no mask."""
        b, hq, _, d = self.query.shape
        hkv = keys.shape[1]
        query = self.query[:, :, start:stop]
        query = query.reshape(b, hkv, (hq // hkv) * query.shape[2], d).float()
        query = query * model_access.attention_scaling(self.module)
        logits = query @ keys.float().transpose(-1, -2)
        softcap = model_access.logit_softcap(self.module)
        return torch.tanh(logits / softcap) * softcap if softcap else logits

    def attention_probs(self, start: int, stop: int) -> torch.Tensor:
        """Softmax attention of the new queries `start:stop` over the slots they can see, fp32.

        Returns `[B, Hkv, g, w, m]`: the query heads grouped by the KV head they share (GQA), and the
        first `m = n_old + stop` slots (later new tokens are in these queries' future). Masked like the
        real attention: padding and holes excluded, causal among the new tokens, and on a sliding-window
        layer the slots `window` or more positions behind a query.
        """
        b, hq = self.query.shape[:2]
        hkv = self.keys.shape[1]
        g, w = hq // hkv, stop - start
        n_old = self.keys.shape[2] - self.q_len
        m = n_old + stop
        logits = self.grouped_logits(self.keys[:, :, :m], start, stop).view(b, hkv, g, w, m)
        valid, window = self.layer.valid, self.layer.window
        if w > 1 or valid is not None or window is not None:
            slot = torch.arange(m, device=logits.device)
            query_slot = n_old + torch.arange(start, stop, device=logits.device)[:, None]
            visible = slot <= query_slot  # [w, m], causal
            if valid is not None:
                visible = visible & valid[:, :, None, None, :m]
            if window is not None:
                pos = self.layer.pos[..., :m].long().to(logits.device)[:, :, None]  # [B, Hkv, 1, m]
                behind = pos[..., n_old + start : n_old + stop, None] - window  # [B, Hkv, 1, w, 1]
                visible = visible & (pos[..., None, :] > behind)
            logits.masked_fill_(~(visible | (slot == query_slot)), float("-inf"))
        if logits.requires_grad:
            return logits.softmax(dim=-1)
        return torch.softmax(logits, dim=-1, out=logits)  # in place: one block of weights alive, not two

    def attention_mass(self, block: int) -> torch.Tensor:
        """`[B, Hkv, n]` fp32: the attention weight each held slot received from the new queries, summed over
        them and the query heads of its KV head (masked like the real attention). The attention computed it with
        its output when the press asked (`BasePress.mass_block`); otherwise it is computed here, `block`
        queries at a time (`attention_probs`)."""
        if self.mass is not None:
            return self.mass
        b, hkv, n = self.keys.shape[:3]
        mass = torch.zeros(b, hkv, n, dtype=torch.float32, device=self.keys.device)
        for start in range(0, self.q_len, block):
            probs = self.attention_probs(start, min(start + block, self.q_len))
            mass[..., : probs.shape[-1]] += probs.sum(dim=(2, 3))
        return mass


Observer = Callable[[Observation], None]


def within_window(obs: Observation) -> Observation:
    """On a sliding-window layer: drop the slots that left the window (`trim_window`) and return what a press
    ranks: the queries of the new tokens still held, over the slots still held. Other layers: `obs` itself."""
    layer = obs.layer
    if layer.window is None:
        return obs
    layer.trim_window()
    held = min(obs.q_len, layer.n)  # the newest slots stay last
    hidden = None if obs.hidden is None else obs.hidden[:, obs.q_len - held :]
    ids = None if obs.ids is None else obs.ids[:, obs.q_len - held :]
    return Observation(obs.module, obs.query[:, :, obs.q_len - held :], *layer.held_kv(), layer, hidden, ids=ids)


class QueryRecorder:
    """An observer (`kvpress.engine.observe`) that keeps each layer's attention module and the queries of the
    forwards it sees (the latest forward's per layer), and with `keep_hidden` their input hidden states (for
    presses that score from them, `needs_hidden`; a recorded 4K SmolLM2 prefill holds ~280 MB of them)."""

    def __init__(self, keep_hidden: bool = False, keep_queries: bool = True) -> None:
        self.queries: dict[int, tuple[nn.Module, torch.Tensor]] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.keep_hidden, self.keep_queries = keep_hidden, keep_queries

    def __call__(self, obs: Observation) -> None:
        self.queries[obs.layer_idx] = (obs.module, obs.query if self.keep_queries else no_values(obs.query))
        if self.keep_hidden and obs.hidden is not None:
            self.hidden[obs.layer_idx] = obs.hidden


def no_values(query: torch.Tensor) -> torch.Tensor:
    """`query`'s shape without its values (NaN, no memory): what a press that does not read the queries
    (`reads_queries` False) is given in their place, so that `Observation.q_len` still counts the new tokens."""
    b, h, q, d = query.shape
    return query.new_full((b, h, 1, d), float("nan")).expand(b, h, q, d)


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
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # per layer, the attention's input hidden states
    compressed: bool = False  # its cache was compressed in place: it no longer holds the prefill its queries saw

    @property
    def tokens(self) -> int:
        return self.ids.shape[1]


# what takes a prefill in chunks, for the messages of a press that refuses one (`Installable.chunk_refusal`)
AS_CACHED = "a press that scores tokens as they are cached (SnapKVPress, KVzapPress, AdaKVPress over one)"


class Installable:
    """What makes a press usable as `with press(model):` (the base of `BasePress`).

    `per_head`: the press gives each KV head its own budget, so a layer it compresses moves to per-head
    storage (`HeadwiseLayer`); its `select(obs)` returns the `[B, H, n]` slots each head keeps.
    """

    per_head: ClassVar[bool] = False
    needs_whole_context: ClassVar[bool] = False  # scores the whole prompt once it is cached (`prepare`)
    # such a press that also scores a later forward of several tokens over the cache it compressed (`prepare_chunk`:
    # the next chunk of a chunked prefill, a new turn), given the ids fed since it scored last
    scores_later_chunks: ClassVar[bool] = False
    needs_tokenizer: ClassVar[bool] = False  # writes a prompt of its own in `prepare` (KVzip's repeat request)
    # reads the prompt's token ids in `prepare` (feeds them to the model again, drafts after them, finds its shots):
    # a prompt given as embeddings is refused
    needs_token_ids: ClassVar[bool] = False
    needs_hidden: ClassVar[bool] = False  # scores from `Observation.hidden` (the layer's input hidden states)
    # scores or allocates from `Observation.query`; False: a live prefill it compresses whole keeps no queries for it
    # (a recorded 8K prompt's are ~700 MB on Qwen2.5-0.5B; KVzip scores from its own pass)
    reads_queries: ClassVar[bool] = True
    # scores each token once, as it is cached: it observes forwards inside `frozen()` too (nothing is evicted
    # there), so tokens cached while frozen (a question read before decoding) have their scores when eviction resumes
    observes_frozen: ClassVar[bool] = False
    # brings evicted tokens back when a question is read inside `frozen()` (RecallPress): such a forward runs in two
    # parts, so that its last token, which gives the first answer token, attends to what the others recalled
    recalls: ClassVar[bool] = False

    @property
    def refuses_chunks(self) -> bool:
        """Whether a prefill in chunks is refused: the press scores the whole prompt and cannot score later chunks."""
        return self.needs_whole_context and not self.scores_later_chunks

    def chunk_refusal(self) -> tuple[str, str]:
        """Where this press `refuses_chunks`: its name for a message (a wrapper's with the press it wraps), and
        the presses to use instead."""
        inner, name = getattr(self, "press", None), type(self).__name__
        label = name if not isinstance(inner, Installable) else f"{name} over {type(inner).__name__}"
        if not isinstance(inner, Installable) or not inner.scores_later_chunks:
            return label, f"KVzipPress (it scores each chunk) or {AS_CACHED}"
        return label, (f"{type(inner).__name__} alone (it scores each chunk; {name} does not pass it later chunks) "
                       f"or {AS_CACHED}")  # fmt: skip

    def check_budget(self) -> None:
        """Check the budget as the press is installed (`BasePress`: it may have been set since it was built)."""

    def settings(self) -> dict:
        """Every init field of the press, and of a press it wraps under its own name (`press.window_size`): what
        an installation compares to find a press set since it was checked (cheap: no repr of a scorer's
        tensors)."""
        out = {}
        for f in fields(self) if is_dataclass(self) else ():
            value = getattr(self, f.name)
            if f.init and isinstance(value, Installable):
                out.update({f"{f.name}.{name}": v for name, v in value.settings().items()})
            elif f.init:
                out[f.name] = value
        return out

    def __call__(self, model: nn.Module, tokenizer=None) -> PressInstallation:
        """`with press(model):` installs the press for the caller; the model is restored on exit, even on error.
        A press that scores the whole context with a prompt of its own (KVzip) needs the model's `tokenizer`."""
        return PressInstallation(model, self, tokenizer=tokenizer)


@dataclass
class _Unscored:
    """The cache a press that `scores_later_chunks` scored last, and the ids fed to it since (None: some were
    embeddings, whose ids cannot be kept). Replaced whole when another cache is scored."""

    cache: weakref.ref
    ids: list[torch.Tensor] | None = field(default_factory=list)

    def note(self, ids: torch.Tensor) -> None:
        if self.ids is None or ids.is_floating_point():
            self.ids = None
            return
        self.ids.append(ids.clone())  # (not a view: the prompt's last id kept all of the prompt's)
        if len(self.ids) >= 64:  # (a decoding step notes one token: one tensor for each 64 of them, not one each)
            self.ids = [torch.cat(self.ids, dim=-1)]


class PressInstallation:
    """The context `with press(model):` returns: the press (and any observers) applied to the forwards of
    the caller inside the block. `frozen()` pauses eviction; `installed()` + `activated()` split entering in
    two, for generators that must not leave the press active while they are suspended.

    A press that scores the whole context (`needs_whole_context`: KVzip, Lookahead, AdaKV over them) compresses
    the prompt at the end of the prefill: the first forward of a new cache runs on all the prompt's tokens but
    its last, the press scores them (its own pass over the cache) and evicts, then the last token runs over the
    compressed cache and gives the forward's output; generated tokens are kept. A later forward of several tokens
    while the press evicts (a chunk of `prefill_chunk_size`, a new turn) runs the same way on a press that
    `scores_later_chunks` (KVzip, alone or under AdaKV: `prepare_chunk` scores every token fed since it scored
    last, over the compressed cache, whose head-wise layers its observers read padded); any other is refused:
    nothing would score it, so the budget would not hold (read it inside `frozen()` to keep it whole). This is
    what `kvpress.generate(..., query_aware=True)` does for a context and its question."""

    def __init__(
        self, model: nn.Module, press: Installable | None, observers: tuple[Observer, ...] = (), tokenizer=None
    ) -> None:
        if press is not None and not isinstance(press, Installable):
            raise TypeError(f"press must be a kvpress press, got {type(press).__name__}")
        if press is None and not observers:
            raise ValueError("nothing to install: give a press or at least one observer")
        wrong = [type(o).__name__ for o in observers if not callable(o)]
        if wrong:
            raise TypeError(f"an observer is a callable taking an Observation, got {', '.join(wrong)}")
        self.intercept = Intercept(model, self)  # refuses models kvpress cannot intercept
        check_tokenizer(model, tokenizer)
        self.model, self.press, self.observers, self.tokenizer = model, press, tuple(observers), tokenizer
        self._inv_freq, self._dynamic_length, self._checked = None, None, None
        if press is not None:
            self._check()
        self._activation = None
        self._unscored: _Unscored | None = None  # (`scores_later_chunks`) the cache scored last, the ids fed since

    def _check(self) -> None:
        """Refuse a press that cannot run on the model; keep what re-rotation reads of it, and the press's settings
        as they passed (`_checked`)."""
        _check_press(self.model, self.press)
        if self.press.rerotate:
            self._inv_freq = model_access.rerotation_inv_freq(self.model)
            self._dynamic_length = model_access.dynamic_rope_length(self.model)
        self._checked = self.press.settings()

    # ----- entering -----------------------------------------------------------------------------------
    def _install(self) -> None:
        if self.press is not None and self.press.needs_tokenizer and self.tokenizer is None:
            raise ValueError(
                f"{type(self.press).__name__} uses the model's tokenizer when it scores the prompt (to write a "
                "prompt of its own, or find its markers): enter it as `with press(model, tokenizer=tokenizer):`"
            )
        if self.press is not None:  # entered again (a stream's next chunk): settings set since are checked again
            self.press.check_budget()
            now = self.press.settings()
            if now.keys() != self._checked.keys() or not all(same_value(v, self._checked[k]) for k, v in now.items()):
                self._check()
        self.intercept.install()

    def __enter__(self) -> PressInstallation:
        self._install()
        activation = self.intercept.activated()
        try:
            activation.__enter__()
        except BaseException:
            self.intercept.uninstall()
            raise
        self._activation = activation
        return self

    def __exit__(self, *exc) -> None:
        activation, self._activation = self._activation, None
        try:
            if activation is not None:
                activation.__exit__(None, None, None)
        finally:
            self._uninstall()

    def _uninstall(self) -> None:
        """Leave the model as it was; a press that scores later chunks (KVzip) forgets the prompt this installation
        scored last (no later chunk can follow it outside this block: `_unscored` goes too), under the lock that
        callers scoring with it take turns at (another thread may be between its scoring and its eviction)."""
        unscored, self._unscored = self._unscored, None
        try:
            if unscored is not None and self.press is not None:
                with SCORING:
                    self.press.forget(unscored.cache())
        finally:
            self.intercept.uninstall()

    @contextlib.contextmanager
    def installed(self) -> Iterator[PressInstallation]:
        """Install without activating: forwards go through the press only inside `activated()`."""
        self._install()
        try:
            yield self
        finally:
            self._uninstall()

    def activated(self):
        """Forwards run by this caller inside this block go through the press (needs `installed()`)."""
        return self.intercept.activated()

    def frozen(self):
        """Inside this block the caller's cache grows without eviction (for example while a question is read)."""
        return self.intercept.frozen()

    @contextlib.contextmanager
    def observing(self, *observers: Observer) -> Iterator[PressInstallation]:
        """Inside this block `observers` see this caller's forwards too, and nothing is evicted (what
        `observe(model, ...)` gives while a press is active on the model: a press's own scoring pass)."""
        current = _OBSERVING.get() or {}
        token = _OBSERVING.set({**current, self: (*current.get(self, ()), *observers)})
        try:
            with self.intercept.frozen():
                yield self
        finally:
            _OBSERVING.reset(token)

    # ----- what the intercept calls -------------------------------------------------------------------
    def before_forward(self, cache: DynamicCache, args: tuple, kwargs: dict) -> None:
        headwise = any(isinstance(layer, HeadwiseLayer) for layer in cache.layers)
        if headwise:
            self._check_headwise(cache, args, kwargs)
        if (headwise or (self.press is not None and self.press.per_head)) and kwargs.get(
                "output_attentions", getattr(self.model.config, "output_attentions", False)):  # fmt: skip
            raise ValueError("output_attentions under a press that compresses head by head: once compressed, its "
                             "layers hold other tokens in each KV head and return no attention weights "
                             "(transformers' list skipped them without a word; refused from the first forward, not "
                             "part way through a generation): read attentions under a dense press, or without one")
        if (self.press is None or not self.press.rerotate) and any(getattr(layer, "rotated", False)
                                                                   for layer in cache.layers):  # fmt: skip
            name = type(self.press).__name__ if self.press is not None else "an observer (a chat's round policy)"
            raise ValueError(f"this cache's keys were re-rotated to positions inside the cache by a press with "
                             f"rerotate=True; {name} does not re-rotate, so its new tokens would run at their true "
                             "positions: continue it with a press that re-rotates (rerotate=True)")  # fmt: skip
        if self.press is not None and self.press.rerotate:
            if any(getattr(layer, "kv_bits", None) is not None for layer in cache.layers):  # (a loaded 4-bit cache)
                raise ValueError(f"this cache holds quantized keys (kv_bits), which {type(self.press).__name__} "
                                 "(rerotate=True) would re-rotate in place, losing precision at every step: continue "
                                 "it with a press that does not re-rotate")  # fmt: skip
            if self._dynamic_length is not None:  # (host integers: no device read a step)
                reach = max((layer.n for layer in cache.layers if isinstance(layer, PressedLayer)), default=0) + \
                    new_tokens(args, kwargs).shape[1]  # fmt: skip
                if reach >= self._dynamic_length:  # (at the length itself transformers keeps stretched ones)
                    raise ValueError(f"{type(self.press).__name__} (rerotate=True) on a dynamic RoPE: this forward "
                                     f"reaches position {reach - 1}; the model keeps its own frequencies only while a "
                                     f"forward stays below position {self._dynamic_length - 1} (past it they stretch "
                                     "for these keys, and the cache's re-rotation would move them with the others): "
                                     "prefill in chunks (prefill_chunk_size) with a budget plus a chunk within "
                                     "that")  # fmt: skip
            # compressed by a press that did not re-rotate: its keys move to their ranks first (its new tokens run
            # at their ranks; its held keys stayed at their true positions). Host integers: nothing evicted leaves
            # every rank at its position, and no step reads the device
            moved = [layer for layer in cache.layers if isinstance(layer, PressedLayer) and not layer.rotated
                     and layer.n != layer.seen and layer.shift is not None]  # fmt: skip
            if len({layer.n for layer in moved}) > 1:
                raise ValueError(f"this cache's layers hold different numbers of tokens (a press with per-layer "
                                 f"budgets compressed it): {type(self.press).__name__} (rerotate=True) feeds its new "
                                 "tokens at one position in every layer, so it cannot continue it")  # fmt: skip
            for layer in moved:
                self._rerank(layer)
            kwargs["position_ids"] = cache_positions(cache, args, kwargs)

    def run_forward(self, forward: Callable, cache: DynamicCache, args: tuple, kwargs: dict):
        """Run one forward of the caller; the first forward of a new cache in parts when the press scores the
        whole prompt, and later ones of several tokens when it scores them too (see the class docstring)."""
        q = new_tokens(args, kwargs).shape[1]
        fresh = all(getattr(layer, "seen", 0) == 0 for layer in cache.layers)
        frozen = not self.intercept.compressing()
        if self.press is not None and self.press.recalls and frozen and q >= 2 and not fresh:
            return _in_two(forward, args, kwargs, q, "a recalling press reads a question", "outside frozen()")
        if self.press is None or not self.press.needs_whole_context:
            return forward(*args, **kwargs)
        if q < 2 and fresh and not frozen and not self.press.__dict__.get("_said_one_token"):
            self.press.__dict__["_said_one_token"] = True  # (once per press, as its budget's warnings)
            warn(f"{type(self.press).__name__} scores a prompt when it is cached, and this one is a single "
                 "token, nothing to score; the tokens fed after it one a forward are kept unscored, as "
                 "generated ones (a prefill fed one token a forward, prefill_chunk_size=1, compresses "
                 "nothing: feed chunks of 2 or more)")  # fmt: skip
        if q < 2 or frozen:
            unscored = self._unscored  # (read once: another thread's scoring may replace it)
            if unscored is not None and unscored.cache() is cache and not (_OBSERVING.get() or {}).get(self):
                unscored.note(new_tokens(args, kwargs))  # fed by the caller (not a press's own pass): kept unscored
            return forward(*args, **kwargs)
        if not fresh and self.press.refuses_chunks:
            seen = max(getattr(layer, "seen", 0) for layer in cache.layers)
            name, instead = self.press.chunk_refusal()
            raise ValueError(
                f"{name} compresses the first prompt of a cache, scored by a pass over all of it; this forward adds "
                f"{q} tokens to a cache already holding {seen} seen (the next chunk of a chunked prefill, a new "
                "turn, or assisted decoding's draft tokens), which it cannot score, so the budget would not hold: "
                f"feed the prompt in one forward (no prefill_chunk_size, no assistant), use {instead}, or read a new "
                "turn inside `installed.frozen()` to keep it whole"
            )
        unscored = self._unscored
        if not fresh and (unscored is None or unscored.cache() is not cache or unscored.ids is None):
            raise ValueError(
                f"{type(self.press).__name__} scores a later forward of several tokens by the ids fed since it "
                f"compressed the cache; this forward adds {q} tokens to a cache it did not compress in this block, "
                "or not last (another prompt was scored since, in this thread or another: on one model, start no "
                "prompt while another's chunks are fed), or one fed embeddings since: feed token ids to the cache "
                "it compressed last"
            )
        ids = new_tokens(args, kwargs)
        if not fresh and ids.is_floating_point():
            raise ValueError(f"{type(self.press).__name__} rebuilds a later chunk from its token ids: feed input_ids, "
                             "not inputs_embeds")  # fmt: skip
        if ids.is_floating_point() and self.press.needs_token_ids:
            raise ValueError(f"{type(self.press).__name__} scores a prompt from its token ids (it feeds them to the "
                             "model again, or drafts after them): feed input_ids, not inputs_embeds")  # fmt: skip
        recorder = QueryRecorder(keep_hidden=self.press.needs_hidden, keep_queries=self.press.reads_queries)
        seen = [getattr(layer, "seen", 0) for layer in cache.layers]

        def scored_head(*head_args, **head_kwargs):  # all but the last token, then the press scores and evicts
            try:
                with self.observing(recorder):
                    out = forward(*head_args, **head_kwargs)
                with SCORING:  # the press holds this prompt's scores from its prepare to the end of its eviction
                    self._score(cache, recorder, ids, None if fresh else unscored)
            except BaseException:
                if not fresh and seen != [getattr(layer, "seen", 0) for layer in cache.layers]:
                    tear(cache)  # it holds the chunk's first part, which nothing scored: it cannot go on
                raise
            return out

        return _in_two(forward, args, kwargs, q, f"{type(self.press).__name__} scores a prompt",
                       "inside frozen(), where the prompt is not compressed", scored_head)

    def _score(self, cache: DynamicCache, recorder: QueryRecorder, ids: torch.Tensor, unscored: _Unscored | None):
        """The press scores the prompt (`unscored` None) or the chunk just fed to `cache` (all of `ids` but the
        last) after the ids `unscored` holds, and evicts by its scores."""
        token_ids = None if ids.is_floating_point() else ids[:, :-1]
        if unscored is not None and self._unscored is not unscored:  # another caller's prompt was scored since
            raise ValueError(
                f"{type(self.press).__name__} scores a later chunk of a prompt with what it kept of the chunks "
                "before, and another generation's prompt was scored meanwhile: with a press that scores the whole "
                "context, feed a chunked prompt (prefill_chunk_size) while no other thread starts one (this cache "
                "now holds the chunk unscored and is marked torn: start it again)"
            )
        evicted = False
        try:
            if unscored is None:
                recording = Recording(cache, recorder.queries, ids[:, :-1], next_ids=ids[:, -1:],
                                      hidden=recorder.hidden)  # fmt: skip
                self.press.prepare(self.model, recording, self.tokenizer)
            else:
                fed = torch.cat([*unscored.ids, token_ids], dim=-1)
                self.press.prepare_chunk(self.model, cache, fed, self.tokenizer)
            for layer in compress_layers(self.press, cache, recorder.queries, recorder.hidden, token_ids):
                layer.driven = True  # a layer moved to per-head storage: the rest of the forward drives it too
            evicted = True
        finally:  # (its scores of the prompt: nothing reads them once it has evicted, or failed to)
            if not evicted or not self.press.scores_later_chunks:
                self.press.forget(cache)
        if self.press.scores_later_chunks:
            unscored = _Unscored(weakref.ref(cache))
            unscored.note(ids[:, -1:])
            self._unscored = unscored

    def _watching(self) -> tuple[Observer, ...]:
        """The observers of this caller's forwards now: the installation's, and those `observing()` added."""
        return (*self.observers, *(_OBSERVING.get() or {}).get(self, ()))

    def mass_block(self, layer: PressedLayer | HeadwiseLayer, evict_now: bool = True) -> int | None:
        """Queries a block when this forward's press or an observer reads the attention weights of a layer (see the
        intercept): the smallest block any of them asks for. An observer of a head-wise layer computes them itself."""
        asked = []
        if not isinstance(layer, HeadwiseLayer):
            heads = model_access.text_config(self.model).num_attention_heads
            asked = [o.weights_block(layer, heads) for o in self._watching() if hasattr(o, "weights_block")]
        press = self.press
        if press is not None and not press.needs_whole_context and (evict_now or press.observes_frozen):
            asked.append(press.mass_block())
        asked = [block for block in asked if block]
        return min(asked) if asked else None

    def reads_peak(self) -> bool:
        """Whether an observer may read `Observation.peak` (one with `weights_block`)."""
        return any(hasattr(o, "weights_block") for o in self._watching())

    def after_attention(
        self, module: nn.Module, query, key, value, layer: PressedLayer, evict_now: bool = True, hidden=None, mass=None,
        ids=None, peak=None,
    ) -> HeadwiseLayer | None:  # fmt: skip
        if torch.is_grad_enabled():  # what stays is decided, not learned: no autograd history in what is kept
            with torch.no_grad():  # (generate runs without grad already: this step costs it nothing)
                return self.after_attention(module, query, key, value, layer, evict_now, hidden, mass, ids, peak)
        obs = Observation(module, query, key, value, layer, hidden, mass=mass, ids=ids, peak=peak)
        for observer in self._watching():  # see every slot attended to
            observer(obs)
        if self.press is None or self.press.needs_whole_context:
            return None  # a whole-context press evicts once, at the end of the prefill (`run_forward`)
        if not evict_now:
            if self.press.observes_frozen:
                self.press.observe_frozen(within_window(obs))
            return None
        return evict(self.press, within_window(obs), self._rerank if self.press.rerotate else None)

    def after_headwise(
        self, module: nn.Module, query: torch.Tensor, layer: HeadwiseLayer, hidden=None, evict_now: bool = True,
        ids=None, mass=None,
    ) -> None:  # fmt: skip
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self.after_headwise(module, query, layer, hidden, evict_now, ids, mass)
        watching = self._watching()
        if watching:  # observers read a head-wise layer as a padded dense one (a press's own pass: KVzip's)
            dense = layer.as_dense()
            obs = Observation(module, query, dense.keys, dense.values, dense, hidden, ids=ids)
            for observer in watching:
                observer(obs)
        if self.press.needs_whole_context or not (evict_now or self.press.observes_frozen):
            return  # a whole-context press evicts where it scores (`run_forward`)
        self.press.observe_heads(module, query, layer, hidden, ids, mass)
        if evict_now:
            self.press.evict_heads(module, query, layer)
            if self.press.kv_bits is not None:  # (a no-op once at that width; after `reset`, the next prompt's codes)
                layer.quantize(self.press.kv_bits)

    def _check_headwise(self, cache: DynamicCache, args: tuple, kwargs: dict) -> None:
        """Refuse, before any layer runs, a forward that a cache with head-wise layers cannot take."""
        makers = {layer.made_by for layer in cache.layers if isinstance(layer, HeadwiseLayer)}
        name = type(self.press).__name__ if self.press is not None else "an observer"
        if self.press is None or not self.press.per_head or makers != {name}:
            raise ValueError(
                f"this cache holds head-wise compressed layers made by {', '.join(sorted(makers))}; "
                f"{name} cannot continue it (use the press that made it)"
            )
        if intercept_module.new_padding(kwargs.get("attention_mask"), new_tokens(args, kwargs).shape[1]) is not None:
            raise ValueError(
                "a head-wise compressed cache takes padding only in its first forward (left padding of the prompt); "
                "this forward has padding tokens among its new tokens. In a chunked prefill (prefill_chunk_size) a "
                "left-padded row's padding reaches a later chunk once an earlier one evicted: use chunks at least as "
                "long as the longest padding, no chunks, or rows of similar lengths"
            )

    def _rerank(self, layer: PressedLayer) -> None:
        """Re-rotate held keys to their rank among the row's held real tokens (StreamingLLM positions)."""
        if layer.key_channels is not None:
            raise ValueError("rerotate=True cannot re-rotate keys that keep only some channels (ThinK)")
        pos, valid = layer.pos.long(), layer.valid
        order = layer.position_order()
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(layer.n, device=pos.device).expand_as(order))
        current = layer.slots["rot"][..., : layer.n].long() if layer.rotated else pos
        delta = rank - current
        if valid is not None:
            delta = delta.masked_fill(~valid, 0)
        if bool(delta.any()):
            layer.keys[:, :, : layer.n] = rope.rerotate(layer.keys[:, :, : layer.n], delta, self._inv_freq)
        layer.set_rotation(rank)


def observe(model: nn.Module, *observers: Observer) -> contextlib.AbstractContextManager:
    """`with observe(model, fn):` calls `fn(observation)` after every compressible layer's attention of the
    caller's forwards inside the block; nothing is evicted (also when a press is active on the model for this
    caller: its eviction pauses inside the block). An observer that reads the attention weights has a method
    `weights_block(layer, query_heads)` (queries a block, or None): a full-attention layer's attention is then
    computed from its weights, that many queries at a time, and hands it their sum and peak per slot
    (`Observation.mass`, `.peak`), so the observer need not compute them a second time; they are None where the
    attention cannot give them (a sliding-window layer, attention sinks or a position bias, a forward that records
    gradients), and the observer computes them itself."""
    active = active_handler(model)
    if isinstance(active, PressInstallation):
        return active.observing(*observers)
    return PressInstallation(model, None, observers)


def compress_layers(
    press, cache: DynamicCache, queries: dict[int, tuple[nn.Module, torch.Tensor]], hidden: dict | None = None,
    ids: torch.Tensor | None = None,
) -> list:  # fmt: skip
    """Apply `press` to every layer of a prefilled `cache`, given each layer's attention module and the queries of
    its prefill (a recording), its input hidden states where recorded and the prefill's token ids `[B, n]`: the
    eviction a live prefill under the press would have made (a head-wise layer: the press's `evict_heads`).
    Returns the layers that moved to per-head storage (they replace the dense ones in `cache`)."""
    moved = []
    for idx, (module, query) in queries.items():
        layer = cache.layers[idx]
        if isinstance(layer, HeadwiseLayer):  # a later chunk over a layer a head-wise press compressed before
            press.evict_heads(module, query, layer)
            layer.compact()
            continue
        obs = Observation(module, query, *layer.held_kv(), layer, (hidden or {}).get(idx), ids=ids)
        replacement = evict(press, within_window(obs))  # what the live intercept calls after this layer's attention
        if replacement is not None:
            cache.layers[idx] = replacement
            moved.append(replacement)
    return moved


# A press that scores the whole context keeps a prompt's scores (KVzip's), draft (Lookahead) or layer plan
# (SimLayerKV) on itself from its `prepare` to the end of that prompt's eviction: callers in other threads (given
# the context, or a second model sharing the press) take turns there, so none evicts by another's scores.
SCORING = threading.RLock()

# the observers `observe()` adds to an active installation, per caller
_OBSERVING: contextvars.ContextVar[dict | None] = contextvars.ContextVar("kvpress_observing", default=None)


def check_tokenizer(model: nn.Module, tokenizer) -> None:
    """Refuse a `tokenizer=` that cannot be the model's (a press writing a prompt of its own failed inside with
    'str' object is not callable, or an IndexError in the embedding): a name or a class in place of the object, or
    more tokens than the model's vocabulary. None passes (a press that needs one says so as it is entered)."""
    if tokenizer is None:
        return
    if isinstance(tokenizer, (str, bytes, int, float, type)):  # (a name, or the class: not the object)
        raise TypeError(f"tokenizer must be the model's tokenizer object (AutoTokenizer.from_pretrained(...)), got "
                        f"{tokenizer!r}")  # fmt: skip
    vocab = model.get_input_embeddings().num_embeddings
    if hasattr(tokenizer, "__len__") and len(tokenizer) > vocab:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, more than the model's vocabulary of {vocab}: "
                         "pass the model's own tokenizer")  # fmt: skip


def maybe_installed(press: Installable | None, model: nn.Module, tokenizer=None):
    """`press(model, tokenizer)` as a context, or a context that does nothing when `press` is None."""
    return contextlib.nullcontext() if press is None else press(model, tokenizer=tokenizer)


def _in_two(forward: Callable, args: tuple, kwargs: dict, q: int, who: str, instead: str,
            head: Callable | None = None) -> object:  # fmt: skip
    """One forward of `q` new tokens run as two: all but the last (by `head`, `forward` by default: a press scores
    between the two), then the last; the output's logits are those the caller asked for (`logits_to_keep`: 1 (what
    `generate` asks) from the second alone, else both joined). `who` (what splits it) and `instead` (where the
    forward runs whole) word the refusals."""
    head = forward if head is None else head
    as_tuple = kwargs.get("return_dict") is False  # (the parts are joined as outputs, then given as asked)
    if as_tuple:
        kwargs = {**kwargs, "return_dict": True}
    (head_args, head_kwargs), (tail_args, tail_kwargs) = split_inputs(args, kwargs, q - 1)
    unmerged = [name for name in ("labels", "output_attentions", "output_hidden_states")
                if kwargs.get(name) is not None and kwargs.get(name) is not False]  # fmt: skip
    if unmerged:
        raise ValueError(f"{who} in two forwards (all but its last token, then the last), whose "
                         f"{', '.join(unmerged)} it cannot join: compute them without the press, or {instead}")
    keep = kwargs.get("logits_to_keep", 0)
    if not isinstance(keep, int) or keep < 0:
        raise ValueError(f"{who} in two forwards: logits_to_keep must be an int, got {keep!r}")
    if keep == 1:
        head(*head_args, **{**head_kwargs, "logits_to_keep": 1})
        out = forward(*tail_args, **tail_kwargs)
    else:
        first = head(*head_args, **{**head_kwargs, "logits_to_keep": max(keep - 1, 0)})  # 0: every token's
        out = forward(*tail_args, **{**tail_kwargs, "logits_to_keep": 1})
        out.logits = torch.cat([first.logits, out.logits], dim=1)
    return out.to_tuple() if as_tuple else out


# ----- eviction: the one decision ------------------------------------------------------------------------
def evict(press, obs: Observation, rerank: Callable[[PressedLayer], None] | None = None) -> HeadwiseLayer | None:
    """Let `press` observe `obs`, then evict what exceeds each row's budget in `obs.layer`. A per-head press
    returns the `HeadwiseLayer` that replaces the layer (or None while nothing is evicted). A dense layer's press
    then reshapes what it kept (`after_eviction`: ThinK's thinner keys), and `rerank` re-rotates the kept keys
    (rerotate=True). A press with `kv_bits` then stores what the layer keeps, and what it appends from now on, in
    that many bits (decided on the exact keys, so a live prefill and a recorded
    one keep the same codes)."""
    press.observe(obs)
    if press.per_head:
        replacement = _to_headwise(press, obs)
        if press.kv_bits is not None:
            (replacement or obs.layer).quantize(press.kv_bits)
        return replacement
    evicted = _evict_rows(press, obs)
    press.after_eviction(obs)
    if rerank is not None and (evicted or not obs.layer.rotated):  # a step that evicted nothing moved no rank
        rerank(obs.layer)
    if press.kv_bits is not None:
        obs.layer.quantize(press.kv_bits)
    return None


def _evict_rows(press, obs: Observation) -> bool:
    """Every head of a row keeps the row's budget: the best-ranked slots stay, the rest is freed. Whether any was."""
    layer = obs.layer
    budgets = press.row_budgets(obs.layer_idx, obs.n_layers, layer.span_list())  # (host integers: nothing read)
    if not layer.padded:  # every row holds n of the same tokens
        if layer.n <= min(budgets):
            return False
        held = torch.full((len(budgets),), layer.n, dtype=torch.long)
    else:
        held = layer.held()  # the host's copy of padded rows' counts
        if all(n <= b for n, b in zip(held.tolist(), budgets, strict=True)):
            return False
    budget = torch.tensor(budgets, dtype=torch.long)
    keep = torch.where(held > budget, press.target(budget, obs.q_len), held)
    scores = press.ranked_scores(obs, budget)
    k = int(keep.max())
    uneven = bool((keep != k).any())  # rows keep different numbers (padded rows, or a plan per row)
    if layer.valid is None and not layer.padded and not uneven and k == layer.n - 1:
        lowest = scores == scores.amin(dim=-1, keepdim=True)  # (of equal scores the latest goes: see `best_slots`)
        layer.remove_one(layer.pos.masked_fill(~lowest, -1).argmax(dim=-1))  # one slot per head, overwritten in place
    else:
        index, order = best_slots(scores, layer.position_order(), k).sort(dim=-1)
        ranked = held_after = None
        if layer.padded or uneven:  # each row's fullest head keeps its `keep` best (padding and holes rank last)
            ranked = torch.arange(k, device=index.device) < keep.to(index.device, non_blocking=True)[:, None, None]
            ranked = ranked.expand_as(index).gather(-1, order)
            # all real where the row's fullest head held as many real ones (`held`, or n where nothing is a hole)
            held_after = keep.tolist() if layer.padded or layer.valid is None else None
        layer.keep(index, ranked, capacity=int(budget.max()), held=held_after)
    return True


def best_slots(scores: torch.Tensor, by_position: torch.Tensor, k: int) -> torch.Tensor:
    """`[B, H, k]` the slots of the `k` best `scores` `[B, H, n]`, best first; of equal scores the earlier in
    `by_position` (the slots in position order, padding and holes last: `PressedLayer.position_order`) first, so a
    row keeps the tokens it keeps alone whatever its slots' layout (a padded batch's, or slots reordered by decoding
    steps): `topk` chose among ties by the tensor's length and order."""
    ranked = scores.gather(-1, by_position).argsort(dim=-1, descending=True, stable=True)[..., :k]
    return by_position.gather(-1, ranked)


def _to_headwise(press, obs: Observation) -> HeadwiseLayer | None:
    """The per-head storage holding the slots `press.select(obs)` keeps (None: nothing evicted yet)."""
    keep = press.select(obs)
    if keep is None:
        return None
    layer = obs.layer
    if layer.valid is not None:
        keep = keep & layer.valid
    new = HeadwiseLayer.from_dense(layer, keep)
    new.made_by = type(press).__name__  # only this press can continue the layer
    budgets = press.head_budgets(obs)
    new.head_budget = None if budgets is None else budgets.cpu()  # read once: the layer keeps it on the host
    return new


def _check_press(model: nn.Module, press: Installable) -> None:
    """Raise when `press` cannot run on `model` (called when the press is installed or applied)."""
    press.check_budget()  # (set since it was built: checked again, a wrapper's shared with the press it wraps)
    if not model_access.compressible_layers(model):
        raise ValueError(
            f"no layer of {type(model).__name__} is a full-attention or sliding-window layer (its kinds: "
            f"{sorted(set(model_access.layer_types(model)))}), so nothing would be compressed"
        )
    if not getattr(press, "chooses_by_position", False):  # (first: KVzap said no packaged scorer fit such a model)
        model_access.check_reads_keys(model, type(press).__name__)
    press.check_model(model)
    kinds = sorted(set(model_access.layer_types(model)))
    if getattr(press, "spreads_over_layers", False) and len(kinds) > 1:
        raise ValueError(f"{type(press).__name__} gives each layer a share of the budget set beforehand "
                         f"(layer_scales, or KVzap's global_budget > 0); {type(model).__name__} has layers of several "
                         f"kinds ({', '.join(kinds)}): a sliding-window layer holds its window alone and cannot take a "
                         "larger share, so the layers' total would not be the budget (a 3-layer Gemma 3 kept 77 tokens "
                         "for 54): use the press without them")  # fmt: skip
    if press.kv_bits is not None:
        quant.check_bits(press.kv_bits, model_access.head_dim(model))
        if press.rerotate:
            raise ValueError(f"{type(press).__name__}: rerotate=True re-rotates held keys in place, which quantized "
                             "keys (kv_bits) cannot take without losing precision at every step")  # fmt: skip
    if press.rerotate and press.needs_whole_context:
        raise ValueError(f"{type(press).__name__} scores the whole context once it is cached: rerotate=True is not "
                         "supported there (its keys are evicted after the prefill, not re-rotated)")  # fmt: skip
    if press.rerotate:
        model_access.check_half_split_rope(model)
    if press.rerotate and model_access.has_sliding_layers(model):
        raise ValueError(
            f"rerotate=True is not supported on {type(model).__name__}: its layers of other kinds than full "
            f"attention ({model_access.other_layer_kinds(model)}) keep their own positions or states, so in-cache "
            "positions cannot be shared by all layers"
        )
    n_layers = model_access.text_config(model).num_hidden_layers
    scales = [press.layer_scale(i, n_layers) for i in range(n_layers)]  # raises on a length mismatch
    if press.rerotate and (press.per_head or any(abs(scale - 1.0) > 1e-9 for scale in scales)):
        raise ValueError(
            f"rerotate=True needs the same budget in every layer and head ({type(press).__name__} gives them "
            "different budgets, so in-cache positions would differ between them)"
        )
