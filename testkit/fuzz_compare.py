"""Compare a candidate server's fuzz replies with the reference's, and summarize (pure python).

Per case: both answered (no connection error or timeout), with the same status, and not a
5xx; then for a greedy case (``TOKENS``) identical tokens (text where the endpoint gives no
ids), log-probs equal within a tolerance and hidden states of the same shape within
``HIDDEN_TOLERANCE``; for seeded sampling (``COUNT``) the same number of completions and tokens;
for a ``DISTRIBUTION`` case, the token at the case's decode position (or the output's end)
distributed alike in both servers' completions (``fuzz_stats.chi_square_homogeneity`` at least
``DISTRIBUTION_ALPHA``). Top-k lists may differ only by a tie at their boundary, since the order
of two equal log-probs is not part of the contract.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from testkit.fuzz import COUNT, TOKENS, FuzzCase
from testkit.fuzz_outputs import Output, Reply, Table, outputs
from testkit.fuzz_stats import chi_square_homogeneity
from testkit.fuzz_surfaces import DISTRIBUTION

DEFAULT_TOLERANCE = 1e-3
# Hidden states of a plain step are SGLang's own forward's; a verify forward's may differ from a
# decode's in the last float bits, which over a 576-wide float32 row stays far below this.
HIDDEN_TOLERANCE = 1e-3
DISTRIBUTION_ALPHA = 1e-3

# Problem kinds, in the order the summary lists them.
NO_RESPONSE = "no_response"  # connection error, timeout, or a dead server
STATUS_MISMATCH = "status_mismatch"
SERVER_ERROR = "server_error"  # both answered the same 5xx
UNPARSABLE = "unparsable"
OUTPUT_COUNT = "output_count"
# Cases whose sampled output may end wherever a token completes a grammar or a stop: two samples
# (plain SGLang's and VeriCache's own random stream) need not have the same length.
LENGTH_FOLLOWS_TOKENS = frozenset({"grammar", "stop"})
TOKEN_MISMATCH = "token_mismatch"
COUNT_MISMATCH = "count_mismatch"
LOGPROB_MISMATCH = "logprob_mismatch"
HIDDEN_MISMATCH = "hidden_mismatch"
DISTRIBUTION_MISMATCH = "distribution_mismatch"
PROBLEM_KINDS = (NO_RESPONSE, STATUS_MISMATCH, SERVER_ERROR, UNPARSABLE, OUTPUT_COUNT,
                 TOKEN_MISMATCH, COUNT_MISMATCH, LOGPROB_MISMATCH, HIDDEN_MISMATCH,
                 DISTRIBUTION_MISMATCH)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Problem:
    kind: str
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CaseResult:
    index: int
    kind: str
    ref_status: int | None
    cand_status: int | None
    problems: tuple[Problem, ...] = ()
    max_logprob_diff: float = 0.0
    logprobs_compared: int = 0
    seconds: float = 0.0  # the slower side's time: what sizes a run
    ref_seconds: float = 0.0
    cand_seconds: float = 0.0
    p_value: float | None = None  # a DISTRIBUTION case's test

    @property
    def ok(self) -> bool:
        return not self.problems


def first_divergence(ref: Sequence, cand: Sequence) -> int | None:
    """First differing index (one side ending counts), or None if equal."""
    for i, (a, b) in enumerate(zip(ref, cand)):
        if a != b:
            return i
    return None if len(ref) == len(cand) else min(len(ref), len(cand))


def _status(reply: Reply) -> Any:
    return reply.status if not reply.stream_error else f"{reply.status}+stream-error"


def compare_case(case: FuzzCase, ref: Reply, cand: Reply,
                 tol: float = DEFAULT_TOLERANCE) -> CaseResult:  # fmt: skip
    base = {"index": case.index, "kind": case.kind, "ref_status": ref.status,
            "cand_status": cand.status, "seconds": round(max(ref.seconds, cand.seconds), 3),
            "ref_seconds": round(ref.seconds, 3), "cand_seconds": round(cand.seconds, 3)}
    if ref.status is None or cand.status is None:
        detail = {"reference_error": ref.error, "candidate_error": cand.error}
        return CaseResult(**base, problems=(Problem(NO_RESPONSE, detail),))
    if _status(ref) != _status(cand):
        detail = {"reference": _status(ref), "candidate": _status(cand),
                  "reference_body": _short(ref.body), "candidate_body": _short(cand.body)}  # fmt: skip
        return CaseResult(**base, problems=(Problem(STATUS_MISMATCH, detail),))
    if ref.status >= 500:
        return CaseResult(**base, problems=(Problem(SERVER_ERROR, {"body": _short(ref.body)}),))
    if ref.status != 200 or ref.stream_error or case.disconnect_after is not None:
        return CaseResult(**base)
    if case.check not in (TOKENS, COUNT, DISTRIBUTION):
        return CaseResult(**base)
    try:
        ref_out, cand_out = outputs(case, ref), outputs(case, cand)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        return CaseResult(**base, problems=(Problem(UNPARSABLE, {"error": str(exc)}),))
    if len(ref_out) != len(cand_out):
        detail = {"reference": len(ref_out), "candidate": len(cand_out)}
        return CaseResult(**base, problems=(Problem(OUTPUT_COUNT, detail),))
    if case.check == DISTRIBUTION:
        return _compare_distribution(base, case, ref_out, cand_out)
    if case.check == COUNT:
        if case.labels() & LENGTH_FOLLOWS_TOKENS:
            return CaseResult(**base)  # two samples of a grammar / stop may end anywhere
        return CaseResult(**base, problems=tuple(_count_problems(ref_out, cand_out)))
    return _compare_greedy(base, ref_out, cand_out, tol)


def _count_problems(ref: list[Output], cand: list[Output]) -> Iterable[Problem]:
    """Sampled outputs with ``ignore_eos``: the same token count, read from token ids only (a
    streamed OpenAI reply without ids counts logprob entries, and SGLang's stream drops the
    entries of tokens whose text is an incomplete UTF-8 sequence, which depends on the sample)."""
    for i, (r, c) in enumerate(zip(ref, cand)):
        if r.ids is not None and c.ids is not None and r.n_tokens != c.n_tokens:
            yield Problem(COUNT_MISMATCH, {"output": i, "reference": r.n_tokens,
                                           "candidate": c.n_tokens})  # fmt: skip


def _compare_greedy(base: dict, ref: list[Output], cand: list[Output], tol: float) -> CaseResult:
    problems, worst, compared = [], 0.0, 0
    for i, (r, c) in enumerate(zip(ref, cand)):
        token_problem = _token_problem(i, r, c)
        if token_problem is not None:
            problems.append(token_problem)
            continue  # log-probs of different tokens are not comparable
        diff, n, bad = compare_tables(r.logprobs, c.logprobs, tol)
        worst, compared = max(worst, diff), compared + n
        if bad:
            problems.append(Problem(LOGPROB_MISMATCH, {"output": i, **bad}))
        hidden = _hidden_problem(r.hidden, c.hidden)
        if hidden is not None:
            problems.append(Problem(HIDDEN_MISMATCH, {"output": i, **hidden}))
    return CaseResult(**base, problems=tuple(problems), max_logprob_diff=worst,
                      logprobs_compared=compared)  # fmt: skip


def _prompt_tails(ref: Any, cand: Any) -> tuple[Any, Any]:
    """SGLang returns a prompt's hidden states (entry 0, one row per position) only for the
    positions it computed, not those its prefix cache served: two servers whose caches hold
    different prefixes answer different lengths (seen both ways in the hour soak). The rows
    both computed are the prompt's last ones; entry 0 is cut to them."""
    def rows(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and isinstance(x[0], list) and bool(x[0]) \
            and isinstance(x[0][0], list)
    if not (rows(ref) and rows(cand)):
        return ref, cand
    n = min(len(ref[0]), len(cand[0]))
    return [ref[0][len(ref[0]) - n:], *ref[1:]], [cand[0][len(cand[0]) - n:], *cand[1:]]


def _hidden_problem(ref: Any, cand: Any) -> dict[str, Any] | None:
    """Hidden states (nested lists of floats) of the same shape and within HIDDEN_TOLERANCE,
    the prompt's entry over the positions both servers computed (``_prompt_tails``)."""
    worst = 0.0
    todo = [((), *_prompt_tails(ref, cand))]
    while todo:
        path, a, b = todo.pop()
        if isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                return {"at": list(path), "reference_len": len(a), "candidate_len": len(b)}
            todo.extend(((*path, j), x, y) for j, (x, y) in enumerate(zip(a, b)))
        elif isinstance(a, (int, float)) and isinstance(b, (int, float)):
            worst = max(worst, abs(a - b))
        elif a != b:
            return {"at": list(path), "reference": _short(a), "candidate": _short(b)}
    return None if worst <= HIDDEN_TOLERANCE else {"max_abs_diff": worst}


def _compare_distribution(base: dict, case: FuzzCase, ref: list[Output],
                          cand: list[Output]) -> CaseResult:  # fmt: skip
    """The token at the case's ``posK`` decode position ("end" past an output's end)."""
    pos = next(int(t[3:]) for t in case.tags if t.startswith("pos"))
    values = [[o.ids[pos] if o.ids is not None and len(o.ids) > pos else "end" for o in side]
              for side in (ref, cand)]  # fmt: skip
    p = chi_square_homogeneity(*values).p_value
    if p >= DISTRIBUTION_ALPHA:
        return CaseResult(**base, p_value=p)
    detail = {"position": pos, "p_value": p, "samples": len(ref)}
    return CaseResult(**base, problems=(Problem(DISTRIBUTION_MISMATCH, detail),), p_value=p)


def _token_problem(i: int, r: Output, c: Output) -> Problem | None:
    use_ids = r.ids is not None and c.ids is not None
    ref_seq, cand_seq = (r.ids, c.ids) if use_ids else (r.text or "", c.text or "")
    pos = first_divergence(ref_seq, cand_seq)
    if pos is None:
        return None
    unit = "token" if use_ids else "char"
    return Problem(TOKEN_MISMATCH, {
        "output": i, "unit": unit, "first_divergence": pos,
        "reference": _window(ref_seq, pos), "candidate": _window(cand_seq, pos),
        "reference_len": len(ref_seq), "candidate_len": len(cand_seq)})  # fmt: skip


def _window(seq: Sequence, pos: int, width: int = 8) -> Any:
    part = seq[max(0, pos - 2): pos + width]
    return part if isinstance(part, str) else list(part)


def compare_tables(ref: Table, cand: Table, tol: float) -> tuple[float, int, dict[str, Any]]:
    """(max abs diff, values compared, first violation or {}) over two log-prob tables."""
    worst, compared = 0.0, 0
    for name in sorted(set(ref) | set(cand)):
        a, b = ref.get(name), cand.get(name)
        if a is None or b is None or len(a) != len(b):
            return worst, compared, {"stream": name, "reason": "missing or different length",
                                     "reference_len": _len(a), "candidate_len": _len(b)}  # fmt: skip
        for pos, (pa, pb) in enumerate(zip(a, b)):
            diff, n, reason = _compare_position(pa or {}, pb or {}, tol)
            worst, compared = max(worst, diff), compared + n
            if reason:
                return worst, compared, {"stream": name, "position": pos, "reason": reason,
                                         "reference": pa, "candidate": pb}  # fmt: skip
    return worst, compared, {}


def _len(x: Any) -> int | None:
    return None if x is None else len(x)


def _compare_position(a: dict, b: dict, tol: float) -> tuple[float, int, str]:
    """Common tokens within ``tol``; a token in one top-k only if it ties the other's last."""
    worst, n = 0.0, 0
    for key in a.keys() & b.keys():
        va, vb = a[key], b[key]
        if (va is None) != (vb is None):
            return worst, n, f"value for {key!r} missing on one side"
        if va is None:
            continue
        d = abs(float(va) - float(vb)) if math.isfinite(va) and math.isfinite(vb) else (
            0.0 if va == vb else math.inf)  # fmt: skip
        worst, n = max(worst, d), n + 1
    if worst > tol:
        return worst, n, f"log-prob differs by {worst:.3g} > {tol:g}"
    for side, other in ((a, b), (b, a)):
        floor = min((v for v in other.values() if v is not None), default=None)
        for key in side.keys() - other.keys():
            v = side[key]
            if floor is None or v is None or abs(float(v) - floor) > tol:
                return worst, n, f"token {key!r} on one side only (not a top-k boundary tie)"
    return worst, n, ""


def _short(body: Any, limit: int = 300) -> Any:
    text = body if isinstance(body, str) else repr(body)
    return text if len(text) <= limit else text[:limit] + "..."
