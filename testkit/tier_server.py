"""The zmq KV server as a child process, for tests and benchmarks on one machine (the tier's
counterpart of ``server.SGLangServer``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import sglang_vericache
from sglang_vericache.tier.admin import server_request
from sglang_vericache.tier.protocol import Op
from sglang_vericache.tier.secret import TierSecret

PACKAGE_ROOT = str(Path(sglang_vericache.__file__).resolve().parents[1])


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

    def stats(self, secret: TierSecret | bytes | None = None) -> dict[str, int]:
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

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
