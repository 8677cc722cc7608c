"""Tiny randomly initialised models of each tested family, built in-process (no download)."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# Llama 3.x's rope scaling (frequencies below the original context stretched by `factor`)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}  # fmt: skip

CONFIGS = {
    "llama": lambda **kw: LlamaConfig(**{**COMMON, **kw}),
    "llama3": lambda **kw: LlamaConfig(**{**COMMON, "rope_parameters": LLAMA3_ROPE, **kw}),
    "qwen2": lambda **kw: Qwen2Config(**{**COMMON, **kw}),
    "qwen3": lambda **kw: Qwen3Config(**{**COMMON, "head_dim": 16, **kw}),  # QK norm
    "mistral": lambda **kw: MistralConfig(**{**COMMON, "sliding_window": None, **kw}),
    # Mistral-7B-v0.1's form: every layer a sliding-window layer (window 16 here: tiny prompts run past it)
    "mistral-window": lambda **kw: MistralConfig(**{**COMMON, "sliding_window": 16, **kw}),
    "phi3": lambda **kw: Phi3Config(**{**COMMON, **kw}),
    "gemma3": lambda **kw: Gemma3TextConfig(
        **{
            **COMMON,
            "num_hidden_layers": 3,
            "head_dim": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            **kw,
        }
    ),
}


# a short document and a question about it, for tests that tokenize real text (the `tokenized` fixture)
CONTEXT = "Ada keeps her bicycle in the blue shed. The code of its lock is 48213. Tomorrow it will rain again."
QUESTION = "What is the code of the lock?"

_MODELS: dict[str, torch.nn.Module] = {}


def quoref_stand_in(k: int = 30) -> list[dict]:
    """Items in the form of the qa_quoref task's data (`quoref_items`), made up: its real data is fetched."""
    words = "the river ran past the old mill where people met every market day".split()
    rng = random.Random(0)
    return [{"passage": f"Passage {i}: " + " ".join(rng.choice(words) for _ in range(60)) + f" Name{i} lived here.",
             "question": f"Who lived by passage {i}?", "answers": [f"Name{i}"]} for i in range(k)]  # fmt: skip


SLIDING = ("gemma3", "mistral-window")  # the families with sliding-window layers


def refused_on_sliding(name: str) -> str | None:
    """Why the press named `name` (a registry name or spec) is refused on a model with sliding-window layers, or
    None: re-rotated keys, and PyramidKV's shares (tests/test_layer_budgets.py)."""
    if "rerotate" in name:
        return "rerotate is refused on models with sliding-window layers"
    if name.split(":")[0] == "pyramidkv":
        return "PyramidKV is refused on models with sliding-window layers (tests/test_layer_budgets.py)"
    return None


def tiny_model(family: str = "llama", attn: str = "sdpa", **overrides) -> torch.nn.Module:
    """A tiny random model (cached per arguments: tests must leave it as they found it)."""
    key = repr((family, attn, sorted(overrides.items())))
    if key not in _MODELS:
        torch.manual_seed(0)
        config = CONFIGS[family](**overrides)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
        _MODELS[key] = model.eval()
    return _MODELS[key]


