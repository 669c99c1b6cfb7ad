"""The request fuzzer's built-in prompt pool (pure data, no dependencies).

Small on purpose: a handful of varied texts (code, prose, chat-formatted, JSON, lists, numbers,
other languages, odd whitespace) covers the tokenizer paths that matter, and the long prompts
are built from them by repetition so they cross the 512-token chunked-prefill size of the shared
test servers (about 600 to 1500 tokens with SmolLM2's tokenizer, ~4 characters a token).
"""

from __future__ import annotations

import random

CHAT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
)

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain recursion in one sentence.",
    "Answer yes or no: is water wet?",
)

SHORT = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village by the sea, there lived",
    '{"name": "Alice", "age": 30, "city": "',
    "1, 2, 3, 5, 8, 13, 21,",
    "Shopping list:\n- eggs\n- milk\n-",
    "La vie est belle, et le soleil",
    "Q: How many legs does a spider have?\nA:",
    "    \n\t  whitespace   \n\n and then the",
    "SELECT name, count(*) FROM users WHERE",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "a",
)

PARAGRAPHS = (
    ("The history of computing is a story of abstraction. Early machines were programmed by "
     "rewiring panels; later ones read instructions from punched cards, then from magnetic "
     "memory. Each step hid a layer of detail behind a simpler interface, so that the people "
     "using the machine could think about their problem instead of the hardware. "),
    ("import json\nimport sys\n\n\ndef load(path):\n    with open(path) as f:\n        return "
     "json.load(f)\n\n\ndef main(argv):\n    data = load(argv[1])\n    for key, value in "
     "sorted(data.items()):\n        print(f'{key}: {value}')\n    return 0\n\n\n"),
    ("User: Can you summarize the meeting notes?\nAssistant: The team agreed to ship the release "
     "on Friday, to move the database migration to next week, and to review the on-call rota. "
     "Two open questions remain: the budget for the new servers and the hiring plan.\n"),
    ("In the quiet hours before dawn, the harbour was still. Fishing boats rocked gently at their "
     "moorings, gulls slept on the breakwater, and the only sound was the slow slap of water "
     "against the stones. An old man walked along the quay, carrying a lantern and a net. "),
)


def chat(question: str) -> str:
    """A question wrapped in SmolLM2's chat template, sent as raw text to /generate."""
    return CHAT.format(q=question)


def short_prompt(rng: random.Random) -> str:
    """One short prompt: plain text most of the time, chat-formatted sometimes."""
    if rng.random() < 0.3:
        return chat(rng.choice(QUESTIONS))
    return rng.choice(SHORT)


def long_prompt(rng: random.Random) -> str:
    """About 600-1500 tokens: paragraphs repeated and interleaved, then an open end, so that
    prefill runs in several chunks and the continuation is still well-defined."""
    target = rng.randint(2600, 6000)  # characters
    picks = rng.sample(PARAGRAPHS, rng.randint(1, len(PARAGRAPHS)))
    parts: list[str] = []
    while sum(map(len, parts)) < target:
        parts.append(picks[len(parts) % len(picks)])
    return "".join(parts) + rng.choice(SHORT)
