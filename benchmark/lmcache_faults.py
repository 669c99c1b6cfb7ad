"""The zmq tier's fault tests (``test/e2e/test_remote_prefix.py``), replayed against a real
``lmcache server`` shared by two ``--vericache --vericache-tier lmcache://`` replicas.

Used by ``lmcache_e2e.py``. Each scenario returns one row: what it checks, whether the answers
were token-identical to plain SGLang (``/generate`` with input ids, greedy), the cached tokens
the replica reported, its latency, and the replicas' tier-link counters (``/metrics``) it moved.
Every scenario runs to the end and records its outcome; none raises on a wrong answer.

Corruption: LMCache cannot be told to corrupt an entry (the zmq server's CORRUPT op), so
``plant_corrupt_chunk`` stores one chunk through ``_TamperingTier``, an ``LMCacheTier`` that
changes one value of the staged KV after its manifest checksums were taken: what a torn or
bit-flipped write would leave behind.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from sglang_vericache.exactness.server import SGLangServer, http_json

from testkit.lmcache_server import LMCacheServerProcess, stored_chunks, wait_task

NEW_TOKENS = 12


def link_counters(server: SGLangServer) -> dict[str, float]:
    """The replica's tier-link event counts and up/down state (needs ``--enable-metrics``)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'vericache:tier_link_events\{[^}]*event="(\w+)"[^}]*\} (\S+)', text)}
    up = re.search(r"vericache:tier_up\{[^}]*\} (\S+)", text)
    out["tier_up"] = float(up.group(1)) if up else float("nan")
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()
            if k != "tier_up" and v - before.get(k, 0.0)}


def generate(server: SGLangServer, ids: list[int]) -> tuple[dict, float]:
    start = time.perf_counter()
    got = http_json(server.url + "/generate", {
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS}})
    return got, time.perf_counter() - start


class Faults:
    """The fault scenarios over one plain server, replicas ``a`` / ``b`` and the LMCache server."""

    def __init__(self, plain: SGLangServer, a: SGLangServer, b: SGLangServer,
                 lm: LMCacheServerProcess, geometry: Any, tokenizer: Any,
                 say: Callable[[str], None]) -> None:
        self.plain, self.a, self.b, self.lm = plain, a, b, lm
        self.geometry, self.tok, self.say = geometry, tokenizer, say
        self.chunk = geometry.chunk_tokens
        self.rows: list[dict] = []

    # -- helpers -----------------------------------------------------------------------------
    def prompt(self, topic: str) -> list[int]:
        text = f"Notes on {topic}. " + " ".join(
            f"Section {i}: the {topic} rule number {i} says that every {topic} item must be "
            f"checked twice before release." for i in range(40))
        return self.tok.encode(text)[:700]

    def full_chunks(self, ids: list[int]) -> int:
        return len(ids) // self.chunk

    def wait_stored(self, ids: list[int], timeout_s: float = 120.0) -> tuple[int, float]:
        """Poll LMCache itself until every full chunk of ``ids`` is there: (chunks, seconds)."""
        start = time.monotonic()
        n = 0
        while time.monotonic() - start < timeout_s:
            n = stored_chunks(self.lm.spec, self.geometry, ids)
            if n >= self.full_chunks(ids):
                break
            time.sleep(0.5)
        return n, time.monotonic() - start

    def check(self, name: str, expect: str, server: SGLangServer, ids: list[int],
              cached_ok: Callable[[int], bool], **extra: Any) -> dict:
        """Send ``ids`` to ``server`` and to plain SGLang; record the outcome as a row."""
        before = {s: link_counters(s) for s in (self.a, self.b)}
        got, latency = generate(server, ids)
        want, _ = generate(self.plain, ids)
        counters = {tag: delta(link_counters(s), before[s]) for tag, s in
                    (("a", self.a), ("b", self.b))}
        cached = int(got["meta_info"].get("cached_tokens") or 0)
        identical = got["output_ids"] == want["output_ids"]
        row = {"name": name, "expect": expect, "identical": identical, "cached_tokens": cached,
               "prompt_tokens": len(ids), "latency_s": round(latency, 3),
               "cached_as_expected": cached_ok(cached), "link_counters_delta": counters,
               **extra}
        row["ok"] = identical and row["cached_as_expected"]
        self.rows.append(row)
        self.say(f"  {name}: identical={identical} cached={cached}/{len(ids)} "
                 f"latency={latency:.2f}s {'OK' if row['ok'] else 'UNEXPECTED'}")
        return row

    # -- scenarios ---------------------------------------------------------------------------
    def corrupt_chunk(self, bad: int = 1) -> dict:
        """A chunk whose bytes do not match its manifest: B loads only the chunks before it."""
        self.say(f"fault: corrupt chunk {bad} in LMCache")
        ids = self.prompt("shipping")
        planted = plant_corrupt_chunk(self.lm.spec, self.geometry, ids, bad)
        generate(self.a, ids)  # A computes and writes the prefix through
        stored, _ = self.wait_stored(ids)
        verified = verified_chunks(self.lm.spec, self.geometry, ids)
        if verified != bad:  # A's write replaced the planted chunk: plant it over A's
            planted = plant_corrupt_chunk(self.lm.spec, self.geometry, ids, bad)
            verified = verified_chunks(self.lm.spec, self.geometry, ids)
        turn2 = ids + self.tok.encode(" Summarize.")
        lo, hi = bad * self.chunk, (bad + 1) * self.chunk
        return self.check("corrupt chunk", f"B loads chunks before #{bad} only, recomputes the "
                          f"rest (cached in [{lo}, {hi}))", self.b, turn2,
                          lambda c: lo <= c < hi, planted=planted, stored_chunks=stored,
                          chunks_verifying_before=verified)

    def killed_mid_fetch(self, delay_s: float = 0.3) -> dict:
        """The LMCache server SIGKILLed while B fetches a prefix A wrote."""
        self.say("fault: lmcache server killed while B fetches")
        ids = self.prompt("warehouse")
        generate(self.a, ids)
        stored, secs = self.wait_stored(ids)
        turn2 = ids + self.tok.encode(" Which rule matters most?")
        killer = threading.Timer(delay_s, self.lm.kill)
        killer.start()
        row = self.check("killed mid-fetch", "answered identically (loaded or recomputed)",
                         self.b, turn2, lambda c: True, stored_chunks=stored,
                         stored_after_s=round(secs, 2), killed_after_s=delay_s)
        killer.join()
        row["lmcache_alive_after"] = self.lm.alive()
        return row

    def dead_tier_keeps_serving(self) -> list[dict]:
        """With LMCache down, both replicas answer new conversations identically, and keep
        finished turns on the device (the next turn is a device hit)."""
        self.say("fault: lmcache server down, replicas keep serving")
        rows = []
        for tag, server, topic in (("A", self.a, "garden"), ("B", self.b, "orchard")):
            ids = self.prompt(topic)
            n = len(ids)
            first = self.check(f"dead tier, new prompt on {tag}", "answered identically",
                               server, ids, lambda c: True)
            got, _ = generate(server, ids)
            turn2 = ids + got["output_ids"] + self.tok.encode(" Which rule matters most?")
            second = self.check(f"dead tier, next turn on {tag}", "device hit (cached >= "
                                "turn 1 prompt), identical", server, turn2,
                                lambda c, n=n: c >= n)
            rows += [first, second]
        return rows

    def restarted(self) -> dict:
        """A fresh LMCache server on the same port: new write-throughs land, B hits them."""
        self.say("fault: lmcache server restarted (empty) on the same port")
        t0 = time.monotonic()
        self.lm.start()
        started_s = time.monotonic() - t0
        ids = self.prompt("harbor")
        t1 = time.monotonic()
        generate(self.a, ids)
        stored, _ = self.wait_stored(ids, timeout_s=180)
        if stored < self.full_chunks(ids):  # the link may still be backing off: one more turn
            self.say("  first write-through after the restart did not land; sending A a turn")
            generate(self.a, ids + self.tok.encode(" Again."))
            stored, _secs = self.wait_stored(ids, timeout_s=180)
        full = self.full_chunks(ids) * self.chunk
        return self.check("restarted, hits resume", f"B hits A's prefix (cached >= {full})",
                          self.b, ids + self.tok.encode(" Which rule is checked first?"),
                          lambda c: c >= full, restart_s=round(started_s, 1),
                          stored_chunks=stored, stored_after_s=round(time.monotonic() - t1, 2))

    def run_all(self) -> list[dict]:
        self.corrupt_chunk()
        self.killed_mid_fetch()
        self.dead_tier_keeps_serving()
        self.restarted()
        return self.rows


