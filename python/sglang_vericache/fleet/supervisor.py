"""Run a ``FleetPlan``: start its pieces, wait for each, watch them, stop them all.

Every piece runs in its own process group (SGLang spawns scheduler and detokenizer processes),
so stopping a piece ends its whole group: SIGTERM to every group, a grace period, then SIGKILL
to every group, so nothing outlives the fleet. The tier starts first and must answer before the
replicas start (they open their tier link at start-up); the replicas start together and the
gateway starts once all are healthy. A piece that exits or does not become ready within the
start-up timeout fails the start: ``FleetStartError`` names it, its log and its last lines, and
the caller stops the rest. Progress goes to ``progress`` (stderr), never stdout: stdout carries
only the gateway's URL.

Once up: a replica that dies is reported and left out (the gateway routes around it; the tier
keeps its KV for the others); a dead tier is reported (replicas recompute instead of fetching);
a dead gateway ends the fleet (nothing could reach the replicas).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from sglang_vericache.fleet.plan import FleetPlan, Piece, Role
from sglang_vericache.fleet.probes import is_ready

POLL_S = 1.0
PROGRESS_EVERY_S = 10.0
STOP_GRACE_S = 20.0
TAIL_LINES = 30
# uvicorn's message when its bind fails; SGLang then hangs in shutdown instead of exiting
BIND_FAILED = "error while attempting to bind on address"


class FleetStartError(RuntimeError):
    """A piece exited or did not become ready; the message names its log and last lines."""

    def __init__(self, piece: Piece, log_path: Path, reason: str) -> None:
        self.piece = piece
        self.log_path = log_path
        super().__init__(f"{piece.name} failed to start: {reason}\n  log: {log_path}\n"
                         f"  last lines:\n{last_lines(log_path, TAIL_LINES)}")


class FleetStopped(Exception):
    """The fleet was asked to stop (SIGTERM); Ctrl-C arrives as KeyboardInterrupt."""


def last_lines(path: Path, n: int) -> str:
    try:
        lines = path.read_bytes()[-64_000:].decode(errors="replace").splitlines()[-n:]
    except OSError:
        return "    (no log)"
    return "\n".join("    " + line for line in lines) or "    (empty log)"


@dataclass
class Running:
    piece: Piece
    proc: subprocess.Popen[bytes]
    log_path: Path
    reported_exit: bool = False


class Supervisor:
    """Starts ``plan``'s pieces with logs in ``log_dir``; ``stop()`` is safe to call twice."""

    def __init__(self, plan: FleetPlan, log_dir: Path, *, startup_timeout_s: float,
                 progress: TextIO, ready: Callable[[Piece, FleetPlan], bool] = is_ready) -> None:
        self.plan = plan
        self.log_dir = log_dir
        self.startup_timeout_s = startup_timeout_s
        self.progress = progress
        self.ready = ready
        self.running: list[Running] = []

    def say(self, message: str) -> None:
        print(f"fleet: {message}", file=self.progress, flush=True)

    # -- start ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start every piece in plan order, waiting for the tier before the replicas and for
        all replicas before the gateway. Raises FleetStartError (the caller stops the rest)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for role in (Role.TIER, Role.REPLICA, Role.GATEWAY):
            batch = [self._spawn(p) for p in self.plan.by_role(role)]
            for running in batch:
                self._wait_ready(running)

    def _spawn(self, piece: Piece) -> Running:
        log_path = self.log_dir / piece.log_name
        self.say(f"starting {piece.name}: {' '.join(piece.argv)}  (log: {log_path})")
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(piece.argv, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env={**os.environ, **piece.env},
                                    start_new_session=True)
        running = Running(piece, proc, log_path)
        self.running.append(running)
        return running

    def _wait_ready(self, running: Running) -> None:
        piece, started = running.piece, time.monotonic()
        next_progress = started + PROGRESS_EVERY_S
        while True:
            elapsed = time.monotonic() - started
            if running.proc.poll() is not None:
                raise FleetStartError(piece, running.log_path,
                                      f"exited with status {running.proc.returncode}")
            if self.ready(piece, self.plan):
                self.say(f"{piece.name} ready at {piece.target} after {elapsed:.0f} s")
                return
            if piece.role is Role.REPLICA and BIND_FAILED in last_lines(running.log_path, 5):
                raise FleetStartError(piece, running.log_path, "its port was taken")
            if elapsed > self.startup_timeout_s:
                raise FleetStartError(piece, running.log_path,
                                      f"not ready after {self.startup_timeout_s:.0f} s")
            if time.monotonic() >= next_progress:
                self.say(f"waiting for {piece.name} at {piece.target} ({elapsed:.0f} s)")
                next_progress += PROGRESS_EVERY_S
            time.sleep(POLL_S)

    # -- watch ---------------------------------------------------------------------------------

    def watch(self) -> int:
        """Until stopped: report pieces that exit. Returns 1 when the gateway exits."""
        while True:
            for running in self.running:
                code = running.proc.poll()
                if code is None or running.reported_exit:
                    continue
                running.reported_exit = True
                piece = running.piece
                self.say(f"{piece.name} exited with status {code} (log: {running.log_path})")
                if piece.role is Role.GATEWAY:
                    self.say(f"the gateway is gone; last lines:\n"
                             f"{last_lines(running.log_path, TAIL_LINES)}")
                    return 1
                if piece.role is Role.REPLICA:
                    self.say("the gateway routes around it; the others keep serving")
                if piece.role is Role.TIER:
                    self.say("the replicas recompute what they would have fetched")
            time.sleep(POLL_S)

    # -- stop ----------------------------------------------------------------------------------

    def stop(self) -> None:
        """End every group started: gateway first (no new requests reach a replica being
        stopped), SIGTERM to all, up to STOP_GRACE_S for them to exit, then SIGKILL."""
        order = sorted(self.running, key=lambda r: (r.piece.role is not Role.GATEWAY,
                                                    r.piece.role is Role.TIER))
        for running in order:
            _signal_group(running.proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for running in order:
            try:
                running.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"{running.piece.name} did not stop in {STOP_GRACE_S:.0f} s: killing")
        for running in order:  # children left in a group (scheduler, detokenizer) go too
            _signal_group(running.proc, signal.SIGKILL)
            try:
                running.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.say(f"{running.piece.name} (pid {running.proc.pid}) survived SIGKILL")
        if self.running:
            self.say(f"stopped {', '.join(r.piece.name for r in order)}")
        self.running = []

    # -- state ---------------------------------------------------------------------------------

    def state(self) -> dict:
        """What is running, for fleet.json: tools and tests find each piece's pid (= its process
        group) and URL there."""
        return {
            "url": self.plan.url,
            "model": self.plan.model_name,
            "tier": self.plan.tier_spec,
            "fleet_pid": os.getpid(),
            "pieces": [{"name": r.piece.name, "role": r.piece.role.value, "pid": r.proc.pid,
                        "target": r.piece.target, "log": str(r.log_path)}
                       for r in self.running],
        }

    def write_state(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state(), indent=2))
        tmp.replace(path)  # readers never see half a file


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Signal the piece's process group (its pid: started with start_new_session)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
