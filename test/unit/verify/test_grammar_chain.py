"""Grammar masks along a draft chain (``verify/grammar_chain.py``, ``draft_column``).

The property that matters: a constrained greedy row drafted from *wrong* logits and verified by
greedy acceptance over masked full logits commits exactly the tokens that plain masked greedy
decoding produces, with the matcher left where the scheduler expects it. Checked on a small
hand-written grammar (every branch: termination mid-chain, a terminated grammar, refused drafts)
and on a real xgrammar regex over the embedded model's tokenizer.
"""

from __future__ import annotations

import torch
from grammar_stubs import BoolMaskGrammar

import pytest
from sglang_vericache.verify.row_acceptance import draft_column
from sglang_vericache.verify.accept import greedy_accept
from sglang_vericache.verify.grammar_chain import GrammarChain

V = 8
EOS = 7


class ToyGrammar(BoolMaskGrammar):
    """Accepts ``1 2 (3|4)+ EOS`` over an 8-token vocabulary; a bool mask, True = allowed.

    Same interface as SGLang's grammar objects (``BaseGrammarObject``); rollback like xgrammar's.
    """

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def allowed(self) -> set[int]:
        n = len(self.accepted)
        if self.is_terminated():
            return set(range(V))
        if n == 0:
            return {1}
        if n == 1:
            return {2}
        return {3, 4} if n == 2 else {3, 4, EOS}

    def accept_token(self, token: int) -> None:
        if self.is_terminated():
            return
        if token not in self.allowed():
            raise ValueError(f"token {token} not accepted after {self.accepted}")
        self.accepted.append(token)

    def rollback(self, k: int) -> None:
        del self.accepted[len(self.accepted) - k:]

    def is_terminated(self) -> bool:
        return bool(self.accepted) and self.accepted[-1] == EOS

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        vocab_mask[idx] = False
        vocab_mask[idx, sorted(self.allowed())] = True


def logits_after(prefix: tuple[int, ...], salt: int, vocab: int = V) -> torch.Tensor:
    """A deterministic 'model': logits as a function of the token prefix ([vocab] float32)."""
    gen = torch.Generator().manual_seed(hash((prefix, salt)) % (2**31))
    return torch.randn(vocab, generator=gen)


def plain_masked_greedy(grammar, prompt: tuple[int, ...], steps: int, vocab: int) -> list[int]:
    """Plain SGLang: mask from the matcher, argmax, advance (unconstrained once terminated)."""
    out: list[int] = []
    mask = grammar.allocate_vocab_mask(vocab_size=vocab, batch_size=1, device="cpu")
    for _ in range(steps):
        logits = logits_after(prompt + tuple(out), salt=0, vocab=vocab)[None].clone()
        if not grammar.is_terminated():
            grammar.fill_vocab_mask(mask, 0)
            grammar.apply_vocab_mask(logits=logits, vocab_mask=mask)
        token = int(logits.argmax(-1))
        out.append(token)
        grammar.accept_token(token)
        mask = grammar.allocate_vocab_mask(vocab_size=vocab, batch_size=1, device="cpu")
    return out


