"""GPU diagnosis of backward test failures: each (test, environment) pair in its own pytest process with
CUDA_LAUNCH_BLOCKING=1 (an illegal memory access kills only that case and its traceback names the kernel
launch), so that a failure can be bisected by the launch knobs (CHUNKWISE_BWD_*) in one device call.

    python benchmarks/diag_bwd.py --cases "test_grads_kda_steep_blocks[dtype0]" --envs "default|CHUNKWISE_BWD_PAIR_SPLIT=0"
    python benchmarks/diag_bwd.py --preset session5 --jobs 8 --out $OUT

Prints one line per pair: PASS / FAIL, seconds, and the first error line (with the kernel named where an
illegal memory access was raised).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

FILE = "tests/test_triton_chunk_bwd.py"
KDA_BAD = ["test_grads_kda_steep_blocks[dtype0]", "test_grads_strong_gates[kda]", "test_grads_varlen_transposed[kda]",
           "test_grads_key_side_in_column_blocks[kda]", "test_grads_in_op_preludes[kda]"]
PRESETS = {
    # the failures of the GPU run of a3986d3 (benchmarks/results/h200/bwdtests_a3986d3), against the knobs
    "session5": (
        [(c, e) for c in KDA_BAD for e in ("", "CHUNKWISE_BWD_PAIR_SPLIT=0", "CHUNKWISE_BWD_WARPS=all:4",
                                           "CHUNKWISE_BWD_WARPS=bwd_grad:4,bwd_pair:4")]
        + [(c, e) for c in ("test_grads_recompute_paths[gdn-1-dtype1]", "test_grads_recompute_paths[delta-1-dtype1]")
           for e in ("", "CHUNKWISE_BWD_LOWP=1", "CHUNKWISE_BWD_WARPS=prep:8")]
        + [(c, e) for c in ("test_grads_wide_keys[gdn-256-dtype2]", "test_grads_wide_keys[delta-256-dtype2]")
           for e in ("", "CHUNKWISE_BWD_LOWP=0", "CHUNKWISE_BWD_FUSED_PREP=0")]
        + [(c, e) for c in ("test_grads_wide_keys[kda-256-dtype0]", "test_grads_wide_keys[kda-160-dtype1]",
                            "test_grads_wide_keys[kda-256-dtype2]")
           for e in ("", "CHUNKWISE_BWD_PAIR_SPLIT=0", "CHUNKWISE_BWD_WARPS=all:4")]
        + [(c, "") for c in ("test_grads_16_bit_products[gdn-2]", "test_grads_16_bit_products[delta-2]",
                             "test_grads_16_bit_products[gdn-3]", "test_grads_fp16[gdn]", "test_grads_fp16[gla]")]
        + [("test_real_size_grads_vs_fla[kda-bf16]", e) for e in ("", "CHUNKWISE_BWD_PAIR_SPLIT=0")]
    ),
    # session 8: GDN / DeltaNet bf16 at small tiles (K = 16, V = 32, a length-1 sequence) failed on the H200
    # (illegal memory access or wrong q / k / g) with stage 1 saved and recomputed; fp16 at the same shapes
    # passes with the intra / solve / wu recompute
    "session8": (
        [(f"test_grads_bf16_small_tiles[{f}-{s}-{sh}]", "") for f in ("gdn", "delta") for s in (0, 1)
         for sh in ("k16", "k16-nolen1", "k64")]
        + [(f"test_grads_bf16_small_tiles[{f}-0-k16]", e) for f in ("gdn", "delta")
           for e in ("CHUNKWISE_BWD_FUSED_PREP=0", "CHUNKWISE_BWD_LOWP=0", "CHUNKWISE_BWD_LOWP=1",
                     "CHUNKWISE_BWD_WARPS=all:8", "CHUNKWISE_BWD_FUSED_PREP=0;CHUNKWISE_BWD_LOWP=1")]
        + [(f"test_grads_bf16_small_tiles[{f}-1-k16]", e) for f in ("gdn", "delta")
           for e in ("CHUNKWISE_BWD_LOWP=0", "CHUNKWISE_PREP_WU_LOWP=0")]
        # the key side's 16-bit operands but the pairwise products (level 4) at small tiles in bf16
        + [(f"test_grads_bf16_small_tiles[{f}-1-{sh}]", "CHUNKWISE_BWD_LOWP=4") for f in ("kda", "gla")
           for sh in ("k16", "k64")]
    ),
    # session 9 (run of 4f6f22a): KDA bf16 at K = 64 with stage 1 recomputed wrong (every gradient ~1; saved
    # passed), KDA fp16 real-size dg 1.16e-3 against fla's 5.97e-4 (tf32rn products)
    "session9": (
        [("test_grads_bf16_small_tiles[kda-0-k64]", e)
         for e in ("", "CHUNKWISE_BWD_LOWP=1", "CHUNKWISE_BWD_LOWP=0", "CHUNKWISE_BWD_WARPS=all:4")]
        + [("test_real_size_grads_vs_fla[kda-fp16]", e)
           for e in ("", "CHUNKWISE_BWD_PREC16=tf32x3", "CHUNKWISE_BWD_LOWP=0", "CHUNKWISE_BWD_LOWP=1",
                     "CHUNKWISE_SAVE_STAGE1=0")]
    ),
}


def run_case(case, env_str, timeout):
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    for kv in filter(None, env_str.split(";")):
        k, v = kv.split("=", 1)
        env[k] = v
    t = time.time()
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=",
                            "--tb=short", f"{FILE}::{case}"], env=env, capture_output=True, text=True, timeout=timeout)
        out, ok = p.stdout + p.stderr, p.returncode == 0
    except subprocess.TimeoutExpired:
        out, ok = "timeout", False
    err = ""
    if not ok:
        lines = out.splitlines()
        errs = [ln for ln in lines if ln.startswith("E ")]
        err = errs[0][:220] if errs else (lines[-1][:220] if lines else "")
        kern = [m.group(1) for ln in lines for m in [re.search(r"(_\w+_kernel|chunk_\w+_kernel)\[", ln)] if m]
        if kern:
            err += f"  (last launch: {kern[-1]})"
    return dict(case=case, env=env_str or "default", ok=ok, s=round(time.time() - t, 1), err=err)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="")
    ap.add_argument("--cases", default="", help="'|'-separated test ids in " + FILE)
    ap.add_argument("--envs", default="default", help="'|'-separated settings, each 'VAR=v;VAR=v' or 'default'")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.preset:
        pairs = PRESETS[a.preset]
    else:
        envs = ["" if e == "default" else e for e in a.envs.split("|")]
        pairs = list(itertools.product(filter(None, a.cases.split("|")), envs))
    with ThreadPoolExecutor(a.jobs) as ex:
        rows = list(ex.map(lambda p: run_case(p[0], p[1], a.timeout), pairs))
    for r in rows:
        print(f"{'PASS' if r['ok'] else 'FAIL'} {r['s']:6.1f}s  {r['case']:45s} {r['env']:45s} {r['err']}")
    if a.out:
        with open(os.path.join(a.out, "diag_bwd.json"), "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
