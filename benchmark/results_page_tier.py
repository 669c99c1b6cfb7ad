"""Results page sections about the remote KV tier: remote prefix across replicas, LMCache end to
end, an agent fleet on a tight budget, drafting while the prefix is fetched.

Each renderer takes a ``results_page.Results`` and returns the section's body lines: fixed text
(what is measured; limits and negative results) around tables built from the result files.
"""

from __future__ import annotations

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
Limits, plainly: turn 0 has nothing to fetch, and there the VeriCache replica pays a tier lookup
and its compressed KV for nothing (TTFT below 1x against the same-attention replicas). Decode is at
parity: at 2-3k tokens and batch 1-2 the planner decodes plainly. Whether fetching pays depends on
prefill cost per token against the link's bytes per token (fp32 SmolLM2: 46 KB a token, so 2k
tokens are ~90 MB, about a second at 100 MB/s); the link measures both and recomputes where that
is faster. Details per turn: REMOTE_LINKS.
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
Limits, plainly: the request port of `lmcache server` 0.5.6 has no authentication (no secret, no
TLS): keep it on a trusted network. LMCache's client does not notice a lost connection, so a fetch
in flight when LMCache dies is given up only at its fetch deadline and the adapter's I/O thread
waits out its 30 s timeout (the zmq client fails it at once); after a restart the first
write-through costs about two client timeouts. The "killed mid-fetch" row kills mid-fetch only if
the fetch still runs 0.3 s in. Replica TTFT was compared with one plain server only.
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
Limits, plainly: one run each way, and the median per turn is this benchmark's least stable number:
the sessions run in lockstep, so a turn's median is one scheduling accident, and it has moved by
0.9-1.7x between runs of comparable code. Drafting while fetching gains less than fetch-then-decode:
its DEMOTED prefixes hold pool slots (a quarter of each drafted turn's KV), so FULL prefixes are
evicted sooner, and its drafts run only on compute the serving path leaves idle, which 16 busy
sessions do not leave. Against plain SGLang with the same attention path the gain is smaller
(the "vs vericache attention" column): that share is the placement and the tier.
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
Limits, plainly: TTFT cannot drop below the fetch (the first token is committed by a forward over
the full KV); drafting during the fetch can only buy the tokens after it. The drafter uses only
compute the server leaves idle, so a fleet's running requests are never slowed for a waiting one;
here the other session kept the scheduler busy and it made **0 drafts**: parity with
fetch-then-decode, within noise. No run shows it paying on this CPU; it needs idle compute beside
a slow fetch (a GPU on a 1-3 GB/s storage link, the paper's setting). The gain over plain SGLang
is the tier and the prefix-extend path, not drafting.
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
