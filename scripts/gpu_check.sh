#!/usr/bin/env bash
# GPU check for the ops/ kernels (issue 7), one run on a CUDA machine that has torch + triton.
# Needs nothing else: step 1 imports only sglang_vericache.ops (no sglang) from this working tree.
#   1. kernel-vs-reference tests on the GPU (pytest), and the srt glue's GPU tests where SGLang
#      is installed
#   2. the Triton draft decode over KIVI pool pages: bandwidth vs measured copy bandwidth and
#      speed vs the per-row fallback (B=32 x 8k)
#   3. draft step time alone vs with a concurrent pinned H2D full-KV copy on a side stream
# Writes JSON (and the log) to $OUT (default ./gpu_out); ends with one SUMMARY line.
# Budget: about 4 minutes (tests ~60 s, decode bench ~60 s, overlap ~15 s, or twice that when
# CUDA_DEVICE_MAX_CONNECTIONS / CUDA_LAUNCH_BLOCKING are set); every step has a hard timeout.
# Usage: bash scripts/gpu_check.sh        (env: OUT, PYTHON)
set -u
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
: > "$OUT/steps.txt"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
export PYTHONPATH="python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
PY=${PYTHON:-python3}
START=$(date +%s)

log() { echo "[gpu_check +$(( $(date +%s) - START ))s] $*"; }

step() {  # step NAME LIMIT_S CMD...
  local name=$1 limit=$2
  shift 2
  log "start $name (limit ${limit}s): $*"
  timeout -k 10 "$limit" "$@"
  local rc=$?
  [ "$rc" -eq 124 ] && log "$name TIMED OUT"
  log "end $name rc=$rc"
  echo "$name $rc" >> "$OUT/steps.txt"
}

step env 30 "$PY" -c "
import json, torch, triton
ok = torch.cuda.is_available()
info = {'torch': torch.__version__, 'triton': triton.__version__, 'cuda': ok,
        'gpu': torch.cuda.get_device_name(0) if ok else None}
print(info); json.dump(info, open('$OUT/env.json', 'w'))
raise SystemExit(0 if ok else 1)"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv 2>/dev/null || true
# Settings that serialise streams (one hardware queue, synchronous launches) would void the overlap
# measurement: log them; if set, the overlap bench also runs once without them.
log "stream-relevant env: CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS-<unset>}" \
  "CUDA_LAUNCH_BLOCKING=${CUDA_LAUNCH_BLOCKING-<unset>}" \
  "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF-<unset>}"

if "$PY" -c "import pytest" 2>/dev/null; then
  XDIST=()  # parallel workers overlap Triton compiles
  "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 8)
  step kernel_tests 150 "$PY" -m pytest test/kernels -q -p no:cacheprovider -rs ${XDIST[@]+"${XDIST[@]}"} \
    --junitxml="$OUT/kernel_tests.xml"
else
  log "pytest not found: the decode bench below still checks the kernel against its reference"
  echo "kernel_tests skipped" >> "$OUT/steps.txt"
fi

# The GPU tests of the serving glue (staging a verify's full KV: srt/kv/full_kv_stage.py) need SGLang
if "$PY" -c "import pytest, sglang" 2>/dev/null; then
  step srt_gpu_tests 120 "$PY" -m pytest test/srt -m gpu -q -p no:cacheprovider -rs \
    --junitxml="$OUT/srt_gpu_tests.xml"
else
  log "sglang not importable: skipping the srt GPU tests"
fi

step pool_kivi_decode_bench 150 "$PY" kernels/bench_pool_kivi_decode.py \
  --out "$OUT/pool_kivi_decode.json"
step overlap_bench 90 "$PY" kernels/bench_overlap.py --out "$OUT/overlap.json"
if [ -n "${CUDA_DEVICE_MAX_CONNECTIONS:-}${CUDA_LAUNCH_BLOCKING:-}" ]; then
  step overlap_env_unset 90 env -u CUDA_DEVICE_MAX_CONNECTIONS -u CUDA_LAUNCH_BLOCKING \
    "$PY" kernels/bench_overlap.py --out "$OUT/overlap_env_unset.json"
fi

log "done in $(( $(date +%s) - START ))s; step exit codes: $(tr '\n' ' ' < "$OUT/steps.txt")"
"$PY" kernels/summarize.py "$OUT"
