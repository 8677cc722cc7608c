"""Nothing silent: a fault raised inside the model, at a random layer and step, propagates unchanged, leaves
the model exactly as it was, and leaves no cache, chat, stream or sweep silently wrong.

Every fault is a hook on one decoder layer's `self_attn` (before or after it: the layers before it, or up
to it, have fed the forward's tokens to the cache) that raises on one chosen call; which layer, which call
and which side are drawn from `random.Random(seed)`.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from test_install import _registered, _snapshot
from transformers import DynamicCache

import kvpress
from kvpress import (
    AdaKVPress,
    DuoAttentionPress,
    HeavyHitterPress,
    KVzipPress,
    RoundPolicy,
    SinkWindowPress,
    SnapKVPress,
)
from kvpress.eval import sweep as sweep_module
from kvpress.eval import tasks as task_module
from kvpress.eval.sweep import run_sweep
from kvpress.patches import intercept
from kvpress.patterns import config_hash
from kvpress.pipeline import split_prompt
from kvpress.recording import record_prefill
from tiny import CONTEXT, QUESTION, prompt, tiny_model

LAYERS = 3  # a middle layer too: a fault there leaves layers fed on both sides of it (`tokenized`'s model has 3)
# (seed, what is raised): seeds whose draws hit a middle layer (0), before the first layer's attention (2), after
# the last one's (5) and after the first one's (8), so faults that leave the cache torn and faults that leave
# every layer alike are both met, with either exception
SEEDS = [(0, "Fault"), (2, "KeyboardInterrupt"), (5, "Fault"), (8, "KeyboardInterrupt")]
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
              "_forward_pre_hooks_with_kwargs")  # fmt: skip


class Fault(Exception):
    """The injected fault: a type nothing under test raises or catches by name."""


RAISED = {"Fault": Fault, "KeyboardInterrupt": KeyboardInterrupt}


# ----- injection ------------------------------------------------------------------------------------------
@dataclass
class Injection:
    """Raise `exc` at the `call`-th (from 0) call of layer `layer`'s self_attn, before it (`pre`) or after it."""

    layer: int
    call: int
    pre: bool
    exc: type[BaseException]
    raised: BaseException | None = None

    @classmethod
    def draw(cls, seed: int, calls, exc: type[BaseException] = Fault, layers: int = LAYERS) -> Injection:
        rng = random.Random(seed)
        return cls(layer=rng.randrange(layers), call=rng.choice(list(calls)), pre=rng.random() < 0.5, exc=exc)

    @contextlib.contextmanager
    def armed(self, model):
        count = itertools.count()

        def hook(module, *args):
            if next(count) == self.call:
                self.raised = self.exc(f"injected at layer {self.layer}, call {self.call}")
                raise self.raised

        attn = model.model.layers[self.layer].self_attn
        handle = attn.register_forward_pre_hook(hook) if self.pre else attn.register_forward_hook(hook)
        try:
            yield self
        finally:
            handle.remove()

    @contextlib.contextmanager
    def raising(self, model):
        """Armed, and the fault must come out of the block unchanged: the very object raised."""
        with self.armed(model), pytest.raises(self.exc) as info:
            yield self
        assert self.raised is not None and info.value is self.raised  # not wrapped, not replaced


@contextlib.contextmanager
def counting(model, layer: int):
    """Count the calls of layer `layer`'s self_attn inside the block (`calls[0]`)."""
    calls = [0]

    def hook(module, *args):
        calls[0] += 1

    handle = model.model.layers[layer].self_attn.register_forward_pre_hook(hook)
    try:
        yield calls
    finally:
        handle.remove()


# ----- the model as it was ---------------------------------------------------------------------------------
def _plain(model) -> torch.Tensor:
    return model.generate(prompt(1, 24, seed=9), max_new_tokens=6, do_sample=False, pad_token_id=0)


def _state(model):
    """The model's forwards, config and attention implementation, and every hook dict of every module."""
    hooks = {name: {kind: dict(getattr(m, kind)) for kind in HOOK_DICTS} for name, m in model.named_modules()}
    return _snapshot(model), hooks, model.config._attn_implementation


@dataclass
class Before:
    state: tuple
    plain: torch.Tensor

    @classmethod
    def take(cls, model) -> Before:
        return cls(_state(model), _plain(model))

    def check(self, model) -> None:
        assert model.config._attn_implementation == self.state[2]
        assert _state(model) == self.state  # no hook left on the model or any module, forwards and config as before
        assert not _registered()  # no kvpress_* attention or mask function left in transformers' registries
        assert not intercept._ACTIVE.get()  # and no press left active for this caller
        assert torch.equal(_plain(model), self.plain)


