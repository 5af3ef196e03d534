"""The backward's state-tile pass: everything that reads the chunks' states S (h) and their gradients dS' (dh),
read once per chunk and key column block (docs/design.md, section 6)::

    dQg = scale dO Sᵀ,   dK_end = R dS'ᵀ,   dW = −dR Sᵀ,   dγ = Σ_v S ⊙ dS',   dP = scale tril(dO Rᵀ) ⊙ Γ

and from them dq (final), dk's state and P terms (dk1, finished by the WY pass) and the scalar gate's per-row
shares; with KDA's per-channel gate the WY form's column-local terms instead of the pairwise ones (those are
bwd_kda's). Grouped value heads then sum their dq / dk over each group (group_sum).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bwd_states import _chunk_bounds, _chunk_rows, _col_offsets, _gate_factors, _load_gate, _load_gate_cols
from .common import _exp, _mm, _mm_acc, cdiv, next_pow2


@triton.jit
def _state_tiles_own(h, dh, p_h, o_k, o_v, m_kv, V: tl.constexpr):
    """S and dS' at key rows o_k, value columns o_v ([BK, BV] each), loaded for an elementwise use only.

    Not the tiles the same loop feeds to products: triton 3.6's pipeliner gives a loaded tile that feeds both an
    async wgmma and a register load the register load's buffer count (triton #6691, PR #7110), so the copy of a later
    iteration overwrote S / dS' while an unwaited product still read them (gradients that changed from run to run on
    sm_90). A different cache modifier keeps CSE from merging the loads."""
    p = p_h + o_k[:, None] * V + o_v[None, :]
    return (tl.load(h + p, mask=m_kv, other=0., cache_modifier=".cg"),
            tl.load(dh + p, mask=m_kv, other=0., cache_modifier=".cg"))


@triton.jit
def _mm_split16(acc, a, b, PREC: tl.constexpr):
    """acc + a @ b for an fp32 a [M, N] and a 16-bit b [N, P], as two products with 16-bit operands: a = hi + lo, hi
    its rounding to b's dtype, lo the rounding of the rest (a's 24-bit significand kept to ~16 bits, finer than
    tf32's 11; fp32 accumulation). For bf16 (fp16's narrow range would overflow or flush the parts). Both products
    accumulate into acc (_mm_acc)."""
    a_hi = a.to(b.dtype)
    a_lo = (a - a_hi.to(tl.float32)).to(b.dtype)
    return _mm_acc(_mm_acc(acc, a_hi, b, PREC), a_lo, b, PREC)                                 # [M, N] @ [N, P]


@triton.jit
def _bwd_dqk_kernel(q, k, v, G, h, dh, R, dR, do, dq, dk1, dW, dGp, Tmat, beta, dTp, dbs, cu_seqlens,
                    chunk_indices, T, scale,
                    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr, C: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr,
                    IS_VARLEN: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr = 0, EARLY: tl.constexpr = 0,
                    SDS_OWN: tl.constexpr = 1, FULL: tl.constexpr = 0):
    """Scalar / no gate, one program per (key column block of BK, chunk, value head); everything that needs the
    chunk's state tiles h (S) and dh (dS'), read once::

        V loop:  dP = dO Rᵀ,  dPᵀ = R dOᵀ  ([C, C]),  dQg = dO Sᵀ,  dK_end = R dS'ᵀ,  dW = −dR Sᵀ  ([C, BK])
        dP ← scale tril(dP) ⊙ Γ  (dPᵀ alike: it is a product of its own, never tl.trans of an accumulator, fla #640)
        dq  = scale dQg ⊙ e^G + dP K                       -> dq (final)
        dk1 = dK_end ⊙ e^{G_last − G} + dPᵀ Q              -> dk1 (the WY pass adds the rest) or dk (no delta)
        dW                                                 -> dW (the WY pass's product operand dtype)
        scalar gate: Σ_k (q ⊙ dq − k ⊙ dk1) per row, + dG_last's share (Σ k ⊙ dK_end e^{..} + e^{G_last} Σ S ⊙ dS')
                     on the last row                       -> dGp[i_k] (summed over column blocks by the WY pass)

    R: R = U − W S with the delta rule, V without. LOWP: 0, the pairwise products (dP, dPᵀ with k, q) from fp32
    operands at PREC; 4, from 16-bit q, k with dP / dPᵀ split into two 16-bit parts (_mm_split16: ~16 significant
    bits of dP against tf32's 11, two bf16 products in the time of one tf32 product). EARLY: q, k and the gate are
    loaded before the V loop (their latency under it), else after it. dk1 in the 16-bit input dtype is then rounded
    twice with the WY pass's terms, as fla's dk is.
    SDS_OWN (gates): ⟨S, dS'⟩ from loads of S and dS' of their own (_state_tiles_own); 0 (delta rule): from the
    product tiles, with dW's product issued last, whose wait (its result is used at once) finishes dq's and dk's
    products before the loop's next copies into those tiles' buffers.

    Per-channel gate (GATE 2, KDA): no pairwise products here (dP, dA and their gradients are the WY pass's and
    bwd_kda's), but the WY form's column-local terms, since this program holds its columns' whole dW
    (LOWP 2: the products of T, dW and X from 16-bit operands)::

        dX = Tᵀ dW,  X = β K ⊙ e^G
        dk1 = dK_end ⊙ e^{G_last − G} + β e^G ⊙ dX                  -> dk1 (fp32, the pair kernel finishes it)
        dG  = −k ⊙ dK_end e^{..} + X ⊙ dX, + on the last row Σ_t k ⊙ dK_end e^{..} + e^{G_last} Σ_v S ⊙ dS'
                                                                     -> dGp ([B, T, HV, K] per channel)
        dq  = scale dQg ⊙ e^G                                        -> dq (fp32, likewise)
        dT's share dW Xᵀ -> dTp[i_k] ([NK, B, T, HV, C] fp32), dβ's share Σ_k K e^G ⊙ dX -> dbs[i_k] ([NK, B, T, HV])
    dW is not stored then."""
    NK: tl.constexpr = (K + BK - 1) // BK
    i_k, i_t = tl.program_id(0) % NK, tl.program_id(0) // NK
    i_bh = tl.program_id(1)
    i_b, i_h = i_bh // HV, i_bh % HV
    i_hk = i_h // (HV // H)
    t0, L, i_g = _chunk_bounds(i_t, i_b, cu_seqlens, chunk_indices, T, C, IS_VARLEN, FULL)
    o_t, m_t, rows, m_cc, p_cc, p_ccT = _chunk_rows(t0, L, i_h, HV, C)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    p_h = (i_g * HV + i_h).to(tl.int64) * K * V
    m_tk, p_tk, p_hk = _col_offsets(rows, m_t, o_k, m_k, i_h, i_hk, H, HV, K)
    if EARLY:
        b_q0 = tl.load(q + p_tk, mask=m_tk, other=0.)
        b_k0 = tl.load(k + p_tk, mask=m_tk, other=0.)
        if GATE == 1:
            b_G, b_last = _load_gate(G, t0, L, i_h, HV, K, BK, C, False)
        elif GATE == 2:
            b_G, b_last = _load_gate_cols(G, t0, L, i_h, o_k, m_k, HV, K, C)
    b_dq = tl.zeros([C, BK], dtype=tl.float32)
    b_dk = tl.zeros([C, BK], dtype=tl.float32)
    b_dw = tl.zeros([C, BK], dtype=tl.float32)
    b_dP = tl.zeros([C, C], dtype=tl.float32)
    b_dPt = tl.zeros([C, C], dtype=tl.float32)
    b_dgam = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_kv = m_k[:, None] & m_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        p_tv = (rows[:, None] * HV + i_h) * V + o_v[None, :]
        if GATE > 0 and SDS_OWN:   # for ⟨S, dS'⟩, loaded first: their latency under the products
            b_Sr, b_dSr = _state_tiles_own(h, dh, p_h, o_k, o_v, m_kv, V)
        b_do = tl.load(do + p_tv, mask=m_tv, other=0.)
        b_S = tl.load(h + p_h + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)          # [BK, BV]
        b_dSn = tl.load(dh + p_h + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        if DELTA:
            b_R = tl.load(R + p_tv, mask=m_tv, other=0.)
            b_dR = tl.load(dR + p_tv, mask=m_tv, other=0.)
        else:
            b_R = tl.load(v + p_tv, mask=m_tv, other=0.)
        if GATE != 2:
            b_dP += _mm(b_do, tl.trans(b_R), PREC)                                          # [C, BV] @ [BV, C]
            b_dPt += _mm(b_R, tl.trans(b_do), PREC)                                         # [C, BV] @ [BV, C]
        b_dq += _mm(b_do, tl.trans(b_S), PREC)                                              # [C, BV] @ [BV, BK]
        b_dk += _mm(b_R, tl.trans(b_dSn), PREC)                                             # [C, BV] @ [BV, BK]
        if DELTA:   # last: its result is used at once, so its wait also covers dq's and dk's reads of S / dS'
            b_dw -= _mm(b_dR, tl.trans(b_S), PREC)                                          # [C, BV] @ [BV, BK]
        if GATE > 0:
            if SDS_OWN:
                b_dgam += tl.sum(b_Sr.to(tl.float32) * b_dSr.to(tl.float32), axis=1)
            else:       # the product tiles, read once every product that reads them has finished (SDS_OWN)
                b_dgam += tl.sum(b_S.to(tl.float32) * b_dSn.to(tl.float32), axis=1)
    if DELTA and GATE != 2:
        tl.store(dW + p_hk, b_dw.to(dW.dtype.element_ty), mask=m_tk)
    if EARLY:
        b_q, b_k = b_q0.to(tl.float32), b_k0.to(tl.float32)
    elif LOWP == 4:     # (the split products take them in 16 bits)
        b_q0 = tl.load(q + p_tk, mask=m_tk, other=0.)
        b_k0 = tl.load(k + p_tk, mask=m_tk, other=0.)
        b_q, b_k = b_q0.to(tl.float32), b_k0.to(tl.float32)
    else:
        b_q = tl.load(q + p_tk, mask=m_tk, other=0.).to(tl.float32)
        b_k = tl.load(k + p_tk, mask=m_tk, other=0.).to(tl.float32)
    i_ge_j = o_t[:, None] >= o_t[None, :]
    if GATE == 2:   # the pairwise parts are the pair kernel's; ordered so that few [C, BK] tiles are live at once
        OPD: tl.constexpr = q.dtype.element_ty if LOWP else tl.float32
        s_p = tl.num_programs(1).to(tl.int64) * T                                               # B·HV·T
        b_dwo = b_dw.to(OPD)
        if not EARLY:
            b_G, b_last = _load_gate_cols(G, t0, L, i_h, o_k, m_k, HV, K, C)
        # tl.exp, not _exp's ex2.approx.ftz: this pass measured slower with it on sm_90 (fewer instructions)
        b_eG = tl.exp(b_G)
        tl.store(dq + p_hk, b_dq * scale * b_eG, mask=m_tk)
        b_dk = b_dk * tl.exp(b_last[None, :] - b_G)                             # a: the state part
        b_Tt = tl.load(Tmat + p_ccT, mask=m_cc & (o_t[None, :] >= o_t[:, None]), other=0.).to(OPD)   # Tᵀ
        b_dx = _mm(b_Tt, b_dwo, PREC)                                                          # [C, C] @ [C, BK]
        b_beta = tl.load(beta + rows * HV + i_h, mask=m_t, other=0.).to(tl.float32)
        b_ke = b_k * b_eG
        tl.store(dbs + i_k * s_p + rows * HV + i_h, tl.sum(b_ke * b_dx, axis=1), mask=m_t)
        b_dx = b_dx * b_eG * b_beta[:, None]                                                   # b = β e^G dX
        b_dlast = tl.sum(b_k * b_dk, axis=0) + tl.exp(b_last) * b_dgam                         # [BK]
        tl.store(dk1 + p_hk, (b_dk + b_dx).to(dk1.dtype.element_ty), mask=m_tk)
        tl.store(dGp + p_hk, b_k * (b_dx - b_dk) + tl.where((o_t == L - 1)[:, None], b_dlast[None, :], 0.), mask=m_tk)
        b_dTp = _mm(b_dwo, tl.trans((b_ke * b_beta[:, None]).to(OPD)), PREC)                   # dW Xᵀ [C, BK] @ [BK, C]
        tl.store(dTp + i_k * (s_p * C) + p_cc, b_dTp, mask=m_cc)
    else:
        if GATE == 1:
            if not EARLY:
                b_G, b_last = _load_gate(G, t0, L, i_h, HV, K, BK, C, False)
            b_eG, b_ekend = _gate_factors(b_G, b_last, GATE)
            b_dq = b_dq * scale * b_eG
            b_dk = b_dk * b_ekend
            b_dlast = tl.sum(tl.sum(b_k * b_dk, axis=1), axis=0)
            b_dlast += _exp(b_last) * tl.sum(b_dgam, axis=0)
            b_dP = tl.where(i_ge_j, b_dP * _exp(b_G[:, None] - b_G[None, :]), 0.) * scale
            b_dPt = tl.where(o_t[None, :] >= o_t[:, None], b_dPt * _exp(b_G[None, :] - b_G[:, None]), 0.) * scale
        else:
            b_dq = b_dq * scale
            b_dP = tl.where(i_ge_j, b_dP, 0.) * scale
            b_dPt = tl.where(o_t[None, :] >= o_t[:, None], b_dPt, 0.) * scale
        if LOWP == 4:   # dP, dPᵀ as two 16-bit parts (hi + lo) against 16-bit q, k, summed into a zeroed tile
            b_dq += _mm_split16(tl.zeros([C, BK], dtype=tl.float32), b_dP, b_k0, PREC)          # [C, C] @ [C, BK]
            b_dk += _mm_split16(tl.zeros([C, BK], dtype=tl.float32), b_dPt, b_q0, PREC)         # [C, C] @ [C, BK]
        else:
            b_dq += _mm(b_dP, b_k, PREC)                                                        # [C, C] @ [C, BK]
            b_dk += _mm(b_dPt, b_q, PREC)                                                       # [C, C] @ [C, BK]
        tl.store(dq + p_hk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
        tl.store(dk1 + p_hk, b_dk.to(dk1.dtype.element_ty), mask=m_tk)
        if GATE == 1:
            b_dg = tl.sum(b_q * b_dq - b_k * b_dk, axis=1) + tl.where(o_t == L - 1, b_dlast, 0.)
            tl.store(dGp + i_k * (tl.num_programs(1).to(tl.int64) * T) + rows * HV + i_h, b_dg, mask=m_t)


@triton.jit
def _group_sum_kernel(x, y, n_rows, G: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    """Grouped value heads: y[r, :] = Σ_g x[r, g, :] over a row's G value heads, in fp32, stored in y's dtype.
    x: [n_rows, G, K] (the per-value-head dq or dk in the input dtype or fp32, rows = B·T·H), y: [n_rows, K]. One
    pass: the sum and the cast as two torch launches would write and read back an fp32 [B, T, H, K]."""
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_k = tl.arange(0, BK)
    m = (o_r < n_rows)[:, None] & (o_k < K)[None, :]
    b_y = tl.zeros([BR, BK], dtype=tl.float32)
    for i_g in tl.static_range(G):
        b_y += tl.load(x + (o_r[:, None] * G + i_g) * K + o_k[None, :], mask=m, other=0.).to(tl.float32)
    tl.store(y + o_r[:, None] * K + o_k[None, :], b_y.to(y.dtype.element_ty), mask=m)


# ------------------------------------------------------------------------------------------------
# launchers
# ------------------------------------------------------------------------------------------------

def state_tile_pass(q, k, v, G, h, dh, R, dR, do, dq, dk1, dW, dGp, Tmat, beta, dTp, dbs, scale, p, plan):
    """_bwd_dqk_kernel over every chunk, value head and key column block of plan.dqk_bk (p: the backward's
    Problem)."""
    nk = cdiv(p.K, plan.dqk_bk)
    _bwd_dqk_kernel[(nk * p.NT, p.B * p.HV)](
        q, k, v, G, h, dh, R, dR, do, dq, dk1, dW, dGp, Tmat, beta, dTp, dbs,
        scale=scale, H=p.H, HV=p.HV, K=p.K, V=p.V, BK=plan.dqk_bk, BV=plan.bv, C=p.C, GATE=p.gate, DELTA=p.delta,
        IS_VARLEN=p.varlen, PREC=plan.prec, LOWP=plan.dqk_lowp, EARLY=plan.dqk_early,
        SDS_OWN=not p.delta, FULL=p.full("bwd_dqk", plan), num_warps=plan.num_warps,
        num_stages=plan.num_stages, **p.chunks)


def group_sum(x: torch.Tensor, H: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, HV, K] gradients of the value heads (input dtype or fp32) -> [B, T, H, K] in ``dtype``, summed in fp32
    over each key head's HV / H value heads (_group_sum_kernel)."""
    B, T, HV, K = x.shape
    x = x.contiguous()
    y = torch.empty(B, T, H, K, device=x.device, dtype=dtype)
    n_rows, BR = B * T * H, 16
    _group_sum_kernel[(cdiv(n_rows, BR),)](x, y, n_rows, G=HV // H, K=K, BK=next_pow2(K), BR=BR, num_warps=4)
    return y
