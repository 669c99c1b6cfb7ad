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
         "serving_grid_1k_tight_custom_c8.json", "serving_grid_1k_tight_custom_c8_lookup.json",
         "serving_grid_1k_tight_custom_c16.json", "serving_grid_4k_tight_custom_c8.json",
         "serving_grid_4k_c16_custom.json")
COMMAND = "python benchmark/serving_grid.py"
SERVERS = ("plain", "offload-only", "vericache")

TEXT = """
`python -m sglang.benchmark.serving`, `--vericache` (`auto`) vs the baselines; 64 new tokens each.
Under a tight budget running rows give up their compressed KV for admission; on real text those
rows still verify prompt-lookup drafts of their own context.
"""

HEAD = ["budget", "dataset", "VeriCache / better baseline, output tok/s (input: concurrency ratio)",
        "output tok/s plain / offload-only / VeriCache (heaviest cell)", "identical"]  # fmt: skip


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


Cell = dict[str, Any]
Shape = tuple[str, str, int, int]  # budget, dataset, input length, concurrency


def grid_cells(res: Results) -> dict[Shape, tuple[str, Cell]]:
    """Every summarized cell of the ``GRIDS`` files, with the file it came from; a later file's
    cell replaces an earlier one of the same shape (a rerun)."""
    return {(c["budget"], c["dataset"], c["input_len"], c["concurrency"]): (name, c)
            for name in GRIDS if (report := res.load(name))
            for c in report["cells"] if c.get("summary")}  # fmt: skip


def rows(res: Results, cells: dict[Shape, tuple[str, Cell]]) -> list[Row]:
    """One row per budget and dataset over ``cells`` (``grid_cells``). The row's date is its
    newest file's; its command reruns each file it draws on."""
    groups: dict[tuple[str, str], list[tuple[str, Cell]]] = {}
    for (budget, dataset, _, _), found in sorted(cells.items()):
        groups.setdefault((budget, dataset), []).append(found)
    out = []
    for (budget, dataset), found in groups.items():
        group = [c for _, c in found]
        names = [n for n in GRIDS if any(n == m for m, _ in found)]  # in run order
        by_len: dict[int, list[str]] = {}
        for c in group:
            by_len.setdefault(c["input_len"], []).append(
                f"c{c['concurrency']} " + _num(c["summary"]["ratio"]["output_throughput"], ".2f"))
        ratios = "; ".join(f"{n}: {', '.join(v)}" for n, v in by_len.items())
        top = group[-1]  # the longest input at its highest concurrency
        figures = " / ".join(_num(top["summary"]["servers"].get(s, {}).get("output_throughput"),
                                  ".1f") for s in SERVERS)  # fmt: skip
        row = res.row(max(names, key=res.date), [
            budget, f"`{dataset}`", ratios, f"{figures} (in {top['input_len']}, "
            f"c{top['concurrency']})", _identical(group)],
            " && ".join(res.load(n).get("command", COMMAND) for n in names))  # fmt: skip
        out.append(row)
    return out


def _identical(cells: list[dict[str, Any]]) -> str:
    """'same/total' of VeriCache's texts against plain SGLang's over ``cells``."""
    same = [c["summary"]["identical"].get("vericache", {}) for c in cells]
    return f"{sum(s.get('same', 0) for s in same)}/{sum(s.get('total', 0) for s in same)}"


def serving(res: Results) -> list[str]:
    """The section's body; one line while the grid has not run (the page stays under 500)."""
    found = rows(res, grid_cells(res))
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
    found = grid_cells(res).values()
    cells = [c for _, c in found]
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
    return [("Is it ahead on SGLang's own benchmark?", answer, max(res.date(n) for n, _ in found),
             "Serving through SGLang's client")]  # fmt: skip
