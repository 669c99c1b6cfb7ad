r"""How many long requests fit one device KV budget, and how fast: plain SGLang vs --vericache.

Each budget (``--max-total-tokens``) holds ``--n-full`` requests of ``--prompt-tokens`` prompt +
``--max-new-tokens`` output with the full KV on the device. Every server gets the same
``--requests`` distinct prompts at once; the peak of SGLang's own ``#running-req`` (its decode
log, every step) is the number served concurrently, and output tokens / wall time the
throughput. VeriCache outputs are compared with plain SGLang's token by token, so the run also
checks exactness under memory pressure. Several ``--n-full`` values sweep the budget from tight
to ample (the paper's Fig. 13 analogue). Unless ``--no-offload-baseline``, each budget also runs
the offload-only baseline (``--vericache-draft-len 0``: the full KV off the device, read back
for every token, no compressed KV, no drafting): what VeriCache would cost without drafting.

    python benchmark/capacity.py --max-new-tokens 256          # N=3: snapkv 4x and kivi-4
    python benchmark/capacity.py --max-new-tokens 64 --n-full 2 3 6 12 --requests 8 \
        --compressors snapkv:ratio=0.25 --out benchmark/results/budget_sweep
    python benchmark/capacity.py ... --n-full 24 --append    # one more budget, same settings
    python benchmark/capacity.py ... --temperature 0.7       # sampled rows (speculative sampling)
    python benchmark/capacity.py ... --n-full 2 12 --rounds 3 # VeriCache servers x 3, alternately

Writes OUT.{json,md} (and OUT.png for a sweep); default OUT benchmark/results/capacity.
"""

from __future__ import annotations

import argparse
import json
import re
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

RUNNING = re.compile(r"Decode batch, #running-req: (\d+)")
SLOT_SLACK = 64  # headroom for the decode step's own slots
OFFLOAD_ONLY = "offload only, no drafting (--vericache-draft-len 0)"


def peak_running(log: Path) -> int:
    """Largest ``#running-req`` SGLang logged for a decode batch."""
    return max((int(m) for m in RUNNING.findall(log.read_text(errors="replace"))), default=0)


