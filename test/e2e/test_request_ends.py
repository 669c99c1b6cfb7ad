"""Every way a request can end under ``--vericache`` leaves no per-request state behind.

One ``--vericache`` server with a small KV budget, then requests that end each way: finished
after decoding, finished at prefill (``max_new_tokens`` 1), aborted while queued and mid-decode
(``/abort_request`` by rid, and a streamed request whose client hangs up), and more long outputs
at once than the budget holds (queued; retracted where SGLang's admission, which reserves for
``max_new_tokens``, lets the budget run out: counted, not required). Each ends through the scheduler's request table
(``requests/table.py``: one ``close`` tells every holder of per-request state), which the worker
publishes: ``vericache:tracked_requests`` (live records) and ``vericache:request_entries`` (the
entries each holder keeps: the worker's book, the offload ledger's rows and admission asks,
drafting ahead, the tier link, ...). Once the server is idle every one of them must be 0. The
srt-level version, over SGLang's pool without a server and with a retraction, is
``test/srt/test_request_close.py``.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sglang_vericache.exactness.server import SGLangServer, http_json

pytestmark = [pytest.mark.sglang, pytest.mark.model, pytest.mark.timeout(1800)]

BUDGET_TOKENS = 1536  # a few long requests' full KV: more at once queue, or retract
PROMPT = "Write a long story about a lighthouse keeper and the ships she guides home.\n"
LONG = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}
# decoded plainly (min_new_tokens: logit processing): their full KV stays in the pool, as plain
# SGLang's does, so the budget runs out mid-decode and SGLang retracts (drafted rows' full KV
# moves to host memory)
LONG_PLAIN = {**LONG, "min_new_tokens": 1}


@pytest.fixture(scope="module")
def tight_server(default_model_path: Path, tmp_path_factory) -> Iterator[SGLangServer]:
    args = ["--max-total-tokens", str(BUDGET_TOKENS), "--chunked-prefill-size", "256",
            "--vericache", "--vericache-draft-len", "4", "--enable-metrics"]  # fmt: skip
    log = tmp_path_factory.mktemp("request_ends") / "server.log"
    with SGLangServer(args, log_path=log) as server:
        yield server


def _metrics(url: str) -> dict[str, float]:
    """``/metrics`` samples by full name (labels included)."""
    with urllib.request.urlopen(url + "/metrics", timeout=60) as resp:
        lines = resp.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in lines if line and not line.startswith("#")}  # fmt: skip


def _sum(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def _state_when_idle(url: str, timeout: float = 120.0) -> dict[str, float]:
    """Every ``vericache:request_entries`` sample and ``vericache:tracked_requests``, once the
    scheduler runs and queues nothing and they are all 0, or whatever they are at timeout."""
    deadline = time.monotonic() + timeout
    while True:
        samples = _metrics(url)
        busy = _sum(samples, "sglang:num_running_reqs") + _sum(samples, "sglang:num_queue_reqs")
        state = {k: v for k, v in samples.items()
                 if k.startswith(("vericache:request_entries", "vericache:tracked_requests"))}
        if (busy == 0 and state and not any(state.values())) or time.monotonic() > deadline:
            return state
        time.sleep(1.0)


def _generate(server: SGLangServer, sampling: dict[str, Any], rid: str | None = None,
              text: str = PROMPT) -> dict[str, Any]:  # fmt: skip
    body: dict[str, Any] = {"text": text, "sampling_params": sampling}
    if rid is not None:
        body["rid"] = rid
    return http_json(server.url + "/generate", body)


def _finish_type(server: SGLangServer, sampling: dict[str, Any], rid: str) -> str:
    """How ``rid`` finished: SGLang's finish reason type; an HTTP error (an abort answered with
    an error status) counts as "abort"."""
    try:
        return _generate(server, sampling, rid)["meta_info"]["finish_reason"]["type"]
    except urllib.error.HTTPError:
        return "abort"


def _abort(server: SGLangServer, rid: str) -> None:
    http_json(server.url + "/abort_request", {"rid": rid})


def _stream_then_hang_up(server: SGLangServer, chunks: int) -> int:
    """A streamed request whose client closes the connection after ``chunks`` chunks (SGLang
    aborts a request whose client is gone). Returns the chunks read."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    body = json.dumps({"text": PROMPT, "sampling_params": LONG, "stream": True})
    conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    read = 0
    while read < chunks:
        line = resp.readline()
        if not line:
            break
        read += line.startswith(b"data:")
    conn.close()
    return read


def test_requests_ended_every_way_leave_no_state(tight_server: SGLangServer) -> None:
    server = tight_server
    # finished after decoding, and finished at prefill (its first token is its last)
    assert len(_generate(server, {"temperature": 0, "max_new_tokens": 24})["output_ids"]) == 24
    for text in ("Once upon a time", "def main():", PROMPT):
        one = _generate(server, {"temperature": 0, "max_new_tokens": 1}, text=text)
        assert len(one["output_ids"]) == 1
    # sampled, penalized (drafted) and plainly decoded (min_new_tokens) rows end the same way
    _generate(server, {"temperature": 0.8, "max_new_tokens": 16, "sampling_seed": 7})
    _generate(server, {"temperature": 0, "max_new_tokens": 16, "repetition_penalty": 1.2})
    _generate(server, {"temperature": 0, "max_new_tokens": 16, "min_new_tokens": 2})

    # more long outputs at once than the budget holds: some wait in the queue (aborted there
    # by rid), one is aborted mid-decode, one's client hangs up, the rest run; decoding past
    # the budget retracts requests (SGLang re-queues them) until they fit
    rids = [f"ends-{i}" for i in range(8)]
    with ThreadPoolExecutor(len(rids) + 1) as pool:
        outs = {rid: pool.submit(_finish_type, server, LONG_PLAIN if i % 2 else LONG, rid)
                for i, rid in enumerate(rids)}  # fmt: skip
        hung_up = pool.submit(_stream_then_hang_up, server, 3)
        time.sleep(3.0)  # the first are decoding, the last still queued
        _abort(server, rids[-1])  # queued
        _abort(server, rids[-2])  # queued
        _abort(server, rids[0])  # mid-decode (the first admitted)
        assert hung_up.result(timeout=900) >= 1
        reasons = {rid: future.result(timeout=1200) for rid, future in outs.items()}
    assert reasons[rids[-1]] == reasons[rids[-2]] == reasons[rids[0]] == "abort", reasons
    assert all(reasons[rid] == "length" for rid in rids[1:-2]), reasons

    # a burst aborted at once: before admission, while matching a prefix, at prefill
    burst = [f"burst-{i}" for i in range(4)]
    with ThreadPoolExecutor(len(burst)) as pool:
        futures = [pool.submit(_finish_type, server, LONG, rid) for rid in burst]
        time.sleep(0.3)
        for rid in burst:
            _abort(server, rid)
        for future in futures:
            future.result(timeout=900)

    # SGLang admits against max_new_tokens, so a retraction here depends on timing; the
    # retraction path is driven directly over SGLang's pool in test/srt/test_request_close.py
    retracted = _sum(_metrics(server.url), "sglang:num_retracted_requests_total")
    state = _state_when_idle(server.url)
    assert state and not any(state.values()), state
    # the server still serves, and is idle again afterwards
    assert len(_generate(server, {"temperature": 0, "max_new_tokens": 8})["output_ids"]) == 8
    state = _state_when_idle(server.url)
    assert state and not any(state.values()), state
    print(f"idle state {state}; {retracted:.0f} requests retracted")
