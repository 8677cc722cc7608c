"""`RoundStore`: spans of a cache (finished chat rounds, a prefill's tokens) kept outside the working cache, per
layer, until recalled (by `RoundPolicy` for rounds, `RecallPress` for a context's spans)."""

from __future__ import annotations

import torch

from kvpress.patches.cache import tensor_bytes


class RoundStore:
    """Copies of finished rounds' slots (keys, values, positions), keyed by (layer index, round index).

    A round is stored once, when it is finished (and compressed by the round press's `inner`, if any),
    and never changes afterwards, so recalling it gives back exactly what left the working cache.
    `device="cpu"` keeps them in host memory (what frees accelerator memory on a GPU).
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        if not isinstance(device, (str, torch.device)):  # (torch's own error lists its overloads)
            raise TypeError(f"RoundStore's device is where stored spans are kept, a str or torch.device such as "
                            f"'cpu', got {device!r}")  # fmt: skip
        self.device = torch.device(device)
        self._rounds: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def put(self, layer_idx: int, round_idx: int, slots: dict[str, torch.Tensor]) -> None:
        """Keep `slots` (name -> tensor), moved to `device`, as span `round_idx` of layer `layer_idx`."""
        self._rounds[layer_idx, round_idx] = {name: t.to(self.device) for name, t in slots.items()}

    def get(self, layer_idx: int, round_idx: int) -> dict[str, torch.Tensor]:
        """The slots stored as span `round_idx` of layer `layer_idx` (a KeyError if none were)."""
        return self._rounds[layer_idx, round_idx]

    def spans(self, layer_idx: int) -> list[dict[str, torch.Tensor]]:
        """Every span stored for layer `layer_idx`, in the order of their indices."""
        return [slots for (layer, _), slots in sorted(self._rounds.items(), key=lambda kv: kv[0]) if layer == layer_idx]

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self._rounds

    def __len__(self) -> int:
        return len(self._rounds)

    def nbytes(self) -> int:
        """Bytes held by the store."""
        return tensor_bytes(t for slots in self._rounds.values() for t in slots.values())
