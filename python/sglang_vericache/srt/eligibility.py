"""Which requests VeriCache drafts: greedy ones whose tokens depend only on the logits' argmax."""

from __future__ import annotations

from typing import Any


def plain_reason(req: Any) -> str | None:
    """Why ``req`` cannot be drafted greedily (None: it can). Such requests decode plainly."""
    sp = req.sampling_params
    if sp.top_k != 1:
        return "sampling (temperature > 0)"
    if sp.frequency_penalty or sp.presence_penalty or sp.repetition_penalty != 1.0:
        return "penalties"
    if sp.min_new_tokens or sp.logit_bias or getattr(req, "custom_logit_processor", None):
        return "logit processing"
    if getattr(req, "grammar", None) is not None:
        return "constrained decoding"
    if req.return_logprob:
        return "logprobs requested"
    return None
