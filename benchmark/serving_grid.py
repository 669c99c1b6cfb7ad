r"""Serving benchmarks through SGLang's own client: ``python -m sglang.benchmark.serving``.

Three servers on the embedded default model, started one at a time: plain SGLang, the offload-only
baseline (``--vericache --vericache-draft-len 0``) and ``--vericache`` (draft length ``auto``).
Each gets every cell of a grid: input length x concurrency x dataset (``random-ids``; ``custom``,
a JSONL of the project's real-text prompts from ``benchmark/prompts.py``, seed ``--prompt-seed``;
``generated-shared-prefix`` with ``--gsp-turns`` turns, run by the harness on its chat backend),
at an ample and a tight KV budget. ``--max-total-tokens`` holds N requests' full KV, N x (input +
output) + 64 as in capacity.py / rate_sweep.py: ample N = the largest concurrency (nothing
waits for memory), tight N = ``--tight-n-full`` (2, the budget sweep's tight end). Greedy,
``--output-len`` tokens per request (EOS ignored, the harness's default), ``--seed``, all
requests at once up to the cell's concurrency, the radix cache flushed after the warm-up.

Rounds pair the servers: round r starts every server (in an order rotated by r) on a group of
cells (one budget and input length, as the budget depends on it; ``--restart-per-cell``: one
cell) before round r + 1, so a slow spell of a shared machine hits all alike. A cell's figure
is each server's median over rounds; the ratio of ``--vericache`` to the better baseline is
given per round and as their median (above 1: VeriCache better). The harness saves generated
texts (``--output-details``); VeriCache's and offload-only's are compared with plain's, text by
text (token ids are not in its output; greedy texts equal position by position).

    python benchmark/serving_grid.py                       # the full grid, 2 rounds
    python benchmark/serving_grid.py --input-lens 1024 --concurrency 1 8 --datasets random-ids \
        --rounds 1 --num-prompts 4 --output-len 32 --out /tmp/serving_smoke.json   # minutes

Writes OUT (default benchmark/results/serving_grid.json, rewritten after every round) and OUT.md;
progress on stderr; server logs and harness outputs under ``--work``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sglang_vericache.exactness.server import SGLangServer

from benchmark import serving_grid_plan as plan

SERVERS = [plan.PLAIN, plan.OFFLOAD, plan.VERICACHE]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--input-lens", type=int, nargs="+", default=[1024, 4096, 7168])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--datasets", nargs="+", default=list(plan.DATASETS), choices=plan.DATASETS)
    ap.add_argument("--budgets", nargs="+", default=["ample", "tight"], choices=["ample", "tight"])
    ap.add_argument("--tight-n-full", type=int, default=2,
                    help="full-KV requests the tight budget holds")
    ap.add_argument("--ample-n-full", type=int, default=0,
                    help="full-KV requests the ample budget holds (0: the largest concurrency)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prompt-seed", type=int, default=23,
                    help="seed of the real-text prompt set (not one other benchmarks use)")
    ap.add_argument("--gsp-turns", type=int, default=3)
    ap.add_argument("--gsp-question-len", type=int, default=64)
    ap.add_argument("--server-args", default="",
                    help="more launch_server flags for every server (one shell-quoted string)")
    ap.add_argument("--restart-per-cell", action="store_true",
                    help="start the servers per cell, not per (budget, input length) group")
    ap.add_argument("--run-timeout", type=float, default=3600.0, help="seconds per harness run")
    ap.add_argument("--out", type=Path, default=REPO / "benchmark/results/serving_grid.json")
    ap.add_argument("--work", type=Path, default=None, help="logs and harness files (a temp dir)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.num_prompts < 1 or args.output_len < 4:
        ap.error("need --rounds >= 1, --num-prompts >= 1 and --output-len >= 4 (the harness's)")
    return args


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpus": os.cpu_count()}  # fmt: skip
    for pkg in ("sglang", "torch", "sglang-vericache"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]
        gpus = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout
        info["gpus"] = [g.strip() for g in gpus.splitlines() if g.strip()]
    except (OSError, subprocess.SubprocessError):
        info["gpus"] = []
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True, check=False).stdout.strip()  # fmt: skip
    info["commit"] = commit or None
    return info


def custom_datasets(model: Path, args: argparse.Namespace, work: Path) -> dict[int, Path]:
    """Per input length, a ``custom`` JSONL of ``--num-prompts`` real-text prompts of 3/4 to all
    of that many tokens (benchmark/prompts.py: code, JSON tool calls, prose, multi-document)."""
    if "custom" not in args.datasets:
        return {}
    from transformers import AutoTokenizer

    from benchmark.prompts import build_prompt_set

    tok = AutoTokenizer.from_pretrained(model)
    out = {}
    for n in args.input_lens:
        prompts = build_prompt_set(tok, n=args.num_prompts, min_tokens=n * 3 // 4, max_tokens=n,
                                   seed=args.prompt_seed)  # fmt: skip
        path = work / f"custom-in{n}.jsonl"
        path.write_text("\n".join(plan.custom_jsonl_lines([p["text"] for p in prompts])) + "\n")
        out[n] = path
    return out


def run_harness(cell: plan.Cell, url: str, model: Path, args: argparse.Namespace, work: Path,
                stem: str, custom: dict[int, Path]) -> dict[str, Any]:  # fmt: skip
    """One harness run of ``cell``; its metrics and texts, or an error with the log's tail."""
    out_file = work / f"{stem}.jsonl"
    gsp = None
    if cell.dataset == "generated-shared-prefix":
        gsp = plan.gsp_shape(cell.input_len, args.output_len, args.num_prompts, args.gsp_turns,
                             args.gsp_question_len)  # fmt: skip
    cmd = plan.harness_command(sys.executable, cell, url, str(model), num_prompts=args.num_prompts,
                               output_len=args.output_len, seed=args.seed, output_file=out_file,
                               custom_path=custom.get(cell.input_len), gsp=gsp)  # fmt: skip
    return harness_run(cmd, out_file, work / f"{stem}.log", args.run_timeout)


