"""Compressed KV in the device pool: each drafted request's draft row.

When a drafted request's full KV leaves the pool (``srt/kv/offload.py``), it holds pool slots for
its compressed KV, as many as its bytes fill: the allocator counts them, so admission sees what
VeriCache holds. Those slots are its draft row: column j of every layer's full-precision view
(a dropper's kept tokens, a quantizer's residual, then the recent window) lives in slot
``slots[j]`` of that layer's pool buffers, as a request's token j lives in slot
``req_to_token[r, j]``. Per-head selections are already compacted (every head keeps the same
count, keys post-RoPE), so one slot holds column j of all heads::

    draft row           s_0   s_1   s_2  ...  s_(n-1) | s_n ... s_(cap-1)
    layer l, K and V    col 0 col 1 col 2     col n-1 | free (appends, folds)

A draft forward reads a row by its slots, its chain by the chain's own slots
(``srt/attention/draft_attention.py``), in place. A KIVI body's packed codes and scales are pages of the
same row (``pages``, one page of slots per key group, ``compress/kivi_pages.py``): layer l's
body in layer l's buffers at the row's first pages, read packed where they lie::

    draft row pages     p_0 .. p_5 | p_6 .. p_11 | ...      (6 slots a group: int4, G 32, fp32)
    layer l             group 0    | group 1     | ...

An offloaded row's slots come out of what its offload frees, so taking them never eats into
what SGLang has promised (the rest of a chunked prompt, the running requests' next tokens). A
request whose full KV stays resident (pressure placement) takes free slots only, where they
cover its compressed KV (``PoolOffloader.hold_resident``): admission counts them as held, and an
allocation SGLang promised that finds the pool short takes them back through the prefix tree's
eviction, after every cached node (``PoolOffloader.evict_resident``); the state then keeps its
compressed KV beside the pool until pressure moves its full KV. (Taking them for good was tried:
a chunked prefill's next chunk, promised at its first admission, ran out of memory.)

Lifetime: the ledger holds each row's draft row (``OffloadLedger.draft_rows``); the row owns
its slots. A request's ``RequestDraftState`` lodges in them (``lodge``) when the offloader holds
slots for it; before the slots go back to the allocator (the request's end, release for
admission), ``release`` evicts: the columns of a state still alive are copied into buffers of
its own (a finished state parked as a demoted prefix keeps its KV), and a state no one holds any
more is simply gone (the row holds it by weak reference). At most one state lodges in a row;
everything runs on the scheduler thread.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch
from torch import Tensor

from sglang_vericache.compress.base import QuantizedBlock
from sglang_vericache.compress.kivi_pages import KiviPageLayout, PagedKiviBlock
from sglang_vericache.compress.view_store import ViewStore
from sglang_vericache.srt.kv.offload import read_pool_kv

logger = logging.getLogger(__name__)


class DraftRow:
    """Pool slots held for one request's compressed KV, as columns of its compressed views.

    take: n -> [m >= n] int64 fresh pool slots (whole pages), or None where the pool has none.
    ``slots`` [capacity] int64: column j of every layer lives in slot ``slots[j]``; ``pages``
    [n] int64: a packed body's pages. Both grow (``grow_to``, ``grow_pages_to``) and go back
    together (``release``), never move.
    """

    def __init__(self, pool: Any, take: Callable[[int], Tensor | None]) -> None:
        self.pool, self._take = pool, take
        self.slots = torch.empty(0, dtype=torch.int64)
        self.pages = torch.empty(0, dtype=torch.int64)
        self._tenant: weakref.ref | None = None

    @property
    def held(self) -> Tensor:
        """[n] int64: every slot the row holds (columns, then pages)."""
        return torch.cat([self.slots, self.pages])

    @property
    def num_held(self) -> int:
        return int(self.slots.numel()) + int(self.pages.numel())

    @property
    def tenant(self) -> Any | None:
        """The ``RequestDraftState`` lodged here, if it is still alive."""
        return None if self._tenant is None else self._tenant()

    def grow_to(self, capacity: int) -> bool:
        """At least ``capacity`` column slots (more taken from the pool); False where it has
        none."""
        got = self._more(capacity - int(self.slots.numel()))
        if got is not None:
            self.slots = torch.cat([self.slots, got])
        return got is not None

    def grow_pages_to(self, count: int) -> bool:
        """At least ``count`` page slots; False where the pool has none."""
        got = self._more(count - int(self.pages.numel()))
        if got is not None:
            self.pages = torch.cat([self.pages, got])
        return got is not None

    def _more(self, need: int) -> Tensor | None:
        if need <= 0:
            return self.slots[:0]
        got = self._take(need)
        return None if got is None else got.to(self.slots.device, torch.int64)

    def release(self) -> Tensor:
        """Evict the tenant and hand back every slot ([n] int64, for the caller to free); the
        row holds none after this."""
        self.evict()
        held = self.held
        self.slots, self.pages = self.slots[:0], self.pages[:0]
        return held

    def lodge(self, state: Any) -> int:
        """Move ``state``'s full-precision columns (and a KIVI body, to pages) into this row
        (the previous tenant, if any, evicted first). Returns the layers lodged: a layer whose
        columns the pool could not take keeps its own buffer (and the pool's count is short by
        it, logged)."""
        if self.tenant is state:
            return sum(isinstance(c.store, PoolViewStore) and c.store.row is self
                       for c in state.layers)  # fmt: skip
        self.evict()
        lodged = 0
        for layer, cache in enumerate(state.layers):
            try:
                cache.move_to(PoolViewStore(self, layer))
                lodged += 1
            except ValueError:  # the pool is full: this layer keeps its own buffer
                pass
        if lodged < len(state.layers):
            logger.warning("pool full: %d of %d layers' compressed KV stay outside the pool",
                           len(state.layers) - lodged, len(state.layers))  # fmt: skip
        self._tenant = weakref.ref(state)
        return lodged

    def evict(self) -> None:
        """Copy the lodged state's columns and packed body (if it is alive) into buffers of its
        own; after this no cache reads or writes these slots."""
        state = self.tenant
        self._tenant = None
        for cache in () if state is None else state.layers:
            if isinstance(cache.store, PoolViewStore) and cache.store.row is self:
                cache.move_to(None)

    def check_integrity(self) -> None:
        """Raises AssertionError if the row's slots repeat, hold the placeholder slot 0, or are
        fewer than a lodged layer's columns or pages."""
        held = self.held
        assert int(held.unique().numel()) == int(held.numel()), "a slot twice in the row"
        assert not bool((held == 0).any()), "the padding slot in a draft row"
        for cache in () if self.tenant is None else self.tenant.layers:
            if isinstance(cache.store, PoolViewStore) and cache.store.row is self:
                assert cache.float_len <= self.slots.numel(), "a layer's columns past the row"
            if isinstance(cache.block, PagedKiviBlock) and cache.block.in_pool:
                assert cache.block.key_buffer is self.pool.get_key_buffer(cache.layer_id)
                pages = cache.block.pages
                assert torch.equal(pages, self.pages[: pages.numel()]), "a body off the pages"


