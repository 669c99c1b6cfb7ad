"""LMCache as the remote full-KV tier, end to end: a real ``lmcache server`` shared by two
``--vericache --vericache-tier lmcache://`` replicas, checked against plain SGLang.

Needs the LMCache venv (``bash scripts/lmcache_venv.sh``); every server runs on 127.0.0.1:

    .venv-lmcache/bin/python benchmark/lmcache_e2e.py          # 2 sessions x 4 turns, ~15 min

1. Agent sessions (``remote_prefix.build_sessions``) replayed on one plain SGLang server, then
   on the two replicas with turn k on replica k mod 2 (``remote_prefix.replay``), so each
   turn's prefix was computed on the other replica and can only come from LMCache.
2. Every answer compared with plain SGLang's; the replicas' tier-link counters (``/metrics``):
   tokens hit in LMCache, lookups, write-throughs, failures.
3. The zmq tier's faults (``lmcache_faults.py``): a corrupt chunk, the LMCache server killed
   while a replica fetches, both replicas serving with LMCache down, LMCache restarted.

Writes benchmark/results/lmcache_e2e.{json,md}. Exit status 0 only when every answer was
identical, the second replica hit prefixes in LMCache, and every fault ended as expected.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmark"))

from lmcache_faults import Faults, link_counters
from remote_prefix import build_sessions, per_turn, replay, session_args
from sglang_vericache.exactness.server import SGLangServer

from testkit.lmcache_server import (
    QUIET_ENV,
    LMCacheServerProcess,
    server_geometry,
)

PLAIN, REPLICAS = "plain SGLang (one server)", "2 replicas, VeriCache + LMCache"
START = time.monotonic()


def say(msg: str) -> None:
    print(f"[lmcache_e2e +{time.monotonic() - START:5.0f}s] {msg}", flush=True)


def parse_args() -> argparse.Namespace:
    ap = session_args(__doc__, "lmcache_e2e")
    ap.add_argument("--system-tokens", type=int, default=1000,
                    help="system prompt size of the agent sessions (agentic_workload.py)")
    ap.add_argument("--l1-size-gb", type=float, default=1.0, help="LMCache server memory")
    ap.add_argument("--skip-faults", action="store_true")
    ap.set_defaults(turns=4, max_tokens=32)
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    # SIGTERM (a background run's only stop) unwinds the ExitStack: every server is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from sglang_vericache.srt.prefix.radix_cache import REMOTE_CHUNK_TOKENS
    from transformers import AutoTokenizer

    say(f"workload: {args.sessions} sessions x {args.turns} turns, {args.max_tokens} tokens "
        f"per answer, system prompt ~{args.system_tokens} tokens")
    work, sessions, base = build_sessions(args, "lmcache-e2e-", "--system-tokens",
                                          str(args.system_tokens))
    model = Path(base[base.index("--model-path") + 1])
    say(f"work dir {work} (server logs)")
    geometry = server_geometry(model, REMOTE_CHUNK_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(model)
    load = [os.getloadavg()]
    runs: dict[str, dict] = {}
    counters: dict[str, dict] = {}
    faults: list[dict] = []
    with ExitStack() as stack:
        say("starting plain SGLang")
        plain = stack.enter_context(SGLangServer(base, log_path=work / "plain.log"))
        say("replaying the sessions on plain SGLang")
        runs[PLAIN] = replay([plain.url], sessions, work / "plain.json", args)
        say(f"starting lmcache server (engine_driven, --chunk-size {REMOTE_CHUNK_TOKENS})")
        lm = LMCacheServerProcess(REMOTE_CHUNK_TOKENS, l1_size_gb=args.l1_size_gb,
                                  log_path=work / "lmcache.log")
        stack.callback(lm.stop)
        lm.start()
        extra = ["--vericache", "--vericache-tier", lm.spec, "--enable-metrics"]
        say(f"starting replicas A and B with --vericache-tier {lm.spec}")
        a, b = (stack.enter_context(SGLangServer(base + extra, log_path=work / f"vc-{n}.log",
                                                 env=QUIET_ENV)) for n in "ab")
        say("replaying the sessions on the replicas (turn k on replica k mod 2)")
        runs[REPLICAS] = replay([a.url, b.url], sessions, work / "replicas.json", args)
        counters = {"A": link_counters(a), "B": link_counters(b)}
        say(f"after the replay: A {counters['A']}")
        say(f"                  B {counters['B']}")
        load.append(os.getloadavg())
        if not args.skip_faults:
            faults = Faults(plain, a, b, lm, geometry, tokenizer, say).run_all()
            load.append(os.getloadavg())
        say("stopping servers")
    report = summarize(runs, counters, faults, args, load)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    say(f"wrote {args.out.with_suffix('.md')} and .json")
    return 0 if report["passed"] else 1


def summarize(runs: dict[str, dict], counters: dict[str, dict], faults: list[dict],
              args: argparse.Namespace, load: list) -> dict:  # fmt: skip
    import importlib.metadata as md

    want = {(r["session_id"], r["turn"]): r.get("output_sha256") for r in runs[PLAIN]["turns"]}
    got = {(r["session_id"], r["turn"]): r.get("output_sha256")
           for r in runs.get(REPLICAS, {"turns": []})["turns"]}
    same = sum(1 for k, h in want.items() if h and got.get(k) == h)
    fault_same = sum(1 for f in faults if f["identical"])
    b_hits = counters.get("B", {}).get("hits_tokens", 0)
    report = {
        "sessions": args.sessions, "turns": args.turns, "max_tokens": args.max_tokens,
        "system_tokens": args.system_tokens, "think_s": args.think_s,
        "versions": {p: md.version(p) for p in ("lmcache", "sglang", "torch")},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_start_replay_faults": [round(x[0], 2) for x in load]},
        "replay_identical": f"{same}/{len(want)}",
        "replay_errors": {n: r["summary"]["errors"] for n, r in runs.items()},
        "per_turn": {n: per_turn(r) for n, r in runs.items()},
        "cached_tokens": {n: [r.get("cached_tokens") for r in run["turns"]]
                          for n, run in runs.items()},
        "link_counters_after_replay": counters,
        "faults": faults,
        "fault_identical": f"{fault_same}/{len(faults)}",
        "faults_ok": f"{sum(1 for f in faults if f['ok'])}/{len(faults)}",
    }
    report["passed"] = (same == len(want) and b_hits > 0 and fault_same == len(faults)
                        and all(f["ok"] for f in faults))
    return report


def markdown(report: dict) -> str:
    pt = report["per_turn"]
    lines = [
        (f"# LMCache tier end to end (lmcache {report['versions']['lmcache']}, sglang "
        f"{report['versions']['sglang']}, {report['machine']['cpus']} shared CPU cores)"), "",
        (f"{report['sessions']} agent sessions x {report['turns']} turns (system prompt "
        f"~{report['system_tokens']} tokens), {report['max_tokens']} tokens per answer, "
        f"{report['think_s']:g} s between turns. `{PLAIN}` runs every turn on one server; "
        f"`{REPLICAS}` runs turn k on replica k mod 2, both `--vericache --vericache-tier "
        f"lmcache://...` on one `lmcache server` (engine_driven, L1 only), so each turn's "
        "prefix was computed on the other replica. Greedy; answers compared by sha256."), "",
        ("| turn | prompt tokens | TTFT s plain | TTFT s replicas | E2E s plain | E2E s replicas "
        "| cached tokens plain / replicas |"), "|---|---|---|---|---|---|---|"]
    for k, p in pt.get(PLAIN, {}).items():
        r = pt.get(REPLICAS, {}).get(k)
        if r is None:
            continue
        lines.append(f"| {k} | {p['prompt_tokens']:.0f} | {p['ttft_s']:.2f} | "
                     f"{r['ttft_s']:.2f} | {p['e2e_s']:.2f} | {r['e2e_s']:.2f} | "
                     f"{p['cached']:.0f} / {r['cached']:.0f} |")
    c = report["link_counters_after_replay"]
    keys = ("lookups", "hits_tokens", "puts", "fetch_failures", "put_failures",
            "overdue_lookups", "fetches_skipped_slower")
    lines += ["", "Medians per turn over the sessions. Per request, cached tokens: "
              + "; ".join(f"{n}: {v}" for n, v in report["cached_tokens"].items()) + ".", "",
              (f"**Identical to plain SGLang: {report['replay_identical']}** turns "
              f"(replay errors: {report['replay_errors']})."), "",
              ("Tier-link counters of the replicas after the replay (`/metrics`, "
              "`vericache:tier_link_events`):"), "",
              "| replica | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name in ("A", "B"):
        lines.append(f"| {name} | " + " | ".join(f"{c.get(name, {}).get(k, 0):.0f}"
                                                  for k in keys) + " |")
    if report["faults"]:
        lines += ["", "## Faults (as `test/e2e/test_remote_prefix.py` for the zmq tier)", "",
                  (f"Identical to plain SGLang: **{report['fault_identical']}**; ended as "
                  f"expected: **{report['faults_ok']}**. Each row: a `/generate` of "
                  "~700-token prompts, 12 new tokens, greedy."), "",
                  ("| fault | expected | identical | cached / prompt tokens | latency s | "
                  "link counters moved | as expected |"), "|---|---|---|---|---|---|---|"]
        for f in report["faults"]:
            moved = "; ".join(f"{tag}: " + ", ".join(f"{k} {v:+.0f}" for k, v in d.items())
                              for tag, d in f["link_counters_delta"].items() if d) or "-"
            lines.append(f"| {f['name']} | {f['expect']} | {'yes' if f['identical'] else 'NO'} "
                         f"| {f['cached_tokens']} / {f['prompt_tokens']} | {f['latency_s']:.2f} "
                         f"| {moved} | {'yes' if f['ok'] else 'NO'} |")
        extras = [f"{f['name']}: " + ", ".join(f"{k}={v}" for k, v in f.items() if k in (
            "planted", "stored_chunks", "chunks_verifying_before", "stored_after_s",
            "killed_after_s", "lmcache_alive_after", "restart_s")) for f in report["faults"]]
        lines += ["", "Details: " + "; ".join(e for e in extras if not e.endswith(": ")) + "."]
    lines += ["", (f"Load average (1 min) at start / after the replay / after the faults: "
              f"{report['machine']['loadavg_start_replay_faults']} (the cores are shared: "
              "timings are +-2x)."), "",
              f"**Passed: {'yes' if report['passed'] else 'NO'}.**"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
