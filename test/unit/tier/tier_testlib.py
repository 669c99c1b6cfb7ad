"""Helpers for the tier tests: real server subprocesses on 127.0.0.1 and a result collector."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import sglang_vericache
from sglang_vericache.tier.base import FullKVTier, TaskId, TaskResult
from sglang_vericache.tier.admin import server_request
from sglang_vericache.tier.geometry import KVGeometry
from sglang_vericache.tier.protocol import Op

PACKAGE_ROOT = str(Path(sglang_vericache.__file__).resolve().parents[1])

TINY = KVGeometry("tiny-llama", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32",
                  chunk_tokens=8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m sglang_vericache.tier.server`` as a real child process."""

    def __init__(self, *args: str, port: int = 0, capacity_gb: float = 0.25,
                 env: dict[str, str] | None = None, expect_ready: bool = True) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="tier-server-", suffix=".log")
        full_env = {**os.environ, "PYTHONPATH": PACKAGE_ROOT + os.pathsep
                    + os.environ.get("PYTHONPATH", ""), **(env or {})}
        cmd = [sys.executable, "-m", "sglang_vericache.tier.server", "--port", str(port),
               "--capacity-gb", str(capacity_gb), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=full_env)
        self.endpoint = ""
        if expect_ready:
            line = self.proc.stdout.readline()  # "vericache-tier listening on tcp://..."
            assert "listening on" in line, f"server did not start: {line!r} {self.logs()}"
            self.endpoint = line.split()[-1]

    @property
    def spec(self) -> str:
        return "zmq://" + self.endpoint.removeprefix("tcp://")

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    def stats(self, secret: bytes | None = None) -> dict[str, int]:
        reply = server_request(self.endpoint, Op.STATS, secret=secret)
        assert reply["integrity"] == "ok", reply["integrity"]
        return reply["stats"]

    def logs(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        return self.proc.returncode


class Results:
    """Drains a tier's poll(), asserting each task id comes back exactly once."""

    def __init__(self, tier: FullKVTier) -> None:
        self.tier = tier
        self.seen: dict[TaskId, TaskResult] = {}

    def drain(self) -> None:
        self.tier.check_integrity()
        for task_id, result in self.tier.poll().items():
            assert task_id not in self.seen, f"task {task_id} returned twice"
            assert result.task_id == task_id
            self.seen[task_id] = result

    def wait(self, task_id: TaskId, timeout_s: float = 10.0) -> TaskResult:
        deadline = time.monotonic() + timeout_s
        while task_id not in self.seen:
            assert time.monotonic() < deadline, f"task {task_id} not done in {timeout_s}s"
            self.drain()
            time.sleep(0.002)
        return self.seen[task_id]

    def wait_all(self, task_ids: Sequence[TaskId], timeout_s: float = 10.0) -> list[TaskResult]:
        return [self.wait(t, timeout_s) for t in task_ids]
