"""Generate benchmark/README.md, the results page, from benchmark/results/*.json.

    python benchmark/results_page.py            # rewrite benchmark/README.md
    python benchmark/results_page.py --check    # exit 1 if benchmark/README.md is stale

One section per question (exactness, capacity, throughput where attention dominates, remote
prefix, ...), each a table whose every row carries the date of its result and the command that
regenerates it. A row's date is the JSON's own ``date`` field where it has one, else the day its
file was last committed (``git log -1 --format=%cs``), else ``uncommitted``. The prose beside
each table is fixed text kept with its section's renderer (``results_page_*.py``): what is
measured, and the limits and negative results, stated plainly. Run history lives in git, not on
the page. Result files that no section reads are listed at the end with their dates, so a new
result is never silently left off.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PAGE = REPO / "benchmark" / "README.md"
RESULTS = REPO / "benchmark" / "results"
OFFLOAD = "offload only, no drafting (--vericache-draft-len 0)"


@dataclass(frozen=True)
class Row:
    """One table row: its result cells, the date of the result, the command that makes it."""

    cells: tuple[str, ...]
    date: str
    command: str


@dataclass
class Results:
    """Reads result files under ``root`` and remembers which ones the page used."""

    root: Path
    used: set[str] = field(default_factory=set)
    _json: dict[str, Any] = field(default_factory=dict)
    _dates: dict[str, str] = field(default_factory=dict)
    _git_days: dict[str, str] | None = None

    def has(self, name: str) -> bool:
        return (self.root / name).is_file()

    def load(self, name: str) -> Any:
        """The parsed JSON of ``name`` (relative to root), or None when the file is absent."""
        if name not in self._json:
            path = self.root / name
            self._json[name] = json.loads(path.read_text()) if path.is_file() else None
        if self._json[name] is not None:
            self.used.add(name)
        return self._json[name]

    def date(self, name: str) -> str:
        """The result's own ``date`` field, else its last commit's day, else ``uncommitted``."""
        if name in self._dates:
            return self._dates[name]
        data = self.load(name) if name.endswith(".json") else None
        stamp = data.get("date") if isinstance(data, dict) else None
        if not isinstance(stamp, str) or not stamp:
            if self._git_days is None:
                self._git_days = git_days(self.root)
            stamp = self._git_days.get(name, "uncommitted")
        self._dates[name] = stamp
        return stamp

    def row(self, name: str, cells: Iterable[Any], command: str) -> Row:
        return Row(tuple(str(c) for c in cells), self.date(name), command)

    def links(self, *names: str) -> str:
        """Markdown links to those of ``names`` that exist (detail tables, plots), or ''."""
        found = [n for n in names if self.has(n)]
        for n in found:
            self.used.add(n)
        return ", ".join(f"[{n}](results/{n})" for n in found)


# the headline's throughput runs: the same command at the same code, their rounds pooled
THROUGHPUT_HEADLINE = ("step_profile_joined.json", "step_profile_joined_r3.json")


def git_days(root: Path) -> dict[str, str]:
    """The day each file under ``root`` was last committed (YYYY-MM-DD), by path under root.

    One ``git log`` over the directory; a file never committed (or no git) is absent.
    """
    try:
        command = ["git", "log", "--format=@%cs", "--name-only", "--relative", "--", "."]
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=120,
                              check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {}
    if done.returncode != 0:
        return {}
    days: dict[str, str] = {}
    day = ""
    for line in done.stdout.splitlines():
        if line.startswith("@"):
            day = line[1:]
        elif line and line not in days:  # newest commit first: the first day seen is the last
            days[line] = day
    return days


def table(header: Sequence[str], rows: Sequence[Row]) -> list[str]:
    """A markdown table: ``header`` + date + command columns, one line per row."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join([*header, "date", "command"]) + " |",
             "|" + "---|" * (len(header) + 2)]  # fmt: skip
    for r in rows:
        if len(r.cells) != len(header):
            raise ValueError(f"row has {len(r.cells)} cells for {len(header)} columns: {r.cells}")
        lines.append("| " + " | ".join([*(cell(c) for c in r.cells), r.date,
                                         f"`{r.command}`"]) + " |")  # fmt: skip
    return lines


