"""Kernel-vs-reference check without pytest (fallback for machines that lack it).

Runs the Triton decode on the current device (CUDA, or CPU with TRITON_INTERPRET=1) over a grid
of shapes, bits and dtypes; prints one line per case, exits 1 on any mismatch.
Usage: PYTHONPATH=python python kernels/selfcheck.py [--out results.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from sglang_vericache.ops.quant_decode import (
    DecodeBackend,
    QuantDecodeLaunch,
    QuantDecodeWorkspace,
    QuantPagedDecodeWrapper,
)
from sglang_vericache.ops.quant_pack import build_quant_paged_batch
from sglang_vericache.ops.reference import quant_paged_decode_reference

ATOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
CASES = (  # (lengths, H_q, H_kv, D, page, window, splits)
    ([70, 5, 130], 6, 2, 64, 16, 8, 3),
    ([100, 60], 9, 3, 64, 24, 3, 2),
    ([300, 257, 31], 32, 8, 128, 32, 16, 4),
)


def run_case(lengths: list[int], heads_q: int, heads_kv: int, dim: int, page: int, window: int,
             splits: int, bits: int, dtype: torch.dtype, device: torch.device) -> float:
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(heads_kv, n, dim, generator=gen).to(dtype).to(device) for n in lengths]
    values = [torch.randn(heads_kv, n, dim, generator=gen).to(dtype).to(device) for n in lengths]
    inp = build_quant_paged_batch(keys, values, page_size=page, bits=bits, recent_window=window,
                                  num_pages=sum(n // page for n in lengths) + 2, generator=gen)
    ws = QuantDecodeWorkspace.allocate(max_batch=len(lengths), num_q_heads=heads_q, head_dim=dim,
                                       max_splits=8, max_pages=inp.cache.num_pages, device=device)
    launch = QuantDecodeLaunch(DecodeBackend.TRITON, num_splits=splits)
    wrapper = QuantPagedDecodeWrapper(ws, launch)
    wrapper.plan(inp.batch, inp.cache, inp.window, num_q_heads=heads_q)
    q = torch.randn(len(lengths), heads_q, dim, generator=gen).to(dtype).to(device)
    out = wrapper.run(q, inp.cache, inp.window)
    ref = quant_paged_decode_reference(q, inp.cache, inp.window, inp.batch)
    return (out.float() - ref.float()).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows, failed = [], 0
    for case, bits, dtype in itertools.product(CASES, (4, 2), tuple(ATOL)):
        try:
            err = run_case(*case, bits=bits, dtype=dtype, device=device)
            ok = err <= ATOL[dtype]
        except Exception as exc:  # report and continue: one broken case must not hide others
            err, ok = float("nan"), False
            print(f"  error: {type(exc).__name__}: {exc}")
        failed += not ok
        rows.append({"case": case, "bits": bits, "dtype": str(dtype), "max_err": err, "ok": ok})
        print(f"{'ok  ' if ok else 'FAIL'} H_q={case[1]} H_kv={case[2]} D={case[3]} P={case[4]} "
              f"int{bits} {str(dtype)[6:]}: max err {err:.2e}", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": str(device), "cases": rows, "failed": failed}, fh, indent=2)
    print(f"selfcheck: {len(rows) - failed}/{len(rows)} passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
