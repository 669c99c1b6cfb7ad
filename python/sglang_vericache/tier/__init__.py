"""Full-KV tiers: where the uncompressed KV lives while the device holds a compressed cache.

Public API (pure python + torch + pyzmq + msgpack; nothing here imports sglang, and only
``tier.lmcache`` imports lmcache, lazily, when an lmcache:// tier is opened):

    KVGeometry, chunk_keys, ChunkKey          what a chunk is and what it is called
    split_chunks, join_chunks, alloc_chunks   [L, 2, H_kv, T, D] <-> per-chunk tensors
    gather_chunk, scatter_chunk               token-slot KV pool <-> one chunk
    FullKVTier, TaskId, TaskResult, ...       the submit/poll interface (base.py)
    open_tier(spec, geometry, options)        "host" | "zmq://HOST:PORT" | "lmcache://HOST:PORT"
    ModelIdentity                             the model's content identity (KVGeometry.model_id)
    TierSecret, resolve_secret                the zmq server's shared secret and where it is from

The KV server runs as ``python -m sglang_vericache.tier.server`` (see server.py). The names
above are resolved lazily (PEP 562) so that starting the server, which needs neither torch
nor the client, does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FullKVTier": "base", "TaskId": "base", "TaskKind": "base", "TaskResult": "base",
    "TaskStatus": "base",
    "TierOptions": "factory", "open_tier": "factory", "parse_tier_spec": "factory",
    "KVGeometry": "geometry", "alloc_chunks": "layout", "join_chunks": "layout",
    "split_chunks": "layout", "gather_chunk": "layout", "scatter_chunk": "layout",
    "ChunkKey": "keys", "chunk_keys": "keys", "ModelIdentity": "identity",
    "TierSecret": "secret", "resolve_secret": "secret",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
