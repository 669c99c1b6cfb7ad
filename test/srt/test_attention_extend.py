"""The ``vericache`` backend's prefix extend against torch_native's, on a real CPU KV pool.

A prefix extend attends only the new tokens' queries (``srt/attention/backend.py``); torch_native runs a
query for every prefix position and keeps the last ones. Same attention, so the outputs agree to
float rounding, for rows with and without a prefix, with queries split into blocks, and with the
row's prefix moved to its host buffer.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

H_Q, H_KV, D, SLOTS, ROWS, MAX_LEN = 4, 2, 8, 4096, 4, 1024
PREFIX, NEW = (37, 0), (5, 9)  # row 0 extends a 37-token prefix by 5, row 1 is a fresh prompt


def _setup(dtype: torch.dtype = torch.float32, prefix: tuple[int, ...] = PREFIX,
           new: tuple[int, ...] = NEW):  # fmt: skip
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_vericache.srt.attention.backend import VeriCacheAttnBackend

    torch.manual_seed(0)
    kv = MHATokenToKVPool(SLOTS, 1, dtype, H_KV, D, 1, "cpu", False)
    kv.get_key_buffer(0).copy_(torch.randn_like(kv.get_key_buffer(0)))
    kv.get_value_buffer(0).copy_(torch.randn_like(kv.get_value_buffer(0)))
    rows = ReqToTokenPool(ROWS, MAX_LEN, "cpu", False)
    alloc = TokenToKVPoolAllocator(SLOTS, dtype, "cpu", kv, False)
    seq = [p + n for p, n in zip(prefix, new)]
    for row, n in enumerate(seq):  # every position's KV is already in the pool
        rows.req_to_token[row, :n] = alloc.alloc(n).to(torch.int32)
    runner = SimpleNamespace(device="cpu", req_to_token_pool=rows, token_to_kv_pool=kv)
    backend = VeriCacheAttnBackend(runner)
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=H_Q, tp_k_head_num=H_KV, qk_head_dim=D,
                            v_head_dim=D, scaling=D**-0.5, is_cross_attention=False,
                            attn_type=AttentionType.DECODER, sliding_window_size=-1)  # fmt: skip
    batch = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, req_pool_indices=torch.arange(len(seq)),
        seq_lens=torch.tensor(seq), seq_lens_cpu=torch.tensor(seq),
        extend_prefix_lens=torch.tensor(prefix), extend_seq_lens=torch.tensor(new),
        extend_prefix_lens_cpu=list(prefix), extend_seq_lens_cpu=list(new), encoder_lens=None,
        out_cache_loc=None,
    )  # fmt: skip
    q = torch.randn(sum(new), H_Q * D)
    return backend, layer, batch, q, (kv, rows, alloc)


def _torch_native(backend, q, layer, batch):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    return TorchNativeAttnBackend.forward_extend(backend, q, None, None, layer, batch, False)


def _verify(batch, bases: list[int], w: int):
    """A TARGET_VERIFY forward batch of ``w`` queries a row after ``bases`` committed tokens,
    and its queries [len(bases) * w, H_q * D]."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    fb = SimpleNamespace(**{**vars(batch), "forward_mode": ForwardMode.TARGET_VERIFY,
                            "spec_info": SimpleNamespace(draft_token_num=w),
                            "seq_lens_cpu": torch.tensor(bases)})  # fmt: skip
    return fb, torch.randn(len(bases) * w, H_Q * D)


