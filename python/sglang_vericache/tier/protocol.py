"""Wire protocol of the zmq full-KV tier (version 2): msgpack headers + raw payload frames.

Every message (request or reply) is one zmq multipart message::

    [ header: msgpack map ][ payload frame 0 ] ... [ payload frame k-1 ][ mac: 32 bytes ]

- ``header`` always has ``v`` (protocol version) and ``id`` (the client's request id, echoed
  in the reply); requests have ``op`` and the authentication fields ``ts``, ``sid``, ``seq``;
  replies have ``ok``, ``epoch`` and the request's ``sid``/``seq`` and, on failure, ``code`` +
  ``error``.
- payload frames are raw chunk bytes (one frame per chunk, layout in ``geometry.py``), sent
  and received zero-copy.
- ``mac``: always, 32 bytes. Keyed blake2b (the shared secret that server and clients always
  have: ``secret.py``) over the header and the frame lengths; payload frames are bound to it
  through the checksums of their manifests in the header. Details and replay protection:
  ``auth.py``.
- ``epoch``: 8 random bytes drawn when the server starts. A client that sees it change knows
  the server lost everything it held (restart), so it forgets what it remembers as stored.

Limits the server checks as frames arrive, before it hashes or keeps anything: at most
``max_frames`` frames and ``max_message_bytes`` bytes per message, ``MAX_HEADER_BYTES`` per
header, and libzmq's ZMQ_MAXMSGSIZE (``max_frame_bytes``) per frame, which disconnects the
sender of an oversized frame before it is buffered. A refused message gets an error reply
(``unauthorized`` / ``limit``) and never touches the store.

Ops (request fields -> reply fields):
  ping   {}                                  -> {version}
  put    {items: [{key, m: manifest}]} + one frame per item -> {status: [str per item]}
  get    {keys, ns}                          -> {items: [{key, m}]} + one frame per item,
                                                for the LEADING run of stored keys (prefix)
  exists {keys, ns}                          -> {present: [bool], prefix: int}
  stats  {}                                  -> {stats: {name: int}, integrity: "ok" | why}
  corrupt {keys}  (server --fault-injection only; flips a byte in stored chunks: tests)

A manifest says what a chunk is and that it is complete: ``ns`` (geometry namespace, 16 B),
``n`` (tokens), ``layers`` (count), ``nbytes``, ``algo`` and ``sums`` (one checksum per
layer over that layer's bytes). The server verifies it on put; the client re-verifies on
get. A chunk is stored only whole (zmq delivers a multipart message atomically), so a
partial write can never be read back as a hit.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgpack

PROTOCOL_VERSION = 2
KEY_BYTES = 32
NAMESPACE_BYTES = 16
CHECKSUM_ALGO = "sha256-128"  # SHA-NI makes sha256 the fastest hashlib digest here (1.7 GB/s)
CHECKSUM_BYTES = 16
MAX_HEADER_BYTES = 1 << 20
MAX_KEYS_PER_REQUEST = 8192
EPOCH_BYTES = 8
# header + one payload frame per key + MAC: the most frames a legitimate message has
MAX_FRAMES = MAX_KEYS_PER_REQUEST + 2


class Op(str, Enum):
    PING = "ping"
    PUT = "put"
    GET = "get"
    EXISTS = "exists"
    STATS = "stats"
    CORRUPT = "corrupt"


class ErrorCode(str, Enum):
    BAD_REQUEST = "bad_request"
    UNAUTHORIZED = "unauthorized"
    VERSION = "version"
    DISABLED = "disabled"
    LIMIT = "limit"  # too many frames or bytes in one message


class PutStatus(str, Enum):
    STORED = "stored"
    EXISTS = "exists"            # same key already stored (not an error)
    CORRUPT = "corrupt"          # checksum or size mismatch: rejected
    TOO_LARGE = "too_large"      # bigger than the whole byte budget: rejected, nothing evicted


class ProtocolError(ValueError):
    """A message that does not follow this protocol; ``code`` goes into the error reply."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.BAD_REQUEST) -> None:
        super().__init__(message)
        self.code = code


