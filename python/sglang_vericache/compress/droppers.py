"""The token droppers: StreamingLLM, SnapKV, H2O, Knorm. Each is a score() plus its budget.

Papers: StreamingLLM arXiv 2309.17453; SnapKV arXiv 2404.14469; H2O arXiv 2306.14048;
Knorm ("A simple and effective L2 norm-based strategy", arXiv 2406.11430).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from sglang_vericache.compress.base import Observation
from sglang_vericache.compress.dropping import TokenDropper, observed_attention, pool_scores
from sglang_vericache.compress.selection import keep_count


def _check_common(obj: TokenDropper, ratio: float | None = None) -> None:
    if ratio is not None and not 0.0 < ratio <= 1.0:
        raise ValueError(f"{obj.name}: ratio must be in (0, 1], got {ratio}")
    if obj.sink < 0 or obj.window < 0:
        raise ValueError(f"{obj.name}: sink and window must be >= 0")


class RatioDropper(TokenDropper):
    """A dropper that keeps a ``ratio`` of the tokens (its subclasses declare ``ratio``)."""

    __slots__ = ()
    ratio: float

    def __post_init__(self) -> None:
        _check_common(self, self.ratio)

    def budget(self, layer_id: int, num_tokens: int, obs: Observation) -> int:
        return keep_count(self.ratio, num_tokens)


@dataclass(frozen=True, slots=True)
class StreamingLLM(TokenDropper):
    """Attention sinks + a recent window; everything in between is dropped. Needs no observation.

    sink: first tokens always kept; window: most recent tokens kept. Budget = sink + window.
    """

    name: ClassVar[str] = "streaming"
    sink: int = 4
    window: int = 252
    shared: bool = True  # position-based: every head keeps the same tokens anyway

    def __post_init__(self) -> None:
        _check_common(self)
        if self.sink + self.window < 1:
            raise ValueError("streaming: sink + window must be >= 1")

    def budget(self, layer_id: int, num_tokens: int, obs: Observation) -> int:
        return min(num_tokens, self.sink + self.window)

    def score(self, layer_id: int, keys: Tensor, values: Tensor, positions: Tensor, obs: Observation) -> Tensor:
        return torch.zeros(positions.shape, dtype=torch.float32)


@dataclass(frozen=True, slots=True)
class SnapKV(RatioDropper):
    """Keeps the tokens the last W queries attend to most (pooled), plus the recent window.

    Needs Observation.queries (the observation window). ratio: kept fraction of tokens;
    window: recent tokens always kept; pool: odd average-pooling kernel over scores.
    """

    name: ClassVar[str] = "snapkv"
    ratio: float = 0.5
    window: int = 32
    pool: int = 7
    sink: int = 0
    shared: bool = False

    def __post_init__(self) -> None:
        RatioDropper.__post_init__(self)  # no zero-arg super() in slots dataclasses
        if self.pool < 1 or self.pool % 2 == 0:
            raise ValueError(f"snapkv: pool must be an odd integer >= 1, got {self.pool}")

    def score(self, layer_id: int, keys: Tensor, values: Tensor, positions: Tensor, obs: Observation) -> Tensor:
        return pool_scores(observed_attention(keys, positions, obs, "snapkv"), self.pool)


@dataclass(frozen=True, slots=True)
class H2O(RatioDropper):
    """Heavy hitters: keeps the tokens with the largest accumulated attention, plus a recent window.

    Uses Observation.attention [H_kv, T] when it covers the candidates (prefill); otherwise (decode
    re-selection) the attention of Observation.queries; fails if neither is given.
    """

    name: ClassVar[str] = "h2o"
    ratio: float = 0.5
    window: int = 32
    sink: int = 0
    shared: bool = False

    def score(self, layer_id: int, keys: Tensor, values: Tensor, positions: Tensor, obs: Observation) -> Tensor:
        if obs.attention is not None and obs.attention.shape == positions.shape:
            return obs.attention.float()
        if obs.queries is None:
            raise ValueError(
                "h2o needs Observation.attention [H_kv, T] (accumulated attention) or "
                "Observation.queries; none given"
            )
        return observed_attention(keys, positions, obs, "h2o")


@dataclass(frozen=True, slots=True)
class Knorm(RatioDropper):
    """Keeps the keys with the smallest L2 norm (low-norm keys draw attention). Needs no observation."""

    name: ClassVar[str] = "knorm"
    ratio: float = 0.5
    window: int = 32
    sink: int = 4
    shared: bool = False

    def score(self, layer_id: int, keys: Tensor, values: Tensor, positions: Tensor, obs: Observation) -> Tensor:
        return -keys.float().norm(dim=-1)
