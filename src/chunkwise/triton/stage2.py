"""Stage 2 of the chunk forward: state and output, serial over the chunks of one sequence.

``chunk_state_output_kernel``, grid (V / BV, N·HV), carries S [K, BV] fp32 in registers::

    R = U − W S              (delta)        R = V        (simple GLA)
      = T diag(β) (V − e^G ⊙ K S)            (delta, T_FORM: stage 1 wrote T diag(β))
    O = scale · ((Q ⊙ e^G) S + P R)
    S ← diag(e^{G_last}) S + (K ⊙ e^{G_last − G})ᵀ R

and writes only o (and the final state; in a forward saved for the backward, R): no per-chunk state tensor ever
reaches memory. For a scalar gate or none it can form P itself (``P_IN=False``). Simple GLA launches this stage
alone, and on a batch too small to fill the GPU splits each sequence into segments (its state is linear in the
inputs: each segment's local end state first, then every segment from the earlier ones' states).

Beside stage 1 (``WAIT``): stage 1 runs its grid chunk-major and publishes each chunk (ready[slot, head], release);
stage 2 runs on a high-priority stream that waits for the inputs but not for stage 1, and each step waits for its
chunk (acquire). Stage 1 never waits and is launched first; stage 2's spinning programs hold fewer SMs than the GPU
has, so stage 1 always has one to run on.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .common import (BT, G_FLOOR, INTERPRET, _alloc, _and, _chunk_cut, _dim, _exp, _ensure_allocator,
                     _finite, _first_bad_row, _first_cut, _tile_load, _tile_store, _wait_ready, cdiv)
from .configs import ForwardPlan, Stage2Launch
from .gate import _chunk_decay, _chunk_gate, _step_gate


# ------------------------------------------------------------------------------------------------
# one chunk's step
# ------------------------------------------------------------------------------------------------

@triton.jit
def _state_step(i_t, S, k, v, g, bos, T_seq, i_h, i_hk, i_v, H, HV, K, V, BTc: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, GATE: tl.constexpr, DOT_PREC: tl.constexpr, g_floor: tl.constexpr):
    """One chunk of simple GLA's state alone (no output): S ← e^{G_last} S + (K ⊙ e^{G_last − G})ᵀ V.
    Returns (S, e^{G_last})."""
    o_t = tl.arange(0, BTc)
    t0 = i_t * BTc
    b_k = _tile_load(k, (bos * H + i_hk) * K, T_seq, K, H * K, t0, 0, BTc, BK, 1, 1)
    b_v = _tile_load(v, (bos * HV + i_h) * V, T_seq, V, HV * V, t0, i_v * BV, BTc, BV, 1, 1)
    if GATE == 1:
        Gc = _chunk_gate(g, bos, t0, T_seq, i_h, HV, BTc, g_floor)                    # [BT]
        G_last = tl.sum(tl.where(o_t == BTc - 1, Gc, 0.), 0)
        b_dl = _exp(G_last)
        b_v = (b_v.to(tl.float32) * _exp(G_last - Gc)[:, None]).to(b_k.dtype)
        S = S * b_dl
    else:
        b_dl = tl.full([], 1., tl.float32)
    S += tl.dot(tl.trans(b_k), b_v, input_precision=DOT_PREC)                         # [BK, BT] @ [BT, BV]
    return S, b_dl


@triton.jit
def _tile(x, base, n_rows, n_cols, row_stride, r0, c0, R: tl.constexpr, C: tl.constexpr, TMA: tl.constexpr):
    """Rows r0 .. r0 + R − 1, columns c0 .. c0 + C − 1 of the [n_rows, n_cols] matrix at x + base (row stride
    row_stride), zero outside it. TMA: x is a tensor descriptor of that matrix (made once per program by
    _tma_view; one copy instruction per tile instead of per-thread addresses and masks)."""
    if TMA:
        t = x.load([r0, c0])
    else:
        t = _tile_load(x, base, n_rows, n_cols, row_stride, r0, c0, R, C, 1, 1)
    return t


@triton.jit
def _tma_view(x, base, n_rows, n_cols, row_stride, R: tl.constexpr, C: tl.constexpr, TMA: tl.constexpr):
    """A tensor descriptor of the [n_rows, n_cols] matrix at x + base for [R, C] tiles (TMA), else x itself."""
    if TMA:
        d = tl.make_tensor_descriptor(x + base, [n_rows, n_cols], [row_stride, 1], [R, C])
    else:
        d = x
    return d


@triton.jit
def _store_r(rs, b_R, bos, t0, T_seq, i_h, i_v, HV, V, BTc: tl.constexpr, BV: tl.constexpr, TRANS: tl.constexpr = 0):
    """R [BTc, BV] (TRANS: Rᵀ [BV, BTc]) -> its rows of rs [B, T, HV, V]. Its layout conversion takes a shared-memory
    staging, which the output's store shares when that is not a TMA store (hence no TMA_O where R is stored: with
    both, GDN's training stage 2 left no room for a stage-1 program beside it)."""
    o_v = i_v * BV + tl.arange(0, BV)
    if TRANS:
        o_t = tl.arange(0, BTc)
        tl.store(rs + ((bos + t0 + o_t[None, :]) * HV + i_h) * V + o_v[:, None], b_R.to(rs.dtype.element_ty),
                 mask=(t0 + o_t < T_seq)[None, :] & (o_v < V)[:, None])
    else:
        o_t = t0 + tl.arange(0, BTc)
        tl.store(rs + ((bos + o_t[:, None]) * HV + i_h) * V + o_v[None, :], b_R.to(rs.dtype.element_ty),
                 mask=(o_t < T_seq)[:, None] & (o_v < V)[None, :])


