"""cost_model.md from the projection document (benchmark/model_report.py): every number in the
text is read from the same dict that becomes cost_model.json.
"""

from __future__ import annotations

import model_params as p


def _para(text: str) -> str:
    return " ".join(text.split())


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _range(vs: list[float] | None, unit: str = "x", nd: int = 2) -> str:
    return "none" if not vs else f"{vs[0]:.{nd}f}-{vs[1]:.{nd}f}{unit}"


def _summary(doc: dict) -> list[str]:
    val, hl, chk = doc["cpu_validation"], doc["headline"], doc["paper_setup_check"]
    lo, hi = doc["paper_bands"]["long_context"]
    rlo, rhi = doc["paper_bands"]["remote_prefix"]
    h8, h70 = hl["8B/paper_e21"], hl["70B/paper_e21"]
    kv70, kv_nvl = doc["h200"]["70B"]["kv_budget_gb"], chk["70B"]["kv_budget_gb"]

    def absolute(row: str, lo_ctx: int, hi_ctx: int) -> str:
        rs = [r for r in chk[row]["context_sweep"] if lo_ctx <= r["context"] <= hi_ctx]
        full = sorted(r["full"]["tokens_per_s"] for r in rs)
        stag = sorted(r["staggered"]["tokens_per_s"] for r in rs)
        return f"{stag[0]:.0f}-{stag[-1]:.0f} vs {full[0]:.0f}-{full[-1]:.0f} tok/s"

    abs70 = absolute("70B", 16384, 32768)

    def check(row: str) -> str:
        sp = [r["speedup_staggered"] for r in chk[row]["context_sweep"] if r["speedup_staggered"]]
        return f"{chk[row]['label']}: {min(sp):.2f}-{max(sp):.2f}x"

    def remote(h: dict, topo: str) -> str:
        return " / ".join(_x(v[topo]) for v in h["remote_prefix_32k"].values())

    return [
        "## Summary",
        "",
        _para(f"""- **CPU fit.** Fitted on forward costs and plain decode only, the model predicts
            the measured end-to-end speedups of the CPU prototype: keep 2048
            {val["keep 2048"]["model_speedup"]:.2f}x (measured
            {val["keep 2048"]["measured_speedup"]:.2f}x),
            keep 1024 {val["keep 1024"]["model_speedup"]:.2f}x (measured
            {val["keep 1024"]["measured_speedup"]:.2f}x), within the stated
            +-{doc["cpu_speedup_tolerance"]:.0%}."""),
        _para(f"""- **The paper's own setups.** The same model and parameters on the paper's GPUs
            give {check("70B")} and {check("8B")} over 8k-128k contexts (where full KV fits at
            all; Mistral's acceptance is not reported, Qwen-32B's E=19 is assumed), against the
            paper's {lo}-{hi}x. For Llama-70B at 16k-32k the model gives {abs70}, the paper
            256 vs 102 tok/s: the model reproduces the reported range on the paper's hardware."""),
        _para(f"""- **H200, long-context decoding (PCIe 5, paper acceptance E=21).** At the H200's
            own KV budget VeriCache is *slower* than full-KV decoding: 8B
            {_range(h8["long_context_own_budget_32k_to_128k"])}, 70B (TP=2)
            {_range(h70["long_context_own_budget_32k_to_128k"])} over 32k-128k contexts. An H200
            has {p.H200_HBM_BW / p.RTX_PRO_6000[1]:.1f}x the memory bandwidth of the paper's RTX
            PRO 6000, and two H200s leave {kv70:.0f} GB for KV where the paper's 2xH100 NVL left
            {kv_nvl:.0f} GB, which makes full-KV decoding fast; the PCIe link is the same and caps
            VeriCache at `E*BW_pcie/KV_full` tokens/s. VeriCache wins
            only under a tight KV budget: below {h8["largest_winning_budget_gb"]:.0f} GB (8B, peak
            {_x(h8["long_context_peak"]["speedup"])}) or {h70["largest_winning_budget_gb"]:.0f} GB
            (70B, peak {_x(h70["long_context_peak"]["speedup"])}); 70B sits inside the paper's band
            for budgets of {_range(h70["long_context_budgets_in_paper_band_gb"], " GB", 0)} (the
            paper's 2xH100 NVL setup leaves {kv_nvl:.0f} GB)."""),
        _para(f"""- **H200, remote prefix caching (32k prefix, 1 / 2 / 3 GB/s).** In the paper's
            topology (the slow link carries only the compressed KV; a near GPU verifies): 8B
            {remote(h8, "paper_topology")}, 70B {remote(h70, "paper_topology")}, against the
            paper's {rlo}-{rhi}x. In this repo's single-node design (the full KV crosses the slow
            link once): 8B {remote(h8, "single_node")}, 70B {remote(h70, "single_node")}: when the
            link binds, VeriCache cannot beat fetch-then-decode."""),
        "",
    ]


