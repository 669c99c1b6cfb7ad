"""``process_logits`` returns the vector SGLang's own sampler draws from.

The reference is SGLang 0.5.23's real ``Sampler.forward`` (torch backend) on a real
``SamplingBatchInfo`` built from real, normalised ``SamplingParams``; the test records the
weights handed to its final draw. Skipped where sglang is not installed (these tests import it,
the package code never does).
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from sglang_vericache.verify.sampling_probs import TOP_K_ALL, RowSampling, process_logits

VOCAB = 64


def _sampling(temps, top_ps, top_ks, min_ps) -> RowSampling:
    ks = torch.tensor(top_ks, dtype=torch.int32)
    return RowSampling.of(torch.tensor(temps), torch.tensor(top_ps), ks, torch.tensor(min_ps))


def test_top_p_boundary_and_filters_by_hand() -> None:
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]] * 4)
    top_ks = [TOP_K_ALL, 1, TOP_K_ALL, 2]
    sampling = _sampling([1.0] * 4, [0.5, 1.0, 0.4, 1.0], top_ks, [0.0, 0.0, 0.0, 0.7])
    probs = process_logits(logits, sampling)
    # top_p 0.5: exclusive mass of the second token is 0.5, not > 0.5: kept (SGLang's rule).
    assert probs[0].tolist() == pytest.approx([0.625, 0.375, 0.0])
    assert probs[1].tolist() == [1.0, 0.0, 0.0]  # top_k 1 in a sampled batch: rank 0 only
    assert probs[2].tolist() == pytest.approx([1.0, 0.0, 0.0])  # 0.5 already exceeds 0.4
    assert probs[3].tolist() == pytest.approx([1.0, 0.0, 0.0])  # min_p 0.7: 0.3 < 0.35


def test_all_greedy_is_argmax_onehot_and_repeat_select() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 3.0, 1.0]])
    s = _sampling([1.0, 1.0], [1.0, 1.0], [1, 1], [0.0, 0.0])
    assert s.all_greedy
    assert process_logits(logits, s).tolist() == [[0, 1, 0], [1, 0, 0]]  # ties: first index
    r = _sampling([0.5, 2.0], [0.9, 1.0], [5, TOP_K_ALL], [0.0, 0.1]).repeat(3)
    assert r.temperatures.tolist() == [0.5] * 3 + [2.0] * 3 and r.need_min_p and r.need_top_p
    assert r.select(torch.tensor([4])).top_ks.tolist() == [TOP_K_ALL]
    with pytest.raises(ValueError):
        process_logits(torch.zeros(3, 4), s)


# ---- against SGLang's sampler -------------------------------------------------------------

sampler_mod = pytest.importorskip("sglang.srt.layers.sampler")
sbi_mod = pytest.importorskip("sglang.srt.sampling.sampling_batch_info")
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.sampling.sampling_params import TOP_K_ALL as SGL_TOP_K_ALL
from sglang.srt.sampling.sampling_params import SamplingParams

ns = types.SimpleNamespace


class _Batch(types.SimpleNamespace):
    """A ScheduleBatch stand-in (the penalizer orchestrator keeps a weakref to it)."""


@pytest.fixture
def sglang_sampler(monkeypatch):
    """SGLang's Sampler with the torch backend and a recorder on its final draw."""
    exec_ = ns(deterministic=ns(enable_deterministic_inference=False, rl_on_policy_target=None),
               features=ns(enable_custom_logit_processor=False, enable_watermark=False),
               kernel=ns(sampling_backend="pytorch"))  # fmt: skip
    monkeypatch.setattr(sbi_mod, "get_exec", lambda: exec_)
    monkeypatch.setattr(sampler_mod, "get_exec", lambda: exec_)
    seen: dict[str, torch.Tensor] = {}
    filtered = sampler_mod.top_k_top_p_min_p_sampling_from_probs_torch
    simple = sampler_mod.sampling_from_probs_torch

    def record_filtered(probs, *args, **kwargs):
        # The full-sort variant returns the filtered weights and their token ids; then the
        # call exactly as SGLang made it (head-only topk when max_top_k allows) draws.
        _, weights, ids, _ = filtered(
            probs.clone(), *args, **{**kwargs, "return_filtered_probs": True}
        )
        seen["weights"] = torch.zeros_like(probs).scatter_(1, ids.long(), weights)
        return filtered(probs, *args, **kwargs)

    def record_simple(probs, *args, **kwargs):
        seen["weights"] = probs.clone()
        return simple(probs, *args, **kwargs)

    monkeypatch.setattr(sampler_mod, "top_k_top_p_min_p_sampling_from_probs_torch", record_filtered)
    monkeypatch.setattr(sampler_mod, "sampling_from_probs_torch", record_simple)
    sampler = sampler_mod.Sampler.__new__(sampler_mod.Sampler)
    torch.nn.Module.__init__(sampler)
    sampler.rl_on_policy_target, sampler.enable_deterministic = None, False
    sampler.use_log_softmax_logprob, sampler.use_ascend_backend = False, False

    def run(params: list[dict], logits: torch.Tensor):
        reqs = []
        for kw in params:
            sp = SamplingParams(**kw)
            sp.normalize(None)
            sp.verify(VOCAB)
            reqs.append(ns(sampling_params=sp, custom_logit_processor=None,
                           return_sampling_mask=False, sampling_logprobs_mode=None))  # fmt: skip
        info = sbi_mod.SamplingBatchInfo.from_schedule_batch(_Batch(reqs=reqs, device="cpu"), VOCAB)
        seen.clear()
        out = LogitsProcessorOutput(next_token_logits=logits.clone())
        tokens = sampler.forward(
            out, info, False, [], [], torch.zeros(len(reqs), dtype=torch.int64)
        )
        if info.is_all_greedy:
            weights = torch.nn.functional.one_hot(tokens.long(), VOCAB).to(logits.dtype)
        else:
            weights = seen["weights"]
        return info, weights / weights.sum(dim=-1, keepdim=True), tokens

    return run


