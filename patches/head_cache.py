"""A cache layer whose KV heads hold different numbers of tokens, each in storage of its own size.

`HeadwiseLayer` is what head-specific presses (AdaKV, DuoAttention) turn a `PressedLayer` into: every
(row, KV head) pair owns its own key and value tensors `[capacity, head_dim]`, so a layer's bytes are
proportional to the tokens kept per head: nothing is padded to the largest head, nothing is masked.
Decoding appends to every head (in place while a head has spare capacity, which only decoding adds).
A sliding-window layer (`window`) keeps per head only the real tokens of the last `window - 1` positions,
as its `PressedLayer` did (`trim_window`).

Storage, all of it counted by `cache_bytes`: per pair `i = row * kv_heads + head`, `keys_h[i]` and
`values_h[i]`, and per-slot tensors `slots_h[name][i]` (`"pos"`: int32 token positions among the
row's real tokens; press state such as H2O's accumulated attention). Slots stay in position order.

Quantized (`kv_bits`, from a quantized `PressedLayer` or by `quantize`): each pair's `keys_h[i]` /
`values_h[i]` hold `uint8` codes, one row per slot (`kvpress.patches.kv_quantization`), normalised by
the key channels' `key_stats` `[batch, kv_heads, 2, head_dim]`; `pair()` decodes them (the forward's own
tokens exact until a press evicts in the layer).

Attention over it needs the kvpress intercept (`patches/headwise_attention.py`), so such a cache can
only be continued inside `with press(model):` with a head-wise press; elsewhere `update` refuses.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from kvpress.patches import kv_quantization as quant
from kvpress.patches.cache import PressedLayer


class HeadwiseLayer(DynamicLayer):
    """Per-(row, KV head) variable-length storage; see the module docstring."""

    is_croppable = False  # evicted tokens are gone: transformers' rollback paths must not pick crop()
    kv_bits: int | None = None  # class defaults: a layer saved before quantization existed loads as dense
    key_stats: torch.Tensor | None = None
    _fresh: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, batch: int, heads: int, like: torch.Tensor) -> None:
        super().__init__()
        self.batch, self.heads = batch, heads
        empty = like.new_empty(batch, heads, 0, like.shape[-1])
        self.keys, self.values = empty, empty  # placeholders: dtype/device/head_dim for transformers' helpers
        self.device, self.dtype, self.is_initialized = like.device, like.dtype, True
        self.keys_h: list[torch.Tensor] = []
        self.values_h: list[torch.Tensor] = []
        self.slots_h: dict[str, list[torch.Tensor]] = {}
        self.lengths: list[int] = []
        self.seen = 0
        self.real_seen = torch.zeros(batch, dtype=torch.long)
        self.pending: int = 0
        self.torn = False  # a forward that raised left this cache's layers at different points
        self._new: tuple[torch.Tensor, torch.Tensor] | None = None
        self.driven = False
        self.made_by = ""  # the class name of the press that made this layer (only it can continue it)
        self.head_budget: torch.Tensor | None = None  # [B, H] per-head budgets a press may record (-1: none)
        self.window: int | None = None  # a sliding-window layer's window
        self.kv_bits: int | None = None  # keys and values stored as codes of this width (`quantize`)
        self.key_stats: torch.Tensor | None = None
        self._fresh: tuple[torch.Tensor, torch.Tensor] | None = None  # the last commit's tokens, exact

    @property
    def is_sliding(self) -> bool:
        return self.window is not None

    @property
    def span(self) -> torch.Tensor:
        """`[B]` real tokens each row would hold with no press (see `PressedLayer.span`)."""
        return self.real_seen if self.window is None else self.real_seen.clamp(max=self.window - 1)

    # ----- construction -------------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, layer: PressedLayer, keep: torch.Tensor) -> HeadwiseLayer:
        """The slots of `layer` marked by `keep` `[B, H, n]` (padding must be unmarked), per head in
        position order, each head in tensors of exactly its size."""
        if layer.key_channels is not None:
            raise ValueError("a layer whose keys keep only some channels (ThinK) cannot move to per-head storage")
        b, h = layer.keys.shape[:2]
        like = layer.keys if layer.kv_bits is None else layer.key_stats.to(layer.dtype)  # dtype and head size
        new = cls(b, h, like)
        new.kv_bits, new.key_stats = layer.kv_bits, layer.key_stats
        order = layer.position_order()
        keep = keep.gather(-1, order)
        names = [name for name in layer.slots if name not in ("valid", "rot")]
        for row in range(b):
            for head in range(h):
                index = order[row, head][keep[row, head]]
                new.keys_h.append(layer.keys[row, head].index_select(0, index))
                new.values_h.append(layer.values[row, head].index_select(0, index))
                for name in names:
                    new.slots_h.setdefault(name, []).append(layer.slots[name][row, head].index_select(0, index))
                new.lengths.append(int(index.numel()))
        new.seen = layer.seen
        new.real_seen = layer.real_seen.clone()
        new.window = layer.window
        return new

    # ----- the transformers layer API -----------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Hold the new keys/values until the intercept commits them to every head."""
        if not self.driven:
            raise RuntimeError(
                "this cache holds head-wise compressed layers (AdaKV / DuoAttention): continue it inside "
                "`with press(model):` with a head-wise press, which computes attention over them"
            )
        if self.pending or self.torn:
            raise RuntimeError(
                "this cache was left half-updated by a forward that raised; it cannot be continued (start a new cache)"
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
        raise NotImplementedError("a head-wise compressed cache cannot be cropped: its evicted tokens are gone")

    def reset(self) -> None:
        """Empty every head (the layer then takes a new prompt, appended to every head)."""
        width = self.keys.shape[-1] if self.kv_bits is None else quant.code_width(self.kv_bits, self.keys.shape[-1])
        empty = self.keys.new_empty(0, width, dtype=self.keys.dtype if self.kv_bits is None else torch.uint8)
        self.keys_h = [empty for _ in range(self.batch * self.heads)]
        self.values_h = list(self.keys_h)
        self.slots_h = {"pos": [torch.zeros(0, dtype=torch.int32, device=empty.device)] * len(self.keys_h)}
        self.lengths = [0] * len(self.keys_h)
        self.seen, self.pending, self._new, self.torn, self._fresh = 0, 0, None, False, None
        self.key_stats = None  # a quantized layer fits the next prompt's ranges on its first commit
        self.real_seen = torch.zeros(self.batch, dtype=torch.long, device=empty.device)

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
        out = self.keys_h + self.values_h + [t for ts in self.slots_h.values() for t in ts] + [self.real_seen]
        out += [t for t in (self.head_budget, self.key_stats) if t is not None]
        return out

    @property
    def value_dim(self) -> int | None:
        """The size of one head's values (None while no head holds any storage)."""
        if not self.values_h:
            return None
        width = self.values_h[0].shape[-1]
        return width if self.kv_bits is None else quant.head_size(width, self.kv_bits)

    def pair(self, row: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The held keys and values `[n, D]` of one (row, KV head), dense."""
        i = row * self.heads + head
        n = self.lengths[i]
        if self.kv_bits is None:
            return self.keys_h[i][:n], self.values_h[i][:n]
        q = 0 if self._fresh is None else self._fresh[0].shape[2]
        keys = quant.decode(self.keys_h[i][: n - q], self.key_stats[row, head], self.kv_bits, self.dtype)
        values = quant.decode(self.values_h[i][: n - q], None, self.kv_bits, self.dtype)
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
        self.key_stats = torch.stack(stats).view(self.batch, self.heads, 2, -1)
        self.keys_h = [quant.encode(k, ks, bits) for (k, _), ks in zip(pairs, stats, strict=True)]
        self.values_h = [quant.encode(v, None, bits) for _, v in pairs]
        self.kv_bits, self._fresh = bits, None

    def slot(self, name: str, row: int, head: int) -> torch.Tensor:
        i = row * self.heads + head
        return self.slots_h[name][i][: self.lengths[i]]

    def held(self) -> torch.Tensor:
        """`[B, H]` tokens held per (row, KV head)."""
        return torch.tensor(self.lengths, dtype=torch.long, device=self.real_seen.device).view(self.batch, self.heads)

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
        pos = (self.real_seen[:, None] + torch.arange(q, device=self.real_seen.device)).to(torch.int32)
        self.real_seen = self.real_seen + q
        fresh = {name: ts[0].new_zeros(q, *ts[0].shape[1:]) for name, ts in self.slots_h.items() if name != "pos"}
        pos = pos.to(self.device)
        for row in range(self.batch):
            fresh["pos"] = pos[row]
            for head in range(self.heads):
                i = row * self.heads + head
                n = self.lengths[i]
                self.keys_h[i] = self._append(self.keys_h[i], n, keys[row, head])
                self.values_h[i] = self._append(self.values_h[i], n, values[row, head])
                for name, ts in self.slots_h.items():
                    ts[i] = self._append(ts[i], n, fresh[name])
                self.lengths[i] = n + q

    def settle(self) -> None:
        """The forward is over: its tokens are read from their codes from now on."""
        self._fresh = None

    def keep(self, row: int, head: int, index: torch.Tensor) -> None:
        """Keep the slots `index` (sorted) of one (row, KV head), in tensors of exactly that size."""
        i = row * self.heads + head
        n = self.lengths[i]
        self._fresh = None  # which of the held slots are this forward's is no longer known
        self.keys_h[i] = self.keys_h[i][:n].index_select(0, index)
        self.values_h[i] = self.values_h[i][:n].index_select(0, index)
        for ts in self.slots_h.values():
            ts[i] = ts[i][:n].index_select(0, index)
        self.lengths[i] = int(index.numel())

    def trim_window(self) -> None:
        """A sliding-window layer drops, per head, the slots older than the last `window - 1` real tokens."""
        if self.window is None or self.seen < self.window:  # every token seen is in the window
            return
        low = (self.real_seen - (self.window - 1)).tolist()
        for i, n in enumerate(self.lengths):
            pos = self.slots_h["pos"][i][:n]
            if n and int(pos[0]) < low[i // self.heads]:  # slots are in position order
                self.keep(i // self.heads, i % self.heads, (pos >= low[i // self.heads]).nonzero().squeeze(-1))

    def view(self, row: int, head: int) -> PressedLayer:
        """One (row, KV head) as a one-head `PressedLayer` sharing this layer's storage, so an ordinary
        press can score it; state it creates (`slot(name)`) is taken back by `absorb`."""
        v = PressedLayer(self.window)
        keys, values = self.pair(row, head)
        v.keys, v.values = keys[None, None], values[None, None]
        v.device, v.is_initialized, v.driven = keys.device, True, True
        v.n, v.seen = keys.shape[0], int(self.real_seen[row])
        v.slots = {name: self.slot(name, row, head)[None, None] for name in self.slots_h}
        v.real_seen = self.real_seen[row : row + 1].to(keys.device)
        v.shift = v.real_seen - v.n
        return v

    def absorb(self, row: int, head: int, view: PressedLayer) -> None:
        """Take back per-slot state a press created on `view(row, head)`."""
        for name, t in view.slots.items():
            if name not in self.slots_h:
                zeros = [torch.zeros(n, dtype=t.dtype, device=t.device) for n in self.lengths]
                self.slots_h[name] = zeros
                self.slots_h[name][row * self.heads + head] = t[0, 0].clone()

    # ----- helpers ----------------------------------------------------------------------------------------
    @staticmethod
    def _append(t: torch.Tensor, n: int, new: torch.Tensor) -> torch.Tensor:
        q = new.shape[0]
        if n + q <= t.shape[0]:
            t[n : n + q] = new
            return t
        grown = t.new_empty(n + q + max(8, n // 32), *t.shape[1:])  # decoding reserves a little room (~3%)
        grown[:n] = t[:n]
        grown[n : n + q] = new
        return grown

    def _select_rows(self, rows: list[int]) -> None:
        def pick(ts: list[torch.Tensor]) -> list[torch.Tensor]:
            return [ts[r * self.heads + h].clone() for r in rows for h in range(self.heads)]

        self.keys_h, self.values_h = pick(self.keys_h), pick(self.values_h)
        self.slots_h = {name: pick(ts) for name, ts in self.slots_h.items()}
        self.lengths = [self.lengths[r * self.heads + h] for r in rows for h in range(self.heads)]
        self.real_seen = self.real_seen[rows]
        for name in ("head_budget", "key_stats"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[rows])
        self.batch = len(rows)
        self.keys = self.keys.new_empty(self.batch, self.heads, 0, self.keys.shape[-1])
        self.values = self.keys

    def _map(self, fn) -> None:
        self.keys_h, self.values_h = [fn(t) for t in self.keys_h], [fn(t) for t in self.values_h]
        self.slots_h = {name: [fn(t) for t in ts] for name, ts in self.slots_h.items()}
        if self.kv_bits is not None:
            self.key_stats = fn(self.key_stats)
