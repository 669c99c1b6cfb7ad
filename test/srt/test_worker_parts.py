"""The worker's pure parts: compressed per-request state, plain-decoding rules, the patches."""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.compress import build_compressor

pytestmark = pytest.mark.sglang

H_KV, H_Q, D, LAYERS, T = 2, 4, 16, 3, 80


@pytest.fixture
def pool() -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """A KV pool laid out like SGLang's: per layer [slots, H_kv, D] keys and values."""
    g = torch.Generator().manual_seed(0)
    return {layer: (torch.randn(512, H_KV, D, generator=g), torch.randn(512, H_KV, D, generator=g))
            for layer in range(LAYERS)}  # fmt: skip


class LayerPool:
    """The two accessors of SGLang's MHATokenToKVPool that the worker reads through."""

    def __init__(self, pool) -> None:
        self.pool = pool

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.pool[layer][0]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.pool[layer][1]


def reader(pool):
    from sglang_vericache.srt.kv.offload import read_pool_kv

    return lambda layer, slots: read_pool_kv(LayerPool(pool), layer, slots)


def layer_reader(pool, slots):
    """layer -> full (K, V) of ``slots``, as the worker reads a row's committed prefix."""
    read = reader(pool)
    return lambda layer: read(layer, slots)


@pytest.mark.parametrize("spec", ["kivi:bits=4", "streaming:sink=4,window=28",
                                  "snapkv:ratio=0.5+kivi:bits=2"])  # fmt: skip
def test_state_builds_grows_and_stays_in_step(pool, spec: str) -> None:
    from sglang_vericache.srt.kv.draft_state import RequestDraftState

    slots = torch.randperm(200)[:T]
    queries = [torch.randn(H_Q, 8, D) for _ in range(LAYERS)]
    state = RequestDraftState.build(build_compressor(spec), layer_reader(pool, slots), T, queries,
                                    LAYERS)  # fmt: skip
    state.check_integrity()
    assert state.covered == T
    full_bytes = LAYERS * 2 * T * H_KV * D * 4
    assert state.nbytes < full_bytes  # the compressed copy is really smaller
    views = state.views()
    assert len(views) == LAYERS and views[0][0].shape[0] == H_KV
    assert state.view_tokens == views[0][0].shape[1]
    for step in range(5):  # commits of 1..5 tokens, with their verify queries
        n = step + 1
        new = torch.arange(100 + 10 * step, 100 + 10 * step + n)
        state.append(reader(pool), new, [torch.randn(H_Q, n, D) for _ in range(LAYERS)])
        state.check_integrity()
    assert state.covered == T + 15
    assert state.views()[0][0].shape[1] == state.view_tokens  # built on read, never stale


def test_identity_compressor_view_is_the_full_kv(pool) -> None:
    from sglang_vericache.srt.kv.draft_state import RequestDraftState

    slots = torch.arange(T)
    state = RequestDraftState.build(build_compressor("full"), layer_reader(pool, slots), T,
                                    [None] * LAYERS, LAYERS)  # fmt: skip
    k, v = state.views()[1]
    assert torch.equal(k, pool[1][0][slots].transpose(0, 1))
    assert torch.equal(v, pool[1][1][slots].transpose(0, 1))


def _req(**sampling):
    from types import SimpleNamespace

    from sglang.srt.sampling.sampling_params import SamplingParams

    sp = SamplingParams(**sampling)
    sp.verify(vocab_size=1000)  # normalizes temperature 0 into greedy top_k=1
    return SimpleNamespace(sampling_params=sp, return_logprob=False, grammar=None,
                           custom_logit_processor=None)  # fmt: skip


