"""Aggregates compressor-benchmark rows into JSON, a markdown table and two PNG plots."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 3) if xs else None


def summarise(rows: dict, families: list[str], ratios: list[float], xs: list[int]) -> list[dict]:
    out = []
    for fam in families:
        for target in ratios:
            row = rows[(fam, target)]
            acc = {}
            for x in xs:
                rounds = [a for per_prompt in row["accepted"][x] for a in per_prompt]
                if rounds:
                    acc[str(x)] = {
                        "mean_accepted_per_verify": round(sum(rounds) / len(rounds), 3),
                        "rounds": len(rounds),
                        "per_prompt": [round(sum(p) / len(p), 3) for p in row["accepted"][x]],
                    }
            out.append({
                "family": fam,
                "target_ratio": target,
                "spec_first_prompt": row["specs"][0],
                "specs": row["specs"],
                "measured_ratio": _mean(row["ratio"]),
                "measured_ratio_min": round(min(row["ratio"]), 3),
                "bytes_per_token": _mean(row["bytes_per_token"]),
                "matched_before_divergence_mean": _mean(row["matched"]),
                "matched_before_divergence_median": statistics.median(row["matched"]) if row["matched"] else None,
                "matched_per_prompt": row["matched"],
                # KL(full KV || compressed), nats per token, over each lossy run before divergence
                "kl_nats_per_token_mean": _mean(row.get("kl", [])),
                "kl_per_prompt": [round(k, 4) for k in row.get("kl", [])],
                "accepted": acc,
            })
    return out


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _acc(r: dict, x: int) -> float | None:
    a = r["accepted"].get(str(x))
    return a["mean_accepted_per_verify"] if a else None


def verdict(results: list[dict], droppers: tuple, quantizers: tuple, at: float, x: int) -> dict:
    """Best dropper / quantizer / composition at ratio ``at`` and draft length ``x``."""
    def best(names: tuple) -> dict | None:
        cands = [r for r in results if r["family"] in names and r["target_ratio"] == at and _acc(r, x) is not None]
        if not cands:
            return None
        r = max(cands, key=lambda r: _acc(r, x))
        return {"family": r["family"], "accepted": _acc(r, x), "measured_ratio": r["measured_ratio"],
                "spec_first_prompt": r["spec_first_prompt"]}

    comps = tuple(sorted({r["family"] for r in results} - set(droppers) - set(quantizers) - {"full"}))
    out = {"ratio": at, "x": x, "best_dropper": best(droppers), "best_quantizer": best(quantizers),
           "best_composition": best(comps)}
    out["meets_8_tokens"] = {k: (v["accepted"] >= 8.0 if v else None)
                             for k, v in out.items() if k.startswith("best_")}
    return out


def markdown(results: list[dict], xs: list[int], meta: dict, check: dict) -> str:
    head = ["family", "target", "measured ratio", "bytes/token", "matched before divergence (mean / median)",
            "KL from full KV (nats/token)"]
    head += [f"accepted/verify x={x}" for x in xs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    full_bpt = 2 * meta["geometry"]["layers"] * meta["geometry"]["kv_heads"] * meta["geometry"]["head_dim"] * (
        4 if "32" in meta["geometry"]["dtype"] else 2)
    lines.append(f"| full KV | 1x | 1.00 | {full_bpt} | all | 0 | " + " | ".join(f"{x + 1}" for x in xs) + " |")
    for r in results:
        accs = [f"{_acc(r, x):.2f}" if _acc(r, x) is not None else "-" for x in xs]
        lines.append(
            f"| {r['family']} | {r['target_ratio']:g}x | {r['measured_ratio']:.2f} | {r['bytes_per_token']:.0f} | "
            f"{r['matched_before_divergence_mean']:.1f} / {r['matched_before_divergence_median']:g} | "
            f"{_fmt(r.get('kl_nats_per_token_mean'))} | " + " | ".join(accs) + " |")
    ps = meta["prompt_set"]
    s = meta["settings"]
    lines += ["", f"Model {meta['model']}; {ps['n']} prompts ({min(ps['tokens'])}-{max(ps['tokens'])} tokens, "
              f"digest {ps['digest'][:12]}); horizon {s['horizon']} committed tokens; "
              f"run took {meta['seconds'] / 60:.1f} min wall, {meta['cpu_seconds'] / 60:.1f} min CPU, "
              f"{meta['cpu_threads']} thread; {ps['done']} of {ps['n']} prompts done."]
    for k in ("best_dropper", "best_quantizer", "best_composition"):
        v = check[k]
        if v:
            lines.append(f"- {k.replace('_', ' ')} at {check['ratio']:g}x, x={check['x']}: **{v['family']}** "
                         f"{v['accepted']:.2f} tokens/verify (measured {v['measured_ratio']:.2f}x, "
                         f"`{v['spec_first_prompt']}` on the first prompt)")
    return "\n".join(lines) + "\n"


def plots(out_dir: Path, results: list[dict], xs: list[int], at: float) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        if r["target_ratio"] != at:
            continue
        pts = [(x, _acc(r, x)) for x in xs if _acc(r, x) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=r["family"])
    ax.plot(xs, [x + 1 for x in xs], "k--", lw=1, label="full KV (x+1)")
    ax.set_xlabel("draft length x (tokens)")
    ax.set_ylabel("mean accepted length per verify")
    ax.set_title(f"Drafting from a {at:g}x-compressed KV (measured bytes)")
    ax.set_xticks(xs)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    paths.append(out_dir / "compressors_accept.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for fam in dict.fromkeys(r["family"] for r in results):
        pts = sorted((r["measured_ratio"], r["matched_before_divergence_mean"]) for r in results if r["family"] == fam)
        ax.plot(*zip(*pts), marker="o", label=fam)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("measured compression ratio (full bytes / stored bytes)")
    ax.set_ylabel("tokens matched before first divergence (mean)")
    ax.set_title("Lossy-only greedy decoding vs full-KV greedy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    paths.append(out_dir / "compressors_match.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def write_outputs(out_dir: Path, meta: dict, rows: dict, families: list[str], ratios: list[float],
                  xs: list[int], droppers: tuple, quantizers: tuple, args) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    results = summarise(rows, families, ratios, xs)
    at = args.all_x_at if args.all_x_at in ratios else ratios[0]
    check = verdict(results, droppers, quantizers, at, args.main_x)
    doc = {**meta, "check": check, "results": results}
    (out_dir / "compressors.json").write_text(json.dumps(doc, indent=1) + "\n")
    table = markdown(results, xs, meta, check)
    (out_dir / "compressors.md").write_text(table)
    plots(out_dir, results, xs, at)
    return doc
