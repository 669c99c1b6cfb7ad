"""Where a VeriCache decode step's time goes, beside the cost model, where attention dominates.

Side by side in one run, at each ``--concurrency`` B: plain SGLang, the offload-only baseline
(``--vericache-draft-len 0``) and VeriCache (``--vericache-compressor``, planner ``auto``) each
get the same B long prompts at once (ample budget: every request fits with its full KV) and
stream them. Decode throughput is measured while all B decode (from the last first token to
the first finish: prefill excluded), end to end as well. VeriCache's own step profile comes
from its ``/metrics`` (``vericache:step_phase_seconds`` by phase, ``draft_forwards``,
``step_transient_bytes_peak``), scraped at the two ends of that window, and is printed beside
``benchmark/model.py``'s CPU fit for the same batch, context and compression::

    draft forward   f0 + g * B * (V + chain) + k * B        V: compressed view, chain ~ (x+1)/2
    verify          f0 + g * B * (L + W)     + k * B * W    W = x + 1 queries per row
    plain forward   f0 + g * B * L           + k * B

Every output is compared with plain SGLang's, token by token.

    python benchmark/step_profile.py                               # B = 8, 5-7k prompts, 256 new
    python benchmark/step_profile.py --concurrency 8 16 --max-new-tokens 128
    python benchmark/step_profile.py --concurrency 1 --rounds 7   # offload-only / VeriCache x 7

Rounds after the first (``--rounds``) run offload-only and VeriCache with both servers up,
taking turns on the same prompts (``interleaved_rounds``): servers started one after another
differed by up to 30% in the very same code path (the plain decode step); taking turns, both
meet the same load on these shared cores.

Writes OUT.{json,md,png}; default OUT benchmark/results/step_profile.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmark"))
sys.path.insert(0, str(REPO / "scripts"))

from model_params import SMOLLM2, fit_cpu  # noqa: E402
from replay_agentic import stream_chat  # noqa: E402
from step_profile_report import PHASES, shortest_prompt  # noqa: E402

from benchmark.agentic_tool_calls import vericache_counters  # noqa: E402
from benchmark.capacity import OFFLOAD_ONLY, SLOT_SLACK  # noqa: E402
from benchmark.prompts import build_prompt_set  # noqa: E402
from sglang_vericache.exactness.server import SGLangServer  # noqa: E402
from sglang_vericache.models import ensure_default_model  # noqa: E402



class Window:
    """The span while every request decodes: opens at the last first token, closes at the first
    finish; ``on_open`` / ``on_close`` run once each (the VeriCache run scrapes its metrics)."""

    def __init__(self, n: int, on_open=None, on_close=None) -> None:
        self.n, self.lock = n, threading.Lock()
        self.first, self.opened, self.closed = 0, None, None
        self.finished_early = False  # one finished before all had started: no such span
        self.snapshots: dict[str, object] = {}
        self._on = {"open": on_open, "close": on_close}

    def _fire(self, which: str) -> None:
        hook = self._on[which]
        if hook is not None:
            self.snapshots[which] = hook()

    def first_token(self, t: float) -> None:
        with self.lock:
            self.first += 1
            if self.first == self.n:
                self.opened = t
                self._fire("open")

    def finished(self, t: float) -> None:
        with self.lock:
            if self.opened is None:
                self.finished_early = True
            elif self.closed is None:
                self.closed = t
                self._fire("close")

    @property
    def valid(self) -> bool:
        return (not self.finished_early and self.opened is not None
                and self.closed is not None and self.closed > self.opened)  # fmt: skip


def ample_workload(tok, model: Path, batch: int, prompt_tokens: int, max_new: int,
                   seed: int) -> tuple[list[dict], list[str]]:  # fmt: skip
    """``batch`` long prompts and the server arguments of a budget that fits all their full KV:
    the step profile's workload (``source_profile.py`` profiles the same one)."""
    prompts = build_prompt_set(tok, n=batch, min_tokens=shortest_prompt(prompt_tokens),
                               max_tokens=prompt_tokens, seed=seed)  # fmt: skip
    budget = batch * (prompt_tokens + max_new + 16) + SLOT_SLACK
    return prompts, ["--model-path", str(model), "--max-total-tokens", str(budget),
                     "--max-running-requests", str(batch)]  # fmt: skip


