"""`kvpress train-gates`: fit NAtSPress's per-layer role gates (NAtS, arXiv:2502.13251) with the model frozen.

Each training text is prefilled as a chat context (the form `kvpress.generate` caches) and every layer's
post-RoPE queries, keys, values and input hidden states are recorded. Then, layer by layer, a linear gate maps
each token's hidden state to its role probabilities per KV head (global: seen by every later query; local: seen
until the next global token; window: seen by the next `window` queries). A forward draws hard roles (Gumbel-max),
builds their attention mask and attends with it, and the gradient reaches the gate through the same mask built
from the probabilities (straight-through, as NAtS learns its mask). The loss keeps the layer's output: the
squared error of the masked attention after the layer's output projection, relative to the full attention's,
plus `sparsity` times the share of earlier tokens a query still sees (the cache held, averaged over steps).
Layers are trained on their own recorded inputs (a layer-wise distillation: minutes on two CPU cores, where the
paper fine-tunes end to end); the report is on test texts nobody chose anything on, against the same number of
roles given to the tokens at random (shuffled), which says what the gates learned beyond how many they keep.

Text: `kvpress.train_scorer.training_texts` (lm-eval's task READMEs and the standard library's modules): no task
of `kvpress.eval` uses either.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvpress import shipped
from kvpress.counts import check_whole
from kvpress.gates import ROLES, Gates
from kvpress.patches import model_access
from kvpress.patterns import config_hash
from kvpress.pipeline import split_prompt
from kvpress.recording import record_prefill
from kvpress.train_scorer import check_tokens, corpus_sha256, training_texts


@torch.no_grad()
def recorded_layers(model: nn.Module, tokenizer, text: str) -> dict[int, tuple[torch.Tensor, ...]]:
    """Per compressible layer, `(query [Hq, n, D], keys [Hkv, n, D], values [Hkv, n, Dv], hidden [n, d])` (fp32)
    of `text` prefilled as a chat context."""
    ids, _ = split_prompt(tokenizer, text, "Question.")
    recording = record_prefill(model, ids.to(model.device), keep_hidden=True)
    out = {}
    for idx, (_, query) in recording.queries.items():
        keys, values = recording.cache.layers[idx].held_kv()
        out[idx] = tuple(t[0].float().cpu() for t in (query, keys, values, recording.hidden[idx]))
    return out


def role_mask(roles: torch.Tensor, window: int, closers: torch.Tensor | None = None) -> torch.Tensor:
    """`[H, n, n]` how much query i sees token j under `roles` `[H, n, 3]` (probabilities, or one-hot hard roles):
    p_global(j) + p_local(j) x P(no global token in (j, i]) + p_window(j) x [i - j < window]; 1 on the diagonal,
    0 above it. `closers` `[H, n]`: the global probabilities that close local tokens, when not `roles`' own."""
    n = roles.shape[1]
    p_global, p_local, p_window = roles.unbind(-1)
    closers = p_global if closers is None else closers
    certain = closers >= 1  # hard global roles close exactly (a log of 0 would not)
    closed = torch.log1p(-closers.masked_fill(certain, 0)).cumsum(-1)  # [H, n]
    closings = certain.long().cumsum(-1)
    causal = torch.ones(n, n, dtype=torch.bool, device=roles.device).tril()
    open_since = (closed[:, :, None] - closed[:, None, :]).masked_fill(~causal, 0).clamp(max=0).exp()
    open_since = open_since * (closings[:, :, None] == closings[:, None, :])
    i = torch.arange(n, device=roles.device)
    recent = ((i[:, None] - i[None, :]) < window) & causal
    mask = p_global[:, None] + p_local[:, None] * open_since + p_window[:, None] * recent
    return torch.where(i[:, None] == i[None, :], torch.ones_like(mask), mask).masked_fill(~causal, 0)


