"""Decode-time growth: chunking does not matter, budgets hold, versions tell appends from folds."""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.compress import CompressedLayerCache, Observation, attend, build_compressor

SPECS = ["full", "streaming:sink=4,window=32", "snapkv:ratio=0.25,window=8", "h2o:ratio=0.25",
         "knorm:ratio=0.25", "kivi:bits=4,group=16,residual=16", "turbo:bits=4,residual=16",
         "snapkv:ratio=0.5+kivi:bits=2,group=16,residual=8", "pyramid(knorm:ratio=0.25):beta=4"]


def _grow(tiny_kv, spec: str, chunks: list[int], layer: int = 1) -> CompressedLayerCache:
    comp = build_compressor(spec)
    t = tiny_kv.num_tokens
    c = comp.compress(layer, tiny_kv.keys[layer], tiny_kv.values[layer], tiny_kv.obs(layer))
    cache = CompressedLayerCache(comp, layer, c, num_layers=tiny_kv.num_layers, fold_every=8, obs_window=8)
    start = 0
    for n in chunks:
        sl = slice(start, start + n)
        version, before = cache.version, cache.view()
        cache.append(tiny_kv.next_keys[layer][:, sl], tiny_kv.next_values[layer][:, sl],
                     torch.arange(t + start, t + start + n), tiny_kv.next_queries[layer][:, sl])
        cache.check_integrity()
        if cache.version == version:  # no fold: the view only grew at its end
            after = cache.view()
            for a, b in zip(before, after):
                assert torch.equal(b[:, : a.shape[1]], a)
        start += n
    return cache


@pytest.mark.parametrize("spec", SPECS)
def test_chunking_does_not_change_the_state(tiny_kv, spec: str) -> None:
    one = _grow(tiny_kv, spec, [1] * 40)
    mixed = _grow(tiny_kv, spec, [5, 11, 2, 22])
    for a, b in zip(one.view(), mixed.view()):
        assert torch.equal(a, b)
    assert one.nbytes == mixed.nbytes and one.version == mixed.version == 5


def test_droppers_stay_within_budget(tiny_kv) -> None:
    cache = _grow(tiny_kv, "snapkv:ratio=0.25,window=8", [40])
    assert cache.compressed.num_kept == round(0.25 * (tiny_kv.num_tokens + 40))
    stream = _grow(tiny_kv, "streaming:sink=4,window=32", [40])
    pos = stream.compressed.positions[0].tolist()
    t = tiny_kv.num_tokens + 40
    assert pos == list(range(4)) + list(range(t - 32, t))


def test_quantizer_quantizes_whole_groups(tiny_kv) -> None:
    cache = _grow(tiny_kv, "kivi:bits=4,group=16,residual=16", [40])
    c = cache.compressed
    assert c.block.num_tokens % 16 == 0
    assert 16 <= c.residual_keys.shape[1] < 32
    assert c.num_kept + cache.num_pending == tiny_kv.num_tokens + 40
    assert c.kept_positions is None  # nothing dropped: no index stored


def test_full_cache_attention_is_exact(tiny_kv) -> None:
    layer, t = 0, tiny_kv.num_tokens
    cache = _grow(tiny_kv, "full", [40], layer)
    keys = torch.cat([tiny_kv.keys[layer], tiny_kv.next_keys[layer]], dim=1)
    values = torch.cat([tiny_kv.values[layer], tiny_kv.next_values[layer]], dim=1)
    q = tiny_kv.next_queries[layer][:, -3:]
    qpos = torch.arange(t + 37, t + 40)
    pos = torch.arange(t + 40).expand(keys.shape[0], -1)
    assert torch.equal(cache.attend(q, qpos, 0.25), attend(q, qpos, keys, values, pos, 0.25))


def test_append_validates(tiny_kv) -> None:
    cache = _grow(tiny_kv, "snapkv:ratio=0.25", [])
    k = tiny_kv.next_keys[0][:, :2]
    with pytest.raises(ValueError, match="positions must increase"):
        cache.append(k, k, torch.tensor([5, 6]))
    t = tiny_kv.num_tokens
    cache.append(k[:, :1], k[:, :1], torch.tensor([t]))  # no queries: fine until a fold needs them
    with pytest.raises(ValueError, match="snapkv needs Observation.queries"):
        fresh = _grow(tiny_kv, "snapkv:ratio=0.25", [])
        fresh._queries = None
        fresh.append(tiny_kv.next_keys[1][:, :8], tiny_kv.next_values[1][:, :8], torch.arange(t, t + 8))
    assert isinstance(cache.observation(), Observation)


def test_recent_window_stays_whole(tiny_kv) -> None:
    layer, t = 1, tiny_kv.num_tokens
    comp = build_compressor("snapkv:ratio=0.25,window=4+kivi:bits=4,group=16,residual=0")
    c = comp.compress(layer, tiny_kv.keys[layer], tiny_kv.values[layer], tiny_kv.obs(layer))
    cache = CompressedLayerCache(comp, layer, c, num_layers=3, fold_every=8, obs_window=8, recent=16)
    for i in range(40):
        cache.append(tiny_kv.next_keys[layer][:, i : i + 1], tiny_kv.next_values[layer][:, i : i + 1],
                     torch.tensor([t + i]), tiny_kv.next_queries[layer][:, i : i + 1])
        cache.check_integrity()
        assert cache.num_pending >= min(i + 1, 16)  # the newest 16 are never thinned or quantized
    _, _, pos = cache.view()
    assert pos[0, -16:].tolist() == list(range(t + 24, t + 40))
    assert cache.version == 3
