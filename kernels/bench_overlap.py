"""Drafting under a concurrent full-KV copy, measured from device timestamps.

A draft step is `layers` runs of the Triton draft decode over int4 KIVI bodies in pool pages
(``ops/pool_kivi_decode.py``; batch 32 x 8k, GQA 32/8, D=128) on a dedicated non-default stream. The copy is the next verification's full KV, moved by
FullKVPrefetcher (its own non-blocking side stream, pinned host memory allocated and touched
before timing, ordered after an event instead of the drafting stream) in chunks that are kept
`--depth` deep on the side stream and resubmitted from poll() until the last draft step has
ended, so a copy is meant to be in flight for the whole timed window.

Every copy chunk has start/end CUDA events on the side stream, every step start/end events on
the drafting stream; all are read against one reference event (timestamps of one device are
comparable across streams). From them: the fraction of the drafting window during which a copy
actually ran, and the slowdown of the steps that ran entirely under a copy. A low overlap
fraction means the copy and the kernels serialized, and the slowdown is then not a measurement.

A raw check with plain torch ops (an elementwise kernel on one stream, copy_ on another, no
prefetcher, no Triton) tells the platform's ability to overlap apart from ours.
Run: PYTHONPATH=python python kernels/bench_overlap.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_common import DecodeShape, bench_device, device_info, pool_kivi_inputs, write_json
from overlap_stats import analyse_overlap

from sglang_vericache.ops.pool_kivi_decode import PoolKiviDecode
from sglang_vericache.ops.prefetch import FullKVPrefetcher

SHAPE = DecodeShape("gqa4_h8_d128_b32x8k", batch=32, context=8192, num_q_heads=32,
                    num_kv_heads=8, head_dim=128)
SMOKE_SHAPE = DecodeShape("smoke", batch=2, context=100, num_q_heads=4, num_kv_heads=2,
                          head_dim=32, group=16, recent_window=8)
MIN_OVERLAP = 0.8  # below this the copy did not run alongside drafting: the check FAILS
# A copy "busy" from its start event to its end event but moving bytes far slower than alone was
# mostly waiting (e.g. behind kernels in one hardware queue): that is not overlap either.
MIN_H2D_SHARE = 0.5
ENV_NAMES = ("CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_LAUNCH_BLOCKING", "CUDA_MODULE_LOADING",
             "CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING",
             "TORCH_CUDA_SANITIZER", "TRITON_INTERPRET")
MIB = 1 << 20


class Stamps:
    """Timestamps in ms from one reference: CUDA events (device clock) or the host clock (CPU
    smoke runs). Create it while the current stream is idle, before anything it will time."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._ref = self.mark()

    def mark(self, stream: torch.cuda.Stream | None = None) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def ms(self, stamp: object) -> float:
        if self.cuda:
            return self._ref.elapsed_time(stamp)  # type: ignore[union-attr]
        return (stamp - self._ref) * 1e3  # type: ignore[operator]

    def done(self, stamp: object) -> bool:
        return (not self.cuda) or stamp.query()  # type: ignore[union-attr]


def time_steps(step: Callable[[], None], steps: int, device: torch.device) -> list[float]:
    """Per-step times in ms on the current stream (events; wall clock on CPU)."""
    stamps = Stamps(device)
    marks = [stamps.mark()]
    for _ in range(steps):
        step()
        marks.append(stamps.mark())
    if stamps.cuda:
        marks[-1].synchronize()  # type: ignore[union-attr]
    return [stamps.ms(marks[i + 1]) - stamps.ms(marks[i]) for i in range(steps)]


