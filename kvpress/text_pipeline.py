"""The transformers pipeline `kv-press-text-generation`: a context compressed once, then one or many questions.

    pipe = transformers.pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    pipe(context, question="...", press=press)["answer"]
    pipe(context, questions=["...", "..."], press=press, answer_prefix="", max_new_tokens=50)["answers"]

Called as NVIDIA kvpress's pipeline is, so switching tools is changing the import. The context is prefilled
and compressed once without the questions (`kvpress.pipeline.prefill_context`); each question and its
answer are appended to that cache and dropped before the next question (`scratch`), so every question sees
the same compressed context, and one question gives exactly `kvpress.generate`'s answer at the same
`max_new_tokens` (the defaults differ: 50 here, as NVIDIA kvpress's pipeline; 64 there). `cache=` receives the
compressed context (left as the context alone). Importing kvpress registers the task (the one global effect of
the import; no model is touched).
"""

from __future__ import annotations

import inspect

import torch
from transformers import AutoModelForCausalLM, DynamicCache, Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

from kvpress.patches.cache import scratch
from kvpress.pipeline import (
    answer_from_cache,
    check_compresses,
    check_no_outer_press,
    check_positions,
    check_press,
    prefill_context,
    split_prompt,
)

TASK = "kv-press-text-generation"


class KVPressTextGenerationPipeline(Pipeline):
    """See the module docstring."""

    def __init__(self, *args, cache: DynamicCache | None = None, **kwargs):
        if cache is not None:  # (kept for every call, it would take the first context and refuse the next)
            raise ValueError(f"{TASK} takes cache= at a call (it receives that call's compressed context), not when "
                             "the pipeline is built")  # fmt: skip
        super().__init__(*args, **kwargs)

    def __call__(self, context, *args, batch_size: int | None = None, **kwargs):
        if args:  # (transformers' Pipeline would drop them with a logged warning)
            raise TypeError(f"{TASK} takes the context (or a list of contexts) as its one positional argument; pass "
                            f"the question as question= (or questions=), got {len(args)} more")  # fmt: skip
        size = self._batch_size if batch_size is None else batch_size
        if size not in (None, 1):  # a batch would stack contexts of different lengths, and answer its first row
            raise ValueError(f"{TASK} compresses each context alone, one at a time: batch_size must be 1, got "
                             f"{size!r}")  # fmt: skip
        for one, other in (("question", "questions"), ("questions", "question")):  # a call's question replaces a
            if one in kwargs and other not in kwargs:  # built one of either kind
                kwargs[other] = None
        if kwargs.get("cache") is not None and not isinstance(context, str) and len(context) > 1:
            raise ValueError(f"cache= receives one compressed context; {len(context)} contexts were given: call the "
                             "pipeline once per context")  # fmt: skip
        return super().__call__(context, batch_size=1, **kwargs)  # (not the batch_size it was built with)

    def _sanitize_parameters(self, **given):
        """The arguments given (when the pipeline is built, or at a call: a call's override the built ones), each
        to its stage; what is not given takes the stage's default, so one given when built holds for every call."""
        unknown = sorted(set(given) - set(PARAMETERS))
        if unknown:
            raise TypeError(f"{TASK} takes no argument {', '.join(unknown)}; it takes {', '.join(PARAMETERS)}")
        questions = given.get("questions")
        if questions is not None and (isinstance(questions, str) or not questions):
            raise ValueError(f"questions= is a non-empty list of strings, got {questions!r}")
        max_new_tokens = given.get("max_new_tokens", 1)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        cache = given.get("cache")
        if cache is not None and not isinstance(cache, DynamicCache):
            raise TypeError(f"cache= takes a DynamicCache, got {type(cache).__name__}")
        press = given.get("press")
        check_press(press)
        if press is not None and press.needs_question:  # (refused before the prefill, not after it)
            raise ValueError(f"{TASK} compresses the context once, without the questions: {type(press).__name__} "
                             "scores by the question (use kvpress.generate(..., query_aware=True))")  # fmt: skip
        stages = [{k: v for k, v in given.items() if PARAMETERS[k] == stage} for stage in ("preprocess", "forward")]
        return stages[0], stages[1], {}

    def preprocess(self, context: str, question: str | None = None, questions: list[str] | None = None,
                   answer_prefix: str = "", chat_template: bool = True):  # fmt: skip
        if question is not None and questions is not None:
            raise ValueError("give question= or questions=, not both")
        if question is None and questions is None:
            raise ValueError(f"{TASK} answers a question about the context: give question= or questions=")
        asked = [question] if questions is None else list(questions)
        if not all(isinstance(q, str) and q for q in asked):
            raise ValueError(f"every question is a non-empty string, got {asked!r}")
        if not isinstance(answer_prefix, str):
            raise TypeError(f"answer_prefix is the text the answer starts with (a string, '' for none), got "
                            f"{answer_prefix!r}")  # fmt: skip
        parts = [split_prompt(self.tokenizer, context, q, chat_template) for q in asked]
        context_ids = parts[0][0]
        if any(not torch.equal(ids, context_ids) for ids, _ in parts):
            raise ValueError("the context tokenizes differently before different questions; ask them one at a time")
        prefix = self.tokenizer(answer_prefix, add_special_tokens=False, return_tensors="pt").input_ids
        return {"context_ids": context_ids, "question_ids": [torch.cat([q, prefix], dim=-1) for _, q in parts],
                "one": questions is None}  # fmt: skip

    def _forward(self, inputs: dict, press=None, max_new_tokens: int = 50, cache: DynamicCache | None = None):
        cache = DynamicCache(config=self.model.config) if cache is None else cache
        if cache.get_seq_length():
            raise ValueError(f"cache= already holds {cache.get_seq_length()} tokens: pass an empty DynamicCache")
        device = self.model.device
        context_ids = inputs["context_ids"].to(device)
        if press is None:  # (before the prefill: its scratch cache refused only after)
            check_no_outer_press(self.model, TASK, "the context")
        check_compresses(press, context_ids.shape[1])  # as kvpress.generate: one question gives its answer
        longest = context_ids.shape[1] + max(q.shape[1] for q in inputs["question_ids"]) + max_new_tokens
        check_positions(self.model, longest, press, "the context, a question and its answer",
                        "a shorter context or max_new_tokens")  # fmt: skip
        prefill_context(self.model, context_ids, press, cache, self.tokenizer)
        answers = []
        for question_ids in inputs["question_ids"]:
            ids = torch.cat([context_ids, question_ids.to(device)], dim=-1)
            with scratch(cache):  # the question and its answer leave the cache before the next question
                answers.append(answer_from_cache(self.model, self.tokenizer, ids, cache, press, max_new_tokens))
        return {"answers": answers, "one": inputs["one"]}

    def postprocess(self, outputs: dict):
        return {"answer": outputs["answers"][0]} if outputs["one"] else {"answers": outputs["answers"]}


# each argument the task takes and the stage that takes it (its default is that stage's): the keywords of
# `preprocess` after the context, and of `_forward` after the inputs
PARAMETERS = {name: stage for stage, fn in (("preprocess", KVPressTextGenerationPipeline.preprocess),
                                            ("forward", KVPressTextGenerationPipeline._forward))
              for name in list(inspect.signature(fn).parameters)[2:]}  # fmt: skip


PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=KVPressTextGenerationPipeline, pt_model=AutoModelForCausalLM)
