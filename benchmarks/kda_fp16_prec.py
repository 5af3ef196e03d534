"""KDA forward with fp16 inputs: the precision of stage 1's per-channel fp32 products (CHUNKWISE_FP16_MM_PREC).

The tensor cores truncate fp32 operands to tf32; this prints, for each setting, the output error against
the float64 recurrence (B2-T1000-H8, the GPU test's inputs) next to fla's on the same inputs, and the
forward time at B1-T32768-H32 next to fla's (same process, fp16, K = V = 128).

    python benchmarks/kda_fp16_prec.py [--precs tf32,tf32x3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import chunkwise
from chunkwise.reference.recurrent import recurrent_forward


def inputs(B, T, H, K, V, seed, dev, dtype=torch.float16):
    gen = torch.Generator(device=dev).manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    q = rn(B, T, H, K).to(dtype)
    k = F.normalize(rn(B, T, H, K), dim=-1).to(dtype)
    v = rn(B, T, H, V).to(dtype)
    g = F.logsigmoid(rn(B, T, H, K)) * 0.1 - 0.02
    beta = torch.sigmoid(rn(B, T, H)).to(dtype)
    h0 = rn(B, H, K, V) * 0.1
    return q, k, v, g, beta, h0


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--precs", default="tf32,tf32x3")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = "cuda"
    try:
        from fla.ops.kda import chunk_kda as fla_kda
    except ImportError:
        fla_kda = None
    q, k, v, g, beta, h0 = inputs(2, 1000, 8, 128, 128, 11, dev)
    ref_o, _ = recurrent_forward(q, k, v, g, beta, 128 ** -0.5, h0, None, dtype=torch.float64)
    big = inputs(1, 32768, 32, 128, 128, 0, dev)
    rows = []
    if fla_kda is not None:
        with torch.no_grad():
            o, _ = fla_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
            t = do_bench(lambda: fla_kda(*big[:5], initial_state=big[5], output_final_state=True))
        rows.append(dict(impl="fla", err=rel(o, ref_o), ms=t))
    for prec in a.precs.split(","):
        os.environ["CHUNKWISE_FP16_MM_PREC"] = prec
        with torch.no_grad():
            o, _ = chunkwise.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       backend="triton")
            t = do_bench(lambda: chunkwise.chunk_kda(*big[:5], initial_state=big[5], output_final_state=True,
                                                     backend="triton"))
        rows.append(dict(impl=f"chunkwise {prec}", err=rel(o, ref_o), ms=t))
    print(f"{'impl':<22} {'o rel err (B2-T1000-H8)':>24} {'fwd ms (B1-T32768-H32)':>24}")
    for r in rows:
        print(f"{r['impl']:<22} {r['err']:>24.3e} {r['ms']:>24.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
