"""`KVPressLM`: lm-eval's `HFLM` with a press, so any lm-eval task measures quality under compression.

    lm_eval.simple_evaluate(model=KVPressLM(press="snapkv", compression_ratio=0.5), tasks=[...])
    kvpress lm-eval --model_args pretrained=default,press=snapkv,compression_ratio=0.5 --tasks kvpress_ruler

Loglikelihood requests: the context (minus its last token) is prefilled with the press installed, so
it is compressed; then the last context token and the continuation are fed frozen and every
continuation token is scored against the compressed cache (no mask simulation). Requests that share a
context share its prefill (the compressed cache is copied per continuation). generate_until: the
prompt is compressed at prefill and decoding continues with the press's decode-time eviction.
loglikelihood_rolling (perplexity tasks): the whole document goes through one cache in chunks of
`rolling_chunk` tokens with the press installed (StreamingLLM's evaluation, `tasks/perplexity.py`), so
every token is predicted from the compressed past, not from HFLM's full-cache windows; documents
longer than `max_length` are not cut into windows: the press bounds the cache, and a document past the
model's positions is refused unless the press re-rotates (`rerotate=True`).

Every request records the KV bytes it held (summed over the cache's tensors) next to what a full
cache would hold; `kv_summary()` (also in lm-eval's results under `config.kvpress`) gives their
means, the peak resident memory of the process and, on a GPU, the peak allocated CUDA memory.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm.auto import tqdm
from transformers import DynamicCache

import kvpress
from kvpress.eval.memory import full_cache_bytes, peak_memory
from kvpress.eval.tasks.perplexity import CHUNK, chunked_nll
from kvpress.models import resolve_model_path
from kvpress.patches.model_access import cache_keyword
from kvpress.presses import PRESSES, BasePress, press_from_name


def _press_parameters() -> set[str]:
    """Every keyword some press takes (the model_args that belong to the press, not to HFLM)."""
    names = {"inner", "alpha_safeguard"}
    for factory in PRESSES.values():
        if dataclasses.is_dataclass(factory):
            names |= {f.name for f in dataclasses.fields(factory)}
    return names - {"press"}


@register_model("kvpress")
class KVPressLM(HFLM):
    """`HFLM` whose KV cache a press compresses.

    Parameters (besides HFLM's, e.g. `batch_size`, `max_length`):
        pretrained: "default" (SmolLM2-135M, offline), a packaged model name, a local directory, or a
            loaded model (then pass `tokenizer=` too).
        press: a press name (`kvpress.PRESSES`), a press object, or None / "none" (plain HFLM).
        compression_ratio, max_tokens, and any press parameter (`window_size`, `n_sink`, ...): the press's.
        rolling_chunk: tokens fed per forward in loglikelihood_rolling (default 128).
    """

    def __init__(
        self,
        pretrained="default",
        press: str | BasePress | None = None,
        compression_ratio: float | None = None,
        max_tokens: int | None = None,
        rolling_chunk: int = CHUNK,
        **kwargs,
    ) -> None:
        rolling_chunk = int(rolling_chunk)
        if rolling_chunk < 1:
            raise ValueError(f"rolling_chunk must be a positive number of tokens, got {rolling_chunk}")
        self.rolling_chunk = rolling_chunk
        params = _press_parameters()
        press_kwargs = {key: kwargs.pop(key) for key in list(kwargs) if key in params}
        if isinstance(press, BasePress):
            if compression_ratio is not None or max_tokens is not None or press_kwargs:
                raise ValueError("pass press parameters either in the press object or as arguments, not both")
            self.press = press
        elif press is None or press == "none":
            if compression_ratio is not None or max_tokens is not None or press_kwargs:
                raise ValueError(f"press parameters given without a press: {compression_ratio=}, {max_tokens=}, "
                                 f"{press_kwargs}")  # fmt: skip
            self.press = None
        else:
            budget = {"compression_ratio": compression_ratio, "max_tokens": max_tokens}
            self.press = press_from_name(press, **budget, **press_kwargs)
        if isinstance(pretrained, str):  # a local directory: HFLM loads it (and shards data under accelerate)
            pretrained = str(resolve_model_path(None if pretrained == "default" else pretrained))
            kwargs.setdefault("dtype", "float32")
            kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
        cpu_processes = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
        if cpu_processes:  # torchrun --nproc_per_node N on CPUs: accelerate must join them over gloo
            os.environ["ACCELERATE_USE_CPU"] = "true"
        super().__init__(pretrained=pretrained, **kwargs)
        self.kv_records: list[dict] = []
        if cpu_processes and self._world_size == 1:  # HFLM shards data only across GPUs: shard it here
            from accelerate import Accelerator

            self.accelerator = Accelerator(cpu=True)
            self._rank, self._world_size = self.accelerator.process_index, self.accelerator.num_processes

    # ----- loglikelihood: the context compressed, the continuation scored against it ------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        if self.press is None:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        groups: dict[tuple[int, ...], list[int]] = {}
        tokens = []
        for i, (_, context, continuation) in enumerate(requests):
            if not context or not continuation:
                raise ValueError("loglikelihood requests need a non-empty context and continuation")
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens exceeds max_length={self.max_length}")
            full = (context + continuation)[-(self.max_length + 1) :]
            split = len(full) - len(continuation) - 1  # the compressed part: context minus its last token
            tokens.append((full, split))
            groups.setdefault(tuple(full[:split]), []).append(i)
        results: list = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="kvpress loglikelihood")
        for prefix, members in groups.items():
            cache = self._prefill(list(prefix))
            for j, i in enumerate(members):
                full, split = tokens[i]
                working = cache if j == len(members) - 1 else copy.deepcopy(cache)
                results[i] = self._score(working, full[split:], len(requests[i][2]))
                self._record(working, len(full) - 1)
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
                bar.update(1)
        bar.close()
        return results

    @torch.inference_mode()
    def _prefill(self, prefix: list[int]) -> DynamicCache:
        cache = DynamicCache(config=self.model.config)
        if prefix:
            with self.press(self.model):
                self.model(torch.tensor([prefix], device=self.device), cache=cache, use_cache=True)
        return cache

    @torch.inference_mode()
    def _score(self, cache: DynamicCache, fed: list[int], n_cont: int) -> tuple[float, bool]:
        with self.press(self.model) as installed, installed.frozen():
            logits = self.model(torch.tensor([fed[:-1]], device=self.device), cache=cache, use_cache=True).logits
        logprobs = F.log_softmax(logits[0, -n_cont:].float(), dim=-1)
        target = torch.tensor(fed[-n_cont:], device=logprobs.device)
        return float(logprobs.gather(-1, target[:, None]).sum()), bool((logprobs.argmax(-1) == target).all())

    # ----- loglikelihood_rolling: the document read in chunks through one compressed cache ----------------
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        if self.press is None:
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
        results = []
        for request in tqdm(requests, disable=disable_tqdm or self.rank != 0, desc="kvpress loglikelihood_rolling"):
            (string,) = request.args
            ids = torch.tensor([self.prefix_token_id, *self.tok_encode(string)], device=self.device)
            limit = getattr(self.model.config.get_text_config(decoder=True), "max_position_embeddings", None)
            if limit is not None and ids.numel() > limit and not self.press.rerotate:
                raise ValueError(
                    f"a document of {ids.numel()} tokens runs past the model's {limit} positions; use a press "
                    "with rerotate=True (positions inside the cache) or shorter documents"
                )
            cache = DynamicCache(config=self.model.config)
            nll, _ = chunked_nll(self.model, ids, self.press, self.rolling_chunk, cache)
            self._record(cache, ids.numel())
            results.append(-nll)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), -nll)
        return results

    # ----- generation: compressed prompt, decode-time eviction -----------------------------------------------
    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        if self.press is None:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        cache = DynamicCache(config=self.model.config)
        keyword = cache_keyword(self.model)
        with self.press(self.model):
            out = super()._model_generate(context, max_length, stop, **{keyword: cache}, **generation_kwargs)
        self._record(cache, cache.get_seq_length(), batch=context.shape[0])
        return out

    # ----- memory records ----------------------------------------------------------------------------------
    def _record(self, cache: DynamicCache, tokens: int, batch: int = 1) -> None:
        """Bytes `cache` holds, next to a full cache of `batch` rows of `tokens` (padding included)."""
        full = batch * full_cache_bytes(self.model, tokens)
        self.kv_records.append({"kept_bytes": kvpress.cache_bytes(cache), "full_bytes": full})

    def kv_summary(self) -> dict:
        """Mean kept and full KV bytes per request, their ratio, and peak process / CUDA memory."""
        n = len(self.kv_records)
        kept = sum(r["kept_bytes"] for r in self.kv_records) / max(n, 1)
        full = sum(r["full_bytes"] for r in self.kv_records) / max(n, 1)
        return {
            "press": repr(self.press),
            "requests": n,
            "mean_kept_kv_bytes": round(kept),
            "mean_full_kv_bytes": round(full),
            "kept_ratio": round(kept / full, 4) if full else None,
            **peak_memory(),
        }

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info["kvpress"] = self.kv_summary()
        return info


TASKS_DIR = str(Path(__file__).parent / "tasks")


def main(argv: list[str]) -> int:
    """`kvpress lm-eval ARGS`: lm-eval's own CLI with `--model kvpress` and kvpress's offline tasks included."""
    if "--model" in argv or any(a.startswith("--model=") for a in argv):
        message = "--model is always kvpress; pick the model with --model_args pretrained=..."
        print(f"kvpress lm-eval: {message}", file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate

    argv = ["run", "--model", "kvpress", *argv]
    if "--include_path" not in argv:
        argv += ["--include_path", TASKS_DIR]
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0
