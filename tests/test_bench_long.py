"""The long-context benchmark's plan, one measured configuration (on a tiny model) and its summary."""

import math
import os
import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress.eval.bench_long import (
    CHILD_ENV,
    DECODE_MALLOC,
    _key,
    configurations,
    main,
    markdown,
    measure,
    pending,
    stamped_generate,
    summary,
)


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
    assert not any("decode_malloc" in r or "repeat" in r for r in runs)  # as bench_gpu plans them: one one-chunk run
    timed = configurations({"qwen2.5-0.5b": (4096,)}, ["snapkv"], [0.5], 1024, 8, DECODE_MALLOC)
    assert {r["decode_malloc"] for r in timed} == {"steady"}
    default = configurations({"qwen2.5-0.5b": (4096,)}, ["default"], [0.5], None, 8)[1]
    assert default["press"] == "default" and default["spec"] == kvpress.presses.defaults.default_for("qwen2.5-0.5b")


def test_the_bound_takes_the_median_of_repeated_one_chunk_runs():
    runs = configurations({"m": (64,)}, ["snapkv"], [0.5], 32, 2, one_chunk_runs=3)
    ones = [r for r in runs if r["pairs_with"] == "one-chunk"]
    assert [r["repeat"] for r in ones] == [0, 1, 2] and len({_key(r) for r in runs}) == len(runs) == 5
    assert runs[:3] == ones  # before the pairs
    measured = {"peak_above_model_bytes": 0, "cache_bytes": 8, "weight_bytes": 10, "unread_weight_bytes": 0,
                "prefill_seconds": 1.0, "decode_step_seconds": 0.1}  # fmt: skip
    rows = [{**r, **measured} for r in runs]
    for row, peak in zip(rows, (100, 160, 300, 400, 200), strict=True):
        row["peak_above_model_bytes"] = peak
    rows[-1]["cache_bytes"] = 40  # the press's
    (row,) = summary(rows)
    assert row["one_chunk_runs"] == 3 and row["peak_over_bound"] == 200 / (40 + 160)  # 160: the median of 100-300
    other_chunk = [*(dict(r, chunk=16) for r in rows[:3]), *rows[3:]]
    assert "peak_over_bound" not in summary(other_chunk)[0]  # a one-chunk run of another chunk size sets no bound
    other_steps = [*(dict(r, steps=9) for r in rows[:1]), *rows[1:]]
    assert summary(other_steps)[0]["one_chunk_runs"] == 2  # nor one of other decode steps
    old_default = [*rows[:3], rows[3], {**rows[4], "press": "default", "spec": "snapkv:old", "pairs_with": None}]
    old_default[3] = {**rows[3], "pairs_with": "default@0.5"}
    again = {**old_default[4], "spec": "snapkv:new", "cache_bytes": 20}
    assert _key(again) != _key(old_default[4])  # a default press that changed runs again ...
    (row,) = summary([*old_default, again])  # ... and its new row stands for it, paired with the no-press run
    assert row["spec"] == "snapkv:new" and row["cache_ratio"] == 20 / 8
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="one_chunk_runs must be a whole number >= 1"):
            configurations({"m": (64,)}, ["snapkv"], [0.5], 32, 2, one_chunk_runs=bad)


