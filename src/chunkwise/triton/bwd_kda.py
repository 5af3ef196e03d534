"""KDA's pairwise gradients: the gradients through the per-channel pairwise products (docs/design.md,
section 3, "KDA's per-channel factorisation")::

    P = tril(⟨q_i, Γ_ij k_j⟩),   A = strict_tril(⟨βk_i, Γ_ij k_j⟩),   Γ_ijc = e^{G_ic − G_jc}
    M_ij = Σ_c a_ic b_jc Γ_ijc:  da_i = Σ_j dM_ij b_j Γ_ij,  db_j = Σ_i dM_ij a_i Γ_ij,  dG += a ⊙ da − b ⊙ db

from dP and dA (left in Pmat, Amat by the WY pass), then the reverse cumsum of dG into dg. Γ is never formed
from e^{G_i} and e^{−G_j}: where a chunk's gate stays within ±SPAN_MAX of r = G_last / 2 for a block of
channels, Γ_ij = e^{G_i − r} · e^{r − G_j} over the whole chunk (_pair_grads_one_ref, both factors within
fp32's range); elsewhere, off the 16×16 diagonal blocks, column block J (last token r) factors as
e^{G_i − G_r} · e^{G_r − G_j}, both ≤ 1, and the diagonal blocks around their last token when they span less
than SPAN_MAX, else pair by pair.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bwd_states import _chunk_bounds, _chunk_rows, _col_offsets, _load_gate_cols, _rev_cumsum
from .bwd_wy import _diag_column, _diag_factors
from .common import BC, SPAN_MAX, _and, _exp, _mm, cdiv


@triton.jit
def _ref_offsets(G, t0, L, i_h, o_k, m_k, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr):
    """G − r [C, BKP] for the channels o_k [BKP] of a chunk, r = G_last / 2 per channel (rows past L at G_last). The
    one-reference form fits a channel block where every |G_i − r| is under span_max (_ref_span): the one test
    every launch that splits the work by it must share."""
    b_G, b_last = _load_gate_cols(G, t0, L, i_h, o_k, m_k, HV, K, C)
    return b_G - 0.5 * b_last[None, :]


@triton.jit
def _ref_span(b_d):
    """The largest |G_i − r| of a channel block (_ref_offsets): the block fits one reference where it is under
    span_max."""
    return tl.max(tl.max(tl.abs(b_d), axis=1), axis=0)


# ------------------------------------------------------------------------------------------------
# the pairwise gradients
# ------------------------------------------------------------------------------------------------

@triton.jit
def _pairwise_grads_channel(b_dP, b_dPt, b_dA, b_dAt, b_q, b_k, b_kb, b_G, C: tl.constexpr, BC: tl.constexpr,
                            PREC: tl.constexpr):
    """The gradients through P and A off the 16×16 diagonal blocks, for the channels of b_q, b_k, b_kb, b_G [C, BKW]:
    (dq, dk from P and from A's right side, dk from A's left side, that is d(βk)). Column block J (last token r)
    factors Γ_ij = e^{G_i − G_r} e^{G_r − G_j}, both ≤ 1."""
    o_t = tl.arange(0, C)
    b_dqp = tl.zeros_like(b_q)
    b_dkp = tl.zeros_like(b_q)
    b_dkb = tl.zeros_like(b_q)
    for jb in tl.static_range(C // BC - 1):
        r = jb * BC + BC - 1
        b_Gr = tl.sum(tl.where((o_t == r)[:, None], b_G, 0.), axis=0)                       # [BKW]
        b_left = _exp(tl.where((o_t > r)[:, None], b_G - b_Gr[None, :], float("-inf")))
        b_right = _exp(tl.where(((o_t // BC) == jb)[:, None], b_Gr[None, :] - b_G, float("-inf")))
        b_kr = b_k * b_right
        b_dqp += _mm(b_dP, b_kr, PREC) * b_left                                            # [C, C] @ [C, BKW]
        b_dkp += _mm(b_dPt, b_q * b_left, PREC) * b_right                                  # [C, C] @ [C, BKW]
        b_dkb += _mm(b_dA, b_kr, PREC) * b_left                                            # [C, C] @ [C, BKW]
        b_dkp += _mm(b_dAt, b_kb * b_left, PREC) * b_right                                 # [C, C] @ [C, BKW]
    return b_dqp, b_dkp, b_dkb


@triton.jit
def _diag_grads_exact(k, G, Pmat, Amat, b_q, b_kb, b_G, b_last, t0, L, ib, rows, m_r, i_h, i_hk, o_k, m_k,
                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr,
                      BC: tl.constexpr):
    """The gradients through diagonal block ib of P and A (dP, dA in Pmat, Amat) column by column, with
    the exact Γ_ij = e^{G_i − G_j} (blocks whose gates span too far to factor). Returns (dq, d(βk), dk) [BC, BK]."""
    o_i = tl.arange(0, BC)
    b_dqd = tl.zeros([BC, BK], dtype=tl.float32)
    b_dkbd = tl.zeros([BC, BK], dtype=tl.float32)
    b_dkd = tl.zeros([BC, BK], dtype=tl.float32)
    for jj in range(BC):
        j, m_j, b_kj, b_e = _diag_column(k, G, b_G, b_last, t0, L, ib, jj, i_h, i_hk, o_k, m_k, H, HV, K, BC)
        b_dPc = tl.load(Pmat + (rows * HV + i_h) * C + j, mask=_and(m_r, m_j), other=0.)        # [BC]
        b_w = b_kj[None, :] * b_e
        b_dqd += b_dPc[:, None] * b_w
        b_z = b_dPc[:, None] * b_q
        b_dAc = tl.load(Amat + (rows * HV + i_h) * C + j, mask=_and(m_r, m_j), other=0.)
        b_dkbd += b_dAc[:, None] * b_w
        b_z += b_dAc[:, None] * b_kb
        b_dkd = tl.where((o_i == jj)[:, None], tl.sum(b_z * b_e, axis=0)[None, :], b_dkd)
    return b_dqd, b_dkbd, b_dkd


@triton.jit
def _pair_grads_one_ref(q, k, dq, dk, dG, dq_o, dk_o, b_dP, b_dPt, b_dA, b_dAt, b_beta, b_d, rows, m_t, o_k, m_k,
                        i_h, i_hk, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, PREC: tl.constexpr):
    """The pairwise gradients for the channels o_k of one chunk around one reference r, b_d = G − r [C, BKP] with
    every |G_i − r| under span_max: Γ_ij = x_i y_j, x = e^{G − r}, y = e^{r − G} (both in fp32's range), so over the
    whole chunk (the diagonal blocks included)

        dq = x ⊙ (dP (k ⊙ y)),   d(βk) = x ⊙ (dA (k ⊙ y)),   dk = y ⊙ (dPᵀ (q ⊙ x) + dAᵀ (βk ⊙ x))

    added to dq, dk, the sums stored to dq_o, dk_o (dq, dk themselves, or the final gradients in their dtype); dG
    gets them and becomes dg (reverse cumsum). b_dP, b_dPt, b_dA, b_dAt: [C, C] fp32 (dP lower, dA strict lower,
    zero elsewhere). Returns dβ's share [C]."""
    m_tk, p_tk, p_hk = _col_offsets(rows, m_t, o_k, m_k, i_h, i_hk, H, HV, K)
    b_x = _exp(b_d)                                                                      # e^{G_i − r}
    b_y = _exp(-b_d)                                                                     # e^{r − G_j}
    b_q = tl.load(q + p_tk, mask=m_tk, other=0.).to(tl.float32)
    b_k = tl.load(k + p_tk, mask=m_tk, other=0.).to(tl.float32)
    b_ky = b_k * b_y
    b_dqp = _mm(b_dP, b_ky, PREC) * b_x                                                 # [C, C] @ [C, BKP]
    b_dkp = _mm(b_dPt, b_q * b_x, PREC)                                                 # [C, C] @ [C, BKP]
    b_kb = b_k * b_beta[:, None]
    b_dkb = _mm(b_dA, b_ky, PREC) * b_x                                                 # [C, C] @ [C, BKP]
    b_dkp += _mm(b_dAt, b_kb * b_x, PREC)                                               # [C, C] @ [C, BKP]
    b_dkp = b_dkp * b_y
    b_dq = tl.load(dq + p_hk, mask=m_tk, other=0.) + b_dqp
    tl.store(dq_o + p_hk, b_dq.to(dq_o.dtype.element_ty), mask=m_tk)
    b_dk = tl.load(dk + p_hk, mask=m_tk, other=0.) + b_dkp + b_beta[:, None] * b_dkb
    tl.store(dk_o + p_hk, b_dk.to(dk_o.dtype.element_ty), mask=m_tk)
    b_dG = tl.load(dG + p_hk, mask=m_tk, other=0.) + b_q * b_dq + b_kb * b_dkb - b_k * b_dkp
    tl.store(dG + p_hk, _rev_cumsum(b_dG), mask=m_tk)
    return tl.sum(b_k * b_dkb, axis=1)


@triton.jit
def _pair_grads_blocks(q, k, beta, G, Pmat, Amat, dq, dk, dbp, dG, dq_o, dk_o, t0, L, i_h, i_hk, i_kb, o_k, m_k, b_last,
                       s_dbp,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BKP: tl.constexpr, C: tl.constexpr,
                       BC: tl.constexpr, PREC: tl.constexpr, span_max: tl.constexpr, OFFDIAG: tl.constexpr,
                       DIAG: tl.constexpr):
    """The pair kernel's block form for the channels o_k of one chunk (OFFDIAG, DIAG: see _bwd_pair_kernel). The
    diagonal blocks' pass stores the finished dq, dk to dq_o, dk_o."""
    o_i = tl.arange(0, BC)
    if OFFDIAG:
        o_t, m_t, rows, m_cc, p_cc, p_ccT = _chunk_rows(t0, L, i_h, HV, C)
        b_dP = tl.load(Pmat + p_cc, mask=m_cc & (o_t[:, None] >= o_t[None, :]), other=0.)          # dP [C, C]
        b_dPt = tl.load(Pmat + p_ccT, mask=m_cc, other=0.)                                          # dPᵀ
        b_dA = tl.load(Amat + p_cc, mask=m_cc, other=0.)                                            # dA (strict lower)
        b_dAt = tl.load(Amat + p_ccT, mask=m_cc, other=0.)                                          # dAᵀ
        b_beta = tl.load(beta + rows * HV + i_h, mask=m_t, other=0.).to(tl.float32)
        m_tk, p_tk, p_hk = _col_offsets(rows, m_t, o_k, m_k, i_h, i_hk, H, HV, K)
        b_q = tl.load(q + p_tk, mask=m_tk, other=0.).to(tl.float32)
        b_k = tl.load(k + p_tk, mask=m_tk, other=0.).to(tl.float32)
        b_kb = b_k * b_beta[:, None]
        b_Gh = _load_gate_cols(G, t0, L, i_h, o_k, m_k, HV, K, C)[0]
        b_dqp, b_dkp, b_dkb = _pairwise_grads_channel(b_dP, b_dPt, b_dA, b_dAt, b_q, b_k, b_kb, b_Gh, C, BC, PREC)
        b_dq = tl.load(dq + p_hk, mask=m_tk, other=0.) + b_dqp
        tl.store(dq + p_hk, b_dq, mask=m_tk)
        b_dGm = tl.load(dG + p_hk, mask=m_tk, other=0.) + b_q * b_dq + b_kb * b_dkb - b_k * b_dkp
        tl.store(dG + p_hk, b_dGm, mask=m_tk)
        tl.store(dk + p_hk, tl.load(dk + p_hk, mask=m_tk, other=0.) + b_dkp + b_beta[:, None] * b_dkb, mask=m_tk)
        tl.store(dbp + i_kb.to(tl.int64) * s_dbp + rows * HV + i_h, tl.sum(b_k * b_dkb, axis=1), mask=m_t)
        tl.debug_barrier()      # the diagonal blocks below read these rows back (other threads wrote them)
    if DIAG:
        b_carry = tl.zeros([BKP], dtype=tl.float32)
        for ii in tl.static_range(C // BC):
            ib = C // BC - 1 - ii
            o_r = ib * BC + o_i
            m_r = o_r < L
            rows = (t0 + o_r).to(tl.int64)
            m_rk, p_tk, p_hk = _col_offsets(rows, m_r, o_k, m_k, i_h, i_hk, H, HV, K)
            b_q = tl.load(q + p_tk, mask=m_rk, other=0.).to(tl.float32)
            b_k = tl.load(k + p_tk, mask=m_rk, other=0.).to(tl.float32)
            b_G = tl.load(G + p_hk, mask=m_rk, other=0.)
            b_G = tl.where(m_r[:, None], b_G, b_last[None, :])
            b_beta = tl.load(beta + rows * HV + i_h, mask=m_r, other=0.).to(tl.float32)
            b_kb = b_k * b_beta[:, None]
            b_xr, b_xc, fast = _diag_factors(b_G, span_max)
            if fast:
                # Γ_ij = xr_i xc_j: dq_i = xr_i Σ_j dP_ij xc_j k_j, dk_j = xc_j Σ_i (dP_ij q_i + dA_ij βk_i) xr_i
                p_bb = (rows[:, None] * HV + i_h) * C + o_r[None, :]
                m_bb = (m_r[:, None] & m_r[None, :]) & (o_i[:, None] >= o_i[None, :])
                b_dPb = tl.load(Pmat + p_bb, mask=m_bb, other=0.)                                  # [BC, BC]
                b_kc = b_k * b_xc
                b_dqd = _mm(b_dPb, b_kc, PREC) * b_xr                                            # [BC, BC] @ [BC, BKP]
                b_dkd = _mm(tl.trans(b_dPb), b_q * b_xr, PREC)                                   # [BC, BC] @ [BC, BKP]
                b_dAb = tl.load(Amat + p_bb, mask=m_bb, other=0.)
                b_dkbd = _mm(b_dAb, b_kc, PREC) * b_xr                                           # [BC, BC] @ [BC, BKP]
                b_dkd += _mm(tl.trans(b_dAb), b_kb * b_xr, PREC)                                 # [BC, BC] @ [BC, BKP]
                b_dkd = b_dkd * b_xc
            else:
                b_dqd, b_dkbd, b_dkd = _diag_grads_exact(k, G, Pmat, Amat, b_q, b_kb, b_G, b_last, t0, L, ib, rows, m_r,
                                                         i_h, i_hk, o_k, m_k, H, HV, K, BKP, C, BC)
            b_dGd = b_q * b_dqd + b_kb * b_dkbd - b_k * b_dkd
            tl.store(dq_o + p_hk, (tl.load(dq + p_hk, mask=m_rk, other=0.) + b_dqd).to(dq_o.dtype.element_ty),
                     mask=m_rk)
            tl.store(dk_o + p_hk, (tl.load(dk + p_hk, mask=m_rk, other=0.) + b_dkd + b_beta[:, None] * b_dkbd).to(
                dk_o.dtype.element_ty), mask=m_rk)
            b_dbd = tl.sum(b_k * b_dkbd, axis=1)
            if OFFDIAG:
                b_dbd += tl.load(dbp + i_kb.to(tl.int64) * s_dbp + rows * HV + i_h, mask=m_r, other=0.)
            tl.store(dbp + i_kb.to(tl.int64) * s_dbp + rows * HV + i_h, b_dbd, mask=m_r)
            b_dG = tl.load(dG + p_hk, mask=m_rk, other=0.) + b_dGd
            b_tot = tl.sum(b_dG, axis=0)
            b_dg = b_tot[None, :] - tl.cumsum(b_dG, axis=0) + b_dG + b_carry[None, :]             # reverse cumsum
            b_carry += b_tot
            tl.store(dG + p_hk, b_dg, mask=m_rk)


@triton.jit
def _bwd_pair_kernel(q, k, beta, G, Pmat, Amat, dq, dk, dbp, dG, dq_o, dk_o, flag, cu_seqlens, chunk_indices, T, s_dbp,
                     H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BKP: tl.constexpr, C: tl.constexpr,
                     BC: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
                     span_max: tl.constexpr, OFFDIAG: tl.constexpr, DIAG: tl.constexpr = True,
                     ONE_REF: tl.constexpr = 1, FITB: tl.constexpr = 16):
    """After the WY pass: the gradients through the pairwise products P and A (dP, dA in Pmat, Amat), added to dq, dk
    (fp32), the finished sums stored to dq_o, dk_o (dq, dk themselves, or the gradients in their own dtype), and to
    dG, which then becomes dg (reverse cumsum over the chunk). Everything here is local to a key channel, so each
    program takes one block of BKP channels (grid (chunks, B·HV, channel blocks)). Three launches, by ONE_REF:

        1: one program per chunk over every channel block in turn (dP, dA loaded once): a block whose chunk gate
           stays within ±span_max of r = G_last / 2 does all of it (both parts and the reverse cumsum) with four
           [C, C] x [C, BKP] products of e^{±(G − r)}-scaled operands (_pair_grads_one_ref); it flags the others
           (flag, int32 [chunks, B·HV, cdiv(K, FITB)], FITB the first launch's BKP);
        2: the block form for the flagged blocks (the others return at once): OFFDIAG, the blocks off the 16×16
           diagonal on whole [C, BKP] tiles (_pairwise_grads_channel); DIAG, then the diagonal blocks, last to first,
           with four products of factored operands when a block's gates span less than 2 span_max (_diag_factors),
           else the exact column loop (rare), and the reverse cumsum;
        3: where launch 2 leaves DIAG out (more than one channel block), the diagonal blocks over all channels, for
           the channels of the flagged blocks (the block form's registers stay out of the one-reference launch,
           and the diagonal part's out of the off-diagonal one).

    dβ's share of each channel block goes to dbp[i_kb] (fp32 [NKB, B·T·HV], summed by the launcher: no atomics, so
    the result does not depend on the order of the programs)."""
    i_t, i_bh, i_kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NKF: tl.constexpr = (K + FITB - 1) // FITB        # the flags' channel blocks (the ONE_REF 1 launch's, FITB wide)
    p_flag = flag + (i_t.to(tl.int64) * tl.num_programs(1) + i_bh) * NKF
    if ONE_REF == 2:
        if tl.load(p_flag + i_kb) == 0:
            return
    i_b, i_h = i_bh // HV, i_bh % HV
    i_hk = i_h // (HV // H)
    t0, L, _ = _chunk_bounds(i_t, i_b, cu_seqlens, chunk_indices, T, C, IS_VARLEN)
    o_k = i_kb * BKP + tl.arange(0, BKP)
    m_k = o_k < K
    b_last = tl.load(G + ((t0 + L - 1).to(tl.int64) * HV + i_h) * K + o_k, mask=m_k, other=0.)
    if ONE_REF == 1:
        o_t, m_t, rows, m_cc, p_cc, p_ccT = _chunk_rows(t0, L, i_h, HV, C)
        b_dP = tl.load(Pmat + p_cc, mask=m_cc & (o_t[:, None] >= o_t[None, :]), other=0.)           # dP [C, C]
        b_beta = tl.load(beta + rows * HV + i_h, mask=m_t, other=0.).to(tl.float32)
        b_dA = tl.load(Amat + p_cc, mask=m_cc & (o_t[:, None] > o_t[None, :]), other=0.)            # dA [C, C]
        for i_kc in range(tl.cdiv(K, BKP)):
            i_kb2 = i_kb + i_kc
            o_k2 = i_kb2 * BKP + tl.arange(0, BKP)
            m_k2 = o_k2 < K
            b_d = _ref_offsets(G, t0, L, i_h, o_k2, m_k2, HV, K, C)                             # [C, BKP]
            fits = _ref_span(b_d) < span_max
            tl.store(p_flag + i_kb2, (fits == 0).to(tl.int32))
            if fits:
                b_db = _pair_grads_one_ref(q, k, dq, dk, dG, dq_o, dk_o, b_dP, tl.trans(b_dP), b_dA, tl.trans(b_dA),
                                           b_beta, b_d, rows, m_t, o_k2, m_k2, i_h, i_hk, H, HV, K, PREC)
                tl.store(dbp + i_kb2.to(tl.int64) * s_dbp + rows * HV + i_h, b_db, mask=m_t)
    elif ONE_REF == 2:
        _pair_grads_blocks(q, k, beta, G, Pmat, Amat, dq, dk, dbp, dG, dq_o, dk_o, t0, L, i_h, i_hk, i_kb, o_k,
                           m_k, b_last, s_dbp, H, HV, K, BKP, C, BC, PREC, span_max, OFFDIAG, DIAG)
    else:
        # the channels of the FITB-channel blocks that fit one reference (the same test, block by block) were finished
        # by the first launch; its flags say whether any block of this chunk is left before the gate is read
        o_f = tl.arange(0, BKP // FITB)
        missed = tl.sum(tl.load(p_flag + o_f, mask=o_f < NKF, other=0), axis=0) > 0
        b_fit = tl.full([BKP], 1, tl.int1)
        if missed:
            b_a = tl.max(tl.abs(_ref_offsets(G, t0, L, i_h, o_k, m_k, HV, K, C)), axis=0)            # [BKP]
            b_blk = tl.max(tl.reshape(b_a, [BKP // FITB, FITB]), axis=1)                     # [BKP / FITB]
            b_fit = tl.reshape(tl.broadcast_to(b_blk[:, None], [BKP // FITB, FITB]), [BKP]) < span_max
        if tl.max(tl.where(b_fit, 0, 1), axis=0) > 0:
            _pair_grads_blocks(q, k, beta, G, Pmat, Amat, dq, dk, dbp, dG, dq_o, dk_o, t0, L, i_h, i_hk, i_kb, o_k,
                               m_k & (b_fit == 0), b_last, s_dbp, H, HV, K, BKP, C, BC, PREC, span_max, OFFDIAG, DIAG)
        else:     # every block done by the first launch: this launch's share of dβ is 0
            o_t, m_t, rows, m_cc, p_cc, p_ccT = _chunk_rows(t0, L, i_h, HV, C)
            tl.store(dbp + i_kb.to(tl.int64) * s_dbp + rows * HV + i_h, tl.zeros([C], dtype=tl.float32), mask=m_t)


# ------------------------------------------------------------------------------------------------
# launchers
# ------------------------------------------------------------------------------------------------

def pair_grads(q, k, beta, G, Pmat, Amat, dq, dk, dbeta, dG, dq_o, dk_o, p, plan):
    """The pair kernel's launches (_bwd_pair_kernel) in plan.pair_bk channel blocks: adds the pairwise gradients to
    dq, dk (stored finished to dq_o, dk_o), dG (then dg) and dβ."""
    nkb = cdiv(p.K, plan.pair_bk)
    split_diag = nkb > 1        # the diagonal blocks in a launch of their own over all channels
    rows = p.B * p.T * p.HV
    dbp = p.alloc(nkb + split_diag, rows)                # dβ's shares by channel block
    flag = torch.empty(p.NT * p.B * p.HV * nkb, dtype=torch.int32, device=q.device)
    args = (q, k, beta, G, Pmat, Amat, dq, dk, dbp, dG, dq_o, dk_o)
    common = dict(flag=flag, s_dbp=rows, H=p.H, HV=p.HV, K=p.K, C=p.C, BC=BC, IS_VARLEN=p.varlen, PREC=plan.prec,
                  span_max=SPAN_MAX, FITB=plan.pair_bk, num_warps=plan.num_warps, num_stages=plan.num_stages,
                  **p.chunks)
    _bwd_pair_kernel[(p.NT, p.B * p.HV, 1)](*args, BKP=plan.pair_bk, OFFDIAG=True, DIAG=True, ONE_REF=1, **common)
    _bwd_pair_kernel[(p.NT, p.B * p.HV, nkb)](*args, BKP=plan.pair_bk, OFFDIAG=True, DIAG=not split_diag, ONE_REF=2,
                                              **common)
    if split_diag:
        args = args[:8] + (dbp[nkb:],) + args[9:]
        _bwd_pair_kernel[(p.NT, p.B * p.HV, 1)](*args, BKP=p.BK, OFFDIAG=False, DIAG=True, ONE_REF=3, **common)
    dbeta += dbp.view(-1, p.B, p.T, p.HV).sum(0)
