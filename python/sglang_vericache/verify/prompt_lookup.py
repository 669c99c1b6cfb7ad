"""Prompt-lookup drafts: a request's next tokens proposed from where its own context repeats.

Agent turns quote their tool output, code edits copy the file they edit, answers restate the
document: where the last few committed tokens occurred before in the request's context (prompt
and output), the tokens that followed them then are a draft that costs no forward at all. The
full-KV verify accepts them exactly as it accepts the compressed KV's drafts (greedy rows: while
they equal its argmax), so output is unchanged; what a lookup draft saves is every draft
forward, and what it risks is one verify whose drafts are all rejected (one token, as a plain
step). ``verify/step_plan.py`` weighs both from measured acceptance.

``ContextIndex`` keeps, per n-gram length in ``[min_ngram, max_ngram]``, the position that
followed each n-gram's latest occurrence; it grows with the committed tokens (no rescan)::

    tokens:  a b c d x y a b c d   (t = 10 committed)
                      ^ after "a b c d" (n = 4) came position 4: "x y a b ..."
    propose(3) -> [x, y, a]      (the longest n that matches wins; the latest occurrence)

An n-gram is entered once the token after it exists, so the context's own suffix never matches
itself. Pure python, no torch: a few dict operations per committed token.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_vericache.verify.policy import AcceptanceConfig, AcceptanceEstimate


@dataclass(frozen=True, slots=True)
class LookupConfig:
    """min_ngram / max_ngram: the suffix lengths tried, longest first (a 1-gram matches too
    often to predict; past ~4 a match is rarely longer)."""

    min_ngram: int = 2
    max_ngram: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram: {self}")


class ContextIndex:
    """One request's tokens and the n-gram index over them (module doc). Mutated only by
    ``extend``; ``propose`` reads."""

    __slots__ = ("config", "tokens", "_follows")

    def __init__(self, config: LookupConfig = LookupConfig()) -> None:
        self.config = config
        self.tokens: list[int] = []
        # per n: n-gram -> the position after its latest occurrence (< len(tokens))
        self._follows: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(config.min_ngram, config.max_ngram + 1)}

    def extend(self, tokens: list[int]) -> None:
        """Append committed tokens; each new position indexes the n-grams that end before it."""
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending at end - 1 are now followed by `token`
            for n, index in self._follows.items():
                if end >= n:
                    index[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(token)

    def sync(self, context: list[int]) -> None:
        """Catch up with ``context``, the request's full committed token list (prompt +
        output), of which ``tokens`` is a prefix."""
        if len(context) > len(self.tokens):
            self.extend(context[len(self.tokens):])

    def propose(self, most: int) -> list[int]:
        """Up to ``most`` tokens that followed the latest earlier occurrence of the longest
        matching suffix; [] when no suffix of ``min_ngram`` or more occurred before."""
        t = len(self.tokens)
        for n in range(min(self.config.max_ngram, t), self.config.min_ngram - 1, -1):
            start = self._follows[n].get(tuple(self.tokens[t - n:]))
            if start is not None:
                return self.tokens[start:start + most]
        return []

    def check_integrity(self) -> None:
        t = len(self.tokens)
        for n, index in self._follows.items():
            for gram, start in index.items():
                assert len(gram) == n and n <= start < t, (n, gram, start, t)
                assert tuple(self.tokens[start - n:start]) == gram


# Before a request's first lookup verify: about what prompt lookup accepts on text that repeats
# its context, and a weight of one trial, so the first step's shadow scoring decides
LOOKUP_ACCEPTANCE = AcceptanceConfig(prior_alpha=0.5)


class RequestLookup:
    """One greedy request's lookup drafts: its ``ContextIndex``, the proposal of the step in
    flight, and the estimate of how much of a proposal the verify accepts.

    Every step's proposal is scored once the tokens that step committed are known, whichever
    proposer the step used: greedy acceptance is the longest prefix of a proposal equal to the
    tokens committed after it, so a proposal no verify saw is scored exactly as one it did, and
    an estimate that fell while lookup lost keeps learning while the compressed KV drafts::

        proposed at t:   [x y z w]
        committed after: [x y q]       -> 2 of 3 accepted (a rejection at the third)
        committed after: [x y]         -> 2 of 2 (censored: no rejection seen)
    """

    __slots__ = ("index", "estimate", "_pending", "_proposed_at")

    def __init__(self, config: LookupConfig = LookupConfig()) -> None:
        self.index = ContextIndex(config)
        self.estimate = AcceptanceEstimate(LOOKUP_ACCEPTANCE)
        self._pending: list[int] = []
        self._proposed_at = 0

    @property
    def alpha(self) -> float:
        return self.estimate.alpha

    def sync(self, prompt: list[int], output: list[int]) -> None:
        """Catch the index up with the request's committed ``prompt + output`` and score the
        pending proposal against what was committed after it."""
        have = len(self.index.tokens)
        if have < len(prompt):
            self.index.extend(prompt[have:])
            have = len(prompt)
        self.index.extend(output[have - len(prompt):])
        if self._pending and len(self.index.tokens) > self._proposed_at:
            after = self.index.tokens[self._proposed_at:self._proposed_at + len(self._pending)]
            matched = next((k for k, (p, c) in enumerate(zip(self._pending, after)) if p != c),
                           len(after))  # fmt: skip
            self.estimate.update(len(after), matched)
            self._pending = []

    def propose(self, most: int) -> list[int]:
        """Up to ``most`` drafts after the committed tokens (``ContextIndex.propose``), kept to
        be scored at the next ``sync``."""
        self._pending = self.index.propose(most)
        self._proposed_at = len(self.index.tokens)
        return self._pending

    def check_integrity(self) -> None:
        self.index.check_integrity()
        self.estimate.check_integrity()
        assert self._proposed_at <= len(self.index.tokens)
