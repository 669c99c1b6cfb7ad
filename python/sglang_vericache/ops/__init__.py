"""Attention ops over compressed KV: torch references and Triton kernels (no sglang imports).

- layout.py          paged quantized KV layout (ASCII diagram) and its metadata dataclasses
- quant_pack.py      KIVI quantize/pack/unpack/dequantize; page a dense batch
- reference.py       float32 torch references (ground truth and CPU path)
- quant_decode.py    plan/run wrapper: Triton split-K decode over quantized pages + window
- triton/            the Triton kernels (imported lazily; Triton is optional on CPU)
- dropped_decode.py  drafting over kept-token pages (a pool's draft rows): FlashInfer on CUDA,
                     checked against its torch reference
- prefetch.py        FullKVPrefetcher: async pinned host -> device full-KV copies (submit/poll),
                     device_copy_pairs: a strided host view in a few contiguous copies
- cpu_kernels.py     the CPU attention kernels' build (C++ in csrc/, built on first use)
- cpu_draft_decode.py  batched draft attention on CPU
- cpu_verify_decode.py batched verify attention on CPU
"""

from sglang_vericache.ops.dropped_decode import (
    DroppedKVDecoder,
    PagedDecodeGeometry,
    paged_draft_decoder,
)
from sglang_vericache.ops.layout import QuantPagedBatch, QuantPagedKVCache, RecentWindowKV
from sglang_vericache.ops.prefetch import FullKVPrefetcher
from sglang_vericache.ops.quant_decode import (
    DecodeBackend,
    QuantDecodeLaunch,
    QuantDecodeWorkspace,
    QuantPagedDecodeWrapper,
)
from sglang_vericache.ops.quant_pack import build_quant_paged_batch

__all__ = [
    "DecodeBackend",
    "DroppedKVDecoder",
    "FullKVPrefetcher",
    "PagedDecodeGeometry",
    "QuantDecodeLaunch",
    "QuantDecodeWorkspace",
    "QuantPagedBatch",
    "QuantPagedDecodeWrapper",
    "QuantPagedKVCache",
    "RecentWindowKV",
    "build_quant_paged_batch",
    "paged_draft_decoder",
]
