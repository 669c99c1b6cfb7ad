"""Drafting in mixed traffic: greedy rows beside sampled rows and beside plain rows.

VeriCache drafts greedy and sampled rows (speculative sampling) and gives every other row
(``min_new_tokens``, logit bias, ...) one exact token from SGLang's sampler in the same verify
(``srt/decode/row_sampling.py``). On one ``--vericache`` server with a fixed draft length, side by
side in one run, three batches of the same prompts: all greedy; half greedy + half sampled
(``temperature`` 0.8); half greedy + half plain (``min_new_tokens``, the plain rows). It
reports each kind of row's committed tokens per verification. Greedy outputs are compared with
plain SGLang (started with the same arguments minus ``--vericache``).

    python benchmark/mixed_batch.py --requests 8 --max-new-tokens 64

Writes OUT.{json,md}; default OUT benchmark/results/mixed_batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmark.prompts import build_prompt_set  # noqa: E402
from sglang_vericache.exactness.server import SGLangServer, http_json  # noqa: E402
from sglang_vericache.models import ensure_default_model  # noqa: E402


def send_all(url: str, jobs: list[tuple[str, dict]]) -> tuple[list[dict], float]:
    """All ``(text, sampling_params)`` jobs at once; returns responses and wall seconds."""
    start = time.perf_counter()
    body = lambda j: {"text": j[0], "sampling_params": j[1]}  # noqa: E731
    with ThreadPoolExecutor(len(jobs)) as pool, tqdm(total=len(jobs), desc=url) as bar:
        futures = [pool.submit(http_json, url + "/generate", body(j), 3600.0) for j in jobs]
        outs = []
        for future in futures:
            outs.append(future.result())
            bar.update()
    return outs, time.perf_counter() - start


def row_stats(outs: list[dict]) -> dict:
    """Committed tokens per verification of ``outs``' rows (mean over rows that verified)."""
    stats = [o["meta_info"]["vericache"] for o in outs]
    per_verify = [s["committed"] / s["verify_steps"] for s in stats if s["verify_steps"]]
    return {"mode": sorted({s["mode"] for s in stats}), "verify_steps": sum(s["verify_steps"] for s in stats),
            "committed_per_verify": round(statistics.mean(per_verify), 3) if per_verify else 0.0}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=8, help="rows per batch (half sample)")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--compressor", default="kivi:bits=4")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--draft-len", default="4", help="fixed, so every step drafts (not auto)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmark/results/mixed_batch")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ensure_default_model())
    prompts = [p["text"] for p in build_prompt_set(
        tok, n=args.requests, min_tokens=args.prompt_tokens // 2, max_tokens=args.prompt_tokens,
        seed=23)]  # fmt: skip
    half = args.requests // 2
    greedy = {"temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    sampled = {**greedy, "temperature": args.temperature}
    plain_rows = {**greedy, "min_new_tokens": 1}  # logit processing: decoded plainly
    base = ["--max-total-tokens", "65536", "--chunked-prefill-size", "1024"]
    logs = args.out.parent / f"{args.out.name}-logs"
    with SGLangServer(base, log_path=logs / "plain.log") as plain:
        reference, _ = send_all(plain.url, [(p, greedy) for p in prompts[:half]])
    vc_args = base + ["--vericache", "--vericache-compressor", args.compressor,
                      "--vericache-draft-len", args.draft_len]  # fmt: skip
    with SGLangServer(vc_args, log_path=logs / "vericache.log") as server:
        all_greedy, wall_greedy = send_all(server.url, [(p, greedy) for p in prompts])
        mixed, wall_mixed = send_all(server.url, [(p, greedy) for p in prompts[:half]]
                                     + [(p, sampled) for p in prompts[half:]])  # fmt: skip
        with_plain, wall_plain = send_all(server.url, [(p, greedy) for p in prompts[:half]]
                                          + [(p, plain_rows) for p in prompts[half:]])  # fmt: skip
    identical = all(m["output_ids"] == r["output_ids"] == g["output_ids"] == w["output_ids"]
                    for m, r, g, w in zip(mixed[:half], reference, all_greedy, with_plain))
    batches = {"all_greedy": (all_greedy, wall_greedy), "mixed": (mixed, wall_mixed),
               "with_plain_rows": (with_plain, wall_plain)}  # fmt: skip
    result = {"settings": vars(args) | {"out": str(args.out)},
              "greedy_rows_identical_to_plain": identical}  # fmt: skip
    for name, (outs, wall) in batches.items():
        result[name] = {"greedy_rows": row_stats(outs[:half]), "other_rows": row_stats(outs[half:]),
                        "wall_s": round(wall, 2)}  # fmt: skip
    base_cpv = max(result["all_greedy"]["greedy_rows"]["committed_per_verify"], 1e-9)
    for name in ("mixed", "with_plain_rows"):
        cpv = result[name]["greedy_rows"]["committed_per_verify"]
        result[name]["greedy_rows_vs_all_greedy"] = round(cpv / base_cpv, 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# Mixed batches: {half} greedy rows + {args.requests - half} others "
          f"(draft length {args.draft_len}, {args.compressor})", "",
          "| batch | other rows | greedy rows: committed / verify | other rows: mode, "
          "committed / verify | wall s |", "|---|---|---|---|---|"]  # fmt: skip
    others = {"all_greedy": "greedy", "mixed": f"temperature {args.temperature}",
              "with_plain_rows": "min_new_tokens 1"}  # fmt: skip
    for name, label in others.items():
        r = result[name]
        g, o = r["greedy_rows"], r["other_rows"]
        md.append(f"| {name} | {label} | {g['committed_per_verify']} | {'/'.join(o['mode'])}, "
                  f"{o['committed_per_verify']} | {r['wall_s']} |")  # fmt: skip
    md += ["", f"greedy rows identical to plain SGLang in every batch: {identical}", ""]
    args.out.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))
    if not identical:
        sys.exit("greedy rows differ from plain SGLang")


if __name__ == "__main__":
    main()
