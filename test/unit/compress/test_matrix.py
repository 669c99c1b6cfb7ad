"""Every compressor x {alone, composed with a quantizer / after a dropper, per-layer budgets}
on a tiny random Llama: compress every layer, attend over it, grow it, check every invariant."""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.compress import (
    CompressedLayerCache,
    TokenDropper,
    attend,
    available_compressors,
    build_compressor,
)

# (name, kwargs ordered easy -> hard), kvpress-style
BASE = {
    "full": [""],
    "streaming": ["sink=4,window=60", "sink=0,window=8"],
    "snapkv": ["ratio=0.5", "ratio=0.1,window=4,pool=3,shared=true"],
    "h2o": ["ratio=0.5", "ratio=0.1,window=4,sink=2"],
    "knorm": ["ratio=0.5", "ratio=0.1,window=0,sink=0"],
    "kivi": ["bits=4", "bits=2,group=16,residual=0"],
    "turbo": ["bits=4", "bits=2,residual=0"],
}


def _variants() -> list[str]:
    out = []
    for name, kwargs in BASE.items():
        for kw in kwargs:
            spec = f"{name}:{kw}" if kw else name
            out.append(spec)
            if name in ("snapkv", "h2o", "knorm"):
                out.append(f"pyramid({spec}):beta=4")
                out.append(f"pyramid({spec}):beta=4+kivi:bits=4,group=16")
            if name in ("streaming", "snapkv", "h2o", "knorm"):
                out.append(f"{spec}+kivi:bits=2,group=16,residual=8")
                out.append(f"{spec}+turbo:bits=4,residual=8")
    return out


VARIANTS = _variants()


def test_matrix_covers_every_registered_compressor() -> None:
    names = {v.split(":")[0].split("(")[0].split("+")[0] for v in VARIANTS}
    assert names == set(available_compressors())


@pytest.mark.parametrize("spec", VARIANTS)
def test_compress_attend_grow(tiny_kv, spec: str) -> None:
    comp = build_compressor(spec)
    assert build_compressor(comp.spec) == comp
    h_q = tiny_kv.num_q_heads
    d = tiny_kv.keys[0].shape[2]
    t = tiny_kv.num_tokens
    for layer in range(tiny_kv.num_layers):
        k, v = tiny_kv.keys[layer], tiny_kv.values[layer]
        c = comp.compress(layer, k, v, tiny_kv.obs(layer))
        assert c.num_tokens == t and 0 < c.num_kept <= t
        assert c.nbytes <= c.full_nbytes() + c.num_heads * c.num_kept * 4
        kk, vv = c.dequantize()
        assert kk.shape == (k.shape[0], c.num_kept, d) and kk.dtype == k.dtype
        pos = c.positions
        assert pos.dtype == torch.int64 and bool((pos.diff(dim=1) > 0).all()) and int(pos.max()) < t
        # attention over the compressed KV is finite and close in spirit: same shapes/dtype
        q = tiny_kv.queries[layer][:, -2:]
        qpos = torch.arange(t - 2, t)
        out = attend(q, qpos, kk, vv, pos, d**-0.5)
        assert out.shape == (h_q, 2, d) and bool(torch.isfinite(out).all())
        # decode-time growth: 40 committed tokens in uneven chunks
        cache = CompressedLayerCache(comp, layer, c, num_layers=tiny_kv.num_layers, fold_every=16, obs_window=8)
        start = 0
        for n in (1, 7, 3, 16, 13):
            sl = slice(start, start + n)
            cache.append(tiny_kv.next_keys[layer][:, sl], tiny_kv.next_values[layer][:, sl],
                         torch.arange(t + start, t + start + n), tiny_kv.next_queries[layer][:, sl])
            cache.check_integrity()
            start += n
        assert cache.num_tokens == t + 40
        vk, vv2, vpos = cache.view()
        assert vk.shape[1] == vpos.shape[1] == cache.compressed.num_kept + cache.num_pending
        assert bool((vpos[:, -cache.num_pending:] >= t).all()) if cache.num_pending else True
        if isinstance(comp, TokenDropper) and comp.name != "streaming":
            assert cache.compressed.num_kept <= comp.budget(layer, t + 40, tiny_kv.obs(layer))
        full_out = cache.attend(tiny_kv.next_queries[layer][:, -1:], torch.tensor([t + 39]), d**-0.5)
        assert bool(torch.isfinite(full_out).all())
