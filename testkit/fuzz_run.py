"""Send fuzz cases to a reference and a candidate server side by side; check both survived.

No sglang import: plain ``http.client``, so a server that crashes, hangs or drops a connection
is recorded as such rather than taking the runner down. Each server gets the same cases in the
same order from its own small thread pool, so batches mix request kinds on both. A server that
is dead (``alive()`` false), or fails ``max_consecutive_errors`` requests in a row and then does
not answer /health, is marked dead: its remaining cases are recorded as skipped instead of each
waiting for a timeout.

Two kinds of case run alone on their server, because plain SGLang's own answer to them
depends on what else is in flight (``runs_alone``):

- penalized (frequency / presence / repetition): the overlapped scheduler feeds its penalizers
  the last output token it has *processed* when it prepares a step, one step behind unless a
  prefill batch ran in between (then current, and the next step learns the same token again);
  seen in this fuzzer as different greedy tokens from the same plain server (seed 13, cases
  122 and 182);
- a weight update (``/update_weights_from_disk``): it waits for the requests in flight, and
  those after it must see the weights it loaded; its cache flush fails while any request is
  still running, so it also waits for the *server* to be idle (a stream the client closed
  lives on in the scheduler until its abort lands: seed 21, cases 31-33);
- ``max_new_tokens: 0`` (OpenAI ``max_tokens: 0``): a prefill batch made only of such requests skips sampling, so they get
  no output-token logprob; one that shares its prefill batch with another request gets one.

At the end, per server: alive, /health and /health_generate answer 200, and once idle
(/v1/loads: no running, waiting or grammar-queued request) ``num_used_tokens`` is back at its
start value (after a /flush_cache if it is not): KV held by nobody is a leak. SGLang's own
idle self-check, which kills the scheduler on a pool leak, shows up as a dead server.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from testkit.fuzz import FuzzCase, VocabInfo, generate_cases
from testkit.fuzz_compare import DEFAULT_TOLERANCE, compare_case
from testkit.fuzz_outputs import Reply
from testkit.fuzz_report import summarize
from testkit.fuzz_surfaces import STORM

FREQUENT_STRINGS = (" the", "\n", ".", ",", " and")


def _print(message: str) -> None:
    print(message, flush=True)


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    alive: Callable[[], bool] = field(default=lambda: True, compare=False)


def get_json(url: str, timeout: float = 30.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def send(base_url: str, case: FuzzCase, timeout: float) -> Reply:
    """POST one case; transport failures become a Reply with no status, never an exception."""
    if case.endpoint == STORM:
        return run_storm(base_url, case, timeout)
    u = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=timeout)
    start = time.perf_counter()
    try:
        payload = case.body.encode() if isinstance(case.body, str) else json.dumps(case.body).encode()
        conn.request("POST", case.endpoint, body=payload,
                     headers={"Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        if case.stream and resp.status == 200:
            events, err = _read_stream(resp, case.disconnect_after)
            return Reply(200, events, None, time.perf_counter() - start, err)
        return Reply(resp.status, _parse(resp.read()), None, time.perf_counter() - start)
    except (OSError, http.client.HTTPException) as exc:
        return Reply(None, None, f"{type(exc).__name__}: {exc}", time.perf_counter() - start)
    finally:
        conn.close()  # also what a mid-stream client disconnect is


def abort_later(base_url: str, rid: str, delay_s: float) -> threading.Timer:
    """Cancel request ``rid`` through ``/abort_request`` after ``delay_s`` (started; a request
    that finished first has nothing to cancel, and the server says so)."""

    def fire() -> None:
        try:
            _post_json(base_url + "/abort_request", {"rid": rid}, timeout=30)
        except (OSError, ValueError, http.client.HTTPException):
            pass

    timer = threading.Timer(delay_s, fire)
    timer.start()
    return timer


def run_storm(base_url: str, case: FuzzCase, timeout: float) -> Reply:
    """A burst at once: ``streams`` streaming requests dropped after their first event and
    ``aborts`` requests cancelled through ``/abort_request`` while they run. The reply's status
    is 200 when the server still answers /health afterwards (the leak check at the end of the
    run sees what the burst left behind), None otherwise."""
    from testkit.fuzz import GENERATE, STATUS

    spec, start = case.body, time.perf_counter()
    params = {"temperature": 0, "max_new_tokens": spec["max_new_tokens"], "ignore_eos": True}
    burst = []
    for i in range(spec["streams"]):
        body = {"text": spec["texts"][i % len(spec["texts"])], "sampling_params": params,
                "stream": True}  # fmt: skip
        burst.append(FuzzCase(i, "disconnect", GENERATE, body, STATUS, disconnect_after=1))
    for i in range(spec["aborts"]):
        rid = f"fuzz-storm-{case.index}-{i}-{time.monotonic_ns()}"
        body = {"text": spec["texts"][i % len(spec["texts"])], "sampling_params": params,
                "rid": rid}  # fmt: skip
        burst.append(FuzzCase(i, "abort", GENERATE, body, STATUS))
    timers = [abort_later(base_url, c.body["rid"], 0.2 + 0.1 * c.index) for c in burst
              if "rid" in c.body]  # fmt: skip
    with ThreadPoolExecutor(max_workers=len(burst)) as pool:
        list(pool.map(lambda c: send(base_url, c, timeout), burst))
    for t in timers:
        t.join()
    # SGLang's /health answers 503 while a step outlasts its 20 s detokenizer heartbeat (a
    # loaded machine): the server must answer 200 again within ``timeout``, not at once
    deadline = time.monotonic() + timeout
    while not (answered := _answers(base_url)) and time.monotonic() < deadline:
        time.sleep(2.0)
    status = 200 if answered else None
    return Reply(status, {"burst": len(burst)}, None if status else "no /health after the storm",
                 time.perf_counter() - start)  # fmt: skip


def _parse(raw: bytes) -> Any:
    try:
        return json.loads(raw or b"null")
    except ValueError:
        return raw.decode(errors="replace")[:2000]


def _read_stream(resp: http.client.HTTPResponse, stop_after: int | None) -> tuple[list, bool]:
    """SSE events until [DONE] (or ``stop_after`` events: the caller then closes the socket);
    the flag says whether one of them was an error event."""
    events: list[Any] = []
    error = False
    while stop_after is None or len(events) < stop_after:
        raw = resp.readline()
        if not raw:
            break
        line = raw.decode("utf-8", errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        event = _parse(data.encode())
        error |= isinstance(event, dict) and ("error" in event or event.get("object") == "error")
        events.append(event)
    return events, error


class _Progress:
    """Thread-safe counters, one line every ``every`` finished requests."""

    def __init__(self, total: int, every: int, log: Callable[[str], None] | None) -> None:
        self.total, self.every, self.log = total, every, log
        self.done: dict[str, int] = {}
        self.start = time.perf_counter()
        self.lock = threading.Lock()

    def tick(self, name: str) -> None:
        with self.lock:
            self.done[name] = self.done.get(name, 0) + 1
            n = sum(self.done.values())
            if self.log and self.every and n % self.every == 0:
                parts = ", ".join(f"{k} {v}/{self.total}" for k, v in sorted(self.done.items()))
                self.log(f"fuzz: {parts} ({time.perf_counter() - self.start:.0f} s)")


def run_side(target: Target, cases: Sequence[FuzzCase], *, concurrency: int, timeout: float,
             progress: _Progress | None = None,
             max_consecutive_errors: int = 3) -> dict[int, Reply]:  # fmt: skip
    """Replies by case index. Once the server is dead, the rest are skipped at once."""
    state = {"dead": None, "errors": 0}
    lock = threading.Lock()

    def one(case: FuzzCase) -> tuple[int, Reply]:
        if state["dead"]:
            reply = Reply(None, error=f"skipped: {target.name} {state['dead']}")
        else:
            reply = send(target.url, case, timeout)
            _track(reply)
        if progress:
            progress.tick(target.name)
        return case.index, reply

    def _track(reply: Reply) -> None:
        with lock:
            state["errors"] = state["errors"] + 1 if reply.status is None else 0
            if reply.status is not None:
                return
            if not target.alive():
                state["dead"] = "dead"
            elif state["errors"] >= max_consecutive_errors and not _answers(target.url):
                state["dead"] = "unresponsive"  # (timeouts alone may just be a loaded machine)

    replies: dict[int, Reply] = {}
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        for group in solo_groups(cases):
            if runs_alone(group[0]) and not state["dead"]:
                wait_idle(target.url, timeout)  # the pool has drained; let the server drain too
            replies.update(pool.map(one, group))
    return replies


def runs_alone(case: FuzzCase) -> bool:
    """Whether plain SGLang's answer to ``case`` depends on other requests (module doc)."""
    if case.labels() & {"penalty", "weights"}:
        return True
    body = case.body if isinstance(case.body, dict) else {}
    params = body.get("sampling_params")
    items = params if isinstance(params, list) else [params if isinstance(params, dict) else {}]
    limits = ("max_new_tokens", "max_tokens", "max_completion_tokens")  # /generate, OpenAI
    return any(p.get(k) == 0 for p in [body, *items] if isinstance(p, dict) for k in limits)