def drafted_masked_greedy(grammar, prompt: tuple[int, ...], steps: int, drafts: int,
                          vocab: int) -> tuple[list[int], list[int]]:  # fmt: skip
    """VeriCache: draft ``drafts`` tokens from wrong logits (salt 1), verify with the right ones
    (salt 0), commit, then advance the matcher over the run as the scheduler does (stopping at
    termination). Returns (tokens, tokens committed per verify)."""
    out: list[int] = []
    per_verify: list[int] = []
    width = drafts + 1
    while len(out) < steps:
        rows = torch.zeros(1, width, dtype=torch.int64)
        rows[0, 0] = out[-1] if out else prompt[-1]
        chain = GrammarChain.start([grammar], [0], width, vocab, torch.device("cpu"))
        before = list(getattr(grammar, "accepted", []))
        try:
            for j in range(drafts):
                logits = logits_after(prompt + tuple(out) + tuple(rows[0, 1:j + 1].tolist()),
                                      salt=1, vocab=vocab)[None].clone()  # fmt: skip
                rows[:, j + 1] = draft_column(j, logits, None, chain)  # the worker's own step
            chain.fill(width - 1)
            chain.check_integrity()
        finally:
            chain.rollback()
        if hasattr(grammar, "accepted"):
            assert grammar.accepted == before  # the step leaves the matcher where it found it
        verify = torch.stack([logits_after(prompt + tuple(out) + tuple(rows[0, 1:j + 1].tolist()),
                                           salt=0, vocab=vocab) for j in range(width)])  # fmt: skip
        chain.apply(verify)
        draft_lens = torch.full((1,), drafts, dtype=torch.int32)
        chain.limit(draft_lens)
        result = chain.close(greedy_accept(rows, verify.argmax(-1)[None], draft_lens), draft_lens)
        run = result.committed[0, : int(result.accept_lens[0])].tolist()
        retained = []
        for token in run:  # SchedulerBatchResultProcessor._accept_grammar_tokens
            grammar.accept_token(token)
            retained.append(token)
            if grammar.is_terminated():
                break
        assert retained == run  # nothing past termination: committed KV stays in step
        out += retained
        per_verify.append(len(retained))
    return out[:steps], per_verify


@pytest.mark.parametrize("drafts", [1, 2, 4, 6])
@pytest.mark.parametrize("prompt", [(5,), (6, 5), (0, 0, 1)])
def test_drafted_constrained_greedy_equals_plain(prompt: tuple[int, ...], drafts: int) -> None:
    steps = 12  # runs past the grammar's termination: the unconstrained tail must match too
    want = plain_masked_greedy(ToyGrammar(), prompt, steps, V)
    got, per_verify = drafted_masked_greedy(ToyGrammar(), prompt, steps, drafts, V)
    assert got == want
    assert max(per_verify) <= drafts + 1
    # the grammar's forced tokens (1 2) are drafted right from masked logits and accepted
    assert per_verify[0] >= 2, per_verify


def test_masks_per_column_termination_and_rollback() -> None:
    grammar = ToyGrammar()
    grammar.accepted = [1, 2]  # the committed output so far
    chain = GrammarChain.start([grammar], [1], width=5, vocab_size=V, device=torch.device("cpu"))
    drafts = [3, EOS, 5, 5]  # EOS terminates the grammar at draft 2
    tokens = torch.zeros(2, dtype=torch.int64)
    for j, d in enumerate(drafts):
        chain.fill(j)
        tokens[1] = d
        chain.advance(j, tokens)
    chain.fill(4)
    # the terminating draft is the chain's last, offered to the verify like the others
    assert chain.draft_lens == [2] and chain.advanced == [2] and chain.open == [False]
    assert chain.terminal == [True]
    chain.check_integrity()
    masks = chain.masks.view(5, V)
    assert set(masks[0].nonzero().flatten().tolist()) == {3, 4}
    assert set(masks[1].nonzero().flatten().tolist()) == {3, 4, EOS}
    assert masks[2:].all()  # terminated: unconstrained, as plain SGLang leaves such a row
    chain.rollback()
    assert grammar.accepted == [1, 2] and chain.advanced == [0]
    chain.rollback()  # idempotent
    assert grammar.accepted == [1, 2]
    lens = torch.tensor([4, 4], dtype=torch.int32)
    chain.limit(lens)
    assert lens.tolist() == [4, 2]


def test_verify_masks_only_constrained_rows_and_terminated_rows_draft_nothing() -> None:
    done = ToyGrammar()
    done.accepted = [1, 2, 3, EOS]
    live = ToyGrammar()
    chain = GrammarChain.start([live, done], [0, 2], width=3, vocab_size=V,
                               device=torch.device("cpu"))  # fmt: skip
    assert chain.open == [True, False]
    tokens = torch.tensor([1, 0, 6])
    chain.fill(0)
    chain.advance(0, tokens)
    tokens = torch.tensor([6, 0, 6])  # refused by ``live``: its chain stops at one draft
    chain.fill(1)
    chain.advance(1, tokens)
    chain.fill(2)
    assert chain.draft_lens == [1, 0] and chain.open == [False, False]
    logits = torch.zeros(3 * 3, V)
    chain.apply(logits)
    rows = logits.view(3, 3, V)
    assert torch.isinf(rows[0, 0]).sum() == V - 1  # only token 1 allowed at column 0
    assert torch.isinf(rows[0, 1]).sum() == V - 1  # only token 2 after it
    assert not torch.isinf(rows[1]).any() and not torch.isinf(rows[2]).any()
    chain.rollback()
    assert live.accepted == [] and done.accepted == [1, 2, 3, EOS]


