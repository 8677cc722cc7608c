"""A press on a model that accelerate splits across two places with `device_map` (issue 21).

This machine has one compute device, the CPU: the second place accelerate can put layers on is the disk
(`offload_folder`). The first decoder layers stay on "cpu", the others go to "disk": their weights are on
`meta` between forwards, and each forward of such a layer loads them through accelerate's hooks
(`AlignDevicesHook`, execution device cpu). Every decoder layer carries a hook, and the model's own `forward`
is accelerate's, set on the instance: the press's intercept wraps it and gives it back.

Two ways in: Llama loaded by `from_pretrained(device_map=..., offload_folder=...)`, and Qwen2 (GQA) dispatched
in-process by `dispatch_model` on the map `infer_auto_device_map` makes under a memory cap (no `skip_keys`, as
a user calling it by hand would). A third split, Llama's layers on cuda:0 and cuda:1, runs only where there are
two CUDA devices. For a dense press (SnapKV), a head-wise one (AdaKV), one that evicts while decoding (H2O) and
one that re-rotates kept keys (sink-window, `rerotate=True`), greedy generation equals the same weights on one
device token for token, every layer's cache tensors lie on the execution device of its layer's hook (with the
CPU alone that check is weak: all are cpu; it still shows that no cache tensor is left on `meta`, where the
offloaded weights wait), the held slots are the same bit for bit with the same `cache_bytes`, and the model
leaves the press with its hooks, `forward` and attention implementation as before. A left-padded batch
under SnapKV is compared the same way.
"""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import dispatch_model, infer_auto_device_map
from accelerate.utils import compute_module_sizes
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from kvpress import HeadwiseLayer, PressedLayer, SnapKVPress, cache_bytes
from kvpress.patches.cache import layer_tensors
from kvpress.presses import press_from_name
from tiny import prompt, tiny_model

N_LAYERS = 4
NEW_TOKENS = 12
GREEDY = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)  # no early stop at eos

