"""Penalized greedy rows through a verify: every column penalized as plain decoding would.

A drafted row with repetition / frequency / presence penalties verifies W columns; column j is
the position after j drafts, which plain decoding would penalize after its penalizers learned
j more tokens of the row's feed stream (``srt/hooks/penalties.py``)::

    column 0      SGLang's own accumulation for the row (``sampling_info.acc_*``): what the
                  scheduler's penalizers learned up to the row's last committed token
    column j > 0  the row's ``PenaltyMirror`` after learning F[k .. k+j-1], which are the chain's
                  tokens rows[i, lag .. lag+j-1] (lag 0 overlapped, 1 synchronous)

The mirror (a record field) learns what the scheduler's penalizers learned before it is used,
and must equal SGLang's accumulation at column 0, bit for bit, every step; a row where it does
not (its penalizer rows were made afresh, e.g. after a retraction) verifies no draft that step:
its column 0 alone, penalized by SGLang's own state, is exactly a plain step. Penalties are
applied to the verify logits in place, as plain decoding's sampler applies them before it takes
the argmax and its logprobs. After the commit the hook feeds the scheduler's penalizers every
committed token (``penalty_learned``).
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

import torch
from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties

from sglang_vericache.srt.hooks.penalties import feed_stream
from sglang_vericache.verify.penalty_mirror import PenaltyMirror, PenaltyParams

logger = logging.getLogger(__name__)


def penalty_params(req: Any) -> PenaltyParams:
    sp = req.sampling_params
    return PenaltyParams(float(sp.frequency_penalty or 0.0), float(sp.presence_penalty or 0.0),
                         float(sp.repetition_penalty))  # fmt: skip


def penalize_verify(logits: torch.Tensor, chain_rows: torch.Tensor, draft_lens: torch.Tensor,
                    rows: list[int], reqs: list[Any], sampling_info: Any,
                    mirrors: MutableMapping[str, PenaltyMirror],
                    overlapped: bool) -> None:  # fmt: skip
    """Penalize ``rows``' verify logits in place (module doc).

    logits: [bs * W, V] float32, the verify's; chain_rows: [bs, W] int64, last token + drafts;
    draft_lens: [bs] int32, cut to 0 for a row whose mirror disagrees with SGLang's state.
    mirrors: request id -> its mirror (made here on a row's first penalized verify).
    """
    if not rows:
        return
    bs, width = chain_rows.shape
    view = logits.view(bs, width, -1)
    additive = sampling_info.acc_additive_penalties  # [bs, V] or None
    scaling = sampling_info.acc_scaling_penalties
    lag = 0 if overlapped else 1
    tokens = chain_rows.tolist()
    for i in rows:
        req = reqs[i]
        mirror = mirrors.get(req.rid)
        if mirror is None:
            mirror = mirrors[req.rid] = PenaltyMirror(penalty_params(req), view.shape[-1],
                                                      logits.device)  # fmt: skip
        k = len(req.output_ids)
        mirror.learn(feed_stream(req.output_ids, req.origin_input_ids, overlapped,
                                 mirror.learned, k))  # fmt: skip
        base_add = None if additive is None else additive[i]
        base_scale = None if scaling is None else scaling[i]
        _penalize(view[i, 0], base_add, base_scale)
        if width == 1:
            continue
        if not agrees(mirror, base_add, base_scale):
            draft_lens[i] = 0
            logger.warning("request %s: penalty state differs from SGLang's at %d output tokens; "
                           "it verifies no drafts this step", req.rid, k)
            continue
        scratch = mirror.copy()
        for j in range(1, width):
            scratch.learn([tokens[i][j - 1 + lag]])
            _penalize(view[i, j], scratch.additive(), scratch.scaling())


def agrees(mirror: PenaltyMirror, additive: torch.Tensor | None,
           scaling: torch.Tensor | None) -> bool:  # fmt: skip
    """Whether ``mirror`` holds SGLang's accumulation for its row (None: none accumulated)."""
    mine_add, mine_scale = mirror.additive(), mirror.scaling()
    if additive is None:
        same_add = not bool(mine_add.any())
    else:
        same_add = torch.equal(mine_add, additive)
    if scaling is None:
        same_scale = mine_scale is None
    elif mine_scale is None:
        same_scale = bool((scaling == 1.0).all())
    else:
        same_scale = torch.equal(mine_scale, scaling)
    return same_add and same_scale


def _penalize(logits: torch.Tensor, additive: torch.Tensor | None,
              scaling: torch.Tensor | None) -> None:  # fmt: skip
    """One position's [V] logits, in place, in SGLang's order (additive, then scaling)."""
    if additive is not None:
        logits.add_(additive)
    if scaling is not None:
        apply_scaling_penalties(logits, scaling)
