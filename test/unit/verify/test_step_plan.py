"""The measured-cost fit and the draft-or-plain planner (pure, microseconds)."""

from __future__ import annotations

import random

import pytest
from sglang_vericache.verify.step_cost import (
    CostFitConfig,
    ForwardKind,
    ForwardShape,
    LinearCost,
    StepCostModel,
)
from sglang_vericache.verify.stats import Proposer
from sglang_vericache.verify.step_plan import (
    ADMISSION_FIRST,
    LOOKUP_PAYS,
    PLAIN_FASTER,
    PlannedRow,
    PlannerConfig,
    StepDecision,
    StepPlanner,
    draft_shape,
    plain_shape,
    verify_shape,
)

# benchmark/model.py's CPU fit: 58 ms per forward + 9 ms per query token + 11 us per KV token
CPU = (0.058, 0.009, 11e-6)


def cpu_seconds(shape: ForwardShape, coef=CPU) -> float:
    return coef[0] + coef[1] * shape.queries + coef[2] * shape.kv_read


def shapes(n: int, seed: int = 0) -> list[ForwardShape]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        rows = rng.randint(1, 16)
        width = rng.randint(1, 8)
        read = rows * rng.randint(16, 8000)
        out.append(ForwardShape(rows, rows * width, read, rng.randint(1, width) * read))
    return out


def test_fit_recovers_a_linear_cost() -> None:
    fit = LinearCost(CostFitConfig(forgetting=1.0))
    for shape in shapes(60):
        fit.observe(shape, cpu_seconds(shape))
    fit.check_integrity()
    for shape in shapes(20, seed=1):
        assert fit.predict(shape) == pytest.approx(cpu_seconds(shape), rel=0.02)


def test_fit_follows_a_machine_that_slows_down() -> None:
    fit = LinearCost()
    for shape in shapes(80):
        fit.observe(shape, cpu_seconds(shape))
    slower = tuple(2 * c for c in CPU)
    for shape in shapes(200, seed=2):
        fit.observe(shape, cpu_seconds(shape, slower))
    probe = ForwardShape(8, 8, 8 * 4000)
    assert fit.predict(probe) == pytest.approx(cpu_seconds(probe, slower), rel=0.05)


def test_no_prediction_before_enough_samples() -> None:
    model = StepCostModel(CostFitConfig(min_samples=3))
    shape = ForwardShape(1, 1, 100)
    for _ in range(2):
        model.observe(ForwardKind.PLAIN, shape, 0.1)
    assert model.predict(ForwardKind.PLAIN, shape) is None
    model.observe(ForwardKind.PLAIN, shape, 0.1)
    assert model.predict(ForwardKind.PLAIN, shape) is not None
    assert model.predict(ForwardKind.VERIFY, shape) is None


@pytest.mark.parametrize("bad", [(0, 1, 0), (2, 1, 0), (1, 1, -1)])
def test_shape_rejects_nonsense(bad) -> None:
    with pytest.raises(ValueError):
        ForwardShape(*bad)


NEVER = PlannerConfig(explore_every=10**9, explore_max=10**9)


def trained_planner(coef=CPU, draft_coef=None, max_drafts=7, config=NEVER) -> StepPlanner:
    """A planner whose three fits learned ``coef`` (drafts: ``draft_coef``) from 40 forwards."""
    planner = StepPlanner(1, max_drafts, config)
    for shape in shapes(40, seed=3):
        planner.observe(ForwardKind.PLAIN, shape, cpu_seconds(shape, coef))
        planner.observe(ForwardKind.DRAFT, shape, cpu_seconds(shape, draft_coef or coef))
        planner.observe(ForwardKind.VERIFY, shape, cpu_seconds(shape, coef))
    return planner


def batch(n: int, context: int, ratio: float = 0.25, alpha: float = 0.9, remaining: int = 256):
    return [PlannedRow(context, int(context * ratio), alpha, remaining, True) for _ in range(n)]


def test_long_contexts_draft_and_short_ones_decode_plainly() -> None:
    """The regimes of the drafting issue under its CPU fit: 8 x 6.3k drafts (measured 1.91x
    plain), 8 x 1k does not (fixed and per-token costs of x + 1 forwards dominate)."""
    planner = trained_planner()
    long_plan = planner.plan(batch(8, 6300))
    assert long_plan.drafts >= 2, long_plan
    assert long_plan.draft_rate > 1.2 * long_plan.plain_rate
    short = planner.plan(batch(8, 1000))
    assert short.drafts == 0 and short.reason == "plain decoding is faster", short


