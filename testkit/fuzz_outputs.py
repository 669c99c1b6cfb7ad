"""Read the completions out of a fuzz reply, in one shape for every endpoint (pure python).

/generate answers a dict (a list for batches and n > 1), or streams cumulative events tagged with
``index``; the OpenAI endpoints answer ``choices``, or stream per-choice deltas. The comparator
needs, per completion: token ids (when the endpoint gives them), text, a token count and the
log-probs, keyed so that two servers' answers line up position by position. Streams are folded
back into that final shape, because a ``--vericache`` server commits several tokens per step
and so chunks its stream differently; only the folded result is comparable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from testkit.fuzz import CHAT, COMPLETIONS, FuzzCase

# A log-prob table: stream name -> one {token key: log-prob} per position (None: no value).
Table = dict[str, list[dict[Any, float | None] | None]]

GENERATE_LOGPROB_KEYS = (
    "input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs",
    "input_token_ids_logprobs", "output_token_ids_logprobs",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Reply:
    """One server's answer to one case. ``status`` None: no HTTP answer (refused, reset,
    timed out, or skipped because the server was already dead); ``error`` says which.
    ``body`` is the parsed JSON, or for a stream the list of parsed events."""

    status: int | None
    body: Any = None
    error: str | None = None
    seconds: float = 0.0
    stream_error: bool = False  # a 200 stream that carried an {"error": ...} event


@dataclass(frozen=True, slots=True)
class Output:
    ids: tuple[int, ...] | None
    text: str | None
    n_tokens: int | None
    logprobs: Table = field(default_factory=dict)
    hidden: Any = None  # /generate's meta_info["hidden_states"], where asked for


def outputs(case: FuzzCase, reply: Reply) -> list[Output]:
    """The completions in a 200 reply, in index order. Raises ValueError on a shape it does
    not know (the comparator reports that as a problem, not a crash)."""
    if case.endpoint == COMPLETIONS or case.endpoint == CHAT:
        chat = case.endpoint == CHAT
        choices = _fold_openai_stream(reply.body, chat) if case.stream else _choices(reply.body)
        return [_openai_output(c, chat) for c in choices]
    items = _fold_generate_stream(reply.body) if case.stream else reply.body
    items = items if isinstance(items, list) else [items]
    return [_generate_output(item) for item in items]


def _choices(body: Any) -> list[dict]:
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        raise ValueError(f"no choices in {str(body)[:200]}")  # noqa: TRY004 (a bad reply)
    return sorted(body["choices"], key=lambda c: c.get("index", 0))


def _fold_generate_stream(events: list[dict]) -> list[dict]:
    """/generate streams cumulative events per ``index``: the last one of each is the answer."""
    last: dict[int, dict] = {}
    for ev in events:
        if isinstance(ev, dict) and "error" not in ev:
            last[int(ev.get("index", 0))] = ev
    return [last[i] for i in sorted(last)]


def _generate_output(item: Any) -> Output:
    if not isinstance(item, dict) or "output_ids" not in item:
        raise ValueError(f"no output_ids in {str(item)[:200]}")
    meta = item.get("meta_info") or {}
    ids = tuple(int(t) for t in item["output_ids"])
    table = {k: _generate_positions(meta[k]) for k in GENERATE_LOGPROB_KEYS if meta.get(k)}
    return Output(ids, item.get("text"), len(ids), table, meta.get("hidden_states"))


def _generate_positions(rows: list) -> list[dict[Any, float | None] | None]:
    """Rows are ``[lp, id, text]`` (one token a position) or lists of them (top-k a position)."""
    out: list[dict[Any, float | None] | None] = []
    for row in rows:
        if row is None:
            out.append(None)
        elif row and isinstance(row[0], list):
            out.append({int(e[1]): e[0] for e in row})
        elif row:
            out.append({int(row[1]): row[0]})
        else:
            out.append({})
    return out


def _fold_openai_stream(events: list[dict], chat: bool) -> list[dict]:
    """Concatenate per-choice deltas (text, token ids, log-probs) into whole choices."""
    merged: dict[int, dict] = {}
    for ev in events:
        for ch in (ev.get("choices") or []) if isinstance(ev, dict) else []:
            acc = merged.setdefault(int(ch.get("index", 0)), {"text": "", "logprobs": None})
            piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
            acc["text"] += piece or ""
            if ch.get("token_ids") is not None:
                acc.setdefault("token_ids", []).extend(ch["token_ids"])
            _merge_logprobs(acc, ch.get("logprobs"), chat)
    return [merged[i] for i in sorted(merged)]


def _merge_logprobs(acc: dict, lp: Any, chat: bool) -> None:
    if not isinstance(lp, dict):
        return
    if acc["logprobs"] is None:
        acc["logprobs"] = {"content": []} if chat else {"token_logprobs": [], "top_logprobs": [],
                                                         "tokens": []}  # fmt: skip
    for key, value in lp.items():
        if key in acc["logprobs"] and isinstance(value, list):
            acc["logprobs"][key].extend(value)


def _openai_output(choice: dict, chat: bool) -> Output:
    if chat and "message" in choice:  # a whole answer; a folded stream carries "text"
        text = (choice.get("message") or {}).get("content")
    else:
        text = choice.get("text")
    ids = choice.get("token_ids")
    ids = tuple(int(t) for t in ids) if isinstance(ids, list) else None
    table = _openai_table(choice.get("logprobs"), chat)
    n = len(ids) if ids is not None else len(table["token"]) if "token" in table else None
    return Output(ids, text, n, table)


def _openai_table(lp: Any, chat: bool) -> Table:
    """Chat: ``content[i] = {token, logprob, top_logprobs: [{token, logprob}]}``; completions:
    parallel ``tokens`` / ``token_logprobs`` lists and ``top_logprobs`` dicts."""
    if not isinstance(lp, dict):
        return {}
    if chat:
        content = lp.get("content") or []
        table: Table = {"token": [{c.get("token"): c.get("logprob")} for c in content]}
        tops = [{t.get("token"): t.get("logprob") for t in c.get("top_logprobs") or []}
                for c in content]  # fmt: skip
        if any(tops):
            table["top"] = tops
        return table
    tokens, values = lp.get("tokens") or [], lp.get("token_logprobs") or []
    table = {"token": [{t: v} for t, v in zip(tokens, values)]}
    if lp.get("top_logprobs"):
        table["top"] = [dict(d) if isinstance(d, dict) else None for d in lp["top_logprobs"]]
    return table
