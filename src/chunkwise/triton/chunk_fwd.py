"""Triton chunked forward (prefill / training forward) of the four families (DESIGN.md §2).

Two kernels, each with its launcher:

1. ``chunk_prepare_kernel`` (delta families only), grid (chunks, B·HV), fully parallel. Per chunk of
   C = 64 tokens, on four 16-token sub-blocks held in registers::

       G   = cumsum(max(g, G_FLOOR))                    fp32, chunk-local, per channel for KDA
       A   = strict_tril(β_i ⟨k_i, Γ_ij ⊙ k_j⟩)           [C, C] as 4×4 blocks of 16×16
       T   = (I + A)⁻¹                                  16×16 forward substitution on the diagonal
                                                        blocks, then block merging (no 64-row loop)
       W   = T (β ⊙ e^G ⊙ K)     U = T (β ⊙ V)
       P   = tril(⟨q_i, Γ_ij ⊙ k_j⟩)                     diagonal included

   It writes w [B,T,HV,K], u [B,T,HV,V] (input dtype), P [B,T,HV,C] (input dtype) and, for KDA's
   per-channel gate only, q ⊙ e^G and k ⊙ e^{G_last − G} [B,T,HV,K] (input dtype) plus
   e^{G_last} [slots, HV, K] fp32.

2. ``chunk_state_output_kernel``, grid (V / BV, N·HV), serial over the chunks of one sequence. It
   carries S [K, BV] fp32 in registers::

       R = U − W S              (delta)        R = V        (simple GLA)
       O = scale · ((Q ⊙ e^G) S + P R)
       S ← diag(e^{G_last}) S + (K ⊙ e^{G_last − G})ᵀ R

   and writes only o (and the final state): no per-chunk state tensor ever reaches memory.
   For scalar / no gates it can form P itself (``P_IN=False``), which simple GLA always does:
   simple GLA launches this kernel alone.

Numerics. Every exponential is of a non-positive number: e^{G_i − G_j} with i ≥ j, or of a factor
around a reference point. KDA's per-channel pairwise products factor around the last token r of
each 16-token column block, e^{G_i − G_j} = e^{G_i − G_r} · e^{G_r − G_j}, both ≤ 1; the diagonal
16×16 blocks use the block start s as reference (e^{G_i − s} · e^{s − G_j}) when the gates inside
the block sum above −SPAN_MAX (no under/overflow), else an exact pair-by-pair loop.
Gates are clamped per token at G_FLOOR = −40 (NaN passes through): e^{−40} ≈ 4e-18 is 11 orders
under fp32's resolution, so the recurrence cannot tell the clamp from the true gate, while a hard
reset g = −1e4 would otherwise make the fp32 cumulative sums after it lose ~3 digits when
differenced (measured on the torch model of this kernel: output error 6e-5 unclamped, 9e-7 clamped,
"strong" gates of tests/helpers.make_inputs).

The backward may import ``chunk_prepare`` (recompute w, u, P) and the kernels themselves.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BT = 64          # chunk length
BC = 16          # sub-block of the triangular solve and of the per-channel factorisation
G_FLOOR = -40.0  # per-token gate clamp (see the module docstring)
SPAN_MAX = 80.0  # a 16-token block whose per-channel gates sum below -SPAN_MAX takes the exact path
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _poison() -> bool:
    """CHUNKWISE_POISON=1 (tests) pre-fills every tensor the launchers allocate with NaN."""
    return os.environ.get("CHUNKWISE_POISON") == "1"


def _alloc(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device) if _poison() else \
        torch.empty(shape, dtype=dtype, device=device)


def _dim(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


# ------------------------------------------------------------------------------------------------
# small helpers (inlined by triton)
# ------------------------------------------------------------------------------------------------

@triton.jit
def _sub(x, b: tl.constexpr, BCc: tl.constexpr, BTc: tl.constexpr):
    """x [BT] -> x[b·BC : (b+1)·BC] as [BC] (exact: a masked sum of one term)."""
    o_t = tl.arange(0, BTc)
    o_c = tl.arange(0, BCc)
    return tl.sum(tl.where(o_t[None, :] == (b * BCc + o_c)[:, None], x[None, :], 0.), 1)


@triton.jit
def _last_row(x, BCc: tl.constexpr):
    """x [BC, D] -> its last row [D] (exact)."""
    o_c = tl.arange(0, BCc)
    return tl.sum(tl.where((o_c == BCc - 1)[:, None], x, 0.), 0)


@triton.jit
def _scalar_pair(a, b, G_i, G_j, beta_i, GATE: tl.constexpr, MASK: tl.constexpr, BETA: tl.constexpr,
                 DOT_PREC: tl.constexpr, BCc: tl.constexpr):
    """M_ij = [β_i] ⟨a_i, b_j⟩ e^{G_i − G_j} on one 16×16 block (scalar or no gate).

    a, b: [BC, BK] input dtype; G_i, G_j, beta_i: [BC] fp32. MASK 0: full block (rows after
    columns), 1: strictly lower, 2: lower with diagonal. Returns [BC, BC] fp32.
    """
    m = tl.dot(a, tl.trans(b), input_precision=DOT_PREC)          # [BC, BK] @ [BK, BC]
    o_c = tl.arange(0, BCc)
    if MASK == 0:
        keep = o_c[:, None] >= 0
    elif MASK == 1:
        keep = o_c[:, None] > o_c[None, :]
    else:
        keep = o_c[:, None] >= o_c[None, :]
    if GATE == 1:
        m = m * tl.exp(tl.where(keep, G_i[:, None] - G_j[None, :], float("-inf")))
    else:
        m = tl.where(keep, m, 0.)
    if BETA:
        m = m * beta_i[:, None]
    return m


@triton.jit
def _channel_diag(bk, qf, kf, G, s, x, span_max: tl.constexpr, DOT_PREC: tl.constexpr, BCc: tl.constexpr):
    """Diagonal 16×16 blocks of A (strict) and P (with diagonal) under a per-channel gate.

    bk = β ⊙ k, qf, kf: [BC, BK] fp32; G: [BC, BK] fp32 cumulative gate; s: [BK] the cumulative gate
    before the block; x = e^{G − s} [BC, BK]. Returns (A_bb, P_bb) [BC, BC] fp32.

    Fast path (the gates in the block sum above −span_max, so e^{s − G} ≤ e^{span_max} stays finite):
    e^{G_i − G_j} = e^{G_i − s} · e^{s − G_j}, two products on the tensor cores. Otherwise each column
    j is formed exactly from e^{G_i − G_j}, i ≥ j.
    """
    o_c = tl.arange(0, BCc)
    strict = o_c[:, None] > o_c[None, :]
    incl = o_c[:, None] >= o_c[None, :]
    worst = tl.min(tl.min(G - s[None, :], 1), 0)
    if worst > -span_max:
        kinv = kf * tl.exp(s[None, :] - G)
        A = tl.dot(bk * x, tl.trans(kinv), input_precision=DOT_PREC)     # [BC, BK] @ [BK, BC]
        P = tl.dot(qf * x, tl.trans(kinv), input_precision=DOT_PREC)     # [BC, BK] @ [BK, BC]
        A = tl.where(strict, A, 0.)
        P = tl.where(incl, P, 0.)
    else:
        A = tl.zeros([BCc, BCc], dtype=tl.float32)
        P = tl.zeros([BCc, BCc], dtype=tl.float32)
        for j in range(BCc):        # a loop, not unrolled: this path is rare
            sel = tl.where(o_c[None, :] == j, 1., 0.) + tl.zeros([BCc, BCc], dtype=tl.float32)  # every row e_jᵀ
            k_j = tl.dot(sel, kf, input_precision="ieee")                # [BC, BC] @ [BC, BK]: rows = k_j (exact)
            G_j = tl.dot(sel, G, input_precision="ieee")                 # [BC, BC] @ [BC, BK]: rows = G_j (exact)
            e = tl.exp(tl.where((o_c >= j)[:, None], G - G_j, float("-inf")))              # e^{G_i − G_j}, i ≥ j
            a_col = tl.dot(bk * e, tl.trans(k_j), input_precision=DOT_PREC)   # [BC, BK] @ [BK, BC]: columns equal
            p_col = tl.dot(qf * e, tl.trans(k_j), input_precision=DOT_PREC)   # [BC, BK] @ [BK, BC]
            A = tl.where((o_c == j)[None, :] & strict, a_col, A)
            P = tl.where((o_c == j)[None, :] & incl, p_col, P)
    return A, P


@triton.jit
def _inv_unit_lower4(A0, A1, A2, A3, BCc: tl.constexpr):
    """(I + A_b)⁻¹ for four A_b [BC, BC] fp32 strictly lower: BC − 1 steps of X ← I − A X from X = I.

    This is forward substitution done on all rows at once: after step n rows 0..n hold their final
    values, each formed as e_i − Σ_{m<i} A_im X_m from final rows, so it rounds like substitution
    (no powers of A are formed). The four independent chains share one loop. Returns 4 × [BC, BC] fp32.
    """
    o_c = tl.arange(0, BCc)
    eye = tl.where(o_c[:, None] == o_c[None, :], 1., 0.)
    X0, X1, X2, X3 = eye, eye, eye, eye
    for _ in range(BCc - 1):
        X0 = eye - tl.dot(A0, X0, input_precision="ieee")                 # [BC, BC] @ [BC, BC]
        X1 = eye - tl.dot(A1, X1, input_precision="ieee")                 # [BC, BC] @ [BC, BC]
        X2 = eye - tl.dot(A2, X2, input_precision="ieee")                 # [BC, BC] @ [BC, BC]
        X3 = eye - tl.dot(A3, X3, input_precision="ieee")                 # [BC, BC] @ [BC, BC]
    return X0, X1, X2, X3


@triton.jit(do_not_specialize=["T", "NT", "H", "HV"])
def chunk_prepare_kernel(
    q, k, v, g, beta,            # [B,T,H,K] [B,T,H,K] [B,T,HV,V] None|[B,T,HV]|[B,T,HV,K] fp32, [B,T,HV]
    w, u, p,                     # out: [B,T,HV,K] [B,T,HV,V] [B,T,HV,BT] (input dtype)
    qg, kg, glast,               # out (GATE == 2): [B,T,HV,K] [B,T,HV,K] input dtype, [slots,HV,K] fp32
    cu_seqlens, chunk_indices,   # varlen: [N+1], [NT_total, 2] (sequence, chunk in sequence)
    T, NT,
    H, HV, K, V,
    BTc: tl.constexpr, BCc: tl.constexpr, BK: tl.constexpr, BVf: tl.constexpr,
    GATE: tl.constexpr,          # 0 none, 1 scalar, 2 per channel
    IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, MM_PREC: tl.constexpr,
    g_floor: tl.constexpr, span_max: tl.constexpr,
):
    """One chunk of one value head: see the module docstring (stage 1). Grid (chunks, B·HV)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // HV, i_bh % HV
    i_hk = i_h // (HV // H)
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
        i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        slot = i_n + (bos + i_c * BTc) // BTc
    else:
        i_c = i_t.to(tl.int64)
        bos = i_b.to(tl.int64) * T
        eos = bos + T
        slot = i_b.to(tl.int64) * NT + i_c
    T_seq = (eos - bos).to(tl.int32)
    t0 = (i_c * BTc).to(tl.int32)

    q_base = q + (bos * H + i_hk) * K
    k_base = k + (bos * H + i_hk) * K
    v_base = v + (bos * HV + i_h) * V
    w_base = w + (bos * HV + i_h) * K
    u_base = u + (bos * HV + i_h) * V
    p_base = p + (bos * HV + i_h) * BTc
    o_c = tl.arange(0, BCc)
    o_t = tl.arange(0, BTc)

    # ---- inputs, in four 16-row blocks
    k0 = tl.load(tl.make_block_ptr(k_base, (T_seq, K), (H * K, 1), (t0, 0), (BCc, BK), (1, 0)), boundary_check=(0, 1))
    k1 = tl.load(tl.make_block_ptr(k_base, (T_seq, K), (H * K, 1), (t0 + BCc, 0), (BCc, BK), (1, 0)), boundary_check=(0, 1))
    k2 = tl.load(tl.make_block_ptr(k_base, (T_seq, K), (H * K, 1), (t0 + 2 * BCc, 0), (BCc, BK), (1, 0)), boundary_check=(0, 1))
    k3 = tl.load(tl.make_block_ptr(k_base, (T_seq, K), (H * K, 1), (t0 + 3 * BCc, 0), (BCc, BK), (1, 0)), boundary_check=(0, 1))
    q0 = tl.load(tl.make_block_ptr(q_base, (T_seq, K), (H * K, 1), (t0, 0), (BCc, BK), (1, 0)), boundary_check=(0, 1))
    q1 = tl.load(tl.make_block_ptr(q_base, (T_seq, K), (H * K, 1), (t0 + BCc, 0), (BCc, BK), (1, 0)), boundary_check=(0, 1))
    q2 = tl.load(tl.make_block_ptr(q_base, (T_seq, K), (H * K, 1), (t0 + 2 * BCc, 0), (BCc, BK), (1, 0)), boundary_check=(0, 1))
    q3 = tl.load(tl.make_block_ptr(q_base, (T_seq, K), (H * K, 1), (t0 + 3 * BCc, 0), (BCc, BK), (1, 0)), boundary_check=(0, 1))
    p_beta = beta + bos * HV + i_h
    be0 = tl.load(p_beta + (t0 + o_c) * HV, mask=t0 + o_c < T_seq, other=0.).to(tl.float32)
    be1 = tl.load(p_beta + (t0 + BCc + o_c) * HV, mask=t0 + BCc + o_c < T_seq, other=0.).to(tl.float32)
    be2 = tl.load(p_beta + (t0 + 2 * BCc + o_c) * HV, mask=t0 + 2 * BCc + o_c < T_seq, other=0.).to(tl.float32)
    be3 = tl.load(p_beta + (t0 + 3 * BCc + o_c) * HV, mask=t0 + 3 * BCc + o_c < T_seq, other=0.).to(tl.float32)

    if GATE == 2:
        # ---- per-channel gate: cumulative sums per block, factors around block ends
        g_base = g + (bos * HV + i_h) * K
        gb = tl.load(tl.make_block_ptr(g_base, (T_seq, K), (HV * K, 1), (t0, 0), (BCc, BK), (1, 0)), boundary_check=(0, 1)).to(tl.float32)
        G0 = tl.cumsum(tl.where(gb < g_floor, g_floor, gb), 0)
        e0 = _last_row(G0, BCc)
        gb = tl.load(tl.make_block_ptr(g_base, (T_seq, K), (HV * K, 1), (t0 + BCc, 0), (BCc, BK), (1, 0)), boundary_check=(0, 1)).to(tl.float32)
        G1 = tl.cumsum(tl.where(gb < g_floor, g_floor, gb), 0) + e0[None, :]
        e1 = _last_row(G1, BCc)
        gb = tl.load(tl.make_block_ptr(g_base, (T_seq, K), (HV * K, 1), (t0 + 2 * BCc, 0), (BCc, BK), (1, 0)), boundary_check=(0, 1)).to(tl.float32)
        G2 = tl.cumsum(tl.where(gb < g_floor, g_floor, gb), 0) + e1[None, :]
        e2 = _last_row(G2, BCc)
        gb = tl.load(tl.make_block_ptr(g_base, (T_seq, K), (HV * K, 1), (t0 + 3 * BCc, 0), (BCc, BK), (1, 0)), boundary_check=(0, 1)).to(tl.float32)
        G3 = tl.cumsum(tl.where(gb < g_floor, g_floor, gb), 0) + e2[None, :]
        e3 = _last_row(G3, BCc)
        zero = tl.zeros([BK], dtype=tl.float32)
        x0 = tl.exp(G0)                      # e^{G − s_b} ≤ 1, s_b = cumulative gate before block b
        x1 = tl.exp(G1 - e0[None, :])
        x2 = tl.exp(G2 - e1[None, :])
        x3 = tl.exp(G3 - e2[None, :])
        k0f, k1f, k2f, k3f = k0.to(tl.float32), k1.to(tl.float32), k2.to(tl.float32), k3.to(tl.float32)
        q0f, q1f, q2f, q3f = q0.to(tl.float32), q1.to(tl.float32), q2.to(tl.float32), q3.to(tl.float32)
        ky0 = k0f * tl.exp(e0[None, :] - G0)    # column factors e^{G_r − G_j} ≤ 1, r = block end
        ky1 = k1f * tl.exp(e1[None, :] - G1)
        ky2 = k2f * tl.exp(e2[None, :] - G2)
        bk0, bk1, bk2, bk3 = k0f * be0[:, None], k1f * be1[:, None], k2f * be2[:, None], k3f * be3[:, None]
        # off-diagonal blocks (row block b > column block c): rows scaled by e^{G_i − e_c} = x_b e^{s_b − e_c}
        r10 = x1
        r20 = x2 * tl.exp(e1 - e0)[None, :]
        r21 = x2
        r30 = x3 * tl.exp(e2 - e0)[None, :]
        r31 = x3 * tl.exp(e2 - e1)[None, :]
        r32 = x3
        A10 = tl.dot(bk1 * r10, tl.trans(ky0), input_precision=MM_PREC)      # [BC, BK] @ [BK, BC]
        A20 = tl.dot(bk2 * r20, tl.trans(ky0), input_precision=MM_PREC)      # [BC, BK] @ [BK, BC]
        A21 = tl.dot(bk2 * r21, tl.trans(ky1), input_precision=MM_PREC)      # [BC, BK] @ [BK, BC]
        A30 = tl.dot(bk3 * r30, tl.trans(ky0), input_precision=MM_PREC)      # [BC, BK] @ [BK, BC]
        A31 = tl.dot(bk3 * r31, tl.trans(ky1), input_precision=MM_PREC)      # [BC, BK] @ [BK, BC]
        A32 = tl.dot(bk3 * r32, tl.trans(ky2), input_precision=MM_PREC)      # [BC, BK] @ [BK, BC]
        P10 = tl.dot(q1f * r10, tl.trans(ky0), input_precision=MM_PREC)      # [BC, BK] @ [BK, BC]
        P20 = tl.dot(q2f * r20, tl.trans(ky0), input_precision=MM_PREC)      # [BC, BK] @ [BK, BC]
        P21 = tl.dot(q2f * r21, tl.trans(ky1), input_precision=MM_PREC)      # [BC, BK] @ [BK, BC]
        P30 = tl.dot(q3f * r30, tl.trans(ky0), input_precision=MM_PREC)      # [BC, BK] @ [BK, BC]
        P31 = tl.dot(q3f * r31, tl.trans(ky1), input_precision=MM_PREC)      # [BC, BK] @ [BK, BC]
        P32 = tl.dot(q3f * r32, tl.trans(ky2), input_precision=MM_PREC)      # [BC, BK] @ [BK, BC]
        A00, P00 = _channel_diag(bk0, q0f, k0f, G0, zero, x0, span_max, MM_PREC, BCc)
        A11, P11 = _channel_diag(bk1, q1f, k1f, G1, e0, x1, span_max, MM_PREC, BCc)
        A22, P22 = _channel_diag(bk2, q2f, k2f, G2, e1, x2, span_max, MM_PREC, BCc)
        A33, P33 = _channel_diag(bk3, q3f, k3f, G3, e2, x3, span_max, MM_PREC, BCc)
        # W's right-hand side β e^G k, e^G = x_b e^{s_b}; and q e^G, k e^{G_last − G} for stage 2
        eg0 = x0
        eg1 = x1 * tl.exp(e0)[None, :]
        eg2 = x2 * tl.exp(e1)[None, :]
        eg3 = x3 * tl.exp(e2)[None, :]
        xk0, xk1, xk2, xk3 = bk0 * eg0, bk1 * eg1, bk2 * eg2, bk3 * eg3
        qg_base = qg + (bos * HV + i_h) * K
        kg_base = kg + (bos * HV + i_h) * K
        tl.store(tl.make_block_ptr(qg_base, (T_seq, K), (HV * K, 1), (t0, 0), (BCc, BK), (1, 0)), (q0f * eg0).to(qg_base.dtype.element_ty), boundary_check=(0, 1))
        tl.store(tl.make_block_ptr(qg_base, (T_seq, K), (HV * K, 1), (t0 + BCc, 0), (BCc, BK), (1, 0)), (q1f * eg1).to(qg_base.dtype.element_ty), boundary_check=(0, 1))
        tl.store(tl.make_block_ptr(qg_base, (T_seq, K), (HV * K, 1), (t0 + 2 * BCc, 0), (BCc, BK), (1, 0)), (q2f * eg2).to(qg_base.dtype.element_ty), boundary_check=(0, 1))
        tl.store(tl.make_block_ptr(qg_base, (T_seq, K), (HV * K, 1), (t0 + 3 * BCc, 0), (BCc, BK), (1, 0)), (q3f * eg3).to(qg_base.dtype.element_ty), boundary_check=(0, 1))
        tl.store(tl.make_block_ptr(kg_base, (T_seq, K), (HV * K, 1), (t0, 0), (BCc, BK), (1, 0)), (ky0 * tl.exp(e3 - e0)[None, :]).to(kg_base.dtype.element_ty), boundary_check=(0, 1))
        tl.store(tl.make_block_ptr(kg_base, (T_seq, K), (HV * K, 1), (t0 + BCc, 0), (BCc, BK), (1, 0)), (ky1 * tl.exp(e3 - e1)[None, :]).to(kg_base.dtype.element_ty), boundary_check=(0, 1))
        tl.store(tl.make_block_ptr(kg_base, (T_seq, K), (HV * K, 1), (t0 + 2 * BCc, 0), (BCc, BK), (1, 0)), (ky2 * tl.exp(e3 - e2)[None, :]).to(kg_base.dtype.element_ty), boundary_check=(0, 1))
        tl.store(tl.make_block_ptr(kg_base, (T_seq, K), (HV * K, 1), (t0 + 3 * BCc, 0), (BCc, BK), (1, 0)), (k3f * tl.exp(e3[None, :] - G3)).to(kg_base.dtype.element_ty), boundary_check=(0, 1))
        o_k = tl.arange(0, BK)
        tl.store(glast + (slot * HV + i_h) * K + o_k, tl.exp(e3), mask=o_k < K)
    else:
        # ---- scalar gate or none: one cumulative sum over the chunk, decays applied after the dot
        if GATE == 1:
            gv = tl.load(g + bos * HV + i_h + (t0 + o_t) * HV, mask=t0 + o_t < T_seq, other=0.).to(tl.float32)
            Gc = tl.cumsum(tl.where(gv < g_floor, g_floor, gv), 0)            # [BT]
            G0, G1, G2, G3 = _sub(Gc, 0, BCc, BTc), _sub(Gc, 1, BCc, BTc), _sub(Gc, 2, BCc, BTc), _sub(Gc, 3, BCc, BTc)
        else:
            G0 = tl.zeros([BCc], dtype=tl.float32)
            G1, G2, G3 = G0, G0, G0
        A00 = _scalar_pair(k0, k0, G0, G0, be0, GATE, 1, True, DOT_PREC, BCc)
        A10 = _scalar_pair(k1, k0, G1, G0, be1, GATE, 0, True, DOT_PREC, BCc)
        A11 = _scalar_pair(k1, k1, G1, G1, be1, GATE, 1, True, DOT_PREC, BCc)
        A20 = _scalar_pair(k2, k0, G2, G0, be2, GATE, 0, True, DOT_PREC, BCc)
        A21 = _scalar_pair(k2, k1, G2, G1, be2, GATE, 0, True, DOT_PREC, BCc)
        A22 = _scalar_pair(k2, k2, G2, G2, be2, GATE, 1, True, DOT_PREC, BCc)
        A30 = _scalar_pair(k3, k0, G3, G0, be3, GATE, 0, True, DOT_PREC, BCc)
        A31 = _scalar_pair(k3, k1, G3, G1, be3, GATE, 0, True, DOT_PREC, BCc)
        A32 = _scalar_pair(k3, k2, G3, G2, be3, GATE, 0, True, DOT_PREC, BCc)
        A33 = _scalar_pair(k3, k3, G3, G3, be3, GATE, 1, True, DOT_PREC, BCc)
        P00 = _scalar_pair(q0, k0, G0, G0, be0, GATE, 2, False, DOT_PREC, BCc)
        P10 = _scalar_pair(q1, k0, G1, G0, be1, GATE, 0, False, DOT_PREC, BCc)
        P11 = _scalar_pair(q1, k1, G1, G1, be1, GATE, 2, False, DOT_PREC, BCc)
        P20 = _scalar_pair(q2, k0, G2, G0, be2, GATE, 0, False, DOT_PREC, BCc)
        P21 = _scalar_pair(q2, k1, G2, G1, be2, GATE, 0, False, DOT_PREC, BCc)
        P22 = _scalar_pair(q2, k2, G2, G2, be2, GATE, 2, False, DOT_PREC, BCc)
        P30 = _scalar_pair(q3, k0, G3, G0, be3, GATE, 0, False, DOT_PREC, BCc)
        P31 = _scalar_pair(q3, k1, G3, G1, be3, GATE, 0, False, DOT_PREC, BCc)
        P32 = _scalar_pair(q3, k2, G3, G2, be3, GATE, 0, False, DOT_PREC, BCc)
        P33 = _scalar_pair(q3, k3, G3, G3, be3, GATE, 2, False, DOT_PREC, BCc)
        if GATE == 1:
            xk0 = k0.to(tl.float32) * (be0 * tl.exp(G0))[:, None]
            xk1 = k1.to(tl.float32) * (be1 * tl.exp(G1))[:, None]
            xk2 = k2.to(tl.float32) * (be2 * tl.exp(G2))[:, None]
            xk3 = k3.to(tl.float32) * (be3 * tl.exp(G3))[:, None]
        else:
            xk0 = k0.to(tl.float32) * be0[:, None]
            xk1 = k1.to(tl.float32) * be1[:, None]
            xk2 = k2.to(tl.float32) * be2[:, None]
            xk3 = k3.to(tl.float32) * be3[:, None]

    # ---- P: lower blocks, zeros above the diagonal
    zb = tl.zeros([BCc, BCc], dtype=tl.float32)
    tl.store(tl.make_block_ptr(p_base, (T_seq, BTc), (HV * BTc, 1), (t0, 0), (BCc, BCc), (1, 0)), (P00).to(p_base.dtype.element_ty), boundary_check=(0, 1))
    tl.store(tl.make_block_ptr(p_base, (T_seq, BTc), (HV * BTc, 1), (t0, BCc), (BCc, BCc), (1, 0)), (zb).to(p_base.dtype.element_ty), boundary_check=(0, 1))
    tl.store(tl.make_block_ptr(p_base, (T_seq, BTc), (HV * BTc, 1), (t0, 2 * BCc), (BCc, BCc), (1, 0)), (zb).to(p_base.dtype.element_ty), boundary_check=(0, 1))
    tl.store(tl.make_block_ptr(p_base, (T_seq, BTc), (HV * BTc, 1), (t0, 3 * BCc), (BCc, BCc), (1, 0)), (zb).to(p_base.dtype.element_ty), boundary_check=(0, 1))
    tl.store(tl.make_block_ptr(p_base, (T_seq, BTc), (HV * BTc, 1), (t0 + BCc, 0), (BCc, BCc), (1, 0)), (P10).to(p_base.dtype.element_ty), boundary_check=(0, 1))
    tl.store(tl.make_block_ptr(p_base, (T_seq, BTc), (HV * BTc, 1), (t0 + BCc, BCc), (BCc, BCc), (1, 0)), (P11).to(p_base.dtype.element_ty), boundary_check=(0, 1))
    tl.store(tl.make_block_ptr(p_base, (T_seq, BTc), (HV * BTc, 1), (t0 + BCc, 2 * BCc), (BCc, BCc), (1, 0)), (zb).to(p_base.dtype.element_ty), boundary_check=(0, 1))
    tl.store(tl.make_block_ptr(p_base, (T_seq, BTc), (HV * BTc, 1), (t0 + BCc, 3 * BCc), (BCc, BCc), (1, 0)), (zb).to(p_base.dtype.element_ty), boundary_check=(0, 1))
    tl.store(tl.make_block_ptr(p_base, (T_seq, BTc), (HV * BTc, 1), (t0 + 2 * BCc, 0), (BCc, BCc), (1, 0)), (P20).to(p_base.dtype.element_ty), boundary_check=(0, 1))
    tl.store(tl.make_block_ptr(p_base, (T_seq, BTc), (HV * BTc, 1), (t0 + 2 * BCc, BCc), (BCc, BCc), (1, 0)), (P21).to(p_base.dtype.element_ty), boundary_check=(0, 1))
    tl.store(tl.make_block_ptr(p_base, (T_seq, BTc), (HV * BTc, 1), (t0 + 2 * BCc, 2 * BCc), (BCc, BCc), (1, 0)), (P22).to(p_base.dtype.element_ty), boundary_check=(0, 1))
    tl.store(tl.make_block_ptr(p_base, (T_seq, BTc), (HV * BTc, 1), (t0 + 2 * BCc, 3 * BCc), (BCc, BCc), (1, 0)), (zb).to(p_base.dtype.element_ty), boundary_check=(0, 1))
    tl.store(tl.make_block_ptr(p_base, (T_seq, BTc), (HV * BTc, 1), (t0 + 3 * BCc, 0), (BCc, BCc), (1, 0)), (P30).to(p_base.dtype.element_ty), boundary_check=(0, 1))
    tl.store(tl.make_block_ptr(p_base, (T_seq, BTc), (HV * BTc, 1), (t0 + 3 * BCc, BCc), (BCc, BCc), (1, 0)), (P31).to(p_base.dtype.element_ty), boundary_check=(0, 1))
    tl.store(tl.make_block_ptr(p_base, (T_seq, BTc), (HV * BTc, 1), (t0 + 3 * BCc, 2 * BCc), (BCc, BCc), (1, 0)), (P32).to(p_base.dtype.element_ty), boundary_check=(0, 1))
    tl.store(tl.make_block_ptr(p_base, (T_seq, BTc), (HV * BTc, 1), (t0 + 3 * BCc, 3 * BCc), (BCc, BCc), (1, 0)), (P33).to(p_base.dtype.element_ty), boundary_check=(0, 1))

    # ---- T = (I + A)^-1: diagonal blocks by substitution, then T_ij = -T_ii Σ_{j≤m<i} A_im T_mj
    T00, T11, T22, T33 = _inv_unit_lower4(A00, A11, A22, A33, BCc)
    T10 = -tl.dot(T11, tl.dot(A10, T00, input_precision="ieee"), input_precision="ieee")                                     # [BC, BC] @ [BC, BC]
    T21 = -tl.dot(T22, tl.dot(A21, T11, input_precision="ieee"), input_precision="ieee")                                     # [BC, BC] @ [BC, BC]
    T32 = -tl.dot(T33, tl.dot(A32, T22, input_precision="ieee"), input_precision="ieee")                                     # [BC, BC] @ [BC, BC]
    T20 = -tl.dot(T22, tl.dot(A20, T00, input_precision="ieee") + tl.dot(A21, T10, input_precision="ieee"), input_precision="ieee")             # [BC, BC] @ [BC, BC]
    T31 = -tl.dot(T33, tl.dot(A31, T11, input_precision="ieee") + tl.dot(A32, T21, input_precision="ieee"), input_precision="ieee")             # [BC, BC] @ [BC, BC]
    T30 = -tl.dot(T33, tl.dot(A30, T00, input_precision="ieee") + tl.dot(A31, T10, input_precision="ieee") + tl.dot(A32, T20, input_precision="ieee"), input_precision="ieee")

    # ---- W = T (β e^G K): rows of block b = Σ_{c ≤ b} T_bc X_c
    tl.store(tl.make_block_ptr(w_base, (T_seq, K), (HV * K, 1), (t0, 0), (BCc, BK), (1, 0)), (tl.dot(T00, xk0, input_precision=MM_PREC)).to(w_base.dtype.element_ty), boundary_check=(0, 1))          # [BC, BC] @ [BC, BK]
    tl.store(tl.make_block_ptr(w_base, (T_seq, K), (HV * K, 1), (t0 + BCc, 0), (BCc, BK), (1, 0)), (tl.dot(T10, xk0, input_precision=MM_PREC) + tl.dot(T11, xk1, input_precision=MM_PREC)).to(w_base.dtype.element_ty), boundary_check=(0, 1))
    tl.store(tl.make_block_ptr(w_base, (T_seq, K), (HV * K, 1), (t0 + 2 * BCc, 0), (BCc, BK), (1, 0)), (tl.dot(T20, xk0, input_precision=MM_PREC) + tl.dot(T21, xk1, input_precision=MM_PREC) + tl.dot(T22, xk2, input_precision=MM_PREC)).to(w_base.dtype.element_ty), boundary_check=(0, 1))
    tl.store(tl.make_block_ptr(w_base, (T_seq, K), (HV * K, 1), (t0 + 3 * BCc, 0), (BCc, BK), (1, 0)), (tl.dot(T30, xk0, input_precision=MM_PREC) + tl.dot(T31, xk1, input_precision=MM_PREC) + tl.dot(T32, xk2, input_precision=MM_PREC) + tl.dot(T33, xk3, input_precision=MM_PREC)).to(w_base.dtype.element_ty), boundary_check=(0, 1))
    # ---- U = T (β V)
    xv0 = tl.load(tl.make_block_ptr(v_base, (T_seq, V), (HV * V, 1), (t0, 0), (BCc, BVf), (1, 0)), boundary_check=(0, 1)).to(tl.float32) * be0[:, None]
    xv1 = tl.load(tl.make_block_ptr(v_base, (T_seq, V), (HV * V, 1), (t0 + BCc, 0), (BCc, BVf), (1, 0)), boundary_check=(0, 1)).to(tl.float32) * be1[:, None]
    xv2 = tl.load(tl.make_block_ptr(v_base, (T_seq, V), (HV * V, 1), (t0 + 2 * BCc, 0), (BCc, BVf), (1, 0)), boundary_check=(0, 1)).to(tl.float32) * be2[:, None]
    xv3 = tl.load(tl.make_block_ptr(v_base, (T_seq, V), (HV * V, 1), (t0 + 3 * BCc, 0), (BCc, BVf), (1, 0)), boundary_check=(0, 1)).to(tl.float32) * be3[:, None]
    tl.store(tl.make_block_ptr(u_base, (T_seq, V), (HV * V, 1), (t0, 0), (BCc, BVf), (1, 0)), (tl.dot(T00, xv0, input_precision=MM_PREC)).to(u_base.dtype.element_ty), boundary_check=(0, 1))          # [BC, BC] @ [BC, BV]
    tl.store(tl.make_block_ptr(u_base, (T_seq, V), (HV * V, 1), (t0 + BCc, 0), (BCc, BVf), (1, 0)), (tl.dot(T10, xv0, input_precision=MM_PREC) + tl.dot(T11, xv1, input_precision=MM_PREC)).to(u_base.dtype.element_ty), boundary_check=(0, 1))
    tl.store(tl.make_block_ptr(u_base, (T_seq, V), (HV * V, 1), (t0 + 2 * BCc, 0), (BCc, BVf), (1, 0)), (tl.dot(T20, xv0, input_precision=MM_PREC) + tl.dot(T21, xv1, input_precision=MM_PREC) + tl.dot(T22, xv2, input_precision=MM_PREC)).to(u_base.dtype.element_ty), boundary_check=(0, 1))
    tl.store(tl.make_block_ptr(u_base, (T_seq, V), (HV * V, 1), (t0 + 3 * BCc, 0), (BCc, BVf), (1, 0)), (tl.dot(T30, xv0, input_precision=MM_PREC) + tl.dot(T31, xv1, input_precision=MM_PREC) + tl.dot(T32, xv2, input_precision=MM_PREC) + tl.dot(T33, xv3, input_precision=MM_PREC)).to(u_base.dtype.element_ty), boundary_check=(0, 1))