def test_low_acceptance_or_costly_drafts_turn_drafting_off() -> None:
    planner = trained_planner()
    assert planner.plan(batch(8, 6300, alpha=0.1)).drafts == 0
    # a quantized view that costs as much to attend as the full KV (CPU dequantize-on-read)
    costly = trained_planner(draft_coef=(CPU[0], CPU[1], CPU[2] * 4))
    assert costly.plan(batch(8, 6300, ratio=1.0)).drafts == 0


def test_draft_count_grows_with_acceptance_and_respects_remaining() -> None:
    planner = trained_planner()
    low = planner.plan(batch(8, 8000, alpha=0.6)).drafts
    high = planner.plan(batch(8, 8000, alpha=0.98)).drafts
    assert 1 <= low <= high
    assert planner.plan(batch(8, 8000, alpha=0.98, remaining=3)).drafts <= 2


def test_measures_plain_first_then_short_chains_then_explores_now_and_then() -> None:
    planner = StepPlanner(2, 16, PlannerConfig(explore_every=5))
    rows = batch(4, 6000)
    assert planner.plan(rows).drafts == 0  # plain first: its cost is the baseline
    for _ in range(3):
        planner.observe(ForwardKind.PLAIN, plain_shape(rows), cpu_seconds(plain_shape(rows)))
    probes = []
    for _ in range(3):  # short chains of two widths: a fresh server's first drafts cost least
        plan = planner.plan(rows)
        assert plan.reason == "measuring drafting"
        probes.append(plan.drafts)
        planner.observe(ForwardKind.VERIFY, verify_shape(rows, plan.drafts + 1), 0.5)
    assert probes == [2, 4, 2]
    for j in range(3):
        shape = draft_shape(rows, j)
        planner.observe(ForwardKind.DRAFT, shape, cpu_seconds(shape))
        shape = verify_shape(rows, 2 * j + 3)
        planner.observe(ForwardKind.VERIFY, shape, cpu_seconds(shape))
    plans = [planner.plan(rows) for _ in range(10)]
    assert sum(p.reason == "exploring" for p in plans) == 1
    assert {p.drafts > 0 for p in plans} == {True, False}


def _explorations(planner: StepPlanner, rows, decisions: int) -> list[int]:
    out = []
    for _ in range(decisions):
        plan = planner.plan(rows)
        if plan.reason == "exploring":
            out.append(planner.decisions)
            assert plan.drafts in (0, planner.min_drafts)  # a probe: the shortest chain
    return out


def test_explorations_that_confirm_the_choice_come_ever_later() -> None:
    """Where plain wins (short contexts), each probe of drafting costs time: the interval
    doubles after every confirming exploration, up to explore_max."""
    planner = trained_planner(config=PlannerConfig(explore_every=4, explore_max=32))
    seen = _explorations(planner, batch(8, 1000), 140)
    assert seen == [4, 13, 30, 63, 96, 129], seen  # +9, +17, +33, then the cap: +33


def test_an_exploration_that_changes_the_choice_resets_the_interval() -> None:
    planner = trained_planner(config=PlannerConfig(explore_every=4, explore_max=64))
    short = batch(8, 1000)
    _explorations(planner, short, 40)  # plain keeps winning: the interval grew
    assert planner.explore_interval > 4
    while planner.plan(short).reason != "exploring":
        pass
    long_rows = batch(8, 6300)  # the batch changed: drafting now pays
    assert planner.plan(long_rows).drafts > 0
    assert planner.explore_interval == 4 and planner.next_exploration == planner.decisions + 4


def test_rows_that_cannot_draft_never_plan_drafts() -> None:
    planner = trained_planner()
    rows = [PlannedRow(6300, 0, 0.9, 100, False) for _ in range(4)]
    assert planner.plan(rows).drafts == 0 and planner.plan(rows).reason == "no row can draft"


