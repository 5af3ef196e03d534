"""Warps sweep of the Triton chunk backward on the GPU: for each family, one fwd+bwd at
B1-T32768-H32 (K = V = 128, bf16) with every backward kernel at 8 warps and again at 4, each kernel's
time from torch.profiler, then the per-kernel pick (the faster setting of each at the default 16-bit
level) timed once more.
Prints the pick as CHUNKWISE_BWD_WARPS (the knob of triton/chunk_bwd.py's BWD_WARPS) and writes
sweep_bwd.json to --out. Gradients of every configuration are checked finite (NaN-poisoned buffers)
and against the 8-warp configuration's. Each setting is also timed with the key side in two 64-wide
column blocks (CHUNKWISE_BWD_KSPLIT=64; 0 is one block of K; the pick takes the faster form), and
with 16-bit product operands (CHUNKWISE_BWD_LOWP=1: the serial state passes, 2 (the default): also the
W / U recompute, 3: also the key side, 4: the key side but its pairwise products; the pick is timed at
0-4). Their gradient error against float64 and fla: the GPU test
`CHUNKWISE_BWD_LOWP=4 pytest tests/test_triton_chunk_bwd.py -k "real_size or hopper"`.

    python benchmarks/sweep_bwd.py --warm --fams gdn --warps 4 &    # compile, time nothing
    python benchmarks/sweep_bwd.py --out $OUT
    python benchmarks/sweep_bwd.py --fams kda --variants "p32:CHUNKWISE_BWD_PAIR_SPLIT=32;old:CHUNKWISE_BWD_PAIR_SPLIT=0"

--variants "name:VAR=value,VAR=value;..." (or "sides", "leads", "wyregs", "pairregs", "tform", "ahead", "states", "pair", "regs", "save", "lowp", "oneref": the named sets below): time only these environment settings (on top of the defaults),
each with its per-kernel profile and its gradients' difference from the first variant's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_forward import env_vars, make, run_ours, shapes  # noqa: E402
from bench_train import bench, fwd_bwd, leaves, profile  # noqa: E402

# profiler names of the backward kernels -> BWD_WARPS keys
KERNELS = {"_gate_cumsum_kernel": "gate_cumsum", "_intra_kernel": "intra", "_intra_diag_kernel": "intra_diag",
           "_solve_kernel": "solve", "_wu_kernel": "wu", "_fwd_h_kernel": "fwd_h", "_bwd_dh_kernel": "bwd_dh",
           "_bwd_dv_kernel": "bwd_dv", "_bwd_grad_kernel": "bwd_grad", "_bwd_dqk_kernel": "bwd_dqk", "_bwd_wy_kernel": "bwd_wy",
           "_bwd_dqk_sides_kernel": "bwd_dqk_sides",
           "_bwd_pair_kernel": "bwd_pair", "chunk_prepare_kernel": "prep", "chunk_state_output_kernel": "fwd_o"}     # prep: the forward's stage 1 + the
# backward's fused recompute (BWD_FUSED_PREP); only the latter changes with the backward's warps


def kernel_times(prof_rows):
    out = {}
    for name, ms in prof_rows.items():
        for kname, key in KERNELS.items():
            if name.startswith(kname):
                out[key] = out.get(key, 0.0) + ms
    return out


def run_config(fam, x, do, env, warm, ksplit=0, lowp=0):
    """One fwd+bwd with the warps setting env ("all:4", "wu:4,..."), key-side column block and LOWP level."""
    return run_env(fam, x, do, dict(CHUNKWISE_BWD_WARPS=env, CHUNKWISE_BWD_KSPLIT=str(ksplit),
                                    CHUNKWISE_BWD_LOWP=str(lowp)), warm)


# --variants pair: KDA's pairwise-gradient kernel (_bwd_pair_kernel): the default (32 key channels per program,
# 4 warps, the diagonal blocks in a second launch), the diagonal blocks in each program (p32diag), 16 channels
# (offline sm_90: no spills, 237 registers at 4 warps, 151 at 8) at 4 / 8 warps / 8 warps capped at 128
# registers (two programs per SM), and the key side's level-4 16-bit operands
PAIR_VARIANTS = ("p32:;p32diag:CHUNKWISE_BWD_PAIR_DIAG=1;p16:CHUNKWISE_BWD_PAIR_SPLIT=16;"
                 "p16w8:CHUNKWISE_BWD_PAIR_SPLIT=16,CHUNKWISE_BWD_WARPS=bwd_pair:8;"
                 "p16w8r128:CHUNKWISE_BWD_PAIR_SPLIT=16,CHUNKWISE_BWD_WARPS=bwd_pair:8,CHUNKWISE_MAXNREG=bwd_pair:128;"
                 "p32lowp4:CHUNKWISE_BWD_LOWP=4")


# --variants regs: registers per thread capped (CHUNKWISE_MAXNREG, Triton's maxnreg) in the chunk-parallel kernels
# whose shared memory leaves room for a third or fourth program per SM (ncu, run of cd0d241: they ran at 255
# registers, two programs per SM); the forward's stage 2 (fwd_o) and the key side / pair kernel are left alone
_CAPPED = ("prep_fwd", "prep", "bwd_dv", "bwd_diag", "intra", "intra_diag", "wu", "solve")
REG_VARIANTS = ";".join(["base:"] + [f"r{n}:CHUNKWISE_MAXNREG=" + "/".join(f"{k}:{n}" for k in _CAPPED)
                                     for n in (168, 128)])
# --variants save: the forward keeps stage 1 (w, u, p, T) and the backward skips its recompute (the default,
# chunkwise/_custom_ops.py) against the recomputing backward (CHUNKWISE_SAVE_STAGE1=0)
SAVE_VARIANTS = "recompute:CHUNKWISE_SAVE_STAGE1=0;save:CHUNKWISE_SAVE_STAGE1=1"
# the key side with 16-bit operands but its pairwise products (level 4) against the default level 2
LOWP_VARIANTS = "lowp2:;lowp4:CHUNKWISE_BWD_LOWP=4"
# KDA's one-reference products (forward stage 1: CHUNKWISE_KDA_ONE_REF; backward: CHUNKWISE_BWD_ONE_REF 1 in the pair
# kernel, 2 in the key side) and the state passes on scaled keys (CHUNKWISE_BWD_KD_IN). Run of ac0ebbf: off / forward
# only / both (pair kernel) / both with KD_IN / both with the pair kernel at 64 channels, 8 warps: 20.84 / 19.84 /
# 15.77 / 14.63 / 15.92 ms; run of b42e3c4: pair kernel 14.50, key side 14.98, off 20.90. Now the pair kernel's
# launch: one program per 32-channel block (the default) or per chunk over the blocks (KLOOP), at 4 / 8 warps.
ONEREF_VARIANTS = ("pair:;pair_w8:CHUNKWISE_BWD_WARPS=bwd_pair_ref:8;kloop:CHUNKWISE_BWD_PAIR_KLOOP=1;"
                   "kloop_w8:CHUNKWISE_BWD_PAIR_KLOOP=1,CHUNKWISE_BWD_WARPS=bwd_pair_ref:8")
# the one-reference pair launch (KLOOP, the default) at 16 / 32 channels per block and capped registers: offline sm_90
# (bf16, 4 warps, 2eb2b43): 32 channels 255 registers / 32 B of spills / 80 KB of shared memory (2 programs per SM, as
# ncu saw), at 168 204 B of spills; 16 channels 202 / 0 / 72 KB, at 168 96 B of spills (3 programs per SM), at 128 84 B
# (shared memory still limits it to 3)
PAIRREGS_VARIANTS = ("p32:;p16:CHUNKWISE_BWD_PAIR_SPLIT=16;"
                     "p16r168:CHUNKWISE_BWD_PAIR_SPLIT=16,CHUNKWISE_MAXNREG=bwd_pair_ref:168;"
                     "p16r128:CHUNKWISE_BWD_PAIR_SPLIT=16,CHUNKWISE_MAXNREG=bwd_pair_ref:128;"
                     "p32r168:CHUNKWISE_MAXNREG=bwd_pair_ref:168")
# KDA with its one-reference products on (the defaults) and off: with CHUNKWISE_BENCH_GATE_SCALE=4 (gates of ~-3 per
# token, past the one-reference range in nearly every column chunk) what the fallback costs
GATES_VARIANTS = "on:;off:CHUNKWISE_KDA_ONE_REF=0,CHUNKWISE_BWD_ONE_REF=0"
# the reverse state pass's dR_local: in the step (0), a step ahead (1), in the step with the product unfused (2)
AHEAD_VARIANTS = "a0:CHUNKWISE_BWD_DH_AHEAD=0;a1:CHUNKWISE_BWD_DH_AHEAD=1;a2:CHUNKWISE_BWD_DH_AHEAD=2"
# the forward's stage 2 keeps the per-chunk states and R for the backward (which then skips its forward state pass)
STATES_VARIANTS = "recompute:CHUNKWISE_SAVE_STATES=0;states:CHUNKWISE_SAVE_STATES=1"
# scalar / no gate: the value and key sides as the state tiles' pass by key column blocks + the WY pass (BWD_DQK, the
# default) against _bwd_dv_kernel + _bwd_grad_kernel (run of b5d9499: also 8 warps, 32-wide blocks, a register cap, the
# reverse pass's own Pᵀ dO, all slower; run of 05fc501: 16-bit dk1 and the early loads for DeltaNet won, now the
# defaults; fp32 dk1 and the WY pass at 64 columns slower; run of 804bdbc: the dq-first order slower for both,
# removed; run of 21cb7e1: the gate's ⟨S, dS'⟩ from the reverse pass slower (off), the WY pass's T once and dk1 ahead
# faster for DeltaNet, its dAᵀ through a scratch faster for GDN only); now KDA: the two kernels + the pair kernel
# (BWD_DQK_KDA, the default; run of 8f95fab: 1.54 + 2.22 ms against 1.24 + 2.54, with ⟨S, dS'⟩ from the reverse pass
# slower) against the value-side + key-side kernels (kdaold); now with the WY form's column-local terms in the
# state-tile pass (run of c470c78: 2.90 + 0.96 ms at 8 warps, 2.41 + 0.96 at 4 (now the default), 3.04 + 1.14 at 4
# warps and 32 columns; fwd+bwd 12.60 against the older kernels' 13.04)
DQK_VARIANTS = "dqk:;kdaold:CHUNKWISE_BWD_DQK_KDA=0;w8:CHUNKWISE_BWD_WARPS=bwd_dqk:8"
# KDA's stage 1 (kept for the backward) in one launch or two (CHUNKWISE_KDA_ONE_REF 1 / 2, chunk_fwd.KDA_ONE_REF)
KDASPLIT_VARIANTS = "oneref1:CHUNKWISE_KDA_ONE_REF=1;oneref2:CHUNKWISE_KDA_ONE_REF=2"
# the training forward under T_FORM, keeping T alone (the backward forms W, U: _wu_kernel, from fp32 operands at
# CHUNKWISE_SAVE_WU_LOWP=0, bf16 at 1, scaled fp16 at 2 (the default since session 21)), or keeping W and U
TFORM_VARIANTS = ("wu:CHUNKWISE_SAVE_T_FORM=0;tform:CHUNKWISE_SAVE_T_FORM=1,CHUNKWISE_SAVE_WU_LOWP=0;"
                  "tform_fp16:CHUNKWISE_SAVE_T_FORM=1,CHUNKWISE_SAVE_WU_LOWP=2;"
                  "tform_w8:CHUNKWISE_SAVE_T_FORM=1,CHUNKWISE_BWD_WARPS=wu:8;"
                  "tform_lowp:CHUNKWISE_SAVE_T_FORM=1,CHUNKWISE_SAVE_WU_LOWP=1;"
                  "tform_lowp_w8:CHUNKWISE_SAVE_T_FORM=1,CHUNKWISE_SAVE_WU_LOWP=1,CHUNKWISE_BWD_WARPS=wu:8")
# the forward state pass beside the W / U launch (chunk_bwd's BWD_OVERLAP) or after it; KDA's pass beside it at 8
# warps instead of 4; KDA's qg / kg formed again in the backward (CHUNKWISE_SAVE_GATE_SCALED=0); KDA's W / U launch
# capped at 136 registers (offline sm_90: the 4-warp pass takes 104 registers and 116 KB, so three 136-register, 36 KB
# W / U programs fit beside it, every register and byte of shared memory of the SM, against two at 168; 176 B of
# spills against 24) or 128 (268 B)
BESIDE_VARIANTS = ("after:CHUNKWISE_BWD_OVERLAP=0;beside:CHUNKWISE_BWD_OVERLAP=1;"
                   "beside_w8:CHUNKWISE_BWD_OVERLAP=1,CHUNKWISE_BWD_WARPS=fwd_h:8;"
                   "after_gs0:CHUNKWISE_BWD_OVERLAP=0,CHUNKWISE_SAVE_GATE_SCALED=0;"
                   "beside_gs0:CHUNKWISE_BWD_OVERLAP=1,CHUNKWISE_SAVE_GATE_SCALED=0;"
                   "beside_wu136:CHUNKWISE_BWD_OVERLAP=1,CHUNKWISE_MAXNREG=wu:136;"
                   "beside_wu128:CHUNKWISE_BWD_OVERLAP=1,CHUNKWISE_MAXNREG=wu:128;"
                   "after_wu136:CHUNKWISE_BWD_OVERLAP=0,CHUNKWISE_MAXNREG=wu:136")
# ⟨S, dS'⟩ in the state-tile pass (gates): from loads of their own, or from the product tiles after dW's product (issued
# last) has waited for every product (chunk_bwd.BWD_SDS_OWN); session 24's order raced on the H200 (triton #6691)
SDS_VARIANTS = "tiles:CHUNKWISE_BWD_SDS_OWN=0;own:CHUNKWISE_BWD_SDS_OWN=1"
# KDA's G kept by the training forward (chunk_fwd.SAVE_GATE_CUMSUM) or formed again by the backward
GC_VARIANTS = "gc1:CHUNKWISE_SAVE_GATE_CUMSUM=1;gc0:CHUNKWISE_SAVE_GATE_CUMSUM=0"
# R kept by the training forward (chunk_fwd.SAVE_R: the backward's forward state pass forms the states from it, one
# product a step) or formed again by that pass; with it, the pass beside the dR_local / W launch or after it
SAVER_VARIANTS = ("r1:CHUNKWISE_SAVE_R=1;r0:CHUNKWISE_SAVE_R=0;r1_after:CHUNKWISE_SAVE_R=1,CHUNKWISE_BWD_OVERLAP=0;"
                  "r1_beside:CHUNKWISE_SAVE_R=1,CHUNKWISE_BWD_OVERLAP=1")
# with R kept, the training forward of GDN / DeltaNet under the T form (stage 1 and stage 2 as the inference forward's,
# plus T and R stored; the backward forms W alone from T beside dR_local, fp16-scaled operands): session 20 measured it
# slower when that launch also formed U (GDN 6.48 -> 6.82 ms at fp32 operands); untimed since R is kept
TFORMR_VARIANTS = "wu:CHUNKWISE_SAVE_T_FORM=0;tform:CHUNKWISE_SAVE_T_FORM=1;tform_bf16w:CHUNKWISE_SAVE_T_FORM=1,CHUNKWISE_SAVE_WU_LOWP=1"
# the training forward's stage 2 beside its stage 1 (chunk_fwd.FWD_OVERLAP; GDN's mode 1: BV 32, one W / U stage-1 program
# per SM beside each 197 KB stage-2 program; KDA's mode 2: BV 64, 2 stages) or after it (0), or GDN at KDA's mode (2):
# chosen on the inference forward, untimed on the training one, whose stage 1 writes W, U, T and P (GDN's training
# forward ~1.5 ms of fwd+bwd against 0.98 for inference, session 27)
# the backward's launches with a constant chunk length (chunk_bwd.BWD_FULL: masks folded), stage 1 too (PREP_FULL)
FULL_VARIANTS = "full0:CHUNKWISE_BWD_FULL=0;wy:CHUNKWISE_BWD_FULL=bwd_wy;wydqk:CHUNKWISE_BWD_FULL=bwd_wy+bwd_dqk;" \
    "serial:CHUNKWISE_BWD_FULL=fwd_h+bwd_dh;wyserial:CHUNKWISE_BWD_FULL=bwd_wy+fwd_h+bwd_dh;" \
    "all+prep:CHUNKWISE_BWD_FULL=bwd_wy+bwd_dqk+fwd_h+bwd_dh,CHUNKWISE_PREP_FULL=1"
# the WY pass capped at 168 / 128 registers for a third / fourth 4-warp program per SM (it is 41 % of its memory floor,
# latency-bound at two; NOTES.md session 32). Offline sm_90 (bf16, level 4): DeltaNet 250 registers, no spill -> 424 B
# spilled at 168, 644 B at 128; GDN 244 -> 188 B at 168, 744 B at 128
WYREGS_VARIANTS = "base:;wy168:CHUNKWISE_MAXNREG=bwd_wy:168;wy128:CHUNKWISE_MAXNREG=bwd_wy:128"
# the state-tile pass by side (chunk_bwd.BWD_DQK_SIDES: 2 programs a chunk over all key columns, or 3 with dW apart;
# 8 warps unless said) against key column blocks (the default), and the column blocks' split products accumulated in
# place (BWD_SPLIT_INPLACE). Offline sm_90 (bf16, level 4, 3 stages; registers / spill B): DeltaNet 2: 147 / 0, 3: 110
# / 0 (two 8-warp programs per SM), 3 at 4 warps 174 / 0, capped at 168 8 B; GDN 2: 231 / 0, 3: 176 / 0, capped at
# 128 (two programs per SM) 52 B; simple GLA 2: 181 / 0, capped at 128 84 B; the column blocks in place: DeltaNet 250
# -> 236 registers, GDN's spills 104 -> 52 B, GLA's 88 -> 36. (wyf1 / wyf2 / wyf2scr, the WY pass's work in the key
# side, were timed on an H100 in session 37, 0.9-1.5 ms slower, and removed in session 38: NOTES.md)
SIDES_VARIANTS = ("cols:;inplace:CHUNKWISE_BWD_SPLIT_INPLACE=1;s2:CHUNKWISE_BWD_DQK_SIDES=2;"
                  "s3:CHUNKWISE_BWD_DQK_SIDES=3;s3w4:CHUNKWISE_BWD_DQK_SIDES=3,CHUNKWISE_BWD_WARPS=bwd_dqk_sides:4;"
                  "s3w4c168:CHUNKWISE_BWD_DQK_SIDES=3,CHUNKWISE_BWD_WARPS=bwd_dqk_sides:4,"
                  "CHUNKWISE_MAXNREG=bwd_dqk_sides:168;"
                  "s3c128:CHUNKWISE_BWD_DQK_SIDES=3,CHUNKWISE_MAXNREG=bwd_dqk_sides:128")
# session 33's untimed leads: the WY pass's split pairwise form with K through registers (BWD_WY_PAIR16), level 3
# with its dA K the same way (DeltaNet), the reverse pass forming dR_local itself on top of SAVE_HT (BWD_P_IN_DH)
LEADS_VARIANTS = ("base:;w1:CHUNKWISE_BWD_WY_PAIR16=1;l3:CHUNKWISE_BWD_LOWP=3;pin:CHUNKWISE_BWD_P_IN_DH=1")
FWDOVL_VARIANTS = "ovl:;ovl0:CHUNKWISE_FWD_OVERLAP=0;ovl1:CHUNKWISE_FWD_OVERLAP=1;ovl2:CHUNKWISE_FWD_OVERLAP=2"
NAMED = {"sides": SIDES_VARIANTS, "leads": LEADS_VARIANTS, "wyregs": WYREGS_VARIANTS, "full": FULL_VARIANTS, "fwdovl": FWDOVL_VARIANTS, "tformr": TFORMR_VARIANTS, "saver": SAVER_VARIANTS, "gc": GC_VARIANTS, "sds": SDS_VARIANTS, "beside": BESIDE_VARIANTS, "pairregs": PAIRREGS_VARIANTS, "tform": TFORM_VARIANTS, "kdasplit": KDASPLIT_VARIANTS, "dqk": DQK_VARIANTS, "ahead": AHEAD_VARIANTS, "states": STATES_VARIANTS, "pair": PAIR_VARIANTS, "gates": GATES_VARIANTS, "regs": REG_VARIANTS, "save": SAVE_VARIANTS, "lowp": LOWP_VARIANTS,
         "oneref": ONEREF_VARIANTS}


def run_env(fam, x, do, env, warm):
    """One fwd+bwd with the environment settings env (dict) on top of the defaults."""
    with env_vars(env):
        grads = leaves(x)
        f = fwd_bwd(lambda: run_ours(fam, x), do)
        os.environ["CHUNKWISE_POISON"] = "1"
        f()
        os.environ["CHUNKWISE_POISON"] = "0"
        got = [t.grad.detach().float().clone() for t in grads]
        if warm:
            return None, None, got
        return bench(f, grads), kernel_times(profile(f, grads)), got


def print_table(row, settings):
    """One family's fwd+bwd time under each setting, then each kernel's time under each (ms)."""
    print(f"\n{row['family']} {row['shape']}: fwd+bwd ms " +
          "  ".join(f"{n}: {v['fwd_bwd_ms']:.2f}" for n, v in settings.items()))
    for k in sorted({k for v in settings.values() for k in v["kernels"]}):
        print(f"  {k:12s} " + "  ".join(f"{n}: {v['kernels'].get(k, float('nan')):.3f}" for n, v in settings.items()))


def variants(a, shape):
    """--variants: each named environment setting, timed per family."""
    specs = []
    for item in filter(None, NAMED.get(a.variants, a.variants).split(";")):
        name, _, kv = item.partition(":")
        specs.append((name, dict(p.split("=", 1) for p in filter(None, kv.split(",")))))
    rows = []
    for fam in a.fams.split(","):
        x = make(fam, shape)
        do = torch.randn_like(x["v"])
        base, row = None, dict(family=fam, shape=shape["name"], variants={})
        for name, env in specs:
            ms, per, got = run_env(fam, x, do, env, a.warm)
            diff = None if base is None else max(((t - b).norm() / b.norm()).item() for t, b in zip(got, base))
            base = base or got
            row["variants"][name] = dict(env=env, fwd_bwd_ms=ms, kernels=per, grad_rel_diff=diff,
                                         finite=all(bool(torch.isfinite(t).all()) for t in got))
            if not a.warm:
                print(json.dumps(dict(family=fam, variant=name, **row["variants"][name])), flush=True)
        rows.append(row)
        del x, do
        torch.cuda.empty_cache()
    if a.warm:
        return
    for r in rows:
        print_table(r, r["variants"])
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "sweep_bwd_variants.json"), "w") as fh:
        json.dump(rows, fh, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fams", default="gdn,delta,kda")
    ap.add_argument("--warps", default="8,4", help="the settings to compare (warm: compile these)")
    ap.add_argument("--warm", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--variants", default="", help="name:VAR=value,...;... time only these settings")
    a = ap.parse_args()
    torch.manual_seed(0)
    shape = shapes(64 if a.warm else 1)[0]
    if a.variants:
        return variants(a, shape)
    settings = [int(w) for w in a.warps.split(",")]
    results, picks = [], {}
    for fam in a.fams.split(","):
        x = make(fam, shape)
        do = torch.randn_like(x["v"])
        row = dict(family=fam, shape=shape["name"], configs={})
        base = None
        for w in settings:
            ms, per, got = run_config(fam, x, do, f"all:{w}", a.warm)
            finite = all(bool(torch.isfinite(t).all()) for t in got)
            diff = None if base is None else max(((t - b).norm() / b.norm()).item() for t, b in zip(got, base))
            base = base or got
            row["configs"][f"all:{w}"] = dict(fwd_bwd_ms=ms, kernels=per, finite=finite, grad_rel_diff=diff)
            # the key side in two 64-wide column blocks (the other configurations: one block), same warps
            ms, per, got = run_config(fam, x, do, f"all:{w}", a.warm, ksplit=64)
            row["configs"][f"all:{w}+ksplit"] = dict(
                fwd_bwd_ms=ms, kernels=per, finite=all(bool(torch.isfinite(t).all()) for t in got),
                grad_rel_diff=max(((t - b).norm() / b.norm()).item() for t, b in zip(got, base)))
            # 16-bit product operands in the serial state passes and the W / U recompute (CHUNKWISE_BWD_LOWP=2,
            # the default), also in the key side (3), in the key side but its pairwise products (4)
            for lowp in (2, 3, 4):
                ms, per, got = run_config(fam, x, do, f"all:{w}", a.warm, ksplit=64, lowp=lowp)
                row["configs"][f"all:{w}+ksplit+lowp{lowp}"] = dict(
                    fwd_bwd_ms=ms, kernels=per, finite=all(bool(torch.isfinite(t).all()) for t in got),
                    grad_rel_diff=max(((t - b).norm() / b.norm()).item() for t, b in zip(got, base)))
        if not a.warm:
            # per kernel the faster warps at the default 16-bit level (LOWP 2); KSPLIT from the key side's two
            # forms at fp32 operands
            pick, ksplit = {}, 0
            at_default = [c for c in row["configs"] if c.endswith("+lowp2")]
            for key in KERNELS.values():
                times = {c: row["configs"][c]["kernels"].get(key) for c in at_default}
                times = {c: t for c, t in times.items() if t is not None}
                if times:
                    pick[key] = int(min(times, key=times.get).split(":")[1].split("+")[0])
            forms = {c: row["configs"][c]["kernels"].get("bwd_grad") for c in row["configs"] if "+lowp" not in c}
            forms = {c: t for c, t in forms.items() if t is not None}
            if forms:
                ksplit = 64 if min(forms, key=forms.get).endswith("+ksplit") else 0
            env = ",".join(f"{k}:{w}" for k, w in pick.items())
            for name, lowp in (("pick", 0), ("pick+lowp1", 1), ("pick+lowp2", 2), ("pick+lowp3", 3), ("pick+lowp4", 4)):
                ms, per, got = run_config(fam, x, do, env, False, ksplit=ksplit, lowp=lowp)
                diff = max(((t - b).norm() / b.norm()).item() for t, b in zip(got, base))
                row["configs"][name] = dict(env=env, ksplit=ksplit, fwd_bwd_ms=ms, kernels=per, grad_rel_diff=diff,
                                            finite=all(bool(torch.isfinite(t).all()) for t in got))
            picks[fam] = f"CHUNKWISE_BWD_WARPS={env} CHUNKWISE_BWD_KSPLIT={ksplit}"
            print(json.dumps(row), flush=True)
        results.append(row)
        del x, do
        torch.cuda.empty_cache()
    if a.warm:
        return
    for r in results:
        print_table(r, r["configs"])
        print(f"  pick {picks[r['family']]}  grad diff vs all:{settings[0]}: "
              f"{r['configs']['pick']['grad_rel_diff']:.1e}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "sweep_bwd.json"), "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
