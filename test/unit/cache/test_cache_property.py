"""Randomized property test: random inserts, matches, locks, evictions, writes, fetches and
tier losses, with ``check_integrity`` + slot accounting + an independent oracle after every
operation.

The oracle records, for every compressed page and resident device slot the tree took, which
(namespace, token prefix) it was computed for, and checks that every node still carries its
payloads at the right positions (splits must cut them correctly) and that ``match`` is exact
and maximal for compressed pages.
"""

from __future__ import annotations

import random

import pytest

from sglang_vericache.cache import FullState, TieredNode

ALPHABET = 3  # few distinct tokens -> many shared prefixes and splits
NAMESPACES = (None, "lora")


class Oracle:
    def __init__(self) -> None:
        self.page_of: dict[tuple, tuple] = {}  # (ns, token prefix) -> compressed page
        self.key_of_page: dict[tuple, tuple] = {}  # page -> (ns, prefix)
        self.token_of_slot: dict[int, tuple] = {}  # device slot -> (ns, prefix incl. token)

    def took_pages(self, ns, tokens, ps, pages, first_page: int) -> None:  # type: ignore
        for i in range(first_page, len(pages)):
            key = (ns, tuple(tokens[: (i + 1) * ps]))
            self.page_of[key] = pages[i]
            self.key_of_page[pages[i]] = key

    def freed_pages(self, pages) -> None:  # type: ignore
        for p in pages:
            del self.page_of[self.key_of_page.pop(p)]

    def check_tree(self, h) -> None:  # type: ignore
        ps = h.ps
        stack: list[tuple[TieredNode, tuple]] = [
            (c, ()) for c in h.tree.root.children.values()
        ]
        while stack:
            node, prefix = stack.pop()
            path = prefix + node.tokens
            if node.compressed is not None:
                for i, page in enumerate(node.compressed):
                    end = len(prefix) + (i + 1) * ps
                    assert self.key_of_page[page] == (node.namespace, path[:end])
            if node.resident is not None:
                for j, slot in enumerate(node.resident):
                    assert self.token_of_slot[slot] == (node.namespace,
                                                        path[: len(prefix) + j + 1])
            if node.full is not None:
                assert list(node.full.keys) == h.keys(path, node.namespace)[len(prefix) // ps:]
            stack.extend((c, path) for c in node.children.values())

    def check_match(self, h, ns, query) -> None:  # type: ignore
        ps = h.ps
        m = h.tree.match(query, namespace=ns)
        pages = h.tree.compressed_prefix(m)
        assert len(pages) * ps == m.compressed_len
        for i, page in enumerate(pages):
            assert self.page_of[(ns, tuple(query[: (i + 1) * ps]))] == page
        aligned = len(query) - len(query) % ps
        if m.compressed_len < aligned:
            assert (ns, tuple(query[: m.compressed_len + ps])) not in self.page_of
        keys = h.tree.full_prefix_keys(m)
        assert keys == h.keys(query, ns)[: m.full_len // ps]
        for node in m.path[: len(m.path)]:
            assert node.has_kv


def _all_nodes(tree) -> list[TieredNode]:  # type: ignore
    return list(tree.nodes())


def _chain_up(node: TieredNode, ok, rng: random.Random) -> list[TieredNode]:  # type: ignore
    """node plus up to 2 ancestors satisfying ``ok`` (gaps allowed), root to leaf."""
    chain = [node]
    n = node.parent
    while n is not None and not n.is_root and len(chain) < 3:
        if ok(n) and rng.random() < 0.5:
            chain.insert(0, n)
        n = n.parent
    return chain


def run_random(seed: int, page_size: int, steps: int, Harness) -> dict[str, int]:  # type: ignore
    """``Harness``: the glue-like harness class from conftest (the ``harness`` fixture)."""
    rng = random.Random(seed)
    h = Harness(page_size=page_size, local_slots=400, device_slots=400,
                slots_per_page=rng.choice([page_size, 1]))
    oracle = Oracle()
    seqs: list[tuple] = []
    locks: list = []
    writes: list = []
    fetches: list = []
    counts: dict[str, int] = {}

    def rand_tokens() -> list[int]:
        if seqs and rng.random() < 0.7:
            ns, base = rng.choice(seqs)
            cut = rng.randrange(len(base) + 1)
            toks = list(base[:cut]) + [rng.randrange(ALPHABET) for _ in range(rng.randrange(9))]
        else:
            toks = [rng.randrange(ALPHABET) for _ in range(rng.randrange(1, 13))]
        return toks

    for _ in range(steps):
        op = rng.choices(
            ["insert", "match", "lock", "unlock", "evict", "bw", "fw", "bf", "ff",
             "release", "evict_full", "touch", "reset"],
            weights=[10, 6, 3, 3, 3, 3, 3, 3, 3, 2, 2, 1, 0.3],
        )[0]
        ns = rng.choice(NAMESPACES)
        nodes = _all_nodes(h.tree)
        if op == "insert":
            toks = rand_tokens()
            toks = toks[: len(toks) - len(toks) % page_size]
            compressed = rng.random() < 0.8
            full = not compressed or rng.random() < 0.8
            state = FullState.STORED if (not compressed or rng.random() < 0.3) else FullState.NONE
            if compressed:
                cached = h.tree.match(toks, namespace=ns).compressed_len
                need = (len(toks) - cached) // page_size
                if not h.pool.can_alloc(need * h.slots_per_page):
                    h.evict(need * h.slots_per_page - h.pool.available_size())
                    oracle.check_tree(h)
                    if not h.pool.can_alloc(need * h.slots_per_page):
                        continue
            # replay the harness insert to learn which pages the tree took
            m = h.tree.match(toks, namespace=ns)
            prefix = h.tree.compressed_prefix(m)
            comp = None
            fresh = rng.random() < 0.3 and h.pool.can_alloc(len(toks) * h.slots_per_page)
            if compressed and fresh:  # caller computed everything itself: prefix duplicates
                comp = h.new_pages(len(toks) // page_size)
            elif compressed:  # caller reused the tree's pages for the cached prefix
                comp = prefix + h.new_pages(len(toks) // page_size - len(prefix))
            r = h.tree.insert(toks, comp, h.keys(toks, ns) if full else None,
                              full_state=state, namespace=ns)
            if compressed and fresh:
                assert list(r.duplicates) == [p for p in comp[: r.prefix_len // page_size] if p]
                h.pool.free(s for p in r.duplicates for s in p)
            else:
                assert r.duplicates == ()
            if comp is not None:
                oracle.took_pages(ns, toks, page_size, comp, r.prefix_len // page_size)
            if len(toks):
                seqs.append((ns, tuple(toks)))
        elif op == "match":
            toks = rand_tokens()
            oracle.check_match(h, ns, toks)
            if seqs:
                ns2, seq = rng.choice(seqs)
                oracle.check_match(h, ns2, seq)
        elif op == "lock" and nodes:
            locks.append(h.tree.lock(rng.choice(nodes)))
        elif op == "unlock" and locks:
            h.tree.unlock(locks.pop(rng.randrange(len(locks))))
        elif op == "evict":
            # LRU: the candidates evicted are the oldest ones, in (last_access, id) order
            before = sorted(h.tree._local_leaves, key=lambda n: (n.last_access, n.node_id))
            r = h.tree.evict_local(rng.randrange(0, 40))
            gone = [n.compressed is None for n in before]
            assert gone == sorted(gone, reverse=True), "evicted leaves are not the oldest"
            oracle.freed_pages(r.pages)
            h.pool.free(s for p in r.pages for s in p)
        elif op == "bw":
            cands = [n for n in nodes if n.full_state is FullState.NONE and n.full is not None]
            if cands:
                chain = _chain_up(rng.choice(cands),
                                  lambda n: n.full is not None and n.full_state is FullState.NONE,
                                  rng)
                t = h.task()
                h.tree.begin_write(t, chain)
                writes.append(t)
        elif op == "fw" and writes:
            h.tree.finish_write(writes.pop(rng.randrange(len(writes))), rng.random() < 0.8)
        elif op == "bf":
            cands = [n for n in nodes if n.full_state is FullState.STORED]
            if cands:
                chain = _chain_up(rng.choice(cands),
                                  lambda n: n.full_state is FullState.STORED, rng)
                if sum(len(n.tokens) for n in chain) <= h.device.available_size():
                    fetches.append(h.begin_fetch(chain))
        elif op == "ff" and fetches:
            t = fetches.pop(rng.randrange(len(fetches)))
            n_tok = h.tree.fetch_len(t)
            ok = rng.random() < 0.8 and h.device.can_alloc(n_tok)
            slots = h.device.alloc(n_tok) if ok else None
            res = h.tree.finish_fetch(t, slots)
            if slots is not None:  # map each slot to its token prefix (nodes may be split)
                off = 0
                for node in res.nodes:
                    base = _path_tokens(node)[: -len(node.tokens)]
                    for j in range(len(node.tokens)):
                        if node.resident is not None and node.resident[j] == slots[off + j]:
                            oracle.token_of_slot[slots[off + j]] = (
                                node.namespace, base + node.tokens[: j + 1])
                    off += len(node.tokens)
            h.device.free(res.duplicates)
        elif op == "release":
            res_nodes = [n for n in nodes if n.resident is not None]
            if res_nodes:
                h.device.free(h.tree.release_resident(rng.sample(res_nodes,
                                                                  min(3, len(res_nodes)))))
        elif op == "evict_full":
            keys = list(h.tree._by_tier_key)
            if keys:
                h.tree.evict_full(rng.sample(keys, min(len(keys), rng.randrange(1, 4))))
        elif op == "touch" and nodes:
            h.tree.touch(rng.choice(nodes))
        elif op == "reset" and not (locks or writes or fetches):
            rel = h.tree.reset()
            oracle.freed_pages(rel.pages)
            h.pool.free(s for p in rel.pages for s in p)
            h.device.free(rel.resident)
        else:
            continue
        counts[op] = counts.get(op, 0) + 1
        h.check()
        oracle.check_tree(h)

    # drain everything: the tree must return to "all evictable", then to empty
    for lk in locks:
        h.tree.unlock(lk)
    for t in writes:
        h.tree.finish_write(t, True)
    for t in fetches:
        h.tree.finish_fetch(t, None)
    h.check()
    assert h.tree.protected_size() == 0 and h.tree.root.lock_ref == 0
    h.device.free(h.tree.release_resident(list(h.tree.nodes())))
    r = h.tree.evict_local(10**9)
    oracle.freed_pages(r.pages)
    h.pool.free(s for p in r.pages for s in p)
    h.check()
    assert h.tree.evictable_size() == 0 and h.pool.available_size() == h.pool.total
    assert all(n.full_state is FullState.STORED or n.children for n in h.tree.nodes())
    h.tree.reset()
    assert not oracle.page_of
    return counts


def _path_tokens(node: TieredNode) -> tuple:
    parts = []
    n = node
    while n is not None and not n.is_root:
        parts.append(n.tokens)
        n = n.parent
    return tuple(t for part in reversed(parts) for t in part)


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_every_invariant(seed, page_size, harness):
    counts = run_random(seed, page_size, 300, harness)
    assert counts.get("insert", 0) > 20 and counts.get("evict", 0) > 3
    assert sum(counts.values()) > 150
