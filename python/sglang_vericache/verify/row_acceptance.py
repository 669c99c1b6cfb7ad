"""One verify step's acceptance for a mixed batch: greedy and sampled rows, merged.

A step drafts GREEDY and SAMPLED rows (``srt/decode/eligibility.py``) in the same draft forwards and
verifies every row in one TARGET_VERIFY forward of width W::

    draft column j (j = 0 .. W-2), logits [bs, V] from the compressed KV (``draft_column``):
        grammar rows  logits masked by the matcher's state there  (``verify/grammar_chain.py``)
        greedy rows   rows[i, j+1] = argmax
        sampled rows  q[:, j] = process_logits(logits[sampled], their sampling)
                      rows[i, j+1] ~ q[:, j]                      (``SampledDrafts.draft``)
    verify logits [bs * W, V] over the full KV:
        greedy rows   ``greedy_accept`` against the argmax
        sampled rows  p = process_logits(logits[sampled], sampling.repeat(W))
                      ``speculative_accept(rows, q, p, ...)``     (exact in distribution)
        both merged into one ``AcceptResult`` over the batch      (``accept_step``)
        a grammar row whose chain ends on a terminating draft commits nothing after it
                                                      (``GrammarChain.close``, in the worker)

Plain rows carry no drafts (draft length 0): ``greedy_accept`` gives them one column, whose token
the worker replaces with SGLang's own sample (``srt/decode/row_sampling.py``).

Both distributions come from raw logits. That is exactly what SGLang samples a sampled row from:
``ModelRunner._preprocess_logits`` changes only rows with penalties, logit bias, grammar masks or
``min_new_tokens`` (plain rows here), the sampler's custom processors only rows that have one
(plain too), and the rest of SGLang's sampling (temperature, softmax, top-k/top-p/min-p) is
``process_logits``. No sglang import: the module runs on tensors and duck-typed requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_vericache.verify.accept import AcceptResult, greedy_accept
from sglang_vericache.verify.grammar_chain import GrammarChain
from sglang_vericache.verify.rng import Randomness, RowSeeds
from sglang_vericache.verify.sampling_probs import RowSampling, process_logits
from sglang_vericache.verify.spec_sampling import (
    draw_accept_uniforms,
    sample_drafts,
    speculative_accept,
)

__all__ = ["SampledDrafts", "accept_step", "draft_column", "merge_accept", "row_seeds"]


def row_seeds(reqs: list[Any], positions: torch.Tensor) -> RowSeeds | None:
    """Per-row seeds of ``reqs`` from ``sampling_params.sampling_seed`` (None: no row seeded).

    positions: [rows] int64, each row's position of its last committed token (verify column 0).
    """
    seeds = [r.sampling_params.sampling_seed for r in reqs]
    if all(s is None for s in seeds):
        return None
    return RowSeeds(
        seeds=torch.tensor([0 if s is None else s for s in seeds], dtype=torch.int64),
        positions=positions.to(torch.int64),
        seeded=torch.tensor([s is not None for s in seeds], dtype=torch.bool),
    )  # fmt: skip


@dataclass
class SampledDrafts:
    """The sampled rows of one step: their parameters, randomness and draft distributions.

    rows: [n] int64 batch indices of the SAMPLED rows, on the logits' device.
    sampling: their parameters; batch-wide switches (top-k/top-p/min-p path, seeded) are the whole
        batch's, because SGLang's sampler takes its path for the whole batch.
    randomness: the worker's generator plus these rows' seeds.
    q: [n, W-1, V] float, ``q[:, j]`` the draft distribution the draft after verify column j was
        sampled from; allocated at the first draft column (V is known from the logits then).
    """

    rows: torch.Tensor
    sampling: RowSampling
    randomness: Randomness
    width: int
    q: torch.Tensor | None = field(default=None)

    @classmethod
    def start(cls, sampling_info: Any, reqs: list[Any], rows: list[int], positions: torch.Tensor,
              width: int, generator: torch.Generator,
              device: torch.device) -> SampledDrafts | None:  # fmt: skip
        """The sampled ``rows`` of a batch, or None when there are none (``reqs``: the batch's
        requests, ``sampling_info`` its SGLang ``SamplingBatchInfo``; positions: [bs] int64 of
        the last committed tokens)."""
        if not rows:
            return None
        index = torch.tensor(rows, dtype=torch.int64, device=device)
        sampling = RowSampling.from_sampling_info(sampling_info).select(index)
        seeds = row_seeds([reqs[i] for i in rows], positions[rows])
        return cls(rows=index, sampling=sampling, randomness=Randomness(generator, seeds),
                   width=width)  # fmt: skip

    def draft(self, column: int, logits: torch.Tensor) -> torch.Tensor:
        """Sample the sampled rows' drafts after verify column ``column`` and keep their q.

        logits: [bs, V] float, one draft forward's ``next_token_logits`` for the whole batch.
        Returns [n] int64 draft tokens, row k for batch row ``rows[k]``.
        """
        q = process_logits(logits.index_select(0, self.rows), self.sampling)
        if self.q is None:
            self.q = q.new_zeros(self.rows.numel(), self.width - 1, q.shape[-1])
        self.q[:, column] = q
        return sample_drafts(q, self.randomness, column)

    def accept(self, tokens: torch.Tensor, logits: torch.Tensor,
               draft_lens: torch.Tensor) -> AcceptResult:  # fmt: skip
        """Speculative sampling for these rows.

        tokens: [bs, W] int64 verify rows; logits: [bs * W, V] verify logits; draft_lens: [bs].
        Returns an ``AcceptResult`` over the n sampled rows (in ``rows`` order).
        """
        n, width = self.rows.numel(), self.width
        vocab = logits.shape[-1]
        mine = logits.view(-1, width, vocab).index_select(0, self.rows).reshape(n * width, vocab)
        p = process_logits(mine, self.sampling.repeat(width)).view(n, width, vocab)
        q = self.q if self.q is not None else p.new_zeros(n, width - 1, vocab)
        draws = draw_accept_uniforms(self.randomness, n, width, logits.device)
        return speculative_accept(tokens.index_select(0, self.rows), q, p,
                                  draft_lens.index_select(0, self.rows), draws)  # fmt: skip


def draft_column(column: int, logits: torch.Tensor, sampled: SampledDrafts | None,
                 grammar: GrammarChain | None) -> torch.Tensor:  # fmt: skip
    """The drafts after verify column ``column`` for every row: grammar rows' logits masked
    first (in place), then greedy rows take the argmax and sampled rows a sample of q (kept for
    the verify); grammar matchers then advance over their rows' drafts.

    logits: [bs, V] float, one draft forward's ``next_token_logits``. Returns [bs] int64.
    """
    if grammar is not None:
        grammar.fill(column)
        grammar.apply(logits, column)
    tokens = logits.argmax(-1)
    if sampled is not None:
        tokens[sampled.rows] = sampled.draft(column, logits)
    if grammar is not None:
        grammar.advance(column, tokens)
    return tokens


def merge_accept(greedy: AcceptResult, sampled: AcceptResult, rows: torch.Tensor) -> AcceptResult:
    """``greedy`` (every row of the batch) with rows ``rows`` ([n] int64) replaced by ``sampled``
    (n rows, in ``rows`` order). Inputs are not modified; ``committed`` keeps greedy's dtype."""
    committed = greedy.committed.clone()
    committed[rows] = sampled.committed.to(committed.dtype)
    accept_lens = greedy.accept_lens.clone()
    accept_lens[rows] = sampled.accept_lens.to(accept_lens.dtype)
    bonus = greedy.bonus.clone()
    bonus[rows] = sampled.bonus
    return AcceptResult(accept_lens=accept_lens, committed=committed, bonus=bonus)


def accept_step(tokens: torch.Tensor, logits: torch.Tensor, draft_lens: torch.Tensor,
                sampled: SampledDrafts | None) -> AcceptResult:  # fmt: skip
    """Every row's committed tokens for one verify.

    tokens: [bs, W] int64, column 0 the last committed token, then each row's drafts.
    logits: [bs * W, V] float, the verify forward's ``next_token_logits`` (not modified).
    draft_lens: [bs] int32, real drafts per row (0 for plain rows).
    sampled: the step's sampled rows, or None when there are none.
    Returns an ``AcceptResult`` over the batch: ``committed`` [bs, W] int64 (row i's first
    ``accept_lens[i]`` entries are its committed tokens), ``accept_lens`` [bs] int32 >= 1.
    """
    bs, width = tokens.shape
    result = greedy_accept(tokens, logits.argmax(-1).view(bs, width), draft_lens)
    if sampled is None:
        return result
    return merge_accept(result, sampled.accept(tokens, logits, draft_lens), sampled.rows)