def prose(text: str) -> list[str]:
    """Fixed text as page lines (a paragraph per blank-line-separated block)."""
    return [line.rstrip() for line in text.strip("\n").splitlines()]


def fx(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}x"


def span(values: Iterable[float], unit: str = "x", digits: int = 2) -> str:
    """'lo-hi' of ``values`` with ``unit`` (one value when they are equal)."""
    vals = sorted(values)
    if not vals:
        return "-"
    lo, hi = f"{vals[0]:.{digits}f}", f"{vals[-1]:.{digits}f}"
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def short_server(name: str) -> str:
    """A benchmark's server label as the page writes it."""
    if name == OFFLOAD:
        return "offload-only"
    if name.startswith("vericache "):
        return "VeriCache " + name.removeprefix("vericache ")
    return name


def ratio_over_turns(per_turn: dict, slow: str, fast: str, key: str) -> list[float]:
    """slow/fast ratios of ``key`` (ttft_s or e2e_s), turn by turn."""
    return [per_turn[slow][t][key] / per_turn[fast][t][key] for t in sorted(per_turn[fast])]


# The sections, in page order; each renderer returns its body lines (the page adds the heading).
Renderer = Callable[[Results], list[str]]


def sections() -> list[tuple[str, Renderer]]:
    from benchmark import results_page_memory as memory
    from benchmark import results_page_quality as quality
    from benchmark import results_page_robustness as robustness
    from benchmark import results_page_serving as serving
    from benchmark import results_page_tier as tier

    return [
        ("Exactness", quality.exactness),
        ("Capacity and budget sweep", memory.capacity),
        ("Latency under load", memory.latency),
        ("Throughput where attention dominates", memory.step_profile),
        ("Serving through SGLang's client", serving.serving),
        ("Remote prefix across replicas", tier.remote_prefix),
        ("LMCache end to end", tier.lmcache),
        ("Agent fleet capacity", tier.agent_fleet),
        ("Agents through the gateway", tier.fleet_gateway),
        ("Drafting while the prefix is fetched", tier.fetch_drafting),
        ("Compressor acceptance", quality.compressors),
        ("Sampled output", quality.sampled),
        ("Request fuzz", robustness.fuzz),
        ("Soak", robustness.soak),
        ("Cost model", quality.cost_model),
        ("CPU kernels", memory.cpu_kernels),
        ("GPU kernels", quality.gpu_kernels),
    ]


def section_titles() -> list[str]:
    """Every ``##`` heading of the page, in order."""
    return ["Headline", *(title for title, _ in sections()), "Other result files"]


def anchor(title: str) -> str:
    """GitHub's heading slug: lower case, punctuation dropped, spaces to hyphens."""
    return "#" + re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


INTRO = """
# Benchmark results

Generated by `python benchmark/results_page.py` from `benchmark/results/*.json` (do not edit;
`--check` exits 1 when the page is stale). Every row gives the date of its result and the command
that regenerates it, run from the repository root with the project venv. Unless a row says
otherwise: SmolLM2-135M-Instruct in float32 on 2 shared CPU cores, where host memory and the KV
pool are the same DRAM. Offload-only is `--vericache --vericache-draft-len 0` (the same memory
layout and attention path, no drafting): the baseline that isolates what drafting buys. Servers
run one after another on shared cores differ by 10-30%; `--rounds` alternates them.
"""