def serve(args_list: list[str], prompts: list[dict], sampling: dict, log: Path) -> dict:
    """Start one server, send every prompt at once (``sampling``: their sampling params),
    return outputs, meta and the peak."""
    with SGLangServer(args_list + ["--decode-log-interval", "1"], log_path=log) as server:
        body = lambda p: {"text": p["text"], "sampling_params": sampling}  # noqa: E731
        start = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool, tqdm(total=len(prompts), desc=log.stem) as bar:
            futures = [pool.submit(http_json, server.url + "/generate", body(p)) for p in prompts]
            outs = []
            for f in futures:
                outs.append(f.result())
                bar.update()
        wall = time.perf_counter() - start
    return {"outputs": [o["output_ids"] for o in outs], "meta": [o["meta_info"] for o in outs],
            "peak_running": peak_running(log), "wall_s": round(wall, 2)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n-full", type=int, nargs="+", default=[3],
                    help="full-KV requests each budget holds (several: a budget sweep)")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy, outputs compared with plain; > 0: sampled (no comparison)")
    ap.add_argument("--requests", type=int, default=0, help="default: 4 x the largest --n-full")
    ap.add_argument("--compressors", nargs="+", default=["snapkv:ratio=0.25", "kivi:bits=4"])
    ap.add_argument("--draft-len", nargs="+", default=["6"],
                    help="integers and/or auto (drafts where it pays); several: one server each")
    ap.add_argument("--no-offload-baseline", action="store_true",
                    help="skip the offload-only baseline (--vericache-draft-len 0)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run each --vericache server (offload-only too) this many times, one "
                         "after another in turn; rows give the median wall time (single runs "
                         "on a shared machine differ by ~10%%)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmark/results/capacity")
    ap.add_argument("--append", action="store_true",
                    help="keep OUT.json's budgets that this run does not measure (same settings)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")

    from transformers import AutoTokenizer

    model = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(model)
    n_req = args.requests or 4 * max(args.n_full)
    lo = args.prompt_tokens * 3 // 4  # the builder cannot hit an exact length for every kind
    prompts = build_prompt_set(tok, n=n_req, min_tokens=lo, max_tokens=args.prompt_tokens, seed=11)
    kept = kept_reports(args.out.with_suffix(".json"), args, n_req) if args.append else []
    sampling = {"temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
                "ignore_eos": True}
    reports = []
    for n_full in args.n_full:
        budget = n_full * (args.prompt_tokens + args.max_new_tokens) + SLOT_SLACK
        base = ["--model-path", str(model), "--max-total-tokens", str(budget)]
        logs = args.out.parent / f"{args.out.name}-logs" / f"n{n_full}"
        servers = {}  # name -> (server args, log name)
        if not args.no_offload_baseline:
            servers[OFFLOAD_ONLY] = (base + ["--vericache", "--vericache-draft-len", "0"],
                                     "offload-only")  # fmt: skip
        for spec in args.compressors:
            for draft_len in args.draft_len:
                extra = ["--vericache", "--vericache-compressor", spec,
                         "--vericache-draft-len", draft_len]  # fmt: skip
                servers[vericache_name(spec, draft_len, args.draft_len)] = (
                    base + extra, f"vericache-{spec.replace(':', '_')}-draft-{draft_len}")
        runs = {"plain": [serve(base, prompts, sampling, logs / "plain.log")]}
        for r in range(args.rounds):  # in turn, so a slow spell of the machine hits all alike
            for name, (argv, log) in servers.items():
                suffix = "" if r == 0 else f"-round{r + 1}"
                runs.setdefault(name, []).append(
                    serve(argv, prompts, sampling, logs / f"{log}{suffix}.log"))
        reports.append(summarize(args, n_full, budget, n_req, runs))
    if args.append:
        reports = sorted(reports + kept, key=lambda r: r["n_full"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = reports[0] if len(reports) == 1 else {"sweep": reports}
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    text = "\n".join(markdown(r) for r in reports)
    args.out.with_suffix(".md").write_text(text)
    if len(reports) > 1:
        plot_sweep(reports, args.out.with_suffix(".png"))
    print(text)


def vericache_name(spec: str, draft_len: str, all_lens: list[str]) -> str:
    """A server's row name; the draft length is named when several were measured."""
    return f"vericache {spec}" + (f" draft {draft_len}" if len(all_lens) > 1 else "")


def kept_reports(path: Path, args: argparse.Namespace, n_req: int) -> list[dict]:
    """Budgets of an earlier run at ``path`` that this run does not measure again.

    Raises ValueError before anything runs if that run used other settings (its rows would
    not be comparable with this run's).
    """
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    old = old.get("sweep", [old])
    servers = ["plain"] + [OFFLOAD_ONLY] * (not args.no_offload_baseline) + [
        vericache_name(spec, d, args.draft_len) for spec in args.compressors
        for d in args.draft_len]  # fmt: skip
    mine = {"prompt_tokens": args.prompt_tokens, "max_new_tokens": args.max_new_tokens,
            "draft_len": args.draft_len, "temperature": args.temperature, "requests": n_req,
            "servers": servers}  # fmt: skip
    for r in old:
        theirs = {k: r[k] for k in ("prompt_tokens", "max_new_tokens", "draft_len")} | {
            "temperature": r.get("temperature", 0.0),  # runs before the option were greedy
            "requests": r["rows"][0]["requests"], "servers": [x["server"] for x in r["rows"]]}
        if theirs != mine:
            raise ValueError(f"--append: {path} was measured with {theirs}, this run with {mine}; "
                             "use the same settings or another --out")  # fmt: skip
    return [r for r in old if r["n_full"] not in args.n_full]


def plot_sweep(reports: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    names = [r["server"] for r in reports[0]["rows"] if r["server"] != "plain"]
    budgets = [r["n_full"] for r in reports]
    for name in names:
        ratio = [next(x["throughput_vs_plain"] for x in r["rows"] if x["server"] == name)
                 for r in reports]  # fmt: skip
        ax.plot(budgets, ratio, marker="o", label=name)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("device KV budget (full-KV requests it holds)")
    ax.set_ylabel("throughput vs plain SGLang")
    ax.set_title("VeriCache vs plain SGLang across KV budgets (CPU, fp32)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summarize(args: argparse.Namespace, n_full: int, budget: int, n_req: int,
              runs: dict[str, list[dict]]) -> dict:  # fmt: skip
    """One row per server; a server run in several rounds gets its median wall time, and the
    outputs of every round are compared with plain's."""
    ref = runs["plain"][0]["outputs"]
    plain_tps = sum(len(o) for o in ref) / runs["plain"][0]["wall_s"]
    rows = []
    for name, rounds in runs.items():
        meta = [m for run in rounds for m in run["meta"]]
        vc = [m.get("vericache") or {} for m in meta]
        comp = [v.get("compressed_kv_bytes", 0) for v in vc]
        wall = statistics.median(run["wall_s"] for run in rounds)
        tokens = statistics.median(sum(len(o) for o in run["outputs"]) for run in rounds)
        same = sum(a == b for run in rounds for a, b in zip(run["outputs"], ref))
        peak = max(run["peak_running"] for run in rounds)
        rows.append({
            "server": name,
            "peak_running": peak,
            "vs_n_full": round(peak / n_full, 2),
            "output_tokens_per_s": round(tokens / wall, 2),
            "throughput_vs_plain": round(tokens / wall / plain_tps, 2),
            "identical_to_plain": same if args.temperature == 0 else None,  # sampled: no contract
            "requests": n_req,
            "rounds": len(rounds),
            "wall_s": round(wall, 2),
            "walls_s": [run["wall_s"] for run in rounds],
            "mean_accept_len": round(sum(v.get("mean_accept_len", 0) for v in vc) / len(vc), 2),
            "mean_prompt_tokens": round(sum(m["prompt_tokens"] for m in meta) / len(meta)),
            "mean_compressed_kv_bytes": round(sum(comp) / len(comp)),
        })  # fmt: skip
    return {"budget_tokens": budget, "n_full": n_full, "prompt_tokens": args.prompt_tokens,
            "max_new_tokens": args.max_new_tokens, "draft_len": args.draft_len,
            "temperature": args.temperature, "rows": rows}  # fmt: skip


def markdown(report: dict) -> str:
    lines = [
        f"Device KV budget `--max-total-tokens {report['budget_tokens']}` = "
        f"{report['n_full']} x ({report['prompt_tokens']} prompt + {report['max_new_tokens']} "
        f"output) tokens of full KV; all requests sent at once"
        f"{', temperature ' + str(report['temperature']) if report.get('temperature') else ''}.",
        "",
        "| server | peak concurrent | x N | identical to plain | wall s | output tok/s | "
        "throughput vs plain | accept len |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        walls = r.get("walls_s", [r["wall_s"]])
        wall = r["wall_s"] if len(walls) == 1 else f"{r['wall_s']} (median of {walls})"
        lines.append(f"| {r['server']} | {r['peak_running']} | {r['vs_n_full']} | "
                     f"{identical(r)} | {wall} | "
                     f"{r['output_tokens_per_s']} | {r['throughput_vs_plain']}x | "
                     f"{r['mean_accept_len']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def identical(row: dict) -> str:
    if row["identical_to_plain"] is None:
        return "n/a (sampled)"
    return f"{row['identical_to_plain']}/{row['requests'] * row.get('rounds', 1)}"


if __name__ == "__main__":
    main()
