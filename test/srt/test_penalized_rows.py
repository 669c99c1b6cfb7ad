"""Penalized greedy rows: the mirror against SGLang's own penalizers, bit for bit; the hook's
per-row feeding; and a verify's columns penalized as plain decoding would penalize each."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.sampling import penaltylib

from sglang_vericache.srt.decode.penalized_rows import agrees, penalize_verify
from sglang_vericache.srt.hooks.penalties import feed_stream, learn_per_row
from sglang_vericache.verify.penalty_mirror import PenaltyMirror, PenaltyParams

V = 64
PENALIZERS = {penaltylib.BatchedFrequencyPenalizer, penaltylib.BatchedMinNewTokensPenalizer,
              penaltylib.BatchedPresencePenalizer, penaltylib.BatchedRepetitionPenalizer}


def _req(rid: str, frequency=0.0, presence=0.0, repetition=1.0) -> SimpleNamespace:
    sp = SimpleNamespace(frequency_penalty=frequency, presence_penalty=presence,
                         repetition_penalty=repetition, min_new_tokens=0, stop_token_ids=None)
    tokenizer = SimpleNamespace(additional_stop_token_ids=None, eos_token_id=2)
    return SimpleNamespace(rid=rid, sampling_params=sp, eos_token_ids={2}, tokenizer=tokenizer,
                           output_ids=[], origin_input_ids=[7, 8, 9])  # fmt: skip


class _Batch:  # the orchestrator holds its batch by weak reference
    def __init__(self, reqs: list) -> None:
        self.reqs, self.device = reqs, "cpu"


def orchestrator(reqs: list) -> tuple[object, object]:
    """SGLang's own orchestrator over a batch of ``reqs`` (and the batch, kept alive)."""
    batch = _Batch(reqs)
    return penaltylib.BatchedPenalizerOrchestrator(V, batch, PENALIZERS), batch


def sglang_rows(orch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What ``SamplingBatchInfo.update_penalties`` accumulates: ([bs, V], [bs, V] or None)."""
    additive = torch.zeros(len(orch.reqs()), V, dtype=torch.float32)
    orch.accumulate_additive_penalties(additive)
    return additive, orch.accumulate_scaling_penalties()


PARAMS = [PenaltyParams(frequency=0.3), PenaltyParams(presence=0.7),
          PenaltyParams(repetition=1.3), PenaltyParams(0.1, 0.2, 0.8), PenaltyParams(-0.4)]


@pytest.mark.parametrize("seed", range(3))
def test_the_mirror_is_sglangs_state_bit_for_bit(seed: int) -> None:
    rng = random.Random(seed)
    reqs = [_req(f"r{i}", p.frequency, p.presence, p.repetition) for i, p in enumerate(PARAMS)]
    reqs.append(_req("none"))  # a row without penalties in a penalized batch
    orch, _batch = orchestrator(reqs)
    mirrors = [PenaltyMirror(PenaltyParams(r.sampling_params.frequency_penalty,
                                           r.sampling_params.presence_penalty,
                                           r.sampling_params.repetition_penalty), V)
               for r in reqs]  # fmt: skip
    for _ in range(40):
        tokens = [rng.randrange(V) for _ in reqs]
        orch.cumulate_output_tokens(torch.tensor(tokens))
        for m, t in zip(mirrors, tokens):
            m.learn([t])
        additive, scaling = sglang_rows(orch)
        for i, m in enumerate(mirrors):
            assert agrees(m, additive[i], scaling[i]), i
            m.check_integrity()


def test_rows_learn_their_own_streams_and_idle_rows_are_put_back() -> None:
    reqs = [_req("a", frequency=0.5, repetition=1.2), _req("b", presence=0.4)]
    orch, _batch = orchestrator(reqs)
    twin, _twin_batch = orchestrator([_req("a", frequency=0.5, repetition=1.2),
                                      _req("b", presence=0.4)])  # fmt: skip
    learn_per_row(orch, [[3, 4, 5], [6]], "cpu")  # a: a verify of 3, b: a plain step
    for tokens in ([3, 6], [4, 6], [5, 6]):  # the twin: b learns 6 once, a all three
        twin.cumulate_output_tokens(torch.tensor(tokens))
    got, want = sglang_rows(orch), sglang_rows(twin)
    assert torch.equal(got[0][0], want[0][0]) and torch.equal(got[1][0], want[1][0])
    b_alone = PenaltyMirror(PenaltyParams(presence=0.4), V)
    b_alone.learn([6])
    assert agrees(b_alone, got[0][1], got[1][1])


def test_verify_columns_are_penalized_as_plain_steps_would_be() -> None:
    """Column j of a penalized row equals what a plain step after the chain's first j fed
    tokens gives, for both schedulers' feed streams; a row whose mirror disagrees with
    SGLang's state verifies no drafts."""
    for overlapped in (True, False):
        req = _req("p", frequency=0.6, repetition=1.4)
        req.output_ids = [11, 12, 11]
        orch, _batch = orchestrator([req])
        k = len(req.output_ids)
        orch.cumulate_output_tokens(torch.tensor(feed_stream(req.output_ids, req.origin_input_ids,
                                                             overlapped, 0, 1)))  # fmt: skip
        for t in feed_stream(req.output_ids, req.origin_input_ids, overlapped, 1, k):
            orch.cumulate_output_tokens(torch.tensor([t]))
        additive, scaling = sglang_rows(orch)
        info = SimpleNamespace(acc_additive_penalties=additive, acc_scaling_penalties=scaling)
        chain = torch.tensor([[11, 12, 13, 12]])  # last token + 3 drafts
        raw = torch.randn(4, V)
        logits, lens, mirrors = raw.clone(), torch.tensor([3], dtype=torch.int32), {}
        penalize_verify(logits, chain, lens, [0], [req], info, mirrors, overlapped)
        assert lens.tolist() == [3]
        # plain decoding at column j: SGLang's state after learning the chain's fed tokens
        lag = 0 if overlapped else 1
        for j in range(4):
            if j:
                orch.cumulate_output_tokens(torch.tensor([int(chain[0, j - 1 + lag])]))
            add, scale = sglang_rows(orch)
            want = raw[j].clone().add_(add[0])
            penaltylib.repetition_penalty.apply_scaling_penalties(want, scale[0])
            assert torch.equal(logits[j], want), (overlapped, j)
        # a stale mirror (its rows made afresh in SGLang): no drafts, column 0 as SGLang's
        mirrors["p"].learn([40])
        logits = raw.clone()
        penalize_verify(logits, chain, lens, [0], [req], info, mirrors, overlapped)
        assert lens.tolist() == [0]
