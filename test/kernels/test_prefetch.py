from __future__ import annotations

import time

import pytest
import torch

from sglang_vericache.ops.prefetch import FullKVPrefetcher, device_copy_pairs


def test_cpu_fallback_copies_and_reports_each_task_once() -> None:
    pre = FullKVPrefetcher(torch.device("cpu"))
    assert not pre.is_async
    src = [torch.randn(3, 4), torch.randn(2, 5)]
    dst = [torch.zeros(3, 4), torch.zeros(2, 5)]
    first = pre.submit(list(zip(src, dst)))
    second = pre.submit([(torch.ones(2), torch.zeros(2))])
    pre.check_integrity()
    assert torch.equal(dst[0], src[0]) and torch.equal(dst[1], src[1])
    assert pre.poll() == [first, second]
    assert pre.poll() == []
    pre.check_integrity()
    assert pre.bytes_submitted == (12 + 10 + 2) * 4
    assert pre.num_in_flight == 0


def test_rejects_mismatched_pairs() -> None:
    pre = FullKVPrefetcher("cpu")
    with pytest.raises(ValueError):
        pre.submit([(torch.zeros(2), torch.zeros(3))])
    with pytest.raises(ValueError):
        pre.submit([(torch.zeros(2), torch.zeros(2, dtype=torch.float16))])
    assert pre.poll() == []


@pytest.mark.gpu
def test_cuda_copies_on_side_stream_without_blocking() -> None:
    pre = FullKVPrefetcher(torch.device("cuda"))
    assert pre.is_async
    src = torch.randn(64, 1024, 1024).pin_memory()  # 256 MiB
    dst = torch.empty_like(src, device="cuda")
    task = pre.submit([(src, dst)])
    pre.check_integrity()
    pre.order_after(task)  # the current stream now waits on the copy (host does not)
    seen: list[int] = []
    deadline = time.monotonic() + 30
    while not seen and time.monotonic() < deadline:
        seen = pre.poll()
        pre.check_integrity()
    assert seen == [task]
    assert pre.poll() == []
    assert torch.equal(dst.cpu(), src)


def test_cpu_accepts_after_and_records_no_timing() -> None:
    pre = FullKVPrefetcher("cpu", record_timing=True)
    dst = torch.zeros(4)
    task = pre.submit([(torch.ones(4), dst)], after=None)
    assert pre.poll() == [task]
    assert pre.take_timing(task) is None
    assert pre.stream is None
    assert torch.equal(dst, torch.ones(4))
    pre.check_integrity()


@pytest.mark.gpu
def test_cuda_copy_ordered_after_event_does_not_wait_for_queued_kernels() -> None:
    """A copy ordered after an (already complete) event must finish while a long kernel queued
    earlier on the current stream is still running; with timing, its interval is returned once."""
    pre = FullKVPrefetcher(torch.device("cuda"), record_timing=True)
    src = torch.randn(4, 1024, 1024).pin_memory()  # 16 MiB
    dst = torch.empty_like(src, device="cuda")
    draft = torch.cuda.Stream()
    with torch.cuda.stream(draft):
        ready = torch.cuda.Event()
        ready.record()
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s at ~2 GHz, queued before the copy
        busy = torch.cuda.Event()
        busy.record()
        task = pre.submit([(src, dst)], after=ready)
        seen: list[int] = []
        deadline = time.monotonic() + 30
        while not seen and time.monotonic() < deadline:
            seen = pre.poll()
        assert seen == [task]
        assert not busy.query(), "the copy waited for the kernel queued on the drafting stream"
        timing = pre.take_timing(task)
        assert timing is not None and timing.nbytes == src.numel() * 4
        assert timing.start.elapsed_time(timing.end) > 0
        assert pre.take_timing(task) is None
        pre.check_integrity()
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), src)


def _host_row(capacity: int, length: int, pin: bool = False) -> torch.Tensor:
    """A host KV row as ``HostKV`` holds it: [L, 2, H_kv, length, D] of a wider buffer."""
    buf = torch.randn(3, 2, 4, capacity, 8)
    return (buf.pin_memory() if pin else buf)[..., :length, :]


@pytest.mark.parametrize(
    "capacity, length, copies",
    [(104, 100, 1),  # gaps of 4 tokens per run: the whole span, one copy
     (400, 100, 3 * 2 * 4),  # a span 4x the view: one copy per [length, D] run
     (100, 100, 1)],  # no gaps: contiguous
)
def test_a_strided_host_view_comes_over_in_few_contiguous_copies(capacity: int, length: int,
                                                                   copies: int) -> None:
    src = _host_row(capacity, length)
    pairs, dst = device_copy_pairs(src, "cpu")
    assert len(pairs) == copies
    assert all(s.is_contiguous() and s.shape == d.shape for s, d in pairs)
    assert sum(s.numel() for s, _ in pairs) <= 1.25 * src.numel()
    pre = FullKVPrefetcher("cpu")
    task = pre.submit(pairs)
    assert pre.poll() == [task]
    assert dst.shape == src.shape and torch.equal(dst, src)


def test_a_view_without_contiguous_runs_still_copies_exactly() -> None:
    transposed = torch.randn(6, 5).t()  # no gaps, other order: one copy keeps its strides
    pairs, dst = device_copy_pairs(transposed, "cpu", max_waste=0.0)
    assert len(pairs) == 1
    sparse = torch.randn(8, 5).t()[:, ::2]  # last dimension strided: runs of one element
    more, dst2 = device_copy_pairs(sparse, "cpu", max_waste=0.0)
    assert len(more) == sparse.numel()
    FullKVPrefetcher("cpu").submit(pairs + more)
    assert torch.equal(dst, transposed) and torch.equal(dst2, sparse)


@pytest.mark.gpu
@pytest.mark.parametrize("capacity", [104, 400])
def test_cuda_strided_host_row_arrives_whole(capacity: int) -> None:
    src = _host_row(capacity, 100, pin=True)
    pre = FullKVPrefetcher(torch.device("cuda"))
    pairs, dst = device_copy_pairs(src, "cuda")
    task = pre.submit(pairs)
    pre.order_after(task)  # the current stream waits on the side stream's copies
    assert torch.equal((dst * 1).cpu(), src)  # a kernel on the current stream reads it
    deadline = time.monotonic() + 30
    seen: list[int] = []
    while not seen and time.monotonic() < deadline:
        seen = pre.poll()
    assert seen == [task]