@pytest.mark.parametrize("query_block", [1024, 2])
def test_a_prefix_extend_attends_as_torch_native_does(monkeypatch, query_block: int) -> None:
    from sglang_vericache.srt.attention import backend as attention

    monkeypatch.setattr(attention, "QUERY_BLOCK", query_block)
    backend, layer, batch, q, _ = _setup()
    assert attention._extends_a_prefix(layer, batch)
    got = backend.forward_extend(q, None, None, layer, batch, save_kv_cache=False)
    want = _torch_native(backend, q, layer, batch)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_prefix_extend_reads_an_offloaded_prefix_from_its_host_buffer() -> None:
    from sglang_vericache.srt.kv.offload import PLACEHOLDER_SLOT
    from sglang_vericache.srt.kv.offloader import PoolOffloader

    backend, layer, batch, q, (kv, rows, alloc) = _setup()
    want = _torch_native(backend, q, layer, batch)
    PoolOffloader(kv, rows, alloc, 1).offload(0, owned_from=0, committed=30, compressed_bytes=0,
                                              min_tokens=1)
    assert bool((rows.req_to_token[0, :30] == PLACEHOLDER_SLOT).all())  # the pool has no copy
    got = backend.forward_extend(q, None, None, layer, batch, save_kv_cache=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("offloaded", [False, True])
def test_a_prefill_chunk_attends_bit_for_bit_as_torch_native_does(offloaded: bool) -> None:
    """A later prefill chunk (its new tokens most of its keys) and the fresh prompt batched with
    it take torch_native's own computation, so chunked prefill keeps plain SGLang's KV to the
    bit; a short extend of a long prefix keeps the masked path."""
    from sglang_vericache.compress.attend import PADDED_MIN_SHARE
    from sglang_vericache.srt.kv.offloader import PoolOffloader

    prefix, new = (300, 0, 600), (500, 700, 20)  # a later chunk, a fresh prompt, a radix hit
    share = [n / (p + n) for p, n in zip(prefix, new)]
    assert share[0] >= PADDED_MIN_SHARE > share[2]
    backend, layer, batch, q, (kv, rows, alloc) = _setup(prefix=prefix, new=new)
    want = _torch_native(backend, q, layer, batch)
    if offloaded:  # the chunk's prefix read from its host buffer, not the pool
        PoolOffloader(kv, rows, alloc, 1).offload(0, owned_from=0, committed=prefix[0],
                                                  compressed_bytes=0, min_tokens=1)  # fmt: skip
    got = backend.forward_extend(q, None, None, layer, batch, save_kv_cache=False)
    chunk_and_fresh = slice(0, new[0] + new[1])
    assert torch.equal(got[chunk_and_fresh], want[chunk_and_fresh])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_batch_of_fresh_prompts_keeps_torch_natives_path() -> None:
    from sglang_vericache.srt.attention import backend as attention

    _, layer, batch, _, _ = _setup()
    batch.extend_prefix_lens_cpu = [0, 0]
    assert not attention._extends_a_prefix(layer, batch)
    layer.sliding_window_size = 16  # a sliding-window layer keeps it too
    batch.extend_prefix_lens_cpu = list(PREFIX)
    assert not attention._extends_a_prefix(layer, batch)


def test_a_verify_attends_causally_and_builds_each_rows_mask_once_per_forward() -> None:
    """Each row's W draft queries attend over [0, base + W) causally, as the reference does; the
    next layer of the same forward reuses the row's mask, and a new forward builds its own."""
    from sglang_vericache.compress.attend import attend

    backend, layer, batch, _, (kv, rows, _) = _setup()
    backend.verify_kernel = None  # the SDPA loop (the kernel: the next test)
    w = 3
    seq = [p + n for p, n in zip(PREFIX, NEW)]
    for bases in ([s - w for s in seq], [s - w - 2 for s in seq]):  # two verifies
        fb, q = _verify(batch, bases, w)
        first = backend.forward_extend(q, None, None, layer, fb, save_kv_cache=False)
        owner, masks = backend._verify_masks
        kept = dict(masks)
        assert owner is fb and len(kept) == len(bases)
        again = backend.forward_extend(q, None, None, layer, fb, save_kv_cache=False)
        assert torch.equal(first, again)  # the next layer: the same masks, not rebuilt
        assert all(backend._verify_masks[1][key] is mask for key, mask in kept.items())
        for i, base in enumerate(bases):
            end = base + w
            slots = rows.req_to_token[i, :end].long()
            keys = kv.get_key_buffer(0)[slots].transpose(0, 1)
            values = kv.get_value_buffer(0)[slots].transpose(0, 1)
            qi = q[i * w : (i + 1) * w].view(w, H_Q, D).transpose(0, 1)
            want = attend(qi, torch.arange(base, end), keys, values,
                          torch.arange(end).expand(H_KV, -1), layer.scaling)  # fmt: skip
            got = first[i * w : (i + 1) * w].view(w, H_Q, D).transpose(0, 1)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_verify_over_a_staged_host_range_equals_one_over_the_host_buffer() -> None:
    """A device pool's verify reads a row's host range from the copy staged while the batch
    drafted (``srt/kv/full_kv_stage.py``): the same attention as over the host buffer itself."""
    from sglang_vericache.srt.kv.full_kv_stage import FullKVStager
    from sglang_vericache.srt.kv.offloader import PoolOffloader

    backend, layer, batch, _, (kv, rows, alloc) = _setup()
    off = PoolOffloader(kv, rows, alloc, 1)
    off.offload(0, owned_from=0, committed=36, compressed_bytes=0, min_tokens=1)
    w = 3
    bases = [p + n - w for p, n in zip(PREFIX, NEW)]
    fb, q = _verify(batch, bases, w)
    want = backend.forward_extend(q, None, None, layer, fb, save_kv_cache=False)
    stager = FullKVStager(off.ledger, "cpu", budget_bytes=1 << 20)
    assert stager.stage([0, 1]) == off.ledger.span(0).host.nbytes  # row 1 is all in the pool
    stager.ready()
    got = backend.forward_extend(q, None, None, layer, fb, save_kv_cache=False)
    stager.release()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_verify_on_the_cpu_kernel_attends_as_the_sdpa_loop_does() -> None:
    """One kernel call per layer for every row (``ops/cpu_verify_decode.py``), a row's prefix
    offloaded to its host buffer or not: the SDPA loop's attention within float32 rounding."""
    from sglang_vericache.srt.kv.offloader import PoolOffloader

    backend, layer, batch, _, (kv, rows, alloc) = _setup()
    assert backend.verify_kernel is not None, "the CPU attention kernels did not build"
    w = 4
    bases = [p + n - w for p, n in zip(PREFIX, NEW)]
    fb, q = _verify(batch, bases, w)
    kernel = backend.forward_extend(q, None, None, layer, fb, save_kv_cache=False)
    assert backend._verify_masks == (None, {})  # no mask built: the kernel ran
    PoolOffloader(kv, rows, alloc, 1).offload(0, owned_from=0, committed=30, compressed_bytes=0,
                                              min_tokens=1)
    offloaded = backend.forward_extend(q, None, None, layer, fb, save_kv_cache=False)
    backend.verify_kernel = None
    sdpa = backend.forward_extend(q, None, None, layer, fb, save_kv_cache=False)
    torch.testing.assert_close(kernel, sdpa, rtol=1e-5, atol=1e-6)
    assert torch.equal(offloaded, kernel)  # the same bytes, read from the host buffer


@pytest.mark.parametrize("kernel", [True, False])
def test_a_ragged_verify_attends_each_rows_live_queries_as_a_full_width_one(kernel: bool) -> None:
    """A row verifying fewer drafts than the width brings only its 1 + drafts queries
    (``live_queries``; the forward's rows ragged): their attention is the full-width verify's,
    on the kernel and on the SDPA loop."""
    from sglang_vericache.srt.decode.batch_inputs import live_index

    backend, layer, batch, _, _ = _setup()
    if not kernel:
        backend.verify_kernel = None
    w, live = 4, [1, 3]
    bases = [p + n - w for p, n in zip(PREFIX, NEW)]
    fb, q = _verify(batch, bases, w)
    full = backend.forward_extend(q, None, None, layer, fb, save_kv_cache=False)
    kept = live_index(live, w, "cpu")
    ragged_fb, _ = _verify(batch, bases, w)
    backend.live_queries = live
    try:
        ragged = backend.forward_extend(q[kept], None, None, layer, ragged_fb, save_kv_cache=False)
    finally:
        backend.live_queries = None
    assert ragged.shape == (sum(live), H_Q * D)
    torch.testing.assert_close(ragged, full[kept], rtol=1e-5, atol=1e-6)


def test_a_pool_the_kernel_cannot_read_keeps_the_sdpa_loop_without_asking_per_layer() -> None:
    """bfloat16 KV: no kernel, decided at the first use (the rows are not read for a kernel
    that then refuses them)."""
    backend, *_ = _setup(torch.bfloat16)
    assert backend.verify_kernel is None
    assert _setup()[0].verify_kernel is not None
