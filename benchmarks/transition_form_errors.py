"""Numerics of a serial stage in transition-matrix form, emulated on the CPU (no GPU, no Triton).

The chunk forward's serial stage (stage 2) carries the state S [K, V] across chunks; per chunk, for the delta rule
under T_FORM (chunk_fwd.py; D = diag(e^{G_last − G}), Td = (I + A)⁻¹ diag(β), Kg = K ⊙ e^G, γ = e^{G_last})::

    R = Td (V − Kg S)            S ← γ S + Kᵀ D R            (three dependent products a chunk)

The same update is S ← M S + B with M = γ I − Kᵀ D Td Kg [K, K] and B = Kᵀ D Td V [K, V], both formed by the
chunk-parallel stage 1, so that the serial chain is one [K, K] @ [K, BV] product a chunk (o still needs R, but off the
chain). The open question is precision: M is stored once and multiplies the state 512 times at T = 32768, so its
rounding compounds. This script measures the output's relative error against a float64 run of the same recurrence,
for the current form (operands rounded where the kernel rounds them: 16-bit q, k, v, S, R, Td, P) and the M form with
M (and B) kept in bf16, fp16, or fp32 used through tf32 products (operands truncated to 10 mantissa bits, as sm_90's
tensor cores take fp32).

    python benchmarks/transition_form_errors.py [--T 32768] [--heads 2] [--gate gdn|none] [--seed 0]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

C = 64


def bf16(x):
    return x.to(torch.bfloat16).to(x.dtype)


def fp16(x):
    return x.to(torch.float16).to(x.dtype)


def tf32(x):
    """fp32 operands as the tensor cores take them: the mantissa truncated to 10 bits."""
    return (x.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


def chunk_terms(q, k, v, g, beta):
    """Per chunk (float64): Q ⊙ e^G, Kg, K, Td, P, D, γ and the reference M, B (lists over chunks)."""
    T, K = k.shape
    out = []
    for c0 in range(0, T, C):
        Q, Kc, Vc, b = q[c0:c0 + C], k[c0:c0 + C], v[c0:c0 + C], beta[c0:c0 + C]
        G = torch.cumsum(g[c0:c0 + C], 0)
        dec = torch.exp(G[:, None] - G[None, :])
        A = torch.tril(b[:, None] * (Kc @ Kc.T) * dec, -1)
        Td = torch.linalg.inv(torch.eye(len(b), dtype=A.dtype) + A) * b[None, :]
        P = torch.tril((Q @ Kc.T) * dec)
        Kg = Kc * torch.exp(G)[:, None]
        D = torch.exp(G[-1] - G)
        gam = torch.exp(G[-1])
        M = gam * torch.eye(K, dtype=A.dtype) - Kc.T @ (D[:, None] * (Td @ Kg))
        B = Kc.T @ (D[:, None] * (Td @ Vc))
        out.append(dict(Qg=Q * torch.exp(G)[:, None], Kg=Kg, K=Kc, V=Vc, Td=Td, P=P, D=D, gam=gam, M=M, B=B))
    return out


def run(terms, form, scale):
    """The outputs [T, V] (float64) of the recurrence in ``form``: "ref" exact in float64; "now" the current
    kernel's roundings; "m-bf16" / "m-fp16" / "m-tf32" the transition form with M, B in that format."""
    f32 = form != "ref"
    dt = torch.float32 if f32 else torch.float64
    K, V = terms[0]["K"].shape[1], terms[0]["V"].shape[1]
    S = torch.zeros(K, V, dtype=dt)
    outs = []
    for t in terms:
        x = {n: (val.to(dt) if torch.is_tensor(val) else val) for n, val in t.items()}
        if form == "ref":
            R = x["Td"] @ (x["V"] - x["Kg"] @ S)
            outs.append(scale * (x["Qg"] @ S + x["P"] @ R))
            S = x["gam"] * S + x["K"].T @ (x["D"][:, None] * R)
            continue
        # the kernel's operands: 16-bit inputs, Td and P stored in bf16, S and R rounded to bf16 for the products
        Kg, Kb, Qg, Vb, Td, P = bf16(x["Kg"]), bf16(x["K"]), bf16(x["Qg"]), bf16(x["V"]), bf16(x["Td"]), bf16(x["P"])
        Sb = bf16(S)
        R = Td @ bf16(Vb - Kg @ Sb)
        outs.append(scale * (Qg @ Sb + P @ bf16(R)))
        if form == "now":
            S = x["gam"] * S + Kb.T @ bf16(x["D"][:, None] * R)
        else:
            store = {"m-bf16": bf16, "m-fp16": fp16, "m-tf32": tf32}[form]
            S = store(x["M"]) @ (Sb if form != "m-tf32" else tf32(S)) + store(x["B"])
    return torch.cat(outs).double()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--gate", default="gdn", choices=("gdn", "none"))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    K = V = 128
    forms = ("now", "m-bf16", "m-fp16", "m-tf32")
    errs = {f: [] for f in forms}
    for _ in range(a.heads):        # inputs as benchmarks/bench_forward.py draws them, rounded to bf16
        q = bf16(torch.randn(a.T, K)).double()
        k = bf16(F.normalize(torch.randn(a.T, K), dim=-1)).double()
        v = bf16(torch.randn(a.T, V)).double()
        beta = bf16(torch.rand(a.T) * 0.9 + 0.05).double()
        g = (F.logsigmoid(torch.randn(a.T)) * 0.1).double() if a.gate == "gdn" else torch.zeros(a.T, dtype=torch.float64)
        terms = chunk_terms(q, k, v, g, beta)
        ref = run(terms, "ref", K ** -0.5)
        for f in forms:
            o = run(terms, f, K ** -0.5)
            errs[f].append(((o - ref).norm() / ref.norm()).item())
    print(f"T = {a.T}, gate {a.gate}, {a.heads} heads: output error against float64 (relative, mean over heads)")
    for f in forms:
        print(f"  {f:8s} {sum(errs[f]) / len(errs[f]):.3e}")


if __name__ == "__main__":
    main()
