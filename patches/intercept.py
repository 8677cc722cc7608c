"""`Intercept`: the transformers side of an installed press, for the caller that entered it.

Installing registers an attention function and its mask partner under a name of their own, switches the
model's attention implementation to that name and wraps the model instance's `forward` (it prepares the
cache, counts the forwards in flight, so uninstalling never lands mid-forward, and marks a cache a forward
left half-written when any exception, KeyboardInterrupt included, escapes it, and on CUDA runs it with cuDNN's
attention set aside, `sdpa_backends`); uninstalling undoes all of it, error or not. Importing kvpress patches
nothing.

Activation is scoped to the caller: the wrapper and the attention function act only for forwards run in a
context (thread, `contextvars` context) where `activated()` is entered. Another thread's forwards on the
same model, or code that runs while a generator that activated the press is suspended, get the model's
own attention and masks, exactly as with nothing installed, and the first such forward of each other thread warns
(`UNPRESSED`): `threading.Thread(target=model.generate, ...)` started inside `with press(model):`, the usual way to
stream with a `TextIteratorStreamer`, would otherwise run uncompressed without a word.

The mask function registered with the attention function does not build a mask: it returns a `MaskInfo`
that keeps the 2D padding mask and builds transformers' standard mask only if a layer asks for it (layers
not compressed yet, other callers). A compressed layer's mask is built from that layer's own slots (and,
for a sliding-window layer, their positions), so layers of different lengths work on sdpa and eager alike.

For an active caller, the forward wrapper finds or makes the cache and turns its full-attention and
sliding-window layers into `PressedLayer`s; the attention function builds each compressed layer's mask
from its slots and, after the attention ran, drops what left a sliding layer's window and hands the layer
to the `handler` (the engine, `kvpress.engine`), which decides what the layer keeps. The handler is any
object with:

- `before_forward(cache, args, kwargs)`: before the forward runs (it may refuse it, or set `position_ids`);
- `run_forward(forward, cache, args, kwargs)`: runs the forward (`forward(*args, **kwargs)`, or in parts);
- `mass_block(layer, evict)`: before a full-attention layer's attention (dense or head-wise): None, or the queries
  a block when the press (or an observer) reads the attention mass (each slot's summed weights), which the attention
  then computes from its weights (`blocked_attention.attention_with_mass`) instead of sdpa's fused kernel;
- `reads_peak()`: when `mass_block` gave a block for a dense layer, whether the largest weight each slot received
  is wanted too (`peak`);
- `after_attention(module, query, key, value, layer, evict, hidden, mass, ids, peak)`: after a dense layer's
  attention (before a sliding layer's `trim_window`; `evict` False while the caller is `frozen()`; `hidden` the
  attention module's input hidden states of the new tokens, `[B, q, d]`; `mass` `[B, Hkv, n]` when `mass_block`
  asked for it, `peak` `[B, Hkv, n]` when `reads_peak()` did too, else None; `ids` the new tokens' ids, `[B, q]`,
  or None when the forward was given embeddings); returns a layer that replaces it (per-head storage), or None;
- `after_headwise(module, query, layer, hidden, evict, ids, mass)`: after a head-wise layer's attention (`mass`
  `[slots]` aligned with the layer's packed storage when `mass_block` asked for it, else None).

The hidden states reach the attention function through a forward pre-hook on each attention module,
registered with the intercept and removed with it; it keeps them in the caller's state only until that
layer's attention ran. The token ids come the same way, from a pre-hook on the input embedding: they are those
of the model forward running now (each part of a forward a handler runs in parts has its own).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from kvpress.patches import blocked_attention as blocked
from kvpress.patches import model_access, sdpa_backends
from kvpress.patches.cache import PressedLayer, leave_inference, made_in_inference, without_backward
from kvpress.patches.head_cache import HeadwiseLayer
from kvpress.patches.headwise_attention import headwise_attention
from kvpress.patches.user_warnings import warn

_PREFIX = "kvpress_"
_counter = itertools.count()
_INSTALLING = threading.Lock()  # one install at a time: from the check that no press is active to the switch
_DRIVEN = (PressedLayer, HeadwiseLayer)  # the cache layers an installed press drives
UNPRESSED = (
    "a forward of this {model} ran without the press installed on it (thread {thread!r}): a press acts only for the "
    "thread and context that entered `with press(model):`, and this forward runs as with no press. To run "
    "`model.generate` in a thread with the press (with a TextIteratorStreamer, say), start the thread inside the "
    "block with its context: `threading.Thread(target=contextvars.copy_context().run, args=(model.generate,), "
    "kwargs=...)`"
)


OUTSIDE = (
    "an attention of this {model} ran while a press is active for this caller, but outside the model's own forward "
    "(its decoder or a layer called alone: `model.model(...)`): the press acts through the model's forward, so this "
    "cache is not compressed. Call the model itself (`model(...)`, `model.generate(...)`)"
)


def headwise_unsupported(kwargs: dict) -> list[str]:
    """What an attention call asks for that the head-wise attention does not compute (attention sinks `s_aux`, a
    `position_bias`, a nonzero `dropout`): their names."""
    return [name for name in ("s_aux", "position_bias", "dropout") if kwargs.get(name) is not None
            and not (isinstance(kwargs[name], (bool, int, float)) and not kwargs[name])]  # fmt: skip


class _Call:
    """The state of one activation (one caller): the cache of its current forward, and whether it evicts."""

    def __init__(self, compressing: bool = True) -> None:
        self.owner = threading.current_thread()  # (a thread started with a copy of the context makes its own)
        self.cache: DynamicCache | None = None
        self.compressing = compressing
        self.hidden: dict[int, torch.Tensor] = {}  # layer -> input hidden states of its attention, until it ran
        self.ids: torch.Tensor | None = None  # [B, q] the token ids of the forward running now (None: embeddings)


# the intercepts active in this context, each with its caller's state (a new dict on every change)
_ACTIVE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("kvpress_active", default=None)


class Intercept:
    """Installs the attention intercept on `model` and routes active callers' layers to `handler`."""

    def __init__(self, model: nn.Module, handler) -> None:
        model_access.check_supported(model)
        self.model, self.handler = model, handler
        self.name = f"{_PREFIX}{next(_counter)}"
        self.installed = False
        self._caches: weakref.WeakSet = weakref.WeakSet()
        self._forward: Callable | None = None  # our wrapper of the model's forward, while installed
        self._own_forward: Callable | None = None  # the instance's own `forward` attribute it replaced, if any
        self._original: str | None = None
        self._inner: dict[int, object] = {}
        self._modules: dict[int, nn.Module] = {}  # the model's attention modules by layer, while installed
        self._hooks: list = []  # the forward pre-hooks that hand the attention its module's hidden states
        self._compressible: set[int] = set()  # the layers whose cache a press takes over
        self._flight = threading.Condition()
        self._forwards: dict[int, int] = {}  # thread id -> forwards of the model it is inside
        self._warned: weakref.WeakSet = weakref.WeakSet()  # the other threads told their forwards run without it
        self._said_outside = False  # an attention ran outside the model's forward for an active caller (`OUTSIDE`)

    def __deepcopy__(self, memo):
        if self.installed:
            raise TypeError(f"a {type(self.model).__name__} with a press installed cannot be copied or saved whole "
                            "(its forward and hooks lead to the press): leave the press's `with` block first")
        raise TypeError("a press's installation is not copied or saved: copy the press, and install the copy")

    def __reduce_ex__(self, protocol):
        self.__deepcopy__({})

    # ----- install / uninstall ----------------------------------------------------------------------
    def install(self) -> None:
        with _INSTALLING:  # (two threads entering presses on one model: the second refused, not both in)
            self._install()

    def _install(self) -> None:
        """Check and switch, undoing what changed when a step raises (inside the lock: a model half-installed is
        never seen by another install; the undo waits only for a forward that entered the new wrapper meanwhile)."""
        current = self.model.config._attn_implementation
        if current is not None and current.startswith(_PREFIX):
            raise RuntimeError(
                f"a press is already active on this {type(self.model).__name__}, or on another model built on the "
                "same config object (the press marks config._attn_implementation): leave its `with` block first, "
                "or give each model its own config (copy.deepcopy(config))"
            )
        if not model_access.runs_attention(current):
            raise ValueError(
                f"attention implementation {current!r} is not supported; use {model_access.RUNS_ON}"
            )
        self._original = current
        modules = model_access.attention_modules(self.model)
        self._modules = modules
        self._inner = {i: model_access.inner_attention(self.model, current, m) for i, m in modules.items()}
        self._compressible = set(model_access.compressible_layers(self.model))
        self.cache_key = model_access.cache_keyword(self.model)
        register(self.name, self._attention, original_mask_function(current))
        self._forwards = {}
        self._warned = weakref.WeakSet([threading.current_thread()])  # (its own `installed()` split is deliberate)
        try:
            self._own_forward = self.model.__dict__.get("forward")  # accelerate's hooks set one, for example
            self._forward = self._wrap(self.model.forward)
            self.model.forward = self._forward
            self._hooks = [m.register_forward_pre_hook(self._keep_hidden, with_kwargs=True) for m in modules.values()]
            self._hooks.append(self.model.get_input_embeddings().register_forward_pre_hook(self._keep_ids))
            self.model.set_attn_implementation(self.name)
        except BaseException:
            self.uninstall()
            raise
        self.installed = True

    def uninstall(self, wait_s: float = 60.0) -> None:
        """Restore the model. Another thread's forward already running on it finishes with the intercept
        first (waited for up to `wait_s` seconds): switching back mid-forward would hand transformers'
        own attention a mask it does not know. Every step of the restore runs even when one raises, or when the
        wait is interrupted (Ctrl-C): the first error is raised once all have run."""
        steps = (self._restore_forward, self._remove_hooks, self._restore_implementation,
                 lambda: unregister(self.name), self._release_caches)  # fmt: skip
        error: BaseException | None = None
        with self._flight:
            try:
                self._forwards.pop(threading.get_ident(), None)  # this thread's own forwards are over
                if not self._flight.wait_for(lambda: not any(self._forwards.values()), timeout=wait_s):
                    warn(f"another thread's forward of this {type(self.model).__name__} was still running "
                         f"{wait_s:g} s after the press's block ended: the press is removed under it (that "
                         "forward fails at its next attention layer, whose mask was built for the press)")  # fmt: skip
            except BaseException as caught:  # (KeyboardInterrupt in the wait: restore all the same)
                error = caught
            for step in steps:
                try:
                    step()
                except BaseException as caught:
                    error = error or caught
        self.installed = False
        if error is not None:
            raise error

    def _restore_forward(self) -> None:
        if self._forward is not None and self.model.__dict__.get("forward") is self._forward:
            if self._own_forward is None:
                del self.model.forward
            else:
                self.model.forward = self._own_forward
        self._forward = self._own_forward = None

    def _remove_hooks(self) -> None:
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook.remove()

    def _restore_implementation(self) -> None:
        if self.model.config._attn_implementation == self.name:
            self.model.set_attn_implementation(self._original)

    def _release_caches(self) -> None:
        for cache in list(self._caches):
            for layer in cache.layers:
                if isinstance(layer, _DRIVEN):
                    layer.driven = False

    # ----- who it acts for ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def activated(self) -> Iterator[None]:
        """Inside this block, forwards run by this caller (this thread and context) go through the press."""
        if not self.installed:
            raise RuntimeError("the press is not installed on the model: enter `with press(model):` first")
        current = _ACTIVE.get() or {}
        if self in current:  # already active for this caller
            yield
            return
        _ACTIVE.set({**current, self: _Call()})
        try:
            yield
        finally:  # this one's entry only: blocks left out of order (two sessions' generators closed in the order
            # they began) leave the other active (a reset to the value before would drop it, and keep this one's)
            _ACTIVE.set({k: v for k, v in (_ACTIVE.get() or {}).items() if k is not self} or None)

    def _call(self) -> _Call | None:
        """This caller's state, or None when the press is not active for it. A thread started with a copy of the
        caller's context (`copy_context().run`, `asyncio.to_thread`) holds the same state object: it gets its own
        on first use (whether it evicts carried over), so two threads never share a forward's cache or a frozen()."""
        active = _ACTIVE.get()
        call = None if active is None else active.get(self)
        if call is not None and call.owner is not threading.current_thread():
            call = _Call(call.compressing)
            _ACTIVE.set({**active, self: call})
        return call

    def compressing(self) -> bool:
        """Whether this caller's forwards evict now (not inside `frozen()`)."""
        call = self._call()
        return call is not None and call.compressing

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """Inside this block this caller's cache grows without eviction (for example while a question is read)."""
        call = self._call()
        if call is None:
            raise RuntimeError("frozen() pauses an active press: use it inside `with press(model) as installed:`")
        previous, call.compressing = call.compressing, False
        try:
            yield
        finally:
            call.compressing = previous

    # ----- per forward --------------------------------------------------------------------------------
    def _wrap(self, forward: Callable) -> Callable:
        @functools.wraps(forward)
        def wrapped(*args, **kwargs):
            me = threading.get_ident()
            with self._flight:
                live = self._forward is not None  # (a thread that took this wrapper before the restore: runs plainly)
                if live:
                    self._forwards[me] = self._forwards.get(me, 0) + 1
            if not live:
                return forward(*args, **kwargs)
            call = outer = outer_ids = None
            try:
                call = self._call()
                if call is None:
                    thread = threading.current_thread()  # (not its id: a finished thread's id is reused)
                    if thread not in self._warned:
                        self._warned.add(thread)
                        warn(UNPRESSED.format(model=type(self.model).__name__, thread=thread.name), once_per_line=False)
                    return forward(*args, **kwargs)
                outer, outer_ids = call.cache, call.ids  # a cache already: this forward runs inside another
                self._prepare(call, args, kwargs)
                with sdpa_backends.without_cudnn(self.model.device):  # no cuDNN graph per new length (CUDA)
                    return self.handler.run_forward(forward, call.cache, args, kwargs)
            except BaseException:
                if call is not None and call.cache is not None and _torn(call.cache):
                    tear(call.cache)
                raise
            finally:
                if call is not None:  # the outer forward goes on with its own cache (a draft runs on another)
                    call.cache, call.ids = outer, outer_ids
                with self._flight:
                    self._forwards[me] = max(0, self._forwards.get(me, 0) - 1)
                    self._flight.notify_all()

        return wrapped

    def _prepare(self, call: _Call, args: tuple, kwargs: dict) -> None:
        """Before an active caller's forward: find or make its cache and let the press drive its layers."""
        call.cache = call.ids = None  # ids: set by the input embedding's hook (none when embeddings are given)
        switched = self.model.config._attn_implementation
        if switched != self.name:  # (set_attn_implementation inside the block: no attention would reach the press)
            raise RuntimeError(f"this {type(self.model).__name__}'s attention implementation was set to {switched!r} "
                               "inside the press's block, so its attention no longer reaches the press: switch it "
                               "before the `with press(model):` block (a press runs on "
                               f"{model_access.RUNS_ON})")  # fmt: skip
        cache = kwargs.get(self.cache_key, kwargs.get("past_key_values"))
        training = self.model.training and torch.is_grad_enabled()  # (only then: the property walks every module)
        if training and getattr(self.model, "is_activation_checkpointing", False):
            raise ValueError("gradient checkpointing in training mode runs each layer without the cache (transformers "
                             "hands it cache=None), so a press has none to compress: call model.eval(), or "
                             "model.activation_checkpointing_disable()")  # fmt: skip
        if kwargs.get("use_cache") is False:  # (with a cache given too: generate re-fed the whole text each step and
            # the press compressed a cache no step read, its answer the uncompressed model's)
            raise ValueError("a press compresses the KV cache: call the model with use_cache=True (in "
                             "model.generate: use_cache=True, or the model's generation_config.use_cache=True)")
        if cache is None:
            cache = model_access.new_cache(self.model)
            kwargs[self.cache_key] = cache
        if not isinstance(cache, DynamicCache):
            raise TypeError(
                f"kvpress compresses a DynamicCache in place; got {type(cache).__name__}. Pass "
                "cache=DynamicCache(config=model.config), or let generate make one: leave cache_implementation "
                "unset or 'dynamic' (in generate's arguments and the model's generation_config)"
            )
        model_access.complete_layers(cache, self.model)
        if not torch.is_inference_mode_enabled():  # (before anything writes into a layer)
            for layer in cache.layers:
                if isinstance(layer, _DRIVEN) and made_in_inference(layer):
                    leave_inference(layer)
        newly = []  # layers this forward drives first: a refused forward leaves them as they were
        for i, layer in enumerate(cache.layers):
            if i in self._compressible and model_access.is_plain_layer(layer):
                cache.layers[i] = layer = PressedLayer.from_layer(layer)
            elif isinstance(layer, HeadwiseLayer) and not (layer.seen or layer.pending or layer.torn):
                # an emptied head-wise layer (`cache.reset()`) starts the next prompt as a fresh cache's does:
                # dense, of the new prompt's batch and padding, for whichever press runs it
                cache.layers[i] = layer = PressedLayer(layer.window)
            if isinstance(layer, _DRIVEN) and not layer.driven:
                layer.driven = True
                newly.append(layer)
        try:
            check_inputs(cache, args, kwargs)
            if _torn(cache):
                raise ValueError(
                    "this cache was left inconsistent by a forward that raised half-way (its layers hold different "
                    "numbers of tokens) or by `scratch`, which cannot undo an eviction inside; it cannot be "
                    "continued: start a new cache"
                )
            self.handler.before_forward(cache, args, kwargs)
        except BaseException:
            for layer in newly:
                layer.driven = False
            raise
        call.cache = cache
        self._caches.add(cache)

    def _keep_hidden(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        call = self._call()
        if call is not None:
            call.hidden[module.layer_idx] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

    def _keep_ids(self, module: nn.Module, args: tuple) -> None:
        call = self._call()
        if call is not None and args and isinstance(args[0], torch.Tensor):
            call.ids = None if args[0].is_floating_point() else args[0]

    def _attention(self, module: nn.Module, query, key, value, attention_mask, **kwargs):
        info = attention_mask if isinstance(attention_mask, MaskInfo) else None
        inner = self._inner[module.layer_idx]
        call = self._call()
        hidden = call.hidden.pop(module.layer_idx, None) if call is not None else None
        ids = call.ids if call is not None and call.ids is not None and call.ids.shape[-1] == query.shape[2] else None
        layer = call.cache.layers[module.layer_idx] if call is not None and call.cache is not None else None
        if not isinstance(layer, _DRIVEN):  # another caller's forward, or a layer the press leaves alone
            ours = self._modules.get(module.layer_idx) is module  # (not another model built on the same config)
            if not self._said_outside and ours and call is not None and call.cache is None:  # (once per install)
                self._said_outside = True
                warn(OUTSIDE.format(model=type(self.model).__name__))
            return inner(module, query, key, value, info.standard() if info else attention_mask, **kwargs)
        if info is None and attention_mask is not None:
            raise ValueError("kvpress builds its own masks: pass a 2D attention_mask, not a 4D one")
        q_len = query.shape[2]
        if layer.pending != q_len:
            raise RuntimeError(
                "the cache seen by the attention is not the one the press prepared; pass it by keyword "
                f"({self.cache_key}=...)"
            )
        if isinstance(layer, HeadwiseLayer):
            unsupported = headwise_unsupported(kwargs)
            if unsupported:  # (the head-wise attention computes softmax(scaled logits + mask) @ values alone)
                raise ValueError(f"head-wise compressed layers do not support {', '.join(unsupported)} (attention "
                                 "sinks, a position bias, dropout in training mode): use a dense press or eval()")
            layer.commit()
            grad = torch.is_grad_enabled() and query.requires_grad
            block = self.handler.mass_block(layer, call.compressing) if layer.window is None and not grad else None
            out, mass = headwise_attention(module, query, layer, block, kwargs.get("softcap"))
            layer.trim_window()
            self.handler.after_headwise(module, query, layer, hidden, call.compressing, ids, mass)
            layer.compact()  # evictions free slots in place: a layer with too much spare room is packed tight
            layer.settle()
            # (it attended to slots held from before, whose storage later steps rewrite in place: no backward)
            return (without_backward(out) if out.requires_grad else out), None
        thin = layer.key_channels is not None  # keys of fewer channels (ThinK): the queries meet only those
        if thin:
            query = layer.query_channels(query)
        if layer.adopted and info is not None and info.padding is not None:
            layer.adopt_padding(info.padding[:, : layer.seen - q_len])
        layer.commit(info.new_valid(q_len) if info is not None else None)
        flash = self._original.startswith("flash_attention")
        # a chunk after held tokens on the CPU: transformers' sdpa path would copy every KV head g times over all
        # of them and the kernel turn its mask into floats, so even a layer the press left whole runs in blocks
        over_held = self._original == "sdpa" and key.shape[2] > q_len
        blocks = over_held and blocked.applies(module, query, kwargs)
        # where blocks are left out (a GPU) and every held slot is visible: one bottom-right causal call, no mask,
        # the KV heads shared (`blocked_attention.bottom_right_attention`)
        fused = (over_held and layer.valid is None and layer.window is None and not thin
                 and blocked.fuses(module, query, kwargs))  # fmt: skip
        whole = not layer.compressed and not blocks and not fused
        standard = info.standard() if info is not None and whole else None  # built only if used
        out = mass = None
        block = self.handler.mass_block(layer, call.compressing) if layer.window is None else None
        grad = torch.is_grad_enabled() and query.requires_grad  # (its buffers take no autograd history)
        peak = None
        if block and blocked.weighable(module, kwargs) and not grad:  # the press reads the weights: computed once
            plain = layer.valid is None  # no padding, no holes: causal among the new tokens is all the mask says
            rows_mask = None if plain else functools.partial(layer_mask, layer, q_len, 1, query.dtype, False)
            if self.handler.reads_peak():
                peak = key.new_zeros(*key.shape[:3], dtype=torch.float32)
            out, mass = blocked.attention_with_mass(query, key, value, rows_mask, block, kwargs.get("scaling"),
                                                    kwargs.get("softcap"), peak)  # fmt: skip
            out = out, None
        elif fused:
            out = blocked.bottom_right_attention(query, key, value, kwargs.get("scaling"))
            out = out.transpose(1, 2).contiguous(), None
        elif whole and not _sized_for_another_layer(standard, key) and not (flash and thin):
            mask = standard  # slots still line up with tokens: transformers' own mask is right
        elif flash and "valid" not in layer.slots and not thin and (layer.window is None or q_len == 1):
            mask = None  # flash aligns causal masks bottom-right: new tokens after every held slot
        else:  # kvpress's own mask (flash cannot express holes in a padded batch, keys narrower than values, nor a
            # sliding window over held slots that are not consecutive positions: it counts the window in slots; that
            # call runs on sdpa), on the CPU in blocks of queries
            fn = "sdpa" if flash else self._original
            inner = model_access.inner_attention(self.model, fn, module) if fn != self._original else inner
            n_rep = query.shape[1] // key.shape[1]
            if fn == "sdpa" and blocked.applies(module, query, kwargs):  # no g-times copy of the held keys
                rows_mask = functools.partial(layer_mask, layer, q_len, n_rep, query.dtype, False)
                out = blocked.blocked_attention(query, key, value, rows_mask, kwargs.get("scaling")), None
            else:
                mask = layer_mask(layer, q_len, n_rep, query.dtype, additive=fn == "eager")
        if out is None:
            out = inner(module, query, key, value, mask, **kwargs)
        replacement = self.handler.after_attention(module, query, key, value, layer, call.compressing, hidden, mass,
                                                   ids, peak)  # fmt: skip
        if replacement is not None:  # the layer moved to per-head storage
            replacement.driven = True
            call.cache.layers[module.layer_idx] = replacement
        layer.trim_window()  # a sliding-window layer drops what left its window (the handler may have already)
        return out


# ----- the mask partner: transformers' mask built only where a layer needs it ---------------------------------
@dataclass
class MaskInfo:
    """What the mask interface was asked for, kept until a layer needs it."""

    build: Callable[..., torch.Tensor | None]
    kwargs: dict
    _standard: list = field(default_factory=list)
    _new_valid: dict = field(default_factory=dict)

    @property
    def padding(self) -> torch.Tensor | None:
        mask = self.kwargs.get("attention_mask")
        return mask if mask is not None and mask.dim() == 2 else None

    def new_valid(self, q_len: int) -> torch.Tensor | None:
        """`[B, q]` True for the real tokens among the last `q_len`, or None when none is padding (read from the
        device once per forward, not once per layer)."""
        if q_len not in self._new_valid:
            self._new_valid[q_len] = new_padding(self.kwargs.get("attention_mask"), q_len)
        return self._new_valid[q_len]

    def standard(self) -> torch.Tensor | None:
        """transformers' own mask for these arguments (built once)."""
        if not self._standard:
            self._standard.append(self.build(**self.kwargs))
        return self._standard[0]


def layer_mask(layer: PressedLayer, q_len: int, n_rep: int, dtype: torch.dtype, additive: bool,
               rows: tuple[int, int] | None = None):  # fmt: skip
    """The mask of a compressed layer: held slots visible where valid, causal among the new tokens, and for a
    sliding-window layer only the slots less than `window` positions behind the query.

    Bool (sdpa) or additive float (eager); None when nothing is hidden. A query always sees its
    own slot, so padding queries stay finite. `rows` `(s, e)`: only queries `s:e` of the `q_len` new ones,
    over the slots they can see (all but the new ones after query `e - 1`).
    """
    n, device = layer.n, layer.keys.device
    valid = layer.valid
    if valid is None and q_len == 1:  # a sliding layer's held slots are all in the window of the next token
        return None
    s, e = rows if rows is not None else (0, q_len)
    old_n, width = n - q_len, n - q_len + e
    causal = torch.ones(e - s, e, dtype=torch.bool, device=device).tril(s)  # new query s + i sees new slots <= s + i
    if valid is None and layer.window is None:
        old = torch.ones(e - s, old_n, dtype=torch.bool, device=device)
        mask = torch.cat([old, causal], dim=-1)[None, None]
    else:
        b, h = layer.keys.shape[:2]
        valid = valid[..., :width] if valid is not None else torch.ones(b, h, width, dtype=torch.bool, device=device)
        old = valid[:, :, None, :old_n].expand(b, h, e - s, old_n)
        mask = torch.cat([old, causal & valid[:, :, None, old_n:]], dim=-1)
        if layer.window is not None:
            pos = layer.pos[..., :width].long()
            mask = mask & (pos[:, :, None, :] > pos[:, :, old_n + s : old_n + e, None] - layer.window)
        own = torch.arange(e - s, device=device)
        mask[..., own, old_n + s + own] = True
        mask = mask.repeat_interleave(n_rep, dim=1)
    if additive:
        return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask


def active_handler(model: nn.Module):
    """The handler of the intercept active on `model` for this caller, or None."""
    return next((i.handler for i in (_ACTIVE.get() or {}) if i.model is model and i.installed), None)


def split_inputs(args: tuple, kwargs: dict, at: int) -> tuple[tuple[tuple, dict], tuple[tuple, dict]]:
    """A forward's inputs as two forwards: its first `at` new tokens, then the rest. Tensors over the new tokens
    (ids, embeddings, position ids) are cut; a 2D attention mask (past and new tokens) is cut for the first."""
    q = new_tokens(args, kwargs).shape[1]
    parts = []
    for lo, hi in ((0, at), (at, q)):
        part = {}
        for name, value in kwargs.items():
            if name == "attention_mask" and isinstance(value, torch.Tensor):
                if value.dim() != 2:
                    raise ValueError("kvpress builds its own masks: pass a 2D attention_mask, not a 4D one")
                part[name] = value[:, : value.shape[1] - (q - hi)]
            elif isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == q:
                part[name] = value[:, lo:hi]
            else:
                part[name] = value
        first = tuple(a[:, lo:hi] if isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[1] == q else a
                      for a in args)  # fmt: skip
        parts.append((first, part))
    return parts[0], parts[1]


def register(name: str, attention_fn: Callable, original_mask_fn: Callable) -> None:
    """Register `attention_fn` and a `MaskInfo`-returning mask function under `name`."""

    def mask_fn(**kwargs):
        return MaskInfo(original_mask_fn, kwargs)

    AttentionInterface.register(name, attention_fn)
    AttentionMaskInterface.register(name, mask_fn)


def unregister(name: str) -> None:
    AttentionInterface._global_mapping.pop(name, None)
    AttentionMaskInterface._global_mapping.pop(name, None)


def original_mask_function(implementation: str) -> Callable:
    """The mask function transformers resolves `implementation` to (a user's own registration of it included)."""
    return ALL_MASK_ATTENTION_FUNCTIONS[implementation]


def new_padding(mask: torch.Tensor | None, q: int) -> torch.Tensor | None:
    """`[B, q]` True for the real tokens among a forward's `q` new ones by its 2D attention `mask`, or None when
    every one is real (or the mask is not 2D): the one read of the device a forward makes for its padding."""
    if mask is None or mask.dim() != 2:
        return None
    new = mask[:, -q:].bool()
    return None if bool(new.all()) else new


def check_inputs(cache: DynamicCache, args: tuple, kwargs: dict) -> None:
    """Refuse, naming it, what a press would misread in a forward's inputs: ids not `[batch, tokens]` (or
    embeddings not `[batch, tokens, hidden]`), a 2D attention mask not `[batch, tokens seen + new]` (it marks each
    row's padding among every token seen: a shorter one raised inside the cache, a longer one was read wrongly)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is not None and not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point()):
        got = f"shape {list(ids.shape)}, {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"input_ids must be a [batch, tokens] tensor of token ids, got {got}")
    embeds = kwargs.get("inputs_embeds") if ids is None else None
    if ids is None and not (isinstance(embeds, torch.Tensor) and embeds.dim() == 3):
        got = f"shape {list(embeds.shape)}" if isinstance(embeds, torch.Tensor) else repr(embeds)
        raise ValueError(f"a forward takes input_ids [batch, tokens] or inputs_embeds [batch, tokens, hidden], got "
                         f"inputs_embeds {got}")  # fmt: skip
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        inputs = ids if ids is not None else embeds
        expected = [inputs.shape[0], cache.get_seq_length() + inputs.shape[1]]
        if list(mask.shape) != expected:
            raise ValueError(f"attention_mask must be [batch, tokens seen + new] = {expected} (it marks each row's "
                             f"padding among every token the cache has seen), got {list(mask.shape)}")  # fmt: skip


def new_tokens(args: tuple, kwargs: dict) -> torch.Tensor:
    """The new tokens of a forward: `input_ids`, or `inputs_embeds` when no ids are given."""
    inputs = kwargs.get("input_ids", args[0] if args else None)
    return inputs if inputs is not None else kwargs["inputs_embeds"]


def cache_positions(cache: DynamicCache, args: tuple, kwargs: dict) -> torch.Tensor:
    """Positions inside the cache for a forward's new tokens: their true positions minus the tokens each row
    evicted before (the positions StreamingLLM re-rotates keys to)."""
    inputs = new_tokens(args, kwargs)
    q = inputs.shape[1]
    positions = kwargs.get("position_ids")
    if positions is None:
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2:
            positions = (mask.long().cumsum(-1) - 1).clamp_min(0)[:, -q:]
        else:
            positions = torch.arange(q, device=inputs.device)[None] + cache.get_seq_length()
    layer = next(layer for layer in cache.layers if isinstance(layer, PressedLayer))
    if layer.shift is None:
        return positions
    return positions - layer.shift.to(positions.device)[:, None]


def _sized_for_another_layer(mask, key: torch.Tensor) -> bool:
    """transformers sizes one mask per layer type from the first such layer; a full layer after a compressed
    one (per-layer budgets that leave a layer whole) holds more keys than that mask covers."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-1] != key.shape[-2]


def tear(cache: DynamicCache) -> None:
    """Mark every layer a press drives in `cache` torn: refused from now on, with or without the press."""
    for layer in cache.layers:
        if isinstance(layer, _DRIVEN):
            layer.torn = True


def _torn(cache: DynamicCache) -> bool:
    """Whether a forward that raised left the layers a press drives at different points (some hold its tokens,
    some do not, or one holds them uncommitted), or a layer is marked torn (so is one `scratch` could not rewind)."""
    ours = [layer for layer in cache.layers if isinstance(layer, _DRIVEN)]
    return len({layer.seen for layer in ours}) > 1 or any(layer.pending or layer.torn for layer in ours)
