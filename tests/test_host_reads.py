"""A decoding step reads nothing back from the device: on a GPU each such read (`.item()`, `bool(t)`, `.tolist()`,
`nonzero`) waits for every kernel queued before it, so the host stops feeding the device once per layer. Here the
cache and the model move to torch's meta device after the prefill, where reading any value raises, and the press
decodes on: through steps that append and steps that evict."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, DynamicCache

from kvpress import DuoAttentionPress, HeadwiseLayer
from kvpress.patches import intercept
from kvpress.presses import defaults, kvzap, press_from_name, press_names, press_parameters
from tiny import CONFIGS, SLIDING, join_low_ids, prompt, refused_on_sliding, tiny_model, tiny_pattern, tiny_scorer

# a prompt of few-shot questions (ShotKV's marker), about 250 tokens
TEXT = " ".join(f"Question: what is {i} plus {i}? Answer: {2 * i}." for i in range(20))
SMALL = {"window_size": 4, "window": 8, "n_sink": 2, "chunk": 16, "lag_size": 16, "span_size": 8,
         "similarity_window": 8, "query_window": 8}  # fmt: skip
REAL_STEPS, META_STEPS = 3, 24


# the packaged defaults too (a packaged scorer does not fit the tiny model: the tiny one stands in, conftest.py),
# and StreamingLLM's re-rotated keys
SPECS = {f"default-{model}": re.sub(r":scorer=[^:]+", "", spec) for model, spec in
         [("any", defaults.DEFAULT_PRESS), *((m, e["press"]) for m, e in defaults._table()["models"].items())]}
SPECS["rerotated"] = "sink-window:n_sink=2:rerotate=true"


def _reads_to_evict(press) -> bool:
    """Whether a decoding step that evicts reads the device: budgets per head (AdaKV, TAPPA) decide how many slots
    each head keeps from its scores, and re-rotated keys (`rerotate=True`) are rotated by how far each moved."""
    return (press.per_head and not press.needs_whole_context and not isinstance(press, DuoAttentionPress)) \
        or press.rerotate  # fmt: skip


def _press(name: str, model):
    """`name` at r = 0.5 with small windows; a press that reads to evict evicts on the CPU only: its decode_slack
    lets the meta steps run under budget."""
    if name in SPECS:
        probe = press_from_name(SPECS[name], compression_ratio=0.5)
        return press_from_name(SPECS[name], compression_ratio=0.5,
                               **({"decode_slack": 0.5} if _reads_to_evict(probe) else {}))  # fmt: skip
    params = press_parameters(name)
    settings = {k: v for k, v in SMALL.items() if k in params and params[k] is not None}
    if name == "duo-attention":
        settings["head_pattern"] = tiny_pattern(model)
    elif _reads_to_evict(press_from_name(name, compression_ratio=0.5)):
        settings["decode_slack"] = 0.5
    return press_from_name(name, compression_ratio=0.5, **settings)


HOST = {"head_budget"}  # what a layer keeps on the host by design


def _to_meta(layer) -> None:
    """Every tensor a cache layer holds on the device (in attributes, or in dicts of them) moved to the meta one."""
    for name, value in list(vars(layer).items()):
        if name in HOST:
            continue
        if isinstance(value, torch.Tensor):
            setattr(layer, name, value.to("meta"))
        elif isinstance(value, dict) and any(isinstance(t, torch.Tensor) for t in value.values()):
            setattr(layer, name, {k: t.to("meta") if isinstance(t, torch.Tensor) else t for k, t in value.items()})
        elif isinstance(value, torch.device):
            setattr(layer, name, torch.device("meta"))


class _NoCopyIn(TorchDispatchMode):
    """Raises on a blocking copy from the host to the device: CUDA waits for the queued kernels first, as for a
    read (a `non_blocking` one from pageable memory is staged and returns at once)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) and not kwargs.get("non_blocking"):
            copy = func is torch.ops.aten.copy_.default
            source, target = (args[1], args[0].device) if copy else (args[0], kwargs.get("device"))
            if source.device.type == "cpu" and target is not None and torch.device(target).type == "meta":
                raise RuntimeError(f"{func} copies a host tensor {tuple(source.shape)} to the device")
        return func(*args, **kwargs)


