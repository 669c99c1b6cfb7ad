"""Start and stop a real SGLang HTTP server as a child process (harness, tests, benchmarks).

The server runs in its own process group on 127.0.0.1 and a free port; ``stop()`` ends the whole
group (SGLang spawns scheduler and detokenizer processes), so nothing outlives the caller.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message ends with its log tail."""


class PortTakenError(ServerStartError):
    """Another process bound the chosen port between ``free_port()`` and the server's bind."""


# uvicorn's message when its bind fails; the server then hangs in shutdown instead of exiting
# (so the message stays at the log's end)
_BIND_FAILED = "error while attempting to bind on address"


# Under Linux's default ephemeral range (32768-60999), and apart from the range SGLang picks its
# own NCCL port from (22000-29999), so two servers starting together do not take each other's.
_LISTEN_PORTS = range(12000, 22000)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range, for a child to listen on later.

    ``bind(0)`` hands out ephemeral ports, and so does every outgoing connection: a port picked
    that way and bound by a server ~20 s later can meanwhile become a client socket's source
    port (CI saw ``[Errno 98] address already in use``). Below the range only listeners compete.
    """
    candidates = range(_LISTEN_PORTS.start, min(_LISTEN_PORTS.stop, _ephemeral_low()))
    for port in random.sample(candidates, min(64, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no range: any free port
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, payload: Any | None = None, timeout: float = 600.0) -> Any:
    """GET (payload None) or POST JSON; returns the decoded JSON body. HTTP errors raise."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def log_tail(path: Path, n_bytes: int) -> str:
    """The last ``n_bytes`` of a server's log file, for start-up errors ("(no log)" if none)."""
    try:
        return path.read_bytes()[-n_bytes:].decode(errors="replace")
    except OSError:
        return "(no log)"


class SGLangServer:
    """``python -m sglang.launch_server ARGS`` on 127.0.0.1, usable as a context manager.

    ``args`` must not contain ``--host``/``--port``; the port is ``port`` or a free one, and a
    free one again (up to ``port_attempts`` tries in all) if another process holds it when the
    server binds. The log goes to ``log_path`` (a file in the working directory if not given).
    """

    def __init__(
        self,
        args: list[str],
        *,
        log_path: Path | None = None,
        startup_timeout: float = 600.0,
        env: dict[str, str] | None = None,
        port: int | None = None,
        port_attempts: int = 3,
    ) -> None:
        for forbidden in ("--host", "--port"):
            if any(a == forbidden or a.startswith(forbidden + "=") for a in args):
                raise ValueError(f"{forbidden} is chosen by the harness; remove it from the args")
        self.args = list(args)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or Path(f"sglang-server-{self.port}.log")
        self.startup_timeout = startup_timeout
        self.env = {**os.environ, **(env or {})}
        self.port_attempts = port_attempts
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "SGLangServer":
        for attempt in range(1, self.port_attempts + 1):
            try:
                return self._start_once()
            except PortTakenError:
                if attempt == self.port_attempts:
                    raise
                self.port = free_port()
                self.url = f"http://127.0.0.1:{self.port}"
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _start_once(self) -> "SGLangServer":
        cmd = [sys.executable, "-m", "sglang.launch_server", *self.args]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()
        self._wait_healthy()
        return self

    def log_tail(self, n_bytes: int = 4000) -> str:
        return log_tail(self.log_path, n_bytes)

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"server exited with status {self.proc.returncode} during start-up "
                    f"(args: {' '.join(self.args)}); log tail:\n{self.log_tail()}"
                )
            if _BIND_FAILED in self.log_tail():
                self.stop()
                raise PortTakenError(f"port {self.port} was taken before the server bound it")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        self.stop()
        raise ServerStartError(
            f"server not healthy after {self.startup_timeout:.0f}s; log tail:\n{self.log_tail()}"
        )

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = os.getpgid(self.proc.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=timeout)
        try:  # children (scheduler, detokenizer) share the group; make sure they are gone
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "SGLangServer":
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
