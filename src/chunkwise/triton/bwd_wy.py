"""The WY form in the backward (docs/design.md, section 6): W = T X, U = T Y with T = (I + A)⁻¹, X = β e^G K,
Y = β V. First its operands where the forward did not keep them — A and P, T, W, U — and dR_local = scale Pᵀ dO
(always); then, after the state-tile pass, the WY pass: the gradients through T, per chunk::

    dX = Tᵀ dW,   dY = Tᵀ dR,   dT = dR Yᵀ + dW Xᵀ,   dA = −Tᵀ dT Tᵀ (strict lower part)

and dv, dβ and, for scalar / no gates, dk and dg finished (the pairwise products through A); for KDA's per-channel
gate dA and dP go on to bwd_kda's pair kernel.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .bwd_states import (Problem, _chunk_bounds, _chunk_program, _chunk_rows, _col_offsets, _gate_factors,
                         _load_gate, _load_gate_cols, _rev_cumsum)
from .common import BC, SPAN_MAX, _and, _exp, _mm, state_dtype
from .stage1 import chunk_prepare_bwd


# ------------------------------------------------------------------------------------------------
# A = strict_tril(β ⟨k_i, Γ k_j⟩), P = tril(⟨q_i, Γ k_j⟩) and T = (I + A)⁻¹, where stage 1 was not saved
# ------------------------------------------------------------------------------------------------

@triton.jit
def _intra_kernel(q, k, beta, G, Amat, Pmat, cu_seqlens, chunk_indices, T,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr,
                  BC: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr, IS_VARLEN: tl.constexpr,
                  PREC: tl.constexpr):
    """A, P: [B, T, HV, C] fp32 (row i of chunk, column j). GATE: 0 none, 1 scalar, 2 per channel.

    Per channel only the blocks off the BC×BC diagonal are written here (_intra_diag_kernel writes the
    diagonal blocks)."""
    i_h, i_hk, t0, L, _ = _chunk_program(cu_seqlens, chunk_indices, T, H, HV, C, IS_VARLEN)
    o_t = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    m_t = o_t < L
    m_k = o_k < K
    rows = (t0 + o_t).to(tl.int64)
    if DELTA:
        b_beta = tl.load(beta + rows * HV + i_h, mask=m_t, other=0.).to(tl.float32)
    else:
        b_beta = tl.zeros([C], dtype=tl.float32)
    i_ge_j = o_t[:, None] >= o_t[None, :]
    i_gt_j = o_t[:, None] > o_t[None, :]
    m_cc = m_t[:, None] & m_t[None, :]
    p_cc = (rows[:, None] * HV + i_h) * C + o_t[None, :]
    if GATE == 2:
        # in column chunks of at most 128 channels (A and P are sums over channels): [C, 256] fp32 operands
        # would need more shared memory than an SM has
        BKI: tl.constexpr = BK if BK <= 128 else 128
        b_P = tl.zeros([C, C], dtype=tl.float32)
        b_A = tl.zeros([C, C], dtype=tl.float32)
        for kc in tl.static_range(BK // BKI):
            o_kc = kc * BKI + tl.arange(0, BKI)
            m_kc = o_kc < K
            p_c = (rows[:, None] * H + i_hk) * K + o_kc[None, :]
            m_c = m_t[:, None] & m_kc[None, :]
            b_qc = tl.load(q + p_c, mask=m_c, other=0.).to(tl.float32)
            b_kc = tl.load(k + p_c, mask=m_c, other=0.).to(tl.float32)
            b_G, b_last = _load_gate_cols(G, t0, L, i_h, o_kc, m_kc, HV, K, C)
            for jb in tl.static_range(C // BC - 1):
                r = jb * BC + BC - 1
                b_Gr = tl.sum(tl.where((o_t == r)[:, None], b_G, 0.), axis=0)               # [BKI]
                b_left = _exp(tl.where((o_t > r)[:, None], b_G - b_Gr[None, :], float("-inf")))
                in_blk = (o_t // BC) == jb
                b_right = _exp(tl.where(in_blk[:, None], b_Gr[None, :] - b_G, float("-inf")))
                b_kr = b_kc * b_right
                b_P += _mm(b_qc * b_left, tl.trans(b_kr), PREC)                        # [C, BKI] @ [BKI, C]
                if DELTA:
                    b_A += _mm(b_kc * b_beta[:, None] * b_left, tl.trans(b_kr), PREC)    # [C, BKI] @ [BKI, C]
        off = (o_t[:, None] // BC) != (o_t[None, :] // BC)
        tl.store(Pmat + p_cc, b_P, mask=m_cc & off)
        if DELTA:
            tl.store(Amat + p_cc, b_A, mask=m_cc & off)
    else:
        p_qk = (rows[:, None] * H + i_hk) * K + o_k[None, :]
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + p_qk, mask=m_tk, other=0.).to(tl.float32)
        b_k = tl.load(k + p_qk, mask=m_tk, other=0.).to(tl.float32)
        b_kb = b_k * b_beta[:, None]
        if GATE == 1:
            b_G, b_last = _load_gate(G, t0, L, i_h, HV, K, BK, C, False)
            b_gam = _exp(tl.where(i_ge_j, b_G[:, None] - b_G[None, :], float("-inf")))
        else:
            b_gam = tl.where(i_ge_j, 1., 0.)
        b_P = _mm(b_q, tl.trans(b_k), PREC) * b_gam                                    # [C, BK] @ [BK, C]
        tl.store(Pmat + p_cc, b_P, mask=m_cc)
        if DELTA:
            b_A = _mm(b_kb, tl.trans(b_k), PREC) * tl.where(i_gt_j, b_gam, 0.)  # [C, BK] @ [BK, C]
            tl.store(Amat + p_cc, b_A, mask=m_cc)


@triton.jit
def _diag_factors(b_G, span_max: tl.constexpr):
    """A BC×BC diagonal block of a per-channel gate (b_G [BC, BK], rows past the end = G_last), factored
    around the middle of its gates, m = (G_first + G_last) / 2: Γ_ij = e^{G_i − m} · e^{m − G_j}. Returns
    (e^{G − m}, e^{m − G}, whether the block spans under 2 span_max: G is non-increasing, so every |G_i − m| stays
    under span_max, and the factors and their products for i ≥ j in fp32's range)."""
    BC: tl.constexpr = b_G.shape[0]
    o_i = tl.arange(0, BC)
    b_f = tl.sum(tl.where((o_i == 0)[:, None], b_G, 0.), axis=0)                           # [BK]
    b_e = tl.sum(tl.where((o_i == BC - 1)[:, None], b_G, 0.), axis=0)                      # [BK]
    fast = tl.max(b_f - b_e, axis=0) < 2 * span_max
    b_d = tl.where(fast, b_G - 0.5 * (b_f + b_e)[None, :], 0.)
    return _exp(b_d), _exp(-b_d), fast


@triton.jit
def _diag_column(k, G, b_G, b_last, t0, L, ib, jj, i_h, i_hk, o_k, m_k, H: tl.constexpr, HV: tl.constexpr,
                 K: tl.constexpr, BC: tl.constexpr):
    """Column jj of diagonal block ib, exactly: (its chunk row j, whether it is inside the sequence, k_j [BK],
    e^{G_i − G_j} [BC, BK] for the block's rows i ≥ j, 0 above). b_G: the block's rows of the chunk gate."""
    o_i = tl.arange(0, BC)
    j = ib * BC + jj
    m_j = j < L
    row_j = (t0 + j).to(tl.int64)
    b_kj = tl.load(k + (row_j * H + i_hk) * K + o_k, mask=_and(m_k, m_j), other=0.).to(tl.float32)
    b_Gj = tl.load(G + (row_j * HV + i_h) * K + o_k, mask=_and(m_k, m_j), other=0.)
    b_Gj = tl.where(m_j, b_Gj, b_last)
    return j, m_j, b_kj, _exp(tl.where((o_i >= jj)[:, None], b_G - b_Gj[None, :], float("-inf")))


@triton.jit
def _intra_diag_kernel(q, k, beta, G, Amat, Pmat, cu_seqlens, chunk_indices, T,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr,
                       BC: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr, span_max: tl.constexpr):
    """The BC×BC diagonal blocks of A and P (_intra_kernel forms the rest).
    A block whose gates span less than 2 span_max takes two products of factored operands (_diag_factors);
    otherwise each column j exactly (rare)."""
    i_h, i_hk, t0, L, _ = _chunk_program(cu_seqlens, chunk_indices, T, H, HV, C, IS_VARLEN)
    o_i = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_last = tl.load(G + ((t0 + L - 1).to(tl.int64) * HV + i_h) * K + o_k, mask=m_k, other=0.)
    for ib in tl.static_range(C // BC):
        o_r = ib * BC + o_i
        m_r = o_r < L
        rows = (t0 + o_r).to(tl.int64)
        m_rk = m_r[:, None] & m_k[None, :]
        b_q = tl.load(q + (rows[:, None] * H + i_hk) * K + o_k[None, :], mask=m_rk, other=0.).to(tl.float32)
        b_k = tl.load(k + (rows[:, None] * H + i_hk) * K + o_k[None, :], mask=m_rk, other=0.).to(tl.float32)
        b_G = tl.load(G + (rows[:, None] * HV + i_h) * K + o_k[None, :], mask=m_rk, other=0.)
        b_G = tl.where(m_r[:, None], b_G, b_last[None, :])
        b_beta = tl.load(beta + rows * HV + i_h, mask=m_r, other=0.).to(tl.float32)
        b_xr, b_xc, fast = _diag_factors(b_G, span_max)
        if fast:
            b_kc = tl.trans(b_k * b_xc)
            b_P = _mm(b_q * b_xr, b_kc, PREC)                                                # [BC, BK] @ [BK, BC]
            b_A = _mm(b_k * b_xr, b_kc, PREC)                                                # [BC, BK] @ [BK, BC]
        else:
            b_P = tl.zeros([BC, BC], dtype=tl.float32)
            b_A = tl.zeros([BC, BC], dtype=tl.float32)
            for jj in range(BC):
                j, m_j, b_kj, b_e = _diag_column(k, G, b_G, b_last, t0, L, ib, jj, i_h, i_hk, o_k, m_k, H, HV, K, BC)
                b_w = b_kj[None, :] * b_e
                b_P = tl.where((o_i == jj)[None, :], tl.sum(b_q * b_w, axis=1)[:, None], b_P)
                b_A = tl.where((o_i == jj)[None, :], tl.sum(b_k * b_w, axis=1)[:, None], b_A)
        p = (rows[:, None] * HV + i_h) * C + o_r[None, :]
        m = m_r[:, None] & m_r[None, :]
        tl.store(Pmat + p, tl.where(o_i[:, None] >= o_i[None, :], b_P, 0.), mask=m)
        tl.store(Amat + p, tl.where(o_i[:, None] > o_i[None, :], b_A * b_beta[:, None], 0.), mask=m)


@triton.jit
def _load_blk(Amat, rows, m_r, i_h, cb, HV: tl.constexpr, C: tl.constexpr, BC: tl.constexpr):
    o = tl.arange(0, BC)
    return tl.load(Amat + (rows[:, None] * HV + i_h) * C + cb * BC + o[None, :], mask=m_r[:, None], other=0.)


@triton.jit
def _store_blk(Tmat, b, rows, m_r, i_h, cb, HV: tl.constexpr, C: tl.constexpr, BC: tl.constexpr):
    o = tl.arange(0, BC)
    tl.store(Tmat + (rows[:, None] * HV + i_h) * C + cb * BC + o[None, :], b, mask=m_r[:, None])


@triton.jit
def _inv_diag(Amat, t0, L, i_h, ib, HV: tl.constexpr, C: tl.constexpr, BC: tl.constexpr):
    """(I + A_bb)⁻¹ of one BC×BC diagonal block by forward substitution: T_i = e_i − Σ_{j<i} A_ij T_j."""
    o = tl.arange(0, BC)
    b_T = tl.where(o[:, None] == o[None, :], 1., 0.)
    for i in range(1, BC):
        row = ib * BC + i
        b_a = tl.load(Amat + ((t0 + row).to(tl.int64) * HV + i_h) * C + ib * BC + o,
                      mask=_and(o < i, row < L), other=0.)                          # [BC]
        b_new = tl.where(o == i, 1., 0.) - tl.sum(b_a[:, None] * b_T, axis=0)
        b_T = tl.where((o == i)[:, None], b_new[None, :], b_T)
    return b_T


@triton.jit
def _solve_kernel(Amat, Tmat, cu_seqlens, chunk_indices, T, HV: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
                  IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    """T = (I + A)⁻¹ for C = 4·BC, blockwise: the 16×16 diagonal blocks by forward substitution, then the blocks
    below them.  A, T: [B, T, HV, C] fp32 (T's upper blocks are not written)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // HV, i_bh % HV
    t0, L, _ = _chunk_bounds(i_t, i_b, cu_seqlens, chunk_indices, T, C, IS_VARLEN)
    o = tl.arange(0, BC)
    r0, r1, r2, r3 = (t0 + o).to(tl.int64), (t0 + BC + o).to(tl.int64), (t0 + 2 * BC + o).to(tl.int64), \
        (t0 + 3 * BC + o).to(tl.int64)
    m0, m1, m2, m3 = o < L, BC + o < L, 2 * BC + o < L, 3 * BC + o < L
    T00 = _inv_diag(Amat, t0, L, i_h, 0, HV, C, BC)
    T11 = _inv_diag(Amat, t0, L, i_h, 1, HV, C, BC)
    T22 = _inv_diag(Amat, t0, L, i_h, 2, HV, C, BC)
    T33 = _inv_diag(Amat, t0, L, i_h, 3, HV, C, BC)
    A10 = _load_blk(Amat, r1, m1, i_h, 0, HV, C, BC)
    A20 = _load_blk(Amat, r2, m2, i_h, 0, HV, C, BC)
    A21 = _load_blk(Amat, r2, m2, i_h, 1, HV, C, BC)
    A30 = _load_blk(Amat, r3, m3, i_h, 0, HV, C, BC)
    A31 = _load_blk(Amat, r3, m3, i_h, 1, HV, C, BC)
    A32 = _load_blk(Amat, r3, m3, i_h, 2, HV, C, BC)
    # T_ij = −T_ii Σ_{j ≤ m < i} A_im T_mj                                            all [BC, BC] @ [BC, BC]
    T10 = -_mm(T11, _mm(A10, T00, PREC), PREC)
    T21 = -_mm(T22, _mm(A21, T11, PREC), PREC)
    T32 = -_mm(T33, _mm(A32, T22, PREC), PREC)
    T20 = -_mm(T22, _mm(A20, T00, PREC) + _mm(A21, T10, PREC), PREC)
    T31 = -_mm(T33, _mm(A31, T11, PREC) + _mm(A32, T21, PREC), PREC)
    T30 = -_mm(T33, _mm(A30, T00, PREC) + _mm(A31, T10, PREC) + _mm(A32, T20, PREC), PREC)
    _store_blk(Tmat, T00, r0, m0, i_h, 0, HV, C, BC)
    _store_blk(Tmat, T10, r1, m1, i_h, 0, HV, C, BC)
    _store_blk(Tmat, T11, r1, m1, i_h, 1, HV, C, BC)
    _store_blk(Tmat, T20, r2, m2, i_h, 0, HV, C, BC)
    _store_blk(Tmat, T21, r2, m2, i_h, 1, HV, C, BC)
    _store_blk(Tmat, T22, r2, m2, i_h, 2, HV, C, BC)
    _store_blk(Tmat, T30, r3, m3, i_h, 0, HV, C, BC)
    _store_blk(Tmat, T31, r3, m3, i_h, 1, HV, C, BC)
    _store_blk(Tmat, T32, r3, m3, i_h, 2, HV, C, BC)
    _store_blk(Tmat, T33, r3, m3, i_h, 3, HV, C, BC)


# ------------------------------------------------------------------------------------------------
# W = T X, U = T Y, dR_local = scale Pᵀ dO
# ------------------------------------------------------------------------------------------------

@triton.jit
def _wu_kernel(k, v, beta, G, Tmat, Pmat, do, W, U, dRl, cu_seqlens, chunk_indices, T, scale,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, C: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr,
               IS_VARLEN: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr = 0, STORE_U: tl.constexpr = 1):
    """dRl: [B, T, HV, V]; with DELTA also W: [B, T, HV, K] and (STORE_U) U: [B, T, HV, V] (16-bit storage for 16-bit
    inputs; no U where the forward saved R, which is all the backward reads U for). LOWP: 1, the products'
    operands (T, P, β e^G K, β V, dO) in the 16-bit input dtype, fp32 accumulation, as the forward's stage 1 forms
    W and U; 2, in fp16, each tile scaled by a power of two first (_fp16_scaled: no overflow, no subnormals at its
    top 14 binades, 11 significant bits rounded to nearest where tf32 keeps 11 truncated); 0, fp32 operands at
    PREC."""
    i_h, i_hk, t0, L, i_g = _chunk_program(cu_seqlens, chunk_indices, T, H, HV, C, IS_VARLEN)
    o_t = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    m_t = o_t < L
    m_k = o_k < K
    rows = (t0 + o_t).to(tl.int64)
    m_cc = m_t[:, None] & m_t[None, :] & (o_t[:, None] >= o_t[None, :])
    p_cc = (rows[:, None] * HV + i_h) * C + o_t[None, :]
    op_dt = k.dtype.element_ty if LOWP == 1 else tl.float32                        # the products' operands
    b_P, s_P = _wu_left(tl.load(Pmat + p_cc, mask=m_cc, other=0.).to(op_dt), LOWP)
    if DELTA:
        b_T, s_T = _wu_left(tl.load(Tmat + p_cc, mask=m_cc, other=0.).to(op_dt), LOWP)
        b_beta = tl.load(beta + rows * HV + i_h, mask=m_t, other=0.).to(tl.float32)
        m_tk = m_t[:, None] & m_k[None, :]
        b_x = tl.load(k + (rows[:, None] * H + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_x = b_x * b_beta[:, None]
        if GATE > 0:
            b_G, b_last = _load_gate(G, t0, L, i_h, HV, K, BK, C, GATE == 2)
            b_eG, _ = _gate_factors(b_G, b_last, GATE)
            b_x = b_x * b_eG
        b_w = _wu_mm(b_T, s_T, b_x, op_dt, PREC, LOWP)                                  # [C, C] @ [C, BK]
        tl.store(W + (rows[:, None] * HV + i_h) * K + o_k[None, :], b_w, mask=m_tk)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_tv = (rows[:, None] * HV + i_h) * V + o_v[None, :]
        b_do = tl.load(do + p_tv, mask=m_tv, other=0.).to(op_dt)
        b_dr = _wu_mm(tl.trans(b_P), s_P * scale, b_do, op_dt, PREC, LOWP)              # [C, C] @ [C, BV]
        tl.store(dRl + p_tv, b_dr, mask=m_tv)
        if DELTA and STORE_U:
            b_y = tl.load(v + p_tv, mask=m_tv, other=0.).to(tl.float32) * b_beta[:, None]
            tl.store(U + p_tv, _wu_mm(b_T, s_T, b_y, op_dt, PREC, LOWP), mask=m_tv)       # [C, C] @ [C, BV]


@triton.jit
def _wu_left(a, LOWP: tl.constexpr):
    """_wu_kernel's left operand (T or P, loaded once per program) and the factor its products take: (a as
    _fp16_scaled makes it, its scale) at LOWP 2, else (a, 1)."""
    s = 1.0
    if LOWP == 2:
        a, s = _fp16_scaled(a)
    return a, s


@triton.jit
def _wu_mm(a, s_a, b, op_dt: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr):
    """s_a · (a @ b) for _wu_kernel's products, a from _wu_left: at LOWP 2 b is _fp16_scaled here and its scale
    applied with s_a (fp16 operands, fp32 accumulation); else b in op_dt at PREC."""
    if LOWP == 2:
        b, s_b = _fp16_scaled(b)
        c = tl.dot(a, b) * (s_a * s_b)
    else:
        c = s_a * _mm(a, b.to(op_dt), PREC)
    return c


@triton.jit
def _fp16_scaled(x):
    """(x / s in fp16, s) for a 2-D fp32 tile, s = 2^⌈log2 max|x|⌉: the tile's largest entries keep fp16's 11
    significant bits (rounded to nearest) and nothing overflows, whatever the tile's own scale (dO and v of any
    magnitude; fp16 as it is would lose a tile of 1e-6 to subnormals and one of 1e5 to inf). The product of two such
    tiles times both s is the fp32-accumulated product of the tiles. The exponent stays within ±126 and log2 never
    sees an fp32 subnormal (the GPU's log2 flushes those to −inf): an all-zero or all-subnormal tile gets s = 2^−122,
    so that its entries scale up into fp16's range instead of to inf."""
    b_m = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    b_e = tl.minimum(tl.ceil(tl.log2(tl.maximum(b_m, 1e-37))), 126.)
    return (x * tl.exp2(-b_e)).to(tl.float16), tl.exp2(b_e)


# ------------------------------------------------------------------------------------------------
# the WY pass
# ------------------------------------------------------------------------------------------------

@triton.jit
def _share_rows(acc, dGp, s_p, rows, i_h, m_t, HV: tl.constexpr, NKP: tl.constexpr):
    """acc + Σ_i dGp[i] at the token rows `rows` (mask m_t) and value head i_h of NKP per-row shares dGp [NKP, B, T,
    HV] fp32 (one share: s_p elements)."""
    for i_p in tl.static_range(NKP):
        acc += tl.load(dGp + i_p * s_p + rows * HV + i_h, mask=m_t, other=0.)
    return acc


@triton.jit
def _cols_ahead(X, rows, m_t, k0, i_h, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """Columns [k0, k0 + BK) of a [B, T, HV, K] tensor at the chunk's rows (zeros past K)."""
    o_k = k0 + tl.arange(0, BK)
    return tl.load(X + (rows[:, None] * HV + i_h) * K + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :], other=0.)


@triton.jit
def _wy_value_step(b_dR, b_v, b_beta, b_Ttv, b_dT, b_dTt, b_db, dv, p_tv, m_tv, PREC: tl.constexpr,
                   DTT: tl.constexpr):
    """One value block [C, BV] of the WY pass: dT += dR (βV)ᵀ, dTᵀ += (βV) dRᵀ (DTT), dv = β (Tᵀ dR) stored at p_tv,
    dβ += Σ_v V ⊙ Tᵀ dR. Returns (dT, dTᵀ, dβ)."""
    b_vb = (b_v.to(tl.float32) * b_beta[:, None]).to(b_dR.dtype)
    b_dT += _mm(b_dR, tl.trans(b_vb), PREC)                                                  # [C, BV] @ [BV, C]
    if DTT:
        b_dTt += _mm(b_vb, tl.trans(b_dR), PREC)                                             # [C, BV] @ [BV, C]
    b_dy = _mm(b_Ttv, b_dR, PREC)                                                            # [C, C] @ [C, BV]
    tl.store(dv + p_tv, (b_dy * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_tv)
    b_db += tl.sum(b_v.to(tl.float32) * b_dy, axis=1)
    return b_dT, b_dTt, b_db


@triton.jit
def _wy_dw_x(b_k, b_dw, b_beta, b_eG, b_dT, b_dTt, OPD: tl.constexpr, PREC: tl.constexpr, GATE: tl.constexpr,
             DTT: tl.constexpr):
    """The WY pass's dW terms of dT for key columns [C, BK]: dT += dW Xᵀ and (DTT) dTᵀ += X dWᵀ, X = β e^G K (b_eG:
    e^G [C, 1], GATE 1), b_k fp32 K, b_dw dW; both as OPD operands. Returns (dT, dTᵀ)."""
    b_x = b_k * b_beta[:, None]
    if GATE == 1:
        b_x = b_x * b_eG
    b_x = b_x.to(OPD)
    b_dT += _mm(b_dw, tl.trans(b_x), PREC)                                                   # [C, BK] @ [BK, C]
    if DTT:
        b_dTt += _mm(b_x, tl.trans(b_dw), PREC)                                              # [C, BK] @ [BK, C]
    return b_dT, b_dTt


@triton.jit
def _wy_dA(b_Ttl, b_Tl, b_dT, b_dTt, b_G, o_t, m_cc, p_cc, p_ccT, Ascr, OPD: tl.constexpr, PREC: tl.constexpr,
           GATE: tl.constexpr, DA_SCR: tl.constexpr):
    """The gradient through A from dT: dA = −Tᵀ dT Tᵀ (strict lower) and dAᵀ = −T dTᵀ T (strict upper), with a scalar
    gate each ⊙ its factor Γ / Γᵀ. DA_SCR: dAᵀ is read back transposed from the chunk's rows of the fp32 scratch Ascr
    once dA is stored there and the program's threads meet at a barrier (b_Tl, b_dTt unused). GATE 2: dA alone
    (dAᵀ returned as dA), no gate factor. b_Ttl: Tᵀ, b_Tl: T, as product operands of type OPD."""
    b_dA = _mm(_mm(b_Ttl, b_dT.to(OPD), PREC).to(OPD), b_Ttl, PREC)                          # [C, C] @ [C, C] @ [C, C]
    if not DA_SCR and GATE != 2:
        b_dAt = _mm(_mm(b_Tl, b_dTt.to(OPD), PREC).to(OPD), b_Tl, PREC)                      # [C, C] @ [C, C] @ [C, C]
    b_dA = tl.where(m_cc & (o_t[:, None] > o_t[None, :]), -b_dA, 0.)
    if GATE != 2:
        if not DA_SCR:
            b_dAt = tl.where(m_cc & (o_t[None, :] > o_t[:, None]), -b_dAt, 0.)
        if GATE == 1:
            b_dA = b_dA * _exp(tl.where(o_t[:, None] > o_t[None, :], b_G[:, None] - b_G[None, :], float("-inf")))
            if not DA_SCR:
                b_dAt = b_dAt * _exp(tl.where(o_t[None, :] > o_t[:, None], b_G[None, :] - b_G[:, None],
                                                float("-inf")))
        if DA_SCR:      # dAᵀ: the chunk's rows of the scratch, read back transposed once every thread has stored
            tl.store(Ascr + p_cc, b_dA, mask=m_cc)
            tl.debug_barrier()
            b_dAt = tl.load(Ascr + p_ccT, mask=m_cc, other=0.)
    else:
        b_dAt = b_dA
    return b_dA, b_dAt


@triton.jit
def _wy_key_terms(b_k16, b_dw, b_dk1, b_Ttl, b_dA, b_dAt, b_beta, b_eG, PREC: tl.constexpr, GATE: tl.constexpr):
    """dk for key columns [C, BK] from dk1 (the state-tile pass's share) and the WY pass's, with that share's row sums
    into dβ and (GATE 1) dG: dX = Tᵀ dW, dk = dk1 + β e^G dX + dAᵀ (βK) + β (dA K). b_k16: K as loaded, b_dw: dW in
    the products' dtype, dA and dAᵀ fp32, b_eG: e^G [C, 1] (GATE 1). Returns (dk, dβ share, dG share)."""
    b_k = b_k16.to(tl.float32)
    b_kb = b_k * b_beta[:, None]
    if GATE == 1:
        b_ke = b_k * b_eG
    else:
        b_ke = b_k
    b_dx = _mm(b_Ttl, b_dw, PREC)                                                            # [C, C] @ [C, BK]
    b_dkb = _mm(b_dA, b_k, PREC)                                                             # [C, C] @ [C, BK]
    b_dkp = _mm(b_dAt, b_kb, PREC)                                                           # [C, C] @ [C, BK]
    if GATE == 1:
        b_dxk = b_beta[:, None] * b_eG * b_dx
    else:
        b_dxk = b_beta[:, None] * b_dx
    b_dk = b_dk1 + b_dxk + b_dkp + b_beta[:, None] * b_dkb
    b_db = tl.sum(b_ke * b_dx + b_k * b_dkb, axis=1)
    if GATE == 1:
        b_dg = tl.sum(b_k * b_dxk + b_kb * b_dkb - b_k * b_dkp, axis=1)
    else:
        b_dg = tl.zeros_like(b_db)
    return b_dk, b_db, b_dg


@triton.jit
def _bwd_wy_kernel(k, v, beta, G, Tmat, dW, dR, dk1, dGp, Ascr, dv, dk, dbeta, dG, R, do, Pmat, dTp,
                   cu_seqlens, chunk_indices, T, scale,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, C: tl.constexpr, NKP: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr,
                   IS_VARLEN: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr = 0, DA_SCR: tl.constexpr = 0):
    """Scalar / no gate, one program per (chunk, value head), after _bwd_dqk_kernel: the gradients through T
    (the WY form W = T X, U = T Y), then dk, dβ, dg finished::

        V loop:  dT = dR (βV)ᵀ, dTᵀ = (βV) dRᵀ,  dv = β (Tᵀ dR),  dβ = Σ_v V ⊙ Tᵀ dR
        K loop:  dT += dW Xᵀ, dTᵀ += X dWᵀ                  (X = β e^G K)
        dA = −Tᵀ dT Tᵀ (strict lower) ⊙ Γ,  dAᵀ = −T dTᵀ T (strict upper) ⊙ Γᵀ
        K loop:  dX = Tᵀ dW;  dk = dk1 + β e^G dX + dAᵀ (βK) + β (dA K);  dβ += Σ_k (K e^G ⊙ dX + K ⊙ dA K)
        scalar gate: dG = Σ of _bwd_dqk_kernel's NKP column-block shares + Σ_k (X ⊙ dX + βK ⊙ dA K − K ⊙ dAᵀ βK),
                     dg its reverse cumsum in the chunk
    Without the delta rule only the last step runs (dv = dR and dk = dk1 are the caller's). BK: the key loops'
    column block. LOWP 2: the products of T, dW, X, dT and dA in the 16-bit input dtype (fp32 accumulation); the
    pairwise ones (dA K, dAᵀ βK) stay fp32. T is Tᵀ's tile transposed (a loaded tile, not a product's accumulator)
    rather than a second load of Tmat whose latency the program would wait on, and the last key loop loads dk1's
    next column block an iteration ahead (a product's accumulator stays out of Triton's software pipeline).
    DA_SCR: dAᵀ read back transposed from the chunk's rows of Ascr ([B, T, HV, C] fp32 scratch) after dA is stored
    there and the program's threads meet at a barrier, instead of formed by products of its own (dTᵀ in both loops
    and −T dTᵀ T: 12 of the pass's 40 [64, 32, 64] products).

    Per-channel gate (GATE 2, KDA; after _bwd_dqk_kernel, before the pair kernel): no key loops: dT = dR (βV)ᵀ + the
    state-tile pass's NKP shares in dTp ([NKP, B, T, HV, C]), dβ = Σ_v V ⊙ Tᵀ dR + its shares in dGp ([NKP, B, T,
    HV]); no pairwise products and no dAᵀ: dA (no gate factor) goes to Ascr (Amat) and dP = scale tril(dO Rᵀ) to
    Pmat, fp32, for the pair kernel, which finishes dq, dk, dG, dβ. (Ascr and Pmat may be dTp's first two blocks:
    each program reads its rows of dTp before it writes them.)"""
    i_h, i_hk, t0, L, i_g = _chunk_program(cu_seqlens, chunk_indices, T, H, HV, C, IS_VARLEN)
    o_t, m_t, rows, m_cc, p_cc, p_ccT = _chunk_rows(t0, L, i_h, HV, C)
    OPD: tl.constexpr = k.dtype.element_ty if LOWP else tl.float32
    if GATE == 1:
        b_G, b_last = _load_gate(G, t0, L, i_h, HV, K, BK, C, False)
        b_eG = _exp(b_G)[:, None]
        s_p = tl.num_programs(1).to(tl.int64) * T          # one column block's share: [B, T, HV]
        b_dGr = _share_rows(tl.zeros([C], dtype=tl.float32), dGp, s_p, rows, i_h, m_t, HV, NKP)
    if DELTA:
        b_beta = tl.load(beta + rows * HV + i_h, mask=m_t, other=0.).to(tl.float32)
        b_Tt = tl.load(Tmat + p_ccT, mask=m_cc & (o_t[None, :] >= o_t[:, None]), other=0.)        # Tᵀ [C, C]
        b_Ttv = b_Tt.to(dR.dtype.element_ty)
        b_Ttl = b_Tt.to(OPD)
        b_dT = tl.zeros([C, C], dtype=tl.float32)
        b_dTt = tl.zeros([C, C], dtype=tl.float32)
        b_dP = tl.zeros([C, C], dtype=tl.float32)
        b_db = tl.zeros([C], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_tv = m_t[:, None] & (o_v < V)[None, :]
            p_tv = (rows[:, None] * HV + i_h) * V + o_v[None, :]
            b_dR = tl.load(dR + p_tv, mask=m_tv, other=0.)
            b_v = tl.load(v + p_tv, mask=m_tv, other=0.)
            b_dT, b_dTt, b_db = _wy_value_step(b_dR, b_v, b_beta, b_Ttv, b_dT, b_dTt, b_db, dv, p_tv, m_tv, PREC,
                                               not DA_SCR and GATE != 2)
            if GATE == 2:
                b_dP += _mm(tl.load(do + p_tv, mask=m_tv, other=0.),
                            tl.trans(tl.load(R + p_tv, mask=m_tv, other=0.)), PREC)          # [C, BV] @ [BV, C]
        if GATE == 2:   # dT's and dβ's column-block shares from the state-tile pass
            s_p = tl.num_programs(1).to(tl.int64) * T
            for i_p in tl.static_range(NKP):
                b_dT += tl.load(dTp + i_p * (s_p * C) + p_cc, mask=m_cc, other=0.)
                b_db += tl.load(dGp + i_p * s_p + rows * HV + i_h, mask=m_t, other=0.)
        if GATE != 2:   # dT += dW Xᵀ
            for i_k in range(tl.cdiv(K, BK)):
                o_k = i_k * BK + tl.arange(0, BK)
                m_tk, p_tk, p_hk = _col_offsets(rows, m_t, o_k, o_k < K, i_h, i_hk, H, HV, K)
                b_dT, b_dTt = _wy_dw_x(tl.load(k + p_tk, mask=m_tk, other=0.).to(tl.float32),
                                       tl.load(dW + p_hk, mask=m_tk, other=0.).to(OPD), b_beta,
                                       b_eG if GATE == 1 else b_beta, b_dT, b_dTt, OPD, PREC, GATE, not DA_SCR)
        b_Tl = b_Ttl
        if GATE != 2 and not DA_SCR:
            b_Tl = tl.trans(b_Ttl)                                                          # T
        if GATE != 2:     # the first column block of dk1, its latency under the dA products
            b_dk1n = _cols_ahead(dk1, rows, m_t, 0, i_h, HV, K, BK)
        b_dA, b_dAt = _wy_dA(b_Ttl, b_Tl, b_dT, b_dTt, b_G if GATE == 1 else b_beta, o_t, m_cc, p_cc, p_ccT, Ascr,
                             OPD, PREC, GATE, DA_SCR)
    if DELTA and GATE == 2:     # dA and dP for the pair kernel
        tl.store(Ascr + p_cc, b_dA, mask=m_cc)
        tl.store(Pmat + p_cc, tl.where(o_t[:, None] >= o_t[None, :], b_dP * scale, 0.), mask=m_cc)
        tl.store(dbeta + rows * HV + i_h, b_db, mask=m_t)
    elif DELTA:
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_tk, p_tk, p_hk = _col_offsets(rows, m_t, o_k, o_k < K, i_h, i_hk, H, HV, K)
            b_k16 = tl.load(k + p_tk, mask=m_tk, other=0.)
            b_dw = tl.load(dW + p_hk, mask=m_tk, other=0.).to(OPD)
            b_dk1 = b_dk1n
            b_dk1n = _cols_ahead(dk1, rows, m_t, (i_k + 1) * BK, i_h, HV, K, BK)
            b_dk, b_dbk, b_dGk = _wy_key_terms(b_k16, b_dw, b_dk1, b_Ttl, b_dA, b_dAt, b_beta,
                                               b_eG if GATE == 1 else b_beta, PREC, GATE)
            b_db += b_dbk
            if GATE == 1:
                b_dGr += b_dGk
            tl.store(dk + p_hk, b_dk.to(dk.dtype.element_ty), mask=m_tk)
        tl.store(dbeta + rows * HV + i_h, b_db, mask=m_t)
    if GATE == 1:
        tl.store(dG + rows * HV + i_h, _rev_cumsum(b_dGr), mask=m_t)


# ------------------------------------------------------------------------------------------------
# launchers
# ------------------------------------------------------------------------------------------------

def stage1_from_saved(k, v, beta, G, do, scale, saved, p: Problem, plan) -> tuple:
    """With the forward's stage 1 saved: dR_local = scale Pᵀ dO, and W = T X where the forward kept T alone (the T
    form, KDA), its products from fp16 operands each scaled by a power of two. Returns (T, W, dR_local)."""
    sdt = state_dtype(k.dtype)
    T_, W = saved["t"].contiguous(), saved.get("w")
    from_t = W is None
    W = p.alloc(p.B, p.T, p.HV, p.K, dtype=sdt) if from_t else W.contiguous()
    dRl = p.alloc(p.B, p.T, p.HV, p.V, dtype=sdt)
    lowp = (2 if from_t else 1) if plan.wu_lowp else 0
    _wu_kernel[p.grid_c](k, v, beta, G, T_ if from_t else None, saved["p"].contiguous(), do, W if from_t else None,
                         None, dRl, scale=scale, H=p.H, HV=p.HV, K=p.K, V=p.V, BK=p.BK, BV=plan.bv, C=p.C,
                         GATE=p.gate, DELTA=from_t, IS_VARLEN=p.varlen, PREC=plan.prec, LOWP=lowp, STORE_U=False,
                         num_warps=plan.num_warps, **plan.regs("wu"), num_stages=plan.num_stages, **p.chunks)
    return T_, W, dRl


def recompute_stage1(q, k, v, g, beta, G, do, scale, Amat, Pmat, p: Problem, plan) -> tuple:
    """Without a saved stage 1: T, W, U (delta rule) and dR_local, by stage 1's kernel in its backward mode where
    plan.fused_prep (A and P stay in registers), else by the A / P, diagonal-block, solve and W / U launches into
    the scratch Amat, Pmat. Returns (T, W, U, dR_local)."""
    sdt = state_dtype(q.dtype)
    T_ = W = U = None
    if p.delta:
        T_ = p.alloc(p.B, p.T, p.HV, p.C)
        W, U = p.alloc(p.B, p.T, p.HV, p.K, dtype=sdt), p.alloc(p.B, p.T, p.HV, p.V, dtype=sdt)
    dRl = p.alloc(p.B, p.T, p.HV, p.V, dtype=sdt)
    if plan.fused_prep:
        chunk_prepare_bwd(q, k, v, g, beta, do, scale, W, U, T_, dRl, p.cu_seqlens, p.chunk_indices,
                          wu_lowp=plan.wu_lowp, num_warps=plan.num_warps)
        return T_, W, U, dRl
    launch = dict(num_warps=plan.num_warps, num_stages=plan.num_stages, **p.chunks)
    _intra_kernel[p.grid_c](q, k, beta, G, Amat, Pmat, H=p.H, HV=p.HV, K=p.K, BK=p.BK, C=p.C, BC=BC, GATE=p.gate,
                            DELTA=p.delta, IS_VARLEN=p.varlen, PREC=plan.prec, **plan.regs("intra"), **launch)
    if p.gate == 2:
        _intra_diag_kernel[p.grid_c](q, k, beta, G, Amat, Pmat, H=p.H, HV=p.HV, K=p.K, BK=p.BK, C=p.C, BC=BC,
                                     IS_VARLEN=p.varlen, PREC=plan.prec, span_max=SPAN_MAX,
                                     **plan.regs("intra_diag"), **launch)
    if p.delta:
        _solve_kernel[p.grid_c](Amat, T_, HV=p.HV, C=p.C, BC=BC, IS_VARLEN=p.varlen, PREC=plan.prec,
                                **plan.regs("solve"), **launch)
    _wu_kernel[p.grid_c](k, v, beta, G, T_, Pmat, do, W, U, dRl, scale=scale, H=p.H, HV=p.HV, K=p.K, V=p.V, BK=p.BK,
                         BV=plan.bv, C=p.C, GATE=p.gate, DELTA=p.delta, IS_VARLEN=p.varlen, PREC=plan.prec,
                         LOWP=plan.wu_lowp, **plan.regs("wu"), **launch)
    return T_, W, U, dRl


def wy_pass(k, v, beta, G, Tmat, dW, dR, dk1, dGp, Ascr, dv, dk, dbeta, dG, R, do, Pmat, dTp, scale, p, plan):
    """_bwd_wy_kernel over every chunk and value head (p: the backward's Problem). NKP: the state-tile pass's column
    blocks, whose shares of dG (and for KDA of dT, dβ) it sums."""
    _bwd_wy_kernel[p.grid_c](
        k, v, beta, G, Tmat, dW, dR, dk1, dGp, Ascr, dv, dk, dbeta, dG, R, do, Pmat, dTp,
        scale=scale, H=p.H, HV=p.HV, K=p.K, V=p.V, BK=plan.wy_bk, BV=plan.bv, C=p.C,
        NKP=-(-p.K // plan.dqk_bk), GATE=p.gate, DELTA=p.delta, IS_VARLEN=p.varlen, PREC=plan.prec,
        LOWP=plan.key_lowp, DA_SCR=plan.wy_da_scr, num_warps=plan.num_warps, num_stages=plan.num_stages,
        **p.chunks)
