"""The lm-eval bridge on the default model: r = 0 equals plain HFLM; compression is real; bad input is refused."""

import sys

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from transformers import DynamicCache

import kvpress
from kvpress.eval.lm_eval_bridge import TASKS_DIR, KVPressLM, full_cache_bytes
from kvpress.pipeline import answer_from_cache, prefill_context


@pytest.fixture(scope="module")
def default_model():
    return kvpress.load_model()


def _loglikelihood(lm, pairs):
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    return lm.loglikelihood(requests, disable_tqdm=True)


CONTEXT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
PAIRS = [(CONTEXT, " Madrid."), (CONTEXT, " Paris."), ("Two plus two equals", " four"), (CONTEXT, " Berlin")]


def test_ratio_zero_equals_plain_hflm(default_model):
    model, tokenizer = default_model
    plain = _loglikelihood(HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1), PAIRS)
    bridge = KVPressLM(pretrained=model, tokenizer=tokenizer, press="snapkv", compression_ratio=0.0, window_size=4,
                       query_aware=True)
    pressed = _loglikelihood(bridge, PAIRS)
    for (a, greedy_a), (b, greedy_b) in zip(plain, pressed, strict=True):
        assert abs(a - b) <= 1e-3 and greedy_a == greedy_b
    assert plain[0][0] > plain[1][0]  # the model knows Madrid: the comparison is not vacuous
    for record in bridge.kv_records:  # nothing evicted: the full cache, an int32 position per slot, 2 int64 per layer
        assert record["full_bytes"] <= record["kept_bytes"] <= record["full_bytes"] * (1 + 4 / 512) + 30 * 16


def test_compressed_context_scores_against_the_compressed_cache(default_model):
    model, tokenizer = default_model
    context = " ".join(f"Item {i} is numbered {i}." for i in range(60)) + " The first item is"
    bridge = KVPressLM(pretrained=model, tokenizer=tokenizer, press="knorm", compression_ratio=0.5, query_aware=True)
    pressed = _loglikelihood(bridge, [(context, " Item 0."), (context, " numbered 7.")])
    plain = _loglikelihood(KVPressLM(pretrained=model, tokenizer=tokenizer), [(context, " Item 0.")])
    assert pressed[0][0] != pytest.approx(plain[0][0], abs=1e-3)
    summary = bridge.kv_summary()
    assert summary["requests"] == 2 and 0.45 < summary["kept_ratio"] < 0.55
    short = KVPressLM(pretrained=model, tokenizer=tokenizer, press="knorm", compression_ratio=0.5, query_aware=True,
                      max_length=32)  # fmt: skip
    with pytest.warns(UserWarning, match="1 of 2 loglikelihood requests were cut from the left to max_length=32"):
        _loglikelihood(short, [(context, " Item 0."), ("Two plus two equals", " four")])
    tokens = len(tokenizer(context + " Item 0.").input_ids) - 1
    assert bridge.kv_records[0]["full_bytes"] == full_cache_bytes(model, tokens) == tokens * 46080
    assert summary["kept_whole"] == 0
    budget = KVPressLM(pretrained=model, tokenizer=tokenizer, press="knorm", max_tokens=100, query_aware=True)
    whole = r"a context of \d+ tokens is kept whole, uncompressed: max_tokens=100 is not"
    with pytest.warns(UserWarning, match=whole) as told:
        _loglikelihood(budget, [(context, " Item 0."), ("Two plus two equals", " four"), ("Two plus two", " is")])
    assert len([w for w in told if "kept whole" in str(w.message)]) == 1  # said once, counted each time
    assert budget.kv_summary()["kept_whole"] == 2


@pytest.mark.parametrize("family", ["gemma3", "mistral-window"])
def test_a_full_cache_counts_what_a_plain_cache_of_sliding_layers_holds(family):
    """A sliding layer of a plain DynamicCache holds the last window - 1 tokens (full_cache_bytes counted window)."""
    from tiny import prompt, tiny_model

    windowed = tiny_model(family)
    plain = DynamicCache(config=windowed.config)
    windowed(prompt(1, 40), cache=plain)
    assert full_cache_bytes(windowed, 40) == sum(layer.keys.nbytes + layer.values.nbytes for layer in plain.layers)


def test_generate_until_compresses_the_prompt(default_model):
    model, tokenizer = default_model
    bridge = KVPressLM(pretrained=model, tokenizer=tokenizer, press="sink-window", compression_ratio=0.5, batch_size=2,
                       query_aware=True)
    prompts = ["The capital of France is Paris. " * 20 + "The capital of France is", "Count: one, two, three,"]
    arguments = {"until": ["\n"], "max_gen_toks": 6}
    requests = [Instance("generate_until", {}, (p, arguments), i) for i, p in enumerate(prompts)]
    out = bridge.generate_until(requests, disable_tqdm=True)
    assert len(out) == 2 and "Paris" in out[0]
    assert len(bridge.kv_records) == 1 and bridge.kv_records[0]["kept_bytes"] < 0.6 * bridge.kv_records[0]["full_bytes"]
    summary = bridge.kv_summary()  # one cache served the batch's two requests: means per request
    assert summary["requests"] == 2 and summary["mean_kept_kv_bytes"] == round(bridge.kv_records[0]["kept_bytes"] / 2)
    assert model.config._attn_implementation == "sdpa"


