"""``python -m sglang_vericache.fleet`` end to end: one fleet (zmq KV server, two --vericache
replicas, smg's gateway with cache_aware routing), started once for the module.

An agent-like greedy session (a ~1k-token shared document, four chat turns, each turn's answer
appended to the next turn's messages) goes through the gateway under the fleet's served model
name, and every answer is compared with plain SGLang's (the shared ``plain_server``). After
turn two the replica that served the session is killed (SIGKILL to its process group: a crash);
turns three and four still answer identically through the gateway (the other replica, with the
prefix in the shared tier). Last, SIGTERM to the fleet stops every process it started.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sglang_vericache.exactness.server import free_port, http_json

pytestmark = [pytest.mark.sglang, pytest.mark.model, pytest.mark.timeout(2400)]

MAX_TOKENS = 16
START_TIMEOUT_S = 1200
QUESTIONS = [
    "Which team owns the billing service?",
    "What must happen before a release is tagged?",
    "Who is paged first when the queue backs up?",
    "Summarize the rollback rule in one sentence.",
]


@dataclass
class Fleet:
    proc: subprocess.Popen[bytes]
    url: str
    state: dict
    log_dir: Path

    def pieces(self, role: str) -> list[dict]:
        return [p for p in self.state["pieces"] if p["role"] == role]


def _stderr_tail(log_dir: Path) -> str:
    try:
        return (log_dir / "fleet.stderr").read_text(errors="replace")[-6000:]
    except OSError:
        return "(no stderr)"


def _kill_everything(proc: subprocess.Popen[bytes], log_dir: Path) -> None:
    """Teardown safety net: the fleet's own group and every piece's group it recorded."""
    pids = [proc.pid]
    state_file = log_dir / "fleet.json"
    if state_file.exists():
        pids += [p["pid"] for p in json.loads(state_file.read_text())["pieces"]]
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def fleet(default_model_path: Path, chunked_prefill_size: int,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    log_dir = tmp_path_factory.mktemp("fleet")
    # no --model-path, no --served-model-name: the defaults a fresh clone gets
    cmd = [sys.executable, "-m", "sglang_vericache.fleet", "--replicas", "2",
           "--port", str(free_port()), "--tier-capacity-gb", "1", "--log-dir", str(log_dir),
           "--", "--max-total-tokens", "4096", "--chunked-prefill-size",
           str(chunked_prefill_size), "--enable-metrics"]  # fmt: skip
    with open(log_dir / "fleet.stderr", "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, start_new_session=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        url = proc.stdout.readline().decode().strip() if ready else ""
        assert url.startswith("http://"), f"fleet did not start:\n{_stderr_tail(log_dir)}"
        state = json.loads((log_dir / "fleet.json").read_text())
        yield Fleet(proc, url, state, log_dir)
    finally:
        if proc.poll() is None:
            _kill_everything(proc, log_dir)


@pytest.fixture(scope="module")
def document(default_model_path: Path) -> str:
    """~1k tokens of a made-up operations handbook: the prefix every turn shares."""
    from transformers import AutoTokenizer

    teams = ["billing", "search", "ingest", "payments", "alerts", "storage"]
    parts = ["Operations handbook of the Example Corp platform group."]
    for i in range(16):
        team = teams[i % len(teams)]
        parts.append(f"Rule {i + 1}: the {team} team owns service {team}-{i}; before a release "
                     f"of {team}-{i} is tagged, its canary runs for {10 + i} minutes, and when "
                     f"its queue backs up the {teams[(i + 1) % len(teams)]} on-call is paged "
                     f"first. Rollback of {team}-{i} needs one approval.")  # fmt: skip
    text = "\n".join(parts)
    tokens = len(AutoTokenizer.from_pretrained(default_model_path).encode(text))
    assert 800 <= tokens <= 1500, tokens
    return text


def _chat(url: str, model: str, messages: list[dict]) -> dict:
    reply = http_json(url + "/v1/chat/completions", {
        "model": model, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS,
    })  # fmt: skip
    choice = reply["choices"][0]
    return {"text": choice["message"]["content"], "finish_reason": choice["finish_reason"],
            "completion_tokens": reply["usage"]["completion_tokens"],
            "prompt_tokens": reply["usage"]["prompt_tokens"]}


def _requests_served(replica_url: str) -> float:
    """sglang:num_requests_total summed over its labels (--enable-metrics); -1 if unreadable."""
    try:
        with urllib.request.urlopen(replica_url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return -1.0
    return sum(float(v) for v in re.findall(r"^sglang:num_requests_total(?:\{[^}]*\})? (\S+)$",
                                            text, re.MULTILINE))


def test_fleet_is_up_under_the_embedded_models_name(fleet: Fleet) -> None:
    from sglang_vericache.models import DEFAULT_MODEL_NAME

    assert fleet.state["model"] == DEFAULT_MODEL_NAME
    assert [p["role"] for p in fleet.state["pieces"]] == ["tier", "replica", "replica", "gateway"]
    assert fleet.state["tier"].startswith("zmq://127.0.0.1:")
    models = http_json(fleet.url + "/v1/models")
    assert DEFAULT_MODEL_NAME in [m["id"] for m in models["data"]], models


def test_session_matches_plain_sglang_and_survives_a_replica_crash(fleet: Fleet, plain_server,
                                                                   document: str) -> None:  # fmt: skip
    plain_model = http_json(plain_server.url + "/v1/models")["data"][0]["id"]
    system = {"role": "system", "content": "Answer from this handbook.\n\n" + document}
    fleet_messages, plain_messages = [system], [system]
    killed = None
    for turn, question in enumerate(QUESTIONS):
        if turn == 2:  # crash the replica that served the session so far
            replicas = fleet.pieces("replica")
            served = [_requests_served(r["target"]) for r in replicas]
            killed = replicas[served.index(max(served))]
            os.killpg(killed["pid"], signal.SIGKILL)
            time.sleep(1.0)
        fleet_messages = [*fleet_messages, {"role": "user", "content": question}]
        plain_messages = [*plain_messages, {"role": "user", "content": question}]
        got = _chat(fleet.url, fleet.state["model"], fleet_messages)
        want = _chat(plain_server.url, plain_model, plain_messages)
        assert got == want, f"turn {turn + 1} (killed: {killed and killed['name']})"
        assert got["prompt_tokens"] > 800 and got["completion_tokens"] > 0, got
        fleet_messages.append({"role": "assistant", "content": got["text"]})
        plain_messages.append({"role": "assistant", "content": want["text"]})
    assert fleet.proc.poll() is None, "a replica's death must not stop the fleet"
    assert f"{killed['name']} exited" in _stderr_tail(fleet.log_dir)


def _group_members(pgids: set[int]) -> list[str]:
    """Processes still in any of these process groups (from /proc)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        if int(fields[2]) in pgids and fields[0] != "Z":
            alive.append(f"{entry.name}: {stat[:80]}")
    return alive


def test_sigterm_stops_every_piece(fleet: Fleet) -> None:
    pgids = {p["pid"] for p in fleet.state["pieces"]}
    fleet.proc.send_signal(signal.SIGTERM)
    assert fleet.proc.wait(timeout=120) == 0, _stderr_tail(fleet.log_dir)
    assert _group_members(pgids) == []
    assert "fleet: stopped" in _stderr_tail(fleet.log_dir)
