"""The memory layout on SGLang's real pool and allocator: offload, read back, restore, drop."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.sglang

SLOTS, H_KV, D, LAYERS, ROWS, MAX_LEN = 256, 2, 8, 3, 4, 200


def _pools(page_size: int):
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    kv = MHATokenToKVPool(SLOTS, page_size, torch.float32, H_KV, D, LAYERS, "cpu", False)
    for layer in range(LAYERS):  # distinct contents per slot and layer
        kv.get_key_buffer(layer).copy_(torch.randn_like(kv.get_key_buffer(layer)))
        kv.get_value_buffer(layer).copy_(torch.randn_like(kv.get_value_buffer(layer)))
    rows = ReqToTokenPool(ROWS, MAX_LEN, "cpu", False)
    if page_size == 1:
        alloc = TokenToKVPoolAllocator(SLOTS, torch.float32, "cpu", kv, False)
    else:
        alloc = PagedTokenToKVPoolAllocator(SLOTS, page_size, torch.float32, "cpu", kv, False)
    return kv, rows, alloc


def _fill_row(rows, alloc, row: int, n: int, start: int = 0) -> torch.Tensor:
    """Fresh slots for positions [start, start + n) of ``row``: [n]."""
    slots = alloc.alloc(n)
    rows.req_to_token[row, start : start + n] = slots.to(torch.int32)
    return slots


def _full_kv(offloader, row: int, end: int) -> list[torch.Tensor]:
    read = offloader.layer_reader(row, end)
    return [torch.stack(read(layer)) for layer in range(LAYERS)]


@pytest.mark.parametrize("page_size", [1, 4])
def test_offload_frees_slots_and_reads_back_exactly(page_size: int) -> None:
    from sglang_vericache.srt.kv.offload import PLACEHOLDER_SLOT, TAIL_CHUNK
    from sglang_vericache.srt.kv.offloader import PoolOffloader

    kv, rows, alloc = _pools(page_size)
    off = PoolOffloader(kv, rows, alloc, LAYERS)
    _fill_row(rows, alloc, 1, 120)
    before = _full_kv(off, 1, 120)
    free0 = alloc.available_size()
    compressed = 30 * off.slot_bytes  # as if a 4x compressor kept 30 slots' worth
    result = off.offload(1, owned_from=6, committed=103, compressed_bytes=compressed)
    lo, hi = (8, 100) if page_size == 4 else (6, 103)
    assert (result.moved, off.ledger.span(1).lo, off.ledger.span(1).hi) == (hi - lo, lo, hi)
    assert alloc.available_size() == free0 + (hi - lo) - result.reserved
    assert result.reserved >= 30 and result.reserved % page_size == 0
    off.ledger.check_integrity(rows.req_to_token)
    assert bool((rows.req_to_token[1, lo:hi] == PLACEHOLDER_SLOT).all())
    for a, b in zip(before, _full_kv(off, 1, 120)):
        assert torch.equal(a, b)  # exact: the host copy is the pool's bytes
    # the tail continues the host range; on a device pool too little tail moves nothing, on
    # this host-memory pool every committed token follows (a tail there is gathered per read)
    assert off.offload(1, 6, 110, compressed, min_tokens=TAIL_CHUNK).moved == 0
    assert off.tail_tokens == 1
    assert off.offload(1, 6, 120, compressed, min_tokens=8).moved == (120 - hi) // page_size * page_size
    for a, b in zip(before, _full_kv(off, 1, 120)):
        assert torch.equal(a, b)
    _fill_row(rows, alloc, 1, page_size, start=120)  # one more page decoded: it follows at once
    grown = _full_kv(off, 1, 120 + page_size)
    assert off.offload(1, 6, 120 + page_size, compressed).moved == page_size
    assert off.ledger.span(1).hi == 120 + page_size
    for a, b in zip(grown, _full_kv(off, 1, 120 + page_size)):
        assert torch.equal(a, b)


def test_restore_and_drop_give_every_slot_back() -> None:
    from sglang_vericache.srt.kv.offloader import PoolOffloader

    kv, rows, alloc = _pools(1)
    off = PoolOffloader(kv, rows, alloc, LAYERS)
    total = alloc.available_size()
    a_slots, b_slots = _fill_row(rows, alloc, 0, 90), _fill_row(rows, alloc, 2, 70)
    before = _full_kv(off, 0, 90)
    off.offload(0, 0, 90, 20 * off.slot_bytes)
    off.offload(2, 0, 70, 20 * off.slot_bytes)
    assert off.owned_ranges(0, [(0, 95)]) == [(90, 95)]
    assert off.restore(0, evict=lambda n: None)
    assert off.ledger.span(0) is None
    for a, b in zip(before, _full_kv(off, 0, 90)):
        assert torch.equal(a, b)  # restored into fresh slots, same KV
    assert off.owned_ranges(0, [(0, 95)]) == [(0, 95)]
    alloc.free(rows.req_to_token[0, :90].to(torch.int64))
    off.drop(2)
    assert alloc.available_size() == total  # nothing leaked: reserved slots came back too
    del a_slots, b_slots


def test_restore_fails_cleanly_when_the_pool_is_full() -> None:
    from sglang_vericache.srt.kv.offloader import PoolOffloader

    kv, rows, alloc = _pools(1)
    off = PoolOffloader(kv, rows, alloc, LAYERS)
    _fill_row(rows, alloc, 0, 100)
    off.offload(0, 0, 100, off.slot_bytes)
    hog = alloc.alloc(alloc.available_size())  # another request takes everything
    evicted = []
    assert not off.restore(0, evict=evicted.append)
    assert evicted == [100] and off.ledger.span(0) is not None  # still readable, still offloaded
    alloc.free(hog)
    off.drop(0)
    assert alloc.available_size() == SLOTS


def test_a_wholly_offloaded_row_is_read_in_place_with_its_pool_tail() -> None:
    """Offloaded from position 0 with room in the host buffer: the read is a view of the host
    buffer (no copy of the offloaded tokens) holding exactly the pool's bytes, tail included."""
    from sglang_vericache.srt.kv.offloader import PoolOffloader

    kv, rows, alloc = _pools(1)
    off = PoolOffloader(kv, rows, alloc, LAYERS)
    _fill_row(rows, alloc, 2, 150)
    before = _full_kv(off, 2, 150)
    off.offload(2, owned_from=0, committed=140, compressed_bytes=0)
    span = off.ledger.span(2)
    assert (span.lo, span.hi) == (0, 140)
    host = span.host.restore()
    for layer in range(LAYERS):
        keys, values = off.ledger.read(kv, rows.req_to_token, layer, 2, 150)
        assert keys.data_ptr() == host[layer, 0].data_ptr()  # in place
        assert values.data_ptr() == host[layer, 1].data_ptr()
        assert torch.equal(torch.stack([keys, values]), before[layer])
    assert span.host.length == 140  # the tail was scratch, not buffered