def test_data_parallel_kv_summary_covers_every_process(default_model, monkeypatch):
    """lm-eval asks process 0 alone for the model's info, after the run: its KV means covered its own share of the
    requests (4 of 8 at two processes). Each kind of request, which every process runs, ends by sending each
    process's totals to process 0."""
    model, tokenizer = default_model
    bridge = KVPressLM(pretrained=model, tokenizer=tokenizer, press="sink-window", compression_ratio=0.5, batch_size=1,
                       query_aware=True)  # fmt: skip
    other = {"requests": 3, "kept_bytes": 3000, "full_bytes": 6000, "kept_whole": 1, "peak_rss_bytes": 2**50}
    sent = []
    monkeypatch.setattr(bridge, "_world_size", 2)
    monkeypatch.setattr(bridge, "gather_object", lambda obj, dst=0: sent.append(obj) or [obj, other])
    arguments = {"until": ["\n"], "max_gen_toks": 2}
    requests = [Instance("generate_until", {}, (p, arguments), i) for i, p in enumerate(["One, two,", "Red, green,"])]
    bridge.generate_until(requests, disable_tqdm=True)
    assert len(sent) == 1 and sent[0]["requests"] == 2  # once per kind of request, this process's two
    mine = sum(r["kept_bytes"] for r in bridge.kv_records)
    summary = bridge.kv_summary()
    assert (summary["requests"], summary["processes"], summary["kept_whole"]) == (5, 2, 1)
    assert summary["mean_kept_kv_bytes"] == round((mine + 3000) / 5) and summary["peak_rss_bytes"] == 2**50


def test_model_info_asks_no_model_hub(default_model, monkeypatch):
    """lm-eval's HFLM asked the hub for `pretrained`'s commit at every run (`simple_evaluate` reads the model's info):
    two connections to huggingface.co for a relative local path. The bridge gives HFLM's fields without it."""
    import huggingface_hub

    model, tokenizer = default_model
    bridge = KVPressLM(pretrained=model, tokenizer=tokenizer, press="knorm", compression_ratio=0.5, batch_size=1)
    asked = []
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, **kw: asked.append(kw) or
                        type("Info", (), {"sha": "abc"})())  # fmt: skip
    info = bridge.get_model_info()
    assert asked == [] and info["model_sha"] == "" and info["kvpress"]["requests"] == 0
    assert info["model_num_parameters"] == model.num_parameters() and info["model_dtype"] == model.dtype
    lm_evals = HFLM.get_model_info(bridge)  # (its fields: the bridge gives each of them)
    assert asked and set(info) == set(lm_evals) | {"kvpress"}
    with pytest.raises(FileNotFoundError, match="is neither a packaged model"):  # (lm-eval asked the hub for it)
        KVPressLM(pretrained=model, tokenizer="HuggingFaceTB/SmolLM2-135M-Instruct", press="knorm",
                  compression_ratio=0.5)
    for extra in ("peft", "delta"):  # (HFLM fetched a hub name)
        with pytest.raises(ValueError, match=f"{extra}='org/adapter' is not a local path: kvpress runs offline"):
            KVPressLM(pretrained=model, tokenizer=tokenizer, press="knorm", compression_ratio=0.5,
                      **{extra: "org/adapter"})


def _rolling(lm, texts):
    requests = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(texts)]
    return lm.loglikelihood_rolling(requests, disable_tqdm=True)


DOCS = [CONTEXT + " Madrid. " + " ".join(f"Item {i} is numbered {i}." for i in range(20)), "Two plus two equals four."]


def test_rolling_loglikelihood_is_chunked_through_the_compressed_cache(default_model):
    model, tokenizer = default_model
    plain = _rolling(HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1), DOCS)
    for chunk in (16, 128):
        bridge = KVPressLM(pretrained=model, tokenizer=tokenizer, press="snapkv", compression_ratio=0.0,
                           window_size=4, rolling_chunk=chunk)  # fmt: skip
        assert _rolling(bridge, DOCS) == pytest.approx(plain, abs=1e-3)
    assert len(tokenizer(DOCS[0]).input_ids) > 100  # several chunks of 16
    bridge = KVPressLM(pretrained=model, tokenizer=tokenizer, press="knorm", compression_ratio=0.5, rolling_chunk=16)
    pressed = _rolling(bridge, DOCS)
    assert pressed[0] < plain[0] - 1  # the document was read through the compressed cache, not HFLM's windows
    assert 0.5 <= bridge.kv_records[0]["kept_bytes"] / bridge.kv_records[0]["full_bytes"] < 0.55
    bridge = KVPressLM(pretrained=model, tokenizer=tokenizer, press="knorm", compression_ratio=0.5,
                       prefill_chunk_size=32)  # fmt: skip
    with pytest.raises(ValueError, match="drop prefill_chunk_size=32"):  # its chunks are rolling_chunk's: not ignored
        _rolling(bridge, DOCS)


def test_perplexity_task_end_to_end(default_model):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from kvpress.eval.lm_eval_bridge import TASKS_DIR

    model, tokenizer = default_model
    manager = TaskManager(include_path=TASKS_DIR, include_defaults=False, metadata={"n": 2, "length": 64})
    metrics = {}
    for press in (None, "sink-window"):
        lm = KVPressLM(pretrained=model, tokenizer=tokenizer, press=press, compression_ratio=press and 0.0)
        out = lm_eval.simple_evaluate(model=lm, tasks=["kvpress_perplexity"], task_manager=manager, bootstrap_iters=0)
        metrics[press] = out["results"]["kvpress_perplexity"]
    for key in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert metrics[None][key] == pytest.approx(metrics["sink-window"][key], rel=1e-4)
    assert 1 < metrics[None]["byte_perplexity,none"] < 10
    assert out["configs"]["kvpress_perplexity"]["metadata"]["n"] == 2 and out["n-samples"]["kvpress_perplexity"][
        "effective"] == 2  # fmt: skip


