"""Drafting in mixed traffic: greedy rows beside sampled rows in the same decode batch.

VeriCache drafts greedy rows and gives every other row one exact token from SGLang's sampler in
the same verify (``srt/row_sampling.py``). This measures what the greedy rows keep: their
committed tokens per verification in an all-greedy batch vs a batch where half the rows sample
(``temperature`` 0.8), on one ``--vericache`` server, side by side in one run. Greedy outputs
are compared with plain SGLang (started with the same arguments minus ``--vericache``).

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


def greedy_rows(outs: list[dict], n: int) -> dict:
    """Committed tokens per verification of the first ``n`` (greedy) rows."""
    stats = [o["meta_info"]["vericache"] for o in outs[:n]]
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
    base = ["--max-total-tokens", "65536", "--chunked-prefill-size", "1024"]
    logs = args.out.parent / f"{args.out.name}-logs"
    with SGLangServer(base, log_path=logs / "plain.log") as plain:
        reference, _ = send_all(plain.url, [(p, greedy) for p in prompts[:half]])
    vc_args = base + ["--vericache", "--vericache-compressor", args.compressor]
    with SGLangServer(vc_args, log_path=logs / "vericache.log") as server:
        all_greedy, wall_greedy = send_all(server.url, [(p, greedy) for p in prompts])
        mixed, wall_mixed = send_all(server.url, [(p, greedy) for p in prompts[:half]]
                                     + [(p, sampled) for p in prompts[half:]])  # fmt: skip
    identical = all(m["output_ids"] == r["output_ids"] == g["output_ids"]
                    for m, r, g in zip(mixed[:half], reference, all_greedy))  # fmt: skip
    result = {
        "settings": vars(args) | {"out": str(args.out)},
        "all_greedy": greedy_rows(all_greedy, half) | {"wall_s": round(wall_greedy, 2)},
        "mixed": greedy_rows(mixed, half) | {"wall_s": round(wall_mixed, 2)},
        "sampled_rows_mode": sorted({o["meta_info"]["vericache"]["mode"] for o in mixed[half:]}),
        "greedy_rows_identical_to_plain": identical,
    }
    ratio = result["mixed"]["committed_per_verify"] / max(result["all_greedy"]["committed_per_verify"], 1e-9)
    result["mixed_over_all_greedy"] = round(ratio, 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# Mixed batch: {half} greedy + {args.requests - half} sampled (T={args.temperature})", "",
          "| batch | greedy rows' committed tokens per verify | verify steps | wall s |",
          "|---|---|---|---|"]  # fmt: skip
    for name in ("all_greedy", "mixed"):
        r = result[name]
        md.append(f"| {name} | {r['committed_per_verify']} | {r['verify_steps']} | {r['wall_s']} |")
    md += ["", f"mixed / all-greedy: {result['mixed_over_all_greedy']}x; greedy rows identical to "
           f"plain SGLang: {identical}; sampled rows: {result['sampled_rows_mode']}", ""]  # fmt: skip
    args.out.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))
    if not identical:
        sys.exit("greedy rows differ from plain SGLang")


if __name__ == "__main__":
    main()
