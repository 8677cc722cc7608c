"""ShotKVPress: the wrapped press's scores averaged over the shots of a few-shot prompt, so shots stay whole."""

import pytest

from kvpress import ShotKVPress, SnapKVPress
from kvpress.presses.shotkv import shot_ids
from kvpress.recording import compress_recording, record_prefill

PAIRS = [(3, 4), (12, 9), (7, 7), (21, 30), (5, 8), (40, 2), (11, 6), (9, 13)]
SHOTS = [f"Question: What is {a} plus {b}?\n\nAnswer: {a + b}" for a, b in PAIRS]
PROMPT = "Solve each problem.\n\n" + "\n\n".join(SHOTS) + "\n\nQuestion: What is 6 plus 5?"


def test_shot_ids_count_the_markers(tokenized):
    _, tokenizer = tokenized
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids[0]
    shots = shot_ids(ids, tokenizer, "Question:")
    assert int(shots[0]) == 0 and int(shots[-1]) == len(SHOTS) + 1  # the preamble, then one id per "Question:"
    starts = (shots[1:] > shots[:-1]).nonzero().flatten() + 1
    assert [tokenizer.decode(ids[i : i + 2]).strip() for i in starts.tolist()] == ["Question:"] * (len(SHOTS) + 1)
    with pytest.raises(ValueError, match="no shot marker 'Problem:'"):
        shot_ids(ids, tokenizer, "Problem:")


def test_shots_are_kept_whole_but_the_one_at_the_budgets_edge(tokenized):
    model, tokenizer = tokenized
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    shots = shot_ids(ids[0], tokenizer, "Question:")
    press = ShotKVPress(SnapKVPress(compression_ratio=0.5, window_size=4))
    cache = compress_recording(model, record_prefill(model, ids), press, tokenizer)
    n = ids.shape[1]
    for layer in cache.layers:
        for head in range(layer.keys.shape[1]):
            kept = layer.pos[0, head, : layer.n].long()
            kept = kept[kept < n - 4]  # the window is kept whatever its shot
            counts = shots[kept].bincount(minlength=len(SHOTS) + 2)
            sizes = shots[: n - 4].bincount(minlength=len(SHOTS) + 2)
            partial = [s for s in range(len(SHOTS) + 2) if 0 < counts[s] < sizes[s]]
            assert len(partial) <= 1 and layer.n == n - n // 2


def test_a_prompt_without_the_marker_is_refused(tokenized):
    model, tokenizer = tokenized
    ids = tokenizer("Nothing to see here, only words.", return_tensors="pt").input_ids
    with pytest.raises(ValueError, match="no shot marker"):
        compress_recording(model, record_prefill(model, ids), ShotKVPress(SnapKVPress(0.5)), tokenizer)
    with pytest.raises(ValueError, match="shot_marker"):
        ShotKVPress(SnapKVPress(0.5), shot_marker=" ")


def test_shots_over_a_press_that_scores_hidden_states_run_through_generate(tokenized):
    """ShotKV over KVzap (which scores each layer's input hidden states): `kvpress.generate` records them."""
    from transformers import DynamicCache

    import kvpress

    model, tokenizer = tokenized
    press = ShotKVPress(kvpress.KVzapPress(compression_ratio=0.5))
    assert press.needs_hidden and press.needs_whole_context
    cache = DynamicCache(config=model.config)
    kvpress.generate(model, tokenizer, PROMPT, "What is 6 plus 5?", press, max_new_tokens=2, cache=cache,
                     chat_template=False)  # fmt: skip
    n = len(tokenizer(PROMPT).input_ids)
    fed = cache.get_seq_length() - n  # the question and the answer, after the context was compressed
    assert fed > 0 and all(layer.n == n - n // 2 + fed for layer in cache.layers)