def test_a_measured_configuration_and_its_ratios(tokenized):
    model, tokenizer = tokenized
    rows = []
    for config in configurations({"tiny": (96,)}, ["snapkv"], [0.5], 32, 3, DECODE_MALLOC):
        rows.append(measure({**config, "spec": config["spec"].replace("snapkv", "snapkv:window_size=8")}, model,
                            tokenizer))  # fmt: skip
    one, none, pressed = rows
    assert {r["decode_malloc"] for r in rows} == {"steady"}  # the setting the decode was timed under, in the key
    assert _key(none) != _key({k: v for k, v in none.items() if k != "decode_malloc"})
    assert one["length"] == one["chunk"] == 32 and one["cache_bytes"] < none["cache_bytes"]
    assert pressed["cache_bytes"] < none["cache_bytes"] and none["prefill_seconds"] > 0
    assert none["peak_above_model_bytes"] >= 0 and pressed["decode_step_seconds"] > 0
    (row,) = summary(rows)
    assert row["cache_ratio"] == pressed["cache_bytes"] / none["cache_bytes"]
    peaks = pressed["peak_above_model_bytes"], none["peak_above_model_bytes"]
    assert row["memory_ratio"] == (peaks[0] / peaks[1] if peaks[1] else None)
    embedding = model.get_input_embeddings().weight  # untied here: a step reads one row of it, not all
    assert model.lm_head.weight is not embedding and pressed["unread_weight_bytes"] == embedding.nbytes > 0
    w = pressed["weight_bytes"] - embedding.nbytes
    assert row["decode_byte_limit"] == (w + pressed["cache_bytes"]) / (w + none["cache_bytes"])
    tied = summary([{**r, "unread_weight_bytes": 0} for r in rows])[0]  # tied: the head reads the whole matrix
    w = pressed["weight_bytes"]
    assert tied["decode_byte_limit"] == (w + pressed["cache_bytes"]) / (w + none["cache_bytes"])
    before = summary([{k: v for k, v in r.items() if k != "unread_weight_bytes"} for r in rows])[0]  # older rows
    assert before["decode_byte_limit"] == tied["decode_byte_limit"] and before["limit_counts_every_weight"]
    marked = markdown([before])
    assert f"{before['decode_byte_limit']:.3f} * |" in marked and "counts every weight" in marked
    assert "limit_counts_every_weight" not in tied
    bound = pressed["cache_bytes"] + one["peak_above_model_bytes"]  # its cache + one chunk alone
    assert row["bound_mb"] == bound / 2**20 and row["peak_over_bound"] == pressed["peak_above_model_bytes"] / bound
    table = markdown([row])
    memory = "-" if row["memory_ratio"] is None else f"{row['memory_ratio']:.2f}"  # None: no rise to divide by
    assert table.count("\n") == 3 and f"| {memory} | {row['peak_over_bound']:.2f} |" in table


def test_after_prefill_runs_once_between_the_prefill_and_the_first_decode_step(tokenized):
    model, tokenizer = tokenized
    forwards, calls = [], []  # per forward: the calls made before it; per call: the forwards before it
    handle = model.register_forward_hook(lambda *_: forwards.append(len(calls)))
    try:
        ids = torch.arange(5, 45)[None]
        prefill, steps = stamped_generate(model, tokenizer, ids, DynamicCache(config=model.config), 3, None,
                                          after_prefill=lambda: calls.append(len(forwards)))  # fmt: skip
    finally:
        handle.remove()
    assert calls == [1] and forwards == [0, 1, 1, 1] and len(steps) == 3 and min(steps) > 0 and prefill > 0