BATCHES = {
    "all_greedy": [{"temperature": 0.0}, {"temperature": 0.0}, {"top_k": 1}],
    "plain_softmax": [{"temperature": 0.3}, {"temperature": 1.0}],
    "mixed": [
        {"temperature": 0.3, "top_p": 0.9},
        {"temperature": 0.0},  # a greedy row in a sampled batch: sort path, top_k = 1
        {"temperature": 1.0, "min_p": 0.1, "top_k": 5},
        {"temperature": 1.0},  # an unfiltered row in a filtered batch
        {"temperature": 0.7, "top_p": 0.5, "top_k": 20},
    ],
    "finite_top_k": [{"top_k": 3}, {"temperature": 0.3, "top_k": 10}],
    "min_p_only": [{"min_p": 0.2}, {"temperature": 0.3, "min_p": 0.05}],
    "top_p_only": [{"top_p": 0.95, "temperature": 0.3}, {"top_p": 0.2}],
}


def test_top_k_all_matches_sglang() -> None:
    assert TOP_K_ALL == SGL_TOP_K_ALL


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_process_logits_matches_sglang_sampler(sglang_sampler, batch: str, seed: int) -> None:
    params = BATCHES[batch]
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(params), VOCAB, generator=gen) * 3.0
    info, expected, tokens = sglang_sampler(params, logits)
    ours = RowSampling.from_sampling_info(info)
    derived = RowSampling.of(info.temperatures, info.top_ps, info.top_ks, info.min_ps)
    for field in ("all_greedy", "need_top_k", "need_top_p", "need_min_p", "max_top_k", "seeded"):
        assert getattr(ours, field) == getattr(derived, field), field
    assert torch.equal(derived.temperatures, ours.temperatures)
    probs = process_logits(logits, ours)
    assert torch.equal(probs, expected), (probs - expected).abs().max()
    # SGLang's own draw lies inside the support we compute.
    assert bool((probs.gather(1, tokens.long().view(-1, 1)) > 0).all())
