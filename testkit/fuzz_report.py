"""The fuzz run's summary: a JSON-able dict and its markdown rendering (pure python).

Every failing case is listed with its full request body, so the JSON is its own reproducer
(POST the body to the endpoint on both servers); the markdown abbreviates long strings.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from testkit import fuzz_compare as fc
from testkit.fuzz import FuzzCase

# summary key for each problem kind
LISTS = {
    fc.STATUS_MISMATCH: "status_mismatches", fc.TOKEN_MISMATCH: "greedy_mismatches",
    fc.COUNT_MISMATCH: "count_mismatches", fc.LOGPROB_MISMATCH: "logprob_violations",
    fc.NO_RESPONSE: "no_response", fc.SERVER_ERROR: "server_errors",
    fc.UNPARSABLE: "unparsable", fc.OUTPUT_COUNT: "output_count_mismatches",
    fc.HIDDEN_MISMATCH: "hidden_state_mismatches",
    fc.DISTRIBUTION_MISMATCH: "distribution_mismatches",
}  # fmt: skip


def summarize(cases: Sequence[FuzzCase], results: Sequence[fc.CaseResult], *, seed: int | None,
              tolerance: float, health: dict[str, dict] | None = None,
              wall_s: float | None = None) -> dict[str, Any]:  # fmt: skip
    """``health``: per server name, ``{"alive", "healthy", "leak"}`` from the end-of-run check."""
    by_index = {c.index: c for c in cases}
    out: dict[str, Any] = {"seed": seed, "requests": len(results), "wall_s": wall_s,
                           "tolerance": tolerance}  # fmt: skip
    out["by_kind"], out["by_tag"] = _breakdown(by_index, results)
    for key in LISTS.values():
        out[key] = []
    for r in results:
        for p in r.problems:
            out[LISTS[p.kind]].append(_entry(by_index[r.index], r, p))
    out["logprob_max_abs_diff"] = max((r.max_logprob_diff for r in results), default=0.0)
    out["logprob_values_compared"] = sum(r.logprobs_compared for r in results)
    p_values = [r.p_value for r in results if r.p_value is not None]
    out["distribution_tests"] = len(p_values)
    out["distribution_min_p"] = min(p_values, default=None)
    health = health or {}
    out["health"] = health
    out["server_deaths"] = sorted(n for n, h in health.items() if not (h["alive"] and h["healthy"]))
    out["leaks"] = [{"server": n, **h["leak"]} for n, h in sorted(health.items()) if h.get("leak")]
    out["failed_cases"] = sum(1 for r in results if not r.ok)
    out["ok"] = not out["failed_cases"] and not out["server_deaths"] and not out["leaks"]
    return out


def _breakdown(by_index: dict[int, FuzzCase], results: Sequence[fc.CaseResult]) -> tuple:
    kinds: dict[str, dict] = defaultdict(lambda: {
        "requests": 0, "failed": 0, "reference_seconds": 0.0, "candidate_seconds": 0.0,
        "problems": Counter(), "statuses": Counter()})  # fmt: skip
    tags: dict[str, dict] = defaultdict(lambda: {"requests": 0, "failed": 0})
    for r in results:
        c = by_index[r.index]
        row = kinds[c.kind]
        row["requests"] += 1
        row["failed"] += not r.ok
        row["reference_seconds"] = round(row["reference_seconds"] + r.ref_seconds, 1)
        row["candidate_seconds"] = round(row["candidate_seconds"] + r.cand_seconds, 1)
        row["statuses"][str(r.ref_status)] += 1
        row["problems"].update(p.kind for p in r.problems)
        for t in c.tags:
            tags[t]["requests"] += 1
            tags[t]["failed"] += not r.ok
    plain = {k: {**v, "problems": dict(v["problems"]), "statuses": dict(v["statuses"])}
             for k, v in sorted(kinds.items())}  # fmt: skip
    return plain, dict(sorted(tags.items()))


def _entry(c: FuzzCase, r: fc.CaseResult, p: fc.Problem) -> dict[str, Any]:
    return {"index": c.index, "kind": c.kind, "tags": list(c.tags), "endpoint": c.endpoint,
            "reference_status": r.ref_status, "candidate_status": r.cand_status, **p.detail,
            "body": c.body}  # fmt: skip


def merge(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Totals over several seeds' summaries (the per-seed ones keep the details)."""
    tot: dict[str, Any] = {"seeds": [s["seed"] for s in summaries],
                           "requests": sum(s["requests"] for s in summaries),
                           "failed_cases": sum(s["failed_cases"] for s in summaries)}  # fmt: skip
    for key in LISTS.values():
        tot[key] = sum(len(s[key]) for s in summaries)
    tot["logprob_max_abs_diff"] = max((s["logprob_max_abs_diff"] for s in summaries), default=0.0)
    tot["distribution_tests"] = sum(s.get("distribution_tests", 0) for s in summaries)
    mins = [s["distribution_min_p"] for s in summaries if s.get("distribution_min_p") is not None]
    tot["distribution_min_p"] = min(mins, default=None)
    tot["server_deaths"] = sum(len(s["server_deaths"]) for s in summaries)
    tot["leaks"] = sum(len(s["leaks"]) for s in summaries)
    failing: Counter = Counter()
    for s in summaries:
        failing.update({k: v["failed"] for k, v in s["by_kind"].items() if v["failed"]})
    tot["failing_kinds"] = dict(failing)
    tot["ok"] = all(s["ok"] for s in summaries)
    return tot


