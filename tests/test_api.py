"""The public API's names, validation and error messages."""

import subprocess
import sys

import pytest
import torch
import transformers
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

import kvpress
from kvpress import (
    H2OPress,
    HeavyHitterPress,
    KnormPress,
    RandomPress,
    SinkWindowPress,
    SnapKVPress,
    StreamingLLMPress,
)

ALL = [SnapKVPress, HeavyHitterPress, SinkWindowPress, KnormPress, RandomPress]


def test_aliases():
    assert StreamingLLMPress is SinkWindowPress
    assert H2OPress is HeavyHitterPress


def test_import_patches_nothing():
    names = list(AttentionInterface._global_mapping) + list(AttentionMaskInterface._global_mapping)
    assert not [n for n in names if n.startswith("kvpress")]


@pytest.mark.parametrize("press", ALL)
@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5])
def test_ratio_out_of_range(press, ratio):
    with pytest.raises(ValueError, match=r"compression_ratio must be in \[0, 1\)"):
        press(compression_ratio=ratio)


def test_ratio_wrong_type():
    with pytest.raises(TypeError, match="compression_ratio"):
        SnapKVPress(compression_ratio="0.5")


@pytest.mark.parametrize("press", ALL)
def test_exactly_one_budget(press):
    with pytest.raises(ValueError, match="exactly one of compression_ratio"):
        press()
    with pytest.raises(ValueError, match="exactly one of compression_ratio"):
        press(compression_ratio=0.5, max_tokens=10)


def test_budget_smaller_than_protected_window():
    with pytest.raises(ValueError, match=r"max_tokens=10 is smaller than the protected tokens.*>= 64"):
        SnapKVPress(max_tokens=10)
    with pytest.raises(ValueError, match="smaller than the protected"):
        SinkWindowPress(max_tokens=3, n_sink=4)
    with pytest.raises(ValueError, match="smaller than the protected"):
        HeavyHitterPress(max_tokens=8, window=16)
    assert SnapKVPress(max_tokens=64).max_tokens == 64
    for field in ("n_sink", "window_size"):  # None is no count (it reached `None + 64` with max_tokens)
        with pytest.raises(ValueError, match=f"{field} must be a (non-negative|positive) integer, got None"):
            SnapKVPress(max_tokens=100, **{field: None})
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*31\), got 1000000000000"):
        kvpress.RandomPress(compression_ratio=0.5, seed=10**12)  # (it overflowed int64 at the first eviction)


def test_random_scores_hash_the_kv_head_in_a_one_head_view():
    """Under a head-wise press each KV head is scored alone: its hash keeps the head's own index (it was 0)."""
    from types import SimpleNamespace

    pos = torch.arange(12).repeat(1, 3, 1)  # [B, H, n]: every head holds the same positions
    press = kvpress.RandomPress(compression_ratio=0.5)
    dense = press.score(SimpleNamespace(layer=SimpleNamespace(pos=pos), layer_idx=2, kv_heads=slice(None)))
    assert not torch.equal(dense[:, 0], dense[:, 1])
    for h in range(3):
        view = SimpleNamespace(layer=SimpleNamespace(pos=pos[:, h : h + 1]), layer_idx=2, kv_heads=slice(h, h + 1))
        assert torch.equal(press.score(view), dense[:, h : h + 1])


def test_bad_max_tokens():
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        KnormPress(max_tokens=0)
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        KnormPress(max_tokens=2.5)


def test_sink_window_window():
    assert SinkWindowPress(n_sink=4, window=60).max_tokens == 64
    with pytest.raises(ValueError, match="not both"):
        SinkWindowPress(window=8, compression_ratio=0.5)


def test_unknown_press_name():
    with pytest.raises(ValueError, match="unknown press 'nope'; choose one of: .*snapkv"):
        kvpress.press_from_name("nope", compression_ratio=0.5)


def test_press_requires_a_press():
    from kvpress.engine import PressInstallation
    from tiny import tiny_model

    with pytest.raises(TypeError, match="press must be a kvpress press"):
        PressInstallation(tiny_model(), object())


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "kvpress.cli", *args], capture_output=True, text=True)


def _refused(monkeypatch, capsys, *args: str) -> str:
    """`kvpress ARGS` run in this process: refused with status 2 before any model loads; what it said."""
    from kvpress.cli import main

    def loaded(*args, **kwargs):
        raise RuntimeError("the model loads")

    monkeypatch.setattr(kvpress, "load_model", loaded)
    assert main(list(args)) == 2
    return capsys.readouterr().err


def test_the_cli_entry_point_refuses_an_unknown_press_with_status_2(tmp_path):
    (tmp_path / "c.txt").write_text("hello")
    res = _cli("generate", "--press", "nope", "--context-file", str(tmp_path / "c.txt"), "--question", "q")
    assert res.returncode == 2
    assert "unknown press 'nope'" in res.stderr


def test_cli_missing_file(tmp_path, monkeypatch, capsys):
    said = _refused(monkeypatch, capsys, "generate", "--press", "snapkv", "--context-file", str(tmp_path / "none.txt"),
                    "--question", "q")  # fmt: skip
    assert "none.txt does not exist" in said


def test_cli_bad_ratio(tmp_path, monkeypatch, capsys):
    (tmp_path / "c.txt").write_text("hello")
    said = _refused(monkeypatch, capsys, "generate", "--ratio", "1.2", "--context-file", str(tmp_path / "c.txt"),
                    "--question", "q")  # fmt: skip
    assert "compression_ratio must be in [0, 1)" in said


