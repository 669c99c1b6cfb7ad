"""Integrity manifests for cached model directories.

A converted model directory is valid only if its manifest exists and every file it lists has
the recorded size and sha256. The manifest is written last, after every other file, so a
directory left behind by a crash or a full disk has no manifest and is never loaded.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

MANIFEST_NAME = "vericache-manifest.json"
MANIFEST_VERSION = 1
_BLOCK = 8 << 20


def sha256_file(path: Path, on_bytes: Callable[[int], object] | None = None) -> str:
    """sha256 of a file, streamed; ``on_bytes(n)`` is called per block (progress bars)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
            if on_bytes is not None:
                on_bytes(len(block))
    return h.hexdigest()


def write_manifest(directory: Path, source: dict[str, str]) -> None:
    """Hash every regular file in ``directory`` and write the manifest (last)."""
    files = {
        p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST_NAME
    }
    doc = {"version": MANIFEST_VERSION, "source": source, "files": files}
    tmp = directory / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True))
    tmp.replace(directory / MANIFEST_NAME)


def check_manifest(
    directory: Path, source: dict[str, str], on_bytes: Callable[[int], object] | None = None
) -> str | None:
    """Return None if ``directory`` is a complete, uncorrupted build of ``source``, else why not.

    Sizes are checked for every file before any hashing, so a partial build fails fast.
    """
    path = directory / MANIFEST_NAME
    if not path.is_file():
        return "no manifest (the conversion did not finish)"
    try:
        doc = json.loads(path.read_text())
        files: dict[str, dict[str, object]] = doc["files"]
    except (ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest ({exc})"
    if doc.get("version") != MANIFEST_VERSION or doc.get("source") != source:
        return "manifest is for another source or format version"
    for name, meta in files.items():
        p = directory / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != meta["size"]:
            return f"{name} has {p.stat().st_size} bytes, expected {meta['size']}"
    for name, meta in files.items():
        if sha256_file(directory / name, on_bytes) != meta["sha256"]:
            return f"{name} is corrupt (sha256 mismatch)"
    return None


def manifest_total_bytes(directory: Path) -> int:
    """Bytes covered by the manifest (for sizing a progress bar); 0 when there is none."""
    try:
        doc = json.loads((directory / MANIFEST_NAME).read_text())
        return sum(int(m["size"]) for m in doc["files"].values())
    except (OSError, ValueError, KeyError, TypeError):
        return 0
