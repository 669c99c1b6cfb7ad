"""The batched CPU verify-attention kernel (``ops/cpu_verify_decode.py``) against a float64
reference and torch's SDPA, over the layouts a verify reads: a host buffer's rows in place, a
pool's slot-major buffer, rows of every length (shorter than a key block, one block, many),
rows with as many queries as the batch's width or fewer (ragged)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang_vericache.ops import cpu_verify_decode
from sglang_vericache.ops.cpu_verify_decode import CpuVerifyDecode


@pytest.fixture(scope="module")
def kernel(cpu_kernels) -> CpuVerifyDecode:
    return CpuVerifyDecode(cpu_kernels)


def _reference(q: torch.Tensor, keys, values, scale: float) -> torch.Tensor:
    """float64 causal attention: q [B, n, H_q, D], row b's query i over keys [0, T_b - n + i]."""
    b_, n, h_q, d = q.shape
    out = torch.empty(b_, n, h_q, d, dtype=torch.float64)
    for b in range(b_):
        k, v = keys[b].double(), values[b].double()
        group = h_q // k.shape[0]
        t = k.shape[1]
        for i in range(n):
            for h in range(h_q):
                seen = t - n + i + 1
                w = torch.softmax(k[h // group, :seen] @ q[b, i, h].double() * scale, 0)
                out[b, i, h] = w @ v[h // group, :seen]
    return out


def _call(kernel: CpuVerifyDecode, q: torch.Tensor, keys, values, scale: float) -> torch.Tensor:
    """The kernel on a full-width batch: q [B, n, H_q, D] -> [B, n, H_q, D]."""
    b_, n, h_q, d = q.shape
    return kernel(q.reshape(b_ * n, h_q, d), keys, values, scale, [n] * b_).view(q.shape)


def _host_rows(lengths, h_kv: int, d: int, room: int, gen: torch.Generator):
    """Views [H_kv, T, D] of wider buffers [2, H_kv, T + room, D], as a host buffer is read."""
    keys, values = [], []
    for t in lengths:
        buf = torch.randn(2, h_kv, t + room, d, generator=gen)
        keys.append(buf[0, :, :t])
        values.append(buf[1, :, :t])
    return keys, values


@pytest.mark.parametrize("h_q, h_kv, d", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 3, 40)])
@pytest.mark.parametrize("n", [1, 6])
def test_kernel_matches_the_reference_over_host_rows(kernel, h_q: int, h_kv: int, d: int,
                                                     n: int) -> None:
    gen = torch.Generator().manual_seed(h_q * d + n)
    lengths = [700, n, 63, 64, 65, 1500]
    keys, values = _host_rows(lengths, h_kv, d, 37, gen)
    q = torch.randn(len(lengths), n, h_q, d, generator=gen)
    assert kernel.accepts(q.flatten(0, 1), keys, values, [n] * len(lengths))
    got = _call(kernel, q, keys, values, d**-0.5)
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(q, keys, values, d**-0.5), rtol=1e-5,
                               atol=2e-6)  # fmt: skip


