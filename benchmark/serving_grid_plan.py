"""The pure parts of benchmark/serving_grid.py: the grid, the rounds, the harness's command line,
its output, and the per-cell medians and ratios. No server, no subprocess, no tokenizer.

Contract:
- ``expand_grid`` lists cells (budget, input length, dataset, concurrency) grouped so that one
  server start (a budget's ``--max-total-tokens`` depends on the input length) serves a group;
- ``round_order(servers, r)`` rotates the servers by ``r`` so no server always goes first;
- ``harness_command`` is the ``python -m sglang.benchmark.serving`` argv for one cell (the
  installed sglang 0.5.23's flags; its multi-turn mode only runs on a chat backend, so
  ``generated-shared-prefix`` uses ``sglang-oai-chat``, the others ``sglang``);
- ``parse_harness_line`` keeps the harness's own field names from one ``--output-file`` line;
- ``summarize_cell`` gives each server's median over rounds and the ratio of ``--vericache`` to
  the better baseline (plain, offload-only) per round and their median, oriented so that above 1
  means VeriCache is better (throughput: VeriCache / best; latency: best / VeriCache).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PLAIN, OFFLOAD, VERICACHE = "plain", "offload-only", "vericache"
SERVER_FLAGS = {PLAIN: [], OFFLOAD: ["--vericache", "--vericache-draft-len", "0"],
                VERICACHE: ["--vericache"]}  # fmt: skip
BASELINES = (PLAIN, OFFLOAD)
DATASETS = ("random-ids", "custom", "generated-shared-prefix")
SLOT_SLACK = 64  # as capacity.py / rate_sweep.py: headroom for a decode step's own slots

# The harness's --output-file fields kept per run (its names); True: higher is better.
METRICS = {
    "output_throughput": True, "max_output_tokens_per_s": True, "request_throughput": True,
    "total_throughput": True, "median_ttft_ms": False, "p90_ttft_ms": False,
    "median_tpot_ms": False, "p90_tpot_ms": False, "median_itl_ms": False, "p90_itl_ms": False,
    "median_e2e_latency_ms": False, "p90_e2e_latency_ms": False,
}  # fmt: skip
COUNTS = ("completed", "duration", "total_input_tokens", "total_output_tokens", "accept_length",
          "concurrency", "max_concurrent_requests")  # fmt: skip
RATIO_METRICS = ("output_throughput", "max_output_tokens_per_s", "median_ttft_ms",
                 "median_tpot_ms")  # fmt: skip


@dataclass(frozen=True)
class Cell:
    budget: str  # "ample" or "tight"
    input_len: int
    dataset: str
    concurrency: int

    def key(self) -> str:
        return f"{self.budget}/{self.dataset}/in{self.input_len}/c{self.concurrency}"


@dataclass(frozen=True)
class GspShape:
    """generated-shared-prefix sizes whose last turn's prompt is ``input_len`` tokens:
    system prompt + ``turns`` questions + the ``turns - 1`` earlier answers."""

    groups: int
    per_group: int
    system_len: int
    question_len: int
    turns: int


def budget_tokens(n_full: int, input_len: int, output_len: int) -> int:
    """``--max-total-tokens`` holding ``n_full`` requests' full KV (as capacity.py)."""
    return n_full * (input_len + output_len) + SLOT_SLACK


def budget_n_full(budget: str, concurrency: list[int], tight_n_full: int,
                  ample_n_full: int = 0) -> int:  # fmt: skip
    """Ample: every request of the largest concurrency (or ``ample_n_full``); tight: a few."""
    if budget == "ample":
        return ample_n_full or max(concurrency)
    if budget == "tight":
        return tight_n_full
    raise ValueError(f"unknown budget {budget!r} (ample, tight)")


def expand_grid(budgets: list[str], input_lens: list[int], datasets: list[str],
                concurrency: list[int]) -> list[list[Cell]]:  # fmt: skip
    """Cells grouped by (budget, input length): one server start per group and server."""
    for d in datasets:
        if d not in DATASETS:
            raise ValueError(f"unknown dataset {d!r} (one of {', '.join(DATASETS)})")
    return [[Cell(b, n, d, c) for d in datasets for c in concurrency]
            for b in budgets for n in input_lens]  # fmt: skip


def round_order(servers: list[str], r: int) -> list[str]:
    """Round ``r``'s server order: the list rotated left by ``r``."""
    k = r % len(servers)
    return servers[k:] + servers[:k]


