"""VeriCache for SGLang: lossless decoding from a compressed KV cache.

The model drafts tokens from a compressed (token-dropped and/or quantized) KV
cache while the full KV is fetched from host memory or a remote tier; one
forward over the full KV verifies the draft and commits the accepted tokens.
Greedy output is token-identical to full-KV decoding.

Import rule: only ``sglang_vericache.srt`` imports ``sglang``; only
``sglang_vericache.tier.lmcache`` imports ``lmcache``. Importing this package
is cheap and pulls in neither.
"""

__version__ = "0.1.0"
