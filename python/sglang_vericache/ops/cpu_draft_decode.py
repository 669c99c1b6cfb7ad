"""Batched draft decode attention on CPU: one parallel region per layer for the whole batch.

A draft forward gives each row one query over its own compressed view (``srt/attention/draft_attention.py``).
Through torch's SDPA that is one call per row and layer, 240 at 8 rows x 30 layers, each its own
OpenMP region over only H_kv x 1 work items; between two calls the threads go to sleep
(``GOMP_SPINCOUNT=1000``, ``srt/platform.py``) and must be woken. ``csrc/draft_decode.cpp`` runs
every (row, KV head) pair of a layer in one region, reading each view where it lies::

    bodies[b]            a KIVI-packed body (``compress/kivi.KiviBlock``, or one in pool pages:
                         ``compress/kivi_pages.PagedKiviBlock``, read there), or None
    keys[b], values[b]   [H_kv, T_b, D] float32, strides [*, *, 1]  (a view of a wider buffer)
    index[b]             None, or [T_b'] int64: the columns of keys[b], values[b] read, in order
    q, out               [B, H_q, D] float32, contiguous

An indexed row is paged attention with pages of one token: a view kept as slots of SGLang's KV
pool passes the layer's slot-major buffer [S, H_kv, D] transposed (token stride H_kv * D) and its
slots, and the kernel reads those slots in place instead of attending over a gathered copy
(prefetched a few tokens ahead: a run of slots reads as fast as a contiguous view, random slots
in about 1.6x its time).

Measured on 2 AVX2 cores, 8 rows x 1.4-2k-token views x 30 layers: the SDPA loop took 100-107 ms
per forward, this kernel 50 ms (the views' bytes at ~13 GB/s: DRAM-bound).

A quantized view is read packed: its keys and values as codes (4 bits a channel at int4, with a
scale and zero per key group and channel, and per value token), the logits and the weighted sum
computed from the codes: a draft builds no full-precision copy of the body and reads about an
eighth of its bytes. One row of 6.3k int4 tokens took 1.0 ms a layer, against 16.6 ms
dequantizing it first and 0.77 ms for a float32 view of that length: on an AVX2 CPU unpacking
costs more arithmetic than the bytes it saves (``benchmark/draft_attention.py``).

Drafts are proposals: the verify over the full KV decides every committed token, so this
kernel's float32 summation order can move acceptance by a rounding, never an output. The plain
forward keeps torch's SDPA; the verify has a kernel of its own (``cpu_verify_decode.py``).

The kernel is part of the CPU attention build (``cpu_kernels.py``: compiled on first use, about
30 s, then cached). Where it cannot be built (no compiler) drafting keeps the SDPA loop and says
so once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from sglang_vericache.compress.kivi import KiviBlock
from sglang_vericache.compress.kivi_pages import PagedKiviBlock
from sglang_vericache.ops.cpu_kernels import load_cpu_kernels

PACKED_BITS = (2, 4, 8)  # the KIVI widths read packed (16 is stored unquantized)


@dataclass(frozen=True, slots=True)
class CpuDraftDecode:
    """The compiled kernel (``load_cpu_draft_decode``)."""

    module: Any

    @staticmethod
    def accepts(q: Tensor, keys: Sequence[Tensor], values: Sequence[Tensor],
                bodies: Sequence[KiviBlock | None] = (),
                index: Sequence[Tensor | None] | None = None) -> bool:  # fmt: skip
        """Whether ``__call__`` takes these: float32 on the CPU, each token's channels
        contiguous (the token stride is free: a compressed cache's buffer and a pool's slot-major
        buffer transposed both qualify), packed bodies of one format (``accepts_body``; one bit
        width and key group), each row's index None or a contiguous 1-D int64 CPU tensor (its
        bounds are checked by the call, which raises on a slot outside the view)."""
        if q.device.type != "cpu" or q.dtype != torch.float32:
            return False
        if index is not None:
            if len(index) != len(keys):
                return False
            if not all(i is None or (i.dtype == torch.int64 and i.device.type == "cpu"
                                     and i.dim() == 1 and i.is_contiguous())
                       for i in index):  # fmt: skip
                return False
        packed = [b for b in bodies if b is not None]
        if len({(b.bits, b.group) for b in packed}) > 1:
            return False
        if not all(CpuDraftDecode.accepts_body(b) for b in packed):
            return False
        return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 3
                   and t.stride(2) == 1 for t in (*keys, *values))  # fmt: skip

    @staticmethod
    def accepts_body(body: Any) -> bool:
        """Whether ``__call__`` reads ``body`` packed: a float32 KIVI block of 2, 4 or 8 bits on
        the CPU, in tensors or in pool pages (other quantized formats are dequantized by the
        caller)."""
        if isinstance(body, PagedKiviBlock):  # written out (no tail: a store writes it)
            buffers = (body.key_buffer, body.value_buffer)
            return body.tail is None and body.bits in PACKED_BITS and all(
                b.dtype == torch.float32 and b.device.type == "cpu" for b in buffers)
        return (isinstance(body, KiviBlock) and body.bits in PACKED_BITS
                and body.key_scale.dtype == torch.float32
                and body.packed_keys.device.type == "cpu")  # fmt: skip

    def __call__(self, q: Tensor, keys: Sequence[Tensor], values: Sequence[Tensor], scale: float,
                 bodies: Sequence[KiviBlock | PagedKiviBlock | None] | None = None,
                 index: Sequence[Tensor | None] | None = None) -> Tensor:  # fmt: skip
        """softmax(q_b K_b^T * scale) V_b for every row b, grouped-query heads (H_q a multiple
        of H_kv). q: [B, H_q, D]; keys[b], values[b]: [H_kv, T_b, D] (any token stride), after
        ``bodies[b]``'s tokens where it has one (``accepts_body``; all of one bit width and key
        group). Where ``index[b]`` is given ([T'] int64, slots < T_b, any order), row b's float
        tokens are keys[b][:, index[b]] and values[b][:, index[b]], read in place.
        Returns [B, H_q, D]."""
        q = q.contiguous()
        out = torch.empty_like(q)
        bodies = bodies or [None] * len(keys)
        packed = [b for b in bodies if b is not None]
        bits, group = (packed[0].bits, packed[0].group) if packed else (0, 0)
        if any((b.bits, b.group) != (bits, group) for b in packed):
            raise ValueError("CpuDraftDecode: packed bodies of one call share bits and group")
        parts = [_body_parts(b) for b in bodies]
        slots = [] if index is None else list(index)  # [] : every row dense
        self.module.draft_decode(q, list(keys), list(values), parts, slots, bits, group, out,
                                 float(scale))  # fmt: skip
        return out


def _body_parts(body: KiviBlock | PagedKiviBlock | None) -> list[Tensor]:
    """What the kernel takes for a body: nothing, its six tensors, or (pool key buffer, value
    buffer, pages) for one in pool pages."""
    if body is None:
        return []
    if isinstance(body, PagedKiviBlock):
        return [body.key_buffer, body.value_buffer, body.pages]
    return list(body.stored_tensors())


def load_cpu_draft_decode() -> CpuDraftDecode | None:
    """The draft kernel of the CPU attention build (``cpu_kernels.py``); None where it cannot
    be built."""
    module = load_cpu_kernels()
    return None if module is None else CpuDraftDecode(module)
