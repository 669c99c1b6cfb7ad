"""Triton draft attention over draft rows in the pool (``ops/pool_kivi_decode.py``): KIVI bodies
read in their pages, then float slots. On CPU under Triton's interpreter (test/conftest.py);
the bfloat16 cases need a GPU (the interpreter rounds to bfloat16 otherwise than a GPU)."""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.compress import Kivi
from sglang_vericache.compress.kivi_pages import KiviPageLayout, PagedKiviBlock
from sglang_vericache.ops.dropped_decode import PagedDecodeGeometry
from sglang_vericache.ops.pool_kivi_decode import (
    PoolKiviDecode,
    agrees_with_reference,
    pool_kivi_decoder,
)
from sglang_vericache.ops.reference import pool_kivi_decode_reference

SLOTS = 4096
# (body key groups, float slots) per row: a body of several groups, no body, a long tail, one slot
ROWS = [(2, 5), (0, 40), (3, 33), (1, 1)]
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _batch(heads: int, group_q: int, dim: int, bits: int, group: int, dtype: torch.dtype,
           device: torch.device, rows=ROWS, seed: int = 0):  # fmt: skip
    """A layer's pool buffers with each row's body written to scattered pages and its float
    slots scattered too (slot 0, SGLang's padding slot, never used); q [B, H_q, D]."""
    g = torch.Generator().manual_seed(seed)
    k_buf, v_buf = (torch.randn(SLOTS, heads, dim, generator=g).to(device, dtype) for _ in "kv")
    free = iter((torch.randperm(SLOTS - 1, generator=g) + 1).tolist())
    take = lambda n: torch.tensor([next(free) for _ in range(n)], dtype=torch.int64)  # noqa: E731
    columns, bodies = [], []
    for groups, n_float in rows:
        body, tokens = None, groups * group
        if tokens:
            keys, values = (torch.randn(2, heads, tokens, dim, generator=g) * 3).to(device, dtype)
            block = Kivi(bits=bits, group=group).quantize(keys, values)
            pages = take(KiviPageLayout.of(block).pages_for(tokens))
            body = PagedKiviBlock.write(block, k_buf, v_buf, pages)
        bodies.append(body)
        columns.append(take(n_float))
    q = torch.randn(len(rows), heads * group_q, dim, generator=g).to(device, dtype)
    return q, k_buf, v_buf, columns, bodies


GEOMETRIES = [  # heads, query heads a KV head, head_dim, bits, key group, dtype
    (3, 3, 64, 4, 32, torch.float32),  # SmolLM2
    (2, 2, 16, 2, 16, torch.float32),
    (4, 1, 16, 8, 64, torch.float32),
    (1, 4, 32, 4, 32, torch.float16),
    pytest.param(8, 4, 128, 4, 32, torch.bfloat16, marks=pytest.mark.gpu),
    pytest.param(3, 3, 64, 2, 32, torch.bfloat16, marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("heads, group_q, dim, bits, group, dtype", GEOMETRIES)
@pytest.mark.parametrize("splits", [1, 3, None])
def test_the_kernel_attends_as_the_reference(heads, group_q, dim, bits, group, dtype, splits,
                                             device) -> None:  # fmt: skip
    """Every row, with or without a body, over any number of splits (more splits than a row
    has units leaves some empty), equals dequantize-then-attend."""
    q, k_buf, v_buf, columns, bodies = _batch(heads, group_q, dim, bits, group, dtype, device)
    decoder = PoolKiviDecode(device)
    decoder.plan(columns, bodies, k_buf, q.shape[1], splits=splits)
    before = [b.view(torch.uint8).clone() for b in (k_buf, v_buf)]  # page bytes: NaNs as floats
    for layer_scale in (dim**-0.5, 0.3):  # one plan, run per layer
        got = decoder.run(q, k_buf, v_buf, layer_scale)
        want = pool_kivi_decode_reference(q, k_buf, v_buf, columns, bodies, layer_scale)
        assert got.dtype == q.dtype and got.shape == q.shape
        torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])
    for buffer, bytes_before in zip((k_buf, v_buf), before):
        assert torch.equal(buffer.view(torch.uint8), bytes_before), "the pool was written"


