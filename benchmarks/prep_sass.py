"""Inspect stage 1 of the chunk forward (chunk_prepare_kernel) for Hopper without a GPU: registers,
spill bytes and SASS instruction counts (tensor-core ops, shuffles, barriers, shared-memory traffic)
of its variants, compiled with `triton.compile(..., target=GPUTarget("cuda", 90, 32))`.

Usage: python benchmarks/prep_sass.py [--fams gdn,kda]     (CPU only; ~10-60 s per variant)
"""
from __future__ import annotations

import argparse
import itertools
import re


from sass_util import assemble, compile_sm90

from chunkwise.triton.chunk_fwd import BC, BT, G_FLOOR, SPAN_FP16, SPAN_MAX, chunk_prepare_kernel as KERNEL

GATES = {"gdn": 1, "kda": 2, "delta": 0}


def compile_variant(fam="gdn", wu_lowp=0, num_warps=4, K=128, V=128, BKC=64, form=0, bwd=False, maxnreg=None,
                    mm_prec="tf32", store_p=True, one_ref=0, doubling=1, num_stages=1, tform=0, ap_lowp=0,
                    solve_prec="tf32", solve_redo=0):
    gate = GATES[fam]
    sig = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "g": "*fp32", "beta": "*bf16", "w": "*bf16", "u": "*bf16",
           "p": "*bf16", "qg": "*bf16", "kg": "*bf16", "glast": "*fp32", "do": "*bf16", "t_out": "*fp32",
           "drl": "*bf16", "flag": "*i32", "T": "i32", "NT": "i32", "H": "i32", "HV": "i32", "scale": "fp32"}
    consts = dict(cu_seqlens=None, chunk_indices=None, K=K, V=V, BTc=BT, BCc=BC, BK=K, BVf=V, BKC=min(BKC, K),
                  GATE=gate, IS_VARLEN=False, DOT_PREC="tf32", MM_PREC=mm_prec, SOLVE_PREC=solve_prec, SOLVE_REDO=solve_redo, g_floor=G_FLOOR,
                  span_max=SPAN_MAX, WU_LOWP=wu_lowp,
                  AP_FORM=form if gate == 2 else 0, BWD=bwd, STORE_P=int(store_p or gate == 2),
                  AP_ONE_REF=int(one_ref if gate == 2 else 0), SOLVE_DOUBLING=doubling, T_FORM=tform, AP_LOWP=ap_lowp,
                  span16=SPAN_FP16)
    absent = [] if gate == 2 else ["qg", "kg", "glast"]
    absent += ["p"] if bwd or not consts["STORE_P"] else []
    absent += [] if bwd else ["do", "drl", "t_out"]
    absent += ["w"] if tform and gate != 2 else []     # (T_FORM: T diag(β) in u, K ⊙ e^G in w per channel)
    absent += [] if (one_ref in (2, 3) and gate == 2) or solve_redo else ["flag"]
    if gate == 0:
        absent.append("g")
    return compile_sm90(KERNEL, sig, consts, absent, num_warps=num_warps, num_stages=num_stages,
                        **({"maxnreg": maxnreg} if maxnreg else {}))


def summary(compiled) -> dict:
    regs, spill, sass = assemble(compiled)
    ops = re.findall(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    count = lambda *names: sum(1 for o in ops if o.split(".")[0] in names)  # noqa: E731
    return dict(regs=regs, spill=spill, smem=compiled.metadata.shared, instrs=len(ops), mma=count("HMMA", "HGMMA"), shfl=count("SHFL"),
                bar=count("BAR"), lds=count("LDS", "LDSM"), sts=count("STS"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fams", default="gdn,kda")
    ap.add_argument("--bkc", type=int, default=64, help="column chunk of the per-channel gate (KDA)")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--lowp", default="0,1")
    ap.add_argument("--form", type=int, default=0, help="KDA's A/P form (0 eight products, 1 by row blocks)")
    ap.add_argument("--bwd", action="store_true", help="the backward's recompute mode (T, W, U, dR_local)")
    ap.add_argument("--maxnreg", type=int, default=None, help="cap on registers per thread (CHUNKWISE_MAXNREG)")
    ap.add_argument("--mm-prec", default="tf32", help="precisions of the fp32 factor products, e.g. tf32,tf32rn,tf32x3")
    ap.add_argument("--one-ref", default="0", help="KDA's one-reference A / P products (AP_ONE_REF), e.g. 0,1")
    ap.add_argument("--no-p", action="store_true", help="the forward without P (STORE_P=0: stage 2 forms it)")
    ap.add_argument("--doubling", type=int, default=1, help="the solve's diagonal blocks by doubling (SOLVE_DOUBLING)")
    args = ap.parse_args()
    print(f"{'fam':4s} {'ref':>3s} {'prec':>6s} {'lowp':>4s} {'warps':>5s} {'regs':>4s} {'spill':>5s} {'smem':>6s} {'instrs':>6s} "
          f"{'mma':>5s} {'shfl':>5s} {'bar':>4s} {'lds':>5s} {'sts':>5s}")
    for fam, one_ref, prec, lowp, warps in itertools.product(args.fams.split(","), map(int, args.one_ref.split(",")),
                                                             args.mm_prec.split(","), map(int, args.lowp.split(",")),
                                                             map(int, args.warps.split(","))):
        s = summary(compile_variant(fam, lowp, warps, BKC=args.bkc, form=args.form, bwd=args.bwd, maxnreg=args.maxnreg,
                                    mm_prec=prec, store_p=not args.no_p, one_ref=one_ref,
                                    doubling=args.doubling))
        print(f"{fam:4s} {one_ref:3d} {prec:>6s} {lowp:4d} {warps:5d} {s['regs']:4d} {s['spill']:5d} {s['smem']:6d} {s['instrs']:6d} "
              f"{s['mma']:5d} {s['shfl']:5d} {s['bar']:4d} {s['lds']:5d} {s['sts']:5d}", flush=True)


if __name__ == "__main__":
    main()
