"""Inputs of the VeriCache cost model (benchmark/model.py): the serving device (Hardware), the
decoder geometry (Model), the per-token draft acceptance (Acceptance, E(x, alpha)) and the
workload (Workload, with where a verifier's full KV lands: VerifyBuffers).

Kept apart from model.py, which evaluates them (step(), throughput(), the sweeps), so each file
stays small; model.py re-exports every public name here, as the sibling modules and the tests
reach them through it (m.Hardware, m.Acceptance, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np


@dataclass(frozen=True, slots=True)
class Hardware:
    """One serving device (or a TP group, with bandwidths, FLOPs and memory summed)."""

    name: str
    hbm_bw: float  # B/s, effective device-memory bandwidth for weights and KV
    inter_bw: float  # B/s, effective link that brings the full KV in (PCIe, storage); may be inf
    step_overhead_s: float  # per forward step: launches, sampling, TP all-reduce, Python
    flops: float  # effective FLOP/s
    memory_bytes: float  # device memory for weights + KV (activations and graphs already taken)
    # GPU kernels overlap compute with memory traffic (roofline max); eager torch on CPU does not.
    compute_overlaps_memory: bool = True
    # Per scheduler iteration, per request and per token of its context (on CPU, SGLang's
    # bookkeeping outside the timed forward grows with context). A lock-step VeriCache cycle
    # (x drafts + verify, looped inside the worker) is one iteration; other systems pay it per step.
    sched_s_per_context_token: float = 0.0

    def __post_init__(self) -> None:
        for name in ("hbm_bw", "inter_bw", "flops", "memory_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.step_overhead_s < 0 or self.sched_s_per_context_token < 0:
            raise ValueError("overheads must be >= 0")

    def with_inter_bw(self, inter_bw: float) -> Hardware:
        return replace(self, inter_bw=inter_bw)


@dataclass(frozen=True, slots=True)
class Model:
    """Decoder geometry; KV bytes per token follow from it (K and V, every layer)."""

    name: str
    n_params: float
    weight_bytes: float
    n_layers: int
    n_kv_heads: int
    head_dim: int
    n_q_heads: int
    kv_dtype_bytes: int = 2
    # False when the attention's compute is already inside the per-KV-byte cost (the CPU fit).
    attention_flops: bool = True

    def __post_init__(self) -> None:
        if (
            min(self.n_layers, self.n_kv_heads, self.head_dim, self.n_q_heads, self.kv_dtype_bytes)
            < 1
        ):
            raise ValueError("geometry must be positive")
        if self.n_params <= 0 or self.weight_bytes < 0:
            raise ValueError("n_params must be > 0 and weight_bytes >= 0")

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.kv_dtype_bytes

    def flops_per_token(self, context: float) -> float:
        """Weights (2 per parameter) plus attention QK and PV over ``context`` tokens."""
        attn = 4.0 * context * self.n_layers * self.n_q_heads * self.head_dim
        return 2.0 * self.n_params + (attn if self.attention_flops else 0.0)

    def prefill_flops(self, tokens: int) -> float:
        """Causal prefill: weights per token plus half of the L x L attention."""
        attn = 2.0 * tokens * tokens * self.n_layers * self.n_q_heads * self.head_dim
        return 2.0 * self.n_params * tokens + (attn if self.attention_flops else 0.0)


def tokens_per_verify(x: int, alpha: float) -> float:
    """E(x, alpha): committed tokens per verify with i.i.d. per-token acceptance alpha, x drafts."""
    if not 0.0 <= alpha <= 1.0 or x < 0:
        raise ValueError("need 0 <= alpha <= 1 and x >= 0")
    return float(x + 1) if alpha == 1.0 else (1.0 - alpha ** (x + 1)) / (1.0 - alpha)


def _solve_alpha(f, target: float) -> float:
    """Bisection for alpha in [0, 1] with f increasing in alpha."""
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return 0.5 * (lo + hi)


@dataclass(frozen=True, slots=True)
class Acceptance:
    """Per-token acceptance alpha, optionally with a measured accepted-length curve.

    ``curve`` holds (draft length x, committed tokens per verify) pairs; inside its x range it is
    interpolated, outside it the geometric model with ``alpha`` (fitted to the curve) is used.
    """

    label: str
    alpha: float
    curve: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError("alpha must be in [0, 1]")
        if any(not 1.0 <= e <= x + 1 for x, e in self.curve):
            raise ValueError("a curve point needs 1 <= E <= x + 1")

    def tokens_per_verify(self, x: int) -> float:
        xs = [p[0] for p in self.curve]
        if self.curve and xs[0] <= x <= xs[-1]:
            return float(np.interp(x, xs, [p[1] for p in self.curve]))
        return tokens_per_verify(x, self.alpha)

    @classmethod
    def from_tokens_per_verify(cls, label: str, x: int, e: float) -> Acceptance:
        return cls(label, _solve_alpha(lambda a: tokens_per_verify(x, a), e))

    @classmethod
    def from_accepted_fraction(cls, label: str, x: int, fraction: float) -> Acceptance:
        """``fraction`` of x drafted tokens accepted on average (excludes the bonus token)."""
        return cls(label, _solve_alpha(lambda a: (tokens_per_verify(x, a) - 1.0) / x, fraction))

    @classmethod
    def from_curve(cls, label: str, points: list[tuple[int, float]]) -> Acceptance:
        pts = tuple(sorted((int(x), float(e)) for x, e in points))
        grid = np.linspace(0.0, 1.0, 2001)
        err = [sum((tokens_per_verify(x, a) - e) ** 2 for x, e in pts) for a in grid]
        return cls(label, float(grid[int(np.argmin(err))]), pts)


class VerifyBuffers(StrEnum):
    """Where a staggered verifier's full KV lands on the device.

    RING: whole full KVs are prefetched into 2*ceil(B/(x+1)) slots (the paper's memory ring), so
    the link streams continuously and every step carries B/(x+1) verifies' worth of transfer.
    LAYER: a verifier's full KV streams in layer by layer inside its own step (double-buffered,
    2*ceil(B/(x+1)) layers of KV), so a step with k verifiers waits for k whole transfers: with
    B < x+1 most steps carry none and a few carry one.
    AUTO: throughput() takes whichever gives more tokens/s under the budget.
    """

    RING = "ring"
    LAYER = "layer"
    AUTO = "auto"


@dataclass(frozen=True, slots=True)
class Workload:
    context: int  # tokens of context per request (the KV each step attends over)
    draft_len: int  # x
    kept_fraction: float  # c: compressed KV bytes / full KV bytes
    acceptance: Acceptance
    max_batch: int = 128  # offered concurrency: the batch when memory is ample
    verify_buffers: VerifyBuffers = VerifyBuffers.AUTO

    def __post_init__(self) -> None:
        if self.context < 1 or self.draft_len < 1 or self.max_batch < 1:
            raise ValueError("context, draft_len, max_batch must be >= 1")
        if not 0.0 < self.kept_fraction <= 1.0:
            raise ValueError("kept_fraction must be in (0, 1]")

    @property
    def tokens_per_verify(self) -> float:
        return self.acceptance.tokens_per_verify(self.draft_len)
