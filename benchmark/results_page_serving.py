"""Results page section: serving benchmarks through SGLang's own client (serving_grid.json).

``serving(res)`` returns the section's body: one table, a row per (budget, dataset) giving
VeriCache's output tokens/s over the better baseline cell by cell (median over rounds), the three
servers' figures at the grid's heaviest cell, and identical texts; "not yet run" without the JSON.
The full per-cell table (TTFT, TPOT, ratios by round) is serving_grid.md, written beside it.
"""

from __future__ import annotations

from typing import Any

from benchmark.results_page import Results, Row, prose, table

# the grid's runs so far, each a part of the grid (one machine runs a few cells an hour), merged
# on the page by budget and dataset; the single rounds of serving_grid.json (4k / c8) and
# serving_grid_1k.json (1k / c1, c16) are superseded by paired runs
GRIDS = ("serving_grid_1k_paired.json", "serving_grid_1k_c8.json", "serving_grid_4k_random.json",
         "serving_grid_4k_c8_custom.json", "serving_grid_4k_c16.json",
         "serving_grid_4k_tight_c8.json", "serving_grid_1k_tight_c8.json",
         "serving_grid_1k_tight_c16.json", "serving_grid_1k_tight_c1.json",
         "serving_grid_4k_c8_gsp.json", "serving_grid_7k.json", "serving_grid_7k_c1.json",
         "serving_grid_1k_custom.json", "serving_grid_4k_tight_c1.json",
         "serving_grid_4k_custom_c1.json", "serving_grid_1k_tight_custom.json",
         "serving_grid_1k_tight_custom_c8.json")
COMMAND = "python benchmark/serving_grid.py"
SERVERS = ("plain", "offload-only", "vericache")

TEXT = """
`python -m sglang.benchmark.serving`, `--vericache` (`auto`) vs the baselines; 64 new tokens each.
"""

HEAD = ["budget", "dataset", "VeriCache / better baseline, output tok/s (input: concurrency ratio)",
        "output tok/s plain / offload-only / VeriCache (heaviest cell)", "identical"]  # fmt: skip


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def rows(res: Results, reports: dict[str, dict[str, Any]]) -> list[Row]:
    """One row per budget and dataset over every report (``{file name: report}``): a later
    report's cell replaces an earlier one of the same input length and concurrency. The row's
    date is its newest report's; its command reruns each report it draws on."""
    groups: dict[tuple[str, str], dict[tuple[int, int], tuple[str, dict[str, Any]]]] = {}
    for name, report in reports.items():
        for c in report["cells"]:
            if c.get("summary"):
                key = (c["input_len"], c["concurrency"])
                groups.setdefault((c["budget"], c["dataset"]), {})[key] = (name, c)
    out = []
    for (budget, dataset), found in sorted(groups.items()):
        cells = [c for _, (_, c) in sorted(found.items())]
        names = list(dict.fromkeys(n for n, _ in found.values()))
        by_len: dict[int, list[str]] = {}
        for c in cells:
            by_len.setdefault(c["input_len"], []).append(
                f"c{c['concurrency']} " + _num(c["summary"]["ratio"]["output_throughput"], ".2f"))
        ratios = "; ".join(f"{n}: {', '.join(v)}" for n, v in by_len.items())
        top = cells[-1]  # the longest input at its highest concurrency
        figures = " / ".join(_num(top["summary"]["servers"].get(s, {}).get("output_throughput"),
                                  ".1f") for s in SERVERS)  # fmt: skip
        row = res.row(max(names, key=res.date), [
            budget, f"`{dataset}`", ratios, f"{figures} (in {top['input_len']}, "
            f"c{top['concurrency']})", _identical(cells)],
            " && ".join(reports[n].get("command", COMMAND) for n in names))  # fmt: skip
        out.append(row)
    return out


def _identical(cells: list[dict[str, Any]]) -> str:
    """'same/total' of VeriCache's texts against plain SGLang's over ``cells``."""
    same = [c["summary"]["identical"].get("vericache", {}) for c in cells]
    return f"{sum(s.get('same', 0) for s in same)}/{sum(s.get('total', 0) for s in same)}"


def serving(res: Results) -> list[str]:
    """The section's body; one line while the grid has not run (the page stays under 500)."""
    found = rows(res, {name: report for name in GRIDS if (report := res.load(name))})
    if not found:
        not_run = (f"Not yet run: `{COMMAND}` (SGLang's own client, `python -m "
                   "sglang.benchmark.serving`, against plain SGLang, offload-only and "
                   "`--vericache`).")
        return [not_run]
    links = res.links(*(n.replace(".json", ".md") for n in GRIDS))
    text = prose(TEXT)  # one paragraph with the links: the page stays under 500 lines
    if links:
        text[-1] += f" Per cell (TTFT, TPOT, ratios by round): {links}."
    return text + [""] + table(HEAD, found)


def serving_headline(res: Results) -> list[tuple[str, str, str, str]]:
    """The headline row: every grid cell's ratio (median over its rounds), the lowest named."""
    found = {name: cells for name in GRIDS if (report := res.load(name))
             if (cells := [c for c in report["cells"] if c.get("summary")])}  # fmt: skip
    # a later file's cell replaces an earlier one of the same shape, as in the table
    cells = list({(c["budget"], c["dataset"], c["input_len"], c["concurrency"]): c
                  for name_cells in found.values() for c in name_cells}.values())  # fmt: skip
    if not cells:
        return []

    def ratio(c: dict[str, Any]) -> float:
        return c["summary"]["ratio"]["output_throughput"]

    def kinds(key: str) -> str:
        return "/".join(str(v) for v in sorted({c[key] for c in cells}))

    rated = [c for c in cells if ratio(c) is not None]  # None: a server failed in the cell
    if not rated:
        return []
    low, high = min(rated, key=ratio), max(rated, key=ratio)
    unrated = len(cells) - len(rated)
    failed = f" ({unrated} without a ratio: a server failed)" if unrated else ""
    paired = sum(len(c["summary"]["ratio_by_round"]["output_throughput"]) > 1 for c in cells)
    answer = (f"`python -m sglang.benchmark.serving`, VeriCache's output tok/s over the better of "
              f"plain SGLang and offload-only in {len(cells)} cells (inputs {kinds('input_len')}, "
              f"concurrency {kinds('concurrency')}, {kinds('dataset')}, budgets "
              f"{kinds('budget')}; {paired} in paired rounds): "
              f"**{ratio(low):.2f}-{ratio(high):.2f}x**, lowest at {low['budget']} "
              f"{low['input_len']} / c{low['concurrency']} `{low['dataset']}`{failed}; "
              f"{_identical(cells)} texts identical")  # fmt: skip
    return [("Is it ahead on SGLang's own benchmark?", answer, max(map(res.date, found)),
             "Serving through SGLang's client")]  # fmt: skip
