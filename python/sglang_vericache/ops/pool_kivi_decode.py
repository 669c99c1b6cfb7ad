"""Draft attention over draft rows in a GPU's KV pool, KIVI bodies read packed: plan once per
draft forward, run once per layer.

Where pressure moved a drafted request's full KV to host memory, its compressed KV is its draft
row (``srt/kv/draft_rows.py``): a KIVI body in pages of pool slots (``compress/kivi_pages.py``),
then full-precision columns in single slots, then this step's draft chain. FlashInfer's paged
decode reads a batch of rows without a body (``ops/dropped_decode.py``); this reads a batch
with bodies, codes and all, where they lie (``ops/triton/pool_kivi_decode.py``), instead of
dequantizing each row's body into a copy for one SDPA call per row. A row without a body is a
row with no pages, so one plan serves any batch of rows in the pool::

    page_indptr   0 | p_0 | p_0 + p_1 | ...      p_i = row i's body pages (PER_GROUP a key group)
    col_indptr    0 | n_0 | n_0 + n_1 | ...      n_i = its float columns + its chain
    pages, col_slots                             int64 pool slots, row after row

The kernel splits each row's units (key groups, then blocks of float slots) over enough
programs to fill the device and writes a partial output and log-sum-exp per split, merged here
(caller-owned plan buffers, reused by every layer of the forward).

Drafts only propose: the verify recomputes every committed token over the full KV, so this
kernel's rounding can move acceptance, never an output. On a CPU the C++ kernel serves
(``ops/cpu_draft_decode.py``); Triton's interpreter runs this one on CPU tensors for the tests.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from sglang_vericache.compress.kivi_pages import KiviPageLayout, PagedKiviBlock
from sglang_vericache.ops.dropped_decode import PagedDecodeGeometry
from sglang_vericache.ops.reference import pool_kivi_decode_reference

logger = logging.getLogger(__name__)

LOG2E = 1.4426950408889634
BLOCK_N = 32  # float slots a unit
MIN_DOT = 16  # tl.dot needs every dimension >= 16
PROGRAMS_PER_SM = 4
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _pow2_at_least_16(n: int) -> bool:
    return n >= MIN_DOT and n & (n - 1) == 0


@dataclass(slots=True)
class PoolKiviPlan:
    """One draft forward's batch, on the device (see module doc). ``layout``: the bodies' page
    layout (one bit width and key group per batch); ``dot``: ``_dot_dtype`` of the pool's.
    part_o [B, H_q, splits, D] / part_lse [B, H_q, splits] float32: the splits' results."""

    col_indptr: Tensor
    col_slots: Tensor
    page_indptr: Tensor
    pages: Tensor
    layout: KiviPageLayout
    splits: int
    dot: object  # the kernel's dot operand dtype (a triton.language dtype)
    part_o: Tensor
    part_lse: Tensor