def overlapped_window(step: Callable[[], None], steps: int, device: torch.device,
                      prefetcher: FullKVPrefetcher, pair: tuple[torch.Tensor, torch.Tensor],
                      ready: object, depth: int) -> dict[str, object]:
    """Run `steps` draft steps on the current stream while copies of `pair` are kept `depth`
    deep on the prefetcher's stream, topped up after every step launch and then until the last
    step has ended on the device. Returns the overlap analysis and the host's submit costs."""
    stamps = Stamps(device)
    host_intervals: dict[int, tuple[float, float]] = {}  # CPU: submit() copies synchronously
    submit_ms: list[float] = []
    finished: list[int] = []

    def top_up() -> None:
        finished.extend(prefetcher.poll())
        while prefetcher.num_in_flight < depth and (stamps.cuda or len(submit_ms) < depth):
            began = time.perf_counter()
            task = prefetcher.submit([pair], after=ready)  # type: ignore[arg-type]
            ended = time.perf_counter()
            submit_ms.append((ended - began) * 1e3)
            if not stamps.cuda:
                host_intervals[task] = (stamps.ms(began), stamps.ms(ended))
                break

    marks = []
    top_up()  # the side stream is busy before the first step starts
    for _ in range(steps):
        start = stamps.mark()
        step()
        marks.append((start, stamps.mark()))
        top_up()
    while not stamps.done(marks[-1][1]):  # keep copies in flight until drafting has ended
        top_up()
        time.sleep(1e-4)
    still_in_flight = prefetcher.num_in_flight
    while prefetcher.num_in_flight:
        finished.extend(prefetcher.poll())
        time.sleep(1e-4)
    finished.extend(prefetcher.poll())
    prefetcher.check_integrity()
    if len(set(finished)) != len(finished) or len(finished) != len(submit_ms):
        raise AssertionError("prefetcher returned a task twice or lost one")
    copies, nbytes = [], []
    for task in sorted(finished):
        timing = prefetcher.take_timing(task)
        if timing is not None:
            copies.append((stamps.ms(timing.start), stamps.ms(timing.end)))
            nbytes.append(timing.nbytes)
        else:
            copies.append(host_intervals[task])
            nbytes.append(pair[0].numel() * pair[0].element_size())
    step_spans = [(stamps.ms(a), stamps.ms(b)) for a, b in marks]
    return {"report": analyse_overlap(step_spans, copies, nbytes), "submit_ms": submit_ms,
            "copies": len(copies), "in_flight_when_drafting_ended": still_in_flight,
            "first_copy_start_ms": min(c[0] for c in copies) - step_spans[0][0],
            "last_copy_end_ms": max(c[1] for c in copies) - step_spans[0][0],
            "steps_ms": [b - a for a, b in step_spans]}


def raw_torch_overlap(device: torch.device, host: torch.Tensor, dev: torch.Tensor,
                      steps: int = 20) -> dict[str, object]:
    """Platform check without our code: an elementwise torch kernel (~0.5 ms per op, 4 ops per
    step) on one new stream and plain copy_ chunks on another, submitted alternately."""
    work = torch.ones(256 * MIB, dtype=torch.float32, device=device)
    compute, side = torch.cuda.Stream(device), torch.cuda.Stream(device)
    torch.cuda.synchronize(device)
    with torch.cuda.stream(compute):
        stamps = Stamps(device)
        spans, copies = [], []
        for _ in range(steps):
            with torch.cuda.stream(side):
                c0 = stamps.mark(side)
                dev.copy_(host, non_blocking=True)
                copies.append((c0, stamps.mark(side)))
            s0 = stamps.mark()
            for _ in range(4):
                work.mul_(1.0)
            spans.append((s0, stamps.mark()))
    torch.cuda.synchronize(device)
    report = analyse_overlap([(stamps.ms(a), stamps.ms(b)) for a, b in spans],
                             [(stamps.ms(a), stamps.ms(b)) for a, b in copies],
                             [host.numel()] * len(copies))
    return {"overlap_fraction": report.overlap_fraction, "window_ms": report.window_ms,
            "h2d_GBps_in_window": report.h2d_GBps_in_window}