# ------------------------------------------------------------------------------------------------
# 2. state + output: serial over the chunks of one sequence
# ------------------------------------------------------------------------------------------------

@triton.jit
def _state_output_step(i_t, S, q, k, v, w, u, p, g, qg, kg, glast, o_base, bos, T_seq, slot0, i_h, i_hk, i_v, scale,
                       H, HV, K, V,
                       BTc: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       GATE: tl.constexpr, DELTA: tl.constexpr, P_IN: tl.constexpr,
                       DOT_PREC: tl.constexpr, g_floor: tl.constexpr):
    """One chunk of stage 2: returns the state after chunk i_t, writes its rows of o."""
    o_k = tl.arange(0, BK)
    o_t = tl.arange(0, BTc)
    t0 = i_t * BTc
    if DELTA:
        b_w = tl.load(tl.make_block_ptr(w + (bos * HV + i_h) * K, (T_seq, K), (HV * K, 1), (t0, 0), (BTc, BK), (1, 0)), boundary_check=(0, 1))
        b_u = tl.load(tl.make_block_ptr(u + (bos * HV + i_h) * V, (T_seq, V), (HV * V, 1), (t0, i_v * BV), (BTc, BV), (1, 0)), boundary_check=(0, 1))
        b_R = b_u.to(tl.float32) - tl.dot(b_w, S.to(b_w.dtype), input_precision=DOT_PREC)   # [BT, BK] @ [BK, BV]
    else:
        b_R = tl.load(tl.make_block_ptr(v + (bos * HV + i_h) * V, (T_seq, V), (HV * V, 1), (t0, i_v * BV), (BTc, BV), (1, 0)), boundary_check=(0, 1)).to(tl.float32)
    if GATE == 2:
        b_qd = tl.load(tl.make_block_ptr(qg + (bos * HV + i_h) * K, (T_seq, K), (HV * K, 1), (t0, 0), (BTc, BK), (1, 0)), boundary_check=(0, 1))
        b_kd = tl.load(tl.make_block_ptr(kg + (bos * HV + i_h) * K, (T_seq, K), (HV * K, 1), (t0, 0), (BTc, BK), (1, 0)), boundary_check=(0, 1))
        b_dl = tl.load(glast + ((slot0 + i_t) * HV + i_h) * K + o_k, mask=o_k < K, other=0.)[:, None]
    else:
        b_q = tl.load(tl.make_block_ptr(q + (bos * H + i_hk) * K, (T_seq, K), (H * K, 1), (t0, 0), (BTc, BK), (1, 0)), boundary_check=(0, 1))
        b_k = tl.load(tl.make_block_ptr(k + (bos * H + i_hk) * K, (T_seq, K), (H * K, 1), (t0, 0), (BTc, BK), (1, 0)), boundary_check=(0, 1))
        if GATE == 1:
            gv = tl.load(g + (bos + t0 + o_t) * HV + i_h, mask=t0 + o_t < T_seq, other=0.).to(tl.float32)
            Gc = tl.cumsum(tl.where(gv < g_floor, g_floor, gv), 0)                 # [BT]
            G_last = tl.sum(tl.where(o_t == BTc - 1, Gc, 0.), 0)
            b_qd = (b_q.to(tl.float32) * tl.exp(Gc)[:, None]).to(b_q.dtype)
            b_kd = (b_k.to(tl.float32) * tl.exp(G_last - Gc)[:, None]).to(b_k.dtype)
            b_dl = tl.exp(G_last)
        else:
            b_qd = b_q
            b_kd = b_k
    if P_IN:
        b_P = tl.load(tl.make_block_ptr(p + (bos * HV + i_h) * BTc, (T_seq, BTc), (HV * BTc, 1), (t0, 0), (BTc, BTc), (1, 0)), boundary_check=(0, 1))
    else:
        b_P = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)              # [BT, BK] @ [BK, BT]
        if GATE == 1:
            b_P = b_P * tl.exp(tl.where(o_t[:, None] >= o_t[None, :], Gc[:, None] - Gc[None, :], float("-inf")))
        else:
            b_P = tl.where(o_t[:, None] >= o_t[None, :], b_P, 0.)
        b_P = b_P.to(b_q.dtype)
    b_Rd = b_R.to(b_qd.dtype)
    b_o = tl.dot(b_qd, S.to(b_qd.dtype), input_precision=DOT_PREC)               # [BT, BK] @ [BK, BV]
    b_o += tl.dot(b_P.to(b_qd.dtype), b_Rd, input_precision=DOT_PREC)             # [BT, BT] @ [BT, BV]
    tl.store(tl.make_block_ptr(o_base, (T_seq, V), (HV * V, 1), (t0, i_v * BV), (BTc, BV), (1, 0)), (b_o * scale).to(o_base.dtype.element_ty), boundary_check=(0, 1))
    if GATE != 0:
        S = S * b_dl
    S += tl.dot(tl.trans(b_kd), b_Rd, input_precision=DOT_PREC)                  # [BK, BT] @ [BT, BV]
    return S


