"""verify/prompt_lookup.py: the n-gram index over a request's tokens, its drafts, and the scoring
of each proposal against what was committed after it."""

from __future__ import annotations

import random

import pytest
from sglang_vericache.verify.prompt_lookup import ContextIndex, LookupConfig, RequestLookup


def brute_force(tokens: list[int], most: int, config: LookupConfig) -> list[int]:
    """The definition: the longest suffix (max_ngram down to min_ngram) with an earlier
    occurrence; the latest such occurrence; the tokens after it."""
    t = len(tokens)
    for n in range(min(config.max_ngram, t), config.min_ngram - 1, -1):
        suffix = tokens[t - n:]
        for start in range(t - 1, n - 1, -1):  # an occurrence ending before position start
            if tokens[start - n:start] == suffix:
                return tokens[start:start + most]
    return []


def test_the_tokens_after_the_latest_earlier_occurrence_are_proposed() -> None:
    index = ContextIndex()
    index.extend([1, 2, 3, 4, 9, 8, 1, 2, 3, 4])
    assert index.propose(3) == [9, 8, 1]
    index.extend([7, 1, 2, 3, 4])  # "1 2 3 4" last occurred before 7
    assert index.propose(2) == [7, 1]
    index.check_integrity()


def test_no_repeat_no_draft_and_the_suffix_never_matches_itself() -> None:
    index = ContextIndex()
    index.extend([5, 6, 7, 8])
    assert index.propose(4) == []
    index.extend([5])  # a 1-gram match is below min_ngram
    assert index.propose(4) == []
    index.extend([6])  # "5 6" occurred at the start
    assert index.propose(4) == [7, 8, 5, 6]


@pytest.mark.parametrize("seed", range(5))
def test_index_matches_the_definition_as_it_grows(seed: int) -> None:
    rng = random.Random(seed)
    config = LookupConfig(min_ngram=2, max_ngram=4)
    index, tokens = ContextIndex(config), []
    for _ in range(300):  # a small vocabulary repeats often
        chunk = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        index.extend(chunk)
        tokens += chunk
        most = rng.randrange(1, 8)
        assert index.propose(most) == brute_force(tokens, most, config)
    index.check_integrity()


def test_a_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="min_ngram"):
        LookupConfig(min_ngram=3, max_ngram=2)


def test_each_proposal_is_scored_against_what_committed_after_it() -> None:
    lookup = RequestLookup()
    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    lookup.sync(prompt, [])
    assert lookup.propose(3) == [4, 5, 6]
    prior = lookup.alpha
    lookup.sync(prompt, [4, 5, 6, 7])  # all three accepted (censored: no rejection)
    rose = lookup.alpha
    assert rose > prior
    assert lookup.propose(3) == []  # "6 7" never occurred: nothing pending
    lookup.sync(prompt, [4, 5, 6, 7, 1])
    assert lookup.alpha == rose  # nothing was proposed: nothing scored
    lookup.sync(prompt, [4, 5, 6, 7, 1, 2])
    assert lookup.propose(2) == [3, 4]
    lookup.sync(prompt, [4, 5, 6, 7, 1, 2, 9])  # rejected at the first draft
    assert lookup.alpha < rose
    lookup.check_integrity()


def test_a_proposal_is_scored_once_whatever_commits_in_between() -> None:
    lookup = RequestLookup()
    lookup.sync([1, 2, 3, 1, 2], [])
    assert lookup.propose(4) == [3, 1, 2]
    lookup.sync([1, 2, 3, 1, 2], [3])  # a plain step: one token, the first draft right
    assert lookup.estimate.observations == 1
    lookup.sync([1, 2, 3, 1, 2], [3, 1])
    assert lookup.estimate.observations == 1
