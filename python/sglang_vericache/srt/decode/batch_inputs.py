"""The worker's own forwards over one SGLang batch: rewriting its inputs in place.

Per scheduler step the worker runs several forwards over the same ``ModelWorkerBatch``: x
single-token DECODE forwards that draft, then one TARGET_VERIFY forward of width x+1. Each
sets the batch's input ids, positions (through ``seq_lens`` or the verify input) and output
slots; SGLang's model runner reads nothing else of the batch for these modes::

    row r: committed KV at positions 0 .. base[r]-1, last committed token t0 (no KV yet)
    draft j  (j = 0 .. x-1): input rows[r, j] at position base+j, attends to [0, base+j],
                             writes slot table[r, base+j]
    verify:  inputs rows[r, 0..x] at positions base .. base+x, writes slots table[r, base..base+x]

``table`` is SGLang's req_to_token [pool rows, max context] int32; ``base`` is [bs] int64 on
the host. ``spec_result`` packs a step's outcome the way SGLang's spec result path reads it.
"""

from __future__ import annotations

import torch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative.ngram_info import NgramVerifyInput


def set_decode_inputs(batch, table: torch.Tensor, input_ids: torch.Tensor, base: torch.Tensor,
                      offset: int) -> None:  # fmt: skip
    """One token per row (input_ids [bs] int64) at position base+offset."""
    device = table.device
    seq = base + offset + 1
    batch.forward_mode = ForwardMode.DECODE
    batch.spec_info = None
    batch.input_ids = input_ids
    batch.out_cache_loc = table[batch.req_pool_indices, (base + offset).to(device)].to(torch.int64)
    batch.seq_lens = seq.to(device)
    batch.seq_lens_cpu = seq
    batch.seq_lens_sum = int(seq.sum())


def set_verify_inputs(batch, table: torch.Tensor, rows: torch.Tensor, base: torch.Tensor,
                      kept: torch.Tensor | None = None) -> None:  # fmt: skip
    """rows [bs, width] int64 (last committed token, then the drafts) at positions base..;
    ``kept`` (``live_index``): the flat [bs * width] columns that go into the forward (each
    row's 1 + drafts; None: all). A row's columns past its drafts would pad the width through
    every layer for logits nobody reads, so the forward takes the rows ragged::

        rows     [t0 a b c | t0 - - - | t0 x y -]     live 4, 1, 3 of width 4
        forward  [t0 a b c   t0         t0 x y  ]     8 tokens, not 12
    """
    device = table.device
    width = rows.shape[1]
    positions = base.to(device)[:, None] + torch.arange(width, device=device)[None, :]
    tokens, positions = rows.flatten(), positions.flatten()
    slots = table[batch.req_pool_indices[:, None], positions.view(-1, width)].flatten().long()
    if kept is not None:
        tokens, positions, slots = tokens[kept], positions[kept], slots[kept]
    batch.forward_mode = ForwardMode.TARGET_VERIFY
    batch.input_ids = tokens
    batch.out_cache_loc = slots
    batch.seq_lens, batch.seq_lens_cpu = base.to(device), base
    batch.seq_lens_sum = int(base.sum())
    batch.spec_info = NgramVerifyInput(
        draft_token=tokens, positions=positions, draft_token_num=width,
        new_seq_lens=batch.seq_lens,
    )  # fmt: skip


def live_index(live: list[int], width: int, device) -> torch.Tensor | None:
    """The flat [bs * width] columns of rows with ``live[i]`` columns each (1 + drafts), as
    an int64 index; None when every row fills the width."""
    if all(n == width for n in live):
        return None
    return torch.tensor([i * width + j for i, n in enumerate(live) for j in range(n)],
                        dtype=torch.int64, device=device)  # fmt: skip


def spread_rows(ragged: torch.Tensor, kept: torch.Tensor, total: int) -> torch.Tensor:
    """[len(kept), ...] -> [total, ...]: a ragged forward's per-token outputs at their columns
    of the full width (``kept``), zeros at the padding, which no acceptance reads."""
    out = ragged.new_zeros(total, *ragged.shape[1:])
    out[kept] = ragged
    return out


