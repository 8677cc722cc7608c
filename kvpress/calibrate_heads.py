"""`kvpress calibrate-heads`: rank (layer, KV head) pairs by how much they retrieve, for DuoAttention.

Method: synthetic passkey prompts (a repeated filler haystack with "The pass key is NNNNN" hidden at a
random depth, ending in "The pass key is"), fed with the true answer appended. For every query that
predicts an answer token, each head's attention mass on the key's digits in the needle is measured
(softmax over the whole context, averaged over the query heads of the KV group and over the answer
tokens), then averaged over the prompts. This is a soft form of the retrieval score of Wu et al. 2024
("Retrieval Head Mechanistically Explains Long-Context Factuality", arXiv:2404.15574: a head that
attends to the token being copied). Chosen over DuoAttention's gate optimisation because it needs no
gradient training (minutes on a CPU instead of hours on a GPU) and is deterministic for a seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from torch import nn

from kvpress.counts import check_whole
from kvpress.engine import Observation, observe
from kvpress.patches import model_access
from kvpress.patterns import config_hash

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
METHOD = "attention mass on the needle's digits from the queries that copy them (passkey prompts)"


def passkey_prompt(tokenizer, rng: random.Random, length: int) -> tuple[torch.Tensor, tuple[int, int], int]:
    """`(ids [1, n], (start, stop) of the key's tokens in the needle, number of answer tokens at the end)`."""
    key = str(rng.randint(10000, 99999))
    filler = tokenizer(FILLER, add_special_tokens=False).input_ids
    body = length - 40
    depth = int(rng.uniform(0.1, 0.9) * body)
    pieces = [
        filler * (depth // len(filler)) + filler[: depth % len(filler)],
        tokenizer(" The pass key is", add_special_tokens=False).input_ids,
        tokenizer(" " + key, add_special_tokens=False).input_ids,
        tokenizer(". Remember it. ", add_special_tokens=False).input_ids,
        filler * ((body - depth) // len(filler)),
        tokenizer("What is the pass key? The pass key is", add_special_tokens=False).input_ids,
        tokenizer(" " + key, add_special_tokens=False).input_ids,
    ]
    start = sum(len(p) for p in pieces[:2])
    ids = [i for p in pieces for i in p]
    return torch.tensor([ids]), (start, start + len(pieces[2])), len(pieces[-1])


@dataclass
class _Probe:
    """An observer (`kvpress.engine.observe`): each KV head's attention mass on a span of the context."""

    span: tuple[int, int] = (0, 0)
    answer: int = 1
    mass: dict[int, torch.Tensor] = field(default_factory=dict)

    def __call__(self, obs: Observation) -> None:
        stop = obs.q_len - 1  # queries from the last prompt token to the one before the last answer token
        probs = obs.attention_probs(stop - self.answer, stop)  # [B, Hkv, g, w, m]
        mass = probs[..., self.span[0] : self.span[1]].sum(-1).mean(dim=(0, 2, 3)).cpu()
        self.mass[obs.layer_idx] = self.mass.get(obs.layer_idx, 0) + mass


@torch.inference_mode()
def calibrate_heads(
    model: nn.Module, tokenizer, name: str, examples: int = 16, length: int = 1024, seed: int = 0, progress: bool = True
) -> dict:
    """A head pattern for `model` (see `kvpress.patterns`), from `examples` passkey prompts of `length` tokens."""
    check_whole(examples=(examples, 1), length=(length, 100), seed=(seed, 0))
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    probe = _Probe()
    correct = 0
    for _ in tqdm(range(examples), desc="calibrate-heads", disable=not progress):
        ids, probe.span, probe.answer = passkey_prompt(tokenizer, rng, length)
        ids = ids.to(model.device)
        with observe(model, probe):
            logits = model(ids, use_cache=True).logits
        predicted = logits[0, -probe.answer - 1 : -1].argmax(-1)
        correct += bool((predicted == ids[0, -probe.answer :]).all())
    layers, heads = model_access.text_config(model).num_hidden_layers, model_access.kv_heads(model)
    # layers the press leaves alone (chunked attention, ...) are never observed: score 0
    scores = [(probe.mass[i] / examples).tolist() if i in probe.mass else [0.0] * heads for i in range(layers)]
    return {
        "model": name,
        "config_hash": config_hash(model),
        "layers": layers,
        "kv_heads": heads,
        "method": METHOD,
        "examples": examples,
        "length": length,
        "seed": seed,
        "passkey_accuracy": correct / examples,
        "scores": [[round(s, 6) for s in row] for row in scores],
    }
