"""Invariants of the VeriCache cost model (benchmark/model*.py) and its CPU fit; numpy, < 1 s."""

from __future__ import annotations

import itertools
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmark"))
import model as m  # noqa: E402
import model_params as p  # noqa: E402
import model_report as report  # noqa: E402
from model_markdown import markdown  # noqa: E402

S = m.System
HW = p.h200(p.LLAMA_8B)
MEMORY_ONLY = replace(HW, step_overhead_s=0.0, flops=1e30)  # the paper's formula: bytes only


def workload(
    alpha: float = 0.97,
    c: float = 0.25,
    x: int = 30,
    ctx: int = 32768,
    buffers: m.VerifyBuffers = m.VerifyBuffers.RING,
) -> m.Workload:
    return m.Workload(ctx, x, c, m.Acceptance("test", alpha), verify_buffers=buffers)


AUTO, RING, LAYER = m.VerifyBuffers.AUTO, m.VerifyBuffers.RING, m.VerifyBuffers.LAYER


def test_tokens_per_verify_bounds_and_monotone() -> None:
    for x in (1, 4, 30):
        assert m.tokens_per_verify(x, 0.0) == 1.0
        assert m.tokens_per_verify(x, 1.0) == x + 1
        es = [m.tokens_per_verify(x, a / 20) for a in range(21)]
        assert all(1.0 <= e <= x + 1 for e in es)
        assert all(b > a for a, b in zip(es, es[1:]))
    assert m.tokens_per_verify(30, 0.8) == pytest.approx(
        5.0, abs=0.01
    )  # why alpha=0.8 is pessimistic
    assert m.tokens_per_verify(8, 0.5) == pytest.approx(2.0, abs=0.01)  # cpu-draft-cost.md §3 table


def test_acceptance_inversions_round_trip() -> None:
    acc = m.Acceptance.from_tokens_per_verify("e21", 30, 21.0)
    assert acc.tokens_per_verify(30) == pytest.approx(21.0, rel=1e-6)
    frac = m.Acceptance.from_accepted_fraction("f", 4, 0.95)
    assert (m.tokens_per_verify(4, frac.alpha) - 1) / 4 == pytest.approx(0.95, rel=1e-6)
    pts = [(x, m.tokens_per_verify(x, 0.9)) for x in (2, 4, 8, 16)]
    curve = m.Acceptance.from_curve("c", pts)
    assert curve.alpha == pytest.approx(0.9, abs=1e-3)
    assert curve.tokens_per_verify(6) == pytest.approx((pts[1][1] + pts[2][1]) / 2)  # interpolated
    assert curve.tokens_per_verify(30) == pytest.approx(m.tokens_per_verify(30, curve.alpha))
    with pytest.raises(ValueError):
        m.Acceptance("bad", 0.5, ((4, 6.0),))  # E > x + 1


def test_kv_bytes_per_token_from_architecture() -> None:
    assert p.LLAMA_8B.kv_bytes_per_token == 131072  # 128 KiB
    assert p.LLAMA_70B.kv_bytes_per_token == 327680  # 320 KiB
    assert p.SMOLLM2.kv_bytes_per_token == 46080  # baseline.md (c)


def test_staggered_matches_paper_formula() -> None:
    """T = max((M + B*KV*(c + 1/x))/BW_hbm, B*KV/(x*BW_inter)), up to the 1/x vs 1/(x+1) cycle."""
    for b, x, c in itertools.product((8, 64), (8, 30), (0.125, 0.5)):
        wl = workload(c=c, x=x)
        kv = p.LLAMA_8B.kv_bytes_per_token * wl.context
        st = m.step(S.STAGGERED, MEMORY_ONLY, p.LLAMA_8B, wl, b)
        paper_hbm = (p.LLAMA_8B.weight_bytes + b * kv * (c + 1 / x)) / HW.hbm_bw
        paper_inter = b * kv / (x * HW.inter_bw)
        assert st.inter_s == pytest.approx(paper_inter * x / (x + 1))
        assert st.device_s <= paper_hbm and st.device_s >= paper_hbm * (1 - 1 / x)
        assert st.seconds == pytest.approx(max(st.device_s, st.inter_s))


def test_no_compression_and_perfect_acceptance_is_full_kv() -> None:
    """c = 1, alpha = 1, free interconnect, memory-bound: VeriCache and lossy equal full KV."""
    hw = replace(MEMORY_ONLY, inter_bw=math.inf)
    wl = workload(alpha=1.0, c=1.0)
    full = m.step(S.FULL, hw, p.LLAMA_8B, wl, 16).throughput
    for s in (S.STAGGERED, S.LOSSY):
        assert m.step(s, hw, p.LLAMA_8B, wl, 16).throughput == pytest.approx(full, rel=1e-12)


