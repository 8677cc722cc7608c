"""`KVPressLM`: lm-eval's `HFLM` with a press, so any lm-eval task measures quality under compression.

    lm_eval.simple_evaluate(model=KVPressLM(press="snapkv", compression_ratio=0.5), tasks=[...])
    manager = TaskManager(include_path=TASKS_DIR, include_defaults=False, metadata={"pretrained": "qwen2.5-0.5b"})
    lm_eval.simple_evaluate(model=KVPressLM("qwen2.5-0.5b", ...), tasks=["kvpress_ruler"], task_manager=manager)
    kvpress lm-eval --model_args pretrained=default,press=snapkv,compression_ratio=0.5 --tasks kvpress_ruler

kvpress's own tasks cut their contexts to length with the tokenizer their metadata names (`pretrained`, or
`tokenizer`; the default model's when none): from Python, name the model there as above (the command line does it
from --model_args); a model whose tokenizer counts otherwise is refused.

Two modes, as in `kvpress.generate`. Query-agnostic (the default, `query_aware=False`): only the text
before the request's question is compressed, so the compressed cache could serve any question; the
question is found as the document's `question` field, which the prompt must contain after some context
(kvpress's tasks and SQuAD-style tasks have it; for others the bridge refuses and names
`query_aware=True`). The question and the answer are then fed with the press frozen. Query-aware
(`query_aware=True`): the whole prompt is compressed at prefill, so the question guides the scores,
and generation continues with the press's decode-time eviction (a press that scores the context by a
pass of its own, KVzip, compresses each prompt alone and then answers frozen).

Loglikelihood requests: the compressed part (query-aware: the context minus its last token) is
prefilled with the press installed; then the rest and the continuation are fed frozen and every
continuation token is scored against the compressed cache (no mask simulation). Requests that share a
compressed part share its prefill (the compressed cache is copied per continuation).
loglikelihood_rolling (perplexity tasks): the whole document goes through one cache in chunks of
`rolling_chunk` tokens with the press installed (StreamingLLM's evaluation, `tasks/perplexity.py`), so
every token is predicted from the compressed past, not from HFLM's full-cache windows; documents
longer than `max_length` are not cut into windows: the press bounds the cache, and a document past the
model's positions is refused unless the press re-rotates (`rerotate=True`).

With a press, loglikelihood requests and query-agnostic generation run one at a time (`batch_size` shapes only
query-aware generation and the press-free model); `mixed_precision_dtype` and `softmax_dtype` are refused with a
press (its prefill and scoring run outside HFLM's autocast and softmax). A loglikelihood request longer than
`max_length` + 1 tokens is cut from the left, as HFLM cuts it, with a warning.

Every request records the KV bytes it held (summed over the cache's tensors) next to what a full
cache would hold; `kv_summary()` (also in lm-eval's results under `config.kvpress`) gives their
means per request, the peak resident memory of the process and, on a GPU, the peak allocated CUDA memory, and
`kept_whole`: the compressed prefills a press's budget kept whole (`BasePress.keeps_whole`: a benchmark's short
documents; warned the first time). `kvpress lm-eval` says a refused press, parameter or task in a line
(`KVPRESS_TRACEBACK=1`: the whole traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
import functools
import inspect
import io
import os
import re
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from torch import nn
from tqdm.auto import tqdm
from transformers import DynamicCache

import kvpress
from kvpress.eval.memory import full_cache_bytes, peak_memory
from kvpress.eval.tasks.lm_eval_hooks import TOKENIZED_BY, metadata_keys, tokenizer_fingerprint
from kvpress.eval.tasks.perplexity import CHUNK, chunked_nll
from kvpress.files import check_writable
from kvpress.models import PACKAGED_MODELS, resolve_model_path
from kvpress.patches.model_access import cache_keyword
from kvpress.patches.user_warnings import warn
from kvpress.pipeline import check_chunk_size, holds_whole, prefill_context
from kvpress.presses import (
    BasePress,
    all_press_parameters,
    press_from_name,
    resolve_default,
    spec_before_loading,
)


def _tokens(name: str, value) -> int:
    """`value` (an int, or its digits from --model_args) as a positive count of tokens; anything else refused by
    `name` (lm-eval hands 12.9 or true over as a float or a bool, which are not counts)."""
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive number of tokens, got {value!r}")
    return value


@register_model("kvpress")
class KVPressLM(HFLM):
    """`HFLM` whose KV cache a press compresses.

    Parameters (besides HFLM's, e.g. `batch_size`, `max_length`):
        pretrained: "default" (SmolLM2-135M, offline), a packaged model name, a local directory, or a
            loaded model (then pass `tokenizer=` too).
        press: a press name (`kvpress.PRESSES`), a press object, or None / "none" (plain HFLM).
        compression_ratio, max_tokens, and any press parameter (`window_size`, `n_sink`, ...): the press's.
        rolling_chunk: tokens fed per forward in loglikelihood_rolling (default None: 128).
        prefill_chunk_size: prefill each context this many tokens a forward, the press evicting after each
            (default None: one forward; KVzip scores each chunk, the other presses that score the whole
            context refuse it).
        query_aware: compress the whole prompt, question included (default False: only the text before
            the document's `question`; see the module docstring).
        question_key: the document field that holds the question (default "question"), for tasks whose
            documents name it otherwise. Or:
        question_regex: a regular expression; the question starts where its last match in the prompt starts
            (for tasks whose documents hold no question of their own, e.g. "Question:").
    """

    def __init__(
        self,
        pretrained="default",
        press: str | BasePress | None = None,
        compression_ratio: float | None = None,
        max_tokens: int | None = None,
        rolling_chunk: int | None = None,
        query_aware: bool = False,
        question_key: str | None = None,
        question_regex: str | None = None,
        prefill_chunk_size: int | str | None = None,
        **kwargs,
    ) -> None:
        pretrained, kwargs, beside = self._settle(
            True, pretrained=pretrained, press=press, compression_ratio=compression_ratio, max_tokens=max_tokens,
            rolling_chunk=rolling_chunk, query_aware=query_aware, question_key=question_key,
            question_regex=question_regex, prefill_chunk_size=prefill_chunk_size, **kwargs,
        )  # by name: a parameter added to one and not the other is refused at the first call
        cpu_processes = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
        if cpu_processes:  # torchrun --nproc_per_node N on CPUs: accelerate must join them over gloo
            os.environ["ACCELERATE_USE_CPU"] = "true"
        super().__init__(pretrained=pretrained, **kwargs)
        if isinstance(press, str) and resolve_default(press) != press:  # `default`: this model's default press
            self.press = press_from_name(press, self.model, **beside)
            _check_question(self.press, self.query_aware)
            check_chunk_size(self.prefill_chunk_size, self.press)  # (any other press: checked by _settle)
        self.kv_records: list[dict] = []
        self._all_totals: list[dict] | None = None  # data-parallel, on process 0: every process's `_totals`
        self.kept_whole = 0  # contexts the press's budget keeps whole: nothing compressed (said once, counted)
        if cpu_processes and self._world_size == 1:  # HFLM shards data only across GPUs: shard it here
            from accelerate import Accelerator

            self.accelerator = Accelerator(cpu=True)
            self._rank, self._world_size = self.accelerator.process_index, self.accelerator.num_processes

    @classmethod
    def check_model_args(cls, model_args: dict) -> None:
        """Refuse `model_args` (`--model_args` as lm-eval parses it) as the bridge would, without loading the model:
        a bad press, parameter or setting is said before lm-eval reads its task index (~10 s). A packaged model is
        not converted here (the run converts it on first use, once lm-eval has checked the rest); what depends on
        the loaded model (a directory's `default` press) is checked once it loads."""
        bound = inspect.signature(cls.__init__).bind(None, **model_args)  # __init__'s defaults, as lm-eval calls it
        bound.apply_defaults()
        args = {key: value for key, value in bound.arguments.items() if key not in ("self", "kwargs")}
        cls.__new__(cls)._settle(False, **args, **bound.arguments["kwargs"])

    def _settle(self, convert: bool, *, pretrained, press, compression_ratio, max_tokens, rolling_chunk, query_aware,
                question_key, question_regex, prefill_chunk_size, **kwargs) -> tuple[object, dict, dict]:
        """Every check and setting made before the model loads: HFLM's `pretrained` (a packaged model converted on
        first use where `convert`) and arguments, and the press parameters a model's default press is built with
        once it loads."""
        if isinstance(query_aware, str) and query_aware.lower() in ("true", "false"):  # from --model_args
            query_aware = query_aware.lower() == "true"
        if not isinstance(query_aware, bool):
            raise ValueError(f"query_aware must be true or false, got {query_aware!r}")
        self.query_aware = query_aware
        if question_key is not None and question_regex is not None:
            raise ValueError("give question_key= or question_regex=, not both")
        if self.query_aware and (question_key is not None or question_regex is not None):
            raise ValueError("question_key= / question_regex= find the question a query-agnostic run leaves "
                             "whole; with query_aware=true the whole prompt is compressed: drop them")  # fmt: skip
        if question_key is not None and (not isinstance(question_key, str) or not question_key):
            raise ValueError(f"question_key must be a document field name, got {question_key!r}")
        try:
            self.question_regex = re.compile(question_regex) if question_regex is not None else None
        except (re.error, TypeError) as error:
            raise ValueError(f"question_regex {question_regex!r} is not a regular expression: {error}") from error
        self.question_key = question_key or "question"
        self._question_tails: dict[tuple[int, ...], int] = {}  # prompt tokens -> tokens of its question
        self._question_starts: dict[str, int] = {}  # loglikelihood context -> where its question starts
        self.rolling_chunk = CHUNK if rolling_chunk is None else _tokens("rolling_chunk", rolling_chunk)
        self.prefill_chunk_size = check_chunk_size(None if prefill_chunk_size is None else
                                                   _tokens("prefill_chunk_size", prefill_chunk_size))  # fmt: skip
        params = all_press_parameters()  # derived from the press classes: a new parameter reaches its press
        press_kwargs = {key: kwargs.pop(key) for key in list(kwargs) if key in params}
        shared = [key for key in press_kwargs if key in metadata_keys()]  # (RandomPress's seed)
        if shared:  # lm-eval merges model_args into the tasks' metadata: there they would draw other examples
            named = f"press={press}:{shared[0]}={press_kwargs[shared[0]]}" if isinstance(press, str) else (
                f"{shared[0]}= in the press object")  # fmt: skip
            raise ValueError(f"{', '.join(f'{key}={press_kwargs[key]!r}' for key in shared)} in model_args would also "
                             f"reach kvpress's tasks (lm-eval hands them model_args), whose {', '.join(shared)} "
                             f"draws their examples: give it in the press ({named}), and the tasks' in "
                             "--metadata")  # fmt: skip
        _check_leftovers(kwargs, params, loaded=isinstance(pretrained, nn.Module))
        beside = {"compression_ratio": compression_ratio, "max_tokens": max_tokens, **press_kwargs}
        if isinstance(press, BasePress):
            if compression_ratio is not None or max_tokens is not None or press_kwargs:
                raise ValueError("pass press parameters either in the press object or as arguments, not both")
            self.press = press
        elif press is None or press == "none":
            if compression_ratio is not None or max_tokens is not None or press_kwargs:
                raise ValueError(f"press parameters given without a press: {compression_ratio=}, {max_tokens=}, "
                                 f"{press_kwargs}")  # fmt: skip
            self.press = None
        else:  # `default`: built as the named model's default press, and as the model's own once it loads
            named = pretrained if isinstance(pretrained, str) and pretrained != "default" else None
            early = resolve_default(press, pretrained, beside) if isinstance(pretrained, nn.Module) else (
                spec_before_loading(press, named, beside))  # (None: a directory's default, known once it loads)
            self.press = None if early is None else press_from_name(early, **beside)
        later = self.press is None and press is not None and press != "none"  # (built once the model loads)
        _check_question(self.press, self.query_aware)
        if self.press is not None:  # (a directory's default press: checked once it loads)
            check_chunk_size(self.prefill_chunk_size, self.press)
        if self.press is None and not later and self.prefill_chunk_size:
            raise ValueError("prefill_chunk_size chunks a press's prefill; with no press lm-eval's own model runs "
                             "(nothing to evict: chunks would change only the memory): drop it, or give a press")
        unused = {"query_aware": query_aware, "rolling_chunk": rolling_chunk is not None, "question_key": question_key,
                  "question_regex": question_regex}  # fmt: skip
        if self.press is None and not later and any(unused.values()):
            raise ValueError(f"{', '.join(k for k, v in unused.items() if v)} only shape how a press compresses; with "
                             "no press lm-eval's own model runs: drop them, or give a press")  # fmt: skip
        dtypes = [key for key in ("mixed_precision_dtype", "softmax_dtype") if kwargs.get(key) is not None]
        if dtypes and (self.press is not None or later):
            raise ValueError(f"{', '.join(dtypes)} shape lm-eval's own forwards, and the bridge's prefill and scoring "
                             "with a press run outside them (in the model's dtype, log-probabilities in float32): "
                             "load the model in the dtype wanted (dtype=bfloat16), or drop them")  # fmt: skip
        if isinstance(pretrained, str):  # a local directory: HFLM loads it (and shards data under accelerate)
            if not convert and (pretrained == "default" or pretrained in PACKAGED_MODELS):
                return pretrained, kwargs, beside
            pretrained = str(resolve_model_path(None if pretrained == "default" else pretrained))
            kwargs.setdefault("dtype", "float32")
            kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
        for extra in ("peft", "delta"):  # adapters or weight deltas HFLM reads: a name not found here goes to the hub
            if kwargs.get(extra) and not Path(str(kwargs[extra])).expanduser().exists():
                raise ValueError(f"{extra}={kwargs[extra]!r} is not a local path: kvpress runs offline (lm-eval would "
                                 f"fetch it from the model hub); give the directory that holds it")  # fmt: skip
        tokenizer = kwargs.get("tokenizer")
        if isinstance(tokenizer, str) and (convert or tokenizer not in PACKAGED_MODELS):  # (a hub name: to the hub)
            resolved = str(resolve_model_path(tokenizer))  # refuses what is neither a packaged model nor a directory
            kwargs["tokenizer"] = resolved if convert else tokenizer
        return pretrained, kwargs, beside

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
            if not self.query_aware:  # the compressed part: the context before the question
                text = requests[i][0][0] if requests[i][0] is not None else None
                if text not in self._question_starts:
                    raise ValueError("query-agnostic loglikelihood needs each request's document (its question): "
                                     "call loglikelihood(), or pass query_aware=True")  # fmt: skip
                # (lm-eval encodes the context without its trailing whitespace: it goes with the continuation)
                head = self._head_tokens(text.rstrip(), self._question_starts[text], context)
                split = head - (len(context) + len(continuation) - len(full))
                if split < 1:
                    raise ValueError(f"query-agnostic loglikelihood: max_length={self.max_length} cut off the text "
                                     "before the question; raise max_length or pass query_aware=True")  # fmt: skip
            tokens.append((full, split))
            groups.setdefault(tuple(full[: split + 1 if self.query_aware else split]), []).append(i)
        cut = sum(len(full) < len(requests[i][1]) + len(requests[i][2]) for i, (full, _) in enumerate(tokens))
        if cut:  # as lm-eval's own model does (it logs it too)
            warn(f"{cut} of {len(requests)} loglikelihood requests were cut from the left to "
                 f"max_length={self.max_length} + 1 tokens")  # fmt: skip
        results: list = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="kvpress loglikelihood")
        for key, members in groups.items():  # query-aware: the prefix and the token fed next (Lookahead drafts)
            prefix, following = (key[:-1], key[-1:]) if self.query_aware else (key, None)
            cache = self._prefill(list(prefix), following)
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

    def _check_tokenized_by(self, requests) -> None:
        """Refuse kvpress task rows cut to length with another tokenizer than this model's: lm-eval hands the tasks
        `model_args` as metadata, so `simple_evaluate(model=KVPressLM(...))` without `metadata={"pretrained": ...}`
        counts every context's tokens with the default model's tokenizer (a 1,024-token context read as 977)."""
        own = None
        for request in requests:
            made = request.doc.get(TOKENIZED_BY) if isinstance(request.doc, dict) else None
            if made is None:
                continue
            own = own or tokenizer_fingerprint(self.tokenizer)
            if made != own:
                raise ValueError(
                    f"task {request.task_name!r} counted its contexts' tokens with another tokenizer than this "
                    f"model's ({TOKENIZED_BY} {made} against {own}): its lengths would be wrong for this model. Name "
                    "the model for the tasks in their metadata, {'pretrained': <model name or directory>} or "
                    "{'tokenizer': <this tokenizer>}: TaskManager(..., metadata=...) when you pass simple_evaluate a "
                    "task_manager (it then ignores its own metadata=), else simple_evaluate(metadata=...) "
                    "(`kvpress lm-eval` does it from --model_args)"
                )

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        self._check_tokenized_by(requests)
        if self.press is not None and not self.query_aware:
            self._question_starts = {request.args[0]: self._question_start(request) for request in requests}
        return self._shared(super().loglikelihood(requests, disable_tqdm=disable_tqdm))

    def _head_tokens(self, text: str, start: int, tokens: list[int]) -> int:
        """How many of `tokens` (`text` encoded as lm-eval does) end before character `start` (its question);
        a token across the boundary goes with the question, so it is not compressed."""
        special = tokens[:1] == [self.prefix_token_id] and not text.startswith(self.tok_decode([self.prefix_token_id]))
        enc = self.tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
        if enc.input_ids != tokens:
            raise ValueError("query-agnostic mode: cannot map the prompt's tokens to its text; pass query_aware=True")
        head = 0
        while head < len(tokens) and enc.offset_mapping[head][1] <= start:
            head += 1
        return head

    def _question_start(self, request) -> int:
        """Where the request's question starts in its prompt (query-agnostic mode), or a clear error."""
        doc, context = request.doc, request.args[0]
        if self.question_regex is not None:
            matches = list(self.question_regex.finditer(context))
            if not matches or matches[-1].start() <= 0:
                raise ValueError(f"query-agnostic mode: question_regex {self.question_regex.pattern!r} finds no "
                                 f"question after some context in a prompt of task {request.task_name!r}")  # fmt: skip
            return matches[-1].start()
        question = doc.get(self.question_key) if isinstance(doc, dict) else None
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"query-agnostic mode compresses the text before the question, but task "
                             f"{request.task_name!r} has no {self.question_key!r} field in its documents; name "
                             "the field with question_key=, or where the question starts with question_regex=, "
                             "or pass query_aware=True to compress the whole prompt")  # fmt: skip
        start = context.rfind(question.strip())
        if start <= 0:
            raise ValueError(f"query-agnostic mode: the prompt of task {request.task_name!r} does not contain its "
                             "document's question after some context; pass query_aware=True")  # fmt: skip
        return start

    @torch.inference_mode()
    def _prefill(self, prefix: list[int], following: list[int] | None = None) -> DynamicCache:
        cache = DynamicCache(config=self.model.config)
        if prefix:
            self._check_compresses(len(prefix))
            ids = torch.tensor([prefix], device=self.device)
            after = None if following is None else torch.tensor([list(following)], device=self.device)
            prefill_context(self.model, ids, self.press, cache, self.tokenizer, next_ids=after,
                            prefill_chunk_size=self.prefill_chunk_size)
        return cache

    @torch.inference_mode()
    def _score(self, cache: DynamicCache, fed: list[int], n_cont: int) -> tuple[float, bool]:
        """The log-probability of the last `n_cont` of `fed` (and whether each is the greedy pick), `fed` read over
        `cache` inside `frozen()`. A press that recalls reads the question alone, then the continuation a token a
        forward, as it answers: read at once, the continuation's own tokens would choose what the question
        recalls (and each token's probability would depend on the tokens after it)."""
        ids = torch.tensor([fed[:-1]], device=self.device)
        with self.press(self.model, tokenizer=self.tokenizer) as installed, installed.frozen():
            if not self.press.recalls:
                logits = self.model(ids, cache=cache, use_cache=True,
                                    logits_to_keep=n_cont).logits  # the continuation's only: a 4K prompt's all are GBs
            else:
                first = len(fed) - n_cont  # the question (or the context's last token), then each continuation token
                parts = [ids[:, :first], *ids[:, first:].split(1, dim=1)]
                logits = torch.cat([self.model(part, cache=cache, use_cache=True, logits_to_keep=1).logits
                                    for part in parts], dim=1)  # fmt: skip
        logprobs = F.log_softmax(logits[0, -n_cont:].float(), dim=-1)
        target = torch.tensor(fed[-n_cont:], device=logprobs.device)
        return float(logprobs.gather(-1, target[:, None]).sum()), bool((logprobs.argmax(-1) == target).all())

    # ----- loglikelihood_rolling: the document read in chunks through one compressed cache ----------------
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        return self._shared(self._rolling(requests, disable_tqdm))

    def _rolling(self, requests, disable_tqdm: bool) -> list[float]:
        self._check_tokenized_by(requests)
        if self.press is None:
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
        if self.prefill_chunk_size and requests:
            raise ValueError(f"a perplexity task feeds its documents rolling_chunk={self.rolling_chunk} tokens a "
                             f"forward already: drop prefill_chunk_size={self.prefill_chunk_size}")  # fmt: skip
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

    # ----- generation: query-aware, the prompt compressed with decode-time eviction; else the context only ------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        self._check_tokenized_by(requests)
        if self.press is not None and not self.query_aware:
            self._question_tails = {}
            for request in requests:
                context = request.args[0]
                tokens = self.tok_encode(context)
                head = self._head_tokens(context, self._question_start(request), tokens)
                self._question_tails[tuple(tokens)] = len(tokens) - head
        return self._shared(super().generate_until(requests, disable_tqdm=disable_tqdm))

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        if self.press is None:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        keyword = cache_keyword(self.model)
        if self.query_aware and not self.press.needs_whole_context:
            cache = DynamicCache(config=self.model.config)
            if self.prefill_chunk_size:  # transformers' own chunked prefill inside generate: each chunk evicts
                generation_kwargs["prefill_chunk_size"] = self.prefill_chunk_size
            with self.press(self.model, tokenizer=self.tokenizer):
                out = super()._model_generate(context, max_length, stop, **{keyword: cache}, **generation_kwargs)
            self._record(cache, cache.get_seq_length(), batch=context.shape[0])
            return out
        mask = generation_kwargs.pop("attention_mask", None)
        rows = []  # each row is compressed alone (its own question; KVzip's pass), then answered frozen
        for b in range(context.shape[0]):
            ids = context[b : b + 1] if mask is None else context[b : b + 1, mask[b].bool()]
            tail = 1 if self.query_aware else self._question_tails.get(tuple(ids[0].tolist()))
            if tail is None:
                raise ValueError("query-agnostic mode: a prompt no longer matches its question (cut to max_length?); "
                                 "raise max_length or pass query_aware=True")  # fmt: skip
            cut = ids.shape[1] - tail
            cache = self._prefill(ids[0, :cut].tolist(), ids[0, cut:].tolist() if self.query_aware else None)
            installation = self.press(self.model, tokenizer=self.tokenizer)
            with torch.inference_mode(), installation as installed, installed.frozen():  # as the prefill
                out = super()._model_generate(ids, max_length - (context.shape[1] - ids.shape[1]), stop,
                                              attention_mask=torch.ones_like(ids), **{keyword: cache},
                                              **generation_kwargs)  # fmt: skip
            self._record(cache, cache.get_seq_length())
            rows.append(out[0, ids.shape[1] :])
        width = max(row.numel() for row in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
        new = torch.full((len(rows), width), pad, device=context.device)
        for b, row in enumerate(rows):
            new[b, : row.numel()] = row
        return torch.cat([context, new.to(context.dtype)], dim=1)

    def _check_compresses(self, tokens: int) -> None:
        """Count a compressed prefill the press's budget keeps whole (`holds_whole`; and say so, the first time): its
        requests are answered over an uncompressed context (frozen: nothing more is evicted), which `kvpress.generate`
        refuses for its one context. (Query-aware generation evicts while it decodes: not counted there.)"""
        if (why := holds_whole(self.press, tokens)) is None:
            return
        if not self.kept_whole:
            warn(f"a context of {tokens} tokens is kept whole, uncompressed: {why} (each such prefill is "
                 "counted in kv_summary's kept_whole)")  # fmt: skip
        self.kept_whole += 1

    # ----- memory records ----------------------------------------------------------------------------------
    def _record(self, cache: DynamicCache, tokens: int, batch: int = 1) -> None:
        """Bytes `cache` holds, next to a full cache of `batch` rows of `tokens` (padding included): one record
        per cache, which served `batch` requests."""
        full = batch * full_cache_bytes(self.model, tokens)
        self.kv_records.append({"kept_bytes": kvpress.cache_bytes(cache), "full_bytes": full, "requests": batch})

    def _totals(self) -> dict:
        """This process's records summed, its prefills kept whole and its peak memory."""
        return {"requests": sum(r["requests"] for r in self.kv_records),
                "kept_bytes": sum(r["kept_bytes"] for r in self.kv_records),
                "full_bytes": sum(r["full_bytes"] for r in self.kv_records),
                "kept_whole": self.kept_whole, **peak_memory()}  # fmt: skip

    def _shared(self, result: list) -> list:
        """`result`, after every process (data-parallel) sent its totals to process 0: lm-eval runs each kind of
        request on every process, then asks process 0 alone for `get_model_info`, where a gather would wait for
        processes that never come."""
        if self.world_size > 1:
            gathered = self.gather_object(self._totals(), dst=0)
            if self.rank == 0:
                self._all_totals = gathered
        return result

    def kv_summary(self) -> dict:
        """Mean kept and full KV bytes per request (a batch's cache counted for each of its rows), their ratio, and
        peak process / CUDA memory; data-parallel, over every process's requests (`processes`; peaks: the largest
        process's; a request lm-eval repeated to even out the processes' shares counts as one more)."""
        mine = self._totals()  # process 0's as of now; the others' as of their last requests
        totals = [mine, *self._all_totals[1:]] if self._all_totals else [mine]
        n = sum(t["requests"] for t in totals)
        kept = sum(t["kept_bytes"] for t in totals) / max(n, 1)
        full = sum(t["full_bytes"] for t in totals) / max(n, 1)
        peaks = {key: max(t[key] for t in totals) for key in mine if key.startswith("peak_")}
        return {
            "press": repr(self.press),
            "requests": n,
            "mean_kept_kv_bytes": round(kept),
            "mean_full_kv_bytes": round(full),
            "kept_ratio": round(kept / full, 4) if full else None,
            "kept_whole": sum(t["kept_whole"] for t in totals),
            "processes": len(totals),
            **peaks,
        }

    def get_model_info(self) -> dict:
        """lm-eval's model information, without the model hub: HFLM asks the hub for the commit of `pretrained`
        (`model_sha`) at every run, a network call kvpress never makes (a relative local path was looked up there);
        the hub's fields are left empty, as lm-eval leaves them when the hub does not answer."""
        info = {"model_num_parameters": self._model.num_parameters(), "model_dtype": self._model.dtype,
                "model_revision": self.revision, "model_sha": ""}  # fmt: skip
        info |= {f"{extra}_sha": "" for extra in ("peft", "delta") if getattr(self, extra, None)}
        info["kvpress"] = self.kv_summary()
        return info


def _check_leftovers(kwargs: dict, params: set[str], loaded: bool) -> None:
    """Refuse an argument meant for a press but misspelt: it would go to lm-eval's HFLM, which ignores what it does
    not take given a loaded model, and passes it to the model's class given a directory (a TypeError there)."""
    named = set(inspect.signature(HFLM.__init__).parameters) - {"self", "kwargs"}
    for key in kwargs:
        close = difflib.get_close_matches(key, sorted(params), n=1, cutoff=0.8)
        if key not in named and (loaded or close):
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"{key}={kwargs[key]!r} is neither a press parameter{hint} nor an argument of lm-eval's "
                             "HFLM (`kvpress presses` lists every press's parameters)")  # fmt: skip


def _check_question(press: BasePress | None, query_aware: bool) -> None:
    if press is not None and press.needs_question and not query_aware:
        raise ValueError(f"{type(press).__name__} scores by the question: pass query_aware=true")


TASKS_DIR = str(Path(__file__).parent / "tasks")


@functools.cache
def _run_parser():
    """lm-eval's own parser of its `run` command."""
    from lm_eval._cli.harness import HarnessCLI

    return HarnessCLI()._subparsers.choices["run"]


@functools.cache
def _run_flags(dest: str) -> tuple[str, ...]:
    """The option strings of lm-eval's `run` for `dest`, read from its own parser (`--model` is also `-M`)."""
    flags = next((tuple(action.option_strings) for action in _run_parser()._actions if action.dest == dest), None)
    if flags is None:
        raise RuntimeError(f"lm-eval's run command has no {dest!r} option any more: kvpress lm-eval needs updating")
    return flags


def _given(arg: str, flags: tuple[str, ...]) -> str | None:
    """The value `arg` gives one of `flags` in itself (`--model=x`, `-Mx`, `-M=x`), or None."""
    for flag in flags:
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1 :]
        if not flag.startswith("--") and arg.startswith(flag) and len(arg) > len(flag):
            return arg[len(flag) :]
    return None


