"""How torch's OpenMP threads should wait between parallel regions on a CPU server.

A decode step runs thousands of small parallel regions (8-row matmuls, one attention per row and
layer). Between two of them a worker thread either spins (OpenMP's default: ~300k iterations),
sleeps at once (``OMP_WAIT_POLICY=PASSIVE``), or spins briefly (``GOMP_SPINCOUNT=N``). Spinning
is fastest while the process has the cores to itself and collapses when other busy processes
share them; sleeping pays a thread wake-up per region. ``srt/platform.py`` picks from this.

Each configuration runs, in fresh processes started together, K = 1, 2, 3 at once:

    pairs   3,000 x (an 8-row x 576 -> 1536 matmul, one 9-head query over 1k keys)
    draft   a draft forward's attention: 8 rows x 30 layers, one SDPA per row and layer, over a
            1k-token view in a wider buffer with two chain tokens written after it (K = 1 only)

    python benchmark/omp_wait.py                    # writes benchmark/results/omp_wait.{json,md}
    python benchmark/omp_wait.py --spin 300 1000 3000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

WORK = r"""
import sys, time, torch
from torch.nn.functional import scaled_dot_product_attention as sdpa
torch.manual_seed(0)
if sys.argv[1] == "pairs":
    x, ws = torch.randn(8, 576), [torch.randn(1536, 576) for _ in range(30)]
    q, k = torch.randn(1, 9, 1, 64), torch.randn(1, 3, 1000, 64)
    start = time.perf_counter()
    for i in range(3000):
        torch.nn.functional.linear(x, ws[i % 30])
        sdpa(q, k, k, enable_gqa=True)
    print(time.perf_counter() - start)
else:
    bufs = [[(torch.randn(3, 1200, 64), torch.randn(3, 1200, 64)) for _ in range(8)]
            for _ in range(30)]
    pool, q, best = torch.randn(40000, 3, 64), torch.randn(8, 9, 64), float("inf")
    for _ in range(6):
        start = time.perf_counter()
        for layer in bufs:
            for i, (k, v) in enumerate(layer):
                chain = pool[torch.tensor([5 + i, 9000 + i])].transpose(0, 1)
                k[:, 1000:1002] = chain
                v[:, 1000:1002] = chain
                sdpa(q[i, :, None].unsqueeze(0), k[:, :1002].unsqueeze(0),
                     v[:, :1002].unsqueeze(0), scale=0.125, enable_gqa=True)
        best = min(best, time.perf_counter() - start)
    print(best)
"""


# result column -> (workload, processes started together)
COLUMNS = {"1": ("pairs", 1), "2": ("pairs", 2), "3": ("pairs", 3), "draft": ("draft", 1)}


def configs(spins: list[int]) -> dict[str, dict[str, str]]:
    out = {"default spin": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
    out.update({f"spin {n}": {"GOMP_SPINCOUNT": str(n)} for n in spins})
    return out


def run_together(kind: str, env: dict[str, str], k: int) -> list[float]:
    """Seconds each of ``k`` processes took, started together."""
    base = {n: v for n, v in os.environ.items() if n not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    procs = [subprocess.Popen([sys.executable, "-c", WORK, kind], env={**base, **env},
                              stdout=subprocess.PIPE, text=True) for _ in range(k)]  # fmt: skip
    return [float(p.communicate()[0]) for p in procs]


def markdown(report: dict) -> str:
    lines = ["# OpenMP wait policy on this machine's cores (`omp_wait.py`)", "",
             f"{os.cpu_count()} CPUs, {report['rounds']} rounds; seconds per process "
             "(min-max over rounds and processes).", "",
             "| configuration | pairs, alone | pairs, 2 at once | pairs, 3 at once | "
             "draft attention, alone (ms per forward) |", "|---|---|---|---|---|"]  # fmt: skip
    for name, row in report["results"].items():
        cells = [f"{min(v):.2f}-{max(v):.2f}" for v in (row["1"], row["2"], row["3"])]
        draft = f"{1e3 * min(row['draft']):.0f}-{1e3 * max(row['draft']):.0f}"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {draft} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spin", type=int, nargs="+", default=[1000])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmark/results/omp_wait"))
    args = parser.parse_args()
    table = configs(args.spin)
    results = {name: {column: [] for column in COLUMNS} for name in table}
    jobs = [(name, column) for _ in range(args.rounds) for name in table for column in COLUMNS]
    started = time.perf_counter()
    for name, column in tqdm(jobs, desc="omp_wait"):  # rounds alternate the configurations
        kind, k = COLUMNS[column]
        results[name][column] += run_together(kind, table[name], k)
    report = {"rounds": args.rounds, "configs": table, "results": results,
              "wall_s": round(time.perf_counter() - started, 1)}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
