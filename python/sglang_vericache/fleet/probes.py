"""One readiness probe per ``plan.ReadyCheck``: a single quick attempt that says whether the
piece answers now (never raises for "not yet"; the supervisor polls).

- TIER_PING: an authenticated ping to the zmq KV server, with the secret the replicas use;
- TCP_CONNECT: LMCache's server accepts a connection on its request port;
- HTTP_HEALTH: an SGLang server's ``GET /health`` is 200;
- GATEWAY_MODELS: smg's ``GET /v1/models`` lists the served model (smg learns a worker's model
  when it registers it, so this also says the replicas joined; without a known name, any model).
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

from sglang_vericache.fleet.plan import FleetPlan, Piece, ReadyCheck

PROBE_TIMEOUT_S = 5.0


def is_ready(piece: Piece, plan: FleetPlan) -> bool:
    if piece.check is ReadyCheck.TIER_PING:
        return _tier_answers(piece.target, plan.tier_secret_file)
    if piece.check is ReadyCheck.TCP_CONNECT:
        return _accepts(piece.target)
    if piece.check is ReadyCheck.HTTP_HEALTH:
        return _http_get(piece.target + "/health") is not None
    if piece.check is ReadyCheck.GATEWAY_MODELS:
        body = _http_get(piece.target + "/v1/models")
        return body is not None and lists_model(body, plan.model_name)
    raise AssertionError(f"unknown readiness check {piece.check}")


def lists_model(body: bytes, model_name: str | None) -> bool:
    """Whether an OpenAI ``/v1/models`` body lists ``model_name`` (any model when None)."""
    try:
        ids = [m.get("id") for m in json.loads(body).get("data", [])]
    except (ValueError, AttributeError):
        return False
    return bool(ids) if model_name is None else model_name in ids


def _http_get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as resp:
            return resp.read() if resp.status == 200 else None
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


def _accepts(endpoint: str) -> bool:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def _tier_answers(endpoint: str, secret_file: str | None) -> bool:
    from sglang_vericache.tier.admin import server_request
    from sglang_vericache.tier.protocol import Op
    from sglang_vericache.tier.secret import resolve_secret

    try:
        secret = resolve_secret(secret_file, create=False)
        reply = server_request(endpoint, Op.PING, secret=secret, timeout_s=PROBE_TIMEOUT_S)
    except (OSError, ValueError, TimeoutError):
        return False
    return bool(reply.get("ok"))
