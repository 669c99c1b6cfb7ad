"""Admission under the VeriCache memory layout: what a running request will still take.

SGLang's ``PrefillAdder`` admits a new request only if the pool can also hold every running
request's future output: ``min(max_new - generated, CLIP) * new_token_ratio`` slots each. A
request VeriCache drafts keeps far less: its committed tokens move to host memory every
``TAIL_CHUNK`` tokens, so its future share of the pool is

    tail not yet offloaded + one verify's slots + compressed KV of the future tokens
    <= TAIL_CHUNK + verify width + ceil(future * reserved / offloaded)

(``reserved / offloaded`` is the request's own measured compressed fraction). This hook makes
admission reserve exactly that for such requests, and SGLang's estimate for everything else; it
is what lets a 4x compressor serve several times more long requests in the same budget. The
same method sizes decode retraction, which therefore also sees the smaller footprint.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from sglang_vericache.srt.offload import TAIL_CHUNK

TARGET = (
    "sglang.srt.managers.schedule_policy.PrefillAdder._get_running_request_total_token_offset"
)


def vericache_future_tokens(sglang_estimate: float, reserved: int, offloaded: int,
                            verify_width: int) -> float:  # fmt: skip
    """Pool slots a drafted request may still take (see module doc); never above SGLang's."""
    compressed = math.ceil(sglang_estimate * reserved / max(offloaded, 1))
    return min(sglang_estimate, TAIL_CHUNK + verify_width + compressed)


def _running_offset_around(original: Callable[..., Any], adder: Any, req: Any) -> Any:
    estimate = original(adder, req)
    offloader = getattr(adder.tree_cache, "offloader", None)
    kv = getattr(req, "kv", None)
    if offloader is None or kv is None or kv.req_pool_idx is None:
        return estimate
    span = offloader.ledger.span(kv.req_pool_idx)
    if span is None:
        return estimate  # not offloaded (yet): it holds its full KV like any request
    return vericache_future_tokens(
        estimate, int(span.reserved.numel()), span.host.length, adder.tree_cache.verify_width
    )


def register_admission_hook() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, _running_offset_around, HookType.AROUND)
