#!/usr/bin/env python3
"""Replay agent sessions (from ``agentic_workload.py``) against an OpenAI-compatible server
and measure time to first token (TTFT) and end-to-end latency per turn.

For each session the turns are sent one after another to ``/v1/chat/completions``
(stream=True, temperature 0, ``--max-tokens``; with ``--json-tool-calls`` each answer is
constrained to a JSON tool call by a JSON schema, as agent frameworks do); the server's answer
is appended to the history before the next turn, as an agent would. Sessions run one at a time unless
``--concurrency`` > 1 (then whole sessions run in parallel threads; turns within a session
stay sequential). Standard library only; a progress bar if ``tqdm`` is installed.

    python scripts/replay_agentic.py sessions.jsonl --url http://127.0.0.1:30000 \\
        --max-tokens 64 -o results.json
    python scripts/replay_agentic.py --compare baseline.json vericache.json

Output JSON: {"meta": {...}, "turns": [{"session_id", "turn", "kind", "ttft_s", "e2e_s",
"prompt_tokens", "completion_tokens", "cached_tokens", "worker", "reuse", "finish_reason",
"output_sha256", "output"?, "error"}], "summary": {"by_turn": {k: {...}}, "all": {...}}}.
``reuse`` = (previous turn's prompt + completion tokens) / this prompt's tokens;
``cached_tokens`` is filled only when SGLang runs with ``--enable-cache-report``; ``worker`` only
through SGLang's gateway (the replica it routed the turn to).
``--compare`` prints per-turn median TTFT/E2E ratios and whether the outputs are identical.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import statistics
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

ROUTED_WORKER_HEADER = "x-smg-routed-worker-id"  # smg names the worker it chose


def stream_chat(url: str, body: dict, timeout: float,
                headers: dict[str, str] | None = None) -> Iterator[tuple[float, dict]]:
    """POST ``body`` to ``url`` and yield (arrival time, parsed SSE event) until [DONE];
    ``headers``, when given, receives the response's headers (names in lower case)."""
    u = urllib.parse.urlsplit(url)
    conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(u.hostname or "127.0.0.1", u.port, timeout=timeout)
    try:
        payload = json.dumps(body).encode()
        conn.request("POST", u.path or "/", body=payload,
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        resp = conn.getresponse()
        if headers is not None:
            headers.update((k.lower(), v) for k, v in resp.getheaders())
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read(2000).decode(errors='replace')}")
        while True:
            raw = resp.readline()
            if not raw:
                return
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return
            yield time.perf_counter(), json.loads(data)
    finally:
        conn.close()


def run_turn(args: argparse.Namespace, messages: list[dict], tools: list[dict],
             url: str) -> dict:
    body: dict[str, Any] = {
        "model": args.model, "messages": messages, "stream": True, "temperature": 0,
        "max_tokens": args.max_tokens, "stream_options": {"include_usage": True},
    }
    if args.send_tools and tools:
        body["tools"] = tools
    if args.json_tool_calls and tools:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "tool_call", "schema": tool_call_schema(tools)}}
    if args.ignore_eos:
        body["ignore_eos"] = True  # SGLang extension: fixed-length answers
    start = time.perf_counter()
    ttft = None
    pieces: list[str] = []
    usage: dict = {}
    finish = None
    headers: dict[str, str] = {}
    for t, event in stream_chat(url.rstrip("/") + "/v1/chat/completions", body,
                                args.timeout, headers):
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices") or []:
            text = (choice.get("delta") or {}).get("content") or ""
            if text:
                if ttft is None:
                    ttft = t - start
                pieces.append(text)
            finish = choice.get("finish_reason") or finish
    end = time.perf_counter()
    if finish is None:  # a complete stream names why it ended; a cut one (a dead server) does not
        raise RuntimeError(f"the stream ended without a finish_reason after {len(pieces)} pieces")
    output = "".join(pieces)
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": ttft, "e2e_s": end - start, "finish_reason": finish,
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "cached_tokens": details.get("cached_tokens"),
        # SGLang's gateway names the replica it routed to; None straight to a server
        "worker": headers.get(ROUTED_WORKER_HEADER),
        "output": output, "output_sha256": hashlib.sha256(output.encode()).hexdigest(),
    }


