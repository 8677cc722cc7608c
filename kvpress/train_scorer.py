"""`kvpress train-scorer`: fit KVzapPress's per-layer linear scorers to KVzip's scores on offline text.

Method (KVzap, arXiv:2601.07891, with this project's KVzip): each training text is prefilled as a chat
context (the form `kvpress.generate` caches), the hidden state entering every layer's attention is recorded,
and KVzip's reconstruction pass scores every cached token per layer and KV head. A ridge regression per
layer and KV head maps the hidden state (with `--attention-mass`, also the log of the attention the token received
in the prefill and of how many queries saw it) to the log of the score; its penalty is chosen per layer on
validation texts, and the fit is reported on test texts nobody chose anything on: R^2 of the log score, Spearman's rank
correlation per (text, layer, KV head), and the share of KVzip's kept tokens the prediction keeps too. On the
first training texts it also measures the layer profile (`layer_profile`): how KVzip's ranking of all layers'
scores together spreads a budget across layers, per compression ratio, which a live prefill cannot rank
(each layer evicts before the next has scores).

Text: windows of the Markdown READMEs of lm-eval's task folders (English prose about benchmarks, installed
with lm-eval) and of the Python standard library's modules (code and docstrings), alternately. No task of
`kvpress.eval` uses either, so a sweep measures the scorer on text it never saw.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from pathlib import Path

import torch
from torch import nn

from kvpress import shipped
from kvpress.counts import check_whole, floor_share
from kvpress.patches import model_access
from kvpress.patterns import config_hash
from kvpress.pipeline import split_prompt
from kvpress.presses.base import Observation
from kvpress.presses.kvzap import MASS_BLOCK, MASS_FLOOR
from kvpress.presses.kvzip import REPEAT_PROMPT, reconstruction_scores
from kvpress.recording import record_prefill
from kvpress.scorers import Scorer
from kvpress.words import word_edges

PENALTIES = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)  # ridge penalties tried, relative to the mean variance of the inputs
PROFILE_RATIOS = (0.25, 0.5, 0.75, 0.9)  # compression ratios at which the layer profile is measured
PROFILE_TEXTS = 8  # the first training texts, on which the layer profile is measured
KEEP_RATIOS = (0.5, 0.75)  # compression ratios at which the kept-token agreement is reported
_FLOOR = 1e-8  # scores below it count as it (the log of an attention weight of 0)


def corpus() -> tuple[str, str]:
    """(prose, code): lm-eval's task READMEs and the standard library's top-level modules, each concatenated in
    sorted file order."""
    import lm_eval

    tasks = Path(lm_eval.__file__).parent / "tasks"
    prose = "\n\n".join(p.read_text(errors="replace") for p in sorted(tasks.glob("**/README.md")))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = "\n\n".join(p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py")))
    if len(prose) < 100_000 or len(code) < 100_000:
        raise RuntimeError(f"training text too short ({len(prose)} characters of prose, {len(code)} of code)")
    return prose, code


def corpus_sha256() -> str:
    """The SHA-256 of `corpus()`'s text (recorded with what is trained on it: the installed lm-eval and Python give
    it)."""
    prose, code = corpus()
    return hashlib.sha256((prose + "\0" + code).encode()).hexdigest()


def check_arguments(texts: int, held_out: int, tokens: int, **_) -> None:
    """`train_scorer`'s counts, refused by name (the command checks them before the model loads)."""
    check_whole(texts=(texts, 1), held_out=(held_out, 1), tokens=(tokens, 64))
    check_tokens(tokens)


def check_full_attention(model: nn.Module) -> None:
    """Refuse a model with sliding-window layers: KVzip's scores there are 0 for every token that left the window,
    so a fit would learn a token's age, not what its hidden state says."""
    if model_access.has_sliding_layers(model):
        kinds = sorted(set(model_access.layer_types(model)) - {"full_attention"})
        raise ValueError("train-scorer fits models whose layers all attend to the whole context; this "
                         f"{type(model).__name__} has sliding-window layers or others: {kinds}")  # fmt: skip


def check_tokens(tokens: int) -> None:
    """Refuse windows longer than the corpus can give: each is drawn from 8 x `tokens` characters of its source."""
    most = (min(len(source) for source in corpus()) - 1) // 8  # (a start is drawn below len - 8 x tokens)
    if tokens > most:
        raise ValueError(f"tokens must be at most {most} for this corpus (each window is drawn from 8 x tokens "
                         f"characters of its source), got {tokens}")  # fmt: skip


