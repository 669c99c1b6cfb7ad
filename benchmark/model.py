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

This module: step(), max_batch(), throughput(), the sweeps, remote_prefix(); it re-exports
Hardware, Model, Acceptance, Workload from model_inputs.py (the inputs those take). Beside it:
model_params.py (GPU/model presets, the measured CPU points and their least-squares fit),
model_report.py (scenarios, projection, JSON, CLI), model_markdown.py, model_plots.py.
CLI: python benchmark/model.py [--out benchmark/results].
Pure python + numpy (+ matplotlib Agg for the plots); no sglang.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum

# Flat import like the other model_*.py siblings: benchmark/ is on sys.path (script dir, tests).
# Re-exported: model_params, model_report and the tests use these as m.Hardware, m.Acceptance, ...
from model_inputs import (  # noqa: F401
    Acceptance,
    Hardware,
    Model,
    VerifyBuffers,
    Workload,
    tokens_per_verify,
)

GB = 1e9


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
    ratio = lambda a, b: a / b if b else None
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
