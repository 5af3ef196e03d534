"""Inspect the decode kernel for Hopper without a GPU: registers, spills and the order of global
loads / barriers in its SASS, for a few launch configurations and kernel variants.

Compiles `recurrent_fwd_kernel` with `triton.compile(..., target=GPUTarget("cuda", 90, 32))` (the
pointers and row strides marked 16-divisible, as the JIT specialises them for K = V = 128), then
runs the ptxas / nvdisasm that ship with triton. Each global load that is followed by a barrier
before the next load costs one dependent DRAM round trip per program (see benchmarks/NOTES.md, Decode).

Usage: python benchmarks/decode_sass.py      (CPU only; ~1 s per configuration)
"""
from __future__ import annotations

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sass_util import assemble

from chunkwise.triton.recurrent import recurrent_fwd_kernel as KERNEL

FAMILIES = {"gdn": (1, True), "kda": (2, True), "delta": (0, True), "gla": (1, False)}


def compile_variant(fam="gdn", BV=32, num_warps=4, pool=True, state="fp32", fused=False, pipeline=2, K=128, V=128):
    """Compile the kernel for sm_90 as the launcher would launch it (fixed-length batch, [K, V] state)."""
    gate, delta = FAMILIES[fam]
    sig = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "g": "*fp32", "beta": "*bf16", "o": "*bf16",
           "h0": f"*{state}", "ht": f"*{state}", "state_indices": "*i32", "n_slots": "i32", "scale": "fp32", "T": "i32",
           "s_h0_n": "i32", "s_h0_h": "i32", "s_h0_k": "i32", "s_ht_n": "i32", "s_ht_h": "i32", "s_ht_k": "i32"}
    consts = dict(cu_seqlens=None, s_h0_v=1, s_ht_v=1, H=32, HV=32, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV,
                  GATE=gate, DELTA=delta, USE_H0=True, STORE_HT=True, IS_VARLEN=False, USE_INDICES=pool,
                  FUSED=fused, STREAM=False, PIPELINE=pipeline)
    for name, present in (("g", gate != 0), ("beta", delta), ("state_indices", pool)):
        if not present:
            del sig[name]
            consts[name] = None
    sig.update({name: "constexpr" for name in consts})
    aligned = ["q", "k", "v", "g", "beta", "o", "h0", "ht", "state_indices", "s_h0_n", "s_h0_h", "s_h0_k",
               "s_ht_n", "s_ht_h", "s_ht_k"]
    attrs = {(KERNEL.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned if sig[a] != "constexpr"}
    return triton.compile(ASTSource(KERNEL, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=1))


def sass_summary(compiled) -> tuple[int, int, str]:
    """(registers, spill bytes, compressed sequence of global loads/stores and barriers)."""
    regs, spill, sass = assemble(compiled)
    ops = []
    for line in sass.splitlines():
        m = re.search(r"\*/\s+(@!?U?P\w+\s+)?((LDGSTS|LDG|STG|BAR|DEPBAR)\b)", line)
        if m:
            ops.append(m.group(2))
    seq = []
    for op in ops:
        if seq and seq[-1][0] == op:
            seq[-1][1] += 1
        else:
            seq.append([op, 1])
    return regs, spill, " ".join(f"{op}x{n}" for op, n in seq)


def main():
    cases = [dict(fam="gdn", pipeline=0), dict(fam="gdn"), dict(fam="gdn", fused=True), dict(fam="gdn", num_warps=2),
             dict(fam="gdn", BV=8, num_warps=1), dict(fam="kda", pipeline=0), dict(fam="kda"),
             dict(fam="gdn", state="bf16"), dict(fam="gdn", K=256, V=256, BV=16, num_warps=2)]
    for case in cases:
        regs, spill, seq = sass_summary(compile_variant(**case))
        print(f"{case}: {regs} registers, {spill} B spilled\n    {seq}")


if __name__ == "__main__":
    main()
