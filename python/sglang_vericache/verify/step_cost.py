"""Measured forward costs: an online linear fit per forward kind, predicting any batch's step.

Every decode forward the worker runs is timed and described by its shape. A plain forward is
timed with the rest of its step (the offloads), and a verify with the rest of its drafted step
but the draft forwards (catching the compressed KV up, committing, offloading): the planner
compares what each mode costs per step, not only its kernels. The fit is the iteration-time
model of ``benchmark/model.py`` (on CPU: 58 ms fixed + 9 ms per query token + ~11 us per KV
token read), learned on the serving machine instead of assumed::

    seconds(kind, shape) ~= w0 + w1 * shape.queries + w2 * shape.kv_read + w3 * shape.attended

(w per kind), where ``queries`` counts the tokens the forward runs (a verify row drafting less
than the width runs only its 1 + drafts: ``srt/decode/batch_inputs.py``) and ``attended`` the
query-key pairs attention computes, which grow with each query's context, not only with the
keys read. For a plain or draft forward (one query a row) ``attended`` is ``kv_read``; the ridge
splits that cost between the two, and predictions there are the same.

one fit per kind, because the three forwards run different kernels (SGLang's decode, the
compressed-view decode, the masked verify) whose constants differ by backend and device: the
same code learns that host KV is a copy away on a CPU and a PCIe crossing on a GPU. Recursive
least squares with a forgetting factor follows drifting load (these machines are shared); its
weak ridge prior is never forgotten, so a direction the samples do not vary (a batch that keeps
its size for hours) stays bounded instead of winding up (``LinearCost``). No torch, no clock:
the caller measures, this remembers.

A fit is trusted only near what it has seen (``covers``): a few forwards of one shape cannot
tell fixed from per-token from per-KV-token cost, so the fit a fresh server learns from its
warm-up request (one row, ~40 tokens) says little about eight rows of 2k tokens, and eight rows
of equal context cannot tell per-row from fixed cost either (one fitted on them alone priced a
lone 2k row's step 1.5x too high). A shape is predicted only once ``near_samples`` of the
recent samples (those the forgetting factor still weighs) are near it: rows within a factor
``reach`` either way, and a KV read at least 1 / ``reach`` of the shape's (a smaller one leans
on the fixed cost, which every sample measures). Two, not one: the first forward of a new shape
can carry one-off costs, and one sample alone is the fit there (at 8 x 6k a first plain step
took 914 ms where the next ones took ~470, and the planner, trusting it, drafted at a loss).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

FEATURES = 4  # 1, queries, kv_read, attended
MEMORY_MAX = 4096  # recent samples remembered when nothing is forgotten (forgetting = 1)


class ForwardKind(StrEnum):
    PLAIN = "plain"  # SGLang's one-token decode over the full KV
    DRAFT = "draft"  # one draft step over the compressed views
    VERIFY = "verify"  # the width-W verify over the full KV


@dataclass(frozen=True, slots=True)
class ForwardShape:
    """What a forward computes: ``rows`` requests, ``queries`` query tokens in all (a verify:
    each row's live columns, 1 + its drafts), ``kv_read`` KV tokens attention reads, each row's
    counted once (a decode at context L reads L + 1; a verify of width W at base L reads
    L + W: its queries share one pass over the keys), and ``attended`` query-key pairs
    attention computes (None: one query a row, ``kv_read``; a verify row with ``k`` live
    queries: k * (L + W))."""

    rows: int
    queries: int
    kv_read: int
    attended: int | None = None

    def __post_init__(self) -> None:
        if not (self.rows >= 1 and self.queries >= self.rows and self.kv_read >= 0
                and (self.attended is None or self.attended >= 0)):  # fmt: skip
            raise ValueError(f"need rows >= 1, queries >= rows, kv_read, attended >= 0: {self}")

    @classmethod
    def plain(cls, contexts: Sequence[int]) -> ForwardShape:
        """A one-token decode: row i reads its ``contexts[i]`` committed tokens and the new one."""
        return cls(len(contexts), len(contexts), sum(contexts) + len(contexts))

    @classmethod
    def draft(cls, views: Sequence[int], step: int) -> ForwardShape:
        """Draft forward ``step`` (0-based): row i reads its compressed view of ``views[i]``
        tokens (0 for a row riding along undrafted) and its draft chain so far."""
        return cls(len(views), len(views), sum(views) + len(views) * (step + 1))

    @classmethod
    def verify(cls, contexts: Sequence[int], width: int,
               live: Sequence[int] | None = None) -> ForwardShape:  # fmt: skip
        """A width-W verify: row i's ``live[i]`` queries (1 + its drafts; None: all W) sharing
        one pass over its context + W keys."""
        n = len(contexts)
        live = [width] * n if live is None else live
        attended = sum(k * (c + width) for k, c in zip(live, contexts, strict=True))
        return cls(n, sum(live), sum(contexts) + n * width, attended)

    def features(self) -> tuple[float, float, float, float]:
        attended = self.kv_read if self.attended is None else self.attended
        return 1.0, float(self.queries), float(self.kv_read), float(attended)


def _memory(forgetting: float) -> int:
    """Samples until the forgetting factor has weighed one down to 1/e (1 / (1 - forgetting)
    for a factor near 1; 50 at 0.98)."""
    return max(1, math.ceil(-1.0 / math.log(forgetting))) if forgetting < 1.0 else MEMORY_MAX


@dataclass(frozen=True, slots=True)
class CostFitConfig:
    """forgetting: weight kept per observation (1 = never forget); prior: ridge strength on the
    coefficients (a prior of zero cost, worth this many pseudo-observations per unit feature);
    min_samples: observations before a kind's prediction is trusted; reach, near_samples: how
    far from the recent samples a prediction is trusted, and how many of them must be that near
    (``LinearCost.covers``)."""

    forgetting: float = 0.98
    prior: float = 1e-6
    min_samples: int = 3
    reach: float = 2.0
    near_samples: int = 2

    def __post_init__(self) -> None:
        if not 0.5 < self.forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0.5, 1], got {self.forgetting}")
        if not self.prior > 0:
            raise ValueError(f"prior must be > 0, got {self.prior}")
        if self.min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {self.min_samples}")
        if not self.reach >= 1.0:
            raise ValueError(f"reach must be >= 1, got {self.reach}")
        if not 1 <= self.near_samples <= _memory(self.forgetting):
            raise ValueError(f"near_samples must be in [1, {_memory(self.forgetting)}] (what "
                             f"forgetting {self.forgetting} remembers), got {self.near_samples}")


class LinearCost:
    """Exponentially weighted ridge regression over ``ForwardShape.features``.

    Kept as the information matrix and moment of the samples, each weighed down by
    ``forgetting`` per later sample, plus the ridge prior, which is never forgotten::

        R = prior * I + sum_i f^(n-i) x_i x_i^T      r = sum_i f^(n-i) y_i x_i      w = R^-1 r

    Textbook recursive least squares forgets the prior too: along a direction the samples do not
    vary (a batch of 8 rows for every step: the fixed and per-row costs cannot be told apart) its
    covariance grows by 1 / f per sample, and at f = 0.98 it overflowed into NaN after ~35,000
    steps, minutes of a GPU server at full load. Here R >= prior * I: such a direction keeps the
    prior's split. Features are rescaled (queries / 1e2, kv_read / 1e5, attended / 1e6) so one
    prior suits all; predictions are clamped at zero (a fit may go negative outside its data).
    """

    _SCALE = (1.0, 1e-2, 1e-5, 1e-6)

    def __init__(self, config: CostFitConfig = CostFitConfig()) -> None:
        self.config = config
        self.samples = 0
        self._info = [[config.prior if i == j else 0.0 for j in range(FEATURES)]
                      for i in range(FEATURES)]  # fmt: skip
        self._moment = [0.0] * FEATURES
        self._theta = [0.0] * FEATURES
        # (rows, kv_read) of the samples the forgetting factor still weighs (down to ~1/e)
        self._recent: deque[tuple[int, int]] = deque(maxlen=_memory(config.forgetting))

    def _x(self, shape: ForwardShape) -> list[float]:
        return [f * s for f, s in zip(shape.features(), self._SCALE)]

    def observe(self, shape: ForwardShape, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        f, prior, x = self.config.forgetting, self.config.prior, self._x(shape)
        for i in range(FEATURES):
            for j in range(FEATURES):
                ridge = prior if i == j else 0.0
                self._info[i][j] = f * (self._info[i][j] - ridge) + ridge + x[i] * x[j]
            self._moment[i] = f * self._moment[i] + seconds * x[i]
        self._theta = _solve(self._info, self._moment)
        self.samples += 1
        self._recent.append((shape.rows, shape.kv_read))

    @property
    def ready(self) -> bool:
        return self.samples >= self.config.min_samples

    def covers(self, shape: ForwardShape) -> bool:
        """Ready, and at least ``near_samples`` recent samples near ``shape`` (module doc)."""
        cfg = self.config
        near = sum(1 for rows, kv_read in self._recent
                   if shape.rows <= cfg.reach * rows and rows <= cfg.reach * shape.rows
                   and shape.kv_read <= cfg.reach * kv_read)  # fmt: skip
        return self.ready and near >= cfg.near_samples

    def predict(self, shape: ForwardShape) -> float:
        return max(0.0, sum(t * xi for t, xi in zip(self._theta, self._x(shape))))

    def check_integrity(self) -> None:
        for i in range(FEATURES):
            assert self._info[i][i] >= self.config.prior * (1 - 1e-9), (i, self._info[i][i])
            for j in range(i):
                assert self._info[i][j] == self._info[j][i], (i, j)
        assert all(math.isfinite(t) for t in self._theta), self._theta


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b for a symmetric positive definite ``a`` (Cholesky; a few features)."""
    n = len(b)
    low = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1):
            s = a[i][j] - sum(low[i][k] * low[j][k] for k in range(j))
            low[i][j] = math.sqrt(max(s, 1e-300)) if i == j else s / low[j][j]
    y = [0.0] * n
    for i in range(n):
        y[i] = (b[i] - sum(low[i][k] * y[k] for k in range(i))) / low[i][i]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (y[i] - sum(low[k][i] * x[k] for k in range(i + 1, n))) / low[i][i]
    return x


class StepCostModel:
    """One ``LinearCost`` per ``ForwardKind``; ``predict`` is None until a kind is ``ready``."""

    def __init__(self, config: CostFitConfig = CostFitConfig()) -> None:
        self.fits = {kind: LinearCost(config) for kind in ForwardKind}

    def observe(self, kind: ForwardKind, shape: ForwardShape, seconds: float) -> None:
        self.fits[kind].observe(shape, seconds)

    def ready(self, kind: ForwardKind) -> bool:
        return self.fits[kind].ready

    def covers(self, kind: ForwardKind, shape: ForwardShape) -> bool:
        return self.fits[kind].covers(shape)

    def predict(self, kind: ForwardKind, shape: ForwardShape) -> float | None:
        fit = self.fits[kind]
        return fit.predict(shape) if fit.ready else None

    def check_integrity(self) -> None:
        for fit in self.fits.values():
            fit.check_integrity()
