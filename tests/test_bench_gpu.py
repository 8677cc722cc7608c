"""The GPU benchmark's mechanics on the CPU: one configuration measured on a tiny model, refusals before a
model loads, and flash-attn named when it is missing."""

import json

import pytest
import torch

import kvpress
from kvpress.eval import bench_gpu
from kvpress.eval.bench_long import configurations


def test_a_measured_configuration_on_the_cpu_has_no_peak_but_the_rest(tokenized):
    model, tokenizer = tokenized
    runs = configurations({"tiny": (96,)}, ["snapkv"], [0.5], 32, 3)
    rows = [bench_gpu.measure(model, tokenizer, {**c, "spec": c["spec"].replace("snapkv", "snapkv:window_size=8")},
                              profiled=True) for c in runs]  # fmt: skip
    one, none, pressed = rows
    assert pressed["cache_bytes"] < none["cache_bytes"] and one["length"] == 32
    assert pressed["peak_above_model_bytes"] is None and pressed["device"] == "cpu"  # CUDA's counter only
    assert none["prefill_seconds"] > 0 and pressed["decode_step_seconds"] > 0
    ops = {op["op"]: op for op in pressed["profile"]["by_cpu"]}  # the generation profiled: where its time goes
    assert len(ops) == 15 and {"aten::mm", "aten::addmm"} & set(ops) and pressed["profile"]["by_device"] == []
    assert none["profile"]["by_cpu"][0]["cpu_us"] >= none["profile"]["by_cpu"][-1]["cpu_us"] > 0


