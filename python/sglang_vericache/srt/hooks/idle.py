"""What a ``--vericache`` scheduler does when it has no batch to run (SGLang's ``on_idle``).

SGLang calls ``Scheduler.on_idle`` whenever a loop iteration found nothing to run, e.g. while
every waiting request waits for its prefix from the tier, and over and over once the server is
idle (sleeping between polls with ``--sleep-on-idle``). Then:

- drafting ahead (``srt/prefix/draft_ahead.py``) may use the compute: the serving path idles
  (the worker marks it busy again at its next forward);
- once the scheduler is fully idle (nothing running, nothing waiting) after work, the heap's free
  pages go back to the OS (``host_memory.IdleHeapTrim``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

IDLE_TARGET = "sglang.srt.managers.scheduler.Scheduler.on_idle"


def _on_idle_around(original: Callable[..., Any], scheduler: Any, *args: Any, **kw: Any) -> Any:
    cache = scheduler.tree_cache
    ahead = getattr(cache, "ahead", None)
    if ahead is not None:
        ahead.serving_idle()
    heap = getattr(cache, "heap_trim", None)
    if heap is not None and scheduler.is_fully_idle():
        heap.idle(scheduler.forward_ct)
    return original(scheduler, *args, **kw)


def register_idle_hook() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(IDLE_TARGET, _on_idle_around, HookType.AROUND)
