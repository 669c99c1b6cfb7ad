"""Moves committed full KV between SGLang's pool and the host ledger (layout: ``offload.py``),
and holds an offloaded drafted row's compressed KV in pool slots (``srt/kv/draft_rows.py``).

The worker calls ``offload`` after a request's prefill and after each commit; the ``vericache``
prefix cache calls ``restore`` / ``drop`` when SGLang releases the request's row. Both use the
same offloader (``shared_offloader``: one per scheduler, in its ``srt/context.py`` context). All slot
arithmetic is page-aligned, so paged allocators free whole pages::

    page_size = 4, tree-owned prefix 6, committed 23:
    positions   0   4   8  12  16  20  23
                |...|.:.|...|...|...|..|
    lo = ceil(6/4)*4 = 8 ; hi = floor(23/4)*4 = 20 -> [8, 20) moves, 6..7 and 20..22 stay
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from sglang_vericache.compress.layer_cache import GROW_MIN
from sglang_vericache.srt.context import open_context
from sglang_vericache.srt.kv.draft_rows import DraftRow
from sglang_vericache.srt.decode.eligibility import tokens_left
from sglang_vericache.srt.kv.offload import (
    HOST_ROOM,
    PLACEHOLDER_SLOT,
    PRESIZE_MAX,
    TAIL_CHUNK,
    HostKV,
    OffloadLedger,
    read_pool_kv,
    slot_bytes,
    write_pool_all_layers,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OffloadResult:
    """What one ``offload`` call did: tokens moved to the host (their slots freed), slots held."""

    moved: int = 0
    reserved: int = 0


def shared_offloader(pool: Any, req_to_token_pool: Any, allocator: Any,
                     num_layers: int) -> "PoolOffloader":  # fmt: skip
    """The one ``PoolOffloader`` of the scheduler owning ``req_to_token_pool`` (its context's,
    made on the first call): the prefix cache and the worker both move and free rows through it."""
    context = open_context(req_to_token_pool)
    offloader = context.offloader
    if offloader is None:
        offloader = context.offloader = PoolOffloader(pool, req_to_token_pool, allocator,
                                                      num_layers)  # fmt: skip
    elif offloader.pool is not pool or offloader.allocator is not allocator:
        raise ValueError("one req_to_token pool, two KV pools or allocators: VeriCache's offload "
                         "ledger would describe slots of the wrong pool")
    return offloader


class PoolOffloader:
    """Offload / restore / drop rows of one SGLang pool (see module doc). Built through
    ``shared_offloader`` in a server: one per scheduler.

    pool: token-to-KV pool (``get_key_buffer(layer)`` [slots, H_kv, D]); table: req_to_token
    [rows, max_len] int32; allocator: SGLang token allocator (``alloc``/``free``/``page_size``).
    Its ledger is the pool's (``srt/context.py``).
    """

    def __init__(self, pool: Any, req_to_token_pool: Any, allocator: Any, num_layers: int):
        self.pool, self.allocator, self.num_layers = pool, allocator, num_layers
        self.table: Tensor = req_to_token_pool.req_to_token
        self.ledger: OffloadLedger = open_context(req_to_token_pool).ledger
        self.page = int(getattr(allocator, "page_size", 1))
        self.slot_bytes = slot_bytes(pool, num_layers)
        self.reserve_shortfall = 0  # slots the compressed KV needed but the pool lacked

    @property
    def pool_in_host_memory(self) -> bool:
        """The pool is in host memory (the CPU backend): host buffers are read in place there,
        while a row's pool slots are gathered (``OffloadLedger.read``)."""
        return self.pool.get_key_buffer(0).device.type == "cpu"

    def free_slots(self) -> int:
        """Slots an allocation can have: free ones plus the tree's cached, unlocked ones (SGLang
        evicts those to allocate, as admission counts them)."""
        tree = self.ledger.tree
        return int(self.allocator.available_size()) + (0 if tree is None else tree.cached_tokens())

    def row_slots(self, row: int, start: int, end: int) -> Tensor:
        """Pool slots of positions [start, end) of req_to_token row ``row``: [n] int64."""
        return self.table[row, start:end].to(torch.int64)

    def read_slots(self, layer: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        """K and V of pool ``slots`` ([n] integer) in one layer, each [H_kv, n, D]."""
        return read_pool_kv(self.pool, layer, slots)

    def layer_reader(self, row: int, end: int) -> Callable[[int], tuple[Tensor, Tensor]]:
        """layer -> exact (K, V) of positions [0, end) of ``row``, each [H_kv, end, D]."""
        return lambda layer: self.ledger.read(self.pool, self.table, layer, row, end)

    def range_reader(self, row: int, start: int, end: int
                     ) -> Callable[[int], tuple[Tensor, Tensor]]:  # fmt: skip
        """layer -> exact (K, V) of positions [start, end) of ``row``, each [H_kv, n, D]."""
        return lambda layer: self.ledger.read_range(self.pool, self.table, layer, row, start, end)

    @property
    def tail_tokens(self) -> int:
        """Committed tokens an offloaded row gathers in the pool before they follow it to the
        host. On a device, ``TAIL_CHUNK``: the pool's tail is read in place and each move is a
        transfer. On a host-memory pool, every token: there each forward that reads the row
        gathers its tail's scattered slots, cold (7% of all decode time at 8 x 6k, py-spy),
        while moving them each step copies slots this step just wrote."""
        return 1 if self.pool_in_host_memory else TAIL_CHUNK

    def offload(self, row: int, owned_from: int, committed: int, compressed_bytes: int = 0,
                min_tokens: int | None = None, req: Any = None, state: Any = None
                ) -> OffloadResult:  # fmt: skip
        """Move positions [lo, floor_page(committed)) of ``row`` to the host.

        owned_from: first position the request owns (tree-owned positions before it stay);
        lo continues the row's host range. Moves nothing unless at least ``min_tokens``
        (default ``tail_tokens``) are due. Then holds the row's compressed KV
        (``state``, or ``compressed_bytes`` of it where there is no state).

        req: the row's request, where the prefix tree takes part (``PrefixTreeHooks.adopt``):
        then a row's first offload moves the whole row from position 0, the tree keeps the
        matched prefix it owns (no longer locked by this request) and adopts the request's own
        slots as cached nodes instead of their being freed. The request reads its host copy
        from then on; the tree's copy is evictable like any cached node, and a hit for others.
        """
        entry = self.ledger.span(row)
        tree = self.ledger.tree if req is not None and entry is None else None
        if entry is not None:
            lo = entry.hi
        elif tree is not None and owned_from % self.page == 0:
            lo = 0  # the tree owns [0, owned_from) in whole pages
        else:
            tree, lo = None, -(-owned_from // self.page) * self.page
        hi = committed // self.page * self.page
        if hi - lo < max(self.tail_tokens if min_tokens is None else min_tokens, 1):
            return OffloadResult()
        slots = self.table[row, lo:hi].to(torch.int64)
        read = lambda layer: read_pool_kv(self.pool, layer, slots, view_ok=True)  # noqa: E731
        entry = self.ledger.offload(row, lo, hi - lo, read, lambda: self._new_host(hi, req))
        self.table[row, lo:hi] = PLACEHOLDER_SLOT
        own = slots if tree is None else tree.adopt(req, slots, owned_from)
        self.allocator.free(own)
        self.ledger.freed_slots += hi - lo
        return OffloadResult(moved=hi - lo, reserved=self._hold(row, state, compressed_bytes))

    def hold_resident(self, row: int, state: Any) -> bool:
        """Lodge ``state`` (a drafted row's compressed KV) in a draft row of free pool slots
        while the row's full KV stays in the pool (pressure placement), so the allocator counts
        it. Only free slots, and only where they cover it: slots that admission promised
        elsewhere (a chunked prompt's next chunk, the next decode step) are not eaten into for
        good, since an allocation that finds them short evicts resident draft rows
        (``evict_resident``, via the prefix tree's ``evict``), which is why a tree must be there
        to evict through. Returns whether the state is lodged; otherwise it stays beside the
        pool until its full KV moves (``_hold``)."""
        tree = self.ledger.tree
        if self.ledger.span(row) is not None or tree is None or not tree.supports_prefix_sharing():
            return False
        draft_row = self.ledger.draft_rows.get(row)
        if draft_row is not None:
            if draft_row.tenant is state:
                return True
            self._free_reserved(row)  # a state rebuilt since: its predecessor's slots go back
        # its bytes' worth, and the room a lodged view is given to grow (whole pages)
        if self.allocator.available_size() < self.slots_for(state.nbytes) + GROW_MIN + self.page:
            return False
        draft_row = self.ledger.draft_rows[row] = DraftRow(self.pool, self._take_for(row))
        return draft_row.lodge(state) == len(state.layers)

    def hold(self, row: int, state: Any) -> int:
        """Lodge a drafted row's (re)built compressed KV ``state`` in pool slots now, not at the
        row's next offload: beside its offloaded full KV (``_hold``), or in free slots while its
        full KV is resident (``hold_resident``; where they do not cover it, beside the pool).
        Returns the slots the row holds for it."""
        if self.ledger.span(row) is None:
            self.hold_resident(row, state)
        else:
            self._hold(row, state)
        return self.ledger.reserved(row)

    def evict_resident(self, num_slots: int) -> int:
        """Free resident draft rows (``hold_resident``), largest first, until ``num_slots`` are
        free; each state's columns move to buffers of its own (drafting goes on, beside the pool
        until pressure moves its full KV). Returns the slots freed."""
        if num_slots <= 0:
            return 0
        rows = [r for r in self.ledger.draft_rows if self.ledger.span(r) is None]
        rows.sort(key=lambda r: -self.ledger.draft_rows[r].num_held)
        freed = 0
        for row in rows:
            if freed >= num_slots:
                break
            freed += self._free_reserved(row)
        if freed:
            self.ledger.evicted_resident_slots += freed
            logger.info("an allocation took back %d pool slots of resident draft rows (their "
                        "compressed KV stays beside the pool until pressure moves it)", freed)
        return freed

    def _take_for(self, row: int) -> Callable[[int], Tensor | None]:
        """How ``row``'s draft row takes slots: while its full KV is resident, free ones only
        (never evicting a cached node, no shortfall counted: its compressed KV may stay beside
        the pool); once offloaded, ``_take``."""

        return lambda n: self._take(n, free_only=self.ledger.span(row) is None)

    def _hold(self, row: int, state: Any = None, compressed_bytes: int = 0) -> int:
        """Hold pool slots for ``row``'s compressed KV, at least ``ceil(bytes / slot_bytes)``
        (whole pages), in its draft row (``srt/kv/draft_rows.py``), and lodge ``state`` there.

        state: the row's ``RequestDraftState`` (its ``nbytes`` count, not ``compressed_bytes``):
        its full-precision columns and a KIVI body's pages move into the slots, so its
        compressed KV lives in the pool it is counted in. A state already lodged costs a size
        check. Returns slots added; where the pool lacks them, fewer (``reserve_shortfall``,
        logged).
        """
        draft_row = self.ledger.draft_rows.get(row)
        if draft_row is None:
            if state is None and compressed_bytes == 0:
                return 0  # a plain row: nothing to hold
            draft_row = self.ledger.draft_rows[row] = DraftRow(self.pool, self._take_for(row))
        before = draft_row.num_held
        if state is not None:
            draft_row.lodge(state)  # its columns and packed pages take what they need
        need = self.slots_for(compressed_bytes if state is None else state.nbytes)
        if need > draft_row.num_held:  # the rest (kept-position indices) as room for columns
            draft_row.grow_to(int(draft_row.slots.numel()) + need - draft_row.num_held)
        return draft_row.num_held - before

    def _new_host(self, committed: int, req: Any) -> HostKV:
        """A row's host buffer, sized for ``committed`` tokens and what ``req`` may still emit
        (up to ``PRESIZE_MAX``): growing it later copies all of it."""
        left = 0 if req is None else min(tokens_left(req), PRESIZE_MAX)
        keys = self.pool.get_key_buffer(0)  # [slots, H_kv, D]
        return HostKV(self.num_layers, keys.shape[1], keys.shape[2], keys.dtype,
                      committed + HOST_ROOM + left)  # fmt: skip

    def slots_for(self, nbytes: int) -> int:
        """Pool slots worth ``nbytes`` of compressed KV, in whole pages (0 for 0 bytes)."""
        return math.ceil(nbytes / self.slot_bytes / self.page) * self.page

    def _take(self, n: int, free_only: bool = False) -> Tensor | None:
        """[n] int64 fresh pool slots for compressed KV (cached nodes evicted if they must be),
        or None, counted in ``reserve_shortfall`` and logged, where the pool has none; with
        ``free_only`` (a resident draft row), free slots or None, nothing evicted or counted. A
        paged allocator hands out whole pages: n rounds up to them (the row keeps the rest as
        room)."""
        n = -(-n // self.page) * self.page
        got = self.allocator.alloc(n)
        if free_only:
            return None if got is None else got.to(torch.int64)
        if got is None and self.ledger.tree is not None:
            self.ledger.tree.evict_cached(n)  # free slots may all be cached nodes
            got = self.allocator.alloc(n)
        if got is None:
            self.reserve_shortfall += n
            logger.warning("pool full: %d slots of compressed KV unaccounted", n)
            return None
        return got.to(torch.int64)

    def restore(self, row: int, evict: Callable[[int], None], held: Tensor | None = None) -> bool:
        """Bring ``row``'s host range back onto the device (for the prefix cache).

        held: [k] pool slots of the range's first k positions that the prefix tree already
        holds (its adopted prompt, usually), locked by the caller: the row points at them and
        only the other positions are copied into fresh slots. Frees the row's draft row
        first; ``evict(n)`` may free cached slots. Returns False (row unchanged, still
        offloaded) when the pool cannot take the rest.
        """
        entry = self.ledger.span(row)
        if entry is None:
            return True
        self._free_reserved(row)
        k = 0 if held is None else int(held.numel())
        n = entry.hi - entry.lo - k
        slots = self.allocator.alloc(n) if n > 0 else torch.empty(0, dtype=torch.int64)
        if slots is None:
            evict(n)
            slots = self.allocator.alloc(n)
        if slots is None:
            return False
        slots = slots.to(torch.int64)
        if n > 0:
            write_pool_all_layers(self.pool, slots, entry.host.restore()[..., k:, :])
        if k:
            self.table[row, entry.lo : entry.lo + k] = held.to(self.table.dtype)
        self.table[row, entry.lo + k : entry.hi] = slots.to(self.table.dtype)
        self.ledger.release(row)
        return True

    def release_reserved(self, row: int) -> int:
        """Free ``row``'s compressed-KV slots (its compressed KV is dropped; its full KV stays
        where it is). Returns the slots freed; admission sees them (``freed_slots``)."""
        n = self._free_reserved(row)
        self.ledger.freed_slots += n
        return n

    def drop(self, row: int) -> None:
        """Forget ``row``'s host range and free its draft row (its request is gone)."""
        self.ledger.release(row)
        self._free_reserved(row)

    def _free_reserved(self, row: int) -> int:
        """Free ``row``'s draft row (a state that lives on keeps its columns, copied out);
        returns the slots freed."""
        draft_row = self.ledger.draft_rows.pop(row, None)
        slots = torch.empty(0, dtype=torch.int64) if draft_row is None else draft_row.release()
        if slots.numel():
            self.allocator.free(slots)
        return int(slots.numel())

    def owned_ranges(self, row: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``ranges`` of row positions minus the row's offloaded range (no slots there)."""
        entry = self.ledger.span(row)
        if entry is None:
            return ranges
        out = []
        for start, end in ranges:
            for a, b in ((start, min(end, entry.lo)), (max(start, entry.hi), end)):
                if a < b:
                    out.append((a, b))
        return out
