"""Kept keys and values in 8 or 4 bits: the codes of a quantized cache layer, one self-contained row per slot.

KIVI (Liu et al. 2024, arXiv:2402.02750) found that keys have outlier channels, so it quantizes keys per
channel and values per token. A press evicts single slots, which breaks KIVI's groups of consecutive
tokens, so here every slot is encoded on its own and the channels are handled first:

- keys: `fit` takes, per (row, KV head), each key channel's centre and half-range over the tokens the layer
  holds when it is quantized (`[..., 2, D]`, stored in fp16, and used as stored by both `encode` and
  `decode`; padding excluded; none below 16 slots): subtracting and dividing by them puts every channel,
  outliers included, in [-1, 1] (KIVI's per-channel step, fixed once per layer). Values are taken as they
  are (KIVI: per token).
- `encode` stores each slot's vector with one scale of its own (symmetric, fp16): `bits`-bit codes, two
  per byte at 4 bits, followed by the scale's two bytes. A slot is one `uint8` row of `D * bits / 8 + 2`
  bytes, so eviction moves, gathers and frees codes exactly as it does dense slots.
- `decode` gives the keys or values back in the model's dtype.

At 4 bits and head size 64 a slot's key (or value) takes 34 bytes against 256 in fp32 (7.5x fewer); the
key ranges add 256 bytes per layer and KV head (1 byte a slot at 256 slots).
"""

from __future__ import annotations

import torch

BITS = (8, 4)
_SCALE_BYTES = 2  # one fp16 scale per slot


def check_bits(bits: int, head_dim: int | None = None) -> None:
    """Raise unless `bits` is a supported width (and, at 4 bits, `head_dim` even: two codes share a byte)."""
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"kv_bits must be one of {', '.join(map(str, BITS))} (or None: no quantization), got {bits!r}")
    if bits == 4 and head_dim is not None and head_dim % 2:
        raise ValueError(f"kv_bits=4 packs two codes a byte and needs an even head size, got {head_dim}")


def already_at(current: int | None, bits: int) -> bool:
    """Whether a layer holding `current`-bit codes (None: dense) is already quantized at `bits`; another width
    is refused (a layer's codes are never re-quantized)."""
    if current is not None and current != bits:
        raise ValueError(f"this cache layer holds {current}-bit keys and values; kv_bits={bits} cannot continue it")
    return current is not None


def code_width(bits: int, head_dim: int) -> int:
    """Bytes of one encoded slot."""
    return head_dim * bits // 8 + _SCALE_BYTES


def head_size(width: int, bits: int) -> int:
    """The head size whose slots `code_width` encodes in `width` bytes."""
    return (width - _SCALE_BYTES) * 8 // bits


MIN_FIT = 16  # fewer slots say too little of a channel's range: they are then taken as they are


def fit(x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """`[..., 2, D]` fp16: each channel's centre and half-range over the slots of `x` `[..., n, D]` (only those
    marked in `valid` `[..., n]` when given). Where fewer than `MIN_FIT` slots count: centre 0, half-range 1."""
    x = x.float()
    counted = torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device) if valid is None else valid.to(x.device)
    high = x.masked_fill(~counted[..., None], float("-inf")).amax(dim=-2) if x.shape[-2] else x.sum(-2)
    low = x.masked_fill(~counted[..., None], float("inf")).amin(dim=-2) if x.shape[-2] else x.sum(-2)
    enough = (counted.sum(-1) >= MIN_FIT)[..., None]
    centre = torch.where(enough, (high + low) / 2, 0.0)
    half = torch.where(enough, ((high - low) / 2).clamp_min(1e-3), 1.0)
    return torch.stack([centre, half], dim=-2).clamp(-60000, 60000).to(torch.float16)


def _normalised(x: torch.Tensor, stats: torch.Tensor | None) -> torch.Tensor:
    x = x.float()
    return x if stats is None else (x - stats[..., 0:1, :].float()) / stats[..., 1:2, :].float()


def encode(x: torch.Tensor, stats: torch.Tensor | None, bits: int) -> torch.Tensor:
    """`x` `[..., n, D]` as `uint8` codes `[..., n, code_width]`, normalised by `stats` (`fit`, broadcast over n;
    None: as it is)."""
    qmax = 2 ** (bits - 1) - 1
    y = _normalised(x, stats)
    scale = (y.abs().amax(dim=-1, keepdim=True) / qmax).clamp_max(65504).to(torch.float16)  # codes saturate
    scale = scale.clamp_min(torch.finfo(torch.float16).tiny)
    codes = (y / scale.float()).round().clamp(-qmax, qmax).add(qmax).to(torch.uint8)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return torch.cat([codes, scale.view(torch.uint8)], dim=-1)


def decode(codes: torch.Tensor, stats: torch.Tensor | None, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The `[..., n, D]` tensor in `dtype` that `encode` stored as `codes`."""
    qmax = 2 ** (bits - 1) - 1
    body = codes[..., :-_SCALE_BYTES]
    scale = codes[..., -_SCALE_BYTES:].contiguous().view(torch.float16).float()
    if bits == 4:
        body = torch.stack([body & 15, body >> 4], dim=-1).flatten(-2)
    y = (body.float() - qmax) * scale
    return (y if stats is None else y * stats[..., 1:2, :].float() + stats[..., 0:1, :].float()).to(dtype)
