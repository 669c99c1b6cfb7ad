"""Which rows VeriCache drafts, and which requests make a whole step plain.

A row is drafted when its next tokens depend only on the full-KV logits' argmax: then drafting
from compressed KV and committing the verify's argmax is exactly greedy decoding. Every other
row of a step still gets one exact token from SGLang's sampler in the same step
(``srt/row_sampling.py``): sampling, penalties, logit processing and grammars need the sampler's
own logits pipeline, and some of their state (penalty counts, the grammar matcher) advances one
token per step in SGLang 0.5.23. Logprobs are not a reason: the verify computes full-KV logits
at every committed position and they are served from there.
"""

from __future__ import annotations

from typing import Any


def plain_reason(req: Any) -> str | None:
    """Why ``req``'s rows cannot be drafted greedily (None: they can)."""
    sp = req.sampling_params
    if sp.top_k != 1:
        return "sampling (temperature > 0)"
    if sp.frequency_penalty or sp.presence_penalty or sp.repetition_penalty != 1.0:
        return "penalties"
    if sp.min_new_tokens or sp.logit_bias or getattr(req, "custom_logit_processor", None):
        return "logit processing"
    if getattr(req, "grammar", None) is not None:
        return "constrained decoding"
    return None


def whole_step_reason(req: Any) -> str | None:
    """Why ``req`` needs the whole step to be a plain decode forward (None: it does not).

    Hidden states and sampling masks are returned per forward position; SGLang's spec result
    path reads them in the verify layout only for its own workers, so a batch holding such a
    request decodes one token per row with SGLang's forward (same tokens, no drafting).
    """
    if getattr(req, "return_hidden_states", False):
        return "hidden states requested"
    if getattr(req, "return_sampling_mask", False):
        return "sampling mask requested"
    return None
