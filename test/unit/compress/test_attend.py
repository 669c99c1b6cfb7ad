"""The reference attention (GQA, causal masking by original positions, float32 accumulation),
and the grouped SDPA the verify runs, against it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_vericache.compress import attend
from sglang_vericache.compress.attend import grouped_sdpa


def test_matches_sdpa_on_full_causal_kv() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(8, 5, 16, generator=gen)
    k = torch.randn(2, 20, 16, generator=gen)
    v = torch.randn(2, 20, 16, generator=gen)
    qpos = torch.arange(15, 20)
    out = attend(q, qpos, k, v, torch.arange(20).expand(2, -1), 0.25)
    ref = F.scaled_dot_product_attention(
        q[None], k.repeat_interleave(4, 0)[None], v.repeat_interleave(4, 0)[None],
        attn_mask=(torch.arange(20)[None, :] <= qpos[:, None])[None, None], scale=0.25)[0]
    assert torch.allclose(out, ref, atol=1e-5)


def test_per_head_positions_and_masking() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 1, 8, generator=gen)
    k = torch.randn(1, 4, 8, generator=gen)
    v = torch.randn(1, 4, 8, generator=gen)
    pos = torch.tensor([[0, 3, 9, 12]])
    out = attend(q, torch.tensor([9]), k, v, pos, 1.0)
    # keys at 12 are in the future of query 9: same as attending over the first three only
    ref = attend(q, torch.tensor([9]), k[:, :3], v[:, :3], pos[:, :3], 1.0)
    assert torch.allclose(out, ref, atol=1e-6)
    none = attend(q, torch.tensor([-1]), k, v, pos, 1.0)
    assert torch.equal(none, torch.zeros_like(none))


def test_half_precision_accumulates_in_float32() -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(4, 3, 16, generator=gen)
    k = torch.randn(2, 50, 16, generator=gen)
    v = torch.randn(2, 50, 16, generator=gen)
    pos = torch.arange(50).expand(2, -1)
    qpos = torch.tensor([47, 48, 49])
    out16 = attend(q.half(), qpos, k.half(), v.half(), pos, 0.25)
    assert out16.dtype == torch.float16
    ref = attend(q.half().float(), qpos, k.half().float(), v.half().float(), pos, 0.25)
    assert torch.allclose(out16.float(), ref, atol=2e-3)


@pytest.mark.parametrize("h_q, h_kv, n", [(9, 3, 3), (8, 2, 1), (4, 4, 7), (6, 1, 33)])
def test_grouped_sdpa_is_the_reference_attention(h_q: int, h_kv: int, n: int) -> None:
    """Folding each KV head's query group into the query axis changes nothing but speed: same
    heads, same causal mask, over keys held in a wider buffer (a strided view, as the verify
    reads a host buffer)."""
    gen = torch.Generator().manual_seed(3)
    t = 40
    q = torch.randn(h_q, n, 16, generator=gen)
    k = torch.randn(h_kv, t + 8, 16, generator=gen)[:, :t]
    v = torch.randn(h_kv, t + 8, 16, generator=gen)[:, :t]
    qpos = torch.arange(t - n, t)
    mask = torch.arange(t)[None, :] <= qpos[:, None]
    out = grouped_sdpa(q, k, v, 0.25, mask)
    assert out.shape == (h_q, n, 16)
    assert torch.allclose(out, attend(q, qpos, k, v, torch.arange(t).expand(h_kv, -1), 0.25),
                          atol=1e-5)  # fmt: skip
    unmasked = attend(q, torch.full((n,), t), k, v, torch.arange(t).expand(h_kv, -1), 0.25)
    assert torch.allclose(grouped_sdpa(q, k, v, 0.25), unmasked, atol=1e-5)
