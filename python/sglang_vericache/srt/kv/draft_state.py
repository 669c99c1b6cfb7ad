"""Per-request compressed KV: built from the pool after prefill, grown from each verify.

Everything here works on plain tensors handed in by the worker (pool buffers and slot indices),
so the state logic does not depend on SGLang's batch types.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from sglang_vericache.compress import CompressedLayerCache, Compressor, Full, Observation
from sglang_vericache.verify import VeriCacheStats

logger = logging.getLogger(__name__)

# Newest committed tokens kept in full precision, never folded: the next drafts lean on them
# most (with 0, a fold could thin out the tokens right before the draft; measured in
# benchmark/README.md).
RECENT_WINDOW = 32
# Committed tokens past the window folded at once. A fold re-selects (droppers) over the whole
# kept body, so its cost grows with the body, not with what it folds: at 8 rows of 6k tokens
# (SnapKV 4x), folding every 32 made the commit 8% of a drafted step, three quarters of it in
# folds; every 128 folds a quarter as often and lets drafts attend over at most 160 newest tokens
# in full precision.
FOLD_EVERY = 128

# Committed tokens a state holds back (``defer``) before they are appended anyway: their
# queries wait beside it (~70 KB a token for SmolLM2's 30 layers), and a request whose drafts
# keep coming from elsewhere would otherwise hold them until it ends.
DEFER_MAX = 64

# (layer_id, slots [n] int64) -> (keys, values), each [H_kv, n, D]: reads the device pool.
PoolReader = Callable[[int, Tensor], tuple[Tensor, Tensor]]

# layer_id -> (keys, values), each [H_kv, T, D]: the full KV of a request's committed prefix.
LayerReader = Callable[[int], tuple[Tensor, Tensor]]


@dataclass(slots=True, weakref_slot=True)  # a draft row holds its tenant weakly
class RequestDraftState:
    """The compressed KV of one request, one ``CompressedLayerCache`` per layer.

    ``covered`` is the number of leading positions whose KV the caches hold (compressed or in
    their full-precision recent window). A verify step whose drafts came from the compressed KV
    keeps it equal to the request's committed KV length; other steps leave it behind (nothing
    drafts from it then): plain steps, and verifies of prompt-lookup drafts, which ``defer``
    their tokens with the queries the verify computed. ``catch_up`` brings it level before the
    next draft::

        positions  0 ...... covered | plain | deferred (queries) | plain | ... length
        caches     appended         | appended by catch_up: one append per run, deferred
                                    | runs that meet joined into one
    """

    layers: list[CompressedLayerCache]
    covered: int
    stats: VeriCacheStats = field(default_factory=VeriCacheStats)
    reused: int = 0  # leading positions copied from a stored compressed prefix (``from_prefix``)
    # (first position, per-layer queries [H_q, n, D]) of each run of deferred tokens, in order
    queued: list[tuple[int, list[Tensor]]] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        compressor: Compressor,
        read: LayerReader,
        length: int,
        queries: Sequence[Tensor | None],
        num_layers: int,
    ) -> "RequestDraftState":
        """Compress the full KV of positions 0..length-1 (``read(layer)``) layer by layer.

        queries[layer]: [H_q, W, D] post-RoPE queries of the last W prompt tokens, or None.
        """
        t = length
        caches = []
        for layer in range(num_layers):
            keys, values = read(layer)
            assert keys.shape[1] == t, f"layer {layer}: {keys.shape[1]} tokens, expected {t}"
            q = queries[layer]
            obs = Observation(
                queries=q,
                query_positions=None if q is None else torch.arange(t - q.shape[1], t),
                num_layers=num_layers,
            )
            ckv = compressor.compress(layer, keys, values, obs)
            caches.append(
                CompressedLayerCache(
                    compressor, layer, ckv, num_layers=num_layers, recent=RECENT_WINDOW,
                    fold_every=FOLD_EVERY,
                    observation=obs,
                )
            )
        return cls(layers=caches, covered=t)

    @classmethod
    def from_prefix(cls, prefix: "RequestDraftState", drop_last: int, read: LayerReader,
                    length: int, queries: Sequence[Tensor | None]) -> "RequestDraftState":  # fmt: skip
        """A new request's state from a stored one whose first ``prefix.covered - drop_last``
        positions are this request's prompt too: a copy (the stored state stays as it was),
        then the rest of the prompt appended as plain steps would (``catch_up``), so the cost
        is the prompt's new tokens, not all of it. read(layer): [H_kv, n, D] keys and values
        of positions [covered, length); queries as in ``build`` (the prompt's last W)."""
        layers = [cache.clone(drop_last) for cache in prefix.layers]
        state = cls(layers=layers, covered=prefix.covered - drop_last)
        state.reused = state.covered
        state.catch_up(read, length, queries)
        return state

    @classmethod
    def rebuild(cls, compressor: Compressor, read: LayerReader, length: int,
                num_layers: int) -> "RequestDraftState":  # fmt: skip
        """Compress a running request again from its full KV (no prompt queries any more).

        Used when a request reaches a decode step without a state that matches its committed
        length (e.g. after a retraction): the full KV is always exact, so this is always safe.
        A scorer that needs the prompt's queries cannot run then; the state holds the full KV.
        """
        no_queries = [None] * num_layers
        try:
            return cls.build(compressor, read, length, no_queries, num_layers)
        except ValueError as exc:
            logger.warning("rebuilding without observations (%s): drafting from the full KV", exc)
            return cls.build(Full(), read, length, no_queries, num_layers)

    @classmethod
    def in_step(cls, state: "RequestDraftState | None", req: Any, compressor: Compressor,
                read: LayerReader, length: int, num_layers: int, mode: Any) -> "RequestDraftState":
        """``state`` if it covers at most the ``length`` committed tokens (behind after plain
        steps: ``catch_up`` before drafting), else ``rebuild``'s (normally built at prefill and
        kept by each commit; a request that arrives without one, or ahead of its KV after a
        retraction the worker did not see, is compressed again from its full KV, which is always
        exact). ``mode``: the rebuilt state's stats mode.
        """
        if state is not None and state.covered <= length:
            return state
        if state is not None:
            logger.warning("request %s: compressed KV out of step; rebuilding", req.rid)
        return cls.rebuild(compressor, read, length, num_layers).labelled(req, mode)

    def labelled(self, req: Any, mode: Any) -> "RequestDraftState":
        """This state, its stats labelled with ``req``'s decode mode and whether a grammar
        constrains it (what ``meta_info["vericache"]`` and the metrics report)."""
        self.stats.mode, self.stats.constrained = mode, getattr(req, "grammar", None) is not None
        return self

    def views(self) -> list[tuple[Tensor, Tensor]]:
        """Per layer (keys, values) [H_kv, T_view, D], built on each call (the drafter that runs
        while a prefix is fetched prefills over them; decode steps read ``view_parts`` of one
        layer at a time instead: ``srt/attention/draft_attention.py``)."""
        return [cache.view()[:2] for cache in self.layers]

    def catch_up(self, read: LayerReader, length: int,
                 queries: Sequence[Tensor | None] | None = None) -> int:  # fmt: skip
        """Append positions covered..length-1, read per layer by ``read`` ([H_kv, n, D] keys
        and values of exactly those positions), as steps one by one would have (the caches'
        state does not depend on how appends are chunked): the runs ``defer`` held back with
        their queries, queries[layer] ([H_q, W, D] of the last W positions, kept for later
        folds' scoring; or None) with those, the rest without. Returns n."""
        n = length - self.covered
        if n <= 0:
            self.queued.clear()  # a held-back run past the committed KV is stale
            return 0
        positions = torch.arange(self.covered, length)
        for layer, cache in enumerate(self.layers):
            keys, values = read(layer)
            done = 0
            for lo, q in self._runs(layer, n, None if queries is None else queries[layer]):
                if lo > done:  # positions no verify gave queries for (plain steps)
                    cache.append(keys[:, done:lo], values[:, done:lo], positions[done:lo])
                done = lo + q.shape[1]
                cache.append(keys[:, lo:done], values[:, lo:done], positions[lo:done], q)
            if done < n:
                cache.append(keys[:, done:], values[:, done:], positions[done:])
        self.covered = length
        self.queued.clear()
        return n

    def _runs(self, layer: int, n: int, last: Tensor | None) -> list[tuple[int, Tensor]]:
        """(offset from ``covered``, queries [H_q, m, D]) of each run of the next ``n``
        positions that has queries, in order and apart: the deferred runs, then the last W
        positions' ``last`` [H_q, W, D] (which win where the two overlap), runs that meet
        joined into one (one append each, not one per step). A run that does not lie inside
        the n positions is left out (its positions are appended without)."""
        w = 0 if last is None else min(last.shape[1], n)
        runs: list[tuple[int, list[Tensor]]] = []
        end = 0
        for start, queries in self.queued:
            lo, q = start - self.covered, queries[layer]
            if lo >= end and lo + q.shape[1] <= n - w:
                self._add_run(runs, end, lo, q)
                end = lo + q.shape[1]
        if w:
            self._add_run(runs, end, n - w, last[:, last.shape[1] - w :])
        return [(lo, qs[0] if len(qs) == 1 else torch.cat(qs, dim=1)) for lo, qs in runs]

    @staticmethod
    def _add_run(runs: list[tuple[int, list[Tensor]]], end: int, lo: int, q: Tensor) -> None:
        """Add run ``q`` at ``lo`` to ``runs`` (whose last run ends at ``end``): joined to the
        last run where it starts where that one ends."""
        if runs and lo == end:
            runs[-1][1].append(q)
        else:
            runs.append((lo, [q]))

    def defer(self, start: int, queries: Sequence[Tensor]) -> None:
        """Hold back committed positions [start, start + n) for the next ``catch_up``, with
        their queries (queries[layer]: [H_q, n, D], from the verify that committed them): a
        step whose drafts did not come from the compressed KV leaves it behind as a plain step
        does, and one catch-up of many tokens (one append per layer where no plain step came
        between) costs less than an append per step (~38 ms of a ~600 ms step at 8 x 6k), while
        its folds score by the queries an append would have given them: the caches end the
        same."""
        if queries and queries[0].shape[1]:
            self.queued.append((start, list(queries)))

    @property
    def deferred(self) -> int:
        """Tokens ``defer`` holds back."""
        return sum(queries[0].shape[1] for _, queries in self.queued)

    def append(self, read: PoolReader, slots: Tensor, queries: Sequence[Tensor | None]) -> None:
        """Add newly committed tokens (KV at ``slots`` [n], positions covered..covered+n-1).

        queries[layer]: [H_q, n, D] queries of the same tokens (from the verify pass), or None.
        """
        n = slots.numel()
        if n == 0:
            return
        positions = torch.arange(self.covered, self.covered + n)
        for layer, cache in enumerate(self.layers):
            keys, values = read(layer, slots)
            cache.append(keys, values, positions, queries[layer])
        self.covered += n

    @property
    def view_tokens(self) -> int:
        """Tokens a draft query attends over in the first layer's view (what a draft step's
        attention costs; layers of a pyramid compressor differ, the first is representative)."""
        return self.layers[0].view_len

    @property
    def nbytes(self) -> int:
        """Bytes the compressed caches store (packed ints + scales + kept tokens + windows)."""
        return sum(cache.nbytes for cache in self.layers)

    @property
    def nbytes_in_pool(self) -> int:
        """Of ``nbytes``, those lodged in pool slots (a draft row, ``srt/kv/draft_rows.py``); the
        rest (kept-position indices, columns or bodies not lodged) is beside the pool."""
        return sum(cache.nbytes_in_pool for cache in self.layers)

    def check_integrity(self) -> None:
        for cache in self.layers:
            cache.check_integrity()
            assert cache.num_tokens == self.covered, "a layer covers a different token count"
        end = self.covered
        for start, queries in self.queued:
            assert start >= end and len(queries) == len(self.layers), "deferred runs out of order"
            end = start + queries[0].shape[1]


def prompt_state(compressor: Compressor, offloader: Any, ahead: Any, req: Any, row: int,
                 length: int, queries: Sequence[Tensor | None],
                 num_layers: int) -> RequestDraftState:  # fmt: skip
    """The compressed KV of ``req``'s ``length`` prompt positions in pool ``row``
    (``offloader``: its ``PoolOffloader``). Where a stored compressed prefix (an earlier turn of
    the conversation, kept by ``ahead``, the ``DraftAhead`` or None) covers at least half of
    them, a copy of it plus the new positions (compression costs in proportion to the tokens
    compressed, and a conversation's turn is mostly its earlier turns). Else built from all of
    it."""
    stored = None
    if ahead is not None:
        stored = ahead.store.longest([*req.origin_input_ids, *req.output_ids][:length])
    if stored is not None and 2 * len(stored.tokens) >= length:
        covered = len(stored.tokens)
        return RequestDraftState.from_prefix(stored.state, stored.trim,
                                             offloader.range_reader(row, covered, length),
                                             length, queries)  # fmt: skip
    return RequestDraftState.build(compressor, offloader.layer_reader(row, length), length,
                                   queries, num_layers)  # fmt: skip
