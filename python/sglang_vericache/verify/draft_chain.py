"""One verify step's draft chain: the verify rows, who drafts in them, the sampled rows' draft
distributions and the grammar rows' masks, from the first draft to the committed tokens.

The decode step (``srt/decode/decode_step.py``) enters ``verify/`` through this object only::

    chain = DraftChain.start(last, width, drafted, ...)                 rows[:, 0] = last tokens
    for j in 0 .. W-2:  chain.draft(j, draft_logits)                   rows[:, j+1] = drafts
      (or chain.propose(tokens, lens): drafts made while the prefix was fetched, or prompt-
       lookup drafts of each row's own context; all-greedy steps)
    chain.end_drafts()                                                  last grammar mask column
    chain.mask_verify(verify_logits)                                    grammar rows masked
    accepted = chain.accept(verify_logits)     (plain rows' column 0: SGLang's sampler, in srt)
    accepted = chain.settle(accepted, stop_ids)     terminating drafts close, stop tokens cut

    rows        [bs, W] int64   column 0 the last committed token, then each row's drafts
    draft_lens  [bs]    int32   W - 1 for drafted rows, 0 for the rest, cut to grammar chains
                                by ``mask_verify`` and by closing drafts in ``settle``

Rows outside ``drafted`` ride along in the draft forwards; their drafts are never verified
(their draft length is 0). What each row's acceptance is lives in ``row_acceptance``.
No sglang import: the grammar and sampled parts take SGLang's objects duck-typed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sglang_vericache.verify.accept import AcceptResult, stop_at_first_stop_token
from sglang_vericache.verify.grammar_chain import GrammarChain
from sglang_vericache.verify.row_acceptance import SampledDrafts, accept_step, draft_column


@dataclass
class DraftChain:
    """See the module doc. ``sampled`` / ``grammar``: None when the step has no such rows."""

    rows: torch.Tensor
    draft_lens: torch.Tensor
    sampled: SampledDrafts | None
    grammar: GrammarChain | None

    @classmethod
    def start(cls, last: torch.Tensor, width: int, drafted: list[int], *, reqs: list[Any],
              sampling_info: Any, sampled_rows: list[int], grammar_rows: list[int],
              positions: torch.Tensor, generator: torch.Generator) -> DraftChain:  # fmt: skip
        """The chain of a step verifying ``width`` columns.

        last: [bs] int64, each row's last committed token, on the step's device.
        drafted: rows whose drafts verify; sampled_rows / grammar_rows: those among them drawn
            from q / masked by their request's grammar (``reqs[i].grammar``).
        reqs, sampling_info: the batch's requests and SGLang ``SamplingBatchInfo``.
        positions: [bs] int64 (CPU), each row's position of its last committed token.
        """
        bs, device = last.shape[0], last.device
        rows = torch.empty(bs, width, dtype=torch.int64, device=device)
        rows[:, 0] = last
        draft_lens = torch.zeros(bs, dtype=torch.int32, device=device)
        draft_lens[drafted] = width - 1
        sampled = SampledDrafts.start(sampling_info, reqs, sampled_rows, positions, width,
                                      generator, device)  # fmt: skip
        grammar = GrammarChain.start([reqs[i].grammar for i in grammar_rows], grammar_rows,
                                     width, sampling_info.vocab_size, device)  # fmt: skip
        return cls(rows=rows, draft_lens=draft_lens, sampled=sampled, grammar=grammar)

    @property
    def width(self) -> int:
        return self.rows.shape[1]

    def draft(self, column: int, logits: torch.Tensor) -> None:
        """The drafts after verify column ``column`` from one draft forward's logits ([bs, V],
        grammar rows masked in place)."""
        self.rows[:, column + 1] = draft_column(column, logits, self.sampled, self.grammar)

    def propose(self, tokens: torch.Tensor, lens: torch.Tensor | None = None) -> None:
        """Drafts made elsewhere ([bs, W-1] int64): greedy, unmasked and without q, so only for
        a step with neither sampled nor grammar rows. lens: [bs] int32, how many of each row's
        drafts verify (a prompt-lookup draft may be short or absent; the rest is padding)."""
        if self.sampled is not None or self.grammar is not None:
            raise ValueError("proposed drafts carry no q and no grammar mask: "
                             "all-greedy steps only")
        self.rows[:, 1:] = tokens
        if lens is not None:
            self.draft_lens = torch.minimum(self.draft_lens, lens.to(self.draft_lens.dtype))

    def end_drafts(self) -> None:
        """The grammar masks of the last column (after every draft), for the verify."""
        if self.grammar is not None:
            self.grammar.fill(self.width - 1)

    def mask_verify(self, logits: torch.Tensor) -> None:
        """Before acceptance: grammar rows' draft lengths cut to their chains and their verify
        logits ([bs * W, V]) masked in place (their logprobs are of masked logits, as plain)."""
        if self.grammar is not None:
            self.grammar.limit(self.draft_lens)
            self.grammar.apply(logits)

    def accept(self, logits: torch.Tensor) -> AcceptResult:
        """Every row's acceptance against the verify logits ([bs * W, V], not modified)."""
        return accept_step(self.rows, logits, self.draft_lens, self.sampled)

    def settle(self, accepted: AcceptResult, stop_ids: list[frozenset[int]]) -> AcceptResult:
        """``accepted`` with an accepted terminating draft as its row's last token (its draft
        length drops by one, ``GrammarChain.close``) and every row cut after its first stop
        token."""
        if self.grammar is not None:
            accepted = self.grammar.close(accepted, self.draft_lens)
        return stop_at_first_stop_token(accepted, stop_ids)

    def check_integrity(self) -> None:
        bs, width = self.rows.shape
        assert width >= 1 and self.draft_lens.shape == (bs,)
        assert bs == 0 or 0 <= int(self.draft_lens.min()) <= int(self.draft_lens.max()) < width
        if self.sampled is not None:
            assert self.sampled.width == width
        if self.grammar is not None:
            assert self.grammar.width == width
            self.grammar.check_integrity()
