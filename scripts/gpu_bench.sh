#!/usr/bin/env bash
# The one prepared GPU script named by issues 6/7: runs scripts/gpu_check.sh (kernel tests, the Triton
# draft decode's bench, drafting-under-copy overlap), so either name works. Outputs go to $OUT when
# set (the device tool's folder), else ./gpu_out (git-ignored).
# Usage: bash scripts/gpu_bench.sh     (env: OUT, PYTHON)
set -u
cd "$(dirname "$0")/.." || exit 2
export OUT=${OUT:-./gpu_out}
exec bash scripts/gpu_check.sh "$@"
