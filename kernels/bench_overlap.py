"""Drafting under a concurrent full-KV copy: step time alone vs with a pinned H2D copy in flight.

A draft step is `layers` runs of the int4 quantized decode kernel (batch 32 x 8k, GQA 32/8,
D=128). The copy is the next verification's full KV, moved by FullKVPrefetcher (side stream,
pinned host memory, events); it is sized to outlast the timed steps, and the report says how much
of the timed window it actually covered. Run: PYTHONPATH=python python kernels/bench_overlap.py
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
from bench_common import (
    GIB,
    DecodeShape,
    bench_device,
    device_info,
    random_quant_inputs,
    synchronize,
    write_json,
)

from sglang_vericache.ops.prefetch import FullKVPrefetcher
from sglang_vericache.ops.quant_decode import (
    DecodeBackend,
    QuantDecodeLaunch,
    QuantDecodeWorkspace,
    QuantPagedDecodeWrapper,
)

SHAPE = DecodeShape("gqa4_h8_d128_b32x8k", batch=32, context=8192, num_q_heads=32,
                    num_kv_heads=8, head_dim=128)
SMOKE_SHAPE = DecodeShape("smoke", batch=2, context=100, num_q_heads=4, num_kv_heads=2,
                          head_dim=32, page_size=16, recent_window=8)


def time_steps(step, steps: int, device: torch.device) -> list[float]:
    """Per-step times in ms: CUDA events around each step on the current stream (wall clock on
    CPU smoke runs)."""
    if device.type != "cuda":
        times = []
        for _ in range(steps):
            began = time.perf_counter()
            step()
            times.append((time.perf_counter() - began) * 1e3)
        return times
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    events[0].record()
    for i in range(steps):
        step()
        events[i + 1].record()
    events[-1].synchronize()
    return [events[i].elapsed_time(events[i + 1]) for i in range(steps)]


def _launch(args: argparse.Namespace, shape: DecodeShape) -> QuantDecodeLaunch:
    """The fastest correct int4 bf16 config the bandwidth bench found, else the defaults."""
    launch = QuantDecodeLaunch(DecodeBackend.TRITON, num_splits=args.splits or None)
    if not args.config_from or not Path(args.config_from).exists():
        return launch
    for res in json.loads(Path(args.config_from).read_text()).get("results", []):
        best = res.get("best")
        if best and res["shape"]["name"] == shape.name and res["bits"] == 4 \
                and res["dtype"] == "torch.bfloat16":
            return QuantDecodeLaunch(DecodeBackend.TRITON, num_splits=best["splits"],
                                     num_warps=best["warps"], num_stages=best["stages"],
                                     fast_unpack=best["fast_unpack"])
    return launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="gpu_out/overlap.json")
    parser.add_argument("--layers", type=int, default=8, help="kernel runs per draft step")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--chunk-gib", type=float, default=1.0, help="pinned buffer per copy")
    parser.add_argument("--splits", type=int, default=0, help="0: auto")
    parser.add_argument("--config-from", default=None,
                        help="quant_decode.json: use its best int4 bf16 config for this shape")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU ok), no timings")
    args = parser.parse_args()
    device = bench_device(args.smoke)
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    if args.smoke:
        args.layers, args.steps, args.chunk_gib = 1, 2, 1 / 1024

    inp = random_quant_inputs(shape, 4, torch.bfloat16, device)
    q = torch.randn(shape.batch, shape.num_q_heads, shape.head_dim, device=device).bfloat16()
    out = torch.empty_like(q)
    ws = QuantDecodeWorkspace.allocate(max_batch=shape.batch, num_q_heads=shape.num_q_heads,
                                       head_dim=shape.head_dim, max_splits=32,
                                       max_pages=inp.batch.kv_page_indices.numel(), device=device)
    wrapper = QuantPagedDecodeWrapper(ws, _launch(args, shape))
    wrapper.plan(inp.batch, inp.cache, inp.window, num_q_heads=shape.num_q_heads)

    def step() -> None:
        for _ in range(args.layers):
            wrapper.run(q, inp.cache, inp.window, out=out)

    for _ in range(1 if args.smoke else 5):
        step()
    synchronize(device)
    alone = time_steps(step, args.steps, device)

    chunk = int(args.chunk_gib * GIB)
    host = torch.empty(chunk, dtype=torch.uint8)
    host = host.pin_memory() if device.type == "cuda" else host
    host[:: 4096] = 1  # touch the pages
    dev = torch.empty(chunk, dtype=torch.uint8, device=device)
    prefetcher = FullKVPrefetcher(device)
    probe = time_steps(lambda: dev.copy_(host, non_blocking=True), 2, device)
    h2d_gbps = chunk / (max(min(probe), 1e-6) * 1e-3) / 1e9
    window_ms = 1.5 * statistics.fmean(alone) * args.steps
    copies = max(1, math.ceil(window_ms * 1e-3 * h2d_gbps * 1e9 / chunk))

    synchronize(device)
    started = time.perf_counter()
    tasks = [prefetcher.submit([(host, dev)]) for _ in range(copies)]
    together = time_steps(step, args.steps, device)  # returns once the last step has finished
    finished = prefetcher.poll()
    outlasted = len(finished) < len(tasks)  # a copy was still in flight when drafting ended
    while len(finished) < len(tasks):
        finished += prefetcher.poll()
        prefetcher.check_integrity()
        time.sleep(1e-4)
    copy_s = time.perf_counter() - started
    if sorted(finished) != sorted(tasks):
        raise AssertionError("prefetcher returned a task twice or lost one")

    alone_ms, with_ms = statistics.median(alone), statistics.median(together)
    slowdown = 100.0 * (with_ms / alone_ms - 1.0)
    result = {
        "device": device_info(), "shape": shape, "layers_per_step": args.layers,
        "steps": args.steps, "kernel_splits": wrapper.num_splits,
        "kernel_launch": _launch(args, shape),
        "step_ms_alone_median": alone_ms, "step_ms_with_copy_median": with_ms,
        "step_ms_alone_mean": statistics.fmean(alone),
        "step_ms_with_copy_mean": statistics.fmean(together),
        "draft_slowdown_pct": slowdown, "h2d_probe_GBps": h2d_gbps,
        "copy_bytes": copies * chunk, "copies": copies,
        "copy_outlasted_steps": outlasted, "copy_wall_s": copy_s,
        "h2d_GBps_during_overlap": copies * chunk / copy_s / 1e9,
    }
    print(f"draft step ({args.layers} layers, int4 {shape.name}): alone {alone_ms:.3f} ms, "
          f"with concurrent full-KV copy {with_ms:.3f} ms -> slowdown {slowdown:.1f}% "
          f"(copy {copies * chunk / GIB:.1f} GiB at ~{h2d_gbps:.0f} GB/s, "
          f"outlasted steps: {outlasted})", flush=True)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
