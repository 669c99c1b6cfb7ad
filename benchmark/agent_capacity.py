"""Agent capacity: many concurrent agent sessions on one server whose KV budget holds a few.

``--sessions`` agent sessions (``scripts/agentic_workload.py``: each its own long system prompt +
tool schemas + growing history) run at once, ``--turns`` turns each, on one server whose
``--max-total-tokens`` holds the full final prefixes of only ``--holds`` sessions. Every turn's
prefix comes back, but most were evicted meanwhile. Side by side, same sessions, greedy:

- ``plain SGLang``: radix LRU; an evicted prefix is recomputed;
- ``VeriCache, fetch then decode``: ``--vericache --vericache-tier`` on a KV server throttled to
  ``--bandwidth-mbps``; finished turns are written through to the tier, an evicted prefix is
  fetched back (or recomputed where the server measures that as faster), drafting starts once
  it has landed (``--vericache-fetch-drafting off``);
- ``VeriCache, draft while fetching``: the same, drafting from the local compressed prefix while
  the full KV streams in;
- ``plain SGLang, vericache attention``: plain SGLang with ``--attention-backend vericache`` (no
  ``--vericache``): a prefix hit costs what it costs VeriCache (its extend attends only the new
  tokens' queries; torch_native's recomputes the prefix's attention too). The ratio against it
  is what the tier and the compressed KV buy; against plain SGLang, what ``--vericache`` buys.

    python benchmark/agent_capacity.py       # 16 sessions x 5 turns x 32 tokens, budget of ~4

Writes benchmark/results/agent_capacity.{json,md}: median and p90 TTFT and end-to-end latency per
turn, the turns' wall time, prompt tokens recomputed (prompt minus cached), bytes fetched from the
tier, and whether every configuration gave plain SGLang's answers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmark"))

from agentic_tool_calls import vericache_counters  # noqa: E402
from remote_prefix import SAME_ATTENTION_ARGS, build_sessions, session_args  # noqa: E402
from remote_prefix import write_report  # noqa: E402
from remote_prefix import replay as replay_sessions  # noqa: E402

from sglang_vericache.exactness.server import SGLangServer  # noqa: E402
from testkit.tier_server import ServerProcess  # noqa: E402

PLAIN = "plain SGLang"
SAME_ATTENTION = "plain SGLang, vericache attention"
# name -> --vericache-fetch-drafting (None: a plain server) and more server flags
CONFIGS = {PLAIN: (None, []), "VeriCache, fetch then decode": ("off", []),
           "VeriCache, draft while fetching": ("on", []),
           SAME_ATTENTION: (None, SAME_ATTENTION_ARGS)}  # fmt: skip


def budget_tokens(sessions: Path, holds: int, answer_tokens: int, system_tokens: int) -> int:
    """``--max-total-tokens`` that holds the final prefixes of ``holds`` sessions: each session's
    system prompt, every turn's appended tokens and every answer, the largest session's times
    ``holds`` (rounded up to a page of 64)."""
    largest = 0
    for line in sessions.read_text().splitlines():
        turns = json.loads(line)["turns"]
        largest = max(largest, system_tokens + sum(t["tokens"] + answer_tokens for t in turns))
    return -(-holds * largest // 64) * 64


def replay(url: str, sessions: Path, out: Path, args: argparse.Namespace) -> dict:
    """Every session at once (each waits long: the budget holds a few at a time)."""
    return replay_sessions([url], sessions, out, args, "--concurrency", str(args.sessions),
                           "--timeout", "3600")  # fmt: skip


def run_config(name: str, drafting: str | None, base: list[str], sessions: Path, work: Path,
               args: argparse.Namespace) -> dict:  # fmt: skip
    """One configuration's replay (with its server's counters and the KV server's stats),
    saved as ``{slug}.result.json`` in ``work``, or taken from ``--reuse``'s directory."""
    slug = name.replace(",", "").replace(" ", "-")
    done = args.reuse / f"{slug}.result.json" if args.reuse else None
    if done is not None and done.exists():
        print(f"=== {name}: reusing {done} ===", flush=True)
        return json.loads(done.read_text())
    print(f"\n=== {name} ===", flush=True)
    result = _run(drafting, base, sessions, work, slug, args)
    (work / f"{slug}.result.json").write_text(json.dumps(result) + "\n")
    return result


