"""Results page sections about the remote KV tier: remote prefix across replicas, LMCache end to
end, an agent fleet on a tight budget, drafting while the prefix is fetched.

Each renderer takes a ``results_page.Results`` and returns the section's body lines: fixed text
(what is measured; limits and negative results) around tables built from the result files.
"""

from __future__ import annotations

from benchmark.fleet_sessions_report import gsp_cell, median_p90, moved_cell, skip_reason
from benchmark.results_page import Results, fx, prose, ratio_over_turns, span, table

REMOTE_TEXT = """
Agent sessions (`scripts/agentic_workload.py`: a 1.5k-token system prompt with tool schemas, then
tool results and follow-ups) replayed with turn k on replica k mod 2, so every turn's prefix was
computed on the *other* replica. Plain SGLang replicas recompute it; `--vericache --vericache-tier
zmq://...` replicas fetch it from one KV server throttled to 100 MB/s; a single plain server is the
reference for the answers. Plain replicas with `--attention-backend vericache` extend a prefix hit
as cheaply as VeriCache does, so the ratio against them is what the tier itself buys. Ratios are
the other configuration's time over VeriCache's, turns 0-4 (above 1: VeriCache is faster).
"""

REMOTE_LIMITS = """
Limits, plainly: turn 0 has nothing to fetch and pays a tier lookup and its compressed KV for
nothing; decode is at parity (at 2-3k tokens and batch 1-2 the planner decodes plainly). Fetching
pays where prefill costs more than the link's bytes (fp32 SmolLM2: 46 KB a token, ~90 MB for 2k
tokens, about a second at 100 MB/s); the link measures both. Details per turn: REMOTE_LINKS.
"""


def remote_prefix(res: Results) -> list[str]:
    data = res.load("remote_prefix.json")
    if not data:
        return ["Not yet run: `python benchmark/remote_prefix.py`."]
    pt, tier = data["per_turn"], "replicas, remote tier (VeriCache)"
    same = "yes" if all(data["identical_outputs"].values()) else "NO"
    rows = []
    for other, label in [("replicas, recompute", "plain replicas that recompute"),
                         ("replicas, recompute, vericache attention",
                          "plain replicas, vericache attention")]:  # fmt: skip
        ttft = ratio_over_turns(pt, other, tier, "ttft_s")
        e2e = ratio_over_turns(pt, other, tier, "e2e_s")
        rows.append(res.row("remote_prefix.json", [
            label, ", ".join(f"{r:.2f}" for r in ttft), ", ".join(f"{r:.2f}" for r in e2e),
            f"{pt[other]['1']['cached']:.0f} / {pt[tier]['1']['cached']:.0f}", same],
            "python benchmark/remote_prefix.py"))  # fmt: skip
    lines = prose(REMOTE_TEXT) + [""]
    lines += table(["VeriCache replicas against", "TTFT ratio by turn", "E2E ratio by turn",
                    "turn 1 cached tokens: other / VeriCache", "answers identical"], rows)
    links = res.links("remote_prefix.md")
    return lines + [""] + prose(REMOTE_LIMITS.replace("REMOTE_LINKS", links))


LMCACHE_TEXT = """
The same agent sessions on one plain SGLang server, then on two `--vericache --vericache-tier
lmcache://` replicas sharing a real `lmcache server` 0.5.6 (engine-driven, `--chunk-size 128`),
turn k on replica k mod 2; then faults. LMCache cannot share CI's venv (its pins conflict with
sglang's), so `scripts/lmcache_venv.sh` builds `.venv-lmcache` for it.
"""

LMCACHE_LIMITS = """
Limits, plainly: `lmcache server` 0.5.6's request port has no authentication: keep it on a trusted
network. Its client does not notice a lost connection, so a fetch in flight when LMCache dies ends
at its fetch deadline (the zmq client fails it at once), and after a restart the first
write-through costs about two client timeouts. TTFT was compared with one plain server only.
"""