@triton.jit(do_not_specialize=["T", "NT", "H", "HV"])
def chunk_state_output_kernel(
    q, k, v, w, u, p, g,         # [B,T,H,K] [B,T,H,K] [B,T,HV,V] [B,T,HV,K] [B,T,HV,V] [B,T,HV,BT] [B,T,HV] fp32
    qg, kg, glast,               # GATE == 2: [B,T,HV,K] [B,T,HV,K] [slots,HV,K] fp32
    o, h0, ht,                   # out [B,T,HV,V]; [N,HV,·,·] any float; out [N,HV,·,·] fp32
    cu_seqlens, scale, T, NT,
    s_h0n, s_h0h, s_h0k, s_h0v,  # strides of h0 (its layout)
    s_htn, s_hth, s_htk, s_htv,  # strides of ht
    H, HV, K, V,
    BTc: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, DELTA: tl.constexpr, P_IN: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr, g_floor: tl.constexpr, LOOP_WHILE: tl.constexpr,
):
    """Stage 2 (module docstring). Grid (cdiv(V, BV), N·HV); S [BK, BV] fp32 stays in registers.

    Per chunk (C = BT rows, masked past the sequence end)::

        R = U − W S  |  V                              [C, BV]
        o = scale · ((Q ⊙ e^G) S + P R)                [C, BV]
        S = e^{G_last} S + (K ⊙ e^{G_last − G})ᵀ R      [K, BV]
    """
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    i_hk = i_h // (HV // H)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        slot0 = i_n + bos // BTc
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        slot0 = i_n.to(tl.int64) * NT
    T_seq = (eos - bos).to(tl.int32)
    n_chunks = (T_seq + BTc - 1) // BTc

    o_base = o + (bos * HV + i_h) * V
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BTc)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]

    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        p_h0 = h0 + i_n * s_h0n + i_h * s_h0h + o_k[:, None] * s_h0k + o_v[None, :] * s_h0v
        S += tl.load(p_h0, mask=m_kv, other=0.).to(tl.float32)

    if LOOP_WHILE:      # the triton 3.6 interpreter cannot take a tensor bound in range()
        i_t = 0
        while i_t < n_chunks:
            S = _state_output_step(i_t, S, q, k, v, w, u, p, g, qg, kg, glast, o_base, bos, T_seq, slot0, i_h, i_hk, i_v, scale, H, HV, K, V, BTc, BK, BV, GATE, DELTA, P_IN, DOT_PREC, g_floor)
            i_t += 1
    else:               # compiled: a for loop, so that the loads of later chunks are pipelined
        for i_t in range(n_chunks):
            S = _state_output_step(i_t, S, q, k, v, w, u, p, g, qg, kg, glast, o_base, bos, T_seq, slot0, i_h, i_hk, i_v, scale, H, HV, K, V, BTc, BK, BV, GATE, DELTA, P_IN, DOT_PREC, g_floor)

    if STORE_HT:
        p_ht = ht + i_n * s_htn + i_h * s_hth + o_k[:, None] * s_htk + o_v[None, :] * s_htv
        tl.store(p_ht, S, mask=m_kv)


