"""Admission reserves what a drafted request really keeps in the pool (srt/kv/admission.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")


def test_future_tokens_follow_the_compressed_fraction() -> None:
    from sglang_vericache.srt.kv.admission import vericache_future_tokens
    from sglang_vericache.srt.kv.offload import TAIL_CHUNK

    # 4x compressor (512 slots held for 2048 offloaded), 180 tokens still expected, width 9
    got = vericache_future_tokens(180.0, reserved=512, offloaded=2048, verify_width=9)
    assert got == TAIL_CHUNK + 9 + 45
    # never more than SGLang's own estimate (short remaining outputs)
    assert vericache_future_tokens(10.0, 512, 2048, 9) == 10.0
    # a compressor that keeps everything reserves like full KV, capped by SGLang's estimate
    assert vericache_future_tokens(180.0, 2048, 2048, 9) == 180.0


def test_queued_asks_follow_the_request_that_lacked_room_in_queue_order() -> None:
    """Behind the request admission could not add, every request waiting for memory asks its
    uncached prompt plus its clipped output; requests waiting for a tier and those ahead of it
    (passed over, not short of memory) are not counted."""
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    from sglang_vericache.srt.kv.admission import queued_asks, request_ask

    def req(rid: str, prompt: int, cached: int, max_new: int):
        return SimpleNamespace(rid=rid, full_untruncated_fill_ids=[0] * prompt, prefix_len=cached,
                               sampling_params=SimpleNamespace(max_new_tokens=max_new),
                               output_ids=[])  # fmt: skip

    queue = [req("ahead", 90, 0, 8), req("lacked", 2000, 0, 64), req("fetching", 700, 0, 8),
             req("b", 1000, 400, 64), req("c", 50, 0, 10**6)]  # fmt: skip
    tree = SimpleNamespace(waiting_for_tier=lambda r: r.rid == "fetching")
    scheduler = SimpleNamespace(waiting_queue=queue, tree_cache=tree)
    lacked = [request_ask(queue[1])]
    assert lacked == [("lacked", 2000, 2064)]
    assert queued_asks(scheduler, lacked) == [
        ("lacked", 2000, 2064), ("b", 1000, 664), ("c", 50, 50 + CLIP_MAX_NEW_TOKENS)]
    scheduler.waiting_queue = queue[2:]  # it was admitted after all: nothing to add
    assert queued_asks(scheduler, lacked) == lacked
