"""Grammars under a reasoning parser: drafted only where the wrapped grammar can roll back, and a
matcher whose rollback raises ends its request, not the scheduler (``srt/hooks/grammar_rollback.py``).

With ``--reasoning-parser`` SGLang wraps every grammar in a ``ReasonerGrammarObject``; its
``rollback`` calls the wrapped grammar's for tokens past the reasoning's end, and an outlines
grammar's raises ``NotImplementedError`` there. These tests use the real wrapper around a real
outlines grammar (compiled over the embedded model's tokenizer).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.sglang, pytest.mark.model]

REGEX = "(yes|no)"


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


@pytest.fixture(scope="module")
def outlines_backend(tokenizer):
    from sglang.srt.constrained.outlines_backend import OutlinesGrammarBackend

    return OutlinesGrammarBackend(tokenizer, whitespace_pattern=None)


def token(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def reasoning_outlines(backend, think_end: int):
    """A fresh outlines grammar for ``REGEX`` inside SGLang's reasoning wrapper, thinking."""
    from sglang.srt.constrained.outlines_backend import OutlinesGrammar
    from sglang.srt.constrained.reasoner_grammar_backend import ReasonerGrammarObject

    inner = backend.dispatch_regex(REGEX)
    assert isinstance(inner, OutlinesGrammar)
    wrapped = ReasonerGrammarObject(inner, think_end_ids=[think_end])
    wrapped.maybe_init_reasoning(True)
    return wrapped


def greedy_req(grammar, rid: str = "r"):
    from sglang.srt.sampling.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0, max_new_tokens=8)
    sp.verify(vocab_size=50_000)
    return SimpleNamespace(rid=rid, sampling_params=sp, grammar=grammar, to_finish=None,
                           custom_logit_processor=None, return_logprob=False)  # fmt: skip


def test_rollback_is_decided_by_the_wrapped_grammar(outlines_backend, tokenizer) -> None:
    from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject
    from sglang.srt.constrained.reasoner_grammar_backend import ReasonerGrammarObject

    from sglang_vericache.srt.decode.eligibility import (
        StepRows,
        decode_mode,
        plain_reason,
        rolls_back,
    )
    from sglang_vericache.verify.stats import DecodeMode

    wrapped = reasoning_outlines(outlines_backend, token(tokenizer, "\n"))
    assert not rolls_back(wrapped)
    req = greedy_req(wrapped)
    assert "rollback" in plain_reason(req) and decode_mode(req) is DecodeMode.PLAIN
    assert StepRows.of([req, greedy_req(None)]).drafted == [1]

    class RollsBack(BaseGrammarObject):  # xgrammar, llguidance
        def rollback(self, k: int) -> None:
            pass

    assert rolls_back(ReasonerGrammarObject(RollsBack(), think_end_ids=[1]))
    assert rolls_back(ReasonerGrammarObject(None, think_end_ids=[1]))  # reasoning only


def test_a_matcher_that_cannot_roll_back_ends_its_request_not_the_step(
        outlines_backend, tokenizer) -> None:  # fmt: skip
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    from sglang_vericache.srt.hooks.grammar_rollback import roll_back_or_abort
    from sglang_vericache.verify.grammar_chain import GrammarChain

    end, yes, other = token(tokenizer, "\n"), token(tokenizer, "yes"), token(tokenizer, " the")
    vocab = len(tokenizer)

    def chain_over(grammars: list) -> GrammarChain:
        chain = GrammarChain.start(grammars, list(range(len(grammars))), 3, vocab,
                                   torch.device("cpu"))  # fmt: skip
        # row 0 keeps thinking; row 1 drafts the reasoning's end, then the grammar's "yes"
        chain.advance(0, torch.tensor([other, end]))
        chain.advance(1, torch.tensor([other, yes]))
        return chain

    # what the draft loop's rollback did to the scheduler thread before
    chain = chain_over([reasoning_outlines(outlines_backend, end) for _ in range(2)])
    with pytest.raises(NotImplementedError):
        chain.rollback()

    thinking, answering = (reasoning_outlines(outlines_backend, end) for _ in range(2))
    before = (thinking.tokens_in_think, thinking.tokens_after_end)
    chain = chain_over([thinking, answering])
    reqs = [greedy_req(thinking, "thinking"), greedy_req(answering, "answering")]
    assert roll_back_or_abort(chain, reqs) == [1]
    assert reqs[0].to_finish is None
    assert (thinking.tokens_in_think, thinking.tokens_after_end) == before  # rolled back
    assert isinstance(reqs[1].to_finish, FINISH_ABORT)
    assert "rollback" in reqs[1].to_finish.message and "xgrammar" in reqs[1].to_finish.message
    assert chain.advanced == [0, 0]
    assert roll_back_or_abort(chain, reqs) == []  # idempotent, like GrammarChain.rollback
