"""Static cost of the quantized decode kernel without a GPU: compile for sm_90a on this machine
(Triton's bundled ptxas/nvdisasm) and count SASS instructions in the page loop.

Per page and kv head, a decode must issue `loop instructions x warps` warp-instructions; at a
target bandwidth the device's issue rate (SMs x 4 schedulers x clock) bounds what is affordable:
  pages/s = target_bytes_per_s / bytes_per_page;  need warp_instr/page x pages/s < issue rate.
Run: PYTHONPATH=python python kernels/sass_stats.py [--warps 1 2 4] [--bits 4 2]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sglang_vericache.ops.triton import quant_decode_kernels as kernels
from sglang_vericache.ops.triton import quant_decode_swapped as swapped_kernels

DTYPES = {"bf16": (tl.bfloat16, 0x4300, 128.0), "fp16": (tl.float16, 0x6400, 1024.0),
          "fp32": (tl.float32, 0, 0.0)}
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_sass(dtype: str, bits: int, group: int, dim: int, page: int, warps: int,
                 stages: int, fast: bool, lazy: bool = False, exact_group: bool = False,
                 maxnreg: int | None = None, swapped: bool = False) -> tuple[dict[str, str], str]:
    dot, magic, offset = DTYPES[dtype]
    fn = (swapped_kernels.quant_decode_split_kernel_swapped if swapped
          else kernels.quant_decode_split_kernel)
    const = {f"ASM_P{j}": kernels.unpack_asm(bits, magic, j)
             if fast and dtype != "fp32" and j < 8 // bits else "" for j in range(4)}
    const.update(GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim,
                 PAGE=page, BLOCK_P=max(16, triton.next_power_of_2(page)), BITS=bits,
                 BLOCK_W=16, DOT_DTYPE=dot, MAGIC=magic, OFFSET=offset, UPCAST=False,
                 IEEE=dtype == "fp32", LAZY_RESCALE=lazy)
    if exact_group:
        const["BLOCK_G"] = triton.next_power_of_2(group)
    types = {"k_packed_ptr": "*u8", "v_packed_ptr": "*u8", "part_o_ptr": "*fp32",
             "part_lse_ptr": "*fp32", "qk_scale": "fp32"}
    ints = {"num_kv_heads", "window_capacity", "num_splits", "stride_qb", "stride_qh"}
    index_ptrs = {"kv_indptr_ptr", "kv_page_indices_ptr", "kv_last_page_len_ptr",
                  "window_slot_ptr", "window_len_ptr"}
    sig = {}
    for name in fn.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name in ints:
            sig[name] = "i32"
        elif name in index_ptrs:
            sig[name] = "*i32"
        else:
            sig[name] = types.get(name, f"*{dtype}")
    # What the JIT would specialise at run time: 16-byte aligned pointers and strides.
    aligned = {n for n, t in sig.items() if t.startswith("*")} | {"stride_qb", "stride_qh",
                                                                   "window_capacity"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in aligned}
    compiled = triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages,
                                       **({"maxnreg": maxnreg} if maxnreg else {})})
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        Path(ptx).write_text(compiled.asm["ptx"])
        info = subprocess.run([str(BIN / "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin],
                              capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([str(BIN / "nvdisasm"), "-c", cubin], capture_output=True,
                              text=True, check=True).stdout
    stats = {"registers": re.search(r"Used (\d+) registers", info).group(1),
             "spill_bytes": re.search(r"(\d+) bytes spill stores", info).group(1)}
    return stats, sass


def page_loop(sass: str) -> list[str]:
    """Instructions of the first backward-branch loop (the page loop)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"^\s*(\.L_x_\d+):", line))}
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            body = lines[labels[m.group(1)]: i + 1]
            return [x for x in body if re.search(r"/\*[0-9a-f]{4}\*/", x)]
    return []


def opcode(line: str) -> str:
    tokens = re.sub(r"^\s*/\*[0-9a-f]+\*/\s*", "", line).split()
    tokens = tokens[1:] if tokens and tokens[0].startswith("@") else tokens
    return tokens[0] if tokens else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 2])
    parser.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--page", type=int, default=32)
    parser.add_argument("--portable", action="store_true", help="no inline-PTX unpacking")
    parser.add_argument("--top", type=int, default=0, help="print the N commonest opcodes")
    parser.add_argument("--lazy", action="store_true", help="lazy rescaling variant")
    parser.add_argument("--exact-group", action="store_true", help="min_group_rows=1 variant")
    parser.add_argument("--maxnreg", type=int, default=0, help="register cap (0: none)")
    parser.add_argument("--swapped", action="store_true", help="swapped-MMA kernel")
    args = parser.parse_args()
    for bits in args.bits:
        for warps in args.warps:
            stats, sass = compile_sass(args.dtype, bits, args.group, args.dim, args.page, warps,
                                       args.stages, not args.portable, args.lazy,
                                       args.exact_group, args.maxnreg or None, args.swapped)
            loop = page_loop(sass)
            print(f"{args.dtype} int{bits} G={args.group} D={args.dim} P={args.page} "
                  f"warps={warps} stages={args.stages}: regs {stats['registers']}, spills "
                  f"{stats['spill_bytes']} B, page loop {len(loop)} instr/thread = "
                  f"{len(loop) * warps} warp-instr/page = "
                  f"{len(loop) * warps / args.page:.1f} per token")
            if args.top:
                print("   ", Counter(map(opcode, loop)).most_common(args.top))


if __name__ == "__main__":
    main()
