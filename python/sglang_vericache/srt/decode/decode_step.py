"""The decode step of the VERICACHE worker: prepare, draft, verify, commit (a composed object).

``VeriCacheWorker`` (``srt/decode/worker.py``, whose module doc draws the step) builds one
``DecodeStep`` at construction and calls ``DecodeStep.run(batch)`` for every decode batch; the
step's collaborators are its frozen fields, handed in by name: ``book`` (per-request records and
their ``states``), ``draft_length`` (planner and cost fit), ``clock`` (the step profile),
``metrics``, ``target_worker`` / ``model_runner`` (SGLang's forwards and sampler),
``generator``, ``compressor``, ``precision`` (draft weights), ``draft_kernel`` / ``paged_draft`` /
``pool_kivi_draft`` (batched draft attention: the CPU kernel, a GPU's paged decodes),
``num_layers``, ``offload_only``, ``device`` and ``speculative_num_draft_tokens``. What exists
only after the worker (the pools, the model runner's attention backend, the prefix cache's draft
ahead) is handed in as getters the step calls on use, as the worker's own lazy properties do:
``offloader``, ``stager`` (a step's offloaded full KV to the device: while the batch drafts,
before a plain forward; ``srt/kv/full_kv_stage.py``), ``attn`` and ``ahead``. Two worker methods
are handed in too: ``offload`` (a row's newly committed KV to its placement) and ``result``
(SGLang's result of a step, with each request's meta info).

A step mutates the batch (its inputs, rewritten per forward: ``batch_inputs``), the book (plain
notes, demotions, each drafted row's compressed KV in ``states``), the offloader (pressure moves,
released reservations, offloads), the attention backend's ``draft`` / ``capture`` for the span
of a forward, the planner's cost fit and the clock's laps. Everything runs on the scheduler
thread.

    run           prepare: compressed views in step, pressure offload, draft-or-plain plan
    _plain_step   one token per row from SGLang's own decode forward and sampler (compressed KV
                  is left behind: nothing drafts from it until drafting resumes)
    _verify_step  compressed KV caught up, _draft (x forwards over the compressed views; or
                  the rows' prompt-lookup drafts, no forward, demoted rows' too), one full-KV
                  verify (penalized rows penalized per column: penalized_rows.py), accept
    _commit       per drafted row: compressed KV append, stats, placement (a demoted row's
                  lookup drafts: stats only, _count_verify)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sglang_vericache.srt.attention.backend import QueryCapture, VeriCacheAttnBackend
from sglang_vericache.srt.attention.draft_attention import DraftPlan
from sglang_vericache.srt.attention.draft_precision import DraftPrecision, drafting
from sglang_vericache.srt.decode.batch_inputs import (
    last_tokens,
    live_index,
    lookup_tensor,
    one_token_rows,
    set_decode_inputs,
    set_verify_inputs,
    spread_verify_output,
)
from sglang_vericache.srt.decode.eligibility import StepRows, decode_mode
from sglang_vericache.srt.decode.request_book import RequestBook
from sglang_vericache.srt.decode.penalized_rows import penalize_verify
from sglang_vericache.srt.decode.row_sampling import commit_verify
from sglang_vericache.srt.decode.stop_tokens import stop_token_ids
from sglang_vericache.srt.decode.step_costs import (
    joining_contexts,
    plain_shape,
    relieve_pressure,
    rows_to_release,
    step_rows,
    verify_shape,
)
from sglang_vericache.srt.hooks.grammar_rollback import roll_back_or_abort
from sglang_vericache.srt.hooks.penalties import plain_would_overlap
from sglang_vericache.srt.kv.draft_state import DEFER_MAX, RequestDraftState
from sglang_vericache.srt.kv.full_kv_stage import FullKVStager
from sglang_vericache.srt.kv.offloader import PoolOffloader
from sglang_vericache.srt.kv.reinstate import admission_waits, still_demoted
from sglang_vericache.srt.metrics import VeriCacheExporter
from sglang_vericache.srt.prefix.draft_ahead import DraftAhead, batch_proposals
from sglang_vericache.verify import VerifyRecord
from sglang_vericache.verify.stats import DecodeMode, Proposer
from sglang_vericache.verify.draft_length import DraftLengthController
from sglang_vericache.verify.draft_chain import DraftChain
from sglang_vericache.verify.step_cost import ForwardKind, ForwardShape
from sglang_vericache.verify.step_plan import ADMITTING, DRAFTING_PAYS, LOOKUP_PAYS
from sglang_vericache.verify.step_profile import Phase, StepClock

logger = logging.getLogger(__name__)


def lap(clock: StepClock, phase: Phase) -> None:
    """Charge the time since the clock's last lap to ``phase`` (while a step is profiled)."""
    if clock.running:
        clock.lap(phase, time.perf_counter())