@contextlib.contextmanager
def _no_host_tensors():
    """`torch.tensor` / `torch.as_tensor` of host data onto the device raise (a copy in, not dispatched)."""
    made = {"tensor": torch.tensor, "as_tensor": torch.as_tensor}

    def guard(name):
        def make(data, *args, device=None, **kwargs):
            on_device = device is not None and torch.device(device).type == "meta"
            if on_device and not (isinstance(data, torch.Tensor) and data.device.type == "meta"):
                raise RuntimeError(f"torch.{name} copies host data {data!r:.60} to the device")
            return made[name](data, *args, device=device, **kwargs)

        return make

    try:
        for name in made:
            setattr(torch, name, guard(name))
        with _NoCopyIn():
            yield
    finally:
        for name, fn in made.items():
            setattr(torch, name, fn)


def _held(cache: DynamicCache) -> list[int]:
    """Slots held per layer: a dense layer's per head, a head-wise layer's over every (row, KV head)."""
    return [sum(layer.lengths) if isinstance(layer, HeadwiseLayer) else layer.n for layer in cache.layers]


def _growth(cache: DynamicCache) -> list[int]:
    """Slots a decoding step adds to each layer when it evicts nothing."""
    return [len(layer.lengths) if isinstance(layer, HeadwiseLayer) else 1 for layer in cache.layers]


def _decode_on_meta(name: str, tokenizer, monkeypatch, padded: bool) -> DynamicCache:
    """Prefill and 3 steps on the CPU, then 24 steps on the meta device (see the module docstring); `padded`: a
    batch of two rows, the second left-padded, with its 2D attention mask. Returns the cache."""
    torch.manual_seed(0)
    config = CONFIGS["llama"](num_hidden_layers=3, vocab_size=len(tokenizer))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    monkeypatch.setattr(kvzap, "find_scorer", lambda model: join_low_ids(tiny_scorer(model), model))  # words too
    press = _press(name, model)
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    mask = None
    if padded:
        ids = torch.cat([ids, ids])
        mask = torch.ones_like(ids)
        mask[1, :7] = 0

    def step_mask(step: int, device: str = "cpu"):  # the mask of decoding step `step`: every new token real
        return None if mask is None else torch.cat([mask, torch.ones(2, step + 1, dtype=torch.long)], 1).to(device)

    cache = DynamicCache(config=model.config)
    # outside inference mode: a dispatch mode does not see the copies and reads of inference tensors
    with torch.inference_mode(False), torch.no_grad(), press(model, tokenizer=tokenizer):
        try:
            model(input_ids=ids, attention_mask=mask, cache=cache)
        except ValueError as error:  # a press that scores a prompt whole, or one at a time, refuses padded rows
            if not padded:
                raise
            pytest.skip(f"{name} takes no padded batch: {error}")
        for step in range(REAL_STEPS):
            model(input_ids=ids[:, step : step + 1], attention_mask=step_mask(step), cache=cache)
        if padded:  # the one read a forward, of its mask (whether a new token is padding), stood in: none is
            monkeypatch.setattr(intercept, "new_padding", lambda mask, q: None)
        before = _held(cache)
        model.to("meta")
        for layer in cache.layers:
            _to_meta(layer)
        for step in range(META_STEPS):  # raises where a step reads a value
            new, step_mask_meta = ids[:, step : step + 1].to("meta"), step_mask(REAL_STEPS + step, "meta")
            # the first step may copy in once what a press keeps of the model (KVzap's scorer on the new device)
            with _no_host_tensors() if step else contextlib.nullcontext():
                model(input_ids=new, attention_mask=step_mask_meta, cache=cache)
    grown = [b + META_STEPS * g for b, g in zip(before, _growth(cache), strict=True)]
    assert cache.get_seq_length() == ids.shape[1] + REAL_STEPS + META_STEPS
    if press.needs_whole_context or _reads_to_evict(press):
        assert _held(cache) == grown  # it evicted before (a pass over the prompt, or on the CPU), not on meta
    else:
        assert sum(_held(cache)) < sum(grown), "no step evicted on the meta device"
    return cache


@pytest.mark.parametrize("name", [*press_names(), *SPECS])
def test_decoding_reads_nothing_back(name, tokenized, monkeypatch):
    _decode_on_meta(name, tokenized[1], monkeypatch, padded=False)


@pytest.mark.parametrize("name", [*press_names(), *SPECS])
def test_a_padded_batch_decodes_without_reads(name, tokenized, monkeypatch):
    """A left-padded batch too: each row's counts are read once and then kept on the host (`seen_list`, `held`)."""
    _decode_on_meta(name, tokenized[1], monkeypatch, padded=True)


