"""Forward (prefill) benchmark of the Triton chunk ops against fla, same inputs, same process.

    PYTHONPATH=src python3 benchmarks/bench_forward.py [--out DIR] [--variants] [--families gdn,kda,delta,gla]

On the device, compile first in parallel (Triton caches on disk), then time:

    for f in gdn kda delta gla; do python3 benchmarks/bench_forward.py --warm --variants --families $f & done; wait
    python3 benchmarks/bench_forward.py --variants --out $OUT

Shapes (K = V = 128, bf16): B1-T32768-H32, B8-T4096-H32, B4-T8192-H16/HV32, and a varlen batch of
16 sequences of random lengths totalling 32768 tokens (H = 32). Times are triton.testing.do_bench
medians (ms) of the public op (backend="triton", varlen with cu_seqlens_cpu and a precomputed
chunk index: no host sync) and of fla's public op under torch.no_grad. Writes bench_forward.json
(GPU, versions, commit, every number) and bench_forward.png to --out.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
import triton

import chunkwise
from chunkwise.triton.chunk_fwd import chunk_fwd, chunk_prepare, delta_stage1_form

FAMILIES = ("gdn", "kda", "delta", "gla")
OURS = {"gdn": chunkwise.chunk_gated_delta_rule, "kda": chunkwise.chunk_kda,
        "delta": chunkwise.chunk_delta_rule, "gla": chunkwise.chunk_simple_gla}


def shapes(div=1):
    """The benchmark shapes; ``div`` shrinks T (compile warm-up: same kernels, tiny inputs)."""
    gen = torch.Generator().manual_seed(0)
    total = 32768 // div
    cuts = torch.randperm(total - 1, generator=gen)[:15].add(1).sort().values.tolist()
    cu = [0, *cuts, total]
    return [
        dict(name="B1-T32768-H32", B=1, T=32768 // div, H=32, HV=32),
        dict(name="B8-T4096-H32", B=8, T=4096 // div, H=32, HV=32),
        dict(name="B4-T8192-H16/HV32", B=4, T=8192 // div, H=16, HV=32),
        dict(name="varlen16-T32768-H32", B=1, T=total, H=32, HV=32, cu=cu),
    ]


GATE_SCALE = float(os.environ.get("CHUNKWISE_BENCH_GATE_SCALE", "0.1"))


def make(fam, s, K=128, V=128, dtype=torch.bfloat16, dev=None):
    dev = dev or os.environ.get("CHUNKWISE_BENCH_DEVICE", "cuda")     # cpu: benchmarks/warm_cache.py --bench
    B, T, H, HV = s["B"], s["T"], s["H"], s["HV"]
    q = torch.randn(B, T, H, K, device=dev, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, device=dev, dtype=torch.float32), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, V, device=dev, dtype=dtype)
    g = beta = None
    if fam in ("gdn", "gla"):
        g = F.logsigmoid(torch.randn(B, T, HV, device=dev, dtype=torch.float32)) * 0.1
    elif fam == "kda":
        # CHUNKWISE_BENCH_GATE_SCALE (default 0.1, fla's benchmarks' draw, about -0.08 per token): larger
        # values give chunks whose gates sum past KDA's one-reference range (-160 over 64 tokens at ~2.5)
        g = F.logsigmoid(torch.randn(B, T, HV, K, device=dev, dtype=torch.float32)) * GATE_SCALE
    if fam != "gla":
        beta = torch.rand(B, T, HV, device=dev, dtype=dtype) * 0.9 + 0.05
    cu = cu_cpu = chunk_indices = None
    if "cu" in s:
        cu_cpu = torch.tensor(s["cu"], dtype=torch.int32)
        cu = cu_cpu.to(dev)
        chunk_indices = chunkwise.prepare_chunk_indices(cu_cpu).to(dev)
    return dict(q=q, k=k, v=v, g=g, beta=beta, cu=cu, cu_cpu=cu_cpu, chunk_indices=chunk_indices)


@contextlib.contextmanager
def env_vars(env):
    """The environment variables of ``env`` (dict) set for the block, their former values (or absence) back after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_ours(fam, x):
    args = [x["q"], x["k"], x["v"]] + ([x["g"]] if x["g"] is not None else []) + \
        ([x["beta"]] if x["beta"] is not None else [])
    return OURS[fam](*args, output_final_state=True, cu_seqlens=x["cu"], cu_seqlens_cpu=x["cu_cpu"],
                     chunk_indices=x["chunk_indices"], backend="triton")


