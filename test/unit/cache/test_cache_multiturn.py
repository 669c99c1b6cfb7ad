"""Multi-turn agent sessions driven the way the SGLang glue will drive the tree.

A turn: match the prompt; lock what is used; fetch the full KV the verify needs; "compute"
the rest (new compressed pages from the pool); on finish insert prompt + answer (compressed
locally, full keys written through to the tier); release resident KV and locks. Pools are
real; the idle accounting identity is checked between turns.
"""

from __future__ import annotations

import random

from sglang_vericache.cache import FullState, Residency, check_slot_accounting

PS = 4


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32000) for _ in range(n)]


def _aligned(n: int) -> int:
    return n - n % PS


def run_turn(h, prompt: list[int], answer: list[int], ns=None):  # type: ignore[no-untyped-def]
    """One request, start to finish. Returns the prompt's Match (before the turn)."""
    m = h.tree.match(prompt, namespace=ns)
    lock = h.tree.lock(m.path[-1]) if m.path else None
    task = None
    if m.full_len:  # the verify needs the full KV of the cached prefix
        assert all(n.full_state is FullState.STORED for n in m.full_path)
        task = h.begin_fetch(m.full_path)
    # ... drafting from the compressed prefix would run here, before the fetch lands ...
    if task is not None:
        assert h.finish_fetch(task).ok
    seq = prompt + answer
    r = h.insert(seq[: _aligned(len(seq))], ns=ns)
    if r.to_write:
        t = h.task()
        h.tree.begin_write(t, r.to_write)
        h.tree.finish_write(t, True)
    h.release(list(h.tree.nodes()))  # verify done: transient full KV goes back
    if lock is not None:
        h.tree.unlock(lock)
    h.check()
    return m


def test_turn_k_plus_1_hits_turn_k(harness):
    h = harness(page_size=PS)
    rng = random.Random(0)
    system = _toks(rng, 64)
    history = list(system)
    hits = []
    for turn in range(5):
        prompt = history + _toks(rng, 10)  # new user message / tool result
        answer = _toks(rng, 7)
        m = run_turn(h, prompt, answer)
        hits.append((m.compressed_len, m.full_len))
        history = prompt + answer
    assert hits[0] == (0, 0)
    for k in range(1, 5):  # everything up to the previous turn's aligned end is a hit
        prev_end = _aligned(64 + 17 * k)
        assert hits[k] == (prev_end, prev_end), (k, hits)
    check_slot_accounting(h.tree, h.pool)


def test_sessions_share_the_system_prompt(harness):
    h = harness(page_size=PS)
    rng = random.Random(1)
    system = _toks(rng, 48)
    run_turn(h, system + _toks(rng, 12), _toks(rng, 5), ns="m")
    m = run_turn(h, system + _toks(rng, 12), _toks(rng, 5), ns="m")
    assert m.compressed_len == 48 and m.full_len == 48
    m = run_turn(h, system + _toks(rng, 12), _toks(rng, 5), ns="other-model")
    assert m.hit_len == 0


def test_remote_only_after_local_eviction_then_refill(harness):
    h = harness(page_size=PS, local_slots=64, slots_per_page=PS)
    rng = random.Random(2)
    a = _toks(rng, 40)
    run_turn(h, a, _toks(rng, 8))  # 48 slots
    b = _toks(rng, 40)
    h.evict(48 - h.pool.available_size() + 48)  # make room for session B
    run_turn(h, b, _toks(rng, 8))
    m = h.tree.match(a)
    assert m.compressed_len == 0 and m.full_len == 40  # A is remote-only now
    assert all(n.residency == Residency.REMOTE for n in m.path)
    # A's next turn: compressed miss, full hit -> fetch the full KV "as today", recompute
    # the compressed pages from it; the remote-only nodes adopt them.
    h.evict(64)
    m = run_turn(h, a + _toks(rng, 4), _toks(rng, 4))
    assert (m.compressed_len, m.full_len) == (0, 40)
    m = h.tree.match(a)
    assert m.compressed_len == 40 and m.full_len == 40
    check_slot_accounting(h.tree, h.pool)


def test_draft_while_fetching_then_commit(harness):
    """Turn 2 hits a compressed prefix whose full KV is only in the tier: drafting may start
    at once (compressed pages are locked and readable) while the fetch is in flight."""
    h = harness(page_size=PS)
    rng = random.Random(3)
    prompt1, answer1 = _toks(rng, 32), _toks(rng, 8)
    run_turn(h, prompt1, answer1)
    prompt2 = prompt1 + answer1 + _toks(rng, 6)
    m = h.tree.match(prompt2)
    assert m.compressed_len == m.full_len == 40
    lock = h.tree.lock(m.compressed_node)
    draft_pages = h.tree.compressed_prefix(m)  # what the drafter reads
    task = h.begin_fetch(list(m.path))
    assert not h.tree.path_resident(m.full_node)
    assert h.tree.evict_local(10**6).num_slots == 0  # nothing on the path can go
    # more sessions run meanwhile; the tree keeps working around the in-flight fetch
    run_turn(h, _toks(rng, 20), _toks(rng, 4))
    assert h.tree.compressed_prefix(h.tree.match(prompt2)) == draft_pages
    assert h.finish_fetch(task).ok and h.tree.path_resident(m.full_node)
    # verify accepted 5 tokens: commit prompt2 + accepted, write through, release
    committed = prompt2 + _toks(rng, 6)
    r = h.insert(committed[: _aligned(len(committed))])
    assert r.prefix_len == 40 and len(r.to_write) == 1
    t = h.task()
    h.tree.begin_write(t, r.to_write)
    h.release(list(m.path))
    h.tree.unlock(lock)
    h.tree.finish_write(t, True)
    h.check()
    assert h.tree.match(committed).full_len == _aligned(len(committed))
    assert h.tree.protected_size() == 0 and h.tree.resident_size() == 0


