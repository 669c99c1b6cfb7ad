"""Results page sections about correctness and projections: exactness, compressor acceptance,
sampled output, the cost model, GPU kernels (request fuzz and soak: ``results_page_robustness``).

Each renderer takes a ``results_page.Results`` and returns the section's body lines: fixed text
(what is measured; limits and negative results) around tables built from the result files.
"""

from __future__ import annotations

from benchmark.results_page import Results, Row, fx, prose, table

EXACT_TEXT = """
24 prompts of 1-3k tokens (code, JSON tool calls, prose, multi-document questions) x 256 new
tokens, greedy, draft length 8, against plain SGLang with the same server args and concurrency
(`python -m sglang_vericache.exactness` per row; the plain reference is reused per concurrency).
The CI tests compare a reduced set on every run (4 prompts x 32-96 tokens, several compressors,
fixed and `auto` draft lengths, streaming, chat, a frontend program, the Engine, tier faults).
"""

EXACT_LIMITS = """
Limits, plainly: the times are not a speed comparison (runs shared the machine; the `commit` column
says which code each row ran); at concurrency 8 and an ample budget VeriCache is about as fast as
plain SGLang on this 135M model. Sampled output is exact in distribution, not token by token.
"""

GRAMMAR_COMMAND = ("python -m sglang_vericache.exactness "
                   "--prompts benchmark/results/grammar_prompts.jsonl --max-new-tokens 48 "
                   "--concurrency 4 -- --vericache --vericache-compressor snapkv:ratio=0.25 "
                   "--vericache-draft-len 6")  # fmt: skip


def exactness(res: Results) -> list[str]:
    sweep = res.load("exactness/sweep.json") or []
    by_compressor: dict[str, list[dict]] = {}
    for r in sorted(sweep, key=lambda r: r["concurrency"]):
        by_compressor.setdefault(r["compressor"], []).append(r)
    rows = []
    for compressor, runs in by_compressor.items():  # one row: each concurrency's figures
        each = lambda f: " / ".join(str(f(r)) for r in runs)  # noqa: E731
        rows.append(res.row("exactness/sweep.json", [
            f"`{compressor}`", each(lambda r: r["concurrency"]),
            each(lambda r: f"{r['identical']}/{r['total']}"), each(lambda r: r["candidate_s"]),
            each(lambda r: r["reference_s"]), each(lambda r: r["commit"])],
            f"python benchmark/exactness_sweep.py --concurrency "
            f"{' '.join(str(r['concurrency']) for r in runs)} --compressors {compressor}"))
    lines = prose(EXACT_TEXT) + [""]
    lines += table(["compressor", "concurrency", "identical", "VeriCache s", "plain s", "commit"],
                   rows) + ["", "Other greedy workloads:", ""]  # fmt: skip
    rows = []
    grammar = res.load("grammar_exactness.json")
    if grammar:
        rows.append(res.row("grammar_exactness.json", [
            ("8 prompts of 0.8-1.7k tokens, each under a regex, a JSON schema or an EBNF grammar; "
            "drafts masked by the grammar"), f"{grammar['identical']}/{grammar['total']}",
            f"{grammar['max_new_tokens']} new tokens, concurrency {grammar['concurrency']}"],
            GRAMMAR_COMMAND))  # fmt: skip
    tools = res.load("agentic_tool_calls.json")
    if tools:
        rows.append(res.row("agentic_tool_calls.json", [
            (f"{tools['sessions']} agent sessions x {tools['turns']} turns, every answer an OpenAI "
            f"`response_format` JSON tool call"), f"{tools['identical']}/{tools['answers']}",
            (f"{tools['valid_json_tool_calls']}/{tools['answers']} parse as complete tool calls; "
            f"{tools['accepted_tokens']:.0f} of {tools['drafted_tokens']:.0f} drafts accepted, "
            f"{tools['committed_per_verify']:.2f} committed per verify")],
            "python benchmark/agentic_tool_calls.py"))  # fmt: skip
    mixed = res.load("mixed_batch.json")
    if mixed:
        greedy = mixed["all_greedy"]["greedy_rows"]["committed_per_verify"]
        rows.append(res.row("mixed_batch.json", [
            "greedy rows beside sampled (T 0.8) or penalized (plain) rows in one batch",
            "yes" if mixed["greedy_rows_identical_to_plain"] else "NO",
            f"greedy rows commit {greedy} per verify whatever shares their batch"],
            "python benchmark/mixed_batch.py --requests 8 --max-new-tokens 48"))  # fmt: skip
    lines += table(["workload", "identical to plain", "notes"], rows)
    links = res.links("exactness/sweep.md", "agentic_tool_calls.md", "mixed_batch.md")
    return lines + ["", f"Details: {links}.", ""] + prose(EXACT_LIMITS)


