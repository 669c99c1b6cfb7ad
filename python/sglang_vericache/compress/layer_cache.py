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

import torch
from torch import Tensor

from sglang_vericache.compress.attend import attend
from sglang_vericache.compress.base import CompressedKV, Compressor, Observation, QuantizedBlock
from sglang_vericache.compress.view_store import TensorViewStore, ViewStore, copy_store

GROW_MIN = 16  # columns of room added beyond the need whenever a view buffer is (re)allocated


class CompressedLayerCache:
    """Compressed KV of one layer of one request that grows during decoding.

    Not thread-safe: one owner (the request's scheduler step) mutates it through ``append``.
    ``version`` increases whenever the view changes other than by appending at its end (a fold);
    while it is unchanged, ``view()`` only ever grows at the end, so a caller may mirror it
    incrementally (the benchmark's batched draft buffers do).

    Storage: a quantized body's block is its own tensors; every full-precision token (a
    dropper's kept tokens, a quantizer's residual, then the recent window) is a column of a
    ``ViewStore``, with free room after them where a draft step writes its chain's KV::

        store columns   | residual (body) | window |  room  |
                        0              n_res   n_float  capacity

    The store is a buffer of its own (``TensorViewStore``: a draft attends over it in place) or
    slots of the device pool (``move_to``; ``srt/kv/draft_rows.py``), where the allocator counts it;
    the store keeps the block too (``ViewStore.hold_block``: a pool writes a KIVI block to pages
    of slots). A fold rewrites the columns and the block in place.
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
        dev = compressed.residual_keys.device
        self._layout = (compressed.num_heads, compressed.head_dim, compressed.dtype, dev)
        self._store: ViewStore = TensorViewStore(*self._layout)
        self._positions = torch.empty(0, dtype=torch.int64, device=dev)  # window positions [w]
        self._queries: Tensor | None = None  # last obs_window committed queries [H_q, <=W, D]
        self._query_positions: Tensor | None = None
        if observation is not None and observation.queries is not None and obs_window:
            self._queries = observation.queries[:, -obs_window:]
            self._query_positions = observation.query_positions[-obs_window:]
        self._set_body(compressed, *self._store.read(0, 0))

    def _set_body(self, body: CompressedKV, window_k: Tensor, window_v: Tensor) -> None:
        """Make ``body`` the compressed body, followed by the window ``window_k``/``window_v``
        ([H_kv, w, D], ``_positions`` already its w positions), written to the store."""
        self._block, self._kept = self._store.hold_block(body.block), body.kept_positions
        self._body_tokens, n_res = body.num_tokens, body.residual_keys.shape[1]
        window = (window_k.clone(), window_v.clone())  # may be columns the body overwrites
        self._n_res = 0  # the store's columns are stale until both writes land
        self._room(n_res + window[0].shape[1], keep=0)
        self._store.write(0, body.residual_keys, body.residual_values)
        self._store.write(n_res, *window)
        self._n_res = n_res

    def _room(self, columns: int, keep: int | None = None) -> None:
        """Make the store hold at least ``columns`` columns, keeping the first ``keep`` (default:
        the view's). A pool that cannot grow hands the columns to a buffer of this cache's own:
        drafting goes on, and the pool's accounting is short by them (logged by the pool)."""
        keep = self.float_len if keep is None else keep
        if columns <= self._store.capacity:
            return
        capacity = columns + GROW_MIN + columns // 8
        if not self._store.ensure(capacity, keep):
            self._store = copy_store(self._store, self._private(capacity), keep)

    def _private(self, capacity: int) -> TensorViewStore:
        return TensorViewStore(*self._layout, capacity)

    @property
    def store(self) -> ViewStore:
        """Where the full-precision columns live (see class doc)."""
        return self._store

    def move_to(self, store: ViewStore | None = None) -> None:
        """Copy the columns into ``store`` (None: a buffer of this cache's own) and keep them
        there from now on; the old store is no longer read or written. Raises ValueError
        (nothing moved) where ``store`` cannot hold them."""
        n = self.float_len
        store = self._private(n + GROW_MIN) if store is None else store
        if not store.ensure(n + GROW_MIN, 0):
            raise ValueError(f"move_to: the store cannot hold {n} columns")
        self._store = copy_store(self._store, store, n)
        self._block = store.hold_block(self._block)  # read out of the old store first

    @property
    def compressed(self) -> CompressedKV:
        """The compressed body (a new record on each call; its residual read from the store:
        views where the store is dense, copies where it is a pool)."""
        rk, rv = self._store.read(0, self._n_res)
        return CompressedKV(self._block, rk, rv, self._kept, self._body_tokens)

    @property
    def num_tokens(self) -> int:
        """Tokens covered (kept or dropped) by body + window."""
        return self._body_tokens + self._positions.numel()

    @property
    def num_pending(self) -> int:
        return self._positions.numel()

    @property
    def float_len(self) -> int:
        """Full-precision columns in the store: the body's residual + the window."""
        return self._n_res + self._positions.numel()

    @property
    def nbytes(self) -> int:
        """Bytes stored: the block's exact bytes, the kept-position index and the full-precision
        columns (not the store's free room, nor the observation)."""
        index = 0 if self._kept is None else self._kept.numel() * self._kept.element_size()
        block = 0 if self._block is None else self._block.nbytes
        return block + index + self._store.column_bytes * self.float_len

    @property
    def nbytes_in_pool(self) -> int:
        """Of ``nbytes``, those in pool slots (a draft row's columns and pages)."""
        lodged = self._store.slots() is not None
        block = self._block.nbytes if self._block is not None and self._block.in_pool else 0
        return (self._store.column_bytes * self.float_len if lodged else 0) + block

    def clone(self, drop_last: int = 0) -> "CompressedLayerCache":
        """An independent copy without the window's newest ``drop_last`` tokens (a stored
        prefix's past-the-end positions, ``tier/demoted.DemotedPrefix``), in a buffer of its own.

        A block in tensors is immutable and shared; one in pool pages is copied out. Raises
        ValueError unless 0 <= drop_last <= num_pending.
        """
        if not 0 <= drop_last <= self.num_pending:
            raise ValueError(f"clone: drop_last {drop_last} outside [0, {self.num_pending}]")
        twin = copy.copy(self)
        twin._positions = self._positions[: self.num_pending - drop_last]
        n = twin.float_len
        twin._store = copy_store(self._store, self._private(n + GROW_MIN), n)
        twin._block = twin._store.hold_block(self._block)
        return twin

    def draft_buffer(self, room: int) -> tuple[Tensor, Tensor] | None:
        """(keys, values) [H_kv, capacity, D] whose first ``float_len`` columns are the
        full-precision tokens and whose next ``room`` columns are free for a draft chain (grown
        if short); None where the store is not one buffer (a pool: ``draft_slots``)."""
        if self._store.dense() is None:
            return None
        self._room(self.float_len + room)
        return self._store.dense()

    def draft_slots(self) -> Tensor | None:
        """[capacity] int64 pool slots of the columns (the first ``float_len`` hold them), or
        None where the store is a buffer of its own. A draft chain needs no room here: its KV
        is in the pool already, read by its own slots."""
        return self._store.slots()

    @property
    def block(self) -> QuantizedBlock | None:
        """The quantized part of the body (its oldest tokens), or None."""
        return self._block

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
        end = self.float_len
        self._room(end + keys.shape[1])
        self._store.write(end, keys, values)
        self._positions = torch.cat([self._positions, positions])

    def _fold(self) -> None:
        f, n_res = self.fold_every, self._n_res
        wk, wv = self._store.read(n_res, self.float_len)
        folded = self.compressor.extend(
            self.layer_id, self.compressed, wk[:, :f], wv[:, :f], self._positions[:f],
            self.observation(),
        )
        self._positions = self._positions[f:]
        self._set_body(folded, wk[:, f:], wv[:, f:])  # the new body, then the rest of the window
        self.version += 1

    @property
    def view_len(self) -> int:
        """T_view: tokens a query attends over in ``view()`` (kept body + pending window)."""
        n_q = 0 if self._block is None else self._block.num_tokens
        return n_q + self.float_len

    def _window(self) -> tuple[Tensor, Tensor]:
        return self._store.read(self._n_res, self.float_len)

    def view_parts(self) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """((body keys, body values), (window keys, window values)), each [H_kv, n, D] in the
        KV dtype: ``view()`` without the concatenation, for a caller that joins the parts with
        more of its own (a quantized body is dequantized)."""
        return self.compressed.dequantize(), self._window()

    def packed_view_parts(self) -> tuple[QuantizedBlock | None, tuple[Tensor, Tensor],
                                         tuple[Tensor, Tensor]]:  # fmt: skip
        """(quantized block or None, (residual keys, residual values), (window keys, window
        values)), each [H_kv, n, D] in the KV dtype: ``view_parts`` for a reader of packed codes
        (``ops/cpu_draft_decode.py``), the block as stored and the body's unquantized residual
        apart."""
        return self._block, self._store.read(0, self._n_res), self._window()

    def view(self) -> tuple[Tensor, Tensor, Tensor]:
        """(keys, values [H_kv, T_view, D] in the KV dtype, positions [H_kv, T_view] int64)."""
        body = self.compressed
        (ck, cv), (wk, wv) = body.dequantize(), self._window()
        h = ck.shape[0]
        pos = torch.cat([body.positions, self._positions.expand(h, -1)], dim=1)
        return torch.cat([ck, wk], dim=1), torch.cat([cv, wv], dim=1), pos

    def attend(self, q: Tensor, q_positions: Tensor, scale: float) -> Tensor:
        """Reference attention of q [H_q, n, D] (positions [n]) over the view; [H_q, n, D]."""
        keys, values, positions = self.view()
        return attend(q, q_positions, keys, values, positions, scale)

    def check_integrity(self) -> None:
        """Raises AssertionError if the internal state is inconsistent."""
        c = self.compressed
        assert self._store.capacity >= self.float_len, "store shorter than its columns"
        pos = c.positions
        assert pos.shape == (c.num_heads, c.num_kept), "kept positions shape"
        if c.num_kept > 1:
            assert bool((pos.diff(dim=1) > 0).all()), "kept positions not increasing per head"
        if c.num_kept:
            assert int(pos.max()) < c.num_tokens, "kept position beyond covered tokens"
        assert self._positions.numel() < self.recent + self.fold_every, "window not folded"
        if self._positions.numel():
            assert int(self._positions[0]) >= c.num_tokens, "window overlaps the body"
            assert bool((self._positions.diff() > 0).all()), "window positions not increasing"
        stored = c.block.nbytes if c.block is not None else 0
        stored += 2 * c.residual_keys.numel() * c.residual_keys.element_size()
        if c.kept_positions is not None:
            stored += c.kept_positions.numel() * c.kept_positions.element_size()
        assert stored == c.nbytes, "nbytes does not match the stored tensors"
        if self._queries is not None:
            assert self._queries.shape[1] == self._query_positions.numel() <= max(self.obs_window, 0)