def _cpu(doc: dict) -> list[str]:
    fit, val, res = doc["cpu_fit"], doc["cpu_validation"], doc["cpu_fit"]["residuals_ms"]
    s_8k = fit["s_ms_per_context_token"] * p.CPU_CONTEXT
    lines = [
        "## CPU fit (SmolLM2-135M fp32, SGLang 0.5.23, 2 cores)",
        "",
        _para("""Data: `/work/shared/notes/cpu-draft-cost.md` §1, §2, §4 and
            `/work/shared/notes/baseline.md` (a), kept as constants in `benchmark/model_params.py`.
            Forward time `f0 + g*L + k*n` ms (L: KV tokens attended, n: tokens in the forward);
            each scheduler iteration adds `s*L`; a VeriCache cycle is x drafts on the kept view,
            one verify of x+1 tokens, one scheduler iteration, committing accepted+1 tokens."""),
        "",
        "| parameter | value | least squares over |",
        "|---|---|---|",
        f"| f0: fixed per forward (weights, MLP, Python) | {fit['f0_ms']:.1f} ms "
        "| 6 forwards (§2) |",
        f"| g: per KV token attended | {fit['g_ms_per_kv_token'] * 1e3:.2f} us | same |",
        f"| k: per token in the forward | {fit['k_ms_per_token']:.2f} ms | same (D=9 verifies) |",
        "| s: per scheduler iteration and context token | "
        f"{fit['s_ms_per_context_token'] * 1e3:.2f} us ({s_8k:.0f} ms at 8k) "
        "| 5 plain decodes (baseline.md, §1) + full-view run (§4) |",
        f"| cross-check, plain decode `a + b*L` | {fit['plain_a_ms']:.1f} ms + "
        f"{fit['plain_b_ms_per_token'] * 1e3:.1f} us/token (model: "
        f"{fit['f0_ms'] + fit['k_ms_per_token']:.1f} ms + "
        f"{(fit['g_ms_per_kv_token'] + fit['s_ms_per_context_token']) * 1e3:.1f} us/token) | "
        "same 5 plain decodes |",
        "",
        _para(f"""Residuals (model - measured, ms): forwards
            {", ".join(f"{r:+.1f}" for r in res["forwards"])}; end to end
            {", ".join(f"{r:+.1f}" for r in res["end_to_end"])}; held-out D=17 verify
            {res["forwards_held_out"][0]:+.1f} (measured in a slower period: the note estimates it
            about 35% inflated). SGLang's per-step work outside the timed forward grows with context
            (plain decode's slope exceeds the forward's g), hence s per context token; on the GPU
            projection it is folded into the fixed step overhead."""),
        "",
        _para(f"""Validation: keep 2048 and keep 1024 were not fitted (tolerance
            +-{doc["cpu_speedup_tolerance"]:.0%}; identical runs moved by up to 25%)."""),
        "",
        "| CPU run (D=9, x=8) | measured ms/token | model | measured speedup | model | error "
        "| ok |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, v in val.items():
        if name == "plain":
            continue
        lines.append(
            f"| {name}{'' if v['validated'] else ' (fitted)'} | {v['measured_ms_per_token']:.1f} | "
            f"{v['model_ms_per_token']:.1f} | {v['measured_speedup']:.2f}x | "
            f"{v['model_speedup']:.2f}x | {v['relative_error']:+.1%} | "
            f"{'yes' if v['within_tolerance'] else 'NO'} |"
        )
    return lines + [""]


def _h200(doc: dict) -> list[str]:
    lo, hi = doc["paper_bands"]["long_context"]
    rlo, rhi = doc["paper_bands"]["remote_prefix"]
    lines = [
        "## H200 projection",
        "",
        _para(f"""Paper: long-context {lo}-{hi}x, remote prefix caching {rlo}-{rhi}x. Speedup =
            VeriCache (staggered) throughput over full-KV throughput, each at its largest batch
            in the same KV budget; remote prefix caching against the better of recompute and
            fetch-then-decode."""),
        "",
        "| model | acceptance | E (x=30) | long-context, own budget, 32k-128k | peak over budgets "
        "(32k) | budgets in the paper's band | wins below | remote prefix 32k, 1/2/3 GB/s: "
        "paper topology | same: single node |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, block in doc["h200"].items():
        for key, sc in block["scenarios"].items():
            h = doc["headline"][f"{name}/{key}"]
            pk, win = h["long_context_peak"], h["largest_winning_budget_gb"]
            rp = h["remote_prefix_32k"].values()
            cells = [
                f"{name} ({block['hardware']['name']})",
                sc["label"],
                f"{sc['tokens_per_verify_x30']:.1f}",
                _range(h["long_context_own_budget_32k_to_128k"]),
                f"{_x(pk['speedup'])} at {pk['budget_gb']:.0f} GB",
                _range(h["long_context_budgets_in_paper_band_gb"], " GB", 0),
                "never" if win is None else f"{win:.0f} GB",
                " / ".join(_x(r["paper_topology"]) for r in rp),
                " / ".join(_x(r["single_node"]) for r in rp),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "The same model on the paper's setups (own KV budget, x=30, c=0.25):", ""]
    ctxs = [r["context"] for r in next(iter(doc["paper_setup_check"].values()))["context_sweep"]]
    lines.append("| setup | KV budget | E | " + " | ".join(f"{c // 1024}k" for c in ctxs) + " |")
    lines.append("|---|---|---|" + "---|" * len(ctxs))
    for chk in doc["paper_setup_check"].values():
        sp = " | ".join(_x(r["speedup_staggered"]) for r in chk["context_sweep"])
        lines.append(
            f"| {chk['label']} | {chk['kv_budget_gb']:.0f} GB | "
            f"{chk['tokens_per_verify_x30']:g} | {sp} |"
        )
    lines += [
        "",
        _para("""Why: once interconnect-bound, VeriCache commits at most `E*BW_inter/KV_full`
            tokens/s, while memory-limited full KV gives `budget*BW_hbm/(KV_full*(M+budget))`.
            VeriCache wins only when the KV budget is below `M*q/(1-q)` with
            `q = E*BW_inter/BW_hbm`: about 0.3 on an H200 with PCIe 5 (0.6 on the RTX PRO 6000).
            Staggering keeps the link busy every step; it cannot make it wider. Faster host links
            move the break-even:"""),
        "",
    ]
    for name, block in doc["h200"].items():
        sc = block["scenarios"]["paper_e21"]
        sens = ", ".join(
            f"{r['inter_bw_gbps_per_gpu']:g} GB/s {_x(r['speedup'])}"
            for r in sc["inter_bw_sensitivity_32k"]
        )
        lines.append(
            f"- {name}, E=21, 32k, own budget: {sens}; closed-form break-even budget "
            f"{sc['break_even_budget_gb_closed_form']:.1f} GB; best static x in 8-40: "
            f"{sc['best_draft_len_32k']['draft_len']}."
        )
    lines += [
        "",
        _para("""Remote prefix caching. *Paper topology*: the slow link carries only `c*KV_full`
            to the serving GPU, which drafts; a near GPU that loads the full KV at 40 GB/s verifies,
            and each in-flight request holds a full-KV slot there, so the batch is capped by a
            full-KV GPU's capacity; the near GPU's own serving load is ignored (optimistic).
            *Single node*: this repo's design; the compressed prefix is local, the full KV crosses
            the slow link once into host memory, then decoding is long-context decoding over PCIe.
            TTFT counts the first committed token."""),
        "",
    ]
    return lines


def markdown(doc: dict, pngs: list[str]) -> str:
    lines = [
        "# Cost model: VeriCache iteration time, CPU fit, H200 projection",
        "",
        _para("""`python benchmark/model.py --out benchmark/results` writes this file,
            `cost_model.json` and the plots (code: `benchmark/model.py` (the model),
            `model_params.py` (presets, CPU data and fit), `model_report.py`, `model_markdown.py`,
            `model_plots.py`; tests: `test/unit/benchmark/test_cost_model.py`)."""),
        "",
        _para("""Model: per step `T = overhead + max(device, interconnect)`, device = max(HBM
            bytes / BW, FLOPs / peak) (a sum on CPU). Staggered VeriCache moves
            `M + B*KV*(c*x+1)/(x+1)` bytes through HBM and `B*KV/(x+1)` over the interconnect per
            step: the paper's `max((M + B*KV*(c+1/x))/BW_hbm, B*KV/(x*BW_inter))` with a cycle of
            x drafts plus one verify. Tokens committed per verify `E = (1-a^(x+1))/(1-a)` or a
            measured curve. Each system runs the largest batch whose peak device KV fits the
            budget: full `B*KV`; VeriCache `B*c*KV` plus its verify buffers (a ring of whole full
            KVs, or per-layer streaming, whichever is faster under the budget)."""),
        "",
    ]
    lines += _summary(doc) + _cpu(doc) + _h200(doc)
    lines += ["## Assumptions", ""] + [f"- {a}" for a in doc["assumptions"]]
    lines += ["", "## Plots", ""] + [f"![{png}]({png})" for png in pngs]
    return "\n".join(lines) + "\n"
