"""Plots for the cost-model report (benchmark/model_report.py): the H200 projection beside the
paper's reported bands, and the CPU fit against the measured points. matplotlib Agg.
"""

from __future__ import annotations

from pathlib import Path

import model_params as params
import numpy as np


def _band(ax, band: tuple[float, float], label: str) -> None:
    ax.axhspan(*band, color="tab:green", alpha=0.15, label=label)
    ax.axhline(1.0, color="k", lw=0.8)


def plot_h200(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lc_band, rp_band = doc["paper_bands"]["long_context"], doc["paper_bands"]["remote_prefix"]
    cfg = doc["settings"]
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    for row, (name, block) in zip(axes, doc["h200"].items()):
        scs = block["scenarios"]
        ours = max(
            (k for k in scs if k.startswith("ours")), key=lambda k: scs[k]["tokens_per_verify_x30"]
        )
        styles = {
            "paper_e21": ("tab:blue", "-"),
            "alpha_0.8": ("tab:red", "--"),
            ours: ("tab:purple", ":"),
        }
        ks = [c / 1024 for c in cfg["contexts"]]
        for key, (color, ls) in styles.items():
            sc = scs[key]
            bud = [r["budget_gb"] for r in sc["budget_sweep"]]
            row[0].plot(
                bud,
                [r["speedup_staggered"] or np.nan for r in sc["budget_sweep"]],
                color=color,
                ls=ls,
                marker=".",
                label=sc["label"],
            )
            row[1].plot(
                ks,
                [r["speedup_staggered"] or np.nan for r in sc["context_sweep"]],
                color=color,
                ls=ls,
                marker="o",
                label=sc["label"],
            )
        lo, hi = scs["paper_e19"], scs["paper_e23"]
        row[0].fill_between(
            [r["budget_gb"] for r in lo["budget_sweep"]],
            [r["speedup_staggered"] or np.nan for r in lo["budget_sweep"]],
            [r["speedup_staggered"] or np.nan for r in hi["budget_sweep"]],
            color="tab:blue",
            alpha=0.2,
            label="paper E=19..23",
        )
        row[0].plot(
            [r["budget_gb"] for r in scs["paper_e21"]["budget_sweep"]],
            [r["speedup_lockstep"] or np.nan for r in scs["paper_e21"]["budget_sweep"]],
            color="grey",
            ls="-.",
            label="lock-step (paper E=21)",
        )
        row[0].axvline(block["kv_budget_gb"], color="grey", lw=0.8)
        row[0].set_xscale("log")
        ticks = [t for t in (2, 4, 8, 16, 32, 64, 128) if t <= block["kv_budget_gb"] * 1.2]
        row[0].set_xticks(ticks, [str(t) for t in ticks])
        row[0].minorticks_off()
        row[0].set_xlabel(
            f"device KV budget (GB), context {cfg['budget_context'] // 1024}k; grey line: H200's "
            "own"
        )
        row[1].plot(
            ks,
            [v or np.nan for v in scs["paper_e21"]["lockstep_speedup_by_context"]],
            color="grey",
            ls="-.",
            label="lock-step (paper E=21)",
        )
        chk = doc["paper_setup_check"][name]
        row[1].plot(
            [r["context"] / 1024 for r in chk["context_sweep"]],
            [r["speedup_staggered"] or np.nan for r in chk["context_sweep"]],
            color="tab:green",
            marker="s",
            label=f"same model: {chk['label']}, E={chk['tokens_per_verify_x30']:g}",
        )
        row[1].set_xlabel(f"context (k tokens), H200 KV budget {block['kv_budget_gb']:.0f} GB")
        for bw, ls in zip(cfg["remote_bw_gbps"], ("-", "--", ":")):
            rs = [r for r in scs["paper_e21"]["remote_prefix"] if r["remote_bw_gbps"] == bw]
            row[2].plot(
                ks,
                [r["speedup_paper_topology"] or np.nan for r in rs],
                color="tab:blue",
                ls=ls,
                marker="o",
                label=f"paper topology, {bw:g} GB/s",
            )
            row[2].plot(
                ks,
                [r["speedup_single_node"] or np.nan for r in rs],
                color="tab:orange",
                ls=ls,
                marker="x",
                label=f"single node, {bw:g} GB/s",
            )
        row[2].set_xlabel(f"prefix (k tokens), {cfg['out_tokens']} output tokens, paper E=21")
        _band(row[0], lc_band, "paper long-context 1.92-2.73x")
        _band(row[1], lc_band, "paper long-context 1.92-2.73x")
        _band(row[2], rp_band, "paper remote prefix 1.33-2.11x")
        titles = (
            "memory-budget sweep (Fig. 13 analogue)",
            "long-context decoding, PCIe 5",
            "remote prefix caching",
        )
        for ax, title in zip(row, titles):
            ax.set_title(f"{name} ({block['hardware']['name']}): {title}", fontsize=10)
            ax.set_ylabel("speedup over full KV (throughput)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("VeriCache cost model, H200 projection (assumptions in cost_model.md)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cpu_fit(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fit = doc["cpu_fit"]
    fwd = lambda kv, n: fit["f0_ms"] + fit["g_ms_per_kv_token"] * kv + fit["k_ms_per_token"] * n  # noqa: E731
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    kv = np.linspace(0, 8500, 50)
    for n, color in ((1, "tab:blue"), (9, "tab:orange"), (17, "tab:green")):
        axes[0].plot(kv, fwd(kv, n), color=color, label=f"model, {n} token(s)")
        pts = [p for p in params.CPU_FORWARDS if p[1] == n]
        held = [p for p in params.CPU_FORWARDS_HELD_OUT if p[1] == n]
        if pts:
            axes[0].scatter([p[0] for p in pts], [p[2] for p in pts], color=color)
        if held:
            axes[0].scatter(
                [p[0] for p in held],
                [p[2] for p in held],
                color=color,
                marker="x",
                label="held out",
            )
    axes[0].set(
        xlabel="KV tokens attended",
        ylabel="ms per forward",
        title="forward cost (cpu-draft-cost.md §2)",
    )
    ctx = np.linspace(0, 8500, 50)
    axes[1].scatter(
        [p[0] for p in params.CPU_PLAIN_DECODE],
        [p[1] for p in params.CPU_PLAIN_DECODE],
        color="k",
        label="measured",
    )
    axes[1].plot(
        ctx, fit["plain_a_ms"] + fit["plain_b_ms_per_token"] * ctx, "k--", label="a + b*L fit"
    )
    axes[1].plot(
        ctx,
        fwd(ctx, 1) + fit["s_ms_per_context_token"] * ctx,
        color="tab:blue",
        label="model: forward + s*L",
    )
    axes[1].set(
        xlabel="context (tokens)", ylabel="ms per token", title="plain decode (baseline.md)"
    )
    val = {k: v for k, v in doc["cpu_validation"].items() if k != "plain"}
    xs = np.arange(len(val))
    axes[2].bar(xs - 0.2, [v["measured_speedup"] for v in val.values()], 0.4, label="measured")
    axes[2].bar(
        xs + 0.2,
        [v["model_speedup"] for v in val.values()],
        0.4,
        label="model",
        yerr=[doc["cpu_speedup_tolerance"] * v["measured_speedup"] for v in val.values()],
        capsize=3,
    )
    axes[2].set_xticks(xs, list(val))
    axes[2].set(
        ylabel="speedup over plain decode at 8k",
        title="VeriCache on CPU, D=9 (cpu-draft-cost.md §4)",
    )
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
