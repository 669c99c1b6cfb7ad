"""Where a step's time goes: seconds per phase, draft forwards, peak transient bytes.

The worker splits each decode step (and each prefill step: prefill, compress, offload) into
phases and laps a clock at every boundary; phases may repeat within a step (commit and offload
alternate per row), their laps add up::

    step   |prepare|draft|draft|...|verify|commit|offload|commit|offload|...|
           ^start                                                         ^finish
    other = finish - start - sum(phases)   (SGLang's own step bookkeeping, result building)

``finish`` returns one frozen ``StepProfile``; the metrics sum them (``vericache:step_*``) and
the step-profile benchmark (``benchmark/step_profile.py``) prints the sums beside the cost
model's prediction. No torch, no clock: the caller measures (``time.perf_counter``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Phase(StrEnum):
    PREPARE = "prepare"  # compressed views in step, pressure offload, the draft-or-plain plan
    DRAFT = "draft"  # the draft forwards over the compressed views
    VERIFY = "verify"  # the full-KV verify forward and acceptance
    PLAIN = "plain"  # a plain one-token decode forward (a step that does not draft)
    COMMIT = "commit"  # committed tokens appended to the compressed KV, stats
    OFFLOAD = "offload"  # committed full KV moved to host memory
    # prefill (extend) steps: what a drafted request's first token waits for besides the forward
    PREFILL = "prefill"  # the target's prefill forward
    COMPRESS = "compress"  # drafted rows' compressed KV, built from their prompts


@dataclass(frozen=True, slots=True)
class StepProfile:
    """One decode step: ``seconds`` per phase that ran, ``other`` the rest of the step,
    ``draft_forwards`` draft forwards run, ``transient_bytes`` the largest tensor set built
    outside the KV pool at once (a quantized view with its draft chain, a row's gathered
    verify KV)."""

    seconds: dict[Phase, float]
    other: float
    draft_forwards: int
    transient_bytes: int

    @property
    def total(self) -> float:
        return sum(self.seconds.values()) + self.other


class StepClock:
    """Laps of one step at a time. Not thread-safe: the scheduler thread owns it.

    ``start`` opens a step; ``lap(phase, now)`` charges the time since the previous lap (or the
    start) to ``phase``; ``finish(now)`` closes the step and returns its profile (time after
    the last lap lands in ``other``).
    """

    def __init__(self) -> None:
        self._open = False
        self._started = self._last = 0.0
        self._seconds: dict[Phase, float] = {}
        self._forwards = 0
        self._transient = 0

    @property
    def running(self) -> bool:
        return self._open

    def start(self, now: float) -> None:
        self._open, self._started, self._last = True, now, now
        self._seconds, self._forwards, self._transient = {}, 0, 0

    def lap(self, phase: Phase, now: float) -> None:
        self._require_open()
        self._seconds[phase] = self._seconds.get(phase, 0.0) + max(0.0, now - self._last)
        self._last = now

    def count_draft_forward(self) -> None:
        self._forwards += 1

    def note_transient(self, nbytes: int) -> None:
        """A tensor set of ``nbytes`` built outside the pool; the step keeps the largest."""
        self._transient = max(self._transient, int(nbytes))

    def finish(self, now: float) -> StepProfile:
        self._require_open()
        self._open = False
        phases = sum(self._seconds.values())
        return StepProfile(dict(self._seconds), max(0.0, now - self._started - phases),
                           self._forwards, self._transient)  # fmt: skip

    def _require_open(self) -> None:
        if not self._open:
            raise RuntimeError("StepClock: start() a step first")
