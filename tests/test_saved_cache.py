"""Saved caches: `save_cache` -> `load_cache` in a new process gives the same answers; another architecture
or a damaged file is refused."""

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress import AdaKVPress, SnapKVPress
from kvpress.saved_cache import read_metadata
from tiny import prompt, tiny_model

PRESSES = {  # the spec save_cache records -> the press
    "snapkv:compression_ratio=0.5:window_size=4": lambda: SnapKVPress(0.5, window_size=4),
    "adakv:compression_ratio=0.5:window_size=4": lambda: AdaKVPress(SnapKVPress(0.5, window_size=4)),  # per head
    "adakv:compression_ratio=0.5:window_size=4:kv_bits=4":
        lambda: AdaKVPress(SnapKVPress(0.5, window_size=4, kv_bits=4)),  # per-head codes
    "snapkv:compression_ratio=0.5:window_size=4:kv_bits=8": lambda: SnapKVPress(0.5, window_size=4, kv_bits=8),
}
FAMILIES = {"llama": {}, "gemma3": {}}  # gemma3: sliding-window layers past their window
TESTS = Path(__file__).resolve().parent


def _continue(model, cache, press, ids) -> torch.Tensor:
    with press(model):
        return model.generate(ids, cache=cache, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)


def test_saved_caches_answer_the_same_in_a_new_process(tmp_path):
    """Each press on each family: the cache saved here, loaded in a new process (one for all of them, as a process
    costs seconds), continues with the same tokens."""
    cases = [(family, name) for family in FAMILIES for name in PRESSES]
    expected = []
    for i, (family, name) in enumerate(cases):
        model = tiny_model(family, **FAMILIES[family])
        ids = prompt(1, 40)
        cache = DynamicCache(config=model.config)
        with PRESSES[name]()(model):
            model(ids[:, :-1], cache=cache)
        kvpress.save_cache(cache, tmp_path / f"{i}.safetensors", model, press=name)
        assert read_metadata(tmp_path / f"{i}.safetensors")["press"] == name
        expected.append(str(_continue(model, cache, PRESSES[name](), ids)[0].tolist()))
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(TESTS)!r})
        import kvpress, tiny
        from tiny import prompt, tiny_model
        from test_saved_cache import PRESSES, FAMILIES, _continue
        for i, (family, name) in enumerate({cases!r}):
            tiny._MODELS.clear()  # a model built afresh for each cache, as a process of its own would
            model = tiny_model(family, **FAMILIES[family])
            cache = kvpress.load_cache({str(tmp_path)!r} + f"/{{i}}.safetensors", model)
            print("continued", i, _continue(model, cache, PRESSES[name](), prompt(1, 40))[0].tolist())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = [line.split(" ", 2) for line in done.stdout.splitlines() if line.startswith("continued ")]
    assert [int(i) for _, i, _ in got] == list(range(len(cases)))
    for case, mine, (_, _, theirs) in zip(cases, expected, got, strict=True):
        assert theirs == mine, case