# ----- presses ---------------------------------------------------------------------------------------------
def _duo(model):
    pattern = {"model": "tiny", "config_hash": config_hash(model), "scores": [[0.3, 0.1], [0.2, 0.9], [0.5, 0.4]]}
    return DuoAttentionPress(compression_ratio=0.5, head_pattern=pattern, n_sink=2, window=4)


PRESSES: dict[str, Callable] = {
    "snapkv": lambda model: SnapKVPress(compression_ratio=0.5, window_size=4),
    "h2o": lambda model: HeavyHitterPress(compression_ratio=0.5, window=4),  # per-slot state, updated every step
    "sink-window-rerotate": lambda model: SinkWindowPress(n_sink=4, window=12, rerotate=True),
    "adakv": lambda model: AdaKVPress(SnapKVPress(compression_ratio=0.5, window_size=4)),  # head-wise layers
    "duo": _duo,
}


def _feed(model, press, cache, ids: torch.Tensor, first: int) -> torch.Tensor:
    """Last logits of feeding `cache` the next two tokens of `ids` `[1, N]` under `press`, one at a time
    (an empty cache: the first `first` tokens, then one)."""
    seen = cache.get_seq_length()
    cuts = [seen, seen + 1, seen + 2] if seen else [0, first, first + 1]
    with press(model):
        return torch.cat([model(ids[:, a:b], cache=cache).logits[:, -1:] for a, b in itertools.pairwise(cuts)], dim=1)


def _refuses(err: BaseException) -> None:
    """A refusal is clear: an error that says to start over."""
    assert isinstance(err, (RuntimeError, ValueError)), err
    assert "new cache" in str(err), err


# ----- (a), (b): with press(model): model.generate(...) -------------------------------------------------------
PROMPT_LEN, NEW = 40, 4