@triton.jit
def _state_output_step(i_t, S, b_gl, q, k, v, w, u, p, g, gcum, qg, kg, o_base, rs, slot0, bos, T_seq, i_h, i_hk,
                       i_v, scale, H, HV, K, V,
                       BTc: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       GATE: tl.constexpr, DELTA: tl.constexpr, P_IN: tl.constexpr, GC_IN: tl.constexpr,
                       DOT_PREC: tl.constexpr, g_floor: tl.constexpr, TMA: tl.constexpr = 0,
                       TMA_O: tl.constexpr = 0, STORE_R: tl.constexpr = 0, T_FORM: tl.constexpr = 0, f=BT,
                       NF: tl.constexpr = 0):
    """One chunk of stage 2: returns the state after chunk i_t, writes its rows of o. b_gl: _chunk_decay's.
    NF (non-finite inputs, docs/design.md): 1, f is the chunk's first row with a non-finite k, v, g or β (stage 1's,
    whose outputs took those as 0); 3 (T_FORM), stage 1's f covers k, g, β and v's cut is found here from the v tile
    stage 2 reads anyway; 2 (simple GLA), f is found here from v (the raw k, g reach only rows >= their own through
    P's where and the gate's cumsum). Whatever meets the triangular products is cut at f by a where; the
    output rows from f on and (f < BTc) the state after the chunk are NaN.
    TMA: q, k, v, w, u, p, qg, kg are _tma_view descriptors; TMA_O: o_base too (the output's stores).
    STORE_R (a forward saved for the backward, delta families): R -> rs [B, T, HV, V] (before any gate scales it), in
    its dtype, from which the backward's forward state pass forms the per-chunk states.
    T_FORM (delta rule): u is stage 1's T diag(β) [B, T, HV, BT], w (per-channel gate only) K ⊙ e^G [B, T, HV, K];
    R = T diag(β) (V − (K ⊙ e^G) S), which is U − W S with U = T diag(β) V, W = T diag(β) (K ⊙ e^G)."""
    o_t = tl.arange(0, BTc)
    t0 = i_t * BTc
    if DELTA and T_FORM:
        b_T = _tile(u, (bos * HV + i_h) * BTc, T_seq, BTc, HV * BTc, t0, 0, BTc, BTc, TMA)
        b_v = _tile(v, (bos * HV + i_h) * V, T_seq, V, HV * V, t0, i_v * BV, BTc, BV, TMA)
        if NF == 3:
            f = tl.minimum(f, _first_bad_row(b_v, BTc))
        if GATE == 2:
            b_kx = _tile(w, (bos * HV + i_h) * K, T_seq, K, HV * K, t0, 0, BTc, BK, TMA)
    elif DELTA:
        b_w = _tile(w, (bos * HV + i_h) * K, T_seq, K, HV * K, t0, 0, BTc, BK, TMA)
        b_u = _tile(u, (bos * HV + i_h) * V, T_seq, V, HV * V, t0, i_v * BV, BTc, BV, TMA)
        b_R = b_u.to(tl.float32) - tl.dot(b_w, S.to(b_w.dtype), input_precision=DOT_PREC)   # [BT, BK] @ [BK, BV]
        if STORE_R:
            _store_r(rs, b_R, bos, t0, T_seq, i_h, i_v, HV, V, BTc, BV)
    else:
        b_R = _tile(v, (bos * HV + i_h) * V, T_seq, V, HV * V, t0, i_v * BV, BTc, BV, TMA).to(tl.float32)
        if NF == 2:
            f = _first_bad_row(b_R, BTc)
            b_R = tl.where(o_t[:, None] < f, b_R, 0.)
    if GATE == 2:
        b_qd = _tile(qg, (bos * HV + i_h) * K, T_seq, K, HV * K, t0, 0, BTc, BK, TMA)
        b_kd = _tile(kg, (bos * HV + i_h) * K, T_seq, K, HV * K, t0, 0, BTc, BK, TMA)
        b_dl = b_gl[:, None]
    else:
        b_q = _tile(q, (bos * H + i_hk) * K, T_seq, K, H * K, t0, 0, BTc, BK, TMA)
        b_k = _tile(k, (bos * H + i_hk) * K, T_seq, K, H * K, t0, 0, BTc, BK, TMA)
        if GATE == 1:
            Gc, b_dl, b_eg, b_ek = _step_gate(g, gcum, b_gl, slot0 + i_t, bos, t0, T_seq, i_h, HV, BTc, GC_IN, g_floor)
        b_qd = b_q
        b_kd = b_k
    if DELTA and T_FORM:
        if GATE == 2:
            b_Z = tl.dot(b_kx, S.to(b_kx.dtype), input_precision=DOT_PREC)         # [BT, BK] @ [BK, BV]
        else:
            b_Z = tl.dot(b_k, S.to(b_k.dtype), input_precision=DOT_PREC)           # [BT, BK] @ [BK, BV]
        if GATE == 1:
            b_Z = b_Z * b_eg[:, None]
        b_Z = b_v.to(tl.float32) - b_Z
        if NF:
            b_Z = tl.where(o_t[:, None] < f, b_Z, 0.)
        b_R = tl.dot(b_T, b_Z.to(b_T.dtype), input_precision=DOT_PREC)              # [BT, BT] @ [BT, BV]
        if STORE_R:
            _store_r(rs, b_R, bos, t0, T_seq, i_h, i_v, HV, V, BTc, BV)
    if P_IN:
        b_P = _tile(p, (bos * HV + i_h) * BTc, T_seq, BTc, HV * BTc, t0, 0, BTc, BTc, TMA)
    else:
        b_P = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)              # [BT, BK] @ [BK, BT]
        if GATE == 1:
            b_P = tl.where(o_t[:, None] >= o_t[None, :],
                           b_P * _exp(tl.where(o_t[:, None] >= o_t[None, :], Gc[:, None] - Gc[None, :], float("-inf"))),
                           0.)
        else:
            b_P = tl.where(o_t[:, None] >= o_t[None, :], b_P, 0.)
        b_P = b_P.to(b_q.dtype)
    b_Rd = b_R.to(b_qd.dtype)
    # scalar gate: q and k reach the tensor cores unscaled; the decays scale rows of the products in fp32
    b_o = tl.dot(b_qd, S.to(b_qd.dtype), input_precision=DOT_PREC)               # [BT, BK] @ [BK, BV]
    if GATE == 1:
        b_o = b_o * b_eg[:, None]
    b_o += tl.dot(b_P.to(b_qd.dtype), b_Rd, input_precision=DOT_PREC)             # [BT, BT] @ [BT, BV]
    if NF:
        b_o = tl.where(o_t[:, None] < f, b_o, float("nan"))
    if TMA_O:       # o_base: a descriptor of this sequence's rows (the copy stops at its end)
        o_base.store([t0, i_v * BV], (b_o * scale).to(o_base.dtype))
    else:
        _tile_store(o_base, 0, T_seq, V, HV * V, t0, i_v * BV, b_o * scale, BTc, BV, 1, 1)
    # (NF: the state's NaN comes through a factor formed off its chain where the gate has one)
    if GATE == 1:
        S = S * b_dl
        if NF:
            b_ek = tl.where(o_t < f, b_ek, float("nan"))
        b_Rd = (b_R * b_ek[:, None]).to(b_qd.dtype)
    elif GATE == 2:
        if NF:
            b_dl = tl.where(f < BTc, float("nan"), b_gl)[:, None]
        S = S * b_dl
    S += tl.dot(tl.trans(b_kd), b_Rd, input_precision=DOT_PREC)                  # [BK, BT] @ [BT, BV]
    if NF and GATE == 0:
        S = tl.where(f < BTc, float("nan"), S)
    return S