COMPRESSOR_TEXT = """
How many drafted tokens survive verification, per compressor in `compress/` (24 prompts of 1-3k
tokens; the paper's Fig. 9). Ratios are measured (full K+V bytes over the bytes stored: codes,
scales, residual, kept-position index), each family's knob fitted per prompt to the target.
"Matched": greedy decoding from the compressed KV alone until it first differs from full KV, with
the mean KL(full || compressed) per token before that. "Accepted per verify": draft x tokens,
verify against full KV, commit the matched prefix plus one (a full-KV draft accepts x + 1).
"""

COMPRESSOR_LIMITS = """
Limits, plainly: quantization wins at 2-4x and collapses at 8x (2-bit keys move a 135M model's
small logit margins); SnapKV is the best dropper at every ratio; the composition is the best at
8x. Served alone, each compressor changes the text; behind verification none did. Ratios are
against fp32 KV (fp16/bf16 halve a quantizer's ratio); acceptance is read off the full-KV path.
"""


def compressors(res: Results) -> list[str]:
    data = res.load("compressors.json")
    if not data:
        return ["Not yet run: `python benchmark/compressors.py`."]
    by = {(r["family"], round(r["target_ratio"])): r for r in data["results"]}

    def accepted(r: dict | None, x: str) -> str:
        acc = (r or {}).get("accepted") or {}
        return f"{acc[x]['mean_accepted_per_verify']:.2f}" if x in acc else "-"

    rows = []
    for family in dict.fromkeys(r["family"] for r in data["results"]):
        r = by.get((family, 4))
        if r is None:
            continue
        rows.append(res.row("compressors.json", [
            family, f"{r['measured_ratio']:.2f}", f"{r['bytes_per_token']:.0f}",
            (f"{r['matched_before_divergence_mean']:.1f} / "
            f"{r['matched_before_divergence_median']:g}"),
            f"{r['kl_nats_per_token_mean']:.3f}", accepted(r, "8"), accepted(r, "16"),
            accepted(r, "32"), accepted(by.get((family, 2)), "16"),
            accepted(by.get((family, 8)), "16")], "python benchmark/compressors.py"))
    lines = prose(COMPRESSOR_TEXT) + [""]
    lines += table(["family", "measured ratio (target 4x)", "bytes/token (full KV: 46080)",
                    "matched mean / median", "KL nats/token", "accepted/verify x=8", "x=16",
                    "x=32", "x=16 at 2x", "x=16 at 8x"], rows)  # fmt: skip
    links = res.links("compressors.md", "compressors_accept.png", "compressors_match.png")
    lines += ["", f"All targets, per prompt, and plots: {links}.", ""]
    return lines + prose(COMPRESSOR_LIMITS)


SAMPLED_TEXT = """
6,000 three-token continuations per side and setting of one prompt, from plain SGLang and from
`--vericache --vericache-compressor streaming:sink=4,window=8 --vericache-draft-len 4` (lossy on
purpose, so drafts are rejected and the residual distribution is sampled); chi-square tests of
homogeneity on the first token and the first three (sparse outcomes lumped), and on a wrong pair.
"""

SAMPLED_LIMITS = """
Limits, plainly: one prompt, three settings; "committed per verify" counts tokens past the 3-token
limit that SGLang drops (read the acceptance rate). A `sampling_seed` request is reproducible run
to run, but its tokens are not the ones plain SGLang samples for that seed (another random stream).
"""