def abbreviate(value: Any, limit: int = 160) -> Any:
    """Long strings and lists shortened (for printing; the JSON keeps them whole)."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[: limit // 2]}...<{len(value)} chars>...{value[-limit // 4:]}"
    if isinstance(value, list) and len(value) > 24:
        return [abbreviate(v, limit) for v in value[:12]] + [f"...<{len(value)} items>"]
    if isinstance(value, list):
        return [abbreviate(v, limit) for v in value]
    if isinstance(value, dict):
        return {k: abbreviate(v, limit) for k, v in value.items()}
    return value


def brief(summary: dict[str, Any], per_list: int = 5) -> str:
    """The summary as indented JSON with at most ``per_list`` entries a list, abbreviated:
    what a failing test prints."""
    short = {k: (v[:per_list] + [f"... {len(v) - per_list} more"] if isinstance(v, list)
                 and len(v) > per_list and k in LISTS.values() else v)
             for k, v in summary.items()}  # fmt: skip
    return json.dumps(abbreviate(short), indent=1, default=str)


def markdown(summaries: Sequence[dict[str, Any]], total: dict[str, Any], header: str = "") -> str:
    columns = ("seed", "requests", "failed", "status", "greedy", "count", "logprob",
               "no answer", "5xx", "max abs logprob diff", "deaths", "leaks", "wall s")
    lines = ["# Request fuzz: plain SGLang vs --vericache\n", header, "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for s in summaries:
        lines.append("| " + " | ".join(str(x) for x in (
            s["seed"], s["requests"], s["failed_cases"], len(s["status_mismatches"]),
            len(s["greedy_mismatches"]), len(s["count_mismatches"]),
            len(s["logprob_violations"]), len(s["no_response"]), len(s["server_errors"]),
            f"{s['logprob_max_abs_diff']:.2e}", ",".join(s["server_deaths"]) or 0,
            len(s["leaks"]), f"{s['wall_s'] or 0:.0f}")) + " |")  # fmt: skip
    verdict = "PASS" if total["ok"] else "FAIL"
    kinds = total["failing_kinds"] or "none"
    failing = f"{total['failed_cases']} failing of {total['requests']} requests"
    lines += ["", f"**{verdict}**: {failing}; failing kinds: {kinds}.", ""]
    for s in summaries:
        lines += _markdown_failures(s)
    return "\n".join(lines) + "\n"


def _markdown_failures(s: dict[str, Any], per_list: int = 3) -> list[str]:
    lines = []
    for key in LISTS.values():
        for e in s[key][:per_list]:
            body = json.dumps(abbreviate(e["body"], 120))
            lines.append(f"- seed {s['seed']} #{e['index']} `{key}` {e['kind']} {e['endpoint']}: "
                         f"`{body}`")  # fmt: skip
    return (["## Failures (first few per list and seed; the JSON has all)", ""] + lines + [""]
            if lines else [])  # fmt: skip