def _tampering_tier_class() -> type:
    from sglang_vericache.tier.lmcache import LMCacheTier

    class _TamperingTier(LMCacheTier):
        def _write_manifest(self, manifest: bytes) -> None:
            super()._write_manifest(manifest)  # checksums of the true bytes are in it now
            self._staging["layer.0"][0, 1, 0, 0, 0] += 1.0  # K, block 1, token 0: one value off

    return _TamperingTier


def plant_corrupt_chunk(spec: str, geometry: Any, ids: list[int], index: int) -> bool:
    """Store chunk ``index`` of ``ids`` with bytes that do not match its manifest."""
    from sglang_vericache.tier import alloc_chunks, chunk_keys, parse_tier_spec

    parsed = parse_tier_spec(spec)
    tier = _tampering_tier_class()(str(parsed.host), int(parsed.port), geometry, timeout_s=10)
    try:
        key = chunk_keys(geometry, ids[: (index + 1) * geometry.chunk_tokens])[index]
        chunk = alloc_chunks(geometry, geometry.chunk_tokens)[0].normal_()
        result = wait_task(tier, tier.submit_put([key], [chunk]), 60)
    finally:
        tier.close()
    return bool(result is not None and result.all_ok)


def verified_chunks(spec: str, geometry: Any, ids: list[int]) -> int:
    """Leading chunks of ``ids`` that LMCache holds and that pass the adapter's checks."""
    from sglang_vericache.tier import TaskStatus, alloc_chunks, chunk_keys, open_tier
    from sglang_vericache.tier.factory import TierOptions

    full = len(ids) // geometry.chunk_tokens * geometry.chunk_tokens
    tier = open_tier(spec, geometry, TierOptions(timeout_s=10))
    try:
        result = wait_task(tier, tier.submit_fetch(chunk_keys(geometry, ids[:full]),
                                                   alloc_chunks(geometry, full)), 60)
    finally:
        tier.close()
    return 0 if result is None or result.status is not TaskStatus.DONE else result.num_ok_prefix
