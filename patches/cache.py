"""A cache layer that really shrinks: it knows the tokens it has seen and the slots it holds.

`PressedLayer` is a transformers `DynamicLayer` whose slots can be evicted. Evicted slots are freed
(kept slots are copied into smaller tensors, or a slot is overwritten in place), never only masked, except by a
sliding window's trimming (below), whose holes are freed once every head's slots before them have left too.

Storage, all of it counted by `cache_bytes`:
- `keys`, `values`: `[batch, kv_heads, capacity, head_dim]`; the first `n` slots are in use. Decoding
  appends into spare room (`SPARE`). They may be views that start inside a larger storage: a sliding window's
  trimming moves their start (the storage, counted whole, is copied and shrunk when decoding next grows it).
- `slots`: per-slot tensors `[batch, kv_heads, capacity]`: `"pos"` (int32, the token's position among
  the row's real tokens), `"valid"` (bool, only while some slot is padding or an unused hole) and
  whatever state a press keeps per token (for example H2O's accumulated attention).
- `real_seen` / `shift`: per row, real (non-padding) tokens seen and real tokens evicted.

Quantized (`quantize(bits)`, once a press has decided on the layer, when it has `kv_bits`): `keys` and
`values` hold `uint8` codes, one row per slot (`kvpress.patches.kv_quantization`), with each key channel's
centre and range in `key_stats` `[batch, kv_heads, 2, head_dim]`; new tokens are encoded
as they are appended and the attention gets the held slots decoded plus the forward's own tokens exact.
Every slot operation (eviction, trimming, rewinding) moves codes as it moves dense slots. `held_kv()`
gives the held keys and values dense in either case.

Thinner keys (`prune_key_channels(index)`, ThinK): the keys keep only the channels `key_channels`
`[batch, kv_heads, d']` of each head (post-RoPE), for the held slots and every one appended later;
`query_channels(query)` gives a query the same channels, so q.k over what is kept is what the attention
and every scorer use. Such a layer is continued only inside `with press(model):` (transformers' own
attention would meet keys narrower than its queries).

`get_seq_length()` returns the tokens seen, so positions keep counting; `get_mask_sizes()` describes
the slots held, so transformers' own masks stay right for unpadded continuation (not for a sliding-window layer
compressed head by head once past its window: its heads' holes are refused outside the press).

A sliding-window layer (`window`, the model's `sliding_window`) is a full-attention layer while the
context fits its window, and a press compresses it like one. Past the window it keeps, as transformers'
`DynamicSlidingWindowLayer` does, only what the next token can see: `trim_window` drops the held slots
older than the last `window - 1` real tokens after every forward (a head whose slots leave while another
head's stay marks them as holes, not valid), and the layer's mask hides, for each query, the slots more than
`window - 1` positions behind it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from kvpress.patches import kv_quantization as quant

# A decoding step that finds no room left grows the storage by one slot and `_spare` more: 0 the first time, then
# 1, 2, 4, ... up to `SPARE` of the slots held (at least `SPARE_MIN`). A growing layer copies its slots once every
# `n * SPARE` steps, not every step as `torch.cat` would (and transformers' `DynamicLayer` does). An eviction
# (`keep`) leaves the same room after what it keeps, so a press that evicts every few steps copies its slots once
# an eviction, not also at the steps between that find the layer full.
SPARE, SPARE_MIN = 1 / 32, 8


class PressedLayer(DynamicLayer):
    """A `DynamicLayer` whose slots a press can evict; see the module docstring for its storage."""

    kv_bits: int | None = None  # class defaults: a layer saved before quantization existed loads as dense
    key_stats: torch.Tensor | None = None
    key_channels: torch.Tensor | None = None  # and one saved before thinner keys existed, with every channel
    offloaded = None  # slots a press keeps outside the working cache (RecallPress's store): not in its bytes
    _seen_rows: list[int] | None = None  # (and one saved before the host's copies of the per-row counts existed)
    _held_rows: list[int] | None = None
    _trimmed = False  # nothing was appended or inserted since the last `trim_window`
    _spare = 0  # the room the next growth leaves (see `SPARE`)
    rewrites = 0  # times held slots were evicted or rewritten in place (a `Scratch` cannot undo those)
    in_inference = False  # a forward under torch.inference_mode() made or wrote its tensors (`leave_inference`)
    graded = False  # a slot was written with autograd history: a backward through held slots is refused

    @property
    def is_croppable(self) -> bool:
        """Only while nothing was evicted or trimmed (transformers checks this before rolling tokens back)."""
        return self.seen == self.n

    def __init__(self, window: int | None = None) -> None:
        super().__init__()
        self.window = window  # a sliding-window layer's window (queries see the last `window` positions)
        self.seen = 0
        self.n = 0
        self.pending = 0
        self.slots: dict[str, torch.Tensor] = {}
        self.real_seen: torch.Tensor | None = None
        self.shift: torch.Tensor | None = None
        self.driven = False  # True while an installed press describes each update (padding, positions)
        self.adopted = False  # holds tokens written before a press drove it: padding not known yet
        self.padded = False  # some row has seen a padding token (else every row holds `n` of `seen`)
        self.rotated = False  # True once keys were re-rotated to positions inside the cache
        self.torn = False  # a forward that raised left this cache's layers at different points
        self.kv_bits: int | None = None  # set by `quantize`: keys and values are stored as codes of this width
        self.key_stats: torch.Tensor | None = None  # each key channel's centre and half-range (`kv_quantization`)
        self.key_channels: torch.Tensor | None = None  # `[B, H, d']` the key channels kept (`prune_key_channels`)
        # the host's copies of `real_seen` and of `held()` in a padded batch: read once, then kept up to date by
        # what changes them (a commit, an eviction that knows what each row keeps); None: read again when asked
        self._seen_rows: list[int] | None = None
        self._held_rows: list[int] | None = None

    @property
    def is_sliding(self) -> bool:
        """transformers sizes its sliding-window masks from the first layer that says True here."""
        return self.window is not None

    # ----- construction -------------------------------------------------------------------------
    @classmethod
    def from_layer(cls, layer: DynamicLayer) -> PressedLayer:
        """Adopt the content of a plain `DynamicLayer` or `DynamicSlidingWindowLayer` (a cache that already
        holds a conversation; a sliding one holds only its last `window - 1` tokens)."""
        new = cls(layer.sliding_window if getattr(layer, "is_sliding", False) else None)
        if layer.is_initialized and layer.keys is not None and layer.keys.numel() > 0:
            new.keys, new.values = layer.keys, layer.values
            new.device, new.is_initialized = layer.device, True
            new.n = new.pending = new.keys.shape[-2]
            new.seen = layer.get_seq_length()
            new.commit(None)  # the held slots are the last `n` of the `seen` tokens
            new.real_seen += new.seen - new.n
            new.shift += new.seen - new.n
            new.adopted = True
        return new

    # ----- the transformers layer API -----------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append new keys/values, in place when a freed slot is available."""
        if torch.is_inference_mode_enabled():
            self.in_inference = True
        elif not self.driven and made_in_inference(self):  # (a driven layer's: copied as its forward began)
            leave_inference(self)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.pending or self.torn:
            raise RuntimeError(
                "this cache was left half-updated by a forward that raised (or by `scratch`, which cannot undo an "
                "eviction inside); it cannot be continued (start a new cache)"
            )
        if not self.driven and self.padded and self.compressed:
            raise RuntimeError(
                "this compressed cache holds padded rows whose slots no longer match the 2D attention mask; "
                "continue it inside `with press(model):` so the press builds the right masks"
            )
        if not self.driven and self.rotated:
            raise RuntimeError(
                "this cache's keys were re-rotated to positions inside the cache (rerotate=True); a forward "
                "outside the press would use the true positions: continue it inside `with press(model):`"
            )
        q = key_states.shape[-2]
        if self.key_channels is not None:
            if not self.driven:
                raise RuntimeError(
                    "this cache's keys keep only some channels (ThinK); transformers' own attention would meet keys "
                    "narrower than its queries: continue it inside `with press(model):`"
                )
            key_states = self._thin(key_states)
        if not self.driven and self.window is not None and q > 1 and not self._contiguous():
            raise RuntimeError(
                "this sliding-window layer was compressed; transformers' own window mask would misplace its "
                "slots in a forward of several tokens: continue it inside `with press(model):`"
            )
        if not self.driven and self.window is not None and self.seen + q >= self.window and self._apart():
            raise RuntimeError(
                "this sliding-window layer was compressed head by head: past its window each head drops other "
                "slots, which transformers' own mask cannot hide (it would attend tokens that left the window): "
                "continue it inside `with press(model):`"
            )
        new_keys, new_values = key_states, value_states
        if self.kv_bits is not None:
            new_keys = quant.encode(key_states, self.key_stats, self.kv_bits)
            new_values = quant.encode(value_states, None, self.kv_bits)
        capacity = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        if self.n + q > capacity and self.n and q == 1:  # a decoding step: room for the next steps too (`SPARE`)
            self.keys, self.values = self._grown(self.keys, self.n), self._grown(self.values, self.n)
            self._spare = min(max(1, 2 * self._spare), max(SPARE_MIN, int(self.n * SPARE)))
            capacity = self.keys.shape[-2]
        if self.n + q <= capacity and torch.is_grad_enabled() and self.keys._base is not None:
            # a window's views (`_drop_first`) were made under the eviction's no_grad: autograd refuses writes into
            # them with grad on (a plain `model(...)` call), so they are copied first (not in generate)
            self.keys, self.values = self.keys.clone(), self.values.clone()
        if self.n + q <= capacity:
            self.keys[:, :, self.n : self.n + q] = new_keys
            self.values[:, :, self.n : self.n + q] = new_values
        else:
            self.keys = torch.cat([self.keys[:, :, : self.n], new_keys], dim=-2) if self.n else new_keys
            self.values = torch.cat([self.values[:, :, : self.n], new_values], dim=-2) if self.n else new_values
            self.keys, self.values = self.keys.contiguous(), self.values.contiguous()
        self.n += q
        self.seen += q
        self.pending = q
        self._trimmed = False
        if self.kv_bits is None:
            keys, values = self.keys[:, :, : self.n], self.values[:, :, : self.n]
        else:  # the held slots decoded, this forward's own tokens exact
            old_keys, old_values = self._decoded(self.n - q)
            keys, values = torch.cat([old_keys, key_states], dim=-2), torch.cat([old_values, value_states], dim=-2)
        if not self.driven:
            self.commit(None)
            self.trim_window()  # the attention still gets every slot (views of the storage trimming replaces)
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            if self.n > q:  # held slots: copies (later steps write into the storage in place), whose backward
                # refuses where those slots were written with autograd history (gathered since without it)
                keys, values = (map(without_backward, (keys, values)) if self.graded
                                else (keys.clone(), values.clone()))  # fmt: skip
            self.graded = True
        return keys, values

    def get_seq_length(self) -> int:
        """Tokens seen (padding included), which is what positions and `generate` count."""
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Slots held plus the query; the offset makes transformers' causal mask line up with them."""
        return self.n + query_length, self.seen - self.n

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the newest `-tokens_to_remove` tokens (transformers' convention: a count <= 0), as assisted
        decoding and a chat turn that failed roll back; the storage stays, as room. A layer that evicted or trimmed
        a token refuses (what it held before is gone)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes minus the number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove and self.seen != self.n:  # (0 removes nothing: transformers calls crop(0) as a no-op)
            raise NotImplementedError("a compressed cache cannot be cropped: its evicted tokens are gone")
        drop = min(-tokens_to_remove, self.n)
        if not drop:
            return
        if self.real_seen is not None:  # the real tokens leaving (with nothing evicted, every head holds them all)
            valid = self.valid
            self.real_seen = self.real_seen - (drop if valid is None else valid[:, 0, self.n - drop : self.n].sum(-1))
        self.seen -= drop
        self.n -= drop
        self._forget_rows()
        self._trimmed = False
        if self.real_seen is not None:
            self._count_evicted()

    def reset(self) -> None:
        super().reset()
        self.seen = self.n = self.pending = 0
        self.slots, self.real_seen, self.shift, self.rotated, self.padded = {}, None, None, False, False
        self.torn = self._trimmed = self.graded = False
        self._spare = 0
        self.kv_bits, self.key_stats = None, None  # dense again until a press quantizes the next prompt
        self.key_channels = None  # every channel again until a press thins the next prompt's keys
        self.offloaded = None  # the next prompt's spans are its own
        self._forget_rows()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_rows(lambda t: t[indices])

    def offload(self) -> None:
        if self.is_initialized:
            self._map_all(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized and self.keys.device != self.device:
            self._map_all(lambda t: t.to(self.device, non_blocking=True))

    def rewind_point(self) -> dict:
        """What `rewind` needs to drop every slot appended from now on: a copy of the small state (slots held,
        counters, flags, per-row totals); keys, values and per-slot tensors are not copied, but where a recalling
        press may exchange held slots in place (`offloaded`: its store, not copied) the held ones are, and the store
        is marked (`rewind` forgets the spans stored since and puts back whether a question has read them)."""
        point = copy.deepcopy({name: v for name, v in vars(self).items()
                               if name not in ("keys", "values", "slots", "offloaded")})  # fmt: skip
        point["store"] = None
        if self.offloaded is not None:
            point["store"] = (self.offloaded, self.offloaded.rewind_point())
            point["held"] = self.copy_slots(torch.ones(self.n, dtype=torch.bool, device=self.keys.device))
        return point

    def rewind(self, point: dict) -> None:
        """Drop the slots appended since `rewind_point` gave `point`. Appends go after the held slots, so the
        first `n` are exactly those held then (or their copies, where slots may have been exchanged); they move
        to tensors of their own (the rest is freed)."""
        point = dict(point)
        held, store = point.pop("held", None), point.pop("store", None)
        self.offloaded = None  # a store begun since is forgotten with its spans
        if store is not None:
            self.offloaded, mark = store
            self.offloaded.rewind(mark)
        n = point["n"]
        if held is not None:
            self.keys, self.values = held["keys"].clone(), held["values"].clone()
            self.slots = {name: held[name].clone() for name in held if name not in ("keys", "values")}
        else:
            self.keys, self.values = self.keys[:, :, :n].clone(), self.values[:, :, :n].clone()
            self.slots = {name: t[..., :n].clone() for name, t in self.slots.items()}
        vars(self).update(point)

    # ----- what a press reads ---------------------------------------------------------------------
    def held_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The held keys and values `[B, H, n, D]`, dense (decoded when the layer is quantized)."""
        if self.kv_bits is None:
            return self.keys[:, :, : self.n], self.values[:, :, : self.n]
        return self._decoded(self.n)

    @property
    def valid(self) -> torch.Tensor | None:
        """`[B, H, n]` bool, or None when every held slot is a real token."""
        v = self.slots.get("valid")
        return None if v is None else v[..., : self.n]

    @property
    def pos(self) -> torch.Tensor:
        """`[B, H, n]` int32 positions (among each row's real tokens) of the held slots."""
        return self.slots["pos"][..., : self.n]

    def slot(self, name: str) -> torch.Tensor:
        """A per-slot tensor `[B, H, n]` kept aligned with the slots (created as zeros on first use)."""
        if name not in self.slots:
            b, h = self.keys.shape[:2]
            self.slots[name] = torch.zeros(b, h, self.n, dtype=torch.float32, device=self.keys.device)
        return self.slots[name][..., : self.n]

    def held(self) -> torch.Tensor:
        """`[B]` real tokens held per row, on the host: by its fullest head (heads of a row hold the same number,
        except after a sliding-window layer's trimming, which drops per head what left the window). Where slots may
        be padding or holes, read from the device once and then kept up to date on the host (`_held_rows`)."""
        v = self.valid
        if v is None:
            return torch.full((self.keys.shape[0],), self.n, dtype=torch.long)
        if self._held_rows is None:
            self._held_rows = v.sum(-1).amax(-1).tolist()
        return torch.tensor(self._held_rows, dtype=torch.long)

    @property
    def span(self) -> torch.Tensor:
        """`[B]` real tokens each row would hold with no press: every one seen, or a sliding-window layer's
        last `window - 1` (what budgets are taken from)."""
        return self.real_seen if self.window is None else self.real_seen.clamp(max=self.window - 1)

    def seen_list(self) -> list[int]:
        """`real_seen` as host integers: known without reading the device while no row has seen padding (each row
        has then seen `seen` real tokens); in a padded batch read once, then kept up to date (`_seen_rows`)."""
        if not self.padded:
            return [self.seen] * self.keys.shape[0]
        if self._seen_rows is None:
            self._seen_rows = self.real_seen.tolist()
        return list(self._seen_rows)

    def span_list(self) -> list[int]:
        """`span` as host integers (see `seen_list`)."""
        return [n if self.window is None else min(n, self.window - 1) for n in self.seen_list()]

    def position_order(self) -> torch.Tensor:
        """`[B, H, n]` slot indices sorted by token position, padding and holes last."""
        pos = self.pos.long()
        valid = self.valid
        return (pos if valid is None else pos.masked_fill(~valid, torch.iinfo(torch.long).max)).argsort(dim=-1)

    @property
    def compressed(self) -> bool:
        """Whether slots no longer line up with token positions (masks must come from the layer)."""
        return self.n != self.seen or "valid" in self.slots

    # ----- what the intercept and the presses do ----------------------------------------------------
    def commit(self, new_valid: torch.Tensor | None) -> None:
        """Describe the `pending` tokens of the last update: `new_valid` `[B, q]` marks real tokens."""
        q, self.pending = self.pending, 0
        b, h = self.keys.shape[:2]
        device = self.keys.device
        if self.real_seen is None:
            self.real_seen = torch.zeros(b, dtype=torch.long, device=device)
            self.shift = torch.zeros(b, dtype=torch.long, device=device)
        if new_valid is None:  # q real tokens a row, appended to every head
            self._seen_rows = None if self._seen_rows is None else [n + q for n in self._seen_rows]
            self._held_rows = None if self._held_rows is None else [n + q for n in self._held_rows]
        else:  # how many are real is on the device
            self._forget_rows()
        if new_valid is None and not self.padded:  # every row has seen `seen` real tokens
            pos = torch.arange(self.seen - q, self.seen, device=device).expand(b, q)
            self.real_seen += q
        elif new_valid is None:
            pos = self.real_seen[:, None] + torch.arange(q, device=device)
            self.real_seen = self.real_seen + q
        else:
            self.padded = True
            new_valid = new_valid.to(device=device, dtype=torch.bool)
            counts = new_valid.long().cumsum(-1)
            pos = (self.real_seen[:, None] + counts - 1).clamp_min(0)
            self.real_seen = self.real_seen + counts[:, -1]
            if "valid" not in self.slots:
                self.slots["valid"] = torch.ones(b, h, self.n - q, dtype=torch.bool, device=device)
        self._append_slot("pos", pos.to(torch.int32)[:, None].expand(b, h, q))
        if self.rotated:
            self._append_slot("rot", (pos - self.shift[:, None]).to(torch.int32)[:, None].expand(b, h, q))
        for name, t in self.slots.items():
            if name == "valid":
                fill = new_valid[:, None].expand(b, h, q) if new_valid is not None else t.new_ones(b, h, q)
                self._append_slot(name, fill)
            elif name not in ("pos", "rot"):
                self._append_slot(name, t.new_zeros(b, h, q))

    def adopt_padding(self, history: torch.Tensor) -> None:
        """Learn which adopted slots are padding from the 2D mask `history` `[B, seen]` of the tokens seen before
        this forward, of which the layer holds the last `held` (all of them, or a sliding window's last)."""
        self.adopted = False
        if bool(history.all()):
            return
        b, h = self.keys.shape[:2]
        held = self.n - self.pending  # (this forward's tokens are committed after)
        history = history.to(device=self.keys.device, dtype=torch.bool)
        counts = history.long().cumsum(-1)
        self.padded = True
        self._forget_rows()
        # written into the per-slot tensors, which may hold this forward's slots and room after the adopted ones
        self.slots["pos"][..., :held] = (counts[:, history.shape[1] - held :] - 1).clamp_min(0)[:, None]
        valid = self.slots.setdefault("valid", torch.ones_like(self.slots["pos"], dtype=torch.bool))
        valid[..., :held] = history[:, history.shape[1] - held :][:, None]
        self.real_seen = counts[:, -1]
        self.shift = self.real_seen - history[:, history.shape[1] - held :].sum(-1)

    def keep(self, index: torch.Tensor, keep_valid: torch.Tensor | None = None, capacity: int | None = None,
             held: list[int] | None = None) -> None:  # fmt: skip
        """Keep the slots `index` `[B, H, k]` (per head, in the order they are to be held: sorted, so that the
        newest stay last) in new tensors of `capacity` slots (>= k) and the room decoding grew to (`SPARE`);
        `keep_valid` marks the real ones (a slot held as not valid stays so). `held`: the real slots each row
        then holds by its fullest head, where the caller knows them (`held()` then reads nothing)."""
        k = index.shape[-1]
        capacity = max(k, capacity or k)
        self._spare = min(self._spare, max(SPARE_MIN, int(capacity * SPARE)))  # (the room of fewer slots)
        capacity += self._spare

        def take(t: torch.Tensor) -> torch.Tensor:
            idx = index if t.dim() == 3 else index[..., None].expand(*index.shape, t.shape[-1])
            if capacity == k or t.requires_grad:  # (autograd takes no out=: gathered, then copied into the room)
                kept = t[:, :, : self.n].gather(2, idx)
                return kept if capacity == k else self._grown(kept, k, capacity)
            out = t.new_empty(*t.shape[:2], capacity, *t.shape[3:])
            torch.gather(t[:, :, : self.n], 2, idx, out=out[:, :, :k])  # one copy, into the room's storage
            return out

        self.keys, self.values = take(self.keys), take(self.values)
        if keep_valid is not None and "valid" not in self.slots:
            self.slots["valid"] = torch.ones_like(self.slots["pos"], dtype=torch.bool)
        self.slots = {name: take(t) for name, t in self.slots.items()}
        self.n = k
        if keep_valid is not None:
            self.slots["valid"][..., :k] &= keep_valid
        self._held_rows = None if held is None else list(held)
        if "valid" in self.slots and self._all_valid(k, held):
            del self.slots["valid"]
        self.rewrites += 1
        self._count_evicted()

    def copy_slots(self, chosen: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copies of the held slots where `chosen` `[n]` (bool) is True (the same slots in every row and
        head): `keys`, `values` and every per-slot tensor, for `insert` to bring back later."""
        index = self._chosen(chosen).nonzero().squeeze(-1)
        out = {"keys": self.keys[:, :, : self.n].index_select(2, index),
               "values": self.values[:, :, : self.n].index_select(2, index)}  # fmt: skip
        out.update({name: t[..., : self.n].index_select(2, index) for name, t in self.slots.items()})
        return out

    def drop_slots(self, chosen: torch.Tensor) -> None:
        """Evict the held slots where `chosen` `[n]` (bool) is True (the same slots in every row and head)."""
        b, h = self.keys.shape[:2]
        index = (~self._chosen(chosen)).nonzero().squeeze(-1)
        self.keep(index.expand(b, h, -1))

    def insert(self, held: dict[str, torch.Tensor]) -> None:
        """Hold again slots copied by `copy_slots` (tokens seen before, so `seen` does not change),
        everything kept in position order. Slots already held are refused."""
        extra = {name: t.to(self.keys.device) for name, t in held.items()}
        if set(extra) != {"keys", "values", *self.slots}:
            raise ValueError(f"slots to insert carry {sorted(extra)}, this layer keeps {sorted(self.slots)}")
        if extra["keys"].shape[:2] != self.keys.shape[:2] or extra["keys"].shape[3:] != self.keys.shape[3:]:
            raise ValueError(f"slots to insert have shape {tuple(extra['keys'].shape)}, this layer's keys "
                             f"{tuple(self.keys.shape)} (batch, heads and head size must match)")  # fmt: skip
        # each row and head (their slots may hold other positions): a real slot's position among the real held ones,
        # found in them sorted (padding and holes read as -1, which no real position is)
        if self.n:
            held = self.pos.long() if self.valid is None else self.pos.long().masked_fill(~self.valid, -1)
            held = held.sort(dim=-1).values
            new = extra["pos"].long()
            found = held.gather(-1, torch.searchsorted(held, new).clamp_max(self.n - 1)) == new
            if "valid" in extra:
                found &= extra["valid"]
            if bool(found.any()):
                raise ValueError("some slots to insert are already held (their positions are in the layer)")
        merged = {"keys": torch.cat([self.keys[:, :, : self.n], extra["keys"]], dim=2),
                  "values": torch.cat([self.values[:, :, : self.n], extra["values"]], dim=2)}  # fmt: skip
        merged.update({name: torch.cat([t[..., : self.n], extra[name]], dim=2) for name, t in self.slots.items()})
        order = merged["pos"].long().argsort(dim=2, stable=True)  # each row and head in its own position order
        take = lambda t: t.gather(2, order if t.dim() == 3 else order[..., None].expand(*order.shape, t.shape[-1]))  # noqa: E731
        self.keys, self.values = take(merged.pop("keys")), take(merged.pop("values"))
        self.slots = {name: take(t) for name, t in merged.items()}
        self.n += extra["keys"].shape[2]
        self.rewrites += 1
        self._count_evicted()  # (padding or holes among the slots brought back are not tokens held again)
        self._forget_rows()
        self._trimmed = False

    def replace(self, index: torch.Tensor, held: dict[str, torch.Tensor], where: torch.Tensor) -> None:
        """Exchange held slots for slots copied earlier (tokens seen before, as `copy_slots` gives them): slot
        `index[b, h, j]` takes `held[name][b, h, j]` where `where[b, h, j]` is True. `n` and `seen` stay."""
        if self.kv_bits is not None or self.rotated:
            raise ValueError("slots cannot be exchanged in a quantized or re-rotated layer")
        if set(held) != {"keys", "values", *self.slots}:
            raise ValueError(f"slots to exchange carry {sorted(held)}, this layer keeps {sorted(self.slots)}")
        b, h = self.keys.shape[:2]
        if index.shape != where.shape or index.shape[:2] != (b, h) or held["keys"].shape[:3] != index.shape:
            raise ValueError(f"slots to exchange: index {tuple(index.shape)}, where {tuple(where.shape)} and keys "
                             f"{tuple(held['keys'].shape)} must agree on [batch={b}, heads={h}, k]")  # fmt: skip
        for name, t in (("keys", self.keys), ("values", self.values), *self.slots.items()):
            idx = index if t.dim() == 3 else index[..., None].expand(*index.shape, t.shape[-1])
            mask = where if t.dim() == 3 else where[..., None]
            view = t[:, :, : self.n]
            view.scatter_(2, idx, torch.where(mask, held[name].to(t.device, t.dtype), view.gather(2, idx)))
        self.rewrites += 1
        self._forget_rows()
        self._trimmed = False

    def _chosen(self, chosen: torch.Tensor) -> torch.Tensor:
        if not isinstance(chosen, torch.Tensor) or chosen.dtype != torch.bool or tuple(chosen.shape) != (self.n,):
            got = tuple(chosen.shape) if isinstance(chosen, torch.Tensor) else type(chosen).__name__
            raise ValueError(f"slots are chosen by a bool mask of the {self.n} held slots, got {got}")
        return chosen.to(self.keys.device)

    def remove_one(self, index: torch.Tensor) -> None:
        """Evict one slot per head, `index` `[B, H]`, by moving the last slot into it (no copy of the rest)."""
        last = self.n - 1
        for name in ("keys", "values"):
            t = getattr(self, name)
            src = t[:, :, last : last + 1].clone()
            t.scatter_(2, index[..., None, None].expand(*index.shape, 1, t.shape[-1]), src)
        for t in self.slots.values():
            t.scatter_(2, index[..., None], t[:, :, last : last + 1].clone())
        self.n = last
        self.rewrites += 1
        self._forget_rows()
        self._count_evicted()

    def trim_window(self) -> None:
        """A sliding-window layer drops the held slots the next token cannot see: real tokens older than the
        last `window - 1` of their row (each head its own). The slots leaving a head are the real ones before its
        first staying slot (its real slots are in position order), so the slots before the earliest such first slot
        of the layer leave by a view that starts after them (nothing is copied), and the other heads' leaving slots
        become holes, marked not valid. The slots kept stay in their order, so the newest slots stay last. One read
        from the device."""
        if self.window is None or self.seen < self.window:  # every token seen is in the window (the hot path)
            return
        if self._trimmed or not self.n:  # (called again in the same forward, or nothing held)
            return
        stay = self.pos >= (self.real_seen - (self.window - 1)).to(self.keys.device)[:, None, None]
        valid = self.valid
        if valid is not None:
            stay &= valid
        # the earliest staying slot of any head, and how many stay (all of them at or after it)
        first = torch.where(stay, torch.arange(self.n, device=stay.device), self.n).amin()
        cut, staying = torch.stack([first, stay.sum()]).tolist()
        holes = staying < stay.shape[0] * stay.shape[1] * (self.n - cut)  # slots kept that hold no staying token
        if cut or holes:
            self._drop_first(cut, stay[..., cut:] if holes else None)
        self._trimmed = True

    def _drop_first(self, cut: int, valid: torch.Tensor | None) -> None:
        """Hold the slots from `cut` on, by views of the same storage (copies where more would stay behind them than
        they hold: a prefill past the window, whose whole storage the views kept until the layer next grew), and mark
        which are real (`valid`; None: all of them)."""
        copy = cut > self.keys.shape[2] - cut
        self.keys, self.values = (t[:, :, cut:].clone() if copy else t[:, :, cut:] for t in (self.keys, self.values))
        self.slots = {name: t[..., cut:].clone() if copy else t[..., cut:] for name, t in self.slots.items()}
        self.n -= cut
        if valid is not None:
            if "valid" not in self.slots:
                self.slots["valid"] = torch.ones_like(self.slots["pos"], dtype=torch.bool)
            self.slots["valid"][..., : self.n] = valid
        else:
            self.slots.pop("valid", None)
        self._held_rows = None
        self._count_evicted()

    def quantize(self, bits: int) -> None:
        """Store the held slots, and every slot appended from now on, as `bits`-bit codes (the channels'
        ranges fitted to the slots held now). A layer already quantized keeps its codes; another width is refused."""
        if quant.already_at(self.kv_bits, bits):
            return
        if self.rotated or self.key_channels is not None:
            raise ValueError("keys re-rotated in the cache (rerotate=True) or thinned (ThinK) cannot be quantized")
        keys, values = self.keys[:, :, : self.n], self.values[:, :, : self.n]
        quant.check_bits(bits, keys.shape[-1])
        self.key_stats = quant.fit(keys, self.valid)  # padding and holes do not widen the ranges
        self.dtype = keys.dtype
        self.keys = quant.encode(keys, self.key_stats, bits)
        self.values = quant.encode(values, None, bits)
        self.kv_bits = bits
        self.rewrites += 1

    def prune_key_channels(self, index: torch.Tensor) -> None:
        """Keep only the key channels `index` `[B, H, d']` (sorted, distinct, per row and KV head) of the held
        slots and of every slot appended from now on; once per layer."""
        b, h, _, d = self.keys.shape
        if self.key_channels is not None:
            raise ValueError("this layer's key channels were already pruned (once per prompt)")
        if self.kv_bits is not None or self.rotated:
            raise ValueError("key channels cannot be pruned in a quantized or re-rotated layer")
        if index.dim() != 3 or tuple(index.shape[:2]) != (b, h) or not 0 < index.shape[-1] <= d:
            raise ValueError(f"key channels to keep: index of shape [batch={b}, heads={h}, 1..{d}], "
                             f"got {tuple(index.shape)}")  # fmt: skip
        index = index.to(device=self.keys.device, dtype=torch.long)
        if bool((index.diff(dim=-1) <= 0).any()) or bool((index < 0).any()) or bool((index >= d).any()):
            raise ValueError(f"key channels to keep must be sorted, distinct and in [0, {d})")
        self.key_channels = index
        self.keys = self._thin(self.keys).contiguous()
        self.rewrites += 1

    def query_channels(self, query: torch.Tensor) -> torch.Tensor:
        """`query` `[B, Hq, q, D]` cut to the key channels each query head's KV head keeps (itself if all kept)."""
        if self.key_channels is None:
            return query
        b, hq, q, _ = query.shape
        index = self.key_channels.repeat_interleave(hq // self.key_channels.shape[1], dim=1).to(query.device)
        return query.gather(-1, index[:, :, None, :].expand(b, hq, q, index.shape[-1]))

    def _thin(self, keys: torch.Tensor) -> torch.Tensor:
        """`keys` `[B, H, n, D]` cut to the kept channels."""
        index = self.key_channels.to(keys.device)
        return keys.gather(-1, index[:, :, None, :].expand(*keys.shape[:3], index.shape[-1]))

    def set_rotation(self, rot: torch.Tensor) -> None:
        """Record the positions `[B, H, n]` the held keys are now rotated to."""
        self.rotated = True
        self.slots["rot"] = rot.to(torch.int32)
        self.rewrites += 1

    # ----- helpers ----------------------------------------------------------------------------------
    def _forget_rows(self) -> None:
        """The host's copies of the per-row counts are no longer known (read again when asked)."""
        self._seen_rows = self._held_rows = None

    def _all_valid(self, k: int, held: list[int] | None) -> bool:
        """Whether each of the `k` slots now held is a real token in every head: known on the host from `held` (the
        real slots of each row's fullest head) where every head of a row holds as many (no window trimmed them)."""
        if held is not None and self.window is None:
            return min(held) == k
        return bool(self.valid.all())

    def _count_evicted(self) -> None:
        """`shift`: the real tokens each row no longer holds (by its fullest head)."""
        v = self.valid  # counted on the device (`held()` is the host's copy)
        self.shift = self.real_seen - (self.n if v is None else v.sum(-1).amax(-1).to(self.real_seen.device))

    def _grown(self, t: torch.Tensor, held: int, capacity: int | None = None) -> torch.Tensor:
        """`t` (keys, values or a per-slot tensor) with its first `held` slots copied into a tensor of `capacity`
        slots (by default room for the next slot and `_spare` more)."""
        out = t.new_empty(*t.shape[:2], capacity or held + 1 + self._spare, *t.shape[3:])
        out[:, :, :held] = t[:, :, :held]
        return out

    def _append_slot(self, name: str, new: torch.Tensor) -> None:
        t = self.slots.get(name)
        start = self.n - new.shape[-1]
        if t is not None and start and t.shape[-1] < self.n <= self.keys.shape[-2]:  # the keys grew (`update`)
            t = self.slots[name] = self._grown(t, start, self.keys.shape[-2])
        if t is not None and t.shape[-1] >= self.n:
            t[..., start : self.n] = new
        elif t is None:
            self.slots[name] = new.contiguous()
        else:
            self.slots[name] = torch.cat([t[..., :start], new], dim=-1)

    def _apart(self) -> bool:
        """Whether the held slots differ between heads or rows: holes, or positions that differ (a window's trimming
        would then make holes, which only the press's own masks hide)."""
        if "valid" in self.slots:
            return True
        return self.n > 0 and bool((self.pos != self.pos[:1, :1]).any())

    def _contiguous(self) -> bool:
        """Whether the held slots are exactly the last `n` tokens seen, in order (nothing but the window cut)."""
        if self.n == 0:
            return True
        if self.valid is not None or self.padded:
            return False
        return bool((self.pos == torch.arange(self.seen - self.n, self.seen, device=self.keys.device)).all())

    def _decoded(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `n` held slots' keys and values, decoded."""
        return (quant.decode(self.keys[:, :, :n], self.key_stats, self.kv_bits, self.dtype),
                quant.decode(self.values[:, :, :n], None, self.kv_bits, self.dtype))  # fmt: skip

    def _map_rows(self, fn) -> None:
        if not self.is_initialized or self.keys.numel() == 0:
            return
        if self.offloaded is not None:
            raise ValueError("this layer keeps a RecallPress store of its prompt's spans, which does not follow beam "
                             "search or row selection: generate with num_beams=1 and the whole batch")  # fmt: skip
        self._map_all(fn)
        if self.real_seen is not None:
            self.real_seen, self.shift = fn(self.real_seen), fn(self.shift)
        self.rewrites += 1  # rows reordered, repeated or selected (beam search)
        self._forget_rows()

    def _map_all(self, fn) -> None:
        self.keys, self.values = fn(self.keys), fn(self.values)
        self.slots = {name: fn(t) for name, t in self.slots.items()}
        if self.kv_bits is not None:
            self.key_stats = fn(self.key_stats)
        if self.key_channels is not None:
            self.key_channels = fn(self.key_channels)


def made_in_inference(layer) -> bool:
    """Whether `layer` holds tensors made under `torch.inference_mode()`: its flag (a forward under it), or, read
    cheaply, its keys or per-row counts (a saved cache loaded, a rewind or a copy made under it)."""
    return layer.in_inference or any(isinstance(t, torch.Tensor) and t.is_inference()
                                     for t in (layer.keys, layer.real_seen))  # fmt: skip


def leave_inference(layer) -> None:
    """Copy the tensors a forward under `torch.inference_mode()` left on a cache layer into ordinary ones, before a
    forward outside it writes into them: torch refuses in-place writes into inference tensors outside inference
    mode, and a pressed layer writes its slots in place (transformers' own layers concatenate, so a plain cache
    filled under inference mode goes on outside it; a pressed one does too)."""
    def plain(value):
        if isinstance(value, torch.Tensor):
            return value.clone() if value.is_inference() else value
        if isinstance(value, dict):
            return {name: plain(t) for name, t in value.items()}
        if isinstance(value, tuple):
            return tuple(plain(t) for t in value)
        return value

    with torch.inference_mode(False):
        for name, value in list(vars(layer).items()):
            setattr(layer, name, plain(value))
    layer.in_inference = False


class _NoBackward(torch.autograd.Function):
    """The identity (a copy) forward; its backward refuses (`without_backward`)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            "kvpress: no gradient flows through a compressed cache. This forward attended to keys and values a "
            "press's cache held before it, written with autograd history (by an earlier forward, or by the first "
            "part of a prompt that a press scoring whole prompts feeds in parts) or held head by head (AdaKV, "
            "DuoAttention), which the press chose and moves in place outside autograd: their gradients would be "
            "missing or wrong. A backward works through a forward into an empty cache under a press that scores "
            "tokens as they are cached (a prefill, a training step's loss), and over dense slots written under "
            "torch.no_grad() (constants); for gradients through earlier tokens, run without a press (a full cache)"
        )


def without_backward(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (copied), whose backward raises a clear error: held slots that a forward wrote with autograd
    history, which a press gathered since without it (and later steps overwrite in place), or a head-wise layer's
    attention over its held slots."""
    return _NoBackward.apply(tensor)


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a view of a large tensor counts it whole)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def layer_tensors(layer) -> list[torch.Tensor]:
    """Every tensor a cache layer keeps."""
    if hasattr(layer, "tensors"):
        return layer.tensors()
    return [v for v in vars(layer).values() if isinstance(v, torch.Tensor)] + list(getattr(layer, "slots", {}).values())


def cache_bytes(cache: Cache) -> int:
    """Bytes held by every tensor of every layer of `cache` (keys, values, positions, masks, scores)."""
    if not isinstance(cache, Cache):
        raise TypeError(f"cache_bytes counts a transformers Cache (a DynamicCache), got {type(cache).__name__}")
    return tensor_bytes(t for layer in cache.layers for t in layer_tensors(layer))


class SkippedLayer(DynamicLayer):
    """The cache layer of a decoder layer that a layer-skipped draft does not run (`draft_view`): it holds nothing,
    no press drives it, and it refuses an update (the decoder layer was meant to be skipped)."""

    def update(self, *args, **kwargs):
        raise RuntimeError("a layer-skipped draft ran a layer it skips (`model_access.skipped_layers` not entered?)")


def draft_view(cache: DynamicCache, skip: set[int]) -> DynamicCache:
    """A cache over the same layer objects as `cache` (what a forward on it appends, it appends to them), with a
    `SkippedLayer` at each index of `skip`: the cache of a draft that runs the model with those layers skipped
    (`model_access.skipped_layers`). Layer 0 must run: positions come from its length."""
    if 0 in skip:
        raise ValueError("a draft must run layer 0 (the cache's length, hence the positions, is read from it)")
    view = DynamicCache()
    view.layers = [SkippedLayer() if i in skip else layer for i, layer in enumerate(cache.layers)]
    return view


class Scratch:
    """Forwards inside append to `cache`; on exit every layer is put back as it was, also when one raises. A layer of
    full attention (`PressedLayer`, `HeadwiseLayer`) drops what was appended (no copy of what it holds), so nothing
    may evict from it inside (a press installed there is frozen or only observes); any other layer (a sliding
    window, which also drops what leaves the window: bounded) is restored from a copy taken on entry.
    `release(idx)` puts layer `idx` back at once: a pass fed in one forward needs a layer's own tokens only in that
    layer's attention, so releasing each right after it holds one layer's pass at a time, not every layer's (a layer
    released before a forward raised is put back again on exit: the intercept marks every layer of a torn cache).
    The layer objects themselves are put back too: a press installed inside adopts a plain layer into one of its own
    (`DynamicLayer` -> `PressedLayer`), and that one leaves with what it held. A full-attention layer that evicted or
    rewrote held slots inside (`rewrites`; not one whose held slots the rewind point copied, a recalling press's) is
    put back wrong: it is marked torn (the cache refuses to go on) and the exit raises, naming the layers."""

    def __init__(self, cache: Cache) -> None:
        self.cache = cache
        self._layers: list = []
        self._points: dict[int, dict | object] = {}
        self._released: dict[int, dict | object] = {}
        self._rewritten: set[int] = set()

    def __enter__(self) -> Scratch:
        self._layers = list(self.cache.layers)
        self._points = {idx: layer.rewind_point() if _appends_only(layer) else _detached_copy(layer)
                        for idx, layer in enumerate(self._layers)}  # fmt: skip
        self._released, self._rewritten = {}, set()
        return self

    def release(self, idx: int) -> None:
        """Put layer `idx` back as it was on entry now (once: a later call, and the exit, leave it)."""
        if idx in self._points:
            self._released[idx] = self._points.pop(idx)
            self._put_back(idx, self._released[idx])

    def _put_back(self, idx: int, point: dict | object) -> None:
        layer = self._layers[idx]
        if isinstance(point, dict):
            rewritten = "held" not in point and layer.rewrites != point.get("rewrites", 0)
            layer.rewind(point)  # (a PressedLayer's count goes back with the rest: put back twice, it is known here)
            if rewritten or idx in self._rewritten:  # its first slots are no longer those it held on entry
                layer.torn = True
                self._rewritten.add(idx)
        else:
            vars(layer).clear()
            vars(layer).update(vars(point))
        self.cache.layers[idx] = layer

    def __exit__(self, exc_type, *exc) -> None:
        # a forward that raised marks every layer of a cache left uneven as torn, those released before it too
        for idx, point in [*self._points.items(), *(self._released.items() if exc_type is not None else ())]:
            self._put_back(idx, point)
        for idx in self._released:  # a layer released stays the one put back
            self.cache.layers[idx] = self._layers[idx]
        del self.cache.layers[len(self._layers) :]  # a cache that grows its layers as they come (no config)
        self._points = self._released = {}
        if self._rewritten and exc_type is None:
            raise RuntimeError(
                f"layers {sorted(self._rewritten)} evicted or rewrote held slots inside `scratch`, which can only "
                "drop what was appended: the cache is no longer what it held and is marked torn (install the press "
                "frozen inside, `installed.frozen()`, or outside the block)"
            )


@contextmanager
def scratch(cache: Cache) -> Iterator[Cache]:
    """Let forwards append to `cache`, then put every layer back as it was, also when one raises (`Scratch`)."""
    with Scratch(cache):
        yield cache


def _detached_copy(layer):
    """A deep copy of `layer` with its tensors detached (a forward run with autograd on leaves tensors in the cache
    that `copy.deepcopy` refuses to copy; what a cache holds is not learned)."""
    memo = {}

    def seed(x) -> None:
        if isinstance(x, torch.Tensor):
            memo[id(x)] = x.detach().clone()
        elif isinstance(x, dict):
            for v in x.values():
                seed(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                seed(v)

    for value in vars(layer).values():
        seed(value)
    return copy.deepcopy(layer, memo)


def _appends_only(layer) -> bool:
    """Whether forwards only append to `layer` (its first slots stay as they are, so a rewind can drop the rest): a
    layer of full attention that can rewind (`PressedLayer`, `HeadwiseLayer`)."""
    return hasattr(layer, "rewind_point") and getattr(layer, "window", 1) is None
