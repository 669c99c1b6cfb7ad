"""Shared pieces of the kernel microbenchmarks: timing, copy bandwidth, random draft rows.

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

from sglang_vericache.compress.kivi import Kivi
from sglang_vericache.compress.kivi_pages import KiviPageLayout, PagedKiviBlock

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class DecodeShape:
    """One benchmark shape: batch x context with a GQA head layout; each row's context is whole
    key groups (``group`` tokens each) of a KIVI body, then its ``recent_window`` or more tokens
    in full precision."""

    name: str
    batch: int
    context: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    group: int = 32
    recent_window: int = 128

    @property
    def key_groups(self) -> int:
        """Whole key groups older than the recent window, per request."""
        return (self.context - self.recent_window) // self.group

    @property
    def window_tokens(self) -> int:
        return self.context - self.key_groups * self.group


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


@dataclass(slots=True)
class PoolKiviInputs:
    """A layer's pool with ``batch`` draft rows (``ops/pool_kivi_decode.py``): each row's oldest
    tokens a KIVI body in pages of pool slots, its newest ``recent_window`` tokens float slots."""

    q: torch.Tensor  # [B, H_q, D]
    key_buffer: torch.Tensor  # [S, H_kv, D]
    value_buffer: torch.Tensor
    columns: list[torch.Tensor]  # [window] int64 slots per row
    bodies: list[PagedKiviBlock]


def pool_kivi_inputs(shape: DecodeShape, bits: int, dtype: torch.dtype, device: torch.device,
                     seed: int = 0) -> PoolKiviInputs:  # fmt: skip
    """Random KV quantized as the compressor does (``Kivi``), written to shuffled pool pages; the
    window's slots shuffled too, as a pool's free list hands them out."""
    gen = torch.Generator(device=device).manual_seed(seed)
    heads, dim, group = shape.num_kv_heads, shape.head_dim, shape.group
    tokens = shape.key_groups * group
    layout = KiviPageLayout(heads, dim, bits, group, dtype)
    slots = 1 + shape.batch * (layout.pages_for(tokens) + shape.window_tokens)
    key_buffer, value_buffer = (torch.randn(slots, heads, dim, device=device,
                                            generator=gen).to(dtype) for _ in "kv")  # fmt: skip
    order = (torch.randperm(slots - 1, device=device, generator=gen) + 1).cpu()
    taken = 0

    def take(n: int) -> torch.Tensor:
        nonlocal taken
        taken += n
        return order[taken - n : taken]

    bodies, columns = [], []
    for _ in range(shape.batch):
        keys, values = (torch.randn(heads, tokens, dim, device=device, generator=gen).to(dtype)
                        for _ in "kv")  # fmt: skip
        block = Kivi(bits=bits, group=group).quantize(keys, values)
        bodies.append(PagedKiviBlock.write(block, key_buffer, value_buffer,
                                           take(layout.pages_for(tokens))))  # fmt: skip
        columns.append(take(shape.window_tokens))
    q = torch.randn(shape.batch, shape.num_q_heads, dim, device=device, generator=gen).to(dtype)
    return PoolKiviInputs(q, key_buffer, value_buffer, columns, bodies)


def pool_kivi_bytes_read(shape: DecodeShape, bits: int, dtype: torch.dtype) -> int:
    """Bytes one decode over the whole batch must read: packed codes and their scales and zeros
    (a key group's per channel, a value's per token), the window's slots, q and the output."""
    item = torch.finfo(dtype).bits // 8
    heads, dim, group = shape.num_kv_heads, shape.head_dim, shape.group
    per_group = heads * (2 * group * dim * bits // 8 + 2 * dim * item + 2 * group * item)
    window = heads * shape.window_tokens * dim * 2 * item
    io = 2 * shape.num_q_heads * dim * item
    return shape.batch * (shape.key_groups * per_group + window + io)


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