class RecordedLayer:
    """One layer's recorded texts (`recorded_layers`' tuples) and what training reads of its attention: the output
    projection `[d, Hq x Dv]`, the logit scale and soft cap (`from_module` reads them from the attention module)."""

    def __init__(self, texts: list[tuple[torch.Tensor, ...]], out_proj: torch.Tensor, scale: float,
                 softcap: float | None = None) -> None:  # fmt: skip
        with torch.inference_mode(False):  # tensors made in a caller's inference mode cannot be saved for backward
            self.out_proj = out_proj.detach().float().cpu().clone()
            self.logits, self.targets, self.values, self.hidden = [], [], [], []
            for text in texts:
                self._add(*(t.clone() for t in text), scale, softcap)

    def _add(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor, scale: float,
             softcap: float | None) -> None:  # fmt: skip
        hkv, n = keys.shape[0], keys.shape[1]
        logits = (query.view(hkv, -1, n, query.shape[-1]) * scale) @ keys.transpose(-1, -2)[:, None]
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        logits = logits.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
        logits = logits - logits.amax(-1, keepdim=True)
        self.logits.append(logits)  # [Hkv, g, n, n]
        self.values.append(values)
        self.hidden.append(hidden)
        self.targets.append(self.output(logits.softmax(-1), values))

    @classmethod
    def from_module(cls, module: nn.Module, texts: list[tuple[torch.Tensor, ...]]) -> RecordedLayer:
        out_proj = model_access.output_projection(module)[0]
        return cls(texts, out_proj, model_access.attention_scaling(module), model_access.logit_softcap(module))

    def output(self, probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """`[n, d]` the attention's contribution to the residual stream, from its weights `[Hkv, g, n, n]`."""
        heads = probs @ values[:, None]  # [Hkv, g, n, Dv]
        return heads.permute(2, 0, 1, 3).reshape(heads.shape[2], -1) @ self.out_proj.T

    def error(self, t: int, mask: torch.Tensor) -> torch.Tensor:
        """Relative squared error of text `t`'s output under `mask` `[Hkv, n, n]`."""
        weights = self.logits[t].exp() * mask[:, None]
        out = self.output(weights / weights.sum(-1, keepdim=True), self.values[t])
        target = self.targets[t]
        return ((out - target) ** 2).sum() / (target**2).sum()


def held_share(mask: torch.Tensor) -> torch.Tensor:
    """The share of the earlier tokens a query sees under `mask` `[H, n, n]`, averaged over queries and heads: the
    cache a decoder holding what the mask shows keeps, averaged over its steps."""
    return (mask.sum(-1) / torch.arange(1, mask.shape[-1] + 1, device=mask.device)).mean()


def _hard(logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One-hot roles `[H, n, 3]` from role logits `[n, H, 3]`: Gumbel-max draws, or the argmax without a generator."""
    if generator is not None:
        noise = torch.rand(logits.shape, generator=generator).clamp_min(1e-12)
        logits = logits - torch.log(-torch.log(noise))
    return nn.functional.one_hot(logits.argmax(-1), len(ROLES)).float().transpose(0, 1)


def train_layer(layer: RecordedLayer, train: range, window: int, sparsity: float, epochs: int, lr: float,
                seed: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Gate weights `[d, H, 3]` and bias `[H, 3]` for `layer`, on its texts `train`."""
    with torch.inference_mode(False), torch.enable_grad():  # a caller's inference mode would refuse the backward
        return _train_layer(layer, train, window, sparsity, epochs, lr, seed)


def _train_layer(layer: RecordedLayer, train: range, window: int, sparsity: float, epochs: int, lr: float,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    hidden = torch.cat([layer.hidden[t] for t in train])
    mean, std = hidden.mean(0), hidden.std(0).clamp_min(1e-4)
    d, heads = hidden.shape[1], layer.logits[0].shape[0]
    weight = torch.zeros(d, heads * len(ROLES), requires_grad=True)
    bias = torch.tensor([[2.0, 0.0, 0.0]] * heads, requires_grad=True)  # start global: the full attention
    optimizer = torch.optim.Adam([weight, bias], lr=lr)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for t in train:
            logits = (((layer.hidden[t] - mean) / std) @ weight).view(-1, heads, len(ROLES)) + bias
            probs = logits.softmax(-1).transpose(0, 1)
            hard = role_mask(_hard(logits.detach(), generator), window)
            soft = role_mask(probs, window)
            error = layer.error(t, hard + soft - soft.detach())
            # the cache held charges a global token for what it keeps, without crediting it with the local tokens
            # it closes (a choice, not measured against the alternative; the shipped gates were trained so)
            kept = role_mask(probs, window, closers=probs[..., 0].detach())
            optimizer.zero_grad()
            (error + sparsity * held_share(hard + kept - kept.detach())).backward()
            # a hard draw that hides the tokens a query attends to leaves it a tiny normaliser, and the gradient
            # through it explodes (then Adam's second moment stalls every later step and no token leaves the
            # global role): clip
            nn.utils.clip_grad_norm_([weight, bias], 1.0)
            optimizer.step()
    with torch.no_grad():  # the standardisation folded into the gate: it reads raw hidden states
        folded = weight / std[:, None]
        return folded.view(d, heads, len(ROLES)), bias - (mean @ folded).view(heads, len(ROLES))


@torch.no_grad()
def evaluate_layer(layer: RecordedLayer, texts: range, weight: torch.Tensor, bias: torch.Tensor, window: int,
                   seed: int) -> dict[str, float]:  # fmt: skip
    """On `texts`: the error and held share with the gates' argmax roles, and the error with the same roles
    shuffled across each text's tokens."""
    generator = torch.Generator().manual_seed(seed)
    error = shuffled = held = 0.0
    for t in texts:
        hidden = layer.hidden[t]
        hard = _hard((hidden @ weight.flatten(1)).view(hidden.shape[0], *bias.shape) + bias, None)
        mask = role_mask(hard, window)
        order = torch.randperm(hidden.shape[0], generator=generator)
        error, held = error + float(layer.error(t, mask)), held + float(held_share(mask))
        shuffled += float(layer.error(t, role_mask(hard[:, order], window)))
    return {"error": error / len(texts), "shuffled_error": shuffled / len(texts), "held": held / len(texts)}


def check_arguments(texts: int, held_out: int, tokens: int, window: int, epochs: int, sparsity: float, lr: float,
                    **_) -> None:  # fmt: skip
    """`train_gates`'s settings, refused by name (the command checks them before the model loads)."""
    check_whole(texts=(texts, 1), held_out=(held_out, 1), tokens=(tokens, 64), window=(window, 1), epochs=(epochs, 1))
    check_tokens(tokens)
    for name, value, allowed in (("sparsity", sparsity, "a finite number >= 0"), ("lr", lr, "a finite number > 0")):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
                or (name == "lr" and value == 0):  # fmt: skip
            raise ValueError(f"{name} must be {allowed}, got {value!r}")


def train_gates(
    model: nn.Module,
    tokenizer,
    name: str,
    texts: int = 16,
    held_out: int = 4,
    tokens: int = 512,
    window: int = 32,
    sparsity: float = 0.1,
    epochs: int = 8,
    lr: float = 0.05,
    seed: int = 0,
    log=print,
) -> Gates:
    """Train `Gates` for `model` on `texts` windows of `tokens` tokens and report them on `held_out` others
    (`training` holds the settings and the test fit, per layer and overall)."""
    check_arguments(texts=texts, held_out=held_out, tokens=tokens, window=window, epochs=epochs, sparsity=sparsity,
                    lr=lr)  # fmt: skip
    if model_access.has_sliding_layers(model):
        raise ValueError("train-gates trains on models whose layers all attend to the whole context; this one has "
                         "sliding-window layers")  # fmt: skip
    windows = training_texts(tokenizer, texts + held_out, tokens, seed, apart_from=texts)
    recorded = []
    for i, text in enumerate(windows):
        recorded.append(recorded_layers(model, tokenizer, text))
        log(f"  recorded text {i + 1}/{len(windows)}")
    layers, hidden, heads = shipped.architecture(model)
    weight = torch.zeros(layers, hidden, heads, len(ROLES))
    bias = torch.zeros(layers, heads, len(ROLES))
    bias[..., 0] = 1.0  # a layer that is never compressed: every token global
    fit = {}
    modules = model_access.attention_modules(model)
    for idx in list(recorded[0]):
        layer = RecordedLayer.from_module(modules[idx], [r.pop(idx) for r in recorded])  # freed layer by layer
        weight[idx], bias[idx] = train_layer(layer, range(texts), window, sparsity, epochs, lr, seed + idx)
        fit[idx] = evaluate_layer(layer, range(texts, texts + held_out), weight[idx], bias[idx], window, seed + idx)
        log(f"  layer {idx}: test error {fit[idx]['error']:.4f} (roles shuffled: {fit[idx]['shuffled_error']:.4f}),"
            f" cache held {fit[idx]['held']:.3f}")  # fmt: skip
    summary = {key: round(sum(f[key] for f in fit.values()) / len(fit), 4) for key in next(iter(fit.values()))}
    training = {
        "method": "layer-wise distillation of each attention output with straight-through hard role masks",
        "texts": texts, "held_out": held_out, "tokens": tokens, "window": window, "sparsity": sparsity,
        "epochs": epochs, "lr": lr, "seed": seed, "corpus_sha256": corpus_sha256(), "test": summary,
        "test_layers": {str(k): {key: round(v, 4) for key, v in f.items()} for k, f in fit.items()},
        "command": f"kvpress train-gates --model {name} --texts {texts} --held-out {held_out} --tokens {tokens} "
                   f"--window {window} --sparsity {sparsity} --epochs {epochs} --lr {lr} --seed {seed}",
    }  # fmt: skip
    return Gates(name, config_hash(model), weight, bias, window, training)
