"""Triton split-K decode over quantized paged KV vs the float32 torch reference.

Small shapes run everywhere (CPU: Triton interpreter); @gpu shapes only with CUDA.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sglang_vericache.ops.layout import QuantPagedBatch
from sglang_vericache.ops.quant_decode import (
    DecodeBackend,
    QuantDecodeLaunch,
    QuantDecodeWorkspace,
    QuantPagedDecodeWrapper,
)
from sglang_vericache.ops.quant_pack import PagedQuantBatchInputs, build_quant_paged_batch
from sglang_vericache.ops.reference import quant_paged_decode_reference

ATOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _inputs(lengths: list[int], heads_kv: int, dim: int, page: int, bits: int, window: int,
            dtype: torch.dtype, device: torch.device, seed: int = 0) -> PagedQuantBatchInputs:
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(heads_kv, n, dim, generator=gen).to(dtype).to(device) for n in lengths]
    values = [torch.randn(heads_kv, n, dim, generator=gen).to(dtype).to(device) for n in lengths]
    pages = sum(n // page for n in lengths) + 3
    return build_quant_paged_batch(keys, values, page_size=page, bits=bits, recent_window=window,
                                   num_pages=pages, generator=gen)


def _run(inp: PagedQuantBatchInputs, heads_q: int, device: torch.device, splits: int | None,
         q: torch.Tensor | None = None,
         backend: DecodeBackend | None = DecodeBackend.TRITON, **knobs: object
         ) -> tuple[torch.Tensor, torch.Tensor, QuantPagedDecodeWrapper]:
    batch = inp.batch.batch_size
    dim = inp.cache.head_dim
    ws = QuantDecodeWorkspace.allocate(max_batch=batch, num_q_heads=heads_q, head_dim=dim,
                                       max_splits=8, max_pages=inp.cache.num_pages,
                                       device=device)
    wrapper = QuantPagedDecodeWrapper(ws, QuantDecodeLaunch(backend=backend, num_splits=splits,
                                                            **knobs))  # type: ignore[arg-type]
    wrapper.plan(inp.batch, inp.cache, inp.window, num_q_heads=heads_q)
    if q is None:
        q = torch.randn(batch, heads_q, dim, generator=torch.Generator().manual_seed(7))
        q = q.to(inp.cache.dtype).to(device)
    out = wrapper.run(q, inp.cache, inp.window)
    ref = quant_paged_decode_reference(q, inp.cache, inp.window, inp.batch)
    return out, ref, wrapper


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert bool(torch.isfinite(out).all())
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= ATOL[dtype], f"max abs error {err} > {ATOL[dtype]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("page,splits", [(16, 1), (16, 3), (8, 2)])
def test_kernel_matches_reference(dtype: torch.dtype, bits: int, page: int, splits: int,
                                  device: torch.device) -> None:
    inp = _inputs([70, 5, 130], heads_kv=2, dim=32 if bits == 4 else 64, page=page, bits=bits,
                  window=8, dtype=dtype, device=device)
    out, ref, wrapper = _run(inp, heads_q=6, device=device, splits=splits)
    assert wrapper.backend is DecodeBackend.TRITON
    _assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("min_group_rows,lazy_rescale,swapped_mma",
                         [(1, True, False), (1, False, False), (16, True, False), (1, True, True),
                          (16, False, True)])
def test_launch_knobs_match_reference(dtype: torch.dtype, bits: int, min_group_rows: int,
                                      lazy_rescale: bool, swapped_mma: bool,
                                      device: torch.device) -> None:
    """Unpadded GQA tiles (group 3 -> 4 rows), lazy rescaling and the swapped-MMA kernel
    compute the same function."""
    inp = _inputs([70, 5, 130], heads_kv=2, dim=32 if bits == 4 else 64, page=16, bits=bits,
                  window=8, dtype=dtype, device=device, seed=bits)
    out, ref, _ = _run(inp, heads_q=6, device=device, splits=2, min_group_rows=min_group_rows,
                       lazy_rescale=lazy_rescale, swapped_mma=swapped_mma)
    _assert_close(out, ref, dtype)


@pytest.mark.parametrize("growth", [1.0, -1.0])
def test_lazy_rescale_with_running_max_jumps(growth: float, device: torch.device) -> None:
    """Key magnitudes that grow (or shrink) along the sequence move the running max by far more
    than the 2^8 lazy threshold between pages, so the rescale branch runs mid-split (or only
    on the first page)."""
    gen = torch.Generator().manual_seed(5)
    length, dim = 200, 32
    ramp = torch.linspace(0.0, 1.0, length)
    ramp = ramp if growth > 0 else ramp.flip(0)
    keys = [(torch.randn(2, length, dim, generator=gen) * (1 + 100 * ramp)[None, :, None])
            .to(device)]
    values = [torch.randn(2, length, dim, generator=gen).to(device)]
    inp = build_quant_paged_batch(keys, values, page_size=16, bits=4, recent_window=8,
                                  generator=gen)
    for lazy, swapped in ((True, False), (False, False), (True, True)):
        out, ref, _ = _run(inp, heads_q=4, device=device, splits=2, lazy_rescale=lazy,
                           min_group_rows=1, swapped_mma=swapped)
        _assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("swapped_mma", [False, True])
@pytest.mark.parametrize("heads_q,heads_kv,dim", [(9, 3, 64), (4, 4, 32), (16, 2, 32)])
def test_gqa_group_sizes(heads_q: int, heads_kv: int, dim: int, swapped_mma: bool,
                         device: torch.device) -> None:
    inp = _inputs([40, 33], heads_kv=heads_kv, dim=dim, page=16, bits=4, window=4,
                  dtype=torch.float16, device=device, seed=heads_q)
    out, ref, _ = _run(inp, heads_q=heads_q, device=device, splits=2, swapped_mma=swapped_mma)
    _assert_close(out, ref, torch.float16)


@pytest.mark.parametrize("page", [4, 24, 32])
def test_any_page_size(page: int, device: torch.device) -> None:
    inp = _inputs([100, 60], heads_kv=1, dim=64, page=page, bits=2, window=3,
                  dtype=torch.float32, device=device, seed=page)
    out, ref, _ = _run(inp, heads_q=2, device=device, splits=2)
    _assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("swapped_mma", [False, True])
def test_partial_last_page_and_window_only_requests(swapped_mma: bool,
                                                    device: torch.device) -> None:
    inp = _inputs([64, 64, 10], heads_kv=2, dim=32, page=16, bits=4, window=0,
                  dtype=torch.float32, device=device)
    # Request 0: last page has 5 valid tokens; request 1: pages only; request 2: window only.
    meta = dataclasses.replace(
        inp.batch,
        kv_last_page_len=torch.tensor([5, 16, 16], dtype=torch.int32, device=device),
    )
    partial = dataclasses.replace(inp, batch=meta)
    assert partial.batch.kv_indptr.tolist() == [0, 4, 8, 8]
    assert partial.batch.window_len.tolist() == [0, 0, 10]
    out, ref, _ = _run(partial, heads_q=4, device=device, splits=3, swapped_mma=swapped_mma)
    _assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("swapped_mma", [False, True])
def test_more_splits_than_pages_leaves_empty_splits(swapped_mma: bool,
                                                    device: torch.device) -> None:
    inp = _inputs([20, 140], heads_kv=1, dim=32, page=16, bits=4, window=2,
                  dtype=torch.float32, device=device)
    out, ref, wrapper = _run(inp, heads_q=1, device=device, splits=8, swapped_mma=swapped_mma)
    assert wrapper.num_splits == 8
    _assert_close(out, ref, torch.float32)


def test_one_plan_many_layers_and_strided_q(device: torch.device) -> None:
    first = _inputs([50, 37], heads_kv=2, dim=32, page=16, bits=4, window=4,
                    dtype=torch.float16, device=device)
    # A second layer with the same page table but different contents.
    cache2 = dataclasses.replace(first.cache, k_packed=255 - first.cache.k_packed,
                                 v_packed=first.cache.v_packed.flip(-1).contiguous(),
                                 k_scale=first.cache.k_scale * 1.5)
    window2 = dataclasses.replace(first.window, keys=-first.window.keys)
    layers = [first, dataclasses.replace(first, cache=cache2, window=window2)]
    ws = QuantDecodeWorkspace.allocate(max_batch=2, num_q_heads=4, head_dim=32, max_splits=4,
                                       max_pages=layers[0].cache.num_pages, device=device)
    wrapper = QuantPagedDecodeWrapper(ws, QuantDecodeLaunch(DecodeBackend.TRITON, num_splits=2))
    wrapper.plan(layers[0].batch, layers[0].cache, layers[0].window, num_q_heads=4)
    qkv = torch.randn(2, 12, 32).to(torch.float16).to(device)
    q = qkv[:, :4]  # a view with a batch stride of 12 heads, like a fused qkv projection
    for layer in layers:
        out = torch.empty(2, 4, 32, dtype=torch.float16, device=device)
        wrapper.run(q, layer.cache, layer.window, out=out)
        ref = quant_paged_decode_reference(q, layer.cache, layer.window, layer.batch)
        _assert_close(out, ref, torch.float16)


def test_torch_backend_is_the_reference(device: torch.device) -> None:
    inp = _inputs([40], heads_kv=1, dim=16, page=8, bits=4, window=4, dtype=torch.float32,
                  device=device)
    out, ref, wrapper = _run(inp, heads_q=2, device=device, splits=None,
                             backend=DecodeBackend.TORCH)
    assert wrapper.backend is DecodeBackend.TORCH
    assert torch.equal(out, ref)


def test_auto_backend_is_triton_on_cuda_and_torch_on_cpu(device: torch.device) -> None:
    inp = _inputs([40], heads_kv=1, dim=32, page=8, bits=4, window=4, dtype=torch.float32,
                  device=device)
    out, ref, wrapper = _run(inp, heads_q=2, device=device, splits=None, backend=None)
    expected = DecodeBackend.TRITON if device.type == "cuda" else DecodeBackend.TORCH
    assert wrapper.backend is expected
    _assert_close(out, ref, torch.float32)


def test_narrow_planes_fall_back_to_torch_or_are_refused(device: torch.device) -> None:
    inp = _inputs([40], heads_kv=1, dim=32, page=8, bits=2, window=4, dtype=torch.float32,
                  device=device)  # 32 * 2 / 8 = 8 channels per plane: too narrow for tl.dot
    out, ref, wrapper = _run(inp, heads_q=2, device=device, splits=None, backend=None)
    assert wrapper.backend is DecodeBackend.TORCH
    assert torch.equal(out, ref)
    with pytest.raises(ValueError):
        _run(inp, heads_q=2, device=device, splits=None, backend=DecodeBackend.TRITON)


def test_errors(device: torch.device) -> None:
    inp = _inputs([40], heads_kv=2, dim=16, page=8, bits=4, window=4, dtype=torch.float32,
                  device=device)
    ws = QuantDecodeWorkspace.allocate(max_batch=1, num_q_heads=4, head_dim=16, max_splits=2,
                                       max_pages=8, device=device)
    wrapper = QuantPagedDecodeWrapper(ws)
    q = torch.randn(1, 4, 16, device=device)
    with pytest.raises(RuntimeError):
        wrapper.run(q, inp.cache, inp.window)
    with pytest.raises(ValueError):
        wrapper.plan(inp.batch, inp.cache, inp.window, num_q_heads=3)
    wrapper.plan(inp.batch, inp.cache, inp.window, num_q_heads=4)
    with pytest.raises(ValueError):
        wrapper.run(torch.randn(1, 2, 16, device=device), inp.cache, inp.window)
    small = QuantDecodeWorkspace.allocate(max_batch=1, num_q_heads=4, head_dim=16, max_splits=1,
                                          max_pages=1, device=device)
    with pytest.raises(ValueError):
        QuantPagedDecodeWrapper(small).plan(inp.batch, inp.cache, inp.window, num_q_heads=4)
    empty = QuantPagedBatch(*(torch.zeros(n, dtype=torch.int32) for n in (2, 1, 1, 1, 1)))
    with pytest.raises(ValueError):
        wrapper.plan(empty, inp.cache, inp.window, num_q_heads=4)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("heads_q,heads_kv,dim,page", [(32, 8, 128, 32), (9, 3, 64, 16)])
def test_gpu_sized_batch(bits: int, heads_q: int, heads_kv: int, dim: int, page: int,
                         device: torch.device) -> None:
    lengths = [2048, 1500, 777, 4096, 129, 3000, 64, 2500]
    inp = _inputs(lengths, heads_kv=heads_kv, dim=dim, page=page, bits=bits, window=64,
                  dtype=torch.bfloat16, device=device)
    for splits in (None, 1, 7):
        out, ref, wrapper = _run(inp, heads_q=heads_q, device=device, splits=splits,
                                 backend=None)
        assert wrapper.backend is DecodeBackend.TRITON
        _assert_close(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("fast_unpack", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_unpack_paths_agree(bits: int, fast_unpack: bool, dtype: torch.dtype,
                                device: torch.device) -> None:
    inp = _inputs([1000, 333, 64], heads_kv=2, dim=64, page=32, bits=bits, window=16,
                  dtype=dtype, device=device)
    ws = QuantDecodeWorkspace.allocate(max_batch=3, num_q_heads=8, head_dim=64, max_splits=8,
                                       max_pages=inp.cache.num_pages, device=device)
    wrapper = QuantPagedDecodeWrapper(ws, QuantDecodeLaunch(
        DecodeBackend.TRITON, num_splits=3, num_warps=1, fast_unpack=fast_unpack))
    wrapper.plan(inp.batch, inp.cache, inp.window, num_q_heads=8)
    q = torch.randn(3, 8, 64, device=device).to(dtype)
    out = wrapper.run(q, inp.cache, inp.window)
    _assert_close(out, quant_paged_decode_reference(q, inp.cache, inp.window, inp.batch), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [
    {"num_warps": 1, "min_group_rows": 1, "lazy_rescale": True},
    {"num_warps": 2, "num_stages": 3, "min_group_rows": 1, "lazy_rescale": True},
    {"num_warps": 4, "min_group_rows": 1, "lazy_rescale": False},
    {"num_warps": 1, "max_registers": 168, "min_group_rows": 1, "lazy_rescale": True},
    {"num_warps": 1, "fast_unpack": False, "min_group_rows": 1, "lazy_rescale": True},
    {"num_warps": 1, "min_group_rows": 1, "lazy_rescale": True, "swapped_mma": True},
    {"num_warps": 2, "min_group_rows": 1, "lazy_rescale": True, "swapped_mma": True},
    {"num_warps": 2, "max_registers": 128, "min_group_rows": 1, "lazy_rescale": True,
     "swapped_mma": True},
    {"num_warps": 4, "num_stages": 3, "min_group_rows": 1, "lazy_rescale": True,
     "swapped_mma": True},
    {"num_warps": 2, "fast_unpack": False, "min_group_rows": 1, "lazy_rescale": True,
     "swapped_mma": True},
])
def test_gpu_launch_knobs(knobs: dict[str, object], device: torch.device) -> None:
    """The benchmark's sweep knobs compile and agree with the reference at the target shape."""
    inp = _inputs([2048, 777, 4096, 129], heads_kv=8, dim=128, page=32, bits=4, window=64,
                  dtype=torch.bfloat16, device=device)
    out, ref, _ = _run(inp, heads_q=32, device=device, splits=5, **knobs)
    _assert_close(out, ref, torch.bfloat16)
