"""Greedy chain acceptance on token tensors (pure torch, no sglang).

A verify row is ``[last committed token, d_1 .. d_n, padding]`` of width ``D``;
the verify forward over the full KV predicts, at every position ``j``, the
token that follows it: ``p_0 .. p_{D-1}``. Draft ``d_{j+1}`` is correct iff it
equals ``p_j``. The committed tokens are ``p_0 .. p_k`` where ``k`` is the
number of leading correct drafts: the accepted drafts (which equal
``p_0 .. p_{k-1}``) followed by the correction (first mismatch) or the bonus
token (every draft matched). So the committed tokens are always a prefix of
the verifier's predictions, and greedy output equals full-KV decoding.

Rows may carry fewer real drafts than ``D - 1`` (plain rows, a grammar chain cut
at termination): ``draft_lens`` says how many; whatever sits after them
is never read as a draft, whatever its value (so no padding sentinel).

A row's last draft may end the row (it terminates the row's grammar,
``verify/grammar_chain.py``): :func:`stop_at_last_draft` then commits that
draft, when accepted, as the row's last token, with no bonus after it. A
committed stop token (EOS, ``stop_token_ids``) ends its row too:
:func:`stop_at_first_stop_token` commits nothing after it, as plain decoding
would not have produced it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AcceptResult", "greedy_accept", "stop_at_first_stop_token", "stop_at_last_draft"]


@dataclass(frozen=True, slots=True)
class AcceptResult:
    """Outcome of greedy verification for a batch of ``bs`` chain drafts.

    accept_lens: [bs] int32, committed tokens per row including the
        correction/bonus token; always in ``[1, draft_lens[i] + 1]``. This is
        SGLang's ``GenerationBatchResult.accept_lens``.
    committed: [bs, D] same integer dtype as ``predict``; row ``i``'s first
        ``accept_lens[i]`` entries are the committed tokens in order; entries
        after them are the verifier's predictions at rejected positions and
        must not be emitted (SGLang reads only the prefix). ``committed``
        is ``predict`` itself (no copy).
    bonus: [bs] bool, every real draft of the row was accepted and a bonus
        token follows them (False: the last committed token is a correction, or
        the row's last draft, which ended it: :func:`stop_at_last_draft`).
    """

    accept_lens: torch.Tensor
    committed: torch.Tensor
    bonus: torch.Tensor

    @property
    def accepted_drafts(self) -> torch.Tensor:
        """[bs] int32: drafts accepted per row (``accept_lens - 1``)."""
        return self.accept_lens - 1

    def committed_mask(self) -> torch.Tensor:
        """[bs, D] bool: True at positions holding committed tokens."""
        width = self.committed.shape[1]
        pos = torch.arange(width, device=self.committed.device)
        return pos.unsqueeze(0) < self.accept_lens.unsqueeze(1)

    def row_tokens(self, row: int) -> list[int]:
        """Committed tokens of one row as python ints (for tests, logging)."""
        n = int(self.accept_lens[row])
        return [int(t) for t in self.committed[row, :n].tolist()]


def _check_integer(name: str, t: torch.Tensor) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")


def greedy_accept(
    verify_tokens: torch.Tensor,
    predict: torch.Tensor,
    draft_lens: torch.Tensor | None = None,
) -> AcceptResult:
    """Accept the longest prefix of each draft that the verifier agrees with.

    verify_tokens: [bs, D] integer, the verify input rows: column 0 is the
        last committed token, columns ``1 .. draft_lens[i]`` the drafts.
    predict: [bs, D] integer, the verifier's greedy prediction at each
        position (``argmax`` of the TARGET_VERIFY logits reshaped to
        ``[bs, D]``), same device as ``verify_tokens``.
    draft_lens: [bs] integer, real drafts per row, each in ``[0, D - 1]``;
        ``None`` means every row carries ``D - 1`` drafts.

    Returns an :class:`AcceptResult`; inputs are not modified. Raises
    ``ValueError`` on shape mismatch or out-of-range ``draft_lens``.
    """
    if verify_tokens.dim() != 2 or verify_tokens.shape != predict.shape:
        raise ValueError(
            f"verify_tokens {tuple(verify_tokens.shape)} and predict "
            f"{tuple(predict.shape)} must both be [bs, D]"
        )
    _check_integer("verify_tokens", verify_tokens)
    _check_integer("predict", predict)
    bs, width = verify_tokens.shape
    if width < 1:
        raise ValueError("verify width D must be >= 1 (the last committed token)")
    device = verify_tokens.device
    if draft_lens is None:
        lens = torch.full((bs,), width - 1, dtype=torch.int32, device=device)
    else:
        _check_integer("draft_lens", draft_lens)
        if draft_lens.shape != (bs,):
            raise ValueError(f"draft_lens must be [{bs}], got {tuple(draft_lens.shape)}")
        if bs and (int(draft_lens.min()) < 0 or int(draft_lens.max()) > width - 1):
            raise ValueError(f"draft_lens must lie in [0, {width - 1}]")
        lens = draft_lens.to(device=device, dtype=torch.int32)
    # match[i, j]: draft j+1 equals the verifier's prediction after position j,
    # and is a real draft of the row (j < draft_lens[i]).
    match = predict[:, : width - 1] == verify_tokens[:, 1:]
    real = torch.arange(width - 1, device=device).unsqueeze(0) < lens.unsqueeze(1)
    leading = (match & real).to(torch.int32).cumprod(dim=1).sum(dim=1, dtype=torch.int32)
    accept_lens = (leading + 1).to(torch.int32)
    return AcceptResult(accept_lens=accept_lens, committed=predict, bonus=leading == lens)


def stop_at_last_draft(result: AcceptResult, stops: torch.Tensor) -> AcceptResult:
    """``result`` with the rows whose last real draft ends them committing no bonus after it.

    stops: [bs] bool, True where the row's last real draft (column ``draft_lens[i]``) ends the
        row: a token after it would be dropped (SGLang keeps no speculative token past a
        grammar's termination), so it must not be committed or counted in ``accept_lens``.
    Where such a row accepted every draft (``bonus``), the stopping draft is its last
        committed token: ``accept_lens`` one less, ``bonus`` False (a row without drafts
        commits its one token whatever ``stops`` says). The tokens up to the stop are
        unchanged, so a row's committed sequence up to it keeps its distribution (greedy: the
        argmax chain; sampled: every draft passed speculative sampling's test) and the next
        step samples what follows, as plain decoding does. Other rows are unchanged. Inputs
        are not modified; ``committed`` is shared.
    """
    if stops.shape != result.bonus.shape or stops.dtype != torch.bool:
        raise ValueError(f"stops must be {tuple(result.bonus.shape)} bool, got "
                         f"{tuple(stops.shape)} {stops.dtype}")  # fmt: skip
    # accept_lens > 1: a row without drafts has no stopping draft (its one token is p's)
    stopped = result.bonus & stops.to(result.bonus.device) & (result.accept_lens > 1)
    return AcceptResult(accept_lens=result.accept_lens - stopped.to(result.accept_lens.dtype),
                        committed=result.committed, bonus=result.bonus & ~stopped)  # fmt: skip


def stop_at_first_stop_token(result: AcceptResult, stop_ids: list[frozenset[int]]) -> AcceptResult:
    """``result`` with every row cut after its first committed stop token (kept, no bonus).

    stop_ids: one set per row, the token ids that finish that row (empty: none, e.g.
        ``ignore_eos``). Plain decoding finishes a row at its stop token, so a verify must not
        commit what follows it: SGLang's finish check of a multi-token step looks for stop
        strings before stop tokens, so a stop string completed by a token *after* the EOS
        would end the row there, with the EOS and that token in its output. The tokens up to
        the stop are unchanged (greedy: the argmax chain; sampled: every one passed its test).
        Inputs are not modified; ``committed`` is shared.
    """
    if len(stop_ids) != result.accept_lens.shape[0]:
        raise ValueError(f"stop_ids must have {result.accept_lens.shape[0]} rows, "
                         f"got {len(stop_ids)}")  # fmt: skip
    if not any(stop_ids):
        return result
    lens = result.accept_lens.tolist()
    width = max(lens, default=0)
    tokens = result.committed[:, :width].tolist()
    cut = list(lens)
    for i, (ids, n) in enumerate(zip(stop_ids, lens)):
        if ids:
            cut[i] = next((j + 1 for j, t in enumerate(tokens[i][:n]) if t in ids), n)
    if cut == lens:
        return result
    new_lens = torch.tensor(cut, dtype=result.accept_lens.dtype, device=result.accept_lens.device)
    return AcceptResult(accept_lens=new_lens, committed=result.committed,
                        bonus=result.bonus & (new_lens == result.accept_lens))  # fmt: skip
