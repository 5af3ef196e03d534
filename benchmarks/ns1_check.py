"""Stage 2 at one pipeline stage (num_stages=1) or another forced launch setting against the default, on the GPU,
one configuration per process (an illegal memory access poisons the CUDA context): run with CUDA_LAUNCH_BLOCKING=1.

    python benchmarks/ns1_check.py --fam gdn --B 8 --T 4096 --H 32 --bv 32 --ns 1
    python benchmarks/ns1_check.py --fam gdn --dtype fp32 --B 1 --T 4096 --H 8        # fp32's own picks (1 stage)

History: session 12 saw an illegal memory access once in a split run (DeltaNet, one stage), which this check did not
reproduce unsplit; session 20 saw one with GDN's B8-T4096-H32 stage 2 at BV 32, one stage (bench_forward --variants
--variant-set stages), every later launch of that process failing with it.
"""
import argparse

import torch
import torch.nn.functional as F

from chunkwise.triton.chunk_fwd import chunk_fwd

ap = argparse.ArgumentParser()
ap.add_argument("--fam", default="delta", choices=("gdn", "kda", "delta"))
ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
ap.add_argument("--B", type=int, default=1)
ap.add_argument("--T", type=int, default=2048)
ap.add_argument("--H", type=int, default=32)
ap.add_argument("--K", type=int, default=128)
ap.add_argument("--bv", type=int, default=None)
ap.add_argument("--ns", type=int, default=None)
ap.add_argument("--ref", default="fp32", choices=("fp32", "torch"),
                help="the reference: the triton forward on fp32 inputs at its own picks, or the torch backend in float64")
a = ap.parse_args()
dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
torch.manual_seed(0)
B, T, H, K = a.B, a.T, a.H, a.K
q = torch.randn(B, T, H, K, device="cuda").to(dt)
k = F.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).to(dt)
v = torch.randn(B, T, H, K, device="cuda").to(dt)
beta = torch.rand(B, T, H, device="cuda").to(dt)
g = None
if a.fam == "gdn":
    g = F.logsigmoid(torch.randn(B, T, H, device="cuda")) * 0.1
elif a.fam == "kda":
    g = F.logsigmoid(torch.randn(B, T, H, K, device="cuda")) * 0.1
tag = f"{a.fam} {a.dtype} B{B}-T{T}-H{H}-K{K} bv {a.bv} ns {a.ns}"
print(tag, "...", flush=True)
o, _ = chunk_fwd(q, k, v, g, beta, K ** -0.5, None, True, None, bv=a.bv, num_stages=a.ns)
torch.cuda.synchronize()
print(tag, f"ran; the {a.ref} reference ...", flush=True)
if a.ref == "torch":
    import chunkwise
    op = {"gdn": chunkwise.chunk_gated_delta_rule, "kda": chunkwise.chunk_kda, "delta": chunkwise.chunk_delta_rule}[a.fam]
    args = [q.double(), k.double(), v.double()] + ([] if g is None else [g.double()]) + [beta.double()]
    o_ref, _ = op(*args, scale=K ** -0.5, output_final_state=True, backend="torch")
    o_ref = o_ref.float()
else:
    o_ref, _ = chunk_fwd(q.float(), k.float(), v.float(), g, beta.float(), K ** -0.5, None, True, None)
torch.cuda.synchronize()
print(tag, f"ok, rel err against the {a.ref} reference", ((o.float() - o_ref).norm() / o_ref.norm()).item(), flush=True)
