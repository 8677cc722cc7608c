"""Compression keeps the model's computation right: r = 0 is a no-op, padded batches equal single rows."""

import pytest
import torch

from kvpress import SinkWindowPress, SnapKVPress
from tiny import SLIDING, left_padded, live_presses, prompt, refused_on_sliding, tiny_model

# every press of the registry that evicts inside a forward, with windows that fit tiny prompts
PRESSES = {
    **live_presses(window_size=4, n_sink=2),
    "sink-window-rerotate": lambda **b: SinkWindowPress(n_sink=2, rerotate=True, **b),
}
FAMILIES = ["llama", "llama3", "qwen2", "qwen3", "mistral", "mistral-window", "phi3", "gemma3"]


def _generate(model, ids, press=None, **kw):
    kw = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0, **kw}
    if press is None:
        return model.generate(ids, **kw)
    with press(model):
        return model.generate(ids, **kw)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", list(PRESSES))
def test_ratio_zero_is_identity(family, name):
    if family in SLIDING and refused_on_sliding(name):
        pytest.skip(refused_on_sliding(name))
    model = tiny_model(family)
    ids = prompt(1, 40)
    assert torch.equal(_generate(model, ids, PRESSES[name](compression_ratio=0.0)), _generate(model, ids))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(PRESSES))
def test_ratio_zero_is_identity_per_backend(attn, name):
    model = tiny_model("llama", attn)
    ids = prompt(2, 30, seed=3)
    assert torch.equal(_generate(model, ids, PRESSES[name](compression_ratio=0.0)), _generate(model, ids))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("budget", [{"compression_ratio": 0.5}, {"max_tokens": 12}])
@pytest.mark.parametrize("name", list(PRESSES))
def test_padded_batch_equals_rows_alone(attn, budget, name):
    model = tiny_model("llama", attn)
    rows = [prompt(1, n, seed=s)[0] for n, s in ((40, 1), (25, 2), (33, 3))]
    ids, mask = left_padded(rows)
    press = PRESSES[name](**budget)
    if name == "recall":  # it exchanges slots by position across a row's heads: padded rows are refused, by name
        with pytest.raises(ValueError, match="without padding"):
            _generate(model, ids, press, attention_mask=mask, max_new_tokens=24)
        return
    batch = _generate(model, ids, press, attention_mask=mask, max_new_tokens=24)
    for i, row in enumerate(rows):
        alone = _generate(model, row[None], press, max_new_tokens=24)[0, len(row) :]
        assert torch.equal(batch[i, ids.shape[1] : ids.shape[1] + len(alone)], alone), f"row {i}"


@pytest.mark.parametrize("family", FAMILIES)
def test_compressed_generation_runs_on_every_family(family):
    model = tiny_model(family)
    out = _generate(model, prompt(2, 48), SnapKVPress(compression_ratio=0.75, window_size=4), max_new_tokens=20)
    assert out.shape == (2, 68)
