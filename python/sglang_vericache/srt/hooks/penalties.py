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
``--vericache`` follows the overlapped one. For VeriCache batches the AROUND hook feeds the
penalizers what the scheduler plain SGLang would run with these arguments would have fed
(overlapped unless the user's own ``--disable-overlap-schedule``: ``PLAIN_OVERLAP_ATTR``, set by
the plugin): each row's feed stream (``feed_stream``) up to its output length, so a row whose
verify committed n tokens learns n (``penalty_learned`` in its record counts what it learned).
Penalized greedy rows draft: their verify columns past the first are penalized by a mirror of
this state (``verify/penalty_mirror.py``, ``srt/decode/penalized_rows.py``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from sglang_vericache.server_record import ALGORITHM, PLAIN_OVERLAP_ATTR

TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.cumulate_penalty_output_tokens"


def feed_stream(output_ids: Sequence[int], prompt_ids: Sequence[int], overlapped: bool,
                start: int, stop: int) -> list[int]:
    """F[start:stop], the tokens a row's penalizers learn (see module doc): a row with k output
    tokens has learned F[0 .. k-1], one per decode step.

    overlapped: F = prompt[-1], o_1, o_2, ... (each step learns the token before the last);
    synchronous: F = o_1, o_2, ... output_ids: the committed output (o_1 .. o_k)."""
    if overlapped:
        return [prompt_ids[-1] if i == 0 else output_ids[i - 1] for i in range(start, stop)]
    return list(output_ids[start:stop])


def plain_would_overlap() -> bool:
    """Whether plain SGLang with this server's arguments would run the overlapped scheduler."""
    from sglang.srt.runtime_context import get_server_args

    return bool(getattr(get_server_args(), PLAIN_OVERLAP_ATTR, False))


def _cumulate_around(original: Callable[..., Any], batch: Any, *args: Any, **kw: Any) -> Any:
    """A VeriCache batch's rows learn every token of their feed stream they have not learned:
    one per row after a plain step, as many as a verify committed after a drafted one."""
    if getattr(batch.spec_algorithm, "name", None) != ALGORITHM:
        return original(batch, *args, **kw)
    from sglang_vericache.srt.context import context_of

    overlapped = plain_would_overlap()
    learned = context_of(batch.req_to_token_pool).requests.field("penalty_learned")
    streams = []
    for req in batch.reqs:
        k = len(req.output_ids)
        # first seen (a new request, or one back after a retraction, whose penalizer rows
        # SGLang made afresh): the one token plain decoding would feed now
        start = learned.get(req.rid, k - 1)
        streams.append(feed_stream(req.output_ids, req.origin_input_ids, overlapped, start, k))
        learned[req.rid] = k
    learn_per_row(batch.sampling_info.penalizer_orchestrator, streams, batch.device)
    return None


def learn_per_row(orchestrator: Any, streams: list[list[int]], device: Any) -> None:
    """Row i's penalizers learn ``streams[i]`` in order. SGLang feeds every row one token per
    call, so rows with fewer tokens than a round's sit it out: their rows of every penalizer
    tensor are put back after it (a copy, bit for bit)."""
    for r in range(max((len(s) for s in streams), default=0)):
        idle = [i for i, s in enumerate(streams) if r >= len(s)]
        kept = _rows_of(orchestrator, idle, len(streams)) if idle else []
        tokens = [s[r] if r < len(s) else 0 for s in streams]
        orchestrator.cumulate_output_tokens(torch.tensor(tokens, dtype=torch.int64).to(device))
        for tensor, rows, values in kept:
            tensor[rows] = values


def _rows_of(orchestrator: Any, rows: list[int], bs: int) -> list[tuple[torch.Tensor, Any, Any]]:
    """Copies of ``rows`` of every prepared penalizer's per-row tensors ([bs, ...])."""
    index = torch.tensor(rows, dtype=torch.int64)
    kept = []
    for penalizer in orchestrator.penalizers.values():
        if not penalizer.is_prepared():
            continue
        for value in vars(penalizer).values():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == bs:
                at = index.to(value.device)
                kept.append((value, at, value[at].clone()))
    return kept


def register_penalty_hook() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, _cumulate_around, HookType.AROUND)
