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

SGLang's admission loop stops at the first request it cannot add. A request whose prefix is
being fetched from a remote tier cannot be added yet, but nothing behind it should wait for the
network: the hook around ``add_one_req`` passes over it (as SGLang passes over a request whose
HiCache storage prefetch is running) and the loop goes on to the next.

A prefill's own offload (its full KV to the host, its compressed KV reserved) runs after its
first token is out, at the worker's next forward. When a request waits, the second hook runs
that work first (``OffloadLedger.settle_prefills``): SGLang's loop publishes a step's tokens
before it admits the next batch, so the first token is not delayed, and the attempt counts the
slots the offload gives back instead of waiting a decode step for them.

SGLang also stops trying to admit once an admission failed for memory (``batch_is_full``) until
a request leaves. Under VeriCache memory comes back without anyone leaving (the worker offloads
resident full KV when admission is short), so the second hook reopens admission whenever
offloads have freed slots since the last attempt. The third records what an attempt lacked
(``OffloadLedger.admission_deficit``): the pressure that makes the worker offload
(``sglang_vericache.placement``); while nothing waits for memory, full KV stays in the pool.
With it the second records the ask of each request queued behind (``waiting_asks``), so the
worker weighs plain decoding against drafting with every request that dropping the batch's
compressed KV would let in, not just the first (``srt/decode/step_costs.joining_contexts``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from sglang_vericache.srt.decode.eligibility import tokens_left
from sglang_vericache.srt.kv.offload import TAIL_CHUNK

TARGET = (
    "sglang.srt.managers.schedule_policy.PrefillAdder._get_running_request_total_token_offset"
)
PREFILL_TARGET = "sglang.srt.managers.scheduler.Scheduler._get_new_batch_prefill_raw"
ADD_TARGET = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"


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
    ledger = offloader.ledger
    span = ledger.span(kv.req_pool_idx)
    if span is None:
        return estimate  # not offloaded (yet): it holds its full KV like any request
    return vericache_future_tokens(estimate, ledger.reserved(kv.req_pool_idx), span.host.length,
                                   adder.tree_cache.verify_width)  # fmt: skip


def _new_prefill_around(original: Callable[..., Any], scheduler: Any, *args: Any, **kw: Any) -> Any:
    running_batch = kw.get("running_batch", args[1] if len(args) > 1 else None)
    offloader = getattr(scheduler.tree_cache, "offloader", None)
    settle = None if offloader is None else offloader.ledger.settle_prefills
    if settle is not None and scheduler.waiting_queue:
        settle()  # the last prefill's offload gives slots back: count them in this attempt
    if offloader is not None and running_batch is not None and running_batch.batch_is_full:
        freed = offloader.ledger.freed_slots
        if freed != getattr(scheduler.tree_cache, "freed_seen", 0):
            scheduler.tree_cache.freed_seen = freed
            running_batch.batch_is_full = False  # memory came back: try admitting again
    attempt_runs = running_batch is not None and not running_batch.batch_is_full
    if offloader is not None and (not scheduler.waiting_queue or attempt_runs):
        offloader.ledger.admission_deficit = 0  # an attempt runs now and reports afresh
        offloader.ledger.waiting_asks = []
    batch = original(scheduler, *args, **kw)
    if offloader is not None and attempt_runs and offloader.ledger.waiting_asks:
        offloader.ledger.waiting_asks = queued_asks(scheduler, offloader.ledger.waiting_asks)
    return batch


def queued_asks(scheduler: Any, lacked: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """``lacked`` (the ask of the request the attempt could not add) followed by the ask of every
    request queued behind it that waits for memory, not for a tier: what freeing slots would let
    in, in the order admission takes them (``srt/decode/step_costs.joining_contexts``)."""
    waiting = getattr(scheduler.tree_cache, "waiting_for_tier", None)
    rids = [req.rid for req in scheduler.waiting_queue]
    if lacked[0][0] not in rids:
        return lacked
    behind = scheduler.waiting_queue[rids.index(lacked[0][0]) + 1 :]
    return lacked + [request_ask(req) for req in behind if waiting is None or not waiting(req)]


def request_ask(req: Any) -> tuple[str, int, int]:
    """(request id, prompt tokens, pool slots admission asks for it): its uncached prompt and
    clipped output, as SGLang's ``PrefillAdder`` counts them."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    max_new = min(tokens_left(req), CLIP_MAX_NEW_TOKENS)
    context = len(req.full_untruncated_fill_ids)
    return req.rid, context, context - req.prefix_len + max_new


def admission_deficit(needed: int, remaining: float) -> int:
    """Slots an attempt lacked: what the request asked for minus the budget left (>= 1)."""
    return max(1, math.ceil(needed - remaining))


def _add_one_req_around(original: Callable[..., Any], adder: Any, req: Any, *args: Any,
                        **kw: Any) -> Any:  # fmt: skip
    from sglang.srt.managers.schedule_policy import AddReqResult

    waiting = getattr(adder.tree_cache, "waiting_for_tier", None)
    if waiting is not None and waiting(req):
        running = adder.running_batch
        if not adder.can_run_list and (running is None or running.is_empty()):
            time.sleep(0.001)  # nothing to run: let the tier's I/O thread work, do not spin
        return AddReqResult.CONTINUE  # passed over, not added: the loop tries the next request
    result = original(adder, req, *args, **kw)
    offloader = getattr(adder.tree_cache, "offloader", None)
    if offloader is not None and result == AddReqResult.NO_TOKEN:
        ask = request_ask(req)
        offloader.ledger.admission_deficit = admission_deficit(ask[2], adder.rem_total_tokens)
        offloader.ledger.waiting_asks = [ask]
    return result


def register_admission_hook() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, _running_offset_around, HookType.AROUND)
    HookRegistry.register(PREFILL_TARGET, _new_prefill_around, HookType.AROUND)
    HookRegistry.register(ADD_TARGET, _add_one_req_around, HookType.AROUND)
