"""srt/hooks/idle.py: an idle scheduler lets drafting ahead run and, fully idle, trims the heap."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang_vericache.host_memory import IdleHeapTrim
from sglang_vericache.srt.hooks.idle import IDLE_TARGET, _on_idle_around

pytestmark = pytest.mark.sglang


class _Ahead:
    def __init__(self) -> None:
        self.idle_calls = 0

    def serving_idle(self) -> None:
        self.idle_calls += 1


def test_the_hook_names_sglangs_on_idle() -> None:
    from sglang.srt.managers.scheduler import Scheduler

    assert IDLE_TARGET.rsplit(".", 1)[1] == "on_idle" and hasattr(Scheduler, "on_idle")
    assert hasattr(Scheduler, "is_fully_idle")


def test_idle_lets_drafting_ahead_run_and_trims_only_when_fully_idle_after_work() -> None:
    trims: list[int] = []
    heap = IdleHeapTrim(trim=lambda: trims.append(1), min_interval_s=0.0)
    ahead = _Ahead()
    state = {"fully_idle": False}
    scheduler = SimpleNamespace(tree_cache=SimpleNamespace(ahead=ahead, heap_trim=heap),
                                is_fully_idle=lambda: state["fully_idle"], forward_ct=3)
    original_calls: list[object] = []

    def original(s: object) -> str:
        original_calls.append(s)
        return "done"

    assert _on_idle_around(original, scheduler) == "done"  # requests wait: no trim
    assert ahead.idle_calls == 1 and trims == [] and original_calls == [scheduler]
    state["fully_idle"] = True
    _on_idle_around(original, scheduler)
    _on_idle_around(original, scheduler)  # the same idle period: one trim
    assert trims == [1] and ahead.idle_calls == 3
    scheduler.forward_ct = 9  # served more, idle again
    _on_idle_around(original, scheduler)
    assert trims == [1, 1]
    plain = SimpleNamespace(tree_cache=SimpleNamespace(), is_fully_idle=lambda: True, forward_ct=1)
    assert _on_idle_around(original, plain) == "done"  # a plain prefix cache: nothing to do
