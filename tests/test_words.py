"""Whole words (`kvpress.words`): which tokens join into one word, each new token's word start (across forwards
too), and scores maxed over a word; KVzapPress(whole_words=True) keeps or evicts a word whole."""

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress import AdaKVPress, KVzapPress
from kvpress.recording import compress_recording, record_prefill
from kvpress.words import max_over_words, next_word_starts, word_edges, word_starts
from tiny import attention_inputs, join_low_ids, prompt, tiny_model, tiny_scorer


class _Pieces:
    """A tokenizer of a few pieces of text."""

    pieces = [" the", "8", "5", ".", "ab", "", "中", "x1"]

    def __len__(self) -> int:
        return len(self.pieces)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)

    def __call__(self, text: str, add_special_tokens: bool = True):
        return type("Encoding", (), {"input_ids": [self.pieces.index(text)]})


@pytest.mark.parametrize("decoder", ["llama2", "metaspace", "gemma"])
def test_a_sentencepiece_word_starts_at_its_space_whatever_the_decoder_strips(decoder):
    """Decoded alone, "▁cat" is "cat" under decoders that strip the text's first space (Llama 2's, Metaspace): it
    must still start a word, and "s" after it continue it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁the": 1, "▁cat": 2, "s": 3, "▁sat": 4, "▁.": 5, ".": 6}
    made = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    made.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    replace = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    made.decoder = {"llama2": decoders.Sequence([*replace, decoders.Strip(" ", 1, 0)]),
                    "metaspace": decoders.Metaspace(replacement="▁", prepend_scheme="first"),
                    "gemma": decoders.Sequence(replace)}[decoder]  # fmt: skip
    edges = word_edges(PreTrainedTokenizerFast(tokenizer_object=made, unk_token="<unk>"), len(vocab))
    assert edges[[1, 2, 3, 4]].tolist() == [[0, 1], [0, 1], [1, 1], [0, 1]]
    starts, _ = word_starts(edges, torch.tensor([[1, 2, 3, 4]]), torch.arange(4).view(1, 1, 4),
                            *(torch.zeros(1, 1, 0),) * 3)  # fmt: skip
    assert starts[0, 0].tolist() == [0, 1, 1, 3]  # "the", "cat" + "s", "sat"


def test_word_edges_say_which_token_ids_start_and_end_with_a_letter_or_digit():
    edges = word_edges(_Pieces(), 10)
    assert edges.dtype == torch.uint8 and edges.shape == (10, 2)
    assert edges.tolist() == [[0, 1], [1, 1], [1, 1], [0, 0], [1, 1], [0, 0], [0, 0], [1, 1], [0, 0], [0, 0]]
    with pytest.raises(ValueError, match="vocab must be an integer >= 1, got 0"):
        word_edges(_Pieces(), 0)


def _edges() -> torch.Tensor:
    return word_edges(_Pieces(), 8)


def test_a_token_joins_the_word_before_it_when_nothing_stands_between():
    ids = torch.tensor([[0, 1, 2, 2, 3, 4, 7, 0]])  # " the" "8" "5" "5" "." "ab" "x1" " the"
    pos = torch.arange(8.0).expand(1, 2, 8)
    empty = torch.zeros(1, 2, 0)
    starts, ends = word_starts(_edges(), ids, pos, empty, empty, empty)
    assert starts[0, 0].tolist() == [0, 0, 0, 0, 4, 5, 5, 7]  # "the855" is one word: " the" ends with a letter
    assert torch.equal(starts[0, 0], starts[0, 1]) and ends[0, 0].tolist() == [1, 1, 1, 1, 0, 1, 1, 1]


def test_the_first_new_token_joins_its_predecessor_only_while_it_is_held():
    held_pos = torch.tensor([[[3.0, 5.0], [3.0, 4.0]]])  # head 0 still holds position 5, head 1 evicted it
    held_starts = torch.tensor([[[3.0, 4.0], [3.0, 4.0]]])
    held_ends = torch.ones(1, 2, 2)
    new_pos = torch.tensor([6.0, 7.0]).expand(1, 2, 2)
    starts, _ = word_starts(_edges(), torch.tensor([[1, 2]]), new_pos, held_pos, held_starts, held_ends)
    assert starts[0].tolist() == [[4.0, 4.0], [6.0, 6.0]]
    starts, _ = word_starts(_edges(), torch.tensor([[1, 2]]), new_pos, held_pos, held_starts, torch.zeros(1, 2, 2))
    assert starts[0].tolist() == [[6.0, 6.0], [6.0, 6.0]]  # the held one ends with punctuation: a new word


@pytest.mark.parametrize("q", [1, 2])
def test_packed_slots_find_the_word_starts_word_starts_does(q):
    """`next_word_starts` (packed storage, a head-wise layer) against `word_starts` given each pair's slot before its
    new ones: predecessors held or evicted, ending with a letter or not, a pair holding only the new tokens, for
    every token piece."""
    torch.manual_seed(0)
    heads, old = 2, [4, 2, 0, 5]  # rows 0 and 1, two KV heads each; pair 2 holds only the new tokens
    bounds = [0, 8, 12, 20, 28]
    pos, starts, ends = torch.zeros(28, dtype=torch.int32), torch.zeros(28), torch.zeros(28)
    new = torch.tensor([[b + n + j for j in range(q)] for b, n in zip(bounds, old, strict=False)])  # [4, q]
    for i, (b, n) in enumerate(zip(bounds, old, strict=False)):
        if n:
            kept = sorted(torch.randperm(8)[: n - 1].tolist())  # old positions 0-7, some evicted
            pos[b : b + n] = torch.tensor(kept + [9 if i % 2 else 8])  # the one before the new: held or not
            starts[b : b + n] = torch.tensor([float(p - (p % 3)) for p in pos[b : b + n].tolist()])
            ends[b : b + n] = torch.randint(0, 2, (n,)).float()
            ends[b + n - 1] = float(i != 3)  # held and ending with a letter (1), not held (0), held, no letter (3)
        pos[b + n : b + n + q] = torch.arange(10, 10 + q, dtype=torch.int32)
    ends[bounds[2] - 1] = 1.0  # what stands before pair 2's first slot is pair 1's: never its predecessor
    pos[bounds[2] - 1] = 9
    alone = torch.tensor([n == 0 for n in old])
    for token in range(8):
        ids = torch.tensor([[token, 1][:q], [(token + 3) % 8, 2][:q]])
        word, end = next_word_starts(_edges(), ids, new, pos, starts, ends, heads, alone)
        before = new[:, 0] - 1
        held_pos = torch.where(alone, -2, pos[before]).view(2, heads, 1)
        expected, expected_end = word_starts(_edges(), ids, pos[new].view(2, heads, q), held_pos,
                                             starts[before].view(2, heads, 1), ends[before].view(2, heads, 1))
        assert torch.equal(word, expected.view(-1)) and torch.equal(end, expected_end.view(-1))
        if q == 1 and token == 1:  # "8" after a held word: pair 1 joins it; "ab" in row 1: pair 2 (alone) does not
            assert word.tolist() == [10.0, 9.0, 10.0, 10.0]


def test_each_slot_scores_as_the_best_valid_slot_of_its_word():
    scores = torch.tensor([[[1.0, 5.0, 2.0, 7.0, 3.0]]])
    starts = torch.tensor([[[2.0, 2.0, 4.0, 4.0, 6.0]]])
    assert max_over_words(scores, starts).tolist() == [[[5.0, 5.0, 7.0, 7.0, 3.0]]]
    valid = torch.tensor([[[True, True, True, False, True]]])  # an invalid slot keeps its score, lends none
    assert max_over_words(scores, starts, valid).tolist() == [[[5.0, 5.0, 2.0, 7.0, 3.0]]]


def _word_scorer(model):
    """A tiny scorer whose word table joins every token id below 64 to an id below 64 before it."""
    return join_low_ids(tiny_scorer(model), model)


def _expected_starts(ids: list[int]) -> list[int]:
    starts = []
    for i, t in enumerate(ids):
        starts.append(starts[-1] if i and t < 64 and ids[i - 1] < 64 else i)
    return starts


def test_whole_words_keep_the_top_scores_maxed_over_each_word():
    model = tiny_model("llama")
    ids = prompt(1, 40)
    scorer = _word_scorer(model)
    hidden = attention_inputs(model, ids)
    starts = torch.tensor(_expected_starts(ids[0].tolist()))
    assert len(set(starts.tolist())) <= 30  # several words of more than one token
    cache = DynamicCache(config=model.config)
    with KVzapPress(compression_ratio=0.5, window_size=0, scorer=scorer, whole_words=True)(model):
        model(ids, cache=cache)
    for idx, layer in enumerate(cache.layers):
        predicted = (hidden[idx][0] @ scorer.weight[idx] + scorer.bias[idx]).T.exp()  # [H, n]
        best = torch.stack([predicted[:, starts == s].amax(-1) for s in starts.tolist()], dim=-1)
        expected = best.topk(20, dim=-1).indices.sort(dim=-1).values
        kept = layer.pos[0, :, : layer.n].long()
        assert torch.equal(best.gather(-1, kept).sort(-1).values, best.gather(-1, expected).sort(-1).values)
        for head in range(kept.shape[0]):  # every word kept whole, but for one at the budget's edge (ties)
            split = [s for s in set(starts.tolist()) if 0 < int(torch.isin(kept[head], (starts == s).nonzero())
                                                                 .sum()) < int((starts == s).sum())]
            assert len(split) <= 1


def test_whole_words_keep_the_same_tokens_recorded_and_live_and_words_go_on_while_decoding():
    model = tiny_model("qwen2")
    ids = prompt(1, 40, seed=2)
    press = KVzapPress(max_tokens=16, window_size=2, scorer=_word_scorer(model), whole_words=True)
    live = DynamicCache(config=model.config)
    with press(model):
        model(ids, cache=live)
    recorded = compress_recording(model, record_prefill(model, ids, keep_hidden=True), press)
    for a, b in zip(live.layers, recorded.layers, strict=True):
        assert torch.equal(a.pos, b.pos) and torch.equal(a.slot("kvzap_word"), b.slot("kvzap_word"))
    with press(model):  # a generated token joins the held word before it
        for token in [5, 6, 100, 7]:
            model(torch.tensor([[token]]), cache=live)
    whole = ids[0].tolist() + [5, 6, 100, 7]
    for layer in live.layers:
        assert layer.n == 16
        pos, words = layer.pos[0].long(), layer.slot("kvzap_word")[0]
        new = pos >= 40  # the generated tokens (the window keeps each one's predecessor while it arrives)
        assert int(new.sum()) >= 2 * pos.shape[0]
        assert words[new].tolist() == [float(_expected_starts(whole)[p]) for p in pos[new].tolist()]


def test_whole_words_under_adakv_score_head_wise_layers_while_decoding():
    model = tiny_model("llama")
    press = AdaKVPress(KVzapPress(max_tokens=24, window_size=4, scorer=_word_scorer(model), whole_words=True))
    cache = DynamicCache(config=model.config)
    with press(model):
        out = model.generate(prompt(1, 30), cache=cache, max_new_tokens=12, do_sample=False, pad_token_id=0)
    whole = _expected_starts(out[0].tolist())
    for layer in cache.layers:
        assert isinstance(layer, kvpress.HeadwiseLayer) and int(layer.held().sum()) <= 24 * layer.heads
        for h in range(layer.heads):
            pos = layer.slot("pos", 0, h).long()
            assert layer.slot("kvzap_word", 0, h).tolist() == [float(whole[p]) for p in pos.tolist()]


def test_whole_words_under_adakv_decode_a_batch_row_by_row():
    model = tiny_model("llama")
    press = AdaKVPress(KVzapPress(max_tokens=24, window_size=4, scorer=_word_scorer(model), whole_words=True))
    cache = DynamicCache(config=model.config)
    ids = torch.cat([prompt(1, 30, seed=3), prompt(1, 30, seed=4)])  # two rows, no padding
    with press(model):
        out = model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False, pad_token_id=0)
    for row in range(2):
        whole = _expected_starts(out[row].tolist())
        for layer in cache.layers:
            for h in range(layer.heads):
                pos = layer.slot("pos", row, h).long()
                assert layer.slot("kvzap_word", row, h).tolist() == [float(whole[p]) for p in pos.tolist()]


def test_whole_words_are_refused_without_a_word_table_or_token_ids():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="has no word table: add it with `kvpress train-scorer .* --update-words`"):
        KVzapPress(compression_ratio=0.5, scorer=tiny_scorer(model), whole_words=True).check_model(model)
    with pytest.raises(ValueError, match="whole_words must be true or false, got 1"):
        KVzapPress(compression_ratio=0.5, whole_words=1)
    press = KVzapPress(compression_ratio=0.5, scorer=_word_scorer(model), whole_words=True)
    embeds = model.get_input_embeddings()(prompt(1, 20))
    with press(model), pytest.raises(ValueError, match="did not give \\(it was given inputs_embeds\\): pass input_ids"):
        model(inputs_embeds=embeds, cache=DynamicCache(config=model.config))
    with pytest.raises(ValueError, match=r"word_edges must be \[vocab, 2\] uint8 of 0 and 1"):
        scorer = tiny_scorer(model)
        scorer.word_edges = torch.full((10, 2), 2, dtype=torch.uint8)
        scorer.__post_init__()


def test_observers_see_the_token_ids_of_each_forward():
    model = tiny_model("llama")
    ids = prompt(1, 12)
    seen = []
    cache = DynamicCache(config=model.config)
    with kvpress.observe(model, lambda obs: seen.append(obs.ids)):
        model(ids, cache=cache)
        model(prompt(1, 1, seed=5), cache=cache)
        model(inputs_embeds=model.get_input_embeddings()(prompt(1, 2)), cache=cache)
    layers = len(cache.layers)
    assert all(torch.equal(s, ids) for s in seen[:layers])
    assert all(torch.equal(s, prompt(1, 1, seed=5)) for s in seen[layers : 2 * layers])
    assert all(s is None for s in seen[2 * layers :]) and len(seen) == 3 * layers