def run_variant(fam, x, **kw):
    K = x["q"].shape[-1]
    return chunk_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, None, True, x["cu"],
                     chunk_indices=x["chunk_indices"], **kw)


def fla_fn(fam):
    try:
        if fam == "gdn":
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as f
        elif fam == "kda":
            from fla.ops.kda import chunk_kda as f
        elif fam == "delta":
            from fla.ops.delta_rule import chunk_delta_rule as f
        else:
            from fla.ops.simple_gla import chunk_simple_gla as f
        return f
    except Exception as e:  # noqa: BLE001
        print(f"fla {fam}: not importable ({e!r})", file=sys.stderr)
        return None


def run_fla(fam, f, x):
    q, k = x["q"], x["k"]
    HV = x["v"].shape[2]
    if fam != "gdn" and q.shape[2] != HV:      # only fla's GDN takes grouped value heads
        q, k = q.repeat_interleave(HV // q.shape[2], 2), k.repeat_interleave(HV // k.shape[2], 2)
    kw = dict(output_final_state=True, cu_seqlens=x["cu"])
    if x["cu"] is not None:
        kw["cu_seqlens_cpu"] = x["cu_cpu"].long()
        kw["cu_seqlens"] = x["cu"].long()
    if fam == "gdn":
        return f(q, k, x["v"], x["g"], x["beta"], **kw)
    if fam == "kda":
        return f(q, k, x["v"], x["g"], x["beta"], **kw)
    if fam == "delta":
        return f(q, k, x["v"], x["beta"], **kw)
    return f(q, k, x["v"], g=x["g"], **kw)


def _fla_autotuners():
    """fla's autotuned kernels loaded in this process (through triton.heuristics and other wrappers)."""
    from triton.runtime.autotuner import Autotuner
    found = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("fla.ops") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            for _ in range(4):
                if isinstance(obj, Autotuner) or not hasattr(obj, "fn"):
                    break
                obj = obj.fn
            if isinstance(obj, Autotuner):
                found[id(obj)] = obj
    return list(found.values())


def fla_fresh_search():
    """Make fla's next call search its configurations afresh: its autotuners forget this process's picks and read
    no kept ones from disk. fla's autotuners read Triton's on-disk results whenever FLA_CACHE_RESULTS is on (its
    default), whatever TRITON_CACHE_AUTOTUNING says, and some keys leave T out (fwd_h: H, K, V), so one shape's pick
    would serve the next. With the picks kept from a session-21 run (fwd_h at BV 64) fla's GDN forward at
    B1-T32768-H32 took 2.12 ms on the H200 against 1.93 after a fresh search (NOTES.md, session 30)."""
    for at in _fla_autotuners():
        at.cache_results = False
        at.cache.clear()


def fla_autotune_picks() -> dict:
    """The configurations fla's autotuned kernels ran with in this process ({kernel: {key: config}}), recorded with
    every fla timing."""
    picks = {}
    for at in _fla_autotuners():
        if at.cache:
            picks[at.base_fn.__name__] = {str(k): str(c) for k, c in at.cache.items()}
    return picks


WARM = False
# CHUNKWISE_BENCH_GRAPH=1: time the replay of a CUDA graph of each call (the GPU's time without the host's launch
# cost)
GRAPH = os.environ.get("CHUNKWISE_BENCH_GRAPH") == "1"


def bench(fn):
    out = fn()
    if WARM:
        return float("nan"), out
    torch.cuda.synchronize()
    if GRAPH:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        graph.replay()
        torch.cuda.synchronize()
        return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median"), out
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"), out


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--variant-set", default="all", choices=("all", "seg", "pfree", "tma", "solve", "pstages", "trans", "kdasplit",
                                                            "tform", "bv128", "solvebf16", "tftrans", "aplowp", "stages",
                                                            "overlap", "prepwarps", "wuovl", "full"),
                    help="seg: only simple GLA's segment variants; pfree: only GDN / DeltaNet with P formed in "
                         "stage 2 instead of stage 1; tma: every family's serial stage with its tiles loaded through tensor "
                         "descriptors or not; solve: the delta families with (I + A)⁻¹'s diagonal blocks by "
                         "substitution or doubling; pstages: KDA's stage 1 at 1 / 2 / 3 pipeline stages; trans: "
                         "stage 2 on the transposed state or not, at BV 32 / 64; kdasplit: KDA's stage 1 in one launch or "
                         "two (CHUNKWISE_KDA_ONE_REF 1 / 2); tform: GDN / DeltaNet with stage 1 writing T diag(β) "
                         "instead of W, U (CHUNKWISE_FWD_T_FORM); bv128: stage 2 over all 128 value columns per program at 8 "
                         "warps, and KDA's stage 1 with bf16 A / P operands or capped registers; solvebf16: the delta families' "
                         "inference solve from bf16 operands (CHUNKWISE_SOLVE_BF16); tftrans: DeltaNet's and KDA's stage 2 on the "
                         "transposed state under T_FORM (CHUNKWISE_FWD_TRANS) or not; aplowp: KDA's stage 1 with A from bf16 or A and "
                         "P from fp16 (CHUNKWISE_KDA_AP_LOWP 1 / 2; run it also under CHUNKWISE_BENCH_GATE_SCALE=1); stages: stage 2 at BV 32 / 64 and 1 / 2 / 3 pipeline stages (GDN also transposed); overlap: the delta families' stage 2 beside stage 1 (chunk_fwd(overlap=)) or after it, at BV 32 / 64 and 2 / 3 pipeline stages; prepwarps: GDN's / DeltaNet's stage 1 at 4 or 8 warps (register caps), beside stage 2 or after it, stage 2's output through TMA or not; wuovl: GDN's / DeltaNet's W / U form (CHUNKWISE_FWD_T_FORM=0) beside stage 1 at BV 32 / 64, 2 / 3 stages, P from stage 1 or stage 2; full: stage 1 without the bounds checks its tiles do not need (CHUNKWISE_PREP_FULL), and stage 1 alone (with --variants)")
    ap.add_argument("--variants", action="store_true", help="also time stage-2 variants (BV 16/32/64 x 4/8 warps x 2/3 stages; GLA also with P from its own kernel, GDN with the decays from stage 1)")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--warm", action="store_true", help="compile everything on tiny inputs, time nothing")
    a = ap.parse_args()
    global WARM
    WARM = a.warm
    fams = a.families.split(",")
    os.environ["CHUNKWISE_POISON"] = "0"
    results = []
    torch.manual_seed(0)
    for s in shapes(4 if a.warm else 1):     # T / 4: long enough for the same segment split (simple GLA)
        if a.shapes and s["name"] not in a.shapes.split(","):
            continue
        for fam in fams:
            x = make(fam, s)
            # poison check: one call with NaN-filled outputs, every element must be finite
            os.environ["CHUNKWISE_POISON"] = "1"
            o_chk, _ = run_ours(fam, x)
            os.environ["CHUNKWISE_POISON"] = "0"
            finite = bool(torch.isfinite(o_chk).all())
            t_ours, (o, ht) = bench(lambda: run_ours(fam, x))
            row = dict(shape=s["name"], family=fam, ours_ms=t_ours, all_finite=finite)

            def stage1_ms():
                """Stage 1 alone, as the forward launches it (delta_stage1_form: P stored where stage 2 does not
                form it, T diag(β) instead of W and U)."""
                store_p, t_form = delta_stage1_form({"gdn": 1, "delta": 0, "kda": 2}[fam])
                return bench(lambda: chunk_prepare(x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu"],
                                                   x["chunk_indices"], store_p=store_p, t_form=t_form))[0]
            if x["beta"] is not None:       # (the rest of ours_ms is stage 2)
                row["stage1_ms"] = stage1_ms()
            f = fla_fn(fam)
            if f is not None:
                try:
                    with torch.no_grad():
                        fla_fresh_search()
                        t_fla, (o_f, ht_f) = bench(lambda: run_fla(fam, f, x))
                    row.update(fla_ms=t_fla, speedup=t_fla / t_ours, o_vs_fla=rel(o, o_f), ht_vs_fla=rel(ht, ht_f),
                               fla_configs=fla_autotune_picks())
                except Exception as e:  # noqa: BLE001
                    row["fla_error"] = repr(e)[:300]
            if a.variants:
                var = {}

                def time_variant(key, env=None, stage1=False, **kw):
                    """The forward with chunk_fwd's keywords kw under the environment settings env; with stage1,
                    also stage 1 alone (stage1_ms) as key + "-s1"."""
                    with env_vars(env or {}):
                        try:
                            var[key], (o_v, _) = bench(lambda: run_variant(fam, x, **kw))
                            if a.variant_set in ("bv128", "solvebf16", "tftrans", "aplowp", "overlap", "prepwarps", "wuovl", "full"):     # the output against the default's
                                var[key + "-vs-default"] = rel(o_v, o)
                            if stage1:
                                var[key + "-s1"] = stage1_ms()
                        except Exception as e:  # noqa: BLE001
                            var[key] = repr(e)[:120]
                own = dict(p_in=False) if fam == "gla" else {}      # GLA: P formed in the serial loop
                if a.variant_set == "pfree" and fam in ("gdn", "delta"):
                    # P from stage 1 (the default) or formed in stage 2's serial loop (stage 1 reads no q)
                    time_variant("p-stage1", p_in=True)
                    time_variant("p-stage2", p_in=False)
                    time_variant("p-stage2-ns2", p_in=False, num_stages=2)
                    # beside stage 1 (chunk_fwd(overlap=True)): P's product moved off the throughput-bound stage 1 onto
                    # the latency-bound serial loop, where it is off the state's chain
                    for ns in (2, 3):
                        time_variant(f"p-stage2-ns{ns}-ovl1", p_in=False, num_stages=ns, overlap=True)
                        time_variant(f"p-stage1-ns{ns}-ovl1", p_in=True, num_stages=ns, overlap=True)
                if a.variant_set == "tma":
                    # the serial stage's tiles through tensor descriptors (CHUNKWISE_FWD_TMA) or not
                    for key, val in (("no-tma", "0"), ("tma", "1"), ("tma-o", "1")):
                        time_variant(key, env={"CHUNKWISE_FWD_TMA": val,
                                               "CHUNKWISE_FWD_TMA_O": "1" if key == "tma-o" else "0"})
                if a.variant_set == "trans":
                    # stage 2 on the transposed state (CHUNKWISE_FWD_TRANS) or not, at the default BV and at 32 / 64
                    for key, tr, kw in (("plain", "0", {}), ("trans", "1", {}), ("plain-bv32", "0", dict(bv=32)),
                                        ("trans-bv32", "1", dict(bv=32)), ("trans-bv32-ns2", "1", dict(bv=32, num_stages=2)),
                                        ("plain-bv64", "0", dict(bv=64)), ("trans-bv64", "1", dict(bv=64))):
                        time_variant(key, env={"CHUNKWISE_FWD_TRANS": tr}, **kw)
                if a.variant_set == "solve" and fam != "gla":
                    # (I + A)⁻¹'s diagonal blocks by substitution (0) or doubling (1): the forward and stage 1
                    for form in ("0", "1"):
                        time_variant(f"solve{form}", env={"CHUNKWISE_SOLVE_DOUBLING": form}, stage1=True)
                if a.variant_set == "kdasplit" and fam == "kda":
                    # KDA's stage 1 as one launch with both A / P forms built in, or two (CHUNKWISE_KDA_ONE_REF 1 / 2)
                    for n in ("1", "2"):
                        time_variant(f"oneref{n}", env={"CHUNKWISE_KDA_ONE_REF": n}, stage1=True)
                    # the one-reference build at 8 warps (offline sm_90: 182 registers, one program per SM)
                    time_variant("oneref2-w8", env={"CHUNKWISE_KDA_ONE_REF": "2", "CHUNKWISE_PREP_CONFIG": "2:0,8,32,0"},
                                 stage1=True)
                if a.variant_set == "tform" and fam in ("gdn", "delta", "kda"):
                    # stage 1 writes T diag(β) (KDA: and K ⊙ e^G) and stage 2 forms R from it (CHUNKWISE_FWD_T_FORM=1)
                    # against W, U from stage 1; P where the default puts it or the other place (not KDA's); BV 32 /
                    # 64; KDA at 3 pipeline stages (2 by default with its T tile); stage 1 alone
                    time_variant("wu", env={"CHUNKWISE_FWD_T_FORM": "0"}, stage1=fam == "kda")
                    time_variant("tform", env={"CHUNKWISE_FWD_T_FORM": "1"}, stage1=fam == "kda")
                    if fam == "kda":
                        time_variant("tform-ns3-bv32", env={"CHUNKWISE_FWD_T_FORM": "1"}, bv=32, num_stages=3)
                        # stage 1 in 16-channel column chunks (offline sm_90: 221 registers, no spills; capped at
                        # 168, 28 B of spills and three programs per SM): slower (run of a5e484b, NOTES session 17)
                        bkc16 = {"CHUNKWISE_FWD_T_FORM": "1", "CHUNKWISE_PREP_BKC": "16"}
                        time_variant("tform-bkc16", env=bkc16, stage1=True)
                        time_variant("tform-bkc16-r168", env={**bkc16, "CHUNKWISE_MAXNREG": "prep_fwd:168"}, stage1=True)
                    else:
                        if fam == "gdn":    # stage 1 (P stored, 186 registers) capped for three programs per SM
                            for cap in (168, 160):
                                time_variant(f"tform-r{cap}", env={"CHUNKWISE_FWD_T_FORM": "1",
                                                                   "CHUNKWISE_MAXNREG": f"prep_fwd:{cap}"})
                        other = {"CHUNKWISE_FWD_P_IN": "0" if fam == "gdn" else "1"}
                        time_variant("tform-pother", env={"CHUNKWISE_FWD_T_FORM": "1", **other})
                        time_variant("wu-pother", env={"CHUNKWISE_FWD_T_FORM": "0", **other})
                    for bv in (32, 64):
                        time_variant(f"tform-bv{bv}", env={"CHUNKWISE_FWD_T_FORM": "1"}, bv=bv)
                    for sp in (True, False) if fam != "kda" else ():
                        var[f"tform-s1-p{int(sp)}"] = bench(lambda: chunk_prepare(
                            x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu"], x["chunk_indices"], store_p=sp,
                            t_form=True))[0]
                if a.variant_set == "bv128" and fam in ("gdn", "delta", "kda"):
                    # stage 2 with one program per value head (each chunk's [C, K] tiles, P and T read once, not
                    # once per 64 columns): 8 warps (offline sm_90 bf16 TMA: KDA 254 registers, no spills, 213 KB
                    # of shared memory at 2 stages; GDN 80 B of spills)
                    for ns in (2, 1):
                        time_variant(f"bv128-w8-s{ns}", bv=128, num_warps=8, num_stages=ns)
                    if fam == "kda":
                        # stage 1: A from bf16 operands or tf32 (CHUNKWISE_KDA_AP_LOWP)
                        # (run of 3dfaf46, B1 stage 1: tf32 1.374 ms, A and P from bf16 1.261 (error over fla's), A
                        # alone 1.354 (now the default), P alone 1.332, fp16 where it fits 1.600; NOTES session 18)
                        for mode in ("0", "1"):
                            time_variant(f"aplowp{mode}", env={"CHUNKWISE_KDA_AP_LOWP": mode}, stage1=True)
                if a.variant_set == "solvebf16" and fam in ("gdn", "delta", "kda"):
                    # stage 1's (I + A)⁻¹ from bf16 operands or tf32 ones (CHUNKWISE_SOLVE_BF16), forward and stage 1
                    # (run of bdce396: bf16 for part of the solve, modes 2 / 3 then, also passed fla's error with nearly
                    # parallel keys; run of 2593579 for KDA: 2 pipeline stages of stage 1 slower, BV 128 -2 % at B8 / B4)
                    for mode in ("0", "1"):
                        time_variant(f"solvebf16-{mode}", env={"CHUNKWISE_SOLVE_BF16": mode}, stage1=True)
                    # fp16 operands, the tf32 solve again where T is not finite (CHUNKWISE_SOLVE_FP16)
                    time_variant("solvefp16-1", env={"CHUNKWISE_SOLVE_FP16": "1"}, stage1=True)
                    if fam != "kda":    # the redo as a second launch (CHUNKWISE_SOLVE_FP16_SPLIT)
                        time_variant("solvefp16-split", env={"CHUNKWISE_SOLVE_FP16": "1", "CHUNKWISE_SOLVE_FP16_SPLIT": "1"},
                                     stage1=True)
                if a.variant_set == "tftrans" and fam in ("delta", "kda"):
                    # stage 2 under T_FORM on the transposed state (Rᵀ = (Vᵀ − Sᵀ (K ⊙ e^G)ᵀ) (T diag(β))ᵀ: nothing on the
                    # state's chain staged through shared memory) or the plain one, at the default BV and 64; KDA also
                    # at 3 pipeline stages at BV 64 (run of 3d1debd, NOTES session 19: the default since)
                    for tr in ("0", "1"):
                        time_variant(f"trans{tr}", env={"CHUNKWISE_FWD_TRANS": tr})
                    time_variant("trans1-bv64", env={"CHUNKWISE_FWD_TRANS": "1"}, bv=64)
                    if fam == "kda":
                        time_variant("trans1-bv64-ns2", env={"CHUNKWISE_FWD_TRANS": "1"}, bv=64, num_stages=2)
                        time_variant("trans1-bv64-ns3", env={"CHUNKWISE_FWD_TRANS": "1"}, bv=64, num_stages=3)
                if a.variant_set == "aplowp" and fam == "kda":
                    # stage 1's one-reference A / P: A from bf16 (the default) or A and P from fp16 with the programs
                    # past SPAN_FP16 flagged to the full build's launch (CHUNKWISE_KDA_AP_LOWP)
                    for mode in ("1", "2"):
                        time_variant(f"aplowp{mode}", env={"CHUNKWISE_KDA_AP_LOWP": mode}, stage1=True)
                if a.variant_set == "stages":
                    # stage 2's pipeline depth at BV 32 / 64: one stage fits two or three programs per SM (their loads
                    # wait on memory, but the other programs' steps fill the wait), which at 256 programs (B4-T8192-
                    # H16/HV32) is one wave instead of two (not at BV 32 with 16-bit inputs: chunk_fwd refuses that
                    # build, miscompiled on sm_90); and the transposed step (CHUNKWISE_FWD_TRANS) for GDN
                    for bv in (32, 64):
                        for ns in (2, 3) if bv == 32 else (1, 2, 3):
                            time_variant(f"bv{bv}-ns{ns}", bv=bv, num_stages=ns, **own)
                    if fam == "gdn":
                        for ns in (1, 2, 3):
                            time_variant(f"trans1-bv64-ns{ns}", env={"CHUNKWISE_FWD_TRANS": "1"}, bv=64, num_stages=ns)
                if a.variant_set == "overlap" and fam in ("gdn", "delta", "kda"):
                    # stage 2 beside stage 1 (its own high-priority stream, each step waiting for its chunk's flag;
                    # only where stage 2 has fewer programs than the GPU has SMs) or after it
                    for ov in (False, True):
                        time_variant(f"ovl{int(ov)}", overlap=ov)
                        for bv, ns in ((32, 2), (64, 2), (64, 3)):
                            time_variant(f"ovl{int(ov)}-bv{bv}-ns{ns}", overlap=ov, bv=bv, num_stages=ns)
                if a.variant_set == "prepwarps" and fam in ("gdn", "delta"):
                    # beside stage 2 (one 168 KB stage-2 program per SM at BV 32, 3 stages) a 32 KB stage-1 program
                    # fits once per SM by shared memory: at 8 warps that one program has twice the warps (offline
                    # sm_90, GDN bf16: 162 registers at its 168 cap, 128 with no spills at a 128 cap); stage 2's output
                    # without TMA frees 4 KB. Stage 1 alone too (after: the other shapes' launch)
                    w8 = {"CHUNKWISE_PREP_WARPS": "8"}
                    for key, env in (("w4", {}), ("w8", w8), ("w8-r128", {**w8, "CHUNKWISE_MAXNREG": "prep_fwd:128"}),
                                     ("w8-r144", {**w8, "CHUNKWISE_MAXNREG": "prep_fwd:144"}),
                                     ("w4-tmao0", {"CHUNKWISE_FWD_TMA_O": "0"}),
                                     ("w8-r128-tmao0", {**w8, "CHUNKWISE_MAXNREG": "prep_fwd:128", "CHUNKWISE_FWD_TMA_O": "0"})):
                        for ov in ("1", "0"):
                            time_variant(f"{key}-ovl{ov}", env={**env, "CHUNKWISE_FWD_OVERLAP": ov}, stage1=ov == "0")
                if a.variant_set == "wuovl" and fam in ("gdn", "delta"):
                    # the W / U form's stage 2 (one dependent product fewer per chunk than T_FORM's: 0.622 against
                    # 0.687 ms alone for GDN, session 17) beside stage 1, which the T form got in session 22 but the
                    # W / U form never did; its stage 1 writes W and U instead of T diag(β) (+16 MB of stores at B1)
                    wu = {"CHUNKWISE_FWD_T_FORM": "0"}
                    time_variant("tform", env={"CHUNKWISE_FWD_T_FORM": "1"})
                    time_variant("wu", env=wu)
                    time_variant("wu-ovl0", env={**wu, "CHUNKWISE_FWD_OVERLAP": "0"})
                    for bv, ns in ((32, 2), (32, 3), (64, 2), (64, 3)):
                        time_variant(f"wu-bv{bv}-ns{ns}", env=wu, bv=bv, num_stages=ns, overlap=True)
                        time_variant(f"wu-p0-bv{bv}-ns{ns}", env=wu, bv=bv, num_stages=ns, overlap=True, p_in=False)
                if a.variant_set == "full" and fam in ("gdn", "delta", "kda"):
                    # stage 1 without the row / column bounds checks (chunk_fwd.PREP_FULL: GDN's build −4.2 % of its
                    # instructions offline, predicted 0.98 -> ~0.95 ms at B1 beside stage 2), the forward and stage 1
                    for full in ("0", "1"):
                        time_variant(f"full{full}", env={"CHUNKWISE_PREP_FULL": full}, stage1=True)
                if a.variant_set == "pstages" and fam == "kda":
                    # stage 1's software pipeline over its column chunks (CHUNKWISE_PREP_STAGES): the forward and stage 1
                    for n in ("1", "2", "3"):
                        time_variant(f"pstages{n}", env={"CHUNKWISE_PREP_STAGES": n}, stage1=True)
                if fam == "gla" and a.variant_set in ("all", "seg") and x["q"].shape[0] == 1 and x["cu"] is None:
                    # the segment split's first pass in sub-segments (chunk_fwd(seg_sub=)), 4 segments, at the
                    # second pass's value block (64, 4 warps) or its own
                    for sub, p1 in ((1, (128, 4)), (2, (128, 4)), (4, (128, 4)), (2, (128, 4, 3)), (2, (128, 4, 1)),
                                    (2, (64, 4)), (2, (128, 8)), (4, None)):
                        tag = "" if p1 is None else f"-p1bv{p1[0]}w{p1[1]}" + (f"s{p1[2]}" if len(p1) > 2 else "")
                        time_variant(f"seg4-sub{sub}-bv64-nw4-ns2{tag}", bv=64, num_warps=4, num_stages=2,
                                     segments=4, seg_sub=sub, seg_phase1=p1)
                for bv in (16, 32, 64) if a.variant_set == "all" else ():
                    for nw in (4, 8):
                        for ns in (2, 3):
                            time_variant(f"bv{bv}-nw{nw}-ns{ns}", bv=bv, num_warps=nw, num_stages=ns, **own)
                    if fam == "gla":            # P formed once per chunk by its own kernel (chunk_p_kernel)
                        for ns in (2, 3):
                            time_variant(f"bv{bv}-nw4-ns{ns}-pin", bv=bv, num_warps=4, num_stages=ns, p_in=True)
                    if fam == "gla" and bv >= 32 and x["q"].shape[0] == 1 and x["cu"] is None:
                        # the segment split (chunk_fwd(segments=)): segments x value block x stages
                        for nseg in (4, 8, 16):
                            for ns in (2, 3):
                                time_variant(f"seg{nseg}-bv{bv}-nw4-ns{ns}", bv=bv, num_warps=4, num_stages=ns,
                                             segments=nseg)
                            # the first pass (local end states) over all of V at 8 warps: k read once per head
                            time_variant(f"seg{nseg}-bv{bv}-nw4-ns2-p1bv128w8", bv=bv, num_warps=4, num_stages=2,
                                         segments=nseg, seg_phase1=(128, 8))
                row["variants"] = var
            results.append(row)
            print(json.dumps(row), flush=True)
            del x
            torch.cuda.empty_cache()

    def version(mod):
        try:
            return __import__(mod).__version__
        except Exception:  # noqa: BLE001
            return None
    commit = os.environ.get("GIT_COMMIT")     # the device's copy may carry a stale .git: the caller's word first
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
        except Exception:  # noqa: BLE001
            commit = None
    if a.warm:
        return
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                fla=version("fla"), commit=commit, dirty=os.environ.get("GIT_DIRTY"), dtype="bfloat16", K=128, V=128)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_forward.json"), "w") as fh:
        json.dump(dict(meta=meta, results=results), fh, indent=1)

    print(f"\n{meta['gpu']}  torch {meta['torch']}  triton {meta['triton']}  fla {meta['fla']}  commit {str(commit)[:10]}")
    print(f"{'shape':22s} {'fam':6s} {'ours ms':>8s} {'stage1':>7s} {'fla ms':>8s} {'x fla':>6s} {'o~fla':>8s} finite")
    for r in results:
        print(f"{r['shape']:22s} {r['family']:6s} {r['ours_ms']:8.3f} {r.get('stage1_ms', float('nan')):7.3f} "
              f"{r.get('fla_ms', float('nan')):8.3f} {r.get('speedup', float('nan')):6.2f} "
              f"{r.get('o_vs_fla', float('nan')):8.1e} {r['all_finite']}")
    plot(results, os.path.join(a.out, "bench_forward.png"))


def plot(results, path):
    """Bars of ours against fla per family and shape (results: rows as bench_forward.json holds them)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fams = list(dict.fromkeys(r["family"] for r in results))
        fig, axes = plt.subplots(1, len(fams), figsize=(4.5 * len(fams), 4), squeeze=False)
        for ax, fam in zip(axes[0], fams):
            rs = [r for r in results if r["family"] == fam]
            xs = range(len(rs))
            ax.bar([i - 0.2 for i in xs], [r["ours_ms"] for r in rs], 0.4, label="chunkwise")
            ax.bar([i + 0.2 for i in xs], [r.get("fla_ms", 0) for r in rs], 0.4, label="fla 0.6.0")
            ax.set_xticks(list(xs), [r["shape"].replace("-", "\n", 1) for r in rs], fontsize=7)
            ax.set_title(f"{fam} forward, bf16, K=V=128")
            ax.set_ylabel("ms (median)")
            ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    except Exception as e:  # noqa: BLE001
        print("plot failed:", e)


if __name__ == "__main__":
    main()
