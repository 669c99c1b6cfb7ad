"""Sampled output under ``--vericache`` vs plain SGLang: same distribution? (issue 16, item 1)

Draws N short continuations (``max_new_tokens`` 3, ``ignore_eos``) of each prompt at each
sampling setting from a plain server and from a ``--vericache`` server, and tests whether the
first token and the first three tokens have the same distribution on both sides (chi-square test
of homogeneity, sparse outcomes lumped). Under ``--vericache`` the first token comes from the
prefill's sampler; tokens 2-3 come from one or two verifies with speculative sampling, so the
three-token test is the one that exercises drafting. A deliberately wrong pair (plain at T vs
plain at ``--wrong-temperature``) must be rejected by the same test: it shows the test can fail.

Power: for two samples of N each and any pair of distributions at total-variation distance
``d``, the chi-square statistic's noncentrality is at least ``2 N d^2`` (Cauchy-Schwarz on
sum |a - b| = 2d), so ``power_at(N, df, d, alpha)`` is a lower bound over all alternatives with
that TV on the tested (lumped) cells; ``required_n`` inverts it. For TV 0.05 and power 0.9 at
alpha 0.01 it needs N = 2981 (df 1), 4442 (df 5), 5422 (df 10), 6883 (df 20) per side.

    python benchmark/sampled_distribution.py --n 6000          # the long run (hours on 2 cores)
    python benchmark/sampled_distribution.py --n 500 --configs 1  # a quick look

Writes ``benchmark/results/sampled_distribution.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import time
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO))  # testkit/: the fuzzer and server fixtures (not in the wheel)

from testkit.fuzz_stats import ChiSquare, chi_square_homogeneity  # noqa: E402

PROMPTS = (
    "The capital of France is a city with a long history. Its most famous landmark is",
    "Here is a list of fruits, one per line, in no particular order: apple, banana, cherry,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively.\"\"\"\n",
)
# A lossy compressor by default: with kivi:bits=4 a prompt shorter than its 32-token
# full-precision residual window drafts from exact KV (q == p, every draft accepted), which
# would leave the rejection and residual-resampling path untested.
COMPRESSOR = "streaming:sink=4,window=8"
# (temperature, top_p): the CI test and the long run sample these
CONFIGS = ((0.7, 1.0), (1.0, 0.9), (1.0, 1.0))




def power_at(n: int, df: int, tv: float, alpha: float) -> float:
    """Lower bound on the chi-square test's power for two samples of ``n`` whose distributions
    (over the tested cells) are ``tv`` apart: noncentrality >= 2 n tv^2 (module doc)."""
    from scipy.stats import chi2, ncx2

    return float(ncx2.sf(chi2.isf(alpha, df), df, 2.0 * n * tv * tv))


def required_n(df: int, tv: float = 0.05, alpha: float = 0.01, power: float = 0.9) -> int:
    """Smallest ``n`` per side with ``power_at(n, df, tv, alpha) >= power``."""
    lo, hi = 1, 2
    while power_at(hi, df, tv, alpha) < power:
        lo, hi = hi, hi * 2
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if power_at(mid, df, tv, alpha) < power else (lo, mid)
    return lo


def sample(url: str, prompt: str, sampling: dict[str, Any], n: int, batch: int = 64,
           progress: Any = None) -> tuple[list[tuple[int, ...]], list[dict]]:  # fmt: skip
    """``n`` continuations of ``prompt``: (output ids, ``meta_info["vericache"]`` or {}) each.

    Sent ``batch`` at a time as one /generate with a list of identical texts (SGLang batches
    them and shares the prompt's prefix). ``progress``: a tqdm bar to advance, or None.
    """
    from sglang_vericache.exactness.server import http_json

    ids: list[tuple[int, ...]] = []
    stats: list[dict] = []
    while len(ids) < n:
        k = min(batch, n - len(ids))
        outs = http_json(url + "/generate", {"text": [prompt] * k, "sampling_params": sampling})
        for out in outs:
            ids.append(tuple(out["output_ids"]))
            stats.append(out["meta_info"].get("vericache", {}))
        if progress is not None:
            progress.update(k)
    return ids, stats


def drafting_summary(stats: list[dict]) -> dict[str, Any]:
    """Modes seen, committed tokens per verify and the fraction of drafts accepted over a
    sample's ``meta_info["vericache"]``."""
    steps = sum(s.get("verify_steps", 0) for s in stats)
    committed = sum(s.get("committed", 0) for s in stats)
    drafted = sum(s.get("drafted", 0) for s in stats)
    return {
        "modes": sorted({s.get("mode", "") for s in stats}),
        "verify_steps": steps,
        "committed_per_verify": round(committed / steps, 3) if steps else 0.0,
        "accept_rate": round(sum(s.get("accepted", 0) for s in stats) / drafted, 3)
        if drafted else 0.0,
    }  # fmt: skip


def compare(ref: list[tuple[int, ...]], got: list[tuple[int, ...]]) -> dict[str, ChiSquare]:
    """First-token and first-three-token tests of two samples of output ids."""
    return {
        "first_token": chi_square_homogeneity([o[:1] for o in ref], [o[:1] for o in got]),
        "first_three": chi_square_homogeneity([o[:3] for o in ref], [o[:3] for o in got]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=6000, help="continuations per side and setting")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--configs", type=int, default=len(CONFIGS))
    ap.add_argument("--wrong-temperature", type=float, default=0.8,
                    help="plain at the first config's temperature vs plain at this one")  # fmt: skip
    ap.add_argument("--batch", type=int, default=64, help="continuations per /generate call")
    ap.add_argument("--draft-len", default="4", help="--vericache-draft-len")
    ap.add_argument("--compressor", default=COMPRESSOR, help="--vericache-compressor")
    ap.add_argument("--out", type=Path, default=REPO / "benchmark/results/sampled_distribution")
    args = ap.parse_args()

    from sglang_vericache.exactness.server import SGLangServer

    base = ["--max-total-tokens", "32768", "--chunked-prefill-size", "512"]
    logs = args.out.parent / f"{args.out.name}-logs"
    prompts, configs = PROMPTS[: args.prompts], CONFIGS[: args.configs]
    settings = [(p, t, tp) for p in prompts for t, tp in configs]
    samples: dict[str, dict] = {}
    started = time.perf_counter()
    vericache = ["--vericache", "--vericache-draft-len", args.draft_len,
                 "--vericache-compressor", args.compressor]  # fmt: skip
    from tqdm import tqdm

    bar = tqdm(total=args.n * (2 * len(settings) + 1), unit="sample")
    for side, extra in (("plain", []), ("vericache", vericache)):
        with SGLangServer(base + extra, log_path=logs / f"{side}.log") as server:
            for p, t, tp in settings:
                bar.set_description(f"{side} T={t} top_p={tp}")
                sp = {"temperature": t, "top_p": tp, "max_new_tokens": 3, "ignore_eos": True}
                samples[f"{side}|{p}|{t}|{tp}"] = sample(server.url, p, sp, args.n, args.batch,
                                                           bar)  # fmt: skip
            if side == "plain":
                wrong_t = args.wrong_temperature
                bar.set_description(f"plain T={wrong_t} (the wrong variant)")
                sp = {"temperature": wrong_t, "top_p": configs[0][1], "max_new_tokens": 3,
                      "ignore_eos": True}  # fmt: skip
                samples["wrong"] = sample(server.url, prompts[0], sp, args.n, args.batch, bar)
    bar.close()
    rows = []
    for p, t, tp in settings:
        ref, _ = samples[f"plain|{p}|{t}|{tp}"]
        got, stats = samples[f"vericache|{p}|{t}|{tp}"]
        tests = compare(ref, got)
        rows.append({"prompt": p, "temperature": t, "top_p": tp, **drafting_summary(stats),
                     **{k: asdict(v) for k, v in tests.items()}})  # fmt: skip
    p0, (t0, tp0) = prompts[0], configs[0]
    wrong = compare(samples[f"plain|{p0}|{t0}|{tp0}"][0], samples["wrong"][0])
    result = {
        "n_per_side": args.n,
        "draft_len": args.draft_len,
        "compressor": args.compressor,
        "wall_s": round(time.perf_counter() - started, 1),
        "rows": rows,
        "wrong_variant": {"what": f"plain T={t0} vs plain T={args.wrong_temperature}",
                          **{k: asdict(v) for k, v in wrong.items()}},  # fmt: skip
        "power_tv_0.05_alpha_0.01": {
            str(df): round(power_at(args.n, df, 0.05, 0.01), 3) for df in (1, 5, 10, 20)
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# Sampled output, plain vs --vericache {args.compressor} (N = {args.n} per side)", "",
          "| prompt | T | top_p | mode | committed/verify | accept rate | p first token "
          "| p first three (df) |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        f1, f3 = r["first_token"], r["first_three"]
        md.append(f"| {r['prompt']!r} | {r['temperature']} | {r['top_p']} | {','.join(r['modes'])} "
                  f"| {r['committed_per_verify']} | {r['accept_rate']} | {f1['p_value']:.3g} "
                  f"| {f3['p_value']:.3g} ({f3['df']}) |")  # fmt: skip
    w = result["wrong_variant"]
    md += ["", f"Wrong variant ({w['what']}): p = {w['first_token']['p_value']:.3g} (first token), "
           f"{w['first_three']['p_value']:.3g} (first three); TV {w['first_three']['tv']:.3f}.",
           "", f"Power lower bound at TV 0.05, alpha 0.01, by df: "
           f"{result['power_tv_0.05_alpha_0.01']}"]  # fmt: skip
    args.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
