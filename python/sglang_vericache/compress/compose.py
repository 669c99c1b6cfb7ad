"""Composition (drop, then quantize) and the identity compressor ``full``.

``snapkv:ratio=0.5+kivi:bits=4`` keeps half the tokens and stores them KIVI-int4 packed.
Decode-time growth of a composition: each folded chunk is thinned by the dropper's scores to its
budget for that chunk (``ratio`` of it; streaming keeps it whole), then handed to the quantizer.
Quantized tokens are never re-selected: dropping from a key group would force re-quantization.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from sglang_vericache.compress.base import CompressedKV, Compressor, Observation, check_kv
from sglang_vericache.compress.dropping import TokenDropper
from sglang_vericache.compress.pyramid import Pyramid
from sglang_vericache.compress.quantizing import Quantizer, append_positions
from sglang_vericache.compress.selection import select_tokens


@dataclass(frozen=True, slots=True)
class Full(Compressor):
    """Keeps the full KV unchanged (ratio 1.0): the lossless reference point."""

    name: ClassVar[str] = "full"

    def compress(self, layer_id: int, keys: Tensor, values: Tensor, obs: Observation) -> CompressedKV:
        check_kv(keys, values)
        return CompressedKV(None, keys, values, None, keys.shape[1])

    def extend(self, layer_id: int, ckv: CompressedKV, keys: Tensor, values: Tensor,
               positions: Tensor, obs: Observation) -> CompressedKV:
        check_kv(keys, values)
        num_tokens = int(positions.max().item()) + 1
        kept = append_positions(ckv, positions, keys.shape[0], num_tokens)
        return CompressedKV(
            None,
            torch.cat([ckv.residual_keys, keys], dim=1),
            torch.cat([ckv.residual_values, values], dim=1),
            kept,
            num_tokens,
        )


@dataclass(frozen=True, slots=True)
class Composed(Compressor):
    """A token dropper (or pyramid(...)) followed by a quantizer."""

    name: ClassVar[str] = "+"
    dropper: TokenDropper | Pyramid
    quantizer: Quantizer

    def __post_init__(self) -> None:
        if not isinstance(self.dropper, (TokenDropper, Pyramid)):
            raise ValueError(f"composition: the first stage must drop tokens, got {self.dropper.spec!r}")
        if not isinstance(self.quantizer, Quantizer):
            raise ValueError(f"composition: the second stage must quantize, got {self.quantizer.spec!r}")

    @property
    def spec(self) -> str:
        return f"{self.dropper.spec}+{self.quantizer.spec}"

    def compress(self, layer_id: int, keys: Tensor, values: Tensor, obs: Observation) -> CompressedKV:
        return self.quantizer.compress_kept(self.dropper.compress(layer_id, keys, values, obs))

    def extend(self, layer_id: int, ckv: CompressedKV, keys: Tensor, values: Tensor,
               positions: Tensor, obs: Observation) -> CompressedKV:
        check_kv(keys, values)
        dropper = self.dropper.layer_dropper(layer_id, obs) if isinstance(self.dropper, Pyramid) else self.dropper
        h, n, d = keys.shape
        num_tokens = int(positions.max().item()) + 1
        pos = positions.to(torch.int64).expand(h, -1)
        keep = min(n, dropper.budget(layer_id, n, obs))
        if keep < n:
            scores = dropper.score(layer_id, keys, values, pos, obs)
            idx = select_tokens(scores, keep, 0, 0, dropper.shared)
            gidx = idx.unsqueeze(-1).expand(-1, -1, d)
            keys, values, pos = keys.gather(1, gidx), values.gather(1, gidx), pos.gather(1, idx)
        return self.quantizer.extend_kept(ckv, keys, values, pos, num_tokens)
