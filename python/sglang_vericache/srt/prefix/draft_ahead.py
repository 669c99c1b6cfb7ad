"""Drafting while the full KV streams in: compressed prefixes kept locally, drafts made ahead.

With a remote tier the device keeps the *compressed* KV of finished sequences
(``tier/demoted.py``: DEMOTED prefixes, charged to the KV pool) while their full KV is in the
tier. When the next turn arrives and the tree has evicted its full-KV prefix, that prefix must
be fetched before SGLang can prefill it, and the request waits in the queue. Meanwhile
``DraftAhead`` drafts it from the compressed prefix on a background thread::

    queue:   [ lookup | fetch full KV ..................... ] admit, prefill -> t1
    ahead:   [ match compressed prefix | prefill suffix (lossy) | d1 d2 d3 ... dn ]
    decode:  verify [t1, d2..dw] over the full KV at once (d1 == t1), no draft forwards

Drafts made ahead are only proposals: the first verifications check them against the full KV
exactly like any other draft, so output is unchanged whatever the drafter produced. A job stops
when its request is admitted (``halt``) or leaves (``forget``); the worker consumes the drafts
as long as the committed tokens keep matching them.

Drafts ahead use only compute the serving path leaves idle: the thread runs a forward (a
chunk of the suffix's prefill, one draft step) only while the scheduler has no batch to run
(``serving_idle``, from SGLang's idle hook) and stops at its next forward (``serving_busy``).
On two CPU cores a draft made while others decode slows every one of their tokens to save one
draft forward later; when every request waits for its prefix, the compute is free.

Threading: ``start``/``halt``/``forget``/``drafts`` run on the scheduler thread, one daemon
thread runs the jobs in order. A job's ``drafts`` list is only ever appended to, so a
snapshot read from the scheduler thread is always a consistent prefix.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from sglang_vericache.requests.table import RequestTable
from sglang_vericache.verify.draft_length import ewma
from sglang_vericache.srt.prefix.llama_drafter import LlamaDrafter
from sglang_vericache.tier.demoted import DemotedPrefix, DemotedPrefixes

logger = logging.getLogger(__name__)

AHEAD_MAX_TOKENS = 64  # drafts made per waiting request (more than a fetch usually allows)
AHEAD_MAX_SUFFIX = 1024  # prompt tokens past the compressed prefix the drafter will prefill
PREFILL_CHUNK = 32  # suffix tokens per drafter forward: how long the serving path may wait
IDLE_POLL_S = 0.05  # how often a job waiting for idle compute checks whether it was halted


@dataclass(slots=True)
class AheadJob:
    """One waiting request's drafting: ``drafts`` grows on the drafting thread. Eviction may
    drop ``prefix`` from the store meanwhile: the job's reference keeps its tensors until the
    job ends (one prefix's compressed KV, briefly past its freed slots)."""

    rid: str
    prefix: DemotedPrefix
    suffix: list[int]
    max_tokens: int
    drafts: list[int] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)


