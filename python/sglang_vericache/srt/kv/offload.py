"""The VeriCache memory layout: full KV of a drafted request in host memory, not in the pool.

After prefill (and every ``TAIL_CHUNK`` committed tokens after that; on a host-memory pool,
every committed token: ``PoolOffloader.tail_tokens``) the worker moves the full KV of a
request's own positions to a host buffer and gives their pool slots back; the row keeps a
placeholder there. What stays in the device pool per request::

    row positions  0 ........ lo | lo ............ hi | hi ...... base | base .. base+x
    pool slots     tree-owned    | placeholder (0)    | committed tail | this step's
                   shared prefix | full KV -> host    | (< TAIL_CHUNK) | draft/verify slots
    plus           its draft row: slots holding its compressed KV's full-precision columns
                   (``srt/kv/draft_rows.py``), at least ceil(compressed bytes / slot bytes), so
                   admission sees what VeriCache holds

Attention reads [lo, hi) from the host buffer (``OffloadLedger.read``): for verification and for
a plain decode step, never for drafting (drafts read the compressed view). Freed slots go back
to SGLang's allocator at once, so the scheduler admits more requests into the same budget;
a drafted row's slots go to the prefix tree instead (``PrefixTreeHooks``): evictable like any
cached node, and a hit for the requests that share the prompt while this one decodes.

Ownership: the ledger is shared by the worker (which offloads) and the ``vericache`` prefix
cache (which restores or drops a row when SGLang releases it), through the one ``PoolOffloader``
of their scheduler's context (``srt/context.py``). Everything runs on the scheduler thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import Tensor

from sglang_vericache.host_memory import host_empty

# Committed tokens collected in a device pool before they move to the host (amortises the
# transfer; a host-memory pool moves every token: ``PoolOffloader.tail_tokens``).
TAIL_CHUNK = 32

# Free columns a host buffer keeps after its tokens when it grows: room for the pool's tail
# (< TAIL_CHUNK) and a verify's drafts, so attention reads the whole row in place.
HOST_ROOM = 64
# Most output tokens a new host buffer is sized for up front (``HostKV(capacity=...)``): growing
# copies the whole buffer (a 6k-token row of SmolLM2 is 280 MB), so a row is sized for its
# remaining output once; unpinned pages cost nothing until written, pinned ones do, hence a cap.
PRESIZE_MAX = 4096

# Row entries of offloaded positions point here. SGLang never hands out slot 0 (it takes the
# padding writes), and attention never reads these entries: the ledger serves the range.
PLACEHOLDER_SLOT = 0

class HostKV:
    """A growable host buffer of one request's full KV: [L, 2, H_kv, capacity, D].

    Pinned when CUDA is present, so verification copies overlap with compute.
    """

    def __init__(self, num_layers: int, heads: int, head_dim: int, dtype: torch.dtype,
                 capacity: int = 0) -> None:  # fmt: skip
        """capacity: tokens the buffer holds before its first growth (the row's expected
        length: its prompt and the output it may still emit, up to ``PRESIZE_MAX``)."""
        self._shape = (num_layers, 2, heads)
        self._head_dim, self._dtype = head_dim, dtype
        self._buf = self._alloc(capacity)
        self.length = 0

    def _alloc(self, capacity: int) -> Tensor:
        return host_empty((*self._shape, capacity, self._head_dim), self._dtype,
                          pin_memory=torch.cuda.is_available())

    def append(self, n: int, read: Callable[[int], tuple[Tensor, Tensor]]) -> None:
        """Append ``n`` tokens after ``length``: read(layer) -> (K, V), each [H_kv, n, D] in the
        pool dtype (any device; views of the pool are fine). Each layer is copied straight
        into the buffer: no [L, 2, H_kv, n, D] staging copy of the whole row."""
        if self.length + n > self._buf.shape[3]:
            cap = self._buf.shape[3]
            grown = self._alloc(max(cap + cap // 4, self.length + n) + HOST_ROOM)
            grown[..., : self.length, :] = self._buf[..., : self.length, :]
            self._buf = grown
        end = self.length + n
        for layer in range(self._shape[0]):
            keys, values = read(layer)
            self._buf[layer, 0, :, self.length : end].copy_(keys)
            self._buf[layer, 1, :, self.length : end].copy_(values)
        self.length = end

    def layer(self, layer: int, start: int, end: int) -> tuple[Tensor, Tensor]:
        """Host K and V of buffered tokens [start, end) of one layer: each [H_kv, n, D]."""
        return self._buf[layer, 0, :, start:end], self._buf[layer, 1, :, start:end]

    def layer_with_tail(self, layer: int, tail_k: Tensor, tail_v: Tensor
                        ) -> tuple[Tensor, Tensor] | None:  # fmt: skip
        """K and V of every buffered token of ``layer`` followed by ``tail_k``/``tail_v``
        ([H_kv, n, D], on this buffer's device), each [H_kv, length + n, D], without copying the
        buffered tokens: the tail is written into the free capacity after them (scratch, not
        buffered: ``length`` stays). None when the capacity is short or the devices differ."""
        n = tail_k.shape[1]
        if self.length + n > self._buf.shape[3] or tail_k.device != self._buf.device:
            return None
        end = self.length + n
        self._buf[layer, 0, :, self.length : end] = tail_k
        self._buf[layer, 1, :, self.length : end] = tail_v
        return self._buf[layer, 0, :, :end], self._buf[layer, 1, :, :end]

    def restore(self) -> Tensor:
        """All buffered tokens: [L, 2, H_kv, length, D] (a view)."""
        return self._buf[..., : self.length, :]

    @property
    def nbytes(self) -> int:
        """Bytes of KV held (not capacity)."""
        return self.restore().nbytes


@dataclass(slots=True)
class OffloadedRow:
    """Positions [lo, hi) of one pool row live in ``host``.

    staged: this step's copy of the host tokens [0, n) on the pool's device, [L, 2, H_kv, n, D]
    (a device pool: copied while the batch drafts, dropped after the verify;
    ``srt/kv/full_kv_stage.py``), or None.
    """

    lo: int
    host: HostKV
    staged: Tensor | None = None

    @property
    def hi(self) -> int:
        return self.lo + self.host.length

    def layer(self, layer: int, start: int, end: int) -> tuple[Tensor, Tensor]:
        """K and V of host tokens [start, end) of one layer, each [H_kv, n, D]: from the staged
        device copy where it holds them, else from the host buffer."""
        if self.staged is not None and end <= self.staged.shape[3]:
            return self.staged[layer, 0, :, start:end], self.staged[layer, 1, :, start:end]
        return self.host.layer(layer, start, end)


class PrefixTreeHooks(Protocol):
    """What the offloader asks of the prefix tree (``VeriCacheRadixCache``; scheduler thread)."""

    def adopt(self, req: Any, slots: Tensor, owned_from: int) -> Tensor:
        """Take the slots ([n] int64) of row positions [0, n) of ``req``, whose KV now lives in
        its host buffer, as unlocked cached nodes; ``req`` stops pinning its matched prefix
        [0, owned_from). Returns the request's own slots the tree did not take: free them."""

    def evict_cached(self, num_tokens: int) -> None:
        """Evict at least ``num_tokens`` cached (unlocked) tokens where there are that many."""

    def cached_tokens(self) -> int:
        """Tokens held by cached, unlocked nodes: free for any allocation after eviction."""


class OffloadLedger:
    """Which pool rows have offloaded ranges (``rows``), and which hold pool slots for their
    compressed KV (``draft_rows``, ``srt/kv/draft_rows.py``): two tables, as a draft row may go
    (released for admission) while its row's host range stays, and a resident row (its full
    KV in the pool, pressure placement) may hold one without a host range.

    Mutated by the offloader (``PoolOffloader``: for the worker, and for the prefix cache when
    SGLang releases a row) on the scheduler thread only; readers (the attention backend) use
    ``read`` during forwards.
    """

    def __init__(self) -> None:
        self.rows: dict[int, OffloadedRow] = {}
        self.draft_rows: dict[int, Any] = {}  # pool row -> its DraftRow (srt/kv/draft_rows.py)
        self.freed_slots = 0  # pool slots ever given back by offloads (admission watches it)
        self.evicted_resident_slots = 0  # resident draft rows' slots allocations took back
        # Slots the last admission attempt lacked for a waiting request (0: none lacked); set by
        # the admission hook, relieved by the worker offloading resident rows (placement.py).
        self.admission_deficit = 0
        # (request id, prompt tokens, slots asked) of each request still waiting when an attempt
        # lacked, in queue order: the first lacked ``admission_deficit``, the others queue behind
        self.waiting_asks: list[tuple[str, int, int]] = []
        # The work finished prefills left for after their first tokens (compress, offload),
        # which gives pool slots back; set by the worker when it queues such work. Admission
        # runs it before it counts free slots (``srt/kv/admission.py``), so a waiting request
        # sees that room at once, not one decode step later.
        self.settle_prefills: Callable[[], None] | None = None
        # The prefix tree the pool's rows share (the ``vericache`` prefix cache sets itself):
        # what a drafted row's pool slots become when its full KV moves to the host.
        self.tree: PrefixTreeHooks | None = None

    # -- its part in the request table (requests/table.py) ------------------------------------

    participant_name = "offload ledger"

    def forget(self, rid: str) -> None:
        """``rid`` closed: its admission ask goes (the next attempt would drop it too)."""
        self.waiting_asks = [ask for ask in self.waiting_asks if ask[0] != rid]

    def tracked_rids(self) -> set[str]:
        return {ask[0] for ask in self.waiting_asks}

    def held_rows(self) -> set[int]:
        """Pool rows with a host range or a draft row (freed when SGLang releases the row)."""
        return set(self.rows) | set(self.draft_rows)

    def span(self, row: int) -> OffloadedRow | None:
        return self.rows.get(row)

    def offload(self, row: int, lo: int, n: int, read: Callable[[int], tuple[Tensor, Tensor]],
                new_host: Callable[[], HostKV]) -> OffloadedRow:  # fmt: skip
        """Record ``n`` tokens (``read`` as in ``HostKV.append``) as positions [lo, lo+n) of
        ``row`` in a new host buffer (``new_host()``), or append them to its buffer.

        A row already offloaded must continue exactly at its ``hi``.
        """
        entry = self.rows.get(row)
        if entry is None:
            entry = OffloadedRow(lo=lo, host=new_host())
            self.rows[row] = entry
        elif entry.hi != lo:
            raise ValueError(f"row {row}: offload at {lo} but its host range ends at {entry.hi}")
        entry.host.append(n, read)
        return entry

    def release(self, row: int) -> OffloadedRow | None:
        """Forget ``row``'s host range (its KV is back in the pool, or its request left)."""
        return self.rows.pop(row, None)

    def reserved(self, row: int) -> int:
        """Pool slots ``row`` holds for its compressed KV (its draft row's)."""
        draft_row = self.draft_rows.get(row)
        return 0 if draft_row is None else draft_row.num_held

    def reserved_slots(self) -> int:
        """Pool slots every row holds for compressed KV."""
        return sum(d.num_held for d in self.draft_rows.values())

    def read(self, pool: Any, table: Tensor, layer: int, row: int, end: int
             ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """Full K and V of positions [0, end) of ``row``, each [H_kv, end, D] on the pool device.

        pool: SGLang token-to-KV pool; table: req_to_token [rows, max_len] int32. Where the row's
        whole prefix is in one host buffer on the pool's device (CPU) with room for the tail, or
        all of it in one run of pool slots, the result is a view of that buffer or of the pool
        (no copy): use it before the pool or the ledger changes (one forward), or copy it.
        """
        entry = self.rows.get(row)
        if entry is None or entry.lo >= end:
            return read_pool_kv(pool, layer, table[row, :end], view_ok=True)
        # the host buffer whole, then the pool's tail written after it, in place if it has room
        # (a staged copy lives on the device: read_range concatenates it there)
        if entry.lo == 0 and entry.hi <= end and entry.staged is None:
            tk, tv = read_pool_kv(pool, layer, table[row, entry.hi : end])
            whole = entry.host.layer_with_tail(layer, tk, tv)
            if whole is not None:
                return whole
        return self.read_range(pool, table, layer, row, 0, end)

    def read_range(self, pool: Any, table: Tensor, layer: int, row: int, start: int, end: int
                   ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """Exact K and V of positions [start, end) of ``row``, each [H_kv, end - start, D] on the
        pool device: the pool's slots before and after its host range, the host range between
        (gathered and concatenated: a copy the caller may keep)::

            positions  start .. lo | lo ...... hi | hi .. end
            from       pool slots  | host buffer  | pool slots
        """
        entry = self.rows.get(row)
        if entry is None or entry.lo >= end or entry.hi <= start:
            return read_pool_kv(pool, layer, table[row, start:end])
        lo, hi = max(start, entry.lo), min(end, entry.hi)
        device = table.device
        pk, pv = read_pool_kv(pool, layer, table[row, start:lo])
        hk, hv = entry.layer(layer, lo - entry.lo, hi - entry.lo)
        tk, tv = read_pool_kv(pool, layer, table[row, hi:end])
        keys = torch.cat([pk, hk.to(device, non_blocking=True), tk], dim=1)
        values = torch.cat([pv, hv.to(device, non_blocking=True), tv], dim=1)
        return keys, values

    def check_integrity(self, table: Tensor | None = None) -> None:
        """Ranges are non-empty; with ``table``, offloaded entries hold the placeholder; no slot
        in two draft rows (a draft row beside its row's host range, or a resident one)."""
        for draft_row in self.draft_rows.values():
            draft_row.check_integrity()
        held = [d.held for d in self.draft_rows.values()]
        if held:
            slots = torch.cat(held)
            assert int(slots.unique().numel()) == int(slots.numel()), "a slot in two draft rows"
        for row, entry in self.rows.items():
            assert entry.lo >= 0 and entry.host.length > 0, f"row {row}: empty offload"
            if table is not None:
                slots = table[row, entry.lo : entry.hi]
                assert bool((slots == PLACEHOLDER_SLOT).all()), f"row {row}: live slot offloaded"


def read_pool_kv(pool: Any, layer_id: int, slots: Tensor, *, view_ok: bool = False
                 ) -> tuple[Tensor, Tensor]:  # fmt: skip
    """K and V of ``slots`` ([n] integer) from an SGLang token-to-KV pool: each [H_kv, n, D].

    view_ok: where ``slots`` are one ascending run (a prompt allocated at once usually is),
    return views of the pool instead of gathered copies; only for a reader that is done with
    them before the pool changes (attention within one forward).
    """
    k_buf, v_buf = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
    n = slots.numel()
    if view_ok and n > 1:
        first = int(slots[0])
        if int(slots[-1]) - first == n - 1 and bool((slots.diff() == 1).all()):
            run = slice(first, first + n)
            return k_buf[run].transpose(0, 1), v_buf[run].transpose(0, 1)
    return k_buf[slots].transpose(0, 1), v_buf[slots].transpose(0, 1)


def write_pool_all_layers(pool: Any, slots: Tensor, kv: Tensor) -> None:
    """kv ([L, 2, H_kv, n, D], any device) into pool ``slots`` ([n]) of every layer."""
    for layer in range(kv.shape[0]):
        dst_k, dst_v = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
        dst_k[slots] = kv[layer, 0].transpose(0, 1).to(dst_k.device, dst_k.dtype)
        dst_v[slots] = kv[layer, 1].transpose(0, 1).to(dst_v.device, dst_v.dtype)


def slot_bytes(pool: Any, num_layers: int) -> int:
    """Bytes of full KV one pool slot holds across all layers (keys + values)."""
    k, v = pool.get_key_buffer(0), pool.get_value_buffer(0)
    return num_layers * (k[0].nbytes + v[0].nbytes)
