"""A verify's full KV on the device before it runs: host ranges copied while the batch drafts.

On a device pool (a GPU) a row's offloaded positions live in pinned host memory
(``srt/kv/offload.py``). Read by the verify's attention, each layer of each row would be a
transfer inside the forward, on its critical path. Instead, right before the draft forwards,
the worker submits one copy task for the host ranges of the rows the verify reads
(``ops/prefetch.py``: a side stream, a few contiguous copies per row). The draft forwards run
meanwhile; the verify's stream waits for the copies on the device, the host never does::

    host    catch-up | stage: submit | draft forwards queued ... | ready | verify | release
    side stream                      |== host -> device copies ==|
    compute stream                   | draft x D (compressed)    |wait  | verify reads staged

``OffloadedRow.staged`` holds a row's copy for that one step; ``release`` drops it after the
verify is queued (the caching allocator reuses the memory only after the streams that used
it). At most ``budget_bytes`` are staged per step, rows in batch order; a row past the budget
is read per layer as before. The copies are transient device memory outside the KV pool.

A plain step (the planner chose not to draft, or offload-only) stages its rows too, right
before its forward: nothing runs meanwhile to overlap the copies with, but each row is one copy
of a few contiguous runs instead of one per layer inside the forward.

On a host-memory pool (the CPU backend) the verify reads the host buffer in place: the budget
is 0 and nothing is staged.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from sglang_vericache.ops.prefetch import FullKVPrefetcher, device_copy_pairs
from sglang_vericache.srt.kv.offload import OffloadLedger

# Share of the device memory free after SGLang sized its pool that one step may stage (the rest
# stays for activations, CUDA graphs and the allocator's slack).
STAGE_FRACTION = 0.5


class FullKVStager:
    """stage / ready / release around one verify (see module doc). Scheduler thread only.

    Mutates ``staged`` of the ledger rows it stages, and nothing else of the ledger; every row it
    staged is unstaged by ``release`` (or by the next ``stage``, after a step that raised).
    """

    def __init__(self, ledger: OffloadLedger, device: torch.device | str,
                 budget_bytes: int) -> None:  # fmt: skip
        self.ledger, self.budget_bytes = ledger, budget_bytes
        self.prefetcher = FullKVPrefetcher(device)
        self._rows: list[int] = []
        self._task: int | None = None
        self.bytes_staged = 0  # this step's

    @classmethod
    def for_pool(cls, ledger: OffloadLedger, device: torch.device | str) -> FullKVStager:
        """A stager for a pool on ``device``: on CUDA with ``STAGE_FRACTION`` of the memory
        free now (after the pool's allocation); elsewhere with no budget."""
        device = torch.device(device)
        budget = 0
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * STAGE_FRACTION)
        return cls(ledger, device, budget)

    def stage(self, rows: Iterable[int]) -> int:
        """Submit copies of each row's host range to the device, rows in order while the budget
        lasts (a row that does not fit is skipped; a later, smaller one may fit). Returns the
        bytes staged."""
        self.release()
        if self.budget_bytes <= 0:
            return 0
        pairs = []
        for row in rows:
            entry = self.ledger.span(row)
            if entry is None or entry.staged is not None or entry.host.length == 0:
                continue
            host = entry.host.restore()  # [L, 2, H_kv, n, D], pinned on a CUDA host
            nbytes = host.numel() * host.element_size()
            if self.bytes_staged + nbytes > self.budget_bytes:
                continue
            row_pairs, entry.staged = device_copy_pairs(host, self.prefetcher.device)
            pairs += row_pairs
            self._rows.append(row)
            self.bytes_staged += nbytes
        if pairs:
            self._task = self.prefetcher.submit(pairs)
        return self.bytes_staged

    def ready(self) -> None:
        """Make the current stream wait for the copies before the verify reads them (the host
        does not wait)."""
        if self._task is not None:
            self.prefetcher.order_after(self._task)

    def release(self) -> None:
        """Drop every staged copy (the verify that read them is queued)."""
        for row in self._rows:
            entry = self.ledger.span(row)
            if entry is not None:
                entry.staged = None
        self._rows, self._task, self.bytes_staged = [], None, 0
        self.prefetcher.poll()  # forget finished tasks (their tensors go with them)

    def check_integrity(self) -> None:
        """Only rows this stager staged hold a copy, each of its host range, within budget."""
        for row, entry in self.ledger.rows.items():
            if entry.staged is None:
                continue
            assert row in self._rows, f"row {row} holds a staged copy no stager made"
            assert entry.staged.shape[3] <= entry.host.length, f"row {row}: staged past its host"
        assert 0 <= self.bytes_staged <= max(self.budget_bytes, 0), "staged past the budget"
        self.prefetcher.check_integrity()
