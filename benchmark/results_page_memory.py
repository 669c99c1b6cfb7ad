"""Results page sections about one server's memory and speed: capacity and the budget sweep,
latency under load, throughput where attention dominates (step profile), CPU kernels.

Each renderer takes a ``results_page.Results`` and returns the section's body lines: fixed text
(what is measured; limits and negative results) around tables built from the result files.
"""

from __future__ import annotations

from typing import Any

from benchmark.results_page import OFFLOAD, Results, Row, fx, median, prose, short_server, table

CAPACITY_RUNS = {
    "capacity.json": "python benchmark/capacity.py --max-new-tokens 256",
    "capacity_kivi_pages.json": "python benchmark/capacity.py --max-new-tokens 256 "
    "--compressors kivi:bits=4 --out benchmark/results/capacity_kivi_pages",
}
BUDGET_RUNS = {
    "budget_tight_joining.json": "python benchmark/capacity.py --max-new-tokens 64 --n-full 2 "
    "--requests 8 --compressors snapkv:ratio=0.25 --draft-len auto --rounds 2 "
    "--out benchmark/results/budget_tight_joining",
    "budget_mid_rounds.json": "python benchmark/capacity.py --max-new-tokens 64 --n-full 3 6 12 "
    "--requests 8 --compressors snapkv:ratio=0.25 --draft-len auto --rounds 3 "
    "--out benchmark/results/budget_mid_rounds",
}
# The step profiles that describe the current code, many rows first, then batch 1.
STEP_PROFILES = [
    "step_profile_joined.json", "step_profile_joined_r3.json",
    "step_profile_16_batched_drafts.json", "step_profile_4k_fp16_drafts.json",
    "step_profile_8_kivi_packed.json", "step_profile_b1_kivi_s27.json",
    "step_profile_b1_snapkv_paired.json",
]  # fmt: skip
SOURCE_PROFILE = "source_profile_joined.json"


def _budgets(data: dict) -> list[dict]:
    """capacity.py writes one budget as the document, several under "sweep"."""
    return data.get("sweep", [data])


def _identical(r: dict) -> str:
    if r["identical_to_plain"] is None:  # sampled runs: compared in distribution, not by token
        return "-"
    runs = r.get("rounds") or 1
    return f"{r['identical_to_plain']}/{r['requests'] * runs}"


CAPACITY_TEXT = """
The device KV budget (`--max-total-tokens`) holds N requests' full KV (prompt + output tokens).
All requests are sent at once; "peak" is the largest `#running-req` SGLang logged for a decode
batch, throughput is output tokens over wall time, and every output is compared with plain
SGLang's, token by token. After prefill a drafted request keeps in the pool only slots worth its
compressed KV (SnapKV 4x: a quarter of its prompt plus a 32-token window; KIVI int4 of fp32: about
a seventh) and its newest tokens; its full KV sits in a host buffer the verify reads in place.
"""

CAPACITY_LIMITS = """
Limits, plainly:
- On this CPU the memory layout pays more than drafting: offloading alone fits every request and
  captures most of the capacity gain; VeriCache leads offload-only where the budget binds only.
- A fixed draft length where drafting cannot pay is pure overhead (0.85x plain at the ample end);
  `--vericache-draft-len auto` measures that and decodes plainly.
- Compressed KV holds pool slots while the planner decodes plainly (given up for admission under a
  short budget) and costs 0.14-0.2 s to build for a 2k prompt (SnapKV, 30 layers).
"""