def test_it_reads_the_pages_as_the_cpu_kernel_does(cpu_kernels) -> None:
    """The same pool pages and slots through the C++ kernel (``ops/cpu_draft_decode.py``, which
    the CPU drafts with) and this one: one layout, read alike."""
    from sglang_vericache.ops.cpu_draft_decode import load_cpu_draft_decode

    cpu = load_cpu_draft_decode()
    q, k_buf, v_buf, columns, bodies = _batch(3, 3, 64, 4, 32, torch.float32, torch.device("cpu"))
    decoder = PoolKiviDecode(torch.device("cpu"))
    decoder.plan(columns, bodies, k_buf, q.shape[1])
    pool = k_buf.transpose(0, 1), v_buf.transpose(0, 1)
    want = cpu(q, [pool[0]] * len(ROWS), [pool[1]] * len(ROWS), 0.125, bodies, columns)
    torch.testing.assert_close(decoder.run(q, k_buf, v_buf, 0.125), want, rtol=2e-5, atol=2e-5)


def test_what_it_reads_and_what_it_refuses() -> None:
    cpu = torch.device("cpu")
    q, k_buf, v_buf, columns, bodies = _batch(2, 2, 16, 4, 16, torch.float32, cpu)
    paged = bodies[0]
    assert PoolKiviDecode.accepts_body(paged, k_buf)
    assert not PoolKiviDecode.accepts_body(paged, k_buf.clone()), "another layer's buffer"
    assert not PoolKiviDecode.accepts_body(paged.detached(), k_buf), "a body in tensors"
    tail = paged.concat(Kivi(bits=4, group=16).quantize(*torch.randn(2, 2, 16, 16)))
    assert not PoolKiviDecode.accepts_body(tail, k_buf), "groups not written yet"
    small = _batch(2, 2, 16, 4, 8, torch.float32, cpu, rows=[(1, 1)])
    assert not PoolKiviDecode.accepts_body(small[4][0], small[1]), "a key group below 16"
    assert PoolKiviDecode.accepts(k_buf, 4)
    assert not PoolKiviDecode.accepts(torch.zeros(8, 2, 40), 4), "head_dim not a power of two"
    assert not PoolKiviDecode.accepts(k_buf.double(), 4)
    assert not PoolKiviDecode.accepts(k_buf, 3), "query heads not whole groups"
    decoder = PoolKiviDecode(cpu)
    with pytest.raises(RuntimeError, match="before plan"):
        decoder.run(q, k_buf, v_buf, 0.25)
    with pytest.raises(ValueError, match="at least one float slot"):
        decoder.plan([columns[0], columns[1][:0]], bodies[:2], k_buf, 4)
    int2 = _batch(2, 2, 16, 2, 16, torch.float32, cpu, rows=[(1, 1)], seed=1)[4][0]
    with pytest.raises(ValueError, match="one page layout"):
        decoder.plan(columns[:2], [paged, PagedKiviBlock.write(int2.detached(), k_buf, v_buf,
                                                               int2.pages)], k_buf, 4)  # fmt: skip


def test_the_start_up_check_takes_the_kernel_and_refuses_a_wrong_one() -> None:
    """What ``pool_kivi_decoder`` runs on a GPU before drafting trusts the kernel; a CPU drafts
    with its C++ kernel and gets no Triton decoder."""

    class Unscaled(PoolKiviDecode):  # forgets the softmax scale: close, and wrong
        def run(self, q, key_buffer, value_buffer, scale):
            return super().run(q, key_buffer, value_buffer, 1.0)

    cpu = torch.device("cpu")
    for geometry in (PagedDecodeGeometry(9, 3, 64, 1, torch.float32),
                     PagedDecodeGeometry(8, 2, 32, 1, torch.float16)):  # fmt: skip
        assert agrees_with_reference(PoolKiviDecode(cpu), geometry)
        assert not agrees_with_reference(Unscaled(cpu), geometry)
    assert pool_kivi_decoder(cpu, PagedDecodeGeometry(9, 3, 64, 1, torch.float32)) is None


@pytest.mark.gpu
def test_on_a_gpu_the_decoder_is_built_and_checked() -> None:
    geometry = PagedDecodeGeometry(9, 3, 64, 1, torch.bfloat16)
    assert pool_kivi_decoder(torch.device("cuda"), geometry) is not None
    odd = PagedDecodeGeometry(6, 3, 40, 1, torch.bfloat16)  # head_dim 40: refused, not broken
    assert pool_kivi_decoder(torch.device("cuda"), odd) is None
