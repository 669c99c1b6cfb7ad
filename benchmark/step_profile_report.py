"""Markdown and plot of ``step_profile.py``'s report (kept apart: the runner stays short)."""

from __future__ import annotations

import statistics
from pathlib import Path

from sglang_vericache.verify.step_profile import Phase

PHASES = (*(phase.value for phase in Phase), "other")  # the metrics' phase labels


def shortest_prompt(longest: int) -> int:
    """The shortest prompt of a set whose longest has ``longest`` tokens (the set spans 5/7)."""
    return longest * 5 // 7


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def calibration(run: dict) -> float:
    """Today's machine speed against the fit's: the offload-only baseline's plain forward (the
    same machine, the same run) over the model's prediction for it. These shared cores drift
    by 2x between days; the fit's constants are from one of them."""
    off = run["offload_profile"]
    model = off["model_ms"]["plain"]
    return off["ms_when_run"].get("plain", model) / model if model else 1.0


def _vs(measured: float | None, predicted: float) -> str:
    if measured is None or not predicted:
        return "-"
    return f"{measured / predicted:.2f}x"


def _more_args(settings: dict) -> str:
    """The command line's other settings where they are not the defaults."""
    defaults = {"seed": 23, "rounds": 1, "compressor": "snapkv:ratio=0.25", "draft_len": "auto",
                "max_new_tokens": 256, "prompt_tokens": 7000}
    return "".join(f" --{k.replace('_', '-')} {settings[k]}" for k, v in defaults.items()
                   if k in settings and settings[k] != v)  # fmt: skip


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        "# Step profile: decode throughput while every request decodes, and where a step goes",
        "",
        f"Prompts of {shortest_prompt(s['prompt_tokens'])}-{s['prompt_tokens']} tokens (seed {s['seed']}), "
        f"{s['max_new_tokens']} new "
        f"tokens, greedy, ample budget; VeriCache `{s['compressor']}`, draft length "
        f"`{s['draft_len']}`. `python benchmark/step_profile.py --concurrency "
        f"{' '.join(str(r['concurrency']) for r in report['runs'])}{_more_args(s)}`.",
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
        mdl, cal = p["model_ms"], calibration(run)
        lines += [
            "",
            f"{run.get('profiled', 'vericache')}'s steps while all {b} decode: {p['steps']} steps "
            f"({', '.join(f'{k}: {int(v)}' for k, v in p['decisions'].items() if v)}), "
            f"{p['drafts_per_verify']} drafts and {p['committed_per_verify']} committed tokens "
            f"per verified row; context ~{p['context']} tokens, compressed view ~"
            f"{p['view_tokens']} tokens per row. {proposer_mix(p.get('proposers') or {})}",
            "",
            f"The cost model is the CPU fit x {cal:.2f}, today's speed of this machine against the "
            "fit's (the offload-only server's plain forward in this run over its prediction).",
            "",
            "| phase | steps it ran in | ms per step it ran in | ms per step (all steps) | cost "
            "model (calibrated) | measured / model |",
            "|---|---|---|---|---|---|",
        ]
        when = p["ms_when_run"]
        model_of = {
            "draft": (f"{cal * mdl['draft_forward']:.1f} per forward (measured "
                      f"{p['draft_ms_per_forward']})",
                      _vs(p["draft_ms_per_forward"], cal * mdl["draft_forward"])),
            "verify": (f"{cal * mdl['verify']:.1f}", _vs(when.get("verify"), cal * mdl["verify"])),
            "plain": (f"{cal * mdl['plain']:.1f}", _vs(when.get("plain"), cal * mdl["plain"])),
            "other": (f"scheduler {cal * mdl['scheduler']:.1f} (outside the worker)", "-"),
        }  # fmt: skip
        for phase in PHASES:
            ran = p["phase_steps"].get(phase, p["steps"] if phase == "other" else 0)
            predicted, ratio = model_of.get(phase, ("not modelled (0)", "-"))
            lines.append(f"| {phase} | {ran} | {when.get(phase, '-')} | "
                         f"{p['ms_per_step'][phase]} | {predicted} | {ratio} |")  # fmt: skip
        lines += [
            "",
            f"Peak transient bytes outside the pool per step: {_mib(p['peak_transient_bytes'])} "
            f"(one layer's view of the batch: {_mib(p['one_layer_view_bytes'])}). Offload-only "
            f"per step: plain {run['offload_profile']['ms_per_step']['plain']} ms (model "
            f"{run['offload_profile']['model_ms']['plain']}), offload "
            f"{run['offload_profile']['ms_per_step']['offload']} ms.",
            "",
        ]
        lines += _rounds(run.get("rounds", []))
    return "\n".join(lines) + "\n"


def _rounds(rounds: list[dict]) -> list[str]:
    """Offload-only against VeriCache over ``--rounds``: a table, the median of all rounds and
    of the paired ones (both servers up, taking turns)."""
    if len(rounds) < 2:
        return []
    paired = [r["ratio"] for r in rounds if r["round"] > 0]
    lines = ["Offload-only against VeriCache: round 0 is the run above (servers one after "
             "another); in the later rounds both servers are up and take turns (the order "
             "alternating, prefix caches flushed), so both meet the same load on the shared "
             "cores. Their plain steps run the same code, so a gap there is load, not VeriCache:",
             "", "| round | offload-only decode tok/s | its plain step ms | VeriCache decode "
             "tok/s | its plain step ms | VeriCache / offload-only | identical to plain |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rounds:
        lines.append(f"| {r['round']} | {r['offload_decode_tok_s']} | {r['offload_plain_ms']} | "
                     f"{r['vericache_decode_tok_s']} | {r['vericache_plain_ms']} | {r['ratio']}x "
                     f"| {'yes' if r['identical'] else 'NO'} |")  # fmt: skip
    return [*lines, "", f"Median VeriCache / offload-only: {statistics.median(paired):.2f}x over "
            f"the {len(paired)} paired rounds, "
            f"{statistics.median(r['ratio'] for r in rounds):.2f}x over all {len(rounds)}.", ""]


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
        mdl, cal = p["model_ms"], calibration(run)
        model_bars = [("draft", cal * x * mdl["draft_forward"]), ("verify", cal * mdl["verify"])]
        bottom = 0.0
        for name, ms in model_bars:
            ax.bar(1, ms, bottom=bottom, color="C1" if name == "draft" else "C2", alpha=0.5)
            bottom += ms
        ax.set_xticks([0, 1], ["measured", f"cost model x {cal:.2f}\n(draft + verify)"])
        ax.set_ylabel("ms per drafting step")
        vc = run["systems"][run.get("profiled", "vericache")]
        ax.set_title(f"B={run['concurrency']}: {vc['decode_vs_plain']}x plain, "
                     f"{vc['decode_vs_offload']}x offload-only")  # fmt: skip
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def proposer_mix(proposers: dict[str, dict[str, int]]) -> str:
    """Where the verified drafts came from: "Drafts by proposer: compressed 40 verifies, 160
    drafted, 120 accepted (75%); ..." ("" where the server reported none)."""
    if not proposers:
        return ""
    parts = [f"{name} {c['verifies']} verifies, {c['drafted']} drafted, {c['accepted']} accepted"
             + (f" ({100 * c['accepted'] / c['drafted']:.0f}%)" if c["drafted"] else "")
             for name, c in sorted(proposers.items())]  # fmt: skip
    return "Drafts by proposer: " + "; ".join(parts) + "."
