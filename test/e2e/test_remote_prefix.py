"""Remote prefix reuse through the zmq KV server, between two real --vericache servers.

One KV server process on 127.0.0.1 (throttled, fault injection on) is shared by servers A and
B. A prefix computed on A is a hit on B (also for a turn sent to B the moment A answered: the
prompt is written through as its prefill completes); the next turn on A hits the prefix A kept on its device
(the pool has room); on a replica whose pool is short, an evicted turn is demoted (compressed KV
kept) and its next turn drafts while its full KV is fetched; a corrupted chunk, and a KV server killed in the middle of a fetch, make B
recompute, with output token-identical to plain SGLang every time.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from sglang_vericache.exactness.server import SGLangServer, http_json
from sglang_vericache.tier.admin import server_request
from sglang_vericache.tier.protocol import Op

from testkit.tier_server import ServerProcess

pytestmark = [pytest.mark.sglang, pytest.mark.model, pytest.mark.timeout(1200)]

CHUNK = 128  # srt/prefix/radix_cache.py REMOTE_CHUNK_TOKENS
NEW_TOKENS = 12
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M fp32: layers x (K, V) x heads x dim
LOOKUP_DEADLINE_S = 10  # long enough to tell a request held up behind a hung lookup apart


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


@pytest.fixture(scope="module")
def kv_server() -> Iterator[ServerProcess]:
    # 40 MB/s: a 700-token prefix (~32 MB of fp32 KV) takes ~0.8 s, long enough to kill it
    with ServerProcess("--fault-injection", "--bandwidth-mbps", "40", capacity_gb=1.0) as proc:
        yield proc


@pytest.fixture(scope="module")
def servers(kv_server, tmp_path_factory) -> Iterator[tuple[SGLangServer, SGLangServer]]:
    args = ["--max-total-tokens", "16384", "--vericache", "--vericache-draft-len", "4",
            "--vericache-tier", kv_server.spec, "--enable-metrics",
            "--vericache-tier-inflight-mb", "256",
            "--vericache-tier-lookup-deadline", str(LOOKUP_DEADLINE_S)]  # fmt: skip
    logs = tmp_path_factory.mktemp("remote")
    with SGLangServer(args, log_path=logs / "a.log") as a, SGLangServer(args, log_path=logs / "b.log") as b:
        yield a, b


def _prompt(tokenizer, topic: str) -> list[int]:
    text = (f"Notes on {topic}. " + " ".join(f"Section {i}: the {topic} rule number {i} says "
            f"that every {topic} item must be checked twice before release." for i in range(40)))
    return tokenizer.encode(text)[:700]  # fmt: skip


def _generate(server: SGLangServer, ids: list[int]) -> dict:
    return http_json(server.url + "/generate", {
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS},
    })  # fmt: skip


def _wait_stored(kv_server: ServerProcess, chunks: int, before: int) -> None:
    deadline = time.monotonic() + 30
    while kv_server.stats()["puts"] - before < chunks and time.monotonic() < deadline:
        time.sleep(0.2)
    assert kv_server.stats()["puts"] - before >= chunks, kv_server.stats()


def _two_turns(server, kv_server, tokenizer, topic: str, ask: str) -> tuple[list[int], list[int]]:
    """Turn 1 of a conversation on ``server``, stored in the tier; returns (turn 1, turn 2) ids."""
    ids = _prompt(tokenizer, topic)
    before = kv_server.stats()["puts"]
    first = _generate(server, ids)
    _wait_stored(kv_server, len(ids) // CHUNK, before)
    return ids, ids + first["output_ids"] + tokenizer.encode(ask)


def test_prefix_computed_on_a_is_a_hit_on_b(servers, kv_server, plain_server, tokenizer) -> None:
    a, b = servers
    ids, turn2 = _two_turns(a, kv_server, tokenizer, "invoice", " Now list the exceptions.")
    got = _generate(b, turn2)
    assert got["meta_info"]["cached_tokens"] >= (len(ids) // CHUNK) * CHUNK, got["meta_info"]
    assert got["output_ids"] == _generate(plain_server, turn2)["output_ids"]


def test_a_turn_moved_at_once_finds_its_prompt_in_the_tier(servers, kv_server, plain_server,
                                                           tokenizer) -> None:  # fmt: skip
    """An agent's next turn follows its predecessor within milliseconds and may land on
    another replica: the prompt's KV is written through as its prefill completes, so while the
    turn decodes it lands (~0.8 s at the KV server's 40 MB/s) and the next turn, sent to B the
    moment A answers, hits it. (Written only at the turn's end, B found nothing.)"""
    a, b = servers
    ids = _prompt(tokenizer, "shipment")
    first = http_json(a.url + "/generate", {"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": 48, "ignore_eos": True}})  # fmt: skip
    turn2 = ids + first["output_ids"] + tokenizer.encode(" Which item ships first?")
    got = _generate(b, turn2)  # no wait for the tier: the turn moves at once
    assert got["meta_info"]["cached_tokens"] >= (len(ids) // CHUNK) * CHUNK, got["meta_info"]
    assert got["output_ids"] == _generate(plain_server, turn2)["output_ids"]


def test_tier_link_state_is_on_metrics(servers, kv_server, tokenizer) -> None:
    """The link's bounds (from --vericache-tier-inflight-mb), its up/down state and its event
    counts are on /metrics."""
    import re
    import urllib.request

    a, _ = servers
    _generate(a, _prompt(tokenizer, "metrics"))
    with urllib.request.urlopen(a.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    bound = re.search(r'vericache:tier_bytes_bound\{[^}]*kind="fetch"[^}]*\} (\S+)', text)
    assert bound and float(bound.group(1)) == 256 * 2**20, text[-2000:]
    assert re.search(r'vericache:tier_up\{[^}]*\} 1\.0', text)
    lookups = re.search(r'vericache:tier_link_events\{[^}]*event="lookups"[^}]*\} (\S+)', text)
    assert lookups and float(lookups.group(1)) >= 1


def test_next_turn_on_the_same_server_hits_its_own_device_prefix(servers, kv_server, plain_server,
                                                                  tokenizer) -> None:  # fmt: skip
    """Same server, next turn: turn 1's full KV is still in the pool (placement by pressure: it
    fits, so nothing moved it), so the prefix is a device hit and nothing is fetched from the
    tier, while turn 1 was still written through for the other replicas; turn 2's compressed
    KV starts from turn 1's (kept for its prefix), not from compressing all of it again.
    (Drafting while a prefix is fetched needs that prefix evicted first: the
    demoted-turn test below.)"""
    a, _ = servers
    ids, turn2 = _two_turns(a, kv_server, tokenizer, "payroll", " Which rule is checked first?")
    sent = kv_server.stats()["bytes_out"]
    got = _generate(a, turn2)
    assert got["meta_info"]["cached_tokens"] >= (len(ids) // CHUNK) * CHUNK, got["meta_info"]
    fetched = kv_server.stats()["bytes_out"] - sent  # probe replies only, no chunk of KV
    assert fetched < CHUNK * KV_BYTES_PER_TOKEN, f"a prefix that fits on the device: {fetched} B"
    assert got["meta_info"]["vericache"]["compressed_prefix_reused_tokens"] >= len(ids), got
    assert got["output_ids"] == _generate(plain_server, turn2)["output_ids"]


@pytest.mark.parametrize("bad_chunk", [0, 1])
def test_corrupt_chunk_is_recomputed_identically(servers, kv_server, plain_server, tokenizer,
                                                 default_model_path, bad_chunk: int) -> None:  # fmt: skip
    """A corrupt first chunk: nothing comes from the tier. A corrupt middle chunk: the lookup
    found every chunk, so the first probes promise all of them; the fetch then verifies only
    the first, and exactly that one is loaded (loading fewer tokens than promised is fatal in
    SGLang, so the hit is re-reported before any load)."""
    from sglang_vericache.tier.geometry import KVGeometry
    from sglang_vericache.tier.identity import ModelIdentity
    from sglang_vericache.tier.keys import chunk_keys

    a, b = servers
    ids = _prompt(tokenizer, ("shipping", "invoices")[bad_chunk])
    before = kv_server.stats()["puts"]
    _generate(a, ids)
    _wait_stored(kv_server, len(ids) // CHUNK, before)
    # the keys the servers use: the model's content identity (weights, config, fp32, no
    # overrides, TP rank 0, weight version 0), SmolLM2-135M geometry, 128-token chunks
    model_id = ModelIdentity.for_model(default_model_path, dtype="float32").model_id()
    geometry = KVGeometry(model_id, 30, 3, 64, "float32", CHUNK)
    keys = chunk_keys(geometry, ids[: len(ids) // CHUNK * CHUNK])
    reply = server_request(kv_server.endpoint, Op.CORRUPT, {"keys": [keys[bad_chunk].digest]})
    assert reply["ok"] and reply["corrupted"] == 1  # the keys really are the servers' keys
    got = _generate(b, ids + tokenizer.encode(" Summarize."))
    # chunks before the bad one come from the tier (beside B's own few shared tokens)
    cached = got["meta_info"]["cached_tokens"]
    assert bad_chunk * CHUNK <= cached < (bad_chunk + 1) * CHUNK, got["meta_info"]
    want = _generate(plain_server, ids + tokenizer.encode(" Summarize."))
    assert got["output_ids"] == want["output_ids"]


def test_a_request_waiting_on_a_hung_tier_holds_up_no_one(servers, kv_server, plain_server,
                                                          tokenizer) -> None:  # fmt: skip
    """A KV server that stops answering (SIGSTOP: hung, not dead) keeps a request whose prefix
    it must look up waiting until its lookup deadline; a request with nothing to look up, queued
    behind it, is admitted and answered meanwhile, not held up behind the network. Both answer
    as plain SGLang does."""
    import os
    import signal

    _, b = servers
    waiting = _prompt(tokenizer, "harbour")  # whole chunks: B asks the tier for them
    quick = tokenizer.encode("Name three colours.")  # under one chunk: never looked up
    out: dict = {}
    os.kill(kv_server.proc.pid, signal.SIGSTOP)
    try:
        thread = threading.Thread(target=lambda: out.update(_generate(b, waiting)))
        thread.start()
        time.sleep(1.0)  # its lookup is in flight, unanswered
        started = time.monotonic()
        got = _generate(b, quick)
        took = time.monotonic() - started
        assert not out, "the tier was stopped: the first request should still be waiting"
    finally:
        os.kill(kv_server.proc.pid, signal.SIGCONT)
    thread.join(timeout=600)
    assert took < LOOKUP_DEADLINE_S * 0.6, f"held up {took:.1f} s behind a hung lookup"
    assert got["output_ids"] == _generate(plain_server, quick)["output_ids"]
    assert out["output_ids"] == _generate(plain_server, waiting)["output_ids"]


@pytest.fixture(scope="module")
def tight_server(kv_server, tmp_path_factory) -> Iterator[SGLangServer]:
    """A replica whose pool holds about three 700-token conversations: a fourth evicts one."""
    args = ["--max-total-tokens", "2560", "--vericache", "--vericache-draft-len", "4",
            "--vericache-tier", kv_server.spec, "--enable-metrics"]  # fmt: skip
    log = tmp_path_factory.mktemp("tight") / "server.log"
    with SGLangServer(args, log_path=log) as server:
        yield server


def test_an_evicted_turn_is_demoted_and_its_next_turn_drafts_while_fetching(
    tight_server, kv_server, plain_server, tokenizer
) -> None:
    """Turn 1 finishes FULL (full KV on the device, written through) with its compressed KV
    kept, charged to the pool. Two more conversations need the room: eviction takes turn 1's
    FULL node and keeps its compressed KV (DEMOTED). Turn 2 then misses on the device, fetches
    turn 1's full KV from the tier, and drafts from the DEMOTED prefix while it waits; the
    drafts are verified like any others, so it answers as plain SGLang does."""
    import re
    import urllib.request

    ids, turn2 = _two_turns(tight_server, kv_server, tokenizer, "dockyard", " What comes last?")
    for topic in ("orchard", "quarry"):  # newer conversations evict the least recent turn
        _generate(tight_server, _prompt(tokenizer, topic))
    with urllib.request.urlopen(tight_server.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    entries = re.search(r'vericache:demoted_prefixes\{[^}]*what="entries"[^}]*\} (\S+)', text)
    slots = re.search(r'vericache:demoted_prefixes\{[^}]*what="slots"[^}]*\} (\S+)', text)
    assert entries and float(entries.group(1)) >= 2, text[-3000:]
    assert slots and float(slots.group(1)) > 0  # charged to the pool
    sent = kv_server.stats()["bytes_out"]
    got = _generate(tight_server, turn2)
    info = got["meta_info"]
    assert kv_server.stats()["bytes_out"] - sent >= CHUNK * KV_BYTES_PER_TOKEN, "not fetched"
    assert info["cached_tokens"] >= (len(ids) // CHUNK) * CHUNK, info
    assert info["vericache"]["drafted_while_fetching"] > 0, info["vericache"]
    assert got["output_ids"] == _generate(plain_server, turn2)["output_ids"]


def test_kv_server_killed_mid_fetch_is_recomputed_identically(
    servers, kv_server, plain_server, tokenizer
) -> None:
    a, b = servers
    ids = _prompt(tokenizer, "warehouse")
    before = kv_server.stats()["puts"]
    _generate(a, ids)
    _wait_stored(kv_server, len(ids) // CHUNK, before)
    turn2 = ids + tokenizer.encode(" Which rule matters most?")
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(_generate(b, turn2)))
    thread.start()
    time.sleep(0.4)  # the throttled fetch of ~700 tokens takes ~0.8 s
    kv_server.kill()
    thread.join(timeout=600)
    assert out["output_ids"] == _generate(plain_server, turn2)["output_ids"]
    # B keeps serving after losing its tier, and keeps finished requests' full KV on the
    # device (the tier would lose it): the next turn is a device hit, still identical
    garden = _prompt(tokenizer, "garden")
    again = _generate(b, garden)
    assert len(again["output_ids"]) == NEW_TOKENS
    turn2 = garden + again["output_ids"] + tokenizer.encode(" Which rule matters most?")
    got = _generate(b, turn2)
    assert got["meta_info"]["cached_tokens"] >= len(garden), got["meta_info"]
    assert got["output_ids"] == _generate(plain_server, turn2)["output_ids"]