def test_kernel_agrees_with_sdpa_as_the_verify_calls_it(kernel) -> None:
    """Within float32 rounding of torch's masked SDPA (the path the kernel replaces)."""
    gen = torch.Generator().manual_seed(7)
    n, h_q, h_kv, d = 6, 9, 3, 64
    keys, values = _host_rows([2000, 513], h_kv, d, 64, gen)
    q = torch.randn(2, n, h_q, d, generator=gen)
    got = _call(kernel, q, keys, values, 0.125)
    for b, (k, v) in enumerate(zip(keys, values)):
        t = k.shape[1]
        mask = torch.arange(t)[None] <= torch.arange(t - n, t)[:, None]
        want = scaled_dot_product_attention(q[b].transpose(0, 1)[None], k[None], v[None],
                                            attn_mask=mask, scale=0.125, enable_gqa=True)
        torch.testing.assert_close(got[b], want[0].transpose(0, 1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("items_per_thread", [1, 64])
def test_keys_split_in_chunks_give_the_same_attention(kernel, monkeypatch,
                                                      items_per_thread: int) -> None:
    """One row alone (its keys split so every thread has work) or many: the same result."""
    monkeypatch.setattr(cpu_verify_decode, "ITEMS_PER_THREAD", items_per_thread)
    gen = torch.Generator().manual_seed(11)
    keys, values = _host_rows([3000], 3, 64, 0, gen)
    q = torch.randn(1, 4, 9, 64, generator=gen)
    got = _call(kernel, q, keys, values, 0.125)
    torch.testing.assert_close(got.double(), _reference(q, keys, values, 0.125), rtol=1e-5,
                               atol=2e-6)  # fmt: skip


def test_a_pool_buffer_is_read_with_its_token_stride(kernel) -> None:
    """A slot-major buffer [S, H_kv, D] transposed: tokens H_kv * D floats apart."""
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(2, 300, 3, 64, generator=gen)
    keys, values = [pool[0, 10:210].transpose(0, 1)], [pool[1, 10:210].transpose(0, 1)]
    q = torch.randn(1, 3, 9, 64, generator=gen)
    assert kernel.accepts(q[0], keys, values, [3])
    torch.testing.assert_close(_call(kernel, q, keys, values, 0.125).double(),
                               _reference(q, keys, values, 0.125), rtol=1e-5, atol=2e-6)


def test_what_the_kernel_refuses(kernel) -> None:
    q = torch.randn(4, 9, 64)
    keys = [torch.randn(3, 100, 64)]
    assert not kernel.accepts(q.double(), keys, keys, [4])
    assert not kernel.accepts(q, [keys[0][:, :3]], [keys[0][:, :3]], [4])  # fewer keys than queries
    assert not kernel.accepts(q, [keys[0].transpose(1, 2)], keys, [4])  # strided channels
    with pytest.raises(RuntimeError, match="multiple of H_kv"):
        kernel(torch.randn(4, 8, 64), keys, keys, 0.125, [4])
    with pytest.raises(RuntimeError, match="the counts sum to 3"):
        kernel(q, keys, keys, 0.125, [3])
    with pytest.raises(RuntimeError, match="at least 1"):
        kernel(q, keys * 2, keys * 2, 0.125, [4, 0])
    with pytest.raises(RuntimeError, match="one query count"):
        kernel(q, keys * 2, keys * 2, 0.125, [4])


def test_ragged_rows_attend_as_each_row_alone(kernel, monkeypatch) -> None:
    """A row verifying fewer drafts than the batch's width brings only its queries, its keys
    through its last: its output is bit for bit what the row gets in a call of its own (each
    query's arithmetic is its own; keys in one chunk, as a batch this size splits none)."""
    monkeypatch.setattr(cpu_verify_decode, "ITEMS_PER_THREAD", 1)
    gen = torch.Generator().manual_seed(5)
    lengths, counts = [900, 5, 130], [1, 5, 3]
    keys, values = _host_rows(lengths, 3, 64, 9, gen)
    q = torch.randn(sum(counts), 9, 64, generator=gen)
    got = kernel(q, keys, values, 0.125, counts)
    first = 0
    for b, n in enumerate(counts):
        alone = kernel(q[first : first + n], keys[b : b + 1], values[b : b + 1], 0.125, [n])
        assert torch.equal(got[first : first + n], alone), b
        one_row = q[first : first + n].unsqueeze(0)
        torch.testing.assert_close(alone.double(), _reference(one_row, keys[b : b + 1],
                                                              values[b : b + 1], 0.125)[0],
                                   rtol=1e-5, atol=2e-6)  # fmt: skip
        first += n


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nothing_past_a_rows_keys_is_read(kernel, poison: float) -> None:
    """A row's keys are a view of a wider host buffer whose columns past the view hold whatever
    the buffer last held (slots not written this step): none of it may reach the output."""
    gen = torch.Generator().manual_seed(11)
    lengths, counts = [700, 6, 130], [2, 6, 1]
    bufs = [torch.randn(2, 3, t + 70, 64, generator=gen) for t in lengths]
    keys = [buf[0, :, :t] for buf, t in zip(bufs, lengths)]
    values = [buf[1, :, :t] for buf, t in zip(bufs, lengths)]
    q = torch.randn(sum(counts), 9, 64, generator=gen)
    clean = kernel(q, keys, values, 0.125, counts)
    for buf, t in zip(bufs, lengths):
        buf[:, :, t:] = poison
    got = kernel(q, keys, values, 0.125, counts)
    assert torch.isfinite(got).all()
    assert torch.equal(got, clean)


@pytest.mark.parametrize("h_q, h_kv, d", [(9, 3, 64), (8, 2, 128), (4, 4, 32), (10, 2, 40)])
def test_a_query_computed_beside_others_equals_it_computed_alone(kernel, h_q: int, h_kv: int,
                                                                  d: int) -> None:  # fmt: skip
    """Every query's arithmetic is its own (whatever a kernel shares between the queries of a
    block, such as its keys in L1), so its output is bit for bit what it is as the only query
    of a call (one head, one position, keys through its own)."""
    gen = torch.Generator().manual_seed(h_q * d)
    lengths, n = [300, 7, 64, 129], 7
    keys, values = _host_rows(lengths, h_kv, d, 5, gen)
    q = torch.randn(len(lengths), n, h_q, d, generator=gen) * 2
    out = torch.empty(len(lengths) * n, h_q, d)
    kernel.module.verify_decode(q.reshape(-1, h_q, d), keys, values, out, d**-0.5, 1,
                                [n] * len(lengths))  # keys in one chunk  # fmt: skip
    out = out.view(q.shape)
    group = h_q // h_kv
    for b, t in enumerate(lengths):
        for i in range(n):
            for h in range(h_q):
                seen = t - n + i + 1
                alone = torch.empty(1, 1, d)
                kernel.module.verify_decode(q[b, i : i + 1, h : h + 1].contiguous(),
                                            [keys[b][h // group : h // group + 1, :seen]],
                                            [values[b][h // group : h // group + 1, :seen]],
                                            alone, d**-0.5, 1, [1])  # fmt: skip
                assert torch.equal(alone[0, 0], out[b, i, h]), (b, i, h)
