"""The presses: one policy a file, and the one registry every list of press names and parameters comes from
(the CLI names and spec grammar, the lm-eval bridge's `model_args`, the README's table, the tests)."""

import dataclasses
import inspect
import re

from torch import nn

from kvpress.models import DEFAULT_MODEL, PACKAGED_MODELS
from kvpress.presses.adakv import AdaKVPress
from kvpress.presses.base import BasePress, Observation
from kvpress.presses.chunk import ChunkPress
from kvpress.presses.criticalkv import CriticalKVPress
from kvpress.presses.cur import CURPress
from kvpress.presses.defaults import DEFAULT_PRESS, default_for, default_press
from kvpress.presses.defaults import NAME as DEFAULT_NAME
from kvpress.presses.duo_attention import DuoAttentionPress
from kvpress.presses.expected_attention import ExpectedAttentionPress
from kvpress.presses.head_budget import HeadwisePress
from kvpress.presses.heavy_hitter import H2OPress, HeavyHitterPress
from kvpress.presses.keydiff import KeyDiffPress
from kvpress.presses.knorm import KnormPress
from kvpress.presses.kvzap import KVzapPress
from kvpress.presses.kvzip import KVzipPress
from kvpress.presses.lagkv import LagKVPress
from kvpress.presses.lookahead import LookaheadPress
from kvpress.presses.nats import NAtSPress
from kvpress.presses.pyramidkv import PyramidKVPress
from kvpress.presses.random_press import RandomPress
from kvpress.presses.recall import RecallPress
from kvpress.presses.shotkv import ShotKVPress
from kvpress.presses.simlayerkv import SimLayerKVPress
from kvpress.presses.sink_window import SinkWindowPress, StreamingLLMPress
from kvpress.presses.snapkv import SnapKVPress
from kvpress.presses.specattn import SpecAttnPress
from kvpress.presses.tappa import TAPPAPress
from kvpress.presses.think import ThinKPress
from kvpress.presses.tova import TOVAPress


def _adakv(alpha_safeguard: float = 0.2, normalize: bool = False, inner: str = "snapkv", **kwargs) -> AdaKVPress:
    """AdaKV around the press named `inner` (SnapKV by default), built from the remaining arguments."""
    return AdaKVPress(press_from_name(inner, **kwargs), alpha_safeguard=alpha_safeguard, normalize=normalize)


def _chunkkv(chunk_size: int = 10, inner: str = "snapkv", **kwargs) -> ChunkPress:
    """ChunkKV around the press named `inner` (SnapKV by default), built from the remaining arguments."""
    return ChunkPress(press_from_name(inner, **kwargs), chunk_size=chunk_size)


def _criticalkv(first_stage_ratio: float = 0.5, epsilon: float = 1e-4, inner: str = "snapkv",
                **kwargs) -> CriticalKVPress:  # fmt: skip
    """CriticalKV's two-stage selection over the press named `inner` (SnapKV by default, as in the paper)."""
    return CriticalKVPress(press_from_name(inner, **kwargs), first_stage_ratio=first_stage_ratio, epsilon=epsilon)


def _tappa(similarity_window: int = 32, alpha_safeguard: float = 0.2, inner: str = "snapkv", **kwargs) -> TAPPAPress:
    """TAPPA's q-similarity head budgets over the press named `inner` (SnapKV by default)."""
    return TAPPAPress(press_from_name(inner, **kwargs), alpha_safeguard=alpha_safeguard,
                      similarity_window=similarity_window)  # fmt: skip


def _recall(span_size: int = 32, recall_fraction: float = 0.25, recall_every: int = 0, inner: str = "snapkv",
            **kwargs) -> RecallPress:  # fmt: skip
    """Recall of stored spans over the press named `inner` (SnapKV by default)."""
    return RecallPress(press_from_name(inner, **kwargs), span_size=span_size, recall_fraction=recall_fraction,
                       recall_every=recall_every)  # fmt: skip