def _parsed(argv: list[str]) -> argparse.Namespace | None:
    """`argv` as lm-eval's `run` parses it (flags it does not know left to lm-eval); None where it asks for help or
    does not parse (lm-eval itself then answers)."""
    if any(arg in _run_flags("help") for arg in argv):
        return None
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):  # (--hel)
            return _run_parser().parse_known_args(argv)[0]
    except SystemExit:
        return None


def _config_file(parsed: argparse.Namespace | None) -> dict:
    """The `--config` YAML file's settings as lm-eval reads them ({} without one); a file that is missing or not a
    YAML mapping raises lm-eval's own error."""
    if parsed is None or not parsed.config:
        return {}
    from lm_eval.config.evaluate_config import EvaluatorConfig

    return EvaluatorConfig.load_yaml_config(parsed.config)


def _model_args(parsed: argparse.Namespace | None, config: dict) -> dict | None:
    """The model arguments lm-eval will build its model with: `--model_args` as parsed, or the config file's where
    the command line gives none (lm-eval's precedence: a given `--model_args` replaces the file's); None where the
    arguments ask for help or do not parse, or the file's are not arguments (lm-eval itself then answers)."""
    if parsed is None:
        return None
    if parsed.model_args or "model_args" not in config:
        return parsed.model_args or {}
    from lm_eval.config.evaluate_config import EvaluatorConfig

    given = {} if config["model_args"] is None else config["model_args"]
    given = EvaluatorConfig(model_args=given)._parse_dict_args().model_args  # a string read as lm-eval reads it
    return given if isinstance(given, dict) else None  # (a list, a number: lm-eval itself answers)


