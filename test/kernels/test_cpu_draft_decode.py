"""The batched CPU draft-attention kernel (``ops/cpu_draft_decode.py``) against torch's SDPA."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang_vericache.ops.cpu_draft_decode import CpuDraftDecode


@pytest.fixture(scope="module")
def kernel(cpu_kernels) -> CpuDraftDecode:
    return CpuDraftDecode(cpu_kernels)


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


def test_kernel_takes_only_float32_cpu_views_with_contiguous_channels(kernel) -> None:
    q = torch.randn(1, 4, 16)
    pool = torch.randn(10, 2, 16)  # [slots, H_kv, D]: a gather transposed has strided tokens
    strided = pool[torch.tensor([1, 4, 5])].transpose(0, 1)
    assert kernel.accepts(q, [strided], [strided])  # the token stride is free
    assert kernel.accepts(q, [strided.contiguous()], [strided.contiguous()])
    half = strided.contiguous().half()
    assert not kernel.accepts(q, [half], [half])
    assert not kernel.accepts(q.double(), [strided.contiguous()], [strided.contiguous()])
    channels = torch.randn(2, 16, 3).transpose(1, 2)  # [2, 3, 16], channels 3 apart
    assert not kernel.accepts(q, [channels], [channels])
    with pytest.raises(RuntimeError, match="channels must be contiguous"):
        kernel(q, [channels], [channels], 0.25)  # a caller that skips ``accepts`` gets an error


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


def _pool(slots: int, h_kv: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's key and value buffers of SGLang's KV pool: [S, H_kv, D] float32, slot-major."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(slots, h_kv, d, generator=g), torch.randn(slots, h_kv, d, generator=g)


def _slots(slots: int, n: int, seed: int) -> torch.Tensor:
    """``n`` distinct slots out of ``slots``, unordered and scattered, as a pool hands them out."""
    return torch.randperm(slots, generator=torch.Generator().manual_seed(seed))[:n]


@pytest.mark.parametrize("h_q, h_kv, d", [(9, 3, 64), (4, 4, 32), (8, 2, 16)])
def test_indexed_rows_read_pool_slots_in_place(kernel, h_q: int, h_kv: int, d: int) -> None:
    """A row indexed into the pool's buffer (transposed, tokens H_kv * D apart) attends as a
    dense row over the gathered tokens does."""
    k_buf, v_buf = _pool(4096, h_kv, d, h_q + d)
    lengths = [700, 1, 0, 33, 1500]
    index = [_slots(4096, t, i) for i, t in enumerate(lengths)]
    keys, values = [k_buf.transpose(0, 1)] * len(lengths), [v_buf.transpose(0, 1)] * len(lengths)
    assert keys[0].stride() == (d, h_kv * d, 1)
    q = torch.randn(len(lengths), h_q, d, generator=torch.Generator().manual_seed(d))
    assert kernel.accepts(q, keys, values, index=index)
    got = kernel(q, keys, values, 0.125, index=index)
    gathered_k = [k_buf[i].transpose(0, 1).contiguous() for i in index]
    gathered_v = [v_buf[i].transpose(0, 1).contiguous() for i in index]
    dense = kernel(q, gathered_k, gathered_v, 0.125)
    for i in range(len(lengths)):
        torch.testing.assert_close(got[i], dense[i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[i], _sdpa(q[i], gathered_k[i], gathered_v[i], 0.125),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_batch_mixing_indexed_dense_and_packed_rows(kernel, bits: int) -> None:
    """Indexed rows, dense rows and packed bodies followed by indexed or dense float tokens, in
    one call (GQA as SmolLM2-135M: H_q 9, H_kv 3, D 64)."""
    h_q, h_kv, d = 9, 3, 64
    bodies, dense_k, dense_v, whole = _packed_rows(bits, [0, 0, 64, 256, 0], 20, h_kv, d, bits)
    k_buf, v_buf = _pool(1000, h_kv, d, bits + 1)
    pool_k, pool_v = k_buf.transpose(0, 1), v_buf.transpose(0, 1)
    # rows: 0 indexed, 1 dense, 2 packed body + indexed, 3 packed body + dense, 4 indexed empty
    index = [_slots(1000, 300, 0), None, _slots(1000, 45, 2), None,
             torch.empty(0, dtype=torch.int64)]  # fmt: skip
    keys = [pool_k, dense_k[1], pool_k, dense_k[3], pool_k]
    values = [pool_v, dense_v[1], pool_v, dense_v[3], pool_v]
    refs = []
    for b, (body, slots) in enumerate(zip(bodies, index)):
        if slots is None:
            refs.append(whole[b])
            continue
        bk, bv = body.dequantize() if body is not None else (pool_k[:, :0], pool_v[:, :0])
        refs.append((torch.cat([bk, k_buf[slots].transpose(0, 1)], dim=1),
                     torch.cat([bv, v_buf[slots].transpose(0, 1)], dim=1)))  # fmt: skip
    q = torch.randn(len(keys), h_q, d, generator=torch.Generator().manual_seed(bits))
    assert kernel.accepts(q, keys, values, bodies, index)
    got = kernel(q, keys, values, 0.125, bodies, index)
    for i, (k, v) in enumerate(refs):
        torch.testing.assert_close(got[i], _sdpa(q[i], k, v, 0.125), rtol=1e-4, atol=1e-4)


def test_dense_row_reads_a_strided_run_of_the_pool(kernel) -> None:
    """A dense row may be a run of consecutive pool slots: [H_kv, T, D], tokens H_kv * D apart."""
    h_q, h_kv, d = 9, 3, 64
    k_buf, v_buf = _pool(600, h_kv, d, 5)
    keys = [k_buf[100:612].transpose(0, 1), k_buf[7:8].transpose(0, 1)]
    values = [v_buf[100:612].transpose(0, 1), v_buf[7:8].transpose(0, 1)]
    assert keys[0].stride() == (d, h_kv * d, 1)
    q = torch.randn(2, h_q, d, generator=torch.Generator().manual_seed(6))
    assert kernel.accepts(q, keys, values)
    got = kernel(q, keys, values, 0.125)
    for i in range(2):
        torch.testing.assert_close(got[i], _sdpa(q[i], keys[i], values[i], 0.125),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip


def test_indices_are_checked_before_any_read(kernel) -> None:
    k_buf, v_buf = _pool(50, 2, 16, 7)
    q = torch.randn(2, 4, 16)
    keys, values = [k_buf.transpose(0, 1)] * 2, [v_buf.transpose(0, 1)] * 2
    good = torch.tensor([3, 49, 0])
    for bad in (torch.tensor([3, 50, 0]), torch.tensor([-1, 2])):
        assert kernel.accepts(q, keys, values, index=[good, bad])  # bounds: the call's check
        with pytest.raises(RuntimeError, match="slots must lie in"):
            kernel(q, keys, values, 0.25, index=[good, bad])
    with pytest.raises(RuntimeError, match="int64"):  # a caller that skips ``accepts``
        kernel(q, keys, values, 0.25, index=[good, good.int()])
    with pytest.raises(RuntimeError, match="one entry"):
        kernel(q, keys, values, 0.25, index=[good])


def test_accepts_only_contiguous_int64_cpu_indices(kernel) -> None:
    k_buf, v_buf = _pool(50, 2, 16, 8)
    q = torch.randn(2, 4, 16)
    keys, values = [k_buf.transpose(0, 1)] * 2, [v_buf.transpose(0, 1)] * 2
    good = torch.tensor([3, 49, 0, 7])
    assert kernel.accepts(q, keys, values, index=[good, None])
    assert kernel.accepts(q, keys, values, index=[None, None])
    assert not kernel.accepts(q, keys, values, index=[good, good.int()])
    assert not kernel.accepts(q, keys, values, index=[good, good[::2]])  # strided
    assert not kernel.accepts(q, keys, values, index=[good, good[None]])  # 2-D
    assert not kernel.accepts(q, keys, values, index=[good])  # one entry per row


def _paged(bodies, h_kv: int, d: int, seed: int):
    """Each body written to pages of one shared pool, at shuffled slots (as an allocator hands
    them out after churn); the pool's other slots hold noise."""
    from sglang_vericache.compress.kivi_pages import KiviPageLayout, PagedKiviBlock

    g = torch.Generator().manual_seed(seed)
    need = [0 if b is None else KiviPageLayout.of(b).pages_for(b.num_tokens) for b in bodies]
    k_buf, v_buf = torch.randn(2, sum(need) + 9, h_kv, d, generator=g)
    free = torch.randperm(sum(need) + 8, generator=g) + 1
    paged, at = [], 0
    for body, n in zip(bodies, need):
        paged.append(None if body is None else PagedKiviBlock.write(body, k_buf, v_buf,
                                                                    free[at : at + n]))  # fmt: skip
        at += n
    return paged


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("h_q, h_kv, d, tail", [(9, 3, 64, 40), (8, 2, 16, 3)])
def test_a_body_in_pool_pages_attends_exactly_as_its_tensors(kernel, bits: int, h_q: int,
                                                            h_kv: int, d: int, tail: int) -> None:  # fmt: skip
    """Read where it lies in pool pages, a body gives bit for bit what its tensors give (the
    same arithmetic in the same order), next to rows of tensors and of no body."""
    bodies, keys, values, _ = _packed_rows(bits, [1024, 0, 32, 96], tail, h_kv, d, bits * d)
    paged = _paged(bodies, h_kv, d, bits)
    assert all(kernel.accepts_body(b) for b in paged if b is not None)
    q = torch.randn(len(bodies), h_q, d, generator=torch.Generator().manual_seed(d))
    want = kernel(q, keys, values, 0.125, bodies)
    assert torch.equal(kernel(q, keys, values, 0.125, paged), want)
    mixed = [paged[0], None, bodies[2], paged[3]]
    assert kernel.accepts(q, keys, values, mixed)
    assert torch.equal(kernel(q, keys, values, 0.125, mixed), want)


def test_pages_are_checked_before_any_read(kernel) -> None:
    from dataclasses import replace

    bodies, keys, values, _ = _packed_rows(4, [64], 2, 2, 16, 3)
    (paged,) = _paged(bodies, 2, 16, 4)
    q = torch.randn(1, 4, 16)
    outside = replace(paged, pages=paged.pages + paged.key_buffer.shape[0])
    with pytest.raises(RuntimeError, match="pages must lie in"):
        kernel(q, keys, values, 0.125, [outside])
    torn = replace(paged, pages=paged.pages[:-1])  # not a whole number of groups
    with pytest.raises(RuntimeError, match="whole number of groups"):
        kernel(q, keys, values, 0.125, [torn])