def _shotkv(shot_marker: str = "Question:", inner: str = "snapkv", **kwargs) -> ShotKVPress:
    """ShotKV's whole shots over the press named `inner` (SnapKV by default)."""
    return ShotKVPress(press_from_name(inner, **kwargs), shot_marker=shot_marker)


def _think(key_channel_ratio: float = 0.4, query_window: int = 32, inner: str = "snapkv", **kwargs) -> ThinKPress:
    """ThinK's thinner keys over the tokens the press named `inner` keeps (SnapKV by default)."""
    return ThinKPress(press_from_name(inner, **kwargs), key_channel_ratio=key_channel_ratio, query_window=query_window)


def _pyramidkv(beta: float = 20.0, inner: str = "snapkv", **kwargs) -> PyramidKVPress:
    """PyramidKV's per-layer budgets over the press named `inner` (SnapKV by default, as in the paper)."""
    return PyramidKVPress(press_from_name(inner, **kwargs), beta=beta)


def _duo_attention(head_pattern: str = "auto", retrieval_fraction: float | None = None, n_sink: int = 4,
                  window: int = 64, inner: str | None = None, **kwargs) -> DuoAttentionPress:  # fmt: skip
    """DuoAttention; with `inner`, its retrieval heads keep what the press named `inner` keeps (built from the
    remaining arguments) instead of everything. `n_sink` and `window` are the streaming heads' (the inner
    press keeps its own defaults for parameters of the same name)."""
    duo = {"head_pattern": head_pattern, "retrieval_fraction": retrieval_fraction, "n_sink": n_sink, "window": window}
    if inner is None:
        return DuoAttentionPress(**duo, **kwargs)
    return DuoAttentionPress(**duo, press=press_from_name(inner, **kwargs))


PRESSES = {
    "adakv": _adakv,
    "chunkkv": _chunkkv,
    "criticalkv": _criticalkv,
    "cur": CURPress,
    "duo-attention": _duo_attention,
    "expected-attention": ExpectedAttentionPress,
    "snapkv": SnapKVPress,
    "h2o": HeavyHitterPress,
    "heavy-hitter": HeavyHitterPress,
    "shotkv": _shotkv,
    "simlayerkv": SimLayerKVPress,
    "sink-window": SinkWindowPress,
    "specattn": SpecAttnPress,
    "streaming-llm": SinkWindowPress,
    "knorm": KnormPress,
    "keydiff": KeyDiffPress,
    "kvzip": KVzipPress,
    "kvzap": KVzapPress,
    "lagkv": LagKVPress,
    "lookahead": LookaheadPress,
    "nats": NAtSPress,
    "pyramidkv": _pyramidkv,
    "random": RandomPress,
    "recall": _recall,
    "tappa": _tappa,
    "think": _think,
    "tova": TOVAPress,
}




def press_parameters(name: str, inner: str | None = None) -> dict[str, object]:
    """The keyword parameters the press named `name` takes, with their defaults, read from its class's fields
    or its factory's signature; a wrapper (`adakv`, `chunkkv`) also takes those of its `inner` press (by
    default the one its signature names)."""
    factory = PRESSES[name]
    params = {}
    for param in inspect.signature(factory).parameters.values():
        if param.kind is param.VAR_KEYWORD and (inner or params["inner"]):  # the rest goes to its inner press
            for key, default in press_parameters(parse_press_spec(inner or params["inner"])[0]).items():
                params.setdefault(key, default)  # a name both take is the wrapper's
        elif param.kind is param.VAR_KEYWORD:  # no inner press: the rest goes to the class itself
            own = inspect.signature(press_class(name)).parameters.values()
            params.update({p.name: p.default for p in own if p.name not in params and p.name != "press"})
        elif param.name != "press":  # a wrapper class's inner press object (the factories build it from `inner`)
            params[param.name] = param.default
    return params


def all_press_parameters() -> set[str]:
    """Every keyword some press takes (a wrapper takes those of any press as its `inner`)."""
    return {param for name in PRESSES for param in press_parameters(name)}


