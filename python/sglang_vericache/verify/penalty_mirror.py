"""One greedy request's repetition / frequency / presence penalties along a draft chain.

SGLang's penalizers (``sglang.srt.sampling.penaltylib``) keep per row a state that learns one
token per decode step, and the model worker's sampler adds what they accumulate to the logits
(``SamplingBatchInfo.update_penalties``: ``acc_additive`` = 0 - frequency counts - presence
marks, ``acc_scaling`` = the repetition factors)::

    frequency   cum_f[t] += f       per token t learned     (float32, one add per token)
    presence    cum_p[t]  = p
    repetition  cum_r[t]  = r       (ones elsewhere; logits < 0 multiplied, others divided)

A verify column j of a drafted row is the position after j drafts, whose penalties plain
decoding would compute after learning j more tokens. ``PenaltyMirror`` holds the same state,
built with the same float32 operations in the same order, so the state after any tokens is bit
for bit SGLang's; the decode step checks it against SGLang's own accumulation at column 0 every
step before it trusts the later columns (``srt/decode/penalized_rows.py``).

Which tokens a row learns, and when, is SGLang's scheduler's rule (``srt/hooks/penalties.py``):
the feed stream F, of which a row with k output tokens has learned F[0 .. k-1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PenaltyParams:
    """A request's penalties (SGLang's ``SamplingParams`` fields; 0, 0, 1: none)."""

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0


class PenaltyMirror:
    """A copy of one row's penalizer state (module doc): ``learn`` mutates, ``additive`` /
    ``scaling`` read. ``learned`` counts the feed stream's tokens it holds."""

    __slots__ = ("params", "vocab", "device", "learned", "_freq", "_pres", "_rep")

    def __init__(self, params: PenaltyParams, vocab: int, device: torch.device | str = "cpu"):
        self.params, self.vocab, self.device, self.learned = params, vocab, device, 0
        zeros = lambda: torch.zeros(vocab, dtype=torch.float32, device=device)  # noqa: E731
        self._freq = zeros() if params.frequency else None  # None: all zeros, never changes
        self._pres = zeros() if params.presence else None
        self._rep = torch.ones(vocab, dtype=torch.float32, device=device) \
            if params.repetition != 1.0 else None  # fmt: skip

    def learn(self, tokens: list[int]) -> None:
        """Learn ``tokens`` one at a time, as one decode step each would."""
        f = torch.tensor(self.params.frequency, dtype=torch.float32)
        for t in tokens:
            if self._freq is not None:
                self._freq[t] += f  # scatter_add_ of one float32 value per step
            if self._pres is not None:
                self._pres[t] = self.params.presence
            if self._rep is not None:
                self._rep[t] = self.params.repetition
        self.learned += len(tokens)

    def copy(self) -> PenaltyMirror:
        other = PenaltyMirror.__new__(PenaltyMirror)
        other.params, other.vocab, other.device = self.params, self.vocab, self.device
        other.learned = self.learned
        other._freq, other._pres, other._rep = (None if x is None else x.clone()
                                                for x in (self._freq, self._pres, self._rep))
        return other

    def additive(self) -> torch.Tensor:
        """[V] float32: what SGLang's ``acc_additive_penalties`` row holds for this state."""
        acc = torch.zeros(self.vocab, dtype=torch.float32, device=self.device)
        for state in (self._freq, self._pres):
            if state is not None:
                acc.sub_(state)
        return acc

    def scaling(self) -> torch.Tensor | None:
        """[V] float32: SGLang's ``acc_scaling_penalties`` row (None: no repetition penalty)."""
        return None if self._rep is None else self._rep.clone()

    def check_integrity(self) -> None:
        assert self.learned >= 0
        if self._freq is not None:
            assert bool((self._freq * (1 if self.params.frequency > 0 else -1) >= 0).all())
        if self._rep is not None:
            assert bool(((self._rep == 1.0) | (self._rep == self.params.repetition)).all())