def headline(res: Results) -> list[str]:
    """The answers first: one row per question, linking to its section."""
    rows: list[tuple[str, str, str, str]] = []

    from benchmark.results_page_robustness import latest_fuzz
    from benchmark.results_page_serving import serving_headline
    from benchmark.results_page_tier import gateway_headline

    sweep = res.load("exactness/sweep.json") or []
    fuzz_commit, fuzz = latest_fuzz(res)
    if sweep:
        same = sum(r["identical"] for r in sweep)
        total = sum(r["total"] for r in sweep)
        answer = (f"yes: **{same}/{total}** long prompts token-identical to plain SGLang (6 "
                  f"compressors, 256 new tokens, concurrency 1 and 8)")  # fmt: skip
        if fuzz:
            answer += (f"; fuzz on commit {fuzz_commit}: {fuzz['requests']} requests, "
                       f"{fuzz['greedy_mismatches']} greedy token differences, "
                       f"{fuzz['server_deaths']} server deaths (every run: "
                       "[Request fuzz](#request-fuzz))")  # fmt: skip
        rows.append(("Is it exact?", answer, res.date("exactness/sweep.json"), "Exactness"))

    cap = res.load("capacity.json")
    if cap:
        by = {short_server(r["server"]): r for r in cap["rows"]}
        parts = [f"{k}: **{r['peak_running']}** at once, {fx(r['throughput_vs_plain'])} "
                 "plain's tok/s" for k, r in by.items() if k != "plain"]  # fmt: skip
        answer = (f"a KV budget of {cap['n_full']} full-KV requests ({cap['prompt_tokens']} + "
                  f"{cap['max_new_tokens']} tokens): plain {by['plain']['peak_running']}; "
                  + "; ".join(parts))  # fmt: skip
        rows.append(("How many long requests fit one budget?", answer, res.date("capacity.json"),
                     "Capacity and budget sweep"))  # fmt: skip

    runs = [run for name in THROUGHPUT_HEADLINE if (sp := res.load(name)) for run in sp["runs"]]
    if runs:
        ratios = [r["ratio"] for run in runs for r in run["rounds"]]
        e2e = [run["systems"]["vericache"]["e2e_vs_offload"] for run in runs]
        lookup = sum((run["profile"].get("decisions") or {}).get("lookup drafts pay", 0)
                     for run in runs)  # fmt: skip
        steps = sum(run["profile"]["steps"] for run in runs)
        answer = (f"8 x 5-7k-token prompts: decode **{fx(median(ratios))} offload-only** at the "
                  f"median of {len(ratios)} rounds in {len(runs)} runs "
                  f"({', '.join(fx(r) for r in sorted(ratios))}; prompt-lookup drafts in "
                  f"{int(lookup)} of {steps} profiled steps); end to end, prefill included, "
                  + ", ".join(fx(e) for e in e2e))  # fmt: skip
        rows.append(("Is it faster where attention dominates?", answer,
                     res.date(THROUGHPUT_HEADLINE[-1]), "Throughput where attention dominates"))

    mid = res.load("budget_mid_rounds.json")
    if mid:
        vs = []
        for b in mid["sweep"]:
            by = {short_server(r["server"]): r for r in b["rows"]}
            vc = next(r for k, r in by.items() if k.startswith("VeriCache"))
            ratio = vc["throughput_vs_plain"] / by["offload-only"]["throughput_vs_plain"]
            vs.append(f"{b['n_full']}: **{fx(ratio)}**")
        answer = ("8 x 2k prompts, 64 new, budgets of N full-KV requests, VeriCache's tokens/s "
                  "over offload-only's (median of 3 rounds): " + ", ".join(vs)
                  + "; at batch 1 the planner decodes plainly (parity)")  # fmt: skip
        rows.append(("Does drafting pay at short contexts?", answer,
                     res.date("budget_mid_rounds.json"), "Capacity and budget sweep"))  # fmt: skip
    rows += serving_headline(res)

    rp = res.load("remote_prefix.json")
    if rp:
        pt, tier, rec = rp["per_turn"], "replicas, remote tier (VeriCache)", "replicas, recompute"
        answer = (f"a prefix computed on one replica is fetched by the other: TTFT "
                  f"**{span(ratio_over_turns(pt, rec, tier, 'ttft_s'))}**, end to end "
                  f"{span(ratio_over_turns(pt, rec, tier, 'e2e_s'))} against replicas that "
                  f"recompute, identical answers")  # fmt: skip
        rows.append(("Does a remote prefix tier pay?", answer, res.date("remote_prefix.json"),
                     "Remote prefix across replicas"))  # fmt: skip

    ac = res.load("agent_capacity.json")
    if ac:
        c = ac["configs"]
        base = c["plain SGLang"]["all"]["e2e_s"]["median"]
        fetch = c["VeriCache, fetch then decode"]
        gain = base / fetch["all"]["e2e_s"]["median"]
        answer = (f"{ac['sessions']} agent sessions x {ac['turns']} turns on a budget of "
                  f"~{ac['holds']}: end to end per turn **{fx(gain)}"
                  f"** plain SGLang at the median, all turns in {fetch['wall_s']:.0f} s vs "
                  f"{c['plain SGLang']['wall_s']:.0f} s")  # fmt: skip
        rows.append(("Does an agent fleet on a tight budget gain?", answer,
                     res.date("agent_capacity.json"), "Agent fleet capacity"))  # fmt: skip

    rows += gateway_headline(res)
    sd = res.load("sampled_distribution.json")
    if sd:
        ps = [r[k]["p_value"] for r in sd["rows"] for k in ("first_token", "first_three")]
        answer = (f"same distribution as plain SGLang: smallest p {min(ps):.2f} over {len(ps)} "
                  f"chi-square tests; a 0.06-TV wrong pair is rejected at p = "
                  f"{sd['wrong_variant']['first_three']['p_value']:.0e}")  # fmt: skip
        rows.append(("Is sampled output exact?", answer, res.date("sampled_distribution.json"),
                     "Sampled output"))  # fmt: skip

    cm = res.load("cost_model.json")
    if cm:
        remote = [link["paper_topology"] for key, h in cm["headline"].items() if "paper" in key
                  for link in h["remote_prefix_32k"].values()]  # fmt: skip
        answer = ("cost model (fitted on CPU, projected): inside the paper's band only under a "
                  "tight KV budget for long-context decoding; remote prefix caching "
                  f"{span(remote)} in the paper's topology at 1-3 GB/s; no GPU end-to-end run "
                  "yet")  # fmt: skip
        rows.append(("What would an H200 give?", answer, res.date("cost_model.json"),
                     "Cost model"))  # fmt: skip

    lines = ["## Headline", "", "| question | answer | date | section |", "|---|---|---|---|"]
    lines += [f"| {q} | {a} | {d} | [{s}]({anchor(s)}) |" for q, a, d, s in rows]
    return lines


