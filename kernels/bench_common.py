"""Shared pieces of the kernel microbenchmarks: timing, copy bandwidth, random paged inputs.

Needs only torch (+ triton for the kernels) and the package (installed, or ``PYTHONPATH=python``);
never imports sglang.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sglang_vericache.ops.layout import (
    QuantPagedBatch,
    QuantPagedKVCache,
    RecentWindowKV,
    codes_per_byte,
)
from sglang_vericache.ops.quant_pack import PagedQuantBatchInputs

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class DecodeShape:
    """One benchmark shape: batch x context with a GQA head layout."""

    name: str
    batch: int
    context: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 32
    recent_window: int = 128

    @property
    def quantized_pages(self) -> int:
        """Whole pages older than the recent window, per request."""
        return (self.context - self.recent_window) // self.page_size

    @property
    def window_tokens(self) -> int:
        return self.context - self.quantized_pages * self.page_size


def time_ms(fn: Callable[[], object], device: torch.device, iters: int = 20, repeats: int = 5,
            warmup: int = 3) -> float:
    """Median over `repeats` of the mean time of `iters` back-to-back calls, in ms.

    CUDA: events on the current stream. CPU (smoke runs only): wall clock.
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / iters)
        else:
            began = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - began) * 1e3 / iters)
    return statistics.median(samples)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(device: torch.device, nbytes: int = 2 * GIB) -> dict[str, float]:
    """Device-to-device copy bandwidth (bytes read + written per second, the usual way to count
    a copy) and pinned host-to-device bandwidth, both in GB/s (1e9 bytes)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    d2d_ms = time_ms(lambda: dst.copy_(src), device, iters=10)
    del src, dst
    host = torch.empty(nbytes // 2, dtype=torch.uint8)
    host = host.pin_memory() if device.type == "cuda" else host
    dev = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    h2d_ms = time_ms(lambda: dev.copy_(host, non_blocking=True), device, iters=3, repeats=3)
    return {
        "d2d_copy_GBps": 2 * nbytes / (d2d_ms * 1e-3) / 1e9,
        "d2d_bytes": float(nbytes),
        "h2d_pinned_GBps": (nbytes // 2) / (h2d_ms * 1e-3) / 1e9,
    }


def random_quant_inputs(shape: DecodeShape, bits: int, dtype: torch.dtype,
                        device: torch.device, seed: int = 0) -> PagedQuantBatchInputs:
    """Random packed codes and scales in the paged layout (pages shuffled across the pool)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = shape.batch * shape.quantized_pages
    heads, dim, page = shape.num_kv_heads, shape.head_dim, shape.page_size
    width = dim // codes_per_byte(bits)

    def codes(*size: int) -> torch.Tensor:
        return torch.randint(0, 256, size, dtype=torch.uint8, device=device, generator=gen)

    def scale(*size: int) -> torch.Tensor:
        return (torch.rand(*size, device=device, generator=gen) * 0.1 + 0.01).to(dtype)

    def zero(*size: int) -> torch.Tensor:
        return (torch.randn(*size, device=device, generator=gen) * 0.5).to(dtype)

    cache = QuantPagedKVCache(codes(pages, heads, page, width), scale(pages, heads, dim),
                              zero(pages, heads, dim), codes(pages, heads, width, page),
                              scale(pages, heads, page), zero(pages, heads, page), bits)
    window = RecentWindowKV(
        torch.randn(shape.batch, heads, shape.window_tokens, dim, device=device,
                    generator=gen).to(dtype),
        torch.randn(shape.batch, heads, shape.window_tokens, dim, device=device,
                    generator=gen).to(dtype),
    )
    order = torch.randperm(pages, device=device, generator=gen).to(torch.int32)
    i32 = {"dtype": torch.int32, "device": device}
    meta = QuantPagedBatch(
        kv_indptr=torch.arange(shape.batch + 1, **i32) * shape.quantized_pages,
        kv_page_indices=order,
        kv_last_page_len=torch.full((shape.batch,), page, **i32),
        window_slot=torch.arange(shape.batch, **i32),
        window_len=torch.full((shape.batch,), shape.window_tokens, **i32),
    )
    return PagedQuantBatchInputs(cache, window, meta)


def decode_bytes_read(shape: DecodeShape, bits: int, dtype: torch.dtype) -> int:
    """Bytes one decode over the whole batch must read (packed codes, scales, window, q, out)."""
    item = torch.finfo(dtype).bits // 8
    heads, dim, page = shape.num_kv_heads, shape.head_dim, shape.page_size
    per_page = heads * (2 * page * dim * bits // 8 + 2 * dim * item + 2 * page * item)
    window = heads * shape.window_tokens * dim * 2 * item
    io = 2 * shape.num_q_heads * dim * item
    return shape.batch * (shape.quantized_pages * (per_page + 4) + window + io)


def dense_kv_bytes(shape: DecodeShape, dtype: torch.dtype) -> int:
    """Bytes of the same context held unquantized (K and V), for the compression ratio."""
    item = torch.finfo(dtype).bits // 8
    return shape.batch * shape.context * shape.num_kv_heads * shape.head_dim * 2 * item


def write_json(path: str | Path, payload: object) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, default=_jsonable))


def _jsonable(obj: object) -> object:
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)  # type: ignore[arg-type]
    if isinstance(obj, torch.dtype):
        return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return str(obj)


def device_info() -> dict[str, object]:
    import triton

    info: dict[str, object] = {"torch": torch.__version__, "triton": triton.__version__,
                               "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sms=props.multi_processor_count,
                    memory_GiB=round(props.total_memory / GIB, 1))
    else:
        info.update(gpu=None, note="CPU smoke run under the Triton interpreter: no timings")
    return info


def bench_device(smoke: bool) -> torch.device:
    """CUDA for real runs; a smoke run on a machine without CUDA uses the CPU interpreter."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not smoke:
        raise SystemExit("no CUDA device: run with --smoke (and TRITON_INTERPRET=1) on CPU")
    return torch.device("cpu")