@triton.jit
def _state_output_step_t(i_t, St, b_gl, q, k, v, w, u, p, g, gcum, qg, kg, o_base, rs, slot0, bos, T_seq, i_h,
                         i_hk, i_v, scale, H, HV, K, V,
                         BTc: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         GATE: tl.constexpr, P_IN: tl.constexpr, GC_IN: tl.constexpr,
                         DOT_PREC: tl.constexpr, g_floor: tl.constexpr, TMA: tl.constexpr = 0,
                         TMA_O: tl.constexpr = 0, STORE_R: tl.constexpr = 0, T_FORM: tl.constexpr = 0, f=BT,
                         NF: tl.constexpr = 0):
    """_state_output_step on the transposed state St = Sᵀ [BV, BK] (TRANS): every product takes St or Rᵀ, values
    in registers, as its first operand and a loaded tile as its second, so nothing on the state's chain is staged
    through shared memory, and at BV < 64 the products are warp-level (mma v2) ones the compiler can overlap::

        Rᵀ = Uᵀ − Sᵀ Wᵀ                                 [BV, C]
        oᵀ = scale · (Sᵀ (Q ⊙ e^G)ᵀ + Rᵀ Pᵀ)             [BV, C]
        Sᵀ = e^{G_last} Sᵀ + Rᵀ (K ⊙ e^{G_last − G})     [BV, K]

    The delta rule only. T_FORM: Rᵀ = (Vᵀ − Sᵀ (K ⊙ e^G)ᵀ) (T diag(β))ᵀ, both products with a register first operand."""
    o_t = tl.arange(0, BTc)
    t0 = i_t * BTc
    if T_FORM:
        b_T = _tile(u, (bos * HV + i_h) * BTc, T_seq, BTc, HV * BTc, t0, 0, BTc, BTc, TMA)
        b_v = _tile(v, (bos * HV + i_h) * V, T_seq, V, HV * V, t0, i_v * BV, BTc, BV, TMA)
        if NF == 3:
            f = tl.minimum(f, _first_bad_row(b_v, BTc))
        if GATE == 2:
            b_kx = _tile(w, (bos * HV + i_h) * K, T_seq, K, HV * K, t0, 0, BTc, BK, TMA)
        else:
            b_kx = _tile(k, (bos * H + i_hk) * K, T_seq, K, H * K, t0, 0, BTc, BK, TMA)
        b_Zt = tl.dot(St.to(b_kx.dtype), tl.trans(b_kx), input_precision=DOT_PREC)      # [BV, BK] @ [BK, BT]
        if GATE == 1:
            Gc, b_dl, b_eg, b_ek = _step_gate(g, gcum, b_gl, slot0 + i_t, bos, t0, T_seq, i_h, HV, BTc, GC_IN, g_floor)
            b_Zt = b_Zt * b_eg[None, :]
        b_Zt = tl.trans(b_v).to(tl.float32) - b_Zt
        if NF:
            b_Zt = tl.where(o_t[None, :] < f, b_Zt, 0.)
        b_Rt = tl.dot(b_Zt.to(b_T.dtype), tl.trans(b_T), input_precision=DOT_PREC)      # [BV, BT] @ [BT, BT]
        if STORE_R:
            _store_r(rs, b_Rt, bos, t0, T_seq, i_h, i_v, HV, V, BTc, BV, True)
    else:
        b_w = _tile(w, (bos * HV + i_h) * K, T_seq, K, HV * K, t0, 0, BTc, BK, TMA)
        b_u = _tile(u, (bos * HV + i_h) * V, T_seq, V, HV * V, t0, i_v * BV, BTc, BV, TMA)
        b_Rt = tl.trans(b_u).to(tl.float32) - tl.dot(St.to(b_w.dtype), tl.trans(b_w),
                                                     input_precision=DOT_PREC)     # [BV, BK] @ [BK, BT]
        if STORE_R:
            _store_r(rs, b_Rt, bos, t0, T_seq, i_h, i_v, HV, V, BTc, BV, True)
    if GATE == 2:
        b_qd = _tile(qg, (bos * HV + i_h) * K, T_seq, K, HV * K, t0, 0, BTc, BK, TMA)
        b_kd = _tile(kg, (bos * HV + i_h) * K, T_seq, K, HV * K, t0, 0, BTc, BK, TMA)
    else:
        b_qd = _tile(q, (bos * H + i_hk) * K, T_seq, K, H * K, t0, 0, BTc, BK, TMA)
        b_kd = _tile(k, (bos * H + i_hk) * K, T_seq, K, H * K, t0, 0, BTc, BK, TMA)
        if GATE == 1 and not T_FORM:
            Gc, b_dl, b_eg, b_ek = _step_gate(g, gcum, b_gl, slot0 + i_t, bos, t0, T_seq, i_h, HV, BTc, GC_IN, g_floor)
    if P_IN:
        b_Pt = tl.trans(_tile(p, (bos * HV + i_h) * BTc, T_seq, BTc, HV * BTc, t0, 0, BTc, BTc, TMA))
    else:
        tl.static_assert(GATE == 0, "the transposed step forms P without a gate only (GDN, KDA: P from stage 1)")
        b_Pt = tl.dot(b_kd, tl.trans(b_qd), input_precision=DOT_PREC)            # [BT, BK] @ [BK, BT] = Pᵀ
        b_Pt = tl.where(o_t[:, None] <= o_t[None, :], b_Pt, 0.)
        b_Pt = b_Pt.to(b_qd.dtype)
    b_ot = tl.dot(St.to(b_qd.dtype), tl.trans(b_qd), input_precision=DOT_PREC)    # [BV, BK] @ [BK, BT]
    if GATE == 1:
        b_ot = b_ot * b_eg[None, :]
    b_ot += tl.dot(b_Rt.to(b_qd.dtype), b_Pt.to(b_qd.dtype), input_precision=DOT_PREC)   # [BV, BT] @ [BT, BT]
    b_o = tl.trans(b_ot * scale)
    if NF:
        b_o = tl.where(o_t[:, None] < f, b_o, float("nan"))
    if TMA_O:
        o_base.store([t0, i_v * BV], b_o.to(o_base.dtype))
    else:
        _tile_store(o_base, 0, T_seq, V, HV * V, t0, i_v * BV, b_o, BTc, BV, 1, 1)
    if GATE == 1:
        St = St * b_dl
        if NF:
            b_ek = tl.where(o_t < f, b_ek, float("nan"))
        b_Rt = b_Rt * b_ek[None, :]
    elif GATE == 2:
        b_glf = b_gl
        if NF:
            b_glf = tl.where(f < BTc, float("nan"), b_gl)
        St = St * b_glf[None, :]
    St += tl.dot(b_Rt.to(b_qd.dtype), b_kd, input_precision=DOT_PREC)             # [BV, BT] @ [BT, BK]
    if NF and GATE == 0:
        St = tl.where(f < BTc, float("nan"), St)
    return St