def training_texts(tokenizer, count: int, tokens: int, seed: int,
                   apart_from: int | None = None) -> list[str]:  # fmt: skip
    """`count` windows of about `tokens` tokens, prose and code alternately, at offsets drawn from `seed`. The
    windows from index `apart_from` on (the held-out ones) share no character of their source with a window drawn
    before them: a start that would is drawn again, so no held-out text was learned from (a draw with no overlap is
    what it was before)."""
    check_whole(count=(count, 0), tokens=(tokens, 1), seed=(seed, 0))  # (seed None drew other texts each time)
    check_tokens(tokens)
    rng = random.Random(seed)
    sources = corpus()
    texts, spans = [], []  # spans: (source, first character, end) of each window

    def window(source: str, start: int) -> tuple[list[int], int]:
        """The window's token ids and the character of `source` it ends at."""
        cut = tokenizer(source[start : start + 8 * tokens], add_special_tokens=False, return_offsets_mapping=True)
        return cut.input_ids[:tokens], start + cut.offset_mapping[: tokens][-1][1]

    for i in range(count):
        kind, source = i % 2, sources[i % 2]
        for _ in range(1000):
            start = rng.randrange(0, len(source) - 8 * tokens)
            ids, end = window(source, start)
            if apart_from is None or i < apart_from or all(k != kind or end <= a or b <= start for k, a, b in spans):
                break
        else:
            raise ValueError(f"{count} windows of {tokens} tokens cannot be drawn apart from each other: fewer texts")
        spans.append((kind, start, end))
        texts.append(tokenizer.decode(ids).strip())
    return texts


@torch.no_grad()
def scored_text(model: nn.Module, tokenizer, text: str, chunk: int = 2048, attention_mass: bool = False):
    """Per compressible layer, the hidden states `[n, d]` entering its attention, the log KVzip scores `[n, H]` of
    the tokens of `text` cached as a chat context, and their mass features `[n, H, k]`: with `attention_mass` (k = 2)
    the log of the attention each token received in the prefill (summed over queries and query heads, as
    `KVzapPress` accumulates it) and the log of how many queries saw it; none (k = 0) without."""
    ids, _ = split_prompt(tokenizer, text, "Question.")
    ids = ids.to(model.device)
    recording = record_prefill(model, ids, keep_hidden=True)
    mass = _prefill_mass(recording) if attention_mass else {}
    prompt = tokenizer(REPEAT_PROMPT, add_special_tokens=False, return_tensors="pt").input_ids.to(ids.device)
    scores = reconstruction_scores(model, recording.cache, ids, prompt, chunk)
    data = {}
    for idx in scores:
        x, y = recording.hidden[idx][0].float().cpu(), scores[idx][0].T.float().clamp_min(_FLOOR).log().cpu()
        data[idx] = (x, y, mass[idx] if attention_mass else torch.zeros(*y.shape, 0))
    return data


def _prefill_mass(recording) -> dict[int, torch.Tensor]:
    """Per layer of a recorded prefill of n tokens, `[n, H, 2]`: log attention mass received, log queries seen."""
    n = recording.tokens
    seen = torch.arange(n, 0, -1, dtype=torch.float32).log()[:, None].expand(n, -1)
    out = {}
    for idx, (module, query) in recording.queries.items():
        layer = recording.cache.layers[idx]
        if layer.window is not None:
            raise ValueError(f"layer {idx} attends over a sliding window: training with the attention mass needs "
                             "full-attention layers")  # fmt: skip
        mass = Observation(module, query, *layer.held_kv(), layer).attention_mass(MASS_BLOCK)[0].T.cpu()  # [n, H]
        out[idx] = torch.stack([mass.clamp_min(MASS_FLOOR).log(), seen.expand_as(mass)], dim=-1)
    return out


def layer_counts(data: dict, ratio: float) -> dict[int, float]:
    """Per layer of one text's `scored_text`, how many of its scores KVzip's global ranking keeps at `ratio` (the
    top-k of every layer's and head's scores together, k = the budget of every layer and head)."""
    n, heads = next(iter(data.values()))[1].shape
    flat = torch.cat([y.flatten() for _, y, _ in data.values()])
    k = min(flat.numel(), (n - floor_share(n, ratio)) * heads * len(data))
    threshold = flat.topk(k).values[-1]
    return {idx: float((y >= threshold).sum()) for idx, (_, y, _) in data.items()}


