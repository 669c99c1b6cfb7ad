#!/usr/bin/env bash
# Regenerate every number, table and plot in benchmark/results/, one benchmark after another
# (they would skew each other's timings if run together). About 4-5 hours on 2 shared CPU cores;
# each step prints its own progress bar. Run from anywhere:
#
#     bash benchmark/run_all.sh            # PY=path/to/python to use another interpreter
#
# The GPU numbers come from scripts/gpu_bench.sh on a GPU machine (see benchmark/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

step() { echo; echo "=== $* ==="; "$PY" "$@"; }

step benchmark/compressors.py                                    # drafts from each compressor
step benchmark/capacity.py --max-new-tokens 256                  # requests per KV budget, speed
step benchmark/capacity.py --max-new-tokens 64 --n-full 2 3 6 12 --requests 8 \
    --compressors snapkv:ratio=0.25 --out benchmark/results/budget_sweep   # Fig. 13 analogue
step benchmark/rate_sweep.py                                     # latency vs request rate (~13 min)
step benchmark/exactness_sweep.py                                # 6 compressors x conc 1 and 8
step benchmark/remote_prefix.py                                  # prefixes across replicas
step benchmark/fetch_drafting.py                                 # draft while fetching vs not
step benchmark/model.py                                          # cost model, H200 projection
