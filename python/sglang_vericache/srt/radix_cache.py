"""The ``vericache`` prefix cache: SGLang's radix tree, aware of rows offloaded to host memory.

``--vericache`` selects it (``--radix-cache-backend vericache``). It differs from ``RadixCache``
only where a drafted request's row holds placeholders instead of slots (``srt/offload.py``):

- a running drafted request is not published into the tree (``checkpoint`` before it
  finishes), so the KV it computes stays its own and can move to the host; the shared prefix it
  matched at admission stays tree-owned and on the device;
- when it finishes, its host KV comes back into fresh pool slots and the whole sequence is
  inserted as usual, so the next turn of a conversation hits it (when the pool cannot take it,
  only the part already on the device is kept);
- ``free_kv_row`` never frees the placeholders, and ``on_release`` frees the compressed KV's
  reserved slots, so the idle check ``available + evictable + protected == total`` holds.

Requests decoded plainly (sampling, logprobs, ...) never offload and are cached exactly as
without ``--vericache``.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.radix_cache import RadixCache

from sglang_vericache.srt.eligibility import plain_reason
from sglang_vericache.srt.offloader import PoolOffloader

logger = logging.getLogger(__name__)

BACKEND_NAME = "vericache"


class VeriCacheRadixCache(RadixCache):
    """``RadixCache`` plus restore/drop of offloaded rows (see module doc)."""

    def __init__(self, params: Any, num_layers: int, verify_width: int) -> None:
        allocator = params.token_to_kv_pool_allocator
        self.offloader = PoolOffloader(
            allocator.get_kvcache(), params.req_to_token_pool, allocator, num_layers
        )  # before super().__init__, which calls reset()
        self.restore_failures = 0
        self.verify_width = verify_width  # pool slots one verification writes per request
        super().__init__(params)

    def checkpoint(self, req: Any, *, up_to: int) -> None:
        row = req.kv.req_pool_idx
        if not req.finished():
            if self.offloader.ledger.span(row) is None and plain_reason(req) is not None:
                super().checkpoint(req, up_to=up_to)
            return  # a drafted request keeps its KV to itself while it runs
        if self.disable:
            return  # nothing is cached; the row's placeholders are skipped when it is freed
        restored = self.offloader.restore(
            row, lambda n: self.evict(EvictParams(num_tokens=n))
        )  # fmt: skip
        if restored:
            super().checkpoint(req, up_to=up_to)
            return
        self.restore_failures += 1
        span = self.offloader.ledger.span(row)
        logger.info("pool full: request %s cached up to position %d only", req.rid, span.lo)
        if span.lo > req.kv.cache_protected_len:
            super().checkpoint(req, up_to=span.lo)

    def free_kv_row(self, kv: Any, ranges: list[tuple[int, int]]) -> None:
        super().free_kv_row(kv, self.offloader.owned_ranges(kv.req_pool_idx, ranges))

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        self.offloader.drop(req.kv.req_pool_idx)
        super().on_release(req, checkpointed=checkpointed)

    def reset(self) -> None:
        for row in list(self.offloader.ledger.rows):
            self.offloader.drop(row)
        super().reset()


def build_vericache_radix_cache(ctx: Any) -> VeriCacheRadixCache:
    """``RadixCacheFactory`` for ``--radix-cache-backend vericache``."""
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.enable_hierarchical_cache:
        raise ValueError(
            "--vericache supports dense-attention models without HiCache; "
            "drop --enable-hierarchical-cache or serve this model without --vericache"
        )
    width = int(ctx.server_args.speculative_num_draft_tokens or 1)
    return VeriCacheRadixCache(ctx.params, ctx.model_config.num_hidden_layers, width)
