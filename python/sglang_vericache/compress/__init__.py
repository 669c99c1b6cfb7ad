"""KV compressors: token dropping and quantization behind one interface (pure torch, no sglang).

Entry points:
- ``build_compressor(spec) -> Compressor`` parses ``name:k=v,...`` specs, ``+`` composes
  (``snapkv:ratio=0.5+kivi:bits=4``), ``pyramid(<dropper>):beta=..`` sets per-layer budgets;
  ``available_compressors()`` lists the names; bad specs raise ``CompressorSpecError``.
- ``Compressor.compress(layer_id, keys[H_kv,T,D], values, Observation) -> CompressedKV``.
- ``CompressedLayerCache`` grows a layer's compressed KV during decoding.
- ``attend(q, q_positions, keys, values, key_positions, scale)``: reference attention.
"""

from __future__ import annotations

from sglang_vericache.compress.attend import attend
from sglang_vericache.compress.base import CompressedKV, Compressor, Observation, QuantizedBlock
from sglang_vericache.compress.compose import Composed, Full
from sglang_vericache.compress.droppers import H2O, Knorm, SnapKV, StreamingLLM
from sglang_vericache.compress.dropping import TokenDropper
from sglang_vericache.compress.kivi import Kivi, KiviBlock
from sglang_vericache.compress.layer_cache import CompressedLayerCache
from sglang_vericache.compress.packing import pack_bits, unpack_bits
from sglang_vericache.compress.pyramid import Pyramid
from sglang_vericache.compress.quantizing import Quantizer
from sglang_vericache.compress.spec import (
    CompressorSpecError,
    available_compressors,
    build_compressor,
    describe_keys,
)
from sglang_vericache.compress.turbo import Turbo, TurboBlock

__all__ = [
    "H2O",
    "Composed",
    "CompressedKV",
    "CompressedLayerCache",
    "Compressor",
    "CompressorSpecError",
    "Full",
    "Kivi",
    "KiviBlock",
    "Knorm",
    "Observation",
    "Pyramid",
    "QuantizedBlock",
    "Quantizer",
    "SnapKV",
    "StreamingLLM",
    "TokenDropper",
    "Turbo",
    "TurboBlock",
    "attend",
    "available_compressors",
    "build_compressor",
    "describe_keys",
    "pack_bits",
    "unpack_bits",
]