def stream_flags(stream: torch.cuda.Stream) -> int | None:
    """cuStreamGetFlags of a stream (1 = CU_STREAM_NON_BLOCKING); None if unreadable."""
    try:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        flags = ctypes.c_uint(0)
        rc = lib.cuStreamGetFlags(ctypes.c_void_p(stream.cuda_stream), ctypes.byref(flags))
        return int(flags.value) if rc == 0 else None
    except (OSError, AttributeError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="gpu_out/overlap.json")
    parser.add_argument("--layers", type=int, default=8, help="kernel runs per draft step")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--chunk-mib", type=int, default=128, help="bytes per copy task")
    parser.add_argument("--depth", type=int, default=3, help="copy tasks kept in flight")
    parser.add_argument("--splits", type=int, default=0, help="0: the plan's own")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU ok), no timings")
    args = parser.parse_args()
    device = bench_device(args.smoke)
    cuda = device.type == "cuda"
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    chunk = MIB // 64 if args.smoke else args.chunk_mib * MIB
    if args.smoke:
        args.layers, args.steps = 1, 3

    inp = pool_kivi_inputs(shape, 4, torch.bfloat16 if cuda else torch.float32, device)
    decoder = PoolKiviDecode(device)
    decoder.plan(inp.columns, inp.bodies, inp.key_buffer, shape.num_q_heads, args.splits or None)
    if cuda:  # plan() staged the metadata on the default stream; drafting runs on another
        torch.cuda.synchronize(device)

    def step() -> None:
        for _ in range(args.layers):
            decoder.run(inp.q, inp.key_buffer, inp.value_buffer, shape.head_dim**-0.5)

    # Pinned source and destination exist, and have been touched and copied once, before any
    # timed window; the prefetcher's stream and events are created up front too.
    host = torch.empty(chunk, dtype=torch.uint8)
    host = host.pin_memory() if cuda else host
    host.fill_(1)
    dev = torch.empty(chunk, dtype=torch.uint8, device=device)
    prefetcher = FullKVPrefetcher(device, record_timing=True)
    draft = torch.cuda.Stream(device) if cuda else None
    ctx = torch.cuda.stream(draft) if cuda else contextlib.nullcontext()
    with ctx:
        for _ in range(1 if args.smoke else 5):
            step()
        h2d_alone = []  # the second copy's rate is the alone probe (the first touches pages)
        for _ in range(2):
            warm = prefetcher.submit([(host, dev)])
            while warm not in prefetcher.poll():
                time.sleep(1e-4)
            timing = prefetcher.take_timing(warm)
            if timing is not None:
                h2d_alone.append(chunk / max(timing.start.elapsed_time(timing.end), 1e-6) / 1e6)
        if cuda:
            torch.cuda.synchronize(device)
        alone_before = time_steps(step, args.steps, device)
        ready = Stamps(device).mark()  # the destination has no reader: copies may start at once
        window = overlapped_window(step, args.steps, device, prefetcher, (host, dev), ready,
                                   args.depth)
        alone_after = time_steps(step, args.steps, device)
    raw = raw_torch_overlap(device, host, dev) if cuda else None

    report = window["report"]
    alone_ms = statistics.median(alone_before + alone_after)
    slowdown = report.slowdown_pct(alone_ms)
    submit = window["submit_ms"]
    h2d_alone_gbps = h2d_alone[-1] if h2d_alone else None
    h2d_share = (report.h2d_GBps_in_window / h2d_alone_gbps) if h2d_alone_gbps else None
    overlap_ok = report.overlap_fraction >= MIN_OVERLAP and (h2d_share is None
                                                             or h2d_share >= MIN_H2D_SHARE)
    result = {
        "device": device_info(), "shape": shape, "layers_per_step": args.layers,
        "steps": args.steps, "kernel_splits": decoder.plan_.splits,
        "copy_design": (f"{chunk // MIB if chunk >= MIB else chunk / MIB:g} MiB pinned H2D "
                        f"chunks kept {args.depth} deep on the prefetcher's non-blocking side "
                        "stream, ordered after an event (not the drafting stream), resubmitted "
                        "from poll() until the last draft step ended on the device; drafting "
                        "on its own non-default stream"),
        "timing": "CUDA events: copy start/end on the side stream, step start/end on the "
                  "drafting stream, all against one reference event" if cuda else
                  "CPU smoke: host clock, synchronous copies; not a measurement",
        "step_ms_alone_median": alone_ms,
        "step_ms_alone_before_median": statistics.median(alone_before),
        "step_ms_alone_after_median": statistics.median(alone_after),
        "step_ms_under_copy_median": (statistics.median(report.covered_steps_ms)
                                      if report.covered_steps_ms else None),
        "steps_under_copy": len(report.covered_steps_ms),
        "overlap_fraction": report.overlap_fraction, "min_overlap_fraction": MIN_OVERLAP,
        "overlap_ok": overlap_ok,
        "draft_slowdown_pct": slowdown,
        "window_ms": report.window_ms, "copy_busy_ms": report.copy_busy_ms,
        "copies": window["copies"], "copy_chunk_bytes": chunk,
        "copy_in_flight_when_drafting_ended": window["in_flight_when_drafting_ended"],
        "first_copy_start_ms_from_window": window["first_copy_start_ms"],
        "last_copy_end_ms_from_window": window["last_copy_end_ms"],
        "h2d_GBps_in_window": report.h2d_GBps_in_window,
        "h2d_GBps_alone": h2d_alone_gbps, "h2d_share_in_window_vs_alone": h2d_share,
        "min_h2d_share": MIN_H2D_SHARE,
        "submit_host_ms_median": statistics.median(submit),
        "submit_host_ms_max": max(submit),
        "step_coverage": report.step_coverage, "steps_ms_in_window": window["steps_ms"],
        "raw_torch_overlap": raw,
        "platform": {
            "env": {name: os.environ.get(name) for name in ENV_NAMES},
            "host_pinned": bool(host.is_pinned()),
            "draft_stream_flags": stream_flags(draft) if draft is not None else None,
            "side_stream_flags": (stream_flags(prefetcher.stream)
                                  if prefetcher.stream is not None else None),
        },
    }
    slow_s = "n/a (no step ran fully under a copy)" if slowdown is None else f"{slowdown:.1f}%"
    print(f"draft step ({args.layers} layers, int4 {shape.name}): alone {alone_ms:.3f} ms; "
          f"copy busy during {100 * report.overlap_fraction:.0f}% of the drafting window "
          f"({report.window_ms:.1f} ms, {len(report.covered_steps_ms)}/{args.steps} steps fully "
          f"under a copy, H2D {report.h2d_GBps_in_window:.1f} GB/s in the window vs "
          f"{h2d_alone_gbps or 0:.1f} alone); slowdown of "
          f"overlapped steps {slow_s}; submit() host time max {max(submit):.2f} ms"
          + ("" if raw is None else
             f"; raw torch overlap {100 * raw['overlap_fraction']:.0f}%")
          + ("" if overlap_ok else " -- NOT OVERLAPPED"), flush=True)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
