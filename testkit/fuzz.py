"""A seeded fuzzer over SGLang's request surface (pure python: no sglang import).

``--vericache`` changes how decoding runs, not what it returns, so every request a client can
send must get the same answer from a ``--vericache`` server as from plain SGLang: the same HTTP
status, the same tokens when decoding is greedy, the same log-probs. ``generate_cases(seed, n,
vocab)`` draws ``n`` requests from ``random.Random(seed)``: /generate with text, token ids and
batches; greedy and seeded sampling; edge max_new_tokens; stops that land inside a multi-token
verify step; penalties; n > 1; regex / JSON-schema / EBNF constraints; log-probs; streaming and
client disconnects; the OpenAI endpoints; and malformed bodies (``fuzz_more.py``); hidden
states, batches with an invalid later item, sampled distributions, input embeddings, weight
updates and abort storms (``fuzz_surfaces.py``). The same
seed and vocabulary give the same cases, so a failure's case index is its reproducer.
Comparison lives in ``fuzz_compare.py``, the HTTP runner in ``fuzz_run.py``.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from testkit.fuzz_prompts import long_prompt, short_prompt

GENERATE = "/generate"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# What the comparator checks once both servers answered with the same status.
TOKENS = "tokens"  # greedy: identical output tokens (and log-probs within tolerance)
COUNT = "count"  # seeded sampling with ignore_eos: the same number of outputs and tokens
STATUS = "status"  # nothing beyond the status (disconnects, sampling that may stop early)

REGEXES = (r"(yes|no|maybe)", r"[0-9]{1,3}(\.[0-9]{1,2})?", r"[a-z]+( [a-z]+){0,4}\.",
           r"(red|green|blue), (cat|dog)")  # fmt: skip
JSON_SCHEMAS = (
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
     "age": {"type": "integer"}}, "required": ["name", "age"]},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
)  # fmt: skip
EBNFS = ('root ::= "yes" | "no"', 'root ::= digit+ ("," digit+)*\ndigit ::= [0-9]',
         'root ::= "The answer is " ("A" | "B" | "C") "."')  # fmt: skip
STOP_STRINGS = (" the", "\n", ".", ",", " and", "e", "the", "\n\n")


@dataclass(frozen=True, slots=True)
class VocabInfo:
    """What the generator needs to know about the served model.

    ``frequent_ids`` are ids of tokens such as " the" and "\\n": as stop_token_ids they fire
    often, so often inside a multi-token verify step, where a wrong trim would show.
    """

    vocab_size: int
    context_len: int
    frequent_ids: tuple[int, ...] = ()
    hidden_size: int = 0  # width of ``input_embeds`` rows (0: unknown)
    model_path: str = ""  # what the server loaded (``/update_weights_from_disk`` reloads it)

    def __post_init__(self) -> None:
        if self.vocab_size < 2 or self.context_len < 64:
            raise ValueError(f"implausible vocabulary {self}")


@dataclass(frozen=True, slots=True)
class FuzzCase:
    """One request. ``body`` is JSON-able; a ``str`` body is sent as raw bytes (bad JSON).
    ``disconnect_after``: a streaming request whose socket is closed after that many events."""

    index: int
    kind: str
    endpoint: str
    body: Any
    check: str = TOKENS
    tags: tuple[str, ...] = ()
    disconnect_after: int | None = None

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and bool(self.body.get("stream"))

    def labels(self) -> frozenset[str]:
        """Kind and tags: what ``--kinds`` / ``--exclude`` select on."""
        return frozenset((self.kind, *self.tags))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def case(kind: str, endpoint: str, body: Any, check: str = TOKENS, *tags: str,
         disconnect_after: int | None = None) -> FuzzCase:  # fmt: skip
    """A case without its index (``generate_cases`` numbers them); tags derived from the body
    are added so that a filter on e.g. ``logprob`` catches every request asking for them."""
    derived = tags_of(endpoint, body, disconnect_after)
    merged = tuple(dict.fromkeys((*tags, *derived)))
    return FuzzCase(-1, kind, endpoint, body, check, merged, disconnect_after)


def tags_of(endpoint: str, body: Any, disconnect_after: int | None = None) -> tuple[str, ...]:
    """Feature tags read off a request body (for filtering and the per-feature summary)."""
    if not isinstance(body, dict):
        return ("raw",)
    sp = body.get("sampling_params")
    sps = sp if isinstance(sp, list) else [sp if isinstance(sp, dict) else {}]
    flat = {k: v for p in [body, *[p for p in sps if isinstance(p, dict)]] for k, v in p.items()}
    tags = []
    if flat.get("return_logprob") or flat.get("logprobs") or flat.get("top_logprobs"):
        tags.append("logprob")
    if flat.get("stream"):
        tags.append("stream")
    if disconnect_after is not None:
        tags.append("disconnect")
    if any(k in flat for k in ("stop", "stop_token_ids")):
        tags.append("stop")
    if any(k in flat for k in ("frequency_penalty", "presence_penalty", "repetition_penalty")):
        tags.append("penalty")
    if any(k in flat for k in ("regex", "json_schema", "ebnf", "response_format")):
        tags.append("grammar")
    if isinstance(flat.get("n"), int) and flat["n"] > 1:
        tags.append("n")
    if isinstance(body.get("text"), list) or isinstance(body.get("prompt"), list):
        tags.append("batch")
    temp = flat.get("temperature")
    if isinstance(temp, (int, float)) and temp > 0:
        tags.append("sampled")
    if _prompt_size(body) > 2000:
        tags.append("long")
    return tuple(tags)


def _prompt_size(body: dict) -> int:
    """Characters of text, or 4 per token id: a rough size to tag prompts that chunk."""
    total = 0
    for key, scale in (("text", 1), ("prompt", 1), ("input_ids", 4)):
        value = body.get(key)
        items = value if isinstance(value, list) else [value]
        for item in items:
            total += len(item) * scale if isinstance(item, (str, list)) else 0
    return total


# -- sampling-parameter pieces -------------------------------------------------------------


def max_new(rng: random.Random) -> int:
    """Edge values 0 and 1, mostly small, sometimes 32: real decoding stays short."""
    r = rng.random()
    return 0 if r < 0.06 else 1 if r < 0.16 else rng.randint(2, 24) if r < 0.93 else 32


def greedy(rng: random.Random, **extra: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"temperature": 0, "max_new_tokens": max_new(rng)}
    if rng.random() < 0.2:
        params["ignore_eos"] = True
    if rng.random() < 0.15 and params["max_new_tokens"] > 0:
        params["min_new_tokens"] = rng.randint(1, params["max_new_tokens"])
    params.update(extra)
    return params


def sampled(rng: random.Random, **extra: Any) -> dict[str, Any]:
    """Seeded sampling with ignore_eos, so that only the token count is comparable."""
    params = {"temperature": rng.choice([0.5, 0.8, 1.0, 1.3]), "max_new_tokens": rng.randint(1, 16),
              "sampling_seed": rng.randint(0, 2**31 - 1), "ignore_eos": True}  # fmt: skip
    if rng.random() < 0.4:
        params.update(top_p=rng.choice([0.5, 0.9]), top_k=rng.choice([5, 50]))
    params.update(extra)
    return params


def random_ids(rng: random.Random, vocab: VocabInfo, n: int) -> list[int]:
    """``n`` ids, the edge values 0 and vocab-1 among them when there is room."""
    ids = [rng.randrange(vocab.vocab_size) for _ in range(n)]
    for edge in (0, vocab.vocab_size - 1):
        if len(ids) >= 3:
            ids[rng.randrange(1, len(ids))] = edge
    return ids


def logprob_fields(rng: random.Random, vocab: VocabInfo) -> dict[str, Any]:
    fields: dict[str, Any] = {"return_logprob": True}
    if rng.random() < 0.6:
        fields["top_logprobs_num"] = rng.randint(0, 5)
    if rng.random() < 0.3:
        pool = [0, vocab.vocab_size - 1, *vocab.frequent_ids]
        fields["token_ids_logprob"] = rng.sample(pool, rng.randint(1, min(3, len(pool))))
    fields["logprob_start_len"] = rng.choice([-1, -1, 0, 1, 3])
    if rng.random() < 0.2:
        fields["return_text_in_logprobs"] = True
    return fields


def sprinkle(rng: random.Random, vocab: VocabInfo, body: dict[str, Any]) -> dict[str, Any]:
    """Sometimes stream, sometimes ask for log-probs: every kind meets both."""
    if rng.random() < 0.15:
        body["stream"] = True
    if rng.random() < 0.1:
        body.update(logprob_fields(rng, vocab))
    return body


def stop_fields(rng: random.Random, vocab: VocabInfo) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    r = rng.random()
    if r < 0.7 or not vocab.frequent_ids:
        stops = rng.sample(STOP_STRINGS, rng.randint(1, 2))
        fields["stop"] = stops[0] if len(stops) == 1 and rng.random() < 0.5 else stops
    if r >= 0.5 and vocab.frequent_ids:
        fields["stop_token_ids"] = rng.sample(vocab.frequent_ids, rng.randint(1, 2))
    if rng.random() < 0.2:
        fields["no_stop_trim"] = True
    return fields


def constraint(rng: random.Random) -> dict[str, Any]:
    """One of regex / json_schema / ebnf (as sampling params)."""
    import json

    which = rng.choice(("regex", "json_schema", "ebnf"))
    if which == "regex":
        return {"regex": rng.choice(REGEXES)}
    if which == "json_schema":
        return {"json_schema": json.dumps(rng.choice(JSON_SCHEMAS))}
    return {"ebnf": rng.choice(EBNFS)}


# -- /generate kinds -------------------------------------------------------------------------


def k_greedy(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    body = {"text": short_prompt(rng), "sampling_params": greedy(rng)}
    return case("greedy", GENERATE, sprinkle(rng, vocab, body))


def k_long(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    body = {"text": long_prompt(rng),
            "sampling_params": greedy(rng, max_new_tokens=rng.randint(1, 16))}  # fmt: skip
    return case("long", GENERATE, sprinkle(rng, vocab, body))


def k_input_ids(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    n = rng.randint(600, 1100) if rng.random() < 0.1 else rng.randint(1, 48)
    body = {"input_ids": random_ids(rng, vocab, n), "sampling_params": greedy(rng)}
    return case("input_ids", GENERATE, sprinkle(rng, vocab, body))


def k_batch(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    texts = [long_prompt(rng) if rng.random() < 0.05 else short_prompt(rng)
             for _ in range(rng.randint(2, 4))]  # fmt: skip
    params: Any = greedy(rng)
    if rng.random() < 0.4:
        params = [greedy(rng) for _ in texts]
    return case("batch", GENERATE, sprinkle(rng, vocab, {"text": texts, "sampling_params": params}))


def k_sampled(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    body = {"text": short_prompt(rng), "sampling_params": sampled(rng)}
    return case("sampled", GENERATE, sprinkle(rng, vocab, body), COUNT)


def k_stop(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    params = greedy(rng, max_new_tokens=rng.randint(4, 32), **stop_fields(rng, vocab))
    body = {"text": short_prompt(rng), "sampling_params": params}
    return case("stop", GENERATE, sprinkle(rng, vocab, body))


def k_penalty(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    pen = {"frequency_penalty": rng.choice([-0.5, 0.3, 1.0, 1.5]),
           "presence_penalty": rng.choice([0.0, 0.5, 1.2]),
           "repetition_penalty": rng.choice([0.8, 1.0, 1.2, 1.5])}  # fmt: skip
    pen = {k: v for k, v in pen.items() if rng.random() < 0.7} or {"repetition_penalty": 1.3}
    is_greedy = rng.random() < 0.75
    params = greedy(rng, **pen) if is_greedy else sampled(rng, **pen)
    body = {"text": short_prompt(rng), "sampling_params": params}
    return case("penalty", GENERATE, sprinkle(rng, vocab, body), TOKENS if is_greedy else COUNT)


def k_n(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    n = rng.randint(2, 3)
    is_greedy = rng.random() < 0.6
    params = greedy(rng, n=n) if is_greedy else sampled(rng, n=n)
    body = {"text": short_prompt(rng), "sampling_params": params}
    return case("n", GENERATE, sprinkle(rng, vocab, body), TOKENS if is_greedy else COUNT)


def k_grammar(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    params = greedy(rng, max_new_tokens=rng.randint(4, 32), **constraint(rng))
    body = {"text": short_prompt(rng), "sampling_params": params}
    return case("grammar", GENERATE, sprinkle(rng, vocab, body))


def k_logprob(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    prompt = {"text": short_prompt(rng)} if rng.random() < 0.7 else {
        "input_ids": random_ids(rng, vocab, rng.randint(2, 32))}  # fmt: skip
    body = {**prompt, "sampling_params": greedy(rng), **logprob_fields(rng, vocab)}
    if rng.random() < 0.2:
        body["stream"] = True
    return case("logprob", GENERATE, body)


def k_disconnect(rng: random.Random, vocab: VocabInfo) -> FuzzCase:
    """Read one or two events of a long-running stream, then close the socket: the server
    must abort the request and free its KV (checked by the leak check at the end)."""
    params = greedy(rng, max_new_tokens=rng.randint(24, 64), ignore_eos=True)
    body = {"text": short_prompt(rng), "sampling_params": params, "stream": True}
    return case("disconnect", GENERATE, body, STATUS, disconnect_after=rng.randint(1, 2))


def build_kinds() -> tuple[tuple[str, float, Callable[[random.Random, VocabInfo], FuzzCase]], ...]:
    """(kind, weight, builder); the OpenAI, malformed and context-edge kinds are in fuzz_more,
    hidden states, invalid batch items, distributions, embeddings, weight updates and storms in
    fuzz_surfaces."""
    from testkit import fuzz_more, fuzz_surfaces

    return (
        ("greedy", 13, k_greedy), ("long", 4, k_long), ("input_ids", 6, k_input_ids),
        ("batch", 5, k_batch), ("sampled", 5, k_sampled), ("stop", 8, k_stop),
        ("penalty", 6, k_penalty), ("n", 4, k_n), ("grammar", 6, k_grammar),
        ("logprob", 8, k_logprob), ("disconnect", 4, k_disconnect),
        *fuzz_more.KINDS, *fuzz_surfaces.KINDS,
    )  # fmt: skip


def generate_cases(seed: int, n: int, vocab: VocabInfo, *, kinds: Iterable[str] = (),
                   exclude: Iterable[str] = ()) -> list[FuzzCase]:  # fmt: skip
    """``n`` cases from ``random.Random(seed)``, then filtered: ``kinds`` keeps cases whose kind
    or a tag is listed, ``exclude`` drops them. Filtering after drawing keeps every remaining
    case (and its index) the same as in the unfiltered run."""
    rng = random.Random(seed)
    table = build_kinds()
    names, weights = [t[0] for t in table], [t[1] for t in table]
    builders = {t[0]: t[2] for t in table}
    out = []
    for i in range(n):
        kind = rng.choices(names, weights)[0]
        out.append(dataclasses.replace(builders[kind](rng, vocab), index=i))
    keep, drop = frozenset(kinds), frozenset(exclude)
    return [c for c in out if (not keep or c.labels() & keep) and not c.labels() & drop]


def all_kinds() -> tuple[str, ...]:
    return tuple(t[0] for t in build_kinds())
