"""Long request fuzz: plain SGLang vs --vericache over several seeds (see testkit/fuzz.py).

Starts its own plain and ``--vericache`` servers with the test fixtures' arguments
(``--max-total-tokens 16384 --chunked-prefill-size 512 --return-hidden-states-mode full``;
``--vericache --enable-metrics`` on one) plus a profile's, sends every seed's requests to both
side by side, and writes OUT (JSON: per-seed summaries with every failing request's body, plus
totals) and OUT with ``.md``. A server that dies during a seed is reported and restarted before
the next one. Profiles (``--profiles``, each seed runs on each):

    default     the test fixtures' servers
    no-radix    ``--disable-radix-cache``: ``input_embeds`` prompts are served
    reasoning   ``--reasoning-parser deepseek-r1 --grammar-backend outlines``: every grammar is
                wrapped in SGLang's reasoner grammar, over a backend that cannot roll back

    python benchmark/fuzz.py --seeds 1 2 3 --requests 700 --out benchmark/results/fuzz.json
    python benchmark/fuzz.py --seeds 1 --requests 40 --exclude logprob oov_ids empty_text
    python benchmark/fuzz.py --seeds 4 --requests 300 --profiles no-radix reasoning

Exit status 0 only when every seed is clean.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO))  # testkit/: the fuzzer and server fixtures (not in the wheel)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from sglang_vericache.exactness.server import SGLangServer

from testkit.fuzz import all_kinds
from testkit.fuzz_compare import DEFAULT_TOLERANCE
from testkit.fuzz_report import markdown, merge
from testkit.fuzz_run import Target, fuzz, vocab_from_server

SHARED_ARGS = ["--max-total-tokens", "16384", "--chunked-prefill-size", "512",
               "--return-hidden-states-mode", "full"]  # test/conftest.py
PROFILES = {"default": [], "no-radix": ["--disable-radix-cache"],
            "reasoning": ["--reasoning-parser", "deepseek-r1", "--grammar-backend", "outlines"]}


def servers_of(profile: str) -> dict[str, list[str]]:
    """The plain and the ``--vericache`` server's arguments under ``profile``."""
    base = [*SHARED_ARGS, *PROFILES[profile]]
    return {"plain": base, "vericache": [*base, "--vericache", "--enable-metrics"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--requests", type=int, default=700, help="requests per seed (before filters)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmark/results/fuzz.json")
    ap.add_argument("--kinds", nargs="*", default=[],
                    help=f"keep only these kinds or tags (kinds: {' '.join(all_kinds())})")
    ap.add_argument("--exclude", nargs="*", default=[], help="drop these kinds or tags")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight per server")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    ap.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    ap.add_argument("--progress-every", type=int, default=50)
    ap.add_argument("--profiles", nargs="+", default=["default"], choices=sorted(PROFILES))
    return ap.parse_args(argv)


def start(name: str, args: list[str], logs: Path) -> SGLangServer:
    print(f"starting {name} server ({' '.join(args)})", flush=True)
    return SGLangServer(args, log_path=logs / f"{name}.log").start()


def target(name: str, server: SGLangServer) -> Target:
    return Target(name, server.url, alive=lambda: server.proc is not None and server.proc.poll()
                  is None)  # fmt: skip


def run_seeds(args: argparse.Namespace, profile: str, logs: Path) -> list[dict]:
    servers: dict[str, SGLangServer] = {}
    summaries = []
    try:
        for seed in args.seeds:
            for name, server_args in servers_of(profile).items():  # (re)start what died
                if name not in servers or servers[name].proc.poll() is not None:
                    servers[name] = start(name, server_args, logs / f"{profile}-seed{seed}")
            vocab = vocab_from_server(servers["plain"].url)
            summary = fuzz(target("plain", servers["plain"]),
                           target("vericache", servers["vericache"]), seed=seed,
                           requests=args.requests, vocab=vocab, kinds=args.kinds,
                           exclude=args.exclude, concurrency=args.concurrency,
                           timeout=args.timeout, tolerance=args.tolerance,
                           progress_every=args.progress_every,
                           log=lambda m: print(m, flush=True))  # fmt: skip
            summary["server_logs"] = {n: str(s.log_path) for n, s in servers.items()}
            summary["profile"] = profile
            summaries.append(summary)
            print(f"{profile} seed {seed}: {summary['requests']} requests, {summary['failed_cases']} failing, "
                  f"deaths {summary['server_deaths']}, leaks {len(summary['leaks'])}, "
                  f"{summary['wall_s']} s", flush=True)  # fmt: skip
    finally:
        for server in servers.values():
            server.stop()
    return summaries


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out if args.out.suffix == ".json" else args.out.with_suffix(".json")
    logs = out.parent / f"{out.stem}-logs"
    t0 = time.perf_counter()
    summaries = [s for profile in args.profiles for s in run_seeds(args, profile, logs)]
    total = merge(summaries)
    config = {"seeds": args.seeds, "requests": args.requests, "kinds": args.kinds,
              "exclude": args.exclude, "concurrency": args.concurrency,
              "tolerance": args.tolerance, "profiles": args.profiles,
              "servers": {p: servers_of(p) for p in args.profiles},
              "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": config, "total": total, "seeds": summaries}, indent=1,
                              default=str) + "\n")  # fmt: skip
    header = (f"`python benchmark/fuzz.py --seeds {' '.join(map(str, args.seeds))} --requests "
              f"{args.requests} --profiles {' '.join(args.profiles)}`"
              + (f" --kinds {' '.join(args.kinds)}" if args.kinds else "")
              + (f" --exclude {' '.join(args.exclude)}" if args.exclude else "")
              + f"; {config['wall_s']:.0f} s wall. Full details: `{out.name}`.")  # fmt: skip
    out.with_suffix(".md").write_text(markdown(summaries, total, header))
    print(f"wrote {out} and {out.with_suffix('.md')}: {'PASS' if total['ok'] else 'FAIL'}")
    return 0 if total["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
