"""Two-sample tests on sampled outputs: the fuzzer's distribution check and the sampled-output
benchmark (``benchmark/sampled_distribution.py``) share this one."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

MIN_EXPECTED = 5.0  # chi-square's usual validity rule: every cell expects >= 5 per side


@dataclass(frozen=True)
class ChiSquare:
    """A chi-square test of homogeneity of two samples over lumped cells.

    stat, df, p_value: the test; cells: outcomes kept as their own cell (the rest lumped into
    one); tv: total-variation distance between the two samples' empirical distributions over
    those cells (an effect size, biased upwards for small samples).
    """

    stat: float
    df: int
    p_value: float
    cells: int
    tv: float


def chi_square_homogeneity(a: Sequence[Hashable], b: Sequence[Hashable],
                           min_expected: float = MIN_EXPECTED) -> ChiSquare:  # fmt: skip
    """Test whether samples ``a`` and ``b`` (outcomes, any hashable) share one distribution.

    Outcomes whose expected count on either side is below ``min_expected`` are lumped into one
    cell (the lumping looks at pooled counts only, so it is the same whichever sample is which);
    a lump that still expects too little joins the smallest kept cell.
    """
    from scipy.stats import chi2

    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    if not na or not nb:
        raise ValueError("both samples must be non-empty")
    share = min(na, nb) / (na + nb)
    pooled = sorted(set(ca) | set(cb), key=lambda k: (-(ca[k] + cb[k]), repr(k)))
    kept = [k for k in pooled if (ca[k] + cb[k]) * share >= min_expected]
    rest = pooled[len(kept):]  # pooled is sorted by count: the kept outcomes come first
    cells = [[k] for k in kept]
    if rest:
        lump_count = sum(ca[k] + cb[k] for k in rest)
        if lump_count * share >= min_expected or not cells:
            cells.append(rest)
        else:
            cells[-1] = cells[-1] + rest
    obs_a = [sum(ca[k] for k in cell) for cell in cells]
    obs_b = [sum(cb[k] for k in cell) for cell in cells]
    tv = 0.5 * sum(abs(x / na - y / nb) for x, y in zip(obs_a, obs_b))
    if len(cells) < 2:
        return ChiSquare(stat=0.0, df=0, p_value=1.0, cells=len(cells), tv=tv)
    stat = 0.0
    for x, y in zip(obs_a, obs_b):
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    df = len(cells) - 1
    return ChiSquare(stat=stat, df=df, p_value=float(chi2.sf(stat, df)), cells=len(kept), tv=tv)
