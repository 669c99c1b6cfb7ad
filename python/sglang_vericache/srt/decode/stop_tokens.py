"""The token ids that finish a request, as SGLang's finish check reads them.

``Req._check_token_based_finish`` (sglang 0.5.23 ``managers/schedule_batch.py``) ends a request
at a token in its ``stop_token_ids``, its ``eos_token_ids``, the tokenizer's ``eos_token_id`` or
``additional_stop_token_ids``, unless ``ignore_eos``. A verify commits nothing after such a token
(``verify/accept.stop_at_first_stop_token``): plain decoding would have stopped there.
"""

from __future__ import annotations

from typing import Any

NONE: frozenset[int] = frozenset()


def stop_token_ids(req: Any) -> frozenset[int]:
    """The ids that finish ``req`` (empty with ``ignore_eos``)."""
    params = req.sampling_params
    if params.ignore_eos:
        return NONE
    ids = set(params.stop_token_ids or ()) | set(req.eos_token_ids or ())
    tokenizer = req.tokenizer
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        ids |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
    return frozenset(ids)
