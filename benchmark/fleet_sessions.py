"""Fleet benchmark: agent sessions through SGLang's gateway (``smg``, ``cache_aware``) in front of
``--replicas`` replicas on one machine, with and without a shared KV tier.

Every configuration serves the same seeded agent sessions (``scripts/agentic_workload.py``: a
shared system prompt + tool schemas, a growing history, ~90% prefix reuse per turn), all sessions
at once, greedy, through one gateway URL (started by ``python -m sglang_vericache.fleet
--worker-urls``: the gateway alone, in front of replicas this script starts):

- (a) ``plain``: plain SGLang replicas (radix LRU per replica; an evicted or moved prefix is
  recomputed);
- (b) ``hicache``: plain replicas with SGLang's own host tier (``--enable-hierarchical-cache``);
  where it does not start on this machine the row says why;
- (c) ``vericache-zmq``: ``--vericache`` replicas sharing one zmq KV server (throttled to
  ``--bandwidth-mbps``, a network's speed rather than loopback's); a prefix evicted here or
  computed on another replica is fetched back, drafting from the compressed copy meanwhile;
- (d) ``vericache-lmcache``: the same sharing LMCache's server (needs ``lmcache`` importable:
  run from the venv ``scripts/lmcache_venv.sh`` builds; otherwise the row says so).

At an ample per-replica budget (``--max-total-tokens`` holding every session's final prefix) and
a tight one (``--holds-tight`` sessions' worth per replica). Then, at ``--kill-budget``, each of
``--kill-configs`` again with the busiest replica (the most turns answered) SIGKILLed once half
the turns have answered: its sessions move to the others (the replay sends a failed turn again,
as an agent would: up to 4 times, 1, 2, 4 and 8 s later). Reported: per-turn TTFT and end-to-end latency (median, p90),
output tok/s, prompt tokens recomputed, tokens the tier served, answers identical to (a)'s at
the first budget, turns the gateway moved to another replica and how many found their prefix,
and after the kill the latency of each session's first turn answered after it
(``fleet_sessions_report.next_answers``). After the agent sessions (not in a killed phase),
SGLang's own client, ``python -m sglang.benchmark.serving``, runs ``--gsp-prompts``
generated-shared-prefix conversations of ``--gsp-turns`` turns through the same gateway: its
output tok/s, TTFT and TPOT, and its texts against (a)'s.

    python benchmark/fleet_sessions.py                 # 8 sessions x 4 turns, 2 replicas
    python benchmark/fleet_sessions.py --configs plain vericache-zmq --budgets tight

Writes benchmark/results/fleet_sessions.{json,md}; replica, gateway and tier logs under the
printed work directory.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmark"))
sys.path.insert(0, str(REPO / "scripts"))

from agent_capacity import budget_tokens  # noqa: E402
from agentic_tool_calls import vericache_counters  # noqa: E402
from fleet_sessions_report import markdown, summarize  # noqa: E402
from remote_prefix import build_sessions, session_args, write_report  # noqa: E402
from replay_agentic import build_parser, replay  # noqa: E402

from sglang_vericache.exactness.server import SGLangServer  # noqa: E402
from benchmark import serving_grid_plan as plan  # noqa: E402
from benchmark.serving_grid import harness_run  # noqa: E402
from sglang_vericache.fleet.plan import LMCACHE_CHUNK_TOKENS  # noqa: E402
from testkit.tier_server import ServerProcess  # noqa: E402

# SGLang's host tier at 1 GB per replica, room for every session's KV. SGLang keeps 10 GiB of
# host memory free even with an explicit size (a replica refuses to start otherwise: on a 24 GiB
# machine, start this benchmark alone); torch copies: its "kernel" I/O backend is CUDA's
HICACHE_FLAGS = ("--enable-hierarchical-cache", "--hicache-size", "1", "--hicache-io-backend",
                 "direct")
MODEL_NAME = "fleet-bench"  # the gateway routes chat requests by the served model name
GSP_QUESTION_TOKENS = 64  # a generated-shared-prefix turn's question (serving_grid's default)


@dataclass(frozen=True)
class FleetConfig:
    label: str
    replica_flags: tuple[str, ...]
    tier: str | None  # None, "zmq" or "lmcache"


def configs(compressor: str) -> dict[str, FleetConfig]:
    vc = ("--vericache", "--vericache-compressor", compressor)
    return {"plain": FleetConfig("(a) plain replicas", (), None),
            "hicache": FleetConfig("(b) plain + HiCache", HICACHE_FLAGS, None),
            "vericache-zmq": FleetConfig("(c) --vericache + zmq KV server", vc, "zmq"),
            "vericache-lmcache": FleetConfig("(d) --vericache + LMCache", vc,
                                             "lmcache")}  # fmt: skip


def say(msg: str) -> None:
    print(f"[fleet_sessions {datetime.now(UTC):%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


class Gateway:
    """``python -m sglang_vericache.fleet --worker-urls ...``: smg in front of running replicas;
    ``url`` once it lists the served model."""

    def __init__(self, worker_urls: list[str], log_dir: Path) -> None:
        cmd = [sys.executable, "-m", "sglang_vericache.fleet", "--worker-urls", *worker_urls,
               "--served-model-name", MODEL_NAME, "--port", "0", "--log-dir", str(log_dir)]
        self.log = open(log_dir / "fleet-gateway.stderr", "wb")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     start_new_session=True)  # fmt: skip
        self.url = (self.proc.stdout.readline() if self.proc.stdout else "").strip()
        if not self.url.startswith("http"):
            self.stop()
            raise RuntimeError(f"the gateway did not start: see {log_dir}/fleet-gateway.stderr")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def start_tier(stack: ExitStack, cfg: FleetConfig, args: argparse.Namespace,
               work: Path) -> tuple[list[str], object | None]:  # fmt: skip
    """(replica flags joining the tier, the tier process)."""
    if cfg.tier == "zmq":
        kv = stack.enter_context(ServerProcess("--bandwidth-mbps", str(args.bandwidth_mbps),
                                               capacity_gb=8.0))  # fmt: skip
        return ["--vericache-tier", kv.spec], kv
    if cfg.tier == "lmcache":
        from testkit.lmcache_server import LMCacheServerProcess

        lm = LMCacheServerProcess(LMCACHE_CHUNK_TOKENS, l1_size_gb=8.0,
                                  log_path=work / "lmcache.log").start()  # fmt: skip
        stack.callback(lm.stop)
        return ["--vericache-tier", f"lmcache://127.0.0.1:{lm.port}"], lm
    return [], None


def run_fleet(cfg: FleetConfig, budget: int, sessions: list[dict], args: argparse.Namespace,
              work: Path, kill: bool) -> dict:  # fmt: skip
    """Start tier, replicas and gateway; replay every session through the gateway; stop."""
    base = ["--model-path", str(args.model), "--max-total-tokens", str(budget),
            "--served-model-name", MODEL_NAME, "--enable-cache-report", "--enable-metrics"]
    with ExitStack() as stack:
        tier_flags, tier = start_tier(stack, cfg, args, work)
        servers = [SGLangServer(base + list(cfg.replica_flags) + tier_flags,
                                log_path=work / f"replica-{i}.log") for i in range(args.replicas)]
        for s in servers:
            stack.callback(s.stop)
        with ThreadPoolExecutor(len(servers)) as pool:  # replicas load in parallel
            list(pool.map(SGLangServer.start, servers))
        gateway = Gateway([s.url for s in servers], work)
        stack.callback(gateway.stop)
        say(f"  fleet up at {gateway.url}; replaying {len(sessions)} sessions")
        result, killed = replay_through(gateway.url, servers, sessions, args, kill)
        if args.gsp_prompts and not kill:
            say(f"  SGLang's client through the gateway: generated-shared-prefix, "
                f"{args.gsp_turns} turns")
            result["gsp"] = serving_through(gateway.url, args, work)
        alive = [s for s in servers if s.url != result.get("killed_url")]
        result["counters"] = [vericache_counters(s.url) for s in alive] if cfg.tier else []
        result["tier"] = tier.stats() if isinstance(tier, ServerProcess) else {}
        if killed is not None:
            result["kill_s"] = killed
    return result


def replay_through(url: str, servers: list[SGLangServer], sessions: list[dict],
                   args: argparse.Namespace, kill: bool) -> tuple[dict, float | None]:  # fmt: skip
    """The replay (in this process, so the kill follows its progress); with ``kill``, the
    replica that answered the most turns so far (the gateway's choice: where the sessions'
    prefixes are) is SIGKILLed, its process group, once half the turns have answered.
    (result, with ``killed_url`` after a kill; the kill's time in the replay's clock, or None)"""
    total = sum(len(s["turns"]) for s in sessions)
    done, lock, killed, victim = 0, threading.Lock(), None, None
    answered: dict[str, int] = {}  # worker URL -> turns it answered
    epoch = time.perf_counter()

    def on_turn(row: dict) -> None:
        nonlocal done, killed, victim
        with lock:
            done += 1
            if row.get("worker"):
                answered[row["worker"]] = answered.get(row["worker"], 0) + 1
            if kill and killed is None and done >= total // 2:
                victim = max(servers, key=lambda s: answered.get(s.url, 0))
                assert victim.proc is not None
                os.killpg(os.getpgid(victim.proc.pid), signal.SIGKILL)
                killed = round(time.perf_counter() - epoch, 3)
                say(f"  {victim.url} killed at {killed:.1f} s ({done}/{total} turns done; "
                    f"turns answered per replica: {answered})")

    options = build_parser().parse_args([
        "--url", url, "--model", MODEL_NAME, "--max-tokens", str(args.max_tokens),
        "--concurrency", str(len(sessions)), "--think-s", str(args.think_s), "--timeout", "3600",
        "--retries", "4", "--retry-wait-s", "1", "--ignore-eos"])  # fmt: skip
    result = replay(options, sessions, on_turn, epoch)
    if victim is not None:
        result["killed_url"] = victim.url
    return result, killed


def serving_through(url: str, args: argparse.Namespace, work: Path) -> dict:
    """``python -m sglang.benchmark.serving --dataset-name generated-shared-prefix`` with
    ``--gsp-turns`` turns (its multi-turn mode, on the chat backend) through the gateway: greedy,
    ``--max-tokens`` per answer, every conversation at once. Its metrics and generated texts,
    or the error with its log's tail."""
    cell = plan.Cell("fleet", args.gsp_input_len, "generated-shared-prefix", args.gsp_prompts)
    shape = plan.gsp_shape(args.gsp_input_len, args.max_tokens, args.gsp_prompts, args.gsp_turns,
                           GSP_QUESTION_TOKENS)  # fmt: skip
    out = work / "gsp.jsonl"
    cmd = plan.harness_command(sys.executable, cell, url, str(args.model),
                               num_prompts=args.gsp_prompts, output_len=args.max_tokens, seed=1,
                               output_file=out, custom_path=None, gsp=shape,
                               served_model_name=MODEL_NAME)  # fmt: skip
    return harness_run(cmd, out, work / "gsp.log", timeout=3600)


