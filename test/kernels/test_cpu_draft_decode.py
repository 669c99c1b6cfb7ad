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


def _packed_rows(bits: int, lengths: list[int], tail: int, h_kv: int, d: int, seed: int):
    """Per row a KIVI block of ``lengths[i]`` tokens (None at 0) and ``tail`` float tokens after
    it, with the dequantized whole view each row's reference attends over."""
    from sglang_vericache.compress.kivi import Kivi

    g = torch.Generator().manual_seed(seed)
    bodies, keys, values, whole = [], [], [], []
    for n in lengths:
        body = Kivi(bits=bits).quantize(torch.randn(h_kv, n, d, generator=g) * 3,
                                        torch.randn(h_kv, n, d, generator=g)) if n else None  # fmt: skip
        buf = torch.randn(2, h_kv, tail + 7, d, generator=g)
        tk, tv = buf[0, :, :tail], buf[1, :, :tail]  # views of a wider buffer, as read
        bk, bv = body.dequantize() if body is not None else (tk[:, :0], tv[:, :0])
        bodies.append(body)
        keys.append(tk)
        values.append(tv)
        whole.append((torch.cat([bk, tk], dim=1), torch.cat([bv, tv], dim=1)))
    return bodies, keys, values, whole


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("h_q, h_kv, d, tail", [(9, 3, 64, 40), (4, 4, 32, 0), (8, 2, 16, 3)])
def test_packed_kivi_body_attends_as_its_dequantized_view(kernel, bits: int, h_q: int, h_kv: int,
                                                          d: int, tail: int) -> None:  # fmt: skip
    """A packed body read as codes gives what attending over its dequantization gives, with
    rows of no body and of a body only in the same call."""
    bodies, keys, values, whole = _packed_rows(bits, [1024, 0, 32, 96], tail, h_kv, d, bits + d)
    assert all(kernel.accepts_body(b) for b in bodies if b is not None)
    q = torch.randn(len(bodies), h_q, d, generator=torch.Generator().manual_seed(d))
    assert kernel.accepts(q, keys, values)
    got = kernel(q, keys, values, 0.125, bodies)
    for i, (k, v) in enumerate(whole):
        torch.testing.assert_close(got[i], _sdpa(q[i], k, v, 0.125), rtol=1e-4, atol=1e-4)


def test_packed_bodies_are_refused_where_the_kernel_cannot_read_them(kernel) -> None:
    from sglang_vericache.compress.kivi import Kivi
    from sglang_vericache.compress.turbo import Turbo

    keys, values = torch.randn(2, 64, 16), torch.randn(2, 64, 16)
    assert kernel.accepts_body(Kivi(bits=4).quantize(keys, values))
    assert not kernel.accepts_body(Kivi(bits=4).quantize(keys.half(), values.half()))
    assert not kernel.accepts_body(None)
    assert not kernel.accepts_body(Turbo(bits=4).quantize(keys, values))
    q = torch.randn(2, 4, 16)
    two, four = Kivi(bits=2).quantize(keys, values), Kivi(bits=4).quantize(keys, values)
    tail = [keys[:, :1], keys[:, :1]]
    assert kernel.accepts(q, tail, tail, [four, four]) and kernel.accepts(q, tail, tail, [None, two])
    assert not kernel.accepts(q, tail, tail, [two, four])  # one format a call: the caller dequantizes
    with pytest.raises(ValueError, match="share bits and group"):
        kernel(q, tail, tail, 0.25, [two, four])
    cut = Kivi(bits=4).quantize(keys, values)
    parts = list(cut.stored_tensors())
    parts[3] = parts[3][:, :32]  # values of half the tokens
    with pytest.raises(RuntimeError, match="packed values"):  # malformed: raises, never reads
        kernel(q[:1], tail[:1], tail[:1], 0.25, [type(cut)(4, 32, *parts)])
    with pytest.raises(RuntimeError, match="multiple of group"):
        kernel(q[:1], tail[:1], tail[:1], 0.25,
               [type(cut)(4, 32, *(t[:, :48] for t in cut.stored_tensors()))])
