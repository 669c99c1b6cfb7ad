"""KVGeometry, chunk layout and chained chunk keys (pure, fast)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from sglang_vericache.tier.geometry import KVGeometry
from sglang_vericache.tier.layout import alloc_chunks, join_chunks, split_chunks
from sglang_vericache.tier.keys import ChunkKey, chunk_keys
from tier_testlib import PACKAGE_ROOT, TINY


def test_geometry_validation() -> None:
    with pytest.raises(ValueError, match="num_layers"):
        KVGeometry("m", 0, 2, 4, "float32", 8)
    with pytest.raises(ValueError, match="dtype"):
        KVGeometry("m", 2, 2, 4, "int8", 8)
    with pytest.raises(ValueError, match="model_id"):
        KVGeometry("", 2, 2, 4, "float32", 8)
    with pytest.raises(ValueError, match="chunk_tokens"):
        KVGeometry("m", 2, 2, 4, "float32", True)
    assert KVGeometry.from_torch_dtype("m", 2, 2, 4, torch.bfloat16, 8).dtype == "bfloat16"


def test_chunk_layout_sizes() -> None:
    g = KVGeometry("m", 3, 2, 4, "bfloat16", 8)
    assert g.chunk_shape(5) == (3, 2, 2, 5, 4)
    assert g.layer_nbytes(5) == 2 * 2 * 5 * 4 * 2
    assert g.chunk_nbytes(5) == 3 * g.layer_nbytes(5)
    assert g.chunk_lengths(0) == []
    assert g.chunk_lengths(17) == [8, 8, 1]
    with pytest.raises(ValueError):
        g.chunk_shape(9)


@pytest.mark.parametrize("field", ["model_id", "num_layers", "num_kv_heads", "head_dim",
                                   "dtype", "chunk_tokens"])
def test_every_geometry_field_changes_namespace_and_keys(field: str) -> None:
    other_value = {"model_id": "other", "num_layers": 3, "num_kv_heads": 1, "head_dim": 8,
                   "dtype": "float16", "chunk_tokens": 16}[field]
    other = dataclasses.replace(TINY, **{field: other_value})
    assert other.namespace() != TINY.namespace()
    tokens = list(range(4))  # shorter than either chunk size: same chunk split
    assert chunk_keys(other, tokens)[0].digest != chunk_keys(TINY, tokens)[0].digest


def test_keys_are_chained_and_prefix_stable() -> None:
    tokens = list(range(100, 130))  # 3 full chunks + 6
    keys = chunk_keys(TINY, tokens)
    assert [k.num_tokens for k in keys] == [8, 8, 8, 6]
    assert len({k.digest for k in keys}) == 4
    # A prefix of the sequence has a prefix of the keys (for whole chunks).
    assert chunk_keys(TINY, tokens[:16]) == keys[:2]
    # Changing an early token changes every later key (causality).
    changed = chunk_keys(TINY, [tokens[0] + 1] + tokens[1:])
    assert all(a.digest != b.digest for a, b in zip(changed, keys))
    # Changing a late token leaves earlier keys alone.
    late = chunk_keys(TINY, tokens[:20] + [0] + tokens[21:])
    assert late[:2] == keys[:2] and late[2] != keys[2]
    # A short last chunk never aliases the full chunk that replaces it.
    assert chunk_keys(TINY, tokens[:20])[2].digest != chunk_keys(TINY, tokens[:24])[2].digest
    # Extending a chain from a parent equals hashing the whole sequence.
    assert chunk_keys(TINY, tokens[16:], parent=keys[1]) == keys[2:]
    with pytest.raises(ValueError, match="parent"):
        chunk_keys(TINY, tokens, parent=keys[3])
    assert chunk_keys(TINY, torch.tensor(tokens)) == keys
    assert chunk_keys(TINY, []) == []


def test_keys_identical_across_processes_and_hash_seeds() -> None:
    """Keys are pure stdlib (no torch import) and independent of PYTHONHASHSEED."""
    fields = dataclasses.astuple(TINY)
    code = ("import sys;"
            "from sglang_vericache.tier.geometry import KVGeometry;"
            "from sglang_vericache.tier.keys import chunk_keys;"
            f"print(chunk_keys(KVGeometry(*{fields!r}), list(range(20)))[-1].hex(),"
            " 'torch' in sys.modules)")
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": PACKAGE_ROOT}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                capture_output=True, text=True).stdout.strip())
    assert outs == {chunk_keys(TINY, list(range(20)))[-1].hex() + " False"}


def test_chunk_key_validation() -> None:
    with pytest.raises(ValueError):
        ChunkKey(b"short", 8)
    with pytest.raises(ValueError):
        ChunkKey(bytes(32), 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_split_join_alloc_roundtrip(dtype: str) -> None:
    g = dataclasses.replace(TINY, dtype=dtype)
    kv = torch.randn(2, 2, 2, 19, 4).to(g.torch_dtype)
    chunks = split_chunks(kv, g)
    assert [c.shape[3] for c in chunks] == [8, 8, 3]
    assert all(c.is_contiguous() for c in chunks)
    assert torch.equal(join_chunks(chunks), kv)
    chunks[0].zero_()  # split returns copies, never views of the caller's tensor
    assert not torch.equal(join_chunks(chunks), kv)
    bufs = alloc_chunks(g, 19)
    assert [tuple(b.shape) for b in bufs] == [g.chunk_shape(8), g.chunk_shape(8), g.chunk_shape(3)]
    with pytest.raises(ValueError, match="dtype"):
        g.check_chunk(chunks[0].float() if dtype != "float32" else chunks[0].half(), 8)
    with pytest.raises(ValueError, match="contiguous"):
        g.check_chunk(torch.empty(2, 2, 2, 4, 8, dtype=g.torch_dtype).transpose(3, 4), 8)
