"""Token-level comparison of a candidate run against a reference run (pure python).

A divergence is the first position where the two greedy outputs differ, including one output
ending (EOS, stop) where the other goes on. Where the reference recorded its top-2 log-probs at
that position, the report carries the top-1/top-2 margin: a flip at a margin of ~1e-6 is a
floating-point near-tie, a flip at a margin of 5 is a bug.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence


@dataclass(frozen=True, slots=True)
class Generation:
    """One prompt's output. ``top2[i]`` is ``((logprob, token), (logprob, token))`` at step i."""

    output_ids: tuple[int, ...]
    top2: tuple[tuple[tuple[float, int], ...], ...] | None = None


@dataclass(frozen=True, slots=True)
class PromptResult:
    id: str
    identical: bool
    reference_len: int
    candidate_len: int
    first_divergence: int | None = None
    reference_token: int | None = None  # None: the reference had ended there
    candidate_token: int | None = None  # None: the candidate had ended there
    reference_margin: float | None = None  # top-1 minus top-2 log-prob at the divergence


def first_divergence(ref: Sequence[int], cand: Sequence[int]) -> int | None:
    """Index of the first differing position, or None if the sequences are equal."""
    for i, (a, b) in enumerate(zip(ref, cand)):
        if a != b:
            return i
    return None if len(ref) == len(cand) else min(len(ref), len(cand))


def _margin(ref: Generation, pos: int) -> float | None:
    if ref.top2 is None or pos >= len(ref.top2) or len(ref.top2[pos]) < 2:
        return None
    (lp1, _), (lp2, _) = ref.top2[pos][0], ref.top2[pos][1]
    return float(lp1 - lp2)


def compare(prompt_id: str, ref: Generation, cand: Generation) -> PromptResult:
    pos = first_divergence(ref.output_ids, cand.output_ids)
    lens = dict(reference_len=len(ref.output_ids), candidate_len=len(cand.output_ids))
    if pos is None:
        return PromptResult(prompt_id, True, **lens)
    at = lambda ids: ids[pos] if pos < len(ids) else None  # noqa: E731
    return PromptResult(
        prompt_id,
        False,
        **lens,
        first_divergence=pos,
        reference_token=at(ref.output_ids),
        candidate_token=at(cand.output_ids),
        reference_margin=_margin(ref, pos),
    )


def summarize(results: Sequence[PromptResult], **context: Any) -> dict[str, Any]:
    """The JSON summary the harness prints: context, per-prompt results and totals."""
    divergent = [r for r in results if not r.identical]
    margins = [r.reference_margin for r in divergent if r.reference_margin is not None]
    return {
        **context,
        "total": len(results),
        "identical": len(results) - len(divergent),
        "divergent": len(divergent),
        "min_divergence_margin": min(margins) if margins else None,
        "status": "identical" if not divergent else "divergent",
        "prompts": [asdict(r) for r in results],
    }
