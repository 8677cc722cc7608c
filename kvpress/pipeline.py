"""`kvpress.generate`: compress a context once, then answer a question about it."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedTokenizerBase

from kvpress.engine import maybe_installed
from kvpress.patches import model_access
from kvpress.patches.intercept import active_handler
from kvpress.presses.base import BasePress
from kvpress.recording import compress_recording, record_prefill


def pad_token_id(tokenizer) -> int:
    """The tokenizer's padding id, or its end-of-sequence id when it has none."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


QUESTION_MARK = "KVPRESS-QUESTION-3f9a"  # stands for the question in a rendering that finds where it goes


def split_prompt(
    tokenizer, context: str, question: str, chat_template: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids `[1, n]` of the context part and of the question part of one prompt: in the tokenizer's
    chat template when it has one and `chat_template` is true, else plain text `context + "\n\n" + question`."""
    for name, text in (("context", context), ("question", question)):
        if not isinstance(text, str) or not text:
            raise ValueError(f"{name} must be a non-empty string, got {text!r:.40}")
    if not isinstance(chat_template, bool):
        raise ValueError(f"chat_template must be True or False, got {chat_template!r}")
    if chat_template and getattr(tokenizer, "chat_template", None):
        def rendered(asked: str) -> str:
            messages = [{"role": "user", "content": f"{context}\n\n{asked}"}]
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

        text, marked = rendered(question), rendered(QUESTION_MARK)  # cut where the template puts the question, not
        head = marked[: max(marked.find(QUESTION_MARK), 0)]  # where its text recurs ("assistant" in the header)
        kept = text[len(head) :].startswith((question, question.rstrip()))  # (a template may trim the message's end)
        if not head or not text.startswith(head) or not kept:
            raise ValueError(f"the tokenizer's chat template rewrites the question {question!r}, so the prompt "
                             "cannot be cut before it: pass chat_template=False (plain text) or a question it "
                             "keeps")  # fmt: skip
        tail = text[len(head) :]
        special = False
    else:
        head, tail, special = context + "\n\n", question, True
    ids_head = tokenizer(head, add_special_tokens=special, return_tensors="pt").input_ids
    ids_tail = tokenizer(tail, add_special_tokens=False, return_tensors="pt").input_ids
    return ids_head, ids_tail


def check_token_ids(model, ids: torch.Tensor, what: str, tokenized: bool = False) -> None:
    """Refuse token ids `model` cannot embed (a raw IndexError inside its embedding otherwise), naming `what` they
    are: ids that are not integers, or outside [0, the model's vocabulary); `tokenized`: a tokenizer made them."""
    vocab = model.get_input_embeddings().num_embeddings
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"{what} must be integers, got {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        hint = (f": the tokenizer gives token ids past the model's vocabulary of {vocab}; pass the model's own "
                "tokenizer") if tokenized else ""  # fmt: skip
        raise ValueError(f"{what} must lie in [0, {vocab}) (the model's vocabulary), got {int(ids.min())} to "
                         f"{int(ids.max())}{hint}")  # fmt: skip


def check_positions(model, total: int, press, what: str, instead: str) -> None:
    """Refuse `what` reaching position `total` past the model's positions (transformers generates on with a
    'friendly reminder'), unless `press` re-rotates keys into the cache's own positions; `instead` says what to do."""
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit is not None and total > limit and (press is None or not press.rerotate):
        raise ValueError(f"{what} would reach position {total}, past the model's {limit} positions; use a press with "
                         f"rerotate=True, or {instead}")  # fmt: skip


def check_no_outer_press(model, caller: str, what: str) -> None:
    """Refuse `caller`'s press=None (a full cache) inside a press active on `model`, which would compress `what`."""
    if active_handler(model) is not None:
        raise ValueError(f"{caller}(press=None) runs inside a press active on this model, which would compress {what} "
                         "too: leave its `with` block and pass it as press=")  # fmt: skip


def check_press(press) -> None:
    """Refuse anything but a press or None where a press is expected, saying what is allowed."""
    if press is not None and not isinstance(press, BasePress):
        hint = " (a RoundPolicy is a chat policy: kvpress.ChatSession(..., round_policy=...))" \
            if type(press).__name__ == "RoundPolicy" else ""  # fmt: skip
        raise TypeError(f"press must be a kvpress press (kvpress.press_from_name('snapkv', compression_ratio=0.5), "
                        f"...) or None, got {press!r}{hint}")  # fmt: skip


def holds_whole(press: BasePress | None, context_tokens: int) -> str | None:
    """Why `press` would keep a context of `context_tokens` whole, compressing nothing (`BasePress.keeps_whole`;
    None: it compresses it, or there is no press)."""
    return press.keeps_whole(context_tokens) if isinstance(press, BasePress) else None


def check_compresses(press: BasePress | None, context_tokens: int) -> None:
    """Refuse a budget that holds the whole context of one call: nothing would be compressed."""
    if (why := holds_whole(press, context_tokens)) is not None:
        raise ValueError(f"nothing would be compressed: {why}")


@torch.no_grad()  # not inference_mode: the cache it fills stays usable outside it (a plain model.generate)
def generate(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    context: str,
    question: str,
    press: BasePress | None = None,
    max_new_tokens: int = 64,
    cache: DynamicCache | None = None,
    chat_template: bool = True,
    query_aware: bool = False,
    prefill_chunk_size: int | None = None,
) -> str:
    """Greedy answer to `question` about `context` (decoded without special tokens, whitespace around it stripped),
    with only the context compressed by `press`.

    The context is prefilled and compressed once; the question and the answer are then appended to
    the compressed cache without further eviction (pass an empty `cache=` to inspect it afterwards; one that
    holds tokens already is refused).
    `query_aware=True` prefills the question with the context, so the question's queries guide the
    scores (SnapKV's observation window; the compression serves this question only);
    the default compresses the context without seeing the question (the cache can serve any question).
    `chat_template=False` asks as a plain completion (the question's text is continued).
    `prefill_chunk_size` feeds the prefill that many tokens a forward, each evicting (see `prefill_context`).
    """
    check_press(press)
    if not isinstance(model, nn.Module) or not callable(tokenizer):
        raise TypeError(f"kvpress.generate takes a model and its tokenizer, got {type(model).__name__} and "
                        f"{type(tokenizer).__name__}")  # fmt: skip
    for name, text in (("context", context), ("question", question)):  # (whitespace was answered; a chat refuses it)
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{name} must be a string with some text, got {text!r:.40}")
    if press is None:  # (a press given here is refused as a second one)
        check_no_outer_press(model, "kvpress.generate", "the context and the answer")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not isinstance(query_aware, bool):
        raise ValueError(f"query_aware must be True or False, got {query_aware!r}")
    if press is not None and press.needs_question and not query_aware:
        raise ValueError(f"{type(press).__name__} scores by the question: it needs query_aware=True")
    if cache is not None and not isinstance(cache, DynamicCache):
        raise TypeError(f"cache must be None or an empty transformers DynamicCache (DynamicCache(config="
                        f"model.config)), got {type(cache).__name__}")  # fmt: skip
    # a cache that holds anything: the context would land after it, and the answer be read from both
    if cache is not None and any(model_access.holds_state(layer) for layer in cache.layers):
        held = max((model_access.seen_tokens(layer) or 0 for layer in cache.layers), default=0)
        what = f"{held} tokens" if held else "a linear-attention layer's states"
        raise ValueError(
            f"cache= already holds {what} (from an earlier call, or one that raised); kvpress.generate "
            "prefills the context into an empty cache: start a new cache (DynamicCache(config=model.config))"
        )
    device = model.device
    ctx_ids, q_ids = split_prompt(tokenizer, context, question, chat_template)
    check_token_ids(model, torch.cat([ctx_ids, q_ids], dim=-1), "the prompt's token ids", tokenized=True)
    ctx_ids, q_ids = ctx_ids.to(device), q_ids.to(device)
    cache = DynamicCache(config=model.config) if cache is None else cache
    ids = torch.cat([ctx_ids, q_ids], dim=-1)
    check_positions(model, ids.shape[1] + max_new_tokens, press, f"the prompt ({ids.shape[1]} tokens) and its answer",
                    "a shorter context or max_new_tokens")  # fmt: skip
    prefill = ids[:, :-1] if query_aware else ctx_ids  # generate feeds at least the last token itself
    check_compresses(press, prefill.shape[1])  # (query-aware: the question is compressed with the context)
    prefill_context(model, prefill, press, cache, tokenizer, next_ids=ids[:, -1:] if query_aware else None,
                    prefill_chunk_size=prefill_chunk_size)
    return answer_from_cache(model, tokenizer, ids, cache, press, max_new_tokens)


@torch.no_grad()
def prefill_context(
    model,
    ids: torch.Tensor,
    press: BasePress | None,
    cache: DynamicCache,
    tokenizer=None,
    next_ids=None,
    prefill_chunk_size: int | None = None,
) -> None:
    """Prefill `ids` into `cache`, compressed by `press` (none: the full cache). Presses that score the
    context with a pass of their own (`needs_whole_context`: KVzip, Lookahead) are applied once it is all
    cached; KVzip writes a prompt, so it needs `tokenizer`; Lookahead drafts from `next_ids`, the prompt
    tokens fed afterwards (query-aware prefills).

    `prefill_chunk_size` feeds `ids` that many tokens a forward (as transformers' `prefill_chunk_size` inside
    `model.generate`): the press evicts after each, so the cache never holds more than its budget plus one chunk
    and the activations are one chunk's. KVzip scores each chunk over the cache compressed so far (its
    `scores_later_chunks`); other presses that score the whole context cannot take chunks (refused)."""
    chunk = check_chunk_size(prefill_chunk_size, press)
    if press is not None and press.needs_whole_context and chunk is None:
        recording = record_prefill(model, ids, cache, next_ids, keep_hidden=press.needs_hidden)
        compress_recording(model, recording, press, tokenizer, in_place=True)
    else:
        chunk = chunk or ids.shape[1]
        with maybe_installed(press, model, tokenizer):
            for start in range(0, ids.shape[1], chunk):  # the cache is what is wanted, not logits
                model(ids[:, start : start + chunk], cache=cache, use_cache=True, logits_to_keep=1)


def check_chunk_size(size, press: BasePress | None = None) -> int | None:
    """`size` as a prefill chunk size: None (one forward) or a positive integer; anything else is refused, and so
    is any chunk for a `press` that scores the whole context once it is cached and cannot score later chunks."""
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"prefill_chunk_size must be a positive number of tokens (or None: one forward), got {size!r}")
    if press is not None and press.refuses_chunks:
        name, instead = press.chunk_refusal()
        raise ValueError(f"{name} scores the whole context once it is cached, in one pass: it cannot prefill in "
                         f"chunks (prefill_chunk_size=None, or {instead})")  # fmt: skip
    if press is not None and press.needs_whole_context and size < 2:
        raise ValueError(f"{type(press).__name__} scores each chunk of a prefill as it is fed, and a chunk of one "
                         "token is a decoding step to it, kept unscored: nothing would be compressed; use "
                         "prefill_chunk_size >= 2")  # fmt: skip
    return size


