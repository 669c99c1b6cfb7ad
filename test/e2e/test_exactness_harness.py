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


@pytest.fixture(scope="module")
def control(tmp_path_factory) -> tuple[int, dict, Path]:
    """Plain vs plain, its reference saved for the next run: (exit code, summary, cache)."""
    tmp = tmp_path_factory.mktemp("control")
    cache = tmp / "reference.json"
    rc, summary = run_harness(tmp, "--reference-cache", str(cache))
    return rc, summary, cache


def test_control_plain_vs_plain_finds_no_divergence(control) -> None:
    rc, summary, cache = control
    assert summary["total"] == len(PROMPTS)
    assert summary["divergent"] == 0 and summary["status"] == "identical"
    assert rc == 0 and cache.exists()
    assert all(p["reference_len"] == 24 or p["reference_len"] > 0 for p in summary["prompts"])


def test_a_different_model_is_reported_divergent_against_the_saved_reference(
    control, tmp_path: Path
) -> None:
    """The candidate's model is changed (an RMSNorm epsilon far from the trained one), the
    reference comes from the control's cache (only the candidate starts): the harness reports
    where the greedy tokens part."""
    _, first_run, cache = control
    override = json.dumps({"rms_norm_eps": 4.0})
    rc, summary = run_harness(tmp_path, "--reference-cache", str(cache),
                              "--candidate-extra", f"--json-model-override-args '{override}'")
    assert summary["reference_seconds"] == first_run["reference_seconds"]  # reused, not rerun
    assert rc == 1 and summary["status"] == "divergent"
    assert summary["divergent"] >= 1
    first = next(p for p in summary["prompts"] if not p["identical"])
    assert first["first_divergence"] is not None
