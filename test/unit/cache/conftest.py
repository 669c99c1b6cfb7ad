"""Shared harness for the cache tests: a tree, a real local slot pool, a real device slot
pool, and helpers that behave like the SGLang glue (reuse the tree's pages for the cached
prefix, free what the tree reports as duplicate or evicted) and check every invariant."""

from __future__ import annotations

from typing import Hashable, Sequence

import pytest

from sglang_vericache.cache import (
    FullState,
    InsertResult,
    LocalSlotPool,
    TieredNode,
    TieredRadixTree,
    check_slot_accounting,
)


class Harness:
    def __init__(self, page_size: int = 1, local_slots: int = 4096,
                 device_slots: int = 4096, slots_per_page: int | None = None) -> None:
        self.ps = page_size
        self.tree = TieredRadixTree(page_size)
        self.pool = LocalSlotPool(local_slots)
        self.device = LocalSlotPool(device_slots)
        self.slots_per_page = page_size if slots_per_page is None else slots_per_page
        self.device_held = 0  # device slots the "caller" holds for in-flight fetches
        self._task_ids = iter(range(1, 10**9))

    # ---- handles
    def keys(self, tokens: Sequence[int], ns: Hashable = None) -> list[tuple]:
        """Deterministic per-page tier keys: the page's whole token prefix (chained)."""
        return [(ns, tuple(tokens[: (i + 1) * self.ps])) for i in range(len(tokens) // self.ps)]

    def new_pages(self, n: int) -> list[tuple[int, ...]]:
        pages = []
        for _ in range(n):
            slots = self.pool.alloc(self.slots_per_page)
            assert slots is not None, "local pool exhausted in a test"
            pages.append(slots)
        return pages

    def task(self) -> int:
        return next(self._task_ids)

    # ---- glue-like operations
    def insert(self, tokens: Sequence[int], *, ns: Hashable = None, compressed: bool = True,
               full: bool = True, state: FullState = FullState.NONE) -> InsertResult:
        """Insert like SGLang's checkpoint: the cached compressed prefix reuses the tree's
        pages; new pages come from the pool; duplicates go back to the pool."""
        n_pages = len(tokens) // self.ps
        comp = None
        if compressed:
            m = self.tree.match(tokens, namespace=ns)
            prefix = self.tree.compressed_prefix(m)
            comp = prefix + self.new_pages(n_pages - len(prefix))
        keys = self.keys(tokens, ns) if full else None
        r = self.tree.insert(tokens, comp, keys, full_state=state, namespace=ns)
        self.pool.free(s for p in r.duplicates for s in p)
        self.check()
        return r

    def insert_stored(self, tokens: Sequence[int], ns: Hashable = None) -> InsertResult:
        """Insert and complete the write-through of everything new."""
        r = self.insert(tokens, ns=ns)
        if r.to_write:
            t = self.task()
            self.tree.begin_write(t, r.to_write)
            self.tree.finish_write(t, True)
            self.check()
        return r

    def evict(self, n: int) -> int:
        r = self.tree.evict_local(n)
        self.pool.free(s for p in r.pages for s in p)
        self.check()
        return r.num_slots

    def begin_fetch(self, nodes: Sequence[TieredNode]) -> int:
        t = self.task()
        self.tree.begin_fetch(t, nodes)
        self.check()
        return t

    def finish_fetch(self, task: int, ok: bool = True):  # type: ignore[no-untyped-def]
        n = self.tree.fetch_len(task)
        slots = self.device.alloc(n) if ok else None
        r = self.tree.finish_fetch(task, slots)
        self.device.free(r.duplicates)
        self.check()
        return r

    def release(self, nodes: Sequence[TieredNode]) -> None:
        self.device.free(self.tree.release_resident(nodes))
        self.check()

    def check(self) -> None:
        self.tree.check_integrity()
        self.pool.check_integrity()
        self.device.check_integrity()
        check_slot_accounting(self.tree, self.pool)
        assert self.device.available_size() + self.tree.resident_size() == self.device.total


@pytest.fixture
def harness() -> type[Harness]:
    return Harness


@pytest.fixture
def h() -> Harness:
    return Harness()