def test_a_row_in_one_run_of_pool_slots_is_read_in_place() -> None:
    """A resident row whose slots are one ascending run is a view of the pool; a scattered row
    is gathered; both hold the pool's bytes."""
    from sglang_vericache.srt.kv.offload import OffloadLedger, read_pool_kv

    kv, rows, _ = _pools(1)
    ledger = OffloadLedger()
    rows.req_to_token[0, :50] = torch.arange(10, 60, dtype=torch.int32)
    rows.req_to_token[1, :50] = torch.randperm(50, dtype=torch.int32) + 100
    for row, in_place in ((0, True), (1, False)):
        keys, values = ledger.read(kv, rows.req_to_token, 1, row, 50)
        slots = rows.req_to_token[row, :50].to(torch.int64)
        want_k, want_v = read_pool_kv(kv, 1, slots)
        assert torch.equal(keys, want_k) and torch.equal(values, want_v)
        pool_storage = kv.get_key_buffer(1).untyped_storage().data_ptr()
        assert (keys.untyped_storage().data_ptr() == pool_storage) == in_place


def test_a_range_spanning_pool_host_and_tail_reads_exactly() -> None:
    """read_range over [start, end) crossing the tree-owned pool prefix, the host range and
    the pool tail returns the pool's original bytes for exactly those positions."""
    from sglang_vericache.srt.kv.offloader import PoolOffloader

    kv, rows, alloc = _pools(1)
    off = PoolOffloader(kv, rows, alloc, LAYERS)
    _fill_row(rows, alloc, 3, 140)
    before = _full_kv(off, 3, 140)
    off.offload(3, owned_from=10, committed=120, compressed_bytes=0)
    assert (off.ledger.span(3).lo, off.ledger.span(3).hi) == (10, 120)
    for start, end in ((0, 140), (5, 15), (12, 100), (100, 130), (125, 140)):
        read = off.range_reader(3, start, end)
        for layer in range(LAYERS):
            assert torch.equal(torch.stack(read(layer)), before[layer][:, :, start:end])