@torch.no_grad()
def answer_from_cache(model, tokenizer, ids: torch.Tensor, cache: DynamicCache, press=None, max_new_tokens=64) -> str:
    """Greedy continuation of `ids` `[1, n]`, whose first tokens `cache` already holds (compressed by
    `press` or not). The press is installed frozen: its layers are read, nothing more is evicted."""
    new = answer_ids_from_cache(model, tokenizer, ids, cache, press, max_new_tokens)
    return tokenizer.decode(new, skip_special_tokens=True).strip()


@torch.no_grad()
def answer_ids_from_cache(
    model, tokenizer, ids: torch.Tensor, cache: DynamicCache, press=None, max_new_tokens: int = 64
) -> torch.Tensor:
    """`answer_from_cache`'s generated token ids `[k]` (k <= `max_new_tokens`; an end of sequence
    included when the model stopped on one)."""
    installation = maybe_installed(press, model, tokenizer)
    with installation as installed, installed.frozen() if installed else contextlib.nullcontext():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=max_new_tokens, **greedy(tokenizer)
        )
    return out[0, ids.shape[1] :]


def greedy(tokenizer) -> dict:
    """The settings of kvpress's own `model.generate` calls over a prefilled cache (answers, chat turns, the demo):
    one greedy sequence through that cache, whatever the model's `generation_config` says (with its `use_cache`
    False the whole prompt was fed again at every step on top of the cache; beams or several sequences do not fit
    the cache's one row)."""
    return {"do_sample": False, "use_cache": True, "num_beams": 1, "num_return_sequences": 1,
            "pad_token_id": pad_token_id(tokenizer)}  # fmt: skip
