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
"""

from __future__ import annotations

import math
import mmap

import torch

# Below this a mapping's page rounding and system calls cost more than the heap's slack.
MAPPED_MIN_BYTES = 1 << 20


def host_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, *,
               pin_memory: bool = False) -> torch.Tensor:  # fmt: skip
    """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype``: pinned when asked,
    else its own private anonymous mapping when at least ``MAPPED_MIN_BYTES``, else from the
    heap. The mapping is unmapped when the tensor (and every view of it) is freed."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if pin_memory or nbytes < MAPPED_MIN_BYTES:
        return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    # frombuffer holds a reference to ``pages``: the mapping lives as long as the storage
    return torch.frombuffer(pages, dtype=dtype, count=numel).view(shape)
