"""Draft attention over KIVI bodies in the pool's pages: the Triton kernel against what drafting
does without it, and against the device's copy bandwidth.

For each (shape, bits) at bfloat16: a batch of draft rows (``bench_common.pool_kivi_inputs``:
B x 8k tokens, the body int-b in pool pages, the newest 128+ tokens float slots). It checks
``PoolKiviDecode`` against the float32 reference on those inputs, then times one layer's run
with the plan's own splits and a few forced ones, and the fallback ``srt/attention/draft_attention.py``
takes without the kernel (each row's body dequantized, then one SDPA call per row). Reported:
GB/s = bytes the decode must read / time, as a share of the measured D2D copy bandwidth (read +
written per second), and the speedup over the fallback.

Run: PYTHONPATH=python python kernels/bench_pool_kivi_decode.py [--smoke]
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_common import (
    DecodeShape,
    bench_device,
    device_info,
    measure_copy_bandwidth,
    pool_kivi_bytes_read,
    pool_kivi_inputs,
    time_ms,
    write_json,
)

from sglang_vericache.ops.pool_kivi_decode import PoolKiviDecode
from sglang_vericache.ops.reference import pool_kivi_decode_reference

SHAPES = (
    DecodeShape("gqa4_h8_d128_b32x8k", batch=32, context=8192, num_q_heads=32, num_kv_heads=8,
                head_dim=128),
    DecodeShape("smollm2_h3_d64_b32x8k", batch=32, context=8192, num_q_heads=9, num_kv_heads=3,
                head_dim=64),
)
SMOKE_SHAPES = (DecodeShape("smoke", batch=2, context=80, num_q_heads=4, num_kv_heads=2,
                            head_dim=16, group=16, recent_window=8),)
VARIANTS = ((0, 4), (0, 2), (1, 4), (1, 2))  # (shape index, bits), bfloat16
FORCED_SPLITS = (1, 4, 16, 32)
MAX_ERR = 5e-2  # bf16 outputs of attention over random data


def fallback(inputs, scale: float) -> torch.Tensor:
    """What a draft forward does without the kernel: dequantize each row's body, then one SDPA
    call per row over it and the row's slots."""
    out = torch.empty_like(inputs.q)
    for i, (slots, body) in enumerate(zip(inputs.columns, inputs.bodies)):
        body_keys, body_values = body.dequantize()
        at = slots.to(inputs.key_buffer.device)
        keys = torch.cat([body_keys, inputs.key_buffer[at].transpose(0, 1)], dim=1)
        values = torch.cat([body_values, inputs.value_buffer[at].transpose(0, 1)], dim=1)
        out[i] = torch.nn.functional.scaled_dot_product_attention(
            inputs.q[i, :, None].unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
            scale=scale, enable_gqa=True)[0, :, 0]  # fmt: skip
    return out


def bench_variant(shape: DecodeShape, bits: int, device: torch.device, copy_gbps: float | None,
                  smoke: bool) -> dict:  # fmt: skip
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # interpreter: no bf16
    inputs = pool_kivi_inputs(shape, bits, dtype, device)
    scale = shape.head_dim**-0.5
    decoder = PoolKiviDecode(device)
    decoder.plan(inputs.columns, inputs.bodies, inputs.key_buffer, shape.num_q_heads)
    auto_splits = decoder.plan_.splits

    def run() -> torch.Tensor:
        return decoder.run(inputs.q, inputs.key_buffer, inputs.value_buffer, scale)

    want = pool_kivi_decode_reference(inputs.q, inputs.key_buffer, inputs.value_buffer,
                                      inputs.columns, inputs.bodies, scale).float()  # fmt: skip
    err = (run().float() - want).abs().max().item()
    result = {"shape": shape, "bits": bits, "dtype": str(dtype), "max_abs_err": err,
              "ok": err <= MAX_ERR, "bytes_read": pool_kivi_bytes_read(shape, bits, dtype)}
    if smoke:
        return result
    timings = {f"auto ({auto_splits})": time_ms(run, device)}
    for splits in FORCED_SPLITS:
        decoder.plan(inputs.columns, inputs.bodies, inputs.key_buffer, shape.num_q_heads, splits)
        timings[str(splits)] = time_ms(run, device)
    best = min(timings, key=timings.get)
    fallback_ms = time_ms(lambda: fallback(inputs, scale), device, iters=3, repeats=3)
    gbps = result["bytes_read"] / (timings[best] * 1e-3) / 1e9
    result.update(
        splits_ms=timings, best_splits=best, us=timings[best] * 1e3, GBps=gbps,
        pct_of_copy_bw=100 * gbps / copy_gbps if copy_gbps else None,
        fallback_ms=fallback_ms, speedup_over_fallback=fallback_ms / timings[best],
    )
    print(f"{shape.name} int{bits}: {result['us']:.1f} us ({best} splits), {gbps:.0f} GB/s = "
          f"{result['pct_of_copy_bw'] or 0:.1f}% of copy bw; fallback {fallback_ms:.2f} ms "
          f"({result['speedup_over_fallback']:.1f}x); max err {err:.1e}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="gpu_out/pool_kivi_decode.json")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes under Triton's CPU interpreter: checks, no timings")
    args = parser.parse_args()
    device = bench_device(args.smoke)
    started = time.perf_counter()
    copy = None if args.smoke else measure_copy_bandwidth(device)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    variants = ((0, 4), (0, 2)) if args.smoke else VARIANTS
    results = []
    for index, bits in variants:
        print(f"[{time.perf_counter() - started:.0f}s] {shapes[index].name} int{bits} ...",
              flush=True)  # fmt: skip
        results.append(bench_variant(shapes[index], bits, device,
                                     copy and copy["d2d_copy_GBps"], args.smoke))  # fmt: skip
    write_json(args.out, {"device": device_info(), "copy": copy, "results": results})
    failed = [r for r in results if not r["ok"]]
    print(f"pool_kivi_decode: {len(results) - len(failed)}/{len(results)} variants agree with "
          f"the reference", flush=True)  # fmt: skip
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
