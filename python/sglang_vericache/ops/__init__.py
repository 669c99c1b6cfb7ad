"""Attention ops over compressed KV: the CPU kernels, the GPU decoders and their torch references
(no sglang imports).

- cpu_kernels.py       the CPU attention kernels' build (C++ in csrc/, built on first use)
- cpu_draft_decode.py  batched draft attention on CPU (KIVI bodies read packed)
- cpu_verify_decode.py batched verify attention on CPU
- dropped_decode.py    GPU drafting over draft rows' slots (pages of one token): FlashInfer
- pool_kivi_decode.py  GPU drafting over draft rows with KIVI bodies in their pool pages: Triton
                       (triton/, imported lazily: Triton is optional on CPU)
- reference.py         float32 torch references the GPU decoders are checked against
- prefetch.py          FullKVPrefetcher: async pinned host -> device full-KV copies (submit/poll),
                       device_copy_pairs: a strided host view in a few contiguous copies
"""

from sglang_vericache.ops.dropped_decode import (
    DroppedKVDecoder,
    PagedDecodeGeometry,
    paged_draft_decoder,
)
from sglang_vericache.ops.pool_kivi_decode import PoolKiviDecode, pool_kivi_decoder
from sglang_vericache.ops.prefetch import FullKVPrefetcher

__all__ = [
    "DroppedKVDecoder",
    "FullKVPrefetcher",
    "PagedDecodeGeometry",
    "PoolKiviDecode",
    "paged_draft_decoder",
    "pool_kivi_decoder",
]
