"""Lookahead: the observation window plus a greedy draft of the answer, drafted from the full cache."""

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress import LookaheadPress
from kvpress.eval.lm_eval_bridge import KVPressLM
from kvpress.eval.sweep import run_sweep
from kvpress.pipeline import split_prompt
from kvpress.recording import compress_recording, record_prefill
from tiny import left_padded, prompt, tiny_model


def test_scores_average_the_window_and_the_drafted_answer():
    model = tiny_model("llama", attn="eager")
    ids = prompt(1, 41)
    head, last = ids[:, :40], ids[:, 40:]
    recording = record_prefill(model, head, next_ids=last)
    press = LookaheadPress(0.5, lookahead=3, window_size=4, kernel_size=1)
    before = copy.deepcopy(recording.cache)
    cache = compress_recording(model, recording, press)
    for layer, kept in zip(recording.cache.layers, before.layers, strict=True):  # drafted in it, then dropped
        assert torch.equal(layer.keys, kept.keys) and torch.equal(layer.values, kept.values)
        assert layer.n == layer.seen == 40 and torch.equal(layer.pos, kept.pos)
    full = model.generate(ids, max_new_tokens=3, do_sample=False)  # the prompt and the same greedy draft
    assert full.shape[1] == 44 and model.config.eos_token_id not in full[0, 41:]
    attentions = model(full, output_attentions=True).attentions  # [1, Hq, L, L] per layer
    rows = list(range(36, 40)) + list(range(40, 44))  # the window's 4 queries, then the last token and 3 drafted
    for idx, layer in enumerate(cache.layers):
        probs = attentions[idx][0, :, rows, :40]  # [Hq, 8, 40]
        expected = probs.view(2, 2, len(rows), 40).mean(dim=(1, 2))  # averaged over each KV group's heads
        expected[:, 36:] = float("inf")  # the window is kept
        kept = layer.pos[0].sort(dim=-1).values.long()
        assert torch.equal(kept, expected.topk(20, dim=-1).indices.sort(dim=-1).values)


def test_refuses_without_the_question_or_a_tokenizer():
    model = tiny_model("llama")
    ids = prompt(1, 40)
    press = LookaheadPress(0.5)
    with pytest.raises(ValueError, match="use query_aware=True"):
        compress_recording(model, record_prefill(model, ids), press)
    with pytest.raises(ValueError, match=r"with press\(model, tokenizer=tokenizer\)"):
        with press(model):
            model(ids, cache=DynamicCache(config=model.config))
    with pytest.raises(ValueError, match="lookahead must be a positive integer"):
        LookaheadPress(0.5, lookahead=0)
    with pytest.raises(ValueError, match=r"\['chunkkv:inner=lookahead'\] score by the question: .*--query-aware"):
        run_sweep(model, None, ["snapkv", "chunkkv:inner=lookahead"], [0.5], ["needle_noise"], "/nonexistent")
    with pytest.raises(ValueError, match="LookaheadPress scores by the question: pass query_aware=true"):
        KVPressLM(pretrained=model, tokenizer=None, press="lookahead", compression_ratio=0.5)


def test_generate_query_aware_keeps_the_needle():
    model, tokenizer = kvpress.load_model()
    context = "The grass is green. The sky is blue. " * 20 + "The pass key is 71432. " + "The sun is yellow. " * 20
    question = "What is the pass key? The pass key is"
    cache = DynamicCache(config=model.config)
    answer = kvpress.generate(model, tokenizer, context, question, chat_template=False, query_aware=True,
                              press=kvpress.press_from_name("lookahead", compression_ratio=0.75), cache=cache,
                              max_new_tokens=6)  # fmt: skip
    n = sum(part.shape[1] for part in split_prompt(tokenizer, context, question, chat_template=False)) - 1
    assert cache.layers[0].n == n - int(n * 0.75) + 1 + 5  # the prompt but its last token compressed, then the
    # last token and the answer fed whole (but the answer's last token, never fed)
    assert "71432" in answer
    with pytest.raises(ValueError, match="LookaheadPress scores by the question: it needs query_aware=True"):
        kvpress.generate(model, tokenizer, context, question, press=LookaheadPress(0.75), chat_template=False)


@pytest.mark.parametrize("name", ["lookahead", "specattn"])
@pytest.mark.parametrize("ends", [False, True])
def test_a_padded_batch_drafts_each_row_as_it_would_alone(name, ends):
    """Each row of a left-padded batch drafts from the position after its own real tokens, and until its own
    end-of-sequence (`ends`: the short row drafts it at its second step, the long row drafts on): each row gets
    what it gets alone. Before, the draft took its positions from the padded length and stopped only when every
    row had ended."""
    model = tiny_model("llama")
    rows = [prompt(1, 40, seed=1)[0], prompt(1, 25, seed=2)[0]]
    ids, mask = left_padded(rows)
    greedy = model.generate(rows[1][None], max_new_tokens=2, do_sample=False, pad_token_id=0)[0, -1]
    ender = SimpleNamespace(eos_token_id=int(greedy) if ends else model.config.eos_token_id)  # (what the draft reads)
    press = kvpress.press_from_name(name, compression_ratio=0.5, window_size=4)
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    padding = torch.zeros(2, 3, dtype=torch.long)  # every row padded (pad_to_multiple_of): the check took the
    with press(model, tokenizer=ender):  # longest row for unpadded and refused it ("holds 42 of 42")
        together = model.generate(ids, attention_mask=mask, **settings)[:, 40:]
        alone = [model.generate(row[None], **settings)[0, len(row) :] for row in rows]
        all_padded = model.generate(torch.cat([padding, ids], 1), attention_mask=torch.cat([padding, mask], 1),
                                    **settings)[:, 43:]  # fmt: skip
    assert torch.equal(together[0], alone[0]) and torch.equal(together[1], alone[1])
    assert torch.equal(all_padded, together)
