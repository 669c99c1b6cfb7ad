"""Draft attention over compressed views, in place: planned once per step, run per layer.

A compressed cache keeps its full-precision columns (a dropper's kept tokens, a quantizer's
residual, then the recent window) in a ``ViewStore``: once its request's full KV has left the
pool, the request's draft row, pool slots the allocator counts (``srt/kv/draft_rows.py``). A draft
forward reads such a row by slot, its chain (this step's drafts, whose KV the forward wrote to
their own pool slots) by the chain's slots, so neither is copied::

    row i, layer l   | packed body (KIVI codes, scales) | draft row slots ....... | chain slots |
                       the row's pages, if any           s_0 .. s_(n_float - 1)    from req_to_token

A cache in a buffer of its own (its request's full KV is still in the pool, or the pool had no
slot for it) has free room after its columns; the forward writes the chain's KV there and reads
the buffer's head::

    buffer of row i, layer l   | columns (body | window) | chain (scratch) | free |
                               0                  float_len    + n_chain

Queries sit at their true positions (keys are post-RoPE, so a view's gaps do not matter). On a
CPU with float32 views the rows of a layer attend in one call of a batched kernel
(``ops/cpu_draft_decode.py``: one parallel region, each view read where it lies, a KIVI body
packed). On a GPU, the rows whose view is in pool slots without a packed body are one paged
decode (``ops/dropped_decode.py``, FlashInfer's, pages of one token: the pool's buffers as they
are), planned once per draft forward and run per layer; where rows have KIVI bodies in the
row's pages, one Triton kernel reads them packed beside the slots (``ops/pool_kivi_decode.py``,
the same CSR with the bodies' pages beside it), whichever of the two reads more of the batch::

    kv_indptr        0 | n_0 | n_0 + n_1 | ...          n_i = float_len_i + chain_i
    kv_page_indices  row 0's slots, its chain | row 1's slots, its chain | ...
    kv_last_page_len 1 for every row

Every other row (a view beside the pool; everywhere, where no decoder could be had) is one
SDPA call that reads a tensor: a row in pool slots is gathered, a quantized body dequantized,
one layer of the batch at a time. Those copies
are the only transient tensors drafting builds outside the pool (``transient_bytes``). A row
without a compressed state rides along in the forward, attending over its own chain only; its
drafts are never verified.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention

from sglang_vericache.ops.cpu_draft_decode import CpuDraftDecode
from sglang_vericache.ops.dropped_decode import DroppedKVDecoder, PagedDecodeGeometry
from sglang_vericache.ops.pool_kivi_decode import PoolKiviDecode


@dataclass(slots=True)
class DraftPlan:
    """One draft step of a batch.

    base_lens[i]: committed KV positions of row i when the step starts.
    states[i]: row i's ``RequestDraftState`` (its per-layer compressed caches), or None for a
        row that rides along without drafting.
    drafts: draft forwards the step runs (the chain grows to this many tokens).
    view_lens[layer][i]: T_view of row i's cache of ``layer`` (0 for a row riding along).
    kernel: the batched CPU kernel (None: one SDPA call per row and layer).
    paged: a paged decoder over the pool (FlashInfer on a GPU), for rows whose view is in pool
        slots without a packed body; None: not used.
    pool_kivi: the Triton decoder over the pool (a GPU), for rows whose view is in pool slots,
        packed KIVI bodies in its pages included (FlashInfer first where it reads as many).
    transient_bytes: the most bytes of view + chain a forward copied at one layer, over all its
        rows (0 when every drafted row attends in place): at most one layer's view of the batch.
    """

    base_lens: list[int]
    states: Sequence[Any | None]
    drafts: int
    kernel: CpuDraftDecode | None = None
    paged: DroppedKVDecoder | None = None
    pool_kivi: PoolKiviDecode | None = None
    view_lens: list[list[int]] = field(init=False)
    transient_bytes: int = field(default=0, init=False)
    # (decoder, every row's float_len and body pages at a layer, every chain's length): what the
    # last plan over the pool was made for
    _planned: tuple | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if len(self.base_lens) != len(self.states):
            raise ValueError("DraftPlan: one base length per state")
        layers = next((len(s.layers) for s in self.states if s is not None), 0)
        self.view_lens = [[0 if s is None else s.layers[layer].view_len for s in self.states]
                          for layer in range(layers)]  # fmt: skip
        for state in self.states:  # room for the chain after every own buffer, once per step
            for cache in () if state is None else state.layers:
                cache.draft_buffer(self.drafts)

    @property
    def view_tokens(self) -> list[int]:
        """Per row, the first layer's T_view (what a draft forward's attention reads)."""
        return self.view_lens[0] if self.view_lens else [0] * len(self.states)

    def _row_kv(self, i: int, layer_id: int, pool_k: Tensor, pool_v: Tensor, chain: Tensor
                ) -> tuple[Any | None, Tensor, Tensor, Tensor | None, int]:  # fmt: skip
        """What row i attends over at ``layer_id``: (packed body the kernel reads as stored, or
        None; keys, values; index or None; bytes copied to make them, 0 where read in place).

        keys / values are [H_kv, n, D] tokens after the body, the view's full-precision columns
        then the chain; or, with an index [n] int64, the pool's buffers of the layer
        ([H_kv, slots, D]) read at those slots (a view in pool slots, then the chain's slots).
        pool_k / pool_v: the layer's pool buffers [slots, H_kv, D]; chain: [n_c] int64 slots of
        this step's drafts so far.
        """
        state = self.states[i]
        if state is None:  # a few tokens, gathered (the kernel takes any token stride)
            return None, pool_k[chain].transpose(0, 1), pool_v[chain].transpose(0, 1), None, 0
        cache = state.layers[layer_id]
        block, at = cache.block, cache.float_len
        if block is None or (self.kernel is not None and self.kernel.accepts_body(block)):
            slots = cache.draft_slots()
            if slots is not None:  # in the pool: the view's slots, then the chain's
                index = torch.cat([slots[:at], chain])
                return block, pool_k.transpose(0, 1), pool_v.transpose(0, 1), index, 0
            buffers = cache.draft_buffer(self.drafts)
            if buffers[0].shape[1] >= at + chain.numel():
                keys, values = buffers
                end = at + chain.numel()
                keys[:, at:end] = pool_k[chain].transpose(0, 1)  # scratch after the view
                values[:, at:end] = pool_v[chain].transpose(0, 1)
                return block, keys[:, :end], values[:, :end], None, 0
        (bk, bv), (wk, wv) = cache.view_parts()  # dequantized: the whole body in full precision
        keys = torch.cat([bk, wk, pool_k[chain].transpose(0, 1)], dim=1)
        values = torch.cat([bv, wv, pool_v[chain].transpose(0, 1)], dim=1)
        return None, keys, values, None, 2 * keys.numel() * keys.element_size()

    def attend(self, q: Tensor, layer_id: int, key_buffer: Tensor, value_buffer: Tensor,
               chain_slots: Sequence[Tensor], scale: float) -> Tensor:  # fmt: skip
        """Attention of one draft forward's queries at one layer.

        q: [B, H_q, D] (one query per row). key_buffer / value_buffer: the pool's buffers of this
        layer, [slots, H_kv, D]. chain_slots[i]: [n_i] int64 pool slots of row i's positions
        base_i .. seq_len_i - 1 (this step's drafts so far, the current one included).
        Returns [B, H_q, D_v].
        """
        batch = range(q.shape[0])
        decoder, pooled = self._pool_decoder(layer_id, key_buffer, q)
        if decoder is None:
            return self._attend_rows(q, layer_id, key_buffer, value_buffer, chain_slots, scale,
                                     list(batch))  # fmt: skip
        out = self._attend_pooled(decoder, q, layer_id, key_buffer, value_buffer, chain_slots,
                                  scale, pooled)  # fmt: skip
        if len(pooled) == len(batch):
            return out
        rest = sorted(set(batch) - set(pooled))
        full = q.new_empty((q.shape[0], q.shape[1], value_buffer.shape[-1]))
        full[pooled] = out.to(full.dtype)
        full[rest] = self._attend_rows(q, layer_id, key_buffer, value_buffer, chain_slots,
                                       scale, rest)  # fmt: skip
        return full

    def _pool_decoder(self, layer_id: int, key_buffer: Tensor, q: Tensor
                      ) -> tuple[Any | None, list[int]]:  # fmt: skip
        """The pool decoder that reads the most rows of this layer, and those rows: FlashInfer's
        the rows whose view is in pool slots without a packed body, Triton's also those whose
        KIVI body is in this layer's pages; a row riding along (its chain only) suits both.
        (None, []) where neither reads a drafted row. FlashInfer wins a tie."""
        kivi = self.pool_kivi
        candidates = []  # (decoder, whether it reads a row's packed body)
        if self.paged is not None and q.dtype == key_buffer.dtype:
            candidates.append((self.paged, lambda block: False))
        if kivi is not None and kivi.accepts(key_buffer, q.shape[1]):
            candidates.append((kivi, lambda block: kivi.accepts_body(block, key_buffer)))
        caches = [None if s is None else s.layers[layer_id] for s in self.states]
        best: tuple[Any | None, list[int]] = (None, [])
        for decoder, reads_body in candidates:
            rows = [i for i, c in enumerate(caches) if c is None or (
                c.draft_slots() is not None and (c.block is None or reads_body(c.block)))]
            if any(caches[i] is not None for i in rows) and len(rows) > len(best[1]):
                best = (decoder, rows)
            if len(rows) == len(caches):
                break  # every row: no other decoder can read more
        return best

    def _attend_pooled(self, decoder: Any, q: Tensor, layer_id: int, key_buffer: Tensor,
                       value_buffer: Tensor, chain_slots: Sequence[Tensor], scale: float,
                       rows: list[int]) -> Tensor:  # fmt: skip
        """``rows``' attention through ``decoder`` (planned once per forward):
        [len(rows), H_q, D]."""
        q_rows = q[rows].contiguous()
        if decoder is self.paged:
            self._plan_paged(layer_id, rows, chain_slots, key_buffer, q.shape[1], scale)
            pages = (key_buffer.unsqueeze(1), value_buffer.unsqueeze(1))  # [slots, 1, H_kv, D]
            return self.paged.run(q_rows, *pages)
        self._plan_pool_kivi(layer_id, rows, chain_slots, key_buffer, q.shape[1])
        return self.pool_kivi.run(q_rows, key_buffer, value_buffer, scale)

    def _attend_rows(self, q: Tensor, layer_id: int, key_buffer: Tensor, value_buffer: Tensor,
                     chain_slots: Sequence[Tensor], scale: float, rows: list[int]) -> Tensor:
        """``rows``' attention over tensors (the CPU kernel, else one SDPA call per row), each
        row's view read in place where the kernel takes it, else gathered or dequantized (those
        copies are ``transient_bytes``): [len(rows), H_q, D]."""
        parts = [self._row_kv(i, layer_id, key_buffer, value_buffer, chain_slots[i]) for i in rows]
        bodies, keys, values, index, copied = (list(part) for part in zip(*parts))
        q = q if len(rows) == q.shape[0] else q[rows]
        if self.kernel is not None and self.kernel.accepts(q, keys, values, bodies, index):
            self.transient_bytes = max(self.transient_bytes, sum(copied))
            return self.kernel(q, keys, values, scale, bodies, index)
        out = q.new_empty((q.shape[0], q.shape[1], value_buffer.shape[-1]))
        gqa = q.shape[1] != key_buffer.shape[1]
        for i, (body, k, v, idx) in enumerate(zip(bodies, keys, values, index)):
            if idx is not None:  # gathered: SDPA reads a tensor, not slots
                k, v = k[:, idx], v[:, idx]
                copied[i] += 2 * k.numel() * k.element_size()
            if body is not None:  # the kernel refused the rest of the view: read it in full
                bk, bv = body.dequantize()
                k, v = torch.cat([bk, k], dim=1), torch.cat([bv, v], dim=1)
                copied[i] += 2 * k.numel() * k.element_size()
            o = scaled_dot_product_attention(
                q[i, :, None].unsqueeze(0), k.unsqueeze(0).to(q.dtype),
                v.unsqueeze(0).to(q.dtype), scale=scale, enable_gqa=gqa,
            )  # fmt: skip
            out[i] = o[0, :, 0]
        self.transient_bytes = max(self.transient_bytes, sum(copied))
        return out

    def _pool_columns(self, layer_id: int, rows: list[int], chain_slots: Sequence[Tensor],
                      decoder: object) -> list[Tensor] | None:  # fmt: skip
        """Each of ``rows``' pool slots at ``layer_id`` (its view's columns, then its chain; a
        row riding along: its chain), or None where ``decoder``'s last plan read the same slots
        and pages: within a forward every layer's chain is the same, and a draft row's slots and
        pages are shared by its layers, so equal lengths mean equal slots (one plan per forward,
        unless a pyramid compressor's layers keep different counts)."""
        caches = [None if self.states[i] is None else self.states[i].layers[layer_id] for i in rows]
        key = (decoder, tuple(rows),
               tuple(0 if c is None else c.float_len for c in caches),
               tuple(0 if c is None or c.block is None else c.block.pages.numel() for c in caches),
               tuple(int(chain_slots[i].numel()) for i in rows))  # fmt: skip
        if key == self._planned:
            return None
        self._planned = key
        chains = [chain_slots[i].to("cpu", torch.int64) for i in rows]
        return [chain if c is None else torch.cat([c.draft_slots()[: c.float_len], chain])
                for c, chain in zip(caches, chains)]  # fmt: skip

    def _plan_pool_kivi(self, layer_id: int, rows: list[int], chain_slots: Sequence[Tensor],
                        key_buffer: Tensor, num_q_heads: int) -> None:  # fmt: skip
        """Plan the Triton decode of ``layer_id`` over ``rows`` (see ``_pool_columns``): each
        reads its body's pages, then its slots."""
        columns = self._pool_columns(layer_id, rows, chain_slots, self.pool_kivi)
        if columns is not None:
            states = [self.states[i] for i in rows]
            bodies = [None if s is None else s.layers[layer_id].block for s in states]
            self.pool_kivi.plan(columns, bodies, key_buffer, num_q_heads)

    def _plan_paged(self, layer_id: int, rows: list[int], chain_slots: Sequence[Tensor],
                    key_buffer: Tensor, num_q_heads: int, scale: float) -> None:  # fmt: skip
        """Plan the paged decode of ``layer_id`` over ``rows`` (see ``_pool_columns``): each
        reads its view's slots, then its chain, as pages of one token."""
        index = self._pool_columns(layer_id, rows, chain_slots, self.paged)
        if index is None:
            return
        lens = [int(i.numel()) for i in index]
        device = key_buffer.device
        indptr = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
        geometry = PagedDecodeGeometry(num_q_heads, key_buffer.shape[1], key_buffer.shape[2], 1,
                                       key_buffer.dtype)  # fmt: skip
        self.paged.plan(indptr, torch.cat(index).to(device, torch.int32),
                        torch.ones(len(lens), dtype=torch.int32, device=device), geometry,
                        sm_scale=scale)  # fmt: skip
