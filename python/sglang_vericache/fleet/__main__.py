"""``python -m sglang_vericache.fleet``: the entry point (docs/FLEET.md).

Exit status: 0 after Ctrl-C / SIGTERM stopped the fleet, 1 when a piece failed to start or the
gateway died (everything started is stopped either way), 2 for a bad command line or a missing
tool. stdout carries one line, the gateway's URL, once every piece is ready; progress and
errors go to stderr.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from sglang_vericache.fleet.options import FleetOptions, FleetOptionsError, parse_options
from sglang_vericache.fleet.plan import FleetPlan, build_plan
from sglang_vericache.fleet.ports import PortAllocationError, allocate_ports
from sglang_vericache.fleet.supervisor import FleetStartError, FleetStopped, Supervisor

STATE_FILE = "fleet.json"


class FleetSetupError(RuntimeError):
    """Something needed before any piece starts is missing (a tool, a port, the secret)."""


def _say(message: str) -> None:
    print(f"fleet: {message}", file=sys.stderr, flush=True)


def _require_module(name: str, hint: str) -> None:
    if importlib.util.find_spec(name) is None:
        raise FleetSetupError(f"{name} is not importable by {sys.executable}: {hint}")


def lmcache_executable() -> str:
    """LMCache's console script beside this interpreter (its venv), else on PATH; the replicas
    import lmcache too, so it must be this venv's."""
    hint = ("LMCache cannot share the main venv; build its own with `bash "
            "scripts/lmcache_venv.sh` and run `.venv-lmcache/bin/python -m "
            "sglang_vericache.fleet --tier lmcache`")
    _require_module("lmcache", hint)
    beside = Path(sys.executable).parent / "lmcache"
    found = str(beside) if beside.exists() else shutil.which("lmcache")
    if found is None:
        raise FleetSetupError(f"no `lmcache` command beside {sys.executable} or on PATH: {hint}")
    return found


def _check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise FleetSetupError(f"the gateway's port {host}:{port} is taken ({exc}): pass "
                                  f"--port N, or --port 0 for a free one") from exc


def _model_path(options: FleetOptions) -> str | None:
    if options.remote:
        return None
    if options.model_path is not None:
        return options.model_path
    from sglang_vericache.models import ensure_default_model

    _say("no --model-path: serving the embedded default model (fetched and converted once)")
    return str(ensure_default_model())


def prepare(options: FleetOptions) -> FleetPlan:
    """Check tools and the environment, allocate ports, build the plan. Starts nothing."""
    from sglang_vericache.exactness.server import free_port
    from sglang_vericache.models import DEFAULT_MODEL_NAME

    _require_module("smg", "install SGLang's model gateway: pip install 'smg>=1.13,<2'")
    lmcache = None
    if not options.remote:
        _require_module("sglang", "install this project: pip install -e .")
        if options.tier == "lmcache":
            lmcache = lmcache_executable()
        if options.tier_secret_file and os.environ.get("VERICACHE_TIER_SECRET"):
            raise FleetSetupError("$VERICACHE_TIER_SECRET is set and takes precedence over "
                                  "--tier-secret-file: unset it or drop --tier-secret-file")
    if options.port:
        _check_port_free(options.host, options.port)
    ports = allocate_ports(options, free_port)
    return build_plan(options, ports, python=sys.executable, model_path=_model_path(options),
                      default_model_name=DEFAULT_MODEL_NAME, lmcache=lmcache)


def _log_dir(options: FleetOptions) -> Path:
    if options.log_dir:
        return Path(options.log_dir)
    return Path(tempfile.mkdtemp(prefix=f"vericache-fleet-{time.strftime('%H%M%S')}-"))


def _raise_stopped(signum: int, frame: object) -> None:
    raise FleetStopped(signal.Signals(signum).name)


def run(plan: FleetPlan, log_dir: Path, options: FleetOptions) -> int:
    supervisor = Supervisor(plan, log_dir, startup_timeout_s=options.startup_timeout_s,
                            progress=sys.stderr)
    previous = {s: signal.signal(s, _raise_stopped) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        if options.remote:
            _say("starting only the gateway: the replicas behind it must all use the same "
                 "--vericache-tier endpoint and the same tier secret file (docs/FLEET.md)")
        supervisor.start()
        supervisor.write_state(log_dir / STATE_FILE)
        _say(f"ready: {plan.url}  model name: {plan.model_name or '(the replicas own)'}  "
             f"tier: {plan.tier_spec or '(the replicas own)'}  logs and {STATE_FILE}: "
             f"{log_dir}  (Ctrl-C stops everything)")
        print(plan.url, flush=True)
        return supervisor.watch()
    except FleetStartError as exc:
        _say(str(exc))
        return 1
    except (KeyboardInterrupt, FleetStopped):
        _say("stopping")
        return 0
    finally:
        # a second Ctrl-C / SIGTERM must not cut the stop short and leave groups behind
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        supervisor.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str] | None = None) -> int:
    try:
        options = parse_options(sys.argv[1:] if argv is None else argv)
    except FleetOptionsError as exc:
        print(f"python -m sglang_vericache.fleet: error: {exc}", file=sys.stderr)
        return 2
    try:
        plan = prepare(options)
    except (FleetSetupError, PortAllocationError) as exc:
        _say(str(exc))
        return 2
    if options.dry_run:
        for piece in plan.pieces:
            env = " ".join(f"{k}={v}" for k, v in piece.env.items())
            print(f"# {piece.name} (ready when {piece.check.value} {piece.target})\n"
                  f"{env + ' ' if env else ''}{shlex.join(piece.argv)}")
        print(f"# clients: {plan.url}  model: {plan.model_name}")
        return 0
    return run(plan, _log_dir(options), options)


if __name__ == "__main__":
    sys.exit(main())
