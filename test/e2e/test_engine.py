"""VeriCache through the offline ``sglang.Engine`` (in-process API), against plain SGLang."""

from __future__ import annotations

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


def test_engine_output_matches_plain_server(plain_server, default_model_path) -> None:
    import sglang as sgl

    from sglang_vericache.srt.engine import vericache_server_args

    sampling = {"temperature": 0, "max_new_tokens": 24}
    reference = http_json(plain_server.url + "/generate", {"text": PROMPT,
                                                           "sampling_params": sampling})
    args = vericache_server_args(model_path=str(default_model_path), max_total_tokens=16384,
                                 vericache_compressor="snapkv:ratio=0.25", vericache_draft_len=4)
    engine = sgl.Engine(server_args=args)
    try:
        out = engine.generate(PROMPT, sampling)
    finally:
        engine.shutdown()
    assert out["output_ids"] == reference["output_ids"]
    stats = out["meta_info"]["vericache"]
    assert stats["mode"] == "vericache" and stats["verify_steps"] >= 1, stats
    assert stats["host_kv_tokens"] > 0, stats  # the prompt's full KV left the pool
