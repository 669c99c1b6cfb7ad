"""Two-sample tests the fuzzer runs on sampled outputs (pure python: no scipy needed).

``homogeneity_p(a, b)``: Pearson's chi-square test that two samples of categorical values come
from one distribution. Categories whose expected count is under 5 in either sample are pooled
into one (and that pool into its smallest neighbour while it is still under 5), the usual
condition for the chi-square approximation. The p-value is the chi-square survival function,
computed as the regularized upper incomplete gamma function Q(df/2, x/2).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence

MIN_EXPECTED = 5.0


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError("df must be positive")
    if x <= 0:
        return 1.0
    return _gamma_q(df / 2.0, x / 2.0)


def _gamma_q(a: float, x: float) -> float:
    """Regularized upper incomplete gamma Q(a, x): a series below a + 1, a continued fraction
    (modified Lentz) above, each to double precision."""
    log_pre = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1.0:
        term = total = 1.0 / a
        ap = a
        for _ in range(10_000):
            ap += 1.0
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(log_pre))
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return min(1.0, math.exp(log_pre) * h)


def pooled_table(a: Sequence[Hashable], b: Sequence[Hashable]) -> list[tuple[int, int]]:
    """Per category (rare ones pooled, see the module doc): (count in a, count in b)."""
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    n = na + nb
    cells, rare = [], [0, 0]
    for key in sorted(set(ca) | set(cb), key=repr):
        total = ca[key] + cb[key]
        if min(na, nb) * total / n < MIN_EXPECTED:
            rare[0] += ca[key]
            rare[1] += cb[key]
        else:
            cells.append((ca[key], cb[key]))
    if sum(rare):
        cells.append((rare[0], rare[1]))
        cells.sort(key=sum)
        while len(cells) > 1 and min(na, nb) * sum(cells[0]) / n < MIN_EXPECTED:
            (a0, b0), (a1, b1) = cells[0], cells[1]
            cells = sorted([(a0 + a1, b0 + b1), *cells[2:]], key=sum)
    return cells


def homogeneity_p(a: Sequence[Hashable], b: Sequence[Hashable]) -> float:
    """p-value of the chi-square test that ``a`` and ``b`` share a distribution (1.0 when there
    is nothing to tell apart: an empty sample or a single pooled category)."""
    if not a or not b:
        return 1.0
    cells = pooled_table(a, b)
    if len(cells) < 2:
        return 1.0
    na, nb = len(a), len(b)
    n = na + nb
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, size in ((x, na), (y, nb)):
            expected = size * total / n
            stat += (observed - expected) ** 2 / expected
    return chi2_sf(stat, len(cells) - 1)
