"""Admission reserves what a drafted request really keeps in the pool (srt/admission.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")


def test_future_tokens_follow_the_compressed_fraction() -> None:
    from sglang_vericache.srt.admission import vericache_future_tokens
    from sglang_vericache.srt.offload import TAIL_CHUNK

    # 4x compressor (512 slots held for 2048 offloaded), 180 tokens still expected, width 9
    got = vericache_future_tokens(180.0, reserved=512, offloaded=2048, verify_width=9)
    assert got == TAIL_CHUNK + 9 + 45
    # never more than SGLang's own estimate (short remaining outputs)
    assert vericache_future_tokens(10.0, 512, 2048, 9) == 10.0
    # a compressor that keeps everything reserves like full KV, capped by SGLang's estimate
    assert vericache_future_tokens(180.0, 2048, 2048, 9) == 180.0
