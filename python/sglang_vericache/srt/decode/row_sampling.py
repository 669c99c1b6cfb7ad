"""Exact tokens and logprobs from a verify forward, for every row of a mixed step.

A VeriCache step over a batch drafts the rows it can (greedy or sampled without logit
processing: ``srt/decode/eligibility.py``) and verifies every row in one TARGET_VERIFY forward
of width W. Rows it cannot draft (``min_new_tokens``, logit bias, sampled penalties, ...) carry
no drafts; the verify's first column gives them the full-KV logits at their next position, which
is exactly the distribution a plain decode step would sample from. They take one token from
SGLang's own sampler there, so penalties, logit bias, grammar masks and ``sampling_seed`` behave
as without ``--vericache``::

    verify logits  [bs * W, V]        row i, column j: the full-KV distribution after
                                      position base_i + j
    greedy row i   commits argmax at columns 0 .. accepted_i   (``verify.greedy_accept``)
    sampled row i  accepted drafts, then a residual/bonus sample (``verify/row_acceptance.py``)
    plain row i    commits SGLang's sample at column 0         (``sample_first_column``)

Logprobs go back in the layout SGLang's spec result path reads (``_apply_decode_logprobs``):
``next_token_logprobs`` [bs, W] and the top / token-id lists flat, entry ``i * W + j`` for row
i's j-th committed token. Drafted rows get them from the verify logits, as SGLang's own spec
workers do (``compute_spec_logprobs``): ``log_softmax(logits / temperature)`` when the batch is
not all greedy, which is what plain SGLang's sampler reports for a sampled row (``log(probs)``
of the temperature-scaled softmax, before top-p/top-k/min-p filtering; raw ``log_softmax`` with
``SGLANG_RETURN_ORIGINAL_LOGPROB``, which ``compute_spec_logprobs`` honours too). Plain rows'
first entry is the sampler's, so their values include penalties and grammar masks exactly as
plain decoding reports them.

``sample_first_column`` calls the model runner's ``_preprocess_logits`` (SGLang 0.5.23): the one
place that applies penalties, logit bias and grammar masks before its sampler, and it has no
public entry point that takes logits without a full ``ForwardBatch``.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.logprob_processor import compute_spec_logprobs

from sglang_vericache.verify.accept import AcceptResult
from sglang_vericache.verify.draft_chain import DraftChain


def commit_verify(model_runner: Any, batch: Any, verify_out: LogitsProcessorOutput,
                  chain: DraftChain, plain_rows: list[int],
                  positions: torch.Tensor) -> AcceptResult:  # fmt: skip
    """Every row's committed tokens from one verify, and their logprobs when asked.

    chain: the step's verify rows ([bs, W] int64), draft lengths (0 for plain rows) and sampled
    rows; plain_rows: rows that take SGLang's sample at column 0; positions: [bs] int64
    positions of the last committed tokens.
    Returns the merged ``AcceptResult``; its ``committed`` [bs, W] holds plain rows' sample at
    column 0. ``verify_out.next_token_logits`` is read, never modified.
    """
    logits = verify_out.next_token_logits
    accepted = chain.accept(logits)
    first = None
    if plain_rows:
        tokens, first = sample_first_column(model_runner, batch, logits, chain.width, positions)
        accepted.committed[plain_rows, 0] = tokens[plain_rows]
    if batch.return_logprob:
        fill_spec_logprobs(batch, verify_out, accepted.committed, first, plain_rows)
    return accepted


def sample_first_column(
    model_runner: Any, batch: Any, logits: torch.Tensor, width: int, positions: torch.Tensor
) -> tuple[torch.Tensor, LogitsProcessorOutput]:
    """SGLang's sampler over column 0 of each verify row.

    logits: [bs * width, V] float, the verify forward's ``next_token_logits``.
    positions: [bs] int64, each row's position of its last committed token (plain decoding's
        sampling position, which seeds ``sampling_seed`` draws).
    Returns (tokens [bs] int64, the sampler's output with its logprob fields for these rows).
    The batch's penalizer and grammar state are read, never advanced (the scheduler does that).
    """
    first = logits.view(-1, width, logits.shape[-1])[:, 0].clone()
    out = LogitsProcessorOutput(next_token_logits=first)
    model_runner._preprocess_logits(out, batch.sampling_info)
    tokens = model_runner.sampler(
        out, batch.sampling_info, batch.return_logprob, batch.top_logprobs_nums,
        batch.token_ids_logprobs, positions,
    )  # fmt: skip
    return tokens.to(torch.int64), out


def fill_spec_logprobs(
    batch: Any,
    verify_out: LogitsProcessorOutput,
    committed: torch.Tensor,
    sampled: LogitsProcessorOutput | None,
    plain_rows: list[int],
) -> None:
    """Write the committed tokens' logprobs into ``verify_out`` in SGLang's spec layout.

    committed: [bs, W] int64, row i's committed tokens first (the rest is never read).
    sampled: ``sample_first_column``'s output (None when every row was drafted).
    plain_rows: rows whose column 0 was sampled; their first entry comes from ``sampled``.
    """
    bs, width = committed.shape
    compute_spec_logprobs(batch, verify_out, committed.reshape(-1), chain_stride=width)
    if sampled is None or not plain_rows:
        return
    logprobs = verify_out.next_token_logprobs  # [bs, W]
    for i in plain_rows:
        logprobs[i, 0] = sampled.next_token_logprobs[i]
    _overwrite_first(verify_out, sampled, plain_rows, width, "next_token_top_logprobs_val",
                     "next_token_top_logprobs_idx")  # fmt: skip
    _overwrite_first(verify_out, sampled, plain_rows, width, "next_token_token_ids_logprobs_val",
                     "next_token_token_ids_logprobs_idx")  # fmt: skip


def _overwrite_first(verify_out: LogitsProcessorOutput, sampled: LogitsProcessorOutput,
                     rows: list[int], width: int, val: str, idx: str) -> None:  # fmt: skip
    """Entry i*width of the flat lists ``val``/``idx`` becomes the sampler's entry i."""
    target_val, target_idx = getattr(verify_out, val), getattr(verify_out, idx)
    source_val, source_idx = getattr(sampled, val), getattr(sampled, idx)
    if not target_val or not source_val:
        return
    for i in rows:
        target_val[i * width], target_idx[i * width] = source_val[i], source_idx[i]