def test_staggered_never_slower_than_lockstep() -> None:
    grid = itertools.product((1e9, 55e9, 1e12), (1, 7, 64), (4, 30), (0.1, 0.5), (0.5, 0.97))
    for bw, b, x, c, a in grid:
        hw = HW.with_inter_bw(bw)
        lock = m.step(S.LOCKSTEP, hw, p.LLAMA_8B, workload(alpha=a, c=c, x=x), b).throughput
        for buffers in (RING, LAYER):  # at the same batch, either buffer layout
            wl = workload(alpha=a, c=c, x=x, buffers=buffers)
            assert m.step(S.STAGGERED, hw, p.LLAMA_8B, wl, b).throughput >= lock * (1 - 1e-12)
        wl = workload(alpha=a, c=c, x=x, buffers=AUTO)
        for budget in (5e9, 40e9, 110e9):  # and under a KV budget
            assert m.throughput(S.STAGGERED, hw, p.LLAMA_8B, wl, budget)[1] >= m.throughput(
                S.LOCKSTEP, hw, p.LLAMA_8B, wl, budget
            )[1] * (1 - 1e-12)


def test_ring_buffers_spread_the_link_layer_buffers_save_memory() -> None:
    for b, bw in itertools.product((1, 5, 40, 100), (2e9, 55e9)):
        hw = HW.with_inter_bw(bw)
        ring, layer = workload(buffers=RING), workload(buffers=LAYER)
        st_ring, st_layer = (m.step(S.STAGGERED, hw, p.LLAMA_8B, w, b) for w in (ring, layer))
        assert st_ring.tokens == st_layer.tokens and st_ring.inter_s == pytest.approx(
            st_layer.inter_s
        )
        assert st_ring.seconds <= st_layer.seconds * (1 + 1e-12)  # spreading never hurts
        assert m.device_kv_bytes(S.STAGGERED, p.LLAMA_8B, layer, b) < m.device_kv_bytes(
            S.STAGGERED, p.LLAMA_8B, ring, b
        )
    # one fetch takes longer than a step but the average fits: only the ring hides it
    ring, layer = workload(ctx=8192, buffers=RING), workload(ctx=8192, buffers=LAYER)
    t_ring = m.step(S.STAGGERED, HW, p.LLAMA_8B, ring, 8).seconds
    assert m.step(S.STAGGERED, HW, p.LLAMA_8B, layer, 8).seconds > 1.3 * t_ring
    auto = m.throughput(S.STAGGERED, HW, p.LLAMA_8B, workload(buffers=AUTO), 20e9)[1]
    for buffers in (RING, LAYER):
        assert auto >= m.throughput(S.STAGGERED, HW, p.LLAMA_8B, workload(buffers=buffers), 20e9)[1]
    with pytest.raises(ValueError):
        m.step(S.STAGGERED, HW, p.LLAMA_8B, workload(buffers=AUTO), 8)


def test_monotone_in_acceptance_compression_and_bandwidth() -> None:
    def tput(hw: m.Hardware, wl: m.Workload) -> float:
        return m.throughput(S.STAGGERED, hw, p.LLAMA_8B, replace(wl, verify_buffers=AUTO))[1]

    alphas = [tput(HW, workload(alpha=a)) for a in (0.5, 0.8, 0.9, 0.97, 0.99)]
    assert all(b > a for a, b in zip(alphas, alphas[1:]))
    cs = [tput(HW, workload(c=c)) for c in (0.5, 0.25, 0.125)]
    assert all(b >= a for a, b in zip(cs, cs[1:]))
    bws = [tput(HW.with_inter_bw(bw), workload()) for bw in (1e9, 55e9, 450e9)]
    assert all(b > a for a, b in zip(bws, bws[1:]))


def test_interconnect_bound_when_link_is_tiny() -> None:
    wl, hw = workload(), HW.with_inter_bw(1e8)
    st = m.step(S.STAGGERED, hw, p.LLAMA_8B, wl, 64)
    assert st.inter_s > 10 * st.device_s
    kv = p.LLAMA_8B.kv_bytes_per_token * wl.context
    assert st.throughput == pytest.approx(wl.tokens_per_verify * hw.inter_bw / kv, rel=0.01)
    off = m.step(S.OFFLOAD, hw, p.LLAMA_8B, wl, 64)
    assert off.throughput == pytest.approx(hw.inter_bw / kv, rel=0.01)


