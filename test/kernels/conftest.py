"""Kernel tests run the Triton kernels on a GPU when present, else under Triton's CPU interpreter.

TRITON_INTERPRET must be set when the kernels' module is imported (triton.jit reads it when
decorating), hence here, before any test module runs a kernel.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch


def _load_kernels_interpreted() -> None:
    """Build the kernels with Triton's CPU interpreter, then restore the environment so that
    nothing else in this pytest process (other suites, SGLang) is switched to the interpreter."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = importlib.import_module("sglang_vericache.ops.triton.quant_decode_kernels")
        if not module.kernels_are_interpreted():
            importlib.reload(module)
        swapped = importlib.import_module("sglang_vericache.ops.triton.quant_decode_swapped")
        importlib.reload(swapped)  # its kernel must be interpreted too
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


if not torch.cuda.is_available():
    _load_kernels_interpreted()


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch: pytest.MonkeyPatch, triton_interpreted: None) -> None:
    """Triton checks TRITON_INTERPRET again while launching interpreted kernels: keep it set for
    the duration of each kernel test only."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def cpu_kernels():
    """The CPU attention build (``ops/cpu_kernels.py``). Built here: a CPU host that runs the
    tests has the compiler SGLang's own install needs, so a missing build is a failure, not a
    skip (drafts and verifies would fall back to the SDPA loop)."""
    from sglang_vericache.ops.cpu_kernels import load_cpu_kernels

    built = load_cpu_kernels()
    assert built is not None, "the CPU attention kernels did not build (see the log)"
    return built
