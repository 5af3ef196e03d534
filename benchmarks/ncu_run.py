"""One forward (or fwd+bwd) of a Triton chunk op inside an NVTX range "profile", for Nsight Compute.

    python3 benchmarks/ncu_run.py --fam kda --mode fwd          # compiles and runs once, then once in the range
    ncu --clock-control none --nvtx --nvtx-include "profile/" -k regex:chunk_prepare_kernel \
        --section SpeedOfLight --section Occupancy --section WarpStateStats ... python3 benchmarks/ncu_run.py --fam kda

Inputs as benchmarks/bench_forward.py (K = V = 128, bf16, --shape one of its shape names). The first call
compiles (or reads the Triton cache) outside the range, so that only the second call's launches are profiled.
benchmarks/gpu_session.sh's `ncu` part runs it for the kernels that NOTES.md asks about.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_forward import make, run_ours, shapes  # noqa: E402
from bench_train import fwd_bwd, leaves  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fam", default="kda", choices=("gdn", "kda", "delta", "gla"))
    ap.add_argument("--mode", default="fwd", choices=("fwd", "train"))
    ap.add_argument("--shape", default="B1-T32768-H32")
    a = ap.parse_args()
    s = next(s for s in shapes() if s["name"] == a.shape)
    x = make(a.fam, s)
    if a.mode == "train":
        leaves(x)
        do = torch.randn_like(x["v"])
        fn = fwd_bwd(lambda: run_ours(a.fam, x), do)
    else:
        def fn():
            with torch.no_grad():
                run_ours(a.fam, x)
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