@dataclass(frozen=True, kw_only=True)
class DecodeStep:
    """One decode batch's step, from its collaborators (see module doc); the getters are called
    on use because what they return exists only after the worker."""

    book: RequestBook
    draft_length: DraftLengthController
    clock: StepClock
    metrics: VeriCacheExporter | None
    target_worker: Any
    model_runner: Any
    compressor: Any
    precision: DraftPrecision | None
    generator: torch.Generator
    device: Any
    num_layers: int
    speculative_num_draft_tokens: int
    offload_only: bool
    draft_kernel: Any
    paged_draft: Any
    pool_kivi_draft: Any
    offloader: Callable[[], PoolOffloader]
    stager: Callable[[], FullKVStager]
    attn: Callable[[], VeriCacheAttnBackend]
    ahead: Callable[[], DraftAhead | None]
    offload: Callable[[Any, int, int, RequestDraftState | None], None]
    result: Callable[..., Any]

    @property
    def states(self) -> dict[str, RequestDraftState]:
        """rid -> compressed KV of each drafted request (the book's)."""
        return self.book.states

    def run(self, batch):
        # The rows this step drafts; the others take one exact token (srt/decode/row_sampling.py).
        step = StepRows.of(batch.reqs, drafting=not self.offload_only,
                           watermarked=batch.sampling_info.watermark_candidates_host).without(
            self._still_demoted(batch))  # fmt: skip
        self._sync_states(batch, step.drafted)
        moved = relieve_pressure(batch, self.states, self.offloader(),
                                 self.speculative_num_draft_tokens)  # fmt: skip
        # each lookup row's draft, scored against what commits whichever proposer the step uses
        lookup = {} if self.draft_length.proposer == "compressed" else self.book.lookup_drafts(
            batch.reqs, step.lookup_rows, self.speculative_num_draft_tokens - 1)
        priced = {i: (len(d), self.book.lookups[batch.reqs[i].rid].alpha)
                  for i, d in lookup.items()} if step.takes_lookup else {}  # fmt: skip
        joining = joining_contexts(batch, step.drafted, self.offloader())
        plan = self.draft_length.plan(step_rows(batch, self.states, step.drafted, priced), joining)
        if plan.reason in ADMITTING:
            self._demote_for_room(batch, step.drafted, plan.reason)
        if joining and plan.reason in (*ADMITTING, DRAFTING_PAYS, LOOKUP_PAYS):
            # the last word on drafting against admission: whether newcomers build their
            # compressed KV while requests wait (srt/kv/reinstate.py, starts_demoted)
            self.book.admission_first = plan.reason in ADMITTING
        elif not admission_waits(self.offloader().ledger):
            self.book.admission_first = False  # a verdict holds while its queue lasts
        logger.debug("decode step: %d rows, %d drafts (%s); %d could join (%d slots short); "
                     "predicted tok/s plain %s, drafted %s", len(batch.reqs), plan.drafts,
                     plan.reason, len(joining), self.offloader().ledger.admission_deficit,
                     plan.plain_rate, plan.draft_rate)  # fmt: skip
        if self.metrics is not None:
            self.metrics.observe_step(plan.reason)
            self.metrics.observe_pressure_offload(moved)
        self._lap(Phase.PREPARE)
        if plan.drafts:
            return self._verify_step(batch, step, plan.drafts,
                                     lookup if plan.proposer is Proposer.LOOKUP else None)
        return self._plain_step(batch)

    def _lap(self, phase: Phase) -> None:
        lap(self.clock, phase)

    def _demote_for_room(self, batch, drafted: list[int], reason: str) -> None:
        """Drafting does not pay (or is not measured yet: ``reason``) and admission is short:
        rows whose compressed KV held pool slots drop it and decode from their full KV until
        room returns (``_still_demoted``)."""
        offloader = self.offloader()
        rows, lens = batch.req_pool_indices.tolist(), batch.seq_lens_cpu.tolist()
        for i in rows_to_release(batch, drafted, offloader.ledger):
            # the state first: a state no one holds is not copied out of the slots it leaves
            self.book.demote(batch.reqs[i].rid, int(lens[i]))
            offloader.release_reserved(rows[i])
            logger.info("request %s: compressed KV dropped for admission (%s); it decodes "
                        "plainly until room returns", batch.reqs[i].rid, reason)

    def _still_demoted(self, batch) -> set[int]:
        """The batch's demoted rows that stay plain this step; those whose room returned draft
        again, their compressed KV rebuilt (``srt/kv/reinstate.py``)."""
        return still_demoted(batch, self.book, self.offloader(), self.compressor, self.num_layers,
                             self.speculative_num_draft_tokens)  # fmt: skip

    def _sync_states(self, batch, drafted: list[int]) -> None:
        """Every drafted row gets a compressed KV covering at most its committed KV (behind
        after plain steps: ``_verify_step`` catches it up before drafting)."""
        offloader = self.offloader()
        bases = batch.seq_lens_cpu.tolist()
        rows = batch.req_pool_indices.tolist()
        for i in drafted:
            req, base = batch.reqs[i], bases[i]
            self.states[req.rid] = RequestDraftState.in_step(
                self.states.get(req.rid), req, self.compressor,
                offloader.layer_reader(rows[i], base), base, self.num_layers, decode_mode(req),
            )  # fmt: skip

    def _plain_step(self, batch):
        """One token per request with SGLang's own decode forward and sampler (no drafting)."""
        started = time.perf_counter()
        for req in batch.reqs:
            self.book.note_plain(req)
        base = batch.seq_lens_cpu.clone()
        set_decode_inputs(batch, self.offloader().table, last_tokens(batch, self.device), base, 0)
        rows = batch.req_pool_indices.tolist()
        # a GPU: the rows' host-resident full KV in one copy each, not one per layer in the
        # forward (nothing runs meanwhile to overlap it with)
        stager = self.stager()
        self.clock.note_transient(stager.stage(rows))
        stager.ready()
        try:
            out = self.target_worker.forward_batch_generation(batch)
        finally:
            stager.release()
        self._lap(Phase.PLAIN)
        for i, req in enumerate(batch.reqs):  # compressed KV catches up when drafting resumes
            state = self.states.get(req.rid)
            if state is not None or self.book.offloads_plainly(req.rid):
                self.offload(req, rows[i], int(base[i]) + 1, state)
                self._lap(Phase.OFFLOAD)
        # the whole plain step, its offloads included: what the planner weighs a drafted step
        # against (the prepare phase before the choice is the same for both)
        self.draft_length.observe_forward(ForwardKind.PLAIN, plain_shape(batch),
                                          time.perf_counter() - started)  # fmt: skip
        tokens, ones = one_token_rows(out, self.speculative_num_draft_tokens)
        return self.result(batch, tokens, ones, (base + 1).to(self.device), out.logits_output)

    def _draft(self, batch, base: torch.Tensor, chain: DraftChain, drafted: list[int]) -> float:
        """Fill the chain's drafts from the compressed views: greedy rows take the argmax,
        sampled rows a sample of q (kept for the verify), grammar rows draw from masked logits
        and keep every column's mask for the verify (``verify/draft_chain.py``).

        Rows not in ``drafted`` ride along (one batch, one forward) attending over their own
        draft chain only; their drafts are never verified. The logits are raw (``is_verify``
        skips SGLang's sampler); ``verify/row_acceptance.py`` says why that is what drafted rows
        sample from. Returns the seconds its draft forwards took (each timed with its inputs
        and its column of drafts, as the planner prices a draft forward).
        """
        states = [None] * len(batch.reqs)
        for i in drafted:
            states[i] = self.states[batch.reqs[i].rid]
        attn, offloader = self.attn(), self.offloader()
        plan = attn.draft = DraftPlan(base.tolist(), states, chain.width - 1,
                                      self.draft_kernel, self.paged_draft,
                                      self.pool_kivi_draft)  # fmt: skip
        spent = 0.0
        try:
            for j in range(chain.width - 1):
                started = time.perf_counter()
                set_decode_inputs(batch, offloader.table, chain.rows[:, j], base, j)
                with drafting(self.precision):
                    out = self.target_worker.forward_batch_generation(batch, is_verify=True)
                chain.draft(j, out.logits_output.next_token_logits)
                seconds = time.perf_counter() - started
                self.draft_length.observe_forward(ForwardKind.DRAFT,
                                                  ForwardShape.draft(plan.view_tokens, j),
                                                  seconds)  # fmt: skip
                self.clock.count_draft_forward()
                spent += seconds
            chain.end_drafts()
        finally:
            attn.draft = None
            self.clock.note_transient(plan.transient_bytes)
            if chain.grammar is not None:
                # the scheduler advances the matchers over what commits; a matcher that
                # cannot undo its drafts ends its request, not the scheduler
                roll_back_or_abort(chain.grammar, batch.reqs)
        return spent

    def _verify_step(self, batch, step: StepRows, drafts: int,
                     lookup: dict[int, list[int]] | None = None):  # fmt: skip
        """Draft ``drafts`` tokens for ``step.drafted`` (from the compressed views, or up to
        that many of each row's ``lookup`` draft), verify every row, commit
        (``verify/row_acceptance.py``)."""
        started, drafting_seconds = time.perf_counter(), 0.0
        bs, drafted, plain_rows = len(batch.reqs), step.drafted, step.plain
        # demoted rows verify their lookup drafts; in any other step they take one token
        looked_up = step.lookup_only if lookup is not None else []
        if looked_up:
            plain_rows = [i for i in plain_rows if i not in looked_up]
        for i in plain_rows:
            self.book.note_plain(batch.reqs[i])
        width = 1 + drafts
        base = batch.seq_lens_cpu.clone()
        pool_rows = batch.req_pool_indices.tolist()
        offloader = self.offloader()
        ahead = batch_proposals(self.ahead(), batch.reqs, width - 1, self.book.ahead_used,
                                self.device) if step.all_greedy else None  # fmt: skip
        proposer = Proposer.COMPRESSED
        if ahead is not None:  # every request was drafted while its prefix was fetched
            width, proposer = 1 + ahead.shape[1], Proposer.AHEAD
        elif lookup is not None:
            proposer = Proposer.LOOKUP
        for i in drafted if proposer is Proposer.COMPRESSED else ():
            # plain and lookup steps left their compressed KV behind: level it first
            self._level(self.states[batch.reqs[i].rid], pool_rows[i], int(base[i]))
        self._lap(Phase.COMMIT)
        # the verify's host-resident full KV goes to the device while the batch drafts (a GPU)
        stager = self.stager()
        self.clock.note_transient(stager.stage(pool_rows))
        chain = DraftChain.start(last_tokens(batch, self.device), width,
                                 sorted({*drafted, *looked_up}), reqs=batch.reqs,
                                 sampling_info=batch.sampling_info,
                                 sampled_rows=step.sampled, grammar_rows=step.grammar,
                                 positions=base, generator=self.generator)  # fmt: skip
        if ahead is not None:
            chain.propose(ahead)
        elif lookup is not None:
            chain.propose(*lookup_tensor(lookup, chain.rows, drafts))
        else:
            drafting_seconds = self._draft(batch, base, chain, drafted)
        self._lap(Phase.DRAFT)

        # a row's columns past its drafts would only pad the width: the forward leaves them out
        live = (chain.draft_lens + 1).tolist()
        kept = live_index(live, width, self.device)
        set_verify_inputs(batch, offloader.table, chain.rows, base, kept)
        attn = self.attn()
        attn.capture = QueryCapture(width)
        attn.live_queries = live
        stager.ready()
        try:
            out = self.target_worker.forward_batch_generation(batch, is_verify=True)
        finally:
            capture, attn.capture = attn.capture, None
            attn.live_queries = None
            stager.release()
        if kept is not None:  # back to the width's layout every reader of the verify expects
            spread_verify_output(out.logits_output, kept, bs * width)
        chain.mask_verify(out.logits_output.next_token_logits)
        penalize_verify(out.logits_output.next_token_logits, chain.rows, chain.draft_lens,
                        step.penalized, batch.reqs, batch.sampling_info, self.book.penalties,
                        plain_would_overlap())  # fmt: skip
        accepted = commit_verify(self.model_runner, batch, out.logits_output, chain, plain_rows,
                                 base.to(self.device))  # fmt: skip
        accepted = chain.settle(accepted, [stop_token_ids(r) for r in batch.reqs])
        draft_lens = chain.draft_lens
        self._lap(Phase.VERIFY)
        predict, accept_lens = accepted.committed, accepted.accept_lens
        for i in drafted:
            queries = [capture.queries[i][layer] for layer in range(self.num_layers)]
            self._commit(batch.reqs[i], pool_rows[i], int(base[i]), int(accept_lens[i]),
                         int(draft_lens[i]), queries, proposer)  # fmt: skip
        for i in looked_up:  # no compressed KV to extend; offloaded with the demoted rows
            self._count_verify(self.book.stats(batch.reqs[i].rid), pool_rows[i],
                               int(draft_lens[i]), int(accept_lens[i]), Proposer.LOOKUP,
                               DecodeMode.GREEDY)  # fmt: skip
        for i in step.demoted:  # what they commit follows their KV to the host
            self.offload(batch.reqs[i], pool_rows[i], int(base[i]) + int(accept_lens[i]), None)
        self._lap(Phase.OFFLOAD)
        # the verify is priced as the whole drafted step but its draft forwards: it carries
        # the catch-up of compressed KV behind after plain steps, the commit and the offloads,
        # which a drafted step pays once (the prepare phase before the choice, both modes pay)
        self.draft_length.observe_forward(
            ForwardKind.VERIFY, verify_shape(batch, width, live),
            time.perf_counter() - started - drafting_seconds)
        new_seq_lens = (base + accept_lens.cpu()).to(self.device)
        tokens = torch.zeros(bs, self.speculative_num_draft_tokens, dtype=torch.int64,
                             device=self.device)  # SGLang's rows are the allocated width
        tokens[:, :width] = predict
        return self.result(batch, tokens.flatten(), accept_lens, new_seq_lens,
                           out.logits_output)  # fmt: skip

    def _count_verify(self, stats: Any, row: int, drafts: int, n: int, proposer: Proposer,
                      mode: DecodeMode) -> None:  # fmt: skip
        """One verification of ``drafts`` drafts that committed ``n`` tokens of pool ``row``, in
        its request's ``stats`` and on ``/metrics`` (labelled ``mode``)."""
        span = self.offloader().ledger.span(row)
        record = VerifyRecord(drafted=drafts, committed=n, wait_full_s=0.0, proposer=proposer,
                              bytes_fetched=0 if span is None else span.host.nbytes)  # fmt: skip
        stats.record(record)  # the bytes: host KV the verify read
        if self.metrics is not None:
            self.metrics.observe_verify(record, mode)

    def _level(self, state: RequestDraftState, row: int, length: int) -> None:
        """Catch ``state`` up with the ``length`` committed positions of pool ``row``."""
        state.catch_up(self.offloader().range_reader(row, state.covered, length), length)

    def _commit(self, req, row: int, base: int, n: int, drafts: int, queries,
                proposer: Proposer) -> None:  # fmt: skip
        """Book ``n`` committed tokens of a row verified over ``drafts`` drafts of ``proposer``:
        compressed KV, stats, placement. Drafts that did not come from the compressed KV
        (lookup, ahead) leave it behind: the tokens wait, with their queries, for the next
        step that drafts from it (``RequestDraftState.defer``), whose verify carries the
        catch-up, or for ``DEFER_MAX`` of them."""
        state, offloader = self.states[req.rid], self.offloader()
        if proposer is Proposer.COMPRESSED:  # caught up before drafting: covered == base
            slots = offloader.row_slots(row, base, base + n)
            state.append(offloader.read_slots, slots, [q[:, :n] for q in queries])
        else:
            state.defer(base, [q[:, :n] for q in queries])
            if state.deferred >= DEFER_MAX:
                self._level(state, row, base + n)
        self._count_verify(state.stats, row, drafts, n, proposer, state.stats.mode)
        if proposer is not Proposer.LOOKUP:  # a lookup draft is scored by its own index
            self.draft_length.observe(req.rid, drafts, n - 1)
        self._lap(Phase.COMMIT)
        self.offload(req, row, base + n, state)
        self._lap(Phase.OFFLOAD)