def test_steady_malloc_reuses_freed_blocks_where_the_child_environment_maps_each_afresh():
    """A child's fixed 1 MB mmap threshold faults every page of every large block in afresh (what made no press's
    decode step, which copies its cache to grow it, twice as slow); after `steady_malloc`, freed blocks are reused."""
    code = (
        "import resource, torch\n"
        "from kvpress.eval.memory import steady_malloc\n"
        "def faults():\n"
        "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "    for _ in range(8): torch.ones(2**21).sum()\n"  # 8 MB blocks, each written
        "    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before\n"
        "faults(); mapped = faults(); steady_malloc(); faults(); print(mapped, faults())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, **CHILD_ENV}).stdout  # fmt: skip
    mapped, steady = map(int, out.split())
    assert mapped >= 8 * 1000 and steady < mapped / 10  # 2,048 pages of 4 KB a block, against a few


def test_a_press_still_to_run_runs_again_beside_its_own_no_press_run():
    """Resumed: a press whose row is missing (stopped between the two runs of its pair, or its name now stands for
    another press) is measured right after its no-press run anew, not paired with one of an earlier session."""
    runs = configurations({"m": (64,)}, ["snapkv", "h2o"], [0.5], 32, 2)
    done = {_key(r) for r in runs if r["press"] != "h2o"}  # h2o's no-press run measured, h2o not
    todo = pending(runs, lambda r: _key(r) in done)
    assert [(r["press"], r["pairs_with"]) for r in todo] == [("none", "h2o@0.5"), ("h2o", None)]
    assert pending(runs, lambda r: True) == [] and pending(runs, lambda r: False) == runs


@pytest.mark.parametrize("argv", [["--models", "qwen2.5-0.5b:4k"], ["--presses", "nosuch"], ["--decode-steps", "1"],
                                  ["--ratios", "1.5"], ["--ratios", "0.5,0.5"], ["--presses", "snapkv,snapkv"],
                                  ["--models", "smollm2-135m:4096;smollm2-135m:8192"],  # (4096 was dropped)
                                  ["--models", "smollm2-135m:4096,4096"], ["--models", "smollm2-135m:-5"],
                                  ["--models", "nosuch:4096"], ["--models", "smollm2-135m"]])  # fmt: skip
def test_bad_arguments_are_refused_before_anything_runs(argv, tmp_path, capsys):
    assert main([*argv, "--out", str(tmp_path)]) == 2
    said = capsys.readouterr().err
    assert "kvpress bench-long:" in said and not list(tmp_path.iterdir())
    assert ("--models is model:length" in said) == (argv[0] == "--models")  # (the hint was added to every refusal)


def test_a_rerun_with_other_decode_settings_into_the_same_out_is_refused(tmp_path, capsys):
    """Its rows would stand beside the earlier run's in long.md with nothing to tell them apart (decode steps 2 and 4:
    two lines of one configuration, one plot line through both); another chunk size is a column of its own."""
    import json

    from kvpress.eval.bench_core import long_ids

    earlier = configurations({"smollm2-135m": (4096,)}, ["snapkv"], [0.5], 1024, 2, DECODE_MALLOC)
    (tmp_path / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier))
    argv = ["--models", "smollm2-135m:4096", "--presses", "snapkv", "--ratios", "0.5", "--out", str(tmp_path)]
    assert main([*argv, "--decode-steps", "4"]) == 2
    said = capsys.readouterr().err
    assert "smollm2-135m 4096 snapkv@0.5 (decode steps 2, malloc steady)" in said and "not decode steps 4" in said
    with pytest.raises(ValueError, match="a long text's length must be a positive number of tokens, got -5"):
        long_ids(None, -5)


