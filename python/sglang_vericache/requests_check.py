"""Request checks SGLang 0.5.23 lacks, where a bad request takes the whole server down.

SGLang's tokenizer manager answers many bad requests with HTTP 400 (an over-long prompt,
``max_new_tokens: -5``, ``top_k: 0``, an out-of-vocabulary ``token_ids_logprob`` or
``logit_bias`` key, an invalid regex or JSON schema ...), but forwards others to the scheduler,
where the first forward pass that touches them raises and the scheduler process exits, taking
every other request with it:

- an empty prompt (``"text": ""``, ``"input_ids": []``, an empty item in a batch): the rotary
  embedding cannot reshape a tensor of 0 elements;
- a prompt token id outside ``[0, vocab_size)``: the embedding lookup raises IndexError;
- ``top_logprobs_num`` above the vocabulary size (``/v1/*`` ``top_logprobs`` / ``logprobs``
  map to it): ``topk`` raises "selected index k out of range";
- ``top_k`` above 2**31 - 1: the sampler packs it into an int32 tensor, which overflows;
- a ``stop_token_ids`` entry outside ``[0, vocab_size)``: harmless alone, but once a request
  with ``min_new_tokens`` shares the batch, its penalizer scatters every request's stop ids into
  a vocabulary-sized tensor and raises (found by the request fuzzer);
- ``min_new_tokens`` together with a grammar (``regex``, ``json_schema``, ``ebnf``,
  ``structural_tag``): once the grammar's output is complete it allows only end-of-sequence,
  which ``min_new_tokens`` masks, so every logit of the row is -inf; as soon as a sampled
  request shares the batch, the sampler draws from NaN probabilities and raises (found by the
  request fuzzer);
- a parallel-sampling ``n`` so large that one request queues ``n`` copies and holds the
  scheduler for hours (a hang for every other client);
- ``input_embeds`` on a server whose model runs in another dtype than bfloat16: SGLang's model
  runner casts them to bfloat16 (``model_runner.py``: ``input_embeds.bfloat16()``), so the first
  linear layer of a float32 (or float16) model raises on the mixed dtypes (found by the request
  fuzzer on a ``--disable-radix-cache`` server);
- ``/start_expert_distribution_record`` (and its stop and dump) on a server started without
  ``--expert-distribution-recorder-mode``: the scheduler's no-op recorder raises; and
  ``/release_memory_occupation`` (and resume) on a host without an accelerator: the scheduler
  synchronizes a CUDA device that is not there (both found by probing SGLang's admin
  endpoints).

These functions decide, without SGLang, whether a request is one of those; each problem is a
``RequestError`` (a ``ValueError``, which SGLang's HTTP layer turns into a 400 carrying the
message) that names the field and what it accepts. ``sglang_vericache.srt.hooks.validation`` calls
them from SGLang's own validation step in the tokenizer process, so the scheduler never sees
such a request. They cost microseconds per request (``min``/``max`` over the prompt ids).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from numbers import Integral
from typing import Any

# Samples one request may ask for (``n``). OpenAI's API caps ``n`` at 128 as well; a larger
# fan-out is better sent as separate requests, which the scheduler interleaves with others.
MAX_PARALLEL_SAMPLES = 128
INT32_MAX = 2**31 - 1
GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")


class RequestError(ValueError):
    """A request the server cannot serve; the message names ``field`` and its allowed values."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _is_int(value: Any) -> bool:
    """An integer, including numpy integers and 0-d integer tensors (Engine callers); not a
    bool, float or string."""
    if isinstance(value, bool):
        return False
    if isinstance(value, Integral):
        return True
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_prompt_ids(ids: Sequence[Any] | None, vocab_size: int, *, field: str) -> None:
    """Raise ``RequestError`` unless ``ids`` is a non-empty sequence of ints in
    ``[0, vocab_size)``. ``field`` is what the client sent: ``"text"`` when the ids are its
    tokenized text, ``"input_ids"`` (or ``"input_ids[3]"``) when it sent ids."""
    if ids is None:
        return
    if len(ids) == 0:
        if field.startswith("text"):
            raise RequestError(field, "the prompt is empty (it tokenizes to 0 tokens); "
                               "send a text of at least one token")  # fmt: skip
        raise RequestError(field, f"the prompt is empty; send at least one token id in "
                           f"[0, {vocab_size})")  # fmt: skip
    # type() first: isinstance(t, Integral) costs ~3 us per token, too much for long prompts
    if not all(type(t) is int for t in ids):
        for pos, token in enumerate(ids):
            if not _is_int(token):
                got = f"{token!r} ({type(token).__name__}) at position {pos}"
                raise RequestError(field, f"token ids must be integers in [0, {vocab_size}), "
                                   f"got {got}")  # fmt: skip
    if min(ids) >= 0 and max(ids) < vocab_size:
        return
    pos, token = next((p, t) for p, t in enumerate(ids) if not 0 <= t < vocab_size)
    raise RequestError(field, f"token id {token} at position {pos} is outside the model's "
                       f"vocabulary; valid range is [0, {vocab_size})")  # fmt: skip


