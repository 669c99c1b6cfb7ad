"""The VERICACHE speculative worker: draft from compressed KV, verify against the full KV.

SGLang drives it through the V2 spec-worker schema with overlap off: ``forward_batch_generation``
gets every extend (prefill) and decode batch. Per decode step and request::

    last committed token t0 (no KV yet) at position p = committed KV length
    draft:   x DECODE forwards, attention over the compressed view + the draft chain -> d1..dx
    verify:  one TARGET_VERIFY forward of [t0, d1..dx] at positions p..p+x over the full KV
    commit:  greedy rows: longest prefix of d matching the verifier's argmax + its correction/
             bonus token; sampled rows: speculative sampling (``verify/row_acceptance.py``);
             positions p..p+n hold exact KV (written by the verify), appended to the compressed
             cache; drafts past the first rejection are rolled back (their slots are rewritten
             by the next step)
    offload: while admission or the next step is short of pool slots, resident full KV moves
             to host memory (largest first; then its tail: ``PoolOffloader.tail_tokens``) and
             its pool slots go back to the allocator; its compressed KV stays in the pool,
             in its draft row (``placement.py``, ``srt/kv/offload.py``, ``srt/kv/draft_rows.py``)

A prefill step returns its first tokens before the rest of its work: each drafted request's
compressed KV and the move of its full KV to the host run first thing in the worker's next
forward (``RequestBook.after_prefill``), or earlier in SGLang's next admission attempt when a
request waits for room (``OffloadLedger.settle_prefills``), so they are not part of the time to
first token, and a request that finishes at its first token never pays for them.

Whether a step drafts at all, and how far, is decided per step from measured forward costs
(``verify/draft_length.py``): where drafting would commit fewer tokens per second than plain
decoding, the step is a plain one.

The decode step itself (prepare, draft, verify, commit, each timed into the step profile of
``verify/step_profile.py``) is a ``DecodeStep`` (``srt/decode/decode_step.py``) this worker builds
with its collaborators and runs per decode batch; this class holds the request records, the
scheduler's entry point, prefill and the result SGLang reads.

Only tokens the full-KV verify decided are ever committed, so greedy output equals plain
decoding and sampled output is distributed as plain sampling; grammar rows are masked along the
chain (``verify/grammar_chain.py``). Rows not drafted (penalties, ...: ``srt/decode/eligibility.py``)
take one token from SGLang's sampler at the verify's first column (``srt/decode/row_sampling.py``).
Logprobs of every committed token come from the verify logits.
"""

from __future__ import annotations

import logging
import time
from functools import cached_property, partial
from typing import Any, Callable

import torch
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