class DraftAhead:
    """The DEMOTED prefixes plus the drafting thread (module doc).

    ``attach(model)`` is called by the worker once the model exists; until then, or for a model
    without the Llama layout, ``start`` does nothing and requests wait for their fetch as before.
    """

    def __init__(self, store: DemotedPrefixes, requests: RequestTable | None = None) -> None:
        """requests: the scheduler's request table, whose records hold each request's job,
        parked compressed KV and whether it declined (a table of its own by default)."""
        self.store = store
        self.drafter: LlamaDrafter | None = None
        self.requests = RequestTable() if requests is None else requests
        self.requests.join(self)  # a closing request's job stops
        self.finished = self.requests.field("finished_draft")  # compressed KV, finish -> release
        self.jobs = self.requests.field("ahead_job")
        self._declined = self.requests.field("ahead_declined")  # waited too short: asked once
        self._queue: queue.Queue[AheadJob | None] = queue.Queue()  # None: the thread exits
        self._thread: threading.Thread | None = None
        self.started = self.failed = self.skipped = 0
        self.prefill_s_per_token = 0.0  # the drafter's measured suffix prefill cost (0: none yet)
        self._idle = threading.Event()  # set while the serving path has no batch to run

    def attach(self, model: Any) -> None:
        self.drafter = LlamaDrafter.from_model(model)
        if self.drafter is None:
            logger.warning("%s does not have the Llama module layout: requests waiting for a "
                           "remote prefix are not drafted ahead", type(model).__name__)  # fmt: skip

    # -- the scheduler thread ----------------------------------------------------------------

    def serving_idle(self) -> None:
        """The scheduler has no batch to run: drafts may use the compute."""
        self._idle.set()

    def serving_busy(self) -> None:
        """The scheduler runs a forward: drafting pauses after its current chunk or step."""
        self._idle.clear()

    def park(self, rid: str, state: Any) -> None:
        """The worker hands over a finished request's compressed KV (before the cache sees it)."""
        if self.drafter is not None:
            self.finished[rid] = state

    def remember(self, rid: str, tokens: Sequence[int]) -> bool:
        """Keep finished request ``rid``'s compressed KV for the prefixes of later requests."""
        state = self.finished.pop(rid, None)
        if state is None:
            return False
        kept = min(len(tokens), state.covered)
        trim = state.covered - kept  # committed past the request's end (see DemotedPrefix)
        if trim > min(layer.num_pending for layer in state.layers):
            return False
        return self.store.put(list(tokens)[:kept], state, trim)

    def start(self, rid: str, prompt: Sequence[int], max_new_tokens: int,
              wait_s: float | None = None) -> bool:  # fmt: skip
        """Begin drafting ``rid`` (once) if a stored compressed prefix covers most of ``prompt``.

        wait_s: the expected time until its full KV lands (None: unknown). Drafting is skipped
        when prefilling the prompt's uncovered suffix would take longer: no draft would be ready
        in time, and the drafter would only compete with the serving path for compute.
        """
        if rid in self.jobs or self.drafter is None or rid in self._declined:
            return rid in self.jobs
        prefix = self.store.longest(prompt)
        suffix = len(prompt) - len(prefix.tokens) if prefix is not None else 0
        if prefix is None or suffix > AHEAD_MAX_SUFFIX:
            return False
        if wait_s is not None and suffix * self.prefill_s_per_token >= wait_s:
            self._declined[rid] = True
            self.skipped += 1
            return False
        job = AheadJob(rid, prefix, list(prompt[len(prefix.tokens) :]),
                       min(AHEAD_MAX_TOKENS, max_new_tokens))  # fmt: skip
        self.jobs[rid] = job
        self.started += 1
        logger.info("request %s: drafting while its prefix is fetched, from a compressed prefix "
                    "of %d tokens (+%d prompt tokens)", rid, len(prefix.tokens), len(job.suffix))
        self._queue.put(job)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vericache-draft-ahead",
                                            daemon=True)  # fmt: skip
            self._thread.start()
        return True

    def drafts(self, rid: str) -> list[int]:
        """Tokens drafted so far for ``rid`` (a snapshot; empty if none)."""
        job = self.jobs.get(rid)
        return [] if job is None else job.drafts[:]

    def proposals(self, reqs: Sequence[tuple[str, Sequence[int]]], most: int) -> list[list[int]] | None:
        """The next drafts made ahead for each (rid, committed output) of a batch: [bs][n].

        A request's drafts d1..dm stay usable while its committed output equals d1..dk; it
        proposes d(k+1).. . None unless every request has at least one (the worker then drafts
        as usual); a request whose output left its drafts is forgotten.
        """
        pending = []
        for rid, output in reqs:
            drafts, k = self.drafts(rid), len(output)
            if not drafts:
                return None
            if k == 0 or len(drafts) <= k or drafts[:k] != list(output):
                self.forget(rid)  # diverged or used up: normal drafting from now on
                return None
            pending.append(drafts[k:])
        n = min([most] + [len(d) for d in pending])
        return [d[:n] for d in pending] if n > 0 else None

    def halt(self, rid: str) -> int:
        """Stop drafting more for ``rid`` (it was admitted); returns the drafts made so far.

        What exists stays readable for ``proposals``.
        """
        job = self.jobs.get(rid)
        if job is None:
            return 0
        job.stop.set()
        return len(job.drafts)

    participant_name = "draft ahead"  # in the request table (requests/table.py)

    def tracked_rids(self) -> set[str]:
        return set()  # its per-request state is in the records

    def forget(self, rid: str) -> None:
        """Stop ``rid``'s job and drop its fields (it closed, or its drafts are of no use)."""
        self.finished.pop(rid, None)
        self._declined.pop(rid, None)
        job = self.jobs.pop(rid, None)
        if job is not None:
            job.stop.set()

    def close(self) -> None:
        """Stop every job and the drafting thread (waits for the step in progress)."""
        for rid in list(self.jobs):
            self.forget(rid)
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._thread = None

    # -- the drafting thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:  # Linux: drafts get only the CPU the serving path leaves idle (on a GPU: moot)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.stop.is_set():
                continue
            try:
                self._draft(job)
            except Exception:  # a draft is only a proposal: the request decodes normally
                self.failed += 1
                logger.exception("drafting ahead for request %s failed", job.rid)

    def _wait_idle(self, job: AheadJob) -> bool:
        """Block until the serving path idles; False if ``job`` was halted meanwhile."""
        while not job.stop.is_set():
            if self._idle.wait(IDLE_POLL_S):
                return not job.stop.is_set()
        return False

    def _draft(self, job: AheadJob) -> None:
        if not self._wait_idle(job):
            return
        views = job.prefix.views()
        first, rest = job.suffix[:PREFILL_CHUNK], job.suffix[PREFILL_CHUNK:]
        busy = 0.0  # seconds in forwards: the cost estimate excludes waits for idle compute
        started = time.perf_counter()
        logits, kv = self.drafter.prefill(views, first, len(job.prefix.tokens),
                                          len(rest) + job.max_tokens)  # fmt: skip
        busy += time.perf_counter() - started
        for i in range(0, len(rest), PREFILL_CHUNK):
            if not self._wait_idle(job):
                return
            started = time.perf_counter()
            logits = self.drafter.extend(rest[i : i + PREFILL_CHUNK], kv)
            busy += time.perf_counter() - started
        self.prefill_s_per_token = ewma(self.prefill_s_per_token, busy / max(1, len(job.suffix)))
        token = int(logits.argmax())
        while not job.stop.is_set():
            job.drafts.append(token)
            if len(job.drafts) >= job.max_tokens or not self._wait_idle(job):
                return
            token = int(self.drafter.step(token, kv).argmax())


def batch_proposals(ahead: DraftAhead | None, reqs: Sequence[Any], most: int,
                    used: dict[str, list[int]], device: Any) -> torch.Tensor | None:  # fmt: skip
    """Drafts made while fetching for every request of a batch: [bs, n] int64, or None (the
    worker drafts as usual). ``used[rid][1]`` counts the drafts sent to verification."""
    if ahead is None or not ahead.jobs:
        return None
    proposals = ahead.proposals([(r.rid, r.output_ids) for r in reqs], most)
    if proposals is None:
        return None
    for req in reqs:
        used.setdefault(req.rid, [0, 0])[1] += len(proposals[0])
    return torch.tensor(proposals, dtype=torch.int64, device=device)
