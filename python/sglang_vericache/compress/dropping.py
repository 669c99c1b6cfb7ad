"""Token dropping: the shared TokenDropper machinery (compress, decode-time re-selection).

A dropper answers two questions: how many tokens a layer keeps (``budget``) and how important each
candidate is (``score``); ``selection.select_tokens`` decides the rest. Kept tokens stay in full
precision with their original positions.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
import torch.nn.functional as F
from torch import Tensor

from sglang_vericache.compress.base import INDEX_DTYPE, CompressedKV, Compressor, Observation, check_kv
from sglang_vericache.compress.selection import select_tokens


class TokenDropper(Compressor):
    """Base of every token-dropping compressor.

    Subclasses are frozen dataclasses with (at least) ``sink``, ``window`` and ``shared`` fields and
    implement ``budget`` and ``score``. ``compress`` keeps ``budget(layer, T)`` tokens per head;
    ``extend`` re-selects over the kept tokens plus the new ones with the budget of the grown
    sequence, so a long generation stays within ``budget`` (+ the caller's recent window).
    """

    sink: int
    window: int
    shared: bool

    @abstractmethod
    def budget(self, layer_id: int, num_tokens: int, obs: Observation) -> int:
        """Tokens kept per head for a layer covering ``num_tokens`` tokens."""

    @abstractmethod
    def score(self, layer_id: int, keys: Tensor, values: Tensor, positions: Tensor, obs: Observation) -> Tensor:
        """Importance of each candidate, higher = keep.

        keys, values: [H_kv, C, D]; positions: [H_kv, C] int64 original positions (sorted per head).
        Returns [H_kv, C] float32.
        """

    def select(self, layer_id: int, keys: Tensor, values: Tensor, positions: Tensor,
               num_tokens: int, obs: Observation) -> Tensor:
        """[H_kv, k] int64 indices (into the candidate axis) of the kept candidates."""
        keep = min(keys.shape[1], self.budget(layer_id, num_tokens, obs))
        if keep == keys.shape[1]:
            return torch.arange(keep).expand(keys.shape[0], -1)
        scores = self.score(layer_id, keys, values, positions, obs)
        return select_tokens(scores, keep, self.sink, self.window, self.shared)

    def compress(self, layer_id: int, keys: Tensor, values: Tensor, obs: Observation) -> CompressedKV:
        check_kv(keys, values)
        h, t, _ = keys.shape
        positions = torch.arange(t, device=keys.device).expand(h, -1)
        idx = self.select(layer_id, keys, values, positions, t, obs)
        if idx.shape[1] == t:
            return CompressedKV(None, keys, values, None, t)
        return _gather(keys, values, positions, idx, t)

    def extend(self, layer_id: int, ckv: CompressedKV, keys: Tensor, values: Tensor,
               positions: Tensor, obs: Observation) -> CompressedKV:
        check_kv(keys, values)
        if ckv.block is not None:
            raise ValueError(f"{self.name}: cannot extend a quantized CompressedKV")
        h = keys.shape[0]
        cand_k = torch.cat([ckv.residual_keys, keys], dim=1)
        cand_v = torch.cat([ckv.residual_values, values], dim=1)
        cand_pos = torch.cat([ckv.positions, positions.to(torch.int64).expand(h, -1)], dim=1)
        num_tokens = int(positions.max().item()) + 1
        idx = self.select(layer_id, cand_k, cand_v, cand_pos, num_tokens, obs)
        if idx.shape[1] == num_tokens:
            return CompressedKV(None, cand_k, cand_v, None, num_tokens)
        return _gather(cand_k, cand_v, cand_pos, idx, num_tokens)


def _gather(keys: Tensor, values: Tensor, positions: Tensor, idx: Tensor, num_tokens: int) -> CompressedKV:
    d = keys.shape[2]
    gidx = idx.unsqueeze(-1).expand(-1, -1, d)
    return CompressedKV(
        None,
        keys.gather(1, gidx),
        values.gather(1, gidx),
        positions.gather(1, idx).to(INDEX_DTYPE),
        num_tokens,
    )


def observed_attention(keys: Tensor, positions: Tensor, obs: Observation, who: str) -> Tensor:
    """Attention the observed queries pay to each key, causally masked by original positions.

    keys: [H_kv, C, D] post-RoPE; positions: [H_kv, C] int64. Softmax over the C keys per query,
    summed over the W queries and averaged over the query heads of each GQA group.
    Returns [H_kv, C] float32.
    """
    if obs.queries is None:
        raise ValueError(f"{who} needs Observation.queries (the last-W post-RoPE queries); none given")
    q = obs.queries.float()
    h_q, w, d = q.shape
    h_kv, c, _ = keys.shape
    if h_q % h_kv:
        raise ValueError(f"{who}: H_q={h_q} is not a multiple of H_kv={h_kv}")
    g = h_q // h_kv
    logits = torch.einsum("kgwd,kcd->kgwc", q.view(h_kv, g, w, d), keys.float()) * d**-0.5
    visible = positions[:, None, None, :] <= obs.query_positions.to(positions.device)[None, None, :, None]
    logits = logits.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a query that sees no key adds nothing
    return probs.sum(dim=2).mean(dim=1)


def pool_scores(scores: Tensor, kernel: int) -> Tensor:
    """Average-pools [H, C] scores along C with an odd ``kernel`` (SnapKV clustering)."""
    if kernel <= 1 or scores.shape[1] == 0:
        return scores
    return F.avg_pool1d(scores.unsqueeze(1), kernel, stride=1, padding=kernel // 2,
                        count_include_pad=False).squeeze(1)
