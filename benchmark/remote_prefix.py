"""Agent sessions on two replicas: recompute vs fetch from the throttled KV server, per turn.

Multi-turn agent sessions (``scripts/agentic_workload.py``: long system prompt + tool schemas +
growing history, ~90% prefix reuse per turn) replayed with turn k on replica k mod 2
(``scripts/replay_agentic.py``: no session affinity, so each turn's prefix was computed on the
*other* replica). Side by side, same sessions, greedy:

- ``single server``: plain SGLang, every turn on one server (the prefix is on the device);
- ``replicas, recompute``: two plain SGLang servers: the other replica's prefix is recomputed;
- ``replicas, remote tier``: two ``--vericache --vericache-tier zmq://`` servers sharing one
  KV server throttled to ``--bandwidth-mbps`` (default 100 MB/s): the prefix is fetched;
- ``replicas, recompute, vericache attention``: two plain SGLang servers with
  ``--attention-backend vericache`` and no ``--vericache``: recompute as above, but a prefix
  hit costs what it costs VeriCache (its extend attends only the new tokens' queries, where
  torch_native's recomputes the prefix's attention too). The ratio against it is what the tier
  itself buys; the ratio against plain recompute is what ``--vericache`` buys a CPU user.

    python benchmark/remote_prefix.py            # 2 sessions x 5 turns, 64 tokens per answer

Writes benchmark/results/remote_prefix.{json,md}: median TTFT and end-to-end latency per turn,
the ratios, and whether every configuration produced the same answers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sglang_vericache.exactness.server import SGLangServer  # noqa: E402
from sglang_vericache.models import ensure_default_model  # noqa: E402
from testkit.tier_server import ServerProcess  # noqa: E402
from benchmark.agentic_tool_calls import vericache_counters  # noqa: E402

RECOMPUTE, REMOTE = "replicas, recompute", "replicas, remote tier (VeriCache)"
SAME_ATTENTION = "replicas, recompute, vericache attention"
SAME_ATTENTION_ARGS = ["--attention-backend", "vericache"]  # plain SGLang, VeriCache's attention
PHASE_METRICS = {"prefill steps": "vericache:prefill_phase_seconds",
                 "decode steps": "vericache:step_phase_seconds"}  # fmt: skip


def replay(urls: list[str], sessions: Path, out: Path, args: argparse.Namespace,
           *options: str) -> dict:  # fmt: skip
    """``scripts/replay_agentic.py`` over ``urls`` (``options``: more of its flags)."""
    cmd = [sys.executable, str(REPO / "scripts/replay_agentic.py"), str(sessions), "--url", *urls,
           "--max-tokens", str(args.max_tokens), "--ignore-eos", "--think-s", str(args.think_s),
           *options, "-o", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def per_turn(result: dict) -> dict[int, dict]:
    turns: dict[int, list[dict]] = {}
    for row in result["turns"]:
        turns.setdefault(row["turn"], []).append(row)
    return {k: {"ttft_s": statistics.median(r["ttft_s"] for r in rows),
                "e2e_s": statistics.median(r["e2e_s"] for r in rows),
                "prompt_tokens": statistics.median(r["prompt_tokens"] or 0 for r in rows),
                "cached": statistics.median(r.get("cached_tokens") or 0 for r in rows)}
            for k, rows in sorted(turns.items())}  # fmt: skip


def session_args(doc: str, out: str) -> argparse.ArgumentParser:
    """The options every agent-session benchmark shares."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--bandwidth-mbps", type=float, default=100.0)
    ap.add_argument("--think-s", type=float, default=3.0,
                    help="agent tool time between turns (the previous turn's write-through lands)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmark/results" / out)
    return ap


