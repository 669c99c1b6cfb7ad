"""The harness's server start on a real SGLang server: a port taken before the server binds it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from sglang_vericache.exactness.server import SGLangServer, free_port, http_json

pytestmark = [pytest.mark.sglang, pytest.mark.model, pytest.mark.timeout(900)]


def test_free_ports_are_below_the_ephemeral_range() -> None:
    """Outgoing connections take their source ports from the ephemeral range; a port a server
    binds later must not be one of them."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(p < low for p in ports)
    assert len(ports) > 1  # random, so concurrent starters rarely pick the same one


def test_a_port_taken_before_the_server_binds_is_chosen_again(
    default_model_path: Path, tmp_path: Path
) -> None:
    """CI once lost a server start to ``[Errno 98] address already in use``: uvicorn then hangs
    in shutdown instead of exiting. The harness sees the bind fail and starts on another port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        args = ["--max-total-tokens", "4096", "--skip-server-warmup"]
        with SGLangServer(args, port=taken, log_path=tmp_path / "server.log") as server:
            assert server.port != taken
            out = http_json(server.url + "/generate", {
                "text": "The capital of France is",
                "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            })  # fmt: skip
            assert out["meta_info"]["completion_tokens"] == 4
