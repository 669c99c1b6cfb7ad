"""Drafting over a token-dropped cache: paged decode over the kept tokens' pages.

The kept tokens of each request (original positions, post-RoPE keys) live in full-precision
pages; the batch is described in FlashInfer's CSR form. On CUDA with FlashInfer installed this
uses ``flashinfer.BatchDecodeWithPagedKVCacheWrapper`` (plan once per batch, run per layer);
the torch path (gather + float32 attention) behind the same plan/run interface is the reference
it is checked against.

Page layout (FlashInfer "NHD"): k_pages, v_pages: [num_pages, P, H_kv, D] in the KV dtype.
SGLang's token pool is that layout with pages of one token (``[slots, H_kv, D]``, unsqueezed):
drafting on a GPU decodes over its draft rows there (``paged_draft_decoder``,
``srt/attention/draft_attention.py``).
"""

from __future__ import annotations

import abc
import importlib
import importlib.util
import logging
import math
from dataclasses import dataclass

import torch

from sglang_vericache.ops.reference import paged_decode_reference

logger = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's advised decode workspace


@dataclass(frozen=True, slots=True)
class PagedDecodeGeometry:
    """Head layout and page size shared by every layer of the drafting model."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if min(self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size) < 1:
            raise ValueError("geometry fields must be positive")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError("num_q_heads must be a multiple of num_kv_heads")


class DroppedKVDecoder(abc.ABC):
    """Contract: plan() once per batch (host work, may synchronise; not graph-capturable), then
    run() once per layer with that layer's pages; run() never changes the plan or the pages."""

    @abc.abstractmethod
    def plan(self, kv_indptr: torch.Tensor, kv_page_indices: torch.Tensor,
             kv_last_page_len: torch.Tensor, geometry: PagedDecodeGeometry,
             sm_scale: float | None = None) -> None:
        """kv_indptr: [B+1] int32; kv_page_indices: [nnz] int32; kv_last_page_len: [B] int32 in
        1..P (every request has at least one page)."""

    @abc.abstractmethod
    def run(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        """q: [B, H_q, D]; k_pages, v_pages: [num_pages, P, H_kv, D].
        Returns [B, H_q, D] in q.dtype."""


class TorchDroppedKVDecoder(DroppedKVDecoder):
    """Pure torch path (CPU, or CUDA without FlashInfer): gather kept pages, float32 attention."""

    def __init__(self) -> None:
        self._meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._scale = 1.0

    def plan(self, kv_indptr: torch.Tensor, kv_page_indices: torch.Tensor,
             kv_last_page_len: torch.Tensor, geometry: PagedDecodeGeometry,
             sm_scale: float | None = None) -> None:
        indptr = kv_indptr.cpu()
        if bool((indptr[1:] <= indptr[:-1]).any()):
            raise ValueError("every request needs at least one kept page")
        last = kv_last_page_len.cpu()
        if bool(((last < 1) | (last > geometry.page_size)).any()):
            raise ValueError(f"kv_last_page_len must be in 1..{geometry.page_size}")
        self._meta = (indptr, kv_page_indices.cpu(), last)
        self._scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(geometry.head_dim)

    def run(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        if self._meta is None:
            raise RuntimeError("run() before plan()")
        return paged_decode_reference(q, k_pages, v_pages, *self._meta, sm_scale=self._scale)


class FlashInferDroppedKVDecoder(DroppedKVDecoder):
    """FlashInfer's batch paged decode. workspace: caller-owned [>= 128 MiB] uint8 on CUDA."""

    def __init__(self, workspace: torch.Tensor) -> None:
        flashinfer = importlib.import_module("flashinfer")
        self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")

    def plan(self, kv_indptr: torch.Tensor, kv_page_indices: torch.Tensor,
             kv_last_page_len: torch.Tensor, geometry: PagedDecodeGeometry,
             sm_scale: float | None = None) -> None:
        self._wrapper.plan(
            kv_indptr, kv_page_indices, kv_last_page_len, geometry.num_q_heads,
            geometry.num_kv_heads, geometry.head_dim, geometry.page_size,
            q_data_type=geometry.dtype, kv_data_type=geometry.dtype, sm_scale=sm_scale,
        )

    def run(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        return self._wrapper.run(q, (k_pages, v_pages))


def flashinfer_usable(device: torch.device) -> bool:
    """True when `device` is CUDA, CUDA is available and the flashinfer package is installed."""
    return (device.type == "cuda" and torch.cuda.is_available()
            and importlib.util.find_spec("flashinfer") is not None)


def agrees_with_reference(decoder: DroppedKVDecoder, geometry: PagedDecodeGeometry,
                          device: torch.device, seed: int = 0) -> bool:  # fmt: skip
    """Whether ``decoder`` decodes a small random batch (3 rows of 1-17 scattered pages, last
    pages part full) as the float32 reference does, within the dtype's rounding."""
    g = torch.Generator().manual_seed(seed)
    p, h_kv, d = geometry.page_size, geometry.num_kv_heads, geometry.head_dim
    k_pages, v_pages = (torch.randn(64, p, h_kv, d, generator=g).to(device, geometry.dtype)
                        for _ in range(2))  # fmt: skip
    q = torch.randn(3, geometry.num_q_heads, d, generator=g).to(device, geometry.dtype)
    indptr = torch.tensor([0, 5, 22, 23], dtype=torch.int32, device=device)
    indices = torch.randperm(64, generator=g)[:23].to(device, torch.int32)
    last = torch.tensor([p, max(p // 2, 1), 1], dtype=torch.int32, device=device)
    outs = []
    for candidate in (decoder, TorchDroppedKVDecoder()):
        candidate.plan(indptr, indices, last, geometry)
        outs.append(candidate.run(q, k_pages, v_pages).float())
    got, want = outs
    tol = 1e-4 if geometry.dtype == torch.float32 else 2e-2
    return bool(torch.allclose(got, want, rtol=tol, atol=tol))


def paged_draft_decoder(device: torch.device,
                        geometry: PagedDecodeGeometry) -> DroppedKVDecoder | None:  # fmt: skip
    """The paged decoder drafts use on ``device``: FlashInfer's where it is usable there and
    agrees with the reference on a check run once, here (start-up); None elsewhere, the reason
    logged (a CPU drafts with its own kernel, ``ops/cpu_draft_decode.py``; otherwise one SDPA
    call per row serves)."""
    if not flashinfer_usable(device):
        return None
    try:
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        decoder = FlashInferDroppedKVDecoder(workspace)
        if agrees_with_reference(decoder, geometry, device):
            return decoder
        logger.warning("FlashInfer's paged decode disagrees with the reference for %s; drafts "
                       "attend with one SDPA call per row", geometry)  # fmt: skip
    except Exception as exc:  # a JIT build that fails, an unsupported head layout
        logger.warning("FlashInfer's paged decode unavailable for %s (%s: %s); drafts attend "
                       "with one SDPA call per row", geometry, type(exc).__name__, exc)  # fmt: skip
    return None
