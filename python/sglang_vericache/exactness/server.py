"""Start and stop a real SGLang HTTP server as a child process (harness, tests, benchmarks).

The server runs in its own process group on 127.0.0.1 and a free port; ``stop()`` ends the whole
group (SGLang spawns scheduler and detokenizer processes), so nothing outlives the caller.
"""

from __future__ import annotations

import json
import os
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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
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

    ``args`` must not contain ``--host``/``--port``; they are chosen here. The log goes to
    ``log_path`` (a temporary file next to the working directory if not given).
    """

    def __init__(
        self,
        args: list[str],
        *,
        log_path: Path | None = None,
        startup_timeout: float = 600.0,
        env: dict[str, str] | None = None,
    ) -> None:
        for forbidden in ("--host", "--port"):
            if any(a == forbidden or a.startswith(forbidden + "=") for a in args):
                raise ValueError(f"{forbidden} is chosen by the harness; remove it from the args")
        self.args = list(args)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or Path(f"sglang-server-{self.port}.log")
        self.startup_timeout = startup_timeout
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "SGLangServer":
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
