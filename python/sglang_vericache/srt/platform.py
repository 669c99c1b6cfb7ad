"""A pure-torch CPU platform for SGLang, active only on machines without CUDA.

SGLang's in-tree CPU engine needs a CPU build of ``sgl_kernel`` that no registry ships. This
out-of-tree platform runs every fused op through its ``forward_native`` torch path and attention
through ``torch_native``, so plain SGLang (and VeriCache) serve on any CPU machine with no stubs
and no environment variables. Where CUDA exists ``activate()`` returns None and SGLang picks its
in-tree CUDA platform as usual.

CPU defaults (applied only where the user left the flag unset):
- ``--dtype auto`` resolves to float32: SGLang would downcast an fp32 checkpoint to fp16, which on
  CPU is 3-4x slower and not batch-invariant (so greedy outputs would depend on batching).
- ``--mem-fraction-static`` 0.2: on CPU the fraction is of host RAM, and the GPU default would
  pin most of the machine's memory for the KV pool.
- KV pool size (see ``cpu_kv_budget``): SGLang sizes the pool as the memory *available* after
  the weights loaded minus ``(1 - fraction)`` of what was available before. On a GPU the card
  is the server's own; on a host shared by several servers, a second server that starts while
  the first allocates its pool (torch zero-fills, so the pages are committed) sees the first
  pool as its own weights and refuses to start ("Loaded weights leave no GPU memory ...").
  Here the pool is a fixed share of *total* host RAM instead (``fraction x RAM - weights``),
  capped at ``CPU_KV_POOL_CAP_BYTES`` while the fraction is our default, and never more than
  half the memory available at that moment (so a crowded host gets smaller pools rather than
  an out-of-memory kill). ``--max-total-tokens`` sizes the pool exactly. The choice is logged.
- ``--sleep-on-idle``: an idle scheduler otherwise spins on its sockets at 100% of a core, which
  on a CPU machine is a core taken from every other server's forward passes.
- ``GOMP_SPINCOUNT=1000`` for the scheduler processes (unless the environment sets it or
  ``OMP_WAIT_POLICY``): after each parallel region torch's OpenMP threads spin this long for the
  next one, then sleep. OpenMP's default spins ~300x longer, and any other busy process on the
  cores (the tokenizer, a second server, a client) turns that spinning into a collapse; never
  spinning (``OMP_WAIT_POLICY=PASSIVE``) wakes a sleeping thread for each of a decode step's
  many small parallel regions instead. 1000 is libgomp's own choice when it sees more threads
  than CPUs. Measured on 2 cores by ``benchmark/omp_wait.py``, 3,000 decode-sized pairs of an
  8-row matmul and a 1k-key attention (seconds per process, two sessions' runs):

      processes at once     default spin   passive     spin 1000
      1                     1.42-1.61      1.79-2.22   1.44-1.72
      2                     8.0-14.1       2.8-3.0     3.4
      3                     19.9-24.6      3.5-5.5     4.7-6.7

  Servers decoding 8 x 3-4k requests went 10-14% faster than passive (``benchmark/README.md``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from sglang.srt.platforms.cpu import CpuSRTPlatform
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import KVPoolKind, PlatformCapabilities

logger = logging.getLogger(__name__)

OMP_WAIT_POLICY = "OMP_WAIT_POLICY"
GOMP_SPINCOUNT = "GOMP_SPINCOUNT"
SPIN_COUNT = "1000"  # libgomp's default when more threads than CPUs (module doc)

CPU_MEM_FRACTION_STATIC = 0.2
PLATFORM_QUALNAME = "sglang_vericache.srt.platform.TorchCpuPlatform"
GIB = 1 << 30
# The default pool's ceiling: about 46k tokens of the embedded model (5 full 8k contexts). A CPU
# forward pass is slow enough that a bigger pool is rarely filled, while every server on the
# host pins its whole pool (torch zero-fills it). An explicit --mem-fraction-static lifts it.
CPU_KV_POOL_CAP_BYTES = 2 * GIB
# The pool never takes more than this share of the memory available when it is sized.
AVAILABLE_SHARE = 0.5
POOL_TARGET = (
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes"
)


@cache
def cpu_mha_pool_cls() -> type:
    """The in-tree MHA pool without its Triton slot-copy kernel (built on first use).

    With a speculative algorithm SGLang builds the pool with ``enable_kv_cache_copy`` and warms
    up a Triton tile-copy kernel, which cannot launch without a GPU. VeriCache verifies a chain
    (not a tree), so it never moves accepted KV between slots and needs no copy kernel. Built
    lazily: the pool module imports the platform registry, which imports this module.
    """
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    class TorchCpuMHAPool(MHATokenToKVPool):
        def _init_kv_copy_and_warmup(self) -> None:
            self._kv_copy_config = None

    return TorchCpuMHAPool


class TorchCpuPlatform(CpuSRTPlatform):
    """SGLang on CPU with pure-torch kernels (no sgl_kernel, no Triton, no graph capture)."""

    # Out-of-tree: SGLang then skips its CUDA/vLLM kernel fallbacks (e.g. rotary embedding).
    _enum = PlatformEnum.OOT
    capabilities = PlatformCapabilities()

    def get_dispatch_key_name(self) -> str:
        return "native"

    def get_default_attention_backend(self) -> str:
        return "torch_native"

    def get_kv_pool_cls(self, *, kind: KVPoolKind) -> type | None:
        return cpu_mha_pool_cls() if kind == "mha" else None

    # SGLang's profiler asks an out-of-tree platform for its device's activity; the base class
    # raises NotImplementedError, inside the scheduler, so ``POST /start_profile`` killed the
    # server. On a CPU the device activity is the CPU's.
    def get_torch_profiler_activity_str(self) -> str:
        return "CPU"

    def get_torch_profiler_activity(self) -> torch.profiler.ProfilerActivity:
        return torch.profiler.ProfilerActivity.CPU

    def apply_server_args_defaults(self, server_args) -> None:
        if server_args.dtype == "auto":
            server_args.dtype = "float32"
        if server_args.mem_fraction_static is None:
            server_args.mem_fraction_static = CPU_MEM_FRACTION_STATIC
        if not server_args.sleep_on_idle:
            server_args.sleep_on_idle = True
        # read by the OpenMP runtime of each scheduler process this one spawns (see module doc)
        if OMP_WAIT_POLICY not in os.environ and GOMP_SPINCOUNT not in os.environ:
            os.environ[GOMP_SPINCOUNT] = SPIN_COUNT
            logger.info("CPU platform: %s=%s (torch threads spin briefly between parallel "
                        "regions, then sleep)", GOMP_SPINCOUNT, SPIN_COUNT)  # fmt: skip


def activate() -> str | None:
    """Entry point (``sglang.srt.platforms``): our platform when there is no CUDA device."""
    if torch.cuda.is_available():
        return None
    return PLATFORM_QUALNAME


@dataclass(frozen=True)
class CpuKvBudget:
    """Bytes for the KV pool and the term of the ``min`` that chose them (for the log)."""

    nbytes: int
    reason: str


def cpu_kv_budget(*, total: int, available: int, weights: int, fraction: float,
                  capped: bool, needed: int | None = None) -> CpuKvBudget:  # fmt: skip
    """The KV pool budget on a CPU host (bytes; see the module doc).

    total/available: host RAM (cgroup-aware) in bytes; weights: the loaded model's bytes;
    fraction: --mem-fraction-static; capped: the fraction is our default (apply the cap);
    needed: bytes of the pool --max-total-tokens asks for, if given.
    """
    if needed is not None:
        if needed > available:
            raise ValueError(
                f"--max-total-tokens asks for a KV pool of {needed / GIB:.2f} GiB, but only "
                f"{available / GIB:.2f} GiB of host memory is available; lower "
                "--max-total-tokens (or free memory)"
            )
        return CpuKvBudget(needed, "--max-total-tokens")
    share = fraction * total - weights
    if share <= 0:
        lowest = weights / total
        raise ValueError(
            f"--mem-fraction-static={fraction:g} of {total / GIB:.1f} GiB host RAM leaves no room "
            f"for the KV pool after {weights / GIB:.2f} GiB of weights; raise "
            f"--mem-fraction-static above {lowest:.3f} or set --max-total-tokens"
        )
    ram = f"{fraction:g} x {total / GIB:.1f} GiB host RAM - {weights / GIB:.2f} GiB weights"
    terms = [(share, ram)]
    if capped:
        terms.append(
            (CPU_KV_POOL_CAP_BYTES, f"the default cap {CPU_KV_POOL_CAP_BYTES / GIB:g} GiB")
        )
    now = f"{AVAILABLE_SHARE:g} x the {available / GIB:.1f} GiB available now"
    terms.append((AVAILABLE_SHARE * available, now))
    nbytes, reason = min(terms, key=lambda t: t[0])
    return CpuKvBudget(int(nbytes), reason)


def _host_memory() -> tuple[int, int]:
    """(total, available) host memory in bytes, within the cgroup's limit if there is one."""
    import psutil
    from sglang.srt.utils.common import get_free_cpu_memory, get_instance_memory_status

    total = psutil.virtual_memory().total
    limit = get_instance_memory_status("/sys/fs/cgroup/memory.max")
    return (total if limit is None else min(total, limit)), get_free_cpu_memory()


