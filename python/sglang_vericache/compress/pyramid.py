"""PyramidKV-style per-layer budgets (arXiv 2406.02069) as a wrapper around a ratio dropper.

Spelled ``pyramid(<dropper spec>):beta=20``, e.g. ``pyramid(snapkv:ratio=0.25):beta=20``.
Lower layers keep more tokens, upper layers fewer, linearly; the mean kept fraction over layers
equals the wrapped dropper's ``ratio`` (so the total budget is the same as the flat dropper's).
With the flat ratio r and L layers, layer l keeps r_l = r * (1/beta + (2 - 2/beta) * (L-1-l)/(L-1)),
clipped to (0, 1] with any excess from clipping redistributed over the unclipped layers.
Needs Observation.num_layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from sglang_vericache.compress.base import CompressedKV, Compressor, Observation, format_value
from sglang_vericache.compress.dropping import TokenDropper


def pyramid_ratios(ratio: float, num_layers: int, beta: float) -> list[float]:
    """Per-layer kept fractions in (0, 1]; their mean is ``ratio``."""
    if num_layers == 1:
        return [ratio]
    out = [ratio * (1 / beta + (2 - 2 / beta) * (num_layers - 1 - l) / (num_layers - 1))
           for l in range(num_layers)]
    # Water-filling: what clipping at 1.0 removes goes to the unclipped layers, by their headroom.
    for _ in range(num_layers):
        out = [min(1.0, r) for r in out]
        excess = ratio * num_layers - sum(out)
        room = sum(1.0 - r for r in out)
        if excess < 1e-12 or room < 1e-12:
            break
        out = [r + excess * (1.0 - r) / room for r in out]
    return out


@dataclass(frozen=True, slots=True)
class Pyramid(Compressor):
    """Per-layer budgets around a dropper with a ``ratio`` field (snapkv, h2o, knorm)."""

    name: ClassVar[str] = "pyramid"
    inner: TokenDropper
    beta: float = 20.0

    def __post_init__(self) -> None:
        if not isinstance(self.inner, TokenDropper) or not any(
            f.name == "ratio" for f in dataclasses.fields(self.inner)
        ):
            raise ValueError("pyramid(...) wraps a token dropper with a ratio field (snapkv, h2o, knorm)")
        if self.beta < 1.0:
            raise ValueError(f"pyramid: beta must be >= 1, got {self.beta}")

    @property
    def spec(self) -> str:
        return f"pyramid({self.inner.spec}):beta={format_value(self.beta)}"

    def layer_dropper(self, layer_id: int, obs: Observation) -> TokenDropper:
        """The wrapped dropper with this layer's ratio."""
        if obs.num_layers is None:
            raise ValueError("pyramid needs Observation.num_layers (per-layer budgets); none given")
        if not 0 <= layer_id < obs.num_layers:
            raise ValueError(f"pyramid: layer_id {layer_id} outside [0, {obs.num_layers})")
        ratios = pyramid_ratios(self.inner.ratio, obs.num_layers, self.beta)
        return dataclasses.replace(self.inner, ratio=min(1.0, ratios[layer_id]))

    def compress(self, layer_id: int, keys: Tensor, values: Tensor, obs: Observation) -> CompressedKV:
        return self.layer_dropper(layer_id, obs).compress(layer_id, keys, values, obs)

    def extend(self, layer_id: int, ckv: CompressedKV, keys: Tensor, values: Tensor,
               positions: Tensor, obs: Observation) -> CompressedKV:
        return self.layer_dropper(layer_id, obs).extend(layer_id, ckv, keys, values, positions, obs)
