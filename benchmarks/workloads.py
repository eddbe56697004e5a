"""Deterministic prompt sets shared by the benchmarks (offline throughput, HTTP serving).

Every prompt is a single user message, composed from fixed lists of topics and sentences with a
seeded RNG and rendered with the model's chat template (``add_generation_prompt=True``). A
candidate is kept only if its rendered length lies in ``[PROMPT_MIN_TOKENS, PROMPT_MAX_TOKENS]``
for the given tokenizer, so the same seed and tokenizer always give the same prompts, and the
first ``n`` prompts of a longer set equal a set of ``n``.

Workloads (both ``ignore_eos``, greedy):

- ``uniform``: 32 chat prompts of 60-130 tokens, 128 new tokens each;
- ``mixed``: 64 chat prompts, new tokens drawn uniformly in [16, 512] by ``random.Random(0)``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

PROMPT_MIN_TOKENS = 60
PROMPT_MAX_TOKENS = 130
PROMPT_SEED = 1234
UNIFORM_NUM_PROMPTS = 32
UNIFORM_MAX_NEW_TOKENS = 128
MIXED_NUM_PROMPTS = 64
MIXED_MIN_NEW_TOKENS = 16
MIXED_MAX_NEW_TOKENS = 512
MIXED_SEED = 0
WORKLOADS = ("uniform", "mixed")

Messages = list[dict[str, str]]

TOPICS: tuple[str, ...] = (
    "photosynthesis",
    "compound interest",
    "the French Revolution",
    "black holes",
    "sourdough bread",
    "machine learning",
    "the water cycle",
    "vaccines",
    "plate tectonics",
    "the Roman Empire",
    "climate change",
    "public speaking",
    "chess openings",
    "the stock market",
    "healthy sleep habits",
    "electric cars",
    "the human immune system",
    "renewable energy",
    "learning a new language",
    "the history of the internet",
    "composting at home",
    "how airplanes fly",
    "time management",
    "the Moon landing",
)
OPENERS: tuple[str, ...] = (
    "I'm a high school teacher preparing a lesson about {topic}.",
    "My younger brother asked me about {topic} yesterday and I could not answer him.",
    "I have been reading about {topic} for a few weeks now.",
    "Our book club decided that next month's theme is {topic}.",
    "I am writing a blog post for beginners on {topic}.",
    "At work we had a long discussion about {topic} during lunch.",
    "I keep hearing people mention {topic}, but I never really understood it.",
    "I need to give a five minute presentation on {topic} next Friday.",
)
CONTEXTS: tuple[str, ...] = (
    "Most of the articles I found online are either too technical or too shallow.",
    "I learn best with concrete examples and simple comparisons.",
    "My audience has no background in science or economics.",
    "I would like to understand the main ideas before going into the details.",
    "English is my second language, so please use clear and simple sentences.",
    "I only have about ten minutes a day to study this.",
    "Last time I tried, I got confused by all the unfamiliar words.",
    "A friend told me that the usual explanation is actually misleading.",
    "I want to be able to explain it to someone else afterwards.",
)
REQUESTS: tuple[str, ...] = (
    "Could you explain {topic} in plain words?",
    "Can you write a short summary of the key facts about {topic}?",
    "Please list three common misconceptions about {topic} and correct each of them.",
    "What are the most important things a beginner should know about {topic}?",
    "Could you give me a step by step explanation of {topic}?",
    "Can you suggest a simple analogy that makes {topic} easy to remember?",
    "Please write a few quiz questions about {topic}, with answers.",
)
CONSTRAINTS: tuple[str, ...] = (
    "Please keep the answer under two hundred words.",
    "Use an example from everyday life.",
    "Avoid jargon where you can.",
    "Finish with one sentence that sums everything up.",
    "A short bulleted list would be perfect.",
    "Feel free to mention a good book or website for further reading.",
)


@dataclass(frozen=True)
class Request:
    """One benchmark request: the rendered prompt, its token budget and its source messages."""

    prompt_token_ids: list[int]
    max_new_tokens: int
    messages: Messages = field(default_factory=list)


def _compose(rng: random.Random) -> str:
    """One natural-ish user request: opener, 1-4 context sentences, request, 0-2 constraints."""
    topic = rng.choice(TOPICS)
    parts = [rng.choice(OPENERS).format(topic=topic)]
    parts += rng.sample(CONTEXTS, rng.randint(1, 4))
    parts.append(rng.choice(REQUESTS).format(topic=topic))
    parts += rng.sample(CONSTRAINTS, rng.randint(0, 2))
    return " ".join(parts)


def render_chat(tokenizer: Any, messages: Messages) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template, ready to answer."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def chat_messages(tokenizer: Any, count: int, seed: int = PROMPT_SEED) -> list[Messages]:
    """``count`` distinct single-turn chats whose rendered prompts have 60-130 tokens."""
    rng = random.Random(seed)
    chats: list[Messages] = []
    seen: set[str] = set()
    for _ in range(count * 1000):
        if len(chats) == count:
            return chats
        text = _compose(rng)
        if text in seen:
            continue
        messages = [{"role": "user", "content": text}]
        if PROMPT_MIN_TOKENS <= len(render_chat(tokenizer, messages)) <= PROMPT_MAX_TOKENS:
            seen.add(text)
            chats.append(messages)
    if len(chats) < count:
        raise RuntimeError(f"could only compose {len(chats)} of {count} prompts in range")
    return chats


def _requests(tokenizer: Any, budgets: list[int]) -> list[Request]:
    chats = chat_messages(tokenizer, len(budgets))
    return [
        Request(render_chat(tokenizer, messages), budget, messages)
        for messages, budget in zip(chats, budgets, strict=True)
    ]


def uniform_workload(tokenizer: Any) -> list[Request]:
    """32 chat prompts of 60-130 tokens, 128 new tokens each."""
    return _requests(tokenizer, [UNIFORM_MAX_NEW_TOKENS] * UNIFORM_NUM_PROMPTS)


def mixed_new_tokens(count: int = MIXED_NUM_PROMPTS) -> list[int]:
    """The mixed workload's budgets: uniform integers in [16, 512] from ``Random(0)``."""
    rng = random.Random(MIXED_SEED)
    return [rng.randint(MIXED_MIN_NEW_TOKENS, MIXED_MAX_NEW_TOKENS) for _ in range(count)]


def mixed_workload(tokenizer: Any) -> list[Request]:
    """64 chat prompts of 60-130 tokens with 16-512 new tokens each (fixed seed)."""
    return _requests(tokenizer, mixed_new_tokens())


def build_workload(
    name: str,
    tokenizer: Any,
    num_prompts: int | None = None,
    max_new_tokens: int | None = None,
) -> list[Request]:
    """A named workload, optionally cut to its first ``num_prompts`` requests and with every
    budget capped at ``max_new_tokens`` (both overrides are for quick runs and tests)."""
    builders = {"uniform": uniform_workload, "mixed": mixed_workload}
    if name not in builders:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    requests = builders[name](tokenizer)
    if num_prompts is not None:
        requests = requests[:num_prompts]
    if max_new_tokens is not None:
        requests = [
            Request(r.prompt_token_ids, min(r.max_new_tokens, max_new_tokens), r.messages)
            for r in requests
        ]
    return requests