def test_bad_arguments_are_refused(default_model):
    model, tokenizer = default_model
    with pytest.raises(ValueError, match="unknown press 'snapkvv'; choose one of: adakv"):
        KVPressLM(pretrained=model, tokenizer=tokenizer, press="snapkvv", compression_ratio=0.5)
    with pytest.raises(ValueError, match="press parameters given without a press"):
        KVPressLM(pretrained=model, tokenizer=tokenizer, compression_ratio=0.5)
    with pytest.raises(ValueError, match=r"compression_ratio must be in \[0, 1\)"):
        KVPressLM(pretrained=model, tokenizer=tokenizer, press="snapkv", compression_ratio=1.5)
    with pytest.raises(ValueError, match="with no press lm-eval's own model runs"):
        KVPressLM(pretrained=model, tokenizer=tokenizer, prefill_chunk_size="64")
    with pytest.raises(ValueError, match="cannot prefill in chunks"):
        KVPressLM(pretrained=model, tokenizer=tokenizer, press="shotkv", compression_ratio=0.5,
                  prefill_chunk_size=64)  # fmt: skip
    with pytest.raises(ValueError, match="prefill_chunk_size must be a positive number of tokens, got 'x'"):
        KVPressLM(pretrained=model, tokenizer=tokenizer, press="snapkv", compression_ratio=0.5, prefill_chunk_size="x")
    for value in (12.9, True, "abc"):  # what lm-eval's model_args parser hands over for 12.9, true, abc
        with pytest.raises(ValueError, match=f"rolling_chunk must be a positive number of tokens, got {value!r}"):
            KVPressLM(pretrained=model, tokenizer=tokenizer, press="snapkv", compression_ratio=0.5, rolling_chunk=value)
    with pytest.raises(ValueError, match="query_aware must be true or false, got 2"):
        KVPressLM(pretrained=model, tokenizer=tokenizer, press="snapkv", compression_ratio=0.5, query_aware=2)
    with pytest.raises(ValueError, match="query_aware, rolling_chunk only shape how a press compresses"):
        KVPressLM(pretrained=model, tokenizer=tokenizer, query_aware="true", rolling_chunk=64)
    with pytest.raises(ValueError, match="rolling_chunk only shape how a press compresses"):  # its default too
        KVPressLM(pretrained=model, tokenizer=tokenizer, rolling_chunk=128)
    with pytest.raises(ValueError, match="question_regex only shape how a press compresses"):
        KVPressLM(pretrained=model, tokenizer=tokenizer, question_regex="Q:")
    with pytest.raises(ValueError, match="mixed_precision_dtype shape lm-eval's own forwards, and the bridge's"):
        KVPressLM(pretrained=model, tokenizer=tokenizer, press="knorm", compression_ratio=0.5,
                  mixed_precision_dtype="bfloat16")  # fmt: skip
    with pytest.raises(ValueError, match="softmax_dtype shape lm-eval's own forwards"):
        KVPressLM(pretrained=model, tokenizer=tokenizer, press="default", compression_ratio=0.5,
                  softmax_dtype="float64")  # fmt: skip
    KVPressLM(pretrained=model, tokenizer=tokenizer, mixed_precision_dtype="bfloat16")  # no press: HFLM's own
    with pytest.raises(ValueError, match="window_sise=16 is neither a press parameter .did you mean window_size"):
        KVPressLM(pretrained=model, tokenizer=tokenizer, press="snapkv", compression_ratio=0.5, window_sise=16)
    with pytest.raises(ValueError, match="trust_remote=True is neither a press parameter nor an argument"):
        KVPressLM(pretrained=model, tokenizer=tokenizer, trust_remote=True)  # a loaded model: HFLM ignored it


