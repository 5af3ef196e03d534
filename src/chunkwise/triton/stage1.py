"""Stage 1 of the chunk forward: per chunk of C = 64 tokens, fully parallel over chunks and heads.

``chunk_prepare_kernel`` (the delta families), grid (chunks, B·HV), on whole [64, ·] register tiles (tensor-core
dots throughout)::

    G   = cumsum(max(g, G_FLOOR))                    fp32, chunk-local, per channel for KDA
    A   = strict_tril(β_i ⟨k_i, Γ_ij ⊙ k_j⟩)           [C, C]
    T   = (I + A)⁻¹                                  triton/solve.py
    W   = T (β ⊙ e^G ⊙ K)     U = T (β ⊙ V)           [C, K], [C, V]
    P   = tril(⟨q_i, Γ_ij ⊙ k_j⟩)                     [C, C], diagonal included

It writes w, u and P (input dtype) and, for KDA's per-channel gate, q ⊙ e^G and k ⊙ e^{G_last − G} (input dtype)
plus e^{G_last} per chunk (fp32). Under T_FORM (the plans' default but for GDN / DeltaNet's training forward) it
writes T diag(β) in u's place instead of W and U (per channel K ⊙ e^G in w's), and stage 2 forms
R = U − W S = T diag(β) (V − e^G ⊙ K S) itself: stage 1 then reads no v and skips W's and U's products.

KDA's pairwise products factor e^{G_i − G_j} = e^{G_i − r} · e^{r − G_j} around one reference per chunk, r =
G_last / 2 per channel, wherever every |G_i − r| of a column chunk is under SPAN_MAX (both factors within e^{±80});
elsewhere by 16-token blocks: off the diagonal around the blocks' starts and ends (both factors ≤ 1), on it around
each block's middle gate value (both factors within e^{±80} where the block's gates sum above −2 SPAN_MAX), with an
exact pair-by-pair loop for a diagonal block whose gates fall further. It runs as two launches: the first builds the
one-reference products only and flags the chunks that need the block form, which the second finishes.

``chunk_p_kernel``: P alone, for simple GLA where stage 2 reads it rather than forming it once per value block.
The backward's recompute (``chunk_prepare_bwd``) is chunk_prepare_kernel's BWD form.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (BC, BT, G_FLOOR, SPAN_MAX, _alloc, _by_block, _chunk_span, _dim, _exp, _finite, _finite_or_zero,
                     _mm, _row_of, _signal_ready, _tile_load, _tile_store, cdiv, chunk_slots, chunks_whole, gate_kind)
from .configs import ForwardPlan, forward_plan, precisions, saved_t_dtype, wu_lowp_ok
from .gate import _block_starts, _chunk_gate
from .solve import _solve_unit_lower


# ------------------------------------------------------------------------------------------------
# KDA's per-channel tiles and its exact diagonal blocks
# ------------------------------------------------------------------------------------------------

@triton.jit
def _kqg_tiles(k_base, q_base, g_base, r0, kc0, T_seq, H, HV, K, R: tl.constexpr, BKC: tl.constexpr,
               CHK_R: tl.constexpr, CHK_C: tl.constexpr):
    """Rows r0 .. r0 + R − 1, channels kc0 .. kc0 + BKC − 1 of k, q and the per-channel gate g, as fp32
    [R, BKC] tiles (zero past the sequence end and K; CHK_R / CHK_C: the bounds checked, chunk_prepare_kernel's)."""
    b_k = _tile_load(k_base, 0, T_seq, K, H * K, r0, kc0, R, BKC, CHK_R, CHK_C).to(tl.float32)
    b_q = _tile_load(q_base, 0, T_seq, K, H * K, r0, kc0, R, BKC, CHK_R, CHK_C).to(tl.float32)
    b_g = _tile_load(g_base, 0, T_seq, K, HV * K, r0, kc0, R, BKC, CHK_R, CHK_C).to(tl.float32)
    return b_k, b_q, b_g


@triton.jit
def _kda_diag_exact(kf, qf, bk, b_G, Ad, Pd, far, BTc: tl.constexpr, BCc: tl.constexpr, BKC: tl.constexpr):
    """KDA's diagonal 16×16 blocks of A (without β: bk = β k) and P for the rows far [BT] marks (whole blocks whose
    gates span too far to factor), each entry exactly from e^{G_i − G_j}, i ≥ j in one block, written over Ad, Pd
    [BT, BT] there. A loop over a block's 16 columns that forms that column of all four blocks at once
    ([NB, BC, BKC] tiles). kf, qf, bk, b_G: [BT, BKC] fp32."""
    NB: tl.constexpr = BTc // BCc
    o_c = tl.arange(0, BCc)
    o_t = tl.arange(0, BTc)
    mine = ((o_t // BCc)[:, None] == (o_t // BCc)[None, :]) & far[:, None]
    k3 = tl.reshape(kf, [NB, BCc, BKC])
    q3 = tl.reshape(qf, [NB, BCc, BKC])
    bk3 = tl.reshape(bk, [NB, BCc, BKC])
    G3 = tl.reshape(b_G, [NB, BCc, BKC])
    for j in range(BCc):
        sel = (o_c == j)[None, :, None]
        k_j = tl.sum(tl.where(sel, k3, 0.), 1)                                          # [NB, BKC]
        G_j = tl.sum(tl.where(sel, G3, 0.), 1)                                          # [NB, BKC]
        e = _exp(tl.where((o_c >= j)[None, :, None], G3 - G_j[:, None, :], float("-inf")))  # e^{G_i − G_j}
        ke = e * k_j[:, None, :]                                                        # [NB, BC, BKC]
        a_j = tl.reshape(tl.sum(bk3 * ke, 2), [BTc])                                    # column j of each block
        p_j = tl.reshape(tl.sum(q3 * ke, 2), [BTc])
        col = mine & (o_t % BCc == j)[None, :]
        Ad = tl.where(col, a_j[:, None], Ad)
        Pd = tl.where(col, p_j[:, None], Pd)
    return Ad, Pd


@triton.jit
def _chunk_gate_finite(g, bos, t0, T_seq, i_h, HV, BTc: tl.constexpr, g_floor: tl.constexpr, FULL_ROWS: tl.constexpr):
    """_chunk_gate with each non-finite clamped gate (NaN, +inf) taken as 0: (G [BT], 1 on the rows that held one)."""
    o_t = tl.arange(0, BTc)
    if FULL_ROWS:
        b_g = tl.load(g + (bos + t0 + o_t) * HV + i_h).to(tl.float32)
    else:
        b_g = tl.load(g + (bos + t0 + o_t) * HV + i_h, mask=t0 + o_t < T_seq, other=0.).to(tl.float32)
    b_g = tl.where(b_g < g_floor, g_floor, b_g)
    ok = _finite(b_g)
    return tl.cumsum(tl.where(ok, b_g, 0.), 0), tl.where(ok, 0, 1)


# ------------------------------------------------------------------------------------------------
# the kernels
# ------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["T", "NT", "H", "HV"])
def chunk_prepare_kernel(
    q, k, v, g, beta,            # [B,T,H,K] [B,T,H,K] [B,T,HV,V] None|[B,T,HV]|[B,T,HV,K] fp32, [B,T,HV]
    w, u, p,                     # out: [B,T,HV,K] [B,T,HV,V] [B,T,HV,BT] (input dtype)
    qg, kg, glast,               # out (GATE == 2): [B,T,HV,K] [B,T,HV,K] input dtype, [slots,HV,K] fp32
    gcum,                        # out (GC_OUT): GATE 1 [slots,HV,BT] fp32 G by chunk (glast then [slots,HV] G_last);
                                 # GATE 2 [B,T,HV,K] fp32 G per token and channel (for the backward)
    do, t_out, drl,              # BWD: [B,T,HV,V] in; out [B,T,HV,BT] fp32, [B,T,HV,V] (do's dtype)
    flag,                        # PASS 1 / 2: [chunks · B·HV] int32, per program: 1 where the second launch must
                                 # finish it (written by 1, read by 2)
    ready,                       # SIGNAL: [slots, HV] int32, set to 1 once the chunk's outputs are stored (stage 2's WAIT)
    cu_seqlens, chunk_indices,   # varlen: [N+1], [NT_total, 2] (sequence, chunk in sequence)
    T, NT, H, HV, K, V, scale,
    BTc: tl.constexpr, BCc: tl.constexpr, BK: tl.constexpr, BVf: tl.constexpr, BKC: tl.constexpr,
    GATE: tl.constexpr,          # 0 none, 1 scalar, 2 per channel
    IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, MM_PREC: tl.constexpr, SOLVE_PREC: tl.constexpr,
    g_floor: tl.constexpr, span_max: tl.constexpr, WU_LOWP: tl.constexpr = 0,
    BWD: tl.constexpr = 0, STORE_T: tl.constexpr = 0, STORE_P: tl.constexpr = 1, GC_OUT: tl.constexpr = 0,
    PASS: tl.constexpr = 0, T_FORM: tl.constexpr = 0, AP_LOWP: tl.constexpr = 0, REDO_PREC: tl.constexpr = "tf32",
    SIGNAL: tl.constexpr = 0, FULL_ROWS: tl.constexpr = 0, FULL_COLS: tl.constexpr = 0,
    nf=None, NF_OUT: tl.constexpr = 0,
):
    """One chunk of one value head (module docstring). Grid (chunks, B·HV); SIGNAL: (B·HV, chunks).

    BWD (the backward's recompute, scalar / no gate): instead of P, write T = (I + A)⁻¹ (fp32) and
    dR_local = scale Pᵀ dO, next to W and U; A and P never reach memory.
    STORE_T (forward, for a backward that reuses stage 1): also write T = (I + A)⁻¹ to t_out.
    STORE_P = 0 (forward, scalar / no gate): no P (stage 2 forms it), q is not read.
    GC_OUT (forward, scalar gate): also write the chunk-local cumulative gate G per token and G_last per chunk,
    so that stage 2's serial loop neither scans nor reduces the gate; per-channel gate (a training forward): G
    [B,T,HV,K], which the backward then does not form again.
    T_FORM (forward, not with BWD): write T diag(β) = (I + A)⁻¹ diag(β) [B,T,HV,BT] to u (input dtype) instead of
    W and U (v is not read; per channel no second column loop), and per channel K ⊙ e^G to w: stage 2 forms
    R = T diag(β) (V − (K ⊙ e^G) S) itself; with STORE_T (the training forward), T to t_out as well.
    PASS (two launches, the second over the programs the first flagged; the others return at once):
      per-channel gate: 1 builds the one-reference products only (no block form: fewer registers) and flags the
      programs where a column chunk's gate leaves the one-reference span (they stop after A and P); 2 takes, per
      column chunk, the one-reference products where the gate allows them, else the block form, and writes all.
      Scalar / no gate (SOLVE_PREC "fp16"): 1 flags the programs whose T came out non-finite (an operand past fp16's
      range), without the redo's code; 2 redoes those whole at SOLVE_PREC.
    SOLVE_PREC "fp16" with PASS 0 or a per-channel gate: where T comes out non-finite, the solve again at REDO_PREC.
    AP_LOWP (the one-reference products): A from bf16 operands.
    SIGNAL (stage 2 running beside this launch): the grid chunk-major, so that every head's first chunks are done
    first, and each program, once its outputs are stored, sets ready[slot, head] (a program flagged to a second
    launch leaves that to it).
    FULL_ROWS (every chunk whole: no varlen, T a multiple of BTc) / FULL_COLS (K = BK, V = BVf): the tiles' row /
    column bounds checks left out.
    NF_OUT (the forward; 2 below): f, the chunk's first row with a non-finite k, β, clamped g or (not T_FORM) v (BTc if
    none) -> nf[slot, head] for stage 2, which makes the outputs from f on and the state after the chunk NaN (under
    T_FORM stage 2 reads v raw and finds v's own cut itself: v is not read here). Non-finite β and
    g are taken as 0; A's rows from f on and the right-hand sides' (W, U) are cut by a where before the solve and the
    products, so that T, W, U stay finite and every row before f is that of finite inputs (a non-finite k reaches
    only its own row and column of A and P, whose upper triangle the wheres drop). NF_OUT 2 takes every input as
    finite and stores f = BTc, but flags a program whose T came out non-finite (as a non-finite k, g or β leaves
    it) to the second launch, which runs with NF_OUT 1."""
    CHK_R: tl.constexpr = 0 if FULL_ROWS else 1
    CHK_C: tl.constexpr = 0 if FULL_COLS else 1
    if SIGNAL:
        i_bh, i_t = tl.program_id(0), tl.program_id(1)
        n_t = tl.num_programs(1)
    else:
        i_t, i_bh = tl.program_id(0), tl.program_id(1)
        n_t = tl.num_programs(0)
    if PASS == 2:
        if tl.load(flag + i_bh * n_t + i_t) == 0:
            return
    i_b, i_h = i_bh // HV, i_bh % HV
    i_hk = i_h // (HV // H)
    bos, T_seq, t0, slot = _chunk_span(i_t, i_b, cu_seqlens, chunk_indices, T, NT, BTc, IS_VARLEN)
    o_t = tl.arange(0, BTc)
    blk = o_t // BCc
    strict = o_t[:, None] > o_t[None, :]
    incl = o_t[:, None] >= o_t[None, :]
    same = blk[:, None] == blk[None, :]

    if FULL_ROWS:
        b_beta = tl.load(beta + bos * HV + i_h + (t0 + o_t) * HV).to(tl.float32)
    else:
        b_beta = tl.load(beta + bos * HV + i_h + (t0 + o_t) * HV, mask=t0 + o_t < T_seq, other=0.).to(tl.float32)
    if NF_OUT == 1:     # rb: 1 on the rows with a non-finite input
        rb = tl.where(_finite(b_beta), 0, 1)
        b_beta = _finite_or_zero(b_beta)
    q_base = q + (bos * H + i_hk) * K
    k_base = k + (bos * H + i_hk) * K

    if GATE == 2:
        # per-channel gate, in column chunks of BKC channels (A and P are sums over channels, every
        # channel's gate is independent): few [BT, BKC] fp32 tiles live, shared memory bounded for K = 256.
        g_base = g + (bos * HV + i_h) * K
        A = tl.zeros([BTc, BTc], dtype=tl.float32)
        P = tl.zeros([BTc, BTc], dtype=tl.float32)
        n_out = tl.zeros([], dtype=tl.int32)     # PASS 1: column chunks whose gate left the one-reference span
        for i_kc in range(BK // BKC):
            kc0 = i_kc * BKC
            kf, qf, b_g = _kqg_tiles(k_base, q_base, g_base, t0, kc0, T_seq, H, HV, K, BTc, BKC, CHK_R, CHK_C)
            if NF_OUT == 1:     # (a non-finite k reaches its own rows and columns of A and P: cut below)
                b_g = tl.where(b_g < g_floor, g_floor, b_g)
                rb = tl.maximum(rb, tl.max(tl.where(_finite(kf) & _finite(b_g), 0, 1), 1))
                b_g = _finite_or_zero(b_g)
            b_G = tl.cumsum(tl.where(b_g < g_floor, g_floor, b_g), 0)                   # [BT, BKC]
            G_last = _row_of(b_G, BTc - 1, BTc)                                          # [BKC]
            # one reference for the whole chunk, r = G_last / 2 per channel, when every |G_i − r| of this
            # column chunk is under span_max: e^{G_i − G_j} = e^{G_i − r} · e^{r − G_j}, both factors in
            # [e^−span_max, e^span_max] (fp32's range), two products instead of eight
            r = 0.5 * G_last
            b_Gr = b_G - r[None, :]
            m_Gr = tl.max(tl.max(tl.abs(b_Gr), 1), 0)
            if PASS == 1:     # (the products may overflow where the span is left: the second launch redoes those)
                n_out += (m_Gr >= span_max).to(tl.int32)
                fast = True
            else:
                fast = m_Gr < span_max
            if fast:
                x = _exp(b_Gr)                                                           # e^{G_i − r}
                kinv = kf * _exp(-b_Gr)                                                  # k_j e^{r − G_j}
                qx = qf * x
                # AP_LOWP: A from bf16 operands (rounded to nearest; bf16 inputs: e^{±span_max} in range)
                A_PREC: tl.constexpr = "bf16" if AP_LOWP else MM_PREC
                bkx = kf * b_beta[:, None] * x
                A += _mm(bkx, tl.trans(kinv), A_PREC)                                    # [BT, BKC] @ [BKC, BT]
                P += _mm(qx, tl.trans(kinv), MM_PREC)                                    # [BT, BKC] @ [BKC, BT]
                b_qg = qx * _exp(r)[None, :]
                b_kg = kinv * _exp(G_last - r)[None, :]
                if T_FORM:
                    b_kx = kf * x * _exp(r)[None, :]                                     # k e^G
            else:
                # by 16-token blocks: off the diagonal blocks each e^{G_i − G_j} factored around a block end or a
                # block start, both factors ≤ 1
                e0, e1, e2, s_rows, blk_min = _block_starts(b_G, BTc, BCc)      # block ends, starts, spans
                e3 = _row_of(b_G, 4 * BCc - 1, BTc)
                e_rows = _by_block(e0[None, :], e1[None, :], e2[None, :], e3[None, :], BTc, BCc)   # each row's e_b
                zero = tl.zeros_like(e0)
                one = tl.full([BKC], 1., tl.float32)
                x = _exp(b_G - s_rows)                                                       # e^{G_i − s_b} ≤ 1
                ky = kf * _exp(e_rows - b_G)                                                 # k_j e^{e_b − G_j} ≤ k_j
                bkx = kf * b_beta[:, None] * x                                               # β_i k_i e^{G_i − s_b}
                qx = qf * x                                                                  # q_i e^{G_i − s_b}
                # off-diagonal blocks, column block c, rows of block b > c: e^{G_i − e_c} = x_i e^{s_b − e_c}
                f = _by_block(zero[None, :], one[None, :], _exp(e1 - e0)[None, :], _exp(e2 - e0)[None, :], BTc, BCc)
                c = tl.trans(tl.where((blk == 0)[:, None], ky, 0.))
                A += _mm(bkx * f, c, MM_PREC)                                                # [BT, BKC] @ [BKC, BT]
                P += _mm(qx * f, c, MM_PREC)                                                 # [BT, BKC] @ [BKC, BT]
                f = _by_block(zero[None, :], zero[None, :], one[None, :], _exp(e2 - e1)[None, :], BTc, BCc)
                c = tl.trans(tl.where((blk == 1)[:, None], ky, 0.))
                A += _mm(bkx * f, c, MM_PREC)                                                # [BT, BKC] @ [BKC, BT]
                P += _mm(qx * f, c, MM_PREC)                                                 # [BT, BKC] @ [BKC, BT]
                f = tl.where((blk == 3)[:, None], 1., 0.)
                c = tl.trans(tl.where((blk == 2)[:, None], ky, 0.))
                A += _mm(bkx * f, c, MM_PREC)                                                # [BT, BKC] @ [BKC, BT]
                P += _mm(qx * f, c, MM_PREC)                                                 # [BT, BKC] @ [BKC, BT]
                # diagonal blocks: around each block's middle value m_b = (s_b + e_b) / 2, both factors within
                # e^{±span_max} where the block's gates span under 2 span_max; a block spanning further ("far"): its
                # factors taken as 1 (finite), its entries then formed exactly
                m_rows = 0.5 * (s_rows + e_rows)
                NB: tl.constexpr = BTc // BCc
                far = tl.reshape(tl.broadcast_to((blk_min <= -2 * span_max)[:, None], [NB, BCc]), [BTc])
                dm = tl.where(far[:, None], 0., b_G - m_rows)
                xm = _exp(dm)                                                                    # e^{G_i − m_b}
                km = kf * _exp(-dm)                                                              # k_j e^{m_b − G_j}
                Ad = _mm(kf * b_beta[:, None] * xm, tl.trans(km), MM_PREC)                       # [BT, BKC] @ [BKC, BT]
                Pd = _mm(qf * xm, tl.trans(km), MM_PREC)                                         # [BT, BKC] @ [BKC, BT]
                if tl.min(blk_min, 0) <= -2 * span_max:
                    Ad, Pd = _kda_diag_exact(kf, qf, kf * b_beta[:, None], b_G, Ad, Pd, far, BTc, BCc, BKC)
                A += tl.where(same & strict, Ad, 0.)
                P += tl.where(same & incl, Pd, 0.)
                b_qg = qf * _exp(b_G)
                b_kg = kf * _exp(G_last[None, :] - b_G)
                if T_FORM:
                    b_kx = kf * _exp(b_G)
            # q e^G, k e^{G_last − G} for stage 2 (both exponents ≤ 0)
            _tile_store(qg, (bos * HV + i_h) * K, T_seq, K, HV * K, t0, kc0, b_qg, BTc, BKC, CHK_R, CHK_C)
            _tile_store(kg, (bos * HV + i_h) * K, T_seq, K, HV * K, t0, kc0, b_kg, BTc, BKC, CHK_R, CHK_C)
            if GC_OUT:      # G itself, for the backward
                _tile_store(gcum, (bos * HV + i_h) * K, T_seq, K, HV * K, t0, kc0, b_G, BTc, BKC, CHK_R, CHK_C)
            o_k = kc0 + tl.arange(0, BKC)
            tl.store(glast + (slot * HV + i_h) * K + o_k, _exp(G_last), mask=o_k < K)
            if T_FORM:      # k e^G (exponent ≤ 0) for stage 2's (K ⊙ e^G) S, in W's place
                _tile_store(w, (bos * HV + i_h) * K, T_seq, K, HV * K, t0, kc0, b_kx, BTc, BKC, CHK_R, CHK_C)
        if PASS == 1:       # flagged: the second launch forms everything else
            tl.store(flag + i_bh * n_t + i_t, tl.minimum(n_out, 1))
            if n_out > 0:
                return
        # the one-reference products also filled the upper triangle (there up to e^{2 span_max})
        if NF_OUT == 1:
            f1 = tl.min(tl.where(rb > 0, o_t, BTc), 0)
            A = tl.where(strict & (o_t[:, None] < f1), A, 0.)
        else:
            A = tl.where(strict, A, 0.)
        P = tl.where(incl, P, 0.)
    else:
        b_k = _tile_load(k_base, 0, T_seq, K, H * K, t0, 0, BTc, BK, CHK_R, CHK_C)
        KK = tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PREC)                       # [BT, BK] @ [BK, BT]
        if NF_OUT == 1:     # a non-finite k_i makes KK_ii = |k_i|² non-finite (reaching only row and column i: cut below)
            rb = tl.maximum(rb, tl.where(_finite(tl.sum(tl.where(o_t[:, None] == o_t[None, :], KK, 0.), 1)), 0, 1))
        if BWD or STORE_P:
            b_q = _tile_load(q_base, 0, T_seq, K, H * K, t0, 0, BTc, BK, CHK_R, CHK_C)
            QK = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)                   # [BT, BK] @ [BK, BT]
        if GATE == 1:
            if NF_OUT == 1:
                Gc, rg = _chunk_gate_finite(g, bos, t0, T_seq, i_h, HV, BTc, g_floor, FULL_ROWS)
                rb = tl.maximum(rb, rg)
            else:
                Gc = _chunk_gate(g, bos, t0, T_seq, i_h, HV, BTc, g_floor, FULL_ROWS)   # [BT]
        low = strict
        if NF_OUT == 1:
            f1 = tl.min(tl.where(rb > 0, o_t, BTc), 0)
            low = strict & (o_t[:, None] < f1)
        if GATE == 1:
            if GC_OUT:
                tl.store(gcum + (slot * HV + i_h) * BTc + o_t, Gc)
                tl.store(glast + slot * HV + i_h, tl.sum(tl.where(o_t == BTc - 1, Gc, 0.), 0))
            dec = _exp(tl.where(incl, Gc[:, None] - Gc[None, :], float("-inf")))       # e^{G_i − G_j}, i ≥ j
            A = tl.where(low, KK * dec, 0.) * b_beta[:, None]
            if BWD or STORE_P:
                if NF_OUT == 1:
                    P = tl.where(incl, QK * dec, 0.)
                else:
                    P = QK * dec
            b_ks = b_beta * _exp(Gc)                                                    # W's row scale
        else:
            A = tl.where(low, KK, 0.) * b_beta[:, None]
            if BWD or STORE_P:
                P = tl.where(incl, QK, 0.)
            b_ks = b_beta
    if not BWD and STORE_P:
        _tile_store(p, (bos * HV + i_h) * BTc, T_seq, BTc, HV * BTc, t0, 0, P, BTc, BTc, CHK_R, 0)

    Tm = _solve_unit_lower(A, SOLVE_PREC, BTc, BCc)                                      # (I + A)^-1
    # NF_OUT 2 (a first launch): a non-finite k, g or β leaves a non-finite T, whose program the second launch
    # (NF_OUT 1) does again whole
    DEFER: tl.constexpr = PASS == 1 and (NF_OUT == 2 or (GATE != 2 and SOLVE_PREC == "fp16"))
    if SOLVE_PREC == "fp16":
        # fp16 operands (rounded to nearest: tf32's significand) unless an operand left fp16's range, which leaves
        # an inf or NaN in T: then the chunk's solve again at REDO_PREC, here or (PASS 1) in the second launch
        bad = tl.sum(tl.sum(tl.where(tl.abs(Tm) < 65504.0, 0, 1), 1), 0) > 0        # (a NaN counts)
        if DEFER:
            tl.store(flag + i_bh * n_t + i_t, bad.to(tl.int32))
        elif bad:
            Tm = _solve_unit_lower(A, REDO_PREC, BTc, BCc)
    elif DEFER:
        bad = tl.sum(tl.sum(tl.where(_finite(Tm), 0, 1), 1), 0) > 0
        tl.store(flag + i_bh * n_t + i_t, bad.to(tl.int32))
    if T_FORM:      # T diag(β) for stage 2, in U's place; no W, U (the training forward: T for the backward too)
        _tile_store(u, (bos * HV + i_h) * BTc, T_seq, BTc, HV * BTc, t0, 0, Tm * b_beta[None, :], BTc, BTc, CHK_R, 0)
        if STORE_T:
            _tile_store(t_out, (bos * HV + i_h) * BTc, T_seq, BTc, HV * BTc, t0, 0, Tm, BTc, BTc, CHK_R, 0)
    else:
        if BWD or STORE_T:
            _tile_store(t_out, (bos * HV + i_h) * BTc, T_seq, BTc, HV * BTc, t0, 0, Tm, BTc, BTc, CHK_R, 0)
        if BWD:
            b_do = _tile_load(do, (bos * HV + i_h) * V, T_seq, V, HV * V, t0, 0, BTc, BVf, CHK_R, CHK_C)
            if WU_LOWP:     # P in the input dtype, as the backward's W / U recompute does with 16-bit operands
                b_drl = _mm(tl.trans(P.to(b_do.dtype)), b_do, MM_PREC)                       # [BT, BT] @ [BT, BV]
            else:
                b_drl = _mm(tl.trans(P), b_do.to(tl.float32), MM_PREC)                       # [BT, BT] @ [BT, BV]
            _tile_store(drl, (bos * HV + i_h) * V, T_seq, V, HV * V, t0, 0, b_drl * scale, BTc, BVf, CHK_R, CHK_C)
        if WU_LOWP:         # W, U products in the input dtype (tensor cores at the 16-bit rate), as fla does
            Tm = Tm.to(w.dtype.element_ty)
        if GATE == 2:
            # W = T (β e^G K), the right-hand side formed again per column chunk (e^G ≤ 1)
            for i_kc in range(BK // BKC):
                kc0 = i_kc * BKC
                kf = _tile_load(k_base, 0, T_seq, K, H * K, t0, kc0, BTc, BKC, CHK_R, CHK_C).to(tl.float32)
                b_g = _tile_load(g, (bos * HV + i_h) * K, T_seq, K, HV * K, t0, kc0, BTc, BKC, CHK_R,
                                 CHK_C).to(tl.float32)
                if NF_OUT == 1:
                    b_g = _finite_or_zero(tl.where(b_g < g_floor, g_floor, b_g))
                b_G = tl.cumsum(tl.where(b_g < g_floor, g_floor, b_g), 0)
                Xk = kf * b_beta[:, None] * _exp(b_G)
                if NF_OUT == 1:
                    Xk = tl.where(o_t[:, None] < f1, Xk, 0.)
                b_w = _mm(Tm, Xk.to(Tm.dtype), MM_PREC)                                      # [BT, BT] @ [BT, BKC]
                _tile_store(w, (bos * HV + i_h) * K, T_seq, K, HV * K, t0, kc0, b_w, BTc, BKC, CHK_R, CHK_C)
        else:
            Xk = b_k.to(tl.float32) * b_ks[:, None]
            if NF_OUT == 1:
                Xk = tl.where(o_t[:, None] < f1, Xk, 0.)
            b_w = _mm(Tm, Xk.to(Tm.dtype), MM_PREC)                                          # [BT, BT] @ [BT, BK]
            _tile_store(w, (bos * HV + i_h) * K, T_seq, K, HV * K, t0, 0, b_w, BTc, BK, CHK_R, CHK_C)
        b_v = _tile_load(v, (bos * HV + i_h) * V, T_seq, V, HV * V, t0, 0, BTc, BVf, CHK_R, CHK_C).to(tl.float32)
        Xv = b_v * b_beta[:, None]
        if NF_OUT == 1:
            rb = tl.maximum(rb, tl.max(tl.where(_finite(b_v), 0, 1), 1))
            Xv = tl.where(o_t[:, None] < tl.min(tl.where(rb > 0, o_t, BTc), 0), Xv, 0.)
        b_u = _mm(Tm, Xv.to(Tm.dtype), MM_PREC).to(u.dtype.element_ty)                      # [BT, BT] @ [BT, BV]
        _tile_store(u, (bos * HV + i_h) * V, T_seq, V, HV * V, t0, 0, b_u, BTc, BVf, CHK_R, CHK_C)
    if NF_OUT == 1:
        tl.store(nf + slot * HV + i_h, tl.min(tl.where(rb > 0, o_t, BTc), 0))
    elif NF_OUT == 2:   # (a flagged program's cut comes from the second launch)
        tl.store(nf + slot * HV + i_h, BTc)
    if SIGNAL:
        if DEFER:       # a flagged program is published by the second launch
            if bad == 0:
                _signal_ready(ready, slot, i_h, HV)
        else:
            _signal_ready(ready, slot, i_h, HV)


@triton.jit(do_not_specialize=["T", "NT", "H", "HV"])
def chunk_p_kernel(q, k, g, p, cu_seqlens, chunk_indices, T, NT, H, HV, K,
                   BTc: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr, IS_VARLEN: tl.constexpr,
                   DOT_PREC: tl.constexpr, g_floor: tl.constexpr):
    """P = tril(⟨q_i, k_j⟩ e^{G_i − G_j}) of one chunk of one value head, for simple GLA (no stage 1
    otherwise): stage 2 then reads P instead of forming it once per value block (``P_IN``). Grid
    (chunks, B·HV); scalar gate or none."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // HV, i_bh % HV
    i_hk = i_h // (HV // H)
    bos, T_seq, t0, _ = _chunk_span(i_t, i_b, cu_seqlens, chunk_indices, T, NT, BTc, IS_VARLEN)
    o_t = tl.arange(0, BTc)
    incl = o_t[:, None] >= o_t[None, :]
    b_q = _tile_load(q, (bos * H + i_hk) * K, T_seq, K, H * K, t0, 0, BTc, BK, 1, 1)
    b_k = _tile_load(k, (bos * H + i_hk) * K, T_seq, K, H * K, t0, 0, BTc, BK, 1, 1)
    P = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)                            # [BT, BK] @ [BK, BT]
    if GATE == 1:
        Gc = _chunk_gate(g, bos, t0, T_seq, i_h, HV, BTc, g_floor)                      # [BT]
        # (a where, not the exact zero of e^{-inf}: 0 · NaN would carry a later key's NaN into the earlier rows)
        P = tl.where(incl, P * _exp(tl.where(incl, Gc[:, None] - Gc[None, :], float("-inf"))), 0.)
    else:
        P = tl.where(incl, P, 0.)
    _tile_store(p, (bos * HV + i_h) * BTc, T_seq, BTc, HV * BTc, t0, 0, P, BTc, BTc, 1, 0)


# ------------------------------------------------------------------------------------------------
# launchers
# ------------------------------------------------------------------------------------------------

def chunk_prepare(q, k, v, g, beta, cu_seqlens=None, chunk_indices=None, *, plan: ForwardPlan | None = None,
                  save_t=False, store_p=True, ready=None, save_g=False):
    """Stage 1 for the delta families.

    Args: q, k [B,T,H,K]; v [B,T,HV,V]; g None | [B,T,HV] fp32 | [B,T,HV,K] fp32 (raw log-decays);
    beta [B,T,HV]; cu_seqlens [N+1] with chunk_indices [NT_total, 2] (varlen, B = 1); ``plan`` (default:
    forward_plan's for these inputs).
    Returns dict: w [B,T,HV,K], u [B,T,HV,V], p [B,T,HV,64] (q's dtype) and, for per-channel g,
    qg, kg [B,T,HV,K] (q's dtype) and glast [slots, HV, K] fp32 (e^{G_last} per chunk; the slot of
    chunk i of sequence n is n·NT + i, or n + start_token // 64 with cu_seqlens), for scalar g gcum [slots, HV, 64]
    fp32 (the chunk-local cumulative gate G, one row per chunk slot) and glast [slots, HV] fp32 (G_last per chunk);
    with ``save_t`` also t = (I + A)⁻¹ [B,T,HV,64] (for a backward that reuses stage 1). ``store_p=False`` (scalar /
    no gate): p is None, for a stage 2 that forms P itself. Under the plan's ``t_form``: u is (I + A)⁻¹ diag(β)
    [B,T,HV,64] and w (per-channel g) K ⊙ e^G [B,T,HV,K] or None, in q's dtype. ``ready`` ([slots, HV] int32,
    zeroed): the chunk-major grid, each program setting its entry once its outputs are stored, for a stage 2
    launched beside it. ``save_g`` (per-channel g): also G [B,T,HV,K] fp32, the chunk-local cumulative gate, for the
    backward (key "G"). nf [slots, HV] int32: each chunk's first row with a non-finite k, v, g or β (64 if none),
    whose own outputs above are those of the chunk with those inputs taken as 0 (stage 2 makes its outputs NaN).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    gate = gate_kind(g)
    if plan is None:
        plan = forward_plan(q.device, q.dtype, gate, True, K, V, save=save_t)
    t_form = plan.t_form
    NT = cdiv(T, BT)
    dev, dt = q.device, q.dtype
    w = None if t_form and gate != 2 else _alloc((B, T, HV, K), dt, dev)
    u = _alloc((B, T, HV, BT if t_form else V), dt, dev)
    store_p = store_p or gate == 2
    p = _alloc((B, T, HV, BT), dt, dev) if store_p else None
    n_chunks = chunk_indices.shape[0] if cu_seqlens is not None else NT
    slots = chunk_slots(B if cu_seqlens is None else cu_seqlens.numel() - 1, T, cu_seqlens is not None)
    gcum = None
    if gate == 2:
        qg = _alloc((B, T, HV, K), dt, dev)
        kg = _alloc((B, T, HV, K), dt, dev)
        glast = _alloc((slots, HV, K), torch.float32, dev)
        if save_g:
            gcum = _alloc((B, T, HV, K), torch.float32, dev)
    else:
        qg = kg = glast = None
        if gate == 1:       # G and G_last for stage 2
            gcum = _alloc((slots, HV, BT), torch.float32, dev)
            glast = _alloc((slots, HV), torch.float32, dev)
    t = None
    if save_t:      # fp32, or the input dtype where the backward takes T in it
        t = _alloc((B, T, HV, BT), saved_t_dtype(dt, K, gate, t_form), dev)
    # KDA: a flagging launch and the flagged programs' second one (PASS); an fp16 solve's redo likewise (redo_split)
    two = gate == 2 or plan.redo_split
    flag = torch.empty(n_chunks * B * HV, dtype=torch.int32, device=dev) if two else None
    if gate == 2:
        launches = [(1, plan.solve_prec), (2, plan.solve_prec)]
    elif plan.redo_split:   # (the second launch tries the fp16 solve again: with a non-finite input cut, T may fit)
        launches = [(1, plan.solve_prec), (2, plan.solve_prec)]
    else:
        launches = [(0, plan.solve_prec)]
    grid = (n_chunks, B * HV) if ready is None else (B * HV, n_chunks)
    nf = torch.empty((slots, HV), dtype=torch.int32, device=dev)     # each chunk's first non-finite row
    full_rows, full_cols = chunks_whole(T, cu_seqlens is not None), K == _dim(K) and V == _dim(V)
    regs = {} if plan.prep_maxnreg is None else {"maxnreg": plan.prep_maxnreg}
    for pass_, s_prec in launches if n_chunks > 0 else ():
        chunk_prepare_kernel[grid](
            q, k, v, g, beta, w, u, p, qg, kg, glast, gcum, None, t, None, flag, ready, cu_seqlens, chunk_indices, T, NT,
            H=H, HV=HV, K=K, V=V, scale=1.0, BTc=BT, BCc=BC, BK=_dim(K), BVf=_dim(V), BKC=min(plan.prep_bkc, _dim(K)),
            GATE=gate, IS_VARLEN=cu_seqlens is not None, DOT_PREC=plan.dot_prec, MM_PREC=plan.mm_prec, SOLVE_PREC=s_prec,
            g_floor=G_FLOOR, span_max=SPAN_MAX, WU_LOWP=plan.wu_lowp, STORE_T=save_t, STORE_P=store_p,
            GC_OUT=gcum is not None, PASS=pass_, T_FORM=t_form, AP_LOWP=plan.ap_lowp, REDO_PREC=plan.redo_prec,
            SIGNAL=ready is not None, FULL_ROWS=full_rows, FULL_COLS=full_cols, nf=nf,
            NF_OUT=2 if pass_ == 1 and t_form else 1,
            num_warps=plan.prep_warps, num_stages=plan.prep_stages, **regs)
    # (the kernel's gcum: G by chunk for a scalar gate, stage 2's; G per token and channel for KDA, the backward's)
    return dict(w=w, u=u, p=p, qg=qg, kg=kg, glast=glast, t=t, gcum=gcum if gate == 1 else None,
                G=gcum if gate == 2 else None, nf=nf)


def chunk_prepare_bwd(q, k, v, g, beta, do, scale, w, u, t_out, drl, cu_seqlens=None, chunk_indices=None,
                      wu_lowp=True, num_warps=4, maxnreg=None):
    """The backward's recompute for the delta rule with a scalar gate or none, in one pass per chunk (BWD
    form of chunk_prepare_kernel): fills w [B,T,HV,K], u [B,T,HV,V] (16-bit for 16-bit inputs), t_out =
    (I + A)⁻¹ [B,T,HV,64] fp32 and drl = scale Pᵀ dO [B,T,HV,V]. ``wu_lowp``: the products of T and P
    with 16-bit operands (16-bit inputs only, where wu_lowp_ok)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    gate = gate_kind(g)
    assert gate != 2 and beta is not None, "chunk_prepare_bwd: delta rule, scalar gate or none"
    NT = cdiv(T, BT)
    n_chunks = chunk_indices.shape[0] if cu_seqlens is not None else NT
    dot_prec, mm_prec, solve_prec = precisions(q.dtype)
    regs = {} if maxnreg is None else {"maxnreg": maxnreg}
    if n_chunks > 0:
        chunk_prepare_kernel[(n_chunks, B * HV)](
            q, k, v, g, beta, w, u, None, None, None, None, None, do, t_out, drl, None, None, cu_seqlens, chunk_indices,
            T, NT,
            H=H, HV=HV, K=K, V=V, scale=scale, BTc=BT, BCc=BC, BK=_dim(K), BVf=_dim(V), BKC=min(64, _dim(K)),
            GATE=gate, IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_prec, MM_PREC=mm_prec, SOLVE_PREC=solve_prec,
            g_floor=G_FLOOR, span_max=SPAN_MAX, WU_LOWP=bool(wu_lowp) and wu_lowp_ok(q.dtype, K, V), BWD=True,
            num_warps=num_warps, num_stages=1, **regs)


def chunk_p(q, k, g, v_heads, cu_seqlens=None, chunk_indices=None):
    """P [B, T, HV, 64] (q's dtype) alone, for simple GLA where stage 2 reads it (see chunk_p_kernel)."""
    B, T, H, K = q.shape
    HV = v_heads
    NT = cdiv(T, BT)
    p = _alloc((B, T, HV, BT), q.dtype, q.device)
    n_chunks = chunk_indices.shape[0] if cu_seqlens is not None else NT
    if n_chunks > 0:
        chunk_p_kernel[(n_chunks, B * HV)](
            q, k, g, p, cu_seqlens, chunk_indices, T, NT, H, HV, K, BTc=BT, BK=_dim(K), GATE=gate_kind(g),
            IS_VARLEN=cu_seqlens is not None, DOT_PREC=precisions(q.dtype)[0], g_floor=G_FLOOR, num_warps=4)
    return p
