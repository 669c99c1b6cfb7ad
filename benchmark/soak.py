"""Soak: an hour of mixed traffic against plain SGLang and a ``--vericache`` server with a KV tier.

Starts a zmq KV server, a plain server and a ``--vericache`` server that writes through to (and
fetches from) the KV server, then sends both the same stream of requests at the same
concurrency (``soak_traffic.py``: the fuzzer's mix, 10% client disconnects, 3% aborts) for
``--minutes``. Every ``--sample-every`` seconds each server's traffic drains and the idle server
is sampled: resident memory and open file descriptors of its process tree, KV pool tokens in
use, tier bytes in flight (``/metrics``), and the window's requests, failures and median
latency. At the end: the least-squares slope of each of those per hour, the end state, greedy
answers compared between the two servers, and a last flush that must return the pool to its
start. Writes OUT (JSON) and OUT with ``.md``.

    python benchmark/soak.py --minutes 60 --concurrency 16 --out benchmark/results/soak.json
    python benchmark/soak.py --minutes 5 --sample-every 30   # the test command's version

Exit status 0 only when both servers lived, no request failed (no answer or a 5xx), greedy
answers agree, and the pool returned to its start value.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO))  # testkit/: the fuzzer and server fixtures (not in the wheel)
sys.path.insert(0, str(REPO / "benchmark"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from soak_traffic import (  # noqa: E402
    ABORT, TrafficMix, metric_values, traffic, tree_usage, trends, window_stats,
)

from testkit.fuzz import TOKENS, FuzzCase  # noqa: E402
from testkit.fuzz_compare import TOKEN_MISMATCH, compare_case  # noqa: E402
from testkit.fuzz_run import (  # noqa: E402
    _flush_then_state, abort_later, runs_alone, send, vocab_from_server, wait_idle,
)

from fuzz import SHARED_ARGS  # noqa: E402  (the test fixtures' server arguments)


@dataclass
class SoakTarget:
    """One server under soak: where it answers, its process (for /proc) and what it kept."""

    name: str
    url: str
    pid: int
    alive: Callable[[], bool]
    metrics: bool = False
    samples: list[dict[str, Any]] = field(default_factory=list)
    replies: dict[int, Any] = field(default_factory=dict)
    windows: list[dict[str, Any]] = field(default_factory=list)


def _send(target: SoakTarget, case: FuzzCase, timeout: float) -> Any:
    """One case; an abort case is cancelled through /abort_request while it runs."""
    if case.kind != ABORT:
        return send(target.url, case, timeout)
    timer = abort_later(target.url, case.body["rid"], 0.3 + (case.index % 7) * 0.1)
    try:
        return send(target.url, case, timeout)
    finally:
        timer.cancel()


def sample(target: SoakTarget, minute: float, window: dict[str, Any]) -> dict[str, Any]:
    """The idle server's state (the traffic has drained)."""
    row: dict[str, Any] = {"minute": round(minute, 2), "alive": target.alive(), **window}
    if not row["alive"]:
        return row
    state = wait_idle(target.url, 300.0)
    row["idle"] = bool(state) and not (state["running"] or state["waiting"] or state["grammar"])
    row["idle_used_tokens"] = None if state is None else state["used_tokens"]
    row.update(tree_usage(target.pid))
    if target.metrics:
        try:
            with urllib.request.urlopen(target.url + "/metrics", timeout=60) as resp:
                text = resp.read().decode()
            row["tier_bytes_in_flight"] = sum(
                metric_values(text, "vericache:tier_bytes_in_flight").values())
            # compressed prefixes kept for the next turn: a cache bounded by design
            # (tier/demoted.py DEMOTED_MAX_BYTES), counted apart from growth
            row["demoted_bytes"] = sum(v for k, v in metric_values(
                text, "vericache:demoted_prefixes").items() if 'what="bytes"' in k)
        except OSError:
            row["tier_bytes_in_flight"] = row["demoted_bytes"] = None
    return row