def run_one(name: str, cfg: FleetConfig, budget_name: str, budget: int, sessions: list[dict],
            args: argparse.Namespace, work: Path, kill: bool = False) -> dict:  # fmt: skip
    slug = f"{budget_name}-{name}" + ("-kill" if kill else "")
    say(f"{cfg.label}, {budget_name} budget ({budget} tokens per replica)"
        + (", the busiest replica killed midway" if kill else ""))
    if cfg.tier == "lmcache" and importlib.util.find_spec("lmcache") is None:
        return {"skipped": "lmcache is not importable here: bash scripts/lmcache_venv.sh builds "
                           ".venv-lmcache; run this benchmark with its python"}  # fmt: skip
    (work / slug).mkdir(parents=True, exist_ok=True)
    try:
        result = run_fleet(cfg, budget, sessions, args, work / slug, kill)
    except Exception as e:  # noqa: BLE001 - recorded (e.g. HiCache on a CPU); the rest goes on
        say(f"  failed: {str(e)[:400]}")
        return {"skipped": f"did not run here: {str(e)[-4000:]}"}  # the log tail says why
    (work / slug / "result.json").write_text(json.dumps(result) + "\n")
    say(f"  {len(result['turns'])} turns, {result['summary']['errors']} errors, wall "
        f"{result['meta']['wall_s']:.0f} s, median E2E "
        f"{result['summary']['all']['e2e_s'].get('median', float('nan')):.2f} s")
    return result


