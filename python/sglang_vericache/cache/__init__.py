"""Tiered radix cache bookkeeping: compressed KV locally, full KV in a tier (pure python).

See README.md for the layer diagram. Only plain ints, tuples and opaque hashables cross
this package's boundary; SGLang glue lives in ``sglang_vericache.srt``.
"""

from sglang_vericache.cache.integrity import IntegrityError
from sglang_vericache.cache.node import (
    FullKV,
    FullState,
    Namespace,
    PageSlots,
    Residency,
    TaskId,
    TierKey,
    TieredNode,
)
from sglang_vericache.cache.pool import LocalSlotPool, check_slot_accounting
from sglang_vericache.cache.results import (
    EvictResult,
    FetchResult,
    InsertResult,
    Match,
    Released,
    TreeLock,
)
from sglang_vericache.cache.tree import TieredRadixTree

__all__ = [
    "EvictResult",
    "FetchResult",
    "FullKV",
    "FullState",
    "InsertResult",
    "IntegrityError",
    "LocalSlotPool",
    "Match",
    "Namespace",
    "PageSlots",
    "Released",
    "Residency",
    "TaskId",
    "TierKey",
    "TieredNode",
    "TieredRadixTree",
    "TreeLock",
    "check_slot_accounting",
]
