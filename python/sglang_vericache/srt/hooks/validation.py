"""Reject, in the tokenizer process, the requests that would kill SGLang's scheduler.

SGLang 0.5.23 validates a request in ``TokenizerManager._validate_one_request`` (prompt length,
``token_ids_logprob``, ...) and ``SamplingParams.verify`` before it sends it to the scheduler;
a ``ValueError`` raised there reaches the client as HTTP 400 with its message (``/generate``,
``/v1/completions`` and ``/v1/chat/completions`` alike) and the scheduler never sees the
request. Some requests pass those checks and then crash the scheduler's first forward pass,
which ends the whole server: see ``sglang_vericache.requests_check`` for the list and the
checks. The plugin registers these hooks in every SGLang process, with or without
``--vericache``; they only do work in the process that owns the tokenizer manager.

- ``GenerateReqInput._handle_parallel_sampling`` (AFTER): bound ``n`` as soon as SGLang has
  read it, before it expands the batch ``n``-fold in memory.
- ``TokenizerManager._handle_batch_request`` (AROUND): check every item of a batch (prompt,
  sampling parameters, ``top_logprobs_num``, an id prompt's length) before SGLang tokenizes
  and sends the items one by one, so a bad item at index 3 is reported (``input_ids[3]``,
  ``sampling_params[3]``, or SGLang's own message) and items 0-2 are never started.
- ``TokenizerManager._validate_one_request`` (AROUND): after SGLang's own checks (their
  messages keep precedence), check the tokenized prompt (empty, ids out of vocabulary),
  ``top_logprobs_num`` and ``top_k``. This is the only check single requests get, and the one that sees
  what a text actually tokenizes to.
- The admin endpoints that kill the scheduler (``ADMIN_CHECKS``: expert-distribution recording
  without a recorder, memory-occupation release without an accelerator), on
  ``TokenizerControlMixin`` (AROUND). The tokenizer process's ``server_args.device`` is still
  None (the scheduler resolves it), so the device check asks torch. These are not generation,
  so the refusal is an ``HTTPException`` (400): SGLang's handlers there map no ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_vericache.requests_check import (
    RequestError,
    check_batch,
    check_batch_items,
    check_expert_recording,
    check_input_embeds,
    check_memory_occupation,
    check_parallel_samples,
    check_prompt_ids,
    check_sampling_params,
    check_top_logprobs_num,
)

TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
VALIDATE_TARGET = f"{TOKENIZER_MANAGER}._validate_one_request"
BATCH_TARGET = f"{TOKENIZER_MANAGER}._handle_batch_request"
PARALLEL_TARGET = "sglang.srt.managers.io_struct.GenerateReqInput._handle_parallel_sampling"
CONTROL_MIXIN = "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin"


def _expert_recording(manager: Any) -> None:
    check_expert_recording(manager.server_args.expert_distribution_recorder_mode)


def _memory_occupation(manager: Any) -> None:
    import torch

    check_memory_occupation(torch.accelerator.is_available())


# TokenizerControlMixin method -> the check its server must pass before SGLang forwards it
ADMIN_CHECKS: dict[str, Callable[[Any], None]] = {
    "start_expert_distribution_record": _expert_recording,
    "stop_expert_distribution_record": _expert_recording,
    "dump_expert_distribution_record": _expert_recording,
    "release_memory_occupation": _memory_occupation,
    "resume_memory_occupation": _memory_occupation,
}

_EMPTY_TEXT_IDS = "_vericache_empty_text_ids"


def _vocab_size(manager: Any) -> int:
    return int(manager.model_config.vocab_size)


def _session_supplies_prompt(obj: Any) -> bool:
    """SGLang sessions may send empty ``input_ids``: the session history is the prompt, and the
    scheduler checks the reconstructed prompt itself."""
    params = getattr(obj, "session_params", None)
    return getattr(obj, "session_id", None) is not None or (
        isinstance(params, dict) and bool(params.get("id"))
    )


def _prompt_is_checkable(obj: Any) -> bool:
    """Prompts built from embeddings or multimodal inputs carry placeholder ids (image pad
    hashes, ...) that are outside the vocabulary by design; those are left to SGLang."""
    if getattr(obj, "input_embeds", None) is not None:
        return False
    contains_mm = getattr(obj, "contains_mm_input", None)
    return not (callable(contains_mm) and contains_mm())


def _empty_text_ids(manager: Any) -> list[int]:
    """What the server's tokenizer makes of ``""`` (nothing, or a BOS token), once per process."""
    ids = getattr(manager, _EMPTY_TEXT_IDS, None)
    if ids is None:
        tokenizer = getattr(manager, "tokenizer", None)
        ids = [] if tokenizer is None else list(tokenizer.encode(""))
        setattr(manager, _EMPTY_TEXT_IDS, ids)
    return ids


