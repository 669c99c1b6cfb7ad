"""Decode attention over a quantized paged KV cache: plan once per batch, run once per layer.

Example (CPU, torch backend)::

    >>> import torch
    >>> from sglang_vericache.ops.quant_pack import build_quant_paged_batch
    >>> keys = [torch.randn(2, 70, 32)]; values = [torch.randn(2, 70, 32)]
    >>> inp = build_quant_paged_batch(keys, values, page_size=16, bits=4, recent_window=8)
    >>> ws = QuantDecodeWorkspace.allocate(max_batch=1, num_q_heads=4, head_dim=32,
    ...                                    max_splits=4, max_pages=8, device=torch.device("cpu"))
    >>> wrapper = QuantPagedDecodeWrapper(ws, QuantDecodeLaunch(backend=DecodeBackend.TORCH))
    >>> wrapper.plan(inp.batch, inp.cache, inp.window, num_q_heads=4)
    >>> wrapper.run(torch.randn(1, 4, 32), inp.cache, inp.window).shape
    torch.Size([1, 4, 32])
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from sglang_vericache.ops.layout import QuantPagedBatch, QuantPagedKVCache, RecentWindowKV
from sglang_vericache.ops.reference import quant_paged_decode_reference

LOG2E = 1.4426950408889634
MIN_DOT_ROWS = 16  # tl.dot needs M, N, K >= 16


class DecodeBackend(enum.Enum):
    TRITON = "triton"
    TORCH = "torch"


@dataclass(frozen=True, slots=True)
class QuantDecodeLaunch:
    """Launch knobs. backend None: Triton on CUDA, torch elsewhere (TRITON forces the kernels,
    also on CPU when they were built by Triton's interpreter).
    num_splits None: enough (request, kv head, split) programs to fill the device."""

    backend: DecodeBackend | None = None
    num_splits: int | None = None
    num_warps: int = 2  # static SASS counts favour 1-2 warps (kernels/README.md)
    num_stages: int = 2
    block_window: int = 16
    fast_unpack: bool = True  # GPU, 16-bit KV: inline-PTX unpacking (see _code_planes)
    # GPU: cap on registers per thread for the split kernel (ptxas .maxnreg); None: the
    # compiler's choice. At 1 warp the kernel takes ~200 registers, which limits an SM to ~10
    # resident programs; a cap trades a few spills for more warps to hide memory latency.
    max_registers: int | None = None
    # Query rows per GQA group tile: the group padded to a power of two >= this. 16 suits every
    # Triton; smaller (e.g. 1) lets the score/output dots use the group's own size (Triton pads
    # M internally), which cuts the registers of the query tiles and accumulators for GQA 4.
    min_group_rows: int = MIN_DOT_ROWS
    # Rescale the running output only when the running max grows by > 2^8 (see the kernel).
    lazy_rescale: bool = False
    # Swapped MMA roles (triton/quant_decode_swapped.py): tokens/channels as M, the GQA group
    # as N; fewer instructions and registers per page (sass_stats: 969 vs 1081 at 1 warp).
    swapped_mma: bool = False

    def __post_init__(self) -> None:
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError("num_splits must be >= 1")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError("num_warps must be a power of two <= 16")
        if self.num_stages < 1:
            raise ValueError("num_stages must be >= 1")
        if self.block_window < MIN_DOT_ROWS or self.block_window & (self.block_window - 1):
            raise ValueError("block_window must be a power of two >= 16")
        if self.min_group_rows < 1 or self.min_group_rows & (self.min_group_rows - 1):
            raise ValueError("min_group_rows must be a power of two >= 1")
        if self.max_registers is not None and not 24 <= self.max_registers <= 255:
            raise ValueError("max_registers must be in 24..255")


@dataclass(frozen=True, slots=True)
class QuantDecodeWorkspace:
    """Caller-owned buffers, reused across batches and layers (the wrapper never allocates).

    partial_out: [N_o] float32, holds [B, H_q, S, D] split outputs.
    partial_lse: [N_l] float32, holds [B, H_q, S] split log2-sum-exps.
    metadata:    [N_m] int32, holds the batch's CSR metadata on the compute device.
    """

    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    metadata: torch.Tensor

    def __post_init__(self) -> None:
        for name, dtype in (("partial_out", torch.float32), ("partial_lse", torch.float32),
                            ("metadata", torch.int32)):
            tensor = getattr(self, name)
            if tensor.dtype != dtype or tensor.dim() != 1:
                raise ValueError(f"{name} must be a 1-D {dtype} tensor")

    @staticmethod
    def allocate(max_batch: int, num_q_heads: int, head_dim: int, max_splits: int,
                 max_pages: int, device: torch.device) -> QuantDecodeWorkspace:
        rows = max_batch * num_q_heads * max_splits
        return QuantDecodeWorkspace(
            partial_out=torch.empty(rows * head_dim, dtype=torch.float32, device=device),
            partial_lse=torch.empty(rows, dtype=torch.float32, device=device),
            metadata=torch.empty(4 * max_batch + 1 + max(max_pages, 1), dtype=torch.int32,
                                 device=device),
        )


@dataclass(frozen=True, slots=True)
class _Geometry:
    num_kv_heads: int
    page_size: int
    head_dim: int
    bits: int
    dtype: torch.dtype
    window_capacity: int

    @staticmethod
    def of(cache: QuantPagedKVCache, window: RecentWindowKV) -> _Geometry:
        return _Geometry(cache.num_kv_heads, cache.page_size, cache.head_dim, cache.bits,
                         cache.dtype, window.capacity)


@dataclass(frozen=True, slots=True)
class _Plan:
    batch: QuantPagedBatch  # on the compute device, views into workspace.metadata
    geometry: _Geometry
    num_q_heads: int
    num_splits: int
    sm_scale: float


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels can run on tensors of `device` in this process."""
    try:
        from sglang_vericache.ops.triton.quant_decode_kernels import kernels_are_interpreted
    except ImportError:
        return False
    interpreted = kernels_are_interpreted()
    return (device.type == "cpu") == interpreted and device.type in ("cpu", "cuda")


def triton_supports(head_dim: int, bits: int) -> bool:
    """Each bit plane (head_dim * bits / 8 channels) is a tl.dot operand: at least 16 wide."""
    return head_dim * bits // 8 >= MIN_DOT_ROWS


class _TorchDecode:
    """Reference path: dequantize, then float32 attention (CPU, or no Triton)."""

    def __call__(self, plan: _Plan, ws: QuantDecodeWorkspace, q: torch.Tensor,
                 cache: QuantPagedKVCache, window: RecentWindowKV, out: torch.Tensor) -> None:
        out.copy_(quant_paged_decode_reference(q, cache, window, plan.batch, plan.sm_scale))


class _TritonDecode:
    """Split-K Triton kernels (GPU, or CPU under TRITON_INTERPRET=1)."""

    def __init__(self, launch: QuantDecodeLaunch) -> None:
        from sglang_vericache.ops.triton import quant_decode_kernels as kernels
        from sglang_vericache.ops.triton import quant_decode_swapped as swapped

        self._kernels = kernels
        self._split_kernel = (swapped.quant_decode_split_kernel_swapped if launch.swapped_mma
                              else kernels.quant_decode_split_kernel)
        self._launch = launch
        self._interpreted = kernels.kernels_are_interpreted()

    def __call__(self, plan: _Plan, ws: QuantDecodeWorkspace, q: torch.Tensor,
                 cache: QuantPagedKVCache, window: RecentWindowKV, out: torch.Tensor) -> None:
        import triton.language as tl

        geo, meta = plan.geometry, plan.batch
        batch, heads_q, dim = q.shape
        splits = plan.num_splits
        rows = batch * heads_q * splits
        part_o, part_lse = ws.partial_out[: rows * dim], ws.partial_lse[:rows]
        dot_dtype, magic, offset = {
            torch.float16: (tl.float16, 0x6400, 1024.0),
            torch.bfloat16: (tl.bfloat16, 0x4300, 128.0),
            torch.float32: (tl.float32, 0, 0.0),
        }[geo.dtype]
        group = heads_q // geo.num_kv_heads
        extra = ({"maxnreg": self._launch.max_registers}
                 if self._launch.max_registers is not None and not self._interpreted else {})
        self._split_kernel[(batch, geo.num_kv_heads, splits)](
            q, cache.k_packed, cache.k_scale, cache.k_zero, cache.v_packed, cache.v_scale,
            cache.v_zero, window.keys, window.values,
            meta.kv_indptr, meta.kv_page_indices, meta.kv_last_page_len, meta.window_slot,
            meta.window_len, part_o, part_lse,
            plan.sm_scale * LOG2E, geo.num_kv_heads, geo.window_capacity, splits,
            q.stride(0), q.stride(1),
            GROUP=group, BLOCK_G=max(self._launch.min_group_rows, _next_pow2(group)),
            HEAD_DIM=dim,
            PAGE=geo.page_size, BLOCK_P=max(MIN_DOT_ROWS, _next_pow2(geo.page_size)),
            BITS=geo.bits, BLOCK_W=self._launch.block_window,
            DOT_DTYPE=dot_dtype, MAGIC=magic, OFFSET=offset,
            UPCAST=self._interpreted, IEEE=geo.dtype == torch.float32,
            LAZY_RESCALE=self._launch.lazy_rescale,
            **self._unpack_asm(geo, magic),
            num_warps=self._launch.num_warps, num_stages=self._launch.num_stages, **extra,
        )
        self._kernels.merge_splits_kernel[(batch, heads_q)](
            part_o, part_lse, out, heads_q, splits, out.stride(0), out.stride(1),
            HEAD_DIM=dim, BLOCK_S=max(2, _next_pow2(splits)),
            num_warps=1 if self._interpreted else 4,
        )


    def _unpack_asm(self, geo: _Geometry, magic: int) -> dict[str, str]:
        fast = self._launch.fast_unpack and not self._interpreted and geo.dtype != torch.float32
        return {f"ASM_P{plane}": self._kernels.unpack_asm(geo.bits, magic, plane)
                if fast and plane < 8 // geo.bits else "" for plane in range(4)}


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _auto_splits(device: torch.device, programs: int, max_pages: int, num_warps: int) -> int:
    """Splits so that (request, kv head, split) programs put about 32 warps on every SM."""
    if device.type != "cuda":
        return 1
    target = 32 * torch.cuda.get_device_properties(device).multi_processor_count // num_warps
    return max(1, min(math.ceil(target / max(programs, 1)), max(max_pages, 1)))


class QuantPagedDecodeWrapper:
    """Batch decode over quantized pages + recent window (FlashInfer-style plan/run).

    plan() once per batch (reads metadata on the host, copies it into the workspace; not
    CUDA-graph capturable); run() once per layer with that layer's cache and window (capturable:
    it only launches kernels on preallocated buffers).
    """

    def __init__(self, workspace: QuantDecodeWorkspace,
                 launch: QuantDecodeLaunch | None = None) -> None:
        self._ws = workspace
        self._launch = launch if launch is not None else QuantDecodeLaunch()
        self._plan: _Plan | None = None
        self._backend: _TorchDecode | _TritonDecode | None = None

    @property
    def backend(self) -> DecodeBackend | None:
        """The backend chosen by the last plan() (None before plan)."""
        if self._backend is None:
            return None
        if isinstance(self._backend, _TritonDecode):
            return DecodeBackend.TRITON
        return DecodeBackend.TORCH

    @property
    def num_splits(self) -> int | None:
        return None if self._plan is None else self._plan.num_splits

    def plan(self, batch: QuantPagedBatch, cache: QuantPagedKVCache, window: RecentWindowKV, *,
             num_q_heads: int, sm_scale: float | None = None) -> None:
        """Validate the batch against the pool geometry and prepare launches.

        batch: metadata on any device; cache/window: any layer's (only geometry is used).
        """
        geo = _Geometry.of(cache, window)
        if num_q_heads % geo.num_kv_heads:
            raise ValueError("num_q_heads must be a multiple of num_kv_heads")
        if geo.head_dim & (geo.head_dim - 1) or geo.head_dim < MIN_DOT_ROWS:
            raise ValueError("head_dim must be a power of two >= 16")
        if window.keys.shape[1] != geo.num_kv_heads or window.keys.shape[3] != geo.head_dim:
            raise ValueError("window geometry disagrees with the cache")
        if window.keys.dtype != geo.dtype:
            raise ValueError("window dtype must equal the cache's KV dtype")
        batch.validate(geo.page_size, cache.num_pages, geo.window_capacity, window.keys.shape[0])
        device = self._ws.metadata.device
        if cache.k_packed.device != device or window.keys.device != device:
            raise ValueError("cache, window and workspace must share one device")
        size = batch.batch_size
        indptr = batch.kv_indptr.cpu()
        nnz = int(indptr[-1])
        max_pages = int((indptr[1:] - indptr[:-1]).max()) if size else 0
        splits = self._launch.num_splits or _auto_splits(device, size * geo.num_kv_heads, max_pages,
                                                         self._launch.num_warps)
        capacity = self._ws.partial_lse.numel() // max(size * num_q_heads, 1)
        splits = max(1, min(splits, capacity, max(max_pages, 1)))
        rows = size * num_q_heads * splits
        if rows * geo.head_dim > self._ws.partial_out.numel() or capacity < 1:
            raise ValueError("workspace too small for this batch")
        if 4 * size + 1 + max(nnz, 1) > self._ws.metadata.numel():
            raise ValueError("workspace metadata buffer too small for this batch")
        self._plan = _Plan(self._stage_metadata(batch, size, nnz), geo, num_q_heads, splits,
                           sm_scale if sm_scale is not None else 1.0 / math.sqrt(geo.head_dim))
        self._backend = self._select_backend(device, geo)

    def run(self, q: torch.Tensor, cache: QuantPagedKVCache, window: RecentWindowKV,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """q: [B, H_q, D] in the KV dtype (fp32 also accepted); out: optional [B, H_q, D] q.dtype.
        Returns out: [B, H_q, D] q.dtype."""
        if self._plan is None or self._backend is None:
            raise RuntimeError("run() before plan()")
        plan = self._plan
        if _Geometry.of(cache, window) != plan.geometry:
            raise ValueError("cache/window geometry differs from the planned one")
        expected = (plan.batch.batch_size, plan.num_q_heads, plan.geometry.head_dim)
        if tuple(q.shape) != expected or q.stride(-1) != 1:
            raise ValueError(f"q must be {list(expected)} with a unit last stride")
        if out is None:
            out = torch.empty_like(q)
        self._backend(plan, self._ws, q, cache, window, out)
        return out

    def _select_backend(self, device: torch.device, geo: _Geometry) -> _TorchDecode | _TritonDecode:
        choice = self._launch.backend
        if choice is None:  # the interpreter is for tests only: auto never picks it on CPU
            use_triton = (device.type == "cuda" and triton_runs_on(device)
                          and triton_supports(geo.head_dim, geo.bits))
            choice = DecodeBackend.TRITON if use_triton else DecodeBackend.TORCH
        if choice is DecodeBackend.TRITON:
            if not triton_runs_on(device):
                raise RuntimeError(f"Triton kernels cannot run on {device} in this process")
            if not triton_supports(geo.head_dim, geo.bits):
                raise ValueError(f"the Triton kernel needs head_dim * bits / 8 >= {MIN_DOT_ROWS} "
                                 f"(got head_dim={geo.head_dim}, bits={geo.bits})")
            return _TritonDecode(self._launch)
        return _TorchDecode()

    def _stage_metadata(self, batch: QuantPagedBatch, size: int, nnz: int) -> QuantPagedBatch:
        buf = self._ws.metadata
        pieces = (batch.kv_indptr[: size + 1], batch.kv_last_page_len[:size],
                  batch.window_slot[:size], batch.window_len[:size],
                  batch.kv_page_indices[: max(nnz, 1)] if batch.kv_page_indices.numel()
                  else torch.zeros(1, dtype=torch.int32))
        views, offset = [], 0
        for piece in pieces:
            view = buf[offset: offset + piece.numel()]
            view.copy_(piece, non_blocking=True)
            views.append(view)
            offset += piece.numel()
        indptr, last, slot, wlen, pages = views
        return QuantPagedBatch(indptr, pages, last, slot, wlen)