def _fraction_is_default(server_args: Any, fraction: float) -> bool:
    """Whether --mem-fraction-static is the default this platform declared (not the user's)."""
    for source, declared in getattr(server_args, "_resolved_overrides", None) or ():
        if "mem_fraction_static" in declared and str(source).startswith("platform:"):
            return True
    return fraction == CPU_MEM_FRACTION_STATIC


def _model_bytes(model: Any) -> int:
    if model is None:
        return 0
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _profile_around(original: Callable[..., Any], configurator: Any, *args: Any,
                    **kw: Any) -> int:  # fmt: skip
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
    from sglang.srt.platforms import current_platform
    from sglang.srt.runtime_context import get_schedule

    if configurator.device != "cpu" or not isinstance(current_platform, TorchCpuPlatform):
        return original(configurator, *args, **kw)
    schedule = get_schedule()
    sizer = create_memory_pool_configurator(configurator)

    def tokens(nbytes: float) -> int:
        return sizer.calculate_pool_sizes(int(nbytes), schedule.page_size).max_total_num_tokens

    per_token = GIB / max(tokens(2 * GIB) - tokens(GIB), 1)
    fixed = max(GIB - tokens(GIB) * per_token, 0)  # bytes the pool takes besides its tokens
    needed = None
    if schedule.max_total_tokens is not None:  # one page over: the pool rounds down to pages
        needed = int(fixed + (schedule.max_total_tokens + schedule.page_size) * per_token)
    total, available = _host_memory()
    fraction = schedule.mem_fraction_static
    budget = cpu_kv_budget(
        total=total,
        available=available,
        weights=_model_bytes(configurator.model),
        fraction=fraction,
        capped=_fraction_is_default(configurator.server_args, fraction),
        needed=needed,
    )
    n = tokens(budget.nbytes)
    if schedule.max_total_tokens is not None:
        n = min(n, schedule.max_total_tokens)
    logger.info(
        "KV pool: %d tokens (%.2f GiB) from %s; set --max-total-tokens or "
        "--mem-fraction-static to change", n, n * per_token / GIB, budget.reason,
    )  # fmt: skip
    return budget.nbytes


def register_pool_sizing_hook() -> None:
    """Size the KV pool from total host RAM on this platform (see the module doc)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(POOL_TARGET, _profile_around, HookType.AROUND)
