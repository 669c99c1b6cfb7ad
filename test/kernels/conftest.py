"""Kernel tests run the Triton kernels on a GPU when present, else under Triton's CPU interpreter.

TRITON_INTERPRET must be set before the kernels' module is imported (triton.jit reads it when
decorating), hence here, before any test module imports sglang_vericache.ops.triton.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