def test_a_saved_dense_layer_holds_its_slots_not_the_room_after_them(tmp_path):
    """Decoding leaves room after a dense layer's slots (`SPARE`), uninitialised memory: the file holds the slots."""
    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    ids = prompt(1, 40)
    with SnapKVPress(0.0)(model):
        model.generate(ids, cache=cache, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert all(layer.keys.shape[-2] > layer.n for layer in cache.layers)
    path = tmp_path / "cache.safetensors"
    kvpress.save_cache(cache, path, model)
    loaded = kvpress.load_cache(path, model)
    for layer, saved in zip(cache.layers, loaded.layers, strict=True):
        assert saved.keys.shape[-2] == saved.n == layer.n
        assert all(t.shape[-1] == layer.n for t in saved.slots.values())
        assert torch.equal(saved.keys, layer.keys[:, :, : layer.n]) and torch.equal(saved.pos, layer.pos)
    # read into memory, not mapped from the file: safetensors' memory map kept ~70 bytes a tensor after each load
    # (3,000 loads of a 24 KB cache: RSS up 16 MB), and a loaded cache held the file mapped while it lived
    maps = Path("/proc/self/maps")  # (Linux)
    assert not maps.exists() or str(path) not in maps.read_text()


def _saved(tmp_path: Path) -> tuple:
    """A tiny Llama, a cache SnapKV compressed from 40 tokens, and the file it was saved to."""
    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    with SnapKVPress(0.5, window_size=4)(model):
        model(prompt(1, 40), cache=cache)
    path = tmp_path / "cache.safetensors"
    kvpress.save_cache(cache, path, model)
    return model, cache, path


def test_another_architecture_or_a_damaged_file_is_refused(tmp_path):
    model, cache, path = _saved(tmp_path)
    with pytest.raises(ValueError, match="only continues the model that made it"):
        kvpress.load_cache(path, tiny_model("llama", num_hidden_layers=3))
    half = copy.deepcopy(model).to(torch.bfloat16)  # same architecture, another dtype: sdpa would refuse the keys
    with pytest.raises(ValueError, match="a model in torch.float32; this one computes in torch.bfloat16"):
        kvpress.load_cache(path, half)
    # the same architecture with other weights (a base model and its instruct one, a fine-tune): loaded and
    # continued without a word before (other tokens than either model's own)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[1].mlp.down_proj.weight.mul_(1.5)
    with pytest.raises(ValueError, match=r"made with other weights .* model.layers.1.mlp.down_proj.weight differs"):
        kvpress.load_cache(path, other)
    assert kvpress.load_cache(path, copy.deepcopy(model)).get_seq_length() == 40  # (a copy of the same weights)
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="damaged"):
        kvpress.load_cache(tmp_path / "cut.safetensors", model)
    (tmp_path / "junk.safetensors").write_bytes(b"not a cache")
    with pytest.raises(ValueError, match="not a cache saved by kvpress.save_cache"):
        kvpress.load_cache(tmp_path / "junk.safetensors", model)
    with pytest.raises(TypeError, match="press= is the spec of the press that compressed the cache"):
        kvpress.save_cache(cache, path, model, press=SnapKVPress(0.5, window_size=4))
    with pytest.raises(ValueError, match="unknown press 'nonsense'"):
        kvpress.save_cache(cache, path, model, press="nonsense:xyz=1")  # --load-cache would continue with it
    with pytest.raises(FileNotFoundError, match="does not exist"):
        kvpress.load_cache(tmp_path / "none.safetensors", model)
    kvpress.save_cache(cache, path, model, press="default:compression_ratio=0.5")  # recorded as this model's default
    assert kvpress.saved_cache.read_metadata(path)["press"] == kvpress.resolve_default("default:compression_ratio=0.5",
                                                                                        model)  # fmt: skip
    assert not kvpress.saved_cache.read_metadata(path)["press"].startswith("default")


