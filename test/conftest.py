"""Shared fixtures: the embedded model and one plain SGLang server per test session.

A server start costs about 30 s on 2 cores, so tests share ``plain_server`` (the embedded default
model, no ``--vericache``) instead of starting their own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

# Tests never reach a model hub; everything they load is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The converted embedded model (built on first use, verified on every session)."""
    from sglang_vericache.models import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="session")
def plain_server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """Plain SGLang on CPU serving the embedded default model (started without --model-path)."""
    from sglang_vericache.exactness.server import SGLangServer

    log = tmp_path_factory.mktemp("plain_server") / "server.log"
    with SGLangServer(["--max-total-tokens", "16384"], log_path=log) as server:
        yield server