def _own_tasks() -> set[str]:
    """The task and group names kvpress's task files define (`TASKS_DIR`)."""
    names = set()
    for path in Path(TASKS_DIR).glob("*.yaml"):
        names |= set(re.findall(r"^(?:task|group): (\w+)$", path.read_text(), re.M))
    return names


def _output_refusal(parsed: argparse.Namespace | None, config: dict) -> str | None:
    """Why lm-eval could not write its results where `--output_path` says (None where it can, or none is given):
    it finds out only once the whole run is over, logs a warning, exits 0, and the results (with `config.kvpress`'s
    KV bytes) are lost but for the printed table. A path ending in .json is a file (its directory made if missing),
    any other a directory (made if missing)."""
    given = (getattr(parsed, "output_path", None) if parsed is not None else None) or config.get("output_path")
    if not given:
        return None
    path = Path(given)
    try:
        check_writable(path, "--output_path", directory=path.suffix != ".json")
    except ValueError as err:
        return f"{err} (lm-eval would say so only after the run, and exit 0)"
    return None


def _cache_refusal(parsed: argparse.Namespace | None, config: dict) -> str | None:
    """Why lm-eval's caches cannot serve this run (None where they are not asked for): its saved answers
    (`--use_cache`) are keyed by a request's text alone, so another press or ratio would read this run's, and those
    read record no KV bytes; its saved requests (`--cache_requests true`) are keyed by a task's name, not by the
    metadata (length, n, seed) kvpress's tasks are built from, so another length would be scored on these."""
    if parsed is None:
        return None
    path = parsed.use_cache or config.get("use_cache")
    if path:
        return (f"--use_cache {path}: lm-eval keys its saved answers by a request's text alone, so a run with another "
                "press or ratio would read this one's (and answers read from it record no KV bytes): run without it")
    asked = parsed.cache_requests or config.get("cache_requests") or {}
    if isinstance(asked, str):
        from lm_eval._cli.utils import request_caching_arg_to_dict

        asked = request_caching_arg_to_dict(asked)
    if not asked.get("cache_requests") or asked.get("rewrite_requests_cache"):
        return None
    tasks = parsed.tasks or config.get("tasks") or []
    tasks = [tasks] if isinstance(tasks, str) else tasks
    ours = sorted({t for given in tasks for t in str(given).split(",")} & _own_tasks())
    if ours:
        return (f"--cache_requests true with {', '.join(ours)}: lm-eval keys its saved requests by a task's name, not "
                "by the metadata (length, n, seed) kvpress's tasks are built from, so another length would be scored "
                "on the saved ones: run without it (or with refresh, which builds them again)")
    return None