def greedy_scores(model, ids: torch.Tensor, press, new: int = 20, mask: torch.Tensor | None = None,
                  chunk: int | None = None) -> tuple[torch.Tensor, DynamicCache]:  # fmt: skip
    """The logits of `new` greedy steps of `model.generate` inside `press` (`[new, B, vocab]`) and its cache
    (`chunk`: `prefill_chunk_size`)."""
    cache = DynamicCache(config=model.config)
    with press(model):
        out = model.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask, cache=cache,
                             max_new_tokens=new, min_new_tokens=new, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0, prefill_chunk_size=chunk)  # fmt: skip
    return torch.stack(out.scores), cache


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` of token ids (1D, of any lengths) as one left-padded batch: `(ids, attention_mask)`, padding id 0."""
    length = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, length - len(r) :] = r
        mask[i, length - len(r) :] = 1
    return ids, mask


def prompt(batch: int = 1, length: int = 48, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=g)


def live_presses(**settings) -> dict:
    """Every press in the registry that evicts per token inside a forward (not per head, not by a pass over
    the whole context), by CLI name, as `budget -> press`; `settings` (for example `window_size=4`) apply to
    the presses that take that parameter (those whose default is not None)."""
    from kvpress.presses import press_from_name, press_names, press_parameters

    out = {}
    for name in press_names():
        probe = press_from_name(name, compression_ratio=0.5)
        if probe.per_head or probe.needs_whole_context:
            continue
        params = press_parameters(name)
        own = {k: v for k, v in settings.items() if params.get(k, None) is not None}
        out[name] = lambda name=name, own=own, **budget: press_from_name(name, **own, **budget)
    return out


def attention_inputs(model: torch.nn.Module, ids: torch.Tensor) -> dict:
    """The hidden states entering each attention module, `{layer: [B, n, d]}`, from plain forward hooks."""
    from kvpress.patches import model_access

    seen, handles = {}, []
    for idx, module in model_access.attention_modules(model).items():
        hook = lambda m, args, kwargs, idx=idx: seen.__setitem__(idx, kwargs["hidden_states"])  # noqa: E731
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        model(ids)
    finally:
        for h in handles:
            h.remove()
    return seen


def join_low_ids(scorer, model: torch.nn.Module):
    """`scorer` with a word table that joins every token id below 64 to an id below 64 before it (whole words)."""
    scorer.word_edges = torch.zeros(model.get_input_embeddings().num_embeddings, 2, dtype=torch.uint8)
    scorer.word_edges[:64] = 1
    return scorer


def tiny_pattern(model: torch.nn.Module, seed: int = 0) -> dict:
    """A random DuoAttention head pattern for `model`'s architecture."""
    from kvpress.patterns import config_hash

    config = model.config.get_text_config(decoder=True)
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(config.num_hidden_layers, config.num_key_value_heads, generator=generator)
    return {"model": "tiny", "config_hash": config_hash(model), "scores": scores.tolist()}


def tiny_gates(model: torch.nn.Module, seed: int = 0, window: int = 4):
    """Random NAtS gates trained on nothing, for `model`'s architecture."""
    from kvpress.gates import Gates
    from kvpress.patterns import config_hash
    from kvpress.shipped import architecture

    g = torch.Generator().manual_seed(seed)
    shape = (*architecture(model), 3)
    weight, bias = torch.randn(shape, generator=g), torch.zeros(shape[0], shape[2], 3)
    return Gates("tiny", config_hash(model), weight, bias, window)


def tiny_scorer(model: torch.nn.Module, seed: int = 0):
    """A random linear KVzap scorer fitted to nothing, for `model`'s architecture."""
    from kvpress.patterns import config_hash
    from kvpress.scorers import Scorer
    from kvpress.shipped import architecture

    g = torch.Generator().manual_seed(seed)
    shape = architecture(model)
    weight, bias = torch.randn(shape, generator=g) * 0.3, torch.zeros(shape[0], shape[2])
    profile = torch.ones(2, shape[0])  # every layer the same share: layer budgets stay even
    return Scorer("tiny", config_hash(model), weight, bias, {}, profile, torch.tensor([0.5, 0.75]))


VARLEN_CALLS: list[dict] = []  # what the variable-length stand-in was given, call by call


def flash_varlen_stand_in(query, keys, values, cu_q, cu_k, max_q, max_k, causal, scale, used_k):
    """FlashAttention-2's variable-length semantics, sequence by sequence through sdpa (its kernel needs CUDA):
    sequence i is queries cu_q[i]:cu_q[i + 1] over the first used_k[i] keys from cu_k[i], query head j on KV head
    j // (Hq / Hk), causal aligned bottom-right. It checks the kernel's contract on what it is handed."""
    for t in (cu_q, cu_k, used_k):
        assert t.dtype == torch.int32 and t.dim() == 1
    assert cu_q.numel() == cu_k.numel() == used_k.numel() + 1 and int(cu_k[-1]) == keys.shape[0]
    assert bool((used_k <= cu_k[1:] - cu_k[:-1]).all())  # within its own segment
    assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int(used_k.max())
    assert query.shape[1] % keys.shape[1] == 0 and keys.shape == values.shape
    VARLEN_CALLS.append({"sequences": used_k.numel(), "causal": causal})
    out = torch.empty_like(query)
    g = query.shape[1] // keys.shape[1]
    for i in range(used_k.numel()):
        q0, q1, k0, n = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(used_k[i])
        k, v = (t[k0 : k0 + n].transpose(0, 1).repeat_interleave(g, 0) for t in (keys, values))
        mask = torch.arange(n)[None] <= torch.arange(q1 - q0)[:, None] + n - (q1 - q0) if causal else None
        out[q0:q1] = F.scaled_dot_product_attention(query[q0:q1].transpose(0, 1), k, v, attn_mask=mask,
                                                    scale=scale).transpose(0, 1)  # fmt: skip
    return out
