"""scripts/agentic_workload.py and scripts/replay_agentic.py: determinism, OpenAI message
format, ~90% prefix reuse, and a replay against a real local HTTP server speaking the
OpenAI streaming protocol (a stand-in for SGLang: answers derived from the prompt)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _load(name: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def workload():  # type: ignore[no-untyped-def]
    return _load("agentic_workload")


def _generate(workload, tmp_path, *args: str) -> list[dict]:  # type: ignore[no-untyped-def]
    out = tmp_path / f"s{abs(hash(args))}.jsonl"
    assert workload.main([*args, "-o", str(out)]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_generator_is_deterministic_and_seeded(workload, tmp_path):
    a = _generate(workload, tmp_path, "--sessions", "2", "--turns", "3", "--seed", "7")
    b = _generate(workload, tmp_path, "--sessions", "2", "--turns", "3", "--seed", "7")
    c = _generate(workload, tmp_path, "--sessions", "2", "--turns", "3", "--seed", "8")
    assert a == b and a != c


def test_sessions_are_openai_chat_with_about_90_percent_reuse(workload, tmp_path):
    sessions = _generate(workload, tmp_path, "--sessions", "4", "--turns", "6",
                         "--system-tokens", "1000", "--answer-tokens", "50")
    count = workload.heuristic_tokens
    system = sessions[0]["messages"][0]
    assert all(s["messages"] == [system] for s in sessions)  # shared agent system prompt
    assert system["role"] == "system" and '"read_file"' in system["content"]
    assert 950 <= count(system["content"]) <= 1050
    for s in sessions:
        assert s["format"] == "vericache-agentic/1" and len(s["turns"]) == 6
        assert s["token_counter"] == "heuristic-pretokens"
        assert all(t["function"]["parameters"]["type"] == "object" for t in s["tools"])
        history = count(system["content"])
        for k, turn in enumerate(s["turns"]):
            (msg,) = turn["append"]
            assert msg["role"] == "user" and isinstance(msg["content"], str)
            assert turn["tokens"] == count(msg["content"])
            if k:  # with 50-token answers: reuse = old history / new history
                assert 0.87 <= history / (history + turn["tokens"]) <= 0.93
            history += turn["tokens"] + 50


class _FakeChat(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[list[dict]] = []

    def log_message(self, *args) -> None:  # type: ignore[no-untyped-def]
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/v1/chat/completions"
        assert body["stream"] is True and body["temperature"] == 0
        _FakeChat.seen.append(body["messages"])
        text = "".join(m["content"] for m in body["messages"])
        words = [hashlib.sha1(f"{text}{i}".encode()).hexdigest()[:4] + " "
                 for i in range(body["max_tokens"])]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("X-SMG-Routed-Worker-Id", "http://replica-a")  # as SGLang's gateway
        self.send_header("Connection", "close")
        self.end_headers()
        events = [{"choices": [{"delta": {"content": w}, "finish_reason": None}]} for w in words]
        events.append({"choices": [{"delta": {}, "finish_reason": "length"}]})
        events.append({"choices": [], "usage": {"prompt_tokens": len(text) // 4,
                                                "completion_tokens": len(words)}})
        for ev in events:
            self.wfile.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")


def test_replay_appends_answers_and_measures_each_turn(workload, tmp_path):
    replay = _load("replay_agentic")
    sessions = tmp_path / "s.jsonl"
    assert workload.main(["--sessions", "2", "--turns", "3", "--system-tokens", "900",
                          "-o", str(sessions)]) == 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeChat)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _FakeChat.seen = []
    try:
        out = tmp_path / "r.json"
        rc = replay.main([str(sessions), "--url", f"http://127.0.0.1:{server.server_port}",
                          "--max-tokens", "5", "--save-text", "-o", str(out)])
    finally:
        server.shutdown()
        server.server_close()
    assert rc == 0
    result = json.loads(out.read_text())
    rows = result["turns"]
    assert [(r["session_id"], r["turn"]) for r in rows] == [
        ("s0000", 0), ("s0000", 1), ("s0000", 2), ("s0001", 0), ("s0001", 1), ("s0001", 2)]
    for r in rows:
        assert 0 < r["ttft_s"] <= r["e2e_s"] and r["completion_tokens"] == 5
        assert r["output_sha256"] == hashlib.sha256(r["output"].encode()).hexdigest()
        assert r["worker"] == "http://replica-a"  # the gateway's header, read case-blind
    # turn k+1's request is turn k's request + the answer + the new messages
    first, second = _FakeChat.seen[0], _FakeChat.seen[1]
    assert second[: len(first)] == first
    assert second[len(first)] == {"role": "assistant", "content": rows[0]["output"]}
    assert result["summary"]["by_turn"]["2"]["ttft_s"]["n"] == 2
    assert 0.8 < rows[1]["reuse"] < 1.0


def _replay_against(handler: type, tmp_path: Path, sessions: Path, *argv: str) -> tuple[int, list]:
    """``replay_agentic.main`` over ``sessions`` against a local server of ``handler``:
    (exit status, the result's turn rows)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    out = tmp_path / "r.json"
    try:
        rc = _load("replay_agentic").main([str(sessions), "--url",
                                           f"http://127.0.0.1:{server.server_port}",
                                           "--max-tokens", "3", *argv, "-o", str(out)])
    finally:
        server.shutdown()
        server.server_close()
    return rc, json.loads(out.read_text())["turns"]


class _FailsEverySecondCall(_FakeChat):
    """Answers 503 to every second request (a replica that died under the gateway)."""

    calls = 0

    def do_POST(self) -> None:
        _FailsEverySecondCall.calls += 1
        if _FailsEverySecondCall.calls % 2 == 0:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        super().do_POST()


@pytest.mark.parametrize("retries", [0, 1])
def test_replay_sends_a_failed_turn_again_or_stops_the_session(workload, tmp_path, retries):
    sessions = tmp_path / "s.jsonl"
    assert workload.main(["--sessions", "1", "--turns", "3", "--system-tokens", "900",
                          "-o", str(sessions)]) == 0
    _FailsEverySecondCall.calls, _FakeChat.seen = 0, []
    rc, rows = _replay_against(_FailsEverySecondCall, tmp_path, sessions, "--retries",
                               str(retries), "--retry-wait-s", "0.05")
    if retries == 0:  # turn 1's request fails: the session stops there
        assert rc == 1 and [r["turn"] for r in rows] == [0, 1]
        assert "HTTP 503" in rows[1]["error"] and rows[1]["attempts"] == 1
        return
    assert rc == 0 and [r.get("attempts") for r in rows] == [1, 2, 2]
    assert all("error" not in r for r in rows)
    assert rows[0]["start_s"] < rows[1]["start_s"] < rows[2]["start_s"]
    assert rows[1]["e2e_s"] >= rows[1]["ttft_s"] > 0


class _CutsTheStream(_FakeChat):
    """Streams two pieces, then the connection ends: no finish_reason, no [DONE] (a server
    killed mid-answer, as a gateway passes it on)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for w in ("half ", "an answer"):
            event = {"choices": [{"delta": {"content": w}, "finish_reason": None}]}
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")


def test_a_stream_cut_midway_is_a_failed_turn_not_a_short_answer(workload, tmp_path):
    sessions = tmp_path / "s.jsonl"
    assert workload.main(["--sessions", "1", "--turns", "2", "--system-tokens", "900",
                          "-o", str(sessions)]) == 0
    rc, rows = _replay_against(_CutsTheStream, tmp_path, sessions)
    assert rc == 1 and len(rows) == 1 and "without a finish_reason" in rows[0]["error"]
