"""The batched CPU draft-attention kernel (``ops/cpu_draft_decode.py``) against torch's SDPA."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang_vericache.ops.cpu_draft_decode import CpuDraftDecode, load_cpu_draft_decode


@pytest.fixture(scope="module")
def kernel() -> CpuDraftDecode:
    """Built here: a CPU host that runs the tests has the compiler SGLang's own install needs,
    so a missing kernel is a failure, not a skip (drafting would fall back to the slow loop)."""
    built = load_cpu_draft_decode()
    assert built is not None, "the CPU draft-attention kernel did not build (see the log)"
    return built


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One row: q [H_q, D] over k, v [H_kv, T, D] -> [H_q, D] (zeros over no keys)."""
    if k.shape[1] == 0:
        return torch.zeros_like(q)
    return scaled_dot_product_attention(q[None, :, None], k[None], v[None], scale=scale,
                                        enable_gqa=True)[0, :, 0]  # fmt: skip


@pytest.mark.parametrize("h_q, h_kv, d", [(9, 3, 64), (4, 4, 32), (8, 2, 16)])
def test_kernel_matches_sdpa_over_views_of_wider_buffers(kernel, h_q: int, h_kv: int, d: int) -> None:
    g = torch.Generator().manual_seed(h_q * d)
    lengths = [700, 1, 0, 33, 1500]
    q = torch.randn(len(lengths), h_q, d, generator=g)
    keys, values = [], []
    for t in lengths:  # a view of its first t columns, as a compressed cache's buffer is read
        buf = torch.randn(2, h_kv, t + 20, d, generator=g)
        keys.append(buf[0, :, :t])
        values.append(buf[1, :, :t])
    assert kernel.accepts(q, keys, values)
    got = kernel(q, keys, values, 0.125)
    for i in range(len(lengths)):
        torch.testing.assert_close(got[i], _sdpa(q[i], keys[i], values[i], 0.125),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip


def test_kernel_takes_only_float32_cpu_views_with_contiguous_tokens(kernel) -> None:
    q = torch.randn(1, 4, 16)
    pool = torch.randn(10, 2, 16)  # [slots, H_kv, D]: a gather transposed has strided tokens
    strided = pool[torch.tensor([1, 4, 5])].transpose(0, 1)
    assert not kernel.accepts(q, [strided], [strided])
    assert kernel.accepts(q, [strided.contiguous()], [strided.contiguous()])
    half = strided.contiguous().half()
    assert not kernel.accepts(q, [half], [half])
    assert not kernel.accepts(q.double(), [strided.contiguous()], [strided.contiguous()])
    with pytest.raises(RuntimeError, match="token rows must be contiguous"):
        kernel(q, [strided], [strided], 0.25)  # a caller that skips ``accepts`` gets an error
