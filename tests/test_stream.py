"""`kvpress.stream`: long streams through a bounded cache."""

import pytest
import torch
from transformers import DynamicCache

import kvpress
from kvpress import HeavyHitterPress, SinkWindowPress, cache_bytes
from tiny import prompt, tiny_model


def test_full_cache_nll_matches_one_forward():
    model = tiny_model("llama")
    ids = prompt(1, 50)[0]
    nll = torch.cat(list(kvpress.stream(model, None, ids, chunk=16, progress=False)))
    logits = model(ids[None]).logits[0]
    expected = torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="none")
    assert nll.shape == (49,)
    assert (nll - expected).abs().max() < 1e-4


@pytest.mark.parametrize(
    "press", [SinkWindowPress(n_sink=4, window=12, rerotate=True), HeavyHitterPress(max_tokens=16, rerotate=True)]
)
def test_streams_10x_past_max_positions_with_a_fixed_cache(press):
    model = tiny_model("llama", max_position_embeddings=32)
    ids = prompt(1, 320, seed=5)[0]
    cache = DynamicCache(config=model.config)
    positions, sizes = [], []
    hook = model.model.register_forward_pre_hook(
        lambda m, a, kw: positions.append(int(kw["position_ids"].max())), with_kwargs=True
    )
    try:
        nll = []
        for piece in kvpress.stream(model, None, ids, press=press, chunk=8, cache=cache, progress=False):
            nll.append(piece)
            sizes.append(cache_bytes(cache))
    finally:
        hook.remove()
    nll = torch.cat(nll)
    assert nll.shape == (319,) and torch.isfinite(nll).all()
    assert max(positions) < 32
    warm = sizes[3:]  # once the cache is full it never grows
    assert max(warm) == min(warm)
    assert all(layer.n == 16 for layer in cache.layers)


def test_full_cache_refuses_a_stream_longer_than_the_positions():
    """A press that does not re-rotate streams past them with a warning (its keys ran at positions up to 39 of 32
    without a word: an audit found it; `make bench-stream` measures that run on purpose)."""
    import warnings

    model = tiny_model("llama", max_position_embeddings=32)
    with pytest.raises(ValueError, match="a full cache cannot stream 40 tokens: the model has 32 positions"):
        kvpress.stream(model, None, prompt(1, 40)[0], progress=False)
    with pytest.warns(UserWarning, match="SinkWindowPress without rerotate=True streams 40 tokens at their own "
                                         "positions, past the model's 32"):  # fmt: skip
        kvpress.stream(model, None, prompt(1, 40)[0], press=kvpress.SinkWindowPress(max_tokens=16), progress=False)
    press = kvpress.SinkWindowPress(max_tokens=16, rerotate=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(torch.cat(list(kvpress.stream(model, None, prompt(1, 40)[0], press=press, progress=False)))) == 39


def test_bad_arguments():
    """Refused when `stream` is called, before anything is iterated."""
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="chunk must be a positive integer"):
        kvpress.stream(model, None, prompt(1, 10)[0], chunk=0)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        kvpress.stream(model, None, torch.tensor([5]))
    vocab = model.config.vocab_size  # (raw torch errors at the first chunk before)
    with pytest.raises(ValueError, match="the stream's token ids must be integers, got torch.float32"):
        kvpress.stream(model, None, torch.tensor([5.0, 7.0, 9.0]))
    for ids in ([5, -1, 7], [5, 7, vocab]):
        with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {vocab}\) .* got {min(ids)} to {max(ids)}"):
            kvpress.stream(model, None, ids)
    for limit in (100.0, True, 1):
        with pytest.raises(ValueError, match=f"limit must be an integer of at least 2 tokens, got {limit!r}"):
            kvpress.stream(model, None, prompt(1, 10)[0], limit=limit)
    with pytest.raises(TypeError, match="press must be a kvpress press"):
        kvpress.stream(model, None, prompt(1, 10)[0], "sink-window")
    with pytest.raises(ValueError, match="KVzipPress compresses a whole prompt once"):
        kvpress.stream(model, None, prompt(1, 10)[0], kvpress.KVzipPress(compression_ratio=0.5))
    for other in (None, b"abc", ["a b", "c d"], iter([5, 7])):  # (torch's own errors before)
        with pytest.raises(TypeError, match=f"a text or its token ids .*, got {type(other).__name__}"):
            kvpress.stream(model, None, other)
    ids = prompt(1, 30)[0]  # int32 ids (numpy's default on some systems) streamed as int64 ones: torch's loss refused
    for narrow in (ids.int(), ids.int().numpy()):  # them after the first forward
        assert torch.equal(torch.cat(list(kvpress.stream(model, None, narrow, progress=False))),
                           torch.cat(list(kvpress.stream(model, None, ids, progress=False))))
    cache = DynamicCache(config=model.config)
    list(kvpress.stream(model, None, prompt(1, 10)[0], cache=cache, progress=False))
    with pytest.raises(ValueError, match="cache= already holds 10 tokens: a stream starts from an empty cache"):
        kvpress.stream(model, None, prompt(1, 10)[0], cache=cache, progress=False)


def test_a_setting_changed_while_the_stream_waits_is_checked_as_the_press_was_built():
    """The stream enters its installation again for each chunk; the press's checks ran once, when it was made, so a
    press changed between chunks ran unchecked (an audit: compression_ratio=1.5 kept 4 of 160 tokens, a window
    of -4 failed in torch). Each entry checks what moved, as `model.generate` under the press would."""
    model = tiny_model("llama", max_position_embeddings=64)
    ids = prompt(1, 64, seed=2)[0]
    for setting, value, refusal in (("window", -4, "window must be a positive integer, got -4"),
                                    ("compression_ratio", 1.5, r"compression_ratio must be in \[0, 1\)")):  # fmt: skip
        press = SinkWindowPress(n_sink=4, window=12) if setting == "window" else HeavyHitterPress(0.5)
        stream = kvpress.stream(model, None, ids, press=press, chunk=8, progress=False)
        next(stream)
        setattr(press, setting, value)
        with pytest.raises(ValueError, match=refusal):
            next(stream)
        assert model.config._attn_implementation == "sdpa"  # (refused before the press was installed)
    press = HeavyHitterPress(0.5)
    stream = kvpress.stream(model, None, ids, press=press, chunk=8, progress=False)
    next(stream)
    press.compression_ratio = 0.75  # (a value in range is taken, as between two runs)
    assert len(torch.cat([*stream])) == 56