def solo_groups(cases: Sequence[FuzzCase]) -> list[list[FuzzCase]]:
    """``cases`` in order, cut so that every case that ``runs_alone`` is a group of its own:
    groups run one after another, the cases of a group concurrently."""
    groups: list[list[FuzzCase]] = [[]]
    for c in cases:
        if runs_alone(c):
            groups += [[c], []]
        else:
            groups[-1].append(c)
    return [g for g in groups if g]


def run_pair(ref: Target, cand: Target, cases: Sequence[FuzzCase], *, concurrency: int = 4,
             timeout: float = 300.0, progress_every: int = 50,
             log: Callable[[str], None] | None = _print) -> tuple[dict, dict]:  # fmt: skip
    progress = _Progress(len(cases), progress_every, log)
    kw = {"concurrency": concurrency, "timeout": timeout, "progress": progress}
    with ThreadPoolExecutor(max_workers=2) as pool:
        f_ref = pool.submit(run_side, ref, cases, **kw)
        f_cand = pool.submit(run_side, cand, cases, **kw)
        return f_ref.result(), f_cand.result()


# -- health and leaks ------------------------------------------------------------------------


def load_state(url: str) -> dict[str, int]:
    load = get_json(url + "/v1/loads?include=core,queues", timeout=10)["loads"][0]
    q = load.get("queues") or {}
    return {"running": load["num_running_reqs"], "waiting": load["num_waiting_reqs"],
            "grammar": q.get("grammar", 0), "used_tokens": load["num_used_tokens"]}  # fmt: skip


