"""A press acts for the caller that entered it: other threads, and code that runs while a stream that holds
a press is suspended, get what they would get with no press at all."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import time
import warnings
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import kvpress
from kvpress import KVzipPress, SinkWindowPress, SnapKVPress
from tiny import prompt, tiny_model

# the other thread runs without the press on purpose (its warning is tested on its own)
_UNPRESSED_ON_PURPOSE = pytest.mark.filterwarnings("ignore:a forward of this .* ran without the press")


def _generate(model, ids, cache=None):
    return model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False, pad_token_id=0)


def _plain(cache: DynamicCache) -> bool:
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def _alone(model, ids, press):
    """What one caller gets with no press and with `press`, nobody else running (and they differ)."""
    plain = _generate(model, ids)
    with press(model):
        pressed = _generate(model, ids)
    assert not torch.equal(plain, pressed)  # so the comparisons of the tests tell the two apart
    return plain, pressed


def _run(*targets) -> None:
    threads = [threading.Thread(target=target) for target in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@_UNPRESSED_ON_PURPOSE
def test_two_threads_one_model():
    model = tiny_model("llama")
    ids = prompt(1, 40)
    press = SnapKVPress(compression_ratio=0.75, window_size=4)
    alone_plain, alone_pressed = _alone(model, ids, press)
    entered, plain_done = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def pressed() -> None:
        with press(model):
            entered.set()
            plain_done.wait(timeout=60)  # the other thread's whole generate runs while the press is installed
            cache = DynamicCache(config=model.config)
            results["pressed"] = _generate(model, ids, cache)

    def plain() -> None:
        entered.wait(timeout=60)
        cache = DynamicCache(config=model.config)
        results["plain"] = _generate(model, ids, cache)
        results["plain_untouched"] = _plain(cache)
        plain_done.set()

    _run(pressed, plain)
    assert torch.equal(results["plain"], alone_plain)
    assert results["plain_untouched"]  # its cache was never turned into pressed layers
    assert torch.equal(results["pressed"], alone_pressed)
    assert model.config._attn_implementation == "sdpa"


@_UNPRESSED_ON_PURPOSE
def test_two_threads_generating_at_once():
    model = tiny_model("llama")
    ids = prompt(1, 40)
    press = SnapKVPress(compression_ratio=0.75, window_size=4)
    alone_plain, alone_pressed = _alone(model, ids, press)
    outputs: dict[str, list] = {"plain": [], "pressed": [], "untouched": []}
    barrier = threading.Barrier(2)

    def pressed() -> None:
        with press(model):
            barrier.wait(timeout=60)
            for _ in range(3):
                outputs["pressed"].append(_generate(model, ids))

    def plain() -> None:
        barrier.wait(timeout=60)
        for _ in range(3):
            cache = DynamicCache(config=model.config)
            outputs["plain"].append(_generate(model, ids, cache))
            outputs["untouched"].append(_plain(cache))

    _run(pressed, plain)
    assert all(torch.equal(out, alone_plain) for out in outputs["plain"]) and all(outputs["untouched"])
    assert all(torch.equal(out, alone_pressed) for out in outputs["pressed"])


@_UNPRESSED_ON_PURPOSE
def test_entering_and_leaving_while_another_thread_generates():
    """Installing and uninstalling never lands in the middle of another thread's forward."""
    model = tiny_model("llama")
    ids = prompt(1, 40, seed=4)
    press = SnapKVPress(compression_ratio=0.75, window_size=4)
    alone_plain, alone_pressed = _alone(model, ids, press)
    outputs: dict[str, list] = {"plain": [], "pressed": [], "errors": []}
    started = threading.Event()

    def plain() -> None:
        try:
            started.set()
            for _ in range(6):
                outputs["plain"].append(_generate(model, ids))
        except Exception as err:  # reported below, with the others
            outputs["errors"].append(err)

    def pressed() -> None:
        started.wait(timeout=60)
        try:
            for _ in range(6):
                with press(model):
                    outputs["pressed"].append(_generate(model, ids))
        except Exception as err:
            outputs["errors"].append(err)

    _run(plain, pressed)
    assert not outputs["errors"]
    assert all(torch.equal(out, alone_plain) for out in outputs["plain"]) and len(outputs["plain"]) == 6
    assert all(torch.equal(out, alone_pressed) for out in outputs["pressed"]) and len(outputs["pressed"]) == 6
    assert model.config._attn_implementation == "sdpa"


@_UNPRESSED_ON_PURPOSE
def test_leaving_waits_for_another_threads_forward():
    """A press left while another thread is between two layers of a forward: that forward finishes as it began."""
    model = tiny_model("llama")
    ids = prompt(1, 40, seed=4)
    expected = model(ids).logits
    mid, errors, logits = threading.Event(), [], []

    def slow(module, args, output):  # after the first decoder layer, give the other thread time to leave
        if threading.current_thread().name == "plain":
            mid.set()
            time.sleep(0.5)

    hook = model.model.layers[0].register_forward_hook(slow)
    try:
        def plain() -> None:
            try:
                with torch.inference_mode():  # thread-local: the new thread starts without it
                    logits.append(model(ids).logits)
            except Exception as err:
                errors.append(err)

        def pressed() -> None:
            with SnapKVPress(compression_ratio=0.5)(model):
                thread = threading.Thread(target=plain, name="plain")
                thread.start()
                mid.wait(timeout=60)
            thread.join()

        _run(pressed)
    finally:
        hook.remove()
    assert not errors and torch.equal(logits[0], expected)
    assert model.config._attn_implementation == "sdpa"


