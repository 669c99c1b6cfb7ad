from __future__ import annotations

import pytest
import torch

from sglang_vericache.ops.dropped_decode import (
    FlashInferDroppedKVDecoder,
    PagedDecodeGeometry,
    TorchDroppedKVDecoder,
    flashinfer_usable,
    make_dropped_kv_decoder,
)
from sglang_vericache.ops.reference import gqa_attention_fp32


def test_cpu_selects_torch_path() -> None:
    assert not flashinfer_usable(torch.device("cpu"))
    decoder = make_dropped_kv_decoder(torch.device("cpu"))
    assert isinstance(decoder, TorchDroppedKVDecoder)


def test_cuda_selection_follows_flashinfer_presence() -> None:
    cuda = torch.device("cuda")
    if not flashinfer_usable(cuda):  # no CUDA or no flashinfer: the torch path, no workspace
        assert isinstance(make_dropped_kv_decoder(cuda), TorchDroppedKVDecoder)
        return
    with pytest.raises(ValueError):
        make_dropped_kv_decoder(cuda)  # FlashInfer needs a caller-owned workspace
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=cuda)
    assert isinstance(make_dropped_kv_decoder(cuda, workspace), FlashInferDroppedKVDecoder)


def test_torch_path_matches_dense_attention_over_kept_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    page, heads_q, heads_kv, dim = 4, 6, 2, 16
    kept = [9, 4]  # kept tokens per request
    pool = torch.randn(2, 8, page, heads_kv, dim, generator=gen)  # (k|v, pages, P, H, D)
    indices = torch.tensor([5, 0, 3, 7], dtype=torch.int32)  # request 0: 3 pages, 1: 1 page
    indptr = torch.tensor([0, 3, 4], dtype=torch.int32)
    last = torch.tensor([1, 4], dtype=torch.int32)
    q = torch.randn(2, heads_q, dim, generator=gen)
    decoder = make_dropped_kv_decoder(torch.device("cpu"))
    decoder.plan(indptr, indices, last, PagedDecodeGeometry(heads_q, heads_kv, dim, page,
                                                            torch.float32))
    out = decoder.run(q, pool[0], pool[1])
    for b, n in enumerate(kept):
        ids = indices[indptr[b]: indptr[b + 1]].long()
        keys = pool[0][ids].reshape(-1, heads_kv, dim)[:n].transpose(0, 1)
        values = pool[1][ids].reshape(-1, heads_kv, dim)[:n].transpose(0, 1)
        expected = gqa_attention_fp32(q[b], keys, values, dim ** -0.5)
        assert torch.allclose(out[b], expected, atol=1e-6)


def test_torch_path_validates_plan() -> None:
    decoder = TorchDroppedKVDecoder()
    geo = PagedDecodeGeometry(2, 1, 8, 4, torch.float32)
    with pytest.raises(RuntimeError):
        decoder.run(torch.zeros(1, 2, 8), torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8))
    with pytest.raises(ValueError):
        decoder.plan(torch.tensor([0, 0], dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                     torch.tensor([1], dtype=torch.int32), geo)
    with pytest.raises(ValueError):
        decoder.plan(torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                     torch.tensor([5], dtype=torch.int32), geo)
    with pytest.raises(ValueError):
        PagedDecodeGeometry(3, 2, 8, 4, torch.float32)
