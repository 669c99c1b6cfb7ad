"""Helpers for the tier tests: real server subprocesses on 127.0.0.1 and a result collector."""

from __future__ import annotations

import time
from collections.abc import Sequence

import zmq
from sglang_vericache.exactness.server import free_port  # noqa: F401
from sglang_vericache.tier.auth import ClientSession
from sglang_vericache.tier.base import FullKVTier, TaskId, TaskResult
from sglang_vericache.tier.geometry import KVGeometry
from sglang_vericache.tier.handshake import authenticate_client_socket
from sglang_vericache.tier.protocol import unpack_header
from sglang_vericache.tier.secret import resolve_secret

from testkit.tier_server import PACKAGE_ROOT, ServerProcess  # noqa: F401

TINY = KVGeometry("tiny-llama", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32",
                  chunk_tokens=8)


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


def signed(header: dict, *payload: bytes, secret: bytes | None = None) -> list:
    """A request signed like a client's (a fresh session; the tests' shared secret unless
    ``secret`` is given)."""
    return ClientSession(secret or resolve_secret().value).sign(header, list(payload))


def raw_request(endpoint: str, frames: list, timeout_s: float = 5.0) -> dict:
    """Send ``frames`` as they are on a fresh DEALER that has the tests' connection credentials
    (a peer past the handshake); the reply header, NOT authenticated (a forger cannot check
    the server's MAC either)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    authenticate_client_socket(sock, resolve_secret().value)
    try:
        sock.connect(endpoint)
        sock.send_multipart(frames)
        assert sock.poll(int(timeout_s * 1000)), "server did not answer"
        return unpack_header(sock.recv_multipart()[0])
    finally:
        sock.close()
