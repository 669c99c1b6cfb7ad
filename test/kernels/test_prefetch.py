from __future__ import annotations

import time

import pytest
import torch

from sglang_vericache.ops.prefetch import FullKVPrefetcher


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
