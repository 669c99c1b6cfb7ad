"""Kernel tests run the Triton kernels on a GPU when present, else under Triton's CPU interpreter
(``triton_interpreted``, test/conftest.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _interpreter_env(triton_interpreted: None) -> None:
    """Every kernel test gets the interpreter where there is no GPU."""


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