def test_cli_refuses_bad_press_task_and_model(default_model, capsys, monkeypatch, tmp_path):
    """A bad press or parameter is refused before lm-eval runs (its task index alone takes ~10 s), given on the
    command line or in a --config file; a bad task by lm-eval; another model before either."""
    import lm_eval.__main__

    from kvpress.cli import main

    real = lm_eval.__main__.cli_evaluate

    ran = []

    def evaluate():
        ran.append(sys.argv[1:])
        raise AssertionError("lm-eval ran")

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", evaluate)
    assert main(["lm-eval", "--model_args", "pretrained=default,press=nope", "--tasks", "kvpress_needle_noise"]) == 2
    said = capsys.readouterr().err
    assert "kvpress lm-eval: unknown press 'nope'; choose one of" in said and "(raised at " in said  # no traceback
    monkeypatch.setenv("KVPRESS_TRACEBACK", "1")
    with pytest.raises(ValueError, match="unknown press 'nope'"):  # the whole traceback when asked for
        main(["lm-eval", "--model_args", "pretrained=default,press=nope", "--tasks", "kvpress_needle_noise"])
    monkeypatch.delenv("KVPRESS_TRACEBACK")
    assert main(["lm-eval", "--model", "kvpress", "--model_args", "pretrained=default,press=nope",
                 "--tasks", "kvpress_needle_noise"]) == 2  # lm-eval's own spelling: accepted
    assert "unknown press 'nope'; choose one of" in capsys.readouterr().err
    assert main(["lm-eval", "--model_args", "pretrained=default,press=snapkv,compression_ratio=0.5,window_sise=8",
                 "--tasks", "kvpress_needle_noise"]) == 2  # (a directory: HFLM would hand it to the model's class)
    assert "window_sise=8 is neither a press parameter (did you mean window_size?)" in capsys.readouterr().err
    assert main(["lm-eval", "-a", "press=snapkv", "query_aware=maybe", "--tasks", "x"]) == 2  # (lm-eval's other form)
    assert "query_aware must be true or false, got 'maybe'" in capsys.readouterr().err
    assert main(["lm-eval", "--model_args", "press=simlayerkv,compression_ratio=0.5,prefill_chunk_size=64"]) == 2
    assert "SimLayerKVPress scores the whole context once it is cached" in capsys.readouterr().err
    (tmp_path / "c.yaml").write_text("model_args:\n  press: nope\ntasks: [kvpress_needle_noise]\n")
    assert main(["lm-eval", "--config", str(tmp_path / "c.yaml")]) == 2
    assert "unknown press 'nope'; choose one of" in capsys.readouterr().err
    (tmp_path / "hf.yaml").write_text("model: hf\n")  # another model in the file: refused as on the command line
    assert main(["lm-eval", "--config", str(tmp_path / "hf.yaml")]) == 2
    assert "hf.yaml sets model: hf: kvpress lm-eval runs lm-eval's model kvpress" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="lm-eval ran"):  # good arguments reach lm-eval
        main(["lm-eval", "--model_args", "pretrained=default,press=snapkv,compression_ratio=0.5", "--tasks", "x"])
    assert ran[-1][-2:] == ["--include_path", TASKS_DIR]  # kvpress's offline tasks
    (tmp_path / "own.yaml").write_text(f"include_path: {tmp_path}\nmodel: kvpress\n")
    with pytest.raises(AssertionError, match="lm-eval ran"):  # the file's own tasks: kvpress's do not replace them
        main(["lm-eval", "--config", str(tmp_path / "own.yaml"), "--tasks", "x"])
    assert ran[-1] == ["run", "--model", "kvpress", "--config", str(tmp_path / "own.yaml"), "--tasks", "x"]
    # lm-eval's caches: its saved answers are keyed by a request's text alone (another press would read this one's),
    # its saved requests by a task's name (another length of a kvpress task would be scored on these)
    assert main(["lm-eval", "--use_cache", str(tmp_path / "db"), "--tasks", "x"]) == 2
    assert "keys its saved answers by a request's text alone" in capsys.readouterr().err
    (tmp_path / "cached.yaml").write_text("use_cache: db\nmodel: kvpress\n")
    assert main(["lm-eval", "--config", str(tmp_path / "cached.yaml"), "--tasks", "x"]) == 2
    assert "--use_cache db: lm-eval keys" in capsys.readouterr().err
    # lm-eval finds an --output_path it cannot write only after the run (a warning, exit 0, the results lost)
    (tmp_path / "a-file").write_text("")
    for bad in ("/dev/full/lm", str(tmp_path / "a-file"), str(tmp_path / "a-file" / "r.json")):
        assert main(["lm-eval", "--output_path", bad, "--tasks", "x"]) == 2
        err = capsys.readouterr().err
        assert f"--output_path {bad}" in err and "lm-eval would say so only after the run" in err
    (tmp_path / "out.yaml").write_text("output_path: /dev/full/lm\nmodel: kvpress\n")
    assert main(["lm-eval", "--config", str(tmp_path / "out.yaml"), "--tasks", "x"]) == 2
    assert "--output_path /dev/full/lm: cannot write there (/dev/full is not a directory" in capsys.readouterr().err
    for fine in (tmp_path / "new" / "dir", tmp_path / "new" / "r.json"):  # made by lm-eval where missing
        with pytest.raises(AssertionError, match="lm-eval ran"):
            main(["lm-eval", "--output_path", str(fine), "--tasks", "x"])
    for given in (["--cache_requests"], ["--cache_requests", "true"], ["--cache_requests=true"]):
        assert main(["lm-eval", *given, "--tasks", "hellaswag,kvpress_ruler"]) == 2
        assert "--cache_requests true with kvpress_ruler: lm-eval keys its saved requests" in capsys.readouterr().err
    for fine in (["--cache_requests", "refresh", "--tasks", "kvpress_ruler"], ["--cache_requests", "--tasks", "x"]):
        with pytest.raises(AssertionError, match="lm-eval ran"):  # rebuilt, or not kvpress's tasks: lm-eval runs
            main(["lm-eval", *fine])
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", real)
    assert main(["lm-eval", "--model_args", "pretrained=default", "--tasks", "no_such_task"]) == 2
    assert "kvpress lm-eval: Tasks not found: no_such_task" in capsys.readouterr().err
    assert main(["lm-eval", "--model", "hf", "--tasks", "kvpress_needle_noise"]) == 2
    assert "--model hf: kvpress lm-eval runs lm-eval's model kvpress" in capsys.readouterr().err
    for other in (["-M", "hf"], ["-Mhf"], ["--model=hf"], ["-M=hf"]):  # every spelling lm-eval's parser takes
        assert main(["lm-eval", *other, "--tasks", "kvpress_needle_noise"]) == 2
        assert "--model hf: kvpress lm-eval runs lm-eval's model kvpress" in capsys.readouterr().err