def capacity(res: Results) -> list[str]:
    lines = prose(CAPACITY_TEXT) + ["", "At a tight budget:", ""]
    rows: list[Row] = []
    for name, command in CAPACITY_RUNS.items():
        data = res.load(name)
        if not data:
            continue
        for b in _budgets(data):
            budget = (f"{b['n_full']} x ({b['prompt_tokens']} + {b['max_new_tokens']}), "
                      f"T {b.get('temperature', 0.0)}")  # fmt: skip
            for r in b["rows"]:
                rows.append(res.row(name, [
                    budget, short_server(r["server"]), r["peak_running"], f"{r['vs_n_full']}x",
                    _identical(r), r["output_tokens_per_s"], fx(r["throughput_vs_plain"]),
                    r["mean_accept_len"] or "-"], command))  # fmt: skip
    lines += table(["budget (N x tokens), temperature", "server", "peak concurrent", "x N",
                    "identical", "output tok/s", "vs plain", "committed per verify"],
                   rows)  # fmt: skip
    lines += ["", ("Budget sweep, 8 requests of ~2k tokens, 64 new, the planner choosing per step "
              "(median over rounds; plain runs once):"), ""]  # fmt: skip
    rows = []
    for name, command in BUDGET_RUNS.items():
        data = res.load(name)
        if not data:
            continue
        for b in _budgets(data):
            by = {r["server"]: r for r in b["rows"]}
            off = by.get(OFFLOAD)
            for r in b["rows"]:
                vs_off = off and r["throughput_vs_plain"] / off["throughput_vs_plain"]
                rows.append(res.row(name, [
                    b["n_full"], short_server(r["server"]), r["peak_running"],
                    r["output_tokens_per_s"], fx(r["throughput_vs_plain"]), fx(vs_off),
                    _identical(r), r["mean_accept_len"] or "-", r.get("rounds") or 1], command))
    lines += table(["budget (full-KV requests)", "server", "peak concurrent", "output tok/s",
                    "vs plain", "vs offload-only", "identical", "accept len", "rounds"], rows)
    links = res.links(*(n.replace(".json", ext) for n in [*CAPACITY_RUNS, *BUDGET_RUNS]
                        for ext in (".md", ".png")))  # fmt: skip
    return lines + ["", f"Details and plots: {links}.", ""] + prose(CAPACITY_LIMITS)


LATENCY_TEXT = """
Requests arrive as a Poisson process (8 per rate, seed 5: the same prompts of 1.1-1.5k tokens and
the same arrival times for every server), streamed, greedy, 64 output tokens each, at a budget
that holds 2 such requests' full KV; VeriCache drafts a fixed 6 tokens. TTFT is the first streamed
token, TPOT the time per output token after it (VeriCache streams several tokens per verify).

Limits, plainly: while plain SGLang's two full-KV slots keep up (0.1 and 0.2 req/s) it has the
lowest latency; VeriCache's drafting costs per token on this CPU (TPOT 0.08-0.12 s against
0.06 s). At 0.4 req/s plain queues while the compressed layouts keep admitting, and offloading
alone does as well as VeriCache: the memory layout is what pays here, not drafting.
"""


def latency(res: Results) -> list[str]:
    data = res.load("rate_sweep.json")
    if not data:
        return ["Not yet run: `python benchmark/rate_sweep.py`."]
    rows = [res.row("rate_sweep.json", [
        r["rate"], short_server(r["server"]), f"{r['ttft_median_s']} / {r['ttft_p90_s']}",
        r["tpot_median_s"], f"{r['e2e_median_s']} / {r['e2e_p90_s']}", r["output_tokens_per_s"],
        f"{r['identical_to_plain']}/{r['requests']}"], "python benchmark/rate_sweep.py")
        for r in data["rows"]]  # fmt: skip
    lines = prose(LATENCY_TEXT) + [""]
    lines += table(["rate (req/s)", "server", "TTFT median / p90 s", "TPOT median s",
                    "E2E median / p90 s", "output tok/s", "identical"], rows)  # fmt: skip
    return lines + ["", f"Details: {res.links('rate_sweep.md', 'rate_sweep.png')}."]


def step_profile_command(settings: dict[str, Any], name: str) -> str:
    """The step_profile.py command line that wrote ``name`` (from its recorded settings)."""
    s = settings
    parts = ["python benchmark/step_profile.py",
             "--concurrency " + " ".join(str(c) for c in s["concurrency"]),
             f"--prompt-tokens {s['prompt_tokens']}", f"--max-new-tokens {s['max_new_tokens']}",
             f"--compressor {s['compressor']}", f"--draft-len {s['draft_len']}"]  # fmt: skip
    if s.get("placements") and s["placements"] != ["auto"]:
        parts.append("--placements " + " ".join(s["placements"]))
    if s.get("proposer", "auto") != "auto":
        parts.append(f"--proposer {s['proposer']}")
    parts.append(f"--seed {s['seed']}")
    if (s.get("rounds") or 1) > 1:
        parts.append(f"--rounds {s['rounds']}")
    return " ".join([*parts, f"--out benchmark/results/{name.removesuffix('.json')}"])


