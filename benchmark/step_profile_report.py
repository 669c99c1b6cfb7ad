"""Markdown and plot of ``step_profile.py``'s report (kept apart: the runner stays short)."""

from __future__ import annotations

from pathlib import Path

PHASES = ("prepare", "draft", "verify", "plain", "commit", "offload", "other")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        "# Step profile: decode throughput while every request decodes, and where a step goes",
        "",
        f"Prompts ~{s['prompt_tokens']} tokens (seed {s['seed']}), {s['max_new_tokens']} new "
        f"tokens, greedy, ample budget; VeriCache `{s['compressor']}`, draft length "
        f"`{s['draft_len']}`. `python benchmark/step_profile.py --concurrency "
        f"{' '.join(str(r['concurrency']) for r in report['runs'])}`.",
        "",
    ]
    for run in report["runs"]:
        b = run["concurrency"]
        lines += [f"## {b} concurrent requests", "",
                  "| system | decode tok/s (all decoding) | vs plain | vs offload-only | "
                  "end-to-end tok/s | vs plain | vs offload-only | identical |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for name, r in run["systems"].items():
            lines.append(
                f"| {name} | {r['decode_tok_s']} | {r['decode_vs_plain']}x | "
                f"{r['decode_vs_offload']}x | {r['e2e_tok_s']} | {r['e2e_vs_plain']}x | "
                f"{r['e2e_vs_offload']}x | {r['identical']} |"
            )
        p = run["profile"]
        mdl = p["model_ms"]
        lines += [
            "",
            f"{run.get('profiled', 'vericache')}'s steps while all {b} decode: {p['steps']} steps "
            f"({', '.join(f'{k}: {int(v)}' for k, v in p['decisions'].items() if v)}), "
            f"{p['drafts_per_verify']} drafts and {p['committed_per_verify']} committed tokens "
            f"per verified row; context ~{p['context']} tokens, compressed view ~"
            f"{p['view_tokens']} tokens per row.",
            "",
            "| phase | steps it ran in | ms per step it ran in | ms per step (all steps) | cost "
            "model |",
            "|---|---|---|---|---|",
        ]
        model_of = {"draft": f"{mdl['draft_forward']} per forward (measured "
                             f"{p['draft_ms_per_forward']})",
                    "verify": str(mdl["verify"]), "plain": str(mdl["plain"]),
                    "other": f"scheduler {mdl['scheduler']} (outside the worker: not in this "
                             "row)"}  # fmt: skip
        for phase in PHASES:
            ran = p["phase_steps"].get(phase, p["steps"] if phase == "other" else 0)
            lines.append(f"| {phase} | {ran} | {p['ms_when_run'].get(phase, '-')} | "
                         f"{p['ms_per_step'][phase]} | "
                         f"{model_of.get(phase, 'not modelled (0)')} |")  # fmt: skip
        lines += [
            "",
            f"Peak transient bytes outside the pool per step: {_mib(p['peak_transient_bytes'])} "
            f"(one layer's view of the batch: {_mib(p['one_layer_view_bytes'])}). Offload-only "
            f"per step: plain {run['offload_profile']['ms_per_step']['plain']} ms (model "
            f"{run['offload_profile']['model_ms']['plain']}), offload "
            f"{run['offload_profile']['ms_per_step']['offload']} ms.",
            "",
        ]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4.2), squeeze=False)
    for ax, run in zip(axes[0], runs):
        p = run["profile"]
        bottom = 0.0  # a drafting step: each phase's ms in the steps it ran in (no plain)
        for phase in (ph for ph in PHASES if ph != "plain"):
            ms = p["ms_when_run"].get(phase, 0.0)
            ax.bar(0, ms, bottom=bottom, label=phase)
            bottom += ms
        x = p["drafts_per_verify"]
        mdl = p["model_ms"]
        model_bars = [("draft", x * mdl["draft_forward"]), ("verify", mdl["verify"])]
        bottom = 0.0
        for name, ms in model_bars:
            ax.bar(1, ms, bottom=bottom, color="C1" if name == "draft" else "C2", alpha=0.5)
            bottom += ms
        ax.set_xticks([0, 1], ["measured", "cost model\n(draft + verify)"])
        ax.set_ylabel("ms per drafting step")
        vc = run["systems"][run.get("profiled", "vericache")]
        ax.set_title(f"B={run['concurrency']}: {vc['decode_vs_plain']}x plain, "
                     f"{vc['decode_vs_offload']}x offload-only")  # fmt: skip
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
