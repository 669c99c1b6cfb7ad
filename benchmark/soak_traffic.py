"""The soak's parts that need no server: the traffic mix, process sampling and trend statistics.

Traffic is the fuzzer's request mix (``testkit/fuzz.py``: greedy, sampled, grammar, logprobs,
streaming, batches, the OpenAI endpoints, malformed bodies), with a share of it replaced by
client disconnects (a stream closed after one or two events) and aborts (a long request that
``/abort_request`` cancels while it runs). Both servers get the same requests in the same order.

A server is sampled while it is idle: the traffic drains before each sample, so "pool slots in
use" is what idles in the pool (cached prefixes and leaks), not what requests hold. Resident
memory and open file descriptors are summed over the server's whole process tree (SGLang runs
its scheduler and detokenizer as children).
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from testkit.fuzz import GENERATE, STATUS, FuzzCase, VocabInfo, generate_cases
from testkit.fuzz_prompts import short_prompt

ABORT = "abort"  # a case the runner cancels mid-flight through /abort_request


@dataclass(frozen=True)
class TrafficMix:
    """Shares of the request stream that become disconnects and aborts (the rest: the fuzzer's
    mix as drawn, its own disconnect kind included)."""

    disconnect: float = 0.10
    abort: float = 0.03

    def __post_init__(self) -> None:
        if not (0 <= self.disconnect and 0 <= self.abort and self.disconnect + self.abort < 1):
            raise ValueError(f"shares must be >= 0 and sum below 1, got {self}")


def traffic(seed: int, vocab: VocabInfo, mix: TrafficMix, batch: int = 500,
            exclude: tuple[str, ...] = ()) -> Iterator[FuzzCase]:  # fmt: skip
    """An endless, seeded stream of cases, numbered from 0 (same seed: same stream); ``exclude``
    drops the fuzzer's cases of those kinds or tags."""
    rng = random.Random(seed ^ 0x50A4)
    index, block = 0, 0
    while True:
        for drawn in generate_cases(seed * 1_000_003 + block, batch, vocab, exclude=exclude):
            roll = rng.random()
            if roll < mix.disconnect:
                drawn = _disconnect(rng)
            elif roll < mix.disconnect + mix.abort:
                drawn = _abort(rng, index)
            yield dataclasses.replace(drawn, index=index)
            index += 1
        block += 1


def _disconnect(rng: random.Random) -> FuzzCase:
    params = {"temperature": 0, "max_new_tokens": rng.randint(24, 64), "ignore_eos": True}
    body = {"text": short_prompt(rng), "sampling_params": params, "stream": True}
    return FuzzCase(-1, "disconnect", GENERATE, body, STATUS, ("stream", "disconnect"),
                    disconnect_after=rng.randint(1, 2))  # fmt: skip


def _abort(rng: random.Random, index: int) -> FuzzCase:
    params = {"temperature": rng.choice([0, 0.8]), "max_new_tokens": rng.randint(48, 128),
              "ignore_eos": True}  # fmt: skip
    body = {"text": short_prompt(rng), "sampling_params": params, "rid": f"soak-abort-{index}"}
    return FuzzCase(-1, ABORT, GENERATE, body, STATUS, (ABORT,))


# -- process sampling ------------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live descendant (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # field 4; the name may hold spaces
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def tree_usage(pid: int) -> dict[str, int]:
    """``{"rss_bytes", "anon_bytes", "file_bytes", "swap_bytes", "memory_bytes", "fds",
    "processes"}`` summed over ``pid``'s process tree (processes that end while being read are
    skipped). ``memory_bytes`` is anonymous resident plus swapped-out memory: what the processes
    allocated, wherever it is now. RSS alone falls on a machine that swaps while nothing is
    freed, and its file-backed part (the model's and libraries' mapped pages, which the kernel
    drops and reads back at will) rises and falls with the machine's pressure, not the server's."""
    fields = ("VmRSS", "RssAnon", "RssFile", "VmSwap")
    total = dict.fromkeys(fields, 0)
    fds = procs = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                kb = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f)
                      if k in fields}  # fmt: skip
            n_fds = len(os.listdir(f"/proc/{p}/fd"))
        except (OSError, ValueError, IndexError):
            continue
        for k in fields:
            total[k] += kb.get(k, 0) * 1024
        fds, procs = fds + n_fds, procs + 1
    return {"rss_bytes": total["VmRSS"], "anon_bytes": total["RssAnon"],
            "file_bytes": total["RssFile"], "swap_bytes": total["VmSwap"],
            "memory_bytes": total["RssAnon"] + total["VmSwap"], "fds": fds, "processes": procs}


def metric_values(text: str, name: str) -> dict[str, float]:
    """Prometheus exposition ``text``: ``{labels: value}`` of every sample of metric ``name``
    (labels as written between the braces, "" when there are none)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, labels = head.partition("{")
        if metric != name:
            continue
        try:
            out[labels.rstrip("}")] = float(value)
        except ValueError:
            continue
    return out


# -- trends ----------------------------------------------------------------------------------


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs`` (0 with fewer than two distinct xs)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


TREND_FIELDS = ("memory_bytes", "anon_bytes", "rss_bytes", "fds", "idle_used_tokens",
                "tier_bytes_in_flight", "demoted_bytes")  # fmt: skip


def trends(samples: list[dict[str, Any]], skip_first: int = 1) -> dict[str, dict[str, float]]:
    """Per field of ``TREND_FIELDS``: first, last, min, max and slope per hour over the samples
    after the first ``skip_first`` (start-up warm-up: allocator pools, compiled kernels), and the
    slope over the second half of the run alone (``late_slope_per_hour``): caches bounded by
    design fill in the first half; what still grows in the second is what would grow forever."""
    body = samples[skip_first:] if len(samples) > skip_first + 1 else samples
    out: dict[str, dict[str, float]] = {}
    for field in TREND_FIELDS:
        pts = [(s["minute"], s[field]) for s in body if s.get(field) is not None]
        if not pts:
            continue
        xs, ys = [p[0] for p in pts], [float(p[1]) for p in pts]
        half = xs[0] + (xs[-1] - xs[0]) / 2
        late = [(x, y) for x, y in zip(xs, ys) if x >= half]
        out[field] = {"first": ys[0], "last": ys[-1], "min": min(ys), "max": max(ys),
                      "slope_per_hour": round(slope(xs, ys) * 60.0, 3),
                      "late_slope_per_hour": round(slope([x for x, _ in late],
                                                         [y for _, y in late]) * 60.0, 3)}
    return out


def window_stats(replies: list[tuple[FuzzCase, Any]]) -> dict[str, Any]:
    """One window's requests: counts by outcome and the median seconds of answered ones."""
    answered = [r for _, r in replies if r.status is not None]
    failed = [r for _, r in replies if r.status is None or r.status >= 500]
    secs = sorted(r.seconds for c, r in replies
                  if r.status == 200 and c.kind not in (ABORT, "disconnect"))  # fmt: skip
    return {"requests": len(replies), "answered": len(answered), "failed": len(failed),
            "median_s": round(secs[len(secs) // 2], 3) if secs else None,
            "failures": [{"index": c.index, "kind": c.kind, "status": r.status,
                          "error": r.error, "seconds": round(r.seconds, 1)}
                         for c, r in replies if r.status is None or r.status >= 500][:10]}