@pytest.mark.parametrize(
    "sampling, mode, reason",
    [
        ({"temperature": 0}, "greedy", None),
        ({"temperature": 0.7, "top_k": 1}, "greedy", None),  # SGLang takes the argmax too
        ({"temperature": 0.7}, "sampled", None),
        ({"temperature": 1.0, "top_p": 0.9}, "sampled", None),
        ({"temperature": 0.5, "top_k": 20, "min_p": 0.05}, "sampled", None),
        # a greedy row's penalties are mirrored along its draft chain (penalized_rows.py)
        ({"temperature": 0, "repetition_penalty": 1.2}, "greedy", None),
        ({"temperature": 0.7, "frequency_penalty": 0.5}, "plain", "penalties"),
        ({"temperature": 0.7, "logit_bias": {"5": 2.0}}, "plain", "logit processing"),
        ({"temperature": 0, "min_new_tokens": 4}, "plain", "logit processing"),
    ],
)
def test_each_row_decodes_greedy_sampled_or_plain(sampling: dict, mode: str,
                                                  reason: str | None) -> None:  # fmt: skip
    from sglang_vericache.srt.decode.eligibility import decode_mode, plain_reason

    req = _req(**sampling)
    got = plain_reason(req)
    assert (got is None) if reason is None else (reason in got)
    assert decode_mode(req).value == mode


def test_grammar_rows_draft_when_their_backend_rolls_back_and_step_rows_split_a_batch() -> None:
    from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject
    from sglang_vericache.srt.decode.eligibility import StepRows, plain_reason

    class RollsBack(BaseGrammarObject):  # xgrammar, llguidance
        def rollback(self, k: int) -> None:
            pass

    class Outlines(BaseGrammarObject):  # no rollback: cannot follow a draft chain
        pass

    drafted, plain = _req(temperature=0.7), _req(temperature=0)
    drafted.grammar, plain.grammar = RollsBack(), Outlines()
    assert plain_reason(drafted) is None and "rollback" in plain_reason(plain)
    batch = [_req(temperature=0), drafted, _req(temperature=0.7), _req(presence_penalty=0.5),
             plain]  # fmt: skip
    step = StepRows.of(batch)
    assert (step.drafted, step.sampled, step.plain) == ([0, 1, 2], [1, 2], [3, 4])
    assert step.grammar == [1]
    assert StepRows.of(batch, drafting=False).plain == [0, 1, 2, 3, 4]
    # demoted rows decode plainly; the greedy ones without grammar or penalties may still
    # take prompt-lookup drafts (their own context needs no compressed KV)
    batch.insert(1, _req(temperature=0, repetition_penalty=1.2))
    step = StepRows.of(batch).without({0, 1, 2, 3})
    assert (step.drafted, step.demoted, step.lookup_only) == ([], [0, 1, 2, 3], [0])
    assert StepRows.of(batch).without({0}).lookup_rows == [0, 1]  # row 1's penalties mirrored
    assert step.plain == [0, 1, 2, 3, 4, 5] and step.takes_lookup  # demoted: none sampled
    assert StepRows.of(batch).without({0}).takes_lookup is False  # rows 2, 3 draw from q
    assert StepRows.of([_req(temperature=0), _req(presence_penalty=0.5)]).without(
        {0}).takes_lookup  # plain rows ride along in a lookup step
    batch[0].return_hidden_states = True
    assert StepRows.of(batch).drafted == []
    assert StepRows.of(batch).without({0, 1}).lookup_only == []  # the whole step is plain


def test_logprob_requests_are_drafted_and_hidden_states_make_the_step_plain() -> None:
    from sglang_vericache.srt.decode.eligibility import plain_reason, whole_step_reason

    req = _req(temperature=0)
    req.return_logprob = True  # served from the verify logits
    assert plain_reason(req) is None and whole_step_reason(req) is None
    req.return_hidden_states = True
    assert "hidden states" in whole_step_reason(req)


@pytest.mark.parametrize("overlapped, output, start, want", [
    (False, [5, 6, 7], 2, [7]),       # synchronous: a step learns the newest token
    (True, [5, 6, 7], 2, [6]),        # overlapped: one token behind
    (True, [5], 0, [99]),             # overlapped first decode: the prompt's last token
    (False, [5], 0, [5]),
    (True, [5, 6, 7, 8], 1, [5, 6, 7]),   # after a verify that committed three
    (False, [5, 6, 7, 8], 1, [6, 7, 8]),
])  # fmt: skip
def test_penalizers_learn_what_plain_sglang_would_feed(overlapped, output, start, want) -> None:
    from sglang_vericache.srt.hooks.penalties import feed_stream

    assert feed_stream(output, [1, 2, 99], overlapped, start, len(output)) == want