def harness_run(cmd: list[str], out_file: Path, log: Path, timeout: float) -> dict[str, Any]:
    """Run one ``python -m sglang.benchmark.serving`` command line writing ``out_file`` (its
    output to ``log``, in the log's folder): the command, seconds and log, and the harness's
    metrics and texts, or the error with the log's tail."""
    out_file.unlink(missing_ok=True)
    start = time.perf_counter()
    with open(log, "wb") as f:
        try:
            done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=log.parent,
                                  timeout=timeout, check=False)  # fmt: skip
            rc: int | str = done.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    result: dict[str, Any] = {"command": shlex.join(cmd[1:]), "elapsed_s":
                              round(time.perf_counter() - start, 1), "log": str(log)}  # fmt: skip
    try:
        if rc != 0:
            raise ValueError(f"harness exit {rc}")
        result["metrics"], result["texts"] = plan.parse_harness_file(out_file)
    except (OSError, ValueError) as e:
        tail = log.read_bytes()[-1500:].decode(errors="replace")
        result["error"] = f"{e}; log tail: {tail}"
    return result


def server_args(name: str, model: Path, budget: int, extra: list[str]) -> list[str]:
    return ["--model-path", str(model), "--max-total-tokens", str(budget), *extra,
            *plan.SERVER_FLAGS[name]]  # fmt: skip


def progress(msg: str, t0: float) -> None:
    print(f"[serving_grid {time.monotonic() - t0:7.0f}s] {msg}", file=sys.stderr, flush=True)


def run_grid(args: argparse.Namespace, report: dict[str, Any], model: Path, work: Path) -> None:
    groups = plan.expand_grid(args.budgets, args.input_lens, args.datasets, args.concurrency)
    if args.restart_per_cell:
        groups = [[c] for g in groups for c in g]
    total = sum(len(g) for g in groups)
    custom = custom_datasets(model, args, work)
    extra = shlex.split(args.server_args)
    cells: dict[str, dict[str, Any]] = {}
    t0, index = time.monotonic(), 0
    for group in groups:
        first = group[0]
        n_full = plan.budget_n_full(first.budget, args.concurrency, args.tight_n_full,
                                    args.ample_n_full)  # fmt: skip
        budget = plan.budget_tokens(n_full, first.input_len, args.output_len)
        for cell in group:
            rec = {**plan.cell_record(cell), "n_full": n_full, "max_total_tokens": budget,
                   "rounds": []}
            cells[cell.key()] = rec
            report["cells"].append(rec)
        for r in range(args.rounds):
            order = plan.round_order(SERVERS, r)
            rounds = {}
            for cell in group:
                rounds[cell.key()] = {"round": r, "order": order, "servers": {}}
                cells[cell.key()]["rounds"].append(rounds[cell.key()])
            for name in order:
                slug = f"{first.budget}-in{first.input_len}-r{r}-{name}"
                if args.restart_per_cell:
                    slug += f"-{first.dataset}-c{first.concurrency}"
                progress(f"start {name} (--max-total-tokens {budget}), "
                         f"round {r + 1}/{args.rounds}", t0)
                try:
                    server = SGLangServer(server_args(name, model, budget, extra),
                                          log_path=work / f"{slug}.server.log").start()  # fmt: skip
                except Exception as e:  # noqa: BLE001 - recorded; the grid goes on
                    for cell in group:
                        rounds[cell.key()]["servers"][name] = {"error": f"server start: {e}"}
                    progress(f"{name} failed to start: {str(e)[:300]}", t0)
                    continue
                try:
                    for i, cell in enumerate(group):
                        progress(f"cell {index + i + 1}/{total} {cell.key()} "
                                 f"round {r + 1} {name}", t0)
                        stem = f"{slug}-{cell.dataset}-c{cell.concurrency}"
                        run = run_harness(cell, server.url, model, args, work, stem, custom)
                        rounds[cell.key()]["servers"][name] = run
                        if "error" in run:
                            progress(f"  error: {run['error'][:300]}", t0)
                        else:
                            m = run["metrics"]
                            progress(f"  {m['output_throughput']:.1f} output tok/s, TTFT median "
                                     f"{m['median_ttft_ms']:.0f} ms, {run['elapsed_s']:.0f} s", t0)
                finally:
                    server.stop()
            for cell in group:
                finish_round(rounds[cell.key()])
                cells[cell.key()]["summary"] = plan.summarize_cell(cells[cell.key()]["rounds"])
            write(report, args.out)
        index += len(group)