def press_names() -> list[str]:
    """The press names without their aliases (`heavy-hitter` for `h2o`, `streaming-llm` for `sink-window`)."""
    seen, names = set(), []
    for name, factory in PRESSES.items():
        if factory not in seen:
            seen.add(factory)
            names.append(name)
    return names


def aliases(name: str) -> list[str]:
    """The other names of the press named `name`."""
    return [other for other, factory in PRESSES.items() if factory is PRESSES[name] and other != name]


BUDGET_PARAMETERS = tuple(field.name for field in dataclasses.fields(BasePress))  # every press takes these


def press_class(name: str) -> type:
    """The class of the press named `name` (a factory's return annotation)."""
    factory = PRESSES[name]
    return factory if isinstance(factory, type) else inspect.signature(factory).return_annotation


def press_table() -> str:
    """The README's table of presses, in Markdown, from the registry: names, classes, own parameters with
    their defaults, what each keeps (its class docstring) and its paper (its module docstring)."""
    rows = ["| name | class | parameters (defaults) | keeps | paper |", "|---|---|---|---|---|"]
    for name in press_names():
        cls = press_class(name)
        own = [p for p in inspect.signature(PRESSES[name]).parameters.values()
               if p.name not in (*BUDGET_PARAMETERS, "press") and p.kind is not p.VAR_KEYWORD]  # fmt: skip
        params = ", ".join(f"`{p.name}={p.default!r}`" for p in own)
        if any(p.kind is p.VAR_KEYWORD for p in inspect.signature(PRESSES[name]).parameters.values()):
            params += " + the inner press's"
        keeps = inspect.getdoc(cls).split("\n\n")[0].replace("\n", " ").split(". ")[0].rstrip(".")
        doc = inspect.getmodule(cls).__doc__
        arxiv = re.search(r"arXiv:(\d{4}\.\d{4,5})", doc)
        who = re.search(r"([A-Z][A-Za-z-]+(?: et al\.)? \d{4})", doc)  # "Kim et al. 2025", "Shah 2025"
        paper = f"{who.group(1)}, arXiv:{arxiv.group(1)}" if arxiv and who else "baseline"
        names = ", ".join(f"`{n}`" for n in [name, *aliases(name)])
        rows.append(f"| {names} | `{cls.__name__}` | {params or '-'} | {keeps} | {paper} |")
    return "\n".join(rows)


def parse_press_spec(spec: str) -> tuple[str, dict]:
    """`"snapkv:window_size=16:kernel_size=3"` -> `("snapkv", {"window_size": 16, "kernel_size": 3})`:
    a press name and its parameters (ints, floats, true/false, none, or text)."""
    if not isinstance(spec, str):
        raise TypeError(f"a press is named by a string such as 'snapkv' or 'snapkv:window_size=16', got {spec!r}")
    name, *pairs = spec.split(":")
    if name not in PRESSES:
        raise ValueError(f"unknown press {name!r}; choose one of: {', '.join(sorted(PRESSES))} (or default, the "
                         "model's default press)")  # fmt: skip
    params = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"press parameters are key=value after the name (snapkv:window_size=16), got {pair!r}")
        if key in params:
            raise ValueError(f"press parameter {key!r} is given twice in {spec!r}")
        params[key] = _value(text)
    return name, params


def _value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def press_from_name(name: str, model: nn.Module | None = None, **kwargs) -> BasePress:
    """Build a press by its CLI name (see `PRESSES`), optionally with parameters: `"snapkv:window_size=16"`;
    `"default"` is `model`'s default press (`kvpress.presses.defaults`; without a model, the one for any model),
    whose own parameters the keyword arguments replace as parameters after `default:` do (`n_sink=8`)."""
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"press_from_name's second argument is the model (whose default press `default` names), got "
                        f"{model!r}: give the budget by name, compression_ratio= or max_tokens=")  # fmt: skip
    name, params = parse_press_spec(resolve_default(name, model, kwargs))
    kwargs = {key: value for key, value in kwargs.items() if not (key in params and value is None)}
    both = sorted(set(params) & set(kwargs))
    if both:
        raise ValueError(f"press parameters {both} are given both in {name!r}'s name and as arguments")
    given = {**params, **kwargs}
    inner = given.get("inner")
    allowed = press_parameters(name, inner if isinstance(inner, str) else None)
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ValueError(f"press {name!r} takes no parameter {', '.join(unknown)}; its parameters: "
                         f"{', '.join(allowed)}")  # fmt: skip
    return PRESSES[name](**given)