def test_rows_without_compressed_kv_weigh_their_lookup_drafts_against_plain_alone() -> None:
    """Every row dropped its compressed KV for admission; their lookup drafts still verify
    where they pay, and a lookup step is explored now and then where plain wins."""
    planner = trained_planner(config=PlannerConfig(explore_every=4, explore_max=32))
    rows = [PlannedRow(6300, 0, 0.0, 100, False, lookup=6, lookup_alpha=0.95)] * 8
    plan = planner.plan(rows)
    assert (plan.proposer, plan.reason, plan.drafts) == (Proposer.LOOKUP, "lookup drafts pay", 6)
    rare = [PlannedRow(1000, 0, 0.0, 100, False, lookup=2, lookup_alpha=0.05)] * 8
    seen = []
    for _ in range(20):
        plan = planner.plan(rare)
        if plan.reason == "exploring":
            seen.append(plan.drafts)
        else:
            assert (plan.reason, plan.drafts) == ("plain decoding is faster", 0), plan
    assert seen and all(d == 1 for d in seen), seen  # a probe: the shortest lookup chain
    ends = [PlannedRow(6300, 0, 0.0, 3, False, lookup=9, lookup_alpha=0.95)] * 8
    assert planner.plan(ends).drafts == 2  # no further than a row may still emit, less one


def test_verify_shape_reads_each_row_once() -> None:
    shape = verify_shape(batch(2, 100), 5)
    assert (shape.rows, shape.queries, shape.kv_read) == (2, 10, 210)


def test_a_batch_past_what_the_fits_have_seen_is_measured_before_it_is_predicted() -> None:
    """A fresh server's fits come from its warm-up request (one row, ~40 tokens): too little to
    tell fixed from per-token cost. Eight rows of 2k tokens are measured first (plain, then
    drafting), and only then predicted; a batch near the warm-up's shape is predicted at once."""
    planner = StepPlanner(2, 7, NEVER)
    warm = [PlannedRow(40, 40, 0.9, 64, True)]
    for _ in range(3):
        planner.observe(ForwardKind.PLAIN, plain_shape(warm), 0.060)
        planner.observe(ForwardKind.DRAFT, draft_shape(warm, 0), 0.060)
        planner.observe(ForwardKind.VERIFY, verify_shape(warm, 3), 0.070)
    assert planner.plan(warm).reason not in ("measuring plain decode", "measuring drafting")
    rows = batch(8, 2000)
    for _ in range(2):  # two samples of a new shape (step_cost.py)
        assert planner.plan(rows) == StepDecision(0, "measuring plain decode")
        planner.observe(ForwardKind.PLAIN, plain_shape(rows), cpu_seconds(plain_shape(rows)))
    for _ in range(2):
        measuring = planner.plan(rows)
        assert measuring.reason == "measuring drafting" and measuring.drafts >= 2
        for j in range(measuring.drafts):
            shape = draft_shape(rows, j)
            planner.observe(ForwardKind.DRAFT, shape, 3 * cpu_seconds(shape))
        shape = verify_shape(rows, measuring.drafts + 1)
        planner.observe(ForwardKind.VERIFY, shape, cpu_seconds(shape))
    decided = planner.plan(rows)  # drafts measured at 3x the cost model's: plain decoding wins
    assert decided.drafts == 0 and decided.reason == PLAIN_FASTER


def test_fewer_rows_than_recent_samples_are_measured_before_they_are_predicted() -> None:
    """Eight rows of equal context cannot split fixed from per-row cost: the fit of a batch
    that shrank to one row is measured first, and is right after one sample of it."""
    planner = StepPlanner(2, 7, NEVER)
    eight, one = batch(8, 2000), batch(1, 2000)
    seen = {ForwardKind.PLAIN: plain_shape(eight), ForwardKind.DRAFT: draft_shape(eight, 0),
            ForwardKind.VERIFY: verify_shape(eight, 3)}  # fmt: skip
    for kind, shape in seen.items():
        for _ in range(60):  # more than the fits remember: every recent sample has 8 rows
            planner.observe(kind, shape, cpu_seconds(shape))
    fit = planner.costs.fits[ForwardKind.PLAIN]
    assert not fit.covers(plain_shape(one)) and fit.covers(plain_shape(batch(4, 2000)))
    for _ in range(2):
        assert planner.plan(one) == StepDecision(0, "measuring plain decode")
        planner.observe(ForwardKind.PLAIN, plain_shape(one), cpu_seconds(plain_shape(one)))
    assert fit.predict(plain_shape(one)) == pytest.approx(cpu_seconds(plain_shape(one)), rel=0.1)
    assert planner.plan(one).reason == "measuring drafting"


