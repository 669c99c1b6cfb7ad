"""Print the GPU check's summary line from the JSON files under an output folder.

Usage: python kernels/summarize.py OUT_DIR  (writes OUT_DIR/summary.json too)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SLOWDOWN_LIMIT_PCT = 15.0
MIN_OVERLAP = 0.8  # share of the drafting window a copy must cover for the slowdown to count
KEY_SHAPE = "gqa4_h8_d128_b32x8k"


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu_out")
    summary: dict[str, object] = {}
    steps = (out / "steps.txt").read_text().split() if (out / "steps.txt").exists() else []
    summary["steps_rc"] = dict(zip(steps[::2], steps[1::2]))
    decode = _load(out / "pool_kivi_decode.json")
    if decode:
        summary["copy_GBps"] = (decode.get("copy") or {}).get("d2d_copy_GBps")
        for res in decode["results"]:
            key = f"{res['shape']['name']}_int{res['bits']}_{res['dtype'].split('.')[-1]}"
            summary[key] = {name: res.get(name) for name in (
                "GBps", "pct_of_copy_bw", "us", "speedup_over_fallback", "ok")}
    overlap = _load(out / "overlap.json")
    if overlap:
        for key in ("draft_slowdown_pct", "overlap_fraction", "overlap_ok", "steps_under_copy",
                    "h2d_GBps_in_window", "submit_host_ms_max"):
            summary[key] = overlap.get(key)
        raw = overlap.get("raw_torch_overlap") or {}
        summary["raw_torch_overlap_fraction"] = raw.get("overlap_fraction")
        summary["platform"] = overlap.get("platform")
    unset = _load(out / "overlap_env_unset.json")
    if unset:
        summary["overlap_fraction_env_unset"] = unset.get("overlap_fraction")
        summary["draft_slowdown_pct_env_unset"] = unset.get("draft_slowdown_pct")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))

    int4 = summary.get(f"{KEY_SHAPE}_int4_bfloat16")
    timed = isinstance(int4, dict) and int4.get("GBps") is not None
    pct = f"{int4['pct_of_copy_bw']:.1f}%" if timed else "n/a"
    gbps = f"{int4['GBps']:.0f} GB/s" if timed else "n/a"
    over = f"{int4['speedup_over_fallback']:.1f}x" if timed else "n/a"
    slow = summary.get("draft_slowdown_pct")
    frac = summary.get("overlap_fraction")
    slow_s = f"{slow:.1f}%" if isinstance(slow, (int, float)) else "n/a"
    frac_s = f"{100 * frac:.0f}%" if isinstance(frac, (int, float)) else "n/a"
    agrees = isinstance(int4, dict) and int4.get("ok") is True
    overlapped = (isinstance(frac, (int, float)) and frac >= MIN_OVERLAP
                  and summary.get("overlap_ok") is True)
    slow_pass = overlapped and isinstance(slow, (int, float)) and slow < SLOWDOWN_LIMIT_PCT
    tests_rc = summary["steps_rc"].get("kernel_tests", "n/a")
    raw = summary.get("raw_torch_overlap_fraction")
    raw_s = f"{100 * raw:.0f}%" if isinstance(raw, (int, float)) else "n/a"
    print(f"SUMMARY Triton draft decode, int4 pool pages, B32x8k H_kv=8 D=128: {gbps} = {pct} of "
          f"copy bw, {over} the per-row dequantize + SDPA it replaces (agrees with the reference: "
          f"{'PASS' if agrees else 'FAIL'}) | "
          f"draft slowdown under concurrent full-KV copy: {slow_s} over a window {frac_s} "
          f"covered by copies (target < {SLOWDOWN_LIMIT_PCT:.0f}% with >= "
          f"{100 * MIN_OVERLAP:.0f}% covered: {'PASS' if slow_pass else 'FAIL'}; raw torch "
          f"overlap {raw_s}) | "
          f"kernel tests rc={tests_rc}")


if __name__ == "__main__":
    main()
