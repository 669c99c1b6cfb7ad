"""The exactness harness on real servers: the plain-vs-plain control, and a known divergence."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# Real servers on 2 shared cores: generous per-test limits (fixtures start servers too).
pytestmark = [pytest.mark.sglang, pytest.mark.model, pytest.mark.timeout(1800)]

PROMPTS = [
    {"id": "code", "prompt": "import json\n\ndef load_config(path):\n"},
    {"id": "prose", "prompt": "The history of the printing press begins"},
    {"id": "chatml", "prompt": "<|im_start|>user\nName three prime numbers.<|im_end|>\n"
                               "<|im_start|>assistant\n"},  # fmt: skip
]
SERVER_ARGS = ["--max-total-tokens", "16384", "--skip-server-warmup"]


def run_harness(tmp_path: Path, *options: str) -> tuple[int, dict]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "sglang_vericache.exactness", "--prompts", str(prompts),
           "--max-new-tokens", "24", "--concurrency", "2", "--output", str(out),
           "--log-dir", str(tmp_path / "logs"), *options, "--", *SERVER_ARGS]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert json.loads(proc.stdout) == summary  # the summary is what it prints
    return proc.returncode, summary


def test_control_plain_vs_plain_finds_no_divergence(tmp_path: Path) -> None:
    rc, summary = run_harness(tmp_path)
    assert summary["total"] == len(PROMPTS)
    assert summary["divergent"] == 0 and summary["status"] == "identical"
    assert rc == 0
    assert all(p["reference_len"] == 24 or p["reference_len"] > 0 for p in summary["prompts"])


def test_sampled_candidate_with_another_seed_is_reported_divergent(tmp_path: Path) -> None:
    rc, summary = run_harness(
        tmp_path, "--temperature", "1.0",
        "--reference-extra", "--random-seed 1", "--candidate-extra", "--random-seed 2",
    )  # fmt: skip
    assert rc == 1 and summary["status"] == "divergent"
    assert summary["divergent"] >= 1
    first = next(p for p in summary["prompts"] if not p["identical"])
    assert first["first_divergence"] is not None
