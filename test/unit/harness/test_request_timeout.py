"""The harness gives a request ``--request-timeout`` seconds, and a request that takes longer
ends the run without a verdict (exit 2), never with a comparison of partial or stale results."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from sglang_vericache.exactness.__main__ import parse_args
from sglang_vericache.exactness.client import Prompt, generate_all


def _silent_server() -> tuple[socket.socket, str]:
    """A real listening socket on 127.0.0.1 that accepts and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    held = []
    threading.Thread(target=lambda: held.append(sock.accept()), daemon=True).start()
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_a_request_past_its_timeout_raises_oserror() -> None:
    sock, url = _silent_server()
    try:
        started = time.perf_counter()
        with pytest.raises(OSError):
            generate_all(url, [Prompt(id="p", text="hello")], max_new_tokens=4, timeout=0.5)
        assert time.perf_counter() - started < 10
    finally:
        sock.close()


def test_request_timeout_is_an_option_and_must_be_positive() -> None:
    opts, server_args = parse_args(["--prompts", "p.jsonl", "--max-new-tokens", "4",
                                    "--request-timeout", "90", "--", "--max-total-tokens", "8"])
    assert opts.request_timeout == 90.0 and server_args == ["--max-total-tokens", "8"]
    with pytest.raises(SystemExit):
        parse_args(["--prompts", "p.jsonl", "--max-new-tokens", "4", "--request-timeout", "0"])
