"""The VERICACHE speculative worker: draft from compressed KV, verify against the full KV.

SGLang drives it through the V2 spec-worker schema with overlap off: ``forward_batch_generation``
gets every extend (prefill) and decode batch. Per decode step and request::

    last committed token t0 (no KV yet) at position p = committed KV length
    draft:   x DECODE forwards, attention over the compressed view + the draft chain -> d1..dx
    verify:  one TARGET_VERIFY forward of [t0, d1..dx] at positions p..p+x over the full KV
    commit:  greedy rows: longest prefix of d matching the verifier's argmax + its correction/
             bonus token; sampled rows: speculative sampling (``srt/row_acceptance.py``);
             positions p..p+n hold exact KV (written by the verify), appended to the compressed
             cache; drafts past the first rejection are rolled back (their slots are rewritten
             by the next step)
    offload: while admission or the next step is short of pool slots, resident full KV moves
             to host memory (largest first; then every TAIL_CHUNK tokens) and its pool slots
             go back to the allocator; only the compressed KV's share stays reserved in the
             pool (``placement.py``, ``srt/offload.py``)

Whether a step drafts at all, and how far, is decided per step from measured forward costs
(``srt/draft_length.py``): where drafting would commit fewer tokens per second than plain
decoding, the step is a plain one.

Only tokens the full-KV verify decided are ever committed, so greedy output equals plain
decoding and sampled output is distributed as plain sampling; grammar rows are masked along the
chain (``verify/grammar_chain.py``). Rows not drafted (penalties, ...: ``srt/eligibility.py``)
take one token from SGLang's sampler at the verify's first column (``srt/row_sampling.py``).
Logprobs of every committed token come from the verify logits.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

from sglang_vericache.compress import build_compressor
from sglang_vericache.config import TierKind
from sglang_vericache.srt.attention import (
    DraftViews,
    QueryCapture,
    VeriCacheAttnBackend,
    empty_view,
)
from sglang_vericache.srt.batch_inputs import (
    last_tokens,
    one_token_rows,
    set_decode_inputs,
    set_verify_inputs,
    spec_result,
)
from sglang_vericache.srt.draft_ahead import DraftAhead, batch_proposals, draft_ahead_for
from sglang_vericache.srt.draft_length import DraftLengthController
from sglang_vericache.srt.draft_state import RequestDraftState
from sglang_vericache.srt.eligibility import (
    StepRows,
    decode_mode,
    plain_reason,
    prefill_only,
)
from sglang_vericache.srt.metrics import VeriCacheExporter, request_meta_info
from sglang_vericache.srt.offloader import PoolOffloader
from sglang_vericache.srt.patches import publish_meta_info
from sglang_vericache.srt.plugin import vericache_config
from sglang_vericache.srt.remote_prefix import link_for
from sglang_vericache.srt.request_book import RequestBook
from sglang_vericache.srt.row_acceptance import SampledDrafts, draft_column
from sglang_vericache.srt.row_sampling import commit_verify
from sglang_vericache.srt.step_costs import (
    draft_shape,
    plain_shape,
    release_for_admission,
    relieve_pressure,
    step_rows,
    verify_shape,
)
from sglang_vericache.verify import VerifyRecord
from sglang_vericache.verify.grammar_chain import GrammarChain
from sglang_vericache.verify.stats import DecodeMode
from sglang_vericache.verify.step_cost import ForwardKind
from sglang_vericache.verify.step_plan import PLAIN_FASTER

logger = logging.getLogger(__name__)

OBS_WINDOW = 32  # prompt queries kept for attention-scored compressors (SnapKV, H2O)


class VeriCacheWorker(BaseSpecWorker):
    """Same-model drafting on compressed KV, verification on full KV (see module doc)."""

    def __init__(self, server_args, gpu_id, nccl_port, target_worker, **_: Any) -> None:
        super().__init__()
        self._target_worker = target_worker
        self._draft_worker = None
        self.model_runner = target_worker.model_runner
        self.device = self.model_runner.device
        self.config = vericache_config(server_args)
        self.compressor = build_compressor(self.config.compressor)
        self.speculative_num_draft_tokens = int(server_args.speculative_num_draft_tokens)
        self.num_layers = self.model_runner.model_config.num_hidden_layers
        self._offloader: PoolOffloader | None = None
        self._ahead: DraftAhead | None = None
        self._empty_view: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # --vericache-draft-len 0: the offload-only baseline (full KV off the device, no drafts)
        self.offload_only = self.config.draft_len == 0
        self.draft_length = DraftLengthController(
            None if self.offload_only else self.config.draft_len,
            self.speculative_num_draft_tokens - 1,
        )
        self.book = RequestBook(self.draft_length, self.offload_only)
        self.states = self.book.states  # rid -> RequestDraftState of each drafted request
        # Draws of sampled rows without a sampling_seed (seeded rows hash their own seed), seeded
        # like SGLang's sampler: --random-seed as the target worker resolved it.
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(int(target_worker.random_seed))
        self.metrics = None
        if server_args.enable_metrics:
            self.metrics = VeriCacheExporter(server_args.served_model_name or "default")
        logger.info(
            "VeriCache worker: compressor %s, verify width %d",
            self.compressor.spec, self.speculative_num_draft_tokens,
        )  # fmt: skip

    @property
    def attn(self) -> VeriCacheAttnBackend:
        """The model runner's backend (built after this worker, so looked up on use)."""
        attn = self.model_runner.attn_backend
        if not isinstance(attn, VeriCacheAttnBackend):
            raise RuntimeError(
                f"--vericache needs the 'vericache' attention backend, got {type(attn).__name__}"
            )
        return attn

    @property
    def offloader(self) -> PoolOffloader:
        """Moves committed full KV to host memory (the pools exist only after init)."""
        if self._offloader is None:
            runner = self.model_runner
            self._offloader = PoolOffloader(
                runner.token_to_kv_pool, runner.req_to_token_pool,
                runner.token_to_kv_pool_allocator, self.num_layers,
            )  # fmt: skip
            # also requests that finish at prefill, which SGLang never reports as finished
            self._offloader.ledger.release_listeners.append(self._forget)
        return self._offloader

    @property
    def ahead(self) -> DraftAhead | None:
        """Drafting while a remote prefix is fetched (remote tiers with fetch drafting on)."""
        if self._ahead is None and self.config.fetch_drafting and (
            self.config.tier.kind is not TierKind.HOST
        ):
            self._ahead = draft_ahead_for(self.model_runner.req_to_token_pool)
            self._ahead.attach(self.model_runner.model)
        return self._ahead

    def _offload(self, req: Any, row: int, committed: int, compressed_bytes: int) -> None:
        """Move an offloaded row's newly committed KV to host memory too. A row still in the pool
        stays there until pressure moves it (``relieve_pressure``); offload-only always moves."""
        if not self.offload_only and self.offloader.ledger.span(row) is None:
            return
        owned_from = int(req.kv.cache_protected_len)
        self.offloader.offload(row, owned_from, committed, compressed_bytes)

    # -- the scheduler's entry point -----------------------------------------------------------

    def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None):
        if batch.forward_mode.is_decode():  # who left the batch (aborted, retracted) is gone;
            self.book.keep_only({r.rid for r in batch.reqs})  # finished ones leave on release
        if batch.forward_mode.is_extend():
            result = self._prefill(batch, pp_proxy_tensors)
        else:
            # The rows this step drafts; the others take one exact token (srt/row_sampling.py).
            step = StepRows.of(batch.reqs, drafting=not self.offload_only).without(
                self.book.demoted_rows(batch.reqs))  # fmt: skip
            self._sync_states(batch, step.drafted)
            moved = relieve_pressure(batch, self.states, self.offloader,
                                     self.speculative_num_draft_tokens)  # fmt: skip
            plan = self.draft_length.plan(step_rows(batch, self.states, step.drafted))
            if plan.reason == PLAIN_FASTER:
                self._demote_for_room(batch, step.drafted)
            if self.metrics is not None:
                self.metrics.observe_step(plan.reason)
                self.metrics.observe_pressure_offload(moved)
            if plan.drafts:
                result = self._verify_step(batch, step, plan.drafts)
            else:
                result = self._plain_step(batch)
        if on_publish is not None:
            on_publish(result.new_seq_lens)
        self._publish_placement()
        return result

    def _demote_for_room(self, batch, drafted: list[int]) -> None:
        """Drafting does not pay and admission is short: rows whose compressed KV held pool
        slots drop it and decode from their offloaded full KV from now on (offload-only)."""
        for i in release_for_admission(batch, drafted, self.offloader):
            self.book.demote(batch.reqs[i].rid)
            logger.info("request %s: compressed KV dropped for admission (drafting does not "
                        "pay); it decodes offload-only", batch.reqs[i].rid)  # fmt: skip

    def _publish_placement(self) -> None:
        if self.metrics is not None:
            self.metrics.set_placement(self.offloader.ledger, len(self.book))

    def _sync_states(self, batch, drafted: list[int]) -> None:
        """Every drafted row gets a compressed KV covering exactly its committed KV."""
        bases = batch.seq_lens_cpu.tolist()
        rows = batch.req_pool_indices.tolist()
        for i in drafted:
            req, base = batch.reqs[i], bases[i]
            self.states[req.rid] = RequestDraftState.in_step(
                self.states.get(req.rid), req, self.compressor,
                self.offloader.layer_reader(rows[i], base), base, self.num_layers, decode_mode(req),
            )  # fmt: skip

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        state = self.states.pop(rid, None)
        if state is not None and self.ahead is not None:
            self.ahead.park(rid, state)  # the prefix cache keeps it for the next turn
        self._forget(rid)

    def _forget(self, rid: str) -> None:
        """Drop everything held for ``rid`` (idempotent: finish, then release, both call it)."""
        self.book.forget(rid)
        self._publish_placement()

    def _result(self, batch, next_token_ids, accept_lens, new_seq_lens, logits_output):
        width = self.speculative_num_draft_tokens
        for req, row in zip(batch.reqs, batch.req_pool_indices.tolist()):
            publish_meta_info(req, self._meta_info(req.rid, row), len(req.output_ids) + width)
        return spec_result(batch, width, next_token_ids, accept_lens, new_seq_lens, logits_output)

    # -- prefill -----------------------------------------------------------------------------

    def _prefill(self, batch, pp_proxy_tensors):
        # SGLang's prefill-only path (no sampling, no output logprob) is off under any spec
        # algorithm; max_new_tokens 0 never decodes, so it takes that path as without us.
        batch.is_prefill_only = all(prefill_only(r) for r in batch.reqs)
        self.attn.capture = QueryCapture(OBS_WINDOW)
        started = time.perf_counter()
        try:
            out = self.target_worker.forward_batch_generation(
                batch, pp_proxy_tensors=pp_proxy_tensors
            )
        finally:
            capture, self.attn.capture = self.attn.capture, None
        link = link_for(self.model_runner.req_to_token_pool)
        if link is not None:  # the tier link weighs fetching a prefix against recomputing it
            link.observe_prefill(int(batch.extend_num_tokens or 0), time.perf_counter() - started)
        seq_lens = batch.seq_lens_cpu.tolist()
        rows = batch.req_pool_indices.tolist()
        for i, req in enumerate(batch.reqs):
            if self.ahead is not None and req.rid in self.ahead.jobs:
                # admitted: its full KV is here; the drafts made meanwhile feed the first steps
                self.book.ahead_used[req.rid] = [self.ahead.halt(req.rid), 0]
            if req is batch.chunked_req:
                continue  # prompt not complete yet: compress after its last chunk
            mode = DecodeMode.PLAIN if self.offload_only else decode_mode(req)
            if self.metrics is not None:
                self.metrics.observe_request(mode)
            if plain_reason(req) is not None or self.offload_only:
                self.book.note_plain(req)
                self._offload(req, rows[i], seq_lens[i], 0)  # offload-only rows: all of it
                continue
            queries = [capture.queries[i].get(layer) if capture.queries else None
                       for layer in range(self.num_layers)]  # fmt: skip
            state = RequestDraftState.build(
                self.compressor, self.offloader.layer_reader(rows[i], seq_lens[i]), seq_lens[i],
                queries, self.num_layers,
            ).labelled(req, mode)  # fmt: skip
            self.states[req.rid] = state
            self._offload(req, rows[i], seq_lens[i], state.nbytes)
        bs = len(batch.reqs)
        ones = torch.ones(bs, dtype=torch.int32, device=self.device)
        return self._result(batch, out.next_token_ids, ones, batch.seq_lens.clone(),
                            out.logits_output)  # fmt: skip

    # -- decode steps ------------------------------------------------------------------------

    def _plain_step(self, batch):
        """One token per request with SGLang's own decode forward and sampler (no drafting)."""
        for req in batch.reqs:
            self.book.note_plain(req)
        base = batch.seq_lens_cpu.clone()
        set_decode_inputs(batch, self.offloader.table, last_tokens(batch, self.device), base, 0)
        rows = batch.req_pool_indices.tolist()
        started = time.perf_counter()
        out = self.target_worker.forward_batch_generation(batch)
        self.draft_length.observe_forward(ForwardKind.PLAIN, plain_shape(batch),
                                          time.perf_counter() - started)  # fmt: skip
        for i, req in enumerate(batch.reqs):
            state = self.states.get(req.rid)
            if state is not None:
                slots = self.offloader.row_slots(rows[i], int(base[i]), int(base[i]) + 1)
                state.append(self.offloader.read_slots, slots, [None] * self.num_layers)
            if state is not None or self.book.offloads_plainly(req.rid):
                self._offload(req, rows[i], int(base[i]) + 1, 0 if state is None else state.nbytes)
        tokens, ones = one_token_rows(out, self.speculative_num_draft_tokens)
        return self._result(batch, tokens, ones, (base + 1).to(self.device), out.logits_output)

    def _draft(self, batch, base: torch.Tensor, rows: torch.Tensor, drafted: list[int],
               sampled: SampledDrafts | None, grammar: GrammarChain | None) -> None:  # fmt: skip
        """Fill rows[:, 1:] from the compressed views (rows[:, 0] = last token): greedy rows take
        the argmax, ``sampled``'s rows a sample of q (kept in ``sampled`` for the verify);
        ``grammar``'s rows draw from masked logits and keep every column's mask for the verify.

        Rows not in ``drafted`` ride along (one batch, one forward) attending over their own
        draft chain only; their drafts are never verified. The logits are raw (``is_verify``
        skips SGLang's sampler); ``srt/row_acceptance.py`` says why that is what drafted rows
        sample from.
        """
        if self._empty_view is None:
            self._empty_view = empty_view(self.model_runner.token_to_kv_pool, self.num_layers)
        views, view_tokens = [self._empty_view] * len(batch.reqs), [0] * len(batch.reqs)
        for i in drafted:
            state = self.states[batch.reqs[i].rid]
            views[i], view_tokens[i] = state.views(), state.view_tokens
        self.attn.draft = DraftViews(base.tolist(), views)
        try:
            for j in range(rows.shape[1] - 1):
                set_decode_inputs(batch, self.offloader.table, rows[:, j], base, j)
                started = time.perf_counter()
                out = self.target_worker.forward_batch_generation(batch, is_verify=True)
                self.draft_length.observe_forward(ForwardKind.DRAFT, draft_shape(view_tokens, j),
                                                  time.perf_counter() - started)  # fmt: skip
                rows[:, j + 1] = draft_column(j, out.logits_output.next_token_logits, sampled,
                                              grammar)  # fmt: skip
            if grammar is not None:
                grammar.fill(rows.shape[1] - 1)
        finally:
            self.attn.draft = None
            if grammar is not None:
                grammar.rollback()  # the scheduler advances the matchers over what commits

    def _verify_step(self, batch, step: StepRows, drafts: int):
        """Draft ``drafts`` tokens for ``step.drafted``, verify every row, commit
        (``srt/row_acceptance.py``)."""
        bs, drafted, plain_rows = len(batch.reqs), step.drafted, step.plain
        for i in plain_rows:
            self.book.note_plain(batch.reqs[i])
        width = 1 + drafts
        base = batch.seq_lens_cpu.clone()
        # Drafts made while fetching are greedy, unmasked and carry no q: all-greedy steps only.
        ahead = None if plain_rows or step.sampled or step.grammar else batch_proposals(
            self.ahead, batch.reqs, width - 1, self.book.ahead_used, self.device)
        if ahead is not None:  # every request was drafted while its prefix was fetched
            width = 1 + ahead.shape[1]
        rows = torch.empty(bs, width, dtype=torch.int64, device=self.device)
        rows[:, 0] = last_tokens(batch, self.device)
        sampled = SampledDrafts.start(batch.sampling_info, batch.reqs, step.sampled, base, width,
                                      self.generator, self.device)  # fmt: skip
        grammar = GrammarChain.start([batch.reqs[i].grammar for i in step.grammar], step.grammar,
                                     width, batch.sampling_info.vocab_size, self.device)  # fmt: skip
        if ahead is not None:
            rows[:, 1:] = ahead
        else:
            self._draft(batch, base, rows, drafted, sampled, grammar)

        set_verify_inputs(batch, self.offloader.table, rows, base)
        self.attn.capture = QueryCapture(width)
        started = time.perf_counter()
        try:
            out = self.target_worker.forward_batch_generation(batch, is_verify=True)
        finally:
            capture, self.attn.capture = self.attn.capture, None
        draft_lens = torch.zeros(bs, dtype=torch.int32, device=self.device)
        draft_lens[drafted] = width - 1
        if grammar is not None:
            grammar.limit(draft_lens)
            grammar.apply(out.logits_output.next_token_logits)  # logprobs are of masked logits
        accepted = commit_verify(self.model_runner, batch, out.logits_output, rows, draft_lens,
                                 sampled, plain_rows, base.to(self.device))  # fmt: skip
        predict, accept_lens = accepted.committed, accepted.accept_lens
        pool_rows = batch.req_pool_indices.tolist()
        for i in drafted:
            queries = [capture.queries[i][layer] for layer in range(self.num_layers)]
            self._commit(batch.reqs[i], pool_rows[i], int(base[i]), int(accept_lens[i]),
                         int(draft_lens[i]), queries)  # fmt: skip
        for i in self.book.demoted_rows(batch.reqs):  # their token follows their KV to the host
            self._offload(batch.reqs[i], pool_rows[i], int(base[i]) + 1, 0)
        # the verify's cost includes its commit bookkeeping: what a drafted step adds per row
        self.draft_length.observe_forward(ForwardKind.VERIFY, verify_shape(batch, width),
                                          time.perf_counter() - started)  # fmt: skip
        new_seq_lens = (base + accept_lens.cpu()).to(self.device)
        tokens = torch.zeros(bs, self.speculative_num_draft_tokens, dtype=torch.int64,
                             device=self.device)  # SGLang's rows are the allocated width
        tokens[:, :width] = predict
        return self._result(batch, tokens.flatten(), accept_lens, new_seq_lens,
                            out.logits_output)  # fmt: skip

    def _commit(self, req, row: int, base: int, n: int, drafts: int, queries) -> None:
        """Book ``n`` committed tokens of a row verified over ``drafts`` drafts: compressed KV,
        stats, placement."""
        state = self.states[req.rid]
        slots = self.offloader.row_slots(row, base, base + n)
        state.append(self.offloader.read_slots, slots, [q[:, :n] for q in queries])
        span = self.offloader.ledger.span(row)
        fetched = 0 if span is None else span.host.nbytes  # host KV the verify read
        record = VerifyRecord(drafted=drafts, committed=n, bytes_fetched=fetched,
                              wait_full_s=0.0)  # fmt: skip
        state.stats.record(record)
        self.draft_length.observe(req.rid, drafts, n - 1)
        if self.metrics is not None:
            self.metrics.observe_verify(record, state.stats.mode)
        self._offload(req, row, base + n, state.nbytes)

    def _meta_info(self, rid: str, row: int) -> dict[str, Any]:
        """``meta_info["vericache"]`` of one request (``srt/metrics.py``)."""
        return request_meta_info(self.book.stats(rid), self.states.get(rid),
                                 self.offloader.ledger.span(row),
                                 self.book.ahead_used.get(rid, (0, 0)))  # fmt: skip