def spread_verify_output(logits_output, kept: torch.Tensor, total: int) -> None:
    """A ragged verify's logits (and hidden states, where captured) spread in place to the
    [bs * width, ...] layout of a full-width verify (``spread_rows``)."""
    logits_output.next_token_logits = spread_rows(logits_output.next_token_logits, kept, total)
    if logits_output.hidden_states is not None:
        logits_output.hidden_states = spread_rows(logits_output.hidden_states, kept, total)


def last_tokens(batch, device: torch.device) -> torch.Tensor:
    """Each request's last committed token (its prompt's last before any output): [bs] int64."""
    last = [r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1] for r in batch.reqs]
    return torch.tensor(last, dtype=torch.int64, device=device)


def one_token_rows(out, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-token decode forward's output in the spec layout: tokens [bs * width] int64 (each
    row's token first, then padding) and accept_lens [bs] int32 ones. Rewrites the output the
    way SGLang's spec result path reads it: ``next_token_logprobs`` [bs] -> [bs, 1] (tokens this
    step per row), ``hidden_states`` [bs, H] -> [bs * width, H] (``strided_rows``)."""
    bs = out.next_token_ids.shape[0]
    device = out.next_token_ids.device
    tokens = strided_rows(out.next_token_ids.to(torch.int64), width)
    logits_output = out.logits_output
    if logits_output.next_token_logprobs is not None:
        logits_output.next_token_logprobs = logits_output.next_token_logprobs.view(bs, 1)
    if logits_output.hidden_states is not None:
        logits_output.hidden_states = strided_rows(logits_output.hidden_states, width)
    return tokens, torch.ones(bs, dtype=torch.int32, device=device)


def strided_rows(per_row: torch.Tensor, width: int) -> torch.Tensor:
    """[bs, ...] -> [bs * width, ...]: row i at i * width, zeros after it.

    SGLang's spec result path reads a row's outputs of a step at ``i * stride`` onwards (stride:
    the result's ``speculative_num_draft_tokens``), one entry per committed token; a one-token
    step commits one, so only the first entry of each row is read."""
    out = per_row.new_zeros(per_row.shape[0], width, *per_row.shape[1:])
    out[:, 0] = per_row
    return out.flatten(0, 1)


def spec_result(batch, width: int, next_token_ids: torch.Tensor, accept_lens: torch.Tensor,
                new_seq_lens: torch.Tensor, logits_output) -> GenerationBatchResult:  # fmt: skip
    """A step's result in SGLang's spec (V2) layout.

    next_token_ids: [bs * width] int64, row i's committed tokens first, then padding; width is
        the allocated verify width (``--speculative-num-draft-tokens``), SGLang's output stride.
    accept_lens: [bs] int32 committed tokens per row (>= 1); new_seq_lens: [bs] KV lengths after.
    """
    bs = len(batch.reqs)
    device = next_token_ids.device
    relay = next_token_ids if next_token_ids.numel() == bs * width else torch.zeros(
        bs * width, dtype=torch.int64, device=device)  # fmt: skip
    return GenerationBatchResult(
        logits_output=logits_output,
        next_token_ids=next_token_ids,
        accept_lens=accept_lens,
        new_seq_lens=new_seq_lens,
        next_draft_input=NgramVerifyInput(
            draft_token_num=width, new_seq_lens=new_seq_lens, accept_tokens=relay,
            accept_lens=accept_lens,
        ),  # fmt: skip
        speculative_num_draft_tokens=width,
    )


def lookup_tensor(lookup: dict[int, list[int]], rows: torch.Tensor,
                  drafts: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A lookup step's drafts for ``DraftChain.propose``: ([bs, drafts] int64, [bs] int32 draft
    lengths), each row's lookup draft cut to ``drafts`` and padded with its last token (rows
    without one: length 0, all padding; ``rows``: the chain's [bs, W] rows, column 0 set)."""
    bs = rows.shape[0]
    tokens = rows[:, :1].expand(bs, drafts).clone()
    lens = torch.zeros(bs, dtype=torch.int32)
    for i, draft in lookup.items():
        n = min(len(draft), drafts)
        if n:
            tokens[i, :n] = torch.tensor(draft[:n], dtype=torch.int64)
            lens[i] = n
    return tokens, lens.to(rows.device)
