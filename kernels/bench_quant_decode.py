"""Achieved bandwidth of the quantized paged decode kernel vs the device's measured copy bandwidth.

For each (shape, bits, dtype) it sweeps launch configs (splits x warps x stages), keeps the
fastest, checks that config against the float32 torch reference on the same inputs, and reports
GB/s = bytes the decode must read / kernel time, as a percentage of the D2D copy bandwidth
(bytes read + written per second). Run: PYTHONPATH=python python kernels/bench_quant_decode.py
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_common import (
    GIB,
    DecodeShape,
    bench_device,
    decode_bytes_read,
    dense_kv_bytes,
    device_info,
    measure_copy_bandwidth,
    random_quant_inputs,
    time_ms,
    write_json,
)

from sglang_vericache.ops.quant_decode import (
    DecodeBackend,
    QuantDecodeLaunch,
    QuantDecodeWorkspace,
    QuantPagedDecodeWrapper,
)
from sglang_vericache.ops.reference import quant_paged_decode_reference

SHAPES = (
    DecodeShape("gqa4_h8_d128_b32x8k", batch=32, context=8192, num_q_heads=32, num_kv_heads=8,
                head_dim=128),
    DecodeShape("smollm2_h3_d64_b32x8k", batch=32, context=8192, num_q_heads=9, num_kv_heads=3,
                head_dim=64),
)
MAX_ERR = 5e-2  # bf16 outputs of O(1) attention over random data
VARIANTS = (  # (shape index, bits, dtype)
    (0, 4, torch.bfloat16), (0, 2, torch.bfloat16), (0, 4, torch.float16),
    (1, 4, torch.bfloat16), (1, 2, torch.bfloat16),
)
SPLITS = (None, 4, 8, 12, 16, 24, 32)
# Launch knobs (QuantDecodeLaunch fields), most promising first: the sweep stops when its
# budget runs out. Columns: num_warps, num_stages, fast_unpack, max_registers, min_group_rows,
# lazy_rescale, swapped_mma. The first row is the defaults. Static SASS with Triton 3.6 (the GPU
# image's), bf16 int4 GQA 4, per page: defaults 1127 instr at 1 warp / 234 regs; swapped MMA 894
# / 203 at 1 warp, 621 per thread / 159 regs at 2 warps, 623 / 128 regs (48 B spilled outside
# the loop) with max_registers=128, i.e. 16 resident warps per SM (kernels/README.md).
KNOBS = ("num_warps", "num_stages", "fast_unpack", "max_registers", "min_group_rows",
         "lazy_rescale", "swapped_mma")
KERNEL_VARIANTS = (
    (1, 2, True, None, 16, False, False), (2, 2, True, 128, 1, True, True),
    (2, 2, True, None, 1, True, True), (4, 2, True, None, 1, True, True),
    (1, 2, True, None, 1, True, True), (2, 3, True, 128, 1, True, True),
    (4, 3, True, None, 1, True, True), (1, 2, True, None, 1, True, False),
    (2, 2, True, 96, 1, True, True), (1, 2, True, 168, 1, True, True),
    (2, 4, True, 128, 1, True, True), (1, 2, True, 168, 1, True, False),
    (2, 2, True, None, 1, True, False), (2, 2, False, None, 1, True, True),
    (2, 2, True, 128, 1, False, True), (8, 2, True, None, 1, True, True),
    (1, 2, False, None, 16, False, False),
)
SMOKE_SHAPES = (  # CPU interpreter: exercises the script, measures nothing
    DecodeShape("smoke_gqa4", batch=2, context=200, num_q_heads=8, num_kv_heads=2, head_dim=64,
                page_size=16, recent_window=8),
    DecodeShape("smoke_gqa3", batch=2, context=120, num_q_heads=3, num_kv_heads=1, head_dim=64,
                page_size=16, recent_window=8),
)


def _wrapper(shape: DecodeShape, launch: QuantDecodeLaunch, inp, device: torch.device
             ) -> QuantPagedDecodeWrapper:
    ws = QuantDecodeWorkspace.allocate(max_batch=shape.batch, num_q_heads=shape.num_q_heads,
                                       head_dim=shape.head_dim, max_splits=32,
                                       max_pages=inp.batch.kv_page_indices.numel(), device=device)
    wrapper = QuantPagedDecodeWrapper(ws, launch)
    wrapper.plan(inp.batch, inp.cache, inp.window, num_q_heads=shape.num_q_heads)
    return wrapper


def bench_variant(shape: DecodeShape, bits: int, dtype: torch.dtype, copy_gbps: float,
                  device: torch.device, budget_s: float, smoke: bool) -> dict[str, object]:
    """Sweep kernel variants x splits on one input; each compiled variant is first checked
    against the float32 reference, and only correct ones are timed."""
    inp = random_quant_inputs(shape, bits, dtype, device)
    q = torch.randn(shape.batch, shape.num_q_heads, shape.head_dim, device=device).to(dtype)
    out = torch.empty_like(q)
    ref = quant_paged_decode_reference(q, inp.cache, inp.window, inp.batch).float()
    nbytes = decode_bytes_read(shape, bits, dtype)
    trials: list[dict[str, object]] = []
    started = time.monotonic()
    iters, repeats = (1, 1) if smoke else (20, 5)
    variants = KERNEL_VARIANTS[:2] if smoke else KERNEL_VARIANTS
    for variant in variants:
        if time.monotonic() - started > budget_s and trials:
            break
        knobs = dict(zip(KNOBS, variant))
        base = {"warps": knobs["num_warps"], "stages": knobs["num_stages"],
                "fast_unpack": knobs["fast_unpack"], "launch": knobs}
        for splits in (SPLITS[:2] if smoke else SPLITS):
            launch = QuantDecodeLaunch(DecodeBackend.TRITON, num_splits=splits, **knobs)
            try:
                wrapper = _wrapper(shape, launch, inp, device)
                if splits is None:  # once per compiled variant: is it right?
                    err = (wrapper.run(q, inp.cache, inp.window).float() - ref).abs().max().item()
                    base["max_abs_err"] = err
                    if not err < MAX_ERR:
                        trials.append({**base, "error": f"wrong result: max abs err {err:.3g}"})
                        break
                ms = time_ms(lambda: wrapper.run(q, inp.cache, inp.window, out=out), device,
                             iters=iters, repeats=repeats)
            except Exception as exc:  # a variant the compiler rejects is skipped, not fatal
                trials.append({**base, "splits": splits,
                               "error": f"{type(exc).__name__}: {exc}"[:300]})
                break
            trials.append({**base, "splits": wrapper.num_splits, "requested_splits": splits,
                           "us": ms * 1e3, "GBps": nbytes / (ms * 1e-3) / 1e9})
    timed = [t for t in trials if "us" in t]
    result: dict[str, object] = {
        "shape": shape, "bits": bits, "dtype": dtype, "bytes_read": nbytes,
        "dense_kv_bytes": dense_kv_bytes(shape, dtype), "trials": trials, "ok": bool(timed),
    }
    if timed:
        best = min(timed, key=lambda t: t["us"])
        result.update(best=best, pct_of_copy_bw=100.0 * best["GBps"] / copy_gbps,
                      max_abs_err_vs_reference=best["max_abs_err"])
        portable = [t for t in timed if not t["fast_unpack"]]
        if portable:
            result["best_portable_unpack_GBps"] = max(t["GBps"] for t in portable)
    return result


def _knobs_text(knobs: dict[str, object]) -> str:
    return ", ".join(f"{k} {v}" for k, v in knobs.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="gpu_out/quant_decode.json")
    parser.add_argument("--budget-s", type=float, default=20.0,
                        help="sweep time per variant before settling on the best so far")
    parser.add_argument("--key-budget-s", type=float, default=60.0,
                        help="sweep time for the first variant (int4 bf16, GQA 32/8, D=128)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one config (CPU ok)")
    args = parser.parse_args()
    device = bench_device(args.smoke)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    copy = measure_copy_bandwidth(device, nbytes=(1 << 20) if args.smoke else 2 * GIB)
    print(f"copy bandwidth: D2D {copy['d2d_copy_GBps']:.0f} GB/s (read+write), "
          f"H2D pinned {copy['h2d_pinned_GBps']:.1f} GB/s", flush=True)
    results = []
    for index, (shape_index, bits, dtype) in enumerate(VARIANTS):
        shape = shapes[shape_index]
        budget = args.key_budget_s if index == 0 else args.budget_s
        res = bench_variant(shape, bits, dtype, copy["d2d_copy_GBps"], device, budget,
                            args.smoke)
        results.append(res)
        if "best" in res:
            best = res["best"]
            print(f"{shape.name} int{bits} {str(dtype)[6:]}: {best['us']:.1f} us, "
                  f"{best['GBps']:.0f} GB/s = {res['pct_of_copy_bw']:.1f}% of copy bw "
                  f"(splits {best['splits']}, {_knobs_text(best['launch'])}); "
                  f"max err {res['max_abs_err_vs_reference']:.2e}", flush=True)
        else:
            print(f"{shape.name} int{bits} {str(dtype)[6:]}: no config ran: {res['trials'][:1]}",
                  flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_json(args.out, {"device": device_info(), "copy": copy, "results": results})


if __name__ == "__main__":
    main()