def test_one_slow_first_sample_of_a_new_shape_is_not_the_fit_there() -> None:
    """The first plain step at 8 x 6k took twice what later ones did (benchmark/README.md):
    alone it would be the plain fit there, and drafting would look better than it is. A second
    sample is taken before the shape is predicted; the exploration a few steps later adds more."""
    planner = StepPlanner(2, 7, NEVER)
    rows = batch(8, 2000)
    for kind, shape in ((ForwardKind.PLAIN, plain_shape(rows)),
                        (ForwardKind.DRAFT, draft_shape(rows, 0)),
                        (ForwardKind.VERIFY, verify_shape(rows, 3))):  # fmt: skip
        for _ in range(10):
            planner.observe(kind, shape, cpu_seconds(shape))
    long = batch(8, 6000)
    true = cpu_seconds(plain_shape(long))
    assert planner.plan(long) == StepDecision(0, "measuring plain decode")
    planner.observe(ForwardKind.PLAIN, plain_shape(long), 2 * true)  # one-off costs
    fit = planner.costs.fits[ForwardKind.PLAIN]
    assert fit.predict(plain_shape(long)) > 1.6 * true  # what trusting it alone would believe
    assert planner.plan(long) == StepDecision(0, "measuring plain decode")
    planner.observe(ForwardKind.PLAIN, plain_shape(long), true)
    assert fit.predict(plain_shape(long)) < 1.6 * true


def test_a_cost_fit_needs_as_many_near_samples_as_it_remembers_at_most() -> None:
    assert CostFitConfig(forgetting=0.98, near_samples=50).near_samples == 50
    with pytest.raises(ValueError):
        CostFitConfig(forgetting=0.98, near_samples=51)
    with pytest.raises(ValueError):
        CostFitConfig(near_samples=0)


# a GPU-like fit: the fixed cost of a forward dominates, a row more costs little
FIXED_HEAVY = (0.010, 0.0002, 1e-6)


def test_a_waiting_request_turns_a_marginal_draft_into_plain_decoding_with_it() -> None:
    """Under a short budget the compressed KV keeps a request out: drafting must then beat plain
    decoding of the batch *with* that request. Where it barely paid it stops; where it pays
    well it goes on."""
    planner = trained_planner(coef=FIXED_HEAVY)
    marginal = batch(2, 4000)
    alone = planner.plan(marginal)
    assert alone.drafts > 0 and alone.draft_rate < 1.2 * alone.plain_rate
    joined = planner.plan(marginal, [PlannedRow(4000, 0, 0.0, 1, False)])
    assert joined.drafts == 0 and joined.reason == PLAIN_FASTER
    assert joined.plain_rate > 1.2 * alone.plain_rate  # three rows for little more than two
    strong = batch(4, 8000, alpha=0.98)
    assert planner.plan(strong, [PlannedRow(8000, 0, 0.0, 1, False)]).drafts > 0


def test_a_waiting_request_comes_first_while_drafting_is_not_measured() -> None:
    """No fit covers the batch: measuring would hold the slots a waiting request needs, so the
    step is plain and admits it (ADMISSION_FIRST); without a waiting request it measures. Once
    the fits cover the batch the rate comparison decides, as without a waiting request."""
    planner = StepPlanner(2, 8)
    rows, newcomer = batch(4, 1000), [PlannedRow(1000, 0, 0.0, 64, False)]
    assert planner.plan(rows, newcomer) == StepDecision(0, ADMISSION_FIRST)
    assert planner.plan(rows) == StepDecision(0, "measuring plain decode")
    for _ in range(6):
        planner.observe(ForwardKind.PLAIN, plain_shape(rows), cpu_seconds(plain_shape(rows)))
    assert planner.plan(rows, newcomer) == StepDecision(0, ADMISSION_FIRST)
    assert planner.plan(rows).reason == "measuring drafting"
    trained = trained_planner(coef=FIXED_HEAVY)
    strong = batch(4, 8000, alpha=0.98)
    assert trained.plan(strong, [PlannedRow(8000, 0, 0.0, 1, False)]).drafts > 0


def test_cost_fit_reach_must_be_at_least_one() -> None:
    with pytest.raises(ValueError):
        CostFitConfig(reach=0.5)


@pytest.mark.parametrize("context, alpha, remaining", [(6300, 0.9, 256), (1000, 0.6, 256),
                                                       (8000, 0.98, 4), (300, 0.99, 64)])