def check_top_logprobs_num(value: Any, vocab_size: int, *, field: str = "top_logprobs_num") -> None:
    """``top_logprobs_num`` asks for the k most likely tokens; k cannot exceed the vocabulary.

    Negative or missing values are left to SGLang (it treats them as "none")."""
    if value is None:
        return
    values = value if isinstance(value, (list, tuple)) else [value]
    for k in values:
        if _is_int(k) and k > vocab_size:
            raise RequestError(field, f"asks for the {k} most likely tokens, but the model's "
                               f"vocabulary has {vocab_size}; use at most {vocab_size} "
                               "(OpenAI top_logprobs / logprobs map to this field)")  # fmt: skip


def check_sampling_params(params: Any, vocab_size: int) -> None:
    """The sampling parameters SGLang's ``SamplingParams.verify`` lets through but the
    scheduler cannot hold: ``top_k`` goes into an int32 tensor; ``stop_token_ids`` index a
    vocabulary-sized tensor once any request of the batch has ``min_new_tokens``;
    ``min_new_tokens`` beside a grammar can leave no token to sample. ``params``: one
    request's dict, or a batch's list of them."""
    for item in params if isinstance(params, list) else [params]:
        if isinstance(item, dict):
            _check_one_sampling(item, vocab_size)


def _check_one_sampling(params: dict, vocab_size: int) -> None:
    top_k = params.get("top_k")
    if _is_int(top_k) and top_k > INT32_MAX:
        raise RequestError("top_k", f"{top_k} is too large; use -1 for the whole vocabulary "
                           f"or a value in [1, {INT32_MAX}]")  # fmt: skip
    stop_ids = params.get("stop_token_ids")
    if isinstance(stop_ids, (list, tuple, set)):
        bad = [t for t in stop_ids if _is_int(t) and not 0 <= t < vocab_size]
        if bad:
            raise RequestError("stop_token_ids", f"token id {bad[0]} is outside the model's "
                               f"vocabulary; valid range is [0, {vocab_size})")  # fmt: skip
    min_new = params.get("min_new_tokens")
    grammar = next((f for f in GRAMMAR_FIELDS if params.get(f) is not None), None)
    if grammar is not None and _is_int(min_new) and min_new > 0:
        raise RequestError("min_new_tokens", f"cannot be combined with {grammar} (got "
                           f"min_new_tokens={min_new}): once the {grammar} output is complete "
                           "only end-of-sequence may follow, which min_new_tokens forbids; drop "
                           "min_new_tokens (OpenAI: min_tokens) and let the grammar set the "
                           "length")  # fmt: skip


def check_parallel_samples(n: Any, *, limit: int = MAX_PARALLEL_SAMPLES) -> None:
    """``n`` (parallel samples of one prompt) must be at most ``limit``; SGLang queues ``n``
    copies of the request, so an unbounded ``n`` holds the scheduler for everyone."""
    if _is_int(n) and n > limit:
        raise RequestError("n", f"asks for {n} samples of one prompt; at most {limit} are "
                           "allowed per request (send more requests for more samples)")  # fmt: skip