@pytest.mark.parametrize("bench, argv, said", [
    ("bench_core", ["--decode-steps", "0"], "--decode-steps must be an integer >= 1, got 0"),
    ("bench_core", ["--repeats", "0"], "--repeats must be an integer >= 1, got 0"),
    ("bench_core", ["--measure", "varlen,speed"],
     "--measure takes parts among prefill, generate, varlen, kvzip, decode, got 'varlen,speed'"),
    ("bench_heads", ["--ratios", "0.5,0.5"], "ratios given twice: 0.5"),
    ("bench_stream", ["--tokens", "600"], "--tokens must be an integer >= 20000, got 600"),
    ("bench_stream", ["--tokens", "15000"], "--tokens must be an integer >= 20000, got 15000"),  # (the short runs')
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


def test_bench_core_runs_only_the_parts_asked(tokenized, tmp_path, monkeypatch):
    """`--measure varlen` times AdaKV against SnapKV (whatever `--presses` lists) and nothing else."""
    import json

    from kvpress.eval import bench_core

    monkeypatch.setattr(kvpress, "load_model", lambda *a, **k: tokenized)
    out = tmp_path / "core.json"
    bench_core.main(["--measure", "varlen", "--presses", "h2o", "--decode-context", "320", "--varlen-steps", "2",
                     "--prefill-tokens", "32", "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["varlen_vs_dense_decode"] > 0
    assert set(result["seconds"]) == {"varlen_decode_step_snapkv", "varlen_decode_step_adakv"}
    assert not (result["prefill_overhead"] or result["generate_prefill_overhead"] or result["decode_step_ratio"])
    assert not {"full_bytes", "kvzip_pass_ratio", "kvzip_scoring_peak_ratio"} & set(result)


def test_bench_core_runs_each_side_first_every_other_round():
    """A fixed order (no press, then the press) adds its order's effect to every ratio: the sides take turns, and
    the warm-up rounds are left out of both."""
    from kvpress.eval.bench_core import side_by_side

    order = []
    a, b = side_by_side(5, lambda: order.append("a") or len(order), lambda: order.append("b") or len(order), warm_up=1)
    assert "".join(order) == "abbaabbaab"
    assert (a, b) == ([4, 5, 8, 9], [3, 6, 7, 10])


def test_bench_stream_says_which_recompute_positions_each_run_reached(tokenized, tmp_path, monkeypatch):
    """Each run is scored on the recompute positions it reached: full_cache stops at the model's positions, and its
    perplexity there was set beside recompute_window's on all of them; now also beside recompute_window's on the
    same positions, with the count of each."""
    import json

    from kvpress.eval import bench_stream

    model, tokenizer = tokenized  # (max_position_embeddings 512)
    monkeypatch.setattr(kvpress, "load_model", lambda *a, **k: (model, tokenizer))
    monkeypatch.setattr(bench_stream, "essays", lambda: " ".join(f"word{i % 97} is here." for i in range(400)))
    monkeypatch.setattr(bench_stream, "plot", lambda *a, **k: None)
    out = tmp_path / "stream.json"
    bench_stream.main(["--cache", "16", "--n-sink", "2", "--chunk", "8", "--rss-warmup", "24", "--tokens", "700",
                       "--short-tokens", "700", "--recompute-every", "50", "--block", "50",
                       "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    positions = range(16, 700, 50)
    scored = result["recompute_positions_scored"]
    assert scored["recompute_window"] == scored["sink_window_rerotate"] == len(positions) == 14
    assert scored["full_cache"] == sum(p - 1 < 511 for p in positions) == 10
    same = result["recompute_window_ppl_on_the_same_positions"]
    assert same["sink_window_rerotate"] == result["ppl_at_recompute_positions"]["recompute_window"]
    assert same["full_cache"] != same["sink_window_rerotate"]
    assert bench_stream._ppl_of([]) is None  # (a run that reached no recompute position: a cache past the positions)
    for name, (low, high) in result["ppl_interval"].items():  # every perplexity with its 95% interval
        assert low <= result["ppl"][name] <= high, name
    assert result["ppl_interval_blocks"]["sink_window_rerotate"] == 699 // 50
    nll = torch.tensor([1.0, 3.0] * 4096)  # blocks of 1,024 alike: no spread between them; each token alone: some
    assert bench_stream.ppl_interval(nll, 1024) == [round(math.exp(2.0), 3)] * 2
    low, high = bench_stream.ppl_interval(nll)
    assert low < math.exp(2.0) < high < low * math.exp(0.05)
    assert bench_stream.ppl_interval(nll[:512], 1024) is None  # (fewer than two blocks)


def test_bench_heads_reports_each_accuracy_with_its_interval_and_n():
    """bench-heads wrote accuracies alone (16 examples a cell, the README's table without intervals)."""
    import json
    from pathlib import Path

    from kvpress.eval.bench_heads import cell

    assert cell(4, 16, 0.5) == {"accuracy": 0.25, "accuracy_interval": [0.102, 0.495], "n": 16, "kept_bytes": 0.5}
    committed = json.loads((Path(__file__).parents[1] / "eval" / "results" / "heads.json").read_text())
    for cells in committed["tasks"].values():
        for value in cells.values():
            assert value == cell(round(value["accuracy"] * value["n"]), value["n"], value["kept_bytes"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_a_measuring_child_ends_with_the_run_that_started_it(tmp_path):
    """A run killed with SIGKILL left its child measuring for minutes (re-parented, competing for the cores with the
    run resumed next): the child ends with its parent (`die_with_parent`)."""
    import time

    child = ("import sys, time\nfrom kvpress.eval.bench_long import die_with_parent\n"
             "die_with_parent(int(sys.argv[1]))\nprint('ready', flush=True)\ntime.sleep(120)")  # fmt: skip
    (tmp_path / "run.py").write_text(
        "import os, subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {child!r}, str(os.getpid())], stdout=subprocess.PIPE, "
        "text=True)\n"
        "assert child.stdout.readline().strip() == 'ready'\n"
        "print(child.pid, flush=True)\ntime.sleep(120)\n"
    )
    run = subprocess.Popen([sys.executable, str(tmp_path / "run.py")], stdout=subprocess.PIPE, text=True)
    pid = int(run.stdout.readline())
    run.kill()
    run.wait()

    def running() -> bool:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        return state != "Z"  # (a zombie has ended: only its parent's reaping is left)

    deadline = time.monotonic() + 30
    while running() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running()
