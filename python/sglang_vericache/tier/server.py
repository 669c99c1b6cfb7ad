"""The zmq full-KV server: one process, one ROUTER socket, one thread, a byte-bounded LRU.

    python -m sglang_vericache.tier.server --host 127.0.0.1 --port 7300 --capacity-gb 4 \\
        [--bandwidth-mbps 100] [--secret-file PATH]

Wire protocol: ``protocol.py``; authentication: ``auth.py``; the secret: ``secret.py`` (there
always is one). A peer must prove it has the secret before it can send a data frame at all
(ZMTP PLAIN checked by a ZAP handler: ``handshake.py``), so no peer without the secret can
make the server hold more than one handshake command (bounded by ``--max-frame-mb``). The
server never dies on bad input: every request is handled inside one try/except that turns any
problem into an error reply (and a counter). A message is checked in this order, and refused
at the first failure without touching the store: frame count and sizes as its frames are
received (oversized frames are cut off earlier by libzmq: ZMQ_MAXMSGSIZE disconnects the peer
before the bytes are buffered), header, MAC (over the header and frame lengths), timestamp
and replay state, then the op itself, which checks every put chunk against its authenticated
manifest before storing it. ``--bandwidth-mbps`` emulates a slower remote store
(``throttle.py``).
Configuration and command line: ``server_config.py``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import asdict, dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from sglang_vericache.tier.auth import RequestAuthenticator, seal
from sglang_vericache.tier.handshake import ZapHandler, require_authenticated_peers
from sglang_vericache.tier.intake import MessageLimits, receive_message
from sglang_vericache.tier.protocol import (
    EPOCH_BYTES,
    KEY_BYTES,
    NAMESPACE_BYTES,
    PROTOCOL_VERSION,
    ChunkManifest,
    ErrorCode,
    Op,
    ProtocolError,
    PutStatus,
    require,
    require_keys,
    unpack_header,
)
from sglang_vericache.tier.server_config import ServerConfig, build_arg_parser, config_from_args
from sglang_vericache.tier.store import Admission, LRUByteStore
from sglang_vericache.tier.throttle import LinkThrottle

logger = logging.getLogger("sglang_vericache.tier.server")


@dataclass(slots=True)
class ServerCounters:
    requests: int = 0
    hits: int = 0               # chunks returned by get
    misses: int = 0             # requested chunks not returned by get (prefix ended)
    lookups: int = 0            # exists requests
    puts: int = 0               # chunks stored
    put_exists: int = 0         # chunks already stored
    evictions: int = 0
    corrupt_rejected: int = 0   # puts whose checksum/size did not match
    full_rejected: int = 0      # puts larger than the whole budget
    bad_requests: int = 0       # malformed, unknown op, wrong version
    unauthorized: int = 0       # missing/bad MAC, stale timestamp, replay
    limit_rejected: int = 0     # too many frames or bytes in one message (never read whole)
    bytes_in: int = 0
    bytes_out: int = 0
    peer_disconnects: int = 0    # includes peers cut off by ZMQ_MAXMSGSIZE (oversized frame)
    handshake_failures: int = 0  # not ZMTP, or no credentials (a peer without the secret)
    connections_refused: int = 0  # credentials refused by the ZAP handler (another secret)


@dataclass(frozen=True, slots=True)
class StoredChunk:
    manifest: ChunkManifest
    payload: memoryview  # keeps the received zmq frame alive: stored zero-copy


class KVTierServer:
    """Serve one ROUTER socket. ``step()`` handles what is ready (testable in-process);
    ``serve_forever()`` loops until ``stop()`` (also called by SIGTERM in the CLI).
    ``context``: None = a context of its own (its ZAP handler is the only one it may hold)."""

    def __init__(self, config: ServerConfig, context: zmq.Context | None = None) -> None:
        self.config = config
        self.counters = ServerCounters()
        self.store: LRUByteStore[bytes, StoredChunk] = LRUByteStore(config.capacity_bytes)
        self.auth = RequestAuthenticator(config.secret, config.max_clock_skew_s)
        # Drawn at every start: a client seeing another epoch knows this store is new.
        self.epoch = os.urandom(EPOCH_BYTES)
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        # bound before the ROUTER: no connection is ever accepted unchecked
        self._zap = ZapHandler(self._ctx, config.secret)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, config.max_frame_bytes)
        require_authenticated_peers(self._sock)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # never drop a reply
        port = "*" if config.port == 0 else str(config.port)
        # libzmq handles oversized frames and non-ZMTP garbage itself (it drops the peer);
        # a monitor socket makes those visible as counters and log lines.
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._poller.register(self._zap.socket, zmq.POLLIN)
        self._sock.bind(f"tcp://{config.host}:{port}")
        self.endpoint: str = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._limits = MessageLimits(config.max_frames, config.max_frame_bytes,
                                     config.max_message_bytes)
        self._throttle = None if config.bandwidth_mb_s is None \
            else LinkThrottle(config.bandwidth_mb_s)
        self._running = True

    # -- loop ---------------------------------------------------------------------------
    def step(self, timeout_ms: int = 100) -> int:
        """Wait up to timeout_ms for requests, handle all that are ready, flush due replies."""
        due_s = None if self._throttle is None else self._throttle.next_due_s()
        if due_s is not None:
            timeout_ms = max(0, min(timeout_ms, int(due_s * 1000) + 1))
        handled = 0
        events = dict(self._poller.poll(timeout_ms))
        if self._zap.socket in events:
            self.counters.connections_refused += self._zap.handle_ready()
        if self._monitor in events:
            self._drain_monitor()
        if self._sock in events:
            while handled < 64:
                try:
                    frames, refusal = receive_message(self._sock, self._limits)
                except zmq.Again:
                    break
                if refusal is None:
                    self._handle(frames)
                else:
                    self._refuse(frames, refusal)
                handled += 1
        self._flush_delayed()
        return handled

    def serve_forever(self) -> None:
        while self._running:
            self.step(100)

    def stop(self) -> None:
        self._running = False

    def close(self) -> None:
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._zap.close()
        if self._own_ctx:
            self._ctx.term()

    def _drain_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.counters.peer_disconnects += 1
                logger.info("peer disconnected (closed, died, or sent an oversized frame)")
            else:
                self.counters.handshake_failures += 1
                logger.warning("rejected a connection without credentials (a peer that does "
                               "not speak ZMTP, or a client without the shared secret)")

    def check_integrity(self) -> None:
        self.store.check_integrity()
        assert all(v >= 0 for v in asdict(self.counters).values())
        # Entries only come from puts and only leave by eviction.
        assert self.counters.puts - self.counters.evictions == len(self.store)

    def stats(self) -> dict[str, int]:
        out = asdict(self.counters)
        out.update(entries=len(self.store), used_bytes=self.store.used_bytes,
                   capacity_bytes=self.store.capacity_bytes)
        return out

    # -- refusal ----------------------------------------------------------------------------
    def _refuse(self, frames: list[zmq.Frame], why: str) -> None:
        self.counters.requests += 1
        self.counters.limit_rejected += 1
        request_id = 0
        sid_seq: dict[str, Any] = {}
        if len(frames) > 1:
            try:  # unauthenticated: only echoed back, never trusted
                header = unpack_header(frames[1].buffer)
                request_id = header["id"]
                sid_seq = _session_echo(header)
            except ProtocolError:
                pass
        logger.warning("refused request %d: %s", request_id, why)
        reply = {"v": PROTOCOL_VERSION, "id": request_id, "epoch": self.epoch, **sid_seq,
                 "ok": False, "code": ErrorCode.LIMIT.value, "error": why}
        self._send(frames[0].bytes, seal(reply, [], self.config.secret), None)

    # -- dispatch -------------------------------------------------------------------------
    def _handle(self, frames: list[zmq.Frame]) -> None:
        self.counters.requests += 1
        if len(frames) < 2:  # identity only: nothing to answer
            self.counters.bad_requests += 1
            return
        identity, body = frames[0].bytes, [f.buffer for f in frames[1:]]
        self.counters.bytes_in += sum(b.nbytes for b in body)
        request_id = 0
        sid_seq: dict[str, Any] = {}
        try:
            header = unpack_header(body[0])
            request_id = header["id"]
            sid_seq = _session_echo(header)
            self.auth.check(header, body)  # header + frame lengths: no payload byte hashed
            reply, payload, link = self._dispatch(header, body[1:-1])
        except ProtocolError as exc:
            if exc.code is ErrorCode.UNAUTHORIZED:
                self.counters.unauthorized += 1
            else:
                self.counters.bad_requests += 1
            logger.warning("rejected request %d: %s: %s", request_id, exc.code.value, exc)
            reply = {"ok": False, "code": exc.code.value, "error": str(exc)}
            payload, link = [], None
        except Exception as exc:  # a bug must cost one request, not the server
            self.counters.bad_requests += 1
            logger.exception("internal error on request %d", request_id)
            reply, payload, link = ({"ok": False, "code": ErrorCode.BAD_REQUEST.value,
                                     "error": f"internal error: {type(exc).__name__}"}, [], None)
        reply = {"v": PROTOCOL_VERSION, "id": request_id, "epoch": self.epoch, **sid_seq, **reply}
        self._send(identity, seal(reply, payload, self.config.secret), link)

    def _dispatch(self, header: dict[str, Any], payload: list[memoryview]
                  ) -> tuple[dict[str, Any], list[memoryview], tuple[str, int] | None]:
        op = require(header, "op", str)
        if op != Op.PUT.value and payload:
            raise ProtocolError(f"{op} takes no payload frames")
        if op == Op.PING.value:
            return {"ok": True, "version": PROTOCOL_VERSION}, [], None
        if op == Op.STATS.value:
            try:  # cheap (one pass over the entries); lets tests audit a live server
                self.check_integrity()
                integrity = "ok"
            except AssertionError as exc:
                integrity = f"violated: {exc}"
                logger.error("integrity check failed: %s", exc)
            return {"ok": True, "stats": self.stats(), "integrity": integrity}, [], None
        if op == Op.PUT.value:
            status = self._put(header, payload)
            return {"ok": True, "status": status}, [], ("in", sum(p.nbytes for p in payload))
        if op == Op.GET.value:
            items, frames = self._get(header)
            return {"ok": True, "items": items}, frames, ("out", sum(f.nbytes for f in frames))
        if op == Op.EXISTS.value:
            present = self._exists(header)
            prefix = present.index(False) if False in present else len(present)
            return {"ok": True, "present": present, "prefix": prefix}, [], None
        if op == Op.CORRUPT.value:
            if not self.config.fault_injection:
                raise ProtocolError("fault injection is disabled", ErrorCode.DISABLED)
            return {"ok": True, "corrupted": self._corrupt(header)}, [], None
        raise ProtocolError(f"unknown op {op!r}")

    # -- ops ------------------------------------------------------------------------------
    def _put(self, header: dict[str, Any], payload: list[memoryview]) -> list[str]:
        items = require(header, "items", list)
        if len(items) != len(payload):
            raise ProtocolError(f"{len(items)} put items but {len(payload)} payload frames")
        status: list[str] = []
        for item, frame in zip(items, payload):
            if not isinstance(item, dict):
                raise ProtocolError("put item must be a map")
            key = require(item, "key", bytes)
            if len(key) != KEY_BYTES:
                raise ProtocolError(f"key must be {KEY_BYTES} bytes")
            manifest = ChunkManifest.from_wire(item.get("m"))
            if not manifest.verify(frame):
                self.counters.corrupt_rejected += 1
                logger.warning("put %s rejected: checksum/size mismatch", key.hex()[:16])
                status.append(PutStatus.CORRUPT.value)
                continue
            outcome = self.store.put(key, StoredChunk(manifest, frame), frame.nbytes)
            self.counters.evictions += outcome.evicted
            if outcome.admission is Admission.STORED:
                self.counters.puts += 1
                status.append(PutStatus.STORED.value)
            elif outcome.admission is Admission.EXISTS:
                self.counters.put_exists += 1
                status.append(PutStatus.EXISTS.value)
            else:
                self.counters.full_rejected += 1
                logger.warning("put %s rejected: %d bytes > capacity %d", key.hex()[:16],
                               frame.nbytes, self.store.capacity_bytes)
                status.append(PutStatus.TOO_LARGE.value)
        return status

    def _lookup_keys(self, header: dict[str, Any]) -> tuple[list[bytes], bytes]:
        keys = require_keys(header, KEY_BYTES)
        ns = require(header, "ns", bytes)
        if len(ns) != NAMESPACE_BYTES:
            raise ProtocolError(f"ns must be {NAMESPACE_BYTES} bytes")
        return keys, ns

    def _get(self, header: dict[str, Any]) -> tuple[list[dict[str, Any]], list[memoryview]]:
        keys, ns = self._lookup_keys(header)
        items: list[dict[str, Any]] = []
        frames: list[memoryview] = []
        for key in keys:  # prefix semantics: stop at the first missing chunk
            chunk = self.store.get(key)
            if chunk is None or chunk.manifest.ns != ns:
                break
            items.append({"key": key, "m": chunk.manifest.to_wire()})
            frames.append(chunk.payload)
        self.counters.hits += len(items)
        self.counters.misses += len(keys) - len(items)
        return items, frames

    def _exists(self, header: dict[str, Any]) -> list[bool]:
        keys, ns = self._lookup_keys(header)
        self.counters.lookups += 1
        present = []
        for key in keys:
            chunk = self.store.peek(key)
            present.append(chunk is not None and chunk.manifest.ns == ns)
        self.store.touch(k for k, p in zip(keys, present) if p)  # a lookup predicts a get
        return present

    def _corrupt(self, header: dict[str, Any]) -> int:
        done = 0
        for key in require_keys(header, KEY_BYTES):
            chunk = self.store.peek(key)
            if chunk is not None:
                damaged = bytearray(chunk.payload)
                damaged[len(damaged) // 2] ^= 0xFF
                self.store.replace(key, StoredChunk(chunk.manifest, memoryview(damaged)))
                done += 1
        logger.warning("fault injection: corrupted %d chunks", done)
        return done

    # -- sending --------------------------------------------------------------------------
    def _send(self, identity: bytes, frames: list[Any], link: tuple[str, int] | None) -> None:
        if self._throttle is None or link is None or link[1] == 0:
            self._send_now(identity, frames)
        else:
            self._throttle.schedule([identity, *frames], *link)

    def _flush_delayed(self) -> None:
        for frames in [] if self._throttle is None else self._throttle.due():
            self._send_now(frames[0], frames[1:])

    def _send_now(self, identity: bytes, frames: list[Any]) -> None:
        self.counters.bytes_out += sum(memoryview(f).nbytes for f in frames)
        try:
            self._sock.send_multipart([identity, *frames], copy=False)
        except zmq.ZMQError as exc:  # peer gone: its request is simply unanswered
            logger.warning("reply dropped: %s", exc)


def _session_echo(header: dict[str, Any]) -> dict[str, Any]:
    """The request's sid/seq for the reply (a client accepts replies to its session only)."""
    return {k: header[k] for k in ("sid", "seq") if isinstance(header.get(k), (bytes, int))}


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config, secret = config_from_args(args)
        server = KVTierServer(config)
    except (ValueError, OSError, zmq.ZMQError) as exc:  # incl. a bad or unreadable secret
        logger.error("cannot start: %s", exc)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    print(f"vericache-tier listening on {server.endpoint}", flush=True)
    logger.info("listening on %s capacity=%d B bandwidth=%s MB/s secret from %s epoch %s",
                server.endpoint, config.capacity_bytes, config.bandwidth_mb_s, secret.source,
                server.epoch.hex())
    try:
        server.serve_forever()
    finally:
        logger.info("shutting down; stats=%s", server.stats())
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