def finish_round(rnd: dict[str, Any]) -> None:
    """Texts compared with plain's, then dropped (each run's ``--output-file`` under
    ``--work`` keeps them); the round's ratios."""
    runs = rnd["servers"]
    ref = runs.get(plan.PLAIN, {}).get("texts")
    rnd["identical"] = {}
    for name, run in runs.items():
        texts = run.pop("texts", None)
        if name != plan.PLAIN and ref is not None and texts is not None:
            rnd["identical"][name] = plan.identical(ref, texts)
    by_server = {n: r["metrics"] for n, r in runs.items() if "metrics" in r}
    rnd["ratio"] = {m: plan.ratio(m, by_server) for m in plan.RATIO_METRICS}


def write(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))


def _f(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def markdown(report: dict[str, Any]) -> str:
    """Every cell: output tok/s and TTFT / TPOT medians per server, ratios, identical texts."""
    g = report["grid"]
    head = (f"`{report['command']}` on {report['date']} "
            f"({report['machine'].get('gpus') or 'no GPU'}); {g['num_prompts']} prompts x "
            f"{g['output_len']} tokens per cell, greedy, median of {g['rounds']} rounds. Ratio: "
            "VeriCache over the better of plain and offload-only (output tok/s; above 1: "
            "VeriCache better), per round.")  # fmt: skip
    columns = ("| cell | budget tokens | output tok/s plain / offload-only / VeriCache "
               "| TTFT median ms | TPOT median ms | ratio by round | identical to plain |")
    lines = [head, "", columns, "|---" * 7 + "|"]
    for c in report["cells"]:
        s = c.get("summary")
        if not s:
            continue
        per = [s["servers"].get(n, {}) for n in SERVERS]

        def trio(metric: str, fmt: str, per: list[dict[str, Any]] = per) -> str:
            return " / ".join(_f(p.get(metric), fmt) for p in per)

        by_round = ", ".join(_f(x, ".2f") for x in s["ratio_by_round"]["output_throughput"])
        same = s["identical"].get(plan.VERICACHE, {})
        lines.append(f"| {c['key']} | {c['max_total_tokens']} | "
                     f"{trio('output_throughput', '.1f')} | "
                     f"{trio('median_ttft_ms', '.0f')} | {trio('median_tpot_ms', '.1f')} | "
                     f"{by_round} (median **{_f(s['ratio']['output_throughput'], '.2f')}x**) | "
                     f"{same.get('same', '-')}/{same.get('total', '-')} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from sglang_vericache.models import ensure_default_model

    model = ensure_default_model()
    work = args.work or Path(tempfile.mkdtemp(prefix="serving-grid-"))
    work.mkdir(parents=True, exist_ok=True)
    n_fulls = {b: plan.budget_n_full(b, args.concurrency, args.tight_n_full, args.ample_n_full)
               for b in args.budgets}  # fmt: skip
    report: dict[str, Any] = {
        "benchmark": "serving_grid", "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "benchmark/serving_grid.py", *(argv or sys.argv[1:])]),
        "harness": "python -m sglang.benchmark.serving (sglang's own client; its --output-file "
                   "fields; texts from --output-details)",
        "grid": {k: getattr(args, k) for k in ("input_lens", "concurrency", "datasets", "budgets",
                                               "rounds", "num_prompts", "output_len", "seed",
                                               "prompt_seed", "gsp_turns", "gsp_question_len",
                                               "restart_per_cell", "server_args")},
        "budgets": {b: {"n_full": n, "rule": f"{n} x (input + output) + {plan.SLOT_SLACK}",
                        "max_total_tokens": {str(L): plan.budget_tokens(n, L, args.output_len)
                                             for L in args.input_lens}}
                    for b, n in n_fulls.items()},
        "servers": {n: plan.SERVER_FLAGS[n] for n in SERVERS},
        "model": str(model.name), "machine": machine_info(), "work": str(work), "cells": [],
    }  # fmt: skip
    run_grid(args, report, model, work)
    report["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
    write(report, args.out)
    print(markdown(report))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}; logs under {work}")


if __name__ == "__main__":
    main()