def _answers(url: str, timeout: float = 30.0) -> bool:
    """Whether the HTTP server answers /health at all (no generation involved)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError, http.client.HTTPException):
        return False


def _healthy(url: str, timeout: float = 60.0) -> bool:
    try:
        for path in ("/health", "/health_generate"):
            with urllib.request.urlopen(url + path, timeout=timeout) as resp:
                if resp.status != 200:
                    return False
        return True
    except (OSError, urllib.error.URLError, http.client.HTTPException):
        return False


def wait_idle(url: str, wait_s: float) -> dict[str, int] | None:
    """The load state once nothing is running, waiting or compiling a grammar (None: never)."""
    deadline = time.monotonic() + wait_s
    state = None
    while time.monotonic() < deadline:
        try:
            state = load_state(url)
        except (OSError, urllib.error.URLError, KeyError, IndexError, ValueError):
            return None
        if not (state["running"] or state["waiting"] or state["grammar"]):
            return state
        time.sleep(0.5)
    return state


def check_health(target: Target, baseline_used: int | None, wait_s: float = 60.0) -> dict:
    """``{"alive", "healthy", "leak"}``; ``leak`` is None or what was left behind."""
    alive = target.alive()
    healthy = alive and _healthy(target.url)
    leak = None
    if healthy:
        state = wait_idle(target.url, wait_s)
        if state is None or state["running"] or state["waiting"] or state["grammar"]:
            leak = {"reason": "not idle", "state": state}
        elif baseline_used is not None and state["used_tokens"] != baseline_used:
            flushed = _flush_then_state(target.url)
            if flushed is None or flushed["used_tokens"] != baseline_used:
                leak = {"reason": "KV tokens still in use", "baseline": baseline_used,
                        "idle": state, "after_flush": flushed}  # fmt: skip
    return {"alive": alive, "healthy": healthy, "leak": leak}


def _flush_then_state(url: str) -> dict[str, int] | None:
    try:
        urllib.request.urlopen(urllib.request.Request(url + "/flush_cache", method="POST"),
                               timeout=30).close()  # fmt: skip
        time.sleep(1.0)
        return load_state(url)
    except (OSError, urllib.error.URLError, KeyError, IndexError, ValueError):
        return None


def vocab_from_server(url: str) -> VocabInfo:
    """Vocabulary size (the served model's config.json), context length and frequent token ids
    (the server's own /v1/tokenize): no tokenizer loaded here, which under load costs minutes."""
    from pathlib import Path

    info = get_json(url + "/model_info")
    config = json.loads((Path(info["model_path"]) / "config.json").read_text())
    shape = {"hidden_size": int(config.get("hidden_size", 0)), "model_path": info["model_path"]}
    frequent, ctx = [], 0
    for text in FREQUENT_STRINGS:
        out = _post_json(url + "/v1/tokenize", {"prompt": text, "add_special_tokens": False})
        ctx = int(out["max_model_len"])
        if out["count"] == 1:
            frequent.append(int(out["tokens"][0]))
    return VocabInfo(int(config["vocab_size"]), ctx, tuple(frequent), **shape)


def _post_json(url: str, payload: Any, timeout: float = 60.0) -> Any:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def fuzz(ref: Target, cand: Target, *, seed: int, requests: int, vocab: VocabInfo | None = None,
         kinds: Sequence[str] = (), exclude: Sequence[str] = (), concurrency: int = 4,
         timeout: float = 300.0, tolerance: float = DEFAULT_TOLERANCE, progress_every: int = 50,
         log: Callable[[str], None] | None = _print) -> dict[str, Any]:  # fmt: skip
    """Generate, send to both, compare, check health and leaks; the summary dict."""
    vocab = vocab or vocab_from_server(ref.url)
    cases = generate_cases(seed, requests, vocab, kinds=kinds, exclude=exclude)
    baselines = {t.name: _baseline(t) for t in (ref, cand)}
    start = time.perf_counter()
    ref_replies, cand_replies = run_pair(ref, cand, cases, concurrency=concurrency,
                                         timeout=timeout, progress_every=progress_every,
                                         log=log)  # fmt: skip
    results = [compare_case(c, ref_replies[c.index], cand_replies[c.index], tolerance)
               for c in cases]  # fmt: skip
    health = {t.name: check_health(t, baselines[t.name]) for t in (ref, cand)}
    return summarize(cases, results, seed=seed, tolerance=tolerance, health=health,
                     wall_s=round(time.perf_counter() - start, 1))  # fmt: skip


def _baseline(target: Target) -> int | None:
    state = wait_idle(target.url, 60.0)
    return None if state is None else state["used_tokens"]