class _Reads(TorchDispatchMode):
    """Counts the reads of a tensor's value on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_a_padding_mask_is_read_once_a_forward():
    """With a 2D attention mask, whether a step's token is padding is read once per forward, not once per layer."""
    model = tiny_model("llama", num_hidden_layers=4)
    ids = prompt(length=40)
    cache = DynamicCache(config=model.config)
    # outside inference mode: a dispatch mode does not see the reads of inference tensors
    with torch.inference_mode(False), torch.no_grad(), press_from_name("knorm", compression_ratio=0.5)(model):
        model(input_ids=ids.clone(), attention_mask=torch.ones_like(ids), cache=cache)
        mask = torch.ones(1, ids.shape[1] + 1, dtype=torch.long)
        with _Reads() as reads:  # the step fills the budget (21 of 41 tokens): nothing is evicted
            model(input_ids=ids[:, :1].clone(), attention_mask=mask, cache=cache)
    assert reads.count == 1


def _check_host_counts(cache: DynamicCache) -> int:
    """Assert each padded layer's host counts (`seen_list`, `held`) equal the device's; how many layers had them."""
    checked = 0
    for layer in cache.layers:
        if isinstance(layer, HeadwiseLayer):
            if layer.padded and layer._seen_rows is not None:
                assert layer._seen_rows == layer.real_seen.tolist()
                checked += 1
        elif getattr(layer, "padded", False):
            if layer._seen_rows is not None:
                assert layer._seen_rows == layer.real_seen.tolist()
                checked += 1
            if layer._held_rows is not None:
                valid = layer.valid
                device_held = [layer.n] * layer.keys.shape[0] if valid is None else valid.sum(-1).amax(-1).tolist()
                assert layer._held_rows == device_held
                checked += 1
    return checked


@pytest.mark.parametrize("family", ["llama", "mistral-window", "gemma3"])
@pytest.mark.parametrize("name", ["snapkv", "h2o", "sink-window", "pyramidkv", "adakv", "duo-attention", "think"])
def test_a_padded_batch_keeps_its_counts_on_the_host_right(family, name):
    """The host's copies of a padded batch's per-row counts follow the device's through a chunked prefill, steps
    that evict and a sliding window's trimming (rows of different lengths, so every path of `_evict_rows` runs)."""
    if family in SLIDING and refused_on_sliding(name):
        pytest.skip(refused_on_sliding(name))
    model = tiny_model(family)
    settings = {"window_size": 2} if name in ("snapkv", "adakv", "think", "pyramidkv") else {}
    if name == "duo-attention":
        settings = {"head_pattern": tiny_pattern(model), "window": 8, "n_sink": 2}
    press = press_from_name(name, compression_ratio=0.5, **settings)
    ids = prompt(batch=3, length=40)
    mask = torch.ones_like(ids)
    mask[1, :9], mask[2, :3] = 0, 0
    cache = DynamicCache(config=model.config)
    checked = 0
    with press(model):
        for start in range(0, 40, 16):  # the prompt in chunks, as prefill_chunk_size does
            model(input_ids=ids[:, start : start + 16], attention_mask=mask[:, : start + 16], cache=cache)
            checked += _check_host_counts(cache)
        for step in range(12):
            mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
            model(input_ids=ids[:, step : step + 1], attention_mask=mask, cache=cache)
            checked += _check_host_counts(cache)
    assert checked > 0, "no layer kept its counts on the host"


@pytest.mark.parametrize("name", ["adakv", "duo-attention"])
def test_one_varlen_call_reads_nothing_back(name, tokenized, monkeypatch):
    """CUDA's path for head-wise layers (one variable-length call a layer, `headwise_attention._varlen`) on the meta
    device, its kernel stood in by one that reads nothing: what kvpress builds around the call reads nothing back."""
    from kvpress.patches import headwise_attention as hw

    calls = []
    monkeypatch.setattr(hw, "VARLEN_DEVICES", ("meta",))
    monkeypatch.setattr(hw, "FLASH_DTYPES", (*hw.FLASH_DTYPES, torch.float32))
    monkeypatch.setattr(hw, "_flash_runs_on", lambda device: True)
    monkeypatch.setattr(hw, "flash_varlen", lambda query, *a: calls.append(a[-1].shape) or torch.empty_like(query))
    cache = _decode_on_meta(name, tokenized[1], monkeypatch, padded=False)
    headwise = sum(isinstance(layer, HeadwiseLayer) for layer in cache.layers)
    assert headwise and len(calls) == headwise * META_STEPS  # every head-wise layer at every step on the meta device
