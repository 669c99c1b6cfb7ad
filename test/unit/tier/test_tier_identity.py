"""Model identity in every key (tier/identity.py) and the server glue that feeds it
(srt/model_identity.py, read with stand-in server arguments: no SGLang server here)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
from sglang_vericache.srt import model_identity as glue
from sglang_vericache.tier.geometry import KVGeometry
from sglang_vericache.tier.identity import DigestCache, ModelIdentity, file_digest
from sglang_vericache.tier.keys import chunk_keys
from tier_testlib import TINY

TOKENS = list(range(8))


def _safetensors(tensors: dict[str, bytes]) -> bytes:
    """A real safetensors file: 8-byte header length, JSON header, raw data."""
    header, offset = {}, 0
    for name, data in tensors.items():
        header[name] = {"dtype": "F32", "shape": [len(data) // 4],
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + b"".join(tensors.values())


def make_model(root: Path, name: str = "final", weights: bytes = b"\x01" * 64,
               config: dict | None = None) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(_safetensors({"w": weights}))
    (path / "config.json").write_text(json.dumps(config or {"hidden_size": 4, "layers": 2}))
    (path / "tokenizer.json").write_text("{}")  # not weights: ignored
    return path


def geometry(identity: ModelIdentity) -> KVGeometry:
    return dataclasses.replace(TINY, model_id=identity.model_id())


def key(identity: ModelIdentity) -> bytes:
    return chunk_keys(geometry(identity), TOKENS)[0].digest


def test_same_directory_name_different_weights_never_share_a_key(tmp_path: Path) -> None:
    run_a = make_model(tmp_path / "ckpt" / "run-a")
    run_b = make_model(tmp_path / "ckpt" / "run-b", weights=b"\x02" * 64)
    a = ModelIdentity.for_model(run_a, dtype="float32")
    b = ModelIdentity.for_model(run_b, dtype="float32")
    assert a.name == b.name == "final"
    assert a.model_id() != b.model_id()
    assert geometry(a).namespace() != geometry(b).namespace() and key(a) != key(b)


def test_same_weights_in_two_paths_share_the_identity(tmp_path: Path) -> None:
    one = make_model(tmp_path / "x", name="llama")
    two = make_model(tmp_path / "mnt" / "copy", name="other-name")
    a = ModelIdentity.for_model(one, dtype="float32")
    b = ModelIdentity.for_model(two, dtype="float32")
    assert a.model_id() == b.model_id() and key(a) == key(b)
    (two / "config.json").write_text(json.dumps({"layers": 2, "hidden_size": 4}))  # reordered
    assert ModelIdentity.for_model(two, dtype="float32").model_id() == a.model_id()
    (two / "config.json").write_text(json.dumps({"layers": 2, "hidden_size": 8}))
    assert ModelIdentity.for_model(two, dtype="float32").model_id() != a.model_id()


@pytest.mark.parametrize("change", [
    {"dtype": "bfloat16"}, {"quantization": "fp8"}, {"tp_rank": 1}, {"weight_version": 1},
    {"overrides": '{"json_model_override_args":{"rope_scaling":{"factor":2.0}}}'},
])
def test_every_identity_field_changes_the_keys(tmp_path: Path, change: dict) -> None:
    base = ModelIdentity.for_model(make_model(tmp_path), dtype="float32")
    other = dataclasses.replace(base, **change)
    assert other.model_id() != base.model_id() and key(other) != key(base)
    assert dataclasses.replace(base, name="renamed").model_id() == base.model_id()


def test_identity_validation_and_single_file_models(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="weight_version"):
        ModelIdentity("m", "w", None, "float32", weight_version=-1)
    with pytest.raises(ValueError, match="JSON map"):
        ModelIdentity("m", "w", None, "float32", overrides="[]")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no weight files"):
        ModelIdentity.for_model(empty, dtype="float32")
    gguf = tmp_path / "model.Q4.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(64))
    single = ModelIdentity.for_model(gguf, dtype="float32")
    assert single.config is None and single.weights


def test_digest_cache_hit_does_not_reread_the_file(tmp_path: Path) -> None:
    """The mtime trick: rewrite a file with the same size and restore its mtime; a cached
    digest stays (the file was not read again); any new mtime makes it read again."""
    cache = DigestCache(tmp_path / "cache")
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"a" * 4096)
    first = file_digest(weights, cache)
    assert len(list((tmp_path / "cache").iterdir())) == 1
    st = weights.stat()
    weights.write_bytes(b"b" * 4096)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_digest(weights, cache) == first          # served from the sidecar
    assert file_digest(weights, None) != first           # really different content
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert file_digest(weights, cache) != first          # new mtime: hashed again
    for entry in (tmp_path / "cache").iterdir():
        entry.write_text("{not json")
    assert file_digest(weights, cache) == file_digest(weights, None)  # broken cache: rehash


def test_identity_of_a_big_model_comes_from_the_cache_the_second_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model(tmp_path, weights=os.urandom(1 << 20))
    cache = DigestCache(tmp_path / "cache")
    first = ModelIdentity.for_model(model, dtype="float32", cache=cache)
    reads: list[str] = []
    real_open = open

    def counting_open(file, *args, **kwargs):
        if str(file).endswith(".safetensors"):
            reads.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counting_open)
    assert ModelIdentity.for_model(model, dtype="float32", cache=cache) == first
    assert reads == []  # no weight file was opened


# -- the server glue (srt/model_identity.py) -----------------------------------------------

def _server_args(model: Path, **overrides: object) -> SimpleNamespace:
    args = {"model_path": str(model), "dtype": "auto", "quantization": None,
            "load_format": "auto", "revision": None, "json_model_override_args": "{}",
            "weight_version": "default", "model_impl": "auto",
            "model_loader_extra_config": "{}"}
    return SimpleNamespace(**{**args, **overrides})


def test_server_identity_reads_dtype_overrides_and_rank(tmp_path: Path) -> None:
    model = make_model(tmp_path)
    config = SimpleNamespace(dtype="torch.float32", quantization=None)
    plain = glue.server_model_identity(_server_args(model), config, tp_rank=0)
    # exactly what a test (or another tool) computes for a default server on this model
    assert plain == ModelIdentity.for_model(model, dtype="float32")
    rope = glue.server_model_identity(_server_args(
        model, json_model_override_args='{"rope_scaling": {"type": "linear", "factor": 2}}'),
        config, tp_rank=0)
    spaced = glue.server_model_identity(_server_args(
        model, json_model_override_args='{"rope_scaling":{"factor":2,"type":"linear"}}'),
        config, tp_rank=0)
    rank1 = glue.server_model_identity(_server_args(model), config, tp_rank=1)
    bf16 = glue.server_model_identity(_server_args(model),
                                      SimpleNamespace(dtype="torch.bfloat16"), tp_rank=0)
    ids = {i.model_id() for i in (plain, rope, rank1, bf16)}
    assert len(ids) == 4 and spaced.model_id() == rope.model_id()
    dummy = [glue.server_model_identity(_server_args(model, load_format="dummy"), config, 0)
             for _ in range(2)]  # random weights: shared with no one, not even each other
    assert dummy[0].model_id() != dummy[1].model_id() != plain.model_id()


def test_weight_update_moves_the_keys_to_a_new_version(tmp_path: Path) -> None:
    identity = ModelIdentity.for_model(make_model(tmp_path), dtype="float32")
    source = glue.tier_geometry_source(identity, 2, 2, 4, "float32", 8)
    before = source()
    assert source() is before  # cached: the link calls it on every poll
    hook = glue._after_weight_change("update_weights_from_disk")
    result = object()
    assert hook(result, "updater", "req") is result  # an AFTER hook passes the result on
    after = source()
    assert after != before and chunk_keys(after, TOKENS) != chunk_keys(before, TOKENS)
    assert after.model_id == identity.with_weight_version(glue.weight_version()).model_id()


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang")
def test_weight_update_hooks_name_real_sglang_methods() -> None:
    """The hook targets exist in the installed SGLang (a rename would silently unhook).
    Read from the source with ast: importing SGLang's scheduler takes ~20 s."""
    import ast

    module, cls = glue.WEIGHT_UPDATER.rsplit(".", 1)
    top = Path(importlib.util.find_spec("sglang").origin).parent
    source = top.joinpath(*module.split(".")[1:]).with_suffix(".py").read_text()
    (node,) = [n for n in ast.walk(ast.parse(source))
               if isinstance(n, ast.ClassDef) and n.name == cls]
    methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
    assert set(glue.WEIGHT_CHANGING_METHODS) <= methods
