"""A real ``lmcache server`` as the remote full-KV tier of a real ``--vericache`` server.

One request writes a prefix through to LMCache; the device radix cache is then flushed, so the
next request with that prefix can only get it from LMCache; both answers must equal plain
SGLang's. Skipped without the ``[lmcache]`` extra (CI's venv does not have it); run it from the
LMCache venv:

    bash scripts/lmcache_venv.sh
    .venv-lmcache/bin/python -m pytest test/e2e/test_lmcache_tier.py -m lmcache
"""

from __future__ import annotations

import importlib.util
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from sglang_vericache.exactness.server import SGLangServer, http_json

HAVE_LMCACHE = importlib.util.find_spec("lmcache") is not None

pytestmark = [
    pytest.mark.lmcache, pytest.mark.sglang, pytest.mark.model, pytest.mark.timeout(1200),
    pytest.mark.skipif(not HAVE_LMCACHE, reason="lmcache is not importable: needs the "
                       "[lmcache] extra, built by scripts/lmcache_venv.sh (.venv-lmcache)"),
]

CHUNK = 128  # srt/prefix/radix_cache.py REMOTE_CHUNK_TOKENS; the lmcache server's --chunk-size
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def lmcache_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    from testkit.lmcache_server import LMCacheServerProcess

    log = tmp_path_factory.mktemp("lmcache") / "lmcache-server.log"
    with LMCacheServerProcess(CHUNK, l1_size_gb=0.5, log_path=log) as server:
        yield server


@pytest.fixture(scope="module")
def lmcache_vericache_server(lmcache_server, tmp_path_factory) -> Iterator[SGLangServer]:
    from testkit.lmcache_server import QUIET_ENV

    args = ["--max-total-tokens", "16384", "--chunked-prefill-size", "512", "--vericache",
            "--vericache-tier", lmcache_server.spec, "--enable-metrics"]
    log = tmp_path_factory.mktemp("lmcache_vericache") / "server.log"
    with SGLangServer(args, log_path=log, env=QUIET_ENV) as server:
        yield server


def _generate(server: SGLangServer, ids: list[int]) -> dict:
    return http_json(server.url + "/generate", {
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS}})


def _hit_tokens(server: SGLangServer) -> float:
    import re

    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    found = re.search(r'vericache:tier_link_events\{[^}]*event="hits_tokens"[^}]*\} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def test_prefix_written_to_lmcache_is_hit_after_the_device_cache_is_flushed(
        lmcache_server, lmcache_vericache_server, plain_server, default_model_path: Path) -> None:
    from transformers import AutoTokenizer

    from testkit.lmcache_server import server_geometry, stored_chunks

    server = lmcache_vericache_server
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    text = "Notes on lighthouses. " + " ".join(
        f"Section {i}: the lighthouse rule number {i} says that every lamp must be checked "
        "twice before dusk." for i in range(40))
    ids = tokenizer.encode(text)[:700]
    chunks = len(ids) // CHUNK

    first = _generate(server, ids)
    assert first["output_ids"] == _generate(plain_server, ids)["output_ids"]
    # the write-through is asynchronous: ask LMCache itself, with the server's own keys
    geometry = server_geometry(default_model_path, CHUNK)
    deadline = time.monotonic() + 120
    while stored_chunks(lmcache_server.spec, geometry, ids) < chunks:
        assert time.monotonic() < deadline, f"LMCache never held the prefix's {chunks} chunks"
        time.sleep(0.5)

    flush = urllib.request.Request(server.url + "/flush_cache", method="POST")
    with urllib.request.urlopen(flush, timeout=60) as resp:  # HTTP 400 (raised) if it refused
        assert resp.status == 200  # the device copy is gone: only LMCache has the prefix now
    hits_before = _hit_tokens(server)
    turn2 = ids + tokenizer.encode(" Which rule is checked first?")
    got = _generate(server, turn2)
    assert got["meta_info"]["cached_tokens"] >= chunks * CHUNK, got["meta_info"]
    assert _hit_tokens(server) - hits_before >= chunks * CHUNK
    assert got["output_ids"] == _generate(plain_server, turn2)["output_ids"]
