"""The results page generator (benchmark/results_page.py) on the real results; no server."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from benchmark.results_page import RESULTS, build_page, main, section_titles

SCRIPT = re.compile(r"(?:^|\s)((?:benchmark|scripts|kernels)/[\w/]+\.(?:py|sh))\b")
MODULE = re.compile(r"python -m ([\w.]+)")


def command_cells(page: str) -> list[str]:
    """The command cell of every row of every table whose last column is 'command'."""
    cells, in_table = [], False
    for line in page.splitlines():
        if not line.startswith("|"):
            in_table = False
            continue
        if line.rstrip().endswith("| command |"):
            in_table = True
            continue
        if in_table and not line.startswith("|---"):
            cell = line.rstrip().rstrip("|").rsplit("|", 1)[-1].strip()
            cells.append(cell.strip("`"))
    return cells


def scripts_named(command: str) -> list[Path]:
    """Repository files a command runs: script paths, and `python -m` modules of this package."""
    paths = [REPO / m for m in SCRIPT.findall(command)]
    for module in MODULE.findall(command):
        base = REPO / "python" / Path(*module.split("."))
        paths.append(base / "__main__.py" if base.is_dir() else base.with_suffix(".py"))
    return paths


def test_the_page_from_the_real_results_answers_every_question(tmp_path: Path) -> None:
    out = tmp_path / "README.md"
    assert main(["--out", str(out)]) == 0
    page = out.read_text()
    headings = [line[3:] for line in page.splitlines() if line.startswith("## ")]
    assert headings == section_titles()
    for title in ("Exactness", "Capacity and budget sweep", "Throughput where attention dominates",
                  "Remote prefix across replicas", "LMCache end to end", "Agent fleet capacity",
                  "Agents through the gateway",
                  "Drafting while the prefix is fetched", "Compressor acceptance",
                  "Sampled output", "Request fuzz", "Soak", "Cost model",
                  "GPU kernels"):  # fmt: skip
        assert title in headings
    assert not re.search(r"session [0-9]", page, re.IGNORECASE)
    assert len(page.splitlines()) < 500
    commands = command_cells(page)
    assert len(commands) > 50
    for command in commands:
        named = scripts_named(command)
        assert named, f"no script in command {command!r}"
        for path in named:
            assert path.is_file(), f"{command!r} names {path}, which does not exist"
    # Every row is dated: a day, or one of the two words for "no commit yet".
    for line in page.splitlines():
        if line.startswith("| ") and line.rstrip().endswith("` |"):
            date = line.rstrip().rstrip("|").rsplit("|", 2)[-2].strip()
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}|uncommitted|-", date), line


def test_check_tells_a_stale_page_from_a_current_one(tmp_path: Path) -> None:
    out = tmp_path / "README.md"
    assert main(["--check", "--out", str(out)]) == 1  # no page yet
    assert main(["--out", str(out)]) == 0
    assert main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text().replace("| yes |", "| no |", 1))
    assert main(["--check", "--out", str(out)]) == 1


def test_a_missing_soak_is_not_yet_run_and_a_new_result_is_listed(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    (results / "soak.json").unlink(missing_ok=True)
    (results / "brand_new_run.json").write_text(json.dumps({"date": "2027-01-02", "x": 1}))
    page = build_page(results)
    soak = page.split("## Soak", 1)[1].split("\n## ", 1)[0]
    assert "| not yet run |" in soak and "benchmark/soak.py" in soak
    others = page.split("## Other result files", 1)[1]
    assert "`brand_new_run.json` (2027-01-02)" in others  # the JSON's own date wins
