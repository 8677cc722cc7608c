"""eval/check_padding: each row of a left-padded batch against the row alone (on a tiny model here)."""

import copy

from kvpress.eval.check_padding import check
from kvpress.presses import press_from_name

TEXTS = ["The lock code is 48213. " * n + "What is the code?" for n in (3, 8, 5)]


def test_rows_equal_to_rows_alone_and_a_refusal_are_told_apart(tokenized):
    model, tokenizer = tokenized
    tokenizer = copy.deepcopy(tokenizer)  # (the fixture's is shared)
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    snapkv = check(press_from_name("snapkv", compression_ratio=0.5, window_size=4), model, tokenizer, TEXTS, 6)
    assert snapkv["rows_equal"] == [True, True, True] and snapkv["first_difference"] == [None, None, None]
    assert snapkv["tokens"] == [6, 6, 6]
    kvzip = check(press_from_name("kvzip", compression_ratio=0.5), model, tokenizer, TEXTS, 6)
    assert "no padding" in kvzip["refused"]


def test_a_resumed_file_of_other_settings_is_refused_and_the_arguments_checked_first(tokenized, tmp_path, monkeypatch):
    """A rerun at another --ratio kept the presses measured at the first and labelled them with the second; a local
    directory as --model made a path under a missing directory (the first press measured, then FileNotFoundError);
    --ratio was checked only once the model had loaded. check_sliding: a model whose every layer slides crashed after
    its generations (max of nothing), its --ratios unchecked until the model had loaded."""
    import json

    import pytest

    import kvpress
    from kvpress.eval import check_padding, check_sliding
    from tiny import tiny_model

    model, tokenizer = tokenized
    loads = []

    def load(name=None):
        loads.append(name)
        return model, copy.deepcopy(tokenizer)

    monkeypatch.setattr(kvpress, "load_model", load)
    monkeypatch.setattr(check_padding, "RESULTS", tmp_path)
    monkeypatch.setattr(check_padding, "WORDS", (20, 30, 40))
    for bad in (["--ratio", "1.5"], ["--new", "0"], ["--presses", "snapkvv"]):
        with pytest.raises(SystemExit):
            check_padding.main(["--model", "tiny", *bad])
    assert loads == []
    check_padding.main(["--model", "/models/tiny", "--presses", "snapkv:window_size=4", "--new", "2"])
    saved = json.loads((tmp_path / "padding-tiny.json").read_text())
    assert saved["ratio"] == 0.5 and list(saved["presses"]) == ["snapkv:window_size=4"]
    with pytest.raises(SystemExit):
        check_padding.main(["--model", "/models/tiny", "--presses", "knorm", "--new", "2", "--ratio", "0.9"])
    assert json.loads((tmp_path / "padding-tiny.json").read_text()) == saved
    check_padding.main(["--model", "/models/tiny", "--presses", "snapkv:window_size=4,knorm", "--new", "2"])
    assert list(json.loads((tmp_path / "padding-tiny.json").read_text())["presses"]) == ["snapkv:window_size=4",
                                                                                          "knorm"]  # fmt: skip
    windowed = tiny_model("mistral-window", vocab_size=len(tokenizer))
    monkeypatch.setattr(kvpress, "load_model", lambda name=None: (loads.append(name), (windowed, tokenizer))[1])
    monkeypatch.setattr(check_sliding, "RESULTS", tmp_path)
    loads.clear()
    with pytest.raises(SystemExit):
        check_sliding.main(["--model", "tiny", "--ratios", "0.5,1.2"])
    assert loads == []
    result = check_sliding.main(["--model", "tiny", "--ratios", "0.5", "--words", "40"])
    assert result["ratios"][0.5]["full_layer_max_held"] is None and result["window"] == 16
    assert result["ratios"][0.5]["sliding_layer_max_held"] <= 15
