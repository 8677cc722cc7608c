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
