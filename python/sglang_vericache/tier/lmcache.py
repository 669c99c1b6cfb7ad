"""LMCacheTier: the full KV on an LMCache multiprocess server, engine-driven transfer.

    lmcache server --host 127.0.0.1 --port 5555 --l1-size-gb 4 \\
        --supported-transfer-mode engine_driven --chunk-size 256     # = geometry.chunk_tokens
    --vericache-tier lmcache://127.0.0.1:5555

The only module that imports ``lmcache`` (lazily, in the constructor); written against
lmcache 0.5.6, the version the ``[lmcache]`` extra pins. It wraps LMCache in our own
guarantees, because LMCache 0.5.6 leaves geometry out of its key and was seen returning
wrong KV after a partial flush (``notes/lmcache-cpu.md``):

- Keys. Every chunk is sent to LMCache as its own one-chunk request whose token ids are
  derived from our chained ``ChunkKey`` digest (which already covers the model id, KV
  geometry, dtype, chunk size and every earlier token). The LMCache ``model_name`` carries
  the geometry namespace too. So LMCache's key is ours, chunks of any length are storable
  (zero-padded to the server's chunk size), and any subset of a chain can be fetched.
- Completeness. The staging KV registered with LMCache has one extra "manifest layer":
  magic, namespace, key digest, token count and one checksum per real layer. A fetched
  chunk is accepted only if that manifest matches the key and every layer's checksum
  matches its bytes; anything else is a miss (counted), never wrong KV.
- Asynchrony. One background thread runs the blocking LMCache RPCs; callers get the same
  submit/poll contract as every tier (``base.py``). Any LMCache exception fails the task.

Trust boundary. The manifest travels WITH the data and carries no MAC: LMCache 0.5.6 has no
authentication, and this tier adds none. What it protects against: partial, truncated,
misfiled or corrupted entries (a wrong key, geometry or checksum is a miss, never wrong KV).
What it does not: anyone who can reach the LMCache server can read every stored KV, and can
plant KV of their own under any key with a matching manifest (the checksums are unkeyed), which
would be served as a hit. So ``--vericache-tier lmcache://HOST:PORT`` is refused at start-up
for a HOST that is not loopback unless ``--vericache-tier-trusted-network`` says every host
that can reach it is trusted (``config.py``); the zmq:// tier MACs every message instead.

Staging layout registered with LMCache (vLLM NHD paged layout, one block = one chunk):
    layer l in [0, L]:  [2, NB=2, BS=chunk_tokens, H_kv, D]   block 0 is LMCache's null
    block, so every transfer uses block 1; layer L is the manifest layer.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
import uuid
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from sglang_vericache.tier.base import TaskId, TaskKind, TaskStatus, check_batch
from sglang_vericache.tier.geometry import KVGeometry
from sglang_vericache.tier.keys import ChunkKey
from sglang_vericache.tier.protocol import (
    CHECKSUM_BYTES,
    KEY_BYTES,
    NAMESPACE_BYTES,
    layer_checksums,
)
from sglang_vericache.tier.task_table import TaskTableTier, TrackedTask

logger = logging.getLogger("sglang_vericache.tier.lmcache")

# pip cannot install the [lmcache] extra beside sglang (pyproject.toml says why): the script can
INSTALL_HINT = "bash scripts/lmcache_venv.sh (builds .venv-lmcache with LMCache 0.5.6)"
_MAGIC = b"VCKVMAN1"
_BLOCK = 1  # block 0 is LMCache's null block id ("absent KV")
_COUNTERS = ("submitted", "completed", "failures", "checksum_mismatch", "geometry_mismatch",
             "cancelled", "fallbacks", "chunks_put", "chunks_fetched", "chunks_missed")


def import_lmcache() -> SimpleNamespace:
    """The lmcache names this adapter uses, or ImportError naming the extra to install."""
    try:
        from lmcache.utils import EngineType
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
        from lmcache.v1.multiprocess.group_view import EngineGroupInfo
        from lmcache.v1.multiprocess.transfer_context import EngineDrivenTransferContext
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory
    except ImportError as exc:
        raise ImportError(f"the lmcache:// tier needs LMCache 0.5.6: {INSTALL_HINT} "
                          f"({exc})") from exc
    return SimpleNamespace(EngineType=EngineType, IPCCacheServerKey=IPCCacheServerKey,
                           EngineGroupInfo=EngineGroupInfo,
                           EngineDrivenTransferContext=EngineDrivenTransferContext,
                           RequestClientFactory=RequestClientFactory)


def pseudo_tokens(key: ChunkKey, chunk_tokens: int) -> tuple[int, ...]:
    """LMCache token ids standing for one of our chunks: the 32-byte digest as eight
    31-bit ints, then the token count, zero-padded to the server's chunk size."""
    words = struct.unpack("<8I", key.digest)
    return tuple(w & 0x7FFFFFFF for w in words) + (key.num_tokens,) \
        + (0,) * (chunk_tokens - 9)