def tool_call_schema(tools: list[dict]) -> dict:
    """JSON schema of one call, ``{"tool": NAME, "arguments": {...}}``, to one of ``tools``
    (OpenAI function schemas): the format the sessions' system prompt asks the agent for."""
    calls = [{"type": "object", "required": ["tool", "arguments"], "properties": {
        "tool": {"const": t["function"]["name"]}, "arguments": t["function"]["parameters"]}}
        for t in tools]  # fmt: skip
    return {"anyOf": calls}


def run_session(args: argparse.Namespace, session: dict, on_turn,  # type: ignore
                epoch: float = 0.0) -> list[dict]:
    """Every turn of ``session`` in order; ``on_turn(row)`` after each. A turn whose request
    fails is sent again up to ``args.retries`` times, ``args.retry_wait_s`` seconds later,
    doubling each time (an agent retries; a gateway cannot resend a stream that broke midway):
    its ``ttft_s`` / ``e2e_s`` count from the first attempt, and ``start_s`` is that attempt's
    start, in seconds after ``epoch`` (a ``perf_counter`` value)."""
    history = [dict(m) for m in session["messages"]]
    rows: list[dict] = []
    prev_total = None
    for k, turn in enumerate(session["turns"][: args.turns]):
        if k and args.think_s:
            time.sleep(args.think_s)  # the agent runs its tools before the next turn
        history.extend(dict(m) for m in turn["append"])
        row: dict[str, Any] = {"session_id": session["session_id"], "turn": k,
                               "kind": turn.get("kind")}
        first = time.perf_counter()
        row["start_s"] = round(first - epoch, 4)
        error = None
        for attempt in range(args.retries + 1):
            began = time.perf_counter()
            try:
                # several --url: replicas without session affinity, turn k on url k mod n
                url = args.url[k % len(args.url)]
                result = run_turn(args, history, session.get("tools", []), url)
            except Exception as exc:  # noqa: BLE001 - recorded per turn; sent again or stops
                error = f"{type(exc).__name__}: {exc}"
                if attempt < args.retries:  # backing off: 1x, 2x, 4x ... --retry-wait-s
                    time.sleep(args.retry_wait_s * 2**attempt)
                continue
            late = began - first  # the failed attempts' time counts: the agent waited it
            result["e2e_s"] += late
            if result["ttft_s"] is not None:
                result["ttft_s"] += late
            row.update(result, attempts=attempt + 1)
            break
        else:
            row.update(error=error, attempts=args.retries + 1)
            rows.append(row)
            on_turn(row)
            break  # the session stops: its history would lack this answer
        p, c = row["prompt_tokens"], row["completion_tokens"]
        row["reuse"] = round(prev_total / p, 4) if prev_total and p else None
        prev_total = p + c if p is not None and c is not None else None
        history.append({"role": "assistant", "content": row["output"]})
        if not args.save_text:
            del row["output"]
        rows.append(row)
        on_turn(row)
    return rows


