"""One ``VeriContext`` per scheduler: the VeriCache objects its SGLang parts share.

SGLang builds the parts of one scheduler separately (the model runner's attention backend, the
speculative worker, the prefix cache, the weight updater) and hands each only its own
arguments; what they share is the scheduler's ``req_to_token_pool``. The context hangs there,
under one attribute (``CONTEXT_ATTR``), set by ``open_context`` only (the first part built
creates it: the attention backend in a server, whatever a test builds first) and read through
``context_of``, which names the problem where it is missing.

What it holds (each made by one part, read by the others):

- ``ledger``: the offload ledger (``srt/kv/offload.py``), made with the context;
- ``offloader``: the one ``PoolOffloader`` of the pool (``srt/kv/offloader.shared_offloader``),
  used by the prefix cache (restore / drop a released row, evict resident draft rows) and the
  worker (offload after prefill and commits);
- ``requests``: the ``RequestTable`` (``requests/table.py``): every request's record and the
  one way a request's state is closed, whichever part holds it;
- ``link``: the remote tier link (``srt/prefix/remote_prefix.py``), set by the prefix cache with
  a remote tier (the worker reports prefill speed to it); None without one;
- ``ahead``: drafting while a prefix is fetched (``srt/prefix/draft_ahead.py``), set by the
  prefix cache where fetch drafting is on; None without it;
- ``served``: the weights served now (``srt/prefix/model_identity.ServedWeights``), set with a
  remote tier; the weight-update hooks move it. None without a remote tier;
- ``draft_precision``: the draft path's shadow weights (``srt/attention/draft_precision.py``),
  set by the worker where it drafts on them; the weight-update hooks mark them stale. None
  without shadows.

Scheduler thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sglang_vericache.requests.table import RequestTable
from sglang_vericache.srt.kv.offload import OffloadLedger

CONTEXT_ATTR = "_vericache_context"  # on a scheduler's req_to_token_pool: its VeriContext


@dataclass(eq=False)
class VeriContext:
    """The VeriCache objects of one scheduler (module doc). Typed ``Any`` where the type's
    module reads the context itself (an import circle otherwise)."""

    ledger: OffloadLedger = field(default_factory=OffloadLedger)
    requests: RequestTable = field(default_factory=RequestTable)
    offloader: Any = None  # srt/kv/offloader.PoolOffloader, once the pool has one
    link: Any = None  # srt/prefix/remote_prefix.RemotePrefixLink | None
    ahead: Any = None  # srt/prefix/draft_ahead.DraftAhead | None
    served: Any = None  # srt/prefix/model_identity.ServedWeights | None
    draft_precision: Any = None  # srt/attention/draft_precision.DraftPrecision | None

    def __post_init__(self) -> None:
        # the ledger's rows must belong to live requests (RequestTable.check_integrity); its
        # admission asks name requests, dropped when they close
        self.requests.join(self.ledger)
        self.requests.hold_rows(self.ledger)


def open_context(req_to_token_pool: Any) -> VeriContext:
    """The context of the scheduler that owns ``req_to_token_pool``, made on the first call
    (the only place ``CONTEXT_ATTR`` is set)."""
    context = getattr(req_to_token_pool, CONTEXT_ATTR, None)
    if context is None:
        context = VeriContext()
        setattr(req_to_token_pool, CONTEXT_ATTR, context)
    return context


def has_context(req_to_token_pool: Any) -> bool:
    """Whether a VeriCache part was built over ``req_to_token_pool`` (not on a draft model's or
    a plain server's pool)."""
    return isinstance(getattr(req_to_token_pool, CONTEXT_ATTR, None), VeriContext)


def context_of(req_to_token_pool: Any) -> VeriContext:
    """The context ``open_context`` made for ``req_to_token_pool``; raises where none was."""
    context = getattr(req_to_token_pool, CONTEXT_ATTR, None)
    if context is None:
        raise RuntimeError(
            f"no VeriCache context on {type(req_to_token_pool).__name__}: the 'vericache' "
            "attention backend or prefix cache makes it (srt/context.open_context); was this "
            "scheduler started with --vericache?"
        )
    return context