def test_a_thread_started_inside_runs_without_the_press_unless_given_the_context():
    """Activation follows `contextvars`: a new thread starts with none, and is told so; `copy_context().run` carries
    it."""
    model = tiny_model("llama")
    ids = prompt(1, 40)
    caches = [DynamicCache(config=model.config), DynamicCache(config=model.config)]
    with SnapKVPress(compression_ratio=0.5, window_size=4)(model):
        with pytest.warns(UserWarning, match="ran without the press installed on it .*copy_context") as told:
            fresh = threading.Thread(target=lambda: _generate(model, ids, caches[0]), name="fresh")
            fresh.start()
            fresh.join()
        assert len(told) == 1 and "'fresh'" in str(told[0].message)  # once a thread, not once a decoding step
        for name in ("again", "once more"):  # a thread started after another ended (which may reuse its id)
            with pytest.warns(UserWarning, match=f"ran without the press installed on it .thread '{name}'"):
                later = threading.Thread(target=lambda: _generate(model, ids), name=name)
                later.start()
                later.join()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the thread given the context is pressed, and not warned
            carried = threading.Thread(target=contextvars.copy_context().run, args=(_generate, model, ids, caches[1]))
            carried.start()
            carried.join()
    assert _plain(caches[0])
    assert not _plain(caches[1]) and caches[1].layers[0].n < caches[1].layers[0].seen


def test_each_thread_told_it_runs_unpressed_leaves_nothing_in_pythons_warning_registry():
    """The message names its thread, so under Python's default filter each new thread's text was kept in the
    calling module's `__warningregistry__` for good (1,000 short-lived threads: 1,000 entries, about 1 MB): each
    thread is still told, and the registry holds none of them."""
    import sys

    model = tiny_model("llama")
    ids = prompt(1, 12)
    with SnapKVPress(compression_ratio=0.5, window_size=4)(model), warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("default")  # (Python's own: once per text and place, recorded in a registry)
        raised = []

        def work():
            try:
                with torch.inference_mode():  # (the test's own mode is this thread's alone)
                    model(ids)
            except Exception as error:
                raised.append(error)

        for i in range(5):
            thread = threading.Thread(target=work, name=f"worker-{i}")
            thread.start()
            thread.join()
    assert not raised and sum("ran without the press" in str(w.message) for w in told) == 5
    registries = [vars(module).get("__warningregistry__") for module in list(sys.modules.values())
                  if isinstance(getattr(module, "__dict__", None), dict)]  # fmt: skip
    kept = [key for registry in registries if isinstance(registry, dict) for key in registry
            if isinstance(key, tuple) and "ran without the press" in str(key[0])]  # fmt: skip
    assert kept == []


def test_threads_given_the_context_keep_their_own_state():
    """Threads started with a copy of the caller's context (`copy_context().run`, `asyncio.to_thread`) share no
    state with it or with each other: one's frozen() pauses its own forwards only, and two generate at once."""
    model = tiny_model("llama")
    ids = prompt(1, 40)
    press = SnapKVPress(compression_ratio=0.75, window_size=4)
    _, alone_pressed = _alone(model, ids, press)
    held, done, outputs = threading.Event(), threading.Event(), []
    barrier = threading.Barrier(2)
    with press(model) as installation:

        def freeze() -> None:
            with installation.frozen():
                held.set()
                done.wait(timeout=60)

        def generate_thrice() -> None:
            barrier.wait(timeout=60)
            for _ in range(3):
                outputs.append(_generate(model, ids))

        worker = threading.Thread(target=contextvars.copy_context().run, args=(freeze,))
        worker.start()
        held.wait(timeout=60)
        try:
            assert torch.equal(_generate(model, ids), alone_pressed)  # the worker's frozen() is not the caller's
        finally:
            done.set()
            worker.join()
        _run(*(functools.partial(contextvars.copy_context().run, generate_thrice) for _ in range(2)))
        paused = DynamicCache(config=model.config)
        with installation.frozen():  # a thread started while the caller's eviction is paused starts paused too
            _run(functools.partial(contextvars.copy_context().run, _generate, model, ids, paused))
    assert paused.layers[0].n == paused.layers[0].seen > 40
    assert len(outputs) == 6 and all(torch.equal(out, alone_pressed) for out in outputs)


class _RepeatRequest:
    """Stands in for a tokenizer where KVzip writes its repeat request: the tokens 5, 6, 7."""

    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        return SimpleNamespace(input_ids=torch.tensor([[5, 6, 7]]))