def _validate_one_around(original: Callable[..., Any], manager: Any, obj: Any,
                         input_ids: Any, *args: Any, **kw: Any) -> Any:  # fmt: skip
    result = original(manager, obj, input_ids, *args, **kw)
    vocab_size = _vocab_size(manager)
    if getattr(obj, "input_embeds", None) is not None:
        check_input_embeds(manager.model_config.dtype)
    if _prompt_is_checkable(obj) and not (not input_ids and _session_supplies_prompt(obj)):
        field = "input_ids" if getattr(obj, "input_ids", None) is not None else "text"
        check_prompt_ids(input_ids, vocab_size, field=field)
    if getattr(obj, "return_logprob", False):
        check_top_logprobs_num(getattr(obj, "top_logprobs_num", None), vocab_size)
    check_sampling_params(getattr(obj, "sampling_params", None), vocab_size)
    return result


def _handle_batch_around(original: Callable[..., Any], manager: Any, obj: Any,
                         *args: Any, **kw: Any) -> Any:  # fmt: skip
    """An async generator like the original: the check runs on the first ``__anext__``, which
    is where SGLang's HTTP layer catches ``ValueError`` for a 400."""

    async def checked():
        _check_batch_before_dispatch(manager, obj)
        async for out in original(manager, obj, *args, **kw):
            yield out

    return checked()


def _check_batch_before_dispatch(manager: Any, obj: Any) -> None:
    """Every check a batch item gets before SGLang sends it, run for all items first: SGLang
    tokenizes, validates and sends the items one by one, so an item refused at index k used
    to leave items 0..k-1 dispatched (then aborted). Checked here: the prompts
    (``check_batch``); this package's per-item checks (``check_batch_items``); SGLang's own
    length checks for items sent as ids (``_validate_one_request``, whose text items need
    their tokens, which come later); and SGLang's sampling-parameter checks
    (``SamplingParams`` built, normalized and verified as ``_create_tokenized_object`` does),
    so the client gets SGLang's own message for them, and nothing is started."""
    n = obj.batch_size  # before parallel-sampling expansion: the client's indices
    vocab_size = _vocab_size(manager)
    checkable = _prompt_is_checkable(obj) and not _session_supplies_prompt(obj)
    if checkable:
        text = obj.text[:n] if isinstance(obj.text, list) else obj.text
        ids = obj.input_ids[:n] if isinstance(obj.input_ids, list) else obj.input_ids
        empty = _empty_text_ids(manager) if text is not None else []
        check_batch(text, ids, vocab_size, empty)
    if not hasattr(obj, "return_logprob"):
        return  # an embedding batch: no sampling
    items = [obj[i] for i in range(n)]  # SGLang's own per-item views (cached on obj)
    check_batch_items([item.sampling_params for item in items],
                      [item.top_logprobs_num if item.return_logprob else None for item in items],
                      vocab_size)  # fmt: skip
    for item in items:
        if checkable and isinstance(item.input_ids, list):
            manager._validate_one_request(item, list(item.input_ids))
        _verify_sampling_params(manager, item)


def _verify_sampling_params(manager: Any, item: Any) -> None:
    """SGLang's sampling-parameter checks of one batch item, as ``_create_tokenized_object``
    runs them (a ``ValueError`` naming the parameter, or what SGLang raises otherwise)."""
    kwargs = {**(manager.preferred_sampling_params or {}), **(item.sampling_params or {})}
    params = manager.sampling_params_class(**kwargs)
    params.normalize(manager.tokenizer)
    params.verify(_vocab_size(manager))


def _parallel_sampling_after(result: Any, obj: Any, *args: Any, **kw: Any) -> Any:
    check_parallel_samples(getattr(obj, "parallel_sample_num", 1))
    return result


def _admin_around(check: Callable[[Any], None]) -> Callable[..., Any]:
    """An AROUND hook that runs ``check(manager)`` first: a ``RequestError`` becomes HTTP 400."""

    def around(original: Callable[..., Any], manager: Any, *args: Any, **kw: Any) -> Any:
        try:
            check(manager)
        except RequestError as exc:
            from fastapi import HTTPException

            raise HTTPException(status_code=400, detail=str(exc)) from exc
        return original(manager, *args, **kw)

    return around


def register_validation_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(PARALLEL_TARGET, _parallel_sampling_after, HookType.AFTER)
    HookRegistry.register(BATCH_TARGET, _handle_batch_around, HookType.AROUND)
    HookRegistry.register(VALIDATE_TARGET, _validate_one_around, HookType.AROUND)
    for method, check in ADMIN_CHECKS.items():
        HookRegistry.register(f"{CONTROL_MIXIN}.{method}", _admin_around(check), HookType.AROUND)
