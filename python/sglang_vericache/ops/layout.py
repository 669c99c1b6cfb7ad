"""Paged layout of a quantized (KIVI-style) KV cache, one layer, as the decode kernels read it.

Shared format (team CONTEXT, also implemented by ``compress/``): asymmetric quantization with
``b`` in {2, 4} bits, ``x ~= code * scale + zero``; keys per CHANNEL over groups of G tokens,
values per TOKEN over all D channels; codes packed along the channel dim, element ``j`` of a row
goes to byte ``j // (8 // b)`` at bit offset ``(j % (8 // b)) * b`` (little end first).

Here the key group IS the page: G == P, so every page carries one key scale/zero per channel.

::

    global page pool (shared by all requests of a layer)
    page p ─┬─ k_packed[p, h] : P rows x D*b/8 bytes  (row = token, bytes along channels)
            ├─ k_scale [p, h] : D      (per channel, over this page's P tokens)
            ├─ k_zero  [p, h] : D
            ├─ v_packed[p, h] : D*b/8 rows x P bytes  (BYTE-MAJOR: row j = byte j of each token)
            ├─ v_scale [p, h] : P      (per token, over all D channels)
            └─ v_zero  [p, h] : P

    batch metadata, CSR like FlashInfer's paged KV:
      kv_indptr        [B+1]  request b owns kv_page_indices[kv_indptr[b] : kv_indptr[b+1]]
      kv_page_indices  [nnz]  page ids into the pool, in token order
      kv_last_page_len [B]    valid tokens in b's last page (1..P); pages before it are full

    request b:  | page 7 | page 2 | page 9 (last, 5 of P valid) |  + window slot 3, 11 tokens
                '------------ quantized, oldest --------------'   '--- full precision, newest ---'

    recent window (full precision, per request SLOT, caller-owned, persistent across steps):
      window_keys/values [num_slots, H_kv, R_max, D]; request b reads slot window_slot[b],
      its first window_len[b] rows (0..R_max). A slot-indexed buffer (like SGLang's
      req_to_token pool) lets the caller append one token per step in place, without
      re-gathering a [B, ...] tensor whenever the batch changes.

Physical page layout (what the kernels read; the logical format above is unchanged):
  k_packed[p, h, t, j]  byte j of token t's packed key row: token-major, as the format packs it.
  v_packed[p, h, j, t]  the same byte of token t's packed VALUE row, stored transposed
                        (byte-major): the 32 tokens of one byte column are contiguous.
Why: in the kernel, keys are the B operand of q @ K^T (reduction over channels = bytes of a
row, contiguous as stored) and values the B operand of p @ V (reduction over tokens). Stored
token-major, a value tile reaches the tensor-core operand only through shared memory one byte
at a time (LDS.U8, ~64 per page per warp in SASS); stored byte-major, the reduction dim is
contiguous and the bytes go from global memory straight into operand registers (page loop 1307
-> 1204 instructions per page at 1 warp, registers 210 -> 197; kernels/sass_stats.py, sm_90a).
The transposition is a storage detail of one page: pack with ``quant_pack.values_byte_major``.

Attention in decode has no position-dependent mask, so the order of quantized pages and window
tokens does not matter to the result; keys are stored post-RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (2, 4)
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def codes_per_byte(bits: int) -> int:
    """How many b-bit codes one uint8 holds (4 for int2, 2 for int4)."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    return 8 // bits


@dataclass(frozen=True, slots=True)
class QuantPagedKVCache:
    """One layer's quantized page pool (caller-owned; kernels only read it).

    k_packed: [num_pages, H_kv, P, D * bits // 8] uint8, key codes packed along channels.
    k_scale:  [num_pages, H_kv, D] kv dtype, per-channel key scale over the page's tokens.
    k_zero:   [num_pages, H_kv, D] kv dtype, per-channel key zero point (the group minimum).
    v_packed: [num_pages, H_kv, D * bits // 8, P] uint8, value codes packed along channels,
              stored byte-major: v_packed[p, h, j, t] = byte j of token t's packed row.
    v_scale:  [num_pages, H_kv, P] kv dtype, per-token value scale.
    v_zero:   [num_pages, H_kv, P] kv dtype, per-token value zero point.
    bits:     2 or 4.
    """

    k_packed: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_packed: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    bits: int

    def __post_init__(self) -> None:
        per_byte = codes_per_byte(self.bits)
        if self.k_packed.dim() != 4 or self.k_packed.dtype != torch.uint8:
            raise ValueError("k_packed must be [num_pages, H_kv, P, D*bits/8] uint8")
        num_pages, heads, page, width = self.k_packed.shape
        if (tuple(self.v_packed.shape) != (num_pages, heads, width, page)
                or self.v_packed.dtype != torch.uint8):
            raise ValueError("v_packed must be [num_pages, H_kv, D*bits/8, P] uint8 (byte-major)")
        dim = self.head_dim
        if self.k_packed.shape[3] * per_byte != dim:
            raise ValueError("packed width disagrees with head_dim")
        expected = {"k_scale": (num_pages, heads, dim), "k_zero": (num_pages, heads, dim),
                    "v_scale": (num_pages, heads, page), "v_zero": (num_pages, heads, page)}
        for name, shape in expected.items():
            tensor = getattr(self, name)
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{name} must be {list(shape)}, got {list(tensor.shape)}")
            if tensor.dtype != self.k_scale.dtype:
                raise ValueError("scales and zeros must share one dtype (the KV dtype)")
        if self.k_scale.dtype not in KV_DTYPES:
            raise ValueError(f"scale dtype must be one of {KV_DTYPES}")
        for name in ("k_packed", "k_scale", "k_zero", "v_packed", "v_scale", "v_zero"):
            tensor = getattr(self, name)
            if not tensor.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
            if tensor.device != self.k_packed.device:
                raise ValueError("all pool tensors must live on one device")

    @property
    def num_pages(self) -> int:
        return int(self.k_packed.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.k_packed.shape[1])

    @property
    def page_size(self) -> int:
        return int(self.k_packed.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.k_scale.shape[2])

    @property
    def dtype(self) -> torch.dtype:
        """The KV dtype (of scales, zeros, the recent window and the attention output)."""
        return self.k_scale.dtype