def _run(drafting: str | None, base: list[str], sessions: Path, work: Path, slug: str,
         args: argparse.Namespace) -> dict:  # fmt: skip
    if drafting is None:
        with SGLangServer(base, log_path=work / f"{slug}.log") as server:
            return replay(server.url, sessions, work / f"{slug}.json", args)
    with ServerProcess("--bandwidth-mbps", str(args.bandwidth_mbps), capacity_gb=8.0) as kv:
        extra = ["--vericache", "--vericache-tier", kv.spec, "--vericache-compressor",
                 args.compressor, "--vericache-fetch-drafting", drafting]  # fmt: skip
        with SGLangServer(base + extra, log_path=work / f"{slug}.log") as server:
            result = replay(server.url, sessions, work / f"{slug}.json", args)
            result["counters"] = vericache_counters(server.url)
        result["tier"] = kv.stats()
    return result


def summarize(runs: dict[str, dict], budget: int, args: argparse.Namespace) -> dict:
    """Per configuration: latency by turn (median/p90 over sessions), totals, and answers
    compared with plain SGLang's by (session, turn)."""
    key = lambda r: (r["session_id"], r["turn"])  # noqa: E731
    ref = {key(r): r.get("output_sha256") for r in runs[PLAIN]["turns"]}
    out: dict[str, dict] = {}
    for name, run in runs.items():
        rows = [r for r in run["turns"] if "error" not in r]
        links = run.get("counters", {}).get("vericache:tier_link_events", {})
        out[name] = {
            "by_turn": {k: {m: {q: round(v[q], 3) for q in ("median", "p90")}
                            for m, v in t.items() if m in ("ttft_s", "e2e_s")}
                        for k, t in run["summary"]["by_turn"].items()},  # fmt: skip
            "all": {m: {q: round(v[q], 3) for q in ("median", "p90")}
                    for m, v in run["summary"]["all"].items()},  # fmt: skip
            "wall_s": round(run["meta"]["wall_s"], 1),
            "errors": run["summary"]["errors"],
            "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in rows),
            "recomputed_tokens": sum((r["prompt_tokens"] or 0) - (r.get("cached_tokens") or 0)
                                     for r in rows),  # fmt: skip
            "tier_hit_tokens": int(links.get("hits_tokens", 0)),
            "tier_bytes_out": int(run.get("tier", {}).get("bytes_out", 0)),
            "identical": sum(1 for r in rows if ref.get(key(r)) == r.get("output_sha256")),
            "answers": len(rows),
        }  # fmt: skip
    return {"sessions": args.sessions, "turns": args.turns, "max_tokens": args.max_tokens,
            "holds": args.holds, "max_total_tokens": budget, "think_s": args.think_s,
            "bandwidth_mb_s": args.bandwidth_mbps, "compressor": args.compressor,
            "configs": out}  # fmt: skip