def lmcache(res: Results) -> list[str]:
    data = res.load("lmcache_e2e.json")
    command = ("bash scripts/lmcache_venv.sh && "
               ".venv-lmcache/bin/python benchmark/lmcache_e2e.py --turns 3")
    if not data:
        return [f"Not yet run: `{command}`."]
    replay = (f"{data['sessions']} sessions x {data['turns']} turns on two replicas "
              f"(lmcache {data['versions']['lmcache']})")  # fmt: skip
    hit = max(c.get("hits_tokens", 0) for c in data["link_counters_after_replay"].values())
    rows = [res.row("lmcache_e2e.json", [
        replay, "answers equal plain SGLang's; a turn hits the other replica's prefix",
        data["replay_identical"], "yes" if data["passed"] else "NO", f"{hit:.0f} fetched", "-"],
        command)]  # fmt: skip
    for f in data["faults"]:
        rows.append(res.row("lmcache_e2e.json", [
            f["name"], f["expect"], "yes" if f["identical"] else "NO", "yes" if f["ok"] else "NO",
            f"{f['cached_tokens']} / {f['prompt_tokens']}", f["latency_s"]], command))
    lines = prose(LMCACHE_TEXT) + [""]
    lines += table(["check", "expected", "identical", "as expected", "cached / prompt tokens",
                    "latency s"], rows)  # fmt: skip
    return lines + ["", f"Details: {res.links('lmcache_e2e.md')}.", ""] + prose(LMCACHE_LIMITS)


FLEET_TEXT = """
16 agent sessions at once (one system prompt shared by the fleet, each session its own task, tool
results and follow-ups), 5 turns each, 32 tokens per answer, 3 s between turns, on one server
whose `--max-total-tokens` holds the final prefixes of about 4 of them. Plain SGLang (radix LRU:
an evicted prefix is recomputed) against `--vericache --vericache-tier zmq://...` on a KV server
throttled to 100 MB/s, fetching evicted prefixes back (or recomputing where that measures faster),
without and with drafting while fetching, and plain SGLang with `--attention-backend vericache`.
"""

FLEET_LIMITS = """
Limits, plainly: one run each way; a turn's median here is one scheduling accident (the sessions
run in lockstep) and has moved by 0.9-1.7x between runs of comparable code. Drafting while fetching
gains less: its demoted prefixes hold pool slots, so full prefixes are evicted sooner, and its
drafts use only idle compute, which 16 busy sessions do not leave.
"""


def agent_fleet(res: Results) -> list[str]:
    data = res.load("agent_capacity.json")
    if not data:
        return ["Not yet run: `python benchmark/agent_capacity.py`."]
    configs = data["configs"]
    plain = configs["plain SGLang"]["all"]["e2e_s"]["median"]
    same_attn = configs.get("plain SGLang, vericache attention", {}).get("all", {})
    rows = []
    for name, c in configs.items():
        e2e, ttft = c["all"]["e2e_s"], c["all"]["ttft_s"]
        vs_attn = same_attn and same_attn["e2e_s"]["median"] / e2e["median"]
        rows.append(res.row("agent_capacity.json", [
            name, f"{e2e['median']:.1f} / {e2e['p90']:.1f}",
            f"{ttft['median']:.1f} / {ttft['p90']:.1f}",
            fx(plain / e2e["median"]), fx(vs_attn or None), f"{c['wall_s']:.0f}",
            f"{c['recomputed_tokens']} of {c['prompt_tokens']}", c["tier_hit_tokens"],
            f"{c['identical']}/{c['answers']}"], "python benchmark/agent_capacity.py"))
    lines = prose(FLEET_TEXT) + [""]
    lines += table(["configuration", "E2E per turn median / p90 s", "TTFT median / p90 s",
                    "median E2E vs plain", "vs vericache attention", "wall s, all turns",
                    "prompt tokens recomputed", "tokens fetched", "identical"], rows)
    lines += ["", f"Details per turn: {res.links('agent_capacity.md')}.", ""]
    return lines + prose(FLEET_LIMITS)


FETCH_RUNS = {
    "fetch_drafting_25mbps.json": "python benchmark/fetch_drafting.py --bandwidth-mbps 25 "
    "--out benchmark/results/fetch_drafting_25mbps",
    "fetch_drafting_25mbps_tight.json": "python benchmark/fetch_drafting.py --kv-budget 4096 "
    "--bandwidth-mbps 25 --out benchmark/results/fetch_drafting_25mbps_tight",
}