def test_torch_row_assignment_matches_the_kernel_contract() -> None:
    from sglang_vericache.srt.hooks.patches import assign_rows_torch

    table = torch.zeros(4, 10, dtype=torch.int32)
    rows, start, end = torch.tensor([2, 0]), torch.tensor([3, 0]), torch.tensor([6, 2])
    locs = torch.tensor([11, 12, 13, 21, 22])
    assign_rows_torch(rows, table, start, end, locs)
    assert table[2, 3:6].tolist() == [11, 12, 13] and table[0, 0:2].tolist() == [21, 22]
    assert int(table.count_nonzero()) == 5


def test_meta_info_hook_keeps_the_latest_counters_only() -> None:
    from sglang_vericache.srt.hooks.patches import META_INFO_KEY, _meta_info_around

    calls = []
    meta: dict = {}
    _meta_info_around(lambda *a: calls.append(a), meta, None, META_INFO_KEY,
                      [{"committed": 3}, {"committed": 7}])  # fmt: skip
    assert meta == {META_INFO_KEY: {"committed": 7}} and not calls
    _meta_info_around(lambda *a: calls.append(a), meta, None, "other", [1])
    assert len(calls) == 1  # other keys keep SGLang's behaviour


@pytest.mark.parametrize("spec", ["snapkv:ratio=0.5", "kivi:bits=4", "streaming:sink=4,window=28"])
def test_catching_up_equals_appending_token_by_token(pool, spec: str) -> None:
    """Plain steps leave a state behind; one catch-up from the full KV leaves it exactly where
    appending each plain step's token would have (the caches do not depend on chunking). Its
    folds score by the prompt's queries (plain steps bring none: a scorer used to raise)."""
    from sglang_vericache.srt.kv.draft_state import FOLD_EVERY, RECENT_WINDOW, RequestDraftState

    compressor = build_compressor(spec)
    queries = [torch.randn(H_Q, 8, D) for _ in range(LAYERS)]
    build = lambda: RequestDraftState.build(compressor, layer_reader(pool, torch.arange(T)), T,  # noqa: E731
                                            queries, LAYERS)  # fmt: skip
    stepwise, lazy = build(), build()
    n = RECENT_WINDOW + 2 * FOLD_EVERY + 6  # plain steps' tokens: enough to fold twice
    extra = torch.arange(100, 100 + n)
    for slot in extra:
        stepwise.append(reader(pool), slot[None], [None] * LAYERS)
    assert all(cache.version == 2 for cache in stepwise.layers)
    behind = RequestDraftState.in_step(lazy, None, compressor, None, T + n, LAYERS, None)
    assert behind is lazy and lazy.covered == T  # behind is fine: it catches up before drafting
    read = reader(pool)
    assert lazy.catch_up(lambda layer: read(layer, extra), T + n) == n
    assert lazy.covered == stepwise.covered == T + n and lazy.catch_up(None, T + n) == 0
    lazy.check_integrity()
    for (ka, va), (kb, vb) in zip(lazy.views(), stepwise.views()):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("spec", ["snapkv:ratio=0.5", "kivi:bits=4", "streaming:sink=4,window=28"])