def _prompt_req(tokens: list[int], protected: int = 0, lock=None):
    """What ``VeriCacheRadixCache.adopt`` reads and moves of a scheduler request (the fields
    SGLang's own ``checkpoint`` reads for the key, the tree lock a matched prefix holds), and
    what the offloader sizes a host buffer by (the output it may still emit)."""
    from types import SimpleNamespace

    kv = SimpleNamespace(cache_inserted_len=0, cache_protected_len=protected)
    return SimpleNamespace(full_untruncated_fill_ids=tokens, extra_key=None, cache_salt=None,
                           priority=None, kv=kv, lock=lock, last_node=None,
                           sampling_params=SimpleNamespace(max_new_tokens=16),
                           output_ids=[])  # fmt: skip


@pytest.mark.parametrize("page_size", [1, 4])
def test_an_offloaded_prompt_stays_in_the_tree_as_an_evictable_hit(page_size: int) -> None:
    """A drafted request's row moves to the host, and the prefix tree keeps its pool slots: a
    request sharing the prompt hits them while the first decodes from its host copy; a matched
    prefix is no longer pinned; a duplicate prompt's slots are freed; eviction frees the rest;
    nothing leaks."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    kv, rows, alloc, tree, worker = _with_tree(page_size)
    total = alloc.available_size()
    prompt = list(range(1000, 1100))
    a_slots = _fill_row(rows, alloc, 0, 100)
    before = _full_kv(worker, 0, 100)
    assert worker.offload(0, 0, 100, 0, req=_prompt_req(prompt)).moved == 100
    for x, y in zip(before, _full_kv(worker, 0, 100)):
        assert torch.equal(x, y)  # the request reads its host copy, exactly
    hit = _tree_slots(tree, prompt)
    assert torch.equal(hit, a_slots.to(hit.dtype))
    assert tree.evictable_size() == 100 and tree.protected_size() == 0  # cached, not locked

    # a second request matched 60 of them (locked, as admission locks a match), then diverged:
    # its row moves to the host whole, the tree keeps the 60 unlocked and adopts the rest
    other = prompt[:60] + list(range(2000, 2040))
    node = tree.match_prefix(MatchPrefixParams(key=RadixKey(other[:60]))).last_device_node
    b = _prompt_req(other, protected=60, lock=tree.lock(node))
    assert tree.protected_size() == 60
    rows.req_to_token[1, :60] = hit[:60].to(torch.int32)
    b_own = _fill_row(rows, alloc, 1, 40, start=60)
    b_before = _full_kv(worker, 1, 100)
    assert worker.offload(1, 60, 100, 0, req=b).moved == 100
    for x, y in zip(b_before, _full_kv(worker, 1, 100)):
        assert torch.equal(x, y)
    assert tree.protected_size() == 0 and b.kv.cache_protected_len == 0  # nothing pinned
    got = _tree_slots(tree, other)
    assert torch.equal(got[60:], b_own.to(got.dtype))

    # a third request computed the same prompt again: the tree keeps its copy, frees this one
    free = alloc.available_size()
    _fill_row(rows, alloc, 2, 100)
    worker.offload(2, 0, 100, 0, req=_prompt_req(prompt))
    assert alloc.available_size() == free  # all of it was a duplicate
    assert tree.evictable_size() == 100 + 40

    for row in (0, 1, 2):  # the requests leave; the tree keeps what it adopted
        worker.drop(row)
    assert tree.evictable_size() == 140
    tree.evict(EvictParams(num_tokens=SLOTS))
    assert alloc.available_size() == total and tree.evictable_size() == 0


def test_compressed_kv_reservation_evicts_cached_nodes_when_no_slot_is_free() -> None:
    """Adopted prompts keep their slots as cached nodes, so the pool may have no free slot
    left for a row's compressed KV: its reservation evicts cached tokens, as any allocation
    does, instead of going unaccounted."""
    kv, rows, alloc, tree, worker = _with_tree(1)
    _fill_row(rows, alloc, 0, 100)
    worker.offload(0, 0, 100, 0, req=_prompt_req(list(range(1000, 1100))))
    hog = alloc.alloc(alloc.available_size() - 100)
    _fill_row(rows, alloc, 2, 100)
    assert alloc.available_size() == 0
    result = worker.offload(2, 0, 100, 10 * worker.slot_bytes,
                            req=_prompt_req(list(range(3000, 3100))))  # fmt: skip
    assert result.reserved == 10 and worker.reserve_shortfall == 0
    assert tree.evictable_size() == 100  # the older cached prompt (one node) made room
    del hog


def test_pressure_counts_cached_prefixes_as_room_and_offloads_rows_whole() -> None:
    """A pool full of cached prefixes is not pressure (allocation evicts them): no row moves.
    Under real pressure a resident row moves whole and the tree keeps its slots, unpinned."""
    from types import SimpleNamespace

    from sglang_vericache.srt.kv.draft_state import RequestDraftState
    from sglang_vericache.srt.decode.step_costs import relieve_pressure

    kv, rows, alloc, tree, worker = _with_tree(1)
    _fill_row(rows, alloc, 0, 100)
    worker.offload(0, 0, 100, 0, req=_prompt_req(list(range(1000, 1100))))
    _fill_row(rows, alloc, 1, 100)  # a resident drafted request
    resident = _prompt_req(list(range(2000, 2100)))
    resident.rid = "resident"
    hog = alloc.alloc(alloc.available_size())
    batch = SimpleNamespace(reqs=[resident], req_pool_indices=torch.tensor([1]),
                            seq_lens_cpu=torch.tensor([100]))  # fmt: skip
    states = {"resident": RequestDraftState(layers=[], covered=100)}  # nothing to lodge
    assert worker.free_slots() == 100  # none free, 100 cached
    assert relieve_pressure(batch, states, worker, width=5) == 0
    worker.ledger.admission_deficit = 150  # a waiting request needs more than the cache holds
    assert relieve_pressure(batch, states, worker, width=5) == 100
    assert worker.ledger.span(1).lo == 0 and tree.cached_tokens() == 200
    del hog


def _with_tree(page_size: int):
    """``_pools`` plus the ``vericache`` prefix tree over them and the scheduler's one offloader
    (the worker's and the tree's: ``shared_offloader``), which finds the tree through its
    ledger."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sglang_vericache.srt.kv.offloader import shared_offloader
    from sglang_vericache.srt.prefix.radix_cache import VeriCacheRadixCache

    kv, rows, alloc = _pools(page_size)
    params = CacheInitParams(disable=False, req_to_token_pool=rows,
                             token_to_kv_pool_allocator=alloc, page_size=page_size)  # fmt: skip
    tree = VeriCacheRadixCache(params, LAYERS, verify_width=5)
    assert shared_offloader(kv, rows, alloc, LAYERS) is tree.offloader
    return kv, rows, alloc, tree, tree.offloader


