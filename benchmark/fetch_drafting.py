"""Agent sessions on one --vericache server whose full-KV prefixes come back from a slow tier.

With a remote tier a ``--vericache`` server writes every finished turn through to the KV server
and keeps it on the device while the pool has room. With ``--kv-budget`` short of the sessions'
prefixes, eviction demotes a turn (its compressed KV stays, its full KV is in the tier), and
its next turn must fetch the prefix back: that is where drafting while fetching can pay.
Side by side, same sessions, greedy, each configuration with its own fresh KV server throttled
to ``--bandwidth-mbps`` (default 100 MB/s):

- ``plain``: SGLang without --vericache, the prefix stays on the device (the reference answers);
- ``fetch, then decode``: ``--vericache-fetch-drafting off``: the request waits for its
  prefix, then prefills and drafts as usual;
- ``draft while fetching``: the request is drafted from the local compressed prefix while its
  full KV streams in; the first verifications check those drafts.

    python benchmark/fetch_drafting.py              # 2 sessions x 5 turns, 64 tokens per answer
    python benchmark/fetch_drafting.py --kv-budget 4096 --bandwidth-mbps 25   # turns demoted

Writes benchmark/results/fetch_drafting.{json,md}: median TTFT and end-to-end latency per turn,
the ratios, the drafts made / verified while fetching (from the server logs), and whether every
configuration produced the plain server's answers.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmark"))

from remote_prefix import build_sessions, per_turn, replay, session_args  # noqa: E402

from sglang_vericache.exactness.server import SGLangServer  # noqa: E402
from testkit.tier_server import ServerProcess  # noqa: E402

CONFIGS = {"plain": None, "fetch, then decode": "off", "draft while fetching": "on"}
STARTED = re.compile(r"drafting while its prefix is fetched")
USED = re.compile(r"(\d+) drafts made while fetching its prefix, (\d+) verified")


def run_config(name: str, drafting: str | None, base: list[str], sessions: Path, work: Path,
               args: argparse.Namespace) -> dict:  # fmt: skip
    slug = name.replace(",", "").replace(" ", "-")
    if drafting is None:
        with SGLangServer(base, log_path=work / f"{slug}.log") as server:
            return replay([server.url], sessions, work / f"{slug}.json", args)
    with ServerProcess("--bandwidth-mbps", str(args.bandwidth_mbps), capacity_gb=4.0) as kv:
        extra = ["--vericache", "--vericache-tier", kv.spec, "--vericache-compressor",
                 args.compressor, "--vericache-fetch-drafting", drafting]  # fmt: skip
        with SGLangServer(base + extra, log_path=work / f"{slug}.log") as server:
            result = replay([server.url], sessions, work / f"{slug}.json", args)
    log = (work / f"{slug}.log").read_text()
    used = [(int(m), int(v)) for m, v in USED.findall(log)]
    result["drafting"] = {"started": len(STARTED.findall(log)),
                          "made": sum(m for m, _ in used), "verified": sum(v for _, v in used)}
    return result


def main() -> None:
    ap = session_args(__doc__, "fetch_drafting")
    ap.add_argument("--compressor", default="kivi:bits=4")
    ap.add_argument("--no-plain", action="store_true",
                    help="skip the plain server (answers are then compared between the two "
                    "VeriCache configurations only)")
    ap.add_argument("--kv-budget", type=int, default=None,
                    help="every server's --max-total-tokens (default: build_sessions' ample one)")
    args = ap.parse_args()
    work, sessions, base = build_sessions(args, "fetch-drafting-")
    if args.kv_budget is not None:
        base[base.index("--max-total-tokens") + 1] = str(args.kv_budget)
    configs = {n: d for n, d in CONFIGS.items() if not (args.no_plain and d is None)}
    runs = {name: run_config(name, d, base, sessions, work, args) for name, d in configs.items()}
    report = summarize(runs, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print(f"server logs and replays: {work}")


def summarize(runs: dict[str, dict], args: argparse.Namespace) -> dict:
    hashes = {name: [r["output_sha256"] for r in run["turns"]] for name, run in runs.items()}
    return {
        "sessions": args.sessions, "turns": args.turns, "max_tokens": args.max_tokens,
        "bandwidth_mb_s": args.bandwidth_mbps, "think_s": args.think_s,
        "kv_budget": args.kv_budget,
        "compressor": args.compressor,
        "reference": next(iter(hashes)),
        "identical_outputs": {name: h == next(iter(hashes.values())) for name, h in hashes.items()},
        "per_turn": {name: per_turn(run) for name, run in runs.items()},
        "drafting": {name: run.get("drafting") for name, run in runs.items()},
    }  # fmt: skip


def markdown(report: dict) -> str:
    names = list(report["per_turn"])
    off, on = names[-2], names[-1]
    lines = [f"{report['sessions']} agent sessions x {report['turns']} turns on one server, "
             f"{report['max_tokens']} tokens per answer, {report['think_s']:g} s between turns; "
             f"KV server throttled to {report['bandwidth_mb_s']:g} MB/s; compressor "
             f"`{report['compressor']}`; KV budget {report.get('kv_budget') or 'ample'} tokens. "
             "Medians over sessions.", "",
             "| turn | prompt tokens | cached tokens | "
             + " | ".join(f"TTFT s: {n}" for n in names) + " | "
             + " | ".join(f"E2E s: {n}" for n in names)
             + " | TTFT off / on | E2E off / on |",
             "|---" * (2 * len(names) + 5) + "|"]  # fmt: skip
    for k, row in report["per_turn"][on].items():
        cells = [report["per_turn"][n][k] for n in names]
        lines.append(f"| {k} | {row['prompt_tokens']:.0f} | {row['cached']:.0f} | "
                     + " | ".join(f"{c['ttft_s']:.2f}" for c in cells) + " | "
                     + " | ".join(f"{c['e2e_s']:.2f}" for c in cells)
                     + f" | {cells[-2]['ttft_s'] / cells[-1]['ttft_s']:.2f}x"
                     + f" | {cells[-2]['e2e_s'] / cells[-1]['e2e_s']:.2f}x |")  # fmt: skip
    same = ", ".join(f"{n}: {'yes' if ok else 'NO'}" for n, ok in report["identical_outputs"].items())
    d = report["drafting"][on]
    lines += ["", f"Same answers as `{report['reference']}`: {same}.",
              f"`{on}`: {d['started']} requests drafted while fetching, {d['made']} drafts made, "
              f"{d['verified']} of them sent to verification. `off / on` compares `{off}` with "
              f"`{on}`."]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
