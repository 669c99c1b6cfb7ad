#!/usr/bin/env bash
# Builds .venv-lmcache at the repo root: this project (editable) with its [test] extra and the
# LMCache pinned by its [lmcache] extra, in a venv of its own, so LMCache's heavy dependency tree
# (cupy, cuda-python, cufile, older numpy/protobuf/setuptools; notes/lmcache-cpu.md) never
# reaches the .venv that CI uses.
#
#   bash scripts/lmcache_venv.sh              # then: .venv-lmcache/bin/python benchmark/lmcache_e2e.py
#   FORCE=1 bash scripts/lmcache_venv.sh      # reinstall even when the stamp says it is current
#
# Why not plain `pip install -e '.[test,lmcache]'`: pip finds no solution. lmcache 0.5.6 requires
# grpcio-observability==1.78.0, which pins grpcio==1.78.0, while sglang 0.5.23 requires
# smg-grpc-servicer, every release of which needs grpcio>=1.81.1. lmcache never imports
# grpc_observability (it is for gRPC telemetry), so this script installs the lmcache wheel with
# --no-deps and then every other requirement lmcache declares, read from its own metadata,
# resolved together with this project: pip then settles on numpy 2.2.6, protobuf 6.33,
# grpcio-reflection/-health-checking 1.81.1, fastapi 0.141, opentelemetry 1.40, setuptools 80.
# `pip check` reports exactly that one missing package, which is accepted; anything else fails.
# torch stays sglang's pin (2.14.1, the CUDA build, as in .venv): lmcache's CUDA ops do not load
# with it (ABI mismatch), and LMCache uses its torch fallback, which is all a CPU run needs.
#
# Idempotent: a stamp records a hash of pyproject.toml and of this script; when both are unchanged
# and the imports still work, a rerun checks and exits in seconds. First run: ~10 min, ~11 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV="$REPO/.venv-lmcache"
PY="$VENV/bin/python"
STAMP="$VENV/.vericache-lmcache-stamp"
START=$(date +%s)
log() { echo "[lmcache_venv +$(( $(date +%s) - START ))s] $*"; }
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1

want=$(cat pyproject.toml "$0" | sha256sum | cut -c1-16)
check_imports() {
  "$PY" - <<'EOF'
import importlib.metadata as md
import torch, lmcache, sglang, sglang_vericache  # noqa: F401
from sglang_vericache.tier.lmcache import import_lmcache
import_lmcache()  # the exact lmcache names the adapter uses
print("  torch", torch.__version__, "| lmcache", md.version("lmcache"), "| sglang",
      md.version("sglang"), "| numpy", md.version("numpy"), "| grpcio", md.version("grpcio"))
EOF
}

if [ -x "$PY" ] && [ "${FORCE:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  log "stamp matches; checking imports"
  if check_imports; then
    log "ready: $VENV (nothing to do; FORCE=1 reinstalls)"
    exit 0
  fi
  log "imports failed; reinstalling"
fi

if [ ! -x "$PY" ]; then
  log "creating $VENV"
  python3 -m venv "$VENV"
fi

pip_quiet() {  # pip without the wall of "already satisfied" lines; fails when pip fails
  set +o pipefail
  "$PY" -m pip "$@" --progress-bar off 2>&1 \
    | grep --line-buffered -v -e '^Requirement already satisfied' -e '^  Using cached'
  local rc=${PIPESTATUS[0]}
  set -o pipefail
  [ "$rc" = 0 ] || { log "pip $1 failed (status $rc)"; exit "$rc"; }
}

# The pin lives in one place: pyproject.toml's [lmcache] extra.
pin=$("$PY" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["lmcache"][0])')
log "installing $pin (wheel only; its requirements follow)"
pip_quiet install --no-deps "$pin"

reqs="$VENV/lmcache-requirements.txt"
"$PY" - "$reqs" <<'EOF'
import importlib.metadata as md, re, sys
keep = []
for req in md.requires("lmcache") or []:
    name = re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
    if "extra ==" in req or name == "grpcio-observability":  # see the header
        continue
    keep.append(req)
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
EOF
log "installing -e '.[test]' with lmcache's other $(wc -l < "$reqs") requirements (first run: minutes)"
pip_quiet install -e "$REPO[test]" -r "$reqs"

log "pip check (grpcio-observability is missing on purpose)"
broken=$("$PY" -m pip check 2>&1 | grep -v -i -e 'grpcio-observability' -e '^No broken requirements' || true)
[ -z "$broken" ] || { echo "$broken"; log "pip check reports broken requirements"; exit 1; }

log "import check"
check_imports
[ -x "$VENV/bin/lmcache" ] || { log "no lmcache console script in $VENV/bin"; exit 1; }

echo "$want" > "$STAMP"
log "ready: $VENV"
