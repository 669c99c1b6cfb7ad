"""The one token selection every scoring dropper shares: sinks + recent window + top-k.

Scorers only produce scores; which tokens survive is decided here, identically for all of them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def keep_count(ratio: float, num_tokens: int) -> int:
    """Tokens kept per head for a kept fraction ``ratio`` of ``num_tokens`` (at least 1)."""
    if num_tokens == 0:
        return 0
    return min(num_tokens, max(1, math.floor(ratio * num_tokens + 0.5)))


def select_tokens(scores: Tensor, keep: int, sink: int, window: int, shared: bool) -> Tensor:
    """Indices of the kept tokens, per head, sorted ascending.

    scores: [H_kv, T] float, higher = more important. Candidates are in position order.
    keep: tokens kept per head (same for every head: the result is rectangular).
    sink: the first ``sink`` candidates are always kept; window: the last ``window`` likewise.
        When keep < sink + window, sinks are kept first, then the most recent of the window.
    shared: one token set for all heads (scores averaged over heads) instead of per head.
    Returns [H_kv, keep] int64.
    """
    h, t = scores.shape
    keep = min(keep, t)
    if keep == t:
        return torch.arange(t, device=scores.device).expand(h, -1).contiguous()
    if shared:
        scores = scores.float().mean(dim=0, keepdim=True)
    ranked = scores.float().clone()
    forced_sink = min(sink, keep, t)
    forced_window = min(window, keep - forced_sink, t - forced_sink)
    # Forced tokens outrank every scored one; among forced ones sinks first, then newest first.
    top = torch.finfo(torch.float32).max
    if forced_window > 0:
        ranked[:, t - forced_window :] = top / 4
    if forced_sink > 0:
        ranked[:, :forced_sink] = top / 2
    idx = torch.topk(ranked, keep, dim=-1, sorted=False).indices
    idx = torch.sort(idx, dim=-1).values
    return idx.expand(h, -1).contiguous() if shared else idx
