"""Verification logic: acceptance (greedy and speculative sampling), the sampling distribution
SGLang draws from, grammar masks along a draft chain, the per-step draft-length planner and
per-request stats.

Pure python + torch; no sglang import (SGLang's objects, where passed in, are duck-typed).
``sglang_vericache.srt.decode.decode_step`` drives these each decode step through one
``draft_chain.DraftChain``: draft along the chain (grammar masks, argmax, sampled draws:
``row_acceptance.draft_column``), verify, accept (``row_acceptance.accept_step`` over
``greedy_accept`` / ``speculative_accept``), settle (terminating drafts, stop tokens); then
record (``VeriCacheStats``) and plan the next step's draft length from measured forward costs
(``draft_length`` over ``step_plan``, ``step_cost``).
"""

from __future__ import annotations

from sglang_vericache.verify.accept import AcceptResult, greedy_accept
from sglang_vericache.verify.policy import (
    AcceptanceConfig,
    AcceptanceEstimate,
    expected_committed,
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
from sglang_vericache.verify.stats import (
    ACCEPT_LEN_BUCKETS,
    DecodeMode,
    VeriCacheStats,
    VerifyRecord,
)

__all__ = [
    "ACCEPT_LEN_BUCKETS",
    "AcceptDraws",
    "AcceptResult",
    "AcceptanceConfig",
    "AcceptanceEstimate",
    "DecodeMode",
    "Draw",
    "Randomness",
    "RowSampling",
    "RowSeeds",
    "TOP_K_ALL",
    "VeriCacheStats",
    "VerifyRecord",
    "acceptance_probability",
    "draw_accept_uniforms",
    "expected_committed",
    "greedy_accept",
    "process_logits",
    "residual_distribution",
    "sample_drafts",
    "sample_from",
    "seeded_uniforms",
    "speculative_accept",
]
