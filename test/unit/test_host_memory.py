"""``host_memory.host_empty``: a large buffer is its own mapping, returned to the OS when freed."""

from __future__ import annotations

import gc

import torch
from sglang_vericache.host_memory import MAPPED_MIN_BYTES, host_empty


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_a_large_buffer_is_a_mapping_that_goes_when_its_last_view_does() -> None:
    before = _mappings()
    buf = host_empty((4, 2, 3, 4096, 64), torch.bfloat16)
    assert buf.shape == (4, 2, 3, 4096, 64) and buf.dtype == torch.bfloat16
    assert buf.is_contiguous() and buf.nbytes >= MAPPED_MIN_BYTES
    assert _mappings() == before + 1
    view = buf[1, 0, :, 10:20]
    view.fill_(2.5)
    del buf
    gc.collect()
    assert _mappings() == before + 1, "a view keeps the mapping"
    assert float(view.sum()) == 2.5 * view.numel()
    del view
    gc.collect()
    assert _mappings() == before


def test_a_small_buffer_comes_from_the_heap() -> None:
    before = _mappings()
    small = host_empty((3, 8), torch.float32)
    assert small.shape == (3, 8) and _mappings() == before
