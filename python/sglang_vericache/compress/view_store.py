"""Where a compressed layer cache keeps its full-precision tokens: a buffer of its own, or pool slots.

A layer cache's float tokens (a dropper's kept tokens, or a quantizer's unquantized residual,
then the recent window) are columns of a store, followed by free room::

    column    0 ........... n_res | n_res ......... n_float | room ........ capacity
              residual (body)     | recent window           | appends, a draft chain

``TensorViewStore`` holds them in one buffer per K and V, [H_kv, capacity, D], of its own: read
in place (``dense``), no copies. A pool store (``srt/kv/draft_rows.PoolViewStore``) holds column j of
layer l in slot ``row[j]`` of layer l's pool buffers, so the compressed KV lives in memory the
allocator counts; it is read by slot (``slots``), as paged attention reads a request's KV.
A store keeps the layer's quantized body too (``hold_block``): a buffer store as tensors, a pool
store in pages of the same row's slots (``compress/kivi_pages.py``).

A store is written and grown by one owner (its layer cache, on the scheduler thread).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from sglang_vericache.compress.base import QuantizedBlock


class ViewStore(ABC):
    """Columns of float K/V, each [H_kv, D] per column (see module doc)."""

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Columns that can be written without ``ensure``."""

    @abstractmethod
    def ensure(self, capacity: int, keep: int) -> bool:
        """Make room for at least ``capacity`` columns, keeping columns [0, keep). Returns False
        (store unchanged) where it cannot grow (a pool with no free slots)."""

    @abstractmethod
    def write(self, start: int, keys: Tensor, values: Tensor) -> None:
        """keys, values: [H_kv, n, D] into columns [start, start + n) (within ``capacity``). The
        source may be a ``read`` of this store: it is copied before it is written."""

    @abstractmethod
    def read(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        """(keys, values) of columns [start, end), each [H_kv, n, D]: views where the store is
        dense (valid until the next write or ensure), gathered copies otherwise."""

    def dense(self) -> tuple[Tensor, Tensor] | None:
        """(keys, values) [H_kv, capacity, D] where the columns are one buffer (read in place),
        else None."""
        return None

    def slots(self) -> Tensor | None:
        """[capacity] int64 pool slots of the columns where they live in a pool, else None."""
        return None

    def hold_block(self, block: QuantizedBlock | None) -> QuantizedBlock | None:
        """The layer's quantized body as this store keeps it: in tensors of its own here (a
        block read out of someone else's memory, ``detached``); a pool store writes it to its
        pages."""
        return None if block is None else block.detached()

    @property
    @abstractmethod
    def column_bytes(self) -> int:
        """Bytes one column of K and V holds."""


class TensorViewStore(ViewStore):
    """Columns in a buffer of the store's own, [H_kv, capacity, D] per K and V."""

    def __init__(self, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 0) -> None:  # fmt: skip
        self._k = torch.empty(heads, capacity, head_dim, dtype=dtype, device=device)
        self._v = torch.empty_like(self._k)

    @property
    def capacity(self) -> int:
        return self._k.shape[1]

    def ensure(self, capacity: int, keep: int) -> bool:
        if capacity <= self.capacity:
            return True
        k = self._k.new_empty((self._k.shape[0], capacity, self._k.shape[2]))
        v = torch.empty_like(k)
        k[:, :keep], v[:, :keep] = self._k[:, :keep], self._v[:, :keep]
        self._k, self._v = k, v
        return True

    def write(self, start: int, keys: Tensor, values: Tensor) -> None:
        end = start + keys.shape[1]
        if end > self.capacity:
            raise ValueError(f"write of columns [{start}, {end}) past capacity {self.capacity}")
        # a read of this buffer moved within it (a fold's window) may overlap its destination
        k = keys.clone() if _shares(keys, self._k) else keys
        v = values.clone() if _shares(values, self._v) else values
        self._k[:, start:end] = k
        self._v[:, start:end] = v

    def read(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        return self._k[:, start:end], self._v[:, start:end]

    def dense(self) -> tuple[Tensor, Tensor]:
        return self._k, self._v

    @property
    def column_bytes(self) -> int:
        return 2 * self._k.shape[0] * self._k.shape[2] * self._k.element_size()


def _shares(t: Tensor, buf: Tensor) -> bool:
    return t.numel() > 0 and t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


def copy_store(src: ViewStore, dst: ViewStore, columns: int) -> ViewStore:
    """``dst`` holding ``src``'s columns [0, columns) (``dst`` large enough); returns ``dst``."""
    if columns:
        keys, values = src.read(0, columns)
        dst.write(0, keys, values)
    return dst