@triton.jit
def _state_output_chunk(i_t, S, b_gl, q, k, v, w, u, p, g, gcum, qg, kg, o_base, rs, slot0, bos, T_seq, i_h, i_hk,
                        i_v, scale, H, HV, K, V, BTc: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        GATE: tl.constexpr, DELTA: tl.constexpr, P_IN: tl.constexpr, GC_IN: tl.constexpr,
                        DOT_PREC: tl.constexpr, g_floor: tl.constexpr, TMA: tl.constexpr, TMA_O: tl.constexpr,
                        STORE_R: tl.constexpr, TRANS: tl.constexpr, T_FORM: tl.constexpr = 0, f=BT,
                        NF: tl.constexpr = 0):
    """One chunk of stage 2 on S [BK, BV] (_state_output_step) or, TRANS, on Sᵀ [BV, BK] (_state_output_step_t)."""
    if TRANS:
        tl.static_assert(DELTA, "the transposed step is the delta rule's")
        S = _state_output_step_t(i_t, S, b_gl, q, k, v, w, u, p, g, gcum, qg, kg, o_base, rs, slot0, bos, T_seq,
                                 i_h, i_hk, i_v, scale, H, HV, K, V, BTc, BK, BV, GATE, P_IN, GC_IN, DOT_PREC,
                                 g_floor, TMA, TMA_O, STORE_R, T_FORM, f, NF)
    else:
        S = _state_output_step(i_t, S, b_gl, q, k, v, w, u, p, g, gcum, qg, kg, o_base, rs, slot0, bos, T_seq,
                               i_h, i_hk, i_v, scale, H, HV, K, V, BTc, BK, BV, GATE, DELTA, P_IN, GC_IN, DOT_PREC,
                               g_floor, TMA, TMA_O, STORE_R, T_FORM, f, NF)
    return S


@triton.jit
def _state_offsets(o_k, o_v, s_k, s_v, K, V, TRANS: tl.constexpr):
    """Offsets (strides s_k, s_v) and mask of the state's [BK, BV] tile, or of its transpose [BV, BK] (TRANS)."""
    if TRANS:
        off = o_k[None, :] * s_k + o_v[:, None] * s_v
        m = (o_k < K)[None, :] & (o_v < V)[:, None]
    else:
        off = o_k[:, None] * s_k + o_v[None, :] * s_v
        m = (o_k < K)[:, None] & (o_v < V)[None, :]
    return off, m


