"""Throughput of a full-KV tier: put then fetch one sequence's KV, report MB/s as JSON.

    python scripts/tier_bench.py                           # starts its own zmq server
    python scripts/tier_bench.py --bandwidth-mbps 100      # ... throttled to 100 MB/s
    python scripts/tier_bench.py --spec zmq://127.0.0.1:7300 --tokens 8192
    python scripts/tier_bench.py --spec host

Geometry defaults to SmolLM2-135M (30 layers, 3 KV heads, head dim 64, fp32, 256-token chunks).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from sglang_vericache.tier import KVGeometry, alloc_chunks, chunk_keys, join_chunks, open_tier
from sglang_vericache.tier import split_chunks
from sglang_vericache.tier.base import FullKVTier, TaskId, TaskResult
from sglang_vericache.tier.factory import TierOptions


def wait(tier: FullKVTier, task: TaskId, timeout_s: float) -> TaskResult:
    deadline = time.monotonic() + timeout_s
    while True:
        done = tier.poll()
        if task in done:
            return done[task]
        if time.monotonic() > deadline:
            raise TimeoutError(f"task {task} not done in {timeout_s}s")
        time.sleep(0.0005)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--spec", default=None, help="tier spec; default: start a local zmq server")
    p.add_argument("--bandwidth-mbps", type=float, default=None,
                   help="throttle of the server this script starts (MB/s)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    server = None
    spec = args.spec
    if spec is None:
        cmd = [sys.executable, "-m", "sglang_vericache.tier.server", "--port", "0",
               "--capacity-gb", "4", "--log-level", "WARNING"]
        if args.bandwidth_mbps:
            cmd += ["--bandwidth-mbps", str(args.bandwidth_mbps)]
        server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        spec = "zmq://" + server.stdout.readline().split()[-1].removeprefix("tcp://")
    try:
        g = KVGeometry("bench-model", args.layers, args.kv_heads, args.head_dim, args.dtype,
                       args.chunk_tokens)
        tier = open_tier(spec, g, TierOptions(timeout_s=600, host_capacity_bytes=8 << 30))
        kv = torch.randn(args.layers, 2, args.kv_heads, args.tokens, args.head_dim)
        kv = kv.to(g.torch_dtype)
        keys = chunk_keys(g, list(range(args.tokens)))
        megabytes = kv.nbytes / 1e6
        t0 = time.perf_counter()
        put = wait(tier, tier.submit_put(keys, split_chunks(kv, g)), 600)
        put_s = time.perf_counter() - t0
        fetch_s = []
        dst = alloc_chunks(g, args.tokens)
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            got = wait(tier, tier.submit_fetch(keys, dst), 600)
            fetch_s.append(time.perf_counter() - t0)
        exact = got.all_ok and torch.equal(join_chunks(dst), kv)
        print(json.dumps({
            "spec": spec, "megabytes": round(megabytes, 1), "chunks": len(keys),
            "put_ok": put.all_ok, "put_s": round(put_s, 4),
            "put_mb_s": round(megabytes / put_s, 1), "fetch_s": [round(s, 4) for s in fetch_s],
            "fetch_mb_s_best": round(megabytes / min(fetch_s), 1), "bit_exact": exact,
            "client_stats": tier.stats(),
        }, indent=1))
        tier.close()
        return 0 if exact else 1
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