def layer_profile(texts_data: list[dict], layers: int) -> torch.Tensor:
    """`[R, L]` each layer's count over the average layer's (at least 1 token: KVzip's `max(c, 1)`), averaged over
    texts, at each of `PROFILE_RATIOS` (layers never scored: 1)."""
    profile = torch.ones(len(PROFILE_RATIOS), layers)
    for row, ratio in enumerate(PROFILE_RATIOS):
        shares = []
        for data in texts_data:
            counts = layer_counts(data, ratio)
            mean = sum(counts.values()) / len(counts)
            shares.append({idx: max(c, 1.0) / mean for idx, c in counts.items()})
        for idx in shares[0]:
            profile[row, idx] = sum(s[idx] for s in shares) / len(shares)
    return profile


def profile_scorer(model: nn.Module, tokenizer, scorer: Scorer, log=print) -> Scorer:
    """`scorer` with its layer profile measured again on the first `PROFILE_TEXTS` of its training texts (what
    `train_scorer` measures while it trains; `kvpress train-scorer --update-profile`)."""
    scorer.check(model)  # (a profile measured on another model's layers would be written as the scorer's)
    check_full_attention(model)
    t = scorer.training or {}
    missing = [key for key in ("texts", "held_out", "tokens", "seed") if key not in t]
    if missing:
        raise ValueError(f"scorer {scorer.model!r} does not record how it was trained ({', '.join(missing)} missing "
                         "from its training metadata): its texts cannot be drawn again; train it anew")  # fmt: skip
    here = corpus_sha256()  # (the corpus read once)
    if t.get("corpus_sha256", here) != here:  # (scorers trained before it was recorded: none)
        raise ValueError(f"scorer {scorer.model!r} was trained on another text than this machine's corpus (lm-eval's "
                         "task READMEs and the standard library differ): its training texts cannot be drawn again")
    texts = training_texts(tokenizer, t["texts"] + 2 * t["held_out"], t["tokens"], t["seed"], t["texts"])
    texts = texts[: min(PROFILE_TEXTS, t["texts"])]
    data = []
    for i, text in enumerate(texts):
        data.append(scored_text(model, tokenizer, text))
        log(f"  profile text {i + 1}/{len(texts)}")
    scorer.layer_profile = layer_profile(data, scorer.weight.shape[0])
    scorer.profile_ratios = torch.tensor(PROFILE_RATIOS)
    scorer.training = {**t, "profile_texts": len(texts)}
    scorer.__post_init__()
    return scorer


def _with_bias(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x.double(), torch.ones(x.shape[0], 1, dtype=torch.float64)], dim=1)


def _solve(gram: torch.Tensor, cross: torch.Tensor, penalty: float) -> torch.Tensor:
    """Ridge weights `[d + 1, H]` (the bias last, unpenalised) from X^T X and X^T Y."""
    d = gram.shape[0] - 1
    ridge = torch.zeros_like(gram)
    ridge[range(d), range(d)] = penalty * gram.diagonal()[:d].mean()
    return torch.linalg.solve(gram + ridge, cross)