class PoolViewStore(ViewStore):
    """A layer's columns in its pool buffers at a draft row's slots (see module doc).

    Reads gather the slots (``read_pool_kv``); writes scatter into the layer's buffers. A KIVI
    body goes to the row's pages (``hold_block``).
    """

    def __init__(self, row: DraftRow, layer: int) -> None:
        self.row, self.layer = row, layer
        self._k, self._v = row.pool.get_key_buffer(layer), row.pool.get_value_buffer(layer)
        self._column_bytes = self._k[0].nbytes + self._v[0].nbytes  # asked each step (nbytes)

    @property
    def capacity(self) -> int:
        return int(self.row.slots.numel())

    def ensure(self, capacity: int, keep: int) -> bool:
        return self.row.grow_to(capacity)  # slots stay where they are: nothing moves

    def write(self, start: int, keys: Tensor, values: Tensor) -> None:
        n = keys.shape[1]
        if start + n > self.capacity:
            raise ValueError(f"write of columns [{start}, {start + n}) past capacity {self.capacity}")
        at = self.row.slots[start : start + n].to(self._k.device)
        self._k[at] = keys.transpose(0, 1).to(self._k.dtype)
        self._v[at] = values.transpose(0, 1).to(self._v.dtype)

    def read(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        return read_pool_kv(self.row.pool, self.layer, self.row.slots[start:end])

    def slots(self) -> Tensor:
        return self.row.slots

    def hold_block(self, block: QuantizedBlock | None) -> QuantizedBlock | None:
        """``block`` written to the row's pages (a ``PagedKiviBlock``); a block of another
        format, or one the pool has no pages for (logged), stays in tensors of its own."""
        if block is None or not KiviPageLayout.fits(block, self._k):
            return None if block is None else block.detached()
        here = isinstance(block, PagedKiviBlock) and block.key_buffer is self._k and torch.equal(
            block.pages, self.row.pages[: block.pages.numel()])  # fmt: skip
        if here and block.tail is None:
            return block  # already here (a fold that quantized nothing new)
        if not self.row.grow_pages_to(KiviPageLayout.of(block).pages_for(block.num_tokens)):
            logger.warning("pool full: layer %d's packed body stays outside the pool", self.layer)
            return block.detached()
        if here:  # a fold's new groups: only they are written
            return block.written(self.row.pages)
        return PagedKiviBlock.write(block.detached(), self._k, self._v, self.row.pages)

    @property
    def column_bytes(self) -> int:
        return self._column_bytes