def test_cli_counts_are_checked_before_the_model_loads(tmp_path, monkeypatch, capsys):
    (tmp_path / "c.txt").write_text("hello")
    said = _refused(monkeypatch, capsys, "generate", "--max-new-tokens", "0", "--context-file", str(tmp_path / "c.txt"),
                    "--question", "q")  # fmt: skip
    assert "--max-new-tokens must be an integer >= 1, got 0" in said
    said = _refused(monkeypatch, capsys, "calibrate-heads", "--out", str(tmp_path / "p.json"), "--examples", "0")
    assert "--examples must be an integer >= 1, got 0" in said


def test_cli_checks_budgets_in_specs_and_chunk_sizes_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """demo takes a press spec that sets its own budget (it was refused as given twice, --ratio defaulting to 0.5),
    and shows that budget; generate refuses a chunk size of 0 before loading anything."""
    from kvpress.cli import _ratio_cell, main

    def loaded(*args, **kwargs):
        raise RuntimeError("the model loads")

    monkeypatch.setattr(kvpress, "load_model", loaded)
    with pytest.raises(RuntimeError, match="the model loads"):  # the checks passed
        main(["demo", "--presses", "snapkv:compression_ratio=0.25,knorm:max_tokens=100"])
    assert _ratio_cell(SnapKVPress(0.25)) == " 0.25" and _ratio_cell(SnapKVPress(max_tokens=100)) == "    -"
    (tmp_path / "c.txt").write_text("hello")
    assert main(["generate", "--prefill-chunk-size", "0", "--context-file", str(tmp_path / "c.txt"),
                 "--question", "q"]) == 2  # fmt: skip
    assert "prefill_chunk_size" in capsys.readouterr().err


def test_cli_saves_no_cache_a_press_could_not_compress(tmp_path, capsys):
    """--save-cache with a press that reads the question (refused before the model loads), or with a budget that
    holds the whole context (refused as kvpress.generate refuses it; it saved the uncompressed cache)."""
    from kvpress.cli import main

    (tmp_path / "c.txt").write_text("The code of the lock is 48213. " * 4)
    common = ["generate", "--context-file", str(tmp_path / "c.txt"), "--question", "q", "--save-cache"]
    assert main([*common, str(tmp_path / "a.safetensors"), "--press", "lookahead"]) == 2
    assert "--save-cache: LookaheadPress scores by the question" in capsys.readouterr().err
    assert main([*common, str(tmp_path / "b.safetensors"), "--press", "snapkv", "--max-tokens", "100000"]) == 2
    assert "max_tokens=100000 is not smaller than the context" in capsys.readouterr().err
    assert not (tmp_path / "b.safetensors").exists()


def test_cli_refuses_flags_it_would_ignore_before_the_model_loads(tmp_path, capsys):
    """--press none with a budget, --load-cache with a chunk size, train-scorer's update modes with training flags
    (or both): refused by name, before a model loads."""
    from kvpress.cli import main

    (tmp_path / "c.txt").write_text("hello")
    ask = ["generate", "--context-file", str(tmp_path / "c.txt"), "--question", "q"]
    cases = [(ask + ["--press", "none", "--ratio", "0.3"], "--press none keeps the whole cache"),
             (ask + ["--press", "none", "--max-tokens", "30"], "drop --ratio, --max-tokens and --query-aware"),
             (ask + ["--load-cache", str(tmp_path / "x.safetensors"), "--prefill-chunk-size", "64"],
              "drop --prefill-chunk-size"),
             (["train-scorer", "--out", "x", "--update-profile", "--update-words"], "give one"),
             (["train-scorer", "--out", "x", "--update-words", "--texts", "9", "--seed", "7"],
              "so --texts, --seed would be ignored"),
             (["calibrate-heads", "--out", str(tmp_path / "no" / "p.json")], "its directory does not exist"),
             (["train-gates", "--out", str(tmp_path / "no" / "g.safetensors")],
              "its directory does not exist"),
             (ask + ["--save-cache", str(tmp_path / "no" / "c.safetensors")],
              f"--save-cache {tmp_path / 'no' / 'c.safetensors'}: its directory does not exist"),
             (ask + ["--save-cache", str(tmp_path)], f"--save-cache {tmp_path} is a directory"),
             (ask + ["--press", "recall", "--save-cache", str(tmp_path / "c.safetensors")],
              "RecallPress keeps its evicted tokens in host memory"),
             (ask + ["--press", "none", "--query-aware"], "drop --ratio, --max-tokens and --query-aware"),
             (["train-scorer", "--out", str(tmp_path)], f"--out {tmp_path} is a directory"),
             (["demo", "--presses", "snapkv,lookahead"], "--presses lookahead: LookaheadPress scores by the question"),
             (["demo", "--presses", "none", "--ratio", "0.3"], "--presses none: the demo prints the full cache's row"),
             (["generate", "--context-file", str(tmp_path / "c.txt"), "--question", "q", "--press",
               "sink-window:window=100", "--ratio", "0.5"], "SinkWindowPress takes window= or a budget"),
             # refused only once the model had loaded
             (ask + ["--press", "lookahead"], "LookaheadPress scores by the question: add --query-aware"),
             (ask + ["--press", "simlayerkv", "--prefill-chunk-size", "8"], "cannot prefill in chunks"),
             (["generate", "--context-file", str(tmp_path / "c.txt"), "--question", "  "], "--question is empty"),
             (["generate", "--context-file", str(tmp_path / "blank.txt"), "--question", "q"],
              "holds no text"),
             # an empty value was taken as not given (--load-cache "" beside --press ran the press; --press "" the
             # default), a directory or a binary file as a context were "does not exist" or a bare codec error
             (ask + ["--load-cache", "", "--press", "snapkv"], "--load-cache is empty"),
             (ask + ["--press", ""], "--press is empty"),
             (["generate", "--context-file", "", "--question", "q"], "--context-file is empty"),
             (["generate", "--context-file", str(tmp_path), "--question", "q"], f"--context-file {tmp_path} is not "
              "a file"),
             (["generate", "--context-file", str(tmp_path / "bin.txt"), "--question", "q"], "is not UTF-8 text"),
             (ask + ["--ratio", "0.5", "--max-tokens", "10"], "--ratio and --max-tokens: give one budget")]  # fmt: skip
    (tmp_path / "blank.txt").write_text(" \n")
    (tmp_path / "bin.txt").write_bytes(b"\x00\x8a\xff\xfe")
    for argv, said in cases:
        assert main(argv) == 2
        assert said in capsys.readouterr().err


