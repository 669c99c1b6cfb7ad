"""Prefix reuse through a remote full-KV tier (``--vericache-tier zmq://`` or ``lmcache://``).

Finished sequences are written through to the tier in chunks named by chained hashes of their
tokens (``tier/keys.py``: model, geometry and dtype are part of every key), so any server
sharing the tier can reuse them. On admission the ``vericache`` prefix cache asks
``probe`` how much of a request's prompt past its device match the tier holds; a request waits
in SGLang's queue (``init_load_back`` returns None) while its lookup and fetch run in the
background, then ``take`` hands over the verified KV to load into the pool::

    probe #1   no state      -> submit lookup(chunks past the device match); report them all
    probe #k   lookup done   -> fetch the leading stored chunks (one fetch per chunk, shared
                             with every request waiting for it: tier/shared_fetch.py)
                             or report 0 (recompute)
    probe #n   fetch done    -> report exactly the chunks that arrived verified
    take(n)    fetched KV [L, 2, H_kv, n, D] of positions [device match, device match + n)

A hit is all-or-nothing for exactly the length reported: SGLang treats loading fewer tokens
than ``probe`` promised as fatal. When a fetch lands short between a probe that reported the
whole lookup and the ``take`` that follows it (a chunk evicted after the lookup, a corrupt
middle chunk), ``take`` answers "not yet" and the request's next probe reports what arrived.

Every failure (dead server, timeout, corrupt chunk, geometry mismatch, full tier) ends as
"report 0 / fewer chunks": SGLang recomputes the rest, output is unchanged. Nothing blocks on
the network (the tier client has its own I/O thread). Lookups and fetches are bounded
(``LinkBounds``): a hung KV server costs one deadline, and a failed tier is left alone for a
while. ``tier_up``: the latest finished task got through (else the prefix cache keeps a
finished request's full KV on the device).

What is remembered as stored (so write-through skips it) is forgotten when the tier's epoch
changes (a restarted KV server holds nothing) and, key by key, when a lookup or fetch finds a
key missing. A weight update (``geometry_now`` returns another geometry) changes every key:
the link drops its requests' lookups and reopens the tier under the new geometry.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, MutableMapping, Sequence

from torch import Tensor

from sglang_vericache.requests.table import RequestTable
from sglang_vericache.verify.draft_length import ewma
from sglang_vericache.tier import TaskStatus, chunk_keys, open_tier
from sglang_vericache.tier.base import FullKVTier, TaskId
from sglang_vericache.tier.geometry import KVGeometry
from sglang_vericache.tier.keys import ChunkKey
from sglang_vericache.tier.layout import join_chunks, split_chunks
from sglang_vericache.tier.link_bounds import LinkBounds, RemoteCounters, fetch_pays
from sglang_vericache.tier.pending_prefix import PendingPrefix, PrefixPhase, check_pending
from sglang_vericache.tier.shared_fetch import SharedFetches

logger = logging.getLogger(__name__)

STORED_KEYS_REMEMBERED = 65536  # digests known to be in the tier (skips re-sending a prefix)
EXPLORE_EVERY = 16  # one in this many fetches judged slower than recomputing is made anyway


class RemotePrefixLink:
    """Lookup / fetch / write-through of full-KV prefixes for one prefix cache (module doc).

    Used from the scheduler thread only. ``tier`` is any ``FullKVTier``. ``geometry_now``
    gives the geometry keys must use now (it changes with the weight version) and ``reopen``
    builds a tier for a new one; without them the geometry is fixed. Each request's lookup is
    its record's ``lookup`` in ``requests`` (the scheduler's table; a table of its own by
    default), cancelled when the request closes (``forget``).
    """

    def __init__(self, tier: FullKVTier, geometry_now: Callable[[], KVGeometry] | None = None,
                 reopen: Callable[[KVGeometry], FullKVTier] | None = None,
                 bounds: LinkBounds = LinkBounds(),
                 requests: RequestTable | None = None) -> None:  # fmt: skip
        if (geometry_now is None) != (reopen is None):
            raise ValueError("geometry_now and reopen go together")
        self.tier = tier
        self.bounds = bounds
        self._down_until = 0.0  # monotonic time before which the tier is not contacted
        self.geometry: KVGeometry = tier.geometry
        self._geometry_now = geometry_now
        self._reopen = reopen
        self._epoch: bytes | None = None  # the tier epoch that _stored was learned under
        self.chunk = self.geometry.chunk_tokens
        self.bind_requests(RequestTable() if requests is None else requests)
        self._puts: dict[TaskId, tuple[list[ChunkKey], list[Tensor]]] = {}
        self._stored: OrderedDict[bytes, None] = OrderedDict()
        self.counters = RemoteCounters()
        self.fetch_bytes_per_s = 0.0  # moving average over completed fetches (0: none yet)
        self.prefill_tokens_per_s = 0.0  # this server's prefill speed (``observe_prefill``)
        self._judged_slower = 0  # fetches predicted slower than recomputing (see _fetch_pays)
        self.tier_up = True  # the latest finished tier task did not fail (a miss is not a fail)

    @classmethod
    def open(cls, spec: str, geometry: KVGeometry | Callable[[], KVGeometry],
             bounds: LinkBounds = LinkBounds(), requests: RequestTable | None = None,
             **options) -> "RemotePrefixLink":  # fmt: skip
        """The link to tier ``spec``; ``geometry`` may be a callable (see the class doc)."""
        from sglang_vericache.tier.factory import TierOptions

        opts = TierOptions(**options)
        if isinstance(geometry, KVGeometry):
            return cls(open_tier(spec, geometry, opts), bounds=bounds, requests=requests)
        return cls(open_tier(spec, geometry(), opts), geometry,
                   lambda g: open_tier(spec, g, opts), bounds, requests)  # fmt: skip

    # -- reads --------------------------------------------------------------------------------

    def probe(self, rid: str, tokens: Sequence[int], device_len: int) -> int:
        """Tokens past ``device_len`` to report as a host hit for ``tokens`` (the match key).

        > 0 while the lookup or fetch is in flight (the request then waits in the queue), the
        verified length once fetched, 0 on a miss or failure (the request recomputes). A
        device prefix that shrank below the pending chunks (evicted) starts anew (``forget``).
        """
        self.poll()
        state = self.pending.get(rid)
        first = device_len // self.chunk
        if state is not None and state.first_chunk > first:
            self.forget(rid)
            state = None
        if state is None:
            end = len(tokens) // self.chunk * self.chunk
            if end <= device_len:
                return 0
            if time.monotonic() < self._down_until:
                self.counters.probes_skipped_down += 1
                return 0  # known down: recompute without asking it
            keys = chunk_keys(self.geometry, list(tokens[:end]))[first:]
            state = PendingPrefix(first, keys, self.tier.submit_lookup(keys), PrefixPhase.LOOKUP)
            self.pending[rid] = state
            self.counters.lookups += 1
        state.probed = time.monotonic()
        if state.phase is PrefixPhase.MISS:
            return 0
        end_chunks = len(state.keys) if state.phase is not PrefixPhase.READY else state.chunks_ok
        return max((state.first_chunk + end_chunks) * self.chunk - device_len, 0)

    def take(self, rid: str, device_len: int, length: int) -> Tensor | None | bool:
        """The fetched KV of positions [device_len, device_len + length): [L, 2, H_kv, length,
        D] on the host, ``length`` being what the latest ``probe`` reported.

        Returns False while in flight, or when fewer than ``length`` tokens arrived (the next
        probe reports what did; retry then), None on a miss (recompute). Consumes the
        request's state only when it returns the KV or None.
        """
        self.poll()
        state = self.pending.get(rid)
        if state is None or state.phase is PrefixPhase.MISS or length <= 0:
            self.forget(rid)
            return None
        if state.phase is not PrefixPhase.READY:
            return False
        start = device_len - state.first_chunk * self.chunk
        if start < 0 or start + length > state.chunks_ok * self.chunk:
            return False  # promised more than arrived: re-probe, never load short
        kv = join_chunks(self.fetches.buffers(rid)[: state.chunks_ok])
        self.forget(rid)
        self.counters.hits_tokens += length
        return kv[..., start : start + length, :]

    def in_flight(self, rid: str) -> bool:
        """Whether ``rid``'s lookup or fetch is still running (as of the latest ``probe``)."""
        state = self.pending.get(rid)
        return state is not None and state.phase in (PrefixPhase.LOOKUP, PrefixPhase.FETCH)

    participant_name = "remote prefix link"  # in the request table (requests/table.py)

    def bind_requests(self, requests: RequestTable) -> None:
        """Keep lookups in ``requests``' records (the scheduler's table; before any lookup)."""
        self.requests = requests
        requests.join(self)
        self.pending: MutableMapping[str, PendingPrefix] = requests.field("lookup")
        self.fetches = SharedFetches(self.tier, requests.field("fetch_claims"))

    def tracked_rids(self) -> set[str]:  # none: lookups and claims are the records' fields
        return set()

    def forget(self, rid: str) -> None:
        """Drop ``rid``'s state in any phase (its one way out): cancel its lookup, free claims."""
        state = self.pending.pop(rid, None)
        if state is not None and state.task is not None:
            self.tier.cancel(state.task)
        self.fetches.release(rid)

    def check_integrity(self) -> None:
        check_pending(self.pending, self.fetches)

    # -- writes -------------------------------------------------------------------------------

    def write_through(self, tokens: Sequence[int], read: Callable[[int, int], Tensor]) -> int:
        """Store the whole chunks of ``tokens`` the tier does not hold yet (asynchronously);
        returns how many were submitted. read(start, end): full KV of positions [start, end),
        [L, 2, H_kv, n, D] on the host."""
        self.poll()
        n_full = len(tokens) // self.chunk
        if n_full == 0:
            return 0
        keys = chunk_keys(self.geometry, list(tokens[: n_full * self.chunk]))
        # Sequences finishing together share prefixes (an agent fleet's system prompt): a
        # chunk another write-through is storing is not sent again.
        writing = {key.digest for put_keys, _ in self._puts.values() for key in put_keys}
        first_new = next((i for i, k in enumerate(keys)
                          if k.digest not in self._stored and k.digest not in writing), n_full)
        self.counters.chunks_already_writing += sum(k.digest in writing for k in keys[:first_new])
        if first_new == n_full:
            return 0
        nbytes = (n_full - first_new) * self.geometry.chunk_nbytes(self.chunk)
        if self.put_bytes_in_flight() + nbytes > self.bounds.max_put_bytes:
            self.counters.puts_skipped_full += 1
            return 0  # the link is behind: a later turn of this prefix writes it
        chunks = split_chunks(read(first_new * self.chunk, n_full * self.chunk), self.geometry)
        new_keys = keys[first_new:]
        self._puts[self.tier.submit_put(new_keys, chunks)] = (new_keys, chunks)
        self.counters.puts += 1
        return len(new_keys)

    # -- completions --------------------------------------------------------------------------

    def poll(self) -> None:
        """Apply every finished tier task (never blocks); forget long-abandoned requests."""
        self._follow_identity()
        now = time.monotonic()
        ttl = self.bounds.forget_unprobed_after_s
        for rid in [r for r, s in self.pending.items() if now - s.probed > ttl]:
            self.forget(rid)
        by_task = {s.task: (rid, s) for rid, s in self.pending.items() if s.task is not None}
        for task_id, result in self.tier.poll().items():
            if result.status is not TaskStatus.CANCELLED:
                self._mark(result.status is TaskStatus.DONE)
            self._follow_epoch(result.epoch)
            put = self._puts.pop(task_id, None)
            if put is not None:
                self._finish_put(put[0], result)
                continue
            if self.fetches.owns(task_id):
                self._finish_fetch(task_id, result)
                continue
            rid_state = by_task.get(task_id)
            if rid_state is None:
                continue  # cancelled: its request is gone
            rid, state = rid_state
            state.task = None
            n_ok = result.num_ok_prefix if result.status is TaskStatus.DONE else 0
            if result.status is TaskStatus.DONE:  # a key found missing is no longer stored
                for key in state.keys[n_ok:]:
                    self._stored.pop(key.digest, None)
            if result.status is not TaskStatus.DONE:
                self.counters.fetch_failures += 1
                logger.warning("tier lookup for request %s: %s; recomputed", rid,
                               result.error or result.status.value)  # fmt: skip
            if n_ok == 0:
                state.phase = PrefixPhase.MISS
            elif self.fetch_bytes_in_flight() + self.fetches.new_bytes(state.keys[:n_ok]) > (
                self.bounds.max_fetch_bytes
            ):
                self.counters.fetches_skipped_full += 1
                state.phase = PrefixPhase.MISS
            elif not self._fetch_pays(state.keys[:n_ok]):
                self.counters.fetches_skipped_slower += 1
                state.phase = PrefixPhase.MISS
            else:
                state.keys = state.keys[:n_ok]
                self.fetches.want(rid, state.keys)
                state.phase, state.fetch_started = PrefixPhase.FETCH, time.monotonic()
        # Only after the answers that have come: a scheduler busy with a long prefill polls
        # late, and a lookup answered meanwhile was not the tier's delay.
        self._expire_overdue_lookups(now)
        self._settle_fetches()
        self._expire_overdue_fetches(now)

    def _finish_fetch(self, task_id: TaskId, result) -> None:
        landed, seconds = self.fetches.complete(task_id, result)
        if result.status is not TaskStatus.DONE or not result.all_ok:
            self.counters.fetch_failures += 1
            logger.warning("tier fetch: %s (%d/%d chunks usable); the rest is recomputed",
                           result.error or result.status.value, result.num_ok_prefix,
                           len(result.ok))  # fmt: skip
        if seconds > 0 and landed > 0:
            self.fetch_bytes_per_s = ewma(self.fetch_bytes_per_s, landed / seconds)

    def _settle_fetches(self) -> None:
        """Requests whose every chunk has landed or failed become ready (or a miss)."""
        for rid, state in self.pending.items():
            if state.phase is not PrefixPhase.FETCH or not self.fetches.settled(rid):
                continue
            state.chunks_ok = self.fetches.leading_ok(rid)
            for key in state.keys[state.chunks_ok:]:  # missing or bad: not stored any more
                self._stored.pop(key.digest, None)
            if state.chunks_ok == 0:
                self.fetches.release(rid)
                state.phase = PrefixPhase.MISS
            else:
                state.phase = PrefixPhase.READY

    def put_bytes_in_flight(self) -> int:
        return sum(c.nbytes for _, chunks in self._puts.values() for c in chunks)

    def fetch_bytes_in_flight(self) -> int:
        """Host bytes of fetch buffers (in flight, or landed and not yet taken)."""
        return self.fetches.nbytes()

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """This server prefilled ``tokens`` in ``seconds`` (the worker times its prefills)."""
        if tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s = ewma(self.prefill_tokens_per_s, tokens / seconds)

    def _fetch_pays(self, keys: list[ChunkKey]) -> bool:
        """``fetch_pays`` for ``keys``; every ``EXPLORE_EVERY``-th skip fetches anyway
        (re-measuring the link)."""
        if fetch_pays(self.fetches.new_bytes(keys), sum(k.num_tokens for k in keys),
                      self.fetch_bytes_per_s, self.prefill_tokens_per_s):  # fmt: skip
            return True
        self._judged_slower += 1
        return self._judged_slower % EXPLORE_EVERY == 0

    def _mark(self, up: bool) -> None:
        """The tier answered (up) or failed / overran a deadline (down, for a while)."""
        self.tier_up = up
        if not up:
            self._down_until = time.monotonic() + self.bounds.retry_down_after_s

    def _expire_overdue_lookups(self, now: float) -> None:
        """Lookups past their deadline: cancel, recompute, and treat the tier as down."""
        deadline = self.bounds.lookup_deadline_s
        for rid, state in self.pending.items():
            if state.phase is not PrefixPhase.LOOKUP or now - state.created <= deadline:
                continue
            if state.task is not None:
                self.tier.cancel(state.task)
            state.task, state.phase = None, PrefixPhase.MISS
            self.counters.overdue_lookups += 1
            self._mark(False)
            logger.warning("tier lookup for request %s unanswered after %.1f s: recomputing, "
                           "and not asking the tier for %.0f s", rid, deadline,
                           self.bounds.retry_down_after_s)  # fmt: skip

    def _expire_overdue_fetches(self, now: float) -> None:
        """Fetches past their deadline (``LinkBounds``): release, recompute, tier down."""
        bounds = self.bounds
        for rid, state in self.pending.items():
            if state.phase is not PrefixPhase.FETCH:
                continue
            deadline = bounds.fetch_deadline_s(state.nbytes(self.geometry), self.fetch_bytes_per_s)
            if now - state.fetch_started <= deadline:
                continue
            self.fetches.release(rid)
            state.phase = PrefixPhase.MISS
            self.counters.overdue_fetches += 1
            self._mark(False)
            logger.warning("tier fetch for request %s not landed after %.1f s: recomputing, "
                           "and not asking the tier for %.0f s", rid, deadline,
                           bounds.retry_down_after_s)  # fmt: skip

    def expected_wait_s(self, rid: str) -> float | None:
        """Seconds until ``rid``'s pending lookup and fetch land (None: no estimate yet)."""
        state = self.pending.get(rid)
        return None if state is None else state.wait_s(self.geometry, self.fetch_bytes_per_s)

    def _finish_put(self, keys: list[ChunkKey], result) -> None:
        if result.status is not TaskStatus.DONE or not result.all_ok:
            self.counters.put_failures += 1
            logger.warning("tier put failed (%s); those prefixes will be recomputed next time",
                           result.error or result.status.value)  # fmt: skip
        for key, ok in zip(keys, result.ok):
            if ok:
                self._stored[key.digest] = None
        while len(self._stored) > STORED_KEYS_REMEMBERED:
            self._stored.popitem(last=False)

    def _follow_epoch(self, epoch: bytes | None) -> None:
        """A new tier epoch (restarted KV server): nothing remembered as stored still is."""
        if epoch is None or epoch == self._epoch:
            return
        if self._epoch is not None and self._stored:
            logger.info("tier epoch changed (KV server restarted): forgetting %d chunks "
                        "remembered as stored; they are written again", len(self._stored))
        self._stored.clear()
        self._epoch = epoch

    def _follow_identity(self) -> None:
        """Reopen the tier under a new geometry when the model identity changed."""
        if self._geometry_now is None or self._reopen is None:
            return
        geometry = self._geometry_now()
        if geometry == self.geometry:
            return
        logger.info("model identity changed: dropping %d waiting requests' tier state and "
                    "reopening the tier with new keys", len(self.pending))
        for rid in list(self.pending):
            self.forget(rid)
        self.tier.close()  # cancels every task: no old-identity KV can land after this
        self._puts.clear()
        self._stored.clear()
        self._epoch = None
        self.tier, self.geometry = self._reopen(geometry), geometry
        self.fetches = SharedFetches(self.tier, self.requests.field("fetch_claims"))

    def close(self) -> None:
        self.tier.close()