def test_without_cuda_the_rows_already_measured_are_summarised(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = {"model": "m", "length": 64, "chunk": 32, "steps": 2, "ratio": 0.5, "attn": "sdpa", "random_weights": True,
              "peak_above_model_bytes": 100, "prefill_seconds": 1.0, "decode_step_seconds": 0.1, "weight_bytes": 10,
              "unread_weight_bytes": 0}
    rows = [{**config, "press": "none", "spec": "none", "ratio": 0.0, "pairs_with": "snapkv@0.5", "cache_bytes": 8},
            {**config, "press": "snapkv", "spec": "snapkv", "pairs_with": None, "cache_bytes": 4,
             "peak_above_model_bytes": 50},
            {**config, "press": "adakv", "spec": "adakv", "pairs_with": None, "error": "RuntimeError: broken"}]
    (tmp_path / "gpu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.json").write_text("{}")  # (--config names a model directory)
    assert bench_gpu.main(["--out", str(tmp_path), "--config", str(tmp_path)]) == 2
    assert "configurations are not measured" in capsys.readouterr().err
    result = json.loads((tmp_path / "gpu.json").read_text())
    (row,) = result["tables"]["sdpa"]
    assert row["memory_ratio"] == 0.5 and row["cache_ratio"] == 0.5
    activations = (100 - 8) / 2**20  # no press's peak above its own cache, at the same length
    assert row["length_bound_mb"] == pytest.approx(4 / 2**20 + activations)
    assert row["peak_over_length_bound"] == pytest.approx((50 / 2**20) / (4 / 2**20 + activations))
    assert result["errors"] == [{"attn": "sdpa", "length": 64, "press": "adakv", "ratio": 0.5,
                                 "error": "RuntimeError: broken"}]  # fmt: skip
    measured = {**rows[2], "peak_above_model_bytes": 60, "cache_bytes": 4}  # a later run measured it
    del measured["error"]
    assert bench_gpu.write(tmp_path, [*rows, measured], {}) == []
    # rows of another card (a lent machine may be an H100 or an H200) are another run, and pair only among
    # themselves: the table is split by device
    pair = [{**r, "device": "H100"} for r in rows[:2]]
    assert bench_gpu._key(pair[0]) != bench_gpu._key(rows[0])
    h200 = [{**r, "device": "H200"} for r in rows[:2]]
    bench_gpu.write(tmp_path, [*h200, pair[0], {**pair[1], "cache_bytes": 2}], {})
    tables = json.loads((tmp_path / "gpu.json").read_text())["tables"]
    assert {name: t[0]["cache_ratio"] for name, t in tables.items()} == {"sdpa on H100": 0.25, "sdpa on H200": 0.5}
    # rows of the packaged weights pair only among themselves too, where a table holds both (`--config` runs are
    # labelled with the model they stand in for)
    real = [{**r, "random_weights": False} for r in rows[:2]]
    bench_gpu.write(tmp_path, [*rows[:2], real[0], {**real[1], "cache_bytes": 2}], {})
    tables = json.loads((tmp_path / "gpu.json").read_text())["tables"]
    assert {name: t[0]["cache_ratio"] for name, t in tables.items()} == {"sdpa random weights": 0.5,
                                                                        "sdpa real weights": 0.25}  # fmt: skip


def test_random_weights_from_a_config_directory(tmp_path, tokenized):
    model, tokenizer = tokenized
    model.config.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    built, _ = bench_gpu.load("ignored", str(tmp_path), "sdpa", torch.float32, "cpu")
    assert type(built) is type(model) and built.config.num_hidden_layers == model.config.num_hidden_layers
    assert not list(tmp_path.glob("*.safetensors"))  # no weights to read: the architecture alone
    assert sum(p.numel() for p in built.parameters()) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("argv, said", [
    (["--attn", "sdpa,eager"], "--attn eager is not one of sdpa, flash_attention_2"),
    (["--decode-steps", "1"], "--decode-steps must be at least 2, got 1"),
    (["--chunk", "-1"], "--chunk must be a token count >= 0 (0: no chunked prefill), got -1"),  # (both flags named)
    (["--lengths", "16k"], "--lengths must be token counts separated by commas, got '16k'"),
    (["--ratios", "0.5,half"], "--ratios must be fractions separated by commas, got '0.5,half'"),
    (["--cpu-stand-in", "--no-cudnn"], "--no-cudnn is a CUDA switch"),
    (["--cpu-stand-in", "--no-varlen"], "--no-varlen is a CUDA switch"),
    (["--config", "Qwen/Qwen2.5-0.5B"], "is not a directory with a config.json"),  # (it asked the hub for it)
])  # fmt: skip
def test_bad_arguments_are_refused_before_a_model_loads(argv, said, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(kvpress, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    assert bench_gpu.main([*argv, "--out", str(tmp_path)]) == 2
    assert said in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_without_cuda_it_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_gpu.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_flash_attention_is_named_when_flash_attn_is_missing(monkeypatch):
    monkeypatch.setattr(bench_gpu.importlib.util, "find_spec", lambda name: None)
    assert "flash-attn is not installed" in bench_gpu.available("flash_attention_2")
    assert bench_gpu.available("sdpa") is None


def test_the_blocked_variant_runs_chunks_in_blocks_on_its_device_and_puts_that_back(tmp_path, capsys, monkeypatch):
    from kvpress.patches import blocked_attention as blocked

    before = blocked.DEVICES
    with pytest.raises(KeyError), bench_gpu.blocks_on("cuda"):
        assert blocked.DEVICES == (*before, "cuda")
        raise KeyError("escapes")
    assert blocked.DEVICES == before
    with bench_gpu.blocks_on(None):
        assert blocked.DEVICES == before
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_gpu.main(["--out", str(tmp_path), "--attn", "sdpa-blocked"]) == 2  # accepted; no CUDA here
    assert "configurations are not measured" in capsys.readouterr().err
    assert bench_gpu.main(["--out", str(tmp_path), "--attn", "sdpa-blocks"]) == 2
    assert "not one of sdpa, flash_attention_2, sdpa-blocked" in capsys.readouterr().err


def test_no_press_without_cudnn_is_its_own_table_and_configuration(tmp_path, capsys, monkeypatch):
    config = {"model": "m", "length": 64, "chunk": 32, "steps": 2, "ratio": 0.5, "attn": "sdpa", "random_weights": True,
              "peak_above_model_bytes": 100, "prefill_seconds": 1.0, "decode_step_seconds": 0.1, "weight_bytes": 10,
              "unread_weight_bytes": 0}
    pair = [{**config, "press": "none", "spec": "none", "ratio": 0.0, "pairs_with": "snapkv@0.5", "cache_bytes": 8},
            {**config, "press": "snapkv", "spec": "snapkv", "pairs_with": None, "cache_bytes": 4}]
    rows = [*pair, *({**r, "no_cudnn": True, "decode_step_seconds": 0.05} for r in pair)]
    bench_gpu.write(tmp_path, rows, {})
    tables = json.loads((tmp_path / "gpu.json").read_text())["tables"]
    assert set(tables) == {"sdpa", "sdpa without cuDNN"}  # each press against no press of its own switch
    assert [len(t) for t in tables.values()] == [1, 1] and bench_gpu._key(rows[0]) != bench_gpu._key(rows[2])
    one = {**pair[0], "length": 32, "pairs_with": "one-chunk"}
    (tmp_path / "gpu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [one, *pair]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "config.json").write_text("{}")
    argv = ["--out", str(tmp_path), "--config", str(tmp_path), "--model", "m", "--lengths", "64", "--presses",
            "snapkv", "--ratios", "0.5", "--chunk", "32", "--decode-steps", "2", "--attn", "sdpa"]  # fmt: skip
    assert bench_gpu.main(argv) == 0  # every configuration measured: nothing to do
    assert bench_gpu.main([*argv, "--no-cudnn"]) == 2  # those rows do not count as measured without cuDNN
    assert "3 configurations are not measured" in capsys.readouterr().err


def test_tensor_peak_counts_storages_alive_at_once_and_builds_causal_biases():
    from kvpress.eval.memory import TensorPeak
    from kvpress.patches import blocked_attention as blocked

    bias = blocked.causal_lower_right
    with torch.inference_mode(), TensorPeak() as counted:
        a = torch.zeros(1000)  # 4,000 bytes
        view = a[10:].view(-1, 2)  # a view: no new storage
        b = torch.zeros(500)  # 2,000
        del a, view
        c = torch.zeros(3000)  # 12,000, with b alive: 14,000 (a's 4,000 freed before)
        del c
        d = torch.zeros(100)  # (c's address may be given out again: counted anew)
        assert counted.current == b.nbytes + d.nbytes
        # a bottom-right causal call (a tensor subclass for its bias) runs inside
        q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 7, 8)
        out = blocked.bottom_right_attention(q, k, k)
    assert out.shape == (1, 4, 3, 8) and counted.peak == 14_000  # (the attention's tensors were fewer bytes)
    assert blocked.causal_lower_right is bias  # put back
    weight = torch.zeros(10_000)  # made before the counting: a slice of it (an embedding row) is no new storage
    with torch.inference_mode(), TensorPeak() as counted:
        row = weight[0:2] + 0  # 8 bytes made
        assert weight[5:7].shape == (2,) and counted.peak == row.nbytes


def test_a_cpu_stands_in_for_a_gpu_with_its_paths_and_a_counted_peak(tokenized, monkeypatch):
    from kvpress.patches import blocked_attention as blocked

    model, tokenizer = tokenized
    calls = []
    original = blocked.bottom_right_attention
    monkeypatch.setattr(blocked, "bottom_right_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    runs = configurations({"tiny": (96,)}, ["adakv:window_size=8"], [0.5], 32, 3)  # head-wise: fused on a GPU
    rows = [bench_gpu.measure(model, tokenizer, {**c, "stand_in": True}) for c in runs]
    one, none, pressed = rows
    assert calls and blocked.DEVICES == ("cpu",)  # chunks over held slots ran the GPU's call; the CPU's paths back
    assert pressed["device"] == "cpu (stand-in)"
    assert none["peak_above_model_bytes"] > none["cache_bytes"]  # the cache and the activations on top of it
    assert pressed["cache_bytes"] < pressed["peak_above_model_bytes"] < none["peak_above_model_bytes"]
    assert one["peak_above_model_bytes"] < none["peak_above_model_bytes"]  # one chunk: less of everything


def test_pair_by_pair_is_its_own_table_and_the_check_compares_both_paths(tmp_path, capsys, monkeypatch, varlen_on_cpu):
    from kvpress.patches import headwise_attention as headwise

    config = {"model": "m", "length": 64, "chunk": 32, "steps": 2, "ratio": 0.5, "attn": "sdpa", "random_weights": True,
              "peak_above_model_bytes": 100, "prefill_seconds": 1.0, "decode_step_seconds": 0.1, "weight_bytes": 10,
              "unread_weight_bytes": 0}
    pair = [{**config, "press": "none", "spec": "none", "ratio": 0.0, "pairs_with": "adakv@0.5", "cache_bytes": 8},
            {**config, "press": "adakv", "spec": "adakv", "pairs_with": None, "cache_bytes": 4}]
    rows = [*pair, *({**r, "no_varlen": True} for r in pair)]
    bench_gpu.write(tmp_path, rows, {})
    assert set(json.loads((tmp_path / "gpu.json").read_text())["tables"]) == {"sdpa", "sdpa pair by pair"}
    assert bench_gpu._key(rows[1]) != bench_gpu._key(rows[3])
    # the check (the stand-in in CUDA's place): the call ran for a step and a chunk, and agrees with the pairs
    check = headwise.check_one_call(torch.device("cpu"), torch.float32)
    assert {k: v["one_call"] for k, v in check.items()} == {"q=1": True, "q=7": True}
    assert all(v["max_difference"] <= 1e-5 < v["max_value"] for v in check.values())
    assert [c["causal"] for c in varlen_on_cpu] == [False, True]  # once each
    # a kernel that reads the spare slots after each pair's held ones: the check shows it
    right = headwise.flash_varlen

    def spare(query, keys, values, cu_q, cu_k, max_q, max_k, causal, scale, used_k):
        whole = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
        return right(query, keys, values, cu_q, cu_k, max_q, int(whole.max()), causal, scale, whole)

    monkeypatch.setattr(headwise, "flash_varlen", spare)
    assert all(v["max_difference"] > 0.01 for v in headwise.check_one_call(torch.device("cpu"), torch.float32).values())
    with pytest.raises(KeyError), bench_gpu.pair_by_pair():
        assert headwise.VARLEN_DEVICES == ()
        raise KeyError("escapes")
    assert headwise.VARLEN_DEVICES == ("cpu",)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_gpu.main(["--out", str(tmp_path), "--no-varlen"]) == 2  # accepted; no CUDA here
    assert "configurations are not measured" in capsys.readouterr().err