def other_files(res: Results) -> list[str]:
    """Every result JSON no section read, with its date: earlier runs, kept for their data."""
    names = sorted(str(p.relative_to(res.root)) for p in res.root.rglob("*.json"))
    left = [n for n in names if n not in res.used]
    # One line (the page stays under 500): what these files are, then the list.
    intro = ("Earlier runs superseded by the rows shown (older code or another machine) and "
             "per-run summaries the tables aggregate; data in `benchmark/results/`, findings in "
             "the git history of this page and of the file: ")
    listed = ", ".join(f"`{n}` ({res.date(n)})" for n in left) + "." if left else "none."
    return ["## Other result files", "", intro + listed]


def build_page(results_dir: Path = RESULTS) -> str:
    res = Results(results_dir)
    parts = [prose(INTRO), headline(res)]
    parts += [[f"## {title}", "", *render(res)] for title, render in sections()]
    parts.append(other_files(res))
    return "\n\n".join("\n".join(p) for p in parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="result files to read")
    ap.add_argument("--out", type=Path, default=PAGE, help="page to write (or check)")
    ap.add_argument("--check", action="store_true", help="exit 1 if --out differs, write nothing")
    args = ap.parse_args(argv)
    page = build_page(args.results)
    if args.check:
        current = args.out.read_text() if args.out.is_file() else ""
        if current != page:
            print(f"{args.out} is stale: run python benchmark/results_page.py", file=sys.stderr)
            return 1
        print(f"{args.out} is up to date")
        return 0
    args.out.write_text(page)
    print(f"wrote {args.out} ({page.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
