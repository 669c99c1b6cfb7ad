"""Tier tests use their own shared secret file and identity cache, never the user's.

Set before any server process starts, so every ``ServerProcess`` (which inherits the
environment) and every client in the test process resolve the same secret file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from sglang_vericache.tier.identity import CACHE_ENV
from sglang_vericache.tier.secret import SECRET_ENV, SECRET_FILE_ENV


@pytest.fixture(scope="session", autouse=True)
def isolated_tier_secret(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    base = tmp_path_factory.mktemp("tier-home")
    saved = {k: os.environ.get(k) for k in (SECRET_ENV, SECRET_FILE_ENV, CACHE_ENV)}
    os.environ.pop(SECRET_ENV, None)  # the generated file is what most tests exercise
    os.environ[SECRET_FILE_ENV] = str(base / "tier_secret")
    os.environ[CACHE_ENV] = str(base / "identity")
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
