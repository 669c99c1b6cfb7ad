"""Print the GPU check's summary line from the JSON files under an output folder.

Usage: python kernels/summarize.py OUT_DIR  (writes OUT_DIR/summary.json too)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

INT4_TARGET_PCT = 60.0
SLOWDOWN_LIMIT_PCT = 15.0
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
    quant = _load(out / "quant_decode.json")
    if quant:
        summary["copy_GBps"] = quant["copy"]["d2d_copy_GBps"]
        for res in quant["results"]:
            if "best" not in res:
                continue
            key = f"{res['shape']['name']}_int{res['bits']}_{res['dtype'].split('.')[-1]}"
            summary[key] = {"GBps": res["best"]["GBps"], "pct_of_copy_bw": res["pct_of_copy_bw"],
                            "us": res["best"]["us"], "ok": res["ok"]}
    overlap = _load(out / "overlap.json")
    if overlap:
        summary["draft_slowdown_pct"] = overlap["draft_slowdown_pct"]
        summary["copy_outlasted_steps"] = overlap["copy_outlasted_steps"]
    (out / "summary.json").write_text(json.dumps(summary, indent=2))

    int4 = summary.get(f"{KEY_SHAPE}_int4_bfloat16")
    pct = f"{int4['pct_of_copy_bw']:.1f}%" if isinstance(int4, dict) else "n/a"
    gbps = f"{int4['GBps']:.0f} GB/s" if isinstance(int4, dict) else "n/a"
    slow = summary.get("draft_slowdown_pct")
    slow_s = f"{slow:.1f}%" if isinstance(slow, (int, float)) else "n/a"
    int4_pass = isinstance(int4, dict) and int4["pct_of_copy_bw"] >= INT4_TARGET_PCT and int4["ok"]
    slow_pass = isinstance(slow, (int, float)) and slow < SLOWDOWN_LIMIT_PCT
    tests_rc = summary["steps_rc"].get("kernel_tests", "n/a")
    print(f"SUMMARY int4 B32x8k H_kv=8 D=128: {gbps} = {pct} of copy bw "
          f"(target >= {INT4_TARGET_PCT:.0f}%: {'PASS' if int4_pass else 'FAIL'}) | "
          f"draft slowdown under concurrent full-KV copy: {slow_s} "
          f"(target < {SLOWDOWN_LIMIT_PCT:.0f}%: {'PASS' if slow_pass else 'FAIL'}) | "
          f"kernel tests rc={tests_rc}")


if __name__ == "__main__":
    main()
