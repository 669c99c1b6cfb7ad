"""One draft forward's attention at one layer, over KIVI views: read packed, or dequantized first.

Side by side in one process, for each batch B and context T: B rows, each a KIVI body of T
tokens (SmolLM2's 3 KV heads x 64 channels, 9 query heads) and 40 full-precision tokens after it
(the residual, window and chain), attended by one query per row:

    packed        the CPU kernel reads the body's codes and scales (``ops/cpu_draft_decode.py``)
    pool pages    the same, the body written to pages of a KV pool's slots, shuffled as an
                  allocator hands them out after churn (``compress/kivi_pages.py``: where a
                  draft row keeps it)
    dequantized   the body dequantized and concatenated, then the same kernel (the path before
                  packed reads, and still the path of other quantizers)
    float32       the kernel over a float32 view of the same length (what a dropper's view of T
                  kept tokens costs: the bytes the codes replace)

Times are the best of ``--repeats`` batches of 10 calls, in ms per layer; a draft forward makes
one call per layer (30 for SmolLM2).

    python benchmark/draft_attention.py                       # B = 1, 8; T = 1.5k, 6.3k; int4
    python benchmark/draft_attention.py --bits 2 4 8 --batch 8

Writes OUT.{json,md}; default OUT benchmark/results/draft_attention.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))

from sglang_vericache.compress.kivi import Kivi  # noqa: E402
from sglang_vericache.compress.kivi_pages import KiviPageLayout, PagedKiviBlock  # noqa: E402
from sglang_vericache.ops.cpu_draft_decode import load_cpu_draft_decode  # noqa: E402

H_Q, H_KV, D, TAIL = 9, 3, 64, 40


def best_ms(run, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(10):
            run()
        times.append((time.perf_counter() - started) / 10)
    return 1e3 * min(times)


def measure(kernel, batch: int, tokens: int, bits: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(batch * tokens + bits)
    full = [(torch.randn(H_KV, tokens, D, generator=g), torch.randn(H_KV, tokens, D, generator=g))
            for _ in range(batch)]  # fmt: skip
    bodies = [Kivi(bits=bits).quantize(k, v) for k, v in full]
    tail = [torch.randn(H_KV, TAIL, D, generator=g) for _ in range(batch)]
    q = torch.randn(batch, H_Q, D, generator=g)

    def dequantized():
        views = [(torch.cat([bk, t], dim=1), torch.cat([bv, t], dim=1))
                 for (bk, bv), t in zip((b.dequantize() for b in bodies), tail)]  # fmt: skip
        return kernel(q, [k for k, _ in views], [v for _, v in views], 0.125)

    floats = [(torch.cat([k, t], dim=1), torch.cat([v, t], dim=1)) for (k, v), t in zip(full, tail)]
    paged = in_pool_pages(bodies, g)
    ms = {
        "packed": best_ms(lambda: kernel(q, tail, tail, 0.125, bodies), repeats),
        "pool_pages": best_ms(lambda: kernel(q, tail, tail, 0.125, paged), repeats),
        "dequantized": best_ms(dequantized, repeats),
        "float32": best_ms(lambda: kernel(q, [k for k, _ in floats], [v for _, v in floats],
                                          0.125), repeats),  # fmt: skip
    }
    return {"batch": batch, "tokens": tokens, "bits": bits, "threads": torch.get_num_threads(),
            "ms_per_layer": {k: round(v, 3) for k, v in ms.items()},
            "dequantized_over_packed": round(ms["dequantized"] / ms["packed"], 2),
            "pages_over_packed": round(ms["pool_pages"] / ms["packed"], 2)}


def in_pool_pages(bodies: list, g: torch.Generator) -> list[PagedKiviBlock]:
    """Each body written to pages of one pool (slots shuffled; slot 0 left as SGLang's pad)."""
    need = [KiviPageLayout.of(b).pages_for(b.num_tokens) for b in bodies]
    key_buffer, value_buffer = torch.zeros(2, sum(need) + 1, H_KV, D)
    slots = torch.randperm(sum(need), generator=g) + 1
    starts = [sum(need[:i]) for i in range(len(need))]
    return [PagedKiviBlock.write(b, key_buffer, value_buffer, slots[s : s + n])
            for b, s, n in zip(bodies, starts, need)]  # fmt: skip


def write(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["# Draft attention over KIVI views: packed reads against dequantizing first", "",
             f"`python benchmark/draft_attention.py`, {rows[0]['threads']} threads; ms per layer "
             "(one call per layer of a draft forward), best of the repeats.", "",
             "| rows | tokens per row | bits | packed | in pool pages | dequantized | float32 view | "
             "dequantized / packed | pages / packed |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        ms = r["ms_per_layer"]
        lines.append(f"| {r['batch']} | {r['tokens']} | {r['bits']} | {ms['packed']} | "
                     f"{ms['pool_pages']} | {ms['dequantized']} | {ms['float32']} | "
                     f"{r['dequantized_over_packed']}x | {r['pages_over_packed']}x |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def case_args(doc: str, tokens: list[int], out: str) -> argparse.ArgumentParser:
    """The arguments of a kernel benchmark at one layer: batches, contexts, repeats, output
    (this one's and ``verify_attention.py``'s)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, nargs="+", default=tokens)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=REPO / "benchmark/results" / out)
    return ap


def built(kernel):
    """``kernel``, or an exit where the CPU attention kernels did not build."""
    if kernel is None:
        sys.exit("the CPU attention kernels did not build (see the log above)")
    return kernel


def main() -> None:
    ap = case_args(__doc__, [1536, 6336], "draft_attention")
    ap.add_argument("--bits", type=int, nargs="+", default=[4])
    args = ap.parse_args()
    kernel = built(load_cpu_draft_decode())
    cases = [(b, t, bits) for b in args.batch for t in args.tokens for bits in args.bits]
    rows = [measure(kernel, b, t, bits, args.repeats) for b, t, bits in tqdm(cases, desc="cases")]
    write(rows, args.out)
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
