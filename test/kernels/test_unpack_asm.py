"""The GPU-only unpacking PTX, checked on CPU by a tiny emulator of the three instructions it
uses (prmt, shr, lop3), over every byte value, every plane, both bit widths and magics."""

from __future__ import annotations

import re

import pytest

from sglang_vericache.ops.triton.quant_decode_kernels import unpack_asm


def _run_ptx(asm: str, source: int) -> tuple[int, int]:
    regs: dict[str, int] = {"$2": source}

    def val(token: str) -> int:
        token = token.strip()
        return regs[token] if token in regs else int(token, 0)

    for line in asm.strip("{}\n").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *ops = [a.strip() for a in args.split(",")]
        if op == "prmt.b32":
            pool = val(ops[0]) | (val(ops[1]) << 32)
            sel = val(ops[2])
            regs[dst] = sum(((pool >> (8 * ((sel >> (4 * i)) & 0x7))) & 0xFF) << (8 * i)
                            for i in range(4))
        elif op == "shr.b32":
            regs[dst] = (val(ops[0]) & 0xFFFFFFFF) >> val(ops[1])
        elif op == "lop3.b32":
            assert ops[3] == "0xea", "emulator knows (a & b) | c only"
            regs[dst] = (val(ops[0]) & val(ops[1])) | val(ops[2])
        else:
            raise AssertionError(f"unexpected instruction {op}")
    assert re.search(r"\$0", asm) and re.search(r"\$1", asm)
    return regs["$0"], regs["$1"]


@pytest.mark.parametrize("bits,magic,offset", [(4, 0x4300, 128), (2, 0x4300, 128),
                                               (4, 0x6400, 1024), (2, 0x6400, 1024)])
def test_unpack_asm_yields_magic_plus_code(bits: int, magic: int, offset: int) -> None:
    """magic | code reinterpreted as bf16 (fp16) is offset + code, exactly, for code < 16."""
    mask = (1 << bits) - 1
    for plane in range(8 // bits):
        asm = unpack_asm(bits, magic, plane)
        for value in range(256):
            word = value | (((value * 7 + 3) & 0xFF) << 8) | ((255 - value) << 16) \
                | (((value ^ 0x5A) & 0xFF) << 24)
            lo, hi = _run_ptx(asm, word)
            lanes = [lo & 0xFFFF, lo >> 16, hi & 0xFFFF, hi >> 16]
            for i, lane in enumerate(lanes):
                code = ((word >> (8 * i)) >> (plane * bits)) & mask
                assert lane == magic | code, (bits, plane, value, i)