def test_best_draft_is_the_best_of_every_chain_length(context, alpha, remaining) -> None:
    """The one-pass search equals pricing each x on its own: x draft forwards + a verify of
    width x + 1, expected commits per row."""
    from sglang_vericache.verify.policy import expected_committed

    planner = trained_planner(max_drafts=16)
    planner.min_drafts = 2
    rows = batch(3, context, alpha=alpha, remaining=remaining)

    def rate(x: int) -> float:
        seconds = sum(planner.costs.predict(ForwardKind.DRAFT, draft_shape(rows, j))
                      for j in range(x)) + planner.costs.predict(ForwardKind.VERIFY,
                                                                 verify_shape(rows, x + 1))  # fmt: skip
        return sum(expected_committed(alpha, min(x, remaining - 1)) for _ in rows) / seconds

    top = max(range(2, min(16, max(2, remaining - 1)) + 1), key=lambda x: (rate(x), x))
    x, best = planner.best_draft(rows)
    assert x == top and best == pytest.approx(rate(top), rel=1e-12)


def with_lookup(rows: list[PlannedRow], tokens: int, alpha: float) -> list[PlannedRow]:
    return [PlannedRow(r.context, r.compressed, r.alpha, r.remaining, r.drafts, tokens, alpha)
            for r in rows]


def test_lookup_drafts_win_where_they_are_accepted_and_lose_where_they_are_not() -> None:
    """A lookup step pays only its verify: at 8 x 6.3k with lookup drafts accepted about as
    often as the compressed KV's, it beats them (no draft forwards); rarely accepted ones do
    not; rows without a lookup draft commit one token each."""
    planner = trained_planner()
    rows = batch(8, 6300, alpha=0.9)
    compressed = planner.plan(rows)
    good = planner.plan(with_lookup(rows, 6, 0.9))
    assert good.proposer is Proposer.LOOKUP and good.reason == LOOKUP_PAYS, good
    assert 1 <= good.drafts <= 6 and good.draft_rate > compressed.draft_rate
    poor = planner.plan(with_lookup(rows, 6, 0.05))
    assert poor.proposer is Proposer.COMPRESSED and poor.drafts == compressed.drafts
    x, rate = planner.best_lookup(with_lookup(rows, 0, 0.9))
    assert (x, rate) == (0, 0.0)  # nobody has a lookup draft


def test_lookup_draft_count_stays_within_the_longest_lookup_draft() -> None:
    planner = trained_planner()
    rows = batch(8, 6300, alpha=0.9)
    mixed = with_lookup(rows[:2], 3, 0.99) + with_lookup(rows[2:], 0, 0.0)
    x, _ = planner.best_lookup(mixed)
    assert 1 <= x <= 3


def test_a_batch_that_never_changes_size_keeps_a_finite_fit() -> None:
    """Eight rows every step: fixed and per-row cost cannot be told apart. Forgetting the
    prior along that direction wound the covariance up into NaN (at forgetting 0.9 within
    ~7,000 samples; 0.98 within ~35,000); the kept prior holds it."""
    fit = LinearCost(CostFitConfig(forgetting=0.9))
    rng = random.Random(4)
    for _ in range(10_000):
        shape = ForwardShape(8, 8, rng.randint(40_000, 56_000))
        fit.observe(shape, cpu_seconds(shape))
    fit.check_integrity()
    probe = ForwardShape(8, 8, 50_000)
    assert fit.predict(probe) == pytest.approx(cpu_seconds(probe), rel=1e-3)


def test_a_verify_prices_the_queries_that_attend() -> None:
    """A row verifying fewer drafts than the width runs (and attends) only its 1 + drafts
    columns: a lookup verify 1 + each row's lookup draft, a compressed one the whole width of
    every drafting row."""
    rows = [PlannedRow(1000, 250, 0.9, 64, True, 3, 0.8), PlannedRow(2000, 500, 0.9, 64, True),
            PlannedRow(3000, 0, 0.0, 64, False)]
    lookup = verify_shape(rows, 5, Proposer.LOOKUP)
    assert (lookup.queries, lookup.kv_read) == (4 + 1 + 1, 6015)
    assert lookup.attended == 4 * 1005 + 1 * 2005 + 1 * 3005
    compressed = verify_shape(rows, 5)
    assert compressed.queries == 5 + 5 + 1
    assert compressed.attended == 5 * 1005 + 5 * 2005 + 1 * 3005
    coef = (0.05, 0.003, 5e-6, 3e-6)  # fixed, per query, per key read, per pair attended
    fit = LinearCost(CostFitConfig(forgetting=1.0))
    for shape in shapes(80, seed=5):
        fit.observe(shape, sum(c * f for c, f in zip(coef, shape.features())))
    for shape in (lookup, compressed):
        truth = sum(c * f for c, f in zip(coef, shape.features()))
        assert fit.predict(shape) == pytest.approx(truth, rel=0.02)
    assert fit.predict(lookup) < fit.predict(compressed)