def main(argv: list[str]) -> int:
    """`kvpress lm-eval ARGS`: lm-eval's own CLI with `--model kvpress` (given or not, in any of lm-eval's own
    spellings) and kvpress's offline tasks included."""
    flags = _run_flags("model")
    models, rest, i = [], [], 0
    while i < len(argv):
        if argv[i] in flags and i + 1 < len(argv):
            models.append(argv[i + 1])
            i += 2
            continue
        given = _given(argv[i], flags)
        if given is not None:
            models.append(given)
        else:
            rest.append(argv[i])
        i += 1
    if any(m != "kvpress" for m in models) or (argv and argv[-1] in flags):
        message = (f"{flags[0]} {' '.join(models) or '(missing)'}: kvpress lm-eval runs lm-eval's model kvpress "
                   "(pick the weights with --model_args pretrained=...); for lm-eval's other models run `lm_eval` "
                   "itself")  # fmt: skip
        print(f"kvpress lm-eval: {message}", file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    try:
        parsed = _parsed(rest)
        config = _config_file(parsed)
        if config.get("model") not in (None, "kvpress"):
            message = (f"{parsed.config} sets model: {config['model']}: kvpress lm-eval runs lm-eval's model kvpress "
                       "(drop the file's model, or run `lm_eval` itself for its other models)")  # fmt: skip
            print(f"kvpress lm-eval: {message}", file=sys.stderr)
            return 2
        refusal = _cache_refusal(parsed, config) or _output_refusal(parsed, config)
        if refusal is not None:
            print(f"kvpress lm-eval: {refusal}", file=sys.stderr)
            return 2
        argv = ["run", "--model", "kvpress", *rest]
        include = _run_flags("include_path")
        if not config.get("include_path") and not any(arg in include or _given(arg, include) is not None
                                                      for arg in argv):  # fmt: skip
            argv += ["--include_path", TASKS_DIR]  # a path of the user's own (or the file's) replaces it
        sys.argv = ["lm-eval", *argv]
        model_args = _model_args(parsed, config)
        if model_args is not None:  # a bad press or setting said at once, not after lm-eval's task index
            KVPressLM.check_model_args(model_args)
        cli_evaluate()
    except (ValueError, TypeError, FileNotFoundError) as err:  # a bad press, parameter or task: said, no traceback
        if os.environ.get("KVPRESS_TRACEBACK"):
            raise
        frame = traceback.extract_tb(err.__traceback__)[-1]
        print(f"kvpress lm-eval: {err}\n(raised at {frame.filename}:{frame.lineno}; KVPRESS_TRACEBACK=1 shows the "
              "whole traceback)", file=sys.stderr)  # fmt: skip
        return 2
    finally:
        sys.argv = saved
    return 0
