"""Which KV may cross to and from the remote tier, and the tier link's set-up.

A tier key names tokens and the model (``tier/keys.py``, ``srt/prefix/model_identity.py``). KV may be
written under a key, or taken from one, only where the key says everything that decided it:

- the request's token ids are its content (``tier_content``): not ``input_embeds`` (SGLang
  gives those requests placeholder ids, token 1 repeated), not multimodal inputs (pad ids
  derived from a hash of the media), not positional embedding overrides or token type ids, not
  LoRA / extra-key / cache-salted requests (their KV, or their right to it, is not the tokens');
- all of its KV was computed by the weights the key names now (``TierEligibility``). SGLang
  can change weights under running requests (``pause_generation(mode="in_place")``, then an
  update): their KV, and whatever the prefix cache kept from before (SGLang cannot flush it
  while requests run), was computed by the old weights.

A ``--disable-radix-cache`` server has no prefix caching, so it neither writes to nor reads
from the tier (``open_remote`` opens no link): its users asked for every prompt to be
computed, and SGLang requires it for ``input_embeds``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang_vericache.requests.table import RequestTable
from sglang_vericache.srt.prefix.remote_prefix import RemotePrefixLink
from sglang_vericache.tier.link_bounds import LinkBounds

logger = logging.getLogger(__name__)


def tier_content(req: Any) -> bool:
    """Whether ``req``'s KV is determined by its token ids (and the model) alone."""
    return (not getattr(req, "extra_key", None) and not getattr(req, "cache_salt", None)
            and getattr(req, "input_embeds", None) is None
            and getattr(req, "multimodal_inputs", None) is None
            and getattr(req, "positional_embed_overrides", None) is None
            and getattr(req, "token_type_ids", None) is None)  # fmt: skip


class TierEligibility:
    """Per request: may its KV be looked up in, or written to, the tier (module doc)?

    ``generation()`` counts the weight changes of this server (``ServedWeights.generation``).
    A request is stamped with it at each match of its prompt against the prefix cache (its
    admission, and every further chunk of a chunked prefill), if the prefix cache holds no KV
    of an earlier generation (it was reset, i.e. SGLang flushed it, since the last change). Its
    KV is then the matched KV plus what it computes afterwards, so it may be written through
    only while the generation is still the stamped one. A request not stamped (never matched,
    or closed: the stamp is its record's) is not written through. Scheduler thread only.
    """

    def __init__(self, generation: Callable[[], int] = lambda: 0,
                 requests: RequestTable | None = None) -> None:  # fmt: skip
        """requests: the scheduler's request table, whose records hold each request's stamp
        (``tier_generation``, gone when the request closes); a table of its own by default."""
        self.generation = generation
        self._tree_generation = generation()  # generation when the prefix cache was reset
        self._stamps = (RequestTable() if requests is None else requests).field("tier_generation")

    def tree_reset(self) -> None:
        """The prefix cache was emptied: what it holds from now on is of this generation."""
        self._tree_generation = self.generation()

    def matched(self, req: Any) -> bool:
        """``req`` matched the prefix cache: stamp it; returns whether the tier may supply the
        rest of its prompt (under keys of the current weights)."""
        self._stamps.pop(req.rid, None)
        now = self.generation()
        if not tier_content(req) or self._tree_generation != now:
            return False
        self._stamps[req.rid] = now
        return True

    def may_write(self, req: Any) -> bool:
        """Whether ``req``'s KV was all computed by the weights served now."""
        return self._stamps.get(req.rid) == self.generation()


def open_remote(ctx: Any, num_layers: int, chunk_tokens: int
                ) -> tuple[RemotePrefixLink, TierEligibility] | None:
    """The tier link for zmq:// and lmcache:// tiers and the eligibility of requests for it;
    None for the host tier and for a ``--disable-radix-cache`` server. Keys name the weights
    served now (``ServedWeights``), which SGLang's weight updates move on."""
    from sglang_vericache.config import TierKind
    from sglang_vericache.srt.prefix.model_identity import ServedWeights, server_model_identity
    from sglang_vericache.server_record import vericache_config
    from sglang_vericache.srt.context import context_of

    config = vericache_config(ctx.server_args)
    tier = config.tier
    if tier.kind is TierKind.HOST:
        return None
    if ctx.server_args.disable_radix_cache:
        logger.warning("--disable-radix-cache: prefix caching is off, so the remote tier %s is "
                       "not used (nothing is written to it or read from it)", tier)
        return None
    if ctx.tp_size > 1:  # readiness would need an all-reduce across ranks (not built)
        raise ValueError(f"--vericache-tier {tier} supports --tp-size 1 only; use "
                         "--vericache-tier host with tensor parallelism")  # fmt: skip
    keys = ctx.params.token_to_kv_pool_allocator.get_kvcache().get_key_buffer(0)
    served = ServedWeights(server_model_identity(ctx.server_args, ctx.model_config, ctx.tp_rank))
    served.attach(ctx.params.req_to_token_pool)  # where the weight-update hooks find it
    geometry = served.geometry_source(num_layers, keys.shape[1], keys.shape[2], keys.dtype,
                                      chunk_tokens)  # fmt: skip
    logger.info("remote prefix tier %s (chunks of %d tokens)", tier, chunk_tokens)
    inflight = config.tier_inflight_mb << 20
    bounds = LinkBounds(lookup_deadline_s=config.tier_lookup_deadline_s,
                        max_put_bytes=inflight, max_fetch_bytes=inflight)  # fmt: skip
    requests = context_of(ctx.params.req_to_token_pool).requests
    link = RemotePrefixLink.open(str(tier), geometry, bounds, requests)
    return link, TierEligibility(lambda: served.generation, requests)