def sampled(res: Results) -> list[str]:
    data = res.load("sampled_distribution.json")
    command = "python benchmark/sampled_distribution.py --n 6000 --prompts 1 --batch 256"
    lines = prose(SAMPLED_TEXT) + [""]
    rows: list[Row] = []
    if data:
        for r in data["rows"]:
            rows.append(res.row("sampled_distribution.json", [
                f"T {r['temperature']}, top_p {r['top_p']}", ", ".join(r["modes"]),
                r["committed_per_verify"], r["accept_rate"], f"{r['first_token']['p_value']:.3f}",
                f"{r['first_three']['p_value']:.3f} ({r['first_three']['df']})"], command))
        wrong = data["wrong_variant"]
        rows.append(res.row("sampled_distribution.json", [
            f"wrong pair, {wrong['what']} (must be rejected)", "-", "-", "-",
            f"{wrong['first_token']['p_value']:.1e}",
            f"{wrong['first_three']['p_value']:.1e} ({wrong['first_three']['df']})"], command))
    lines += table(["setting", "mode", "committed per verify", "accept rate", "p first token",
                    "p first three (df)"], rows)  # fmt: skip
    if data:
        power = ", ".join(f"df {k}: {v}" for k, v in data["power_tv_0.05_alpha_0.01"].items())
        lines += ["", (f"Lower bound on the test's power to detect a TV distance of 0.05 at alpha "
                  f"0.01: {power}.")]  # fmt: skip
    rows = []
    for name, label in [("temperature_greedy.json", "greedy"), ("temperature_t07.json", "T 0.7")]:
        cap = res.load(name)
        if cap:
            vc = next(r for r in cap["rows"] if r["server"].startswith("vericache"))
            rows.append(res.row(name, [
                (f"12 x 2k prompts at a budget of 3, {vc['server'].removeprefix('vericache ')}, "
                f"draft 6, {label}"), vc["mean_accept_len"]], "python benchmark/capacity.py "
                "--n-full 3 --requests 12 --max-new-tokens 64 --compressors snapkv:ratio=0.25 "
                f"--draft-len 6 --no-offload-baseline --temperature {cap['temperature']} "
                f"--out benchmark/results/{name.removesuffix('.json')}"))  # fmt: skip
    mixed = res.load("mixed_batch.json")
    if mixed:
        for batch in ("mixed",):
            other = mixed[batch]["other_rows"]
            rows.append(res.row("mixed_batch.json", [
                (f"{batch.replace('_', ' ')} batch, the other 4 rows ({', '.join(other['mode'])}), "
                f"kivi:bits=4, draft 4"), other["committed_per_verify"]],
                "python benchmark/mixed_batch.py --requests 8 --max-new-tokens 48"))  # fmt: skip
    lines += ["", ("Sampled rows draft by speculative sampling; what a verify commits, beside "
              "greedy:"),
              ""] + table(["run", "committed per verify"], rows)  # fmt: skip
    links = res.links("sampled_distribution.md", "temperature_greedy.md", "temperature_t07.md")
    return lines + ["", f"Details: {links}.", ""] + prose(SAMPLED_LIMITS)


COST_TEXT = """
The paper's iteration-time model (a step costs the larger of its HBM and interconnect time, plus
overhead; E tokens committed per verify of x = 30 drafts), fitted on this CPU's measured forwards,
checked on CPU runs it was not fitted on (within 15%), projected for an 8B model on one H200 and a
70B on two. Speedup over full-KV decoding in the same KV budget; remote prefix caching (32k prefix)
against the better of recompute and fetch-then-decode.
"""

COST_LIMITS = """
Limits, plainly: a projection, not a measurement. At an H200's own KV budget full-KV decoding beats
any offloading design; VeriCache wins only under a tight budget for long-context decoding and on
slow links for remote prefixes, and the paper's topology (only compressed KV on the slow link, a
near GPU verifies) is where its 1.3-4x lies.
"""