def one_request(url: str, text: str, max_new: int, window: Window, row: dict) -> None:
    body = {"text": text, "stream": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}}  # fmt: skip
    start, ids, timeline, meta = time.perf_counter(), [], [], {}
    for t, chunk in stream_chat(url + "/generate", body, timeout=3600):
        if chunk.get("output_ids"):  # cumulative (non-incremental streaming)
            if not ids:
                window.first_token(t)
            ids, meta = chunk["output_ids"], chunk.get("meta_info", meta)
            timeline.append((t, len(ids)))
    window.finished(time.perf_counter())
    row.update(start=start, timeline=timeline, output_ids=ids, meta=meta)


def tokens_at(timeline: list[tuple[float, int]], t: float) -> int:
    return max((n for ts, n in timeline if ts <= t), default=0)


def serve(args_list: list[str], prompts: list[dict], max_new: int, log: Path,
          metrics: bool) -> dict:  # fmt: skip
    """Start a server with ``args_list``, run the workload on it once, stop it."""
    with SGLangServer(args_list + (["--enable-metrics"] if metrics else []),
                      log_path=log) as server:  # fmt: skip
        return run_workload(server, prompts, max_new, log, metrics)


def run_workload(server: SGLangServer, prompts: list[dict], max_new: int, log: Path,
                 metrics: bool) -> dict:  # fmt: skip
    """Every prompt at once on a running ``server``; its decode window, rates and outputs."""
    scrape = (lambda: vericache_counters(server.url)) if metrics else None  # noqa: E731
    window = Window(len(prompts), scrape, scrape)
    rows = [{} for _ in prompts]
    start = time.perf_counter()
    threads = [threading.Thread(target=one_request,
                                args=(server.url, p["text"], max_new, window, rows[i]))
               for i, p in enumerate(prompts)]  # fmt: skip
    with tqdm(total=len(threads), desc=log.stem) as bar:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
            bar.update()
    wall = time.perf_counter() - start
    if not window.valid:
        raise RuntimeError(f"{log.stem}: no span with every request decoding (a request finished "
                           f"before the last one started: raise --max-new-tokens; see {log})")
    span = window.closed - window.opened
    in_window = sum(tokens_at(r["timeline"], window.closed)
                    - tokens_at(r["timeline"], window.opened) for r in rows)  # fmt: skip
    mid = (window.opened + window.closed) / 2
    return {
        "outputs": [r["output_ids"] for r in rows],
        "decode_tok_s": in_window / span, "decode_window_s": round(span, 2),
        "e2e_tok_s": sum(len(r["output_ids"]) for r in rows) / wall, "wall_s": round(wall, 2),
        "prompt_tokens": [r["meta"].get("prompt_tokens", 0) for r in rows],
        "generated_mid": sum(tokens_at(r["timeline"], mid) for r in rows) / len(rows),
        "compressed_kv_bytes": [r["meta"].get("vericache", {}).get("compressed_kv_bytes", 0)
                                for r in rows],  # fmt: skip
        "metrics": window.snapshots,
    }


