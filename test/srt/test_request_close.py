"""Every way a request ends closes it through the request table, over SGLang's real pool and the
``vericache`` prefix tree with a tier link: afterwards no component holds anything for it and
``RequestTable.check_integrity`` passes (the server-level version, through ``/metrics``, is
``test/e2e/test_request_ends.py``). One scheduler, one context, one offloader.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang_vericache.requests.record import RequestEnd
from sglang_vericache.srt.decode.request_book import RequestBook
from test_offload import LAYERS, _fill_row, _with_host_tier_tree

pytestmark = pytest.mark.sglang  # SGLang's pool and tree classes; no server


def _tree_with_link():
    from sglang_vericache.srt.context import context_of

    _, rows, alloc, tree = _with_host_tier_tree(fetch_drafting=True)
    context = context_of(rows)
    book = RequestBook(context.requests, offload_only=False, fixed=None, max_drafts=4)
    return rows, alloc, tree, context, book


def _req(tree, rid: str, row: int, n: int):
    from sglang.srt.managers.schedule_batch import ReqKvInfo

    tokens = list(range(1000 * (row + 1), 1000 * (row + 1) + n))
    return SimpleNamespace(rid=rid, full_untruncated_fill_ids=tokens, origin_input_ids=tokens,
                           extra_key=None, cache_salt=None, priority=None, output_ids=[],
                           kv=ReqKvInfo(req_pool_idx=row, cache_protected_len=0,
                                        kv_allocated_len=n),
                           lock=tree.lock(tree.root_node), last_node=tree.root_node,
                           finished=lambda: True,
                           sampling_params=SimpleNamespace(max_new_tokens=16))  # fmt: skip


def _release(tree, req, n: int, checkpointed: bool) -> None:
    """SGLang's release_kv_cache, in its order."""
    if checkpointed:
        tree.checkpoint(req, up_to=n)
    tree.free_kv_row(req.kv, [(req.kv.cache_protected_len, n)])
    tree.unlock(req.lock)
    tree.on_release(req, checkpointed=checkpointed)


def test_one_context_one_offloader_for_the_tree_and_the_worker() -> None:
    from sglang_vericache.srt.context import context_of
    from sglang_vericache.srt.kv.offloader import shared_offloader

    rows, alloc, tree, context, _ = _tree_with_link()
    assert context.offloader is tree.offloader and context.ledger is tree.offloader.ledger
    assert shared_offloader(alloc.get_kvcache(), rows, alloc, LAYERS) is tree.offloader
    assert context.link is tree.remote and context.ahead is tree.ahead is not None
    with pytest.raises(RuntimeError, match="no VeriCache context"):
        context_of(SimpleNamespace())
    tree.remote.close()


def test_every_end_of_a_request_leaves_nothing_behind() -> None:
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

    rows, alloc, tree, context, book = _tree_with_link()
    table, offloader = context.requests, tree.offloader

    # aborted while queued: its tier lookup was in flight, it never held a row
    table.open("queued")
    tree.remote.probe("queued", list(range(64)), 0)
    tree.ahead._declined["queued"] = True
    assert "queued" in tree.remote.pending and table.get("queued").lookup is not None
    tree.release_aborted_request(CacheRequestHandle(rid="queued", attempt_id=0))
    assert table.ended("queued") is RequestEnd.ABORTED_QUEUED

    # finished after decoding from its host copy (its row offloaded, a draft row held)
    done = _req(tree, "done", 1, 40)
    _fill_row(rows, alloc, 1, 40)
    table.bind_row("done", 1)
    table.note_decoding(["done"])
    book.note_plain(SimpleNamespace(rid="done", sampling_params=None), "a reason")
    book.ahead_used["done"] = [2, 1]
    book.draft_length.observe("done", 4, 3)
    offloader.offload(1, 0, committed=40, compressed_bytes=offloader.slot_bytes * 3, req=done)
    assert offloader.ledger.held_rows() == {1}
    table.check_integrity()
    _release(tree, done, 40, checkpointed=True)

    # finished at prefill (max_new_tokens 1): its after-prefill work never ran
    first = _req(tree, "first", 2, 12)
    _fill_row(rows, alloc, 2, 12)
    table.bind_row("first", 2)
    book.after_prefill["first"] = lambda: None
    _release(tree, first, 12, checkpointed=True)

    # retracted: released without a checkpoint, then scheduled again under its id
    back = _req(tree, "back", 3, 20)
    _fill_row(rows, alloc, 3, 20)
    table.bind_row("back", 3)
    table.note_decoding(["back"])
    book.note_plain(SimpleNamespace(rid="back", sampling_params=None), "a reason")
    offloader.offload(3, 0, committed=20)
    _release(tree, back, 20, checkpointed=False)
    assert table.ended("back") is RequestEnd.RELEASED and 3 not in offloader.ledger.held_rows()
    table.bind_row("back", 4)
    table.note_decoding(["back"])
    book.note_plain(SimpleNamespace(rid="back", sampling_params=None), "a reason")
    table.check_integrity()

    # gone from the decode batch without a release seen (the safety net)
    assert table.keep_only(set()) == ["back"]
    assert table.ended("back") is RequestEnd.LEFT_BATCH

    table.check_integrity()
    assert set(table.entry_counts().values()) == {0}, table.entry_counts()
    tree.remote.close()