def resolve_default(spec: str, model: nn.Module | None = None, keywords: dict | None = None) -> str:
    """`spec` with a leading `default` replaced by `model`'s default press (`with_default`, `keywords` the parameters
    given beside the spec); any other spec unchanged."""
    if not isinstance(spec, str) or spec.partition(":")[0] != DEFAULT_NAME:
        return spec
    return with_default(spec, default_press(model), keywords)


def with_default(spec: str, default: str, keywords: dict | None = None) -> str:
    """`spec` (`default`, then parameters or none) as the press spec `default`, each parameter given after `default`
    or in `keywords` (given beside the spec: `press_from_name("default", model, n_sink=8)`; left out of the spec
    returned) in place of the default's own of that name (`default:n_sink=8` over a default with n_sink=4). Given
    `inner`, the default's own parameters that the press with that inner press takes no more (its old inner press's:
    KVzap's `scorer` under `default:inner=snapkv`) are left out; every parameter given is kept (and checked). A keyword
    of value None is not given."""
    keywords = {key: value for key, value in (keywords or {}).items() if value is not None}
    _, sep, rest = spec.partition(":")
    given = rest.split(":") if sep else []  # (an empty one stays, for `parse_press_spec` to refuse)
    names = {pair.partition("=")[0] for pair in given} | set(keywords)
    base, *pairs = default.split(":")
    pairs = [pair for pair in pairs if pair.partition("=")[0] not in names]
    if "inner" in names:
        inner = keywords["inner"] if "inner" in keywords else parse_press_spec(":".join([base, *given]))[1]["inner"]
        taken = press_parameters(base, inner if isinstance(inner, str) else None)
        pairs = [pair for pair in pairs if pair.partition("=")[0] in taken]
    return ":".join([base, *pairs, *given])


def default_before_loading(spec: str, model_name: str | None, keywords: dict | None = None) -> str | None:
    """`spec` resolved before the model `model_name` (a packaged name, a directory, None: the default model) loads,
    to check it early: as that packaged model's default press (its own entry's, else any model's; `keywords` as
    in `with_default`), or None for a directory (whose default depends on its architecture, known once it loads);
    any spec but `default` unchanged."""
    if not isinstance(spec, str) or spec.partition(":")[0] != DEFAULT_NAME:
        return spec
    name = model_name or DEFAULT_MODEL
    if name not in PACKAGED_MODELS:
        return None
    default = default_for(name) or default_press()  # (a packaged model without its own entry: any model's)
    return with_default(spec, default, keywords)


# the press classes of the registry, plus the API around them
def spec_before_loading(spec: str, model_name: str | None, keywords: dict | None = None) -> str | None:
    """`spec` as the model `model_name` (a packaged name, a directory, None: the default model) will take it, to
    check before it loads (`default_before_loading`, `keywords` the parameters given beside it); None for a
    directory's `default`, whose press is known once the model loads: its spec is only parsed (refused as
    `parse_press_spec` refuses)."""
    early = default_before_loading(spec, model_name, keywords)
    if early is None:
        parse_press_spec(resolve_default(spec))
    return early


__all__ = sorted({press_class(name).__name__ for name in PRESSES}) + [
    "BUDGET_PARAMETERS",
    "DEFAULT_PRESS",
    "PRESSES",
    "BasePress",
    "H2OPress",
    "HeadwisePress",
    "Observation",
    "StreamingLLMPress",
    "aliases",
    "all_press_parameters",
    "default_press",
    "parse_press_spec",
    "press_class",
    "press_from_name",
    "press_names",
    "press_parameters",
    "press_table",
    "resolve_default",
    "spec_before_loading",
]
