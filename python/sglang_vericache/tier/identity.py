"""Model identity: what every tier key says about the model that computed the KV.

A key must change whenever the KV for the same tokens could differ, and must not change just
because the same weights sit in another directory. So the identity is built from content:

- ``weights``: blake2b over every weight file of the model directory (``*.safetensors``,
  their ``*.index.json``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``), each as (file name,
  size, full-content digest). Hashing a 100 GB checkpoint takes a while, so each file's
  digest is cached in a small JSON sidecar under ``~/.cache/sglang_vericache/identity/``
  (``$VERICACHE_IDENTITY_CACHE``) keyed by (real path, size, mtime_ns): computed once per
  file version, re-read on any change of size or mtime.
- ``config``: digest of ``config.json`` (canonical JSON: key order does not matter).
- ``dtype`` (the served weight dtype), ``quantization``, ``overrides`` (rope scaling, JSON
  model overrides, ... as a canonical JSON map) and ``tp_rank``.

A running server's weights can change (SGLang's weight updates): its identity is then that of
what it loaded (``srt/prefix/model_identity.py``), never a count of updates, which two servers on
different weights could share. Weights that cannot be digested get a ``private`` identity: a
fresh nonce that no other server, and no later state of this one, can have.

``ModelIdentity.model_id()`` is what goes into ``KVGeometry.model_id`` and thereby into the
namespace of every key and manifest. It is content only: the same weights copied to another
path (or machine) share keys; two ``final/`` directories of different runs never do. Pure
stdlib: no torch, no sglang (``srt/`` reads the server's arguments and calls this).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_vericache.paths import cache_path

logger = logging.getLogger("sglang_vericache.tier.identity")

IDENTITY_VERSION = "vericache-identity-v2"  # v2: no weight-update counter
CACHE_ENV = "VERICACHE_IDENTITY_CACHE"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
INDEX_SUFFIX = ".index.json"
CONFIG_NAME = "config.json"
_READ_BYTES = 8 << 20
_PROGRESS_EVERY_S = 5.0
_HASH_THREADS = 4  # hashlib releases the GIL on big buffers: files hash in parallel


def default_cache_dir() -> Path:
    return cache_path("identity", CACHE_ENV)


@dataclass(frozen=True, slots=True)
class DigestCache:
    """Sidecar cache of whole-file digests: one JSON file per weight file in ``directory``.

    An entry is used only if the file's real path, size and mtime_ns all match; a file
    rewritten in place gets a new mtime and is hashed again. A broken or unwritable cache is
    never an error: the digest is just recomputed.
    """

    directory: Path

    def _entry_path(self, real: str) -> Path:
        return self.directory / (hashlib.blake2b(real.encode(), digest_size=16).hexdigest()
                                 + ".json")

    def lookup(self, real: str, st: os.stat_result) -> str | None:
        try:
            entry = json.loads(self._entry_path(real).read_text())
        except (OSError, ValueError):
            return None
        if (isinstance(entry, dict) and entry.get("path") == real
                and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns
                and entry.get("algo") == "blake2b-256" and isinstance(entry.get("digest"), str)):
            return entry["digest"]
        return None

    def store(self, real: str, st: os.stat_result, digest: str) -> None:
        entry = {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                 "algo": "blake2b-256", "digest": digest}
        target = self._entry_path(real)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entry))
            os.replace(tmp, target)  # readers see the old entry or the new one, never half
        except OSError as exc:
            logger.warning("cannot write identity cache %s: %s", target, exc)


def file_digest(path: Path, cache: DigestCache | None = None) -> str:
    """blake2b-256 hex digest of a file's whole content (cached when ``cache`` is given)."""
    real = os.path.realpath(path)
    st = os.stat(real)
    if cache is not None:
        hit = cache.lookup(real, st)
        if hit is not None:
            return hit
    h = hashlib.blake2b(digest_size=32)
    buf = bytearray(_READ_BYTES)
    view = memoryview(buf)
    done, last_log = 0, time.monotonic()
    with open(real, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            done += n
            if time.monotonic() - last_log > _PROGRESS_EVERY_S:
                last_log = time.monotonic()
                logger.info("hashing %s for the model identity: %.1f / %.1f GiB", path.name,
                            done / (1 << 30), st.st_size / (1 << 30))
    digest = h.hexdigest()
    if cache is not None:
        cache.store(real, st, digest)
    return digest


def weight_files(model_dir: Path) -> list[Path]:
    """The files whose content is the model's weights (top level of ``model_dir``, sorted)."""
    return sorted(p for p in model_dir.iterdir() if p.is_file() and (
        p.name.endswith(WEIGHT_SUFFIXES) or p.name.endswith(INDEX_SUFFIX)))


def weights_digest(model_path: Path, cache: DigestCache | None = None) -> str:
    """Digest of a model's weights: a directory's weight files, or one weight file (GGUF).

    Raises FileNotFoundError when there is no weight file to hash.
    """
    files = [model_path] if model_path.is_file() else weight_files(model_path)
    if not files:
        raise FileNotFoundError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {model_path}")
    total = sum(f.stat().st_size for f in files)
    if total > 1 << 30:
        logger.info("model identity: digesting %d weight files (%.1f GiB; cached after the "
                    "first time)", len(files), total / (1 << 30))
    with ThreadPoolExecutor(min(_HASH_THREADS, len(files))) as pool:
        digests = list(pool.map(lambda f: file_digest(f, cache), files))
    h = hashlib.blake2b(b"weights\x00", digest_size=32)
    for f, digest in zip(files, digests):  # names too: a renamed shard is another layout
        h.update(f"{f.name}\x00{f.stat().st_size}\x00{digest}\x00".encode())
    return h.hexdigest()


def canonical_json(obj: Any) -> str:
    """JSON text that is equal for equal values (sorted keys, no whitespace)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def config_digest(model_path: Path) -> str | None:
    """Digest of ``config.json`` beside the weights (None when the model has none, e.g. GGUF)."""
    path = (model_path.parent if model_path.is_file() else model_path) / CONFIG_NAME
    if not path.is_file():
        return None
    text = canonical_json(json.loads(path.read_text()))
    return hashlib.blake2b(text.encode(), digest_size=32).hexdigest()


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """Everything that decides a model's KV for given tokens (module doc).

    name: human-readable (directory name), for logs only: not part of the digest or keys.
    weights / config: content digests (``weights_digest``, ``config_digest``); config None
        when the model has no config.json.
    dtype: the served weight dtype (e.g. "float32", "bfloat16"; after SGLang resolved "auto").
    quantization: the served quantization method, None when unquantized.
    overrides: canonical JSON map of the other arguments that change the model's numbers
        (rope scaling, JSON model overrides, revision, ...); "{}" when none.
    tp_rank: this rank's slice of the weights.
    """

    name: str
    weights: str
    config: str | None
    dtype: str
    quantization: str | None = None
    overrides: str = "{}"
    tp_rank: int = 0

    def __post_init__(self) -> None:
        if not self.name or "\x00" in self.name:
            raise ValueError(f"identity name must be non-empty, without NUL: {self.name!r}")
        if not self.weights or not self.dtype:
            raise ValueError("identity needs a weights digest and a dtype")
        if not isinstance(self.tp_rank, int) or isinstance(self.tp_rank, bool) \
                or self.tp_rank < 0:
            raise ValueError(f"tp_rank must be an int >= 0, got {self.tp_rank!r}")
        if not isinstance(json.loads(self.overrides), dict):
            raise ValueError("overrides must be a JSON map")

    @classmethod
    def for_model(cls, model_path: str | os.PathLike[str], *, dtype: str,
                  quantization: str | None = None, overrides: Mapping[str, Any] | None = None,
                  tp_rank: int = 0, cache: DigestCache | None = None) -> ModelIdentity:
        """The identity of the local model at ``model_path`` (a directory, or one GGUF file).

        cache: where file digests are kept (default: ``default_cache_dir()``).
        """
        path = Path(model_path).expanduser().resolve()
        cache = DigestCache(default_cache_dir()) if cache is None else cache
        return cls(name=path.name, weights=weights_digest(path, cache),
                   config=config_digest(path), dtype=dtype, quantization=quantization,
                   overrides=canonical_json(dict(overrides or {})), tp_rank=tp_rank)

    def private(self) -> ModelIdentity:
        """This identity with weights no one can name: a fresh random nonce in place of the
        weights digest (and no config digest), for weights that cannot be digested. Its keys
        match no other server's and no other ``private()`` call's."""
        return dataclasses.replace(self, weights=f"private:{uuid.uuid4()}", config=None)

    def is_private(self) -> bool:
        return self.weights.startswith("private:")

    def digest(self) -> str:
        """32 hex chars over every field but ``name`` (explicit, versioned encoding)."""
        fields = [IDENTITY_VERSION, self.weights, self.config or "-", self.dtype,
                  self.quantization or "-", self.overrides, str(self.tp_rank)]
        return hashlib.blake2b("\x00".join(fields).encode(), digest_size=16).hexdigest()

    def model_id(self) -> str:
        """The ``KVGeometry.model_id`` of KV this model computes (content only, no name)."""
        return f"vericache-model:{self.digest()}"

    def describe(self) -> str:
        """For logs: the name, the model id and the fields that vary most."""
        weights = "private (shared with no one)" if self.is_private() else self.weights[:16]
        return (f"{self.name} ({self.model_id()}: weights {weights}, dtype {self.dtype}, "
                f"quantization {self.quantization}, TP rank {self.tp_rank}, overrides "
                f"{self.overrides})")
