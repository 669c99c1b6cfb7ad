"""``host_memory.host_empty``: a large buffer is its own mapping, returned to the OS when freed."""

from __future__ import annotations

import gc
import mmap

import torch
from sglang_vericache.host_memory import MAPPED_MIN_BYTES, host_empty


def _mapped(address: int) -> bool:
    """Whether ``address`` lies in any mapping of this process."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def test_a_large_buffer_is_a_mapping_that_goes_when_its_last_view_does() -> None:
    buf = host_empty((4, 2, 3, 4096, 64), torch.bfloat16)
    assert buf.shape == (4, 2, 3, 4096, 64) and buf.dtype == torch.bfloat16
    assert buf.is_contiguous() and buf.nbytes >= MAPPED_MIN_BYTES
    address = buf.data_ptr()
    assert address % mmap.PAGESIZE == 0 and _mapped(address)  # a mapping of its own
    view = buf[1, 0, :, 10:20]
    view.fill_(2.5)
    del buf
    gc.collect()
    assert _mapped(address), "a view keeps the mapping"
    assert float(view.sum()) == 2.5 * view.numel()
    del view
    gc.collect()
    assert not _mapped(address), "the mapping goes back to the OS with its last view"


def test_a_small_buffer_comes_from_the_heap() -> None:
    small = host_empty((3, 8), torch.float32)
    assert small.shape == (3, 8) and small.nbytes < MAPPED_MIN_BYTES


def test_the_heap_is_trimmed_once_per_idle_period_that_followed_work() -> None:
    from sglang_vericache.host_memory import IdleHeapTrim

    trims: list[float] = []
    now = [100.0]
    heap = IdleHeapTrim(trim=lambda: trims.append(now[0]), min_interval_s=5.0,
                        clock=lambda: now[0])  # fmt: skip
    assert heap.idle(work_done=7) and trims == [100.0]
    assert not heap.idle(work_done=7)  # still idle, no work since: once
    now[0] = 101.0
    assert not heap.idle(work_done=9)  # work, but too soon after the last trim
    now[0] = 106.0
    assert heap.idle(work_done=9) and trims == [100.0, 106.0] and heap.trims == 2


def test_glibc_malloc_trim_returns_free_heap_pages() -> None:
    """On this (glibc) machine: a heap left full of freed blocks shrinks when trimmed."""
    import ctypes

    from sglang_vericache.host_memory import glibc_malloc_trim

    trim = glibc_malloc_trim()
    assert trim is not None, "glibc's malloc_trim not found"
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 << 10) for _ in range(2000)]  # 125 MiB under the mmap threshold
    for p in blocks:
        ctypes.memset(p, 1, 64 << 10)
    keep = blocks[-1]  # the top block stays: glibc's own trimming cannot shrink past it
    for p in blocks[:-1]:
        libc.free(p)

    def anon() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon")) << 10

    before = anon()
    trim()
    assert before - anon() > 64 << 20
    libc.free(keep)


CHURN = """
import ctypes, ctypes.util, resource, sys
from sglang_vericache.host_memory import hold_heap_pages
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "hold":
    assert hold_heap_pages()
def forward():  # three 30 MiB activations, written, then freed together
    blocks = [libc.malloc(30 << 20) for _ in range(3)]
    for b in blocks:
        ctypes.memset(b, 1, 30 << 20)
    for b in reversed(blocks):
        libc.free(b)
forward(), forward()  # glibc's default thresholds have risen to 30 MiB by now
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    forward()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_held_heap_pages_are_reused_by_the_next_forward() -> None:
    """Forward-like rounds of allocations fault their pages afresh under glibc's default
    thresholds (90 MiB freed at the heap's top is more than twice 30 MiB: it goes back to the
    OS: measured here, ~77,000 faults in five rounds) and reuse them once ``hold_heap_pages``
    fixed them (none)."""
    import subprocess
    import sys

    faults = {how: int(subprocess.run([sys.executable, "-c", CHURN, how], check=True,
                                      capture_output=True, text=True).stdout)
              for how in ("default", "hold")}  # fmt: skip
    assert faults["default"] > 5 * 10_000 and faults["hold"] < 1_000, faults
