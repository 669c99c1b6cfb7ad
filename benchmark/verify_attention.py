"""One verify forward's attention at one layer: the CPU verify kernel against torch's SDPA loop.

Side by side in one process, for each batch B and context T: B rows of T keys (SmolLM2's 3 KV
heads x 64 channels, 9 query heads), each a view of a wider host buffer as an offloaded row is
read in place, and N verify queries a row (the last committed token and N - 1 drafts), causal
within the last N keys:

    sdpa loop     what ``srt/attention/backend.py`` ran before the kernel: per row, one masked
                  ``grouped_sdpa`` call (the group's heads folded into the query axis)
    kernel        ``ops/cpu_verify_decode.py``: every row of the layer in one call

Times are the best of ``--repeats`` batches of 10 calls, in ms per row and layer (a verify
makes one call per layer: 30 for SmolLM2). The largest difference between the two outputs is
reported too (float32 both, summed in different orders).

    python benchmark/verify_attention.py                     # B = 1, 8; T = 2k, 6.3k; N = 6
    python benchmark/verify_attention.py --batch 8 16 --queries 3 9

Writes OUT.{json,md}; default OUT benchmark/results/verify_attention.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "benchmark"))

from draft_attention import best_ms, built, case_args  # noqa: E402

from sglang_vericache.compress.attend import group_mask, grouped_sdpa  # noqa: E402
from sglang_vericache.ops.cpu_verify_decode import load_cpu_verify_decode  # noqa: E402

H_Q, H_KV, D, ROOM = 9, 3, 64, 300  # ROOM: the host buffer's free columns after the row


def measure(kernel, batch: int, tokens: int, queries: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(batch * tokens + queries)
    buffers = [torch.randn(2, H_KV, tokens + ROOM, D, generator=g) for _ in range(batch)]
    keys = [b[0, :, :tokens] for b in buffers]
    values = [b[1, :, :tokens] for b in buffers]
    q = torch.randn(batch, queries, H_Q, D, generator=g)
    scale = D**-0.5
    visible = torch.arange(tokens)[None] <= torch.arange(tokens - queries, tokens)[:, None]
    mask = group_mask(visible, H_Q // H_KV)

    def sdpa_loop() -> torch.Tensor:
        return torch.stack([grouped_sdpa(q[b].transpose(0, 1), keys[b], values[b], scale, mask)
                            .transpose(0, 1) for b in range(batch)])  # fmt: skip

    def kernel_call() -> torch.Tensor:  # the verify's ragged layout, every row at the width
        return kernel(q.view(batch * queries, H_Q, D), keys, values, scale,
                      [queries] * batch).view(q.shape)  # fmt: skip

    diff = (sdpa_loop() - kernel_call()).abs().max().item()
    sdpa_ms, kernel_ms = best_ms(sdpa_loop, repeats), best_ms(kernel_call, repeats)
    return {"batch": batch, "tokens": tokens, "queries": queries,
            "sdpa_ms_per_row": sdpa_ms / batch, "kernel_ms_per_row": kernel_ms / batch,
            "speedup": sdpa_ms / kernel_ms, "max_abs_diff": diff}  # fmt: skip


def write(rows: list[dict], out: Path) -> None:
    out.with_suffix(".json").write_text(json.dumps({"threads": torch.get_num_threads(),
                                                    "rows": rows}, indent=2))  # fmt: skip
    lines = ["# Verify attention at one layer: CPU kernel vs torch's SDPA loop", "",
             f"SmolLM2's heads ({H_Q} query, {H_KV} KV, D {D}), float32, "
             f"{torch.get_num_threads()} threads; ms per row and layer, best of the repeats. "
             "`python benchmark/verify_attention.py`.", "",
             "| rows x keys | queries a row | SDPA loop | kernel | speedup | max abs diff |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['batch']} x {r['tokens']} | {r['queries']} | "
                     f"{r['sdpa_ms_per_row']:.3f} | {r['kernel_ms_per_row']:.3f} | "
                     f"{r['speedup']:.2f}x | {r['max_abs_diff']:.1e} |")  # fmt: skip
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = case_args(__doc__, [2000, 6336], "verify_attention")
    ap.add_argument("--queries", type=int, nargs="+", default=[6])
    args = ap.parse_args()
    kernel = built(load_cpu_verify_decode())
    cases = [(b, t, n) for b in args.batch for t in args.tokens for n in args.queries]
    rows = []
    for batch, tokens, queries in tqdm(cases, desc="verify attention"):
        rows.append(measure(kernel, batch, tokens, queries, args.repeats))
        tqdm.write(json.dumps(rows[-1]))
        write(rows, args.out)
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
