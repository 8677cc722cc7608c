"""`ChatSession`: a multi-turn chat that keeps its KV cache across turns and feeds only new tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedTokenizerBase

from kvpress.engine import maybe_installed, observe
from kvpress.patches import model_access
from kvpress.patches.user_warnings import warn
from kvpress.pipeline import check_no_outer_press, check_positions, check_press, check_token_ids, greedy
from kvpress.presses.base import BasePress
from kvpress.round_store import RoundStore
from kvpress.rounds import RoundPolicy


@dataclass(frozen=True)
class Round:
    """Token span `[start, end)` (positions among the tokens seen) of one user turn and its answer."""

    start: int
    end: int


class ChatSession:
    """A chat whose history is encoded once: each `send` prefills the new turn only, then generates.

    Parameters:
        model, tokenizer: a chat model and its tokenizer (with a chat template).
        press: applied during every turn (None: full cache); a token-level press recompresses the whole
            cache each turn.
        round_policy: a `RoundPolicy` instead: whole rounds kept (the system prompt, the recent ones and
            the relevant past ones), the others parked in `store`. The session owns it: it tells the policy
            where rounds begin and end, and the policy sees every layer's attention during a turn.
        max_new_tokens: the default answer length.
        system: an optional system prompt.

    `send`'s `streamer` is any object with transformers' streamer methods `put()` and `end()` (a TextStreamer).
    """

    def __init__(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, press: BasePress | None = None,
                 max_new_tokens: int = 256, system: str | None = None,
                 round_policy: RoundPolicy | None = None) -> None:  # fmt: skip
        model_access.check_is_model(model)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{type(tokenizer).__name__} has no chat template; ChatSession needs one")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if isinstance(press, RoundPolicy):
            raise TypeError("a RoundPolicy is a chat policy, not a press: pass it as round_policy=")
        if round_policy is not None and not isinstance(round_policy, RoundPolicy):
            raise TypeError(f"round_policy must be a kvpress.RoundPolicy, got {type(round_policy).__name__}")
        if system is not None and (not isinstance(system, str) or not system.strip()):
            raise ValueError(f"system must be a system prompt with some text (or None: none), got {system!r:.40}")
        _check_one_of(press, round_policy)
        self.model, self.tokenizer, self.press, self.round_policy = model, tokenizer, press, round_policy
        self.max_new_tokens = max_new_tokens
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.cache = DynamicCache(config=model.config)
        self.rounds: list[Round] = []
        self._ids: list[int] = []  # every token fed to the cache, in order
        self._pending: list[int] = []  # generated but not fed yet (the last token of the last answer)
        self._rendered = ""  # the template text that `_ids` plus `_pending` stand for
        self.prefix_tokens = 0  # tokens of the template before the first user message (system prompt)
        self.store: RoundStore | None = None  # finished rounds out of the working cache (made by a round policy)
        self._broken = ""  # set when a turn failed after the cache had changed in a way that cannot be undone

    def _render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def new_tokens(self, messages: list[dict]) -> list[int]:
        """Ids of what the template adds after the cached history (append-only templates only)."""
        text = self._render(messages)
        if not text.startswith(self._rendered):
            raise ValueError(
                "the chat template re-renders earlier turns differently, so the cached history cannot be "
                "extended; ChatSession needs an append-only template"
            )
        delta = text[len(self._rendered) :]
        ids = self._pending + self.tokenizer(delta, add_special_tokens=False).input_ids
        check_token_ids(self.model, torch.tensor(ids, dtype=torch.long), "the turn's token ids", tokenized=True)
        return ids

    def _prefix_length(self) -> int:
        """Tokens every rendering shares before the first user message's text (system prompt, then the
        first user header)."""
        a, b = (self.tokenizer(self._render(self.messages + [{"role": "user", "content": t}]),
                               add_special_tokens=False).input_ids for t in ("1", "2"))  # fmt: skip
        return _first_difference(a, b)

    def user_text_span(self, messages: list[dict], new: list[int]) -> tuple[int, int]:
        """Where, among the `new` tokens of a turn, the last user message's own text lies (the template's
        headers around it excluded): the tokens two renderings with different texts do not share."""
        a, b = (self.new_tokens(messages[:-1] + [{"role": "user", "content": t}]) for t in ("1", "2"))
        head, tail = _first_difference(a, b), _first_difference(a[::-1], b[::-1])
        return head, max(head + 1, len(new) - tail)

    def round_spans(self, prefix: int | None = None) -> list[tuple[int, int]]:
        """`[start, end)` positions of each finished round, the prefix (system prompt) left out."""
        prefix = self.prefix_tokens if prefix is None else prefix
        return [(max(r.start, prefix), r.end) for r in self.rounds]

    def _reply_tokens(self, messages: list[dict], reply: str) -> tuple[list[int], str]:
        """Ids of the assistant turn `reply` as the template writes it after `messages`, and that text."""
        with_reply = self.tokenizer.apply_chat_template(
            messages + [{"role": "assistant", "content": reply}], tokenize=False, add_generation_prompt=False
        )
        prompt = self._render(messages)
        if not with_reply.startswith(prompt):
            raise ValueError("the chat template renders an assistant turn differently after the generation prompt")
        return self.tokenizer(with_reply[len(prompt) :], add_special_tokens=False).input_ids, with_reply

    @torch.no_grad()  # not inference_mode: `chat.cache` stays usable outside it
    def send(self, text: str, max_new_tokens: int | None = None, streamer: object | None = None,
             reply: str | None = None) -> str:
        """Add a user turn, answer it greedily and return the answer (decoded without special tokens, as kept in
        `.messages`: not stripped, where `kvpress.generate`'s answer is).

        A refused input (empty message, a turn past the model's positions) leaves the session unchanged,
        and so does an error inside the model when there is no press (the cache is cropped back); with a
        press, an error after the cache changed makes every later `send` raise (start a new session), and so does
        any error inside a turn on a model with recurrent layers (Qwen3-Next: their states can be neither cropped
        back nor told unchanged).

        `reply=` records the given assistant answer instead of generating one (a known history, or a
        benchmark's scripted turns); it is fed to the model, not generated, and returned.
        """
        if self._broken:
            raise RuntimeError(f"this session cannot go on ({self._broken}); start a new one")
        _check_one_of(self.press, self.round_policy)  # both are attributes a caller may set between turns
        if self.press is None and self.round_policy is None:  # (a press given is refused as a second one)
            check_no_outer_press(self.model, "ChatSession.send", "the chat")
        for what, given in (("message", text), ("reply", reply)):
            if given is not None and not isinstance(given, str):
                raise TypeError(f"the {what} is a string (the chat template adds the roles), got "
                                f"{type(given).__name__}")  # fmt: skip
        if text is None or not text.strip():
            raise ValueError("the message is empty")
        if reply is not None and not reply.strip():
            raise ValueError("the reply is empty")
        if reply is not None and (streamer is not None or max_new_tokens is not None):
            raise ValueError("reply= records a given answer: streamer and max_new_tokens do not apply to it")
        if streamer is not None and (isinstance(streamer, type)  # (the class: its methods are found, unbound)
                                     or not all(callable(getattr(streamer, m, None)) for m in ("put", "end"))):
            raise TypeError(f"streamer must be a transformers streamer (with put() and end(), such as TextStreamer), "
                            f"got {streamer!r:.60}")  # fmt: skip
        max_new_tokens = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        messages = self.messages + [{"role": "user", "content": text}]
        new = self.new_tokens(messages)
        reply_ids, with_reply = self._reply_tokens(messages, reply) if reply is not None else ([], "")
        total = len(self._ids) + len(new) + (len(reply_ids) if reply is not None else max_new_tokens)
        check_positions(self.model, total, self.press, "this turn", "start a new session")
        prefix = self.prefix_tokens if self.rounds else self._prefix_length()
        start = len(self._ids)
        policy = self.round_policy
        if policy is not None:
            policy.check_model(self.model)
            self.store = self.store if self.store is not None else RoundStore(device="cpu")
            policy.begin_turn(self.cache, self.round_spans(prefix), self.store, self.user_text_span(messages, new))
        try:
            installation = maybe_installed(self.press, self.model, self.tokenizer)
            with observe(self.model, policy.observe) if policy is not None else installation:
                if reply is None:
                    answer_ids = self._generate(torch.tensor([self._ids + new], device=self.model.device),
                                                max_new_tokens, streamer)  # fmt: skip
                else:
                    for part in (new, reply_ids[:-1]):
                        if part:
                            ids = torch.tensor([part], device=self.model.device)
                            self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1)
                    answer_ids = reply_ids
            end = start + len(new) + len(answer_ids) - 1
            if policy is not None:
                policy.end_turn((max(start, prefix), end))
        except BaseException as err:
            seen = [model_access.seen_tokens(layer) for layer in self.cache.layers]  # (None: recurrent states)
            advanced = [layer for layer, n in zip(self.cache.layers, seen, strict=True) if n is None or n > start]
            unchanged = self.press is None and policy is None  # nothing but appends: the turn can be undone
            if advanced and unchanged and None not in seen and all(getattr(layer, "is_croppable", False)
                                                                   for layer in advanced):  # fmt: skip
                try:  # a full cache goes back to the history before this turn
                    for layer in advanced:
                        layer.crop(start - layer.get_seq_length())
                except Exception as refused:  # (a sliding-window layer past its window holds no earlier tokens)
                    self._broken = (f"interrupted mid-turn by {type(err).__name__}: {err}; the cache could not be "
                                    f"cropped back: {refused}")  # fmt: skip
            elif advanced:  # compressed: the evicted tokens are gone, the turn cannot be undone
                self._broken = f"interrupted mid-turn by {type(err).__name__}: {err}"
            raise
        finally:
            if policy is not None:
                policy.end_turn(None)  # no-op once ended; forgets an unfinished turn
        self._ids += new + answer_ids[:-1]
        self.prefix_tokens = prefix
        self._pending = answer_ids[-1:]
        self.rounds.append(Round(start, len(self._ids)))
        self.messages = messages + [{"role": "assistant", "content": reply if reply is not None else
                                     self.tokenizer.decode(answer_ids, skip_special_tokens=True)}]  # fmt: skip
        if reply is not None:
            self._rendered = with_reply
        else:
            self._end_answer(messages, answer_ids)
        return self.messages[-1]["content"]

    def _end_answer(self, messages: list[dict], answer_ids: list[int]) -> None:
        """What the generated answer stands for in the template's text: its tokens as generated, or, where it
        ended on a stop token the template does not write there (Qwen2.5's `<|endoftext|>` where the template
        closes the turn with `<|im_end|>`), its tokens before it, the stop token left unfed. An answer the
        template writes otherwise (a special token inside it, whitespace the template trims) leaves the session
        unable to go on: said now, and by the next `send`."""
        prompt = self._render(messages)
        after = self._render(self.messages + [{"role": "user", "content": "."}])  # how the next turn renders this one
        ends = [answer_ids]
        if answer_ids and answer_ids[-1] in self.tokenizer.all_special_ids:
            ends.append(answer_ids[:-1])
        for fed in ends:
            rendered = prompt + self.tokenizer.decode(fed, skip_special_tokens=False)
            if after.startswith(rendered):
                self._rendered, self._pending = rendered, self._pending if fed is answer_ids else []
                return
        self._rendered = prompt + self.tokenizer.decode(answer_ids, skip_special_tokens=False)
        self._broken = (f"the answer's tokens {self.tokenizer.convert_ids_to_tokens(answer_ids)[-8:]} (the last 8) "
                        "are not what the chat template writes for it in the next turn, so the cached history "
                        "cannot be extended")  # fmt: skip
        warn(f"{self._broken}: this answer is returned and kept in .messages; start a new session to go "
             "on")  # fmt: skip

    def _generate(self, ids: torch.Tensor, max_new_tokens: int, streamer) -> list[int]:
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=self.cache,
            max_new_tokens=max_new_tokens,
            streamer=streamer,
            **greedy(self.tokenizer),
        )
        return out[0, ids.shape[1] :].tolist()


def _first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first position where `a` and `b` differ (the shorter length if one extends the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _check_one_of(press, round_policy) -> None:
    """A press (one a chat can run every turn), a round policy, or neither; not both."""
    if press is not None and round_policy is not None:
        raise ValueError("give press= or round_policy=, not both (a round policy compresses each round with "
                         "its inner= press)")  # fmt: skip
    check_press(press)
    if press is not None and press.needs_whole_context:
        raise ValueError(f"{type(press).__name__} compresses the first prompt of a cache, in a pass over all of it: "
                         "a chat's later turns cannot be scored that way; use a press that scores tokens as they "
                         "are cached (kvzap, snapkv, ...)")  # fmt: skip