PRESSES = {
    "snapkv": lambda: SnapKVPress(compression_ratio=0.5, window_size=8),  # dense, evicts at prefill
    "adakv": lambda: press_from_name("adakv", compression_ratio=0.5, window_size=8),  # head-wise storage
    "h2o": lambda: press_from_name("h2o", compression_ratio=0.5),  # evicts at every decoding step too
    "sink-window-rerotate": lambda: press_from_name("sink-window", n_sink=4, window=12, rerotate=True),
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny tensors gain nothing from a second thread, and on a busy 2-core machine its spin-waits make this
    module several times slower (about 20 s with one thread, minutes with two under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _reference(family: str):
    return tiny_model(family, num_hidden_layers=N_LAYERS)


def _load_split(tmp) -> torch.nn.Module:
    """Llama saved, then loaded with layers 0-1 on "cpu" and layers 2-3 offloaded to "disk"."""
    _reference("llama").save_pretrained(tmp / "model")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    device_map |= {f"model.layers.{i}": "cpu" if i < N_LAYERS // 2 else "disk" for i in range(N_LAYERS)}
    model = AutoModelForCausalLM.from_pretrained(
        tmp / "model", device_map=device_map, offload_folder=tmp / "offload", dtype=torch.float32
    )
    return model.eval()


def _dispatch_split(tmp) -> torch.nn.Module:
    """Qwen2 dispatched in-process on accelerate's own map for a CPU that holds about two of its four layers."""
    model = copy.deepcopy(_reference("qwen2"))
    sizes = compute_module_sizes(model)
    cap = sizes[""] - sizes["model.layers.2"] - sizes["model.layers.3"] + sizes["model.layers.0"]  # + a layer's room
    device_map = infer_auto_device_map(model, max_memory={"cpu": cap}, no_split_module_classes=model._no_split_modules)
    return dispatch_model(model, device_map, offload_dir=tmp / "offload").eval()


def _split_gpus(tmp) -> torch.nn.Module:
    """Llama loaded with layers 0-1 on cuda:0 and layers 2-3 on cuda:1 (two real devices, where there are)."""
    _reference("llama").save_pretrained(tmp / "model")
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1}
    device_map |= {f"model.layers.{i}": 0 if i < N_LAYERS // 2 else 1 for i in range(N_LAYERS)}
    return AutoModelForCausalLM.from_pretrained(tmp / "model", device_map=device_map, dtype=torch.float32).eval()


def _one_gpu(tmp) -> torch.nn.Module:
    """The same weights on cuda:0 alone (GPU and CPU kernels round differently: compare GPU with GPU)."""
    return AutoModelForCausalLM.from_pretrained(tmp / "model", device_map={"": 0}, dtype=torch.float32).eval()


HALF = N_LAYERS // 2
SPLITS = {  # name: (family, the split model, the reference, where each decoder layer's weights are between forwards)
    "llama-disk": ("llama", _load_split, None, ["cpu"] * HALF + ["disk"] * HALF),
    "qwen2-disk": ("qwen2", _dispatch_split, None, None),  # accelerate's map: checked to split, not fixed here
    "llama-2gpus": ("llama", _split_gpus, _one_gpu, ["cuda:0"] * HALF + ["cuda:1"] * HALF),
}
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@pytest.fixture(scope="module", params=[pytest.param(n, marks=TWO_GPUS) if "gpu" in n else n for n in SPLITS])
def split(request, tmp_path_factory):
    """(the split model, the same weights on one device, where each decoder layer is)."""
    family, make, make_reference, places = SPLITS[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    with torch.inference_mode():
        model = make(tmp)
        reference = _reference(family) if make_reference is None else make_reference(tmp)
    places = places or list(_places(model).values())
    assert len(set(places)) == 2 and places == sorted(places), places  # the first layers on one, the rest on another
    return model, reference, dict(enumerate(places))


def _places(model) -> dict[int, str]:
    """Where each decoder layer's weights are between forwards: a device, or "disk" (on `meta` until a forward)."""
    out = {}
    for i, block in enumerate(model.model.layers):
        weight = block.self_attn.k_proj.weight
        out[i] = "disk" if weight.device.type == "meta" else str(weight.device)
    return out


def _execution_device(place: str) -> torch.device:
    """Where a layer's forward runs: its own device, or the cpu for a layer offloaded to disk on this machine."""
    return torch.device("cpu" if place == "disk" else place)


def _state(model) -> dict:
    """What installing a press touches and leaving it must give back, by identity."""
    return {
        "forward": model.__dict__.get("forward"),
        "attn": model.config._attn_implementation,
        "hooks": {name: getattr(m, "_hf_hook", None) for name, m in model.named_modules()},
        "forwards": {name: m.__dict__.get("forward") for name, m in model.named_modules()},
        "attention_names": sorted(AttentionInterface._global_mapping),
        "mask_names": sorted(AttentionMaskInterface._global_mapping),
    }


def _assert_same_state(before: dict, after: dict) -> None:
    assert after["forward"] is before["forward"]
    assert after["attn"] == before["attn"]
    assert after["attention_names"] == before["attention_names"] and after["mask_names"] == before["mask_names"]
    for key in ("hooks", "forwards"):
        assert after[key].keys() == before[key].keys()
        moved = [name for name, value in after[key].items() if value is not before[key][name]]
        assert not moved, f"{key} changed on {moved}"


def _held(layer) -> list[torch.Tensor]:
    """The held part of every tensor a cache layer keeps (the room reserved past it is uninitialised)."""
    if isinstance(layer, HeadwiseLayer):
        out = [layer.real_seen]
        for row in range(layer.batch):
            out += [layer.slot(name, row, head) for head in range(layer.heads) for name in layer.store]
        return out
    out = [*layer.held_kv(), *(t[..., : layer.n] for t in layer.slots.values())]
    return out + [t for t in (layer.real_seen, layer.shift) if t is not None]


def _generate(model, ids, press=None, mask=None):
    cache = DynamicCache(config=model.config)
    kwargs = dict(attention_mask=mask, cache=cache, **GREEDY)
    if press is None:
        return model.generate(ids, **kwargs), cache
    with press(model):
        out = model.generate(ids, **kwargs)
    return out, cache


def test_layers_are_split_with_hooks(split):
    model, _, places = split
    assert _places(model) == places
    assert "forward" in model.__dict__  # accelerate's forward on the instance: the intercept must wrap it
    for i, block in enumerate(model.model.layers):
        hook = block._hf_hook  # an AlignDevicesHook on every decoder layer
        assert type(hook).__name__ == "AlignDevicesHook"
        assert torch.device(hook.execution_device) == _execution_device(places[i])
        if places[i] == "disk":  # the weights come from the offload folder at each forward of their module
            assert block.self_attn.k_proj._hf_hook.offload


@pytest.mark.parametrize("name", list(PRESSES))
def test_press_on_split_model_equals_one_device(split, name):
    model, reference, places = split
    ids = prompt(1, 48).to(reference.device)
    before = _state(model)
    plain_before, _ = _generate(model, ids)

    want, want_cache = _generate(reference, ids, PRESSES[name]())
    press = PRESSES[name]()
    got, cache = _generate(model, ids, press)

    assert torch.equal(got.cpu(), want.cpu())
    assert cache_bytes(cache) == cache_bytes(want_cache)
    expected_type = HeadwiseLayer if press.per_head else PressedLayer
    for i, (layer, ref_layer) in enumerate(zip(cache.layers, want_cache.layers, strict=True)):
        assert type(layer) is expected_type
        device = torch.device(model.model.layers[i]._hf_hook.execution_device)
        assert device == _execution_device(places[i])
        tensors = layer_tensors(layer)
        assert tensors and all(t.device == device for t in tensors), (i, {t.device for t in tensors})
        held, ref_held = _held(layer), _held(ref_layer)
        assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(held, ref_held, strict=True))
        assert layer.seen == ids.shape[1] + NEW_TOKENS - 1  # the last generated token is never fed
        kept = sum(layer.lengths) / layer.heads if isinstance(layer, HeadwiseLayer) else layer.n
        assert kept < layer.seen  # compressed, on the layers of either place alike

    _assert_same_state(before, _state(model))
    assert _places(model) == places  # offloaded weights went back to `meta` after each forward
    plain_after, _ = _generate(model, ids)
    assert torch.equal(plain_after, plain_before)
    assert torch.equal(plain_after.cpu(), _generate(reference, ids)[0].cpu())


def test_padded_batch_on_split_model_equals_one_device(split):
    """Left padding: the padded rows' `valid` slots and each layer's own mask, on a split model."""
    model, reference, _ = split
    rows = [prompt(1, 40, seed=1)[0], prompt(1, 28, seed=2)[0]]
    ids = torch.zeros(2, 40, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, 40 - len(row) :], mask[i, 40 - len(row) :] = row, 1
    ids, mask = ids.to(reference.device), mask.to(reference.device)
    want, want_cache = _generate(reference, ids, PRESSES["snapkv"](), mask)
    got, cache = _generate(model, ids, PRESSES["snapkv"](), mask)
    assert torch.equal(got.cpu(), want.cpu())
    assert cache_bytes(cache) == cache_bytes(want_cache)
    assert all("valid" in layer.slots for layer in cache.layers)


def test_a_saved_cache_loads_onto_each_layers_execution_device(split, tmp_path):
    """load_cache put a layer's keys and values beside its weights: an offloaded layer's wait on `meta`, so its cache
    went there (its data lost) and the next forward failed on a device mismatch. Each layer's goes to its hook's
    execution device, and the loaded cache continues as the one saved."""
    import kvpress

    model, _, places = split
    ids = prompt(1, 40).to(model.device)
    cache = DynamicCache(config=model.config)
    with PRESSES["snapkv"]()(model):
        model(ids[:, :-1], cache=cache)
    kvpress.save_cache(cache, tmp_path / "c.safetensors", model, press="snapkv:compression_ratio=0.5:window_size=8")
    loaded = kvpress.load_cache(tmp_path / "c.safetensors", model)
    for i, layer in enumerate(loaded.layers):
        assert all(t.device == _execution_device(places[i]) for t in layer_tensors(layer)), i
    outs = []
    for c in (cache, loaded):
        with PRESSES["snapkv"]()(model):
            outs.append(model.generate(ids, cache=c, **GREEDY))
    assert torch.equal(outs[0], outs[1])
