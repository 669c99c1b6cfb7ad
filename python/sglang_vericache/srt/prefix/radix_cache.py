"""The ``vericache`` prefix cache: SGLang's radix tree, aware of rows offloaded to host memory.

``--vericache`` selects it (``--radix-cache-backend vericache``). It differs from ``RadixCache``
only where a drafted request's row holds placeholders instead of slots (``srt/kv/offload.py``):

- a running request whose KV is in the pool is checkpointed as in SGLang (its prompt is a hit
  for others). When a drafted row's full KV moves to the host (after prefill on the CPU backend,
  under pressure on an accelerator), the tree adopts the row's pool slots instead
  (``adopt``): the row's matched or checkpointed prefix is no longer locked by it and the rest
  becomes unlocked nodes. The request decodes from its host copy; requests sharing its prompt
  (an agent fleet's system prompt, a conversation's history) hit the device copy, and under
  pressure eviction frees it, as it frees any cached node;
- when it finishes, the row takes the tree's slots for what the tree still holds and copies
  the rest back from the host into fresh pool slots, and the whole sequence is inserted as
  usual, so the next turn of a conversation hits it (when the pool cannot take the rest, only
  the part the tree holds is kept);
- ``free_kv_row`` never frees the placeholders, and ``on_release`` frees the request's draft
  row (its compressed KV's slots), so the idle check ``available + evictable + protected ==
  total`` holds;
- a drafted request whose full KV stays in the pool (pressure placement) lodges its compressed
  KV in free slots (a resident draft row): SGLang's allocations take them back last (``evict``).

Requests decoded plainly (sampling, logprobs, ...) are cached exactly as without
``--vericache``.

With a remote tier (``--vericache-tier zmq://...`` / ``lmcache://...``) the full KV of every
finished sequence goes to the tier (write-through). A drafted sequence's full KV comes back
into the pool, evicting older cached nodes if it must, as plain SGLang keeps a finished
sequence (FULL: the next turn on this server is a device hit), and its compressed KV is kept
as a DEMOTED prefix (``tier/demoted.py``), charged to the pool: this tree is its
``PoolAccount``. Eviction frees FULL nodes first, then DEMOTED entries,
and counts both as evictable. A prompt whose prefix the tier holds past the device match is
loaded from it instead of recomputed (``srt/prefix/remote_prefix.py``), and while that fetch runs the
request is drafted from its DEMOTED prefix (``srt/prefix/draft_ahead.py``). A prefix computed by one
server is a hit on every server sharing the tier and serving the same weights; only requests
whose KV the key names (their tokens, the weights served now) cross (``srt/prefix/tier_eligibility.py``).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InsertParams,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from sglang_vericache.requests.record import RequestEnd
from sglang_vericache.srt.context import open_context
from sglang_vericache.srt.prefix.draft_ahead import DraftAhead
from sglang_vericache.srt.metrics import TierLinkExporter
from sglang_vericache.srt.kv.offload import write_pool_all_layers
from sglang_vericache.srt.kv.offloader import shared_offloader
from sglang_vericache.host_memory import IdleHeapTrim
from sglang_vericache.srt.prefix.remote_prefix import RemotePrefixLink
from sglang_vericache.srt.prefix.tier_eligibility import TierEligibility, open_remote
from sglang_vericache.server_record import vericache_config
from sglang_vericache.tier.demoted import DemotedPrefixes

logger = logging.getLogger(__name__)

REMOTE_CHUNK_TOKENS = 128  # tokens per tier chunk: the granularity of cross-request reuse


class VeriCacheRadixCache(RadixCache):
    """``RadixCache`` plus restore/drop of offloaded rows (see module doc)."""

    def __init__(self, params: Any, num_layers: int, verify_width: int,
                 remote: RemotePrefixLink | None = None, fetch_drafting: bool = True,
                 tier_metrics: TierLinkExporter | None = None,
                 eligibility: TierEligibility | None = None) -> None:  # fmt: skip
        allocator = params.token_to_kv_pool_allocator
        context = open_context(params.req_to_token_pool)  # shared with the worker
        self.requests = context.requests  # every request's one close path (on_release, ...)
        self.offloader = shared_offloader(
            allocator.get_kvcache(), params.req_to_token_pool, allocator, num_layers
        )  # before super().__init__, which calls reset()
        self.restore_failures = 0
        self.verify_width = verify_width  # pool slots one verification writes per request
        self.remote = context.link = remote  # the worker reports prefill speed to it
        if remote is not None:
            remote.bind_requests(self.requests)  # its lookups are this scheduler's records'
        # weights fixed unless given
        self.eligibility = eligibility or TierEligibility(requests=self.requests)
        self.tier_metrics = tier_metrics
        # DEMOTED prefixes and drafts made while fetching (remote tiers only); the worker
        # finds them in the context.
        self.ahead: DraftAhead | None = None
        if remote is not None and fetch_drafting:
            self.ahead = DraftAhead(DemotedPrefixes(self), self.requests)
        context.ahead = self.ahead
        self.freed_seen = 0  # ledger.freed_slots when admission last reopened (admission.py)
        self.heap_trim = IdleHeapTrim()  # the scheduler's idle hook calls it (srt/hooks/idle.py)
        super().__init__(params)
        self.offloader.ledger.tree = self  # PrefixTreeHooks: adopt, evict_cached, cached_tokens

    def adopt(self, req: Any, slots: torch.Tensor, owned_from: int) -> torch.Tensor:
        """Take over a drafted request's pool slots when its row moves to the host.

        slots: [n] slots of row positions [0, n), whose KV the request reads from the host
        from now on. Positions [0, owned_from) are its matched prefix, already the tree's: the
        request's lock on them is released (its host copy serves it), so they are evictable.
        Its own positions become unlocked tree nodes where the tree lacks them. Returns the
        request's own slots the tree did not take (positions another request inserted
        meanwhile): the caller frees them.
        """
        own = slots[owned_from:]
        if self.disable:
            return own
        n = slots.numel()
        key = _row_key(req, n).page_aligned(self.page_size)
        duplicates = own.numel()  # none inserted: the caller frees them all
        if len(key) == n:  # always, at a page-floored offload
            inserted = self.insert(InsertParams(key=key, value=slots,
                                                priority=req.priority or 0,
                                                inserted_len=req.kv.cache_inserted_len))  # fmt: skip
            req.kv.cache_inserted_len = max(req.kv.cache_inserted_len, n)
            duplicates = max(0, inserted.prefix_len - owned_from)
        self.unlock(req.lock)  # root: locks nothing; _lock_tree_part relocks at the finish
        req.lock, req.last_node = self.lock(self.root_node), self.root_node
        req.kv.cache_protected_len = 0
        return own[:duplicates]

    def evict_cached(self, num_tokens: int) -> None:
        """Evict for an allocation of ours (a restore, a reservation): cached nodes only, never
        a running request's resident draft row (moving one compressed KV out of the pool for
        another, or for a finished turn's cache, gains nothing); the slots freed must be
        allocatable at once, also inside SGLang's free group (``_free_deferred``)."""
        self._evict_cached(EvictParams(num_tokens=num_tokens))
        _free_deferred(self.token_to_kv_pool_allocator)

    def cached_tokens(self) -> int:
        return int(self.evictable_size())

    # -- FULL nodes and DEMOTED entries: one pool, one eviction ------------------------------

    def evictable_size(self) -> int:
        return super().evictable_size() + self._demoted_slots()

    def evict(self, params: EvictParams) -> Any:
        """SGLang's eviction (an allocation short of slots): cached nodes (``_evict_cached``),
        then running requests' resident draft rows (``PoolOffloader.hold_resident``; not in
        ``evictable_size``: admission counts them as held) for what is still short."""
        result = self._evict_cached(params)
        freed = self.offloader.evict_resident(params.num_tokens - result.num_tokens_evicted)
        return replace(result, num_tokens_evicted=result.num_tokens_evicted + freed)

    def _evict_cached(self, params: EvictParams) -> Any:
        """FULL nodes (LRU, as SGLang), then DEMOTED entries (LRU) for what they lack."""
        result = super().evict(params)
        short = params.num_tokens - result.num_tokens_evicted
        if short <= 0 or not self._demoted_slots():
            return result
        freed = self.ahead.store.evict(short)
        return replace(result, num_tokens_evicted=result.num_tokens_evicted + freed)

    def _demoted_slots(self) -> int:
        return 0 if self.ahead is None else self.ahead.store.charged_slots

    def slots_for(self, nbytes: int) -> int:
        """``PoolAccount``: pool slots worth ``nbytes``, whole pages (at least one)."""
        return max(self.offloader.page, self.offloader.slots_for(nbytes))

    def take(self, n: int) -> torch.Tensor | None:
        """``PoolAccount``: ``n`` free slots for a DEMOTED entry, evicting FULL nodes (never
        other DEMOTED entries: the store decides those) where the pool lacks them."""
        allocator = self.token_to_kv_pool_allocator
        _free_deferred(allocator)  # the store may just have given slots back
        slots = allocator.alloc(n)
        if slots is None and not self.disable:
            super().evict(EvictParams(num_tokens=n))
            _free_deferred(allocator)
            slots = allocator.alloc(n)
        return slots

    def give_back(self, held: torch.Tensor) -> None:
        """``PoolAccount``: a DEMOTED entry went."""
        self.token_to_kv_pool_allocator.free(held)

    def checkpoint(self, req: Any, *, up_to: int) -> None:
        row = req.kv.req_pool_idx
        if not req.finished():
            if self.offloader.ledger.span(row) is None:  # its KV in the pool: as plain SGLang
                super().checkpoint(req, up_to=up_to)
            # (offloaded: the tree adopted its slots when they moved, ``adopt``)
            # The prompt goes to the tier as its prefill completes, not when the turn ends: an
            # agent's next turn follows within milliseconds and may land on another replica.
            self._write_through(req, up_to)
            return
        tokens = self._write_through(req, up_to)  # the rest of it (chunks already sent skipped)
        if not self.disable:
            # Back on the device, FULL, as plain SGLang keeps a finished request's KV: it is
            # the most recently used prefix, so older cached nodes are evicted for it (LRU; a
            # FULL node's eviction demotes it where its compressed KV is kept). Copying it back
            # from host memory costs far less than the next turn's fetch or recompute.
            super().checkpoint(req, up_to=self._reclaim(req, up_to))
        if tokens is not None:
            if self.ahead is not None:
                # after the full KV (which takes the room first): its compressed KV, charged
                # to the pool, DEMOTED once the tree evicts the FULL node
                self.ahead.remember(req.rid, tokens)
            self._observe_tier()

    def _write_through(self, req: Any, up_to: int) -> list[int] | None:
        """Submit the whole chunks of ``req``'s first ``up_to`` tokens the tier lacks; returns
        those tokens, or None where ``req`` may not write (no tier, not eligible)."""
        if self.remote is None or not self.eligibility.may_write(req):
            return None
        tokens = req.full_untruncated_fill_ids[:up_to]
        self.remote.write_through(tokens, self._sequence_reader(req.kv.req_pool_idx))
        return tokens

    def _reclaim(self, req: Any, up_to: int) -> int:
        """Point a finished drafted row at device KV again, so SGLang can cache it: positions
        of its host range the tree holds (the prompt it adopted, unless evicted) come from the
        tree, locked for the request like a matched prefix; the rest is copied back into fresh
        pool slots (older cached nodes are evicted for them). Returns how far the row can be
        cached: ``up_to``, or only the tree-held part where the pool could not take the rest.

        The tree's part ends at ``up_to`` even where the span goes on: a verify commits a
        whole accepted chunk, so a stop can land inside the span, and SGLang frees the row's
        positions past ``up_to`` as over-allocated (they must be the request's own slots)."""
        row = req.kv.req_pool_idx
        span = self.offloader.ledger.span(row)
        if span is None:
            return up_to
        held = self._lock_tree_part(req, span.lo, min(span.hi, up_to))
        if self.offloader.restore(row, self.evict_cached, held):
            return up_to
        self.restore_failures += 1
        logger.info("pool full: request %s cached up to position %d only", req.rid,
                    span.lo + held.numel())  # fmt: skip
        return max(int(req.kv.cache_protected_len), span.lo)

    def _lock_tree_part(self, req: Any, lo: int, hi: int) -> torch.Tensor:
        """Pool slots the tree holds for row positions [lo, m) of ``req`` (m <= hi as deep as
        the tree matches), with the request's tree lock moved down to position m. Empty unless
        the request's own positions start at ``lo`` (its host range follows its locked path)."""
        none = torch.empty(0, dtype=torch.int64)
        if lo != int(req.kv.cache_protected_len):
            return none
        key = _row_key(req, hi)
        match = super().match_prefix(MatchPrefixParams(key=key))
        if match.device_prefix_len <= lo:
            return none
        node = match.last_device_node
        lock = self.lock(node)  # before unlocking the old one: restore's eviction spares it
        self.unlock(req.lock)
        req.lock, req.last_node = lock, node
        req.kv.cache_protected_len = match.device_prefix_len
        return self.path_device_indices(node)[lo:].to(torch.int64)

    def free_kv_row(self, kv: Any, ranges: list[tuple[int, int]]) -> None:
        super().free_kv_row(kv, self.offloader.owned_ranges(kv.req_pool_idx, ranges))

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        """Every end of a request that held a row (finished, at prefill too; aborted; retracted):
        its row's host range and draft row go, then its record closes (``RequestTable.close``
        tells the worker, the tier link, drafting ahead, the eligibility stamps)."""
        self.offloader.drop(req.kv.req_pool_idx)
        self.requests.close(req.rid, RequestEnd.RELEASED)
        super().on_release(req, checkpointed=checkpointed)

    def release_aborted_request(self, handle: Any) -> None:
        """SGLang aborted a request before it held a row (queued; the queue was full; ...):
        its lookup, fetch claims and drafting ahead go with its record."""
        self.requests.close(handle.rid, RequestEnd.ABORTED_QUEUED)
        super().release_aborted_request(handle)

    # -- the remote tier -------------------------------------------------------------------

    def _sequence_reader(self, row: int):
        """(start, end) -> full KV of row positions [start, end): [L, 2, H_kv, n, D], host."""

        def read(start: int, end: int) -> torch.Tensor:
            layer = self.offloader.layer_reader(row, end)
            kv = [torch.stack(layer(i))[:, :, start:] for i in range(self.offloader.num_layers)]
            return torch.stack(kv).cpu()

        return read

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        result = super().match_prefix(params)
        req = params.req
        if self.remote is None or req is None or not self.eligibility.matched(req):
            return result
        self.requests.open(req.rid)  # the link keeps its lookup until the request closes
        hit = self.remote.probe(req.rid, params.key.raw_token_ids(), result.device_prefix_len)
        self._observe_tier()
        hit = hit // self.page_size * self.page_size  # init_load_back loads whole pages only
        return result._replace(host_hit_length=hit) if hit > 0 else result

    def init_load_back(self, params: Any) -> tuple[int, Any] | None:
        req, node = params.req, params.best_match_node
        if self.remote is None or req is None:
            return 0, node
        start, promised = int(req.prefix_len), int(params.host_hit_length)
        kv = self.remote.take(req.rid, start, promised)
        if kv is False:
            self._wait_for_tier(req)
            return None  # lookup or fetch in flight: the request waits in the queue
        if self.ahead is not None:
            self.ahead.halt(req.rid)  # the full KV is here: stop competing with its prefill
        if kv is None:
            return 0, node  # miss or failure: recompute
        # SGLang raises unless exactly `promised` tokens (or none) are loaded: all or nothing.
        n = promised
        slots = self.token_to_kv_pool_allocator.alloc(n)
        if slots is None:
            self.evict(EvictParams(num_tokens=n))
            slots = self.token_to_kv_pool_allocator.alloc(n)
        if slots is None:
            return 0, node
        write_pool_all_layers(self.offloader.pool, slots, kv[..., :n, :])
        key = _match_key(req)[: start + n]
        prefix = self.path_device_indices(node)[:start].to(slots.device)
        inserted = self.insert(InsertParams(key=key, value=torch.cat([prefix, slots])))
        duplicates = max(0, inserted.prefix_len - start)
        if duplicates:  # another request inserted part of it meanwhile: keep the tree's copy
            self.token_to_kv_pool_allocator.free(slots[:duplicates])
        return n, super().match_prefix(MatchPrefixParams(key=key)).last_device_node

    def waiting_for_tier(self, req: Any) -> bool:
        """Whether admission should pass over ``req`` for now: its tier lookup or fetch is in
        flight. SGLang's admission loop stops at the first request it cannot admit, so a
        request waiting on the network would hold up everyone queued behind it; passed over,
        it is admitted on a later round, when its KV is here (``admission.py``)."""
        if self.remote is None or req.host_hit_length <= 0 or not self.remote.in_flight(req.rid):
            return False
        self._wait_for_tier(req)
        return True

    def _wait_for_tier(self, req: Any) -> None:
        """Draft from the local compressed prefix while ``req`` waits for its full KV."""
        if self.ahead is not None:
            self.ahead.start(req.rid, req.origin_input_ids, req.sampling_params.max_new_tokens,
                             self.remote.expected_wait_s(req.rid))  # fmt: skip

    def _observe_tier(self) -> None:
        if self.tier_metrics is not None:
            demoted = None if self.ahead is None else self.ahead.store
            self.tier_metrics.observe(self.remote, demoted)

    def reset(self) -> None:
        for row in list(self.offloader.ledger.rows):  # a draft row only beside a host range
            self.offloader.drop(row)
        if self.ahead is not None:
            self.ahead.store.clear()  # the flush clears the allocator next, its slots too
        self.eligibility.tree_reset()  # KV cached from now on is of the weights served now
        super().reset()