def test_threads_take_turns_scoring_the_whole_context(monkeypatch):
    """A press that scores the whole context keeps the prompt's scores on itself until it has evicted by them:
    two threads given the context, each prefilling its own prompt, evict by their own prompt's scores."""
    model = tiny_model("llama")
    prompts = [prompt(1, 40, seed=1), prompt(1, 56, seed=2)]
    press = KVzipPress(0.5, window_size=4)
    with press(model, tokenizer=_RepeatRequest()):
        alone = [_generate(model, ids) for ids in prompts]
    both_scored, prepare = threading.Barrier(2), KVzipPress.prepare

    def prepare_then_wait(self, *args, **kwargs):  # without turns both would score before either evicts
        prepare(self, *args, **kwargs)
        with contextlib.suppress(threading.BrokenBarrierError):
            both_scored.wait(timeout=2)

    monkeypatch.setattr(KVzipPress, "prepare", prepare_then_wait)
    outputs, errors = {}, []

    def generate(i: int) -> None:
        try:
            outputs[i] = _generate(model, prompts[i])
        except Exception as error:  # noqa: BLE001 (reported by the assertion below)
            errors.append(error)

    with press(model, tokenizer=_RepeatRequest()):
        _run(*(functools.partial(contextvars.copy_context().run, generate, i) for i in range(2)))
    assert not errors and all(torch.equal(outputs[i], alone[i]) for i in range(2))


def test_suspended_stream_leaves_the_caller_alone():
    model = tiny_model("llama")
    text = prompt(1, 200, seed=5)[0]
    other = prompt(1, 30, seed=6)
    press = SinkWindowPress(n_sink=4, window=28, rerotate=True)
    expected_plain, expected_generate = model(other).logits, _generate(model, other)
    expected_stream = torch.cat(list(kvpress.stream(model, None, text, press=press, chunk=32, progress=False)))
    nlls = []
    it = kvpress.stream(model, None, text, press=press, chunk=32, progress=False)
    for step, nll in enumerate(it):
        nlls.append(nll)
        if step in (0, 3):  # suspended mid-stream: plain calls by the caller, and another press on the model
            assert model.config._attn_implementation == "sdpa"  # nothing installed while suspended
            cache = DynamicCache(config=model.config)
            assert torch.equal(model(other, cache=cache, use_cache=True).logits, expected_plain)
            assert _plain(cache)
            assert torch.equal(_generate(model, other), expected_generate)
            with SnapKVPress(compression_ratio=0.5, window_size=4)(model):  # (refused while the stream held it)
                model(other, cache=DynamicCache(config=model.config))
    assert torch.equal(torch.cat(nlls), expected_stream)
    assert model.config._attn_implementation == "sdpa"
    abandoned = kvpress.stream(model, None, text, press=press, chunk=32, progress=False)
    next(abandoned)  # left unfinished, never closed
    with SnapKVPress(compression_ratio=0.5, window_size=4)(model):
        model(other, cache=DynamicCache(config=model.config))


def test_a_frozen_block_inside_another_leaves_eviction_paused():
    """The inner block restores what it found (paused), not eviction: the outer block's forwards still keep all."""
    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    with SnapKVPress(compression_ratio=0.5, window_size=4)(model) as installation:
        with installation.frozen():
            with installation.frozen():
                pass
            model(prompt(1, 40), cache=cache)
        assert cache.layers[0].n == 40
        model(prompt(1, 4), cache=cache)  # out of both: evicts again
        assert cache.layers[0].n == 22


def test_frozen_needs_the_caller_that_entered():
    model = tiny_model("llama")
    installation = SnapKVPress(compression_ratio=0.5)(model)
    with installation.installed(), pytest.raises(RuntimeError, match="frozen"):
        with installation.frozen():
            pass
    assert model.config._attn_implementation == "sdpa"
    with installation.installed(), warnings.catch_warnings():
        warnings.filterwarnings("error", "a forward of this")  # the installing thread's own forwards outside
        # `activated()` are its deliberate split: not warned
        cache = DynamicCache(config=model.config)
        model(prompt(1, 20), cache=cache)
        with installation.activated():
            model(prompt(1, 20), cache=DynamicCache(config=model.config))
    assert _plain(cache)


def test_observers_see_every_layer_and_evict_nothing():
    model = tiny_model("llama")
    ids = prompt(1, 30)
    seen = []
    cache = DynamicCache(config=model.config)
    with kvpress.observe(model, lambda obs: seen.append((obs.layer_idx, obs.q_len, obs.keys.shape[2]))):
        logits = model(ids, cache=cache).logits
    assert seen == [(0, 30, 30), (1, 30, 30)]
    assert torch.equal(logits, model(ids).logits) and cache.get_seq_length() == cache.layers[0].n == 30
    with pytest.raises(TypeError, match="an observer is a callable"):
        kvpress.observe(model, 3)
    with pytest.raises(ValueError, match="nothing to install"):
        kvpress.observe(model)