class PoolKiviDecode:
    """The Triton kernel behind ``plan`` / ``run``. Contract: ``plan`` once per draft forward
    (host work: builds the CSR tensors and the split buffers, uploads them); ``run`` once per
    layer with that layer's pool buffers; ``run`` changes neither the plan nor the pool."""

    def __init__(self, device: torch.device) -> None:
        from sglang_vericache.ops.triton import pool_kivi_decode as kernels

        if device.type != "cuda" and not kernels.kernel_is_interpreted():
            raise ValueError(f"PoolKiviDecode runs on CUDA (or Triton's interpreter), not {device}")
        self.device, self._kernels, self.plan_ = device, kernels, None
        self._interpreted = kernels.kernel_is_interpreted()

    @staticmethod
    def accepts(key_buffer: Tensor, num_q_heads: int) -> bool:
        """Whether the kernel reads a pool of this buffer ([S, H_kv, D]) for ``num_q_heads``
        query heads: a float KV dtype, D a power of two >= 16, whole query groups."""
        _, heads, dim = key_buffer.shape
        return (key_buffer.dtype in KV_DTYPES and _pow2_at_least_16(dim)
                and key_buffer.is_contiguous() and num_q_heads % heads == 0)  # fmt: skip

    @staticmethod
    def accepts_body(body: object, key_buffer: Tensor) -> bool:
        """Whether ``body`` is read packed: a KIVI body written in pages of this layer's pool
        buffers (no unwritten tail), its key group a power of two >= 16."""
        return (isinstance(body, PagedKiviBlock) and body.in_pool
                and body.key_buffer is key_buffer and _pow2_at_least_16(body.group))  # fmt: skip

    def plan(self, columns: Sequence[Tensor], bodies: Sequence[PagedKiviBlock | None],
             key_buffer: Tensor, num_q_heads: int, splits: int | None = None) -> None:  # fmt: skip
        """Row i reads ``bodies[i]``'s pages (None: no body), then the pool slots ``columns[i]``
        ([n_i] int64, n_i >= 1: its view's float columns, then its chain), of a pool whose
        layers' buffers are shaped as ``key_buffer`` ([S, H_kv, D]). Every body shares one page
        layout. ``splits`` None: enough programs to fill the device."""
        layouts = {b.layout for b in bodies if b is not None}
        if len(layouts) > 1:
            raise ValueError(f"PoolKiviDecode: one page layout a batch, got {layouts}")
        if any(int(c.numel()) == 0 for c in columns):
            raise ValueError("PoolKiviDecode: every row reads at least one float slot (its chain)")
        _, heads, dim = key_buffer.shape
        # a batch without a body never enters the group loop: any layout compiles it
        layout = next(iter(layouts), KiviPageLayout(heads, dim, 4, 32, key_buffer.dtype))
        pages = [torch.empty(0, dtype=torch.int64) if b is None else b.pages for b in bodies]
        rows = len(columns)
        units = max(int(p.numel()) // layout.slots_per_group + -(-int(c.numel()) // BLOCK_N)
                    for p, c in zip(pages, columns))  # fmt: skip
        if splits is None:
            programs = PROGRAMS_PER_SM * _multiprocessors(self.device)
            splits = min(units, max(1, -(-programs // (rows * heads))))
        col_indptr, col_slots = self._csr(columns)
        page_indptr, flat_pages = self._csr(pages)
        part_o = torch.empty(rows, num_q_heads, splits, dim, dtype=torch.float32,
                             device=self.device)  # fmt: skip
        part_lse = torch.empty(rows, num_q_heads, splits, dtype=torch.float32, device=self.device)
        self.plan_ = PoolKiviPlan(col_indptr, col_slots, page_indptr, flat_pages, layout, splits,
                                  self._dot_dtype(key_buffer.dtype), part_o, part_lse)  # fmt: skip

    def _csr(self, parts: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """([len + 1] int32 offsets, [total] int64 concatenation) of ``parts``, on the device."""
        lens = torch.tensor([0, *(int(p.numel()) for p in parts)], dtype=torch.int64)
        flat = torch.cat([p.to("cpu", torch.int64) for p in parts])
        return lens.cumsum(0).to(self.device, torch.int32), flat.to(self.device)

    def _dot_dtype(self, dtype: torch.dtype):
        """The kernel's dot operands: the KV dtype, float32 under the interpreter (its 16-bit
        dots are wrong; the 16-bit loads and roundings stay as on a GPU)."""
        import triton.language as tl

        if dtype == torch.float32 or self._interpreted:
            return tl.float32
        return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]

    def run(self, q: Tensor, key_buffer: Tensor, value_buffer: Tensor, scale: float) -> Tensor:
        """softmax(q K^T * scale) V per row over its planned body and slots of this layer.
        q: [B, H_q, D]; key_buffer / value_buffer: the layer's pool buffers [S, H_kv, D] (the
        bodies' own). Returns [B, H_q, D] in q's dtype."""
        plan = self.plan_
        if plan is None:
            raise RuntimeError("PoolKiviDecode.run before plan")
        rows, heads_q, dim = q.shape
        heads, layout = key_buffer.shape[1], plan.layout
        group_q = heads_q // heads
        self._kernels.pool_kivi_decode_kernel[(rows, heads, plan.splits)](
            q.contiguous(), key_buffer, value_buffer,
            key_buffer.view(torch.uint8), value_buffer.view(torch.uint8),
            plan.col_indptr, plan.col_slots, plan.page_indptr, plan.pages,
            plan.part_o, plan.part_lse, float(scale) * LOG2E,
            H=heads, GQ=group_q, BLOCK_G=max(MIN_DOT, 1 << (group_q - 1).bit_length()), D=dim,
            BITS=layout.bits, GROUP=layout.group, PER_GROUP=layout.slots_per_group,
            CODE_SLOTS=layout.code_slots, BLOCK_N=BLOCK_N, DOT=plan.dot,
        )  # fmt: skip
        weights = torch.exp2(plan.part_lse - plan.part_lse.amax(-1, keepdim=True))
        out = (plan.part_o * weights[..., None]).sum(-2) / weights.sum(-1)[..., None]
        return out.to(q.dtype)


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter: splits only matter for coverage


def agrees_with_reference(decoder: PoolKiviDecode, geometry: PagedDecodeGeometry,
                          seed: int = 0) -> bool:  # fmt: skip
    """Whether ``decoder`` decodes a small random batch of ``geometry`` (rows with int4 and
    int2 bodies of scattered pages and one without, 1-40 float slots) as the reference
    (``pool_kivi_decode_reference``) does, within the KV dtype's rounding."""
    from sglang_vericache.compress.kivi import Kivi

    g = torch.Generator().manual_seed(seed)
    heads, dim, dtype = geometry.num_kv_heads, geometry.head_dim, geometry.dtype
    device = decoder.device
    k_buf, v_buf = (torch.randn(512, heads, dim, generator=g).to(device, dtype) for _ in range(2))
    free = iter((torch.randperm(511, generator=g) + 1).tolist())
    take = lambda n: torch.tensor([next(free) for _ in range(n)], dtype=torch.int64)  # noqa: E731
    out = []
    for bits in (4, 2):
        columns, bodies = [take(40), take(1), take(7)], []
        for tokens in (64, 32, 0):
            if not tokens:
                bodies.append(None)
                continue
            keys, values = (torch.randn(2, heads, tokens, dim, generator=g) * 3).to(device, dtype)
            block = Kivi(bits=bits, group=32).quantize(keys, values)
            bodies.append(PagedKiviBlock.write(
                block, k_buf, v_buf, take(KiviPageLayout.of(block).pages_for(tokens))))
        q = torch.randn(3, geometry.num_q_heads, dim, generator=g).to(device, dtype)
        decoder.plan(columns, bodies, k_buf, geometry.num_q_heads)
        got = decoder.run(q, k_buf, v_buf, dim**-0.5).float()
        want = pool_kivi_decode_reference(q, k_buf, v_buf, columns, bodies, dim**-0.5).float()
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        out.append(bool(torch.allclose(got, want, rtol=tol, atol=tol)))
    return all(out)


def pool_kivi_decoder(device: torch.device, geometry: PagedDecodeGeometry) -> PoolKiviDecode | None:
    """The Triton decoder drafts use over the pool on ``device``: on CUDA with Triton, where
    ``geometry`` fits it (``accepts``) and a check run once, here (start-up), agrees with the
    reference; None elsewhere, the reason logged (drafts then dequantize a packed body for one
    SDPA call per row)."""
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    probe = torch.empty(0, geometry.num_kv_heads, geometry.head_dim, dtype=geometry.dtype)
    if not PoolKiviDecode.accepts(probe, geometry.num_q_heads):
        logger.info("Triton's pool decode does not take %s (head_dim a power of two >= 16, a "
                    "float KV dtype); packed bodies are dequantized per row", geometry)  # fmt: skip
        return None
    try:
        decoder = PoolKiviDecode(device)
        if agrees_with_reference(decoder, geometry):
            return decoder
        logger.warning("Triton's pool decode disagrees with the reference for %s; packed "
                       "bodies are dequantized per row", geometry)  # fmt: skip
    except Exception as exc:  # a compile that fails on this device
        logger.warning("Triton's pool decode unavailable for %s (%s: %s); packed bodies are "
                       "dequantized per row", geometry, type(exc).__name__, exc)  # fmt: skip
    return None
