"""What a press wrapping another press shares: the wrapped press's budget, sinks, window and layer scales."""

from __future__ import annotations

import dataclasses

from kvpress.presses.base import BasePress


def inner_flag(name: str) -> property:
    """A press's class flag (`needs_hidden`, ...) read from the press it wraps (`self.press`; False without one)."""
    return property(lambda self: self.press is not None and getattr(self.press, name),
                    doc=f"the wrapped press's {name}")  # fmt: skip


def wrapped_chain(press) -> list[BasePress]:
    """`press` and every press it wraps, the outermost first (`ChunkPress(PyramidKVPress(SnapKVPress))`: all three)."""
    chain = []
    while isinstance(press, BasePress):
        chain.append(press)
        press = getattr(press, "press", None)
    return chain


SETTINGS = ("rerotate", "decode_slack", "layer_scales", "kv_bits")  # what a wrapper takes from its press as it is built


def take_settings(holder: BasePress) -> None:
    """Record the settings `holder` took from its press (`holder.press`) as it was built (`check_settings`)."""
    holder.__dict__["_press_settings"] = {name: getattr(holder.press, name) for name in SETTINGS}


def check_settings(holder: BasePress) -> None:
    """Refuse a setting moved on `holder.press` since `holder` took it as it was built: the holder copied it and
    checked it against itself then (AdaKV refuses rerotate), so it would be ignored or pass unchecked."""
    taken = holder.__dict__.get("_press_settings", {})
    moved = [f"{name}={getattr(holder.press, name)!r} (built with {value!r})" for name, value in taken.items()
             if getattr(holder.press, name) != value]  # fmt: skip
    if moved:
        name = type(holder).__name__
        raise ValueError(f"the {type(holder.press).__name__} that {name} wraps was given {', '.join(moved)} after "
                         f"{name} was built, which takes them as it is built (only the budget is shared later): build "
                         f"the {name} again around it")  # fmt: skip


class WrapsPress:
    """Mixin of presses built around another press (`press`), which keeps its own budget and protections."""

    press: BasePress | None

    def adopt_press(self, refused: tuple[type, ...] = ()) -> None:
        """First step of `__post_init__`: accept `Wrapper(inner)` positionally, check the wrapped press (a
        token-level press, none of `refused`) and take its budget: the wrapper has none of its own."""
        name = type(self).__name__
        if self.press is None and isinstance(self.compression_ratio, BasePress):  # Wrapper(SnapKVPress(...))
            self.press, self.compression_ratio = self.compression_ratio, None
        given = self.compression_ratio if self.press is None else self.press  # (`Wrapper("snapkv")`: positional)
        if isinstance(given, str):
            raise TypeError(f"{name} wraps a press object, got the name {given!r}: build it first, "
                            f"{name}(kvpress.press_from_name({given!r}, compression_ratio=0.5))")  # fmt: skip
        deep = next((p for p in wrapped_chain(self.press)[1:] if isinstance(p, refused)), None)
        if not isinstance(self.press, BasePress) or isinstance(self.press, refused) or deep is not None:
            inside = "" if deep is None else f" (it wraps a {type(deep).__name__}, which {name} cannot wrap either)"
            shown = self.press if self.press is not None else given  # (a class or a number given positionally)
            if isinstance(shown, type):
                inside += f": build one first, {name}({shown.__name__}(compression_ratio=0.5))"
            raise TypeError(f"{name} wraps a token-level press such as SnapKVPress, got {shown!r}{inside}")
        if not self.press.wrappable:
            raise TypeError(f"{name} cannot wrap {type(self.press).__name__}: it decides its layers or slots itself "
                            "(use it alone)")  # fmt: skip
        if self.compression_ratio is not None or self.max_tokens is not None:
            raise ValueError(f"{name} takes its budget from the wrapped press; set it there")
        defaults = {f.name: f.default for f in dataclasses.fields(BasePress) if f.name in SETTINGS}
        changed = sorted(key for key, default in defaults.items() if getattr(self, key) != default)
        if changed:
            raise ValueError(f"{name} takes {', '.join(changed)} from the wrapped press; set it there")
        self.compression_ratio, self.max_tokens = self.press.compression_ratio, self.press.max_tokens
        self.decode_slack, self.kv_bits = self.press.decode_slack, self.press.kv_bits
        self.__dict__["_shared_budget"] = (self.compression_ratio, self.max_tokens)  # (`check_budget`)
        take_settings(self)  # (`_share_budget`: fixed once built)

    def _share_budget(self) -> None:
        """The wrapper and the press it wraps hold one budget (`BasePress.check_budget`): the one set since they were
        last checked wins (on the wrapped press, as a ratio loop over `inner.compression_ratio` does, or on the
        wrapper); set on both to different values, it is refused."""
        self.press.check_budget()  # (a press it wraps that wraps another: shared below first)
        check_settings(self)
        mine, inner = (self.compression_ratio, self.max_tokens), (self.press.compression_ratio, self.press.max_tokens)
        built = self.__dict__.get("_shared_budget", inner)  # (as last checked)
        if mine != inner:
            if mine != built and inner != built:
                raise ValueError(f"{type(self).__name__}'s budget and its wrapped {type(self.press).__name__}'s were "
                                 f"both set since they were last checked, to compression_ratio={mine[0]}, "
                                 f"max_tokens={mine[1]} and compression_ratio={inner[0]}, max_tokens={inner[1]}: "
                                 "set one")  # fmt: skip
            if mine == built:  # set on the wrapped press
                self.compression_ratio, self.max_tokens = inner
            else:  # set on the wrapper: the wrapped press (and any it wraps) takes it
                self.press.compression_ratio, self.press.max_tokens = mine
                self.press.check_budget()
        self.__dict__["_shared_budget"] = (self.compression_ratio, self.max_tokens)

    needs_whole_context = inner_flag("needs_whole_context")
    needs_tokenizer = inner_flag("needs_tokenizer")
    needs_token_ids = inner_flag("needs_token_ids")
    needs_question = inner_flag("needs_question")
    needs_hidden = inner_flag("needs_hidden")
    observes_frozen = inner_flag("observes_frozen")

    def prepare(self, model, recording, tokenizer=None) -> None:
        self.press.prepare(model, recording, tokenizer)

    def forget(self, cache=None) -> None:
        self.press.forget(cache)

    def check_model(self, model) -> None:
        self.press.check_model(model)

    def observe(self, obs) -> None:
        self.press.observe(obs)

    def observe_frozen(self, obs) -> None:
        self.press.observe_frozen(obs)

    def mass_block(self) -> int | None:
        return self.press.mass_block()

    def after_eviction(self, obs) -> None:
        self.press.after_eviction(obs)

    def sink_count(self) -> int:
        return self.press.sink_count()

    def recent_count(self, budget):
        return self.press.recent_count(budget)

    @property
    def spreads_over_layers(self) -> bool:
        return self.press.spreads_over_layers

    def layer_scale(self, layer_idx: int, n_layers: int) -> float:
        return self.press.layer_scale(layer_idx, n_layers)
