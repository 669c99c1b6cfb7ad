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
- ``--sleep-on-idle``: an idle scheduler otherwise spins on its sockets at 100% of a core, which
  on a CPU machine is a core taken from every other server's forward passes.
"""

from __future__ import annotations

from functools import cache

import torch
from sglang.srt.platforms.cpu import CpuSRTPlatform
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import KVPoolKind, PlatformCapabilities

CPU_MEM_FRACTION_STATIC = 0.2
PLATFORM_QUALNAME = "sglang_vericache.srt.platform.TorchCpuPlatform"


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

    def apply_server_args_defaults(self, server_args) -> None:
        if server_args.dtype == "auto":
            server_args.dtype = "float32"
        if server_args.mem_fraction_static is None:
            server_args.mem_fraction_static = CPU_MEM_FRACTION_STATIC
        if not server_args.sleep_on_idle:
            server_args.sleep_on_idle = True


def activate() -> str | None:
    """Entry point (``sglang.srt.platforms``): our platform when there is no CUDA device."""
    if torch.cuda.is_available():
        return None
    return PLATFORM_QUALNAME
