"""The default press per model: one file says which, `default` names it everywhere a press is named."""

import json

import pytest

import kvpress
from kvpress.cli import main as cli_main
from kvpress.patterns import load_pattern
from kvpress.presses import DEFAULT_PRESS, default_press, press_from_name, resolve_default
from kvpress.presses.defaults import _FILE
from tiny import tiny_model


def test_every_entry_names_a_press_that_builds_and_a_packaged_model_by_its_hash():
    table = json.loads(_FILE.read_text())
    assert table["any"]["press"] == DEFAULT_PRESS and table["any"]["why"] and table["any"]["evidence"]
    assert not press_from_name(DEFAULT_PRESS, compression_ratio=0.5).needs_hidden  # it needs no file per model
    for name, entry in table["models"].items():
        press_from_name(entry["press"], compression_ratio=0.5)
        assert entry["why"] and entry["evidence"]
        assert entry["config_hash"] == load_pattern(name)["config_hash"]  # the hash of that packaged model


def test_default_resolves_per_model_and_keeps_its_parameters(monkeypatch):
    model, _ = kvpress.load_model()
    tiny = tiny_model("llama")
    assert default_press(tiny) == DEFAULT_PRESS and default_press() == DEFAULT_PRESS
    table = json.loads(_FILE.read_text())
    table["models"]["smollm2-135m"]["press"] = "snapkv:window_size=8"
    monkeypatch.setattr("kvpress.presses.defaults._table", lambda: table)
    assert default_press(model) == "snapkv:window_size=8"
    assert resolve_default("default:kv_bits=4", model) == "snapkv:window_size=8:kv_bits=4"
    assert resolve_default("snapkv", model) == "snapkv"
    press = press_from_name("default", model, compression_ratio=0.5)
    assert isinstance(press, kvpress.SnapKVPress) and press.window_size == 8
    assert isinstance(press_from_name("default", tiny, compression_ratio=0.5), kvpress.AdaKVPress)


def test_parameters_after_default_replace_the_defaults_own_and_are_checked_as_the_named_models(monkeypatch):
    """`default:n_sink=8` over a default with n_sink=4 gives n_sink=8 (it was refused as given twice); before the
    model loads, a spec after `default` is checked against the default of the model named, not of any model."""
    from kvpress.cli import _check_press
    from kvpress.presses import default_before_loading, with_default

    assert with_default("default:n_sink=8", "adakv:inner=kvzap:n_sink=4:window_size=8") == \
        "adakv:inner=kvzap:window_size=8:n_sink=8"  # fmt: skip
    assert with_default("default", "snapkv:window_size=8") == "snapkv:window_size=8"
    for empty in ("default:", "default::n_sink=8"):  # refused as for any other press, not passed over
        with pytest.raises(ValueError, match="key=value"):
            press_from_name(with_default(empty, "snapkv:window_size=8"), compression_ratio=0.5)
    table = json.loads(_FILE.read_text())
    table["models"]["smollm2-135m"]["press"] = "adakv:inner=kvzap:n_sink=4"
    table["models"]["qwen2.5-0.5b"]["press"] = table["any"]["press"] = "snapkv:window_size=8"
    monkeypatch.setattr("kvpress.presses.defaults._table", lambda: table)
    assert default_before_loading("default:pool=max", None) == "adakv:inner=kvzap:n_sink=4:pool=max"
    assert default_before_loading("default:pool=max", "/some/directory") is None  # its default: once it loads
    # a packaged model without its own entry (gemma-3-270m) takes any model's: it was left unchecked until it
    # loaded (and converted), as a directory is
    assert default_before_loading("default:window_size=4", "gemma-3-270m") == "snapkv:window_size=4"
    assert default_before_loading("knorm", None) == "knorm"
    _check_press("default:pool=max:kernel_size=3:n_sink=8", None, None, None)  # KVzap's, SmolLM2's default's
    with pytest.raises(ValueError, match="kernel_size=1 pools nothing"):  # (KVzap's kernel is 1 unless given)
        _check_press("default:pool=max", None, None, None)
    with pytest.raises(ValueError, match="pool"):
        _check_press("default:pool=max", None, None, "qwen2.5-0.5b")  # its default has no pool (SnapKV here)
    _check_press("default:pool=max", None, None, "/some/directory")  # only parsed
    with pytest.raises(ValueError, match="key=value"):
        _check_press("default:pool", None, None, "/some/directory")


def test_a_new_inner_press_after_default_leaves_out_the_old_inners_parameters():
    """`default:inner=snapkv` over AdaKV(KVzap) is AdaKV(SnapKV) with the default's other parameters: KVzap's own
    (`scorer`, `whole_words`) are left out, not refused as if the user had given them; a given one is still checked."""
    from kvpress.presses import with_default

    kvzap = "adakv:normalize=true:inner=kvzap:n_sink=4:whole_words=true:scorer=smollm2-135m-mass"
    assert with_default("default:inner=snapkv", kvzap) == "adakv:normalize=true:n_sink=4:inner=snapkv"
    press = press_from_name(with_default("default:inner=snapkv", kvzap), compression_ratio=0.5)
    assert isinstance(press.press, kvpress.SnapKVPress) and press.press.n_sink == 4 and press.normalize
    assert with_default("default:inner=kvzap", kvzap) == kvzap.replace("inner=kvzap:", "") + ":inner=kvzap"
    with pytest.raises(ValueError, match="whole_words"):
        press_from_name(with_default("default:inner=snapkv:whole_words=true", kvzap), compression_ratio=0.5)
    with pytest.raises(ValueError, match="takes no parameter inner"):  # a default that wraps no press
        press_from_name(with_default("default:inner=snapkv", "kvzap:n_sink=4"), compression_ratio=0.5)


def test_keyword_arguments_replace_the_defaults_own_parameters_as_those_after_default_do(monkeypatch):
    """`press_from_name("default", model, n_sink=8)` was refused as n_sink given twice (the default's own 4)."""
    table = json.loads(_FILE.read_text())
    table["any"]["press"] = "adakv:normalize=true:inner=kvzip:value_norm=true:n_sink=4"
    monkeypatch.setattr("kvpress.presses.defaults._table", lambda: table)
    press = press_from_name("default", None, compression_ratio=0.5, n_sink=8)
    assert press.press.n_sink == 8 and press.press.value_norm and press.normalize
    assert press_from_name("default", None, compression_ratio=0.5, n_sink=None).press.n_sink == 4  # None: not given
    press = press_from_name("default", None, compression_ratio=0.5, inner="snapkv")  # KVzip's value_norm left out
    assert isinstance(press.press, kvpress.SnapKVPress) and press.press.n_sink == 4
    with pytest.raises(ValueError, match="given both"):  # written after `default:` and as a keyword: refused
        press_from_name("default:n_sink=8", None, compression_ratio=0.5, n_sink=2)


def test_the_cli_names_the_press_it_resolved(tmp_path, capsys, monkeypatch):
    table = json.loads(_FILE.read_text())
    table["models"]["smollm2-135m"]["press"] = "knorm"
    monkeypatch.setattr("kvpress.presses.defaults._table", lambda: table)
    doc = tmp_path / "doc.txt"
    doc.write_text("The code of the lock is 48213. " + "The grass is green. " * 30)
    assert cli_main(["generate", "--context-file", str(doc), "--question", "What is the code?",
                     "--max-new-tokens", "2"]) == 0  # fmt: skip
    assert "[knorm:compression_ratio=0.5:" in capsys.readouterr().err


def test_an_unknown_name_mentions_default():
    with pytest.raises(ValueError, match="or default"):
        press_from_name("snap", compression_ratio=0.5)