def run_target(target: SoakTarget, cases: Any, *, minutes: float, sample_every_s: float,
               concurrency: int, timeout: float, log: Callable[[str], None]) -> None:  # fmt: skip
    """Windows of traffic, each drained and followed by an idle sample, for ``minutes``."""
    lock = threading.Lock()
    start = time.monotonic()
    end = start + minutes * 60.0
    target.samples.append(sample(target, 0.0, {"requests": 0}))
    while time.monotonic() < end and target.alive():
        deadline = min(end, time.monotonic() + sample_every_s)
        done: list[tuple[FuzzCase, Any]] = []

        def worker(deadline: float, done: list[tuple[FuzzCase, Any]]) -> None:
            while time.monotonic() < deadline:
                with lock:
                    case = next(cases)
                reply = _send(target, case, timeout)
                with lock:
                    done.append((case, reply))
                    target.replies[case.index] = reply

        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            for _ in range(concurrency):
                pool.submit(worker, deadline, done)
        stats = window_stats(done)
        row = sample(target, (time.monotonic() - start) / 60.0, stats)
        target.samples.append(row)
        log(f"[{target.name}] minute {row['minute']:.1f}: {stats['requests']} requests, "
            f"{stats['failed']} failed, median {stats['median_s']} s, memory "
            f"{row.get('memory_bytes', 0) / 2**20:.0f} MiB (rss "
            f"{row.get('rss_bytes', 0) / 2**20:.0f}), fds {row.get('fds')}, idle pool "
            f"{row.get('idle_used_tokens')} tokens")  # fmt: skip


def compare_greedy(cases: dict[int, FuzzCase], a: SoakTarget, b: SoakTarget) -> dict[str, Any]:
    """Greedy cases both servers answered: identical tokens (a mismatch). Logprob and hidden-state
    differences are listed apart (``other_differences``): a streamed reply's logprob entries
    follow how the server chunked it, which depends on the load; the fuzzer checks them."""
    both = sorted(set(a.replies) & set(b.replies))
    checked = [i for i in both if cases[i].check == TOKENS and not runs_alone(cases[i])]
    results = [compare_case(cases[i], a.replies[i], b.replies[i]) for i in checked]
    bad = [r for r in results if any(p.kind == TOKEN_MISMATCH for p in r.problems)]
    other = [r for r in results if r.problems and r not in bad]

    def listed(rs: list) -> list[dict[str, Any]]:
        return [{"index": r.index, "kind": r.kind, "body": cases[r.index].body,
                 "problems": [{"kind": p.kind, **p.detail} for p in r.problems]} for r in rs[:20]]

    return {"compared": len(checked), "mismatches": listed(bad), "mismatch_count": len(bad),
            "other_differences": listed(other), "other_count": len(other)}


def soak(targets: list[SoakTarget], *, minutes: float, sample_every_s: float = 60.0,
         concurrency: int = 16, seed: int = 1, timeout: float = 300.0,
         exclude: tuple[str, ...] = (),
         log: Callable[[str], None] = print) -> dict[str, Any]:  # fmt: skip
    """Run the soak against ``targets`` side by side; the report dict."""
    vocab = vocab_from_server(targets[0].url)
    # the pool's start after a flush: a shared server may hold earlier requests' prefixes
    baselines = {t.name: (wait_idle(t.url, 300.0) and _flush_then_state(t.url) or {}).get(
        "used_tokens") for t in targets}
    seen: dict[int, FuzzCase] = {}

    def stream() -> Any:
        for case in traffic(seed, vocab, TrafficMix(), exclude=exclude):
            seen[case.index] = case
            yield case

    streams = {t.name: stream() for t in targets}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(targets)) as pool:
        futures = [pool.submit(run_target, t, streams[t.name], minutes=minutes,
                               sample_every_s=sample_every_s, concurrency=concurrency,
                               timeout=timeout, log=log) for t in targets]  # fmt: skip
        for f in futures:
            f.result()
    report: dict[str, Any] = {"minutes": minutes, "concurrency": concurrency, "seed": seed,
                              "exclude": list(exclude),
                              "wall_s": round(time.perf_counter() - t0, 1), "servers": {}}
    for t in targets:
        flushed = None
        if t.alive() and wait_idle(t.url, 300.0) is not None:
            flushed = _flush_then_state(t.url)
        failed = sum(w.get("failed", 0) for w in t.samples)
        report["servers"][t.name] = {
            "alive": t.alive(), "requests": len(t.replies), "failed": failed,
            "baseline_used_tokens": baselines[t.name],
            "after_flush_used_tokens": None if flushed is None else flushed["used_tokens"],
            "trends": trends(t.samples), "samples": t.samples,
            "first_window": t.samples[1] if len(t.samples) > 1 else None,
            "last_window": t.samples[-1],
        }  # fmt: skip
    if len(targets) == 2:
        report["greedy"] = compare_greedy(seen, *targets)
    report["ok"] = ok(report)
    return report