@triton.jit
def _store_checkpoint(ckpt, ckpt_slots, n_ckpt, S, i_t, i_n, i_h, T_seq, o_k, o_v, HV, K, V, BTc: tl.constexpr,
                      CKPT: tl.constexpr, CKPT_VK: tl.constexpr, TRANS: tl.constexpr):
    """A prefix checkpoint after every CKPT-th chunk that lies whole in the sequence: S, the state after its first
    (i_t + 1)·BTc tokens, -> ckpt[ckpt_slots[i_n] + (i_t + 1) / CKPT − 1], contiguous [HV, K, V] states ([HV, V, K]
    with CKPT_VK), in ckpt's dtype. A slot at or past n_ckpt (the buffer's length) is not written."""
    if (i_t + 1) % CKPT == 0:
        slot = tl.load(ckpt_slots + i_n).to(tl.int64) + (i_t + 1) // CKPT - 1
        if CKPT_VK:
            off, m = _state_offsets(o_k, o_v, 1, K, K, V, TRANS)
        else:
            off, m = _state_offsets(o_k, o_v, V, 1, K, V, TRANS)
        m = _and(m, (slot < n_ckpt) & ((i_t + 1) * BTc <= T_seq))
        tl.store(ckpt + (slot * HV + i_h) * K * V + off, S.to(ckpt.dtype.element_ty), mask=m)


@triton.jit
def _chunk_of_loop(i_t, S, b_gl, b_f, q, k, v, w, u, p, g, gcum, qg, kg, glast, nf, ready, ckpt, ckpt_slots, n_ckpt,
                   o_base, rs, slot0, c1, bos, T_seq, i_n, i_h, i_hk, i_v, o_k, o_v, scale, H, HV, K, V,
                   BTc: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr,
                   P_IN: tl.constexpr, GC_IN: tl.constexpr, DOT_PREC: tl.constexpr, g_floor: tl.constexpr,
                   TMA: tl.constexpr, TMA_O: tl.constexpr, STORE_R: tl.constexpr, TRANS: tl.constexpr,
                   T_FORM: tl.constexpr, NF: tl.constexpr, WAIT: tl.constexpr, FENCE: tl.constexpr,
                   LOOP_WHILE: tl.constexpr, CKPT: tl.constexpr, CKPT_VK: tl.constexpr):
    """The chunk loop's body (its arguments are the kernel's): chunk i_t's step on S with its decay b_gl and cut b_f,
    loaded the chunk before, and its checkpoint; the next chunk's decay and cut loaded ahead of the step (WAIT: after
    waiting for chunk i_t + WAIT). NF: the step's non-finite handling (0 in a first launch, the kernel's NF in the
    redo).
    Returns (S, the next chunk's b_gl, b_f)."""
    if WAIT:
        _wait_ready(ready, slot0 + tl.minimum(i_t + WAIT, c1 - 1), i_h, HV, FENCE, not LOOP_WHILE)
    b_gl_next = _chunk_decay(glast, slot0, i_t + 1, c1, i_h, HV, K, BK, GATE, GC_IN)
    if NF == 1 or NF == 3:
        b_f_next = _chunk_cut(nf, slot0, i_t + 1, c1, i_h, HV, BTc)
    S = _state_output_chunk(i_t, S, b_gl, q, k, v, w, u, p, g, gcum, qg, kg, o_base, rs, slot0, bos,
                            T_seq, i_h, i_hk, i_v, scale, H, HV, K, V, BTc, BK, BV, GATE, DELTA, P_IN, GC_IN,
                            DOT_PREC, g_floor, TMA, TMA_O, STORE_R, TRANS, T_FORM, b_f, NF)
    if CKPT > 0:
        _store_checkpoint(ckpt, ckpt_slots, n_ckpt, S, i_t, i_n, i_h, T_seq, o_k, o_v, HV, K, V, BTc, CKPT,
                          CKPT_VK, TRANS)
    if NF == 1 or NF == 3:
        b_f = b_f_next
    return S, b_gl_next, b_f