FETCH_TEXT = """
Two agent sessions x 5 turns on one server, each configuration with a fresh KV server throttled as
stated: plain SGLang (the reference answers), `--vericache-fetch-drafting off` (fetch, then decode)
and `on` (a request waiting for its prefix is drafted on a background thread from the longest
demoted prefix of its prompt; its first verifications check those drafts). A short KV budget
demotes a session's prefix between turns. Ratios turn by turn; above 1: the second named is faster.
"""

FETCH_LIMITS = """
Limits, plainly: TTFT cannot drop below the fetch (the first token comes from the full KV), and
the drafter uses only compute the server leaves idle; here the other session kept it busy: **0
drafts**, parity with fetch-then-decode. It needs idle compute beside a slow fetch (a GPU on a
1-3 GB/s storage link, the paper's setting); on this CPU the gain is the tier, not drafting.
"""


def fetch_drafting(res: Results) -> list[str]:
    rows = []
    for name, command in FETCH_RUNS.items():
        data = res.load(name)
        if not data:
            continue
        pt, off, on = data["per_turn"], "fetch, then decode", "draft while fetching"
        drafting = data["drafting"][on]
        setting = f"{data['bandwidth_mb_s']:.0f} MB/s" + (
            f", KV budget {data['kv_budget']} tokens" if data.get("kv_budget")
            else ", ample budget")
        vs_plain = ("plain" in pt) and (
            f"TTFT {span(ratio_over_turns(pt, 'plain', off, 'ttft_s'))}, "
            f"E2E {span(ratio_over_turns(pt, 'plain', off, 'e2e_s'))}")
        rows.append(res.row(name, [
            setting, "yes" if all(data["identical_outputs"].values()) else "NO",
            f"{drafting['started']} / {drafting['made']} / {drafting['verified']}",
            vs_plain or "-",
            (f"TTFT {span(ratio_over_turns(pt, off, on, 'ttft_s'))}, "
            f"E2E {span(ratio_over_turns(pt, off, on, 'e2e_s'))}")], command))  # fmt: skip
    lines = prose(FETCH_TEXT) + [""]
    lines += table(["KV server link, budget", "answers identical",
                    "turns drafted / drafts made / verified", "fetch-then-decode vs plain",
                    "draft-while-fetching vs fetch-then-decode"], rows)  # fmt: skip
    links = res.links(*(n.replace(".json", ".md") for n in FETCH_RUNS))
    return lines + ["", f"Details per turn: {links}.", ""] + prose(FETCH_LIMITS)


GATEWAY_TEXT = """
Agent sessions through SGLang's gateway (`smg`, `cache_aware`) in front of two replicas, all
sessions at once, greedy: (a) plain SGLang replicas, (b) with SGLang's HiCache (its host pool
registers memory with CUDA: no CPU run), (c) `--vericache` replicas sharing one zmq KV server
throttled to 100 MB/s, (d) sharing LMCache. Per-replica budgets: ample holds every session's final
prefix, tight two. "Replica killed": the replica that answered the most turns so far is SIGKILLed
once half the turns have answered (the client retries a failed turn after 1, 2, 4, 8 s, as agents
do). A turn "moved" when the gateway sent it to another replica than its session's previous turn;
it found its prefix when at least 90% of that turn's prompt came back cached.
"""


FLEET_RUNS = ("fleet_sessions.json", "fleet_serving.json")  # the second: SGLang's client too


def fleet_gateway(res: Results) -> list[str]:
    if not res.load(FLEET_RUNS[0]):
        return ["Not yet run: `python benchmark/fleet_sessions.py`."]
    rows, notes = [], []
    for file in FLEET_RUNS:
        data = res.load(file) or {"phases": {}}
        for phase, by_config in data["phases"].items():
            for name, s in by_config.items():
                label = data["labels"].get(name, name)
                if "skipped" in s:
                    note = f"- {label}: not run here: {skip_reason(s['skipped'])}"
                    notes += [note] if note not in notes else []
                    continue
                rows.append(res.row(file, gateway_cells(phase, label, s), data["command"]))
    lines = prose(GATEWAY_TEXT) + [""]
    lines += table(["phase", "configuration", "E2E per turn median / p90 s", "TTFT median / p90 s",
                    "median E2E vs (a)", "output tok/s", "prompt tokens recomputed",
                    "tokens from the tier", "moved turns that found their prefix",
                    "identical to (a)", "failed (retried) turns",
                    "first turn answered after the kill, E2E median / p90 s"], rows)  # fmt: skip
    lines += ([""] + notes if notes else []) + gateway_client(res)
    lines += ["", f"Details: {res.links('fleet_sessions.md', 'fleet_serving.md')}.", ""]
    return lines + prose(GATEWAY_LIMITS)