def test_cli_refuses_an_output_it_could_not_write(tmp_path, capsys, monkeypatch):
    import os

    from kvpress.cli import main

    monkeypatch.setattr(os, "access", lambda path, mode: False)  # (a test run as root may write anywhere)
    assert main(["calibrate-heads", "--out", str(tmp_path / "p.json")]) == 2
    assert f"--out {tmp_path / 'p.json'}: cannot write there ({tmp_path} is not a directory this process can " \
           "write in)" in capsys.readouterr().err  # fmt: skip
    assert main(["calibrate-heads", "--out", ""]) == 2  # ('--out  is a directory' before: "" is the working one)
    assert "--out is empty: give the file to write" in capsys.readouterr().err
    from kvpress.eval.sweep import main as sweep  # (it took "" and wrote in the working directory)

    assert sweep(["--out", "", "--presses", "snapkv", "--tasks", "needle_noise"]) == 2
    assert "--out is empty: give the directory to write" in capsys.readouterr().err
    with pytest.raises(TypeError, match="offloaded_bytes counts a transformers Cache .*, got NoneType"):
        kvpress.offloaded_bytes(None)  # (an AttributeError on 'layers' before)


def test_cli_budget_in_the_press_name_is_the_budget():
    """`--press snapkv:max_tokens=100` is that budget (no r = 0.5 added beside it); no budget anywhere is r = 0.5."""
    from argparse import Namespace

    from kvpress.cli import _press, _spec

    assert _spec(Namespace(press="snapkv:max_tokens=100", ratio=None, max_tokens=None)) == "snapkv:max_tokens=100"
    assert _spec(Namespace(press="snapkv", ratio=None, max_tokens=None)) == "snapkv:compression_ratio=0.5"
    assert _spec(Namespace(press="snapkv", ratio=None, max_tokens=30)) == "snapkv:max_tokens=30"
    press = _press("snapkv:compression_ratio=0.3", None, None)
    assert press.compression_ratio == 0.3 and press.max_tokens is None
    assert _press("knorm", None, None).compression_ratio == 0.5
    assert _press("sink-window:window=100", None, None).max_tokens == 104  # its window is its budget
    assert _press("streaming-llm:window=100", None, None).max_tokens == 104
    assert _press("duo-attention:retrieval_fraction=0.3", None, None).compression_ratio is None
    duo = _press("duo-attention:retrieval_fraction=0.3:inner=snapkv", None, None)  # the ratio is the inner press's
    assert duo.retrieval_fraction == 0.3 and duo.press.compression_ratio == 0.5
    for wrapper in ("adakv", "pyramidkv"):  # the inner press's window is the budget (r = 0.5 was added: refused)
        assert _press(f"{wrapper}:inner=sink-window:window=8", None, None).max_tokens == 12
    duo = _press("duo-attention:retrieval_fraction=0.3:inner=sink-window:window=8", None, None)  # the streaming heads'
    assert duo.window == 8 and duo.press.compression_ratio == 0.5  # window: the inner press's budget is r = 0.5