@triton.jit
def _entering_state(h0, sloc, gam, i_n, i_h, i_s, o_k, o_v, m_kv, s_h0n, s_h0h, s_h0k, s_h0v, HV, K, V,
                    BK: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr, SEG: tl.constexpr, NSEG: tl.constexpr,
                    SUB: tl.constexpr, TRANS: tl.constexpr):
    """The state the program's first chunk starts from: h0 (or 0), then (SEG = 2) the earlier (sub-)segments in
    order. [BK, BV] fp32 ([BV, BK] with TRANS)."""
    if TRANS:
        S = tl.zeros([BV, BK], dtype=tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        off, m = _state_offsets(o_k, o_v, s_h0k, s_h0v, K, V, TRANS)
        S += tl.load(h0 + i_n * s_h0n + i_h * s_h0h + off, mask=m, other=0.).to(tl.float32)
    if SEG == 2:
        for i_p in tl.static_range(NSEG * SUB - 1):
            if i_p < i_s * SUB:
                i_seg = (i_n * NSEG * SUB + i_p).to(tl.int64)
                S = S * tl.load(gam + i_seg * HV + i_h) + \
                    tl.load(sloc + ((i_seg * HV + i_h) * K + o_k[:, None]) * V + o_v[None, :], mask=m_kv, other=0.)
    return S


@triton.jit(do_not_specialize=["T", "NT", "H", "HV", "seg_len"])
def chunk_state_output_kernel(
    q, k, v, w, u, p, g,         # [B,T,H,K] [B,T,H,K] [B,T,HV,V] [B,T,HV,K] [B,T,HV,V] [B,T,HV,BT] [B,T,HV] fp32
    qg, kg, glast,               # GATE == 2: [B,T,HV,K] [B,T,HV,K] [slots,HV,K] fp32; GC_IN: glast [slots,HV]
    gcum,                        # GC_IN: [slots,HV,BT] fp32 chunk-local cumulative scalar gate by chunk (stage 1)
    o, h0, ht,                   # out [B,T,HV,V]; [N,HV,·,·] any float; out [N,HV,·,·] fp32
    sloc, gam,                   # SEG > 0: [N·NSEG, HV, K, V] fp32 segment-local end states, [N·NSEG, HV] fp32 decays
    rs,                          # STORE_R: out [B, T, HV, V] R = U − W S (for the backward)
    ready,                       # WAIT: [slots, HV] int32, 1 once stage 1 (running beside, SIGNAL) stored the chunk
    cu_seqlens, scale, T, NT, seg_len,
    s_h0n, s_h0h, s_h0k, s_h0v,  # strides of h0 (its layout)
    s_htn, s_hth, s_htk, s_htv,  # strides of ht
    H, HV, K, V,
    BTc: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, DELTA: tl.constexpr, P_IN: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr, g_floor: tl.constexpr, LOOP_WHILE: tl.constexpr,
    SEG: tl.constexpr = 0, NSEG: tl.constexpr = 1, SUB: tl.constexpr = 1, GC_IN: tl.constexpr = 0,
    TMA: tl.constexpr = 0, TMA_O: tl.constexpr = 0, STORE_R: tl.constexpr = 0, TRANS: tl.constexpr = 0,
    T_FORM: tl.constexpr = 0, WAIT: tl.constexpr = 0, FENCE: tl.constexpr = 0,
    ckpt=None, ckpt_slots=None, n_ckpt=None, CKPT: tl.constexpr = 0, CKPT_VK: tl.constexpr = 0,
    nf=None, NF: tl.constexpr = 0, redo=None, REDO: tl.constexpr = 0,
):
    """Stage 2 (module docstring). Grid (cdiv(V, BV), N·HV); S [BK, BV] fp32 stays in registers (TRANS, SEG = 0:
    Sᵀ [BV, BK], the products' first operand; _state_output_step_t).

    SEG (simple GLA, no varlen): each sequence split into NSEG segments of seg_len chunks, grid
    (cdiv(V, BV), N·NSEG·HV), so that a short batch still fills the GPU. Its state is linear in the
    inputs, so a segment's start state is the earlier segments' local end states, decayed:
        SEG = 1: each segment's local end state (from zero) -> sloc, its total decay e^{Σ g} -> gam
        SEG = 2: S = h0; S ← gam[s'] S + sloc[s'] for the earlier segments s'; then the segment as usual
    SUB (SEG = 2): the first pass ran SUB sub-segments per segment (NSEG·SUB local states of seg_len / SUB
    chunks each), so that it fills the GPU with its own, shorter programs

    Per chunk (C = BT rows, masked past the sequence end)::

        R = U − W S  |  V                              [C, BV]
        o = scale · ((Q ⊙ e^G) S + P R)                [C, BV]
        S = e^{G_last} S + (K ⊙ e^{G_last − G})ᵀ R      [K, BV]

    T_FORM (delta rule): u is T diag(β) [B,T,HV,BT] from stage 1, w (per-channel gate only) K ⊙ e^G, and
    R = T diag(β) (V − (K ⊙ e^G) S)                      [C, C] @ [C, BV]

    WAIT (> 0, not with SEG; stage 1 launched just before, running beside this launch): chunk i's stage-1 tiles are
    read only after ready[slot of i, head] is set (_wait_ready), WAIT chunks ahead of the step, so that the loads
    the software pipeline issues for later steps (num_stages − 1 ahead) only read published chunks. FENCE: the
    tiles come through tensor descriptors (TMA).

    CKPT (> 0, chunks per checkpoint; off: nothing of it is built): prefix checkpoints, the state after every CKPT
    chunks of a sequence into ckpt (_store_checkpoint; sequence n's first slot ckpt_slots[n]), in every form (the
    SEG = 2 pass and the TRANS step carry the true state after each chunk too).

    NF (non-finite inputs, docs/design.md): the launch takes every input as finite and runs the step of finite
    inputs; each program stores to redo [programs] int32 whether it met a non-finite input (a cut below BTc in
    stage 1's nf, or a non-finite state at its end). A second launch (REDO) runs again only those programs, with the
    steps that cut each chunk at its first non-finite row: 1, that row from stage 1's nf [slots, HV] (loaded a chunk
    ahead); 3, that of k, g, β from nf and v's from each step's v tile; 2 (simple GLA), found by each step from v
    (_state_output_step).
    """
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_prog = i_nh * tl.num_programs(0) + i_v
    i_n, i_h = i_nh // HV, i_nh % HV
    i_s = 0
    if SEG > 0:
        i_s = i_n % NSEG
        i_n = i_n // NSEG
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
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]

    c0 = 0
    c1 = n_chunks
    if SEG > 0:
        c0 = tl.minimum(i_s * seg_len, n_chunks)
        c1 = tl.minimum(c0 + seg_len, n_chunks)
    if SEG == 1:        # the segment's local end state and total decay
        S = tl.zeros([BK, BV], dtype=tl.float32)
        d = tl.full([], 1., tl.float32)
        if LOOP_WHILE:
            i_t = c0
            while i_t < c1:
                S, b_dl = _state_step(i_t, S, k, v, g, bos, T_seq, i_h, i_hk, i_v, H, HV, K, V, BTc, BK, BV, GATE,
                                      DOT_PREC, g_floor)
                d = d * b_dl
                i_t += 1
        else:
            for i_t in range(c0, c1):
                S, b_dl = _state_step(i_t, S, k, v, g, bos, T_seq, i_h, i_hk, i_v, H, HV, K, V, BTc, BK, BV, GATE,
                                      DOT_PREC, g_floor)
                d = d * b_dl
        i_seg = (i_n * NSEG + i_s).to(tl.int64)
        tl.store(sloc + ((i_seg * HV + i_h) * K + o_k[:, None]) * V + o_v[None, :], S, mask=m_kv)
        if i_v == 0:
            tl.store(gam + i_seg * HV + i_h, d)
    else:
        if TMA:         # the tiles the loop loads, as tensor descriptors of this sequence and head (made once)
            q = _tma_view(q, (bos * H + i_hk) * K, T_seq, K, H * K, BTc, BK, GATE != 2)
            k = _tma_view(k, (bos * H + i_hk) * K, T_seq, K, H * K, BTc, BK, GATE != 2)
            w = _tma_view(w, (bos * HV + i_h) * K, T_seq, K, HV * K, BTc, BK, DELTA and (not T_FORM or GATE == 2))
            if T_FORM:
                u = _tma_view(u, (bos * HV + i_h) * BTc, T_seq, BTc, HV * BTc, BTc, BTc, DELTA)
            else:
                u = _tma_view(u, (bos * HV + i_h) * V, T_seq, V, HV * V, BTc, BV, DELTA)
            v = _tma_view(v, (bos * HV + i_h) * V, T_seq, V, HV * V, BTc, BV, not DELTA or T_FORM)
            p = _tma_view(p, (bos * HV + i_h) * BTc, T_seq, BTc, HV * BTc, BTc, BTc, P_IN)
            qg = _tma_view(qg, (bos * HV + i_h) * K, T_seq, K, HV * K, BTc, BK, GATE == 2)
            kg = _tma_view(kg, (bos * HV + i_h) * K, T_seq, K, HV * K, BTc, BK, GATE == 2)
        o_base = _tma_view(o_base, 0, T_seq, V, HV * V, BTc, BV, TMA_O)
        run = True
        if REDO:        # only the programs whose first pass met a non-finite input
            run = tl.load(redo + i_prog) != 0
        if run:
            S = _entering_state(h0, sloc, gam, i_n, i_h, i_s, o_k, o_v, m_kv, s_h0n, s_h0h, s_h0k, s_h0v, HV, K, V,
                                BK, BV, USE_H0, SEG, NSEG, SUB, TRANS)
            if WAIT:        # the first WAIT chunks (the loop waits for chunk i + WAIT at step i)
                for i_w in tl.static_range(WAIT):
                    if c0 + i_w < c1:
                        _wait_ready(ready, slot0 + c0 + i_w, i_h, HV, FENCE, not LOOP_WHILE)
            b_gl = _chunk_decay(glast, slot0, c0, c1, i_h, HV, K, BK, GATE, GC_IN)
            b_f = tl.full([], BTc, tl.int32)
            if REDO and (NF == 1 or NF == 3):
                b_f = _chunk_cut(nf, slot0, c0, c1, i_h, HV, BTc)
            NF_STEP: tl.constexpr = NF if REDO else 0
            if LOOP_WHILE:      # the triton 3.6 interpreter cannot take a tensor bound in range()
                i_t = c0
                while i_t < c1:
                    S, b_gl, b_f = _chunk_of_loop(
                        i_t, S, b_gl, b_f, q, k, v, w, u, p, g, gcum, qg, kg, glast, nf, ready, ckpt, ckpt_slots,
                        n_ckpt, o_base, rs, slot0, c1, bos, T_seq, i_n, i_h, i_hk, i_v, o_k, o_v, scale, H, HV, K, V,
                        BTc, BK, BV, GATE, DELTA, P_IN, GC_IN, DOT_PREC, g_floor, TMA, TMA_O, STORE_R, TRANS, T_FORM,
                        NF_STEP, WAIT, FENCE, LOOP_WHILE, CKPT, CKPT_VK)
                    i_t += 1
            else:               # compiled: a for loop, so that the loads of later chunks are pipelined
                for i_t in range(c0, c1):
                    S, b_gl, b_f = _chunk_of_loop(
                        i_t, S, b_gl, b_f, q, k, v, w, u, p, g, gcum, qg, kg, glast, nf, ready, ckpt, ckpt_slots,
                        n_ckpt, o_base, rs, slot0, c1, bos, T_seq, i_n, i_h, i_hk, i_v, o_k, o_v, scale, H, HV, K, V,
                        BTc, BK, BV, GATE, DELTA, P_IN, GC_IN, DOT_PREC, g_floor, TMA, TMA_O, STORE_R, TRANS, T_FORM,
                        NF_STEP, WAIT, FENCE, LOOP_WHILE, CKPT, CKPT_VK)
            if NF and not REDO:
                # a non-finite input leaves a non-finite state for good (no step of finite inputs masks it: x·0 and
                # x + y stay non-finite) or, for what stage 1 reads, a cut below BTc in one of the program's chunks
                bad = tl.sum(tl.where(_finite(S), 0, 1)) > 0
                if NF == 1 or NF == 3:
                    bad = bad | (_first_cut(nf, slot0, c0, c1, i_h, HV, BTc) < BTc)
                tl.store(redo + i_prog, bad.to(tl.int32))
            if STORE_HT and i_s == NSEG - 1:    # the last segment (always, without SEG)
                off, m = _state_offsets(o_k, o_v, s_htk, s_htv, K, V, TRANS)
                tl.store(ht + i_n * s_htn + i_h * s_hth + off, S, mask=m)