def step_profile_rows(res: Results, name: str) -> list[Row]:
    data = res.load(name)
    if not data:
        return []
    s, rows = data["settings"], []
    command = step_profile_command(s, name)
    for run in data["runs"]:
        systems = run["systems"]
        plain, off = systems["plain"], systems[OFFLOAD]
        ratios = [r["ratio"] for r in run.get("rounds") or []]
        for key, vc in systems.items():
            if not key.startswith("vericache"):
                continue
            # The step profile is scraped from one server only: the others get no profile cells.
            prof = (run.get("profile") or {}) if run.get("profiled", key) == key else {}
            steps = prof.get("phase_steps") or {}
            drafted = f"{steps.get('draft', 0)} of {prof['steps']}" if prof else "-"
            by_round = ratios if len(ratios) > 1 else [vc["decode_vs_offload"]]
            vs_off = ", ".join(f"{r:.2f}" for r in by_round)
            if len(by_round) > 1:
                vs_off += f" ({median(by_round):.2f})"
            label = s["compressor"] + f", {s['draft_len']}" + key.removeprefix("vericache")
            per_verify = (f"{prof['drafts_per_verify']} / {prof['committed_per_verify']}"
                          + lookup_share(prof.get("proposers") or {}) if prof else "-")
            rows.append(res.row(name, [
                f"{run['concurrency']} x {s['prompt_tokens']}, {s['max_new_tokens']} new", label,
                f"{plain['decode_tok_s']} / {off['decode_tok_s']} / {vc['decode_tok_s']}",
                fx(vc["decode_vs_plain"]), vs_off, drafted, per_verify,
                prof.get("draft_ms_per_forward") or "-", vc.get("identical", "-")], command))
    return rows


def lookup_share(proposers: dict[str, dict[str, int]]) -> str:
    """"; lookup: 12 of 40 verifies, 55% accepted" where prompt-lookup drafts ran ('' else)."""
    lookup = proposers.get("lookup")
    if not lookup:
        return ""
    total = sum(p["verifies"] for p in proposers.values())
    accepted = f", {100 * lookup['accepted'] / lookup['drafted']:.0f}% accepted" \
        if lookup["drafted"] else ""  # fmt: skip
    return f"; lookup: {lookup['verifies']} of {total} verifies{accepted}"


STEP_TEXT = """
Plain SGLang, offload-only and VeriCache (`--vericache-draft-len auto` unless the row fixes a
length) get the same long prompts at once, every request's full KV fitting the budget. Decode
throughput is counted from the streams while every request decodes (last first token to first
finish). Round 0 runs the three servers one after another (the profiled run); with `--rounds N`
later rounds run offload-only and VeriCache side by side, taking turns on the same prompts.
VeriCache's `/metrics` step profile gives the steps it drafted, drafts and committed tokens per
verified row, and a draft forward's time. Prompts are cut to at most the stated tokens (5-7k at
7000); draft weights are fp16 packed for fbgemm (`--vericache-draft-dtype auto` on this AVX2 CPU).
"""

STEP_LIMITS = """
Limits, plainly:
- First two rows, one command and code: round 0 met uneven load (plain steps 451/371 ms, 330/406),
  paired rounds 2.01-2.41x; the verify is 76-80% of a step; end to end 1.18-1.29x. No GPU here.
- Batch 1: a width-8 verify costs 1.9x a plain step; KIVI at 8 x 5-7k: unpacking costs more than
  the bytes saved (0.90x): in both the planner decodes plainly.
"""

CATEGORIES = ["attention (SDPA)", "linear layers", "LM head", "full-KV read", "other model ops",
              "outside the model"]  # fmt: skip


def source_profile(res: Results) -> list[str]:
    data = res.load(SOURCE_PROFILE)
    if not data:
        return []
    s, samples = data["settings"], data["samples"]
    total = sum(sum(c.values()) for c in samples.values())
    command = (f"python benchmark/source_profile.py --concurrency {s['concurrency']} "
               f"--prompt-tokens {s['prompt_tokens']} --max-new-tokens {s['max_new_tokens']} "
               f"--compressor {s['compressor']} --seconds {s['seconds']} "
               f"--out benchmark/results/{SOURCE_PROFILE.removesuffix('.json')}")  # fmt: skip
    rows = []
    for phase, counts in sorted(samples.items(), key=lambda kv: -sum(kv[1].values())):
        if sum(counts.values()) < 0.02 * total:  # prefill, scheduler: noise at this window
            continue
        shares = [f"{100 * counts.get(c, 0) / total:.1f}%" for c in CATEGORIES]
        rows.append(res.row(SOURCE_PROFILE, [phase, f"{100 * sum(counts.values()) / total:.1f}%",
                                             *shares], command))  # fmt: skip
    lines = ["", (f"Where the time goes (py-spy samples of the scheduler for {s['seconds']} s once "
             f"all {s['concurrency']} requests decode, {s['compressor']}), share of all samples:"),
             ""]  # fmt: skip
    return lines + table(["phase", "share", *CATEGORIES], rows)


