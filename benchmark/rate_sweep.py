"""Latency vs request rate: plain SGLang, the offload-only baseline and --vericache, one budget.

Requests arrive as a Poisson process at each ``--rates`` value (requests/s); every server gets
the same prompts at the same arrival times (one seed), streamed, greedy, ``ignore_eos``. The
device KV budget holds ``--n-full`` requests with the full KV on the device, so past that
plain SGLang queues while the other two keep admitting. Per request: TTFT (first streamed
token), time per output token after the first (TPOT; VeriCache streams several tokens per
verify, so its inter-chunk gaps are not comparable, its per-token rate is), end to end. Per
rate and server: median and p90 of each, output tokens/s over the span from the first arrival
to the last finish, and how many outputs equal plain SGLang's token for token.

    python benchmark/rate_sweep.py                     # ~13 min on 2 cores
    python benchmark/rate_sweep.py --rates 0.1 0.3 --requests 6 --max-new-tokens 32

Writes OUT.{json,md,png}; default OUT benchmark/results/rate_sweep. Absolute times are this
machine's; compare servers within one rate (they ran minutes apart on the same cores).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from replay_agentic import stream_chat
from sglang_vericache.exactness.server import SGLangServer, http_json
from sglang_vericache.models import ensure_default_model

from benchmark.capacity import OFFLOAD_ONLY, SLOT_SLACK
from benchmark.prompts import build_prompt_set


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Offsets in seconds of ``n`` Poisson arrivals at ``rate`` per second (the first at 0)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def one_request(url: str, text: str, max_new: int, t0: float, row: dict) -> None:
    """Stream one /generate request; fill ``row`` with its timings and output ids."""
    body = {"text": text, "stream": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}}  # fmt: skip
    start = time.perf_counter()
    first, last, ids = None, start, []
    for t, chunk in stream_chat(url + "/generate", body, timeout=1800):
        if chunk.get("output_ids"):  # cumulative (SGLang's default, non-incremental streaming)
            ids = chunk["output_ids"]
            first = first if first is not None else t
            last = t
    n = len(ids)
    row.update(arrive_s=start - t0, finish_s=last - t0, ttft_s=(first or last) - start,
               e2e_s=last - start, tpot_s=(last - (first or last)) / max(n - 1, 1),
               output_ids=ids)  # fmt: skip


def run_rate(url: str, prompts: list[dict], offsets: list[float], max_new: int, desc: str) -> dict:
    """Send ``prompts`` at ``offsets`` (seconds from now), wait for every answer."""
    rows: list[dict] = [{} for _ in prompts]
    errors: list[str] = []
    threads = []
    t0 = time.perf_counter()

    def send(i: int, text: str, bar: tqdm) -> None:
        try:
            one_request(url, text, max_new, t0, rows[i])
        except Exception as exc:  # noqa: BLE001 -- reported below, after every thread joined
            errors.append(f"request {i}: {exc}")
        bar.update()

    with tqdm(total=len(prompts), desc=desc, leave=False) as bar:
        for i, (p, off) in enumerate(zip(prompts, offsets)):
            time.sleep(max(0.0, t0 + off - time.perf_counter()))
            th = threading.Thread(target=send, args=(i, p["text"], bar))
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
    if errors:
        raise RuntimeError(f"{desc}: {len(errors)} request(s) failed; the server log says why: "
                           + "; ".join(errors))  # fmt: skip
    return {"requests": rows}


def serve(args_list: list[str], log: Path, prompts: list[dict], schedule: dict[float, list[float]],
          max_new: int) -> dict[float, dict]:  # fmt: skip
    with SGLangServer(args_list, log_path=log) as server:
        http_json(server.url + "/generate", {"text": prompts[0]["text"][:400], "sampling_params": {
            "temperature": 0, "max_new_tokens": 8}})  # warm-up, not timed  # fmt: skip
        return {rate: run_rate(server.url, prompts, offs, max_new, f"{log.stem} @ {rate}/s")
                for rate, offs in schedule.items()}  # fmt: skip


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 3)


def summarize(runs: dict[str, dict[float, dict]], rates: list[float]) -> list[dict]:
    rows = []
    for rate in rates:
        ref = [r["output_ids"] for r in runs["plain"][rate]["requests"]]
        for name, by_rate in runs.items():
            reqs = by_rate[rate]["requests"]
            span = max(r["finish_s"] for r in reqs) - min(r["arrive_s"] for r in reqs)
            rows.append({
                "rate": rate, "server": name,
                "ttft_median_s": round(statistics.median(r["ttft_s"] for r in reqs), 3),
                "ttft_p90_s": pct([r["ttft_s"] for r in reqs], 0.9),
                "tpot_median_s": round(statistics.median(r["tpot_s"] for r in reqs), 4),
                "e2e_median_s": round(statistics.median(r["e2e_s"] for r in reqs), 3),
                "e2e_p90_s": pct([r["e2e_s"] for r in reqs], 0.9),
                "output_tokens_per_s": round(sum(len(r["output_ids"]) for r in reqs) / span, 2),
                "identical_to_plain": sum(r["output_ids"] == o for r, o in zip(reqs, ref)),
                "requests": len(reqs),
            })  # fmt: skip
    return rows


def markdown(report: dict) -> str:
    lines = [(f"Device KV budget `--max-total-tokens {report['budget_tokens']}` = {report['n_full']} "
             f"full-KV requests of {report['prompt_tokens']} + {report['max_new_tokens']} tokens; "
             f"{report['requests']} Poisson arrivals per rate (seed {report['seed']})."), "",
             ("| rate (req/s) | server | TTFT median / p90 s | TPOT median s | E2E median / p90 s "
             "| output tok/s | identical to plain |"), "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in report["rows"]:
        lines.append(f"| {r['rate']} | {r['server']} | {r['ttft_median_s']} / {r['ttft_p90_s']} | "
                     f"{r['tpot_median_s']} | {r['e2e_median_s']} / {r['e2e_p90_s']} | "
                     f"{r['output_tokens_per_s']} | {r['identical_to_plain']}/{r['requests']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r["server"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["server"] == name]
        rates = [r["rate"] for r in rows]
        axes[0].plot(rates, [r["e2e_median_s"] for r in rows], marker="o", label=name)
        axes[1].plot(rates, [r["ttft_median_s"] for r in rows], marker="o", label=name)
    for ax, what in zip(axes, ("end-to-end latency, median (s)", "TTFT, median (s)")):
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Latency vs request rate at a budget of {report['n_full']} full-KV requests "
                 "(CPU, fp32 SmolLM2-135M)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.1, 0.2, 0.4])
    ap.add_argument("--requests", type=int, default=8, help="arrivals per rate")
    ap.add_argument("--n-full", type=int, default=2, help="full-KV requests the budget holds")
    ap.add_argument("--prompt-tokens", type=int, default=1536)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--compressor", default="snapkv:ratio=0.25")
    ap.add_argument("--draft-len", type=int, default=6)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--out", type=Path, default=REPO / "benchmark/results/rate_sweep")
    args = ap.parse_args()
    if any(r <= 0 for r in args.rates):
        ap.error("--rates: every rate must be > 0 requests/s")

    from transformers import AutoTokenizer

    model = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(model)
    prompts = build_prompt_set(tok, n=args.requests, min_tokens=args.prompt_tokens * 3 // 4,
                               max_tokens=args.prompt_tokens, seed=17)  # fmt: skip
    budget = args.n_full * (args.prompt_tokens + args.max_new_tokens) + SLOT_SLACK
    base = ["--model-path", str(model), "--max-total-tokens", str(budget)]
    servers = {"plain": base, OFFLOAD_ONLY: base + ["--vericache", "--vericache-draft-len", "0"],
               f"vericache {args.compressor}": base + [
                   "--vericache", "--vericache-compressor", args.compressor,
                   "--vericache-draft-len", str(args.draft_len)]}  # fmt: skip
    schedule = {rate: arrivals(args.requests, rate, args.seed) for rate in args.rates}
    logs = args.out.parent / f"{args.out.name}-logs"
    runs = {name: serve(a, logs / f"{i}.log", prompts, schedule, args.max_new_tokens)
            for i, (name, a) in enumerate(tqdm(servers.items(), desc="servers"))}  # fmt: skip
    report = {"budget_tokens": budget, "n_full": args.n_full, "prompt_tokens": args.prompt_tokens,
              "max_new_tokens": args.max_new_tokens, "requests": args.requests, "seed": args.seed,
              "rates": args.rates, "rows": summarize(runs, args.rates),
              "per_request": {n: {str(k): v["requests"] for k, v in r.items()} for n, r in runs.items()}}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    args.out.with_suffix(".md").write_text(text)
    plot(report, args.out.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
