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