def test_a_stored_prefix_seeds_a_new_state_and_stays_as_it_was(pool, spec: str) -> None:
    """A later turn's state starts from a copy of a stored one (``from_prefix``): positions
    past the stored tokens are dropped from the copy, the rest of the prompt is appended with
    its queries, and the result equals building the stored state then appending the same
    positions. Two copies grown differently never touch each other or the stored state (a
    dropper's view buffer is written in place past its view)."""
    from sglang_vericache.srt.kv.draft_state import RequestDraftState

    compressor = build_compressor(spec)
    queries = [torch.randn(H_Q, 8, D) for _ in range(LAYERS)]
    read = reader(pool)
    stored = RequestDraftState.build(compressor, layer_reader(pool, torch.arange(T)), T, queries,
                                     LAYERS)  # fmt: skip
    stored.catch_up(lambda layer: read(layer, torch.arange(T, T + 3)), T + 3)  # 3 past the end
    before = [tuple(x.clone() for x in view) for view in stored.views()]

    new_q = [torch.randn(H_Q, 8, D) for _ in range(LAYERS)]
    seeded = RequestDraftState.from_prefix(
        stored, 3, lambda layer: read(layer, torch.arange(T, T + 60)), T + 60, new_q)
    other = RequestDraftState.from_prefix(
        stored, 3, lambda layer: read(layer, torch.arange(120, 122)), T + 2, new_q)  # in place
    seeded.check_integrity()
    other.check_integrity()
    assert (seeded.covered, seeded.reused, other.covered) == (T + 60, T, T + 2)

    expected = RequestDraftState.build(compressor, layer_reader(pool, torch.arange(T)), T,
                                       queries, LAYERS)  # fmt: skip
    expected.catch_up(lambda layer: read(layer, torch.arange(T, T + 60)), T + 60, new_q)
    for (ka, va), (kb, vb) in zip(seeded.views(), expected.views()):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    for (ka, va), (kb, vb) in zip(stored.views(), before):
        assert torch.equal(ka, kb) and torch.equal(va, vb)  # the stored state is untouched
    assert stored.covered == T + 3


@pytest.mark.parametrize("spec", ["snapkv:ratio=0.5", "h2o:ratio=0.5", "kivi:bits=4"])
def test_deferred_runs_catch_up_to_the_state_appending_them_would_have_left(pool, spec) -> None:
    """Lookup steps defer their committed tokens with the verify's queries; plain steps between
    them bring none. One catch-up leaves the caches exactly as appending each step's tokens
    (with the same queries) would have, across folds whose scores read those queries; a run
    that is not inside what the catch-up covers is appended without its queries."""
    from sglang_vericache.srt.kv.draft_state import FOLD_EVERY, RECENT_WINDOW, RequestDraftState

    compressor = build_compressor(spec)
    g = torch.Generator().manual_seed(1)
    queries = [torch.randn(H_Q, 8, D, generator=g) for _ in range(LAYERS)]
    build = lambda: RequestDraftState.build(compressor, layer_reader(pool, torch.arange(T)), T,  # noqa: E731
                                            queries, LAYERS)  # fmt: skip
    eager, lazy = build(), build()
    read, slot, steps = reader(pool), 100, []
    while slot < 100 + RECENT_WINDOW + FOLD_EVERY + 20:  # enough to fold at least once
        n = 1 + len(steps) % 4
        verified = None if len(steps) % 3 == 2 else [torch.randn(H_Q, n, D, generator=g)
                                                     for _ in range(LAYERS)]  # plain: none
        steps.append((torch.arange(slot, slot + n), verified))
        slot += n
    position = T
    for slots, verified in steps:
        eager.append(read, slots, verified or [None] * LAYERS)
        if verified is not None:
            lazy.defer(position, verified)
        position += slots.numel()
    lazy.check_integrity()
    assert lazy.covered == T and lazy.deferred == sum(s.numel() for s, q in steps if q)
    every = torch.arange(100, slot)
    assert lazy.catch_up(lambda layer: read(layer, every), position) == position - T
    lazy.check_integrity()
    assert lazy.covered == eager.covered and not lazy.queued
    assert all(cache.version >= 1 for cache in lazy.layers)  # it folded
    for (ka, va), (kb, vb) in zip(lazy.views(), eager.views()):
        assert torch.equal(ka, kb) and torch.equal(va, vb)

    # a run past the positions caught up is stale: appended without, then dropped
    stale = build()
    stale.defer(T + 2, [torch.randn(H_Q, 3, D) for _ in range(LAYERS)])
    assert stale.catch_up(lambda layer: read(layer, torch.arange(100, 103)), T + 3) == 3
    assert not stale.queued and stale.covered == T + 3
