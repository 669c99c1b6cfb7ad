"""Grammar masks along a draft chain: constrained rows draft and verify like the others.

A grammar-constrained row (``regex``, ``json_schema``, ``ebnf``, ``structural_tag``) samples
every token from logits masked by its grammar matcher's state after the tokens before it. A
VeriCache step over such a row needs that mask at every column of its draft chain::

    verify column j       0          1          2      ...   W-1
    tokens                last       d1         d2           d_{W-1}
    mask (state after)    committed  +d1        +d1 d2       +d1 .. d_{W-1}

    draft forward j:  mask column j applied to the compressed-KV logits -> d_{j+1};
                      the matcher accepts d_{j+1} (advancing it along the chain)
    verify:           mask column j applied to the full-KV logits of column j, then the usual
                      greedy or speculative-sampling acceptance
    terminating d_n:  a draft the matcher terminates on is the chain's last (later columns
                      are not verified) and is verified like any draft: accepted, it is the
                      row's last committed token, no bonus after it (``close``); rejected, the
                      correction replaces it
    end of drafting:  every matcher rolls back what it accepted this step (``rollback``), so
                      the scheduler advances it over the committed tokens exactly as for any
                      speculative batch (``_accept_grammar_tokens``)

The masks are computed once, while drafting (the matcher stands at each state then), and kept
for the verify. Plain SGLang leaves a terminated grammar's row unconstrained
(``update_regex_vocab_mask``); so does this. The terminating draft is offered to the verify
because whether drafting stops must not depend on a token the verify never sees: a chain cut
*before* it lets the verify draw a fresh token at that column, and a sampled row then commits
a terminating token with probability about x^2 where plain sampling gives x. Nothing is
committed past it: SGLang drops a speculative run's tokens past termination, so a run that
ends on the terminating token drops nothing and the committed KV and the compressed KV stay in
step. A chain also ends, defensively, before a draft the matcher refuses (a masked draft: only
a broken grammar). The row's ``draft_lens`` entry says how many drafts the verify may accept.

No sglang import: ``grammars`` are SGLang grammar objects (``BaseGrammarObject``) used through
``accept_token`` / ``rollback`` / ``is_terminated`` / ``allocate_vocab_mask`` /
``fill_vocab_mask`` / ``move_vocab_mask`` / ``apply_vocab_mask``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sglang_vericache.verify.accept import AcceptResult, stop_at_last_draft


@dataclass
class GrammarChain:
    """The constrained rows of one step, their masks and how far each matcher was advanced.

    rows: [n] batch indices of the constrained (drafted) rows, ascending.
    grammars: their grammar objects, in ``rows`` order (one backend: the server's).
    width: W, verify columns (1 + drafts).
    masks: [n * W, words] the backend's vocab bitmask, row ``k * W + j`` = row k's column j.
    advanced: tokens each matcher accepted this step (what ``rollback`` undoes).
    draft_lens: drafts each row may have accepted (<= W - 1), a terminating draft included.
    open: rows whose chain still extends (not terminated, no refused draft).
    terminal: rows whose last draft terminates their grammar (``close`` ends them there).
    """

    rows: list[int]
    grammars: list[Any]
    width: int
    masks: torch.Tensor
    advanced: list[int]
    draft_lens: list[int]
    open: list[bool]
    terminal: list[bool]

    @classmethod
    def start(cls, grammars: list[Any], rows: list[int], width: int, vocab_size: int,
              device: torch.device) -> GrammarChain | None:  # fmt: skip
        """The chain of ``rows`` (their ``grammars``), or None when there are none."""
        if not rows:
            return None
        n = len(rows)
        masks = grammars[0].allocate_vocab_mask(vocab_size=vocab_size, batch_size=n * width,
                                                device=device)  # fmt: skip
        live = [not g.is_terminated() for g in grammars]
        return cls(rows=list(rows), grammars=list(grammars), width=width, masks=masks,
                   advanced=[0] * n, draft_lens=[0] * n, open=live,
                   terminal=[False] * n)  # fmt: skip

    def fill(self, column: int) -> None:
        """Fill mask column ``column`` from each open row's matcher (standing after its drafts
        1 .. column); other rows keep the fresh buffer's unconstrained value."""
        for k, grammar in enumerate(self.grammars):
            if self.open[k] and not grammar.is_terminated():
                grammar.fill_vocab_mask(self.masks, k * self.width + column)

    def apply(self, logits: torch.Tensor, column: int | None = None) -> None:
        """Mask ``logits`` in place.

        column given: logits [bs, V], one draft forward's; each constrained row gets its mask
            at that column.
        column None: logits [bs * W, V], the verify's; row k's W columns get their masks.
        """
        bs = logits.shape[0] if column is not None else logits.shape[0] // self.width
        index = torch.tensor(self.rows, dtype=torch.int64, device=logits.device)
        masks = self.masks.view(len(self.rows), self.width, -1)
        if column is not None:
            picked, mask = logits.index_select(0, index), masks[:, column]
        else:
            view = logits.view(bs, self.width, -1)
            picked = view.index_select(0, index).reshape(len(self.rows) * self.width, -1)
            mask = masks.reshape(len(self.rows) * self.width, -1)
        mask = self.grammars[0].move_vocab_mask(mask.contiguous(), logits.device)
        picked = picked.contiguous()
        self.grammars[0].apply_vocab_mask(logits=picked, vocab_mask=mask)
        if column is not None:
            logits.index_copy_(0, index, picked)
        else:
            view.index_copy_(0, index, picked.view(len(self.rows), self.width, -1))

    def advance(self, column: int, tokens: torch.Tensor) -> None:
        """Each open row's matcher accepts its draft after column ``column``.

        tokens: [bs] int64, the batch's drafts after that column (only ``rows`` are read).
        """
        picked = tokens[self.rows].tolist()
        for k, grammar in enumerate(self.grammars):
            if not self.open[k]:
                continue
            try:
                grammar.accept_token(int(picked[k]))
            except ValueError:  # the draft was masked, so only a broken grammar gets here
                self.open[k] = False
                continue
            self.advanced[k] += 1
            self.draft_lens[k] = column + 1
            if grammar.is_terminated():  # verified like any draft, the chain's last (module doc)
                self.open[k], self.terminal[k] = False, True

    def rollback(self) -> None:
        """Every matcher back where the step found it (idempotent)."""
        for k, grammar in enumerate(self.grammars):
            if self.advanced[k]:
                grammar.rollback(self.advanced[k])
                self.advanced[k] = 0

    def limit(self, draft_lens: torch.Tensor) -> None:
        """Cut ``draft_lens`` ([bs] int32, the step's drafts per row) to each chain's length."""
        for k, row in enumerate(self.rows):
            draft_lens[row] = min(int(draft_lens[row]), self.draft_lens[k])

    def close(self, result: AcceptResult, draft_lens: torch.Tensor) -> AcceptResult:
        """``result`` ([bs] rows, verified over ``draft_lens`` [bs] drafts, already cut by
        ``limit``) with each row whose accepted drafts end on its terminating draft committing
        that draft as its last token: no bonus after it (``stop_at_last_draft``).

        Such a row's ``draft_lens`` entry drops by one, in place: its stopping draft takes the
        closing token's place (a correction's or bonus's), so the row's stats and the
        draft-length controller count ``accept_lens - 1`` accepted of ``draft_lens`` drafts
        like any row's (SGLang's spec metrics count ``accept_lens - 1`` correct drafts too).
        """
        verified = draft_lens.tolist()
        stops = torch.zeros(len(verified), dtype=torch.bool)
        for k, row in enumerate(self.rows):
            stops[row] = self.terminal[k] and verified[row] == self.draft_lens[k]
        closed = stop_at_last_draft(result, stops.to(result.bonus.device))
        stopped = (closed.accept_lens < result.accept_lens).to(draft_lens.device)
        draft_lens -= stopped.to(draft_lens.dtype)
        return closed

    def check_integrity(self) -> None:
        n = len(self.rows)
        assert len(self.grammars) == len(self.advanced) == len(self.draft_lens) == n
        assert self.masks.shape[0] == n * self.width
        assert all(0 <= d <= self.width - 1 for d in self.draft_lens)
        # every draft the matcher accepted is in the chain; rollback zeroes ``advanced``
        assert all(a in (0, d) for a, d in zip(self.advanced, self.draft_lens))
        assert all(d >= 1 and not o for t, d, o in zip(self.terminal, self.draft_lens, self.open)
                   if t)  # fmt: skip