def pool_back(report: dict[str, Any]) -> bool:
    """Every server's pool, after a final flush, at its start."""
    return all(s["after_flush_used_tokens"] == s["baseline_used_tokens"]
               for s in report["servers"].values())


def ok(report: dict[str, Any]) -> bool:
    """Both alive, nothing failed, greedy answers agree, the pool back to its start."""
    if any(not s["alive"] or s["failed"] for s in report["servers"].values()):
        return False
    return pool_back(report) and not report.get("greedy", {}).get("mismatch_count")


def markdown(report: dict[str, Any], command: str) -> str:
    lines = [f"Soak: `{command}` ({time.strftime('%Y-%m-%d')}; {report['wall_s']:.0f} s wall, "
             f"concurrency {report['concurrency']} per server, seed {report['seed']}).", "",
             "| server | requests | failed | alive | memory (anonymous + swap) first -> last (MiB) "
             "| memory slope (MiB/h) "
             "| fds first -> last | fd slope (/h) | idle pool tokens first -> last | tier bytes "
             "in flight (idle, last) | median s, first -> last window |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, s in report["servers"].items():
        tr = s["trends"]
        rss, fds = tr.get("memory_bytes", {}), tr.get("fds", {})
        pool = tr.get("idle_used_tokens", {})
        tier = tr.get("tier_bytes_in_flight", {}).get("last", "-")
        mib = lambda v: f"{v / 2**20:.0f}" if isinstance(v, (int, float)) else "-"  # noqa: E731
        first, last = s["first_window"] or {}, s["last_window"] or {}
        lines.append(
            f"| {name} | {s['requests']} | {s['failed']} | {s['alive']} | {mib(rss.get('first'))} "
            f"-> {mib(rss.get('last'))} | {mib(rss.get('slope_per_hour'))} | {fds.get('first')} "
            f"-> {fds.get('last')} | {fds.get('slope_per_hour')} | {pool.get('first')} -> "
            f"{pool.get('last')} | {tier} | {first.get('median_s')} -> {last.get('median_s')} |")
    g = report.get("greedy")
    if g:
        lines += ["", f"Greedy answers compared between the servers: {g['compared']}, "
                  f"mismatches {g['mismatch_count']}. Pool after a final flush equals its start "
                  f"on every server: {pool_back(report)}. Verdict: "
                  f"{'PASS' if report['ok'] else 'FAIL'}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--sample-every", type=float, default=60.0, help="seconds between samples")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight per server")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--exclude", nargs="*", default=[], help="fuzz kinds or tags left out")
    ap.add_argument("--out", type=Path, default=REPO / "benchmark/results/soak.json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from sglang_vericache.exactness.server import SGLangServer

    from testkit.tier_server import ServerProcess

    args = parse_args(argv)
    logs = args.out.parent / f"{args.out.stem}-logs"
    with ServerProcess(capacity_gb=1.0) as tier:
        vc_args = [*SHARED_ARGS, "--vericache", "--vericache-tier", tier.spec, "--enable-metrics"]
        with SGLangServer(SHARED_ARGS, log_path=logs / "plain.log") as plain, \
                SGLangServer(vc_args, log_path=logs / "vericache.log") as vc:  # fmt: skip
            targets = [SoakTarget("plain", plain.url, plain.proc.pid,
                                  lambda: plain.proc.poll() is None),
                       SoakTarget("vericache", vc.url, vc.proc.pid,
                                  lambda: vc.proc.poll() is None, metrics=True)]  # fmt: skip
            report = soak(targets, minutes=args.minutes, sample_every_s=args.sample_every,
                          concurrency=args.concurrency, seed=args.seed,
                          exclude=tuple(args.exclude))  # fmt: skip
        report["tier_stats"] = tier.stats()
    report["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                      capture_output=True, text=True, check=False).stdout.strip()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    command = "python benchmark/soak.py " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.with_suffix(".md").write_text(markdown(report, command.strip()))
    print(f"wrote {args.out}: {'PASS' if report['ok'] else 'FAIL'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