def test_concurrent_fetch_of_a_shared_node(harness):
    """Two sessions with the same system prompt fetch at once: the shared node is covered by
    both fetches; the first to land makes it resident, the second's slots are duplicates."""
    h = harness(page_size=PS)
    rng = random.Random(4)
    system = _toks(rng, 32)
    pa, pb = system + _toks(rng, 8), system + _toks(rng, 8)
    run_turn(h, pa, [])
    run_turn(h, pb, [])
    ma, mb = h.tree.match(pa), h.tree.match(pb)
    shared = ma.path[0]
    assert mb.path[0] is shared and shared.tokens == tuple(system)
    la, lb = h.tree.lock(ma.path[-1]), h.tree.lock(mb.path[-1])
    ta, tb = h.begin_fetch(list(ma.path)), h.begin_fetch(list(mb.path))
    # 2 locks below it + its own 2 fetch holds + the 2 fetch holds of the nodes below
    assert shared.fetching == (ta, tb) and shared.lock_ref == 6
    rb = h.finish_fetch(tb)
    assert rb.duplicates == () and shared.resident is not None
    ra = h.finish_fetch(ta)
    assert len(ra.duplicates) == 32  # the shared node's part of A's buffer
    assert h.tree.path_resident(ma.path[-1]) and h.tree.path_resident(mb.path[-1])
    h.tree.unlock(la)
    h.tree.unlock(lb)
    h.release(list(h.tree.nodes()))
    assert shared.lock_ref == 0 and h.tree.resident_size() == 0


def test_accounting_holds_through_many_sessions_under_pressure(harness):
    h = harness(page_size=PS, local_slots=256, slots_per_page=2)  # 2x compression
    rng = random.Random(5)
    system = _toks(rng, 64)
    sessions = [list(system) for _ in range(6)]
    for _ in range(4):
        for i, hist in enumerate(sessions):
            prompt = hist + _toks(rng, 9)
            answer = _toks(rng, 6)
            need = (len(prompt) + len(answer)) // PS * 2
            if not h.pool.can_alloc(need):
                h.evict(need - h.pool.available_size())
            run_turn(h, prompt, answer)
            sessions[i] = prompt + answer
            check_slot_accounting(h.tree, h.pool)
    # every session's history is still a full hit in the tier, even if evicted locally
    for hist in sessions:
        assert h.tree.match(hist).full_len == _aligned(len(hist))


def test_ongoing_request_checkpoints_are_hits_for_others(harness):
    """Committed tokens of a running request are inserted at each checkpoint (SGLang's
    ``checkpoint(req, up_to)``), so a concurrent request with the same prefix hits them
    before the first request finishes, even while the write-through is still in flight."""
    h = harness(page_size=PS)
    rng = random.Random(6)
    prompt = _toks(rng, 40)
    r1 = h.insert(prompt)  # checkpoint after prefill
    lock = h.tree.lock(r1.last_node)
    w1 = h.task()
    h.tree.begin_write(w1, r1.to_write)
    committed = prompt + _toks(rng, 8)  # two verify rounds later
    r2 = h.insert(committed)
    assert r2.prefix_len == 40 and r2.to_write == (r2.last_node,)
    h.tree.unlock(lock)  # the checkpoint moves the request's lock down
    lock = h.tree.lock(r2.last_node)
    w2 = h.task()
    h.tree.begin_write(w2, r2.to_write)
    # another session forks off the middle of the prompt: splits the node being written
    other = prompt[:24] + _toks(rng, 8)
    m = h.tree.match(other)
    assert (m.compressed_len, m.full_len) == (24, 0)  # drafting yes; full KV not stored yet
    r3 = h.insert(other)
    head = r3.last_node.parent
    assert head.writing == w1 and head.full_state is FullState.WRITING
    h.check()
    h.tree.finish_write(w1, True)
    h.check()
    assert h.tree.match(other).full_len == 24 and h.tree.match(committed).full_len == 40
    h.tree.finish_write(w2, True)
    h.tree.unlock(lock)
    assert h.tree.match(committed).full_len == 48 and h.tree.protected_size() == 0
    h.check()
