"""Cost model of VeriCache decoding (the paper's iteration-time model), fitted to our CPU numbers
and projected to an H200.

Per decode step the device streams its weights and the KV it attends over from HBM, and the
interconnect (PCIe from host memory, or a storage link) brings in the full KV of the requests that
verify in this step; both overlap (arXiv 2605.17613, quoted in /work/shared/notes/anchors.md §1.2):

    T_iter = max((M + B*KV_full*(c + 1/x)) / BW_hbm,  B*KV_full / (x*BW_inter))

Here a request cycles through x draft steps (compressed KV, kept bytes fraction c) and one verify
step (x+1 tokens over its full KV), committing E(x, alpha) = (1 - alpha^(x+1)) / (1 - alpha)
tokens, so B/(x+1) requests verify per step (the paper's 1/x is the large-x limit). Additions
over the paper's formula, all needed to fit real numbers: a fixed per-step overhead, a
per-scheduler-iteration overhead, and compute (roofline max with memory on a GPU, a sum on CPU).

This module: Hardware, Model, Acceptance, Workload, step(), max_batch(), throughput(), the
sweeps, remote_prefix(). Beside it: model_params.py (GPU/model presets, the measured CPU points
and their least-squares fit), model_report.py (scenarios, projection, JSON, CLI),
model_markdown.py, model_plots.py. CLI: python benchmark/model.py [--out benchmark/results].
Pure python + numpy (+ matplotlib Agg for the plots); no sglang.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np

GB = 1e9


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


class System(StrEnum):
    FULL = "full"  # full KV resident on the device (plain SGLang)
    OFFLOAD = "offload"  # full KV in host memory, swapped in layer by layer every step, no draft
    LOSSY = "lossy"  # compressed KV only: fast, not exact
    STAGGERED = "staggered"  # VeriCache, B/(x+1) requests verify per step, fetch overlapped
    LOCKSTEP = "lockstep"  # VeriCache, every request verifies in the same step


@dataclass(frozen=True, slots=True)
class Step:
    """A decode step averaged over a draft/verify cycle: seconds and committed tokens."""

    seconds: float
    tokens: float
    device_s: float  # HBM/compute part
    inter_s: float  # interconnect part

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds


def _device_s(hw: Hardware, mem_bytes: float, flops: float) -> float:
    mem, comp = mem_bytes / hw.hbm_bw, flops / hw.flops
    return max(mem, comp) if hw.compute_overlaps_memory else mem + comp


def step(system: System, hw: Hardware, model: Model, wl: Workload, batch: float) -> Step:
    """Average step of ``batch`` requests running ``system``.

    Staggered: (B - v) requests draft over c*KV_full, v = B/(x+1) verify x+1 tokens over KV_full,
    whose bytes cross the interconnect: T = max(device, interconnect), with v spread evenly over
    steps (RING buffers) or rounded to whole verifiers per step (LAYER buffers).
    Lock-step: x draft steps for all, then one verify step that streams all B full KVs layer by
    layer (a buffer to prefetch them during drafting would be the full-KV footprint itself).
    """
    if batch <= 0:
        raise ValueError("batch must be > 0")
    b, x, c, e = float(batch), wl.draft_len, wl.kept_fraction, wl.tokens_per_verify
    kv = model.kv_bytes_per_token * wl.context
    m, ovh, sched = (
        model.weight_bytes,
        hw.step_overhead_s,
        hw.sched_s_per_context_token * b * wl.context,
    )
    f_full, f_comp = model.flops_per_token(wl.context), model.flops_per_token(c * wl.context)
    if system is System.FULL:
        dev = _device_s(hw, m + b * kv, b * f_full)
        return Step(ovh + sched + dev, b, dev, 0.0)
    if system is System.LOSSY:
        dev = _device_s(hw, m + b * c * kv, b * f_comp)
        return Step(ovh + sched + dev, b, dev, 0.0)
    if system is System.OFFLOAD:
        dev, inter = _device_s(hw, m + b * kv, b * f_full), b * kv / hw.inter_bw
        return Step(ovh + sched + max(dev, inter), b, dev, inter)
    if system is System.STAGGERED:
        v = b / (x + 1)

        def parts(k: float) -> tuple[float, float]:  # device and link time, k verifiers
            dev = _device_s(
                hw, m + (b - k) * c * kv + k * kv, (b - k) * f_comp + k * (x + 1) * f_full
            )
            return dev, k * kv / hw.inter_bw

        if _buffers(wl) is VerifyBuffers.RING:
            dev, inter = parts(v)
            return Step(ovh + sched + max(dev, inter), v * e, dev, inter)
        n, frac = math.floor(v), v - math.floor(v)  # steps carry n or n+1 whole verifiers
        (d0, i0), (d1, i1) = parts(n), parts(n + 1)
        t = (1 - frac) * max(d0, i0) + frac * max(d1, i1)
        dev, inter = (1 - frac) * d0 + frac * d1, (1 - frac) * i0 + frac * i1
        return Step(ovh + sched + t, v * e, dev, inter)
    if system is System.LOCKSTEP:
        draft = _device_s(hw, m + b * c * kv, b * f_comp)
        verify_dev, inter = _device_s(hw, m + b * kv, b * (x + 1) * f_full), b * kv / hw.inter_bw
        cycle = (x + 1) * ovh + sched + x * draft + max(verify_dev, inter)
        return Step(
            cycle / (x + 1), b * e / (x + 1), (x * draft + verify_dev) / (x + 1), inter / (x + 1)
        )
    raise ValueError(system)


def _buffers(wl: Workload) -> VerifyBuffers:
    if wl.verify_buffers is VerifyBuffers.AUTO:
        raise ValueError("step() and device_kv_bytes() need RING or LAYER; throughput() picks")
    return wl.verify_buffers


def kv_budget(hw: Hardware, model: Model) -> float:
    """Device bytes left for KV once the weights are loaded."""
    return hw.memory_bytes - model.weight_bytes


def device_kv_bytes(system: System, model: Model, wl: Workload, batch: int) -> float:
    """Peak device KV bytes of ``batch`` requests: resident KV plus transient full-KV buffers."""
    kv = model.kv_bytes_per_token * wl.context
    layer_stream = 2.0 * batch * kv / model.n_layers  # double-buffered per-layer swap-in
    if system is System.FULL:
        return batch * kv
    if system is System.LOSSY:
        return batch * wl.kept_fraction * kv
    if system is System.OFFLOAD:
        return layer_stream
    if system is System.LOCKSTEP:
        return batch * wl.kept_fraction * kv + layer_stream
    if system is System.STAGGERED:
        slots = math.ceil(batch / (wl.draft_len + 1))
        buffer = kv if _buffers(wl) is VerifyBuffers.RING else kv / model.n_layers
        return batch * wl.kept_fraction * kv + 2.0 * slots * buffer
    raise ValueError(system)


def max_batch(system: System, model: Model, wl: Workload, budget: float) -> int:
    """Largest batch <= wl.max_batch whose peak device KV fits ``budget`` bytes (0 if none)."""
    lo, hi = 0, wl.max_batch
    while lo < hi:  # device_kv_bytes is non-decreasing in batch
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if device_kv_bytes(system, model, wl, mid) <= budget else (lo, mid - 1)
    return lo


def throughput(
    system: System, hw: Hardware, model: Model, wl: Workload, budget: float | None = None
) -> tuple[int, float]:
    """(batch, committed tokens/s) at the largest batch that fits the KV budget.

    Staggered with AUTO buffers: the better of RING and LAYER, each at its own largest batch.
    """
    if system is System.STAGGERED and wl.verify_buffers is VerifyBuffers.AUTO:
        modes = (VerifyBuffers.RING, VerifyBuffers.LAYER)
        return max(
            (throughput(system, hw, model, replace(wl, verify_buffers=v), budget) for v in modes),
            key=lambda bt: bt[1],
        )
    b = max_batch(system, model, wl, kv_budget(hw, model) if budget is None else budget)
    return b, (step(system, hw, model, wl, b).throughput if b else 0.0)


def speedup(
    system: System, hw: Hardware, model: Model, wl: Workload, budget: float | None = None
) -> float | None:
    """Throughput of ``system`` over full-KV decoding under the same budget (None: full fits 0)."""
    full = throughput(System.FULL, hw, model, wl, budget)[1]
    return throughput(system, hw, model, wl, budget)[1] / full if full else None


def memory_budget_sweep(
    hw: Hardware, model: Model, wl: Workload, budgets: list[float]
) -> list[dict]:
    """The paper's Fig. 13 analogue: every system's batch and throughput at each KV budget."""
    rows = []
    for budget in budgets:
        row: dict = {
            "budget_gb": budget / GB,
            "budget_fraction": budget / (wl.max_batch * model.kv_bytes_per_token * wl.context),
        }
        for s in System:
            b, tput = throughput(s, hw, model, wl, budget)
            row[s.value] = {"batch": b, "tokens_per_s": tput}
        full = row[System.FULL.value]["tokens_per_s"]
        row["speedup_staggered"] = row["staggered"]["tokens_per_s"] / full if full else None
        row["speedup_lockstep"] = row["lockstep"]["tokens_per_s"] / full if full else None
        rows.append(row)
    return rows


def context_sweep(hw: Hardware, model: Model, wl: Workload, contexts: list[int]) -> list[dict]:
    """Speedups at the device's own KV budget as the context grows."""
    rows = []
    for ctx in contexts:
        w = replace(wl, context=ctx)
        row: dict = {"context": ctx}
        for s in System:
            b, tput = throughput(s, hw, model, w)
            row[s.value] = {"batch": b, "tokens_per_s": tput}
        full = row["full"]["tokens_per_s"]
        row["speedup_staggered"] = row["staggered"]["tokens_per_s"] / full if full else None
        rows.append(row)
    return rows


