"""The batched CPU verify-attention kernel (``ops/cpu_verify_decode.py``) against a float64
reference and torch's SDPA, over the layouts a verify reads: a host buffer's rows in place, a
pool's slot-major buffer, rows of every length (shorter than a key block, one block, many)."""

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
    assert kernel.accepts(q, keys, values)
    got = kernel(q, keys, values, d**-0.5)
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(q, keys, values, d**-0.5), rtol=1e-5,
                               atol=2e-6)  # fmt: skip


def test_kernel_agrees_with_sdpa_as_the_verify_calls_it(kernel) -> None:
    """Within float32 rounding of torch's masked SDPA (the path the kernel replaces)."""
    gen = torch.Generator().manual_seed(7)
    n, h_q, h_kv, d = 6, 9, 3, 64
    keys, values = _host_rows([2000, 513], h_kv, d, 64, gen)
    q = torch.randn(2, n, h_q, d, generator=gen)
    got = kernel(q, keys, values, 0.125)
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
    got = kernel(q, keys, values, 0.125)
    torch.testing.assert_close(got.double(), _reference(q, keys, values, 0.125), rtol=1e-5,
                               atol=2e-6)  # fmt: skip


def test_a_pool_buffer_is_read_with_its_token_stride(kernel) -> None:
    """A slot-major buffer [S, H_kv, D] transposed: tokens H_kv * D floats apart."""
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(2, 300, 3, 64, generator=gen)
    keys, values = [pool[0, 10:210].transpose(0, 1)], [pool[1, 10:210].transpose(0, 1)]
    q = torch.randn(1, 3, 9, 64, generator=gen)
    assert kernel.accepts(q, keys, values)
    torch.testing.assert_close(kernel(q, keys, values, 0.125).double(),
                               _reference(q, keys, values, 0.125), rtol=1e-5, atol=2e-6)


def test_what_the_kernel_refuses(kernel) -> None:
    q = torch.randn(1, 4, 9, 64)
    keys = [torch.randn(3, 100, 64)]
    assert not kernel.accepts(q.double(), keys, keys)
    assert not kernel.accepts(q, [keys[0][:, :3]], [keys[0][:, :3]])  # fewer keys than queries
    assert not kernel.accepts(q, [keys[0].transpose(1, 2)], keys)  # strided channels
    with pytest.raises(RuntimeError, match="multiple of H_kv"):
        kernel(torch.randn(1, 4, 8, 64), keys, keys, 0.125)


@pytest.mark.parametrize("items_per_thread", [1, 64])
def test_live_queries_are_computed_as_in_a_full_call_and_the_rest_is_zero(
        kernel, monkeypatch, items_per_thread: int) -> None:  # fmt: skip
    """A row verifying fewer drafts than the batch's width: its live queries' output is bit for
    bit the full call's (each query's computation is its own), the padding's is zero."""
    monkeypatch.setattr(cpu_verify_decode, "ITEMS_PER_THREAD", items_per_thread)
    gen = torch.Generator().manual_seed(5)
    keys, values = _host_rows([900, 5, 130], 3, 64, 9, gen)
    q = torch.randn(3, 5, 9, 64, generator=gen)
    full = kernel(q, keys, values, 0.125)
    live = [1, 5, 3]
    got = kernel(q, keys, values, 0.125, live=live)
    for b, k in enumerate(live):
        assert torch.equal(got[b, :k], full[b, :k])
        assert not got[b, k:].any()
    with pytest.raises(RuntimeError, match="live counts"):
        kernel(q, keys, values, 0.125, live=[0, 5, 3])
    with pytest.raises(RuntimeError, match="one query count per row"):
        kernel(q, keys, values, 0.125, live=[1, 2])


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_keys_and_values_past_a_query_are_never_read(kernel, poison: float) -> None:
    """A ragged verify leaves the slots past a row's live queries unwritten: whatever they hold
    (NaN, inf) must not reach a live query's output (0 * NaN is NaN in a value sum)."""
    gen = torch.Generator().manual_seed(11)
    lengths, n, live = [700, 6, 130], 6, [2, 6, 1]
    keys, values = _host_rows(lengths, 3, 64, 9, gen)
    q = torch.randn(len(lengths), n, 9, 64, generator=gen)
    clean = kernel(q, keys, values, 0.125, live=live)
    for b, (t, k) in enumerate(zip(lengths, live)):
        keys[b][:, t - n + k :] = poison
        values[b][:, t - n + k :] = poison
    got = kernel(q, keys, values, 0.125, live=live)
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
    out = torch.empty_like(q)
    kernel.module.verify_decode(q, keys, values, out, d**-0.5, 1, [])  # keys in one chunk
    group = h_q // h_kv
    for b, t in enumerate(lengths):
        for i in range(n):
            for h in range(h_q):
                seen = t - n + i + 1
                alone = torch.empty(1, 1, 1, d)
                kernel.module.verify_decode(q[b : b + 1, i : i + 1, h : h + 1].contiguous(),
                                            [keys[b][h // group : h // group + 1, :seen]],
                                            [values[b][h // group : h // group + 1, :seen]],
                                            alone, d**-0.5, 1, [])  # fmt: skip
                assert torch.equal(alone[0, 0, 0], out[b, i, h]), (b, i, h)
