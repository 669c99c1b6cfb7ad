"""Penalties exactly as plain SGLang applies them with the same server arguments.

SGLang's penalizers (repetition, frequency, presence, ``min_new_tokens``) learn one token per
decode step in ``ScheduleBatch.cumulate_penalty_output_tokens``, which reads the request's last
output token when the step is prepared. Which token that is depends on the scheduler (0.5.23):

- synchronous (``--disable-overlap-schedule``): the previous step's results are in, so step k
  learns o_k, and token o_{k+1} is sampled with penalties over o_1 .. o_k;
- overlapped (SGLang's default): step k is prepared before step k-1's results arrive, so it
  learns o_{k-1} (the prompt's last token at the first step; SGLang's own comment there names
  it), and o_{k+1} is penalized over prompt[-1], o_1 .. o_{k-1}.

The two give different tokens for the same request (measured: 3 of 8 repetition-penalty
requests at temperature 0). ``--vericache`` always runs the synchronous scheduler, so without
this hook a penalized request would follow the synchronous rule while the same server without
``--vericache`` follows the overlapped one. The AROUND hook feeds the penalizers the token the
overlapped scheduler would, for VeriCache batches of a server whose arguments, minus
``--vericache``, would have overlapped (``PLAIN_OVERLAP_ATTR``, set by the plugin from the
user's own ``--disable-overlap-schedule``). Drafted rows carry no penalty, so what their
penalizer rows learn does not matter.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from sglang_vericache.server_record import ALGORITHM, PLAIN_OVERLAP_ATTR

TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.cumulate_penalty_output_tokens"


def penalized_token(output_ids: Sequence[int], prompt_ids: Sequence[int], overlapped: bool) -> int:
    """The token a decode step's penalizers learn (see module doc).

    output_ids: the request's committed output so far (the synchronous view, at least one token:
    the prefill's); prompt_ids: its prompt.
    """
    if overlapped:
        return output_ids[-2] if len(output_ids) >= 2 else prompt_ids[-1]
    return output_ids[-1] if output_ids else prompt_ids[-1]


def _plain_would_overlap() -> bool:
    from sglang.srt.runtime_context import get_server_args

    return bool(getattr(get_server_args(), PLAIN_OVERLAP_ATTR, False))


def _cumulate_around(original: Callable[..., Any], batch: Any, *args: Any, **kw: Any) -> Any:
    if getattr(batch.spec_algorithm, "name", None) != ALGORITHM or not _plain_would_overlap():
        return original(batch, *args, **kw)
    tokens = [penalized_token(r.output_ids, r.origin_input_ids, True) for r in batch.reqs]
    ids = torch.tensor(tokens, dtype=torch.int64).to(batch.device)
    batch.sampling_info.penalizer_orchestrator.cumulate_output_tokens(ids)
    return None


def register_penalty_hook() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, _cumulate_around, HookType.AROUND)
