"""Output error of the delta families' bf16 forward against the float64 recurrence, ours under launch switches and
fla 0.6.0's on the same inputs: the tests' random inputs (L2-normalised keys, β in [0.05, 0.95)) and nearly
parallel keys (one direction plus 0.2 noise, β in [0.9, 0.99): an ill-conditioned I + A), several seeds.

Usage (GPU): python benchmarks/forward_errors.py [--fams gdn,delta,kda] [--switch CHUNKWISE_SOLVE_BF16]
             [--shapes B2-T1000-H8,B1-T4096-H8] [--seeds 3]
Prints one line per (family, keys, shape, seed): ours at each of the switch's values, fla; then the worst ratios to fla.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers import CHUNK_OPS, make_inputs, reference, rel_err  # noqa: E402


def correlated(inp, seed):
    """The inputs with nearly parallel unit keys and β near 1 (as tests/test_triton_chunk_fwd.py's fp32 case)."""
    gen = torch.Generator().manual_seed(seed)
    B, T, H, K = inp.k.shape
    base = torch.randn(1, 1, 1, K, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(base + 0.2 * torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    inp.k = k.to(inp.q)
    inp.beta = (0.9 + 0.09 * torch.rand(*inp.beta.shape, generator=gen, dtype=torch.float64)).to(inp.q)
    return inp


def fla_output(fam, inp):
    kw = dict(initial_state=inp.h0, output_final_state=True)
    if fam == "gdn":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as f
        return f(inp.q, inp.k, inp.v, inp.g, inp.beta, **kw)[0]
    if fam == "kda":
        from fla.ops.kda import chunk_kda as f
        return f(inp.q, inp.k, inp.v, inp.g, inp.beta, **kw)[0]
    from fla.ops.delta_rule import chunk_delta_rule as f
    return f(inp.q, inp.k, inp.v, inp.beta, **kw)[0]


def ours(fam, inp, switch, value):
    os.environ[switch] = value
    try:
        return CHUNK_OPS[fam](*inp.args(), initial_state=inp.h0, output_final_state=True)[0]
    finally:
        del os.environ[switch]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fams", default="gdn,delta,kda")
    ap.add_argument("--switch", default="CHUNKWISE_SOLVE_BF16")
    ap.add_argument("--shapes", default="B2-T1000-H8,B1-T4096-H8")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--values", default="0,1", help="the switch's values, the first the reference for the ratios")
    a = ap.parse_args()
    worst = {}
    values = a.values.split(",")
    print(f"{'fam':6s} {'keys':10s} {'shape':12s} seed  {a.switch}=" + "  ".join(f"{v:9s}" for v in values) + "  fla")
    for fam in a.fams.split(","):
        for keys in ("random", "correlated"):
            for shape in a.shapes.split(","):
                B, T, H = (int(p[1:]) for p in shape.split("-"))
                for seed in range(a.seeds):
                    inp = make_inputs(fam, B=B, T=T, H=H, HV=H, K=128, V=128, dtype=torch.bfloat16, seed=100 + seed,
                                      device="cuda")
                    if keys == "correlated":
                        inp = correlated(inp, 200 + seed)
                    with torch.no_grad():
                        ref = reference(inp)[0]
                        errs = [rel_err(ours(fam, inp, a.switch, v), ref) for v in values]
                        e_f = rel_err(fla_output(fam, inp), ref)
                    print(f"{fam:6s} {keys:10s} {shape:12s} {seed:4d}  " + "  ".join(f"{e:.3e}" for e in errs)
                          + f"  {e_f:.3e}", flush=True)
                    w = worst.setdefault((fam, keys), [0.0] * len(values))
                    w[:] = [max(x, e / e_f) for x, e in zip(w, errs)]
    for (fam, keys), ratios in worst.items():
        print(f"worst / fla  {fam:6s} {keys:10s}  " + "  ".join(f"at {v}: {r:.3f}" for v, r in zip(values, ratios)))


if __name__ == "__main__":
    main()
