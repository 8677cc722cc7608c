"""`ChatSession`: a multi-turn chat that keeps its KV cache across turns and feeds only new tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvpress.pipeline import pad_token_id
from kvpress.presses.base import BasePress, maybe_installed


@dataclass(frozen=True)
class Round:
    """Token span `[start, end)` (positions among the tokens seen) of one user turn and its answer."""

    start: int
    end: int


class ChatSession:
    """A chat whose history is encoded once: each `send` prefills the new turn only, then generates.

    Parameters:
        model, tokenizer: a chat model and its tokenizer (with a chat template).
        press: applied during every turn (None: full cache). A token-level press recompresses the whole
            cache each turn; round-level presses build on `rounds`.
        max_new_tokens: the default answer length.
        system: an optional system prompt.
    """

    def __init__(self, model, tokenizer, press: BasePress | None = None, max_new_tokens: int = 256, system=None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{type(tokenizer).__name__} has no chat template; ChatSession needs one")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        self.model, self.tokenizer, self.press = model, tokenizer, press
        self.max_new_tokens = max_new_tokens
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.cache = DynamicCache(config=model.config)
        self.rounds: list[Round] = []
        self._ids: list[int] = []  # every token fed to the cache, in order
        self._pending: list[int] = []  # generated but not fed yet (the last token of the last answer)
        self._rendered = ""  # the template text that `_ids` plus `_pending` stand for

    def _render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def _new_tokens(self, messages: list[dict]) -> list[int]:
        """Ids of what the template adds after the cached history (append-only templates only)."""
        text = self._render(messages)
        if not text.startswith(self._rendered):
            raise ValueError(
                "the chat template re-renders earlier turns differently, so the cached history cannot be "
                "extended; ChatSession needs an append-only template"
            )
        delta = text[len(self._rendered) :]
        return self._pending + self.tokenizer(delta, add_special_tokens=False).input_ids

    @torch.inference_mode()
    def send(self, text: str, max_new_tokens: int | None = None, streamer=None) -> str:
        """Add a user turn, answer it greedily and return the answer. On error the session is unchanged."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("the message is empty")
        max_new_tokens = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        messages = self.messages + [{"role": "user", "content": text}]
        new = self._new_tokens(messages)
        total = len(self._ids) + len(new) + max_new_tokens
        limit = getattr(self.model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        if limit is not None and total > limit and (self.press is None or not self.press.rerotate):
            raise ValueError(
                f"this turn would reach position {total}, past the model's {limit} positions; "
                "use a press with rerotate=True, or start a new session"
            )
        ids = torch.tensor([self._ids + new], device=self.model.device)
        kwargs = dict(
            attention_mask=torch.ones_like(ids),
            cache=self.cache,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_token_id(self.tokenizer),
            streamer=streamer,
        )
        with maybe_installed(self.press, self.model):
            out = self.model.generate(ids, **kwargs)
        answer_ids = out[0, ids.shape[1] :].tolist()
        answer = self.tokenizer.decode(answer_ids, skip_special_tokens=True)
        start = len(self._ids)
        self._ids += new + answer_ids[:-1]
        self._pending = answer_ids[-1:]
        self.rounds.append(Round(start, len(self._ids)))
        self.messages = messages + [{"role": "assistant", "content": answer}]
        self._rendered = self._render(messages) + self.tokenizer.decode(answer_ids, skip_special_tokens=False)
        return answer