@pytest.mark.parametrize("seed,raised", SEEDS)
@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("name", list(PRESSES))
def test_a_fault_in_generate_under_a_press(name, phase, seed, raised):
    model = tiny_model("llama", num_hidden_layers=LAYERS)
    ids = prompt(1, PROMPT_LEN, seed=seed)
    press = PRESSES[name](model)
    with press(model):
        seq = model.generate(ids, max_new_tokens=NEW + 2, do_sample=False, pad_token_id=0)  # never faulted
    assert seq.shape[1] == PROMPT_LEN + NEW + 2
    before = Before.take(model)
    fault = Injection.draw(seed, [0] if phase == "prefill" else range(1, NEW), RAISED[raised])  # forward = call
    cache = DynamicCache(config=model.config)
    with fault.raising(model), press(model):
        model.generate(ids, cache=cache, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    before.check(model)

    # the cache the fault touched: refused, or continued exactly as a never-faulted cache of the same length
    seen = cache.get_seq_length()
    try:
        got = _feed(model, press, cache, seq, PROMPT_LEN)
    except (RuntimeError, ValueError) as err:
        _refuses(err)
        torn = True
    else:
        reference = DynamicCache(config=model.config)
        if seen:  # the same press object: a fault left nothing in it either
            with press(model):
                model.generate(ids, cache=reference, max_new_tokens=seen - PROMPT_LEN + 1, do_sample=False,
                               pad_token_id=0)  # fmt: skip
        assert reference.get_seq_length() == seen
        assert torch.equal(got, _feed(model, press, reference, seq, PROMPT_LEN))
        torn = False
    # only a fault after the last layer's attention, or before the first one's, leaves every layer alike: any
    # other leaves the layers at different lengths, which nothing may continue (today such alike caches continue)
    alike = (fault.layer == LAYERS - 1 and not fault.pre) or (fault.layer == 0 and fault.pre)
    assert torn or alike
    before.check(model)


@pytest.mark.parametrize("how", ["press", "observer"])
def test_a_cache_torn_by_a_fault_refuses_a_plain_forward(how):
    """Refused inside a press, and by a plain forward too (`model.generate(..., cache=cache)`), which once
    continued it silently with its layers at different lengths."""
    model = tiny_model("llama", num_hidden_layers=LAYERS)
    ids = prompt(1, PROMPT_LEN)
    cache = DynamicCache(config=model.config)
    fault = Injection(layer=0, call=0, pre=False, exc=Fault)  # layer 0 holds the prompt, layers 1 and 2 nothing
    context = PRESSES["snapkv"](model)(model) if how == "press" else kvpress.observe(model, lambda obs: None)
    with fault.raising(model), context:
        model(ids, cache=cache)
    with pytest.raises((RuntimeError, ValueError), match="new cache"):
        model(ids[:, -1:], cache=cache)  # a plain forward, as `model.generate(..., cache=cache)` runs


def test_a_keyboard_interrupt_in_a_plain_forward_does_not_stall_another_threads_press(monkeypatch):
    """A forward that a KeyboardInterrupt ends is counted out like any other: leaving a press in another thread
    once waited for it the whole uninstall timeout (60 s: torch runs always-called forward hooks for Exception
    only), then restored the model anyway."""
    model = tiny_model("llama", num_hidden_layers=LAYERS)
    monkeypatch.setattr(intercept.Intercept.uninstall, "__defaults__", (1.0,))  # the wait, 60 s, made 1 s
    entered, release, took = threading.Event(), threading.Event(), []

    def holder() -> None:
        installation = SnapKVPress(compression_ratio=0.5)(model)
        with installation:
            entered.set()
            release.wait(timeout=30)
            start = time.perf_counter()
        took.append(time.perf_counter() - start)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        entered.wait(timeout=30)
        with Injection(layer=1, call=0, pre=False, exc=KeyboardInterrupt).raising(model):
            model(prompt(1, 8))  # this caller's plain forward, while the other thread holds the press
    finally:
        release.set()
        thread.join()
    assert model.config._attn_implementation == "sdpa"
    assert took[0] < 0.5


# ----- (c), (d), (f) use a real tokenizer (SmolLM2's) over a tiny random model of its vocabulary (`tokenized`) ---


# ----- (c): KVzip's whole-context scoring pass in kvpress.generate ----------------------------------------------


def _kvzip() -> KVzipPress:
    return KVzipPress(0.5, reconstruction_chunk=8, window_size=4)  # passes of 8 context tokens


def _layers_equal(a: DynamicCache, b: DynamicCache) -> bool:
    return all(
        x.seen == y.seen and x.n == y.n and torch.equal(x.keys[:, :, : x.n], y.keys[:, :, : y.n])
        and torch.equal(x.values[:, :, : x.n], y.values[:, :, : y.n]) and torch.equal(x.pos, y.pos)
        for x, y in zip(a.layers, b.layers, strict=True)
    )  # fmt: skip


@pytest.mark.parametrize("seed,raised", SEEDS)
def test_a_fault_in_kvzips_scoring_pass(tokenized, seed, raised):
    model, tokenizer = tokenized
    ctx_ids, _ = split_prompt(tokenizer, CONTEXT, QUESTION, chat_template=False)
    assert ctx_ids.shape[1] <= 48
    passes = math.ceil(ctx_ids.shape[1] / 8)
    ask = dict(chat_template=False, max_new_tokens=4)
    expected = kvpress.generate(model, tokenizer, CONTEXT, QUESTION, press=_kvzip(), **ask)
    press = _kvzip()
    before = Before.take(model)
    fault = Injection.draw(seed, range(1, passes + 1), RAISED[raised])  # call 0 is the prefill; then the passes
    cache = DynamicCache(config=model.config)
    with fault.raising(model):
        kvpress.generate(model, tokenizer, CONTEXT, QUESTION, press=press, cache=cache, **ask)
    before.check(model)
    # the pass ran on the cache itself: it is put back, the whole context as a plain prefill left it
    full = record_prefill(model, ctx_ids).cache
    assert _layers_equal(cache, full)
    token = torch.tensor([[7]])
    assert torch.equal(model(token, cache=cache).logits, model(token, cache=full).logits)
    # and the press object, whose pass was cut, answers as a new one
    assert kvpress.generate(model, tokenizer, CONTEXT, QUESTION, press=press, **ask) == expected
    before.check(model)


GENERATE = {"full": lambda: None, "snapkv": lambda: SnapKVPress(compression_ratio=0.5, window_size=4), "kvzip": _kvzip}


@pytest.mark.parametrize("seed,raised", SEEDS)
@pytest.mark.parametrize("name", list(GENERATE))
def test_a_fault_anywhere_in_kvpress_generate(tokenized, name, seed, raised):
    """The prefill, KVzip's passes, the question, the answer's steps: the cache a fault left is never read again."""
    model, tokenizer = tokenized
    ask = dict(chat_template=False, max_new_tokens=4)
    fault = Injection.draw(seed, [0], RAISED[raised])  # the layer and side; the call is drawn below
    with counting(model, fault.layer) as calls:
        expected = kvpress.generate(model, tokenizer, CONTEXT, QUESTION, press=GENERATE[name](), **ask)
    fault.call = random.Random(f"{seed}:call").randrange(calls[0])
    press = GENERATE[name]()
    before = Before.take(model)
    cache = DynamicCache(config=model.config)
    with fault.raising(model):
        kvpress.generate(model, tokenizer, CONTEXT, QUESTION, press=press, cache=cache, **ask)
    before.check(model)
    try:  # asked again on the cache the fault left: refused, or the answer of a never-faulted call
        again = kvpress.generate(model, tokenizer, CONTEXT, QUESTION, press=press, cache=cache, **ask)
    except ValueError as err:
        _refuses(err)
    else:
        assert again == expected
    assert kvpress.generate(model, tokenizer, CONTEXT, QUESTION, press=press, **ask) == expected
    before.check(model)


# ----- (d): a chat turn -------------------------------------------------------------------------------------------
TURNS = ["My locker code is 48213.", "I went hiking in the rain.", "What is my locker code?"]
CHATS = {
    "full": lambda: {},
    "snapkv": lambda: {"press": SnapKVPress(compression_ratio=0.5, window_size=4)},
    "round-policy": lambda: {"round_policy": RoundPolicy(top_k_rounds=0, keep_recent_rounds=1, watershed_layer=1)},
}


@pytest.mark.parametrize("seed,raised", SEEDS)
@pytest.mark.parametrize("kind", list(CHATS))
def test_a_fault_in_a_chat_turn(tokenized, kind, seed, raised):
    model, tokenizer = tokenized
    session = kvpress.ChatSession(model, tokenizer, max_new_tokens=NEW, **CHATS[kind]())
    session.send(TURNS[0])
    history = (list(session.messages), list(session.rounds))
    before = Before.take(model)
    fault = Injection.draw(seed, range(NEW), RAISED[raised])  # the turn's prefill, then its decoding steps
    with fault.raising(model):
        session.send(TURNS[1])
    before.check(model)
    assert (session.messages, session.rounds) == history  # the failed turn is not half-recorded
    reference = kvpress.ChatSession(model, tokenizer, max_new_tokens=NEW, **CHATS[kind]())
    reference.send(TURNS[0])  # a session that never saw the failed turn
    try:
        answer = session.send(TURNS[2])
    except RuntimeError as err:
        assert kind != "full"  # a full-cache session is always rolled back
        assert "interrupted mid-turn" in str(err) and "start a new one" in str(err)
        with pytest.raises(RuntimeError, match="start a new one"):  # and it stays refused
            session.send(TURNS[2])
        assert (session.messages, session.rounds) == history
    else:
        assert answer == reference.send(TURNS[2])
        assert session.messages == reference.messages and session.rounds == reference.rounds
        assert session.cache.get_seq_length() == reference.cache.get_seq_length()
    before.check(model)


# ----- (e): a kvpress.stream chunk ----------------------------------------------------------------------------------
STREAMS = {
    "sink-window-rerotate": lambda: SinkWindowPress(n_sink=4, window=12, rerotate=True),
    "h2o": lambda: HeavyHitterPress(max_tokens=16, window=4),
}
CHUNK, STREAM_LEN = 8, 48


def _stream(model, ids, press, cache=None) -> list[torch.Tensor]:
    return list(kvpress.stream(model, None, ids, press=press, chunk=CHUNK, cache=cache, progress=False))


@pytest.mark.parametrize("seed,raised", SEEDS)
@pytest.mark.parametrize("name", list(STREAMS))
def test_a_fault_in_a_stream_chunk(name, seed, raised):
    model = tiny_model("llama", num_hidden_layers=LAYERS)
    ids = prompt(1, STREAM_LEN, seed=seed)[0]
    press = STREAMS[name]()
    expected = _stream(model, ids, press)
    before = Before.take(model)
    fault = Injection.draw(seed, range(STREAM_LEN // CHUNK), RAISED[raised])  # one forward per chunk
    cache = DynamicCache(config=model.config)
    it = kvpress.stream(model, None, ids, press=press, chunk=CHUNK, cache=cache, progress=False)
    got = []
    with fault.raising(model):
        for nll in it:
            got.append(nll)
    assert inspect.getgeneratorstate(it) == inspect.GEN_CLOSED
    assert len(got) == fault.call and all(torch.equal(a, b) for a, b in zip(got, expected, strict=False))
    before.check(model)
    seen = cache.get_seq_length()
    try:
        continued = _feed(model, press, cache, ids[None], CHUNK)
    except (RuntimeError, ValueError) as err:
        _refuses(err)
    else:
        reference = DynamicCache(config=model.config)
        if seen:
            _stream(model, ids[:seen], press, reference)
        assert torch.equal(continued, _feed(model, press, reference, ids[None], CHUNK))
    again = _stream(model, ids, press)  # the same press object streams as it did before the fault
    assert all(torch.equal(a, b) for a, b in zip(again, expected, strict=True))
    before.check(model)


# ----- (f): a sweep row ---------------------------------------------------------------------------------------
SWEEP = dict(presses=["snapkv:window_size=4", "h2o:window=4", "kvzip:window_size=4"], ratios=[0, 0.5],
             tasks=["fake"], examples=2, length=64, progress=False)  # fmt: skip
ROWS = 2 * 4  # two examples, each: the full cache and three presses at r = 0.5


def _fake_task(tokenizer, n, length, seed):
    return [task_module.Example(f"Note {i}: the code of the blue locker is {48213 + 7 * i}. It rained all day long "
                                "and the trail was muddy, but the view from the top was worth it.",
                                "What is the code of the blue locker?", (str(48213 + 7 * i),))
            for i in range(n)]  # fmt: skip


@pytest.fixture
def fake_task(monkeypatch):
    monkeypatch.setitem(task_module.TASKS, "fake", _fake_task)
    monkeypatch.setitem(task_module.ANSWER_TOKENS, "fake", 3)


def _rows(path) -> list[dict]:
    """The rows of a results file, without the process's peak memory (which a run does not repeat)."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("peak_")}
            for line in path.read_text().splitlines()]  # fmt: skip


def _key(row: dict) -> tuple:
    return row["task"], row["example"], row["press"], row["ratio"]


@pytest.mark.parametrize("seed,raised", SEEDS)
def test_a_fault_in_a_sweep_row(tokenized, fake_task, tmp_path, monkeypatch, seed, raised):
    model, tokenizer = tokenized
    fault = Injection.draw(seed, [0], RAISED[raised])  # the layer and side; the call is drawn below
    with counting(model, fault.layer) as calls:
        whole = run_sweep(model, tokenizer, out=tmp_path / "whole", **SWEEP)
    expected = {_key(r): r for r in _rows(tmp_path / "whole" / "results.jsonl")}
    assert len(expected) == ROWS
    fault.call = random.Random(f"{seed}:call").randrange(calls[0])
    answered = []  # the rows whose answer was generated, run by run
    real = sweep_module.answer_ids_from_cache

    def answer(*args, **kwargs):
        new = real(*args, **kwargs)
        answered[-1] += 1
        return new

    monkeypatch.setattr(sweep_module, "answer_ids_from_cache", answer)
    before = Before.take(model)
    out = tmp_path / "cut"
    answered.append(0)
    with fault.raising(model):
        run_sweep(model, tokenizer, out=out, **SWEEP)
    before.check(model)
    results = out / "results.jsonl"
    text = results.read_text()
    assert not text or text.endswith("\n")  # no row written half
    done = _rows(results)
    assert len(done) == answered[0] < ROWS  # every row completed before the fault was written (the failed one not)
    assert all(row == expected[_key(row)] for row in done)  # as an uninterrupted sweep measured it

    answered.append(0)
    summary = run_sweep(model, tokenizer, out=out, **SWEEP)
    lines = results.read_text().splitlines()
    assert "".join(line + "\n" for line in lines[: len(done)]) == text  # the completed rows stay as written
    resumed = _rows(results)
    assert answered[1] == ROWS - len(done)  # exactly the missing rows are measured again
    assert sorted(map(_key, resumed[len(done) :])) == sorted(set(expected) - set(map(_key, done)))
    assert {_key(r): r for r in resumed} == expected and len(resumed) == ROWS
    drop = ("peak_rss_bytes", "peak_cuda_allocated_bytes")
    assert [{k: v for k, v in s.items() if k not in drop} for s in summary] == [
        {k: v for k, v in s.items() if k not in drop} for s in whole]  # fmt: skip
    before.check(model)
