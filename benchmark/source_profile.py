"""Where a VeriCache decode step's time goes in the source: py-spy on a live server, by phase.

``step_profile.py`` times a step's phases (draft forwards, verify, commit, ...) from the
worker's own clock; this script says what runs inside them. One VeriCache server gets B long
prompts at once (ample budget, as ``step_profile.py``); once every request decodes (the last
first token is out), py-spy samples the scheduler process for ``--seconds`` and each sample is
charged to a phase (the worker frame that opens it) and a component (its innermost known
frame)::

    phase       draft forward | verify forward | plain forward | commit | prefill | scheduler
    component   attention (SDPA) | full-KV read | linear layers | LM head | other model ops
                | outside the model

Shares are of all samples in the window, so a row sums to its phase's share of the time.

    python benchmark/source_profile.py                      # B = 8, 5-7k prompts, draft auto
    python benchmark/source_profile.py --draft-len 3 --prompt-tokens 5000 --seconds 45

Writes OUT.{json,md}; the raw samples and the server log go to OUT-logs/ (not committed);
default OUT benchmark/results/source_profile. Needs py-spy (``pip install py-spy``) and the
right to ptrace the server (same user).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmark"))
sys.path.insert(0, str(REPO / "scripts"))

from benchmark.step_profile import Window, ample_workload, one_request  # noqa: E402
from step_profile_report import shortest_prompt  # noqa: E402
from sglang_vericache.exactness.server import SGLangServer  # noqa: E402
from sglang_vericache.models import ensure_default_model  # noqa: E402

# (phase, function names of the worker frames that open it); the first phase with a frame in
# the sample wins (a verify step holds its draft forwards and its commit).
PHASES = [
    ("prefill", ("VeriCacheWorker._as_prefill_work",)),
    ("draft forward", ("DecodeStep._draft",)),
    ("commit", ("DecodeStep._commit", "RequestDraftState.catch_up")),
    ("verify forward", ("DecodeStep._verify_step",)),
    ("plain forward", ("DecodeStep._plain_step",)),
]
# (component, function names); the innermost match wins (a KV read inside attention is a read).
COMPONENTS = [
    ("full-KV read", ("OffloadLedger.read", "OffloadLedger.read_range", "read_pool_kv")),
    ("attention (SDPA)", ("DraftPlan.attend", "grouped_sdpa", "VeriCacheAttnBackend.forward_decode",
                          "TorchNativeAttnBackend.forward_decode", "CpuVerifyDecode.__call__")),
    ("LM head", ("LogitsProcessor._compute_lm_head",)),
    ("linear layers", ("UnquantizedLinearMethod.apply", "ShadowLinearMethod.apply")),
    ("other model ops", ("LlamaForCausalLM.forward",)),
]
OUTSIDE = "outside the model"
# The table's rows, in the order a drafted step runs them (PHASES is in match priority).
ROWS = ["draft forward", "verify forward", "plain forward", "commit", "prefill", "scheduler"]


def classify(frames: list[str]) -> tuple[str, str]:
    """(phase, component) of one sample; frames outermost first, each ``name (file:line)``."""
    names = [f.split(" (")[0] for f in frames]
    phase = next((p for p, opens in PHASES if any(name in opens for name in names)), "scheduler")
    for name in reversed(names):
        for component, members in COMPONENTS:
            if name in members:
                return phase, component
    return phase, OUTSIDE


def tally(raw: str) -> dict[str, dict[str, int]]:
    """Samples per phase and component from py-spy's ``raw`` (collapsed stacks) output."""
    table: dict[str, Counter] = defaultdict(Counter)
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            phase, component = classify(stack.split(";"))
            table[phase][component] += int(count)
    return {phase: dict(counts) for phase, counts in table.items()}


def markdown(report: dict) -> str:
    table, s = report["samples"], report["settings"]
    total = sum(sum(c.values()) for c in table.values()) or 1
    columns = [c for c, _ in COMPONENTS] + [OUTSIDE]
    lines = [
        "# Where the time goes in the source (py-spy on a live VeriCache server)", "",
        f"{s['concurrency']} requests of "
        f"{shortest_prompt(s['prompt_tokens'])}-{s['prompt_tokens']} "
        f"prompt tokens at once, `{s['compressor']}`, draft length `{s['draft_len']}`; "
        f"{s['seconds']} s of samples at {s['rate']} Hz while every request decodes "
        f"({total} samples). Share of all samples; a row sums to its phase's share.", "",
        "| phase | share | " + " | ".join(columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]  # fmt: skip
    for phase in ROWS:
        counts = table.get(phase, {})
        n = sum(counts.values())
        if n:
            cells = [f"{100 * counts.get(c, 0) / total:.1f}%" for c in columns]
            lines.append(f"| {phase} | {100 * n / total:.1f}% | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def scheduler_pid(server: SGLangServer) -> int:
    """The scheduler process of ``server`` (its process group's ``sglang::scheduler``)."""
    out = subprocess.run(["pgrep", "-g", str(server.proc.pid), "-f", "sglang::scheduler"],
                         capture_output=True, text=True, check=False).stdout.split()  # fmt: skip
    if not out:
        raise RuntimeError(f"no sglang::scheduler process under the server; see {server.log_path}")
    return int(out[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=7000,
                    help="longest prompt; the set spans 5/7 of it up to it")  # fmt: skip
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--compressor", default="snapkv:ratio=0.25")
    ap.add_argument("--draft-len", default="auto")
    ap.add_argument("--seconds", type=int, default=60, help="py-spy sampling time")
    ap.add_argument("--rate", type=int, default=40, help="py-spy samples per second")
    ap.add_argument("--seed", type=int, default=23, help="prompt set (not the tuning prompts)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmark/results/source_profile")
    args = ap.parse_args()
    venv_bin = Path(sys.executable).parent  # py-spy installed beside this interpreter
    py_spy = shutil.which("py-spy", path=f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}")
    if py_spy is None:
        raise SystemExit("source_profile.py needs py-spy: pip install py-spy")
    from transformers import AutoTokenizer

    model = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(str(model))
    b = args.concurrency
    prompts, base = ample_workload(tok, model, b, args.prompt_tokens, args.max_new_tokens,
                                   args.seed)  # fmt: skip
    server_args = base + ["--vericache", "--vericache-compressor", args.compressor,
                          "--vericache-draft-len", args.draft_len]  # fmt: skip
    logs = args.out.parent / f"{args.out.name}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    raw_path = logs / "samples.raw"
    with SGLangServer(server_args, log_path=logs / "vericache.log") as server:
        sampler: list[subprocess.Popen] = []

        def sample() -> None:  # every request decodes from here on
            print(f"[source_profile] sampling {args.seconds} s", flush=True)
            sampler.append(subprocess.Popen(
                [py_spy, "record", "-p", str(scheduler_pid(server)), "-d", str(args.seconds),
                 "-r", str(args.rate), "-f", "raw", "-o", str(raw_path), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip

        window = Window(b, on_open=sample)
        rows = [{} for _ in prompts]
        threads = [threading.Thread(target=one_request, args=(server.url, p["text"],
                                                              args.max_new_tokens, window, rows[i]))
                   for i, p in enumerate(prompts)]  # fmt: skip
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if not sampler:
            raise RuntimeError("no span with every request decoding: raise --max-new-tokens")
        if sampler[0].wait() != 0 or not raw_path.exists():
            raise RuntimeError("py-spy failed (needs ptrace rights: run as the server's user)")
    report = {"settings": vars(args) | {"out": str(args.out)},
              "samples": tally(raw_path.read_text())}  # fmt: skip
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
