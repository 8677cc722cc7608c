"""Round-level selection for multi-turn chat: keep the past rounds relevant to the new user turn.

Round Attention, Tang et al. 2025, "Round Attention: A Novel Round-Level Attention Mechanism to
Accelerate LLM Inference" (arXiv:2502.15294): in a chat, the round-level attention (a round is a user
turn and its answer) of the layers from a "watershed" layer on picks out the same few past rounds.
So, as in the paper, the layers up to the watershed keep the whole history; at the first forward of
each turn the watershed layer's attention of the new user turn, summed over each past round's tokens,
ranks the rounds; and the layers after it hold only the system prompt, the most recent round(s), the
top-k rounds and the current turn (rearranged before they run). Measured here: ranking with the lower
layers reduced too fails (the new turn's queries need the whole history below the watershed to find
the round: SmolLM2 found 0.08-0.25 of asked rounds vs 0.92), hence the paper's split. Unselected rounds
wait in a `RoundStore` (host memory) and come back when a later turn finds them relevant again. Keys
are stored after RoPE at their true positions, so a recalled round sits exactly where it was.
FlowKV, 2025 ("FlowKV: Enhancing Multi-Turn Conversational Coherence in LLMs via Isolated Key-Value
Cache Management", arXiv:2505.15347): compress each finished round once and never again (re-compressing
old turns destroys early information). `inner` does that.

A chat policy, not a press: `kvpress.ChatSession(model, tokenizer, round_policy=RoundPolicy(...))` owns it,
tells it where each round begins and ends, and lets it see every layer's attention as an observer
(`kvpress.engine.observe`) during the turn's forwards. (`RoundPress` is its former name.)

Parameters:
    top_k_rounds: past rounds kept by relevance (besides the recent ones), >= 0.
    keep_recent_rounds: most recent finished rounds always kept, >= 0.
    watershed_layer: index of the (full-attention) layer that ranks the rounds, or "auto": the layer
        measured for this model (`MEASURED_WATERSHEDS`: SmolLM2-135M, Qwen2.5-0.5B; rule in
        `choose_watershed`), else a quarter of the depth.
    inner: a token-level press applied once to each finished round, in every layer (None: rounds stay
        whole). Its budget is per round: `SnapKVPress(compression_ratio=0.5)` halves every round.
    offload: "cpu" keeps every finished round in a host-memory store so an unselected round can be
        recalled; "none" drops unselected rounds (from the layers after the watershed) for good.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kvpress.engine import evict
from kvpress.patches import model_access
from kvpress.patches.cache import PressedLayer
from kvpress.patterns import config_hash
from kvpress.presses.base import BasePress, Observation, PlainNumbers, check_field_types
from kvpress.round_store import RoundStore

OFFLOAD = ("cpu", "none")
# "auto": per model (architecture hash, as head patterns), the layer `choose_watershed` picks from
# `python -m kvpress.eval.bench_chat --watershed --seed 100 --examples 24 [--model qwen2.5-0.5b]`
# (chitchat chats, seeds apart from the reported ones): per layer, the fraction of chats whose asked
# round that layer's round-level attention ranks first (eval/results/watershed*.json).
MEASURED_WATERSHEDS = {
    "59ba6691c8489e2a": 14,  # smollm2-135m: 1.00 (also at 15, 18, 23; layers 3-10 at most 0.42)
    "140aa0967c067ea9": 3,  # qwen2.5-0.5b: 1.00 (also at 7, 11, 15)
}


def choose_watershed(rates: list[float], tolerance: float = 0.9) -> int:
    """The earliest layer ranking the asked round first at least `tolerance` times as often as the best
    layer does (early: the layers up to the watershed keep the whole history, so it sets the memory)."""
    best = max(rates)
    return next(i for i, rate in enumerate(rates) if rate >= tolerance * best)


def auto_watershed(model: nn.Module) -> int:
    """The measured watershed of `model` (`MEASURED_WATERSHEDS`), else a quarter of its depth."""
    n_layers = model_access.text_config(model).num_hidden_layers
    return MEASURED_WATERSHEDS.get(config_hash(model), n_layers // 4)


@dataclass
class _Turn:
    """What the session tells the press about the turn being answered."""

    cache: object
    rounds: list[tuple[int, int]]  # finished rounds, [start, end) positions, oldest first
    store: RoundStore | None
    queries: tuple[int, int]  # the user's text among the turn's first new tokens
    selected: bool = False


@dataclass
class RoundPolicy(PlainNumbers):
    """Keep the system prompt, the recent rounds and the top-k relevant past rounds (see module docstring).

    `compression_ratio` and `max_tokens` are refused: rounds are bounded by `top_k_rounds` and
    `keep_recent_rounds`, and compressed by `inner`."""

    top_k_rounds: int = 2
    keep_recent_rounds: int = 1
    watershed_layer: int | str = "auto"
    inner: BasePress | None = None
    offload: str = "cpu"
    compression_ratio: float | None = None
    max_tokens: int | None = None
    selected: list[int] = field(default_factory=list, init=False)  # rounds chosen at the last turn's selection
    relevance: list[float] = field(default_factory=list, init=False)  # their candidates' scores, oldest first

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("top_k_rounds", "keep_recent_rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        layer = self.watershed_layer
        if layer != "auto" and (isinstance(layer, bool) or not isinstance(layer, int) or layer < 0):
            raise ValueError(f"watershed_layer must be a layer index (int >= 0) or 'auto', got {layer!r}")
        if self.offload not in OFFLOAD:
            raise ValueError(f"offload must be one of {OFFLOAD}, got {self.offload!r}")
        if self.compression_ratio is not None or self.max_tokens is not None:
            raise ValueError(
                "RoundPolicy keeps whole rounds: bound it with top_k_rounds / keep_recent_rounds, and compress "
                "each round with inner=<a press> (compression_ratio and max_tokens are not its parameters)"
            )
        self._check_inner()
        self._turn: _Turn | None = None
        self._queries: dict[int, tuple[nn.Module, torch.Tensor]] = {}
        self.watershed: int | None = None

    def _check_inner(self) -> None:
        """Refuse an `inner` press that cannot compress a finished round in place (as the policy is built, and at
        each turn: a caller may set it between turns)."""
        if self.inner is None:
            return
        if not isinstance(self.inner, BasePress) or self.inner.per_head:
            kind = type(self.inner).__name__
            raise TypeError(f"inner must be a token-level press (SnapKV, H2O, ...), got {kind}")
        if self.inner.rerotate or self.inner.kv_bits is not None:
            raise ValueError("inner presses compress a round in place: rerotate=True and kv_bits are not "
                             "supported there")  # fmt: skip
        if self.inner.needs_whole_context or not self.inner.wrappable:
            raise ValueError(f"inner={type(self.inner).__name__} decides its slots in a pass or a store of its own "
                             "(it cannot score a round's slots in place): use a press that scores from keys "
                             "and queries (SnapKV, H2O, Knorm, ...)")  # fmt: skip
        if self.inner.needs_hidden:
            raise ValueError(f"inner={type(self.inner).__name__} scores tokens from their hidden states, which a "
                             "round compressed at the end of its turn no longer has: use a press that scores "
                             "from keys and queries (SnapKV, H2O, ...)")  # fmt: skip
        if self.inner.decode_slack != BasePress.decode_slack:
            raise ValueError(f"inner={type(self.inner).__name__} compresses each round once, at the end of its turn: "
                             f"decode_slack does not apply there, got {self.inner.decode_slack!r} (leave it at "
                             f"{BasePress.decode_slack})")  # fmt: skip

    def __call__(self, model: nn.Module):
        raise RuntimeError("RoundPolicy is a chat policy, not a press: use it through "
                           "kvpress.ChatSession(model, tokenizer, round_policy=RoundPolicy(...))")  # fmt: skip

    # ----- set-up ------------------------------------------------------------------------------------
    def check_model(self, model: nn.Module) -> None:
        model_access.check_reads_keys(model, "RoundPolicy")  # (it ranks rounds by the queries' attention, too)
        types = model_access.layer_types(model)
        n_layers = len(types)
        full = [i for i, kind in enumerate(types) if kind == "full_attention"]
        if self.watershed_layer == "auto":
            target = auto_watershed(model)
            self.watershed = min(full, key=lambda i: (abs(i - target), i)) if full else None
        else:
            self.watershed = self.watershed_layer
        if self.watershed not in full or self.watershed == n_layers - 1:
            raise ValueError(
                f"watershed_layer={self.watershed_layer} is not a full-attention layer of {type(model).__name__} "
                f"with layers after it (its full-attention layers: {full}, the last one excluded)"
            )
        self._check_inner()  # (set since it was built: checked each turn, as an installed press is)
        if self.inner is not None:
            self.inner.check_budget()
            self.inner.check_model(model)

    def begin_turn(self, cache, rounds: list[tuple[int, int]], store: RoundStore | None,
                   queries: tuple[int, int]) -> None:  # fmt: skip
        """Called by `ChatSession` before a turn: the cache, the finished rounds' spans, the store and
        where the user's text lies among the turn's first new tokens (its queries rank the rounds)."""
        if any(getattr(layer, "kv_bits", None) is not None for layer in cache.layers):
            raise ValueError("this chat's cache holds quantized layers (a press with kv_bits): a round policy moves "
                             "and recompresses dense slots, so it cannot continue it")  # fmt: skip
        kinds = sorted({name for layer in cache.layers if isinstance(layer, PressedLayer) for name in layer.slots})
        if self.inner is not None and set(kinds) - {"pos"}:  # (what `end_turn` cannot compress: said before the turn)
            raise ValueError(f"this chat's cache holds per-slot {[k for k in kinds if k != 'pos']} (a press's padding, "
                             f"scores or rotations): inner={type(self.inner).__name__} cannot compress a round of "
                             "it; continue it without inner=, or with the press that made it")  # fmt: skip
        _check_rounds_aligned(cache, rounds)
        self._turn = _Turn(cache, list(rounds), store if self.offload == "cpu" else None, queries)
        self._queries = {}

    def end_turn(self, span: tuple[int, int] | None) -> None:
        """Called by `ChatSession` once the turn's round `span` is finished: compress it once, store it
        (`span=None`: the turn failed, forget it)."""
        turn, self._turn = self._turn, None
        if turn is None or span is None:
            self._queries = {}
            return
        index = len(turn.rounds)
        layers = [layer for layer in turn.cache.layers if isinstance(layer, PressedLayer)]
        if self.inner is not None and any(set(layer.slots) != {"pos"} for layer in layers):
            kinds = sorted({name for layer in layers for name in layer.slots})
            raise RuntimeError(f"cannot compress a round of layers holding per-slot {kinds} (padding or scores)")
        for layer_idx, layer in enumerate(turn.cache.layers):
            if not isinstance(layer, PressedLayer):
                continue
            if self.inner is not None and layer_idx in self._queries:
                self._compress_round(layer_idx, layer, span)
            if turn.store is not None and layer_idx > self.watershed:
                turn.store.put(layer_idx, index, layer.copy_slots(_in_span(layer, span)))
        self._queries = {}

    # ----- during the turn's forwards: an observer of every layer's attention --------------------------------
    def observe(self, obs: Observation) -> None:
        turn = self._turn
        if turn is None:
            raise RuntimeError("RoundPolicy needs round boundaries: use it through "
                               "kvpress.ChatSession(round_policy=...)")  # fmt: skip
        if self.inner is not None:  # the last queries of the round, for inner's scores at the end
            scorer = getattr(self.inner, "press", None) or self.inner  # a wrapper's inner press has the window
            window = getattr(scorer, "window_size", None) or 64
            previous = self._queries.get(obs.layer_idx)
            query = obs.query if previous is None else torch.cat([previous[1], obs.query], dim=2)
            self._queries[obs.layer_idx] = (obs.module, query[:, :, -window:])
        if obs.layer_idx == self.watershed and not turn.selected:
            turn.selected = True
            self._select(obs, turn)

    def _select(self, obs: Observation, turn: _Turn) -> None:
        """Rank the past rounds by the new tokens' attention at the watershed (which holds every round),
        then make each layer after it hold the prefix, the recent rounds and the top-k, before it runs."""
        self.selected, self.relevance = [], []
        candidates = list(range(max(0, len(turn.rounds) - self.keep_recent_rounds)))
        upper = {i: layer for i, layer in enumerate(turn.cache.layers)
                 if i > self.watershed and isinstance(layer, PressedLayer) and layer.n}  # fmt: skip
        if not turn.rounds or not upper:
            return
        if candidates:
            self.relevance = round_relevance(obs, [turn.rounds[r] for r in candidates], turn.queries)
            available = [r for r in candidates if all(_holds(layer, turn.rounds[r]) or (
                turn.store is not None and (i, r) in turn.store) for i, layer in upper.items())]  # fmt: skip
            self.selected = sorted(sorted(available, key=lambda r: -self.relevance[r])[: self.top_k_rounds])
        recent = range(len(candidates), len(turn.rounds))  # (recalled where a larger keep_recent_rounds asks now)
        for i, layer in upper.items():
            drop = torch.zeros(layer.n, dtype=torch.bool, device=layer.keys.device)
            for r in candidates:
                if r not in self.selected:
                    leaving = _in_span(layer, turn.rounds[r])
                    if turn.store is not None and (i, r) not in turn.store and bool(leaving.any()):
                        # finished before this policy (or this watershed, or offload="cpu") was set: stored as it
                        # leaves, so a later turn can recall it
                        turn.store.put(i, r, layer.copy_slots(leaving))
                    drop |= leaving
            if bool(drop.any()):
                layer.drop_slots(drop)
            for r in (*self.selected, *recent):
                if not _holds(layer, turn.rounds[r]) and turn.store is not None and (i, r) in turn.store:
                    layer.insert(turn.store.get(i, r))

    def _compress_round(self, layer_idx: int, layer: PressedLayer, span: tuple[int, int]) -> None:
        """Apply `inner` to the round's slots alone, as a prefill of that round, with its last queries."""
        chosen = _in_span(layer, span)
        part = layer.copy_slots(chosen)
        alone = PressedLayer()
        alone.update(part["keys"], part["values"])  # positions 0..n-1 within the round
        module, query = self._queries[layer_idx]
        query = query[:, :, -alone.n :]
        evict(self.inner, Observation(module, query, alone.keys, alone.values, alone))
        if alone.n == part["keys"].shape[2]:
            return
        kept = {"keys": alone.keys[:, :, : alone.n], "values": alone.values[:, :, : alone.n],
                "pos": part["pos"].gather(2, alone.pos.long())}  # fmt: skip
        layer.drop_slots(chosen)
        layer.insert(kept)