def test_the_early_check_reads_model_args_as_lm_eval_does_and_converts_no_model(tmp_path, monkeypatch):
    """`--model_args` read by lm-eval's own parser (both forms, JSON), or from a --config file where the command
    line gives none (a mapping or lm-eval's string; a given --model_args replaces the file's); none where the
    arguments ask for help or do not parse; a packaged model is not converted by the check, a directory is looked
    for."""
    from kvpress.eval import lm_eval_bridge as bridge

    def read(argv):
        parsed = bridge._parsed(argv)
        return bridge._model_args(parsed, bridge._config_file(parsed))

    assert read(["--model_args", "press=snapkv,compression_ratio=0.5", "--tasks", "x"]) == {
        "press": "snapkv", "compression_ratio": 0.5}  # fmt: skip
    assert read(["-a", "press=snapkv", "window_size=8", "--bogus"]) == {"press": "snapkv", "window_size": 8}
    assert read(["--model_args", '{"press": "knorm"}']) == {"press": "knorm"}
    assert read(["--tasks", "x"]) == {}
    for argv in (["-h"], ["--hel"], ["--limit", "many"]):
        assert read([*argv, "--model_args", "press=nope"]) is None, argv
    mapping, string, bare = tmp_path / "m.yaml", tmp_path / "s.yaml", tmp_path / "b.yaml"
    mapping.write_text("model_args:\n  press: nope\n  compression_ratio: 0.5\ntasks: [x]\n")
    string.write_text('model_args: "press=snapkv,window_size=8"\n')
    bare.write_text("tasks: [x]\n")
    for argv in (["--config", str(mapping)], [f"-C{mapping}"], [f"--config={mapping}"]):
        assert read(argv) == {"press": "nope", "compression_ratio": 0.5}, argv
    assert read(["--config", str(string)]) == {"press": "snapkv", "window_size": 8}
    assert read(["--config", str(mapping), "--model_args", "press=knorm"]) == {"press": "knorm"}
    assert read(["--config", str(bare)]) == {}
    assert read(["--config", str(mapping), "--model_args", ""]) == {"press": "nope", "compression_ratio": 0.5}
    for odd in ("[press, nope]", "0"):  # not arguments: lm-eval itself answers
        bare.write_text(f"model_args: {odd}\n")
        assert read(["--config", str(bare)]) is None, odd
    with pytest.raises(FileNotFoundError, match="Config file not found"):
        read(["--config", str(tmp_path / "none.yaml")])

    def converted(*args):
        raise AssertionError("a model was converted")

    monkeypatch.setattr(bridge, "resolve_model_path", converted)
    KVPressLM.check_model_args({"pretrained": "qwen2.5-0.5b", "press": "snapkv", "compression_ratio": 0.5})
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match="nor a local transformers directory"):
        KVPressLM.check_model_args({"pretrained": str(tmp_path), "press": "snapkv", "compression_ratio": 0.5})


def test_a_press_parameter_the_tasks_also_read_is_refused_in_model_args():
    """lm-eval merges model_args into the tasks' metadata: RandomPress's `seed=7` there drew kvpress's tasks from
    seed 7 too (other examples than every other run's); given in the press's name it reaches the press alone."""
    from kvpress.eval.tasks.lm_eval_hooks import dataset, metadata_keys

    assert metadata_keys() == ("length", "n", "seed")
    with pytest.raises(ValueError, match=r"seed=7 in model_args would also reach kvpress's tasks .* \(press=random:"
                                         r"seed=7\), and the tasks' in --metadata"):  # fmt: skip
        KVPressLM.check_model_args({"press": "random", "compression_ratio": 0.5, "seed": 7})
    KVPressLM.check_model_args({"press": "random:seed=7", "compression_ratio": 0.5})
    named = dataset("needle_noise", length=128, n=1, press="random:seed=7")["test"][0]  # (the press's seed: not read)
    assert named == dataset("needle_noise", length=128, n=1)["test"][0] != dataset("needle_noise", 128, 1, 7)["test"][0]


def _needle_requests(examples, kind="generate_until"):
    docs = [{"context": e.context, "question": e.question, "answers": list(e.answers)} for e in examples]
    if kind == "generate_until":
        args = {"until": ["\n"], "max_gen_toks": 8}
        return [Instance(kind, d, (f"{d['context']}\n\n{d['question']}", args), i) for i, d in enumerate(docs)]
    return [Instance(kind, d, (f"{d['context']}\n\n{d['question']}", " 1"), i) for i, d in enumerate(docs)]


def test_query_agnostic_generation_compresses_only_the_context(default_model):
    from kvpress.eval.tasks import task_examples

    model, tokenizer = default_model
    examples = task_examples("needle_noise", tokenizer, 2, 256, 0)
    answers = {}
    for aware in (False, True):
        bridge = KVPressLM(pretrained=model, tokenizer=tokenizer, press="snapkv", compression_ratio=0.6,
                           window_size=8, query_aware=aware, batch_size=2)  # fmt: skip
        answers[aware] = bridge.generate_until(_needle_requests(examples), disable_tqdm=True)
    for example, answer in zip(examples, answers[False], strict=True):  # the context compressed, then asked
        ids = tokenizer(f"{example.context}\n\n{example.question}", return_tensors="pt").input_ids
        head = len(tokenizer(f"{example.context}\n").input_ids) + 1  # "\n\n" is two tokens before a word
        press, cache = kvpress.SnapKVPress(0.6, window_size=8), DynamicCache(config=model.config)
        prefill_context(model, ids[:, :head], press, cache)
        assert cache.layers[0].n == head - int(head * 0.6)
        expected = answer_from_cache(model, tokenizer, ids, cache, press, max_new_tokens=8)
        assert answer.strip() == expected.split("\n")[0].strip()
    assert answers[False] != answers[True]  # the question guided the query-aware compression


def test_query_agnostic_loglikelihood_shares_the_context_prefill(default_model):
    model, tokenizer = default_model
    context = " ".join(f"Item {i} is numbered {i}." for i in range(40))
    docs = [{"question": q} for q in ("Which item is numbered 3? Item", "Which item is first? Item")]
    requests = [Instance("loglikelihood", d, (f"{context}\n\n{d['question']}", " 3"), i) for i, d in enumerate(docs)]
    prefixes = {}
    for aware in (False, True):
        bridge = KVPressLM(pretrained=model, tokenizer=tokenizer, press="knorm", compression_ratio=0.5,
                           query_aware=aware)
        seen = []
        original = bridge._prefill
        bridge._prefill = lambda prefix, following=None, seen=seen, original=original: (
            seen.append(len(prefix)) or original(prefix, following))
        bridge.loglikelihood(requests, disable_tqdm=True)
        prefixes[aware] = seen
    head = len(tokenizer(context + "\n").input_ids) + 1  # "\n\n" is two tokens before a word
    assert prefixes[False] == [head]  # one prefill of the context, shared by both questions
    assert len(prefixes[True]) == 2 and min(prefixes[True]) > head