def flush_prefix_cache(url: str, timeout: float = 60.0) -> None:
    """Empty a server's prefix cache (SGLang refuses with 400 while a request is still
    finishing: retried until ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(urllib.request.Request(url + "/flush_cache", b""),
                                        timeout=60):  # fmt: skip
                return
        except urllib.error.HTTPError as exc:
            if exc.code != 400 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def interleaved_rounds(rounds: range, offload_args: list[str], vericache_args: list[str],
                       prompts: list[dict], max_new: int, logs: Path) -> Iterator[tuple]:
    """(round, offload-only run, VeriCache run) for each of ``rounds``, with both servers up at
    once and taking turns (the order alternating, each prefix cache flushed first so every
    prompt is prefilled anew): both meet the same load on the shared cores, where servers run
    one after another differed by up to 30% in the same code (``benchmark/README.md``)."""
    if not rounds:  # --rounds 1: no server to start
        return
    with (SGLangServer(offload_args + ["--enable-metrics"],
                       log_path=logs / "offload-only-rounds.log") as offload_server,
          SGLangServer(vericache_args + ["--enable-metrics"],
                       log_path=logs / "vericache-rounds.log") as vericache_server):  # fmt: skip
        for r in rounds:
            turns = [(OFFLOAD_ONLY, offload_server), ("vericache", vericache_server)]
            runs = {}
            for name, server in turns if r % 2 else turns[::-1]:
                flush_prefix_cache(server.url)
                runs[name] = run_workload(server, prompts, max_new,
                                          logs / f"{name}-round{r}.log", True)  # fmt: skip
            yield r, runs[OFFLOAD_ONLY], runs["vericache"]


def _diff(snap: dict, name: str) -> dict[str, float]:
    before, after = snap["open"].get(name, {}), snap["close"].get(name, {})
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def profile(run: dict, batch: int) -> dict:
    """Measured ms per step by phase, per draft forward, and the model's prediction."""
    snap = run["metrics"]
    steps = sum(_diff(snap, "vericache:profiled_steps").values())
    phase_s = _diff(snap, "vericache:step_phase_seconds")
    phase_steps = _diff(snap, "vericache:step_phase_steps")
    forwards = sum(_diff(snap, "vericache:draft_forwards").values())
    verifies = sum(_diff(snap, "vericache:verify_steps").values())
    drafted = sum(_diff(snap, "vericache:drafted_tokens").values())
    committed = sum(_diff(snap, "vericache:committed_tokens").values())
    decisions = _diff(snap, "vericache:decode_steps")
    by_proposer = {what: _diff(snap, f"vericache:proposer_{metric}")
                   for what, metric in (("verifies", "verify_steps"), ("drafted", "drafted_tokens"),
                                        ("accepted", "accepted_tokens"))}  # fmt: skip
    proposers = {name: {what: int(v.get(name, 0)) for what, v in by_proposer.items()}
                 for name, n in by_proposer["verifies"].items() if n}  # fmt: skip
    peak = max(snap["close"].get("vericache:step_transient_bytes_peak", {"": 0}).values())
    per_step = {p: 1e3 * phase_s.get(p, 0.0) / max(steps, 1) for p in PHASES}
    # ms in the steps where the phase ran (a verify's cost per drafting step, not diluted)
    when_run = {p: round(1e3 * phase_s.get(p, 0.0) / phase_steps[p], 1)
                for p in PHASES if phase_steps.get(p)}  # fmt: skip
    when_run["other"] = round(per_step["other"], 1)
    x = drafted / verifies if verifies else 0.0  # drafts per verified row
    context = sum(run["prompt_tokens"]) / batch + run["generated_mid"]
    per_layer_token = SMOLLM2.n_layers * SMOLLM2.n_kv_heads * (2 * SMOLLM2.head_dim * 4 + 4)
    view = sum(run["compressed_kv_bytes"]) / batch / per_layer_token
    fit = fit_cpu()
    fwd = fit.forward_ms
    width = x + 1
    layer_view = 2 * batch * (view + width) * SMOLLM2.n_kv_heads * SMOLLM2.head_dim * 4
    return {
        "steps": int(steps), "decisions": decisions, "proposers": proposers,
        "drafts_per_verify": round(x, 2),
        "committed_per_verify": round(committed / verifies, 2) if verifies else None,
        "ms_per_step": {p: round(v, 1) for p, v in per_step.items()},
        "ms_when_run": when_run, "phase_steps": {p: int(v) for p, v in phase_steps.items()},
        "draft_ms_per_forward": round(1e3 * phase_s.get("draft", 0.0) / forwards, 1)
        if forwards else None,
        "context": round(context), "view_tokens": round(view),
        "model_ms": {
            "draft_forward": round(fwd(batch * (view + (x + 1) / 2), batch), 1),
            "verify": round(fwd(batch * (context + width), batch * width), 1),
            "plain": round(fwd(batch * context, batch), 1),
            "scheduler": round(fit.s_ms_per_context_token * batch * context, 1),
        },
        "peak_transient_bytes": int(peak), "one_layer_view_bytes": int(layer_view),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8])
    ap.add_argument("--prompt-tokens", type=int, default=7000,
                    help="longest prompt; prompts are 5/7 of it to it (the builder's code "
                         "prompts run out near 5.4k), ~6k on average at the default")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--compressor", default="snapkv:ratio=0.25")
    ap.add_argument("--draft-len", default="auto")
    ap.add_argument("--proposer", default="auto", choices=["auto", "compressed", "lookup"],
                    help="--vericache-proposer of every VeriCache server")
    ap.add_argument("--placements", nargs="+", default=["auto"],
                    help="--vericache-placement of each VeriCache server (the first is profiled "
                         "in full)")
    ap.add_argument("--seed", type=int, default=23, help="prompt set (not the tuning prompts)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds of offload-only against VeriCache (the first is the profiled "
                         "one, its servers one after another); the later ones run with both "
                         "servers up, taking turns, so both meet the same load on shared cores")
    ap.add_argument("--out", type=Path, default=REPO / "benchmark/results/step_profile")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    model = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(model)
    report = {"settings": vars(args) | {"out": str(args.out)}, "runs": []}
    for b in args.concurrency:
        prompts, base = ample_workload(tok, model, b, args.prompt_tokens, args.max_new_tokens,
                                       args.seed)  # fmt: skip
        logs = args.out.parent / f"{args.out.name}-logs" / f"b{b}"
        vc = ["--vericache", "--vericache-compressor", args.compressor,
              "--vericache-draft-len", args.draft_len, "--vericache-proposer", args.proposer]
        offload_only = base + ["--vericache", "--vericache-draft-len", "0"]
        drafted = {placement: base + vc + ["--vericache-placement", placement]
                   for placement in args.placements}  # fmt: skip
        runs = {
            "plain": serve(base, prompts, args.max_new_tokens, logs / "plain.log", False),
            OFFLOAD_ONLY: serve(offload_only, prompts, args.max_new_tokens,
                                logs / "offload-only.log", True),
        }
        for placement in args.placements:
            name = vericache_name(placement, args.placements)
            runs[name] = serve(drafted[placement], prompts, args.max_new_tokens,
                               logs / f"vericache-{placement}.log", True)
        first = args.placements[0]
        profiled = vericache_name(first, args.placements)
        out = summarize(b, runs, profiled)
        out["rounds"] = [round_row(0, runs[OFFLOAD_ONLY], runs[profiled], runs["plain"], b)]
        for r, offload, again in interleaved_rounds(range(1, args.rounds), offload_only,
                                                    drafted[first], prompts,
                                                    args.max_new_tokens, logs):  # fmt: skip
            out["rounds"].append(round_row(r, offload, again, runs["plain"], b))
            write(report | {"runs": [*report["runs"], out]}, args.out)  # progress so far
        report["runs"].append(out)
        write(report, args.out)


