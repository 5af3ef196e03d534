"""Registers, spills and shared memory of the backward kernels for Hopper, without a GPU: each kernel
compiled for sm_90 with `triton.compile(..., target=GPUTarget("cuda", 90, 32))` as chunk_bwd launches it
at B·T·HV-independent settings (bf16 inputs, K = V = 128, H = HV, no varlen), then `ptxas -v`.

Usage: python benchmarks/bwd_sass.py [--kernels bwd_grad,bwd_dh] [--fams gdn,kda,delta] [--warps 4,8]
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sass_util import assemble

from chunkwise.triton import chunk_bwd as cb

GATES = {"delta": 0, "gdn": 1, "kda": 2, "gla": 1}
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {t: n for n, t in TORCH_DTYPES.items()}

# per kernel: pointer arguments -> dtype ("in": the input dtype, "s": 16-bit storage, "g": gradient dtype),
# then its scalar arguments and its constexprs (beyond the common ones)
KERNELS = {
    "bwd_grad": ("_bwd_grad_kernel",          # the key side in 64-wide column blocks (the default)
                 dict(q="in", k="in", v="in", beta="in", G="fp32", Tmat="fp32", Pmat="fp32", Amat="fp32", h="s",
                      dh="s", R="s", dR="s", do="in", dq="g", dk="g", dbeta="fp32", dG="fp32"),
                 dict(T="i32", scale="fp32"), dict(BC=cb.SUB, BKH=64, ONE_REF=0, span_max=cb.SPAN_MAX)),
    "bwd_grad_ref": ("_bwd_grad_kernel",      # with KDA's one-reference pairwise gradients (BWD_ONE_REF 2)
                     dict(q="in", k="in", v="in", beta="in", G="fp32", Tmat="fp32", Pmat="fp32", Amat="fp32", h="s",
                          dh="s", R="s", dR="s", do="in", dq="g", dk="g", dbeta="fp32", dG="fp32"),
                     dict(T="i32", scale="fp32"), dict(BC=cb.SUB, BKH=64, ONE_REF=1, span_max=cb.SPAN_MAX)),
    "bwd_dv": ("_bwd_dv_kernel",
               dict(q="in", k="in", v="in", beta="in", G="fp32", Tmat="fp32", h="s", R="s", dR="s", do="in",
                    Pmat="fp32", Amat="fp32", dq="g", dv="in", dbeta="fp32", dG="fp32"),
               dict(T="i32", scale="fp32"), {}),
    "bwd_dqk": ("_bwd_dqk_kernel",         # the state tiles' pass by key column blocks (BWD_DQK, KDA: BWD_DQK_KDA)
                dict(q="in", k="in", v="in", G="fp32", h="s", dh="s", R="s", dR="s", do="in", dq="g", dk1="in",
                     dW="in", dGp="fp32", dgam="fp32", Tmat="fp32", beta="in", dTp="fp32", dbs="fp32"),
                dict(T="i32", scale="fp32"), dict(BK=cb.BWD_DQK_BK, KD=128)),
    "bwd_dqk_sides": ("_bwd_dqk_sides_kernel",   # the same by side, all key columns (BWD_DQK_SIDES)
                      dict(q="in", k="in", v="in", G="fp32", h="s", dh="s", R="s", dR="s", do="in", dq="g", dk1="in",
                           dW="in", dGp="fp32"),
                      dict(T="i32", scale="fp32"), {}),
    "bwd_wy": ("_bwd_wy_kernel",           # scalar / no gate: the gradients through T, per chunk (BWD_DQK)
               dict(k="in", v="in", beta="in", G="fp32", Tmat="fp32", dW="in", dR="s", dk1="in", dGp="fp32",
                    dgam="fp32", Ascr="fp32", dv="in", dk="g", dbeta="fp32", dG="fp32", R="s", do="in", Pmat="fp32",
                    dTp="fp32"),
               dict(T="i32", scale="fp32"),
               dict(BK=cb.BWD_WY_BK, NKP=2, KD=128, T_TRANS=cb.BWD_WY_T_TRANS, DK1_AHEAD=cb.BWD_WY_DK1_AHEAD,
                    DA_SCR=0)),
    "bwd_dh": ("_bwd_dh_kernel",
               dict(q="in", k="in", G="fp32", W="s", dRl="s", do="in", dht="fp32", dh="s", dR="s", dh0="fp32",
                    h="s", dgam="fp32", ht="fp32", Rs="s"),
               dict(T="i32", scale="fp32", unit="fp32"), dict(HAS_DHT=True, HAS_H0=True, TRANSPOSE=False, LOOP_WHILE=False)),
    "fwd_h": ("_fwd_h_kernel",
              dict(k="in", v="in", G="fp32", W="s", U="s", h0="fp32", h="s", R="s"),
              dict(T="i32"), dict(HAS_H0=True, TRANSPOSE=False, LOOP_WHILE=False)),
    "intra": ("_intra_kernel",
              dict(q="in", k="in", beta="in", G="fp32", Amat="fp32", Pmat="fp32"),
              dict(T="i32"), dict(BC=cb.SUB)),
    "intra_diag": ("_intra_diag_kernel",
                   dict(q="in", k="in", beta="in", G="fp32", Amat="fp32", Pmat="fp32"),
                   dict(T="i32"), dict(BC=cb.SUB, span_max=cb.SPAN_MAX)),
    "bwd_pair": ("_bwd_pair_kernel",          # per channel: the pairwise gradients by column blocks (the default)
                 dict(q="in", k="in", beta="in", G="fp32", Pmat="fp32", Amat="fp32", dq="g", dk="g", dbp="fp32",
                      dG="fp32", dq_o="in", dk_o="in", flag="i32"),
                 dict(T="i32", s_dbp="i32"), dict(BC=cb.SUB, span_max=cb.SPAN_MAX, OFFDIAG=True, DIAG=True, BKP=cb.BWD_PAIR_SPLIT,
                                                 ONE_REF=0)),
    **{f"bwd_pair_ref{n}": ("_bwd_pair_kernel",   # one reference per chunk where the gate allows (BWD_ONE_REF), n channels
                            dict(q="in", k="in", beta="in", G="fp32", Pmat="fp32", Amat="fp32", dq="g", dk="g",
                                 dbp="fp32", dG="fp32", dq_o="in", dk_o="in", flag="i32"),
                            dict(T="i32", s_dbp="i32"),
                            dict(BC=cb.SUB, span_max=cb.SPAN_MAX, OFFDIAG=True, DIAG=True, BKP=n, ONE_REF=1, KLOOP=0))
        for n in (32, 64)},
    "bwd_pair_kloop": ("_bwd_pair_kernel",   # the same, one program per chunk over the 32-channel blocks (BWD_PAIR_KLOOP)
                       dict(q="in", k="in", beta="in", G="fp32", Pmat="fp32", Amat="fp32", dq="g", dk="g",
                            dbp="fp32", dG="fp32", dq_o="in", dk_o="in", flag="i32"),
                       dict(T="i32", s_dbp="i32"),
                       dict(BC=cb.SUB, span_max=cb.SPAN_MAX, OFFDIAG=True, DIAG=True, BKP=32, ONE_REF=1, KLOOP=1, FITB=32, FLAG=cb.BWD_PAIR_FLAG)),
    "bwd_pair_rest": ("_bwd_pair_kernel",   # the block form where one reference does not fit (BWD_ONE_REF's 2nd launch)
                      dict(q="in", k="in", beta="in", G="fp32", Pmat="fp32", Amat="fp32", dq="g", dk="g", dbp="fp32",
                           dG="fp32", dq_o="in", dk_o="in", flag="i32"),
                      dict(T="i32", s_dbp="i32"),
                      dict(BC=cb.SUB, span_max=cb.SPAN_MAX, OFFDIAG=True, DIAG=True, BKP=cb.BWD_PAIR_SPLIT, ONE_REF=2,
                                                  FITB=cb.BWD_PAIR_SPLIT, FLAG=cb.BWD_PAIR_FLAG)),
    "bwd_diag_rest": ("_bwd_pair_kernel",   # the diagonal blocks of the channel blocks one reference does not fit (ONE_REF 3)
                      dict(q="in", k="in", beta="in", G="fp32", Pmat="fp32", Amat="fp32", dq="g", dk="g", dbp="fp32",
                           dG="fp32", dq_o="in", dk_o="in", flag="i32"),
                      dict(T="i32", s_dbp="i32"),
                      dict(BC=cb.SUB, span_max=cb.SPAN_MAX, OFFDIAG=False, DIAG=True, BKP=128, ONE_REF=3,
                           FITB=cb.BWD_PAIR_SPLIT, FLAG=cb.BWD_PAIR_FLAG)),
    "bwd_diag": ("_bwd_pair_kernel",          # the diagonal blocks alone, all channels (CHUNKWISE_BWD_PAIR_DIAG=0)
                 dict(q="in", k="in", beta="in", G="fp32", Pmat="fp32", Amat="fp32", dq="g", dk="g", dbp="fp32",
                      dG="fp32", dq_o="in", dk_o="in", flag="i32"),
                 dict(T="i32", s_dbp="i32"), dict(BC=cb.SUB, span_max=cb.SPAN_MAX, OFFDIAG=False, DIAG=True, BKP=128, ONE_REF=0)),
    **{f"bwd_offdiag{n}": ("_bwd_pair_kernel",     # the off-diagonal part alone, n channels (BWD_PAIR_DIAG=0)
                           dict(q="in", k="in", beta="in", G="fp32", Pmat="fp32", Amat="fp32", dq="g", dk="g",
                                dbp="fp32", dG="fp32", dq_o="in", dk_o="in", flag="i32"),
                           dict(T="i32", s_dbp="i32"),
                           dict(BC=cb.SUB, span_max=cb.SPAN_MAX, OFFDIAG=True, DIAG=False, BKP=n, ONE_REF=0))
        for n in (16, 32)},
    "gate_scaled": ("_gate_scaled_kernel", dict(q="in", k="in", G="fp32", qd="in", kd="in"), dict(T="i32"), {}),
    "wu": ("_wu_kernel",
           dict(k="in", v="in", beta="in", G="fp32", Tmat="fp32", Pmat="fp32", do="in", W="s", U="s", dRl="s"),
           dict(T="i32", scale="fp32"), {}),
}


def compile_kernel(name, fam="gdn", num_warps=8, K=128, V=128, num_stages=3, lowp=0, dtype="bf16", maxnreg=None,
                   **overrides):
    """The sm_90 build of backward kernel ``name`` at the launch's defaults for ``fam`` (``overrides``: constexprs
    set otherwise, e.g. DGAM=0)."""
    kname, ptrs, scalars, extra = KERNELS[name]
    kernel = getattr(cb, kname)
    gate, delta = GATES[fam], fam != "gla"
    gdt = dtype if gate != 2 else "fp32"
    sig, consts = {}, dict(cu_seqlens=None, chunk_indices=None)
    for arg, kind in ptrs.items():
        dgam = gate > 0 and cb.BWD_DGAM_DH and overrides.get("DGAM", 1) and overrides.get("NVD", 1)
        if arg == "dk1" and gate == 2:
            kind = "g"          # KDA's dk1 is dk itself (fp32)
        absent = (arg == "dgam" and not dgam) or (arg == "h" and name == "bwd_dh" and not dgam and not overrides.get("REV_H", 0)) or \
                 (arg in ("Ascr", "Pmat") and name == "bwd_wy" and gate != 2 and
                  not overrides.get("DA_SCR", delta and cb.BWD_WY_DA_SCR[gate])) or (arg == "Pmat" and gate != 2 and name == "bwd_wy") or \
                 (arg in ("R", "do", "dTp") and name == "bwd_wy" and gate != 2) or \
                 (arg in ("Tmat", "beta", "dTp", "dbs") and name == "bwd_dqk" and gate != 2) or \
                 (arg == "dW" and name in ("bwd_dqk", "bwd_wy") and gate == 2) or \
                 (arg == "G" and not gate) or (arg in ("beta", "Tmat", "W", "U", "R", "dbeta", "dbp", "dW", "Ascr") and not delta) or \
                 (arg == "Amat" and not delta) or (arg in ("dG", "dGp") and not gate) or \
                 (arg in ("ht", "Rs") and not overrides.get("REV_H", 0))
        if absent:
            consts[arg] = None
        else:
            tdt = DTYPE_NAMES[cb.saved_t_dtype(TORCH_DTYPES[dtype], K, gate)]        # as a saving forward stores T
            sig[arg] = "*" + {"in": dtype, "s": dtype, "g": gdt, "fp32": "fp32", "i32": "i32", "t": tdt}[kind]
    sig.update(scalars)
    params = dict(H=32, HV=32, K=K, V=V, BK=K, BV=32, C=cb.CHUNK, GATE=gate, DELTA=delta, IS_VARLEN=False,
                  PREC="tf32" if dtype != "fp32" else "tf32x3",
                  LOWP=lowp)
    params.update(extra)
    dgam = int(bool(gate > 0 and cb.BWD_DGAM_DH))      # ⟨S, dS'⟩ from the reverse pass (BWD_DGAM_DH)
    params.update(DGAM=dgam, NVD=4 * dgam, DA_SCR=int(bool(delta and cb.BWD_WY_DA_SCR[gate])))
    # the switches chunk_bwd sets per gate kind, as it launches them (its CHUNKWISE_* environment overrides too)
    if name in ("bwd_wy", "bwd_dqk", "bwd_dqk_sides", "fwd_h", "bwd_dh"):
        params.update(FULL=int(cb.bwd_full("bwd_dqk" if name == "bwd_dqk_sides" else name, gate, 32768, False)))
    if name == "bwd_dh":
        params.update(AHEAD=cb._bwd_dh_ahead(gate))
    if name == "bwd_dqk":
        params.update(EARLY=cb._env_switch("CHUNKWISE_BWD_DQK_EARLY", cb.BWD_DQK_EARLY[gate]),
                      SDS_OWN=int(not delta or cb._env_switch("CHUNKWISE_BWD_SDS_OWN", cb.BWD_SDS_OWN)),
                      INPLACE=cb._env_switch("CHUNKWISE_BWD_SPLIT_INPLACE", cb.BWD_SPLIT_INPLACE[gate]))
    params.update(overrides)
    consts.update({p: v for p, v in params.items() if p in kernel.arg_names})
    # a constexpr given nowhere above takes the kernel's own default (left out, triton would make it None)
    consts.update({p.name: p.default for p in kernel.params
                   if p.is_constexpr and p.has_default and p.name not in consts})
    for arg in list(consts):
        if arg not in kernel.arg_names:
            del consts[arg]
    sig.update({n: "constexpr" for n in consts})
    sig = {n: sig[n] for n in kernel.arg_names if n in sig}
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items() if t.startswith("*")}
    return triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages,
                                       **({} if maxnreg is None else dict(maxnreg=maxnreg))))


def ptxas(compiled):
    regs, spill, _ = assemble(compiled, sass=False)
    return regs, spill


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", default="bwd_grad")
    ap.add_argument("--fams", default="gdn,kda,delta")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", help="the inputs' dtype: bf16, fp16 or fp32")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--lowp", type=int, default=0, help="16-bit product operands (the LOWP constexpr, where a kernel has it)")
    a = ap.parse_args()
    print(f"{'kernel':10s} {'fam':6s} {'warps':>5s} {'regs':>5s} {'spill B':>8s} {'smem B':>8s}")
    for name, fam, w in itertools.product(a.kernels.split(","), a.fams.split(","), map(int, a.warps.split(","))):
        c = compile_kernel(name, fam, w, K=a.K, num_stages=a.stages, lowp=a.lowp, dtype=a.dtype)
        regs, spill = ptxas(c)
        print(f"{name:10s} {fam:6s} {w:5d} {regs:5d} {spill:8d} {c.metadata.shared:8d}", flush=True)


if __name__ == "__main__":
    main()
