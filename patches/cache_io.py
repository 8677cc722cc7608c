"""A cache layer's whole state as named tensors plus JSON-safe fields, and back (for saved caches).

Every attribute of a layer is kept: tensors as they are, lists and dicts of tensors (per-head storage, per-slot
state) element by element, plain fields (counts, flags, the window, the press that made a head-wise layer)
as JSON. Nothing is pickled; a layer class not listed in `LAYER_CLASSES` is refused.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvpress.patches.cache import PressedLayer
from kvpress.patches.head_cache import HeadwiseLayer

LAYER_CLASSES = {cls.__name__: cls for cls in (PressedLayer, HeadwiseLayer, DynamicLayer, DynamicSlidingWindowLayer)}
_PLAIN = (int, float, bool, str, type(None))


def check_savable(layer) -> None:
    """Raise ValueError unless `layer` is of a class a saved cache holds."""
    name = type(layer).__name__
    if name not in LAYER_CLASSES:
        raise ValueError(f"a {name} cache layer cannot be saved (kvpress saves {', '.join(LAYER_CLASSES)})")


def layer_state(layer, prefix: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(`tensors` named under `prefix`, `fields`) of `layer`; raises ValueError for what cannot be saved."""
    check_savable(layer)
    name = type(layer).__name__
    if getattr(layer, "pending", 0) or getattr(layer, "torn", False):
        raise ValueError(
            "this cache was left half-updated by a forward that raised (or by `scratch`, which cannot undo an "
            "eviction inside); it cannot be saved"
        )
    tensors, fields = {}, {"class": name, "plain": {}, "tensor": [], "list": {}, "dict": {}, "dict_list": {}}
    state = vars(layer)
    if isinstance(layer, PressedLayer) and layer.keys is not None and layer.keys.dim() == 4:  # its held slots only:
        n = layer.n  # the room after them (`SPARE`) holds whatever its memory held
        state = {**state, "keys": layer.keys[:, :, :n], "values": layer.values[:, :, :n],
                 "slots": {k: t[..., :n] for k, t in layer.slots.items()}}  # fmt: skip
    for attr, value in state.items():
        key = f"{prefix}.{attr}"
        if isinstance(value, torch.Tensor):
            tensors[key] = value
            fields["tensor"].append(attr)
        elif isinstance(value, (torch.device, torch.dtype)):
            fields["plain"][attr] = {"device" if isinstance(value, torch.device) else "dtype": str(value)}
        elif isinstance(value, _PLAIN) or (isinstance(value, list) and all(isinstance(v, _PLAIN) for v in value)):
            fields["plain"][attr] = value
        elif isinstance(value, list) and all(isinstance(v, torch.Tensor) for v in value):
            tensors.update({f"{key}.{i}": v for i, v in enumerate(value)})
            fields["list"][attr] = len(value)
        elif isinstance(value, dict) and all(isinstance(v, torch.Tensor) for v in value.values()):
            tensors.update({f"{key}.{k}": v for k, v in value.items()})
            fields["dict"][attr] = list(value)
        elif isinstance(value, dict) and all(isinstance(v, list) for v in value.values()):
            tensors.update({f"{key}.{k}.{i}": t for k, ts in value.items() for i, t in enumerate(ts)})
            fields["dict_list"][attr] = {k: len(ts) for k, ts in value.items()}
        else:
            raise ValueError(f"{name}.{attr} ({type(value).__name__}) cannot be saved")
    return {k: t.contiguous() for k, t in tensors.items()}, fields


def layer_from_state(tensors: dict[str, torch.Tensor], fields: dict, prefix: str, device: torch.device):
    """The layer `layer_state` described, its tensors on `device`; not driven by any press yet."""
    cls = LAYER_CLASSES.get(fields.get("class"))
    if cls is None:
        raise ValueError(f"unknown cache layer class {fields.get('class')!r} (loadable: {', '.join(LAYER_CLASSES)})")
    if cls is HeadwiseLayer and "keys_h" in fields["list"]:
        raise ValueError("this head-wise layer was saved by a kvpress before per-head storage was packed: compress "
                         "the prompt again and save it anew")  # fmt: skip
    layer = cls.__new__(cls)
    state = {}
    for attr, value in fields["plain"].items():
        if isinstance(value, dict) and "device" in value:
            value = device
        elif isinstance(value, dict) and "dtype" in value:
            value = getattr(torch, str(value["dtype"]).removeprefix("torch."), None)
            if not isinstance(value, torch.dtype):  # (any attribute of torch was taken: a function, say)
                raise ValueError(f"{cls.__name__}.{attr} names no torch dtype")
        state[attr] = value
    for attr in (*state, *fields["tensor"], *fields["list"], *fields["dict"], *fields["dict_list"]):
        if not str(attr).isidentifier() or attr.startswith("__") or callable(getattr(cls, attr, None)):
            raise ValueError(f"{cls.__name__} has no field {attr!r} (a method or a name no layer sets)")
    take = lambda key: tensors[f"{prefix}.{key}"].to(device)  # noqa: E731
    state.update({attr: take(attr) for attr in fields["tensor"]})
    state.update({attr: [take(f"{attr}.{i}") for i in range(n)] for attr, n in fields["list"].items()})
    state.update({attr: {k: take(f"{attr}.{k}") for k in keys} for attr, keys in fields["dict"].items()})
    state.update({attr: {k: [take(f"{attr}.{k}.{i}") for i in range(n)] for k, n in sizes.items()}
                  for attr, sizes in fields["dict_list"].items()})  # fmt: skip
    vars(layer).update(state)
    if hasattr(layer, "driven"):
        layer.driven = False
    return layer