def main() -> None:
    ap = session_args(__doc__, "fleet_sessions")
    ap.set_defaults(sessions=8, turns=4, max_tokens=32, think_s=1.0)
    names = list(configs("x"))
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--configs", nargs="+", default=names, choices=names)
    ap.add_argument("--budgets", nargs="+", default=["ample", "tight"], choices=["ample", "tight"])
    ap.add_argument("--holds-tight", type=int, default=2,
                    help="sessions whose final prefixes fit in one replica's tight budget")
    ap.add_argument("--kill-budget", default="tight", choices=["ample", "tight", "none"])
    ap.add_argument("--kill-configs", nargs="+", default=["plain", "vericache-zmq"], choices=names)
    ap.add_argument("--compressor", default="snapkv:ratio=0.25")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--gsp-prompts", type=int, default=8,
                    help="conversations of SGLang's own client (generated-shared-prefix) through "
                         "each fleet after the agent sessions (0: none)")
    ap.add_argument("--gsp-turns", type=int, default=3)
    ap.add_argument("--gsp-input-len", type=int, default=2048,
                    help="tokens of a conversation's last prompt")
    args = ap.parse_args()
    if args.replicas < 2:
        ap.error("--replicas must be at least 2 (a fleet, and a survivor after the kill)")
    work, sessions_path, base = build_sessions(args, "fleet-sessions-", "--system-tokens",
                                               str(args.system_tokens))  # fmt: skip
    args.model = Path(base[base.index("--model-path") + 1])
    sessions = [json.loads(line) for line in sessions_path.read_text().splitlines() if line]
    say(f"work directory {work}")
    budgets = {"ample": budget_tokens(sessions_path, args.sessions, args.max_tokens,
                                      args.system_tokens),
               "tight": budget_tokens(sessions_path, args.holds_tight, args.max_tokens,
                                      args.system_tokens)}  # fmt: skip
    table = configs(args.compressor)
    runs: dict[str, dict[str, dict]] = {}
    for b in args.budgets:
        runs[b] = {n: run_one(n, table[n], b, budgets[b], sessions, args, work)
                   for n in args.configs}  # fmt: skip
    if args.kill_budget != "none":
        runs[f"{args.kill_budget}, replica killed"] = {
            n: run_one(n, table[n], args.kill_budget, budgets[args.kill_budget], sessions, args,
                       work, kill=True) for n in args.kill_configs}  # fmt: skip
    report = summarize(runs, {n: c.label for n, c in table.items()}, budgets, args)
    report["command"] = "python benchmark/fleet_sessions.py " + " ".join(sys.argv[1:])
    report["date"] = datetime.now(UTC).strftime("%Y-%m-%d")
    write_report(args.out, report, markdown(report))
    print(f"logs and replays: {work}")


if __name__ == "__main__":
    main()
