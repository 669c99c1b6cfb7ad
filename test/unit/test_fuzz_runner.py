"""The fuzz runner against tiny fake servers (stdlib HTTP, milliseconds, no SGLang).

What only the runner does: send bodies (raw bad JSON included), read and cut streams, survive a
dead server without waiting out timeouts, and turn /v1/loads into leak reports.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from testkit.fuzz import GENERATE, STATUS, FuzzCase, VocabInfo
from testkit.fuzz_run import (
    Target,
    check_health,
    fuzz,
    run_side,
    send,
)

VOCAB = VocabInfo(vocab_size=1000, context_len=256, frequent_ids=(5, 6))


class Fake:
    """A fake server's behaviour: the ids it answers, and KV tokens in use after the start."""

    def __init__(self, ids: list[int], used_after_start: int = 0, started: bool = False,
                 delay_s: float = 0.0) -> None:  # fmt: skip
        self.ids, self.used_after_start, self.load_calls = ids, used_after_start, int(started)
        self.delay_s, self.in_flight, self.lock = delay_s, 0, threading.Lock()
        self.seen: list[tuple[str, int]] = []  # (prompt, requests in flight on arrival)


def make_handler(fake: Fake) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _json(self, status: int, obj) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path.startswith("/v1/loads"):
                used = fake.used_after_start if fake.load_calls else 0
                fake.load_calls += 1
                return self._json(200, {"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0,
                                                   "num_used_tokens": used, "queues": {}}]})
            self._json(200, {})

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path == "/flush_cache":
                return self._json(200, {})
            try:
                body = json.loads(raw)
            except ValueError:
                return self._json(400, {"error": "bad json"})
            with fake.lock:
                fake.in_flight += 1
                fake.seen.append((str(body.get("text")), fake.in_flight))
            time.sleep(fake.delay_s)
            with fake.lock:
                fake.in_flight -= 1
            if body.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i in range(1, len(fake.ids) + 1):
                    ev = {"output_ids": fake.ids[:i], "meta_info": {}, "index": 0}
                    self.wfile.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")
                return None
            return self._json(200, {"output_ids": fake.ids, "meta_info": {}})

    return Handler


@pytest.fixture
def serve() -> Iterator:
    servers = []

    def start(fake: Fake) -> str:
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(fake))
        threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}"

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def test_send_parses_json_streams_cut_streams_and_raw_bodies(serve) -> None:
    url = serve(Fake([1, 2, 3]))
    plain = send(url, FuzzCase(0, "g", GENERATE, {"text": "x"}), 10)
    assert plain.status == 200 and plain.body["output_ids"] == [1, 2, 3]
    stream = send(url, FuzzCase(0, "s", GENERATE, {"text": "x", "stream": True}), 10)
    assert [e["output_ids"] for e in stream.body] == [[1], [1, 2], [1, 2, 3]]
    cut = send(url, FuzzCase(0, "d", GENERATE, {"stream": True}, STATUS, disconnect_after=1), 10)
    assert cut.status == 200 and len(cut.body) == 1
    raw = send(url, FuzzCase(0, "m", GENERATE, '{"text": "unterminated'), 10)
    assert raw.status == 400


def test_identical_fakes_pass_and_a_wrong_candidate_fails(serve) -> None:
    ref = Target("plain", serve(Fake([1, 2, 3])))
    same = fuzz(ref, Target("vericache", serve(Fake([1, 2, 3]))), seed=1, requests=30,
                vocab=VOCAB, kinds=["greedy", "input_ids"], log=None)  # fmt: skip
    assert same["ok"], same
    wrong = fuzz(ref, Target("vericache", serve(Fake([1, 9, 3]))), seed=1, requests=30,
                 vocab=VOCAB, kinds=["greedy", "input_ids"], log=None)  # fmt: skip
    assert not wrong["ok"] and wrong["greedy_mismatches"]
    assert wrong["greedy_mismatches"][0]["first_divergence"] == 1


def test_dead_server_is_skipped_not_waited_for(serve) -> None:
    dead = Target("vericache", "http://127.0.0.1:9", alive=lambda: False)  # nothing listens
    cases = [FuzzCase(i, "g", GENERATE, {"text": "x"}) for i in range(20)]
    replies = run_side(dead, cases, concurrency=1, timeout=30)
    assert all(r.status is None for r in replies.values())
    assert sum("skipped" in (r.error or "") for r in replies.values()) == 19
    health = check_health(dead, baseline_used=0, wait_s=1)
    assert health == {"alive": False, "healthy": False, "leak": None}


def test_penalized_cases_run_alone_on_their_server(serve) -> None:
    """Plain SGLang's answer to penalized and ``max_new_tokens: 0`` requests depends on what else
    is in flight (fuzz_run's doc)."""
    fake = Fake([1], delay_s=0.05)
    url = serve(fake)
    penalized = {"frequency_penalty": 0.3}
    cases = [FuzzCase(i, "g", GENERATE, {"text": f"p{i}" if i % 4 == 2 else f"g{i}",
                                         "sampling_params": penalized if i % 4 == 2 else {}},
                      tags=("penalty",) if i % 4 == 2 else ())  # fmt: skip
             for i in range(12)]
    cases.append(FuzzCase(12, "g", GENERATE, {"text": "p12", "sampling_params": {
        "max_new_tokens": 0}, "return_logprob": True}))  # fmt: skip
    cases += [FuzzCase(i, "g", GENERATE, {"text": f"g{i}"}) for i in range(13, 16)]
    cases.append(FuzzCase(16, "g", GENERATE, {"text": "p16", "max_tokens": 0, "n": 3}))
    cases += [FuzzCase(i, "g", GENERATE, {"text": f"g{i}"}) for i in range(17, 20)]
    replies = run_side(Target("plain", url), cases, concurrency=4, timeout=30)
    assert sorted(replies) == list(range(20)) and all(r.status == 200 for r in replies.values())
    alone = [n for text, n in fake.seen if text.startswith("p")]
    assert alone == [1, 1, 1, 1, 1]
    assert max(n for text, n in fake.seen if text.startswith("g")) > 1  # the rest still overlap


def test_kv_still_in_use_when_idle_is_a_leak(serve) -> None:
    leaky = Target("vericache", serve(Fake([1], used_after_start=7, started=True)))
    health = check_health(leaky, baseline_used=0, wait_s=5)
    assert health["alive"] and health["healthy"]
    assert health["leak"]["reason"] == "KV tokens still in use"
    clean = Target("plain", serve(Fake([1])))
    assert check_health(clean, baseline_used=0, wait_s=5)["leak"] is None
