"""Host buffers for KV that come and go with requests, mapped straight from the OS.

A request's full KV on the host (``srt/kv/offload.py`` ``HostKV``), a host tier's chunks
(``tier/host.py``) and fetch destinations (``tier/layout.py``) are megabytes to hundreds of
megabytes each, allocated and freed as requests come and go. Through glibc's malloc, buffers
under its mmap threshold, a threshold that rises to 32 MiB once a large buffer is freed, come
from the heap, and a heap fragmented by buffers of every size keeps memory the process no
longer uses: measured with SmolLM2-sized rows of 50-2,000 tokens freed in random order, resident
memory held ~0.3 GB over the live bytes, and 0.44 GB after every buffer was freed. A private
anonymous mapping per buffer goes back to the OS the moment its tensor is freed, and its pages
cost nothing until written (a row sized for its whole output does not pay for it up front).

Pinned buffers (CUDA present) come from CUDA's caching host allocator as before.

What else a scheduler allocates (compressed KV, a finished turn's compressed prefix kept for the
next turn, activations) still comes from the heap, and glibc returns a heap's free pages to the
OS only from its top. ``IdleHeapTrim`` asks glibc to return every free page (``malloc_trim``)
once the scheduler is fully idle after work: measured on a ``--vericache`` scheduler after ten
minutes of mixed traffic, resident memory went from 3.24 to 2.83 GB.

Between those trims the heap keeps its free pages (``hold_heap_pages``). By default glibc gives
the heap's top back to the OS whenever more than twice its dynamic mmap threshold lies free
there, and a forward frees its activations layer by layer: on a ``--vericache`` scheduler
admitting 1k prompts on a short budget, each 1k-token prefill forward faulted ~188,000 fresh
pages (~750 MB zeroed by the kernel, 2.2 s of system time in 12 s against 0.4 s offload-only),
and took ~10% longer; with the top kept, none.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import time
from collections.abc import Callable
from typing import Any

import torch

# Below this a mapping's page rounding and system calls cost more than the heap's slack.
MAPPED_MIN_BYTES = 1 << 20


def host_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, *,
               pin_memory: bool = False) -> torch.Tensor:  # fmt: skip
    """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype``: pinned when asked,
    else its own private anonymous mapping when at least ``MAPPED_MIN_BYTES``, else from the
    heap. The mapping is unmapped when the tensor (and every view of it) is freed."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if pin_memory or nbytes < MAPPED_MIN_BYTES:
        return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    # frombuffer holds a reference to ``pages``: the mapping lives as long as the storage
    return torch.frombuffer(pages, dtype=dtype, count=numel).view(shape)


# glibc's mallopt parameters, and what a scheduler sets them to (``hold_heap_pages``): free
# space at the heap's top up to HEAP_KEEP_BYTES stays mapped (idle trims still return it);
# buffers under MMAP_MIN_BYTES come from the heap, the most glibc accepts (its fixed maximum)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
HEAP_KEEP_BYTES = 256 << 20
MMAP_MIN_BYTES = 32 << 20

# Fewest seconds between two trims: a trim walks every arena (milliseconds on a GB heap), and a
# bursty server that drains its queue many times a second needs it once, not each time.
TRIM_MIN_INTERVAL_S = 5.0


def _glibc(name: str, argtypes: list[Any]) -> Any:
    """Function ``name`` of this process's C library, typed to take ``argtypes`` and return an
    int; None where it has none (not loadable, or not glibc)."""
    try:  # find_library None: the process's own symbols, which include its C library's
        function = getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return function


def glibc_malloc_trim() -> Callable[[], None] | None:
    """``malloc_trim(0)`` of this process's C library; None where it has none (not glibc)."""
    trim = _glibc("malloc_trim", [ctypes.c_size_t])
    return None if trim is None else lambda: trim(0)


def hold_heap_pages() -> bool:
    """Fix this process's heap thresholds (module doc); False where it is not glibc's."""
    mallopt = _glibc("mallopt", [ctypes.c_int, ctypes.c_int])
    return mallopt is not None and bool(mallopt(M_TRIM_THRESHOLD, HEAP_KEEP_BYTES)
                                        and mallopt(M_MMAP_THRESHOLD, MMAP_MIN_BYTES))


class IdleHeapTrim:
    """Returns the heap's free pages to the OS when a scheduler goes idle after work (module
    doc). ``idle(work_done)`` is called whenever the scheduler is fully idle, with a counter of
    its work (SGLang's ``forward_ct``): it trims once per idle period that followed work, at
    most every ``min_interval_s``. Scheduler thread only."""

    def __init__(self, trim: Callable[[], None] | None = None,
                 min_interval_s: float = TRIM_MIN_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        """trim: what returns the pages (glibc's ``malloc_trim`` by default; None: nothing)."""
        self._trim = glibc_malloc_trim() if trim is None else trim
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._work_at_trim: int | None = None
        self._last = -math.inf
        self.trims = 0

    def idle(self, work_done: int) -> bool:
        """The scheduler is fully idle with ``work_done`` so far; returns whether it trimmed."""
        if self._trim is None or work_done == self._work_at_trim:
            return False
        now = self._clock()
        if now - self._last < self.min_interval_s:
            return False
        self._trim()
        self._work_at_trim, self._last = work_done, now
        self.trims += 1
        return True