def test_protected_tokens_over_the_budget_are_said_once():
    from tiny import prompt, tiny_model

    model = tiny_model("llama")
    press = SnapKVPress(compression_ratio=0.9)  # a 64-token window on a 40-token prompt
    with pytest.warns(UserWarning, match="SnapKVPress keeps 40 of 40 tokens where its budget allows 4") as said:
        with press(model):
            model.generate(prompt(1, 40), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert len([w for w in said if "budget allows" in str(w.message)]) == 1


def test_cli_saves_a_cache_and_a_new_process_answers_from_it(tmp_path, monkeypatch, capsys):
    """`kvpress generate --save-cache` then `--load-cache` (two processes): the same answer and bytes; the
    loaded cache keeps its press; flags that cannot go together are refused before a model loads."""
    from kvpress.cli import DEMO_QUESTION, demo_document

    doc, saved = tmp_path / "doc.txt", tmp_path / "doc.safetensors"
    doc.write_text(demo_document(n_words=150))
    ask = ("generate", "--context-file", str(doc), "--question", DEMO_QUESTION, "--max-new-tokens", "12")
    first = _cli(*ask, "--press", "snapkv:window_size=8", "--ratio", "0.5", "--save-cache", str(saved))
    assert first.returncode == 0, first.stderr[-2000:]
    second = _cli(*ask, "--load-cache", str(saved))
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.stdout == first.stdout
    assert "snapkv:window_size=8:compression_ratio=0.5" in second.stderr.splitlines()[-1]
    for extra, said in ((("--press", "knorm"), "drop --press"), (("--query-aware",), "drop --query-aware"),
                        (("--save-cache", str(saved)), "give one")):  # fmt: skip
        assert said in _refused(monkeypatch, capsys, *ask, "--load-cache", str(saved), *extra)
    assert "does not exist" in _refused(monkeypatch, capsys, *ask, "--load-cache", str(tmp_path / "none.safetensors"))


def test_a_setting_moved_after_the_press_was_built_is_checked_again_as_it_installs():
    """`press.kernel_size = 4` (even) failed deep inside torch, `decode_slack = 5.0` or a negative layer scale ran
    without a word: each is refused as at construction, naming what moved; a valid move runs (a wrapper's too)."""
    from kvpress import AdaKVPress
    from tiny import prompt, tiny_model

    model = tiny_model("llama", num_hidden_layers=3)
    for name, value, said in (("kernel_size", 4, "kernel_size must be a positive odd integer"),
                              ("decode_slack", 5.0, r"decode_slack must be a fraction in \[0, 1\)"),
                              ("layer_scales", (1.0, -1.0, 1.0), "layer_scales must be positive numbers")):  # fmt: skip
        press = SnapKVPress(compression_ratio=0.5, window_size=4)
        setattr(press, name, value)
        with pytest.raises(ValueError, match=f"SnapKVPress was given {name}=.* after it was built: {said}"):
            with press(model):
                pass
    wrapper = AdaKVPress(SnapKVPress(compression_ratio=0.5, window_size=4))
    wrapper.alpha_safeguard = 3
    with pytest.raises(ValueError, match="alpha_safeguard must be a fraction in"):
        with wrapper(model):
            pass
    wrapper.alpha_safeguard, wrapper.press.window_size = 0.5, 8
    with wrapper(model):
        model.generate(prompt(1, 40), max_new_tokens=2, do_sample=False, pad_token_id=0)
    wrapper.decode_slack = 0.5  # a setting the wrapper takes from its press, moved on the wrapper: said so
    with pytest.raises(ValueError, match="AdaKVPress takes decode_slack from the wrapped press; set it there"):
        with wrapper(model):
            pass
    window = kvpress.SinkWindowPress(window=8)  # a budget taken from a setting: moving another one keeps it
    window.n_sink, window.rerotate = 2, True
    with window(model):
        pass
    assert window.max_tokens == 10
    knorm = kvpress.KnormPress(compression_ratio=0.5)
    knorm.layer_scales = (s for s in (1.0, 2.0, 1.0))  # taken as the press built of it holds it
    with knorm(model):
        pass
    assert knorm.layer_scales == (1.0, 2.0, 1.0)
    from tiny import tiny_pattern

    duo = kvpress.DuoAttentionPress(compression_ratio=0.5, head_pattern=tiny_pattern(model), window=4)
    duo.window = 0
    with pytest.raises(ValueError, match="DuoAttentionPress was given window=0 after it was built: window must be a"):
        with duo(model):
            pass
    with pytest.raises(ValueError, match="layer_scales must be a list of positive numbers in layer order"):
        SnapKVPress(compression_ratio=0.5, layer_scales={0: 1.0, 1: 2.0})


def test_a_budget_set_after_the_press_was_built_is_checked_and_shared_with_what_it_wraps():
    """A tuning loop sets `press.compression_ratio = r` between runs: the value is checked as the press installs (1.5
    evicted nearly everything), and a wrapper and the press it wraps keep one budget, whichever of them was set (the
    wrapper kept the copy it took when built: `inner.compression_ratio = 0.9` was ignored); a window press's budget
    follows its window."""
    from transformers import DynamicCache

    from kvpress import ChunkPress, PyramidKVPress
    from tiny import prompt, tiny_model

    model, ids = tiny_model("llama"), prompt(length=40)

    def held(press) -> int:
        cache = DynamicCache(config=model.config)
        with press(model):
            model(ids, cache=cache, use_cache=True)
        return cache.layers[0].n

    press = SnapKVPress(compression_ratio=0.5, window_size=4)
    press.compression_ratio = 1.5
    with pytest.raises(ValueError, match=r"compression_ratio must be in \[0, 1\) .*got 1.5"):
        held(press)
    press.compression_ratio, press.max_tokens = 0.5, 8
    with pytest.raises(ValueError, match="takes exactly one of compression_ratio .* or max_tokens"):
        held(press)
    inner = SnapKVPress(compression_ratio=0.5, window_size=4)
    chunked = ChunkPress(inner, chunk_size=4)
    assert held(chunked) == 20
    inner.compression_ratio = 0.75
    assert held(chunked) == 10 and chunked.compression_ratio == 0.75
    chunked.compression_ratio = 0.25
    assert held(chunked) == 30 and inner.compression_ratio == 0.25
    chunked.compression_ratio = inner.compression_ratio = 0.5  # both to one value: consistent, then one moves
    assert held(chunked) == 20
    inner.compression_ratio = 0.75
    assert held(chunked) == 10
    chunked.compression_ratio, inner.compression_ratio = 0.5, 0.25
    with pytest.raises(ValueError, match="ChunkPress's budget and its wrapped SnapKVPress's were both set"):
        held(chunked)
    fixed = ChunkPress(SnapKVPress(max_tokens=64, window_size=4), chunk_size=4)
    fixed.press.max_tokens = 8  # checked as it stands before the model runs: 8 compresses a 40-token context
    kvpress.pipeline.check_compresses(fixed, 40)
    assert fixed.max_tokens == 8
    innermost = SnapKVPress(compression_ratio=0.5, window_size=4)
    nested = ChunkPress(PyramidKVPress(innermost, beta=1), chunk_size=4)
    innermost.compression_ratio = 0.75
    assert held(nested) == 10 and nested.compression_ratio == nested.press.compression_ratio == 0.75
    nested.compression_ratio = 0.25
    assert held(nested) == 30 and innermost.compression_ratio == 0.25
    window = SinkWindowPress(window=8, n_sink=2)
    assert held(window) == 10
    window.window = 16
    assert held(window) == 18 and window.max_tokens == 18
    window.window, window.max_tokens = 20, 22  # consistent: the record follows
    assert held(window) == 22
    window.window = 24
    assert held(window) == 26
    window.max_tokens = 30
    with pytest.raises(ValueError, match="built with window= takes its budget from it .* set window, not max_tokens"):
        held(window)
    from kvpress.rounds import RoundPolicy

    policy = RoundPolicy(inner=ChunkPress(SnapKVPress(compression_ratio=0.5, window_size=4), chunk_size=4))
    policy.inner.press.compression_ratio = 1.5  # a chat's round policy applies its inner press itself, each turn
    with pytest.raises(ValueError, match=r"compression_ratio must be in \[0, 1\) .*got 1.5"):
        policy.check_model(model)
    duo = kvpress.DuoAttentionPress(retrieval_fraction=0.5, press=SnapKVPress(compression_ratio=0.5, window_size=4))
    duo.press.compression_ratio = 1.5  # (its own budget: the retrieval heads keep what it keeps)
    with pytest.raises(ValueError, match=r"compression_ratio must be in \[0, 1\) .*got 1.5"):
        held(duo)
    duo.press.compression_ratio, duo.retrieval_fraction = 0.5, 2.0
    with pytest.raises(ValueError, match="retrieval_fraction must be a fraction in \\[0, 1\\], got 2.0"):
        held(duo)


def test_settings_a_wrapper_took_as_it_was_built_are_refused_once_moved_on_its_press():
    """A wrapper takes rerotate / decode_slack / layer_scales / kv_bits from its press as it is built (and checks them
    against itself: AdaKV refuses rerotate); `inner.kv_bits = 8` afterwards was ignored (the cache stayed in the
    model's dtype). It is refused, naming the setting; the wrapper built again around the press applies it."""
    from transformers import DynamicCache

    from kvpress import AdaKVPress, ChunkPress, PyramidKVPress
    from tiny import prompt, tiny_model

    model, ids = tiny_model("llama"), prompt(length=40)

    def bits(press) -> int | None:
        cache = DynamicCache(config=model.config)
        with press(model):
            model(ids, cache=cache, use_cache=True)
        return getattr(cache.layers[0], "kv_bits", None)

    inner = SnapKVPress(compression_ratio=0.5, window_size=4)
    chunked = ChunkPress(inner, chunk_size=4)
    assert bits(chunked) is None
    inner.kv_bits = 8
    with pytest.raises(ValueError, match=r"the SnapKVPress that ChunkPress wraps was given kv_bits=8 \(built with "
                                         r"None\) after ChunkPress was built.*build the ChunkPress again"):  # fmt: skip
        bits(chunked)
    assert bits(ChunkPress(inner, chunk_size=4)) == 8
    innermost = SnapKVPress(compression_ratio=0.5, window_size=4)
    nested = ChunkPress(PyramidKVPress(innermost, beta=1), chunk_size=4)
    innermost.rerotate = True  # (AdaKV would have refused it as it was built)
    with pytest.raises(ValueError, match="SnapKVPress that PyramidKVPress wraps was given rerotate=True"):
        bits(nested)
    head = SnapKVPress(compression_ratio=0.5, window_size=4)
    ada = AdaKVPress(head)
    head.rerotate = True
    with pytest.raises(ValueError, match="SnapKVPress that AdaKVPress wraps was given rerotate=True"):
        bits(ada)
    with pytest.raises(ValueError, match="AdaKVPress gives heads different budgets"):
        AdaKVPress(head)
    scorer = SnapKVPress(compression_ratio=0.5, window_size=4)
    duo = kvpress.DuoAttentionPress(retrieval_fraction=0.5, press=scorer)  # (it takes its press's kv_bits too)
    scorer.kv_bits = 8
    with pytest.raises(ValueError, match=r"the SnapKVPress that DuoAttentionPress wraps was given kv_bits=8"):
        bits(duo)


def test_a_wrong_cache_a_missing_tokenizer_and_a_shared_config_are_named(tokenized):
    """Each raised a bare AttributeError / TypeError, or named the wrong model."""
    import copy

    from tiny import CONTEXT, QUESTION

    model, tokenizer = tokenized
    with pytest.raises(TypeError, match="cache must be None or an empty transformers DynamicCache .* got list"):
        kvpress.generate(model, tokenizer, CONTEXT, QUESTION, cache=[])
    with pytest.raises(TypeError, match="a text is streamed as the tokenizer's token ids: .* got tokenizer=None"):
        next(kvpress.stream(model, None, "some text to stream", SnapKVPress(0.5, window_size=4)))
    twin = type(model)(model.config).eval()  # built on the same config object
    with SnapKVPress(0.5, window_size=4)(model):
        with pytest.raises(RuntimeError, match="or on another model built on the same config object .*copy.deepcopy"):
            SnapKVPress(0.5, window_size=4)(twin).__enter__()
    twin = type(model)(copy.deepcopy(model.config)).eval()
    with SnapKVPress(0.5, window_size=4)(model), SnapKVPress(0.5, window_size=4)(twin):
        assert twin.config._attn_implementation != model.config._attn_implementation  # each its own


def test_trainers_and_calibration_refuse_bad_settings_before_the_model_loads_or_any_work(tmp_path, capsys, monkeypatch,
                                                                                       tokenized):  # fmt: skip
    """train-gates' --lr / --sparsity and train-scorer's --update-* file were refused once the model had loaded,
    tokens past the training text with a bare randrange error; from Python, window=2.5 once every layer had trained,
    and a float length / vocab with raw TypeErrors."""
    import kvpress
    from kvpress.calibrate_heads import calibrate_heads
    from kvpress.cli import main
    from kvpress.train_gates import train_gates
    from kvpress.words import word_edges

    monkeypatch.setattr(kvpress, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    out = str(tmp_path / "g.safetensors")
    cases = [(["train-gates", "--out", out, "--lr", "-1"], "lr must be a finite number > 0, got -1.0"),
             (["train-gates", "--out", out, "--sparsity", "nan"], "sparsity must be a finite number >= 0, got nan"),
             (["train-scorer", "--out", out, "--tokens", "1000000"], "tokens must be at most"),
             (["train-scorer", "--out", str(tmp_path / "none.safetensors"), "--update-words"], "none.safetensors")]
    for argv, said in cases:
        assert main(argv) == 2
        assert said in capsys.readouterr().err
    model, tokenizer = tokenized
    with pytest.raises(ValueError, match="window must be an integer >= 1, got 2.5"):
        train_gates(model, tokenizer, "t", texts=1, held_out=1, tokens=64, epochs=1, window=2.5)
    for call, said in ((lambda: calibrate_heads(model, tokenizer, "t", length=200.5), "length must be an integer"),
                       (lambda: calibrate_heads(model, tokenizer, "t", examples=True), "examples must be an integer"),
                       (lambda: word_edges(tokenizer, 10.0), "vocab must be an integer >= 1, got 10.0")):
        with pytest.raises(ValueError, match=said):
            call()


def test_generate_and_a_chat_refuse_a_tokenizer_past_the_models_vocabulary_and_a_press_left_active():
    """A tokenizer with more ids than the model's embedding gave a raw IndexError (generate and a chat turn); a
    missing model or tokenizer a bare TypeError / AttributeError; press=None inside another press's block was
    compressed by it without a word (a second press there is refused)."""
    from transformers import AutoTokenizer

    from kvpress.models import resolve_model_path
    from tiny import CONTEXT, tiny_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(), local_files_only=True)
    small = tiny_model("llama")  # 128 ids
    with pytest.raises(ValueError, match="past the model's vocabulary of 128"):
        kvpress.generate(small, tokenizer, CONTEXT, "Where?")
    with pytest.raises(ValueError, match="past the model's vocabulary of 128"):
        kvpress.ChatSession(small, tokenizer, max_new_tokens=2).send("hi")
    with pytest.raises(TypeError, match="takes a model and its tokenizer, got LlamaForCausalLM and NoneType"):
        kvpress.generate(small, None, CONTEXT, "Where?")
    # a press entered with a tokenizer that cannot be the model's (KVzip's own prompt: "'str' object is not
    # callable", an IndexError in the embedding; SnapKV took it without a word)
    with pytest.raises(TypeError, match="tokenizer must be the model's tokenizer object .*, got 'gpt2'"):
        kvpress.SnapKVPress(0.5)(small, tokenizer="gpt2")
    with pytest.raises(ValueError, match="the tokenizer has 49152 tokens, more than the model's vocabulary of 128"):
        kvpress.KVzipPress(compression_ratio=0.5)(small, tokenizer=tokenizer)
    for context, question in ((CONTEXT, "   "), (" \n", "Where?")):  # (whitespace was answered; a chat refuses it)
        with pytest.raises(ValueError, match="must be a string with some text"):
            kvpress.generate(small, tokenizer, context, question)
    model = tiny_model("llama", vocab_size=len(tokenizer))
    # a full cache asked for inside another press's block: the chat, the stream and the pipeline were compressed by
    # it without a word (a chat of 49 tokens held 25), where kvpress.generate refused
    pipe = transformers.pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    calls = {"kvpress.generate": lambda: kvpress.generate(model, tokenizer, CONTEXT, "Where?", max_new_tokens=2),
             "ChatSession.send": lambda: kvpress.ChatSession(model, tokenizer, max_new_tokens=2).send("Where?"),
             "kvpress.stream": lambda: next(kvpress.stream(model, tokenizer, CONTEXT, progress=False)),
             "kv-press-text-generation": lambda: pipe(CONTEXT, question="Where?", max_new_tokens=2)}  # fmt: skip
    for caller, call in calls.items():
        with kvpress.KnormPress(0.5)(model), pytest.raises(ValueError, match=rf"^{caller}\(press=None\) runs inside"):
            call()
    with kvpress.KnormPress(0.5)(model):  # a chat's round policy observes the press's forwards: nothing evicted
        policy = kvpress.RoundPolicy(top_k_rounds=1, keep_recent_rounds=1)
        assert isinstance(kvpress.ChatSession(model, tokenizer, round_policy=policy, max_new_tokens=2).send("Hi"), str)


def test_small_public_calls_name_their_bad_input():
    """Raw errors before: stream(cache=[]) an AttributeError, cache_bytes(None) another, load_cache(a directory)
    "does not exist", ChatSession(system=123) a template TypeError at the first turn (system="" was dropped
    silently), stream(progress="no") took the string as true."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from kvpress.models import resolve_model_path
    from tiny import prompt, tiny_model

    model = tiny_model("llama")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(), local_files_only=True)
    with pytest.raises(TypeError, match="cache must be None or an empty transformers DynamicCache, got list"):
        kvpress.stream(model, None, prompt(1, 8)[0], cache=[])
    with pytest.raises(ValueError, match="progress must be True or False, got 'no'"):
        kvpress.stream(model, None, prompt(1, 8)[0], progress="no")
    with pytest.raises(TypeError, match="cache_bytes counts a transformers Cache"):
        kvpress.cache_bytes(None)
    with pytest.raises(ValueError, match="is a directory: name the .safetensors file"):
        kvpress.load_cache(Path(__file__).parent, model)
    for system in (123, ["a"], " "):
        with pytest.raises(ValueError, match="system must be a system prompt with some text"):
            kvpress.ChatSession(model, tokenizer, system=system)


def test_public_functions_name_a_bad_argument(tokenized, tmp_path):
    """Each refused where it was given, naming it and what is allowed (they raised AttributeErrors from deep inside,
    ran a wrapper's string as 'None', or ran a setting that does nothing without a word)."""
    from kvpress import AdaKVPress, ChatSession, RoundPolicy, ThinKPress, load_cache, save_cache, stream
    from kvpress.presses import KVzipPress
    from kvpress.recording import compress_recording, record_prefill
    from tiny import prompt

    model, tokenizer = tokenized
    recording = record_prefill(model, prompt(1, 40))
    press = SnapKVPress(compression_ratio=0.5, window_size=4)
    refused = [
        (lambda: compress_recording(model, recording, "snapkv"), "press must be a kvpress press"),
        (lambda: compress_recording(model, recording, None), "press must be a kvpress press"),
        (lambda: compress_recording(model, "rec", press), "recording must be a kvpress Recording"),
        (lambda: compress_recording(model, recording, press, in_place="no"), "in_place must be True or False"),
        (lambda: AdaKVPress("snapkv"), "AdaKVPress wraps a press object, got the name 'snapkv'"),
        (lambda: save_cache(recording.cache, tmp_path / "c.safetensors", "model"), "needs a transformers Pre"),
        (lambda: load_cache(tmp_path / "c.safetensors", "model"), "needs a transformers PreTrainedModel, got str"),
        (lambda: load_cache(123, model), "path must name a .safetensors file"),
        (lambda: stream("model", tokenizer, "some text here"), "needs a transformers PreTrainedModel, got str"),
        (lambda: ChatSession("model", tokenizer), "needs a transformers PreTrainedModel, got str"),
        (lambda: ChatSession(model, tokenizer).send("hi", max_new_tokens=2, streamer="x"), "streamer must be a"),
        (lambda: ChatSession(model, tokenizer).send("hi", max_new_tokens=2, streamer=transformers.TextStreamer),
         "streamer must be a"),  # (the class, not one: put() missing an argument, after the prefill)
        (lambda: RoundPolicy(inner=SnapKVPress(compression_ratio=0.5, decode_slack=0.5)), "decode_slack does not "),
        (lambda: KVzipPress(compression_ratio=0.5, rerotate=True), "KVzipPress scores the whole context once"),
        (lambda: ThinKPress(press, key_channel_ratio=0.05)(model), r"key_channel_ratio=0.05 prunes none of the 16"),
    ]  # fmt: skip
    for call, said in refused:
        with pytest.raises((TypeError, ValueError), match=said):
            call()
    policy = RoundPolicy(inner=SnapKVPress(compression_ratio=0.5))
    policy.inner.decode_slack = 0.5  # set between turns: refused at the next
    with pytest.raises(ValueError, match="decode_slack does not apply there"):
        policy.check_model(model)


def test_numpy_numbers_are_taken_and_other_bad_inputs_named(tokenized, tmp_path):
    """A budget from a numpy sweep was refused as if it were no number ("max_tokens must be a positive integer, got
    np.int64(64)"; np.float32 ratios refused, np.float64 ones kept as numpy scalars); the others raised deep inside
    (save_cache to a directory or a missing one: a rename error naming a temporary file, safetensors' I/O error),
    named no value, or printed a whole model."""
    import numpy as np
    from transformers import DynamicCache

    from kvpress import DuoAttentionPress, RoundPolicy, RoundStore, SnapKVPress, save_cache
    from kvpress.pipeline import split_prompt
    from tiny import prompt

    model, tokenizer = tokenized
    press = SnapKVPress(max_tokens=np.int64(64), window_size=np.int32(8), layer_scales=np.array([1, 2, 1], "f4"))
    assert (press.max_tokens, press.window_size, press.layer_scales) == (64, 8, (1.0, 2.0, 1.0))
    assert type(press.max_tokens) is int and all(type(s) is float for s in press.layer_scales)
    ratio = SnapKVPress(compression_ratio=np.float32(0.5))
    assert type(ratio.compression_ratio) is float and ratio.compression_ratio == 0.5
    ratio.compression_ratio = np.float64(0.25)  # set between runs, as a tuning loop does
    assert type(ratio.compression_ratio) is float
    assert RoundPolicy(top_k_rounds=np.int64(3)).top_k_rounds == 3
    assert DuoAttentionPress(ratio, retrieval_fraction=0.5).press is ratio  # positional, as the wrappers take it
    cache = DynamicCache()
    model(prompt(1, 12), cache=cache)
    refused = [
        (lambda: SnapKVPress(model), "got a LlamaForCausalLM: a press is built with its budget, then applied"),
        (lambda: SnapKVPress(np.array([0.5, 0.6])), "compression_ratio must be a number"),
        (lambda: DuoAttentionPress(compression_ratio=0.5, head_pattern={}), "head pattern given as a dict is malf"),
        (lambda: RoundStore(device=None), "RoundStore's device is where stored spans are kept, .* got None"),
        (lambda: save_cache(cache, tmp_path, model), f"save_cache's path {tmp_path} is a directory"),
        (lambda: save_cache(cache, tmp_path / "no" / "c.safetensors", model), "its directory does not exist"),
        (lambda: split_prompt(tokenizer, None, "q"), "context must be a non-empty string, got None"),
    ]  # fmt: skip
    for call, said in refused:
        with pytest.raises((TypeError, ValueError), match=said):
            call()
    assert not list(tmp_path.iterdir())


def test_a_budget_that_compresses_nothing_is_refused_or_said(tokenized):
    """Each kept the whole context without a word: a ratio too small to remove one token (its max_tokens twin was
    refused), DuoAttention at a ratio whose budget is not more than a streaming head (r = 0.75 kept everything where
    r = 0.5 halved it), a whole-context press fed one token a forward (prefill_chunk_size=1: each chunk looked like
    a decoding step). Subnormal layer_scales divided by zero."""
    import warnings

    from transformers import DynamicCache

    from kvpress import (
        DuoAttentionPress,
        KnormPress,
        SnapKVPress,
        ThinKPress,
        cache_bytes,
        generate,
        press_from_name,
        stream,
    )
    from tiny import prompt, tiny_pattern

    model, tokenizer = tokenized
    context = "Ada keeps her bicycle in the blue shed. " * 4  # (about 40 tokens)
    kvzip = press_from_name("kvzip", compression_ratio=0.5, window_size=2)
    refused = [
        (lambda: generate(model, tokenizer, context, "Where?", KnormPress(0.01)),
         r"nothing would be compressed: compression_ratio=0.01 removes floor\(\d+ x 0.01\) = 0 of the context's"),
        (lambda: generate(model, tokenizer, context * 5, "Where?",
                          DuoAttentionPress(compression_ratio=0.75, head_pattern=tiny_pattern(model))),
         r"DuoAttentionPress's budget at compression_ratio=0.75 \(\d+ of the context's \d+ tokens\) is not more than"),
        (lambda: generate(model, tokenizer, context, "Where?", kvzip, prefill_chunk_size=1),
         "a chunk of one token is a decoding step to it, kept unscored: nothing would be compressed"),
        (lambda: KnormPress(0.5, layer_scales=(5e-324, 1.0, 1.0)), "layer_scales must each be at least 1e-9"),
        (lambda: generate(model, tokenizer, context, "Where?", DuoAttentionPress(retrieval_fraction=0.5,
                                                                                head_pattern=tiny_pattern(model))),
         "DuoAttentionPress's streaming heads keep their 4 sinks and window of 64, the whole context"),
    ]  # fmt: skip
    for call, said in refused:
        with pytest.raises(ValueError, match=said):
            call()
    # what compresses without evicting a token, or in some layers only, is taken (a review found them refused)
    full = DynamicCache(config=model.config)
    generate(model, tokenizer, context, "Where?", cache=full)
    shrinking = (SnapKVPress(0.5, kv_bits=4), ThinKPress(SnapKVPress(0.5)),
                 DuoAttentionPress(compression_ratio=0.5, head_pattern=tiny_pattern(model), kv_bits=4))
    for press in (*shrinking, KnormPress(0.01, layer_scales=(0.5, 1, 1.5))):
        cache = DynamicCache(config=model.config)
        generate(model, tokenizer, context, "Where?", press, cache=cache)
        if press in shrinking:
            assert cache_bytes(cache) < 0.9 * cache_bytes(full), press  # (ThinK: keys 40% narrower)
        else:  # its first layer's share removes tokens
            assert cache.layers[0].n < full.layers[0].get_seq_length() == cache.layers[1].n
    nlls = list(stream(model, tokenizer, prompt(1, 20)[0], SnapKVPress(0.5)))  # a stream measures a short one whole
    assert sum(len(n) for n in nlls) == 19
    assert generate(model, tokenizer, context * 5, "Where?", DuoAttentionPress(compression_ratio=0.5,
                                                                               head_pattern=tiny_pattern(model)))
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        for chunk in (1, 1, 2):  # said once per press
            with kvzip(model, tokenizer=tokenizer):
                model.generate(prompt(1, 10), cache=DynamicCache(config=model.config), max_new_tokens=1,
                               prefill_chunk_size=chunk, do_sample=False)  # fmt: skip
    single = [w for w in told if "this one is a single token" in str(w.message)]
    assert len(single) == 1 and "prefill_chunk_size=1, compresses nothing" in str(single[0].message)


def test_a_warning_in_a_module_run_as_main_is_said(tmp_path):
    """`python -m kvpress.eval.bench_core` died at its first warning: the line was looked up through the module's
    loader under the name __main__ (ImportError from inside warnings)."""
    (tmp_path / "pkgx").mkdir()
    (tmp_path / "pkgx" / "__init__.py").write_text("")
    (tmp_path / "pkgx" / "run.py").write_text("from kvpress.patches.user_warnings import warn\nwarn('said')\n")
    done = subprocess.run([sys.executable, "-W", "always", "-m", "pkgx.run"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and "run.py:2: KVPressWarning: said" in done.stderr, done.stderr


def test_warnings_name_the_users_line_in_kvpress_category():
    """A press's warning named a line deep inside kvpress or transformers (`base.py:400`, `generation/utils.py`,
    `modeling_llama.py`), so it could be filtered only by that module: it names the caller's line now, as a
    KVPressWarning, and filtering that category silences it alone."""
    import warnings

    from kvpress import KVPressWarning, SnapKVPress
    from tiny import prompt, tiny_model

    model = tiny_model("llama")

    def run(press):
        with press(model):
            model.generate(prompt(1, 20), max_new_tokens=2, do_sample=False, pad_token_id=0)  # (the line said)
        return run.__code__.co_firstlineno + 2

    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        line = run(SnapKVPress(compression_ratio=0.5))  # its window of 64 holds all 20 tokens: it keeps them all
        model.model(prompt(1, 4))  # no press: nothing said
    floor = [w for w in told if "are always kept" in str(w.message)]
    assert len(floor) == 1 and floor[0].category is KVPressWarning and issubclass(KVPressWarning, UserWarning)
    assert (floor[0].filename, floor[0].lineno) == (__file__, line)
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=KVPressWarning)
        run(SnapKVPress(compression_ratio=0.5))
    assert not told