def gateway_cells(phase: str, label: str, s: dict) -> list:
    kill = s.get("kill", {}).get("next_answer_s")
    return [phase, label, median_p90(s["e2e_s"], ".1f"), median_p90(s["ttft_s"], ".1f"),
            f"**{fx(s.get('e2e_speedup_vs_plain'))}**", f"{s['output_tok_s']:.1f}",
            f"{s['recomputed_tokens']} of {s['prompt_tokens']}", s["tier_hit_tokens"],
            moved_cell(s.get("moved")), f"{s['identical']}/{s['compared']}",
            f"{s['errors']} ({s['retried_turns']})", median_p90(kill, ".1f")]  # fmt: skip


def gateway_client(res: Results) -> list[str]:
    """SGLang's own client through the gateway (``fleet_serving.json``: fleet_sessions.py with
    ``--gsp-prompts``), one sentence per phase where it ran."""
    data = res.load(FLEET_RUNS[1])
    if not data:
        return []
    lines = []
    for phase, by_config in data["phases"].items():
        ran = {data["labels"].get(n, n).split(" ")[0]: s["gsp"] for n, s in by_config.items()
               if s.get("gsp")}  # fmt: skip
        if not ran:
            continue
        parts = [f"{label} {gsp_cell(g, 'tok')} tok/s, TTFT / TPOT {gsp_cell(g, 'lat')} ms, "
                 f"texts identical to (a) {gsp_cell(g, 'same')}" for label, g in ran.items()]
        lines.append(f"- {phase}: " + "; ".join(parts) + ".")
    if not lines:
        return []
    return ["", f"SGLang's own client through the same gateway, medians (`{data['command']}`: "
            f"`python -m sglang.benchmark.serving --dataset-name generated-shared-prefix`, "
            f"{data['gsp_prompts']} conversations of {data['gsp_turns']} turns at once, last "
            f"prompt {data['gsp_input_len']} tokens, {data['max_tokens']} per answer, greedy):",
            *lines]


def gateway_headline(res: Results) -> list[tuple[str, str, str, str]]:
    """The headline's row: --vericache replicas over plain ones through the gateway."""
    data = res.load(FLEET_RUNS[0])
    if not data:
        return []
    runs = [d for d in (res.load(f) for f in FLEET_RUNS) if d]
    parts, vericache = [], []
    for run in runs:
        for phase, by_config in run["phases"].items():
            vc, plain = by_config.get("vericache-zmq", {}), by_config.get("plain", {})
            if "e2e_s" in vc and "e2e_s" in plain:
                parts.append(f"{phase}: **{fx(vc['e2e_speedup_vs_plain'])}**")
            # (a) is the reference: only the other configurations' answers are a comparison
            vericache += [s for n, s in by_config.items() if n != "plain"]
    same = sum(s.get("identical", 0) for s in vericache)
    total = sum(s.get("compared", 0) for s in vericache)
    answer = (f"{data['sessions']} agent sessions x {data['turns']} turns through smg on "
              f"{data['replicas']} replicas sharing a KV server, median end to end per turn "
              f"over plain replicas: {', '.join(parts)}; {same}/{total} answers identical")
    return [("Does a fleet behind SGLang's gateway gain?", answer,
             res.date("fleet_sessions.json"), "Agents through the gateway")]


GATEWAY_LIMITS = """
Limits, plainly: 2 shared cores; the tight budget's ratio over four runs the same day: 1.27x,
1.40x, 1.46x, 1.61x (median 1.43x), the ample one's over three: 1.45x, 1.97x, 2.24x (the 1.45x
run shared the machine with tests). At the ample budget the tier serves nothing: that gain is
VeriCache's decode and prefix-extend path. `cache_aware` put 44 of 48 turns on one replica (the
sessions share a system prompt), so the tight budget binds there. After the kill every moved turn
found its prefix in the tier (11 of 11; plain: 0 of 11) and recomputed a third as much.
"""