def best_draft_len(hw: Hardware, model: Model, wl: Workload, candidates: tuple[int, ...]) -> dict:
    """The paper picks a static x per workload from the speedup curve; so do we."""
    tputs = {
        x: throughput(System.STAGGERED, hw, model, replace(wl, draft_len=x))[1] for x in candidates
    }
    x = max(tputs, key=lambda k: tputs[k])
    return {"draft_len": x, "tokens_per_s": tputs[x]}


def prefill_s(hw: Hardware, model: Model, tokens: int) -> float:
    return hw.step_overhead_s + _device_s(hw, model.weight_bytes, model.prefill_flops(tokens))


def remote_prefix(
    hw: Hardware, model: Model, wl: Workload, remote_bw: float, out_tokens: int, near_bw: float
) -> dict:
    """Remote prefix caching: a ``wl.context``-token prefix whose KV sits behind a slow link.

    Baselines on the serving device: recompute the prefix (GPU time shared with decoding) or fetch
    the full KV then decode (link-bound at out_tokens * remote_bw / KV_full). VeriCache in two
    topologies: ``single_node`` (this repo: compressed prefix local, full KV crosses the slow
    link once into host memory, then long-context decoding over PCIe) and ``paper`` (the slow
    link carries only c*KV_full; a near GPU that loads the full KV at ``near_bw`` verifies; each
    in-flight request holds a full-KV slot there, so the batch is capped by the near GPU's
    full-KV capacity; the near GPU's own serving load is ignored: optimistic).
    """
    kv = model.kv_bytes_per_token * wl.context
    b_full, full_tput = throughput(System.FULL, hw, model, wl)
    one = step(System.FULL, hw, model, wl, 1).seconds
    link = out_tokens * remote_bw / kv
    pre = prefill_s(hw, model, wl.context)
    fetch = {"tokens_per_s": min(full_tput, link), "ttft_s": kv / remote_bw + one}
    recompute = {
        "tokens_per_s": out_tokens / (pre + out_tokens / full_tput) if full_tput else 0.0,
        "ttft_s": pre + one,
    }
    best = max(fetch["tokens_per_s"], recompute["tokens_per_s"])
    best_ttft = min(fetch["ttft_s"], recompute["ttft_s"])
    _, vc_tput = throughput(System.STAGGERED, hw, model, wl)
    verify_s = step(System.FULL, hw, model, replace(wl, max_batch=1), 1).seconds
    single = {"tokens_per_s": min(vc_tput, link), "ttft_s": kv / remote_bw + verify_s}
    b_paper = min(b_full, max_batch(System.LOSSY, model, wl, kv_budget(hw, model)))
    if b_paper:
        draft = step(System.LOSSY, hw, model, wl, b_paper)
        capacity = b_paper * wl.tokens_per_verify / ((wl.draft_len + 1) * draft.seconds)
    else:
        capacity = 0.0
    paper = {
        "tokens_per_s": min(capacity, out_tokens * remote_bw / (wl.kept_fraction * kv)),
        "ttft_s": max(kv / near_bw, wl.kept_fraction * kv / remote_bw) + one,
        "batch": b_paper,
    }
    ratio = lambda a, b: a / b if b else None  # noqa: E731
    return {
        "remote_bw_gbps": remote_bw / GB,
        "out_tokens": out_tokens,
        "fetch_then_decode": fetch,
        "recompute": recompute,
        "vericache_single_node": single,
        "vericache_paper_topology": paper,
        "speedup_single_node": ratio(single["tokens_per_s"], best),
        "speedup_paper_topology": ratio(paper["tokens_per_s"], best),
        "ttft_speedup_paper_topology": ratio(best_ttft, paper["ttft_s"]),
        "ttft_speedup_single_node": ratio(best_ttft, single["ttft_s"]),
    }


def kivi_kept_fraction(bits: int, head_dim: int, group: int = 32, dtype_bytes: int = 2) -> float:
    """Bytes kept by KIVI (shared format in CONTEXT.md): keys per-channel scale+zero per ``group``
    tokens, values per-token scale+zero over head_dim channels, both in the KV dtype."""
    packed = bits / 8.0
    key = packed + 2 * dtype_bytes / group
    value = packed + 2 * dtype_bytes / head_dim
    return (key + value) / (2 * dtype_bytes)


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from model_report import main

    main()
