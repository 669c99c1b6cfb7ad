"""Results page sections about what a server survives: the request fuzz (every long run, each on
its commit) and the soak.

Each renderer takes a ``results_page.Results`` and returns the section's body lines: fixed text
(what is measured; limits and negative results) around tables built from the result files.
"""

from __future__ import annotations

from benchmark.results_page import Results, Row, prose, table

FUZZ_TEXT = """
A seeded generator over SGLang's request surface (`testkit/fuzz*.py`): text, `input_ids` and
batches, every sampling parameter, grammars, logprob options, streaming and client disconnects,
the OpenAI endpoints, malformed requests, hidden states, batches with an invalid later item, `n`
with grammars and logprobs, sampled distributions (48 samples a side, two-sample chi-square on one
decode position's token), `input_embeds`, weight reloads and abort storms, each sent to a plain
and a `--vericache` server: same HTTP status, identical greedy tokens, logprobs and hidden states
within 1e-3, no distribution test below p = 0.001, both servers alive, no KV in use once idle.
Penalized requests and weight reloads run alone (plain SGLang's overlapped scheduler feeds its
penalizers a step late unless a prefill ran in between). A CI-sized run (80 requests, seed 21:
every kind) is in the test command (`test/e2e/test_fuzz_servers.py`); `--profiles no-radix
reasoning` serves `input_embeds` and wraps grammars in a reasoning parser over outlines.
"""

FUZZ_LIMITS = """
Limits, plainly: the first run (cc79d6e) found one greedy difference: a verify committed an EOS and
then a newline for a request with a newline stop string (SGLang's multi-token finish check matches
stop strings first). Fixed since: a verify commits nothing after a stop token; every later run is
on the fix. `no-radix`, `reasoning`: not run at length.
"""


# every long run, oldest first: (result file, the commit it ran on, what that commit had)
FUZZ_RUNS = (("fuzz.json", "cc79d6e", ""),
             ("fuzz_recheck.json", "1e5ca23", ", the stop-token fix"),
             ("fuzz_records.json", "1ec9add", ", the fix and one record per request"))


def latest_fuzz(res: Results) -> tuple[str, dict]:
    """The newest long fuzz run present: (its commit, its totals); ("", {}) if none."""
    for name, commit, _ in reversed(FUZZ_RUNS):
        data = res.load(name)
        if data:
            return commit, data["total"]
    return "", {}


def fuzz(res: Results) -> list[str]:
    runs = [(name, f"commit {commit}{note}", res.load(name)) for name, commit, note in FUZZ_RUNS]
    runs = [(name, note, data) for name, note, data in runs if data]
    if not runs:
        return ["Not yet run: `python benchmark/fuzz.py --seeds 1 2 3 --requests 700`."]

    def cells(label: str, s: dict, requests: int, wall: float) -> list[str]:
        def n(key: str) -> int:
            v = s.get(key, 0)
            return len(v) if isinstance(v, list) else int(v)

        return [label, str(requests), str(n("server_deaths")), str(n("status_mismatches")),
                str(n("greedy_mismatches")), str(n("server_errors")), str(n("leaks")),
                str(n("logprob_violations")), f"{s['logprob_max_abs_diff']:.1e}",
                str(s.get("failed_cases", 0)), f"{wall:.0f}"]  # fmt: skip

    rows = []
    for name, note, data in runs:
        reqs = data["config"]["requests"]
        seeds = " ".join(str(s["seed"]) for s in data["seeds"])
        label = f"seeds {seeds} ({note})"
        rows.append(res.row(name, cells(label, data["total"], data["total"]["requests"],
                                        data["config"]["wall_s"]),
                            f"python benchmark/fuzz.py --seeds {seeds} --requests {reqs} "
                            f"--out benchmark/results/{name}"))  # fmt: skip
    lines = prose(FUZZ_TEXT) + [""]
    lines += table(["run", "requests", "server deaths", "status differences", ("greedy token "
                    "differences"), "5xx", "leaks", "logprob violations", "logprob max abs diff",
                    "flagged", "wall s"], rows)  # fmt: skip
    details = res.links(*(name.replace(".json", ".md") for name, _, _ in runs))
    return lines + ["", f"Details: {details}.", ""] + prose(FUZZ_LIMITS)


