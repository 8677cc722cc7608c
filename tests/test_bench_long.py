"""The long-context benchmark's plan, one measured configuration (on a tiny model) and its summary."""

import pytest

import kvpress
from kvpress.eval.bench_long import _key, configurations, main, markdown, measure, summary


def test_each_press_follows_its_own_no_press_run_and_whole_context_pairs_run_unchunked():
    runs = configurations({"qwen2.5-0.5b": (4096, 8192)}, ["snapkv", "lookahead", "kvzip"], [0.5], 1024, 8)
    assert [(r["length"], r["press"], r["pairs_with"], r["chunk"]) for r in runs] == [
        (1024, "none", "one-chunk", 1024),
        (4096, "none", "snapkv@0.5", 1024), (4096, "snapkv", None, 1024),
        (4096, "none", "lookahead@0.5", None), (4096, "lookahead", None, None),
        (4096, "none", "kvzip@0.5", 1024), (4096, "kvzip", None, 1024),  # KVzip scores each chunk
        (8192, "none", "snapkv@0.5", 1024), (8192, "snapkv", None, 1024),
        (8192, "none", "lookahead@0.5", None), (8192, "lookahead", None, None),
        (8192, "none", "kvzip@0.5", 1024), (8192, "kvzip", None, 1024),
    ]  # fmt: skip
    unchunked = configurations({"qwen2.5-0.5b": (4096, 8192)}, ["snapkv", "lookahead", "kvzip"], [0.5], None, 8)
    assert {_key(r) for r in unchunked} & {_key(r) for r in runs} == {_key(r) for r in runs if r["chunk"] is None}
    default = configurations({"qwen2.5-0.5b": (4096,)}, ["default"], [0.5], None, 8)[1]
    assert default["press"] == "default" and default["spec"] == kvpress.presses.defaults.default_for("qwen2.5-0.5b")


def test_a_measured_configuration_and_its_ratios(tokenized):
    model, tokenizer = tokenized
    rows = []
    for config in configurations({"tiny": (96,)}, ["snapkv"], [0.5], 32, 3):
        rows.append(measure({**config, "spec": config["spec"].replace("snapkv", "snapkv:window_size=8")}, model,
                            tokenizer))  # fmt: skip
    one, none, pressed = rows
    assert one["length"] == one["chunk"] == 32 and one["cache_bytes"] < none["cache_bytes"]
    assert pressed["cache_bytes"] < none["cache_bytes"] and none["prefill_seconds"] > 0
    assert none["peak_above_model_bytes"] >= 0 and pressed["decode_step_seconds"] > 0
    (row,) = summary(rows)
    assert row["cache_ratio"] == pressed["cache_bytes"] / none["cache_bytes"]
    peaks = pressed["peak_above_model_bytes"], none["peak_above_model_bytes"]
    assert row["memory_ratio"] == (peaks[0] / peaks[1] if peaks[1] else None)
    w = pressed["weight_bytes"]
    assert row["decode_byte_limit"] == (w + pressed["cache_bytes"]) / (w + none["cache_bytes"])
    bound = pressed["cache_bytes"] + one["peak_above_model_bytes"]  # its cache + one chunk alone
    assert row["bound_mb"] == bound / 2**20 and row["peak_over_bound"] == pressed["peak_above_model_bytes"] / bound
    table = markdown([row])
    memory = "-" if row["memory_ratio"] is None else f"{row['memory_ratio']:.2f}"  # None: no rise to divide by
    assert table.count("\n") == 3 and f"| {memory} | {row['peak_over_bound']:.2f} |" in table


@pytest.mark.parametrize("argv", [["--models", "qwen2.5-0.5b:4k"], ["--presses", "nosuch"], ["--decode-steps", "1"]])
def test_bad_arguments_are_refused_before_anything_runs(argv, tmp_path, capsys):
    assert main([*argv, "--out", str(tmp_path)]) == 2
    assert "kvpress bench-long:" in capsys.readouterr().err and not list(tmp_path.iterdir())


@pytest.mark.parametrize("bench, argv, said", [
    ("bench_core", ["--decode-steps", "0"], "--decode-steps must be an integer >= 1, got 0"),
    ("bench_core", ["--repeats", "0"], "--repeats must be an integer >= 1, got 0"),
    ("bench_heads", ["--ratios", "0.5,0.5"], "ratios given twice: 0.5"),
    ("bench_stream", ["--tokens", "600"], "--tokens must be an integer >= 10001, got 600"),
    ("bench_stream", ["--short-tokens", "100"], "--short-tokens must be an integer >= 513, got 100"),
])  # fmt: skip
def test_the_other_benchmarks_refuse_sizes_before_they_run(bench, argv, said, capsys, monkeypatch):
    """Sizes that would crash a benchmark after its runs (an empty median, nothing past the warm-up) are refused
    before a model loads."""
    import importlib

    monkeypatch.setattr(kvpress, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit):
        importlib.import_module(f"kvpress.eval.{bench}").main(argv)
    assert said in capsys.readouterr().err
