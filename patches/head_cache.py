"""A cache layer whose KV heads hold different numbers of tokens, packed into one tensor per kind of state.

`HeadwiseLayer` is what head-specific presses (AdaKV, DuoAttention) turn a `PressedLayer` into: every
(row, KV head) pair `i = row * kv_heads + head` owns a segment `bounds[i]:bounds[i + 1]` of the layer's packed
storage, of which its first `lengths[i]` slots hold its tokens, in position order. A layer's bytes are
proportional to the tokens kept per head: nothing is padded to the largest head, nothing is masked.
Decoding appends to every head into the spare room of its segment; when a segment is full, the layer is
repacked with room for every head (`max(8, n // 32)` slots, ~3%); an eviction frees slots in place, and a
layer whose spare room grew past twice that is packed tight again (`compact`). One tensor per kind of state
lets a commit append to every head in one indexed copy, and an eviction reuse the storage it frees.
A sliding-window layer (`window`) keeps per head only the real tokens of the last `window - 1` positions,
as its `PressedLayer` did (`trim_window`): the slots leaving are a prefix of each head's, so the head's segment
starts after them instead of its slots moving (the pair before it gains them as room).

Storage, all of it counted by `cache_bytes`: `store["keys"]` `[slots, head_dim]`, `store["values"]`, and
per-slot state under other names (`"pos"`: int32 token positions among the row's real tokens; press state
such as H2O's accumulated attention). Spare slots hold finite values (zeros, or tokens evicted in place).

Quantized (`kv_bits`, from a quantized `PressedLayer` or by `quantize`): `store["keys"]` / `store["values"]`
hold `uint8` codes, one row per slot (`kvpress.patches.kv_quantization`), normalised by the key channels'
`key_stats` `[batch, kv_heads, 2, head_dim]`; `pair()` decodes them (the forward's own tokens exact until a
press evicts in the layer).

Attention over it needs the kvpress intercept (`patches/headwise_attention.py`), so such a cache can
only be continued inside `with press(model):` with a head-wise press; elsewhere `update` refuses.
"""

from __future__ import annotations

from itertools import accumulate

import torch
from transformers.cache_utils import DynamicLayer

from kvpress.patches import kv_quantization as quant
from kvpress.patches.cache import PressedLayer