def round_row(r: int, offload: dict, vericache: dict, plain: dict, batch: int) -> dict:
    """One round of offload-only against VeriCache: decode rates, their plain steps' ms (the
    same code path in both: where those cross over between rounds, a gap is noise)."""
    def plain_ms(run: dict) -> float | None:
        return profile(run, batch)["ms_when_run"].get("plain")

    return {
        "round": r, "offload_decode_tok_s": round(offload["decode_tok_s"], 2),
        "vericache_decode_tok_s": round(vericache["decode_tok_s"], 2),
        "ratio": round(vericache["decode_tok_s"] / offload["decode_tok_s"], 2),
        "offload_plain_ms": plain_ms(offload), "vericache_plain_ms": plain_ms(vericache),
        "identical": all(a == b == c for a, b, c in zip(plain["outputs"], offload["outputs"],
                                                       vericache["outputs"])),
    }  # fmt: skip


def vericache_name(placement: str, placements: list[str]) -> str:
    return "vericache" if len(placements) == 1 else f"vericache (placement {placement})"


def summarize(batch: int, runs: dict, profiled: str = "vericache") -> dict:
    ref = runs["plain"]["outputs"]
    out = {"concurrency": batch, "systems": {}}
    for name, run in runs.items():
        same = sum(a == b for a, b in zip(ref, run["outputs"]))
        out["systems"][name] = {
            "decode_tok_s": round(run["decode_tok_s"], 2),
            "decode_vs_plain": round(run["decode_tok_s"] / runs["plain"]["decode_tok_s"], 2),
            "decode_vs_offload": round(run["decode_tok_s"] / runs[OFFLOAD_ONLY]["decode_tok_s"], 2),
            "e2e_tok_s": round(run["e2e_tok_s"], 2),
            "e2e_vs_plain": round(run["e2e_tok_s"] / runs["plain"]["e2e_tok_s"], 2),
            "e2e_vs_offload": round(run["e2e_tok_s"] / runs[OFFLOAD_ONLY]["e2e_tok_s"], 2),
            "decode_window_s": run["decode_window_s"], "wall_s": run["wall_s"],
            "identical": f"{same}/{len(ref)}",
        }
    out["profile"] = profile(runs[profiled], batch)
    out["profiled"] = profiled
    out["offload_profile"] = profile(runs[OFFLOAD_ONLY], batch)
    return out


def write(report: dict, out: Path) -> None:
    from step_profile_report import markdown, plot

    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    out.with_suffix(".md").write_text(text)
    plot(report, out.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
