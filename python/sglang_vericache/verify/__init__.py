"""Verify-window logic: acceptance, per-request state machine, draft-length
policy, staggered verification with the two resource rings, and stats.

Pure python + torch (torch only in ``accept``, ``spec_sampling``, ``sampling_probs``, ``rng``);
no sglang import. The SGLang
spec worker (``sglang_vericache.srt.spec_worker``) drives these each step
(``test/unit/verify/test_verify_loop.py`` runs exactly this sequence)::

    plan = sched.step(t, n_active)                     # StaggerScheduler
    for wp in plan.planned:   windows[wp.rid].retarget(wp.draft_len)
    for rid in plan.start_fetch:  submit the tier fetch; windows[rid].start_fetch(nbytes)
    poll the tier:            windows[rid].fetch_done(now) / fetch_failed(now)
    for rid in plan.verify:   end_draft(now) if still DRAFT; verify if ready_to_verify()
    everyone else in DRAFT with draft_room > 0: draft one token -> add_drafts([tok])
    verify rows [last, d1..dn, pad] -> greedy_accept(rows, predict, draft_lens)
                              -> truncate_committed(...) (EOS / max_new_tokens)
    per verified request:     begin_verify(); rec = resolve(tokens); metrics.observe_verify(rec)
                              estimate.update(rec.drafted, rec.accepted); sched.complete(rid)
                              finish() | settle(policy.choose(query)); sched.submit(rid, t+1, ...)
"""

from __future__ import annotations

from sglang_vericache.verify.accept import (
    AcceptResult,
    clip_draft_lens_at_stop,
    greedy_accept,
    truncate_committed,
)
from sglang_vericache.verify.policy import (
    AcceptanceConfig,
    AcceptanceEstimate,
    expected_committed,
)
from sglang_vericache.verify.rings import (
    Reservation,
    RingConfig,
    StepRing,
    TransferDemand,
    VerifyRings,
)
from sglang_vericache.verify.rng import Draw, Randomness, RowSeeds, seeded_uniforms
from sglang_vericache.verify.sampling_probs import TOP_K_ALL, RowSampling, process_logits
from sglang_vericache.verify.spec_sampling import (
    AcceptDraws,
    acceptance_probability,
    draw_accept_uniforms,
    residual_distribution,
    sample_drafts,
    sample_from,
    speculative_accept,
)
from sglang_vericache.verify.stagger import (
    StaggerConfig,
    StaggerScheduler,
    StepPlan,
    WindowPlan,
)
from sglang_vericache.verify.stats import (
    ACCEPT_LEN_BUCKETS,
    DecodeMode,
    VeriCacheMetrics,
    VeriCacheStats,
    VerifyRecord,
)
from sglang_vericache.verify.window import FetchState, IllegalTransition, Phase, VerifyWindow

__all__ = [
    "ACCEPT_LEN_BUCKETS",
    "AcceptDraws",
    "AcceptResult",
    "AcceptanceConfig",
    "AcceptanceEstimate",
    "DecodeMode",
    "Draw",
    "FetchState",
    "IllegalTransition",
    "Phase",
    "Randomness",
    "Reservation",
    "RingConfig",
    "RowSampling",
    "RowSeeds",
    "StaggerConfig",
    "StaggerScheduler",
    "StepPlan",
    "StepRing",
    "TOP_K_ALL",
    "TransferDemand",
    "VeriCacheMetrics",
    "VeriCacheStats",
    "VerifyRecord",
    "VerifyRings",
    "VerifyWindow",
    "WindowPlan",
    "acceptance_probability",
    "clip_draft_lens_at_stop",
    "draw_accept_uniforms",
    "expected_committed",
    "greedy_accept",
    "process_logits",
    "residual_distribution",
    "sample_drafts",
    "sample_from",
    "seeded_uniforms",
    "speculative_accept",
    "truncate_committed",
]