# ------------------------------------------------------------------------------------------------
# launchers
# ------------------------------------------------------------------------------------------------

def _gate_kind(g) -> int:
    return 0 if g is None else (1 if g.dim() == 3 else 2)


def _dot_prec(dtype) -> tuple[str, str]:
    """(precision of input-dtype dots, precision of fp32 factor products). fp32 inputs stay exact (ieee);
    bf16 / fp16 inputs run their factored fp32 products as tf32 (10-bit mantissa, fp32 range)."""
    return ("ieee", "ieee") if dtype == torch.float32 else ("tf32", "tf32")


def chunk_prepare(q, k, v, g, beta, cu_seqlens=None, chunk_indices=None):
    """Stage 1 for the delta families.

    Args: q, k [B,T,H,K]; v [B,T,HV,V]; g None | [B,T,HV] fp32 | [B,T,HV,K] fp32 (raw log-decays);
    beta [B,T,HV]; cu_seqlens [N+1] with chunk_indices [NT_total, 2] (varlen, B = 1).
    Returns dict: w [B,T,HV,K], u [B,T,HV,V], p [B,T,HV,64] (q's dtype) and, for per-channel g,
    qg, kg [B,T,HV,K] (q's dtype) and glast [slots, HV, K] fp32 (e^{G_last} per chunk; the slot of
    chunk i of sequence n is n·NT + i, or n + start_token // 64 with cu_seqlens).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    gate = _gate_kind(g)
    NT = triton.cdiv(T, BT)
    dev, dt = q.device, q.dtype
    w = _alloc((B, T, HV, K), dt, dev)
    u = _alloc((B, T, HV, V), dt, dev)
    p = _alloc((B, T, HV, BT), dt, dev)
    if cu_seqlens is not None:
        n_chunks = chunk_indices.shape[0]
        slots = cu_seqlens.numel() - 1 + NT + 1
    else:
        n_chunks = NT
        slots = B * NT
    if gate == 2:
        qg = _alloc((B, T, HV, K), dt, dev)
        kg = _alloc((B, T, HV, K), dt, dev)
        glast = _alloc((slots, HV, K), torch.float32, dev)
    else:
        qg = kg = glast = None
    dot_prec, mm_prec = _dot_prec(dt)
    if n_chunks > 0:
        chunk_prepare_kernel[(n_chunks, B * HV)](
            q, k, v, g, beta, w, u, p, qg, kg, glast, cu_seqlens, chunk_indices, T, NT,
            H=H, HV=HV, K=K, V=V, BTc=BT, BCc=BC, BK=_dim(K), BVf=_dim(V), GATE=gate,
            IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_prec, MM_PREC=mm_prec,
            g_floor=G_FLOOR, span_max=SPAN_MAX, num_warps=4, num_stages=1)
    return dict(w=w, u=u, p=p, qg=qg, kg=kg, glast=glast)


def _pick_bv(V: int, K: int, programs: int) -> int:
    """Value-split of stage 2: the widest BV that still gives ~2 programs per SM (132 on an H200)."""
    env = os.environ.get("CHUNKWISE_FWD_BV")
    if env:
        return min(int(env), _dim(V))
    bv = 64 if K <= 128 else 32
    while bv > 16 and programs * triton.cdiv(V, bv) < 256:
        bv //= 2
    return min(bv, _dim(V))


def chunk_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, *,
              chunk_indices=None, transpose_state_layout=False, p_in=None, bv=None, num_stages=None):
    """The chunk forward of all four families (canonical inputs: see chunkwise.triton).

    Returns (o [B,T,HV,V] in q's dtype, final state fp32 [N,HV,K,V] ([N,HV,V,K] transposed) or None).
    ``p_in`` / ``bv`` / ``num_stages`` override the tuned defaults (benchmarks).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    gate = _gate_kind(g)
    delta = beta is not None
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g = None if g is None else g.float().contiguous()
    beta = None if beta is None else beta.contiguous()
    if cu_seqlens is not None and chunk_indices is None and delta:
        from ..api import prepare_chunk_indices
        chunk_indices = prepare_chunk_indices(cu_seqlens, BT)
    NT = triton.cdiv(T, BT)

    if p_in is None:
        p_in = delta                      # simple GLA has no prepare stage: it forms P itself
    if gate == 2:
        p_in = True
    stage1 = chunk_prepare(q, k, v, g, beta, cu_seqlens, chunk_indices) if delta else \
        dict(w=None, u=None, p=None, qg=None, kg=None, glast=None)
    if not p_in:
        stage1["p"] = None

    o = _alloc((B, T, HV, V), q.dtype, q.device)
    ht = None
    if output_final_state:
        shape = (N, HV, V, K) if transpose_state_layout else (N, HV, K, V)
        ht = _alloc(shape, torch.float32, q.device)

    def strides(x):
        if x is None:
            return (0, 0, 0, 0)
        sn, sh, s2, s3 = x.stride()
        return (sn, sh, s3, s2) if transpose_state_layout else (sn, sh, s2, s3)

    bv = bv or _pick_bv(V, K, N * HV)
    dot_prec, _ = _dot_prec(q.dtype)
    if num_stages is None:
        num_stages = 2
    grid = (triton.cdiv(V, bv), N * HV)
    chunk_state_output_kernel[grid](
        q, k, v, stage1["w"], stage1["u"], stage1["p"], g, stage1["qg"], stage1["kg"], stage1["glast"],
        o, initial_state, ht, cu_seqlens, scale, T, NT,
        *strides(initial_state), *strides(ht),
        H=H, HV=HV, K=K, V=V, BTc=BT, BK=_dim(K), BV=bv, GATE=gate, DELTA=delta, P_IN=p_in,
        USE_H0=initial_state is not None, STORE_HT=output_final_state, IS_VARLEN=cu_seqlens is not None,
        DOT_PREC=dot_prec, g_floor=G_FLOOR, LOOP_WHILE=_INTERPRET, num_warps=4, num_stages=num_stages)
    return o, ht
