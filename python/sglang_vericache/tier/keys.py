"""Chained chunk keys: a key names a chunk's KV *and* everything that produced it.

    key_i = blake2b-256( key_{i-1}  ||  namespace(geometry)  ||  u32 len_i  ||  int64le tokens_i )
    key_{-1} = namespace(geometry)

The namespace digests model id (the model's content identity: ``identity.py``), layers, KV
heads, head dim, dtype and chunk size (``KVGeometry.namespace``), so a key of another model,
weight version or geometry can never collide with ours. Chaining makes key_i depend on every token before the chunk, which is what
makes a prefix hit mean "same KV" (causal attention). The chunk length is hashed so a
short last chunk never aliases the full chunk that later replaces it.

Only ``hashlib.blake2b`` over explicit little-endian encodings is used: identical in
every process and on every machine (Python's ``hash()`` is salted per process).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Sequence

from sglang_vericache.tier.geometry import KVGeometry
from sglang_vericache.tier.protocol import KEY_BYTES


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """digest: 32-byte chained hash; num_tokens: tokens in the chunk (its KV size follows
    from the tier's geometry)."""

    digest: bytes
    num_tokens: int

    def __post_init__(self) -> None:
        if not isinstance(self.digest, bytes) or len(self.digest) != KEY_BYTES:
            raise ValueError(f"digest must be {KEY_BYTES} bytes")
        if not isinstance(self.num_tokens, int) or self.num_tokens <= 0:
            raise ValueError(f"num_tokens must be a positive int, got {self.num_tokens!r}")

    def hex(self) -> str:
        return self.digest.hex()


def chunk_keys(geometry: KVGeometry, token_ids: Sequence[int],
               parent: ChunkKey | None = None) -> list[ChunkKey]:
    """Keys of the chunks covering ``token_ids`` (the last one may be partial).

    parent: the key of the full chunk right before ``token_ids[0]`` when extending an
        existing chain (``None`` = the sequence starts at position 0). A partial chunk
        cannot be a parent: chains only grow by whole chunks.
    """
    if parent is not None and parent.num_tokens != geometry.chunk_tokens:
        raise ValueError("parent must be a full chunk (num_tokens == geometry.chunk_tokens)")
    if hasattr(token_ids, "tolist"):  # torch / numpy token tensors
        token_ids = token_ids.tolist()
    namespace = geometry.namespace()
    prev = namespace if parent is None else parent.digest
    keys: list[ChunkKey] = []
    start = 0
    for n in geometry.chunk_lengths(len(token_ids)):
        tokens = token_ids[start:start + n]
        try:
            encoded = struct.pack(f"<I{n}q", n, *tokens)
        except struct.error as exc:
            raise ValueError(f"token ids must be int64 integers: {exc}") from None
        digest = hashlib.blake2b(prev + namespace + encoded, digest_size=KEY_BYTES).digest()
        keys.append(ChunkKey(digest, n))
        prev = digest
        start += n
    return keys