@dataclass(frozen=True, slots=True)
class RecentWindowKV:
    """One layer's full-precision recent-window buffers, indexed by request slot.

    keys:   [num_slots, H_kv, R_max, D] kv dtype (post-RoPE).
    values: [num_slots, H_kv, R_max, D] kv dtype.
    """

    keys: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        if self.keys.dim() != 4 or self.keys.shape != self.values.shape:
            raise ValueError("window keys/values must both be [num_slots, H_kv, R_max, D]")
        if self.keys.dtype != self.values.dtype or self.keys.dtype not in KV_DTYPES:
            raise ValueError("window keys/values must share a float KV dtype")
        if not (self.keys.is_contiguous() and self.values.is_contiguous()):
            raise ValueError("window keys/values must be contiguous")

    @property
    def capacity(self) -> int:
        """R_max: the most window tokens one slot holds."""
        return int(self.keys.shape[2])


@dataclass(frozen=True, slots=True)
class QuantPagedBatch:
    """Per-batch metadata (CSR page table + window index), as built by the scheduler.

    kv_indptr:        [B + 1] int32, nondecreasing, kv_indptr[0] == 0.
    kv_page_indices:  [nnz] int32, page ids into the pool.
    kv_last_page_len: [B] int32, valid tokens of each request's last page, in 1..P (ignored for
                      a request with no quantized pages).
    window_slot:      [B] int32, each request's row in RecentWindowKV.
    window_len:       [B] int32, valid window tokens per request, in 0..R_max.
    """

    kv_indptr: torch.Tensor
    kv_page_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    window_slot: torch.Tensor
    window_len: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("kv_indptr", "kv_page_indices", "kv_last_page_len", "window_slot",
                     "window_len"):
            tensor = getattr(self, name)
            if tensor.dtype != torch.int32 or tensor.dim() != 1:
                raise ValueError(f"{name} must be a 1-D int32 tensor")
        batch = self.batch_size
        for name in ("kv_last_page_len", "window_slot", "window_len"):
            if getattr(self, name).shape[0] != batch:
                raise ValueError(f"{name} must have B={batch} entries")

    @property
    def batch_size(self) -> int:
        return int(self.kv_indptr.shape[0]) - 1

    def validate(self, page_size: int, num_pages: int, window_capacity: int,
                 num_slots: int) -> None:
        """Check the metadata against a pool (reads tensors to the host: call once per plan)."""
        indptr = self.kv_indptr.cpu()
        last = self.kv_last_page_len.cpu()
        wlen = self.window_len.cpu()
        slots = self.window_slot.cpu()
        pages = self.kv_page_indices.cpu()
        if int(indptr[0]) != 0 or bool((indptr[1:] < indptr[:-1]).any()):
            raise ValueError("kv_indptr must start at 0 and be nondecreasing")
        if int(indptr[-1]) > pages.shape[0]:
            raise ValueError("kv_indptr[-1] exceeds len(kv_page_indices)")
        used = pages[: int(indptr[-1])]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
            raise ValueError("kv_page_indices out of the pool's range")
        counts = indptr[1:] - indptr[:-1]
        has_pages = counts > 0
        if bool(((last < 1) | (last > page_size))[has_pages].any()):
            raise ValueError(f"kv_last_page_len must be in 1..{page_size}")
        if bool(((wlen < 0) | (wlen > window_capacity)).any()):
            raise ValueError(f"window_len must be in 0..{window_capacity}")
        if bool(((slots < 0) | (slots >= num_slots)).any()):
            raise ValueError("window_slot out of range")
        if bool(((~has_pages) & (wlen == 0)).any()):
            raise ValueError("every request needs at least one token (page or window)")

    def num_tokens(self, page_size: int) -> torch.Tensor:
        """[B] int64 on the host: quantized plus window tokens per request."""
        indptr = self.kv_indptr.cpu().long()
        counts = indptr[1:] - indptr[:-1]
        last = self.kv_last_page_len.cpu().long()
        quant = torch.where(counts > 0, (counts - 1) * page_size + last, torch.zeros_like(counts))
        return quant + self.window_len.cpu().long()