class HeadwiseLayer(DynamicLayer):
    """Per-(row, KV head) variable-length segments of packed storage; see the module docstring."""

    is_croppable = False  # evicted tokens are gone: transformers' rollback paths must not pick crop()
    kv_bits: int | None = None  # class defaults: a layer saved before quantization existed loads as dense
    key_stats: torch.Tensor | None = None
    _fresh: tuple[torch.Tensor, torch.Tensor] | None = None
    _appended: torch.Tensor | None = None
    _ends: torch.Tensor | None = None
    _starts: torch.Tensor | None = None
    padded: bool | None = None  # a layer saved before this flag existed: not known (its span is read)
    _seen_rows: list[int] | None = None
    rewrites = 0  # times held slots were evicted or rewritten in place (see `PressedLayer.rewrites`)
    in_inference = False  # a forward under torch.inference_mode() made or wrote its tensors (`leave_inference`)

    UNDECIDED = -2  # a head budget its press decides later (a new prompt, or a context too short yet): keeps all

    def __init__(self, batch: int, heads: int, like: torch.Tensor) -> None:
        super().__init__()
        self.batch, self.heads = batch, heads
        empty = like.new_empty(batch, heads, 0, like.shape[-1])
        self.keys, self.values = empty, empty  # placeholders: dtype/device/head_dim for transformers' helpers
        self.device, self.dtype, self.is_initialized = like.device, like.dtype, True
        self.store: dict[str, torch.Tensor] = {}
        self.bounds: list[int] = [0] * (batch * heads + 1)
        self.lengths: list[int] = [0] * (batch * heads)
        self.seen = 0
        self.real_seen = torch.zeros(batch, dtype=torch.long)
        self.padded: bool | None = False  # some row has seen padding (its first forward's): rows differ in span
        self._seen_rows: list[int] | None = None  # `real_seen` on the host where rows differ (read once, then kept)
        self.pending: int = 0
        self.torn = False  # a forward that raised left this cache's layers at different points
        self._new: tuple[torch.Tensor, torch.Tensor] | None = None
        self.driven = False
        self.made_by = ""  # the class name of the press that made this layer (only it can continue it)
        # [B, H] on the host: per-head budgets of a press (-1: none; `UNDECIDED`: decided at its next eviction)
        self.head_budget: torch.Tensor | None = None
        self.window: int | None = None  # a sliding-window layer's window
        self.kv_bits: int | None = None  # keys and values stored as codes of this width (`quantize`)
        self.key_stats: torch.Tensor | None = None
        self._fresh: tuple[torch.Tensor, torch.Tensor] | None = None  # the last commit's tokens, exact
        # [B, H, q] where this forward's commit put its slots: until `keep` moves slots or the forward ends (`settle`)
        self._appended: torch.Tensor | None = None
        self._ends: torch.Tensor | None = None  # [B * H] on the device: where each pair appends next (`_where`)
        self._starts: torch.Tensor | None = None  # `bounds` on the device, int32 (`segments`)

    @property
    def is_sliding(self) -> bool:
        return self.window is not None

    @property
    def span(self) -> torch.Tensor:
        """`[B]` real tokens each row would hold with no press (see `PressedLayer.span`)."""
        return self.real_seen if self.window is None else self.real_seen.clamp(max=self.window - 1)

    def seen_list(self) -> list[int]:
        """`real_seen` as host integers (see `PressedLayer.seen_list`): for padded rows (or a layer saved before
        `padded` was recorded) read from the device once, then kept up to date by each commit."""
        if self.padded is False:
            return [self.seen] * self.batch
        if self._seen_rows is None:
            self._seen_rows = self.real_seen.tolist()
        return list(self._seen_rows)

    def span_list(self) -> list[int]:
        """`span` as host integers (see `seen_list`)."""
        return [n if self.window is None else min(n, self.window - 1) for n in self.seen_list()]

    # ----- construction -------------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, layer: PressedLayer, keep: torch.Tensor) -> HeadwiseLayer:
        """The slots of `layer` marked by `keep` `[B, H, n]` (padding must be unmarked), per head in
        position order, packed tight."""
        if layer.key_channels is not None:
            raise ValueError("a layer whose keys keep only some channels (ThinK) cannot move to per-head storage")
        b, h, n = *layer.keys.shape[:2], layer.n
        like = layer.keys if layer.kv_bits is None else layer.key_stats.to(layer.dtype)  # dtype and head size
        new = cls(b, h, like)
        new.kv_bits, new.key_stats = layer.kv_bits, layer.key_stats
        order = layer.position_order()
        keep = keep.gather(-1, order)
        pairs = torch.arange(b * h, device=order.device).view(b, h, 1)
        index = (order + pairs * n)[keep]  # pair by pair, each in position order
        names = [name for name in layer.slots if name not in ("valid", "rot")]
        held = {"keys": layer.keys, "values": layer.values, **{name: layer.slots[name] for name in names}}
        new.store = {name: t[:, :, :n].reshape(b * h * n, *t.shape[3:]).index_select(0, index)
                     for name, t in held.items()}  # fmt: skip
        new.lengths = keep.sum(-1).flatten().tolist()
        new.bounds = _bounds(new.lengths)
        new.seen = layer.seen
        new.real_seen = layer.real_seen.clone()
        new.padded = layer.padded
        new._seen_rows = None if layer._seen_rows is None else list(layer._seen_rows)
        new.window = layer.window
        return new

    # ----- the transformers layer API -----------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Hold the new keys/values until the intercept commits them to every head."""
        if torch.is_inference_mode_enabled():  # (copied as the next forward outside it begins: `intercept`)
            self.in_inference = True
        if not self.driven and not (self.seen or self.pending):
            raise RuntimeError(
                "this cache's head-wise layers were emptied (reset): it takes its next prompt inside `with "
                "press(model):` (any press); without a press, use a new DynamicCache"
            )
        if not self.driven:
            raise RuntimeError(
                "this cache holds head-wise compressed layers (AdaKV / DuoAttention): continue it inside "
                "`with press(model):` with a head-wise press, which computes attention over them"
            )
        if self.pending or self.torn:
            raise RuntimeError(
                "this cache was left half-updated by a forward that raised (or by `scratch`, which cannot undo an "
                "eviction inside); it cannot be continued (start a new cache)"
            )
        self._new = (key_states, value_states)
        self.pending = key_states.shape[-2]
        self.seen += self.pending
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0  # never used: the intercept computes this layer's attention itself

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:  # (0 removes nothing: transformers calls crop(0) as a no-op)
            raise NotImplementedError("a head-wise compressed cache cannot be cropped: its evicted tokens are gone")

    def reset(self) -> None:
        """Empty every head and free the storage. The next forward under a press replaces the emptied layer with a
        fresh dense one (`intercept`), so the new prompt may have another batch size, padding or press."""
        self.store = {}
        self.bounds = [0] * (len(self.lengths) + 1)
        self.lengths = [0] * len(self.lengths)
        self.seen, self.pending, self._new, self.torn, self._fresh, self._ends = 0, 0, None, False, None, None
        self._starts = None
        self.padded, self._seen_rows = False, None
        self.kv_bits, self.key_stats = None, None  # dense again until a press quantizes the next prompt
        if self.head_budget is not None:  # the press decides the next prompt's budgets (DuoAttention: by its length)
            self.head_budget = torch.full_like(self.head_budget, self.UNDECIDED)
        self.real_seen = torch.zeros(self.batch, dtype=torch.long, device=self.device)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows([int(i) for i in beam_idx])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([row for row in range(self.batch) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        indices = indices.cpu() if isinstance(indices, torch.Tensor) else indices
        self._select_rows([int(i) for i in torch.arange(self.batch)[indices]])

    def offload(self) -> None:
        self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        self._map(lambda t: t.to(self.device, non_blocking=True))

    # ----- what the intercept and the presses use -------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer keeps (for `cache_bytes`)."""
        out = [*self.store.values(), self.real_seen]
        return out + [t for t in (self.head_budget, self.key_stats, self._starts, self._ends) if t is not None]

    @property
    def value_dim(self) -> int | None:
        """The size of one head's values (None while the layer has no storage)."""
        if "values" not in self.store:
            return None
        width = self.store["values"].shape[-1]
        return width if self.kv_bits is None else quant.head_size(width, self.kv_bits)

    def pair(self, row: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The held keys and values `[n, D]` of one (row, KV head), dense."""
        keys, values = self.slot("keys", row, head), self.slot("values", row, head)
        if self.kv_bits is None:
            return keys, values
        q = 0 if self._fresh is None else self._fresh[0].shape[2]
        n = keys.shape[0]
        keys = quant.decode(keys[: n - q], self.key_stats[row, head], self.kv_bits, self.dtype)
        values = quant.decode(values[: n - q], None, self.kv_bits, self.dtype)
        if q:
            keys = torch.cat([keys, self._fresh[0][row, head]])
            values = torch.cat([values, self._fresh[1][row, head]])
        return keys, values

    def quantize(self, bits: int) -> None:
        """Store every pair's slots, and those appended from now on, as `bits`-bit codes (each pair's channel
        ranges fitted to the slots it holds now); see `PressedLayer.quantize`."""
        if quant.already_at(self.kv_bits, bits):
            return
        quant.check_bits(bits, self.keys.shape[-1])
        pairs = [self.pair(row, head) for row in range(self.batch) for head in range(self.heads)]
        stats = [quant.fit(k) for k, _ in pairs]
        self._repack(self.lengths)  # tight: the codes below fill it in order
        self.key_stats = torch.stack(stats).view(self.batch, self.heads, 2, -1)
        self.store["keys"] = torch.cat([quant.encode(k, ks, bits) for (k, _), ks in zip(pairs, stats, strict=True)])
        self.store["values"] = torch.cat([quant.encode(v, None, bits) for _, v in pairs])
        self.kv_bits, self._fresh = bits, None
        self.rewrites += 1

    def slot(self, name: str, row: int, head: int) -> torch.Tensor:
        """The held part of `store[name]` of one (row, KV head): a view of the storage."""
        i = row * self.heads + head
        return self.store[name][self.bounds[i] : self.bounds[i] + self.lengths[i]]

    def state(self, name: str) -> torch.Tensor:
        """`store[name]`, the per-slot state of a press over every (row, KV head) at once, created as fp32 zeros
        on first use (`slot(name, row, head)` is one pair's part of it)."""
        if name not in self.store:
            self.store[name] = torch.zeros(self.bounds[-1], dtype=torch.float32, device=self.device)
        return self.store[name]

    def newest(self, q: int) -> torch.Tensor:
        """`[B, H, q]` where the `q` newest held slots of each (row, KV head) are in the packed storage (every pair
        holds at least `q`: the tokens a forward appended to all of them)."""
        if self._appended is not None and self._appended.shape[-1] == q:
            return self._appended
        if min(self.lengths, default=q) < q:
            raise ValueError(f"a (row, KV head) of this layer holds fewer than the {q} slots asked for")
        return (self._where()[:, None] - q + torch.arange(q, device=self.device)).view(self.batch, self.heads, q)

    def held(self) -> torch.Tensor:
        """`[B, H]` tokens held per (row, KV head), on the host."""
        return torch.tensor(self.lengths, dtype=torch.long).view(self.batch, self.heads)

    def _where(self) -> torch.Tensor:
        """`[B * H]` on the device: the slot after each pair's held ones (kept between commits, so that a decoding
        step copies nothing from the host; anything that moves slots drops it)."""
        if self._ends is None or self._ends.shape[0] != len(self.lengths):
            ends = [a + n for a, n in zip(self.bounds, self.lengths, strict=False)]
            self._ends = torch.tensor(ends, dtype=torch.long).to(self.device, non_blocking=True)
        return self._ends

    def segments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """On the device, for one variable-length attention call over the packed storage: where each pair's segment
        starts, and the end of the last (`bounds`, int32 `[B * H + 1]`), and the slots each pair holds (int32
        `[B * H]`). A decoding step copies nothing from the host for them (`bounds` change when the layer is repacked,
        and when a sliding window trims it, which moves them on the device too)."""
        starts = self._device_bounds()
        return starts, (self._where() - starts[:-1]).to(torch.int32)

    def _device_bounds(self) -> torch.Tensor:
        """`bounds` on the device, int32 (copied in once; `trim_window` moves them there too)."""
        if self._starts is None:
            self._starts = torch.tensor(self.bounds, dtype=torch.int32).to(self.device, non_blocking=True)
        return self._starts

    def commit(self) -> None:
        """Append the pending keys/values (all real tokens) to every head."""
        keys, values = self._new
        q = self.pending
        self._new, self.pending = None, 0
        self._fresh = None
        if self.kv_bits is not None:  # stored as codes; attended exact (`pair`) until a press evicts here
            self._fresh = (keys, values)
            if self.key_stats is None:  # the first tokens after `reset`
                self.key_stats = quant.fit(keys)
            keys = quant.encode(keys, self.key_stats, self.kv_bits)
            values = quant.encode(values, None, self.kv_bits)
        if "keys" not in self.store:  # the first tokens after `reset` of a layer never filled
            self.store = {"keys": keys.new_empty(0, keys.shape[-1]), "values": values.new_empty(0, values.shape[-1]),
                          "pos": torch.zeros(0, dtype=torch.int32, device=keys.device)}  # fmt: skip
        if any(b - a - n < q for a, b, n in zip(self.bounds, self.bounds[1:], self.lengths, strict=False)):
            self._repack([n + q + max(8, n // 32) for n in self.lengths])  # decoding reserves a little room (~3%)
        where = self._where()
        self._ends = where + q
        pos = self.real_seen.to(self.device, torch.int32)
        if q == 1:  # a decoding step: one slot a pair (the fewest ops: this runs every step in every layer)
            pos = pos.repeat_interleave(self.heads)
        else:
            where = (where[:, None] + torch.arange(q, device=self.device)).flatten()
            pos = pos[:, None, None] + torch.arange(q, dtype=torch.int32, device=self.device)
            pos = pos.expand(-1, self.heads, -1)
        self.real_seen = self.real_seen + q
        self._seen_rows = None if self._seen_rows is None else [n + q for n in self._seen_rows]
        for name, t in self.store.items():
            if name in ("keys", "values"):
                t.index_copy_(0, where, (keys if name == "keys" else values).reshape(where.shape[0], -1))
            elif name == "pos":
                t.index_copy_(0, where, pos.flatten())
            else:
                t.index_fill_(0, where, 0)
        self.lengths = [n + q for n in self.lengths]
        self._appended = where.view(self.batch, self.heads, q)

    def settle(self) -> None:
        """The forward is over: its tokens are read from their codes from now on (and the next commit appends)."""
        self._fresh = self._appended = None

    def keep(self, row: int, head: int, index: torch.Tensor) -> None:
        """Keep the slots `index` (sorted) of one (row, KV head), moved to the front of its segment (the slots
        freed stay spare room until `compact`)."""
        i = row * self.heads + head
        self._fresh = self._appended = None  # which of the held slots are this forward's is no longer known
        start, k = self.bounds[i], int(index.numel())
        for name, t in self.store.items():
            t[start : start + k] = self.slot(name, row, head).index_select(0, index)
        self.lengths[i] = k
        self.rewrites += 1
        self._ends = None

    def keep_marked(self, row: int, keep: torch.Tensor) -> None:
        """Keep, for every KV head of `row`, the held slots `keep` `[heads, n]` marks (head h's j-th held slot: `keep[h,
        j]`; marks past what a head holds are refused), in order at the front of its segment: `keep` for all of the
        row's heads at once (AdaKV's eviction while decoding). Only the kept slots behind a head's first evicted one
        move (one indexed copy per kind of state): a decoding step that evicts a few slots moves few."""
        h, first = self.heads, row * self.heads
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.batch:
            raise ValueError(f"row must be one of this layer's rows, 0 to {self.batch - 1}, got {row!r}")
        if keep.dtype != torch.bool or keep.dim() != 2 or keep.shape[0] != h:
            raise ValueError(f"keep must be a bool [heads={h}, n] mask, got {keep.dtype} {tuple(keep.shape)}")
        held, keep = self.lengths[first : first + h], keep.to(self.device)
        within = torch.arange(keep.shape[1], device=keep.device) < torch.tensor(held, device=keep.device)[:, None]
        if bool((keep & ~within).any()):
            raise ValueError(f"keep marks slots past what the heads of row {row} hold ({held})")
        dropped = within & ~keep
        shift = dropped.cumsum(-1)  # how many slots before and at each one leave: how far it moves up
        head, slot = (keep & (shift > 0)).nonzero(as_tuple=True)
        counts = keep.sum(-1).tolist()  # (a head's slots past the mask's width are not kept)
        self._fresh = self._appended = None
        if head.numel():
            source = torch.tensor(self.bounds[first : first + h], device=keep.device)[head] + slot
            self._move(source, source - shift[head, slot])
        self.lengths[first : first + h] = counts
        self.rewrites += 1
        self._ends = None

    def keep_ends(self, pairs: list[int], first: int, last: int) -> None:
        """Keep the first `first` and the last `last` held slots of each pair in `pairs` (`row * heads + head`, each
        holding more than `first + last`), the last moved up behind the first: `keep` for all of them at once
        (DuoAttention's streaming heads, at every decoding step). Up to two pairs copy slot ranges (two tensor calls
        per pair and kind of state); more build one index and copy once per kind of state."""
        short = [i for i in pairs if self.lengths[i] <= first + last]
        if short or first < 0 or last < 0:
            raise ValueError(f"keep_ends keeps the first {first} and last {last} of pairs holding more than both "
                             f"together (first, last >= 0): pairs {short} hold {[self.lengths[i] for i in short]}")
        if not pairs:
            return
        self._fresh = self._appended = None
        if len(pairs) <= 2:
            for i in pairs:
                to, at = self.bounds[i] + first, self.bounds[i] + self.lengths[i] - last
                for t in self.store.values():
                    t[to : to + last] = t[at : at + last].clone()  # the ranges overlap when few slots were added
        else:
            starts = torch.tensor([[self.bounds[i] + first, self.bounds[i] + self.lengths[i] - last] for i in pairs])
            starts = starts.to(self.device, non_blocking=True)  # per pair: where its last slots go, where they are
            index = (starts.T[:, :, None] + torch.arange(last, device=self.device)).reshape(2, -1)
            self._move(index[1], index[0])
        for i in pairs:
            self.lengths[i] = first + last
        self.rewrites += 1
        self._ends = None

    def compact(self) -> None:
        """Pack the layer tight when evictions left more spare room than twice what decoding reserves."""
        spare = self.bounds[-1] - sum(self.lengths)
        if spare > 2 * sum(max(8, n // 32) for n in self.lengths) + len(self.lengths):
            self._repack(self.lengths)

    def trim_window(self) -> None:
        """A sliding-window layer drops, per head, the slots older than the last `window - 1` real tokens: a prefix of
        each pair's slots (they are in position order), counted for the whole layer with one read from the device.
        Nothing is copied: the pair's segment starts after the slots it dropped, which become spare room of the pair
        before it (the first pair's, room no pair owns until the layer is repacked: `compact` counts it)."""
        if self.window is None or self.seen < self.window or not max(self.lengths):  # every token is in the window
            return
        offsets = torch.arange(max(self.lengths), device=self.device)
        # each pair's first slots; past its held ones its newest again (this forward's: inside the window)
        index = torch.minimum(self._device_bounds()[:-1, None] + offsets, self._where()[:, None] - 1)
        pos = self.store["pos"].index_select(0, index.view(-1)).view(index.shape)
        lows = [n - (self.window - 1) for n in self.seen_list()]  # per row (a left-padded batch's rows differ)
        low = lows[0] if len(set(lows)) == 1 else (
            torch.tensor(lows).repeat_interleave(self.heads)[:, None].to(self.device, non_blocking=True))
        counts = (pos < low).sum(-1)
        drops = counts.tolist()
        if not any(drops):
            return
        self._fresh = self._appended = None  # (a chunk longer than the window drops some of its own tokens)
        for i, d in enumerate(drops):
            self.bounds[i] += d
            self.lengths[i] -= d
        self._starts[:-1] += counts  # (on the device: `segments` copies nothing in for the next forward)

    def view(self, row: int, head: int) -> PressedLayer:
        """One (row, KV head) as a one-head `PressedLayer` sharing this layer's storage, so an ordinary
        press can score it; state it creates (`slot(name)`) is taken back by `absorb`."""
        v = PressedLayer(self.window)
        keys, values = self.pair(row, head)
        v.keys, v.values = keys[None, None], values[None, None]
        v.device, v.is_initialized, v.driven = keys.device, True, True
        v.n, v.seen = keys.shape[0], self.seen_list()[row]
        names = [name for name in self.store if name not in ("keys", "values")]
        v.slots = {name: self.slot(name, row, head)[None, None] for name in names}
        v.real_seen = self.real_seen[row : row + 1].to(keys.device)
        v.shift = v.real_seen - v.n
        return v

    def rewind_point(self) -> dict:
        """What `rewind` needs to drop every slot appended from now on by forwards that evict nothing (a press's own
        pass, inside `scratch`): each pair's held slots stay the first of its segment, so its count is enough."""
        return {"lengths": list(self.lengths), "seen": self.seen, "real_seen": self.real_seen.clone(),
                "seen_rows": None if self._seen_rows is None else list(self._seen_rows),
                "pending": self.pending, "torn": self.torn, "rewrites": self.rewrites}  # fmt: skip

    def rewind(self, point: dict) -> None:
        """Drop the slots appended since `rewind_point` gave `point` (the room they took is packed away)."""
        self.lengths, self.seen, self.real_seen = list(point["lengths"]), point["seen"], point["real_seen"]
        self._seen_rows = point.get("seen_rows")
        self.pending, self.torn = point["pending"], point["torn"]
        self._new = self._fresh = self._appended = self._ends = None
        self.compact()

    def as_dense(self) -> PressedLayer:
        """The whole layer as a dense `PressedLayer` (a copy): each (row, KV head) left-padded to the longest, the
        padding marked invalid (position 0), so every pair's newest slots are the last ones, as in a dense layer:
        what an observer reads (a press's own pass over a head-wise cache, KVzip's)."""
        n = max(self.lengths)
        pairs = [self.pair(row, head) for row in range(self.batch) for head in range(self.heads)]
        keys = pairs[0][0].new_zeros(self.batch, self.heads, n, pairs[0][0].shape[-1])
        values = pairs[0][1].new_zeros(self.batch, self.heads, n, pairs[0][1].shape[-1])
        pos = torch.zeros(self.batch, self.heads, n, dtype=torch.int32, device=self.device)
        valid = torch.zeros(self.batch, self.heads, n, dtype=torch.bool, device=self.device)
        for i, (k, v) in enumerate(pairs):
            row, head = divmod(i, self.heads)
            m = k.shape[0]
            keys[row, head, n - m :], values[row, head, n - m :] = k, v
            pos[row, head, n - m :] = self.slot("pos", row, head)
            valid[row, head, n - m :] = True
        dense = PressedLayer(self.window)
        dense.keys, dense.values, dense.n, dense.seen = keys, values, n, self.seen
        dense.device, dense.is_initialized, dense.driven = keys.device, True, True
        dense.slots = {"pos": pos, "valid": valid}
        dense.padded = True  # its rows hold padding: no row holds `n` real tokens of each head
        dense.real_seen = self.real_seen.to(keys.device)
        dense.shift = dense.real_seen - n
        return dense

    def absorb(self, row: int, head: int, view: PressedLayer) -> None:
        """Take back per-slot state a press created (or replaced) on `view(row, head)`."""
        for name, t in view.slots.items():
            if name not in self.store:
                self.store[name] = t.new_zeros(self.bounds[-1], *t.shape[3:])
            held = self.slot(name, row, head)
            if held.data_ptr() != t.data_ptr():
                held.copy_(t[0, 0])

    # ----- helpers ----------------------------------------------------------------------------------------
    def _repack(self, sizes: list[int]) -> None:
        """Give pair `i` a segment of `sizes[i]` slots (at least its held ones), its held slots first."""
        held = torch.tensor(self.lengths)  # the indices are built on the host and sent once (nothing read back)
        bounds = _bounds(sizes)
        offset = torch.arange(sum(self.lengths)) - torch.tensor(_bounds(self.lengths)[:-1]).repeat_interleave(held)
        source = torch.tensor(self.bounds[:-1]).repeat_interleave(held) + offset
        target = torch.tensor(bounds[:-1]).repeat_interleave(held) + offset
        source, target = (t.to(self.device, non_blocking=True) for t in (source, target))
        self.store = {name: t.new_zeros(bounds[-1], *t.shape[1:]).index_copy_(0, target, t.index_select(0, source))
                      for name, t in self.store.items()}  # fmt: skip
        self.bounds, self._ends, self._starts = bounds, None, None

    def _move(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy slots `source` to slots `target` in every kind of state (each source read before any is written)."""
        for t in self.store.values():
            t.index_copy_(0, target, t.index_select(0, source))

    def _select_rows(self, rows: list[int]) -> None:
        pairs = [r * self.heads + h for r in rows for h in range(self.heads)]
        index = torch.cat([torch.arange(self.bounds[i], self.bounds[i] + self.lengths[i]) for i in pairs])
        index = index.to(self.device, non_blocking=True)
        self.store = {name: t.index_select(0, index) for name, t in self.store.items()}
        self.lengths = [self.lengths[i] for i in pairs]
        self.bounds, self._ends, self._starts = _bounds(self.lengths), None, None
        self.real_seen = self.real_seen[rows]
        self._seen_rows = None if self._seen_rows is None else [self._seen_rows[r] for r in rows]
        for name in ("head_budget", "key_stats"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[rows])
        self.batch = len(rows)
        self.rewrites += 1  # rows reordered, repeated or selected (beam search)
        self.keys = self.keys.new_empty(self.batch, self.heads, 0, self.keys.shape[-1])
        self.values = self.keys

    def _map(self, fn) -> None:
        self.store = {name: fn(t) for name, t in self.store.items()}
        if self.kv_bits is not None:
            self.key_stats = fn(self.key_stats)


def _bounds(sizes: list[int]) -> list[int]:
    """`[0, sizes[0], sizes[0] + sizes[1], ...]`: where each segment of those sizes starts, and the total."""
    return list(accumulate(sizes, initial=0))