def batch_prompts(text: Any, input_ids: Any, empty_text_ids: Sequence[int] = ()
                  ) -> list[tuple[str, Sequence[Any] | None]]:  # fmt: skip
    """The prompts of a batched request as ``(field, ids)``. ``ids`` is None for a non-empty
    text (only the tokenizer knows its ids) and ``empty_text_ids`` (what the tokenizer makes of
    ``""``: nothing, or a BOS token) for an empty one."""
    out: list[tuple[str, Sequence[Any] | None]] = []
    empty = list(empty_text_ids)
    if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
        out += [(f"input_ids[{i}]", ids) for i, ids in enumerate(input_ids)]
    elif isinstance(input_ids, list):
        out.append(("input_ids", input_ids))
    if isinstance(text, list):
        out += [(f"text[{i}]", empty if t == "" else None) for i, t in enumerate(text)]
    elif text == "":
        out.append(("text", empty))
    return out


def check_batch(text: Any, input_ids: Any, vocab_size: int,
                empty_text_ids: Sequence[int] = ()) -> None:  # fmt: skip
    """Check every prompt of a batch before any of them is sent to the scheduler (SGLang
    tokenizes and dispatches batch items one by one, so a bad item found later would leave
    the earlier ones started)."""
    for field, ids in batch_prompts(text, input_ids, empty_text_ids):
        check_prompt_ids(ids, vocab_size, field=field)


def check_batch_items(sampling_params: Sequence[Any], top_logprobs_nums: Sequence[Any],
                      vocab_size: int) -> None:  # fmt: skip
    """The per-item checks of a batch (``check_sampling_params``, ``check_top_logprobs_num``)
    for every item before any is dispatched, the first bad one named by its index:
    ``sampling_params[2]: top_k: ...``. ``sampling_params[i]``: item i's dict;
    ``top_logprobs_nums[i]``: its ``top_logprobs_num``, or None where it asks for no logprobs.
    """
    for i, params in enumerate(sampling_params):
        try:
            check_sampling_params(params, vocab_size)
        except RequestError as exc:
            raise RequestError(f"sampling_params[{i}]", str(exc)) from exc
    for i, k in enumerate(top_logprobs_nums):
        check_top_logprobs_num(k, vocab_size, field=f"top_logprobs_num[{i}]")


def check_input_embeds(model_dtype: Any) -> None:
    """``input_embeds`` reach the model as bfloat16 (SGLang 0.5.23 casts them), which only a
    bfloat16 model can take; ``model_dtype`` is the served dtype (a torch dtype or its name)."""
    name = str(model_dtype).removeprefix("torch.")
    if name != "bfloat16":
        raise RequestError("input_embeds",
                           f"this server runs its model in {name}, and SGLang 0.5.23 feeds "
                           "input_embeds to it as bfloat16, which its forward cannot mix: start "
                           "the server with --dtype bfloat16 to send input_embeds, or send "
                           "input_ids")


def check_expert_recording(recorder_mode: Any) -> None:
    """Expert-distribution recording (``/start_expert_distribution_record``, stop, dump) needs
    a recorder chosen at start-up; without one SGLang's scheduler raises and exits."""
    if recorder_mode is None:
        raise RequestError("expert_distribution_record",
                           "recording is off on this server: start it with "
                           "--expert-distribution-recorder-mode (stat, stat_approx, per_pass or "
                           "per_token) to record which experts an MoE model routes to")


def check_memory_occupation(has_accelerator: bool) -> None:
    """``/release_memory_occupation`` and ``/resume_memory_occupation`` hand device memory back
    and take it again (torch_memory_saver, for RL weight syncs on a GPU); without an
    accelerator SGLang's scheduler synchronizes a CUDA device that is not there and exits."""
    if not has_accelerator:
        raise RequestError("memory_occupation",
                           "releasing and resuming memory occupation needs a GPU "
                           "(torch_memory_saver hands device memory back); this server has none")