def write_report(out: Path, report: dict, text: str) -> None:
    """``out``.json (the report) and ``out``.md (``text``), then ``text`` on stdout."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(text)
    print(text)


def build_sessions(args: argparse.Namespace, prefix: str,
                   *workload: str) -> tuple[Path, Path, list[str]]:  # fmt: skip
    """(work dir, sessions.jsonl, base server args) for the embedded model; ``workload``: more
    ``scripts/agentic_workload.py`` options."""
    model = ensure_default_model()
    work = Path(tempfile.mkdtemp(prefix=prefix))
    sessions = work / "sessions.jsonl"
    subprocess.run([sys.executable, str(REPO / "scripts/agentic_workload.py"), "--sessions",
                    str(args.sessions), "--turns", str(args.turns), "--answer-tokens",
                    str(args.max_tokens), "--tokenizer", str(model / "tokenizer.json"),
                    *workload, "-o", str(sessions)], check=True)  # fmt: skip
    base = ["--model-path", str(model), "--max-total-tokens", "32768", "--enable-cache-report"]
    return work, sessions, base


def main() -> None:
    args = session_args(__doc__, "remote_prefix").parse_args()
    work, sessions, base = build_sessions(args, "remote-prefix-")
    runs = {}
    with SGLangServer(base, log_path=work / "single.log") as one:
        runs["single server (prefix on device)"] = replay([one.url], sessions, work / "single.json", args)
    with ExitStack() as stack:
        a, b = (stack.enter_context(SGLangServer(base, log_path=work / f"plain-{n}.log")) for n in "ab")
        runs[RECOMPUTE] = replay([a.url, b.url], sessions, work / "recompute.json", args)
    with ExitStack() as stack:
        kv = stack.enter_context(ServerProcess("--bandwidth-mbps", str(args.bandwidth_mbps),
                                               capacity_gb=4.0))  # fmt: skip
        extra = ["--vericache", "--vericache-tier", kv.spec, "--enable-metrics"]
        a, b = (stack.enter_context(SGLangServer(base + extra, log_path=work / f"vc-{n}.log"))
                for n in "ab")  # fmt: skip
        runs[REMOTE] = replay([a.url, b.url], sessions, work / "remote.json", args)
        phases = phase_seconds([vericache_counters(s.url) for s in (a, b)])
    with ExitStack() as stack:
        same = base + SAME_ATTENTION_ARGS
        a, b = (stack.enter_context(SGLangServer(same, log_path=work / f"plain-vc-attn-{n}.log"))
                for n in "ab")  # fmt: skip
        runs[SAME_ATTENTION] = replay([a.url, b.url], sessions, work / "same-attention.json", args)
    report = summarize(runs, args)
    report["vericache_phase_seconds"] = phases
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


def phase_seconds(counters: list[dict]) -> dict[str, dict[str, float]]:
    """Seconds the VeriCache replicas spent per step phase, summed over replicas."""
    out: dict[str, dict[str, float]] = {}
    for kind, metric in PHASE_METRICS.items():
        total: dict[str, float] = {}
        for c in counters:
            for phase, s in c.get(metric, {}).items():
                total[phase] = round(total.get(phase, 0.0) + s, 2)
        out[kind] = total
    return out


def summarize(runs: dict[str, dict], args: argparse.Namespace) -> dict:
    hashes = {name: [r["output_sha256"] for r in run["turns"]] for name, run in runs.items()}
    first = next(iter(hashes.values()))
    return {
        "sessions": args.sessions, "turns": args.turns, "max_tokens": args.max_tokens,
        "bandwidth_mb_s": args.bandwidth_mbps, "think_s": args.think_s,
        "identical_outputs": {name: h == first for name, h in hashes.items()},
        "per_turn": {name: per_turn(run) for name, run in runs.items()},
        "cached_tokens": {name: [r.get("cached_tokens") for r in run["turns"]]
                          for name, run in runs.items()},  # fmt: skip
    }  # fmt: skip


def markdown(report: dict) -> str:
    per_turn = report["per_turn"]
    names = list(per_turn)
    baselines = [n for n in (RECOMPUTE, SAME_ATTENTION) if n in per_turn]
    lines = [f"{report['sessions']} agent sessions x {report['turns']} turns, "
             f"{report['max_tokens']} tokens per answer, {report['think_s']:g} s between turns; "
             f"turn k on replica k mod 2; "
             f"KV server throttled to {report['bandwidth_mb_s']:g} MB/s.", ""]  # fmt: skip
    header = (["turn", "prompt tokens"] + [f"TTFT s: {n}" for n in names]
              + [f"cached tokens: {n}" for n in names[1:]]
              + [f"{m} {b} / remote" for b in baselines for m in ("TTFT", "E2E")])  # fmt: skip
    lines += ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for k in per_turn[names[0]]:
        row = {n: per_turn[n][k] for n in names}
        v = row[REMOTE]
        cells = ([str(k), f"{row[names[0]]['prompt_tokens']:.0f}"]
                 + [f"{row[n]['ttft_s']:.2f}" for n in names]
                 + [f"{row[n]['cached']:.0f}" for n in names[1:]]
                 + [f"{row[b][m] / v[m]:.2f}x" for b in baselines for m in ("ttft_s", "e2e_s")])
        lines.append("| " + " | ".join(cells) + " |")
    same = ", ".join(f"{n}: {'yes' if ok else 'NO'}" for n, ok in report["identical_outputs"].items())
    lines += ["", f"Same answers as the single server: {same}."]
    for kind, phases in report.get("vericache_phase_seconds", {}).items():
        spent = ", ".join(f"{p} {s:.1f}" for p, s in sorted(phases.items(), key=lambda x: -x[1]))
        lines.append(f"VeriCache replicas, seconds in {kind} by phase (both replicas): {spent}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