def test_query_agnostic_loglikelihood_takes_a_prompt_ending_in_whitespace(default_model):
    """lm-eval moves a prompt's trailing whitespace to the continuation before it encodes the prompt: the question
    is still found among the prompt's tokens (it was refused), and the continuation scored with that whitespace."""
    model, tokenizer = default_model
    context = " ".join(f"Item {i} is numbered {i}." for i in range(40)) + "\n\nWhich item is numbered 3?"
    doc = {"question": "Which item is numbered 3?"}
    bridge = KVPressLM(pretrained=model, tokenizer=tokenizer, press="knorm", compression_ratio=0.5)
    (plain,) = bridge.loglikelihood([Instance("loglikelihood", doc, (context, "\nItem 3"), 0)], disable_tqdm=True)
    (spaced,) = bridge.loglikelihood([Instance("loglikelihood", doc, (context + "\n", "Item 3"), 0)],
                                     disable_tqdm=True)  # fmt: skip
    assert spaced == plain


def test_a_default_spec_for_a_directory_waits_for_its_model(tmp_path):
    """`press=default:...` for a directory: its default press depends on the model in it, so the spec is only parsed
    before it loads (a parameter of SmolLM2's default, not of the any-model one, was refused there)."""
    with pytest.raises(FileNotFoundError) as refused:
        KVPressLM(pretrained=str(tmp_path), press="default:pool=max")  # (an empty directory: refused as a model)
    assert "pool" not in str(refused.value) and str(tmp_path) in str(refused.value)
    with pytest.raises(ValueError, match="key=value"):
        KVPressLM(pretrained=str(tmp_path), press="default:pool")


def test_a_default_press_takes_its_parameters_as_model_args(default_model):
    """`press=default,n_sink=8`: the argument replaces the default's own n_sink=4 (it was refused as given twice),
    before the model loads (checked against the named model's default) and once it has."""
    from kvpress.presses import spec_before_loading

    model, tokenizer = default_model
    bridge = KVPressLM(pretrained=model, tokenizer=tokenizer, press="default", compression_ratio=0.5, n_sink=8)
    assert bridge.press.press.n_sink == 8 and bridge.press.press.whole_words  # the default's other parameters kept
    early = spec_before_loading("default", "smollm2-135m", {"n_sink": 8, "compression_ratio": 0.5})
    assert "n_sink" not in early and "whole_words=true" in early


def test_query_agnostic_mode_needs_the_question(default_model):
    model, tokenizer = default_model
    bridge = KVPressLM(pretrained=model, tokenizer=tokenizer, press="knorm", compression_ratio=0.5)
    request = Instance("generate_until", {"text": "x"}, ("Some context. Some question?", {"until": ["\n"]}), 0)
    with pytest.raises(ValueError, match="no 'question' field.*query_aware=True"):
        bridge.generate_until([request], disable_tqdm=True)
    request = Instance("loglikelihood", {"question": "Not in the prompt?"}, ("Some context.", " x"), 0)
    with pytest.raises(ValueError, match="does not contain its document's question.*query_aware=True"):
        bridge.loglikelihood([request], disable_tqdm=True)
    with pytest.raises(ValueError, match="query_aware must be true or false"):
        KVPressLM(pretrained=model, tokenizer=tokenizer, press="knorm", compression_ratio=0.5, query_aware="maybe")


def test_kvzip_runs_through_the_bridge_in_both_modes(default_model):
    from kvpress.eval.tasks import task_examples

    model, tokenizer = default_model
    requests = _needle_requests(task_examples("needle_noise", tokenizer, 1, 256, 0))
    for aware in (False, True):
        bridge = KVPressLM(pretrained=model, tokenizer=tokenizer, press="kvzip", compression_ratio=0.5,
                           query_aware=aware)  # fmt: skip
        (answer,) = bridge.generate_until(requests, disable_tqdm=True)
        bridge.loglikelihood(_needle_requests(task_examples("needle_noise", tokenizer, 1, 256, 0), "loglikelihood"),
                             disable_tqdm=True)  # fmt: skip
        assert isinstance(answer, str) and len(bridge.kv_records) == 2
        for record in bridge.kv_records:  # half the context, then the question (and answer) in full
            assert 0.45 < record["kept_bytes"] / record["full_bytes"] < 0.65


def test_lookahead_drafts_from_the_question_in_the_bridge(default_model):
    from kvpress.eval.tasks import task_examples

    model, tokenizer = default_model
    examples = task_examples("needle_noise", tokenizer, 2, 256, 0)
    bridge = KVPressLM(pretrained=model, tokenizer=tokenizer, press="lookahead", compression_ratio=0.5,
                       query_aware=True, batch_size=2)  # fmt: skip
    answers = bridge.generate_until(_needle_requests(examples), disable_tqdm=True)
    expected = [kvpress.generate(model, tokenizer, e.context, e.question, press=kvpress.LookaheadPress(0.5),
                                 chat_template=False, query_aware=True, max_new_tokens=8).split("\n")[0]
                for e in examples]  # fmt: skip
    assert [a.strip() for a in answers] == [e.strip() for e in expected]  # the same draft, the same cache
    bridge.loglikelihood(_needle_requests(examples, "loglikelihood"), disable_tqdm=True)
    assert len(bridge.kv_records) == 4
    for record in bridge.kv_records:  # half the prompt, then its last token (and the answer) in full
        assert 0.45 < record["kept_bytes"] / record["full_bytes"] < 0.6