def layer_checksums(payload: memoryview | bytes, num_layers: int) -> list[bytes]:
    """One CHECKSUM_BYTES digest per layer; ``payload`` is a whole chunk (length must be a
    multiple of num_layers). hashlib releases the GIL on large buffers."""
    view = memoryview(payload).cast("B")
    if num_layers <= 0 or len(view) % num_layers:
        raise ProtocolError(f"payload of {len(view)} bytes does not split into {num_layers} layers")
    step = len(view) // num_layers
    return [hashlib.sha256(view[i * step:(i + 1) * step]).digest()[:CHECKSUM_BYTES]
            for i in range(num_layers)]


@dataclass(frozen=True, slots=True)
class ChunkManifest:
    """What a stored chunk is (see module docstring). Immutable once built."""

    ns: bytes
    num_tokens: int
    num_layers: int
    nbytes: int
    sums: tuple[bytes, ...]
    algo: str = CHECKSUM_ALGO

    @classmethod
    def of(cls, ns: bytes, num_tokens: int, num_layers: int, payload: memoryview) -> ChunkManifest:
        sums = layer_checksums(payload, num_layers)
        return cls(ns, num_tokens, num_layers, memoryview(payload).nbytes, tuple(sums))

    def to_wire(self) -> dict[str, Any]:
        return {"ns": self.ns, "n": self.num_tokens, "layers": self.num_layers,
                "nbytes": self.nbytes, "algo": self.algo, "sums": list(self.sums)}

    @classmethod
    def from_wire(cls, obj: Any) -> ChunkManifest:
        if not isinstance(obj, dict):
            raise ProtocolError("manifest must be a map")
        ns = require(obj, "ns", bytes)
        n = require(obj, "n", int)
        layers = require(obj, "layers", int)
        nbytes = require(obj, "nbytes", int)
        algo = require(obj, "algo", str)
        sums = require(obj, "sums", list)
        if len(ns) != NAMESPACE_BYTES or n <= 0 or layers <= 0 or nbytes <= 0:
            raise ProtocolError("manifest fields out of range")
        if algo != CHECKSUM_ALGO:
            raise ProtocolError(f"unsupported checksum algo {algo!r}")
        if len(sums) != layers or not all(isinstance(s, bytes) and len(s) == CHECKSUM_BYTES
                                          for s in sums):
            raise ProtocolError("manifest needs one checksum per layer")
        return cls(ns, n, layers, nbytes, tuple(sums), algo)

    def verify(self, payload: memoryview) -> bool:
        """True iff payload has nbytes bytes and every layer checksum matches."""
        if memoryview(payload).nbytes != self.nbytes:
            return False
        actual = layer_checksums(payload, self.num_layers)
        return all(hmac.compare_digest(a, b) for a, b in zip(actual, self.sums))


def require(obj: dict[str, Any], name: str, kind: type) -> Any:
    """obj[name] checked to be of ``kind`` (bool is not accepted as int)."""
    if name not in obj:
        raise ProtocolError(f"missing field {name!r}")
    value = obj[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"field {name!r} must be {kind.__name__}")
    return value


def require_keys(obj: dict[str, Any], key_bytes: int) -> list[bytes]:
    keys = require(obj, "keys", list)
    if len(keys) > MAX_KEYS_PER_REQUEST:
        raise ProtocolError(f"too many keys ({len(keys)} > {MAX_KEYS_PER_REQUEST})")
    if not all(isinstance(k, bytes) and len(k) == key_bytes for k in keys):
        raise ProtocolError(f"keys must be {key_bytes}-byte strings")
    return keys


def pack_header(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def unpack_header(frame: memoryview | bytes) -> dict[str, Any]:
    """Decode and sanity-check a header frame; raise ProtocolError on anything unexpected."""
    if len(frame) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(bytes(frame), raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header is not msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a msgpack map")
    version = require(header, "v", int)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} != {PROTOCOL_VERSION}", ErrorCode.VERSION)
    require(header, "id", int)
    return header