def test_batch_fits_budget_and_next_does_not() -> None:
    wl = workload()
    kv = p.LLAMA_8B.kv_bytes_per_token * wl.context
    budget = m.kv_budget(HW, p.LLAMA_8B)
    assert m.max_batch(S.FULL, p.LLAMA_8B, wl, budget) == int(budget // kv)
    for s in S:
        b = m.max_batch(s, p.LLAMA_8B, wl, budget)
        assert m.device_kv_bytes(s, p.LLAMA_8B, wl, b) <= budget
        assert b == wl.max_batch or m.device_kv_bytes(s, p.LLAMA_8B, wl, b + 1) > budget
    assert m.max_batch(S.STAGGERED, p.LLAMA_8B, wl, budget) > 2 * m.max_batch(
        S.FULL, p.LLAMA_8B, wl, budget
    )
    assert m.throughput(S.FULL, HW, p.LLAMA_8B, wl, budget=kv * 0.5) == (0, 0.0)
    assert m.speedup(S.STAGGERED, HW, p.LLAMA_8B, wl, budget=kv * 0.5) is None


def test_break_even_budget_closed_form_brackets_the_sweep() -> None:
    wl = workload(alpha=m.Acceptance.from_tokens_per_verify("p", 30, 21.0).alpha)
    hw = p.h200(p.LLAMA_70B, 2)
    be = report.break_even_budget(p.LLAMA_70B, hw, wl.tokens_per_verify)
    assert be is not None
    assert m.speedup(S.STAGGERED, hw, p.LLAMA_70B, wl, budget=0.5 * be) > 1.0
    assert m.speedup(S.STAGGERED, hw, p.LLAMA_70B, wl, budget=1.5 * be) < 1.0


def test_cpu_fit_reproduces_inputs_and_speedups() -> None:
    fit = p.fit_cpu()
    assert (
        40 < fit.f0_ms < 80 and 5e-3 < fit.g_ms_per_kv_token < 20e-3 and 0 < fit.k_ms_per_token < 20
    )
    assert max(abs(r) for r in fit.residuals_ms["forwards"]) < 5.0  # ms, on 80-234 ms forwards
    assert max(abs(r) for r in fit.residuals_ms["end_to_end"]) < 20.0
    hw, ctx = fit.hardware(), p.CPU_CONTEXT  # the fit as Hardware gives back the fitted line
    plain = m.step(S.FULL, hw, p.SMOLLM2, replace(workload(ctx=ctx), max_batch=1), 1).seconds * 1e3
    expect = (
        fit.f0_ms
        + fit.g_ms_per_kv_token * ctx
        + fit.k_ms_per_token
        + fit.s_ms_per_context_token * ctx
    )
    assert plain == pytest.approx(expect)
    val = p.cpu_validation(fit)
    for name in ("keep 2048", "keep 1024"):
        assert val[name]["validated"] and val[name]["within_tolerance"], val[name]
        assert abs(val[name]["relative_error"]) <= p.CPU_SPEEDUP_TOLERANCE


def test_remote_prefix_bounds() -> None:
    wl = workload()
    kv = p.LLAMA_8B.kv_bytes_per_token * wl.context
    r = m.remote_prefix(HW, p.LLAMA_8B, wl, 2e9, 512, 40e9)
    assert r["vericache_single_node"]["tokens_per_s"] <= 512 * 2e9 / kv * (1 + 1e-12)
    assert r["fetch_then_decode"]["tokens_per_s"] <= 512 * 2e9 / kv * (1 + 1e-12)
    assert r["vericache_paper_topology"]["ttft_s"] < r["fetch_then_decode"]["ttft_s"]


def test_scenarios_with_and_without_compressors_json(tmp_path: Path) -> None:
    fallback = report.scenarios(tmp_path)
    assert [s.key for s in fallback][-1] == "ours_int4_design"
    assert 0.25 < fallback[-1].kept_fraction < 0.3
    doc = {
        "check": {"ratio": 4.0, "best_quantizer": {"family": "kivi4"}, "best_dropper": None},
        "results": [
            {
                "family": "kivi4",
                "target_ratio": 4.0,
                "measured_ratio": 4.1,
                "accepted": {
                    "4": {"mean_accepted_per_verify": 4.6},
                    "8": {"mean_accepted_per_verify": 8.1},
                },
            }
        ],
    }
    (tmp_path / "compressors.json").write_text(json.dumps(doc))
    ours = report.scenarios(tmp_path)[-1]
    assert ours.key == "ours_kivi4" and ours.kept_fraction == 0.25
    assert ours.acceptance.tokens_per_verify(8) == pytest.approx(8.1)
    (tmp_path / "compressors.json").write_text(
        json.dumps({"results": []})
    )  # unknown format: fall back
    assert report.scenarios(tmp_path)[-1].key == "ours_int4_design"


def test_projection_document_is_json_and_states_assumptions(tmp_path: Path) -> None:
    doc = report.project(tmp_path)
    text = json.dumps(doc)
    assert "Infinity" not in text and "NaN" not in text
    assert len(doc["assumptions"]) >= 10 and set(doc["h200"]) == {"8B", "70B"}
    md = markdown(doc, ["x.png"])
    assert "1.92-2.73" in md and "1.33-2.11" in md and "## Assumptions" in md