def test_needle_task_end_to_end_as_lm_eval_runs_it(default_model):
    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager

    from kvpress.eval.lm_eval_bridge import TASKS_DIR

    model, tokenizer = default_model
    manager = TaskManager(include_path=TASKS_DIR, include_defaults=False, metadata={"n": 2, "length": 128})
    with torch.inference_mode(False):  # lm-eval generates under no_grad only, not inference mode
        lm = KVPressLM(pretrained=model, tokenizer=tokenizer, press="chunkkv", inner="kvzip", compression_ratio=0.5)
        out = lm_eval.simple_evaluate(model=lm, tasks=["kvpress_needle_noise"], task_manager=manager, bootstrap_iters=0)
    assert 0 <= out["results"]["kvpress_needle_noise"]["score,none"] <= 1
    assert len(lm.kv_records) == 2 and all(r["kept_bytes"] < 0.7 * r["full_bytes"] for r in lm.kv_records)


def test_task_rows_cut_with_another_tokenizer_are_refused(default_model):
    """From Python, lm-eval hands the tasks no model_args: a kvpress task cut its contexts to length with the default
    model's tokenizer whatever the model (a 1,024-token Qwen context read as 977). The rows name their tokenizer, and
    a model that tokenizes otherwise is refused before any forward; named in the metadata, the rows follow it."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    from kvpress.eval.tasks.lm_eval_hooks import dataset, tokenizer_fingerprint
    from kvpress.models import resolve_model_path

    model, tokenizer = default_model
    qwen = AutoTokenizer.from_pretrained(resolve_model_path("qwen2.5-0.5b"), local_files_only=True)
    assert tokenizer_fingerprint(qwen) != tokenizer_fingerprint(tokenizer)
    import copy

    padded = copy.deepcopy(tokenizer)  # one given a pad token counts as the other does: not refused
    padded.add_special_tokens({"pad_token": "[PAD]"})
    assert len(padded) != len(tokenizer) and tokenizer_fingerprint(padded) == tokenizer_fingerprint(tokenizer)
    assert dataset("needle_noise", length=128, n=1)["test"][0]["tokenized_by"] == tokenizer_fingerprint(tokenizer)
    assert dataset("needle_noise", length=128, n=1, tokenizer=qwen)["test"][0]["tokenized_by"] == (
        tokenizer_fingerprint(qwen))  # fmt: skip
    forwards = []
    for press in (None, "knorm"):
        lm = KVPressLM(pretrained=model, tokenizer=qwen, press=press, compression_ratio=press and 0.5)
        hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
        with torch.inference_mode(False), pytest.raises(ValueError, match="counted its contexts' tokens with another "
                                                                          "tokenizer than this model's"):  # fmt: skip
            manager = TaskManager(include_path=TASKS_DIR, include_defaults=False, metadata={"n": 1, "length": 128})
            lm_eval.simple_evaluate(model=lm, tasks=["kvpress_needle_noise"], task_manager=manager, bootstrap_iters=0)
        hook.remove()
        assert not forwards
    lm = KVPressLM(pretrained=model, tokenizer=qwen, press="knorm", compression_ratio=0.5)
    doc = {"context": "Some text.", "question": "Q?", "answers": ["1"]}
    doc["tokenized_by"] = tokenizer_fingerprint(tokenizer)
    for kind, args in (("loglikelihood", ("Some text.\n\nQ?", " 1")), ("loglikelihood_rolling", ("Some text.",))):
        with pytest.raises(ValueError, match="another tokenizer"):
            getattr(lm, kind)([Instance(kind, doc, args, 0)], disable_tqdm=True)  # (the other request types)


def test_every_press_parameter_reaches_the_press(monkeypatch):
    """Each parameter of each press (the registry's, derived from the classes) goes to the press, not to HFLM (but
    those the tasks read too: refused, `test_a_press_parameter_the_tasks_also_read_is_refused_in_model_args`)."""
    from kvpress.eval import lm_eval_bridge
    from kvpress.eval.tasks.lm_eval_hooks import metadata_keys
    from kvpress.presses import press_names, press_parameters

    class Built(Exception):
        pass

    def capture(name, **kwargs):
        raise Built(name, kwargs)

    monkeypatch.setattr(lm_eval_bridge, "press_from_name", capture)
    for name in press_names():
        for param in press_parameters(name):
            if param in ("compression_ratio", "max_tokens", *metadata_keys()):
                continue
            with pytest.raises(Built) as built:
                KVPressLM(pretrained="unused", press=name, compression_ratio=0.5, **{param: "value"})
            assert built.value.args[0] == name and built.value.args[1].get(param) == "value", (name, param)


def test_adakv_normalize_from_model_args(default_model):
    """`--model_args press=adakv,normalize=true` as lm-eval parses it builds AdaKV with normalize=True."""
    from lm_eval.utils import simple_parse_args_string

    model, tokenizer = default_model
    args = simple_parse_args_string("press=adakv,normalize=true,compression_ratio=0.5,inner=kvzip,value_norm=true")
    lm = KVPressLM(pretrained=model, tokenizer=tokenizer, **args)
    assert lm.press.normalize is True and lm.press.press.value_norm is True
    assert type(lm.press.press).__name__ == "KVzipPress"


def test_query_agnostic_runs_name_the_question_by_field_or_regex(default_model):
    """A task whose documents hold no `question` field runs query-agnostic once the question is named: by
    another field (`question_key=`) or by where it starts in the prompt (`question_regex=`): the same answers
    as the `question` field gives."""
    from kvpress.eval.tasks import task_examples

    model, tokenizer = default_model
    examples = task_examples("needle_noise", tokenizer, 2, 256, 0)
    ask = dict(pretrained=model, tokenizer=tokenizer, press="snapkv", compression_ratio=0.6, window_size=8)
    expected = KVPressLM(**ask).generate_until(_needle_requests(examples), disable_tqdm=True)
    renamed = _needle_requests(examples)
    for request in renamed:
        request.doc = {"query": request.doc.pop("question"), **request.doc}
    with pytest.raises(ValueError, match="no 'question' field in its documents; name the field with question_key="):
        KVPressLM(**ask).generate_until(renamed, disable_tqdm=True)
    assert KVPressLM(**ask, question_key="query").generate_until(renamed, disable_tqdm=True) == expected
    starts = examples[0].question.split()[0]  # every needle question starts with the same word
    assert KVPressLM(**ask, question_regex=starts).generate_until(renamed, disable_tqdm=True) == expected
    with pytest.raises(ValueError, match="finds no question"):
        KVPressLM(**ask, question_regex="NO SUCH TEXT").generate_until(renamed, disable_tqdm=True)
    with pytest.raises(ValueError, match="not both"):
        KVPressLM(**ask, question_key="query", question_regex="x")
    with pytest.raises(ValueError, match="drop them"):
        KVPressLM(**ask, question_key="query", query_aware=True)
    with pytest.raises(ValueError, match="is not a regular expression"):
        KVPressLM(**ask, question_regex="(")


def test_an_lm_eval_task_without_a_question_field_runs_query_agnostic(default_model, monkeypatch):
    """lm-eval's own `infinitebench_longbook_qa_en`, fed from local documents (`eval/tasks/data/`), holds its
    question in `input`, not in a `question` field: with `question_key=input` each prompt is compressed up to its
    question, and the question and answer follow uncompressed, for every document lm-eval runs."""
    import inspect
    from pathlib import Path

    import lm_eval
    import lm_eval.tasks
    import torch
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml

    from kvpress.eval.lm_eval_bridge import TASKS_DIR

    task = "infinitebench_longbook_qa_en_local"
    local = load_yaml(Path(TASKS_DIR) / f"{task}.yaml")
    own = load_yaml(Path(lm_eval.tasks.__file__).parent / "infinitebench" / "infinitebench_longbook_qa_en.yaml")
    assert "question" not in own["doc_to_text"] and "{{input}}" in own["doc_to_text"]
    for key in own.keys() - {"task", "dataset_path", "dataset_kwargs", "metadata"}:  # lm-eval's task, local data
        if callable(own[key]):  # the scoring function: lm-eval's own, from its own file
            files = {Path(inspect.getfile(f)).resolve() for f in (local[key], own[key])}
            assert len(files) == 1 and local[key].__name__ == own[key].__name__, key
        else:
            assert local[key] == own[key], key
    monkeypatch.chdir(Path(TASKS_DIR).parents[1])  # the YAML's data_files are relative to the repository root
    manager = TaskManager(include_path=TASKS_DIR, include_defaults=False)
    model, tokenizer = default_model
    ask = dict(pretrained=model, tokenizer=tokenizer, press="snapkv", compression_ratio=0.5, window_size=8)
    run = dict(tasks=[task], task_manager=manager, limit=2, bootstrap_iters=0, log_samples=True)
    with torch.inference_mode(False):  # lm-eval generates under no_grad only, not inference mode
        with pytest.raises(ValueError, match="no 'question' field in its documents; name the field with question_key="):
            lm_eval.simple_evaluate(model=KVPressLM(**ask), **run)
        lm = KVPressLM(**ask, question_key="input")
        prefills, original = [], lm._prefill

        def prefill(prefix, following=None):
            cache = original(prefix, following)
            prefills.append((prefix, cache.layers[0].n))
            return cache

        lm._prefill = prefill
        out = lm_eval.simple_evaluate(model=lm, **run)
    samples = out["samples"][task]
    assert out["n-samples"][task]["effective"] == len(samples) == len(prefills) == len(lm.kv_records) == 2
    assert 0 <= out["results"][task]["score,none"] <= 1
    heads = {tokenizer.decode(prefix): (len(prefix), kept) for prefix, kept in prefills}
    for sample in samples:
        prompt, question = sample["arguments"][0][0], sample["doc"]["input"]
        head = prompt[: prompt.rindex(question)].rstrip(" ")  # " What": a token across the boundary stays whole
        assert head.endswith(f"{sample['doc']['context']}\n\nQuestion:") and head in heads
        n, kept = heads[head]  # compressed: the prompt up to its question, and no further
        assert len(tokenizer(prompt).input_ids) - n == len(tokenizer(prompt[len(head) :]).input_ids) > 10
        assert kept == n - int(n * 0.5) and n > 150
    for record in lm.kv_records:  # half the context kept, then the question and answer in full
        assert record["kept_bytes"] < 0.75 * record["full_bytes"]


def test_a_recalling_press_reads_the_question_before_the_continuation(default_model):
    """A press that recalls evicted spans recalls by the question, as when it answers: the continuation is read a
    token a forward after it (read at once, its own tokens chose what was recalled for it)."""
    model, tokenizer = default_model
    context = " ".join(f"Item {i} is numbered {i * 7 % 50}." for i in range(60))
    question = tokenizer("\n\nWhich item is numbered 21? Item", add_special_tokens=False).input_ids
    bridge = KVPressLM(pretrained=model, tokenizer=tokenizer, press="recall", compression_ratio=0.5, span_size=8)
    head = tokenizer(context).input_ids
    for continuation in (" 3 is numbered 21.", " 40 and item 3 are"):
        cont = tokenizer(continuation, add_special_tokens=False).input_ids
        scored, _ = bridge._score(bridge._prefill(head), question + cont, len(cont))
        cache, rows = bridge._prefill(head), []
        with torch.inference_mode(), bridge.press(model, tokenizer=tokenizer) as installed, installed.frozen():
            for part in [question, *([t] for t in cont[:-1])]:  # as an answer is read: the question, then each token
                rows.append(model(torch.tensor([part]), cache=cache, use_cache=True).logits[0, -1])
        logprobs = torch.log_softmax(torch.stack(rows).float(), dim=-1)
        assert scored == pytest.approx(float(logprobs.gather(-1, torch.tensor(cont)[:, None]).sum()), abs=1e-4)