@pytest.mark.model
def test_real_xgrammar_regex_chain_equals_plain(default_model_path) -> None:
    """The same property on SGLang's xgrammar backend (bitmask masks, CPU apply)."""
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    vocab = len(tokenizer)
    backend = XGrammarGrammarBackend(tokenizer, vocab_size=vocab,
                                     model_eos_token_ids=[tokenizer.eos_token_id])  # fmt: skip
    regex = r"(yes|no), [a-z]{2,6} [0-9]{1,3}\."
    compiled = backend.dispatch_regex(regex)
    prompt = tuple(tokenizer.encode("Answer:"))
    for drafts in (1, 3, 5):
        want = plain_masked_greedy(compiled.copy(), prompt, 20, vocab)
        got, _ = drafted_masked_greedy(compiled.copy(), prompt, 20, drafts, vocab)
        assert got == want
        text = tokenizer.decode(want)
        assert text.startswith(("yes, ", "no, ")), text


def _chain_over(drafts: list[list[int]], grammars: list[ToyGrammar]) -> tuple[GrammarChain,
                                                                               torch.Tensor]:
    """A chain over rows 0..n-1 advanced over ``drafts`` (row r's drafts ``drafts[r]``, all the
    same length), rolled back as the worker does; returns it and the verify rows [n, W]."""
    width = len(drafts[0]) + 1
    chain = GrammarChain.start(grammars, list(range(len(grammars))), width, V, torch.device("cpu"))
    rows = torch.zeros(len(grammars), width, dtype=torch.int64)
    rows[:, 1:] = torch.tensor(drafts)
    for j in range(width - 1):
        chain.fill(j)
        chain.advance(j, rows[:, j + 1])
    chain.fill(width - 1)
    chain.rollback()
    return chain, rows


def test_close_ends_a_row_on_its_accepted_terminating_draft() -> None:
    ended = ToyGrammar()
    ended.accepted = [1, 2]
    chain, rows = _chain_over([[3, EOS, 5], [1, 2, 3]], [ended, ToyGrammar()])
    lens = torch.full((2,), 3, dtype=torch.int32)
    chain.limit(lens)
    assert lens.tolist() == [2, 3] and chain.terminal == [True, False]

    def close(predict: list[list[int]], verified: list[int]) -> tuple[object, list[int]]:
        draft_lens = torch.tensor(verified, dtype=torch.int32)
        result = chain.close(greedy_accept(rows, torch.tensor(predict), draft_lens), draft_lens)
        return result, draft_lens.tolist()

    # every draft accepted: row 0 ends on EOS (no bonus; EOS counts as its closing token, so
    # one draft accepted of one), row 1 keeps its bonus 4
    result, counted = close([[3, EOS, 6, 6], [1, 2, 3, 4]], [2, 3])
    assert result.row_tokens(0) == [3, EOS] and result.row_tokens(1) == [1, 2, 3, 4]
    assert result.bonus.tolist() == [False, True] and counted == [1, 3]
    # the terminating draft rejected: its correction closes the row as usual
    result, counted = close([[3, 4, 6, 6], [1, 2, 3, 4]], [2, 3])
    assert result.row_tokens(0) == [3, 4] and result.bonus.tolist() == [False, True]
    assert counted == [2, 3]
    # a verify over fewer drafts than the chain (cut below the terminating draft) keeps its bonus
    result, counted = close([[3, 4, 6, 6], [1, 2, 3, 4]], [1, 3])
    assert result.row_tokens(0) == [3, 4] and result.bonus.tolist() == [True, True]
    assert counted == [1, 3]
