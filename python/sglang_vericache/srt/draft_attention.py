"""Draft attention over compressed views, in place: planned once per step, run per layer.

A dropper's compressed cache keeps its view (kept tokens, then the recent window) contiguous in
a buffer with free room after it (``CompressedLayerCache.draft_buffer``). Each draft forward
writes the row's chain KV (this step's drafts so far, read from their pool slots) into that
room and attends over the buffer's head, so the view is never copied::

    buffer of row i, layer l   | view (body | window)      | chain (scratch) | free |
                               0              view_len[l][i]      + n_chain

Queries sit at their true positions (keys are post-RoPE, so a view's gaps do not matter). A
quantized body has no such buffer. The batched CPU kernel reads a KIVI body packed, as stored,
and only its full-precision tokens (residual, window) are concatenated with the chain::

    row i, layer l   | packed body (codes, scales) | residual | window | chain |
                       read in place                 copied: a few dozen tokens

Elsewhere the body is dequantized and concatenated with the rest for one layer of the batch at
a time. Those copies are the only transient tensors drafting builds outside the pool
(``transient_bytes``). A row without a compressed state rides along in the forward, attending
over its own chain only; its drafts are never verified.

On a CPU with float32 views the rows of a layer attend in one call of a batched kernel
(``ops/cpu_draft_decode.py``: one parallel region, each view read in place); elsewhere, or
where that kernel could not be built, one SDPA call per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention

from sglang_vericache.ops.cpu_draft_decode import CpuDraftDecode


@dataclass(slots=True)
class DraftPlan:
    """One draft step of a batch.

    base_lens[i]: committed KV positions of row i when the step starts.
    states[i]: row i's ``RequestDraftState`` (its per-layer compressed caches), or None for a
        row that rides along without drafting.
    drafts: draft forwards the step runs (the chain grows to this many tokens).
    view_lens[layer][i]: T_view of row i's cache of ``layer`` (0 for a row riding along).
    kernel: the batched CPU kernel (None: one SDPA call per row and layer).
    transient_bytes: the most bytes of view + chain a forward copied at one layer, over all its
        rows (0 when every drafted row attends in place): at most one layer's view of the batch.
    """

    base_lens: list[int]
    states: Sequence[Any | None]
    drafts: int
    kernel: CpuDraftDecode | None = None
    view_lens: list[list[int]] = field(init=False)
    transient_bytes: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if len(self.base_lens) != len(self.states):
            raise ValueError("DraftPlan: one base length per state")
        layers = next((len(s.layers) for s in self.states if s is not None), 0)
        self.view_lens = [[0 if s is None else s.layers[layer].view_len for s in self.states]
                          for layer in range(layers)]  # fmt: skip
        for state in self.states:  # room for the chain after every view, made once per step
            for cache in () if state is None else state.layers:
                cache.draft_buffer(self.drafts)

    @property
    def view_tokens(self) -> list[int]:
        """Per row, the first layer's T_view (what a draft forward's attention reads)."""
        return self.view_lens[0] if self.view_lens else [0] * len(self.states)

    def _row_kv(self, i: int, layer_id: int, chain_k: Tensor, chain_v: Tensor
                ) -> tuple[Any | None, Tensor, Tensor, int]:  # fmt: skip
        """Row i's packed body (a quantized block the kernel reads as stored, or None) and the
        keys and values after it, view then chain, each [H_kv, n, D], and the bytes copied to
        make them (0 where read in place)."""
        state, n = self.states[i], chain_k.shape[1]
        if state is None:  # a few tokens: made contiguous, as the batched kernel reads them
            return None, chain_k.contiguous(), chain_v.contiguous(), 0
        cache = state.layers[layer_id]
        at = self.view_lens[layer_id][i]
        buffers = cache.draft_buffer(self.drafts)
        if buffers is not None and buffers[0].shape[1] >= at + n:
            keys, values = buffers
            keys[:, at : at + n] = chain_k  # scratch after the view: not part of it
            values[:, at : at + n] = chain_v
            return None, keys[:, : at + n], values[:, : at + n], 0
        if self.kernel is not None and self.kernel.accepts_body(cache.compressed.block):
            body, (rk, rv), (wk, wv) = cache.packed_view_parts()
        else:  # dequantized: the whole body in full precision
            body, ((rk, rv), (wk, wv)) = None, cache.view_parts()
        keys, values = torch.cat([rk, wk, chain_k], dim=1), torch.cat([rv, wv, chain_v], dim=1)
        return body, keys, values, 2 * keys.numel() * keys.element_size()

    def attend(self, q: Tensor, layer_id: int, key_buffer: Tensor, value_buffer: Tensor,
               chain_slots: Sequence[Tensor], scale: float) -> Tensor:  # fmt: skip
        """Attention of one draft forward's queries at one layer.

        q: [B, H_q, D] (one query per row). key_buffer / value_buffer: the pool's buffers of this
        layer, [slots, H_kv, D]. chain_slots[i]: [n_i] int64 pool slots of row i's positions
        base_i .. seq_len_i - 1 (this step's drafts so far, the current one included).
        Returns [B, H_q, D_v].
        """
        rows = [self._row_kv(i, layer_id, key_buffer[slots].transpose(0, 1),
                             value_buffer[slots].transpose(0, 1))
                for i, slots in enumerate(chain_slots)]  # fmt: skip
        bodies = [body for body, _, _, _ in rows]
        keys, values = [k for _, k, _, _ in rows], [v for _, _, v, _ in rows]
        self.transient_bytes = max(self.transient_bytes, sum(copied for *_, copied in rows))
        if self.kernel is not None and self.kernel.accepts(q, keys, values, bodies):
            return self.kernel(q, keys, values, scale, bodies)
        out = q.new_empty((q.shape[0], q.shape[1], value_buffer.shape[-1]))
        gqa = q.shape[1] != key_buffer.shape[1]
        for i, (body, k, v) in enumerate(zip(bodies, keys, values)):
            if body is not None:  # the kernel refused the rest of the view: read it in full
                bk, bv = body.dequantize()
                k, v = torch.cat([bk, k], dim=1), torch.cat([bv, v], dim=1)
            o = scaled_dot_product_attention(
                q[i, :, None].unsqueeze(0), k.unsqueeze(0).to(q.dtype),
                v.unsqueeze(0).to(q.dtype), scale=scale, enable_gqa=gqa,
            )  # fmt: skip
            out[i] = o[0, :, 0]
        return out