def _with_host_tier_tree(fetch_drafting: bool):
    """``_pools`` (page size 1) plus the ``vericache`` prefix tree linked to a host-memory tier
    of 8-token chunks: (kv, rows, alloc, tree)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sglang_vericache.srt.prefix.radix_cache import VeriCacheRadixCache
    from sglang_vericache.srt.prefix.remote_prefix import RemotePrefixLink
    from sglang_vericache.tier.geometry import KVGeometry
    from sglang_vericache.tier.host import HostTier

    kv, rows, alloc = _pools(1)
    geometry = KVGeometry("test-model", num_layers=LAYERS, num_kv_heads=H_KV, head_dim=D,
                          dtype="float32", chunk_tokens=8)  # fmt: skip
    link = RemotePrefixLink(HostTier(geometry, capacity_bytes=1 << 20))
    params = CacheInitParams(disable=False, req_to_token_pool=rows,
                             token_to_kv_pool_allocator=alloc, page_size=1)  # fmt: skip
    tree = VeriCacheRadixCache(params, LAYERS, verify_width=5, remote=link,
                               fetch_drafting=fetch_drafting)  # fmt: skip
    return kv, rows, alloc, tree


def _tree_slots(tree, tokens: list[int]) -> torch.Tensor:
    """Pool slots of the longest prefix of ``tokens`` the tree holds: [n] int64."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    node = tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).last_device_node
    return tree.path_device_indices(node)


