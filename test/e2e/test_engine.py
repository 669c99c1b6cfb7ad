"""VeriCache through the offline ``sglang.Engine`` (in-process API), against plain SGLang."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sglang_vericache.exactness.server import http_json

pytestmark = [pytest.mark.sglang, pytest.mark.model, pytest.mark.timeout(900)]

PROMPT = ("Write a Python function that parses an ISO-8601 date string and returns the day of the "
          "week. Explain each step of the function in a short comment. " * 6)  # fmt: skip


def test_bad_engine_argument_is_named_before_anything_loads() -> None:
    from sglang_vericache.config import VeriCacheConfigError
    from sglang_vericache.srt.engine import vericache_server_args

    with pytest.raises(VeriCacheConfigError, match="vericache_compressor.*snapkv"):
        vericache_server_args(vericache_compressor="nonsense")
    with pytest.raises(VeriCacheConfigError, match="attention_backend"):
        vericache_server_args(attention_backend="torch_native")


ENGINE_SCRIPT = """
import json, sys
import sglang as sgl
from sglang_vericache.srt.engine import vericache_server_args

model, prompt = sys.argv[1], sys.argv[2]
args = vericache_server_args(model_path=model, max_total_tokens=16384,
                             vericache_compressor="snapkv:ratio=0.25", vericache_draft_len=4)
engine = sgl.Engine(server_args=args)
try:
    out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 24})
finally:
    engine.shutdown()
print("RESULT " + json.dumps({"output_ids": out["output_ids"], "vericache": out["meta_info"]["vericache"]}))
"""


def test_engine_output_matches_plain_server(plain_server, default_model_path) -> None:
    # Its own process: Engine.shutdown() kills every child of the calling process, which in
    # pytest would include the session's plain server.
    sampling = {"temperature": 0, "max_new_tokens": 24}
    reference = http_json(plain_server.url + "/generate", {"text": PROMPT,
                                                           "sampling_params": sampling})
    proc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(default_model_path), PROMPT],
                          capture_output=True, text=True, timeout=800)  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["output_ids"] == reference["output_ids"]
    stats = out["vericache"]
    assert stats["mode"] == "greedy" and stats["verify_steps"] >= 1, stats
    # --vericache-placement auto on CPU: the full KV moved to its host buffer after prefill
    assert stats["host_kv_tokens"] > 0, stats
