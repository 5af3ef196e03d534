"""Inspect stage 2 of the chunk forward (chunk_state_output_kernel, the serial state pass) for Hopper without a
GPU: registers, spills, shared memory and the SASS of its chunk loop (tensor-core ops, the waits on them,
barriers, shared-memory traffic, global loads outside the pipeline) for each family, compiled with
`triton.compile(..., target=GPUTarget("cuda", 90, 32))`.

The serial loop is latency-bound at B1 (one program per SM): each wgmma group it waits on (`WARPGROUP.DEPBAR`)
is a round trip on the chunk's critical path, so `waits` is the number to read.

Usage: python benchmarks/stage2_sass.py [--fams gdn,kda,delta] [--bv 32] [--warps 4] [--stages N]   (CPU only)
"""
from __future__ import annotations

import argparse
import re


from sass_util import assemble, compile_sm90

from chunkwise.triton.chunk_fwd import BT, DELTA_P_IN, G_FLOOR, _pick_stages, chunk_state_output_kernel as KERNEL

GATES = {"gdn": 1, "kda": 2, "delta": 0}
BF16 = ("q", "k", "v", "w", "u", "p", "qg", "kg", "o")
FP32 = ("g", "glast", "gcum", "h0", "ht", "sloc", "gam")


def compile_variant(fam="gdn", bv=32, K=128, V=128, num_warps=4, num_stages=None, tma=0, trans=0, tform=0, p_in=None,
                    wait=0):
    gate = GATES[fam]
    p_in = (gate == 2 or DELTA_P_IN[gate]) if p_in is None else p_in
    if num_stages is None:
        num_stages = _pick_stages(2, K, bv, True, p_in, False, bool(tform and gate == 2))
    sig = {a: "*bf16" for a in BF16} | {a: "*fp32" for a in FP32}
    sig |= {a: "i32" for a in ("T", "NT", "seg_len", "H", "HV")} | {"scale": "fp32"}
    sig |= {a: "i32" for a in ("s_h0n", "s_h0h", "s_h0k", "s_h0v", "s_htn", "s_hth", "s_htk", "s_htv")}
    consts = dict(cu_seqlens=None, K=K, V=V, BTc=BT, BK=K, BV=bv, GATE=gate, DELTA=True, P_IN=int(p_in),
                  USE_H0=False, STORE_HT=False, IS_VARLEN=False, DOT_PREC="tf32", g_floor=G_FLOOR, LOOP_WHILE=False,
                  SEG=0, NSEG=1, SUB=1, GC_IN=int(gate == 1), TMA=int(tma > 0), TMA_O=int(tma > 1), TRANS=trans,
                  T_FORM=tform, WAIT=num_stages + 1 if wait else 0, FENCE=int(bool(wait and tma)))
    if wait:
        sig["ready"] = "*i32"
    absent = ["h0", "ht", "sloc", "gam"] + ([] if wait else ["ready"]) + ((["w"] if gate != 2 else []) if tform else ["v"])
    absent += ([] if p_in else ["p"]) + ([] if gate == 2 else ["qg", "kg"] + ([] if gate == 1 else ["glast"]))
    absent += [] if gate == 1 else ["gcum"]
    absent += ["g"] if gate != 1 else []
    return compile_sm90(KERNEL, sig, consts, absent, num_warps=num_warps, num_stages=num_stages), num_stages


def summary(compiled) -> dict:
    regs, spill, sass = assemble(compiled)
    ops = re.findall(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    count = lambda *names: sum(1 for o in ops if o.split(".")[0] in names)  # noqa: E731
    waits = sum(1 for o in ops if o.startswith("WARPGROUP.DEPBAR"))
    return dict(regs=regs, spill=spill, smem=compiled.metadata.shared, instrs=len(ops), mma=count("HGMMA", "HMMA"),
                waits=waits, bar=count("BAR"), lds=count("LDS", "LDSM"), sts=count("STS"), ldg=count("LDG"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fams", default="gdn,kda,delta")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--tma", type=int, default=0, help="1: the loop's tile loads through tensor descriptors (TMA), 2: its output stores too")
    ap.add_argument("--bv", type=int, default=32)
    ap.add_argument("--trans", type=int, default=0, help="1: the transposed state (TRANS, _state_output_step_t)")
    ap.add_argument("--tform", type=int, default=0, help="1: R from stage 1's T diag(β) (T_FORM)")
    ap.add_argument("--stages", type=int, default=None, help="pipeline depth (default: _pick_stages)")
    ap.add_argument("--wait", type=int, default=0, help="1: beside stage 1, each step waiting for its chunk (WAIT)")
    args = ap.parse_args()
    print(f"{'fam':5s} {'stg':>3s} {'regs':>4s} {'spill':>5s} {'smem':>6s} {'instrs':>6s} {'mma':>4s} "
          f"{'waits':>5s} {'bar':>4s} {'lds':>4s} {'sts':>4s} {'ldg':>4s}")
    for fam in args.fams.split(","):
        c, stages = compile_variant(fam, args.bv, num_warps=args.warps, num_stages=args.stages, tma=args.tma,
                                   trans=args.trans, tform=args.tform, wait=args.wait)
        s = summary(c)
        print(f"{fam:5s} {stages:3d} {s['regs']:4d} {s['spill']:5d} {s['smem']:6d} {s['instrs']:6d} "
              f"{s['mma']:4d} {s['waits']:5d} {s['bar']:4d} {s['lds']:4d} {s['sts']:4d} {s['ldg']:4d}", flush=True)


if __name__ == "__main__":
    main()