def _spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rank correlation of the columns of `a` and `b` `[n, H]`, `[H]`."""
    ra, rb = (x.argsort(0).argsort(0).double() for x in (a, b))
    ra, rb = ra - ra.mean(0), rb - rb.mean(0)
    return (ra * rb).sum(0) / (ra.norm(dim=0) * rb.norm(dim=0)).clamp_min(1e-12)


def _kept_agreement(predicted: torch.Tensor, target: torch.Tensor, ratio: float) -> torch.Tensor:
    """`[H]` share of the tokens `target`'s top-k keeps (k = the budget at `ratio`) that `predicted`'s keeps too."""
    k = max(1, predicted.shape[0] - floor_share(predicted.shape[0], ratio))
    a = torch.zeros_like(predicted, dtype=torch.bool).scatter_(0, predicted.topk(k, dim=0).indices, True)
    b = torch.zeros_like(target, dtype=torch.bool).scatter_(0, target.topk(k, dim=0).indices, True)
    return (a & b).sum(0).double() / k


def train_scorer(
    model: nn.Module,
    tokenizer,
    name: str,
    texts: int = 48,
    held_out: int = 4,
    tokens: int = 1024,
    seed: int = 0,
    attention_mass: bool = False,
    log=print,
) -> Scorer:
    """Fit a `Scorer` for `model` on `texts` training windows, choose each layer's penalty on `held_out`
    validation windows and report on `held_out` test windows (`training` holds the settings and the fit). With
    `attention_mass` each KV head's model also reads the attention its token received in the prefill and how many
    queries saw it (`Scorer.mass_weight`)."""
    check_arguments(texts=texts, held_out=held_out, tokens=tokens)
    check_full_attention(model)
    windows = training_texts(tokenizer, texts + 2 * held_out, tokens, seed, apart_from=texts)
    train, val, test = windows[:texts], windows[texts : texts + held_out], windows[texts + held_out :]
    gram: dict[int, list] = {}
    cross: dict[int, list] = {}
    profiled = []
    for i, text in enumerate(train):
        data = scored_text(model, tokenizer, text, attention_mass=attention_mass)
        if i < PROFILE_TEXTS:
            profiled.append(data)
        for idx, (x, y, e) in data.items():
            for h in range(y.shape[1]):
                z = _inputs(x, e, h)
                gram.setdefault(idx, [0] * y.shape[1])[h] += z.T @ z
                cross.setdefault(idx, [0] * y.shape[1])[h] += z.T @ y[:, h : h + 1].double()
        log(f"  training text {i + 1}/{len(train)}")
    val_data = [scored_text(model, tokenizer, text, attention_mass=attention_mass) for text in val]
    weights, chosen = {}, {}
    for idx in gram:
        errors = {}
        for penalty in PENALTIES:
            w = _layer_solve(gram[idx], cross[idx], penalty)
            errors[penalty] = sum(float(((_predict(d[idx], w) - d[idx][1]) ** 2).mean()) for d in val_data)
        chosen[idx] = min(errors, key=errors.get)
        weights[idx] = _layer_solve(gram[idx], cross[idx], chosen[idx])
    layers, hidden, heads = shipped.architecture(model)
    weight = torch.zeros(layers, hidden, heads)
    bias = torch.full((layers, heads), 0.0)
    mass_weight = torch.zeros(layers, 2, heads) if attention_mass else None
    for idx, w in weights.items():
        weight[idx], bias[idx] = w[:hidden].float(), w[-1].float()
        if attention_mass:
            mass_weight[idx] = w[hidden:-1].float()
    fit = _report([scored_text(model, tokenizer, text, attention_mass=attention_mass) for text in test], weights)
    method = "ridge regression of log KVzip scores on the hidden states entering each layer's attention"
    flag = " --attention-mass" if attention_mass else ""
    training = {
        "method": method + (", the log attention mass received and the log queries seen" if attention_mass else ""),
        "texts": texts, "held_out": held_out, "tokens": tokens, "seed": seed, "attention_mass": attention_mass,
        "corpus_sha256": corpus_sha256(),
        "penalties": {str(k): v for k, v in chosen.items()}, "test": fit, "profile_texts": len(profiled),
        "command": f"kvpress train-scorer --model {name} --texts {texts} --held-out {held_out} --tokens {tokens} "
                   f"--seed {seed}{flag}",
    }  # fmt: skip
    profile = layer_profile(profiled, layers)
    edges = word_edges(tokenizer, model.get_input_embeddings().num_embeddings)
    return Scorer(name, config_hash(model), weight, bias, training, profile, torch.tensor(PROFILE_RATIOS), mass_weight,
                  edges)  # fmt: skip


def _inputs(x: torch.Tensor, extra: torch.Tensor, head: int) -> torch.Tensor:
    """`[n, d + k + 1]` what KV head `head`'s model reads: the hidden states, its mass features, 1 (the bias)."""
    return _with_bias(torch.cat([x, extra[:, head]], dim=1))


def _layer_solve(gram: list, cross: list, penalty: float) -> torch.Tensor:
    """`[d + k + 1, H]` one layer's ridge weights, a column per KV head."""
    return torch.cat([_solve(g, c, penalty) for g, c in zip(gram, cross, strict=True)], dim=1)


def _predict(data: tuple, w: torch.Tensor) -> torch.Tensor:
    """`[n, H]` predicted log scores of one layer's `(x, y, extra)`."""
    x, y, e = data
    return torch.stack([(_inputs(x, e, h) @ w[:, h]) for h in range(y.shape[1])], dim=1)


def _report(test_data: list[dict], weights: dict[int, torch.Tensor]) -> dict:
    """The fit on test texts: R^2 of the log scores (all layers), mean Spearman, kept-token agreement."""
    residual = total = 0.0
    spearman, agree = [], {r: [] for r in KEEP_RATIOS}
    for data in test_data:
        for idx, (x, y, e) in data.items():
            predicted = _predict((x, y, e), weights[idx]).float()
            residual += float(((predicted - y) ** 2).sum())
            total += float(((y - y.mean(0)) ** 2).sum())
            spearman.append(_spearman(predicted, y))
            for r in KEEP_RATIOS:
                agree[r].append(_kept_agreement(predicted, y, r))
    return {
        "r2_log_score": round(1 - residual / total, 4),
        "spearman": round(float(torch.cat(spearman).mean()), 4),
        **{f"kept_agreement_r{r}": round(float(torch.cat(agree[r]).mean()), 4) for r in KEEP_RATIOS},
    }