def step_profile(res: Results) -> list[str]:
    rows = [r for name in STEP_PROFILES for r in step_profile_rows(res, name)]
    lines = prose(STEP_TEXT) + [""]
    lines += table(["rows x prompt tokens, new", "compressor, draft len",
                    "decode tok/s: plain / offload-only / VeriCache", "VeriCache vs plain",
                    "vs offload-only by round (median)", "drafted steps",
                    "drafts / committed per verify", "draft forward ms", "identical"], rows)
    lines += source_profile(res)
    links = res.links(*(n.replace(".json", ext) for n in [*STEP_PROFILES, SOURCE_PROFILE]
                        for ext in (".md", ".png")))  # fmt: skip
    return lines + ["", f"Details and plots: {links}.", ""] + prose(STEP_LIMITS) + layer_skip(res)


def layer_skip(res: Results) -> list[str]:
    """One paragraph: the cheaper draft a layer-skipped forward would be, and what it keeps."""
    data = res.load("layer_skip_agreement.json")
    if not data:
        return []
    s = data["settings"]
    kept = ", ".join(f"{r['skipped']} of {s['layers']}: {100 * r['agreement']:.1f}%"
                     for r in data["least_harmful"])  # fmt: skip
    return ["", f"Layer-skipped drafts, not offered: the model's argmax with its least harmful "
            f"layers skipped agrees with the full model's at {kept} of positions "
            f"({len(data['prompts'])} held-out prompts, teacher-forced; `python benchmark/"
            f"layer_skip_agreement.py`, {res.date('layer_skip_agreement.json')}), against 86-95% "
            "accepted from full-depth drafts over the 4x-compressed KV above; skipping k layers "
            f"saves about k / {s['layers']} of a draft forward."]


KERNEL_TEXT = """
The C++ CPU kernels (`ops/csrc/`, built by torch's `cpp_extension` at the first start) attend every
row of a layer in one call: draft attention reads a KIVI body as stored (packed codes and scales,
in tensors or in the pool's pages), the verify kernel reads each key and value block once for all
queries of a head group. Milliseconds per layer (draft), per row and layer (verify), 2 threads.
"""

KERNEL_LIMITS = """
Limits, plainly: packed KIVI reads are 5-17x faster than dequantizing, 1.3-1.5x slower than float32;
the verify kernel differs from SDPA by float32 rounding (exactness is tested end to end).
"""


def cpu_kernels(res: Results) -> list[str]:
    lines = prose(KERNEL_TEXT) + [""]
    draft = res.load("draft_attention.json") or []
    command = "python benchmark/draft_attention.py --bits 2 4 8 --repeats 9"
    shown = [r for r in draft if r["bits"] == 4]  # other widths: draft_attention.md
    rows = [res.row("draft_attention.json", [
        f"{r['batch']} x {r['tokens']}", r["bits"], r["ms_per_layer"]["packed"],
        r["ms_per_layer"].get("pool_pages", "-"), r["ms_per_layer"]["dequantized"],
        r["ms_per_layer"]["float32"]], command) for r in shown]  # fmt: skip
    lines += table(["rows x tokens", "KIVI bits", "packed", "in pool pages", "dequantized first",
                    "float32 view"], rows) + [""]  # fmt: skip
    verify = res.load("verify_attention.json") or {"rows": []}
    rows = [res.row("verify_attention.json", [
        f"{r['batch']} x {r['tokens']}", r["queries"], f"{r['sdpa_ms_per_row']:.3f}",
        f"{r['kernel_ms_per_row']:.3f}", fx(r["speedup"]), f"{r['max_abs_diff']:.1e}"],
        "python benchmark/verify_attention.py") for r in verify["rows"]]  # fmt: skip
    lines += table(["rows x keys", "queries a row", "SDPA loop", "kernel", "speedup",
                    "max abs diff"], rows) + [""]  # fmt: skip
    omp = res.load("omp_wait.json")
    if omp:
        rows = []
        for config, by in omp["results"].items():
            secs = [f"{min(v):.2f}-{max(v):.2f}" if (v := by.get(k)) else "-" for k in "123"]
            draft_ms = [1000 * v for v in by.get("draft") or []]
            rows.append(res.row("omp_wait.json", [
                config, *secs,
                f"{min(draft_ms):.0f}-{max(draft_ms):.0f}" if draft_ms else "-"],
                "python benchmark/omp_wait.py"))  # fmt: skip
        lines += table(["OpenMP wait", "s per process: alone", "2 at once", "3 at once",
                        "draft attention alone, ms per forward"], rows) + [""]  # fmt: skip
    links = res.links("draft_attention.md", "verify_attention.md", "omp_wait.md")
    return lines + [f"Details: {links}.", ""] + prose(KERNEL_LIMITS)
