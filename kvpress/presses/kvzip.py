"""KVzip: score each cached token by how much the model needs it to repeat the context.

Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction"
(arXiv:2505.23416, NeurIPS 2025): once the context is cached, the model is fed a repeat request and
then the context itself (teacher-forced: one forward, no generation); a cached pair's importance is
the largest attention any query of that reconstruction pays it, over the query heads of its KV group.
Tokens the model can rebuild from their neighbours get little; a number or a name it must copy gets
a sharp peak. No question is needed, so the compressed cache serves any later one (the paper: 3-4x
smaller caches with negligible loss on SQuAD, NIAH, SCBench and GSM8K, Qwen2.5-7B and LLaMA3.1-8B).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from kvpress.engine import observe
from kvpress.patches import model_access
from kvpress.patches.cache import Scratch
from kvpress.patches.head_cache import HeadwiseLayer
from kvpress.presses.base import BasePress, Observation, scaled_to_peak
from kvpress.presses.prepared import PromptAttention, at_held_slots, check_prepared
from kvpress.shipped import architecture

REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n\n"


@dataclass
class KVzipPress(BasePress):
    """Keep the tokens the model attends to most while it repeats the context.

    Parameters:
        compression_ratio / max_tokens: the budget (see `BasePress`).
        prompt: the repeat request fed between the cached context and its copy (default `REPEAT_PROMPT`,
            "Repeat the previous context exactly." between blank lines).
        reconstruction_chunk: context tokens rebuilt per pass (default 2048; the paper's ~2K): each pass
            is dropped before the next, each layer dropping it right after its attention in the pass's last
            forward (`reconstruction_scores`), so scoring holds the cache plus at most one pass.
        n_sink: leading tokens always kept (default 0: the attention sink scores high anyway).
        window_size: last context tokens always kept (default 16; the paper keeps none).
        global_budget: the fraction g in [0, 1] of the budget spread across layers by ranking every
            layer's scores together (the paper ranks all layers at once: g = 1); layers whose pairs score
            higher keep more, the total stays the budget (each layer's share rounded down: up to one token a
            layer less). Each layer keeps at least (1 - g) of the even share (default 0.5; 0: every layer keeps
            the same number). A batch's rows share one split, their scores ranked together: a prompt repeated
            (beams, num_return_sequences) splits as it alone, rows of other prompts as their mean. On a model with
            sliding-window and full-attention layers only the latter share their budget this way: a sliding layer
            holds its window alone and keeps its even share of it (a larger share there would go unused, and the
            full-attention layers' shares, which multiply the whole context's budget, summed to up to twice it).
            Within a layer the budget is per head, or spread across heads with
            `AdaKVPress(KVzipPress(...))`.
        value_norm: weight each pair's score by the L2 norm of its value (default False), since what a
            pair adds to an attention output is its weight times its value (value-aware pruning, Guo et
            al. 2024, arXiv:2406.12335, weights by the L1 norm: no better on the tuning seeds). Layer
            budgets still rank the unweighted scores.
        normalize_layers: spread the layer budgets by each head's scores divided by that head's peak
            (default False: by the raw scores), as `AdaKVPress(normalize=True)` does across heads: a layer
            pays for the tokens near its heads' own peaks, so one whose heads look only at the attention
            sink keeps little more than its window (DuoAttention's streaming heads), whatever its scale.
            Needs global_budget > 0.

    Defaults chosen on tuning seed 1 (never on the reported seed 0; eval/results/notes/tuning.md):
    with g = 1 SmolLM2 kept every prose needle at r = 0.75 but lost the noise-haystack ones that g = 0
    kept, g = 0.5 kept most of both; a 16-token window kept the last problem of the arithmetic task
    (Qwen2.5-0.5B at r = 0.75: 0.29 -> 0.86 of the examples).

    The whole context must be cached before it is scored, so this press is applied right after the
    prefill: `kvpress.generate` and `kvpress sweep` do so through `kvpress.recording`, and inside
    `with press(model, tokenizer=tokenizer): model.generate(...)` the end of the prompt's forward triggers it
    (`PressInstallation`). A later forward of several tokens while it evicts (the next chunk of
    `prefill_chunk_size`, a new turn) is scored the same way, over the cache compressed so far
    (`prepare_chunk`): a pass rebuilds the tokens fed since the last scoring, the budget is taken of every token
    seen, so a chunked prefill holds at most the budget plus one chunk (and one pass while scoring); under AdaKV
    the pass reads the head-wise layers padded (`HeadwiseLayer.as_dense`) and each (row, KV head) keeps its own.
    Chunks see only what came before them: a cache prefilled in chunks differs from one scored whole.
    Cost: one more forward of the prompt and the context over the cached context: a pass (the request, 8 tokens of
    lead-in and `reconstruction_chunk` tokens, or the chunk fed) in one forward where that holds less (each layer
    then holds its pass only during its attention), else in pieces of 512 (`pass_pieces`), never longer than the
    forward that fed those tokens plus the request. Its full-attention layers compute their weights once, for
    their output and the scores (`PromptAttention.weights_block`). The prefill's own queries are not read
    (`reads_queries`), so a live prefill keeps none of them for it.
    """

    needs_whole_context: ClassVar[bool] = True
    scores_later_chunks: ClassVar[bool] = True
    needs_tokenizer: ClassVar[bool] = True
    needs_token_ids: ClassVar[bool] = True
    reads_queries: ClassVar[bool] = False  # its scores come from its pass

    prompt: str = REPEAT_PROMPT
    reconstruction_chunk: int = 2048
    n_sink: int = 0
    window_size: int = 16
    global_budget: float = 0.5
    value_norm: bool = False
    normalize_layers: bool = False
    scores: dict[int, torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)
    _shares: dict[int, float] | None = field(default=None, init=False, repr=False, compare=False)
    _lead: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)  # last ids scored
    _scored: weakref.ref | None = field(default=None, init=False, repr=False, compare=False)  # the cache they are of

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ValueError(f"prompt must be a non-empty repeat request, got {self.prompt!r}")
        chunk = self.reconstruction_chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"reconstruction_chunk must be a positive integer, got {self.reconstruction_chunk!r}")
        g = self.global_budget
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g <= 1:
            raise ValueError(f"global_budget must be a fraction in [0, 1], got {g!r}")
        if not isinstance(self.value_norm, bool):
            raise ValueError(f"value_norm must be true or false, got {self.value_norm!r}")
        if not isinstance(self.normalize_layers, bool):
            raise ValueError(f"normalize_layers must be true or false, got {self.normalize_layers!r}")
        if self.normalize_layers and not g:
            raise ValueError("normalize_layers spreads the budget across layers: it needs global_budget > 0")
        if g and self.layer_scales is not None:
            raise ValueError("KVzipPress sets layer budgets from its scores (global_budget > 0); pass global_budget=0 "
                             "to give layer_scales yourself")
        super().__post_init__()

    def prepare(self, model: nn.Module, recording, tokenizer=None) -> None:
        """Score the recorded context by reconstruction (once per recording, kept in `recording.memo`)."""
        key = ("kvzip", self.prompt, self.reconstruction_chunk)
        if key not in recording.memo:
            ids = recording.ids
            prompt = self._request(tokenizer, ids.device)
            recording.memo[key] = reconstruction_scores(model, recording.cache, ids, prompt, self.reconstruction_chunk)
        self.scores, self._lead = recording.memo[key], recording.ids[:, -LEAD_IN:].clone()  # (not the whole prompt's)
        self._scored = weakref.ref(recording.cache)
        self._shares = self._layer_shares(model, self.scores, recording.tokens) if self.global_budget else None

    def forget(self, cache=None) -> None:
        scored = None if self._scored is None else self._scored()
        if scored is None or scored is cache:  # (another live cache's, scored in another block since: kept for it)
            self.scores = self._lead = self._scored = self._shares = None

    def prepare_chunk(self, model: nn.Module, cache, ids: torch.Tensor, tokenizer=None) -> None:
        """Score a later chunk: `ids` `[B, m]`, the last tokens `cache` has seen, fed after the ones this press
        scored and compressed last (`prepare`, or the chunk before). One reconstruction pass rebuilds them over
        the compressed cache; a token held from before keeps the larger of its old score and the attention it
        gets now, a token no longer held scores 0; the layer budgets are spread again over every token seen."""
        if self.scores is None or self._lead is None or self._scored is None or self._scored() is not cache:
            raise ValueError(
                "KVzipPress scores a later chunk with the scores and last ids of the cache it scored before, and it "
                "has scored another since, or forgot them as that block ended (this press object on another model, "
                "in another thread, or in compress_recording): give each generation that feeds chunks a press of its "
                "own"
            )
        prompt = self._request(tokenizer, ids.device)
        peaks = reconstruction_scores(model, cache, ids, prompt, self.reconstruction_chunk, lead_in=self._lead)
        scores = {}
        for idx, peak in peaks.items():
            before = self.scores[idx].to(peak.dtype)
            if before.shape[-1] + ids.shape[1] != peak.shape[-1]:
                raise ValueError(f"KVzipPress scored {before.shape[-1]} tokens of this cache, and {ids.shape[1]} "
                                 f"follow them, but layer {idx} has seen {peak.shape[-1]}: the cache was cut back "
                                 "since it scored (assisted or prompt-lookup decoding crops rejected draft tokens), "
                                 "which a press scoring the whole context cannot follow: generate without an "
                                 "assistant or prompt lookup")  # fmt: skip
            peak[..., : before.shape[-1]] = torch.maximum(peak[..., : before.shape[-1]], before)
            scores[idx] = peak.masked_fill_(~_held(cache.layers[idx], peak), 0)
        self.scores, self._lead = scores, torch.cat([self._lead, ids], dim=-1)[:, -LEAD_IN:]
        self._shares = self._layer_shares(model, scores, peak.shape[-1]) if self.global_budget else None

    def _request(self, tokenizer, device: torch.device) -> torch.Tensor:
        """The repeat request's ids `[1, p]`, written with the model's tokenizer."""
        if tokenizer is None:
            raise ValueError("KVzipPress writes its repeat request with the model's tokenizer: pass tokenizer=")
        return tokenizer(self.prompt, add_special_tokens=False, return_tensors="pt").input_ids.to(device)

    def _layer_shares(self, model: nn.Module, scores: dict[int, torch.Tensor], n: int) -> dict[int, float]:
        """Each layer's budget relative to the average one: (1 - g) plus g times its share of the global top-k of
        the layers' scores (each head's divided by its peak first with `normalize_layers`); beside full-attention
        layers, a sliding-window layer is left out (its even share, of the window it holds)."""
        kinds = model_access.layer_types(model)
        if len(set(kinds)) > 1:  # (layers of one kind hold as much: every one shares)
            scores = {idx: s for idx, s in scores.items() if kinds[idx] == "full_attention"}
        if not scores:
            return {}
        if self.normalize_layers:
            scores = {idx: scaled_to_peak(s.float()) for idx, s in scores.items()}
        flat = torch.cat([s.flatten().float() for s in scores.values()])
        rows, heads = next(iter(scores.values())).shape[:2]  # (the rows of a batch are ranked together)
        k = min(flat.numel(), self.budget_of(n) * heads * len(scores) * rows)
        threshold = flat.topk(k).values[-1]
        counts = {idx: float((s.float() >= threshold).sum()) for idx, s in scores.items()}
        mean = sum(counts.values()) / len(counts)
        g = self.global_budget
        return {idx: (1 - g) + g * max(c, 1.0) / mean for idx, c in counts.items()}

    def layer_scale(self, layer_idx: int, n_layers: int) -> float:
        if self._shares is not None and layer_idx in self._shares:
            return self._shares[layer_idx]
        return super().layer_scale(layer_idx, n_layers)

    def score(self, obs: Observation) -> torch.Tensor:
        tokens = None if self.scores is None else self.scores[obs.layer_idx].shape[-1]
        check_prepared(self, tokens, obs, "a reconstruction pass", "kvpress.generate(..., press=...)", chunks=True)
        scores = at_held_slots(self.scores[obs.layer_idx], obs)
        return scores * obs.values.float().norm(dim=-1) if self.value_norm else scores


def _held(layer, like: torch.Tensor) -> torch.Tensor:
    """`[B, Hkv, seen]` bool shaped as `like`: the positions `layer` holds (each (row, KV head)'s own when the layer
    is head-wise)."""
    held = torch.zeros_like(like, dtype=torch.bool)
    if not isinstance(layer, HeadwiseLayer):
        return held.scatter_(-1, layer.pos.long(), True)
    for row in range(layer.batch):
        for head in range(layer.heads):
            held[row, head, layer.slot("pos", row, head).long()] = True
    return held


class _Released:
    """An observer: while a pass's last piece is fed (`scratch` set), each layer drops the pass right after its
    attention, since no later piece reads it; the cache then holds one layer's pass at a time, not every layer's."""

    scratch: Scratch | None = None

    def __call__(self, obs: Observation) -> None:
        if self.scratch is not None:
            self.scratch.release(obs.layer_idx)


PIECE = 512  # tokens a forward where a pass is fed in pieces (`pass_pieces`)


def pass_pieces(model: nn.Module) -> int | None:
    """Tokens a forward of a reconstruction pass: None (the pass in one forward) where a token's keys and values
    over every layer weigh at least its MLP activations (three vectors of the intermediate size), since each layer
    drops the pass right after its attention (SmolLM2-135M: 30 layers of 3 KV heads of 64 against 3 x 1,536);
    `PIECE` where a long forward's activations weigh more than what the pieces leave in every layer (Qwen2.5-0.5B:
    24 layers of 2 KV heads of 64 against 3 x 4,864)."""
    layers, _, kv_heads = architecture(model)
    kv = 2 * layers * kv_heads * model_access.head_dim(model)
    return None if kv >= 3 * getattr(model_access.text_config(model), "intermediate_size", 0) else PIECE


LEAD_IN = 8  # context tokens before a pass's chunk fed again after the request, so the model knows where to resume


@torch.no_grad()
def reconstruction_scores(
    model: nn.Module,
    cache,
    context_ids: torch.Tensor,
    prompt_ids: torch.Tensor,
    chunk_size: int = 2048,
    piece_size: int | str | None = "auto",
    lead_in: torch.Tensor | None = None,
    from_output: bool = True,
) -> dict[int, torch.Tensor]:
    """KVzip's importance of each cached context token, per compressible layer `[B, Hkv, n]`: the peak
    attention paid to it while the model rebuilds the context after the request `prompt_ids`. As in the
    paper's scoring of long contexts, each pass rebuilds `chunk_size` context tokens (the request, the
    `LEAD_IN` tokens before the chunk, the chunk), fed `piece_size` tokens a forward over the cached context (the
    shortest piece first; None: the pass in one forward; "auto", the default: whichever holds less on this model,
    `pass_pieces`), and is dropped before the next: in its last forward each layer drops it right after its
    attention. `cache` (holding exactly the context, nothing evicted) holds at most the context plus one pass (plus
    one layer's pass, fed in one forward), no copy of it, and is left as it was.

    `lead_in`: `context_ids` are the last tokens the cache has seen, after tokens it has compressed already, of
    which `lead_in` are the last ids (a later chunk of a chunked prefill); only `context_ids` are rebuilt, and
    the scores are per position of every token seen `[B, Hkv, seen]`, 0 where a layer no longer holds it.
    `from_output`: full-attention layers compute the pass's attention weights once, for their output and the scores
    (False: the scores compute them again, as sliding-window layers do; what `make bench` compares against)."""
    if piece_size not in (None, "auto") and (isinstance(piece_size, bool) or not isinstance(piece_size, int)
                                             or piece_size < 1):  # fmt: skip
        raise ValueError(f"piece_size must be a positive number of tokens, None (one forward) or 'auto', got "
                         f"{piece_size!r}")  # fmt: skip
    n = context_ids.shape[1]
    seen = n
    if lead_in is None:
        for idx, layer in enumerate(cache.layers):
            window = getattr(layer, "window", None)  # a sliding-window layer holds the last `window - 1` tokens
            held = n if window is None else min(n, window - 1)
            if getattr(layer, "n", held) != held or getattr(layer, "seen", n) != n or getattr(layer, "padded", False):
                padded = "; its rows are left-padded: give KVzip one prompt, or prompts of one length" if getattr(
                    layer, "padded", False) else ""  # fmt: skip
                raise ValueError(
                    f"reconstruction scores need the whole context cached ({n} tokens, no padding, nothing evicted); "
                    f"layer {idx} holds {getattr(layer, 'n', '?')} of {getattr(layer, 'seen', '?')} tokens{padded}"
                )
    else:
        seen = max(getattr(layer, "seen", 0) for layer in cache.layers)
        for idx, layer in enumerate(cache.layers):
            if getattr(layer, "seen", seen) != seen or getattr(layer, "padded", False) or seen < n:
                raise ValueError(
                    f"a later chunk's reconstruction scores need every layer to have seen the same tokens, the "
                    f"chunk's {n} last, and no padding; layer {idx} has seen {getattr(layer, 'seen', '?')}"
                )
    observer = PromptAttention(n_prompt=seen, by_position=lead_in is not None, from_output=from_output)
    prompt = prompt_ids.expand(context_ids.shape[0], -1)
    before = context_ids[:, :0] if lead_in is None else lead_in
    piece_size = pass_pieces(model) if piece_size == "auto" else piece_size
    released = _Released()
    with observe(model, observer, released):
        for start in range(0, n, chunk_size):
            lead = torch.cat([before, context_ids[:, max(0, start - LEAD_IN) : start]], dim=-1)
            lead = lead[:, max(0, lead.shape[1] - LEAD_IN) :]
            ids = torch.cat([prompt, lead, context_ids[:, start : start + chunk_size]], dim=-1)
            step = min(piece_size or ids.shape[1], ids.shape[1])
            ends = range(ids.shape[1] % step or step, ids.shape[1] + 1, step)  # the shortest piece first
            with Scratch(cache) as pass_:
                for begin, end in zip([0, *ends], ends, strict=False):
                    released.scratch = pass_ if end == ids.shape[1] else None
                    model(ids[:, begin:end], cache=cache, use_cache=True, logits_to_keep=1)
                released.scratch = None
    return observer.peaks
