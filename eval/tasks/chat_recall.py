"""Multi-turn recall: real human chats with facts planted in early rounds, asked about rounds later.

The conversations are the Chit Chat Challenge's (`chitchat-dataset` on PyPI, MIT, read from the
installed package at run time, never committed): consecutive messages become rounds (the first
speaker is the user, the second the assistant, whose replies are fed as they are, not generated).
Two facts (a number each) are added to user messages among the first rounds; after all the rounds
the user asks for one of them. Deterministic for a seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvpress.eval.tasks.example import Example, drawn_one_at_a_time, holds

_FACTS = (
    ("By the way, my locker code is {v}.", "What is my locker code? Answer with the number.", 10000, 99999),
    ("Also, my flight number is {v}.", "What is my flight number? Answer with the number.", 100, 999),
    ("By the way, my apartment number is {v}.", "What is my apartment number? Answer with the number.", 100, 9999),
    ("Oh, and my bike lock PIN is {v}.", "What is my bike lock PIN? Answer with the number.", 1000, 9999),
    ("By the way, my employee ID is {v}.", "What is my employee ID? Answer with the number.", 10000, 99999),
)


@dataclass(frozen=True)
class ChatExample:
    """Scripted rounds (user, assistant), then a question whose answer is `answer`."""

    rounds: tuple[tuple[str, str], ...]
    question: str
    answer: str
    fact_round: int  # the round that holds the asked fact

    def score(self, text: str) -> float:
        return whole_number_score(self.answer, text)


def whole_number_score(answer: str, text: str) -> float:
    """1 if the number `answer` appears whole in `text` (not inside a longer number, nor a decimal's: `holds`); a
    thousands separator is read as part of its number ("12,345" answers 12345, and "1,345" does not answer 345)."""
    return float(holds(answer, text))


@dataclass(frozen=True)
class TranscriptExample(Example):
    """A chat as one prompt; scored as `ChatExample` is (the number, whole)."""

    def score(self, text: str) -> float:
        return whole_number_score(self.answers[0], text)


def conversations() -> list[list[str]]:
    """Every Chit Chat Challenge conversation as its list of messages."""
    try:
        from chitchat_dataset import ConversationDataset
    except ImportError as err:
        raise ImportError(
            "the chats come from the PyPI package chitchat-dataset: pip install 'kvpress[tasks]'"
        ) from err
    return [list(c) for c in ConversationDataset()]


def chat_recall_examples(n: int, rounds: int = 10, seed: int = 0, plant_within: int = 3) -> list[ChatExample]:
    """`n` chats of `rounds` rounds; two facts planted in the first `plant_within` rounds, one asked."""
    if n < 1 or rounds < 2 or not 2 <= plant_within <= rounds - 1:
        raise ValueError(f"need n >= 1, rounds >= 2 and 2 <= plant_within < rounds, got {n}, {rounds}, {plant_within}")
    rng = random.Random(f"chat-recall-{seed}")
    pool = [c for c in conversations() if len(c) >= 2 * rounds and all(m.strip() for m in c[: 2 * rounds])]
    if n > len(pool):
        raise ValueError(f"n={n} chats of {rounds} rounds asked; the conversation pool holds {len(pool)} that long")
    out = []
    for convo in drawn_one_at_a_time(rng, pool, n):
        turns = [[convo[2 * i].strip(), convo[2 * i + 1].strip()] for i in range(rounds)]
        facts = rng.sample(_FACTS, 2)
        where = sorted(rng.sample(range(plant_within), 2))
        values = [str(rng.randint(lo, hi)) for _, _, lo, hi in facts]
        for (statement, _, _, _), r, value in zip(facts, where, values, strict=True):
            turns[r][0] = f"{turns[r][0]} {statement.format(v=value)}"
        asked = rng.randrange(2)
        out.append(ChatExample(tuple(map(tuple, turns)), facts[asked][1], values[asked], where[asked]))
    return out


def chat_recall_transcripts(tokenizer, n: int, length: int, seed: int) -> list:
    """The same chats as one prompt each (for lm-eval and sweeps, which take a context and a question):
    the rounds as a "User:/Assistant:" transcript, as many as fit in about `length` tokens (at least 4),
    then the question. The multi-turn form with a live session is `eval/bench_chat.py`."""
    out = []
    for example in chat_recall_examples(n, rounds=10, seed=seed):
        lines = [f"User: {user}\nAssistant: {reply}" for user, reply in example.rounds]
        while len(lines) > 4 and len(tokenizer("\n".join(lines)).input_ids) > length:
            lines.pop()  # drop the latest rounds: the planted ones are among the first three
        out.append(TranscriptExample(context="\n".join(lines), question=f"User: {example.question}\nAssistant:",
                           answers=(example.answer,)))  # fmt: skip
    return out
