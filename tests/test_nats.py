"""NAtSPress: learned token roles (global, local, sliding window) from the hidden states, at prefill and while
decoding; the gates files and `kvpress train-gates`."""

import json
import shlex

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress import AdaKVPress, cli
from kvpress.gates import Gates, load_gates, packaged, save_gates
from kvpress.patches import model_access
from kvpress.presses.nats import NAtSPress
from kvpress.train_gates import RecordedLayer, evaluate_layer, role_mask, train_gates, train_layer
from tiny import attention_inputs, prompt, tiny_gates, tiny_model


def _expected_scores(gates, idx, hidden):
    """`[H, n]` -log P(a token's role no longer holds it for the next query), computed directly in float64: a window
    token j is seen by query i while i - j < window (`role_mask`), so the next one, n, no longer sees it from n - j =
    window on (it was counted held one step longer)."""
    logits = (hidden.double() @ gates.weight[idx].double().flatten(1)).view(hidden.shape[0], -1, 3)
    p = (logits + gates.bias[idx].double()).softmax(-1)
    n = hidden.shape[0]
    scores = torch.zeros(p.shape[1], n, dtype=torch.float64)
    for j in range(n):
        no_global_after = torch.prod(p[j + 1 :, :, 1] + p[j + 1 :, :, 2], dim=0)
        gone = float(n - j >= gates.window)
        scores[:, j] = -(p[j, :, 1] * (1 - no_global_after) + p[j, :, 2] * gone).clamp_min(1e-30).log()
    return scores


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_keeps_the_tokens_whose_roles_most_probably_hold_them(family):
    model = tiny_model(family)
    ids = prompt(1, 40)
    gates = tiny_gates(model, window=6)
    hidden = attention_inputs(model, ids)
    cache = DynamicCache(config=model.config)
    with NAtSPress(max_tokens=20, window_size=0, gates=gates)(model):
        model(ids, cache=cache)
    for idx, layer in enumerate(cache.layers):
        expected = _expected_scores(gates, idx, hidden[idx][0]).topk(20, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(layer.pos[0, :, : layer.n].long(), expected)


def test_roles_accumulate_across_chunks_and_decoding_steps_as_in_one_forward():
    """A global token arriving later ends the earlier local ones: the survival each slot holds after a prefill in
    chunks and five decoding steps equals that of one forward over the same tokens (nothing evicted)."""
    model = tiny_model("llama")
    ids = prompt(1, 40, seed=4)
    gates = tiny_gates(model, seed=1)
    whole, parts = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with NAtSPress(max_tokens=100, gates=gates)(model):
        model(ids, cache=whole)
        model(ids[:, :15], cache=parts)
        model(ids[:, 15:35], cache=parts)
        for t in range(35, 40):
            model(ids[:, t : t + 1], cache=parts)
    hidden = attention_inputs(model, ids)
    for idx, (a, b) in enumerate(zip(whole.layers, parts.layers, strict=True)):
        for name in ("nats_local", "nats_window", "nats_survive"):
            torch.testing.assert_close(a.slot(name), b.slot(name), atol=1e-5, rtol=1e-4)
        press = NAtSPress(max_tokens=100, gates=gates)
        press.check_model(model)
        module = model_access.attention_modules(model)[idx]
        obs = kvpress.Observation(module, torch.zeros(1, 1, 1, 1), *b.held_kv(), b)
        expected = _expected_scores(gates, idx, hidden[idx][0]).float()
        torch.testing.assert_close(press.score(obs)[0], expected, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("make", [lambda: NAtSPress(max_tokens=24, window_size=4),
                                  lambda: AdaKVPress(NAtSPress(max_tokens=24, window_size=4))])  # fmt: skip
def test_generated_tokens_get_roles_and_the_budget_holds_while_decoding(make):
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
            newest = torch.stack([layer.slot("nats_local", 0, h)[-1] + layer.slot("nats_window", 0, h)[-1]
                                  for h in range(layer.heads)])  # fmt: skip
        else:
            newest = layer.slot("nats_local")[0, :, -1] + layer.slot("nats_window")[0, :, -1]
        assert bool((newest > 0).all())  # the last generated token has its roles (0 in a slot never given them)


def test_a_path_without_hidden_states_and_bad_gates_are_refused_by_name():
    model = tiny_model("llama")
    press = NAtSPress(compression_ratio=0.5)
    press.check_model(model)
    layer = kvpress.PressedLayer()
    keys = torch.zeros(1, 2, 4, 16)
    layer.lazy_initialization(keys, keys)
    obs = kvpress.Observation(model_access.attention_modules(model)[0], torch.zeros(1, 4, 4, 16), keys, keys, layer)
    with pytest.raises(ValueError, match="hidden states"):
        press.observe(obs)
    with pytest.raises(ValueError, match="hidden states"):
        kvpress.RoundPolicy(inner=NAtSPress(compression_ratio=0.5))
    with pytest.raises(ValueError, match="gates must be 'auto'"):
        NAtSPress(compression_ratio=0.5, gates="")
    with pytest.raises(ValueError, match="window must be a positive integer"):
        Gates("x", "y", torch.zeros(2, 4, 2, 3), torch.zeros(2, 2, 3), 0)
    with pytest.raises(ValueError, match=r"weight must be \[layers, hidden, kv_heads, 3\]"):
        Gates("x", "y", torch.zeros(2, 4, 2), torch.zeros(2, 2), 4)


def test_gates_files_round_trip_and_refuse_another_architecture(tmp_path):
    model = tiny_model("llama")
    gates = tiny_gates(model, window=7)
    gates.training = {"texts": 3}
    path = tmp_path / "g.safetensors"
    save_gates(gates, path)
    back = load_gates(path)
    assert torch.equal(back.weight, gates.weight) and back.window == 7 and back.training == {"texts": 3}
    NAtSPress(compression_ratio=0.5, gates=str(path)).check_model(model)
    with pytest.raises(ValueError, match="not for this Qwen2ForCausalLM"):
        NAtSPress(compression_ratio=0.5, gates=str(path)).check_model(tiny_model("qwen2"))
    half = type(gates)(**{**vars(gates), "weight": gates.weight.half(), "bias": gates.bias.half()})
    hidden = torch.randn(1, 3, model.config.hidden_size)  # gates held in half precision compute their roles in fp32
    assert torch.allclose(half.roles(0, hidden), gates.roles(0, hidden), atol=1e-2)
    with pytest.raises(FileNotFoundError, match="neither a safetensors file nor a packaged gates"):
        load_gates(tmp_path / "missing.safetensors")
    (tmp_path / "bad.safetensors").write_text(json.dumps({"not": "tensors"}))
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_gates(tmp_path / "bad.safetensors")


def test_role_mask_of_hard_roles_is_the_papers_mask():
    """Global: seen by every later query; local: until the next global token; window: by the next `window`."""
    g = torch.Generator().manual_seed(0)
    n, window = 30, 4
    kinds = torch.randint(0, 3, (2, n), generator=g)
    mask = role_mask(torch.nn.functional.one_hot(kinds, 3).float(), window)
    for h in range(2):
        for i in range(n):
            for j in range(n):
                if j > i:
                    want = 0.0
                elif j == i or kinds[h, j] == 0:
                    want = 1.0
                elif kinds[h, j] == 1:
                    want = float(not any(kinds[h, t] == 0 for t in range(j + 1, i + 1)))
                else:
                    want = float(i - j < window)
                assert float(mask[h, i, j]) == want, (h, i, j)


def _sink_texts(count, n=48, seed=0):
    """A layer whose queries all look at token 0 (its hidden state marked by feature 0), as at an attention sink."""
    g = torch.Generator().manual_seed(seed)
    texts = []
    for _ in range(count):
        hidden = torch.randn(n, 4, generator=g)
        hidden[:, 0] = 0.0
        hidden[0, 0] = 4.0
        keys = torch.randn(1, n, 8, generator=g) * 0.1
        keys[0, 0] = 3.0
        query = torch.ones(1, n, 8)
        texts.append((query, keys, torch.randn(1, n, 8, generator=g), hidden))
    return texts


def test_training_makes_the_sink_global_and_drops_the_rest():
    layer = RecordedLayer(_sink_texts(4), torch.eye(8), scale=1.0)
    weight, bias = train_layer(layer, range(3), window=4, sparsity=0.5, epochs=30, lr=0.1, seed=0)
    with torch.no_grad():
        hidden = layer.hidden[3]
        roles = ((hidden @ weight.flatten(1)).view(-1, 1, 3) + bias).argmax(-1)[:, 0]
        fit = evaluate_layer(layer, range(3, 4), weight, bias, window=4, seed=0)
    assert int(roles[0]) == 0 and float((roles[1:] == 0).float().mean()) < 0.2  # the sink global, few others
    assert fit["held"] < 0.5 and fit["error"] < fit["shuffled_error"]


def test_train_gates_writes_gates_for_the_model(tokenized):
    model, tokenizer = tokenized
    gates = train_gates(model, tokenizer, "tiny", texts=2, held_out=1, tokens=64, epochs=1, log=lambda _: None)
    gates.check(model)
    assert gates.weight.shape == (3, 64, 2, 3) and bool(gates.weight.abs().sum() > 0) and gates.window == 32
    t = gates.training
    assert set(t["test"]) == {"error", "shuffled_error", "held"} and len(t["test_layers"]) == 3
    assert t["command"].startswith("kvpress train-gates --model tiny --texts 2 --held-out 1 --tokens 64")
    with pytest.raises(ValueError, match="texts must be an integer >= 1, got 0"):
        train_gates(model, tokenizer, "tiny", texts=0)
    with pytest.raises(ValueError, match="lr must be a finite number > 0, got inf"):
        train_gates(model, tokenizer, "tiny", lr=float("inf"))


def test_packaged_gates_beat_shuffled_roles():
    assert {"smollm2-135m", "qwen2.5-0.5b"} <= set(packaged())
    for name in packaged():
        gates = load_gates(name)
        fit = gates.training["test"]
        assert gates.model == name and fit["error"] < fit["shuffled_error"] and 0 < fit["held"] < 1
        assert gates.training["command"].startswith(f"kvpress train-gates --model {name}")


def test_the_recorded_training_commands_parse_with_the_cli(capsys):
    """Every flag of a shipped file's `command` is one `kvpress train-gates` takes (they come from the trainer's
    signature); a bad count is refused before any model loads."""
    for name in packaged():
        argv = shlex.split(load_gates(name).training["command"])[1:] + ["--out", "x.safetensors", "--epochs", "0"]
        assert cli.main(argv) == 2  # argparse would exit on a flag it does not know
        assert "--epochs must be an integer >= 1, got 0" in capsys.readouterr().err
