"""Registration of the VERICACHE speculative algorithm and the ``vericache`` attention backend
and prefix cache.

Kept apart from the worker and the backend so that registering (which runs in every SGLang
process) stays cheap: those modules, and the model-runner machinery they import, load only in
the scheduler, when SGLang calls the factories.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from sglang_vericache.server_record import ALGORITHM, BACKEND_NAME


class VeriCacheAlgo(CustomSpecAlgo):
    """SGLang 0.5.23 calls these on every spec algorithm; CustomSpecAlgo lacks them."""

    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens=True,
                          needs_confidence_relay=False):  # fmt: skip
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(
            device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay
        )


def _worker_class(server_args: Any) -> type:
    from sglang_vericache.srt.decode.worker import VeriCacheWorker

    return VeriCacheWorker


def register_algorithm() -> None:
    """Register ``--speculative-algorithm VERICACHE`` (idempotent)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    if get_spec(ALGORITHM) is None:
        SpeculativeAlgorithm.register(ALGORITHM, supports_overlap=False, spec_class=VeriCacheAlgo)(
            _worker_class
        )


def _attention_backend(model_runner: Any) -> Any:
    from sglang_vericache.srt.attention.backend import VeriCacheAttnBackend

    return VeriCacheAttnBackend(model_runner)


def register_backend() -> None:
    """Register ``--attention-backend vericache`` (idempotent; before SGLang builds its parser)."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(_attention_backend)


def _radix_cache(ctx: Any) -> Any:
    from sglang_vericache.srt.prefix.radix_cache import build_vericache_radix_cache

    return build_vericache_radix_cache(ctx)


def register_radix_cache() -> None:
    """Register ``--radix-cache-backend vericache`` (idempotent)."""
    from sglang.srt.mem_cache.registry import (
        register_radix_cache_backend,
        registered_radix_cache_backends,
    )

    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, _radix_cache)