SOAK_TEXT = """
The fuzzer's mix plus 10% client disconnects and 3% aborts at concurrency 16, plain SGLang and
`--vericache` (zmq KV tier) side by side, drained and sampled idle every minute (process-tree
memory: anonymous resident plus swapped out; open files, idle pool tokens, tier bytes in flight;
slopes per hour after the first sample). A five-minute version runs in the test command.
"""


SOAK_LIMITS = """
Limits, plainly: one hour, one seed, one mix, 2 shared cores. `--vericache`'s memory moves with
the compressed prefixes kept for next turns (cap 512 MiB counted, ~1.3x that held; 511 at most here)
and the idle heap trim: 4,294 MiB first, 5,217 highest, 4,392 last; slopes over all samples.
"""


def _soak_command(data: dict) -> str:
    return (f"python benchmark/soak.py --minutes {data.get('minutes', 60):g} --concurrency "
            f"{data.get('concurrency', 16)} --out benchmark/results/soak.json")


def soak(res: Results) -> list[str]:
    data = res.load("soak.json")
    lines = prose(SOAK_TEXT) + [""]
    head = ["server", "alive", "requests", "failed",
            "memory first / last MiB (slope /h; second half)", "of it, compressed prefixes kept "
            "(max MiB)", "open files first / last (slope /h)", "idle pool tokens first / last",
            "tier bytes in flight (idle)", "pool start / after flush", "greedy mismatches"]
    if not data:
        row = Row(("not yet run", *["-"] * (len(head) - 1)), "-", _soak_command({}))
        return lines + table(head, [row])
    mismatches = (data.get("greedy") or {}).get("mismatch_count", "-")

    def trend(s: dict, field: str, scale: float = 1.0) -> str:
        t = s.get("trends", {}).get(field)
        if not t:
            return "-"
        late = t.get("late_slope_per_hour")
        return (f"{t['first'] / scale:.0f} / {t['last'] / scale:.0f} "
                f"({t['slope_per_hour'] / scale:+.0f}"
                + ("" if late is None else f"; {late / scale:+.0f}") + ")")

    rows = []
    for name, s in data.get("servers", {}).items():
        tier = s.get("trends", {}).get("tier_bytes_in_flight", {})
        pool = s.get("trends", {}).get("idle_used_tokens", {})
        demoted = s.get("trends", {}).get("demoted_bytes", {})
        rows.append(res.row("soak.json", [
            name, "yes" if s.get("alive") else "NO", s.get("requests", "-"), s.get("failed", "-"),
            trend(s, "memory_bytes" if "memory_bytes" in s.get("trends", {}) else "rss_bytes",
                  2**20), f"{demoted['max'] / 2**20:.0f}" if demoted else "-", trend(s, "fds"),
            f"{pool.get('first', '-')} / {pool.get('last', '-')}",
            f"max {tier['max']:.0f}" if tier else "-",
            f"{s.get('baseline_used_tokens', '-')} / {s.get('after_flush_used_tokens', '-')}",
            mismatches], _soak_command(data)))  # fmt: skip
    lines += table(head, rows)
    verdict = "passed" if data.get("ok") else "FAILED"
    return lines + ["", (f"{data.get('minutes', '?'):g} minutes at concurrency "
                    f"{data.get('concurrency', '?')} on commit {data.get('commit', '?')}: "
                    f"{verdict}. Samples: {res.links('soak.md') or 'soak.md'}."), ""] + prose(
                    SOAK_LIMITS)  # fmt: skip
