"""Property tests: top-scored tokens kept, sinks/window kept, error bounds, exact identity."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_vericache.compress import H2O, Knorm, Observation, SnapKV, build_compressor
from sglang_vericache.compress.selection import keep_count, select_tokens
from sglang_vericache.compress.turbo import normal_codebook


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_select_keeps_top_scored_and_forced(seed: int, shared: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    h, t = 3, 97
    scores = torch.randn(h, t, generator=gen)
    keep, sink, window = 30, 3, 7
    idx = select_tokens(scores, keep, sink, window, shared)
    assert idx.shape == (h, keep)
    assert bool((idx.diff(dim=1) > 0).all())
    eff = scores.mean(0, keepdim=True).expand(h, -1) if shared else scores
    for head in range(h):
        kept = set(idx[head].tolist())
        forced = set(range(sink)) | set(range(t - window, t))
        assert forced <= kept
        free_kept = [eff[head, i] for i in kept - forced]
        dropped = [eff[head, i] for i in set(range(t)) - kept]
        assert min(free_kept) >= max(dropped)
    if shared:
        assert bool((idx == idx[0]).all())


def test_select_budget_smaller_than_forced() -> None:
    idx = select_tokens(torch.zeros(1, 50), 5, 3, 10, False)
    assert idx[0].tolist() == [0, 1, 2, 48, 49]  # sinks first, then the newest


@pytest.mark.parametrize("cls", [SnapKV, H2O, Knorm])
def test_droppers_keep_their_top_scores(tiny_kv, cls) -> None:
    comp = cls(ratio=0.3, window=8, sink=2)
    for layer in range(tiny_kv.num_layers):
        k, v, obs = tiny_kv.keys[layer], tiny_kv.values[layer], tiny_kv.obs(layer)
        t = k.shape[1]
        c = comp.compress(layer, k, v, obs)
        assert c.num_kept == keep_count(0.3, t)
        scores = comp.score(layer, k, v, torch.arange(t).expand(k.shape[0], -1), obs)
        for head in range(k.shape[0]):
            kept = set(c.positions[head].tolist())
            forced = {0, 1} | set(range(t - 8, t))
            assert forced <= kept
            assert min(scores[head, i] for i in kept - forced) >= max(
                scores[head, i] for i in set(range(t)) - kept)
        # kept tokens are the original tokens at their original positions
        kk, vv = c.dequantize()
        gidx = c.positions.unsqueeze(-1).expand(-1, -1, k.shape[2])
        assert torch.equal(kk, k.gather(1, gidx)) and torch.equal(vv, v.gather(1, gidx))


def test_streaming_keeps_sinks_and_window(tiny_kv) -> None:
    c = build_compressor("streaming:sink=4,window=20").compress(0, tiny_kv.keys[0], tiny_kv.values[0], Observation())
    t = tiny_kv.num_tokens
    expected = list(range(4)) + list(range(t - 20, t))
    assert all(c.positions[h].tolist() == expected for h in range(c.num_heads))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kivi_error_within_half_a_step(tiny_kv, bits: int) -> None:
    g = 16
    for layer in range(tiny_kv.num_layers):
        k, v = tiny_kv.keys[layer], tiny_kv.values[layer]
        c = build_compressor(f"kivi:bits={bits},group={g},residual=0").compress(layer, k, v, Observation())
        n = c.block.num_tokens
        kk, vv = c.dequantize()
        h, _, d = k.shape
        k_err = (kk[:, :n] - k[:, :n]).abs().view(h, n // g, g, d)
        k_bound = c.block.key_scale.unsqueeze(2) / 2
        assert bool((k_err <= k_bound * (1 + 1e-5) + 1e-6).all())
        v_err = (vv[:, :n] - v[:, :n]).abs()
        assert bool((v_err <= c.block.value_scale / 2 * (1 + 1e-5) + 1e-6).all())
        assert torch.equal(kk[:, n:], k[:, n:])  # the tail that fills no group stays exact
        levels = (1 << bits) - 1  # the scale is the range over the levels
        span = k[:, :n].reshape(h, n // g, g, d).amax(2) - k[:, :n].reshape(h, n // g, g, d).amin(2)
        assert torch.allclose(c.block.key_scale, (span / levels).clamp_min(1e-8), rtol=1e-6)


@pytest.mark.parametrize("bits, distortion", [(2, 0.1175), (4, 0.009497), (8, 4e-5)])
def test_turbo_error_near_lloyd_max(bits: int, distortion: float) -> None:
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(4, 512, 64, generator=gen)
    x[..., 3] *= 20  # an outlier channel: the rotation spreads it
    c = build_compressor(f"turbo:bits={bits},residual=0").compress(0, x, x, Observation())
    kk, _ = c.dequantize()
    rel = ((kk - x).pow(2).sum(-1) / x.pow(2).sum(-1)).mean().item()
    assert rel <= 1.3 * distortion, rel
    cents, _ = normal_codebook(bits)
    assert torch.allclose(cents, -cents.flip(0), atol=1e-6)  # symmetric codebook


SPEC_IDENTITY = ["full", "snapkv:ratio=1.0", "h2o:ratio=1.0", "knorm:ratio=1.0", "kivi:bits=16",
                 "pyramid(snapkv:ratio=1.0)", "snapkv:ratio=1.0+kivi:bits=16",
                 "streaming:sink=4,window=1000"]


@pytest.mark.parametrize("spec", SPEC_IDENTITY)
def test_ratio_one_and_16_bits_reproduce_full_kv(tiny_kv, spec: str) -> None:
    comp = build_compressor(spec)
    for layer in range(tiny_kv.num_layers):
        k, v = tiny_kv.keys[layer], tiny_kv.values[layer]
        c = comp.compress(layer, k, v, tiny_kv.obs(layer))
        kk, vv = c.dequantize()
        assert torch.equal(kk, k) and torch.equal(vv, v)
        assert torch.equal(c.positions, torch.arange(k.shape[1]).expand(k.shape[0], -1))
        assert c.nbytes == c.full_nbytes()


def test_pyramid_budgets_average_to_ratio(tiny_kv) -> None:
    from sglang_vericache.compress.pyramid import pyramid_ratios

    for ratio in (0.1, 0.25, 0.5, 0.8):
        rs = pyramid_ratios(ratio, 30, 20.0)
        assert math.isclose(sum(rs) / 30, ratio, rel_tol=1e-9)
        assert all(0 < r <= 1 for r in rs) and rs == sorted(rs, reverse=True)
    comp = build_compressor("pyramid(snapkv:ratio=0.25):beta=4")
    kept = [comp.compress(l, tiny_kv.keys[l], tiny_kv.values[l], tiny_kv.obs(l)).num_kept
            for l in range(tiny_kv.num_layers)]
    assert kept[0] > kept[1] > kept[2]
    assert abs(sum(kept) - 3 * keep_count(0.25, tiny_kv.num_tokens)) <= 3


def test_observation_requirements_fail_clearly(tiny_kv) -> None:
    k, v = tiny_kv.keys[0], tiny_kv.values[0]
    with pytest.raises(ValueError, match="snapkv needs Observation.queries"):
        build_compressor("snapkv").compress(0, k, v, Observation())
    with pytest.raises(ValueError, match="h2o needs Observation.attention"):
        build_compressor("h2o").compress(0, k, v, Observation())
    with pytest.raises(ValueError, match="pyramid needs Observation.num_layers"):
        build_compressor("pyramid(knorm)").compress(0, k, v, Observation())
    with pytest.raises(ValueError, match="query_positions"):
        Observation(queries=tiny_kv.queries[0])
    assert build_compressor("knorm").compress(0, k, v, Observation()).num_kept == 100
