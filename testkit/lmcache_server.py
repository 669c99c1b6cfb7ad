"""A real ``lmcache server`` as a child process, for the LMCache end-to-end test and benchmark
(the LMCache counterpart of ``tier_server.ServerProcess``). Needs the ``[lmcache]`` extra
(``scripts/lmcache_venv.sh``); importing this module does not.

The server runs in engine-driven mode (the only one a CPU client can use: the default,
lmcache-driven, moves KV over CUDA IPC) with ``--chunk-size`` equal to the tier geometry's
chunk tokens, which ``LMCacheTier`` checks on connect. ``stored_chunks`` asks the server
directly, through the same adapter and keys the SGLang servers use, how many leading chunks of a
token sequence it holds: evidence of a write-through that does not depend on the servers' own
counters.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sglang_vericache.exactness.server import free_port, log_tail

# LMCache's usage telemetry, banner and builtin-hash warning are noise here (notes/lmcache-cpu.md)
QUIET_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1",
             "PYTHONHASHSEED": "0"}


def lmcache_executable() -> str:
    """The ``lmcache`` console script of this interpreter's venv (else the one on PATH)."""
    beside = Path(sys.executable).parent / "lmcache"
    return str(beside) if beside.exists() else (shutil.which("lmcache") or "lmcache")


class LMCacheServerProcess:
    """``lmcache server`` on 127.0.0.1:``port`` (a free one when 0). ``start()`` returns once
    the server answers a lookup through ``LMCacheTier``; ``kill()`` / ``start()`` again on the
    same port is a restart (the new server starts empty: L1 is its only store here)."""

    def __init__(self, chunk_tokens: int, *, port: int = 0, l1_size_gb: float = 1.0,
                 log_path: Path | None = None) -> None:
        self.chunk_tokens = chunk_tokens
        self.port = port or free_port()
        self.l1_size_gb = l1_size_gb
        self.log_path = log_path or Path(tempfile.mkstemp(prefix="lmcache-server-",
                                                          suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def spec(self) -> str:
        return f"lmcache://127.0.0.1:{self.port}"

    def start(self, ready_timeout_s: float = 180.0) -> LMCacheServerProcess:
        # HTTP and Prometheus ports default to 8080 / 9090: free ones, so runs never collide
        cmd = [lmcache_executable(), "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--chunk-size", str(self.chunk_tokens), "--l1-size-gb", str(self.l1_size_gb),
               "--supported-transfer-mode", "engine_driven", "--eviction-policy", "LRU",
               "--http-port", str(free_port()), "--prometheus-port", str(free_port())]
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start {self.starts + 1}: {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **QUIET_ENV},
                                         start_new_session=True)
        self.starts += 1
        self._wait_ready(ready_timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        """Poll with a probe geometry until a lookup completes (imports take 5-30 s here)."""
        from sglang_vericache.tier import TaskStatus, chunk_keys, open_tier
        from sglang_vericache.tier.factory import TierOptions
        from sglang_vericache.tier.geometry import KVGeometry

        probe = KVGeometry("vericache-readiness-probe", 1, 1, 64, "float32", self.chunk_tokens)
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited during start-up; log tail:\n"
                                   f"{self.log_tail()}")
            tier = open_tier(self.spec, probe, TierOptions(timeout_s=5))
            try:
                task = tier.submit_lookup(chunk_keys(probe, [1] * self.chunk_tokens))
                result = wait_task(tier, task, 30)
                if result is not None and result.status is TaskStatus.DONE:
                    return
                last = "timed out" if result is None else str(result.error)
            finally:
                tier.close()
            time.sleep(1)
        self.kill()
        raise RuntimeError(f"lmcache server not ready after {timeout_s:.0f}s ({last}); "
                           f"log tail:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server (and anything it spawned): the fault, not a clean stop."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        self._signal(signal.SIGTERM, grace_s=20)

    def _signal(self, sig: signal.Signals, grace_s: float = 10) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)  # its own session: the group is exactly its tree
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=grace_s)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers in the group, if any
        except (ProcessLookupError, PermissionError):
            pass

    def log_tail(self, n_bytes: int = 3000) -> str:
        return log_tail(self.log_path, n_bytes)

    def __enter__(self) -> LMCacheServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_task(tier, task_id, timeout_s: float):  # type: ignore[no-untyped-def]
    """Drain ``tier.poll()`` until ``task_id`` settles; its TaskResult (None on timeout)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = tier.poll()
        if task_id in done:
            return done[task_id]
        time.sleep(0.01)
    return None


def server_geometry(model_path: Path, chunk_tokens: int):  # type: ignore[no-untyped-def]
    """The tier geometry a default ``--vericache`` server on ``model_path`` keys its chunks
    with: the model's content identity (fp32, no overrides, TP rank 0, weight version 0) and
    its KV shape from ``config.json``."""
    import json

    from sglang_vericache.tier.geometry import KVGeometry
    from sglang_vericache.tier.identity import ModelIdentity

    config = json.loads((Path(model_path) / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    model_id = ModelIdentity.for_model(model_path, dtype="float32").model_id()
    return KVGeometry(model_id, config["num_hidden_layers"],
                      config.get("num_key_value_heads", heads), head_dim, "float32", chunk_tokens)


def stored_chunks(spec: str, geometry, token_ids: list[int]) -> int:  # type: ignore[no-untyped-def]
    """How many leading full chunks of ``token_ids`` the tier at ``spec`` holds (0 when it
    does not answer)."""
    from sglang_vericache.tier import TaskStatus, chunk_keys, open_tier
    from sglang_vericache.tier.factory import TierOptions

    full = len(token_ids) // geometry.chunk_tokens * geometry.chunk_tokens
    if not full:
        return 0
    tier = open_tier(spec, geometry, TierOptions(timeout_s=5))
    try:
        result = wait_task(tier, tier.submit_lookup(chunk_keys(geometry, token_ids[:full])), 30)
    finally:
        tier.close()
    if result is None or result.status is not TaskStatus.DONE:
        return 0
    return result.num_ok_prefix
