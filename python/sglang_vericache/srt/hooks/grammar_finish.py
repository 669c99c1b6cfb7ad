"""Grammar termination finishes a request on the step plain SGLang finishes it.

SGLang 0.5.23 orders a decode step's bookkeeping differently for plain and speculative batches
(``SchedulerBatchResultProcessor``):

- plain decode: append token t, ``update_finish_state``, *then* advance the grammar over t. A
  grammar that t terminates is seen by the finish check one step later, so the request emits one
  more token (sampled under the terminated matcher's mask) and finishes after it;
- speculative decode (``_resolve_spec_v2_tokens``): advance the grammar over the committed run
  first, so the same t finishes the request at once.

Termination that is not also a stop (an EOS under ``ignore_eos``: ``regex`` + ``ignore_eos``
measured ``[.., 32, 2, 198]`` plain vs ``[.., 32, 2]`` speculative) therefore gives a different
output under ``--vericache``, whose batches are speculative. Two AROUND hooks restore the plain
order for VeriCache servers: ``_accept_grammar_tokens`` records the output length at which this
step's tokens terminated the grammar, and ``update_finish_state`` does not let that termination
finish the request in the same step. The next step's token finishes it, as in plain decoding
(accepting a token on a terminated matcher is a no-op in SGLang's backends). Prefill is the same
on both paths (check, then advance) and untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_vericache.server_record import ALGORITHM

ACCEPT_TARGET = (
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor._accept_grammar_tokens"
)
FINISH_TARGET = "sglang.srt.managers.schedule_batch.Req.update_finish_state"
TERMINATED_AT_ATTR = "_vericache_grammar_terminated_at"  # output length when it terminated


def hides_termination(terminated_at: int | None, output_len: int) -> bool:
    """Whether the finish check of a step ending at ``output_len`` tokens must not see the
    grammar's termination: it happened at this step's last token (plain SGLang sees it a step
    later). ``terminated_at``: output length at termination, None if not terminated."""
    return terminated_at is not None and terminated_at == output_len


def _serving_vericache() -> bool:
    from sglang.srt.runtime_context import get_server_args

    return getattr(get_server_args(), "speculative_algorithm", None) == ALGORITHM


def _accept_around(original: Callable[..., Any], processor: Any, req: Any, tokens: Any) -> Any:
    grammar = req.grammar
    was_terminated = grammar.is_terminated()
    retained = original(processor, req, tokens)
    if not was_terminated and grammar.is_terminated() and _serving_vericache():
        # called before this step's tokens are appended to output_ids
        setattr(req, TERMINATED_AT_ATTR, len(req.output_ids) + len(retained))
    return retained


def _finish_around(original: Callable[..., Any], req: Any, *args: Any, **kw: Any) -> Any:
    grammar = req.grammar
    if grammar is None or not hides_termination(
        getattr(req, TERMINATED_AT_ATTR, None), len(req.output_ids)
    ):
        return original(req, *args, **kw)
    req.grammar = None  # the only grammar read in update_finish_state is the termination check
    try:
        return original(req, *args, **kw)
    finally:
        req.grammar = grammar


def register_grammar_finish_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(ACCEPT_TARGET, _accept_around, HookType.AROUND)
    HookRegistry.register(FINISH_TARGET, _finish_around, HookType.AROUND)
