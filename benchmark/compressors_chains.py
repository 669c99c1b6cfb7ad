"""Draft chains of the compressor benchmark (benchmark/compressors.py): the full-KV greedy
reference trajectory of a prompt, and batched drafting of chains over compressed caches verified
against it.

The reference holds the tokens and the exact per-layer q/k/v of the full-KV continuation, so a
verify needs no forward (the accepted length is read off it) and committed tokens can join a
compressed cache with their exact KV. The forward itself is compressors_engine.DraftEngine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang_vericache.compress import CompressedLayerCache

from benchmark.compressors_engine import DraftBuffers, DraftEngine


@dataclass
class Chain:
    """One draft trajectory over one compressed cache.

    lossy: pure lossy decoding (measure a); otherwise drafts of ``x`` verified against the
    reference (measure b). ``p``: reference tokens committed (ref[0] comes from the prefill).
    kl_sum / kl_steps (lossy only): KL(full-KV || compressed) of the next-token distributions,
    summed over the steps decoded until the first divergence (that step included).
    """

    config: int
    x: int
    lossy: bool
    caches: list[CompressedLayerCache]
    p: int = 1
    m: int = 0
    done: bool = False
    matched: int = 0
    accepted: list[int] | None = None
    view_len: list[int] | None = None
    synced: list[int] | None = None
    kl_sum: float = 0.0
    kl_steps: int = 0


def _load(chain: Chain, buf: DraftBuffers, slot: int) -> None:
    for li, cache in enumerate(chain.caches):
        k, v, _ = cache.view()
        buf.write(li, slot, 0, k, v)
        chain.view_len[li] = k.shape[1]
        chain.synced[li] = cache.version


def _commit(chain: Chain, buf: DraftBuffers, slot: int, ref, t: int) -> None:
    """Ends a verify round: drop draft KV, append the exact KV of newly committed tokens."""
    acc = chain.m + 1
    chain.accepted.append(acc)
    lo, hi = chain.p - 1, chain.p - 1 + acc  # tokens whose KV now enters the cache
    chain.p += acc
    chain.m = 0
    pos = torch.arange(t + lo, t + hi)
    for li, cache in enumerate(chain.caches):
        cache.append(
            ref.keys[li][:, lo:hi], ref.values[li][:, lo:hi], pos, ref.queries[li][:, lo:hi]
        )
        if cache.version != chain.synced[li]:
            k, v, _ = cache.view()
            buf.write(li, slot, 0, k, v)
            chain.view_len[li] = k.shape[1]
            chain.synced[li] = cache.version
        else:
            buf.write(
                li, slot, chain.view_len[li], ref.keys[li][:, lo:hi], ref.values[li][:, lo:hi]
            )
            chain.view_len[li] += hi - lo


@dataclass
class Reference:
    tokens: list[int]  # ref[0] from the prefill, then full-KV greedy
    keys: list[torch.Tensor]  # per layer [H_kv, n, D]: KV of ref[0..n-1] (fed at T + i)
    values: list[torch.Tensor]
    queries: list[torch.Tensor]  # per layer [H_q, n, D]
    logprobs: torch.Tensor  # [n - 1, V] float32: full-KV next-token log-probs after ref[i]


def reference(engine: DraftEngine, pre, t: int, length: int) -> Reference:
    geo = engine.geo
    buf = DraftBuffers(geo, 1, t + length + 1)
    for li in range(geo.num_layers):
        buf.write(li, 0, 0, pre.keys[li], pre.values[li])
    toks = [pre.first_token]
    per_layer: list[list] = [[] for _ in range(geo.num_layers)]
    logprobs = []
    for i in range(length - 1):
        nxt, cap, lp = engine.step(
            buf, torch.tensor([toks[-1]]), torch.tensor([t + i]), capture=True, logprobs=True
        )
        for li, (q, k, v) in enumerate(cap):
            per_layer[li].append((q[0], k[0], v[0]))
        toks.append(int(nxt[0]))
        logprobs.append(lp[0])
    stack = lambda li, j: torch.stack([c[j] for c in per_layer[li]], dim=1)
    n = geo.num_layers
    return Reference(
        toks,
        [stack(li, 1) for li in range(n)],
        [stack(li, 2) for li in range(n)],
        [stack(li, 0) for li in range(n)],
        torch.stack(logprobs),
    )


def kl_divergence(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> float:
    """KL(p || q) in nats for log-probs [V] (tokens p gives no mass, e.g. banned, count 0)."""
    p = ref_logprobs.exp()
    terms = torch.where(p > 0, p * (ref_logprobs - logprobs), torch.zeros_like(p))
    return float(terms.sum())


def run_chains(
    engine: DraftEngine,
    chains: list[Chain],
    ref: Reference,
    t: int,
    horizon: int,
    mem_budget: float,
) -> None:
    """Drafts all chains in batches of similar cache size until each is done."""
    geo = engine.geo
    size = lambda c: max(x.compressed.num_kept + x.num_pending for x in c.caches)
    order = sorted(chains, key=size)
    per_token = (
        2 * geo.num_layers * geo.num_kv_heads * geo.head_dim * torch.finfo(geo.dtype).bits // 8
    )
    i = 0
    while i < len(order):
        cap = size(order[i]) + horizon + 80
        batch = max(1, min(16, int(mem_budget // (per_token * cap))))
        group = order[i : i + batch]
        cap = max(size(c) for c in group) + horizon + 80
        i += len(group)
        buf = DraftBuffers(geo, len(group), cap)
        for slot, c in enumerate(group):
            c.view_len, c.synced = [0] * geo.num_layers, [0] * geo.num_layers
            c.accepted = []
            _load(c, buf, slot)
        while not all(c.done for c in group):
            toks = torch.tensor([ref.tokens[c.p - 1 + c.m] for c in group])
            pos = torch.tensor([t + c.p - 1 + c.m for c in group])
            lossy = any(c.lossy and not c.done for c in group)
            nxt, _, lp = engine.step(buf, toks, pos, logprobs=lossy)
            for slot, c in enumerate(group):
                if c.done:
                    continue
                if c.lossy:  # same input and position as reference step p - 1 + m
                    c.kl_sum += kl_divergence(ref.logprobs[c.p - 1 + c.m], lp[slot])
                    c.kl_steps += 1
                hit = int(nxt[slot]) == ref.tokens[c.p + c.m]
                c.m += hit
                if c.lossy:
                    if not hit or c.m >= horizon:
                        c.matched, c.done = c.m, True
                elif not hit or c.m == c.x:
                    _commit(c, buf, slot, ref, t)
                    c.done = c.p - 1 >= horizon
            # finished chains keep stepping harmlessly; keep their buffers from overflowing
            for slot, c in enumerate(group):
                if c.done:
                    buf.lengths[:, slot] = buf.lengths[:, slot].clamp_max(cap - 1)
