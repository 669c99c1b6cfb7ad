"""The full exactness sweep: every compressor family x concurrency 1 and 8, vs plain SGLang.

    python benchmark/exactness_sweep.py                       # 24 prompts x 256 tokens
    python benchmark/exactness_sweep.py --n 8 --max-new-tokens 64 --compressors kivi:bits=4

Builds the offline prompt set (1-3k tokens: code, JSON tool calls, prose, multi-document
questions), then runs ``python -m sglang_vericache.exactness`` once per (compressor,
concurrency). The plain reference runs once per concurrency and is reused
(``--reference-cache``). Writes one summary per run to benchmark/results/exactness/ and the
table benchmark/results/exactness/sweep.md. Exit status 1 if any run diverged.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmark/results/exactness"
COMPRESSORS = ("streaming:sink=4,window=508", "snapkv:ratio=0.25", "h2o:ratio=0.25",
               "kivi:bits=4", "kivi:bits=2", "snapkv:ratio=0.5+kivi:bits=4")  # fmt: skip


def slug(spec: str) -> str:
    return spec.replace(":", "-").replace(",", "_").replace("=", "")


def run_one(spec: str, conc: int, args: argparse.Namespace, prompts: Path) -> dict:
    out = OUT / f"sweep-{slug(spec)}-x{args.draft_len}-c{conc}-{args.n}x{args.max_new_tokens}.json"
    cmd = [sys.executable, "-m", "sglang_vericache.exactness", "--prompts", str(prompts),
           "--max-new-tokens", str(args.max_new_tokens), "--concurrency", str(conc),
           "--output", str(out), "--log-dir", str(OUT / "logs" / out.stem),
           "--reference-cache", str(OUT / f"reference-c{conc}-{args.n}x{args.max_new_tokens}.json"),
           "--", "--max-total-tokens", str(args.max_total_tokens), "--vericache",
           "--vericache-compressor", spec, "--vericache-draft-len", str(args.draft_len)]  # fmt: skip
    out.unlink(missing_ok=True)  # an earlier run's summary must not pass for this run's
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode not in (0, 1) or not out.exists():
        return {"compressor": spec, "concurrency": conc, "status": "error",
                "error": proc.stderr[-2000:]}  # fmt: skip
    summary = json.loads(out.read_text())
    return {"compressor": spec, "concurrency": conc, "status": summary["status"],
            "identical": summary["identical"], "total": summary["total"],
            "candidate_s": summary.get("candidate_seconds"),
            "reference_s": summary.get("reference_seconds")}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=24, help="prompts")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--draft-len", type=int, default=8)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--compressors", nargs="+", default=list(COMPRESSORS))
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    prompts = OUT / f"prompts{args.n}.jsonl"
    if not prompts.exists():
        subprocess.run([sys.executable, str(REPO / "benchmark/prompts.py"), str(prompts),
                        "--n", str(args.n)], check=True)  # fmt: skip
    runs = [(spec, conc) for conc in args.concurrency for spec in args.compressors]
    rows, commit = earlier_rows(), short_commit()
    for spec, conc in tqdm(runs, desc="exactness sweep"):
        row = {**run_one(spec, conc, args, prompts), "commit": commit}
        tqdm.write(json.dumps(row))
        rows = [r for r in rows if (r["compressor"], r["concurrency"]) != (spec, conc)] + [row]
        write_table(rows, args)
    return 0 if all(r["status"] == "identical" for r in rows) else 1


def earlier_rows() -> list[dict]:
    """Rows of earlier sweeps, so that running one concurrency keeps the other's results."""
    path = OUT / "sweep.json"
    return json.loads(path.read_text()) if path.exists() else []


def short_commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip


def write_table(rows: list[dict], args: argparse.Namespace) -> None:
    rows = sorted(rows, key=lambda r: (r["concurrency"], COMPRESSORS.index(r["compressor"])
                                       if r["compressor"] in COMPRESSORS else len(COMPRESSORS)))
    lines = [f"{args.n} prompts of 1-3k tokens x {args.max_new_tokens} new tokens, greedy, "
             f"draft length {args.draft_len}; reference: plain SGLang, same args and concurrency.",
             "", "| compressor | concurrency | identical | VeriCache s | plain s | commit |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        got = f"{r.get('identical')}/{r.get('total')}" if r["status"] != "error" else "error"
        lines.append(f"| `{r['compressor']}` | {r['concurrency']} | {got} | "
                     f"{r.get('candidate_s')} | {r.get('reference_s')} | "
                     f"{r.get('commit', '0d0d3eb')} |")  # fmt: skip
    (OUT / "sweep.md").write_text("\n".join(lines) + "\n")
    (OUT / "sweep.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