def test_a_cache_of_another_window_another_model_or_a_half_updated_forward_is_refused(tmp_path):
    """Found by an audit: the architecture hash left the sliding window out, so a cache of every-layer-window-16
    Mistral loaded into the same Mistral without a window (15 tokens held of 40 seen: logits off by 0.2; the hash
    now tells them apart, and the file's layer kinds are checked too); a cache
    saved under another model's name loaded into it and failed at the next forward (IndexError); a plain cache
    whose forward raised after some layers ran (45, 45, 40 tokens) was saved and failed as it was continued."""
    from kvpress.patterns import config_hash

    windowed, full = tiny_model("mistral-window"), tiny_model("mistral")
    assert config_hash(windowed) != config_hash(full)
    cache = DynamicCache(config=windowed.config)
    windowed(prompt(1, 40), cache=cache)
    path = tmp_path / "cache.safetensors"
    kvpress.save_cache(cache, path, windowed)
    kvpress.load_cache(path, windowed)
    with pytest.raises(ValueError, match=rf"architecture hash {config_hash(windowed)}; this MistralForCausalLM has "
                                         rf"{config_hash(full)}: a cache only continues"):  # fmt: skip
        kvpress.load_cache(path, full)
    # a file saved before the hash named layer kinds (the windowed model's hash then was the full one's): its layer
    # kinds, recorded since before, still refuse it
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    old = tmp_path / "old.safetensors"
    save_file(load_file(path), old, metadata={**meta, "kvpress": json.dumps({**json.loads(meta["kvpress"]),
                                                                           "config_hash": config_hash(full)})})
    with pytest.raises(ValueError, match=r"attend as sliding_attention x 2 \(window 16\); this MistralForCausalLM's "
                                         r"attend as full_attention x 2: a cache only continues"):  # fmt: skip
        kvpress.load_cache(old, full)
    with pytest.raises(ValueError, match="or the file was saved before 2026-12-07"):  # (the windowed model's, moved)
        kvpress.load_cache(old, windowed)
    with pytest.raises(ValueError, match="this cache has 2 layers and this LlamaForCausalLM 3: save a cache with"):
        kvpress.save_cache(cache, path, tiny_model("llama", num_hidden_layers=3))
    with pytest.raises(ValueError, match="hold 2 KV heads of size 16 and this LlamaForCausalLM 4 of size 16: save"):
        kvpress.save_cache(cache, path, tiny_model("llama", num_key_value_heads=4))  # (loaded, then a raw mismatch)
    with pytest.raises(ValueError, match="hold 2 KV heads of size 16 and this LlamaForCausalLM 2 of size 32"):
        kvpress.save_cache(cache, path, tiny_model("llama", head_dim=32))
    headwise, quantized = DynamicCache(config=full.config), DynamicCache(config=full.config)
    with kvpress.AdaKVPress(kvpress.SnapKVPress(0.5, window_size=4))(full):
        full(prompt(1, 40), cache=headwise)
    with kvpress.SnapKVPress(0.5, window_size=4, kv_bits=4)(full):
        full(prompt(1, 40), cache=quantized)
    for held in (headwise, quantized):  # (a head-wise layer's placeholder, 4-bit codes: counted as what they hold)
        kvpress.save_cache(held, path, full)
        with pytest.raises(ValueError, match="hold 2 KV heads of size 16"):
            kvpress.save_cache(held, path, tiny_model("mistral", num_key_value_heads=4))
    model = tiny_model("llama", num_hidden_layers=3)
    cache = DynamicCache(config=model.config)
    model(prompt(1, 40), cache=cache)
    hook = model.model.layers[2].register_forward_pre_hook(lambda *_: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        model(prompt(1, 5, seed=3), cache=cache)
    hook.remove()
    with pytest.raises(ValueError, match=r"seen different numbers of tokens \(40 to 45\): a forward that raised"):
        kvpress.save_cache(cache, path, model)


def test_a_crafted_saved_cache_is_refused_by_name(tmp_path):
    """A saved cache's metadata rebuilt a layer from any attribute it named: a field named after a method replaced it
    (`get_seq_length` became torch.seed), a dtype could name any attribute of torch (`torch.load`); metadata that is
    not an object, lacks its keys, nests deeply or lists other layers than the model's raised AttributeError,
    KeyError, RecursionError, or loaded (an audit of untrusted files)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model, cache, path = _saved(tmp_path)
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["kvpress"])
    tensors = load_file(path)

    def crafted(change) -> Path:
        made = tmp_path / "crafted.safetensors"
        save_file(tensors, made, metadata={"kvpress": change(json.loads(json.dumps(meta)))})
        return made

    def plain(**fields):
        def change(m):
            m["layers"][0]["plain"].update(fields)
            return json.dumps(m)
        return change

    cases = [
        (plain(get_seq_length={"dtype": "seed"}), "names no torch dtype"),
        (plain(anything={"dtype": "load"}), "names no torch dtype"),
        (plain(get_seq_length=3), "PressedLayer has no field 'get_seq_length'"),
        (plain(__class__="x"), "PressedLayer has no field '__class__'"),
        (lambda m: json.dumps([m]), "its metadata is not a JSON object"),
        (lambda m: json.dumps({k: v for k, v in m.items() if k != "config_hash"}), r"lacks \['config_hash'\]"),
        (lambda m: json.dumps({**m, "layers": "x"}), "has no list of layers"),
        (lambda m: json.dumps({**m, "layers": m["layers"][:1]}), "holds 1 layers and this LlamaForCausalLM has 2"),
        (lambda m: "[" * 100_000 + "]" * 100_000, "not a cache saved by kvpress.save_cache"),
    ]
    for change, said in cases:
        with pytest.raises(ValueError, match=said):
            kvpress.load_cache(crafted(change), model)
    assert kvpress.load_cache(crafted(lambda m: json.dumps(m)), model).get_seq_length() == 40
