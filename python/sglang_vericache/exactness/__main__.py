"""Exactness harness: does a candidate server produce the same tokens as plain SGLang?

    python -m sglang_vericache.exactness --prompts FILE.jsonl --max-new-tokens N \
        [--concurrency C] [--temperature T] [--output summary.json] -- SERVER_ARGS...

Starts a reference server (SERVER_ARGS without any ``--vericache*`` flag), sends every prompt,
stops it; then the same for the candidate (SERVER_ARGS as given). Prints a JSON summary to
stdout: per prompt identical or not, the first divergent position and the reference's top-1/
top-2 log-prob margin there, and totals. Exit status: 0 all identical, 1 some divergent,
2 bad usage or a server that would not start.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

from sglang_vericache.config import is_vericache_flag
from sglang_vericache.exactness.client import (
    REQUEST_TIMEOUT_S,
    Prompt,
    generate_all,
    load_prompts,
)
from sglang_vericache.exactness.compare import Generation, compare, summarize
from sglang_vericache.exactness.server import SGLangServer, ServerStartError

logger = logging.getLogger("sglang_vericache.exactness")


def reference_args(server_args: Sequence[str]) -> list[str]:
    """``server_args`` without ``--vericache`` and ``--vericache-*`` flags (and their values)."""
    out: list[str] = []
    skip_value = False
    for arg in server_args:
        if skip_value:
            skip_value = False
            if not arg.startswith("--"):
                continue
        if is_vericache_flag(arg):
            skip_value = arg != "--vericache" and "=" not in arg
            continue
        out.append(arg)
    return out


def run_side(
    name: str,
    args: list[str],
    prompts: Sequence[Prompt],
    opts: argparse.Namespace,
    with_top2: bool,
) -> tuple[list[Generation], float]:
    log_path = Path(opts.log_dir) / f"{name}.log"
    logger.info("starting %s server: %s (log: %s)", name, shlex.join(args), log_path)
    with SGLangServer(args, log_path=log_path, startup_timeout=opts.startup_timeout) as server:
        t0 = time.perf_counter()
        gens = generate_all(
            server.url,
            prompts,
            max_new_tokens=opts.max_new_tokens,
            temperature=opts.temperature,
            concurrency=opts.concurrency,
            with_top2=with_top2,
            timeout=opts.request_timeout,
        )
        elapsed = time.perf_counter() - t0
    logger.info("%s: %d prompts in %.1fs", name, len(prompts), elapsed)
    return gens, elapsed


def reference_key(prompts: Sequence[Prompt], args: list[str], opts: argparse.Namespace) -> str:
    """What a reference run's output depends on: prompts, server args and sampling."""
    blob = json.dumps([[repr(p) for p in prompts], args, opts.max_new_tokens, opts.temperature,
                       opts.concurrency])  # fmt: skip
    return hashlib.sha256(blob.encode()).hexdigest()


def cached_reference(
    path: Path | None, key: str, run: Callable[[], tuple[list[Generation], float]]
) -> tuple[list[Generation], float]:
    """The reference side, reused from ``path`` when it was written for the same ``key``."""
    if path is not None and path.exists():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            logger.info("reference: reusing %s", path)
            gens = [Generation(tuple(g["output_ids"]),
                               None if g["top2"] is None else
                               tuple(tuple((float(a), int(b)) for a, b in step) for step in g["top2"]))
                    for g in saved["generations"]]  # fmt: skip
            return gens, float(saved["seconds"])
        logger.info("reference: %s was written for other prompts or args; running it again", path)
    gens, seconds = run()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "seconds": seconds, "generations": [
            {"output_ids": list(g.output_ids), "top2": g.top2} for g in gens]}) + "\n")  # fmt: skip
    return gens, seconds


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    if "--" not in argv:
        server_args: list[str] = []
    else:
        cut = argv.index("--")
        argv, server_args = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(
        prog="python -m sglang_vericache.exactness",
        description="Compare a candidate SGLang server's greedy output with plain SGLang.",
        epilog="Everything after '--' is passed to both servers (the reference gets it "
        "without --vericache* flags).",
    )
    p.add_argument("--prompts", required=True, type=Path, help="JSONL: {id?, prompt|input_ids}")
    p.add_argument("--max-new-tokens", required=True, type=int)
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight per server")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the contract)")
    p.add_argument("--reference-extra", default="", help="extra args for the reference only")
    p.add_argument("--candidate-extra", default="", help="extra args for the candidate only")
    p.add_argument("--output", type=Path, help="also write the JSON summary here")
    p.add_argument("--reference-cache", type=Path, default=None,
                   help="reuse the reference outputs saved here by an earlier run with the same "
                   "prompts, args and sampling (written when absent or stale)")
    p.add_argument("--log-dir", default=None, help="server logs (default: a temp dir)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT_S,
                   help="seconds one request may take (a loaded machine at high concurrency "
                   "needs more than a quiet one)")
    opts = p.parse_args(argv)
    if opts.max_new_tokens < 1 or opts.concurrency < 1 or opts.request_timeout <= 0:
        p.error("--max-new-tokens and --concurrency must be >= 1, --request-timeout > 0")
    opts.log_dir = opts.log_dir or tempfile.mkdtemp(prefix="vericache-exactness-")
    return opts, server_args


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds the server context managers: no orphaned servers


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[exactness] %(message)s", stream=sys.stderr)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    opts, server_args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        prompts = load_prompts(opts.prompts)
    except (OSError, ValueError) as exc:
        print(f"error: --prompts: {exc}", file=sys.stderr)
        return 2
    ref_args = reference_args(server_args) + shlex.split(opts.reference_extra)
    cand_args = list(server_args) + shlex.split(opts.candidate_extra)
    try:
        ref, ref_s = cached_reference(
            opts.reference_cache, reference_key(prompts, ref_args, opts),
            lambda: run_side("reference", ref_args, prompts, opts, with_top2=True),
        )  # fmt: skip
        cand, cand_s = run_side("candidate", cand_args, prompts, opts, with_top2=False)
    except ServerStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a timeout, or a server that stopped answering: no verdict
        print(f"error: a request failed ({exc!r}); no comparison was made. If the machine was "
              f"busy, raise --request-timeout (now {opts.request_timeout:.0f}s); else see the "
              f"server logs in {opts.log_dir}", file=sys.stderr)  # fmt: skip
        return 2
    results = [compare(p.id, r, c) for p, r, c in zip(prompts, ref, cand)]
    summary = summarize(
        results,
        reference_args=ref_args,
        candidate_args=cand_args,
        max_new_tokens=opts.max_new_tokens,
        concurrency=opts.concurrency,
        temperature=opts.temperature,
        reference_seconds=round(ref_s, 2),
        candidate_seconds=round(cand_s, 2),
    )
    text = json.dumps(summary, indent=2)
    print(text)
    if opts.output:
        opts.output.write_text(text + "\n")
    logger.info(
        "%s: %d/%d prompts identical", summary["status"], summary["identical"], summary["total"]
    )
    return 0 if summary["status"] == "identical" else 1


if __name__ == "__main__":
    sys.exit(main())