def _free_deferred(allocator: Any) -> None:
    """Free now what the allocator holds for the end of its free group. SGLang opens one
    around a batch's results, where a finished turn is checkpointed; slots an eviction freed
    there would otherwise not be allocatable until the group ends."""
    if getattr(allocator, "free_group", None):
        allocator.free_group_end()
        allocator.free_group_begin()


def _row_key(req: Any, end: int) -> RadixKey:
    """The tree key of ``req``'s row positions [0, end), namespaced as SGLang's checkpoint
    namespaces it (LoRA / extra key, cache salt)."""
    return RadixKey(req.full_untruncated_fill_ids[:end], req.extra_key, cache_salt=req.cache_salt)


def _match_key(req: Any) -> Any:
    from array import array

    return RadixKey(array("q", list(req.origin_input_ids) + list(req.output_ids)))


def build_vericache_radix_cache(ctx: Any) -> VeriCacheRadixCache:
    """``RadixCacheFactory`` for ``--radix-cache-backend vericache``."""
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.enable_hierarchical_cache:
        raise ValueError(
            "--vericache supports dense-attention models without HiCache; "
            "drop --enable-hierarchical-cache or serve this model without --vericache"
        )
    width = int(ctx.server_args.speculative_num_draft_tokens or 1)
    layers = ctx.model_config.num_hidden_layers
    fetch_drafting = vericache_config(ctx.server_args).fetch_drafting
    remote, eligibility = open_remote(ctx, layers, REMOTE_CHUNK_TOKENS) or (None, None)
    metrics = None
    if remote is not None and ctx.server_args.enable_metrics:
        metrics = TierLinkExporter(ctx.server_args.served_model_name or "default", remote)
    return VeriCacheRadixCache(ctx.params, layers, width, remote, fetch_drafting, metrics,
                               eligibility)