def markdown(report: dict) -> str:
    cfg = report["configs"]
    names = list(cfg)
    plain = cfg[PLAIN]
    lines = [f"{report['sessions']} agent sessions at once x {report['turns']} turns, "
             f"{report['max_tokens']} tokens per answer, {report['think_s']:g} s between turns; "
             f"`--max-total-tokens {report['max_total_tokens']}` (the final prefixes of "
             f"{report['holds']} sessions, each counted with the system prompt the fleet "
             f"shares); KV server throttled to "
             f"{report['bandwidth_mb_s']:g} MB/s; compressor `{report['compressor']}`.", "",
             "| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]  # fmt: skip

    def row(label: str, cell) -> None:  # noqa: ANN001
        lines.append(f"| {label} | " + " | ".join(cell(cfg[n]) for n in names) + " |")

    row("E2E per turn, median / p90 s", lambda c: f"{c['all']['e2e_s']['median']:.2f} / "
                                                  f"{c['all']['e2e_s']['p90']:.2f}")
    row("TTFT per turn, median / p90 s", lambda c: f"{c['all']['ttft_s']['median']:.2f} / "
                                                   f"{c['all']['ttft_s']['p90']:.2f}")
    speedup = lambda c: plain["all"]["e2e_s"]["median"] / c["all"]["e2e_s"]["median"]  # noqa: E731
    row("median E2E, plain / this", lambda c: f"**{speedup(c):.2f}x**")
    if SAME_ATTENTION in cfg:
        same = cfg[SAME_ATTENTION]["all"]["e2e_s"]["median"]
        row(f"median E2E, {SAME_ATTENTION} / this",
            lambda c: f"{same / c['all']['e2e_s']['median']:.2f}x")
    row("wall time of all turns s", lambda c: f"{c['wall_s']:.0f}")
    row("prompt tokens recomputed", lambda c: f"{c['recomputed_tokens']} of {c['prompt_tokens']}")
    row("tokens fetched from the tier", lambda c: f"{c['tier_hit_tokens']}")
    row("bytes the KV server sent", lambda c: f"{c['tier_bytes_out'] / 1e6:.0f} MB")
    row("answers identical to plain", lambda c: f"{c['identical']}/{c['answers']}")
    row("request errors", lambda c: f"{c['errors']}")
    lines += ["", "Per turn (median / p90 s over sessions):", "",
              "| turn | " + " | ".join(f"TTFT: {n}" for n in names) + " | "
              + " | ".join(f"E2E: {n}" for n in names) + " |",
              "|---" * (2 * len(names) + 1) + "|"]  # fmt: skip
    for k in plain["by_turn"]:
        cells = [cfg[n]["by_turn"].get(k) for n in names]
        fmt = lambda c, m: f"{c[m]['median']:.2f} / {c[m]['p90']:.2f}" if c else "-"  # noqa: E731
        lines.append(f"| {k} | " + " | ".join(fmt(c, "ttft_s") for c in cells) + " | "
                     + " | ".join(fmt(c, "e2e_s") for c in cells) + " |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = session_args(__doc__, "agent_capacity")
    ap.set_defaults(sessions=16, max_tokens=32)
    ap.add_argument("--holds", type=int, default=4,
                    help="sessions whose final full prefixes fit in the KV budget")
    ap.add_argument("--compressor", default="snapkv:ratio=0.25")
    ap.add_argument("--system-tokens", type=int, default=1000,
                    help="each session's system prompt (instructions + tool schemas: >= ~900)")
    ap.add_argument("--reuse", type=Path, default=None,
                    help="a previous run's directory: configurations it finished are not rerun "
                    "(the workload is seeded, so its sessions are these)")
    args = ap.parse_args()
    work, sessions, base = build_sessions(args, "agent-capacity-", "--system-tokens",
                                          str(args.system_tokens))  # fmt: skip
    if args.reuse and (args.reuse / "sessions.jsonl").read_bytes() != sessions.read_bytes():
        raise SystemExit(f"--reuse {args.reuse}: its sessions differ from these (other options?)")
    budget = budget_tokens(sessions, args.holds, args.max_tokens, args.system_tokens)
    base[base.index("--max-total-tokens") + 1] = str(budget)
    base.append("--enable-metrics")  # the VeriCache counters; on every server, for parity
    runs = {name: run_config(name, drafting, base + flags, sessions, work, args)
            for name, (drafting, flags) in CONFIGS.items()}  # fmt: skip
    report = summarize(runs, budget, args)
    write_report(args.out, report, markdown(report))
    print(f"server logs and replays: {work}")


if __name__ == "__main__":
    main()