def pack_manifest(ns: bytes, key: ChunkKey, sums: Sequence[bytes]) -> bytes:
    return _MAGIC + ns + key.digest + struct.pack("<II", key.num_tokens, len(sums)) \
        + b"".join(sums)


def manifest_nbytes(num_layers: int) -> int:
    return len(_MAGIC) + NAMESPACE_BYTES + KEY_BYTES + 8 + CHECKSUM_BYTES * num_layers


class LMCacheTier(TaskTableTier[TrackedTask]):
    """Full-KV tier on ``lmcache server`` at HOST:PORT (engine-driven mode). Thread-safe.
    Construction never contacts the server; registration happens on the I/O thread, and
    a server that is down or incompatible turns into FAILED tasks (logged, counted)."""

    def __init__(self, host: str, port: int, geometry: KVGeometry, *,
                 timeout_s: float = 30.0) -> None:
        self._lm = import_lmcache()  # raises ImportError with the install hint
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        g = geometry
        if g.chunk_tokens < 9:
            raise ValueError("the lmcache tier needs chunk_tokens >= 9 (key encoding)")
        if g.layer_nbytes(g.chunk_tokens) < manifest_nbytes(g.num_layers):
            raise ValueError("a layer of one chunk is too small to hold the manifest")
        super().__init__(_COUNTERS)
        self.geometry = g
        self.url = f"tcp://{host}:{port}"
        self.timeout_s = timeout_s
        self._ns = g.namespace()
        self._model_name = f"vericache-{g.namespace().hex()}"
        self._instance_id = uuid.uuid4().int & ((1 << 62) - 1)
        shape = (2, 2, g.chunk_tokens, g.num_kv_heads, g.head_dim)
        self._staging = {f"layer.{i}": torch.zeros(shape, dtype=g.torch_dtype)
                         for i in range(g.num_layers + 1)}
        self._queue: queue.Queue[TrackedTask | None] = queue.Queue()
        self._client: Any = None
        self._transfer: Any = None
        self._zmq_ctx: Any = None
        self._thread = threading.Thread(target=self._run, name=f"vericache-lmcache:{self.url}",
                                        daemon=True)
        self._thread.start()

    # -- public API --------------------------------------------------------------------------
    def submit_put(self, keys: Sequence[ChunkKey], chunks: Sequence[torch.Tensor]) -> TaskId:
        check_batch(self.geometry, keys, chunks, "chunks")
        return self._submit(TaskKind.PUT, keys, chunks)

    def close(self) -> None:
        if not self._close_tasks():
            return
        self._queue.put(None)
        self._thread.join(timeout=self.timeout_s)

    # -- bookkeeping -----------------------------------------------------------------------
    def _submit(self, kind: TaskKind, keys: Sequence[ChunkKey],
                tensors: Sequence[torch.Tensor]) -> TaskId:
        with self._lock:
            if self._closed:
                raise RuntimeError("LMCacheTier is closed")
            task = TrackedTask(TaskId(self._next_id), kind, list(keys), list(tensors))
            self._next_id += 1
            self._tasks[task.task_id] = task
            self._counters["submitted"] += 1
        self._queue.put(task)
        return task.task_id

    def _log_failure(self, task: TrackedTask, error: str | None) -> None:
        logger.warning("lmcache %s task %d failed: %s", task.kind.value, task.task_id, error)

    # -- I/O thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                break
            if task.cancelled:
                continue
            try:
                self._connect()
                if task.kind is TaskKind.PUT:
                    self._do_put(task)
                elif task.kind is TaskKind.LOOKUP:
                    self._do_lookup(task)
                else:
                    self._do_fetch(task)
            except Exception as exc:  # noqa: BLE001 - LMCache raises many types; all mean "no data"
                self._drop_connection()
                self._finish(task, TaskStatus.FAILED, [False] * len(task.keys),
                             f"{type(exc).__name__}: {exc}")
        self._drop_connection()

    def _connect(self) -> None:
        if self._transfer is not None:
            return
        import zmq  # pyzmq is a core dependency; LMCache's transport takes its context

        lm = self._lm
        self._zmq_ctx = zmq.Context()
        # LMCache closes its sockets with the context's default linger, and a request queued
        # for a dead server is never delivered: with zmq's default (wait forever),
        # _drop_connection's term() blocked the I/O thread for good and no task ever finished.
        self._zmq_ctx.setsockopt(zmq.LINGER, 0)
        self._client = lm.RequestClientFactory.create(self.url, context=self._zmq_ctx)
        chunk_size = int(self._client.get_chunk_size().result(timeout=self.timeout_s))
        if chunk_size != self.geometry.chunk_tokens:
            raise ValueError(f"lmcache server chunk size {chunk_size} != geometry "
                             f"chunk_tokens {self.geometry.chunk_tokens} (--chunk-size)")
        transfer = lm.EngineDrivenTransferContext(self._instance_id, self._client)
        groups = [lm.EngineGroupInfo(engine_group_id=0,
                                     layer_indices=tuple(range(len(self._staging))),
                                     tokens_per_block=self.geometry.chunk_tokens)]
        transfer.register(self._staging, self._model_name, 1, 1, self.timeout_s,
                          layout_hints={"kv_layout": "NHD"}, engine_group_infos=groups,
                          engine_type=lm.EngineType.VLLM)
        self._transfer = transfer
        logger.info("registered with lmcache server %s as %s", self.url, self._model_name)

    def _drop_connection(self) -> None:
        for closer in (lambda: self._transfer.unregister(), lambda: self._transfer.close(),
                       lambda: self._client.close(), lambda: self._zmq_ctx.term()):
            try:
                closer()
            except Exception:  # noqa: BLE001, S110 - best effort: the server may be gone
                pass
        self._transfer = self._client = self._zmq_ctx = None

    def _lm_key(self, key: ChunkKey, request_id: str) -> Any:
        return self._lm.IPCCacheServerKey(
            model_name=self._model_name, world_size=1, num_kv_readers=1, worker_id=0,
            token_ids=pseudo_tokens(key, self.geometry.chunk_tokens), start=0,
            end=self.geometry.chunk_tokens, request_id=request_id)

    def _lookup_one(self, key: ChunkKey, request_id: str) -> bool:
        lm_key = self._lm_key(key, request_id)
        self._client.lookup(lm_key, 1).result(timeout=self.timeout_s)
        deadline = time.monotonic() + self.timeout_s
        while True:
            hits = self._client.query_prefetch_status(request_id).result(timeout=self.timeout_s)
            if hits is not None:
                return int(hits) >= 1
            if time.monotonic() > deadline:
                raise TimeoutError("lmcache prefetch status did not settle")
            time.sleep(0.002)

    def _end(self, key: ChunkKey, request_id: str, release_locks: bool) -> None:
        try:
            if release_locks:
                self._client.free_lookup_locks(self._lm_key(key, request_id), 1) \
                    .result(timeout=self.timeout_s)
            self._client.end_session(request_id).result(timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - cleanup only; locks also expire on the server
            logger.info("lmcache session cleanup failed: %s", exc)

    def _do_lookup(self, task: TrackedTask) -> None:
        ok: list[bool] = []
        for key in task.keys:
            request_id = uuid.uuid4().hex
            present = self._lookup_one(key, request_id)
            self._end(key, request_id, release_locks=True)
            ok.append(present)
            if not present:
                break
        ok += [False] * (len(task.keys) - len(ok))
        self._finish(task, TaskStatus.DONE, ok, None if all(ok) else "partial hit")

    def _do_put(self, task: TrackedTask) -> None:
        ok: list[bool] = []
        registered_again = False
        for key, chunk in zip(task.keys, task.tensors):
            if task.cancelled:
                return
            stored = self._store(key, chunk)
            if not stored and not registered_again:
                # A restarted server forgets every registration, and zmq reconnects to it
                # silently: the old one's stores are refused ("context not registered") while
                # lookups still answer, so nothing else would ever re-register. Once per task:
                # a server that refuses a fresh registration's store too is refusing for real.
                registered_again = True
                self._drop_connection()
                self._connect()
                stored = self._store(key, chunk)
            ok.append(stored)
        self._count("chunks_put", sum(ok))
        self._finish(task, TaskStatus.DONE, ok, None if all(ok) else "lmcache refused a store",
                     nbytes=sum(c.nbytes for c, f in zip(task.tensors, ok) if f))

    def _store(self, key: ChunkKey, chunk: torch.Tensor) -> bool:
        """Store one chunk ([L, 2, H, n, D]) and its manifest; whether the server took it."""
        g = self.geometry
        host = chunk.detach().to("cpu").contiguous()
        sums = layer_checksums(memoryview(host.view(torch.uint8).reshape(-1).numpy()),
                               g.num_layers)
        n = key.num_tokens
        for layer in range(g.num_layers):  # [2, H, n, D] -> block [2, n, H, D]
            dst = self._staging[f"layer.{layer}"][:, _BLOCK]
            dst.zero_()
            dst[:, :n].copy_(host[layer].permute(0, 2, 1, 3))
        self._write_manifest(pack_manifest(self._ns, key, sums))
        request_id = uuid.uuid4().hex
        lm_key = self._lm_key(key, request_id)
        event = self._transfer.create_recorded_event()
        stored = bool(self._transfer.submit_store(request_id, lm_key, self._staging, [[_BLOCK]],
                                                  event, 1).result(timeout=self.timeout_s))
        self._end(key, request_id, release_locks=False)
        return stored

    def _do_fetch(self, task: TrackedTask) -> None:
        ok: list[bool] = []
        error: str | None = None
        for key, dst in zip(task.keys, task.tensors):
            request_id = uuid.uuid4().hex
            if not self._lookup_one(key, request_id):
                self._end(key, request_id, release_locks=True)
                error = "miss"
                break
            event = self._transfer.create_recorded_event()
            got = bool(self._transfer.submit_retrieve(request_id, self._lm_key(key, request_id),
                                                      self._staging, [[_BLOCK]], event, 1,
                                                      skip_first_n_tokens=0)
                       .result(timeout=self.timeout_s))
            self._end(key, request_id, release_locks=not got)
            chunk = self._verified_chunk(key) if got else None
            if chunk is None:
                error = "miss" if not got else "manifest/checksum mismatch"
                break
            with task.copy_lock:
                if task.cancelled:
                    return
                dst.copy_(chunk)
            ok.append(True)
        self._count("chunks_fetched", len(ok))
        self._count("chunks_missed", len(task.keys) - len(ok))
        nbytes = sum(t.nbytes for t in task.tensors[:len(ok)])
        ok += [False] * (len(task.keys) - len(ok))
        self._finish(task, TaskStatus.DONE, ok, error, nbytes)

    def _write_manifest(self, manifest: bytes) -> None:
        block = self._staging[f"layer.{self.geometry.num_layers}"][:, _BLOCK]
        raw = block.contiguous().view(torch.uint8).reshape(-1)
        raw.zero_()
        raw[:len(manifest)] = torch.frombuffer(bytearray(manifest), dtype=torch.uint8)
        block.copy_(raw.view(block.dtype).reshape(block.shape))

    def _verified_chunk(self, key: ChunkKey) -> torch.Tensor | None:
        """The staged chunk as [L, 2, H_kv, n, D] if its manifest and checksums match."""
        g = self.geometry
        block = self._staging[f"layer.{g.num_layers}"][:, _BLOCK].contiguous()
        raw = bytes(block.view(torch.uint8).reshape(-1)[:manifest_nbytes(g.num_layers)].numpy())
        expected_head = _MAGIC + self._ns + key.digest + struct.pack("<II", key.num_tokens,
                                                                     g.num_layers)
        if raw[:len(expected_head)] != expected_head:
            self._count("geometry_mismatch")
            logger.warning("lmcache chunk %s: manifest does not match key/geometry", key.hex()[:16])
            return None
        n = key.num_tokens
        chunk = torch.stack([self._staging[f"layer.{layer}"][:, _BLOCK, :n].permute(0, 2, 1, 3)
                             for layer in range(g.num_layers)]).contiguous()
        sums = layer_checksums(memoryview(chunk.view(torch.uint8).reshape(-1).numpy()),
                               g.num_layers)
        if b"".join(sums) != raw[len(expected_head):]:
            self._count("checksum_mismatch")
            logger.warning("lmcache chunk %s: checksum mismatch (partial or corrupt)",
                           key.hex()[:16])
            return None
        return chunk
