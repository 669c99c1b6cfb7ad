"""Batched verify attention on CPU: every row's verify queries over its full KV in one call.

A verify gives row b n_b = 1 + drafts queries at positions base .. base + n_b - 1, each over
the row's full KV through its own position (``srt/attention/backend.py``). Through torch's
SDPA that is one call per row and layer, each an OpenMP region over only H_kv work items (3 for
SmolLM2: one of two threads idles a third of the time), a bool mask per call, and torch's
general GEMM over 18 x 64 query blocks. ``csrc/verify_decode.cpp`` runs every (row, KV head,
chunk of keys) of a layer in one region, reads each key and value once for all G * n_b queries
of its head group, and computes in float32 with AVX2 (an online softmax over blocks of 64 keys, a
vectorized exp within 2 ulp of ``std::exp``). The queries are ragged, as the verify forward
computes them (a row drafting less than the batch's width has fewer: no padding to spread in or
gather out per layer)::

    q, out               [sum n_b, H_q, D] float32, contiguous; row b's queries follow row b - 1's,
                         its query i at T_b - n_b + i
    keys[b], values[b]   [H_kv, T_b, D] float32, strides [*, *, 1]: the host buffer in place

Measured on 2 AVX2 cores, 6 queries a row over 6.3k keys (SmolLM2's 9/3 heads, D 64): 1.00 ms
a row and layer at 8 rows against 1.56 ms for the SDPA loop; 0.97 against 1.21 ms at one row
(its keys in chunks); 0.29 against 0.46 ms at 8 rows of 2k keys
(``benchmark/verify_attention.py``).

The verify decides every committed token, so its numerics are the output's: float32 throughout,
as SDPA's, with a different summation order (outputs within ~3e-7 of SDPA's here, the size of
the difference between SDPA's own grouped and per-head calls, which plain SGLang's decode is).
The exactness tests and sweeps compare the served tokens with plain SGLang's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from sglang_vericache.ops.cpu_kernels import load_cpu_kernels

# Work items a call aims for per thread: a small batch splits each row's keys into chunks so no
# thread idles (a row's chunks are merged after the region).
ITEMS_PER_THREAD = 4


@dataclass(frozen=True, slots=True)
class CpuVerifyDecode:
    """The compiled kernel (``load_cpu_verify_decode``)."""

    module: Any

    @staticmethod
    def accepts(q: Tensor, keys: Sequence[Tensor], values: Sequence[Tensor],
                counts: Sequence[int]) -> bool:  # fmt: skip
        """Whether ``__call__`` takes these: float32 on the CPU, each token's channels
        contiguous, every row at least as long as its queries."""
        if q.device.type != "cpu" or q.dtype != torch.float32 or q.dim() != 3:
            return False
        return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 3
                   and t.stride(2) == 1 and t.shape[1] >= n
                   for n, k, v in zip(counts, keys, values) for t in (k, v))  # fmt: skip

    def __call__(self, q: Tensor, keys: Sequence[Tensor], values: Sequence[Tensor],
                 scale: float, counts: Sequence[int]) -> Tensor:  # fmt: skip
        """softmax(q K^T * scale + causal) V per row, grouped-query heads (H_q a multiple of
        H_kv). q: [sum(counts), H_q, D], row b's ``counts[b]`` queries after row b - 1's, its
        query i at position T_b - counts[b] + i seeing keys 0 .. T_b - counts[b] + i;
        keys[b], values[b]: [H_kv, T_b, D]. Returns [sum(counts), H_q, D]."""
        q = q.contiguous()
        out = torch.empty_like(q)
        items = len(keys) * max(1, keys[0].shape[0]) if len(keys) else 1
        chunks = max(1, math.ceil(ITEMS_PER_THREAD * torch.get_num_threads() / items))
        self.module.verify_decode(q, list(keys), list(values), out, float(scale), chunks,
                                  [int(n) for n in counts])  # fmt: skip
        return out


def load_cpu_verify_decode() -> CpuVerifyDecode | None:
    """The verify kernel of the CPU attention build (``cpu_kernels.py``); None where it cannot
    be built."""
    module = load_cpu_kernels()
    return None if module is None else CpuVerifyDecode(module)
