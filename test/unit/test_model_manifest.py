"""Model cache integrity: a partial or corrupt cache is detected, a good one is accepted."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_vericache.models.manifest import MANIFEST_NAME, check_manifest, write_manifest

SOURCE = {"package": "p", "version": "1", "gguf": "abc"}


@pytest.fixture
def built(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    write_manifest(tmp_path, SOURCE)
    return tmp_path


def test_complete_build_passes(built: Path) -> None:
    assert check_manifest(built, SOURCE) is None


def test_missing_manifest_means_unfinished(built: Path) -> None:
    (built / MANIFEST_NAME).unlink()
    assert "did not finish" in (check_manifest(built, SOURCE) or "")


def test_truncated_file_is_detected(built: Path) -> None:
    data = (built / "model.safetensors").read_bytes()
    (built / "model.safetensors").write_bytes(data[:100])
    assert "bytes, expected" in (check_manifest(built, SOURCE) or "")


def test_flipped_byte_is_detected(built: Path) -> None:
    with open(built / "model.safetensors", "r+b") as f:
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 0xFF]))
    assert "corrupt" in (check_manifest(built, SOURCE) or "")


def test_missing_file_and_other_source(built: Path) -> None:
    assert "another source" in (check_manifest(built, {**SOURCE, "version": "2"}) or "")
    (built / "config.json").unlink()
    assert "missing" in (check_manifest(built, SOURCE) or "")


def test_garbage_manifest(built: Path) -> None:
    (built / MANIFEST_NAME).write_text("{not json")
    assert "unreadable" in (check_manifest(built, SOURCE) or "")
