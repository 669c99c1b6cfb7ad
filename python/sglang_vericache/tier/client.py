"""ZmqTier: the client of the zmq KV server (``server.py``), submit/poll over a background thread.

One I/O thread owns the DEALER socket (zmq sockets are not thread-safe); callers only touch
locked Python structures and wake the thread through a pipe, so submit_*/poll/cancel never
wait for the network. The thread builds manifests (per-layer checksums) for puts, sends
payload frames zero-copy from the caller's CPU tensors, verifies every fetched chunk
(namespace, size, per-layer checksums) before copying it into the caller's tensor, and
turns timeouts and disconnects into FAILED results.

Failure detection: a request that got no reply by its deadline fails (``timeouts``); a lost
connection (socket monitor, plus ZMTP heartbeats for silent peers) fails every request
already sent on it at once (``disconnects``); with no server connected, requests wait at
most ``connect_timeout_s`` (the server unreachable at start-up). libzmq reconnects by itself,
so a restarted server is used again without action from the caller.

A put whose task already failed may still leave zmq's queue later, reading the caller's
tensor as it is then; its checksums were computed at submit time, so the server rejects
it as corrupt if the tensor has changed meanwhile: wrong KV can never be stored.

Security: the connection opens with credentials derived from the shared secret (``handshake.py``;
refused: every unsent task fails at once, ``unauthorized``, naming where our secret came from);
every request is signed and every reply checked with it (``auth.py``): a reply that does not
authenticate only fails its task. Authenticated replies carry the server's epoch (``TaskResult``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from sglang_vericache.tier.auth import ClientSession
from sglang_vericache.tier.base import TaskId, TaskKind, TaskStatus, check_batch, prefix_closed
from sglang_vericache.tier.geometry import KVGeometry
from sglang_vericache.tier.handshake import authenticate_client_socket, refusal_error
from sglang_vericache.tier.keys import ChunkKey
from sglang_vericache.tier.layout import copy_bytes_into, tensor_bytes
from sglang_vericache.tier.outbox import ClientTask, plan_sends
from sglang_vericache.tier.protocol import (
    EPOCH_BYTES,
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    ChunkManifest,
    Op,
    ProtocolError,
    PutStatus,
    require,
    unpack_header,
)
from sglang_vericache.tier.secret import TierSecret, mismatch_hint, resolve_secret
from sglang_vericache.tier.task_table import TaskTableTier

logger = logging.getLogger("sglang_vericache.tier.client")

_COUNTERS = ("submitted", "completed", "failures", "timeouts", "disconnects", "unreachable",
             "unauthorized", "checksum_mismatch", "geometry_mismatch", "protocol_errors",
             "server_errors", "cancelled", "late_replies", "fallbacks", "put_rejected",
             "chunks_put", "chunks_fetched", "chunks_missed", "bytes_sent", "bytes_received")

_RESIGN_AFTER_S = 1.0  # unsent frames older than this are signed again (auth.START_GRACE_S)


class ZmqTier(TaskTableTier[ClientTask]):
    """Client of one zmq KV server at ``endpoint`` ("tcp://HOST:PORT"). Thread-safe.

    timeout_s: a request without a reply after this long fails.
    connect_timeout_s: a request that could not be sent (no server) fails after this long.
    secret: the shared secret (``secret.py``); None resolves it as the server does
        ($VERICACHE_TIER_SECRET, else the per-user secret file). Replies are verified too.
    """

    def __init__(self, endpoint: str, geometry: KVGeometry, *, timeout_s: float = 30.0,
                 connect_timeout_s: float = 2.0, secret: TierSecret | bytes | None = None
                 ) -> None:
        if timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        if not isinstance(secret, TierSecret):
            secret = resolve_secret() if secret is None \
                else TierSecret(secret, "the secret given to the client")
        super().__init__(_COUNTERS)
        self.geometry = geometry
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.connect_timeout_s = min(connect_timeout_s, timeout_s)
        self.secret_source = secret.source
        self._session = ClientSession(secret.value)
        self._ns = geometry.namespace()
        self._inbox: deque[ClientTask] = deque()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        for opt, value in ((zmq.LINGER, 0), (zmq.IMMEDIATE, 1), (zmq.SNDHWM, 0),
                           (zmq.RCVHWM, 0), (zmq.RECONNECT_IVL, 100),
                           (zmq.RECONNECT_IVL_MAX, 1000), (zmq.HEARTBEAT_IVL, 1000),
                           (zmq.HEARTBEAT_TIMEOUT, 5000),
                           # no legitimate reply frame is bigger than a chunk or a header
                           (zmq.MAXMSGSIZE, max(geometry.chunk_nbytes(geometry.chunk_tokens),
                                                MAX_HEADER_BYTES))):
            self._sock.setsockopt(opt, value)
        authenticate_client_socket(self._sock, secret.value)
        self._refused: str | None = None  # why the server refused our last handshake
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        self._sock.connect(endpoint)  # asynchronous: never fails for an absent server
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)  # a full pipe already means "wake up"
        self._thread = threading.Thread(target=self._run, name=f"vericache-tier-io:{endpoint}",
                                        daemon=True)
        self._thread.start()

    # -- public API (any thread) ----------------------------------------------------------
    def submit_put(self, keys: Sequence[ChunkKey], chunks: Sequence[torch.Tensor]) -> TaskId:
        check_batch(self.geometry, keys, chunks, "chunks")
        if any(c.device.type != "cpu" for c in chunks):
            raise ValueError("ZmqTier.submit_put needs CPU chunks (copy device KV to host first)")
        return self._submit(TaskKind.PUT, keys, chunks)

    def close(self) -> None:
        if not self._close_tasks():
            return
        with self._lock:
            self._wake()
        self._thread.join(timeout=5.0)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- bookkeeping -----------------------------------------------------------------------
    def _submit(self, kind: TaskKind, keys: Sequence[ChunkKey],
                tensors: Sequence[torch.Tensor]) -> TaskId:
        now = time.monotonic()
        with self._lock:
            if self._closed:
                raise RuntimeError("ZmqTier is closed")
            task_id = TaskId(self._next_id)
            self._next_id += 1
            task = ClientTask(task_id, kind, list(keys), list(tensors),
                              deadline=now + self.timeout_s,
                              connect_deadline=now + self.connect_timeout_s)
            self._tasks[task_id] = task
            self._inbox.append(task)
            self._counters["submitted"] += 1
            self._wake()  # under the lock: close() cannot close the pipe in between
        return task_id

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    def _log_failure(self, task: ClientTask, error: str | None) -> None:
        logger.warning("%s task %d to %s failed: %s", task.kind.value, task.task_id,
                       self.endpoint, error)

    def _fail(self, task: ClientTask, error: str, counter: str) -> None:
        self._count(counter)
        self._finish(task, TaskStatus.FAILED, [False] * len(task.keys), error=error)

    # -- I/O thread --------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        outbox: deque[ClientTask] = deque()
        try:
            while not self._closed:
                timeout_ms = 5 if outbox else 50
                events = dict(poller.poll(timeout_ms))
                if self._wake_r in events:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                self._drain_replies()
                if self._monitor in events:
                    self._drain_monitor()
                with self._lock:
                    outbox.extend(self._inbox)
                    self._inbox.clear()
                self._send_outbox(outbox)
                self._expire()
        except Exception:  # never let the thread die silently: fail everything instead
            logger.exception("tier I/O thread crashed")
            with self._lock:
                pending = list(self._tasks.values())
            for task in pending:
                self._fail(task, "tier I/O thread crashed", "protocol_errors")
        finally:
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._ctx.term()

    def _send_outbox(self, outbox: deque[ClientTask]) -> None:
        """Reads ahead of write-throughs, a window of puts on the wire (``outbox.py``)."""
        live = [t for t in outbox if not t.cancelled and t.task_id in self._tasks]
        plan = plan_sends(live, self._puts_unanswered())
        now = time.monotonic()
        for task in plan.held:
            task.hold(now, self.timeout_s, self.connect_timeout_s)
        sent = 0
        while sent < len(plan.send) and self._send_task(plan.send[sent]):
            sent += 1  # stops where no server is connected: the rest stays, in order
        outbox.clear()
        outbox.extend(plan.send[sent:] + plan.held)

    def _send_task(self, task: ClientTask) -> bool:
        if task.frames is None or time.monotonic() - task.signed_at > _RESIGN_AFTER_S:
            # a server that starts later refuses requests signed long before it started
            task.frames, task.signed_at = self._request_frames(task), time.monotonic()
        frames = task.frames
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # no server connected (IMMEDIATE): retry until connect deadline
            return False
        task.sent = True
        task.frames = None
        self._count("bytes_sent", sum(memoryview(f).nbytes for f in frames))
        return True

    def _puts_unanswered(self) -> int:
        with self._lock:
            return sum(1 for t in self._tasks.values() if t.kind is TaskKind.PUT and t.sent)

    def _request_frames(self, task: ClientTask) -> list[Any]:
        header: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": int(task.task_id)}
        payload: list[memoryview] = []
        if task.kind is TaskKind.PUT:
            items = []
            for key, chunk in zip(task.keys, task.tensors):
                view = tensor_bytes(chunk)
                manifest = ChunkManifest.of(self._ns, key.num_tokens, self.geometry.num_layers,
                                            view)
                items.append({"key": key.digest, "m": manifest.to_wire()})
                payload.append(view)
            header.update(op=Op.PUT.value, items=items)
        else:
            op = Op.GET if task.kind is TaskKind.FETCH else Op.EXISTS
            header.update(op=op.value, keys=[k.digest for k in task.keys], ns=self._ns)
        return self._session.sign(header, payload)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            tasks = list(self._tasks.values())
        for task in tasks:
            if not task.sent and self._refused is not None:  # nothing is sent until it passes
                self._fail(task, self._refused, "unauthorized")
            elif not task.sent and now > task.connect_deadline:
                self._fail(task, f"tier server {self.endpoint} unreachable", "unreachable")
            elif now > task.deadline:
                self._fail(task, f"no reply within {self.timeout_s}s", "timeouts")

    def _drain_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                if self._refused is None:  # else a refused retry (each task logs the refusal)
                    logger.warning("lost connection to tier server %s", self.endpoint)
                with self._lock:
                    inflight = [t for t in self._tasks.values() if t.sent]
                for task in inflight:
                    self._fail(task, "tier server disconnected", "disconnects")
            elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._refused = refusal_error(self.endpoint, event["value"], self.secret_source)
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._refused = None
                logger.info("connected to tier server %s", self.endpoint)

    def _drain_replies(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._count("bytes_received", sum(f.buffer.nbytes for f in frames))
            self._handle_reply([f.buffer for f in frames])

    def _handle_reply(self, frames: list[memoryview]) -> None:
        try:
            header = unpack_header(frames[0])
        except ProtocolError as exc:
            self._count("protocol_errors")
            logger.warning("unreadable reply from %s: %s", self.endpoint, exc)
            return
        with self._lock:
            task = self._tasks.get(TaskId(header["id"]))
        if task is None:  # timed out, cancelled, or failed by a disconnect earlier
            self._count("late_replies")
            return
        try:
            self._session.check_reply(header, frames)
        except ProtocolError as exc:
            # An unauthenticated reply may only ever fail its task, never deliver data
            # (typically the server has another secret and says "unauthorized").
            detail = f"{header.get('code')}: {header.get('error')}" \
                if header.get("ok") is False else "no error given"
            self._fail(task, f"unauthenticated reply from the KV server {self.endpoint} "
                             f"({exc}; it said {detail}): {mismatch_hint(self.secret_source)}",
                       "protocol_errors")
            return
        frames = frames[:-1]
        epoch = header.get("epoch")
        task.epoch = epoch if isinstance(epoch, bytes) and len(epoch) == EPOCH_BYTES else None
        try:
            if header.get("ok") is not True:
                self._count("server_errors")
                # authenticated, so the secrets match: an "unauthorized" here is a stale
                # timestamp or a replay, and the server's message says which
                error = f"server: {header.get('code')}: {header.get('error')}"
                self._finish(task, TaskStatus.FAILED, [False] * len(task.keys), error=error,
                             epoch=task.epoch)
            elif task.kind is TaskKind.PUT:
                self._on_put(task, header)
            elif task.kind is TaskKind.LOOKUP:
                self._on_lookup(task, header)
            else:
                self._on_fetch(task, header, frames[1:])
        except ProtocolError as exc:
            self._fail(task, f"bad reply: {exc}", "protocol_errors")

    def _on_put(self, task: ClientTask, header: dict[str, Any]) -> None:
        status = require(header, "status", list)
        if len(status) != len(task.keys):
            raise ProtocolError("put status count mismatch")
        good = (PutStatus.STORED.value, PutStatus.EXISTS.value)
        ok = [s in good for s in status]
        rejected = [s for s in status if s not in good]
        self._count("chunks_put", sum(ok))
        if rejected:
            self._count("put_rejected", len(rejected))
        nbytes = sum(c.nbytes for c, flag in zip(task.tensors, ok) if flag)
        self._finish(task, TaskStatus.DONE, ok, nbytes=nbytes, epoch=task.epoch,
                     error=f"rejected: {sorted(set(rejected))}" if rejected else None)

    def _on_lookup(self, task: ClientTask, header: dict[str, Any]) -> None:
        present = require(header, "present", list)
        if len(present) != len(task.keys):
            raise ProtocolError("lookup reply count mismatch")
        ok = prefix_closed([p is True for p in present])
        self._finish(task, TaskStatus.DONE, ok, epoch=task.epoch,
                     error=None if all(ok) else f"{sum(ok)}/{len(ok)} chunks stored")

    def _on_fetch(self, task: ClientTask, header: dict[str, Any],
                  payload: list[memoryview]) -> None:  # fmt: skip
        items = require(header, "items", list)
        if len(items) != len(payload) or len(items) > len(task.keys):
            raise ProtocolError("get reply item/frame count mismatch")
        ok = [False] * len(task.keys)
        error: str | None = None
        nbytes = 0
        with task.copy_lock:
            for i, (item, frame) in enumerate(zip(items, payload)):
                if task.cancelled:
                    return  # cancel() publishes the CANCELLED result
                error = self._verify_chunk(task.keys[i], item, frame)
                if error is not None:
                    break
                copy_bytes_into(task.tensors[i], frame)
                ok[i] = True
                nbytes += frame.nbytes
        hits = sum(ok)
        self._count("chunks_fetched", hits)
        self._count("chunks_missed", len(ok) - hits)
        if error is None and hits < len(ok):
            error = f"{hits}/{len(ok)} chunks stored"
        self._finish(task, TaskStatus.DONE, ok, nbytes=nbytes, error=error, epoch=task.epoch)

    def _verify_chunk(self, key: ChunkKey, item: Any, frame: memoryview) -> str | None:
        """None if the chunk is exactly what ``key`` names under our geometry, else why not."""
        if not isinstance(item, dict) or item.get("key") != key.digest:
            raise ProtocolError("get reply keys out of order")
        manifest = ChunkManifest.from_wire(item.get("m"))
        g = self.geometry
        if (manifest.ns != self._ns or manifest.num_tokens != key.num_tokens
                or manifest.num_layers != g.num_layers
                or manifest.nbytes != g.chunk_nbytes(key.num_tokens)):
            self._count("geometry_mismatch")
            logger.warning("chunk %s: manifest does not match geometry/key", key.hex()[:16])
            return "manifest does not match this geometry"
        if not manifest.verify(frame):
            self._count("checksum_mismatch")
            logger.warning("chunk %s: checksum mismatch (corrupt), treated as a miss",
                           key.hex()[:16])
            return "checksum mismatch"
        return None
