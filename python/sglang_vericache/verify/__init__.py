"""Verify-window logic: acceptance, per-request state machine, draft-length
policy, staggered verification with the two resource rings, and stats.

Pure python + torch (torch only in ``accept``); no sglang import. The SGLang
spec worker (``sglang_vericache.srt.spec_worker``) drives these each step.
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
    AdaptiveDraftLength,
    DraftCosts,
    DraftLengthPolicy,
    DraftQuery,
    FixedDraftLength,
    expected_committed,
)
from sglang_vericache.verify.rings import (
    Reservation,
    RingConfig,
    StepRing,
    TransferDemand,
    VerifyRings,
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
    "AcceptResult",
    "AcceptanceConfig",
    "AcceptanceEstimate",
    "AdaptiveDraftLength",
    "DecodeMode",
    "DraftCosts",
    "DraftLengthPolicy",
    "DraftQuery",
    "FetchState",
    "FixedDraftLength",
    "IllegalTransition",
    "Phase",
    "Reservation",
    "RingConfig",
    "StaggerConfig",
    "StaggerScheduler",
    "StepPlan",
    "StepRing",
    "TransferDemand",
    "VeriCacheMetrics",
    "VeriCacheStats",
    "VerifyRecord",
    "VerifyRings",
    "VerifyWindow",
    "WindowPlan",
    "clip_draft_lens_at_stop",
    "expected_committed",
    "greedy_accept",
    "truncate_committed",
]
