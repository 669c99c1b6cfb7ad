"""Decode-time growth of one layer's compressed KV: a recent full-precision window + periodic folds.

Newly committed tokens (their exact KV from the verify pass) are appended to a pending window in
full precision. Whenever the window holds ``recent + fold_every`` tokens, its oldest ``fold_every``
are folded into the compressed
body by ``Compressor.extend``: droppers re-select over body + new tokens with the budget of the
grown sequence, quantizers quantize the whole groups that leave their residual window, a
composition thins the chunk then quantizes. The state after appending a token sequence does not
depend on how the appends were chunked, so long generations stay within budget deterministically.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
from torch import Tensor

from sglang_vericache.compress.attend import attend
from sglang_vericache.compress.base import CompressedKV, Compressor, Observation, QuantizedBlock

GROW_MIN = 16  # columns of room added beyond the need whenever a view buffer is (re)allocated


class CompressedLayerCache:
    """Compressed KV of one layer of one request that grows during decoding.

    Not thread-safe: one owner (the request's scheduler step) mutates it through ``append``.
    ``version`` increases whenever the view changes other than by appending at its end (a fold);
    while it is unchanged, ``view()`` only ever grows at the end, so a caller may mirror it
    incrementally (the benchmark's batched draft buffers do).

    View storage: unless the body is quantized, body and window live in one contiguous buffer
    per K and V, so a draft attends over the view in place, without a copy::

        _buf_k [H_kv, capacity, D]  | body (kept tokens) | window |  room  |
                                    0                n_body   view_len  capacity

    The body's tensors and the window are views into it; ``draft_buffer(n)`` guarantees ``n``
    free columns after the view, where a draft step writes its chain's KV (scratch, never part
    of the view). A fold re-packs the buffer. A quantized body is dequantized on read
    (``view_parts``) and its window is a tensor of its own.
    """

    def __init__(self, compressor: Compressor, layer_id: int, compressed: CompressedKV, *,
                 num_layers: int | None = None, fold_every: int = 32, obs_window: int = 32,
                 recent: int = 0, observation: Observation | None = None) -> None:
        """recent: tokens that always stay in the full-precision window (never folded yet); 0
        folds the whole window every ``fold_every`` tokens (the setting the benchmark measured).
        A composition thins each folded chunk, so recent > 0 keeps the newest tokens whole.
        observation: what ``compressed`` was selected with (the prompt's last queries); folds
        score with it until appended queries replace it, so a request whose first folds come
        from plain steps (appends without queries) still has queries to score by."""
        if fold_every < 1 or obs_window < 0 or recent < 0:
            raise ValueError("fold_every must be >= 1, obs_window and recent >= 0")
        self.recent = recent
        self.compressor = compressor
        self.layer_id = layer_id
        self.num_layers = num_layers
        self.fold_every = fold_every
        self.obs_window = obs_window
        self.version = 0
        self._compressed = compressed
        h, d = compressed.num_heads, compressed.head_dim
        dev, dt = compressed.residual_keys.device, compressed.dtype
        self._keys = torch.empty(h, 0, d, dtype=dt, device=dev)  # pending window [H_kv, w, D]
        self._values = torch.empty(h, 0, d, dtype=dt, device=dev)
        self._positions = torch.empty(0, dtype=torch.int64, device=dev)  # [w]
        self._queries: Tensor | None = None  # last obs_window committed queries [H_q, <=W, D]
        self._query_positions: Tensor | None = None
        if observation is not None and observation.queries is not None and obs_window:
            self._queries = observation.queries[:, -obs_window:]
            self._query_positions = observation.query_positions[-obs_window:]
        self._buf_k: Tensor | None = None  # [H_kv, capacity, D] body + window + room
        self._buf_v: Tensor | None = None
        self._pack(0)

    @property
    def compressed(self) -> CompressedKV:
        """The compressed body (replaced, never mutated, on each fold)."""
        return self._compressed

    @property
    def num_tokens(self) -> int:
        """Tokens covered (kept or dropped) by body + window."""
        return self._compressed.num_tokens + self._positions.numel()

    @property
    def num_pending(self) -> int:
        return self._positions.numel()

    @property
    def nbytes(self) -> int:
        """Bytes stored: the body's exact bytes + the full-precision window + the view buffer's
        free room (not the observation)."""
        window = 2 * self._keys.numel() * self._keys.element_size()
        if self._buf_k is None:
            return self._compressed.nbytes + window
        room = self._buf_k.shape[1] - self.view_len
        return self._compressed.nbytes + window + 2 * room * self._buf_k[:, 0].numel() * (
            self._buf_k.element_size())  # fmt: skip

    def _pack(self, room: int) -> None:
        """(Re)allocate the view buffer with ``room`` free columns (plus ``GROW_MIN`` and an
        eighth of the view) and point body and window into it; no-op for a quantized body."""
        c = self._compressed
        if c.block is not None:  # quantized (perhaps since this fold): the window stands alone
            if self._buf_k is not None:
                self._keys, self._values = self._keys.clone(), self._values.clone()
            self._buf_k = self._buf_v = None
            return
        n_body, used = c.residual_keys.shape[1], self.view_len
        capacity = used + room + GROW_MIN + used // 8
        h, d = c.num_heads, c.head_dim
        bufs = []
        for body, window in ((c.residual_keys, self._keys), (c.residual_values, self._values)):
            buf = torch.empty(h, capacity, d, dtype=body.dtype, device=body.device)
            buf[:, :n_body] = body
            buf[:, n_body:used] = window
            bufs.append(buf)
        self._buf_k, self._buf_v = bufs
        self._compressed = replace(c, residual_keys=self._buf_k[:, :n_body],
                                   residual_values=self._buf_v[:, :n_body])  # fmt: skip
        self._keys, self._values = self._buf_k[:, n_body:used], self._buf_v[:, n_body:used]

    def clone(self, drop_last: int = 0) -> "CompressedLayerCache":
        """An independent copy without the window's newest ``drop_last`` tokens (a stored
        prefix's past-the-end positions, ``tier/demoted.DemotedPrefix``).

        The body is immutable and shared; a quantized body's window is replaced, never written
        in place, so it is shared too; a view buffer is written in place past its view, so the
        copy gets its own (``_pack``). Raises ValueError unless 0 <= drop_last <= num_pending.
        """
        if not 0 <= drop_last <= self.num_pending:
            raise ValueError(f"clone: drop_last {drop_last} outside [0, {self.num_pending}]")
        twin = copy.copy(self)
        keep = self.num_pending - drop_last
        twin._keys, twin._values = self._keys[:, :keep], self._values[:, :keep]
        twin._positions = self._positions[:keep]
        twin._pack(0)
        return twin

    def draft_buffer(self, room: int) -> tuple[Tensor, Tensor] | None:
        """(keys, values) [H_kv, capacity, D] whose first ``view_len`` columns are the view and
        whose next ``room`` columns are free for a draft chain (re-packed if short); None when
        the body is quantized (then read ``view_parts``)."""
        if self._buf_k is None:
            return None
        if self._buf_k.shape[1] < self.view_len + room:
            self._pack(room)
        return self._buf_k, self._buf_v

    def observation(self) -> Observation:
        return Observation(queries=self._queries, query_positions=self._query_positions,
                           num_layers=self.num_layers)

    def append(self, keys: Tensor, values: Tensor, positions: Tensor, queries: Tensor | None = None) -> None:
        """Appends newly committed tokens.

        keys, values: [H_kv, n, D] in the KV dtype (keys post-RoPE); positions: [n] int64, each
        greater than every position already covered. queries: [H_q, n, D] post-RoPE queries of the
        same tokens, kept (last ``obs_window``) for the scorers of later folds; droppers that score
        by attention (snapkv, h2o) need them.
        """
        if keys.shape != values.shape or keys.dim() != 3 or keys.shape[1] != positions.numel():
            raise ValueError("append: keys/values [H_kv, n, D] and positions [n] must match")
        if positions.numel() == 0:
            return
        positions = positions.to(torch.int64)
        if int(positions[0]) < self.num_tokens or bool((positions.diff() <= 0).any()):
            raise ValueError("append: positions must increase and follow the covered tokens")
        if queries is not None and (queries.dim() != 3 or queries.shape[1] != positions.numel()):
            raise ValueError("append: queries must be [H_q, n, D]")
        # Feed up to each fold boundary, then fold: the observation a fold sees (and so the state)
        # is the same however the caller chunks its appends.
        done = 0
        while done < positions.numel():
            take = min(positions.numel() - done, self.recent + self.fold_every - self._positions.numel())
            sl = slice(done, done + take)
            self._push(keys[:, sl], values[:, sl], positions[sl], None if queries is None else queries[:, sl])
            done += take
            if self._positions.numel() >= self.recent + self.fold_every:
                self._fold()

    def _push(self, keys: Tensor, values: Tensor, positions: Tensor, queries: Tensor | None) -> None:
        if queries is not None:
            qs = queries if self._queries is None else torch.cat([self._queries, queries], dim=1)
            qp = positions if self._query_positions is None else torch.cat([self._query_positions, positions])
            self._queries, self._query_positions = qs[:, -self.obs_window :], qp[-self.obs_window :]
        if self._buf_k is None:
            self._keys = torch.cat([self._keys, keys.to(self._keys.dtype)], dim=1)
            self._values = torch.cat([self._values, values.to(self._values.dtype)], dim=1)
        else:
            n = keys.shape[1]
            if self._buf_k.shape[1] < self.view_len + n:
                self._pack(n)
            n_body, end = self._compressed.residual_keys.shape[1], self.view_len
            self._buf_k[:, end : end + n] = keys
            self._buf_v[:, end : end + n] = values
            self._keys = self._buf_k[:, n_body : end + n]
            self._values = self._buf_v[:, n_body : end + n]
        self._positions = torch.cat([self._positions, positions])

    def _fold(self) -> None:
        f = self.fold_every
        self._compressed = self.compressor.extend(
            self.layer_id, self._compressed, self._keys[:, :f], self._values[:, :f],
            self._positions[:f], self.observation(),
        )
        self._keys, self._values = self._keys[:, f:], self._values[:, f:]
        self._positions = self._positions[f:]
        self._pack(0)  # the new body and the rest of the window, contiguous again
        self.version += 1

    @property
    def view_len(self) -> int:
        """T_view: tokens a query attends over in ``view()`` (kept body + pending window)."""
        return self._compressed.num_kept + self._positions.numel()

    def view_parts(self) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """((body keys, body values), (window keys, window values)), each [H_kv, n, D] in the
        KV dtype: ``view()`` without the concatenation, for a caller that joins the parts with
        more of its own (a quantized body is dequantized; a dropper's is its stored tensors)."""
        return self._compressed.dequantize(), (self._keys, self._values)

    def packed_view_parts(self) -> tuple[QuantizedBlock | None, tuple[Tensor, Tensor],
                                         tuple[Tensor, Tensor]]:  # fmt: skip
        """(quantized block or None, (residual keys, residual values), (window keys, window
        values)), each [H_kv, n, D] in the KV dtype: ``view_parts`` for a reader of packed codes
        (``ops/cpu_draft_decode.py``), the block as stored and the body's unquantized residual
        apart, so the caller joins the full-precision tokens once, with its own."""
        c = self._compressed
        return c.block, (c.residual_keys, c.residual_values), (self._keys, self._values)

    def view(self) -> tuple[Tensor, Tensor, Tensor]:
        """(keys, values [H_kv, T_view, D] in the KV dtype, positions [H_kv, T_view] int64)."""
        (ck, cv), (wk, wv) = self.view_parts()
        h = ck.shape[0]
        pos = torch.cat([self._compressed.positions, self._positions.expand(h, -1)], dim=1)
        return torch.cat([ck, wk], dim=1), torch.cat([cv, wv], dim=1), pos

    def attend(self, q: Tensor, q_positions: Tensor, scale: float) -> Tensor:
        """Reference attention of q [H_q, n, D] (positions [n]) over the view; [H_q, n, D]."""
        keys, values, positions = self.view()
        return attend(q, q_positions, keys, values, positions, scale)

    def check_integrity(self) -> None:
        """Raises AssertionError if the internal state is inconsistent."""
        c = self._compressed
        assert self._keys.shape == self._values.shape, "window keys/values differ in shape"
        assert self._keys.shape[1] == self._positions.numel(), "window positions out of sync"
        assert self._positions.numel() < self.recent + self.fold_every, "window not folded"
        pos = c.positions
        assert pos.shape == (c.num_heads, c.num_kept), "kept positions shape"
        if c.num_kept > 1:
            assert bool((pos.diff(dim=1) > 0).all()), "kept positions not increasing per head"
        if c.num_kept:
            assert int(pos.max()) < c.num_tokens, "kept position beyond covered tokens"
        if self._positions.numel():
            assert int(self._positions[0]) >= c.num_tokens, "window overlaps the body"
            assert bool((self._positions.diff() > 0).all()), "window positions not increasing"
        stored = c.block.nbytes if c.block is not None else 0
        stored += 2 * c.residual_keys.numel() * c.residual_keys.element_size()
        if c.kept_positions is not None:
            stored += c.kept_positions.numel() * c.kept_positions.element_size()
        assert stored == c.nbytes, "nbytes does not match the stored tensors"
        if self._buf_k is not None:
            n_body = c.residual_keys.shape[1]
            assert c.block is None, "a quantized body has no view buffer"
            assert self._buf_k.shape[1] >= self.view_len, "view buffer shorter than the view"
            for body, window, buf in ((c.residual_keys, self._keys, self._buf_k),
                                      (c.residual_values, self._values, self._buf_v)):
                # (an empty slice's data pointer is unspecified: only compare non-empty ones)
                assert not body.numel() or body.data_ptr() == buf.data_ptr(), "body not at head"
                assert not window.numel() or window.data_ptr() == buf[:, n_body:].data_ptr(), (
                    "window not after body")  # fmt: skip
        if self._queries is not None:
            assert self._queries.shape[1] == self._query_positions.numel() <= max(self.obs_window, 0)
