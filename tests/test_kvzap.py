"""KVzapPress: scores predicted from the hidden states entering each layer's attention, at prefill and while
decoding; the scorer files, their architecture check, and `kvpress train-scorer`."""

import dataclasses
import json

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress import AdaKVPress, DuoAttentionPress, KVzapPress
from kvpress.patches import model_access
from kvpress.presses.base import BasePress
from kvpress.recording import compress_recording, record_prefill
from kvpress.scorers import Scorer, find_scorer, load_scorer, packaged, save_scorer
from kvpress.train_scorer import train_scorer
from tiny import attention_inputs, join_low_ids, prompt, tiny_model, tiny_scorer


def test_keeps_the_top_predicted_scores_of_each_head():
    model = tiny_model("llama")
    ids = prompt(1, 40)
    scorer = tiny_scorer(model)
    hidden = attention_inputs(model, ids)
    cache = DynamicCache(config=model.config)
    with KVzapPress(compression_ratio=0.5, window_size=0, scorer=scorer)(model):
        model(ids, cache=cache)
    for idx, layer in enumerate(cache.layers):
        predicted = (hidden[idx][0] @ scorer.weight[idx] + scorer.bias[idx]).T  # [H, n]
        expected = predicted.topk(20, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(layer.pos[0, :, : layer.n].long(), expected)


@pytest.mark.parametrize("pool", ["mean", "max"])
def test_kernel_size_keeps_the_top_scores_pooled_over_neighbouring_positions(pool):
    model = tiny_model("llama")
    ids = prompt(1, 40)
    scorer = tiny_scorer(model)
    hidden = attention_inputs(model, ids)
    cache = DynamicCache(config=model.config)
    with KVzapPress(compression_ratio=0.5, window_size=0, scorer=scorer, kernel_size=5, pool=pool)(model):
        model(ids, cache=cache)
    by = torch.nn.functional.max_pool1d if pool == "max" else torch.nn.functional.avg_pool1d
    for idx, layer in enumerate(cache.layers):
        predicted = (hidden[idx][0] @ scorer.weight[idx] + scorer.bias[idx]).T.exp()  # [H, n]
        pooled = by(predicted[:, None], 5, stride=1, padding=2)[:, 0]  # the mean counts zeros past the ends
        expected = pooled.argsort(dim=-1, descending=True, stable=True)[:, :20].sort(dim=-1).values  # (max pooling
        # ties neighbours exactly: the earlier position stays, `engine.best_slots`)
        assert torch.equal(layer.pos[0, :, : layer.n].long(), expected)


@pytest.mark.parametrize("bad, message", [({"kernel_size": 0}, "kernel_size must be a positive odd integer"),
                                          ({"kernel_size": 2}, "kernel_size must be a positive odd integer"),
                                          ({"kernel_size": True}, "kernel_size must be a positive odd integer"),
                                          ({"pool": "median"}, "pool must be one of mean, max, got 'median'")])
def test_pooling_refuses_a_bad_width_or_kind_by_name(bad, message):
    with pytest.raises(ValueError, match=message):
        KVzapPress(compression_ratio=0.5, **bad)


def test_a_recorded_prefill_keeps_what_a_live_one_keeps():
    model = tiny_model("qwen2")
    ids = prompt(1, 40, seed=2)
    press = KVzapPress(compression_ratio=0.6, window_size=4)
    live = DynamicCache(config=model.config)
    with press(model):
        model(ids, cache=live)
    with pytest.raises(ValueError, match=r"record it with record_prefill\(\.\.\., keep_hidden=True\)"):
        compress_recording(model, record_prefill(model, ids), press)  # the hidden states were not kept
    recorded = compress_recording(model, record_prefill(model, ids, keep_hidden=True), press)
    for a, b in zip(live.layers, recorded.layers, strict=True):
        assert torch.equal(a.keys[..., : a.n, :], b.keys[..., : b.n, :])


@pytest.mark.parametrize("make", [lambda: KVzapPress(max_tokens=24, window_size=4),
                                  lambda: AdaKVPress(KVzapPress(max_tokens=24, window_size=4))])  # fmt: skip
def test_generated_tokens_are_scored_and_the_budget_holds_while_decoding(make):
    model = tiny_model("llama")
    ids = prompt(1, 30)
    press = make()
    cache = DynamicCache(config=model.config)
    with press(model):
        model.generate(ids, cache=cache, max_new_tokens=30, do_sample=False, pad_token_id=0)
    for layer in cache.layers:
        held = layer.held() if isinstance(layer, kvpress.HeadwiseLayer) else torch.tensor([layer.n] * 2)
        assert int(held.sum()) <= 24 * 2 and layer.seen == 59
        if isinstance(layer, kvpress.HeadwiseLayer):
            newest = torch.stack([layer.slot("kvzap", 0, h)[-1] for h in range(layer.heads)])
        else:
            newest = layer.slot("kvzap")[0, :, -1]
        assert bool((newest > 0).all())  # the last generated token has its predicted score (exp of a log score)


@pytest.mark.parametrize("make", [lambda s: KVzapPress(max_tokens=24, window_size=2, scorer=s),
                                  lambda s: AdaKVPress(KVzapPress(max_tokens=24, window_size=2, scorer=s)),
                                  lambda s: DuoAttentionPress(retrieval_fraction=0.5, head_pattern=_pattern(s),
                                                              press=KVzapPress(max_tokens=24, window_size=2, scorer=s),
                                                              n_sink=1, window=4)])  # fmt: skip
def test_tokens_cached_while_frozen_get_their_predicted_scores(make):
    """A question read inside frozen() is scored as it is cached: once decoding evicts again, its tokens compete on
    their predictions (before, they held score 0 and were the first evicted)."""
    model = tiny_model("llama")
    scorer = tiny_scorer(model)
    context, question = prompt(1, 40), prompt(1, 10, seed=3)
    hidden = attention_inputs(model, torch.cat([context, question], dim=-1))
    press = make(scorer)
    cache = DynamicCache(config=model.config)
    with press(model) as installed:
        model(context, cache=cache)
        with installed.frozen():
            model(question, cache=cache)
    predicted = (hidden[0][0, 40:] @ scorer.weight[0] + scorer.bias[0]).exp().T  # [H, 10] (layer 0's input does
    for idx, layer in enumerate(cache.layers):  # not depend on what the press evicted; later layers' do)
        for head in range(predicted.shape[0]):
            if isinstance(layer, kvpress.HeadwiseLayer):
                if isinstance(press, DuoAttentionPress) and int(layer.head_budget[0, head]) >= 0:
                    continue  # a streaming head keeps sinks and window: its press scores retrieval heads only
                got = layer.slot("kvzap", 0, head)[-10:]
            else:
                got = layer.slot("kvzap")[0, head, -10:]
            assert bool((got > 0).all())  # exp of a prediction: every question token was scored
            if idx == 0:
                torch.testing.assert_close(got, predicted[head])
    assert press.needs_hidden and press.observes_frozen  # wrappers pass both on (recordings keep hidden states)


def _pattern(scorer):
    return {"model": "tiny", "config_hash": scorer.config_hash, "scores": [[0.3, 0.1], [0.2, 0.9]]}


def test_a_path_without_hidden_states_is_refused_by_name():
    model = tiny_model("llama")
    press = KVzapPress(compression_ratio=0.5)
    press.check_model(model)
    layer = kvpress.PressedLayer()
    keys = torch.zeros(1, 2, 4, 16)
    layer.lazy_initialization(keys, keys)
    obs = kvpress.Observation(model_access.attention_modules(model)[0], torch.zeros(1, 4, 4, 16), keys, keys, layer)
    with pytest.raises(ValueError, match="hidden states"):
        press.observe(obs)


def test_scorer_files_round_trip_and_refuse_another_architecture(tmp_path):
    model = tiny_model("llama")
    scorer = tiny_scorer(model)
    scorer.training = {"texts": 3}
    path = tmp_path / "s.safetensors"
    save_scorer(scorer, path)
    back = load_scorer(path)
    assert torch.equal(back.weight, scorer.weight) and back.training == {"texts": 3} and back.model == "tiny"
    KVzapPress(compression_ratio=0.5, scorer=str(path)).check_model(model)
    with pytest.raises(ValueError, match="not for this Qwen2ForCausalLM"):
        KVzapPress(compression_ratio=0.5, scorer=str(path)).check_model(tiny_model("qwen2"))
    with pytest.raises(FileNotFoundError, match="neither a safetensors file nor a packaged scorer"):
        load_scorer(tmp_path / "missing.safetensors")
    (tmp_path / "bad.safetensors").write_text(json.dumps({"not": "tensors"}))
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_scorer(tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match=r"weight must be \[layers, hidden, kv_heads\]"):
        Scorer("x", "y", torch.zeros(2, 3), torch.zeros(2, 3))


def test_packaged_scorers_fit_their_models():
    assert {"smollm2-135m", "qwen2.5-0.5b"} <= set(packaged())
    for name in packaged():
        scorer = load_scorer(name)
        fit = scorer.training["test"]
        assert name.startswith(scorer.model) and fit["spearman"] > 0.5 and fit["kept_agreement_r0.5"] > 0.7
        assert scorer.layer_profile.shape == (4, scorer.weight.shape[0])
        assert scorer.training["command"].startswith(f"kvpress train-scorer --model {scorer.model}")
        assert scorer.word_edges is not None and int(scorer.word_edges.all(-1).sum()) > 1000  # whole_words'
        mass = scorer.training.get("attention_mass", False)
        assert (scorer.mass_weight is not None) == name.endswith("-mass") == mass


def test_the_default_model_finds_its_packaged_scorer_and_answers():
    model, tokenizer = kvpress.load_model()
    context = "The pass key is 71432. Remember it. " + "The grass is green. The sky is blue. " * 40
    question = "What is the pass key? The pass key is"
    press = KVzapPress(compression_ratio=0.5)
    answer = kvpress.generate(model, tokenizer, context, question, press=press, chat_template=False,
                              max_new_tokens=6)  # fmt: skip
    assert "71432" in answer
    assert find_scorer(model).mass_weight is None  # "auto": the file named after the model, not its variant


def test_training_fits_kvzip_scores_better_than_chance(tokenized):
    model, tokenizer = tokenized
    scorer = train_scorer(model, tokenizer, "tiny", texts=3, held_out=1, tokens=96, log=lambda _: None)
    fit = scorer.training["test"]
    assert scorer.weight.shape == (3, 64, 2) and bool(scorer.weight.abs().sum() > 0)
    assert fit["spearman"] > 0.2 and fit["kept_agreement_r0.5"] > 0.55  # chance: 0 and 0.5
    assert scorer.layer_profile.shape == (4, 3) and bool((scorer.layer_profile > 0).all())
    assert not torch.allclose(scorer.layer_profile, torch.ones(4, 3))  # layers differ, more so at higher ratios
    scorer.check(model)
    from kvpress.train_scorer import profile_scorer

    with pytest.raises(ValueError, match="not for this Qwen2ForCausalLM"):  # another model's layers: refused
        profile_scorer(tiny_model("qwen2"), tokenizer, scorer, log=lambda _: None)
    with pytest.raises(ValueError, match="does not record how it was trained"):
        profile_scorer(model, tokenizer, tiny_scorer(model), log=lambda _: None)
    assert len(scorer.training["corpus_sha256"]) == 64
    moved = type(scorer)(**{**vars(scorer), "training": {**scorer.training, "corpus_sha256": "0" * 64}})
    with pytest.raises(ValueError, match="trained on another text than this machine's corpus"):
        profile_scorer(model, tokenizer, moved, log=lambda _: None)
    scorer.word_edges = torch.zeros(16, 2, dtype=torch.uint8)  # a table of another vocabulary
    with pytest.raises(ValueError, match="its word table has 16 token ids, the model's vocabulary"):
        scorer.check(model)


def test_training_refuses_sliding_window_models_and_bad_settings_by_name(tokenized):
    """On a sliding-window layer KVzip scores every token that left the window 0: train-scorer fitted a token's age
    without a word (train-gates refused such models already). seed=None drew other texts at every profile; a window
    of 0 tokens, a layer share at a negative ratio and a scorer named by a number failed deep inside."""
    from kvpress.calibrate_heads import calibrate_heads
    from kvpress.gates import load_gates
    from kvpress.train_scorer import training_texts

    model, tokenizer = tokenized
    windowed = tiny_model("mistral-window", vocab_size=len(tokenizer))
    refused = [
        (lambda: train_scorer(windowed, tokenizer, "tiny", texts=1, held_out=1, tokens=64), "sliding-window layers"),
        (lambda: train_scorer(model, tokenizer, "tiny", texts=1, held_out=1, tokens=64, seed=None), "seed must be an "),
        (lambda: calibrate_heads(model, tokenizer, "tiny", examples=1, length=128, seed=1.5), "seed must be an "),
        (lambda: training_texts(tokenizer, 1, 0, 0), "tokens must be an integer >= 1, got 0"),
        (lambda: training_texts(tokenizer, -3, 64, 0), "count must be an integer >= 0, got -3"),
        (lambda: training_texts(tokenizer, 1, 10**7, 0), "tokens must be at most"),
        (lambda: tiny_scorer(model).layer_shares(-0.1), r"ratio must be a compression ratio in \[0, 1\), got -0.1"),
        (lambda: load_scorer(123), "scorer must be the name of a packaged scorer or a path to its file, got 123"),
        (lambda: load_gates(None), "gates must be the name of a packaged gates or a path to its file, got None"),
    ]  # fmt: skip
    for call, said in refused:
        with pytest.raises((TypeError, ValueError), match=said):
            call()


def test_held_out_training_windows_share_no_text_with_the_windows_before_them(tokenized, monkeypatch):
    """Windows are drawn at random offsets: a held-out one that overlapped an earlier one is drawn again (on a
    corpus of numbered words, where which words a window holds says where it was cut)."""
    from kvpress import train_scorer as module

    _, tokenizer = tokenized
    prose, code = (" ".join(f"{kind}{i}" for i in range(4000)) for kind in ("p", "c"))
    monkeypatch.setattr(module, "corpus", lambda: (prose, code))

    def spans(texts):
        return [(w[1][0], int(w[1][1:]), int(w[-2][1:])) for w in (t.split() for t in texts)]  # (whole words)

    for apart in (None, 200):
        windows = spans(module.training_texts(tokenizer, 400, 16, 0, apart_from=apart))
        overlaps = [(i, j) for i in range(200, 400) for j in range(i) if windows[i][0] == windows[j][0]
                    and windows[i][1] <= windows[j][2] and windows[j][1] <= windows[i][2]]  # fmt: skip
        assert (overlaps == []) == (apart is not None), len(overlaps)  # (drawn freely, many overlap)



@pytest.mark.parametrize("inner", [lambda: KVzapPress(compression_ratio=0.5),
                                   lambda: kvpress.ChunkPress(KVzapPress(compression_ratio=0.5))])  # fmt: skip
def test_a_round_policy_refuses_it_as_inner_press(inner):
    with pytest.raises(ValueError, match="scores tokens from their hidden states"):
        kvpress.RoundPolicy(inner=inner())


def test_layer_budgets_follow_the_scorers_profile_at_the_press_ratio():
    model = tiny_model("llama")
    scorer = tiny_scorer(model)
    scorer.layer_profile = torch.tensor([[1.5, 0.5], [1.8, 0.2]])  # at r = 0.5 and 0.75
    assert torch.allclose(scorer.layer_shares(0.0), torch.ones(2))
    assert torch.allclose(scorer.layer_shares(0.25), torch.tensor([1.25, 0.75]))  # halfway from r = 0
    assert torch.allclose(scorer.layer_shares(0.625), torch.tensor([1.65, 0.35]))
    assert torch.allclose(scorer.layer_shares(0.9), torch.tensor([1.8, 0.2]))  # the last ratio's beyond it
    held = {}
    for g in (0.0, 0.5, 1.0):
        cache = DynamicCache(config=model.config)
        with KVzapPress(compression_ratio=0.5, window_size=0, scorer=scorer, global_budget=g)(model):
            model(prompt(1, 40), cache=cache)
        held[g] = [layer.n for layer in cache.layers]
    assert held[0.0] == [20, 20] and held[0.5] == [25, 15] and held[1.0] == [30, 10]  # (1 - g) + g x share
    scorer.layer_profile = torch.tensor([[1.9, 0.1], [1.9, 0.1]])  # at r = 0.25: 1.45, more than layer 0 holds
    cache = DynamicCache(config=model.config)
    with KVzapPress(compression_ratio=0.25, window_size=0, scorer=scorer, global_budget=1.0)(model):
        model(prompt(1, 40), cache=cache)
    assert [layer.n for layer in cache.layers] == [40, 20]  # layer 0 keeps all, layer 1 the rest (16 before)
    press = KVzapPress(compression_ratio=0.5, scorer=scorer, global_budget=0.5)
    press.check_model(model)
    with pytest.raises(ValueError, match=r"installed on last \(2 layers\), not of this one \(3\)"):
        press.layer_scale(0, 3)  # another model's (it was an IndexError, or silently wrong budgets)


def test_layer_budgets_need_a_ratio_and_leave_layer_scales_to_the_user():
    with pytest.raises(ValueError, match="use compression_ratio, or global_budget=0 with max_tokens"):
        KVzapPress(max_tokens=32, global_budget=0.5)
    with pytest.raises(ValueError, match="pass global_budget=0 to give layer_scales yourself"):
        KVzapPress(compression_ratio=0.5, layer_scales=(1.0, 2.0), global_budget=0.5)
    KVzapPress(max_tokens=32)
    model = tiny_model("llama")
    bare = tiny_scorer(model)
    bare.layer_profile = bare.profile_ratios = None
    with pytest.raises(ValueError, match="has no layer profile"):
        KVzapPress(compression_ratio=0.5, scorer=bare, global_budget=0.5).check_model(model)
    KVzapPress(compression_ratio=0.5, scorer=bare).check_model(model)


def _mass_scorer(model, seed: int = 0):
    """`tiny_scorer` with random weights on the log attention mass and the log queries seen."""
    scorer = tiny_scorer(model, seed)
    layers, _, heads = scorer.weight.shape
    scorer.mass_weight = torch.randn(layers, 2, heads, generator=torch.Generator().manual_seed(seed + 1))
    scorer.__post_init__()
    return scorer


def test_a_mass_scorer_adds_the_attention_each_token_received_and_how_many_queries_saw_it():
    model, eager = tiny_model("llama"), tiny_model("llama", attn="eager")
    ids = prompt(1, 40)
    scorer = _mass_scorer(model)
    hidden = attention_inputs(model, ids)
    attentions = eager(ids, output_attentions=True).attentions  # [B, Hq, n, n] per layer, from the eager kernel
    seen = torch.arange(40, 0, -1).float().log()  # token t is seen by the 40 - t queries t..39
    cache = DynamicCache(config=model.config)
    press = KVzapPress(compression_ratio=0.5, window_size=0, scorer=scorer)
    assert press.mass_block() is None  # not installed yet: the scorer is unknown
    with press(model):
        assert press.mass_block() is not None  # the attention runs in blocks that give its weights
        model(ids, cache=cache)
    for idx, layer in enumerate(cache.layers):
        heads = scorer.weight.shape[2]
        mass = attentions[idx][0].view(heads, -1, 40, 40).sum(dim=(1, 2))  # [H, n]: over query heads and queries
        a, c = scorer.mass_weight[idx][:, :, None]
        predicted = (hidden[idx][0] @ scorer.weight[idx] + scorer.bias[idx]).T + a * mass.log() + c * seen
        expected = predicted.topk(20, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(layer.pos[0, :, : layer.n].long(), expected)


def test_a_mass_scorer_keeps_the_same_tokens_recorded_and_live_and_while_decoding():
    model = tiny_model("qwen2")
    ids = prompt(1, 40, seed=2)
    press = KVzapPress(max_tokens=16, window_size=2, scorer=_mass_scorer(model, seed=3))
    live = DynamicCache(config=model.config)
    with press(model):
        model(ids, cache=live)
    recorded = compress_recording(model, record_prefill(model, ids, keep_hidden=True), press)
    for a, b in zip(live.layers, recorded.layers, strict=True):
        assert torch.equal(a.pos, b.pos)
    with press(model):  # decoding: the mass keeps accumulating, the budget holds
        for step in range(6):
            model(prompt(1, 1, seed=10 + step), cache=live)
    assert all(layer.n == 16 for layer in live.layers)
    assert all(bool((layer.slot("kvzap_mass") > 0).all()) for layer in live.layers)


@pytest.mark.parametrize("arch, budget", [("llama", 12), ("mistral-window", 8)])
def test_head_wise_layers_are_observed_whole_as_head_by_head(arch, budget):
    """AdaKV over KVzap (a mass scorer, whole words): observing a head-wise layer at once (one prediction, the mass
    the head-wise attention computed; on sliding-window layers computed per head) leaves the same state and keeps
    the same tokens as observing each head's view with the mass computed again, over a chunk and while decoding."""
    model = tiny_model(arch)
    scorer = join_low_ids(_mass_scorer(model, seed=4), model)  # ids below 64 join into words

    class HeadByHead(KVzapPress):
        observe_headwise = BasePress.observe_headwise  # not defined: observed one view at a time

        def observe(self, obs):
            super().observe(dataclasses.replace(obs, mass=None))  # the mass computed again from the queries

    ids = prompt(1, 40, seed=5)
    caches = []
    for kind in (KVzapPress, HeadByHead):
        press = AdaKVPress(kind(max_tokens=budget, window_size=2, scorer=scorer, whole_words=True))
        cache = DynamicCache(config=model.config)
        with press(model):
            model(ids[:, :18], cache=cache)  # over budget: the layers move to per-head storage
            model(ids[:, 18:], cache=cache)  # a chunk over head-wise layers (longer than a sliding window: 16)
            for token in [5, 6, 100, 7, 8, 9]:
                model(torch.tensor([[token]]), cache=cache)
        caches.append(cache)
    for packed, single in zip(caches[0].layers, caches[1].layers, strict=True):
        assert isinstance(packed, kvpress.HeadwiseLayer) and packed.lengths == single.lengths
        for row, head in [(0, h) for h in range(packed.heads)]:
            for name in ("pos", "kvzap", "kvzap_mass", "kvzap_word", "kvzap_word_end"):
                a, b = packed.slot(name, row, head), single.slot(name, row, head)
                assert torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-6), (name, row, head)
            assert bool((packed.slot("kvzap_mass", row, head) > 0).all())


def test_training_with_the_attention_mass_fits_and_round_trips(tokenized, tmp_path):
    model, tokenizer = tokenized
    scorer = train_scorer(model, tokenizer, "tiny", texts=3, held_out=1, tokens=96, attention_mass=True,
                          log=lambda _: None)  # fmt: skip
    assert scorer.mass_weight.shape == (3, 2, 2) and bool(scorer.mass_weight.abs().sum() > 0)
    assert scorer.training["attention_mass"] and scorer.training["command"].endswith(" --attention-mass")
    assert scorer.training["test"]["spearman"] > 0.2
    save_scorer(scorer, tmp_path / "mass.safetensors")
    back = load_scorer(tmp_path / "mass.safetensors")
    assert torch.equal(back.mass_weight, scorer.mass_weight)
    with pytest.raises(ValueError, match=r"mass_weight must be finite, \[layers, 2, kv_heads\]"):
        Scorer("x", "y", scorer.weight, scorer.bias, mass_weight=torch.zeros(3, 1, 2))


def test_a_mass_scorer_under_adakv_scores_head_wise_layers_while_decoding():
    model = tiny_model("llama")
    press = AdaKVPress(KVzapPress(max_tokens=24, window_size=4, scorer=_mass_scorer(model)))
    cache = DynamicCache(config=model.config)
    with press(model):
        model.generate(prompt(1, 30), cache=cache, max_new_tokens=20, do_sample=False, pad_token_id=0)
    for layer in cache.layers:
        assert isinstance(layer, kvpress.HeadwiseLayer) and int(layer.held().sum()) <= 24 * layer.heads
        mass = torch.cat([layer.slot("kvzap_mass", 0, h) for h in range(layer.heads)])
        assert bool((mass > 0).all())  # every held token, generated ones too, has received attention


@pytest.mark.parametrize("flags, expected", [([], False), (["--attention-mass"], True),
                                             (["--attention-mass", "--no-attention-mass"], False)])  # fmt: skip
def test_train_scorer_takes_attention_mass_as_a_switch(monkeypatch, flags, expected):
    from kvpress import cli

    seen = {}
    monkeypatch.setattr(cli, "cmd_train_scorer", lambda args: seen.update(cli._trainer_args(train_scorer, args)) or 0)
    assert cli.main(["train-scorer", "--out", "scorer.safetensors", *flags]) == 0
    assert seen["attention_mass"] is expected and seen["texts"] == 48


def test_presses_keep_no_attention_module_alive():
    """What a press reads per attention module (KVzap's scorer weights, NAtS's gates, ExpectedAttention's RoPE
    frequencies) goes with the model: one press used on model after model keeps none of their modules alive."""
    import gc

    from transformers import AutoModelForCausalLM

    from tiny import CONFIGS

    model = AutoModelForCausalLM.from_config(CONFIGS["llama"](), dtype=torch.float32)  # (not tiny_model's cached one)
    presses = [KVzapPress(compression_ratio=0.5, scorer=tiny_scorer(model)), kvpress.NAtSPress(compression_ratio=0.5),
               kvpress.ExpectedAttentionPress(compression_ratio=0.5)]  # fmt: skip
    for press in presses:
        press.check_model(model)
    held = [presses[0]._weights, presses[1]._gates, presses[2]._freqs]
    assert all(len(per_module) == model.config.num_hidden_layers for per_module in held)
    del model
    gc.collect()
    assert not any(len(per_module) for per_module in held)
