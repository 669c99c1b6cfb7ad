"""The ``vericache`` attention backend: torch_native plus compressed drafting and a fast verify.

Three forward kinds reach it (``AttentionBackend.forward`` dispatches DECODE to
``forward_decode``, everything else to ``forward_extend``):

- EXTEND (prefill): a batch of fresh prompts takes the stock torch_native path (prompt KV
  bit-identical to plain SGLang's). Where a request extends a prefix (a radix hit, a fetched tier
  prefix, a later chunk of a chunked prefill), its new tokens' queries attend over [0, seq_len)
  with a causal mask offset by the prefix: O(new x L), where torch_native runs a (discarded)
  query for every prefix position too, O(L^2), so a cached prefix saved only its MLP work. This
  is what FlashInfer's and Triton's prefill do on a GPU. While the worker holds a
  ``QueryCapture``, the last W queries of each request are recorded for the compressors that
  score by attention (SnapKV, H2O).
- DECODE while the worker holds a ``DraftPlan`` (drafting): each request attends over its
  compressed view of the committed context plus the full-precision KV of its own draft chain,
  in place in the view's buffer (``srt/attention/draft_attention.py``)::

      positions   0 ............. base-1 | base ... seq_len-1
      keys        compressed view (kept / | pool slots written by this
                  dequantized tokens)     | step's draft forwards
- TARGET_VERIFY: the draft is checked against the full KV with the same masked attention, D
  queries per request over [0, base + D): O(D * L) (stock torch_native's extend would take 16 s
  for one verify at 8k). On a CPU with float32 KV every row of a layer attends in one call of
  the verify kernel (``ops/cpu_verify_decode.py``: 1.56x torch's SDPA loop at 8 rows x 6.3k),
  reading each row's full KV where the ledger finds it. A row that drafts less than the
  batch's width brings only its 1 + drafts queries (``live_queries``, set by the worker; the
  forward's rows are then ragged: ``srt/decode/batch_inputs.py``), and the kernel takes them
  ragged as they come.

The full KV of a request is read through the offload ledger (``srt/kv/offload.py``): positions the
worker moved to host memory come from there, the rest from the pool. Plain DECODE steps over a
batch with offloaded rows take the same per-request path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from torch.nn.functional import scaled_dot_product_attention

from sglang_vericache.compress.attend import (PADDED_MIN_SHARE, group_mask, grouped_sdpa,
                                              suffix_causal_sdpa)
from sglang_vericache.ops.cpu_verify_decode import CpuVerifyDecode, load_cpu_verify_decode
from sglang_vericache.srt.attention.draft_attention import DraftPlan
from sglang_vericache.srt.context import open_context
from sglang_vericache.verify.step_profile import StepClock

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

# Most queries of one request attended at once by the masked path (its mask is [block, L] bool).
QUERY_BLOCK = 1024


@dataclass(slots=True)
class QueryCapture:
    """Records post-RoPE queries per batch row and layer: the last ``window`` of each row.

    queries[i][layer] is [H_q, n, D] (n <= window), appended by each forward in order.
    """

    window: int
    queries: list[dict[int, torch.Tensor]] = field(default_factory=list)

    def record(self, layer_id: int, q: torch.Tensor, row_lens: list[int]) -> None:
        """q: [sum(row_lens), H_q, D] for the rows of one forward, in row order."""
        if not self.queries:
            self.queries = [{} for _ in row_lens]
        start = 0
        for i, n in enumerate(row_lens):
            rows = q[start + max(0, n - self.window) : start + n].transpose(0, 1).clone()
            prev = self.queries[i].get(layer_id)
            if prev is not None:
                rows = torch.cat([prev, rows], dim=1)[:, -self.window :]
            self.queries[i][layer_id] = rows
            start += n


class VeriCacheAttnBackend(TorchNativeAttnBackend):
    """torch_native with compressed-view drafting and an O(D*L) verify (see module doc).

    The worker sets ``draft`` / ``capture`` / ``clock`` / ``live_queries`` around its forwards
    and clears them after; with all None the backend behaves exactly like torch_native (plus
    the fast verify).
    """

    def __init__(self, model_runner) -> None:
        super().__init__(model_runner)
        self.draft: DraftPlan | None = None
        self.capture: QueryCapture | None = None
        # per row of a verify, its queries (1 + its drafts; None: the width, every row): the
        # forward leaves out the columns that would pad a row to the batch's width
        self.live_queries: list[int] | None = None
        self.clock: StepClock | None = None  # the worker's profile of the current decode step
        self.ledger = open_context(self.req_to_token_pool).ledger  # the first part built
        # a verify's causal masks, built at its first layer and shared by the others
        self._verify_masks: tuple[ForwardBatch | None, dict[tuple[int, ...], torch.Tensor]] = (
            None, {})  # fmt: skip

    def _write_kv(self, layer, fb, k, v, save_kv_cache: bool) -> None:
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(fb.out_cache_loc, self.swa_out_cache_loc), k, v
            )

    @functools.cached_property
    def verify_kernel(self) -> CpuVerifyDecode | None:
        """The CPU verify kernel (built with the draft kernel at the worker's start) where the
        pool's KV is float32 on the CPU; else None, and the SDPA loop serves (decided once,
        not per layer after the rows are read)."""
        keys = self.token_to_kv_pool.get_key_buffer(0)
        if keys.device.type != "cpu" or keys.dtype != torch.float32:
            return None
        return load_cpu_verify_decode()

    def _full_kv(self, layer_id: int, row: int, end: int):
        """Exact K/V of positions [0, end) of a row (host-offloaded ranges included)."""
        table = self.req_to_token_pool.req_to_token
        return self.ledger.read(self.token_to_kv_pool, table, layer_id, row, end)

    def forward_extend(self, q, k, v, layer: RadixAttention, fb: ForwardBatch, save_kv_cache=True):
        q3 = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        if fb.forward_mode.is_target_verify():
            width = fb.spec_info.draft_token_num  # seq_lens are the committed KV: drafts follow
            new = self.live_queries or [width] * len(fb.seq_lens_cpu)
            out = self._verify(q3, k, v, layer, fb, new, save_kv_cache)
        elif _extends_a_prefix(layer, fb):  # seq_lens include the extended tokens
            new = list(fb.extend_seq_lens_cpu)
            ends = fb.seq_lens_cpu.tolist()
            out = self._attend_new_tokens(q3, k, v, layer, fb, new, ends, save_kv_cache)
        else:
            new = fb.extend_seq_lens_cpu
            out = super().forward_extend(q, k, v, layer, fb, save_kv_cache)
        if self.capture is not None and new is not None:
            self.capture.record(layer.layer_id, q3, list(new))
        return out

    def _verify(self, q3, k, v, layer: RadixAttention, fb: ForwardBatch, live: list[int],
                save_kv_cache: bool):  # fmt: skip
        """Each row's ``live[i]`` verify queries (1 + its drafts, of the batch's width) over
        its full KV: one kernel call for the layer where the kernel takes it, else
        ``_attend_new_tokens``. q3: [sum(live), H_q, D], the rows ragged where a row drafts
        less than the width (``batch_inputs.set_verify_inputs``); returns
        [sum(live), H_q * D_v]."""
        bases = fb.seq_lens_cpu.tolist()
        ends = [b + n for b, n in zip(bases, live)]  # each row's keys through its last query
        kernel = self.verify_kernel
        if kernel is None or layer.qk_head_dim != layer.v_head_dim:
            return self._attend_new_tokens(q3, k, v, layer, fb, live, ends, save_kv_cache,
                                           shared_masks=True)  # fmt: skip
        self._write_kv(layer, fb, k, v, save_kv_cache)
        rows = fb.req_pool_indices.tolist()
        # each row's keys through its last live query: the width's padding past a row's drafts
        # has no query and no KV written, so nothing reads it
        kv = [self._full_kv(layer.layer_id, row, end) for row, end in zip(rows, ends)]
        keys, values = [kv_k for kv_k, _ in kv], [kv_v for _, kv_v in kv]
        if not kernel.accepts(q3, keys, values, live):
            return self._attend_new_tokens(q3, None, None, layer, fb, live, ends, False,
                                           shared_masks=True)  # fmt: skip
        if self.clock is not None:  # gathered rows (not read in place) live until the call ends
            self.clock.note_transient(sum(2 * kk.numel() * kk.element_size()
                                          for kk in keys if _copied(kk)))  # fmt: skip
        return kernel(q3, keys, values, layer.scaling, live).view(-1, q3.shape[1] * q3.shape[2])

    def _attend_new_tokens(self, q3, k, v, layer: RadixAttention, fb: ForwardBatch,
                           new: list[int], ends: list[int], save_kv_cache: bool,
                           shared_masks: bool = False):  # fmt: skip
        """Causal attention of each request's ``new[i]`` last positions over its full KV: row i's
        queries are positions [end - new[i], end) (end = ``ends[i]``) and attend over [0, end),
        read through the offload ledger (host ranges included)::

            keys      0 ..................... end - n | ............ end
            query j   sees every key <= its position  | (causal within the new tokens)

        q3: [sum(new), H_q, D]; returns [sum(new), H_q * D_v]. A row whose new tokens are most
        of its keys (``PADDED_MIN_SHARE``: a prefill chunk, or a fresh request batched with one)
        takes ``suffix_causal_sdpa``, torch_native's own computation; the others go masked, in
        blocks of at most ``QUERY_BLOCK`` queries so the mask stays small at long contexts.
        ``shared_masks`` (a verify: always masked): keep each
        row's mask for the forward's other layers (a verify's few queries per row; a long
        prefix extend's masks would be large, and its attention dwarfs building them)."""
        self._write_kv(layer, fb, k, v, save_kv_cache)
        out = q3.new_empty((q3.shape[0], layer.tp_q_head_num, layer.v_head_dim))
        group = layer.tp_q_head_num // layer.tp_k_head_num
        start = 0
        for i, end in enumerate(ends):
            n, row = new[i], int(fb.req_pool_indices[i])
            keys, values = self._full_kv(layer.layer_id, row, end)
            if self.clock is not None and _copied(keys):  # gathered, not read in place
                self.clock.note_transient(2 * keys.numel() * keys.element_size())
            keys, values = keys.to(q3.dtype), values.to(q3.dtype)  # once per row, not per block
            if not shared_masks and n >= PADDED_MIN_SHARE * end:  # a prefill chunk, mostly new
                qi = q3[start : start + n].transpose(0, 1)
                out[start : start + n] = suffix_causal_sdpa(qi, keys, values,
                                                            layer.scaling).transpose(0, 1)
                start += n
                continue
            for lo in range(0, n, QUERY_BLOCK):
                hi = min(n, lo + QUERY_BLOCK)
                qi = q3[start + lo : start + hi].transpose(0, 1)  # [H_q, hi - lo, D]
                mask = self._causal_mask(fb if shared_masks else None, group, end, n, lo, hi)
                o = grouped_sdpa(qi, keys, values, layer.scaling, mask)
                out[start + lo : start + hi] = o.transpose(0, 1)
            start += n
        return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    def _causal_mask(self, fb: ForwardBatch | None, group: int, end: int, n: int, lo: int,
                     hi: int) -> torch.Tensor:  # fmt: skip
        """[group * (hi - lo), end] bool, grouped for ``grouped_sdpa``: queries at positions
        end - n + [lo, hi) over keys [0, end). Kept for the rest of forward ``fb`` (None: not
        kept): it depends on the row's length and block, not on the layer."""
        owner, masks = self._verify_masks
        key = (group, end, n, lo, hi)
        if fb is not None and owner is fb and key in masks:
            return masks[key]
        k_pos = torch.arange(end, device=self.device)[None, :]
        q_pos = torch.arange(end - n + lo, end - n + hi, device=self.device)
        mask = group_mask(k_pos <= q_pos[:, None], group)
        if fb is not None:
            if owner is not fb:
                self._verify_masks = (fb, masks := {})
            masks[key] = mask
        return mask

    def forward_decode(self, q, k, v, layer: RadixAttention, fb: ForwardBatch, save_kv_cache=True):
        rows = fb.req_pool_indices.tolist()
        if self.draft is None and not any(self.ledger.span(r) is not None for r in rows):
            return super().forward_decode(q, k, v, layer, fb, save_kv_cache)
        self._write_kv(layer, fb, k, v, save_kv_cache)
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        if self.draft is not None:
            out = self._draft_attend(q3, layer, rows, fb.seq_lens_cpu.tolist())
            return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)
        out = q.new_empty((q3.shape[0], layer.tp_q_head_num, layer.v_head_dim))
        gqa = layer.tp_q_head_num != layer.tp_k_head_num
        for i, seq_len in enumerate(fb.seq_lens_cpu.tolist()):  # full-KV decode, row by row
            keys, values = self._full_kv(layer.layer_id, rows[i], seq_len)
            qi = q3[i : i + 1].transpose(0, 1)  # [H_q, 1, D]
            o = scaled_dot_product_attention(
                qi.unsqueeze(0), keys.unsqueeze(0).to(qi.dtype), values.unsqueeze(0).to(qi.dtype),
                scale=layer.scaling, enable_gqa=gqa,
            )  # fmt: skip
            out[i] = o.squeeze(0).transpose(0, 1)[0]
        return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    def _draft_attend(self, q3, layer: RadixAttention, rows: list[int], seq_lens: list[int]):
        """One draft forward's attention at ``layer`` (``srt/attention/draft_attention.py``)."""
        table = self.req_to_token_pool.req_to_token
        chains = [table[row, base:end].to(torch.int64)
                  for row, base, end in zip(rows, self.draft.base_lens, seq_lens)]  # fmt: skip
        lid = layer.layer_id
        return self.draft.attend(
            q3, lid, self.token_to_kv_pool.get_key_buffer(lid),
            self.token_to_kv_pool.get_value_buffer(lid), chains, layer.scaling,
        )  # fmt: skip


def _extends_a_prefix(layer: RadixAttention, fb: ForwardBatch) -> bool:
    """An extend where some request continues KV already in place (radix hit, fetched prefix,
    later prefill chunk), of a plain causal self-attention layer: the O(new x L) path serves it.
    Cross, encoder-only and sliding-window layers keep torch_native's path."""
    prefix = fb.extend_prefix_lens_cpu
    return bool(prefix) and any(prefix) and fb.extend_seq_lens_cpu is not None and not (
        layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY
        or (layer.sliding_window_size is not None and layer.sliding_window_size > -1)
        or fb.encoder_lens is not None)  # fmt: skip


def _copied(t: torch.Tensor) -> bool:
    """A tensor that owns its storage (a gather or concatenation), not a view into the pool or
    a host buffer (those storages hold more than the tensor: other slots, the values too)."""
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()