def gsp_shape(input_len: int, output_len: int, num_prompts: int, turns: int,
              question_len: int) -> GspShape:  # fmt: skip
    per_group = min(4, num_prompts)
    system_len = input_len - turns * question_len - (turns - 1) * output_len
    if system_len < 16:
        raise ValueError(f"input length {input_len} leaves no system prompt for {turns} turns of "
                         f"{question_len} + {output_len} tokens")  # fmt: skip
    return GspShape(-(-num_prompts // per_group), per_group, system_len, question_len, turns)


def harness_command(python: str, cell: Cell, url: str, model: str, *, num_prompts: int,
                    output_len: int, seed: int, output_file: Path, custom_path: Path | None,
                    gsp: GspShape | None,
                    served_model_name: str | None = None) -> list[str]:  # fmt: skip
    """``python -m sglang.benchmark.serving`` for one cell: greedy, EOS ignored (the harness's
    default) so every request decodes ``output_len`` tokens, all arrivals at once up to the
    cell's concurrency, cache flushed after the warm-up, generated texts saved.
    ``served_model_name``: the name requests carry where it is not ``model`` (SGLang's gateway
    routes chat requests by it)."""
    backend = "sglang-oai-chat" if cell.dataset == "generated-shared-prefix" else "sglang"
    cmd = [python, "-m", "sglang.benchmark.serving", "--backend", backend, "--base-url", url,
           "--model", model, "--tokenizer", model, "--dataset-name", cell.dataset,
           "--num-prompts", str(num_prompts), "--max-concurrency", str(cell.concurrency),
           "--request-rate", "inf", "--temperature", "0", "--seed", str(seed),
           "--output-file", str(output_file), "--output-details", "--flush-cache",
           "--disable-tqdm", "--warmup-requests", "1"]  # fmt: skip
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if cell.dataset == "random-ids":
        cmd += ["--random-input-len", str(cell.input_len), "--random-output-len", str(output_len),
                "--random-range-ratio", "1.0", "--tokenize-prompt"]  # fmt: skip
    elif cell.dataset == "custom":
        if custom_path is None:
            raise ValueError("the custom dataset needs its JSONL")
        cmd += ["--dataset-path", str(custom_path), "--sharegpt-output-len", str(output_len)]
    else:
        if gsp is None:
            raise ValueError("generated-shared-prefix needs its shape")
        cmd += ["--gsp-num-groups", str(gsp.groups), "--gsp-prompts-per-group",
                str(gsp.per_group), "--gsp-system-prompt-len", str(gsp.system_len),
                "--gsp-question-len", str(gsp.question_len), "--gsp-output-len",
                str(output_len), "--gsp-num-turns", str(gsp.turns), "--gsp-range-ratio", "1.0"]  # fmt: skip
    return cmd


def custom_jsonl_lines(texts: list[str]) -> list[str]:
    """The harness's ``custom`` format: a user turn (the prompt) and an assistant turn (empty:
    ``--sharegpt-output-len`` fixes the output length)."""
    return [json.dumps({"conversations": [{"role": "user", "content": t},
                                          {"role": "assistant", "content": ""}]}) for t in texts]  # fmt: skip


def parse_harness_line(line: str) -> tuple[dict[str, Any], list[str]]:
    """One ``--output-file`` JSONL line -> (metrics under the harness's names, generated texts)."""
    data = json.loads(line)
    metrics = {k: data.get(k) for k in (*METRICS, *COUNTS)}
    errors = [e for e in data.get("errors") or [] if e]
    metrics["errors"] = len(errors)
    return metrics, list(data.get("generated_texts") or [])


def parse_harness_file(path: Path) -> tuple[dict[str, Any], list[str]]:
    """The last line of a run's ``--output-file`` (the harness appends)."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{path}: the harness wrote no result")
    return parse_harness_line(lines[-1])


def identical(reference: list[str], texts: list[str]) -> dict[str, int]:
    """Texts equal to plain's, position by position (the harness keeps request order)."""
    same = sum(1 for a, b in zip(reference, texts) if a == b)
    return {"same": same, "total": max(len(reference), len(texts))}


def ratio(metric: str, by_server: dict[str, dict[str, Any]]) -> float | None:
    """VeriCache against the better baseline for ``metric``; above 1: VeriCache is better."""
    try:
        vc = by_server[VERICACHE][metric]
        base = [by_server[b][metric] for b in BASELINES if b in by_server]
    except KeyError:
        return None
    base = [b for b in base if b]
    if not vc or not base:
        return None
    if METRICS[metric]:
        return vc / max(base)
    return min(base) / vc


def summarize_cell(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """``rounds``: [{"servers": {name: {"metrics": {...}}}, "identical": {name: {...}}}] ->
    medians per server, ratios per round and their median, identical counts summed."""
    per_round = [{n: s["metrics"] for n, s in r["servers"].items() if s.get("metrics")}
                 for r in rounds]  # fmt: skip
    names = sorted({n for r in per_round for n in r})
    medians = {n: {m: _median([r[n].get(m) for r in per_round if n in r]) for m in METRICS}
               for n in names}  # fmt: skip
    by_round = {m: [ratio(m, r) for r in per_round] for m in RATIO_METRICS}
    same: dict[str, dict[str, int]] = {}
    for r in rounds:
        for n, c in r.get("identical", {}).items():
            acc = same.setdefault(n, {"same": 0, "total": 0})
            acc["same"] += c["same"]
            acc["total"] += c["total"]
    return {"servers": medians, "ratio_by_round": by_round,
            "ratio": {m: _median(v) for m, v in by_round.items()}, "identical": same}  # fmt: skip


def _median(values: list[Any]) -> float | None:
    vals = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(vals) if vals else None


def cell_record(cell: Cell) -> dict[str, Any]:
    return {"key": cell.key(), **asdict(cell)}
