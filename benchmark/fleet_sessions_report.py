"""The pure half of benchmark/fleet_sessions.py: replays in, figures and tables out. No server.

``runs`` is ``{phase: {config: replay result | {"skipped": reason}}}``, a phase being a budget
("ample", "tight") or "<budget>, replica killed"; a replay result is
``scripts/replay_agentic.py``'s object plus ``counters`` (each live replica's ``/metrics``
counters), ``tier`` (the zmq KV server's stats) and, in a killed phase, ``kill_s`` (the kill's
time on the rows' ``start_s`` clock).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

REFERENCE = "plain"  # answers compare with this config's at the first phase


def _q(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "p90": None}
    v = sorted(values)
    p90 = v[min(len(v) - 1, int(0.9 * len(v)))]
    return {"median": round(statistics.median(v), 3), "p90": round(p90, 3)}


def _key(row: dict) -> tuple[str, int]:
    return row["session_id"], row["turn"]


def by_session(rows: list[dict]) -> dict[str, list[dict]]:
    """Replay rows grouped by session, each session's in the rows' order."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["session_id"], []).append(r)
    return out


def next_answers(rows: list[dict], kill_s: float) -> list[float | None]:
    """Per session, the end-to-end latency of its first turn answered after the kill (the turn
    in flight then, retried where it failed, or the next one sent); None where the session got
    no answer (its turn failed every try).

        turn:   |---- start_s ----|============ e2e_s ============|
        kill:                   ^ kill_s                  answer ^   (ends after the kill)

    The whole turn counts, not only its part after the kill: that part depends on how far the
    session's turn had run when the kill came, which is how spread the sessions' turns are,
    not what the failover costs.
    """
    waits: list[float | None] = []
    for srows in by_session(rows).values():
        for r in sorted(srows, key=lambda r: r["start_s"]):
            if "error" in r:
                waits.append(None)
                break
            if r["start_s"] + r["e2e_s"] > kill_s:
                waits.append(round(r["e2e_s"], 3))
                break
    return waits


CARRIED = 0.9  # a moved turn "found its prefix" when this much of the previous prompt was cached


def moved_turns(rows: list[dict]) -> dict[str, Any]:
    """Turns the gateway sent to another replica than their session's previous turn, and how
    many of them found that turn's prefix: cached tokens at least ``CARRIED`` of the previous
    turn's prompt (which the other replica computed). A replica holds the shared system prompt
    anyway, so a moved turn that recomputes its history still shows some cached tokens.

        turn k-1 on replica A: [system | history_k-1]              prompt_tokens(k-1)
        turn k   on replica B: [system | history_k-1 | answer | tool]  cached >= 0.9 x that
    """
    moved, found = 0, 0
    for srows in by_session(rows).values():
        srows = sorted(srows, key=lambda r: r["turn"])
        for prev, r in zip(srows, srows[1:]):
            if "error" in r or "error" in prev or not (prev.get("worker") and r.get("worker")):
                continue
            if r["worker"] != prev["worker"]:
                moved += 1
                found += (r.get("cached_tokens") or 0) >= CARRIED * (prev["prompt_tokens"] or 0)
    return {"moved": moved, "found_prefix": found}


def skip_reason(text: str) -> str:
    """The line that says why a configuration did not run: the last ``...Error: ...`` line of
    its log tail when there is one (a server's start-up traceback), else the first line."""
    errors = [ln.strip() for ln in text.splitlines() if "Error: " in ln]
    return (errors[-1] if errors else text.splitlines()[0] if text else "?")[:300]


def recomputed(rows: list[dict]) -> int:
    """Prompt tokens the servers computed for ``rows``: prompt less what their caches served."""
    return sum((r["prompt_tokens"] or 0) - (r.get("cached_tokens") or 0) for r in rows)


def summarize_gsp(gsp: dict | None, reference: list[str]) -> dict[str, Any] | None:
    """SGLang's client's run through the gateway: its figures, and its texts equal to the
    reference's position by position (None where it did not run)."""
    if gsp is None:
        return None
    if "error" in gsp:
        return {"error": gsp["error"][:300]}
    m, texts = gsp["metrics"], gsp["texts"]
    return {"output_tok_s": m.get("output_throughput"), "ttft_ms": m.get("median_ttft_ms"),
            "tpot_ms": m.get("median_tpot_ms"), "errors": m.get("errors", 0),
            "identical": sum(a == b for a, b in zip(reference, texts)) if reference else None,
            "texts": len(texts)}  # fmt: skip