def cost_model(res: Results) -> list[str]:
    data = res.load("cost_model.json")
    if not data:
        return ["Not yet run: `python benchmark/model.py --out benchmark/results`."]
    rows = []
    for key, h in data["headline"].items():
        model, acc = key.split("/", 1)
        if acc in ("paper_e19", "paper_e23", "alpha_0.8"):  # the rest of the band: cost_model.md
            continue
        acc = (acc.replace("paper_e", "paper E=").replace("alpha_", "alpha ")
               .replace("ours_", "ours: ").replace("_", " "))  # fmt: skip
        lo, hi = h["long_context_own_budget_32k_to_128k"]
        peak = h["long_context_peak"]
        remote = h["remote_prefix_32k"]
        rows.append(res.row("cost_model.json", [
            model, acc, f"{lo:.2f}-{hi:.2f}x",
            f"{fx(peak['speedup'])} at {peak['budget_gb']:.0f} GB",
            " / ".join(fx(v["paper_topology"]) for v in remote.values()),
            " / ".join(fx(v["single_node"]) for v in remote.values())],
            "python benchmark/model.py --out benchmark/results"))  # fmt: skip
    bws = " / ".join(next(iter(data["headline"].values()))["remote_prefix_32k"])
    lines = prose(COST_TEXT) + [""]
    lines += table(["model", "acceptance", "long context, own budget, 32k-128k",
                    "peak over budgets (32k)", f"remote prefix {bws}: paper topology",
                    "same: single node"], rows)  # fmt: skip
    links = res.links("cost_model.md", "cost_model_cpu_fit.png", "cost_model_h200.png")
    return lines + ["", f"Assumptions, CPU fit and plots: {links}.", ""] + prose(COST_LIMITS)


GPU_TEXT = """
One prepared script for an H200 (torch + triton only): kernel-vs-reference tests, the achieved
bandwidth of a quantized draft decode against the device's copy bandwidth, and drafting under a
concurrent full-KV copy. The one GPU run measured the first quantized decode kernel, since
removed: serving never produced its page layout.
"""

GPU_LIMITS = """
Limits, plainly: no serving path has run on a GPU (its kernels are checked against torch references
on CPU, in `test/kernels` and at start-up); the kernel measured reached 36% of copy bandwidth.
"""


def gpu_kernels(res: Results) -> list[str]:
    data = res.load("gpu/summary.json")
    command = "bash scripts/gpu_check.sh"
    if not data:
        return prose(GPU_TEXT) + ["", f"Not yet run: `{command}`."]
    env = res.load("gpu/env.json") or {}
    rows = [res.row("gpu/summary.json", ["kernel-vs-reference tests",
                                         "passed" if data["steps_rc"].get("kernel_tests") == "0"
                                         else "FAILED", "all pass"], command),
            res.row("gpu/summary.json", ["D2D copy bandwidth", f"{data['copy_GBps']:.0f} GB/s",
                                         "(reference)"], command)]  # fmt: skip
    for shape, r in data.items():
        if isinstance(r, dict) and "us" in r and shape.startswith("gqa4") and "bfloat16" in shape:
            rows.append(res.row("gpu/summary.json", [
                f"decode {shape.replace('_', ' ')}",
                f"{r['us']:.1f} us, {r['GBps']:.0f} GB/s = {r['pct_of_copy_bw']:.1f}% of copy",
                ">= 60% of copy"], command))  # fmt: skip
    overlap = (f"{data['draft_slowdown_pct']:.1f}% slower; copy outlasted the steps: "
               f"{data['copy_outlasted_steps']}")
    rows.append(res.row("gpu/summary.json", ["draft step under a concurrent full-KV copy", overlap,
                                             "< 15%, overlapping"], command))  # fmt: skip
    device = (f"{env.get('gpu', 'GPU')}, torch {env.get('torch', '?')}, "
              f"triton {env.get('triton', '?')}")
    lines = prose(GPU_TEXT) + ["", f"On {device}:", ""]
    lines += table(["check", "result", "target"], rows)
    return lines + ["", f"Details: {res.links('gpu/README.md')}.", ""] + prose(GPU_LIMITS)
