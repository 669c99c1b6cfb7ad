"""JSON-schema tool calls in agent sessions: drafted under ``--vericache``, identical to plain.

Agent frameworks constrain each answer to a tool call with a JSON schema (OpenAI
``response_format: json_schema``). This replays the same agent sessions
(``scripts/agentic_workload.py``: long system prompt + tool schemas + growing history) against
plain SGLang and against ``--vericache`` (``scripts/replay_agentic.py --json-tool-calls``:
greedy, every answer constrained to ``{"tool": ..., "arguments": {...}}`` over the session's
tools), compares the answers turn by turn, and reads the ``--vericache`` server's Prometheus
counters to show the constrained requests were drafted, not decoded plainly:
``vericache:requests_total`` by mode, drafted / accepted / committed tokens and verifies.

    python benchmark/agentic_tool_calls.py                 # 4 sessions x 4 turns, ~10 min

Writes benchmark/results/agentic_tool_calls.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import urllib.request
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sglang_vericache.exactness.server import SGLangServer  # noqa: E402
from sglang_vericache.models import ensure_default_model  # noqa: E402

_SAMPLE = re.compile(r'^(vericache:\w+?)(?:_total)?\{([^}]*)\}\s+([0-9.eE+-]+)$')


def vericache_counters(url: str) -> dict[str, dict[str, float]]:
    """``{metric: {label value (mode, decision, phase, event, kind or proposer; else ''): value}}``
    from /metrics."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1).endswith(("_bucket", "_created")):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        key = next((labels[k] for k in ("mode", "decision", "phase", "event", "kind", "proposer")
                    if k in labels), "")
        out[m.group(1)][key] = out[m.group(1)].get(key, 0.0) + float(m.group(3))
    return dict(out)


def replay(url: str, sessions: Path, out: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(REPO / "scripts/replay_agentic.py"), str(sessions), "--url", url,
           "--max-tokens", str(args.max_tokens), "--json-tool-calls", "--save-text",
           "--concurrency", str(args.concurrency), "-o", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def summarize(plain: dict, vc: dict, counters: dict, args: argparse.Namespace) -> dict:
    key = lambda r: (r["session_id"], r["turn"])  # noqa: E731
    a = {key(r): r for r in plain["turns"]}
    b = {key(r): r for r in vc["turns"]}
    same = [k for k in a if k in b and a[k]["output_sha256"] == b[k]["output_sha256"]]
    valid = sum(1 for r in vc["turns"] if _is_tool_call(r.get("output") or ""))

    def total(name: str, label: str = "") -> float:
        vals = counters.get(f"vericache:{name}", {})
        return vals.get(label, 0.0) if label else sum(vals.values())

    verifies = total("verify_steps")
    return {
        "sessions": args.sessions, "turns": args.turns, "max_tokens": args.max_tokens,
        "concurrency": args.concurrency, "compressor": args.compressor,
        "draft_len": args.draft_len, "answers": len(a),
        "identical": len(same), "errors": plain["summary"]["errors"] + vc["summary"]["errors"],
        "valid_json_tool_calls": valid,
        "completion_tokens": sum(r["completion_tokens"] or 0 for r in vc["turns"]),
        "requests_by_mode": counters.get("vericache:requests", {}),
        "drafted_tokens": total("drafted_tokens"), "accepted_tokens": total("accepted_tokens"),
        "committed_tokens": total("committed_tokens"), "verifies": verifies,
        "committed_per_verify": total("committed_tokens") / verifies if verifies else 0.0,
        "steps_by_decision": counters.get("vericache:decode_steps", {}),
        "e2e_s": {"plain": plain["summary"]["all"]["e2e_s"], "vericache": vc["summary"]["all"]["e2e_s"]},
    }  # fmt: skip


def _is_tool_call(text: str) -> bool:
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    return isinstance(doc, dict) and {"tool", "arguments"} <= doc.keys()


def markdown(r: dict) -> str:
    modes = ", ".join(f"{m}: {n:.0f}" for m, n in sorted(r["requests_by_mode"].items())) or "none"
    decisions = ", ".join(f"{d}: {n:.0f}" for d, n in sorted(r["steps_by_decision"].items()))
    med = lambda side: r["e2e_s"][side].get("median", float("nan"))  # noqa: E731
    return "\n".join([
        f"{r['sessions']} agent sessions x {r['turns']} turns ({r['concurrency']} at once), greedy, "
        f"every answer constrained by the sessions' tool-call JSON schema, at most "
        f"{r['max_tokens']} tokens; `--vericache --vericache-compressor {r['compressor']} "
        f"--vericache-draft-len {r['draft_len']}` vs plain SGLang.", "",
        "| | value |", "|---|---|",
        f"| answers identical to plain SGLang | **{r['identical']}/{r['answers']}** |",
        f"| answers that parse as a complete tool call | {r['valid_json_tool_calls']}/{r['answers']} |",
        f"| `--vericache` requests by mode | {modes} |",
        f"| decode steps by decision | {decisions} |",
        f"| drafted / accepted tokens | {r['drafted_tokens']:.0f} / {r['accepted_tokens']:.0f} |",
        f"| committed tokens per verify | {r['committed_per_verify']:.2f} (max {int(r['draft_len']) + 1 if str(r['draft_len']).isdigit() else 'auto'}) |",
        f"| median end-to-end s per turn: plain / `--vericache` | {med('plain'):.2f} / {med('vericache'):.2f} |",
        f"| request errors | {r['errors']} |", "",
        "Requests in `greedy` mode carry `meta_info[\"vericache\"][\"constrained\"] = true` when a "
        "grammar masks their drafts; `plain` would mean the grammar kept them from drafting.",
    ]) + "\n"  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--compressor", default="snapkv:ratio=0.25")
    ap.add_argument("--draft-len", default="6")
    ap.add_argument("--out", type=Path, default=REPO / "benchmark/results/agentic_tool_calls")
    args = ap.parse_args()

    model = ensure_default_model()
    work = Path(tempfile.mkdtemp(prefix="agentic-tools-"))
    sessions = work / "sessions.jsonl"
    subprocess.run([sys.executable, str(REPO / "scripts/agentic_workload.py"), "--sessions",
                    str(args.sessions), "--turns", str(args.turns), "--answer-tokens",
                    str(args.max_tokens), "--tokenizer", str(model / "tokenizer.json"),
                    "-o", str(sessions)], check=True)  # fmt: skip
    base = ["--model-path", str(model), "--max-total-tokens", "32768"]
    with SGLangServer(base, log_path=work / "plain.log") as srv:
        plain = replay(srv.url, sessions, work / "plain.json", args)
    vc_args = [*base, "--vericache", "--vericache-compressor", args.compressor,
               "--vericache-draft-len", args.draft_len, "--enable-metrics"]  # fmt: skip
    with SGLangServer(vc_args, log_path=work / "vericache.log") as srv:
        vc = replay(srv.url, sessions, work / "vericache.json", args)
        counters = vericache_counters(srv.url)
    report = summarize(plain, vc, counters, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print(f"logs and raw replies: {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