from sglang_vericache.compress import build_compressor
from sglang_vericache.config import Placement
from sglang_vericache.host_memory import hold_heap_pages
from sglang_vericache.ops.cpu_draft_decode import load_cpu_draft_decode
from sglang_vericache.ops.dropped_decode import PagedDecodeGeometry, paged_draft_decoder
from sglang_vericache.ops.pool_kivi_decode import pool_kivi_decoder
from sglang_vericache.server_record import vericache_config
from sglang_vericache.srt.attention.backend import QueryCapture, VeriCacheAttnBackend
from sglang_vericache.srt.decode.batch_inputs import (
    spec_result,
)
from sglang_vericache.srt.decode.decode_step import DecodeStep, lap
from sglang_vericache.srt.context import context_of, open_context
from sglang_vericache.srt.prefix.draft_ahead import DraftAhead
from sglang_vericache.srt.attention.draft_precision import DraftPrecision, choose_draft_format
from sglang_vericache.srt.kv.draft_state import RequestDraftState, prompt_state
from sglang_vericache.srt.decode.eligibility import (
    decode_mode,
    plain_reason,
    prefill_only,
)
from sglang_vericache.srt.kv.full_kv_stage import FullKVStager
from sglang_vericache.srt.metrics import VeriCacheExporter, request_meta_info
from sglang_vericache.srt.kv.offloader import PoolOffloader, shared_offloader
from sglang_vericache.srt.kv.reinstate import builds_without_queries, starts_demoted
from sglang_vericache.srt.hooks.patches import publish_meta_info
from sglang_vericache.requests.table import RequestTable
from sglang_vericache.srt.decode.request_book import RequestBook
from sglang_vericache.verify.stats import DecodeMode
from sglang_vericache.verify.step_profile import Phase, StepClock

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
        self._stager: FullKVStager | None = None
        self._ahead: DraftAhead | None = None
        self.clock = StepClock()  # where each decode step's time goes (metrics, step profile)
        hold_heap_pages()  # a forward's activations reuse their pages (host_memory.py)
        # --vericache-draft-len 0: the offload-only baseline (full KV off the device, no drafts)
        self.offload_only = self.config.draft_len == 0
        # every request's state is in its record, in the scheduler's request table (found on
        # first use: SGLang makes the pool it hangs on after this worker)
        self._requests: RequestTable | None = None
        self.book = RequestBook(lambda: self.requests, self.offload_only,
                                None if self.offload_only else self.config.draft_len,
                                self.speculative_num_draft_tokens - 1,
                                self.config.proposer)  # fmt: skip
        self.draft_length = self.book.draft_length
        self.states = self.book.states  # rid -> RequestDraftState of each drafted request
        # Draws of sampled rows without a sampling_seed (seeded rows hash their own seed), seeded
        # like SGLang's sampler: --random-seed as the target worker resolved it.
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(int(target_worker.random_seed))
        self.metrics = None
        if server_args.enable_metrics:
            self.metrics = VeriCacheExporter(server_args.served_model_name or "default")
        self.precision = self._draft_precision()
        # one batched attention call per layer of a draft forward (built here, not mid-step),
        # only where it can serve: drafts on a CPU over float32 views (the KV dtype); on a GPU,
        # FlashInfer's paged decode over the draft rows, Triton's where rows have packed KIVI
        # bodies in their pages (each checked against its reference here)
        self.draft_kernel, self.paged_draft, self.pool_kivi_draft = None, None, None
        device = torch.device(self.device)
        if (not self.offload_only and device.type == "cpu"
                and self.model_runner.kv_cache_dtype == torch.float32):  # fmt: skip
            self.draft_kernel = load_cpu_draft_decode()
        elif not self.offload_only:
            geometry = self._draft_geometry(server_args)
            self.paged_draft = paged_draft_decoder(device, geometry)
            self.pool_kivi_draft = pool_kivi_decoder(device, geometry)
        logger.info(
            "VeriCache worker: compressor %s, verify width %d, draft weights in %s, draft "
            "attention %s",
            self.compressor.spec, self.speculative_num_draft_tokens,
            "the model's dtype" if self.precision is None else (
                f"{self.precision.format} ({self.precision.layers} layers shadowed, "
                f"{self.precision.nbytes / 2**20:.0f} MiB)"),
            "batched (CPU kernel)" if self.draft_kernel is not None else " + ".join(
                name for name, on in (("paged (FlashInfer)", self.paged_draft),
                                      ("packed pages (Triton)", self.pool_kivi_draft)) if on
            ) or "per row (SDPA)",
        )  # fmt: skip
        # what exists only after this worker (pools, attention backend, draft ahead) is looked
        # up on use, through the worker's lazy properties
        self.step = DecodeStep(
            book=self.book, draft_length=self.draft_length, clock=self.clock, metrics=self.metrics,
            target_worker=target_worker, model_runner=self.model_runner, compressor=self.compressor,
            precision=self.precision, generator=self.generator, device=self.device,
            num_layers=self.num_layers, offload_only=self.offload_only,
            speculative_num_draft_tokens=self.speculative_num_draft_tokens,
            draft_kernel=self.draft_kernel, paged_draft=self.paged_draft,
            pool_kivi_draft=self.pool_kivi_draft, offloader=lambda: self.offloader,
            stager=lambda: self.stager, attn=lambda: self.attn, ahead=lambda: self.ahead,
            offload=self._offload, result=self._result,
        )  # fmt: skip

    def _draft_geometry(self, server_args: Any) -> PagedDecodeGeometry:
        """This rank's attention heads over the pool: pages of one token in the KV dtype."""
        config, tp = self.model_runner.model_config, int(server_args.tp_size)
        return PagedDecodeGeometry(config.num_attention_heads // tp, config.get_num_kv_heads(tp),
                                   config.head_dim, 1, self.model_runner.kv_cache_dtype)

    def _draft_precision(self) -> DraftPrecision | None:
        """Shadow weights for draft forwards (``srt/attention/draft_precision.py``), where
        ``--vericache-draft-dtype`` asks for them and drafting happens at all."""
        if self.offload_only:
            return None
        config = self.model_runner.model_config
        fmt = choose_draft_format(self.config.draft_dtype, config.dtype, torch.device(self.device),
                                  config.hidden_size)  # fmt: skip
        return None if fmt is None else DraftPrecision(fmt).install(self.model_runner.model)

    def init_attention_backends(self) -> None:
        """SGLang's call once the pools exist: from here the weight-update hooks find the shadow
        weights in the scheduler's context (``srt/prefix/model_identity.py``)."""
        super().init_attention_backends()
        if self.precision is not None:
            open_context(self.model_runner.req_to_token_pool).draft_precision = self.precision

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
        """Moves committed full KV to host memory: the scheduler's one offloader, shared with
        the prefix cache (the pools exist only after init)."""
        if self._offloader is None:
            runner = self.model_runner
            self._offloader = shared_offloader(
                runner.token_to_kv_pool, runner.req_to_token_pool,
                runner.token_to_kv_pool_allocator, self.num_layers,
            )  # fmt: skip
        return self._offloader

    @property
    def requests(self) -> RequestTable:
        """The scheduler's request table (``srt/context.py``), found on first use."""
        if self._requests is None:
            self._requests = context_of(self.model_runner.req_to_token_pool).requests
            # the server may be idle after a close, with no forward left to publish the gauges
            self._requests.after_close.append(self._publish_placement)
        return self._requests

    @property
    def stager(self) -> FullKVStager:
        """Copies a verify's host-resident full KV to the device while the batch drafts (a
        device pool; nothing on a host-memory one): sized after the pool took its memory."""
        if self._stager is None:
            device = self.offloader.pool.get_key_buffer(0).device
            self._stager = FullKVStager.for_pool(self.offloader.ledger, device)
        return self._stager

    @property
    def ahead(self) -> DraftAhead | None:
        """Drafting while a remote prefix is fetched (made by the prefix cache where a remote
        tier and fetch drafting are on); attached to the model on first use."""
        if self._ahead is None:
            self._ahead = context_of(self.model_runner.req_to_token_pool).ahead
            if self._ahead is not None:
                self._ahead.attach(self.model_runner.model)
        return self._ahead

    @cached_property
    def builds_later(self) -> bool:
        """The compressor builds a row's compressed KV without its prompt's queries, as it must
        where the row starts demoted (``srt/kv/reinstate.py``)."""
        keys = self.model_runner.token_to_kv_pool.get_key_buffer(0)  # [slots, H_kv, D]
        return builds_without_queries(self.compressor, self.num_layers, keys.shape[1],
                                      keys.shape[2])  # fmt: skip

    @property
    def eager_offload(self) -> bool:
        """Drafted rows' full KV moves to host memory right after prefill (``Placement``)."""
        placement = self.config.placement
        return placement is Placement.EAGER or (
            placement is Placement.AUTO and self.offloader.pool_in_host_memory)  # fmt: skip

    def _offload(self, req: Any, row: int, committed: int,
                 state: RequestDraftState | None) -> None:  # fmt: skip
        """Move an offloaded row's newly committed KV to host memory too, and hold ``state``
        (its compressed KV, or None) in pool slots (its draft row). Under pressure placement a
        row still in the pool stays there until pressure moves it (``relieve_pressure``), its
        compressed KV in free pool slots where there are enough (``hold_resident``), else beside
        the pool; eager placement and offload-only always move."""
        span = self.offloader.ledger.span(row)
        if not (self.offload_only or self.eager_offload) and span is None:
            if state is not None:
                self.offloader.hold_resident(row, state)
            return
        owned_from = int(req.kv.cache_protected_len)
        self.offloader.offload(row, owned_from, committed, req=req, state=state)

    # -- the scheduler's entry point -----------------------------------------------------------

    def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None):
        if self.ahead is not None:
            self.ahead.serving_busy()  # drafting ahead takes only idle compute (draft_ahead.py)
        self._settle_prefills()  # the last prefill's first tokens are out by now
        if batch.forward_mode.is_decode():  # who left the batch without a release is gone
            live = {r.rid for r in batch.reqs}
            self.requests.keep_only(live)
            self.requests.note_decoding(live)
        if batch.forward_mode.is_extend():
            result = self._as_prefill_work(lambda: self._prefill(batch, pp_proxy_tensors))
        else:
            self.clock.start(time.perf_counter())
            self.attn.clock = self.clock
            try:
                result = self.step.run(batch)
            finally:
                self.attn.clock = None
                profile = self.clock.finish(time.perf_counter())
            if self.metrics is not None:
                self.metrics.observe_profile(profile)
        if on_publish is not None:
            on_publish(result.new_seq_lens)
        self._publish_placement()
        return result

    def _publish_placement(self) -> None:
        if self.metrics is not None:
            self.metrics.set_placement(self.offloader.ledger, len(self.requests),
                                       self.requests.entry_counts())  # fmt: skip

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        """Its compressed KV goes to drafting ahead for the next turn; the rest of its state
        goes when SGLang releases its row, right after (``RequestTable.close``)."""
        state = self.states.pop(rid, None)
        if state is not None and self.ahead is not None:
            state.queued.clear()  # what it held back the next turn appends from its own KV
            self.ahead.park(rid, state)  # the prefix cache keeps it for the next turn

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
        lap(self.clock, Phase.PREFILL)
        link = context_of(self.model_runner.req_to_token_pool).link
        if link is not None:  # the tier link weighs fetching a prefix against recomputing it
            link.observe_prefill(int(batch.extend_num_tokens or 0), time.perf_counter() - started)
        seq_lens = batch.seq_lens_cpu.tolist()
        rows = batch.req_pool_indices.tolist()
        for i, req in enumerate(batch.reqs):
            self.requests.bind_row(req.rid, rows[i])  # its record, closed on its release
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
                queries = None  # offload-only rows: all of it moves, nothing is compressed
            else:
                queries = [capture.queries[i].get(layer) if capture.queries else None
                           for layer in range(self.num_layers)]  # fmt: skip
            self.book.after_prefill[req.rid] = partial(self._settle_prefill, req, rows[i],
                                                       seq_lens[i], queries, mode)  # fmt: skip
        if self.book.after_prefill:  # admission runs it first when a request waits for room
            self.offloader.ledger.settle_prefills = self._settle_prefills
        bs = len(batch.reqs)
        ones = torch.ones(bs, dtype=torch.int32, device=self.device)
        return self._result(batch, out.next_token_ids, ones, batch.seq_lens.clone(),
                            out.logits_output)  # fmt: skip

    def _settle_prefill(self, req: Any, row: int, length: int, queries: list[Any] | None,
                        mode: DecodeMode) -> None:  # fmt: skip
        """After ``req``'s first token went out: its compressed KV (``queries`` None: a plain
        row, none; none yet where a request waits for memory: ``starts_demoted``) and the move
        of its full KV to the host (``_offload``)."""
        state = None
        if queries is not None and not starts_demoted(
                self.book, req.rid, length, self.offloader.ledger, self.offloader.slot_bytes,
                self.builds_later):  # fmt: skip
            state = prompt_state(self.compressor, self.offloader, self.ahead, req, row, length,
                                 queries, self.num_layers).labelled(req, mode)  # fmt: skip
            self.states[req.rid] = state
            lap(self.clock, Phase.COMPRESS)
        self._offload(req, row, length, state)
        lap(self.clock, Phase.OFFLOAD)

    def _settle_prefills(self) -> None:
        """The work prefill steps left for after their first tokens (``RequestBook``), timed as
        prefill work (``vericache:prefill_phase_seconds``)."""
        work = self.book.take_after_prefill()
        if work:
            self._as_prefill_work(lambda: [settle() for settle in work])

    def _as_prefill_work(self, run: Callable[[], Any]) -> Any:
        """``run()``, its laps profiled as prefill work (``vericache:prefill_phase_seconds``)."""
        self.clock.start(time.perf_counter())
        try:
            result = run()
        finally:
            profile = self.clock.finish(time.perf_counter())
        if self.metrics is not None:
            self.metrics.observe_prefill_profile(profile)
        return result

    def _meta_info(self, rid: str, row: int) -> dict[str, Any]:
        """``meta_info["vericache"]`` of one request (``srt/metrics.py``)."""
        ledger = self.offloader.ledger
        return request_meta_info(self.book.stats(rid), self.states.get(rid), ledger.span(row),
                                 ledger.reserved(row), self.book.ahead_used.get(rid, (0, 0)))
