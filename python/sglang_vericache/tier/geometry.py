"""KV geometry and the chunk layout every full-KV tier stores.

A *chunk* is the full K and V of ``n`` consecutive tokens (``n == chunk_tokens``
except for the last chunk of a sequence, which may be shorter) for ALL layers,
as one contiguous tensor::

    chunk: [num_layers, 2, num_kv_heads, n, head_dim]  dtype = geometry.dtype
            layer      K/V  head          token  channel     (index 0 = K, 1 = V)

Contiguous means layer ``l`` occupies bytes ``[l * layer_nbytes, (l + 1) * layer_nbytes)``
of the chunk, which is what the per-layer checksums of the wire manifest cover.
Keys are post-RoPE, exactly as the model's KV pool holds them.

This module needs no torch at import (keys and the radix-tree bookkeeping use it without
tensors); ``torch_dtype`` imports torch when first asked. Tensor helpers live in layout.py.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# dtype name (torch's attribute name) -> bytes per element
_DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
}

_NAMESPACE_VERSION = b"vericache-fullkv-v1"


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """What a stored chunk means. Two tiers exchange chunks only if every field matches.

    model_id: what computed the KV; servers use ``ModelIdentity.model_id()`` (``identity.py``:
        weights digest, config, dtype, quantization, overrides, TP rank, weight version).
        It is hashed into every key, so two models never share entries even with equal
        shapes, whatever their directories are called.
    dtype: one of float32, float16, bfloat16, float8_e4m3fn, float8_e5m2 (the KV pool dtype).
    chunk_tokens: tokens per full chunk (the last chunk of a sequence may be shorter).
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    chunk_tokens: int

    def __post_init__(self) -> None:
        if not self.model_id or "\x00" in self.model_id:
            raise ValueError(f"model_id must be a non-empty string without NUL, "
                             f"got {self.model_id!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.dtype not in _DTYPE_SIZES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPE_SIZES)}, got {self.dtype!r}")

    @classmethod
    def from_torch_dtype(cls, model_id: str, num_layers: int, num_kv_heads: int,
                         head_dim: int, dtype: torch.dtype, chunk_tokens: int) -> KVGeometry:
        name = str(dtype).removeprefix("torch.")
        if name not in _DTYPE_SIZES:
            raise ValueError(f"unsupported KV dtype {dtype}")
        return cls(model_id, num_layers, num_kv_heads, head_dim, name, chunk_tokens)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # deferred: see the module docstring

        return getattr(torch, self.dtype)

    @property
    def element_size(self) -> int:
        return _DTYPE_SIZES[self.dtype]

    def namespace(self) -> bytes:
        """16-byte digest of every field: the root of every key chain and the manifest tag.

        Uses blake2b over an explicit, versioned encoding (never Python ``hash()``), so it
        is identical across processes, machines and Python versions.
        """
        text = "\x00".join([
            self.model_id, str(self.num_layers), str(self.num_kv_heads), str(self.head_dim),
            self.dtype, str(self.chunk_tokens),
        ]).encode()
        return hashlib.blake2b(_NAMESPACE_VERSION + b"\x00" + text, digest_size=16).digest()

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of a chunk of ``num_tokens`` tokens: [L, 2, H_kv, num_tokens, D]."""
        self._check_len(num_tokens)
        return (self.num_layers, 2, self.num_kv_heads, num_tokens, self.head_dim)

    def layer_nbytes(self, num_tokens: int) -> int:
        self._check_len(num_tokens)
        return 2 * self.num_kv_heads * num_tokens * self.head_dim * self.element_size

    def chunk_nbytes(self, num_tokens: int) -> int:
        return self.num_layers * self.layer_nbytes(num_tokens)

    def chunk_lengths(self, num_tokens: int) -> list[int]:
        """Token counts of the chunks that cover ``num_tokens`` tokens (last may be partial)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        full, rest = divmod(num_tokens, self.chunk_tokens)
        return [self.chunk_tokens] * full + ([rest] if rest else [])

    def check_chunk(self, chunk: torch.Tensor, num_tokens: int, what: str = "chunk") -> None:
        """Raise ValueError unless ``chunk`` is a contiguous [L, 2, H_kv, num_tokens, D] tensor
        of this geometry's dtype (any device)."""
        expected = self.chunk_shape(num_tokens)
        if tuple(chunk.shape) != expected:
            raise ValueError(f"{what}: shape {tuple(chunk.shape)} != expected {expected}")
        if chunk.dtype != self.torch_dtype:
            raise ValueError(f"{what}: dtype {chunk.dtype} != geometry dtype {self.torch_dtype}")
        if not chunk.is_contiguous():
            raise ValueError(f"{what}: must be contiguous")

    def _check_len(self, num_tokens: int) -> None:
        if not 0 < num_tokens <= self.chunk_tokens:
            raise ValueError(f"chunk length must be in [1, {self.chunk_tokens}], got {num_tokens}")