def _check_rounds_aligned(cache, rounds: list[tuple[int, int]]) -> None:
    """Refuse a cache whose KV heads hold a round in different slots: the policy finds, drops and compresses a
    round by the slots that hold it in the first head, for every head. A press that compressed the history head by
    head (SnapKV at each turn's prefill) leaves such a cache; `inner` keeps each round's slots in line."""
    if not rounds:
        return
    bounds = sorted({p for span in rounds for p in span})
    for idx, layer in enumerate(cache.layers):
        if not isinstance(layer, PressedLayer) or not layer.n:
            continue
        part = torch.bucketize(layer.pos[..., : layer.n].long(), torch.tensor(bounds, device=layer.pos.device),
                               right=True)  # fmt: skip
        if bool((part != part[:1, :1]).any()):
            raise ValueError(f"layer {idx} of this chat's cache holds its rounds in different slots in different KV "
                             "heads (a press compressed the history head by head): a round policy moves whole "
                             "rounds, so it cannot continue it; keep the press, or start the chat with the policy "
                             "(inner= compresses each round)")  # fmt: skip


def _in_span(layer: PressedLayer, span: tuple[int, int]) -> torch.Tensor:
    pos = layer.pos[0, 0]
    return (pos >= span[0]) & (pos < span[1])


def _holds(layer: PressedLayer, span: tuple[int, int]) -> bool:
    return bool(_in_span(layer, span).any())


def round_relevance(obs: Observation, spans: list[tuple[int, int]], queries: tuple[int, int]) -> list[float]:
    """Round-level attention of the user's text: for each query head, the attention of the new tokens
    `queries` (start, stop), averaged over them, summed over each span's slots; the max over heads.
    (Measured on chats: the user's text and the max over heads find the asked round; the template's
    headers and the mean over heads lean to recent rounds.)"""
    n_old = obs.keys.shape[2] - obs.q_len
    start, stop = max(0, min(queries[0], obs.q_len - 1)), max(1, min(queries[1], obs.q_len))
    probs = obs.attention_probs(start, stop)[0, ..., :n_old].mean(dim=2).flatten(0, 1)  # [heads, n_old]
    pos = obs.layer.pos[0, 0, :n_old]
    return [float(probs[:, (pos >= first) & (pos < end)].sum(-1).max()) for first, end in spans]


RoundPress = RoundPolicy  # its former name