# ------------------------------------------------------------------------------------------------
# launcher
# ------------------------------------------------------------------------------------------------

def chunk_state_output(q, k, v, g, beta, stage1: dict, o, initial_state, ht, rs, ready, side, cu_seqlens, scale,
                       plan: ForwardPlan, launch: Stage2Launch, transpose_state_layout: bool = False,
                       checkpoints: tuple | None = None):
    """Stage 2 into o [B,T,HV,V] (and ht, the final state [N,HV,K,V] fp32, [N,HV,V,K] transposed; rs, R
    [B,T,HV,V], where not None), from stage 1's ``stage1`` dict (stage1.chunk_prepare's; for simple GLA p alone or None),
    at the plan's launch resolved for these shapes. ``ready`` / ``side``: stage 1 runs beside (its ready flags, and
    the stream stage 2 runs on), else None. ``checkpoints``: (buffer [n, HV, K, V] contiguous (layout as ht's), each
    sequence's first slot [N + 1] int on the device, chunks per checkpoint), or None."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    NT = cdiv(T, BT)
    gate = 0 if g is None else (1 if g.dim() == 3 else 2)
    delta = beta is not None
    nseg, bv = launch.nseg, launch.bv
    trans = plan.trans and bv >= 64
    tma = plan.tma
    # (not where stage 2 stores R too: the two stores' staging would take GDN's training stage 2 past the shared
    # memory that leaves a stage-1 program room beside it; one staging is shared)
    tma_o = tma and plan.tma_o and nseg == 1 and rs is None
    if tma and not INTERPRET:
        _ensure_allocator()
    if launch.num_stages == 1 and bv <= 32 and q.element_size() == 2 and not INTERPRET:
        # (never planned: 16-bit inputs take 2-3 stages) with triton 3.6 this sm_90 build raised illegal memory
        # accesses or gave wrong outputs, where bv 64 at one stage and fp32 inputs at one stage were right
        raise ValueError(f"chunk_fwd: num_stages=1 with a {bv}-wide value block and {q.dtype} inputs is miscompiled on "
                         f"sm_90 (triton 3.6); use num_stages >= 2 or bv >= 64")

    def strides(x):
        if x is None:
            return (0, 0, 0, 0)
        sn, sh, s2, s3 = x.stride()
        return (sn, sh, s3, s2) if transpose_state_layout else (sn, sh, s2, s3)

    sub = launch.seg_sub if nseg > 1 else 1
    sub_len = cdiv(NT, nseg * sub)           # the first pass's (sub-)segments; a segment is sub of them
    seg_len = sub_len * sub
    sloc = gam = None
    if nseg > 1:
        sloc = _alloc((N * nseg * sub, HV, K, V), torch.float32, q.device)
        gam = _alloc((N * nseg * sub, HV), torch.float32, q.device)
    overlap = ready is not None
    ckpt_args = {}
    if checkpoints is not None:
        buf, slots, every = checkpoints
        ckpt_args = dict(ckpt=buf, ckpt_slots=slots, n_ckpt=buf.shape[0], CKPT=every,
                         CKPT_VK=bool(transpose_state_layout))
    for seg_mode in ((1, 2) if nseg > 1 else (0,)):
        bv_m, warps_m, rows_m, len_m, nseg_m, stages_m = bv, launch.num_warps, N * nseg * HV, seg_len, nseg, \
            launch.num_stages
        if seg_mode == 1:
            rows_m, len_m, nseg_m = N * nseg * sub * HV, sub_len, nseg * sub
            if launch.seg_phase1 is not None:
                # the local-end-state pass with its own value block (it writes whole [K, V] states, which the
                # second pass reads at its own bv): a wider block reads each k tile once for more of V
                bv_m, warps_m = min(launch.seg_phase1[0], _dim(V)), launch.seg_phase1[1]
                stages_m = launch.seg_phase1[2] if len(launch.seg_phase1) > 2 else launch.num_stages
        grid = (cdiv(V, bv_m), rows_m)
        # seg_mode 0 / 2: a first launch on the step of finite inputs, then the programs that met a non-finite one
        # again (REDO); both in every forward, so that nothing waits on the host
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            # (allocated on the stream that uses it, so that the allocator does not hand it out before it is done)
            redo = None if seg_mode == 1 else torch.empty(grid[0] * grid[1], dtype=torch.int32, device=q.device)
            for redo_pass in ((0,) if seg_mode == 1 else (0, 1)):
                chunk_state_output_kernel[grid](
                    q, k, v, stage1["w"], stage1["u"], stage1["p"], g, stage1["qg"], stage1["kg"], stage1["glast"],
                    stage1["gcum"], o, initial_state, ht, sloc, gam, rs, ready, cu_seqlens, scale, T, NT, len_m,
                    *strides(initial_state), *strides(ht),
                    H=H, HV=HV, K=K, V=V, BTc=BT, BK=_dim(K), BV=bv_m, GATE=gate, DELTA=delta, P_IN=launch.p_in,
                    IS_VARLEN=cu_seqlens is not None, USE_H0=initial_state is not None, STORE_HT=ht is not None,
                    DOT_PREC=plan.dot_prec, g_floor=G_FLOOR, LOOP_WHILE=INTERPRET, SEG=seg_mode, NSEG=nseg_m,
                    SUB=sub if seg_mode == 2 else 1, GC_IN=delta and gate == 1, TMA=tma, TMA_O=tma_o,
                    STORE_R=rs is not None, TRANS=int(trans and seg_mode == 0), T_FORM=plan.t_form,
                    WAIT=stages_m + 1 if overlap and not redo_pass else 0,
                    FENCE=bool(overlap and tma and not INTERPRET and not redo_pass),
                    nf=stage1.get("nf"), NF=(3 if plan.t_form else 1) if delta else 2, redo=redo, REDO=redo_pass,
                    num_warps=warps_m, num_stages=stages_m, **(ckpt_args if seg_mode != 1 else {}))
