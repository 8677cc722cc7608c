"""Re-rotating cached keys: RoPE is a rotation, so a key rotated to position p moves to p + d by R(d)."""

from __future__ import annotations

import torch

FEW = 4096  # shifts up to this many are rotated one by one (as many float64 angles as their keys' features)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rerotate(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys `[B, H, n, D]` rotated by `delta` `[B, H, n]` positions (transformers' half-split RoPE layout).

    Works for every RoPE variant that transformers expresses by an `inv_freq` vector (default, linear,
    llama3, yarn, longrope at a fixed length): yarn's attention factor is already in the stored key.
    With partial rotary embeddings only the first `2 * len(inv_freq)` features rotate.
    """
    rot_dim = 2 * inv_freq.shape[-1]
    # the angles in float64: of each shift where there are few (a decoding step's queries: no `unique`, which reads
    # the device), else once per distinct shift (few distinct ones in practice)
    shifts, which = (delta, None) if delta.numel() <= FEW else torch.unique(delta, return_inverse=True)
    angles = shifts.to(torch.float64)[..., None] * inv_freq.to(device=keys.device, dtype=torch.float64)
    angles = torch.cat((angles, angles), dim=-1)
    # computed in fp32 and rounded once (bf16 arithmetic rounded each product: keys moved round after round drift)
    cos, sin = angles.cos().float(), angles.sin().float()
    if which is not None:
        cos, sin = cos[which], sin[which]
    k_rot, k_pass = keys[..., :rot_dim].float(), keys[..., rot_dim:]
    k_rot = (k_rot * cos + rotate_half(k_rot) * sin).to(keys.dtype)
    return torch.cat((k_rot, k_pass), dim=-1) if k_pass.shape[-1] else k_rot


def average_rotation(x: torch.Tensor, shifts: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """`x` `[..., D]` times the mean of the RoPE rotations by each of `shifts` (positions ahead): per frequency,
    a rotation by the mean cosine and sine (transformers' half-split layout; with partial rotary embeddings
    only the first `2 * len(inv_freq)` features rotate)."""
    rot_dim = 2 * inv_freq.shape[-1]
    angles = shifts.to(torch.float64)[:, None] * inv_freq.to(device=x.device, dtype=torch.float64)
    cos, sin = angles.cos().mean(0), angles.sin().mean(0)
    cos, sin = torch.cat((cos, cos)).to(x.dtype), torch.cat((sin, sin)).to(x.dtype)
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x_rot = x_rot * cos + rotate_half(x_rot) * sin
    return torch.cat((x_rot, x_pass), dim=-1) if x_pass.shape[-1] else x_rot