def _stats(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    values = sorted(values)
    return {"n": len(values), "mean": statistics.fmean(values),
            "median": statistics.median(values),
            "p90": values[min(len(values) - 1, int(0.9 * len(values)))],
            "max": values[-1]}


def summarize(rows: list[dict]) -> dict:
    ok = [r for r in rows if "error" not in r]
    by_turn: dict[str, dict] = {}
    for k in sorted({r["turn"] for r in ok}):
        rs = [r for r in ok if r["turn"] == k]
        by_turn[str(k)] = {"ttft_s": _stats([r["ttft_s"] for r in rs if r["ttft_s"] is not None]),
                           "e2e_s": _stats([r["e2e_s"] for r in rs]),
                           "reuse": _stats([r["reuse"] for r in rs if r.get("reuse")])}
    return {"by_turn": by_turn, "errors": len(rows) - len(ok),
            "all": {"ttft_s": _stats([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
                    "e2e_s": _stats([r["e2e_s"] for r in ok])}}


def compare(path_a: str, path_b: str) -> int:
    a, b = (json.load(open(p, encoding="utf-8")) for p in (path_a, path_b))
    rows_b = {(r["session_id"], r["turn"]): r for r in b["turns"]}
    same = diff = 0
    for r in a["turns"]:
        other = rows_b.get((r["session_id"], r["turn"]))
        if other and "error" not in r and "error" not in other:
            same += r["output_sha256"] == other["output_sha256"]
            diff += r["output_sha256"] != other["output_sha256"]
    print(f"outputs identical: {same}/{same + diff}")
    cols = ("turn", "ttft A", "ttft B", "B/A", "e2e A", "e2e B", "B/A")
    print(" ".join(f"{c:>{w}}" for c, w in zip(cols, (4, 9, 9, 6, 9, 9, 6))))
    for k, sa in a["summary"]["by_turn"].items():
        sb = b["summary"]["by_turn"].get(k)
        if not sb or not sa["ttft_s"]["n"] or not sb["ttft_s"]["n"]:
            continue
        ta, tb = sa["ttft_s"]["median"], sb["ttft_s"]["median"]
        ea, eb = sa["e2e_s"]["median"], sb["e2e_s"]["median"]
        print(f"{k:>4} {ta:9.3f} {tb:9.3f} {tb / ta:6.2f} {ea:9.3f} {eb:9.3f} {eb / ea:6.2f}")
    return 0 if diff == 0 else 1


def replay(args: argparse.Namespace, sessions: list[dict], on_turn,  # type: ignore
           epoch: float | None = None) -> dict:
    """Every session, ``args.concurrency`` at a time; ``on_turn(row)`` after each turn (from the
    sessions' threads); rows' ``start_s`` count from ``epoch`` (a ``perf_counter`` value; now
    when None). The output JSON's object (see the module docstring)."""
    started = time.time()
    epoch = time.perf_counter() if epoch is None else epoch
    with ThreadPoolExecutor(max_workers=max(1, args.concurrency)) as pool:
        per_session = list(pool.map(lambda s: run_session(args, s, on_turn, epoch), sessions))
    rows = [r for rs in per_session for r in rs]
    return {
        "meta": {"url": args.url, "model": args.model, "max_tokens": args.max_tokens,
                 "input": args.input, "sessions": len(sessions),
                 "turns": sum(len(s["turns"][: args.turns]) for s in sessions),
                 "concurrency": args.concurrency, "send_tools": args.send_tools,
                 "started_unix": started, "wall_s": time.time() - started},
        "turns": rows, "summary": summarize(rows),
    }


def build_parser() -> argparse.ArgumentParser:
    """The command line; ``build_parser().parse_args([...])`` is also the options object
    ``replay`` and ``run_session`` read, for callers in-process."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("input", nargs="?", help="sessions JSONL from agentic_workload.py")
    p.add_argument("--url", nargs="+", default=["http://127.0.0.1:30000"],
                   help="server URL; several = replicas, turn k of a session goes to URL k mod n")
    p.add_argument("--model", default="default")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--sessions", type=int, default=None, help="replay only the first N")
    p.add_argument("--turns", type=int, default=None, help="replay only the first N turns")
    p.add_argument("--concurrency", type=int, default=1, help="sessions in flight at once")
    p.add_argument("--think-s", type=float, default=0.0,
                   help="seconds between a turn's answer and the next turn (tool execution)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request socket timeout")
    p.add_argument("--retries", type=int, default=0,
                   help="times a failed turn is sent again before its session stops")
    p.add_argument("--retry-wait-s", type=float, default=1.0,
                   help="seconds before the first retry, doubling for each next one")
    p.add_argument("--send-tools", action="store_true",
                   help="also send the tool schemas in the request's 'tools' field")
    p.add_argument("--json-tool-calls", action="store_true",
                   help="constrain every answer to a JSON tool call (response_format json_schema)")
    p.add_argument("--ignore-eos", action="store_true", help="SGLang: always emit max tokens")
    p.add_argument("--save-text", action="store_true", help="keep each answer in the output")
    p.add_argument("-o", "--output", default="-", help="results JSON path, '-' for stdout")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                   help="compare two result files instead of replaying")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.input:
        p.error("input JSONL is required (or use --compare)")
    with open(args.input, encoding="utf-8") as f:
        sessions = [json.loads(line) for line in f if line.strip()]
    sessions = sessions[: args.sessions]
    total = sum(len(s["turns"][: args.turns]) for s in sessions)

    lock = threading.Lock()
    try:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="turn", file=sys.stderr)
    except ImportError:
        bar = None

    def tick(row: dict) -> None:
        if bar is not None:
            with lock:
                bar.update(1)

    result = replay(args, sessions, tick)
    if bar is not None:
        bar.close()
    text = json.dumps(result, indent=1)
    if args.output == "-":
        print(text)
    else:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    errors, rows = result["summary"]["errors"], result["turns"]
    print(f"{len(rows) - errors}/{total} turns ok, {errors} errors, "
          f"median TTFT {result['summary']['all']['ttft_s'].get('median')}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
