"""The CPU attention kernels' build: ``csrc/`` compiled once per source digest and CPU.

One extension holds both kernels of the CPU decode path (``csrc/module.cpp`` binds them):

- ``draft_decode`` (``cpu_draft_decode.py``): every row's one draft query over its compressed
  view, packed KIVI bodies read as stored;
- ``verify_decode`` (``cpu_verify_decode.py``): every row's verify queries over its full KV.

It is compiled on first use by torch's ``cpp_extension`` (about 30 s on 2 cores, then cached
under ``TORCH_EXTENSIONS_DIR``) for this CPU (``-march=native``; the cache name carries torch's
CPU capability, so a shared cache never hands AVX-512 code to an AVX2 host, and a digest of
the sources, so a stale build is never loaded). Where it cannot be built (no compiler, no
ninja, a read-only cache) the loader logs once and returns None; both paths then keep torch's
SDPA.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "module.cpp", CSRC / "draft_decode.cpp", CSRC / "verify_decode.cpp")
HEADERS = (CSRC / "packed_body.h",)  # included by draft_decode.cpp
# -fopenmp: ATen's parallel_for is an OpenMP region inlined from its headers (the symbols
# resolve to the libgomp torch loaded). No -ffast-math: the softmax starts from -inf.
CFLAGS = ("-O3", "-march=native", "-fopenmp")


def _source_digest() -> str:
    """8 hex digits of the sources and headers (torch rebuilds on a changed source, not on a
    changed header alone)."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:8]


@functools.cache
def load_cpu_kernels() -> Any | None:
    """Build (or load the cached build of) the extension; None, logged once, where that fails."""
    from torch.utils.cpp_extension import load

    capability = torch.backends.cpu.get_cpu_capability().lower()
    started = time.perf_counter()
    logger.info("building the CPU attention kernels for %s (about 30 s the first time, cached "
                "after)", capability)  # fmt: skip
    try:
        module = load(name=f"vericache_cpu_attention_{capability}_{_source_digest()}",
                      sources=[str(s) for s in SOURCES], extra_cflags=list(CFLAGS),
                      verbose=False)  # fmt: skip
    except Exception as exc:
        logger.warning("CPU attention kernels unavailable (%s: %s); drafts and verifies attend "
                       "with one SDPA call per row and layer", type(exc).__name__, exc)  # fmt: skip
        return None
    logger.info("CPU attention kernels ready in %.1f s", time.perf_counter() - started)
    return module