def summarize_run(run: dict, reference: dict[tuple[str, int], str],
                  gsp_reference: list[str] | None = None) -> dict[str, Any]:  # fmt: skip
    if "skipped" in run:
        return {"skipped": skip_reason(run["skipped"])}
    rows = run["turns"]
    ok = [r for r in rows if "error" not in r]
    hits = sum(c.get("vericache:tier_link_events", {}).get("hits_tokens", 0.0)
               for c in run.get("counters", []))  # fmt: skip
    compared = [r for r in ok if _key(r) in reference]
    out: dict[str, Any] = {
        "ttft_s": _q([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
        "e2e_s": _q([r["e2e_s"] for r in ok]),
        "by_turn": {str(k): _q([r["e2e_s"] for r in ok if r["turn"] == k])
                    for k in sorted({r["turn"] for r in ok})},  # fmt: skip
        "wall_s": round(run["meta"]["wall_s"], 1),
        "output_tok_s": round(sum(r["completion_tokens"] or 0 for r in ok)
                              / max(run["meta"]["wall_s"], 1e-9), 2),  # fmt: skip
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
        "recomputed_tokens": recomputed(ok),
        "tier_hit_tokens": int(hits),
        "tier_bytes_out": int(run.get("tier", {}).get("bytes_out", 0)),
        "identical": sum(1 for r in compared if reference[_key(r)] == r["output_sha256"]),
        "compared": len(compared), "answers": len(ok), "errors": len(rows) - len(ok),
        "retried_turns": sum(1 for r in rows if (r.get("attempts") or 1) > 1),
        "moved": moved_turns(rows),
        "gsp": summarize_gsp(run.get("gsp"), gsp_reference or []),
    }  # fmt: skip
    if "kill_s" in run:
        kill = run["kill_s"]
        waits = next_answers(rows, kill)
        after = [r for r in ok if r["start_s"] + r["e2e_s"] > kill]
        out["kill"] = {
            "kill_s": kill, "next_answer_s": _q([w for w in waits if w is not None]),
            "sessions_without_answer": sum(w is None for w in waits),
            "e2e_after_s": _q([r["e2e_s"] for r in after]),
            "recomputed_after": recomputed(after),
            "prompt_after": sum(r["prompt_tokens"] or 0 for r in after),
        }
    return out


def summarize(runs: dict[str, dict[str, dict]], labels: dict[str, str], budgets: dict[str, int],
              args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    first = next(iter(runs.values()), {}).get(REFERENCE, {})
    reference = {_key(r): r["output_sha256"] for r in first.get("turns", []) if "error" not in r}
    gsp_reference = (first.get("gsp") or {}).get("texts", [])
    phases = {p: {n: summarize_run(run, reference, gsp_reference) for n, run in by_config.items()}
              for p, by_config in runs.items()}  # fmt: skip
    for by_config in phases.values():
        base = by_config.get(REFERENCE, {}).get("e2e_s", {}).get("median")
        for s in by_config.values():
            med = s.get("e2e_s", {}).get("median")
            s["e2e_speedup_vs_plain"] = round(base / med, 3) if base and med else None
    return {"sessions": args.sessions, "turns": args.turns, "max_tokens": args.max_tokens,
            "think_s": args.think_s, "replicas": args.replicas, "system_tokens": args.system_tokens,
            "holds_tight": args.holds_tight, "bandwidth_mb_s": args.bandwidth_mbps,
            "compressor": args.compressor, "budgets": budgets, "labels": labels,
            "gsp_prompts": args.gsp_prompts, "gsp_turns": args.gsp_turns,
            "gsp_input_len": args.gsp_input_len, "phases": phases}  # fmt: skip


def median_p90(q: dict | None, fmt: str = ".2f") -> str:
    """``{"median", "p90"}`` as "median / p90"; "-" where there is none."""
    if not q or q.get("median") is None:
        return "-"
    return f"{q['median']:{fmt}} / {q['p90']:{fmt}}"


def moved_cell(m: dict | None) -> str:
    return f"{m['found_prefix']} of {m['moved']}" if m and m["moved"] else "-"


ROWS = (
    ("E2E per turn, median / p90 s", lambda s: median_p90(s["e2e_s"])),
    ("TTFT per turn, median / p90 s", lambda s: median_p90(s["ttft_s"])),
    ("median E2E, plain / this", lambda s: f"**{s['e2e_speedup_vs_plain']:.2f}x**"
     if s.get("e2e_speedup_vs_plain") else "-"),
    ("output tok/s (all sessions)", lambda s: f"{s['output_tok_s']:.1f}"),
    ("prompt tokens recomputed", lambda s: f"{s['recomputed_tokens']} of {s['prompt_tokens']}"),
    ("tokens served by the tier", lambda s: str(s["tier_hit_tokens"])),
    ("turns moved to another replica: found their prefix", lambda s: moved_cell(s.get("moved"))),
    ("answers identical to (a)", lambda s: f"{s['identical']}/{s['compared']}"),
    ("failed turns (retried turns)", lambda s: f"{s['errors']} ({s['retried_turns']})"),
)
def gsp_cell(g: dict | None, what: str) -> str:
    if not g:
        return "-"
    if "error" in g:
        return "failed" if what == "tok" else "-"
    if what == "tok":
        return f"{g['output_tok_s']:.1f}" if g["output_tok_s"] is not None else "-"
    if what == "lat":
        return f"{g['ttft_ms']:.0f} / {g['tpot_ms']:.0f}" if g["ttft_ms"] is not None else "-"
    return f"{g['identical']}/{g['texts']}" if g["identical"] is not None else "-"


GSP_ROWS = (  # sglang.benchmark.serving through the gateway (absent in a killed phase)
    ("SGLang client (generated-shared-prefix): output tok/s",
     lambda s: gsp_cell(s.get("gsp"), "tok")),
    ("SGLang client: median TTFT / TPOT ms", lambda s: gsp_cell(s.get("gsp"), "lat")),
    ("SGLang client: texts identical to (a)", lambda s: gsp_cell(s.get("gsp"), "same")),
)
KILL_ROWS = (
    ("first turn answered after the kill, E2E median / p90 s",
     lambda k: median_p90(k["next_answer_s"])),
    ("E2E of turns ending after it, median / p90 s", lambda k: median_p90(k["e2e_after_s"])),
    ("prompt tokens recomputed after it",
     lambda k: f"{k['recomputed_after']} of {k['prompt_after']}"),
    ("sessions left without an answer", lambda k: str(k["sessions_without_answer"])),
)


def markdown(report: dict[str, Any]) -> str:
    lines = [f"`{report.get('command', 'python benchmark/fleet_sessions.py')}` on "
             f"{report.get('date', '?')}: {report['sessions']} agent sessions at once x "
             f"{report['turns']} turns, {report['max_tokens']} tokens per answer, "
             f"{report['think_s']:g} s between turns, {report['replicas']} replicas behind smg "
             f"(`cache_aware`); budgets per replica: "
             + ", ".join(f"{b} `--max-total-tokens {t}`" for b, t in report["budgets"].items())
             + f" (tight: the final prefixes of {report['holds_tight']} sessions); zmq KV server "
             f"throttled to {report['bandwidth_mb_s']:g} MB/s; compressor "
             f"`{report['compressor']}`."]  # fmt: skip
    for phase, by_config in report["phases"].items():
        names = list(by_config)
        head = [report["labels"].get(n, n) for n in names]
        lines += ["", f"**{phase}**", "", "| | " + " | ".join(head) + " |",
                  "|---" * (len(names) + 1) + "|"]  # fmt: skip
        skipped = {n: s["skipped"] for n, s in by_config.items() if "skipped" in s}
        ran = [n for n in names if n not in skipped]
        rows = ROWS + (GSP_ROWS if any(by_config[n].get("gsp") for n in ran) else ()) + (
            tuple((lbl, lambda s, f=f: f(s["kill"])) for lbl, f in KILL_ROWS)
            if any("kill" in by_config[n] for n in ran) else ())  # fmt: skip
        for label, cell in rows:
            cells = [cell(by_config[n]) if n in ran else "not run" for n in names]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines += [f"- {report['labels'].get(n, n)}: not run: {why}" for n, why in skipped.items()]
    return "\n".join(lines) + "\n"
