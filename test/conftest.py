"""Shared fixtures: the embedded model and one plain and one ``--vericache`` SGLang server per
test session.

A server start costs about 30 s on 2 cores, so tests share ``plain_server`` (the embedded default
model, no ``--vericache``) and ``vericache_server`` (the same arguments plus ``--vericache`` with
the default compressor) instead of starting their own. Both prefill in chunks of
``CHUNKED_PREFILL`` tokens, so a prompt longer than that exercises chunked prefill on both sides,
and allow ``return_hidden_states`` (``--return-hidden-states-mode full``: SGLang captures hidden
states only for the batches that ask, so the others run as without it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

# Tests never reach a model hub; everything they load is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CHUNKED_PREFILL = 512
SHARED_ARGS = ["--max-total-tokens", "16384", "--chunked-prefill-size", str(CHUNKED_PREFILL),
               "--return-hidden-states-mode", "full"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` run only where CUDA is (``scripts/gpu_check.sh``)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TRITON_KERNELS = ("sglang_vericache.ops.triton.pool_kivi_decode",)


@pytest.fixture
def triton_interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where there is no GPU, the package's Triton kernels run under Triton's CPU interpreter:
    ``triton.jit`` reads TRITON_INTERPRET when it decorates, so a kernel module imported without
    it is reloaded with it, and Triton reads it again at each launch, so it stays set for the
    test (and only for the test: SGLang in this process must not be switched to it)."""
    import importlib

    import torch

    if torch.cuda.is_available():
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for name in TRITON_KERNELS:
        module = importlib.import_module(name)
        if not module.kernel_is_interpreted():
            importlib.reload(module)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The converted embedded model (built on first use, verified on every session)."""
    from sglang_vericache.models import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="session")
def chunked_prefill_size() -> int:
    """The shared servers' ``--chunked-prefill-size``."""
    return CHUNKED_PREFILL


@pytest.fixture(scope="session")
def plain_server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """Plain SGLang on CPU serving the embedded default model (started without --model-path)."""
    from sglang_vericache.exactness.server import SGLangServer

    log = tmp_path_factory.mktemp("plain_server") / "server.log"
    with SGLangServer(SHARED_ARGS, log_path=log) as server:
        yield server


@pytest.fixture(scope="session")
def vericache_server(
    default_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator:
    """``plain_server``'s arguments plus ``--vericache`` (default compressor), a fixed draft
    length and ``--enable-metrics``: the candidate side of every shared comparison. Fixed, so
    every greedy step drafts: ``auto`` decodes plainly where drafting does not pay, which on
    these short test prompts is most steps, and would leave the drafted path untested."""
    from sglang_vericache.exactness.server import SGLangServer

    log = tmp_path_factory.mktemp("vericache_server") / "server.log"
    args = [*SHARED_ARGS, "--vericache", "--vericache-draft-len", "4", "--enable-metrics"]
    with SGLangServer(args, log_path=log) as server:
        yield server