def test_restore_points_at_the_slots_the_tree_holds_and_copies_only_the_rest() -> None:
    """A finished row whose prompt the tree adopted comes back without copying the prompt."""
    from types import SimpleNamespace

    from sglang_vericache.srt.kv.offloader import PoolOffloader

    kv, rows, alloc = _pools(1)
    off = PoolOffloader(kv, rows, alloc, LAYERS)
    slots = _fill_row(rows, alloc, 0, 90)
    before = _full_kv(off, 0, 90)
    off.ledger.tree = SimpleNamespace(adopt=lambda req, moved, owned_from: moved[50:])  # keeps 50
    off.offload(0, 0, 90, 0, req=_prompt_req(list(range(90))))
    free = alloc.available_size()
    assert off.restore(0, evict=lambda n: None, held=slots[:50])
    assert alloc.available_size() == free - 40  # only positions 50..89 came back as copies
    assert torch.equal(rows.req_to_token[0, :50].to(torch.int64), slots[:50].to(torch.int64))
    for a, b in zip(before, _full_kv(off, 0, 90)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_stop_inside_the_offloaded_span_frees_only_the_requests_own_slots(page_size: int) -> None:
    """A verify commits a whole accepted chunk, so a stop can land before the end of a row's
    offloaded span: SGLang caches the row up to the stop and frees the rest of it as
    over-allocated. The tree's slots past the stop must not be handed to the row (they were,
    and SGLang freed a cached node's slot: the idle leak check killed the server)."""
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_batch import ReqKvInfo
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    kv, rows, alloc, tree, worker = _with_tree(page_size)
    total = alloc.available_size()
    tokens = list(range(1000, 1044))
    tree.insert(InsertParams(key=RadixKey(tokens[:40]), value=alloc.alloc(40)))  # an earlier turn

    # the same prompt again: 24 matched (locked as admission locks), its own KV from there on
    node = tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens[:24]))).last_device_node
    req = SimpleNamespace(rid="b", full_untruncated_fill_ids=tokens, origin_input_ids=tokens[:28],
                          extra_key=None, cache_salt=None,
                          priority=None, kv=ReqKvInfo(req_pool_idx=1, cache_protected_len=24,
                          kv_allocated_len=44), lock=tree.lock(node), last_node=node,
                          finished=lambda: True, sampling_params=SimpleNamespace(max_new_tokens=16),
                          output_ids=[])  # fmt: skip
    rows.req_to_token[1, :24] = tree.path_device_indices(node).to(torch.int32)
    _fill_row(rows, alloc, 1, 20, start=24)
    worker.offload(1, 24, committed=32, compressed_bytes=0, req=req)  # span [0, 32)

    # it stops at 30 (SGLang's owned_kv_len): release_kv_cache's calls, in its order
    owned, allocated = 30, req.kv.kv_allocated_len
    tree.checkpoint(req, up_to=owned)
    tree.free_kv_row(req.kv, [(req.kv.cache_protected_len, owned)])
    tree.unlock(req.lock)
    tree.free_kv_row(req.kv, [(-(-owned // page_size) * page_size, allocated)])
    tree.on_release(req, checkpointed=True)

    free = set(alloc.get_all_free_pages().tolist())
    cached = set((tree.path_device_indices(_deepest(tree, tokens)) // page_size).tolist())
    assert not free & cached  # no cached slot is also free
    assert alloc.available_size() + tree.evictable_size() + tree.protected_size() == total
    tree.evict(EvictParams(num_tokens=SLOTS))
    assert alloc.available_size() == total


def _deepest(tree, tokens: list[int]):
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).last_device_node


def test_a_row_is_sized_for_its_remaining_output_so_decode_appends_never_regrow_it() -> None:
    """Growing a host buffer copies all of it (280 MB for a 6k-token SmolLM2 row): a row's first
    offload sizes it for the output its request may still emit, and decode appends fill it."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_vericache.srt.kv.offloader import PoolOffloader

    kv, rows, alloc = _pools(1)
    off = PoolOffloader(kv, rows, alloc, LAYERS)
    req = Req("r", "", list(range(60)), SamplingParams(max_new_tokens=90))
    req.output_ids = [5] * 10  # 80 more tokens to come
    slots = [_fill_row(rows, alloc, 1, 60)]
    off.offload(1, owned_from=0, committed=60, compressed_bytes=0, req=req)
    host = off.ledger.span(1).host
    buffer = host.restore().data_ptr()
    for end in range(68, 141, 8):  # decode appends of 8 up to the request's last token
        slots.append(_fill_row(rows, alloc, 1, 8, start=end - 8))
        assert off.offload(1, 0, end, 0, min_tokens=8, req=req).moved == 8
    assert host.length == 140 and host.restore().data_ptr() == buffer  # filled, never regrown
    written = torch.cat(slots).to(torch.int64)
    for layer in range(LAYERS):  # and it holds exactly what the pool held
        keys, values = off.layer_reader(1, 140)(layer)
        assert torch.equal(keys, kv.get_key_buffer(layer)[written].transpose(0, 1))
        assert torch.equal(values, kv.get_value_buffer(layer)[written].transpose(0, 1))
