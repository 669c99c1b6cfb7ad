"""The harness's view of a server: send prompts greedily (grammar-constrained where a prompt
says so), collect output token ids."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from sglang_vericache.exactness.compare import Generation
from sglang_vericache.exactness.server import http_json


@dataclass(frozen=True, slots=True)
class Prompt:
    """One line of a prompts file: ``{"id"?, "prompt" | "input_ids", "max_new_tokens"?,
    "regex" | "json_schema" | "ebnf"?}`` (a grammar constrains the output; a JSON schema may
    be an object or its JSON text). ``grammar``: (SGLang sampling field, its string) or None."""

    id: str
    text: str | None = None
    input_ids: tuple[int, ...] | None = None
    max_new_tokens: int | None = None
    grammar: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError(f"prompt {self.id!r}: give exactly one of 'prompt' or 'input_ids'")


GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf")


def _grammar(row: dict[str, Any]) -> tuple[str, str] | None:
    given = [k for k in GRAMMAR_FIELDS if row.get(k) is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of {', '.join(GRAMMAR_FIELDS)}, got {given}")
    if not given:
        return None
    value = row[given[0]]
    return given[0], value if isinstance(value, str) else json.dumps(value)


def load_prompts(path: Path) -> list[Prompt]:
    """Read a JSONL prompt file; a bad line raises with its line number."""
    prompts = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            ids = row.get("input_ids")
            prompts.append(
                Prompt(
                    id=str(row.get("id", f"line{lineno}")),
                    text=row.get("prompt"),
                    input_ids=tuple(int(t) for t in ids) if ids is not None else None,
                    max_new_tokens=row.get("max_new_tokens"),
                    grammar=_grammar(row),
                )
            )
        except (ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}:{lineno}: {exc}") from None
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def _request(prompt: Prompt, sampling: dict[str, Any], with_top2: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"sampling_params": sampling}
    if prompt.text is not None:
        body["text"] = prompt.text
    else:
        body["input_ids"] = list(prompt.input_ids or ())
    if with_top2:
        body.update(return_logprob=True, top_logprobs_num=2, logprob_start_len=-1)
    return body


def _parse_top2(meta: dict[str, Any]) -> tuple[tuple[tuple[float, int], ...], ...] | None:
    tops = meta.get("output_top_logprobs")
    if not tops:
        return None
    return tuple(tuple((float(e[0]), int(e[1])) for e in step[:2]) for step in tops)


REQUEST_TIMEOUT_S = 1800.0  # one request at high concurrency on a loaded CPU can take minutes


def generate_one(
    url: str, prompt: Prompt, *, max_new_tokens: int, temperature: float, with_top2: bool,
    timeout: float = REQUEST_TIMEOUT_S,
) -> Generation:
    sampling = {
        "temperature": temperature,
        "max_new_tokens": prompt.max_new_tokens or max_new_tokens,
    }
    if prompt.grammar is not None:
        sampling[prompt.grammar[0]] = prompt.grammar[1]
    out = http_json(url + "/generate", _request(prompt, sampling, with_top2), timeout=timeout)
    return Generation(output_ids=tuple(out["output_ids"]), top2=_parse_top2(out["meta_info"]))


def generate_all(
    url: str,
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    concurrency: int = 1,
    with_top2: bool = False,
    timeout: float = REQUEST_TIMEOUT_S,
) -> list[Generation]:
    """Send every prompt, ``concurrency`` requests in flight; results in prompt order.
    timeout: seconds one request may take (``OSError`` past it)."""
    kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, with_top2=with_top2,
                  timeout=timeout)  # fmt: skip
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        return list(pool.map(lambda p: generate_one(url, p, **kwargs), prompts))
