"""The intercept's flash_attention_2 paths, on the CPU. flash-attn needs CUDA and no wheel of it installs here, so a
stand-in with its semantics (queries aligned bottom-right against the keys, GQA, a 2D padding mask over the keys, a
sliding window) takes its place in transformers' attention table. A press on a model that uses it must give the
logits it gives on sdpa: over compressed layers whose slots no longer line up with positions (flash's own causal
alignment is enough there), a padded batch's holes (that call goes to sdpa), head-wise layers (their own attention),
sliding-window layers, and chunked prefill. Not a test of flash-attn's kernel: of what kvpress hands it."""

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers.modeling_utils
from transformers import PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import kvpress
from tiny import SLIDING, greedy_scores, live_presses, prompt, refused_on_sliding, tiny_model

CALLS: list[tuple] = []  # (query length, key length, mask) of each call the stand-in got


def flash_stand_in(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                   softcap=None, is_causal=None, **kwargs):  # fmt: skip
    """flash-attn's semantics through sdpa: `[B, q, Hq, D]`."""
    if softcap is not None or (attention_mask is not None and attention_mask.dim() != 2):
        dims = None if attention_mask is None else attention_mask.dim()
        raise AssertionError(f"flash takes no softcap nor a 4D mask (got softcap {softcap}, mask dimensions {dims})")
    q, n = query.shape[2], key.shape[2]
    CALLS.append((q, n, attention_mask))
    i = torch.arange(q)[:, None] + (n - q)  # bottom-right: the last query sees every key
    j = torch.arange(n)[None]
    allowed = j <= i if (module.is_causal if is_causal is None else is_causal) else torch.ones(q, n, dtype=torch.bool)
    if sliding_window is not None:
        allowed = allowed & (j > i - sliding_window)
    mask = allowed[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, -n:].bool()
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


@pytest.fixture
def flash(monkeypatch):
    """`model -> a copy of it on the stand-in` (transformers is told flash-attn is there)."""
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2", flash_stand_in)
    monkeypatch.setattr(PreTrainedModel, "_flash_attn_can_dispatch", lambda self, *a, **k: True)
    monkeypatch.setattr(transformers.modeling_utils, "lazy_import_flash_attention", lambda *a, **k: None)
    CALLS.clear()

    def on_flash(model):
        twin = copy.deepcopy(model)
        twin.set_attn_implementation("flash_attention_2")
        return twin

    return on_flash


def scores(model, ids, spec, mask=None) -> torch.Tensor:
    """The logits of 6 greedy steps inside the press (a CLI name, or a press), the prompt in chunks of 16."""
    press = kvpress.press_from_name(spec, compression_ratio=0.5) if isinstance(spec, str) else spec
    return greedy_scores(model, ids, press, new=6, mask=mask, chunk=16)[0]


SPECS = ["snapkv:window_size=4", "adakv:window_size=4", "h2o", "streaming-llm", "tova", "snapkv:kv_bits=4",
         "snapkv:rerotate=True:window_size=4", "sink-window:rerotate=True"]
OWN_ATTENTION = {"adakv:window_size=4", "h2o"}  # head-wise layers, and a press that reads the weights: kvpress attends


FAMILIES = ("llama", "qwen2", "mistral-window", "gemma3")


@pytest.mark.parametrize(("family", "spec"), [(f, s) for f in FAMILIES for s in SPECS
                                              if not (f in SLIDING and refused_on_sliding(s))])  # fmt: skip
def test_a_press_on_flash_gives_the_logits_it_gives_on_sdpa(flash, family, spec):
    model = tiny_model(family)
    ids = prompt(length=48)
    expected = scores(model, ids, spec)
    got = scores(flash(model), ids, spec)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    if spec not in OWN_ATTENTION:
        assert [(q, n) for q, n, _ in CALLS if n > q], "the stand-in never attended over held slots"


@pytest.mark.parametrize("family", ["llama", "mistral-window"])
@pytest.mark.parametrize("name", sorted(live_presses()))
def test_every_per_token_press_on_flash_gives_the_logits_it_gives_on_sdpa(flash, family, name):
    if family in SLIDING and refused_on_sliding(name):
        pytest.skip(refused_on_sliding(name))
    model = tiny_model(family)
    ids = prompt(length=48)
    make = live_presses(window_size=4)[name]
    torch.testing.assert_close(scores(flash(model), ids, make(compression_ratio=0.5)),
                               scores(model, ids, make(compression_ratio=0.5)), rtol=1e-4, atol=1e-4)  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "mistral-window"])
@pytest.mark.parametrize("spec", ["snapkv:window_size=4", "adakv:window_size=4", "h2o"])
def test_a_padded_batch_on_flash_gives_the_logits_it_gives_on_sdpa(flash, family, spec):
    model = tiny_model(family)
    ids = prompt(batch=2, length=40)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding in the second row: holes in its held slots
    expected = scores(model, ids, spec, mask)
    got = scores(flash(model), ids, spec, mask)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_the_stand_in_is_flash_without_a_press(flash):
    model = tiny_model("mistral-window")
    ids = prompt(length=40)
    with torch.inference_mode():
        torch.testing.assert_close(flash(model)(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    assert CALLS and all(mask is None for *_, mask in CALLS)
