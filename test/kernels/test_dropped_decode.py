from __future__ import annotations

import pytest
import torch

from sglang_vericache.ops.dropped_decode import (
    FlashInferDroppedKVDecoder,
    PagedDecodeGeometry,
    TorchDroppedKVDecoder,
    agrees_with_reference,
    flashinfer_usable,
    paged_draft_decoder,
)
from sglang_vericache.ops.reference import gqa_attention_fp32


def test_a_cpu_drafts_with_its_own_kernel_not_a_paged_decoder() -> None:
    assert not flashinfer_usable(torch.device("cpu"))
    geometry = PagedDecodeGeometry(9, 3, 64, 1, torch.float32)
    assert paged_draft_decoder(torch.device("cpu"), geometry) is None


def test_the_start_up_check_takes_the_reference_and_refuses_a_wrong_decoder() -> None:
    """What ``paged_draft_decoder`` runs on a device before drafting trusts FlashInfer."""

    class Unscaled(TorchDroppedKVDecoder):  # forgets 1/sqrt(D): close, and wrong
        def plan(self, *args, sm_scale=None) -> None:
            super().plan(*args, sm_scale=1.0)

    for geometry in (PagedDecodeGeometry(9, 3, 64, 1, torch.float32),
                     PagedDecodeGeometry(6, 2, 16, 4, torch.float32)):  # fmt: skip
        assert agrees_with_reference(TorchDroppedKVDecoder(), geometry, torch.device("cpu"))
        assert not agrees_with_reference(Unscaled(), geometry, torch.device("cpu"))


@pytest.mark.skipif(not flashinfer_usable(torch.device("cuda")), reason="needs CUDA + flashinfer")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_flashinfer_reads_a_token_pool_as_pages_of_one(dtype: torch.dtype) -> None:
    """Drafting on a GPU: SGLang's pool buffers [slots, H_kv, D] are pages of one token; rows
    of scattered slots (draft rows, then their chains) decode as the reference does."""
    cuda = torch.device("cuda")
    geometry = PagedDecodeGeometry(9, 3, 64, 1, dtype)  # SmolLM2-135M's heads
    decoder = paged_draft_decoder(cuda, geometry)
    assert isinstance(decoder, FlashInferDroppedKVDecoder)
    gen = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(4096, 3, 64, generator=gen).to(cuda, dtype) for _ in range(2))
    lens = [1500, 37, 1]
    indices = torch.randperm(4095, generator=gen)[: sum(lens)].add(1).to(cuda, torch.int32)
    indptr = torch.tensor([0, 1500, 1537, 1538], dtype=torch.int32, device=cuda)
    last = torch.ones(3, dtype=torch.int32, device=cuda)
    q = torch.randn(3, 9, 64, generator=gen).to(cuda, dtype)
    outs = []
    for d in (decoder, TorchDroppedKVDecoder()):
        d.plan(indptr, indices, last, geometry, sm_scale=0.125)
        outs.append(d.run(q, keys.unsqueeze(1), values.unsqueeze(1)).float())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0], outs[1], rtol=tol, atol=tol)


def test_torch_path_matches_dense_attention_over_kept_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    page, heads_q, heads_kv, dim = 4, 6, 2, 16
    kept = [9, 4]  # kept tokens per request
    pool = torch.randn(2, 8, page, heads_kv, dim, generator=gen)  # (k|v, pages, P, H, D)
    indices = torch.tensor([5, 0, 3, 7], dtype=torch.int32)  # request 0: 3 pages, 1: 1 page
    indptr = torch.tensor([0, 3, 4], dtype=torch.int32)
    last = torch.tensor([1, 4], dtype=torch.int32)
    q = torch.randn(2, heads_q, dim, generator=gen)
    decoder = TorchDroppedKVDecoder()
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
