"""Triton chunked forward (prefill / training forward) of the four families (DESIGN.md §2).

Two kernels, each with its launcher:

1. ``chunk_prepare_kernel`` (delta families only), grid (chunks, B·HV), fully parallel. Per chunk of
   C = 64 tokens, on whole [64, ·] register tiles (tensor-core dots throughout)::

       G   = cumsum(max(g, G_FLOOR))                    fp32, chunk-local, per channel for KDA
       A   = strict_tril(β_i ⟨k_i, Γ_ij ⊙ k_j⟩)           [C, C]
       T   = (I + A)⁻¹                                  (I+D)⁻¹ on the four 16×16 diagonal blocks,
                                                        then (I+M)⁻¹ = (I−M)(I+M²), M = (I+D)⁻¹ L
       W   = T (β ⊙ e^G ⊙ K)     U = T (β ⊙ V)
       P   = tril(⟨q_i, Γ_ij ⊙ k_j⟩)                     diagonal included

   It writes w [B,T,HV,K], u [B,T,HV,V] (input dtype), P [B,T,HV,C] (input dtype) and, for KDA's
   per-channel gate only, q ⊙ e^G and k ⊙ e^{G_last − G} [B,T,HV,K] (input dtype) plus
   e^{G_last} [slots, HV, K] fp32. Outside autograd (``T_FORM``, the default; under autograd for KDA too,
   ``SAVE_T_FORM``, with T kept for the backward) it writes T diag(β)
   [B,T,HV,C] in u's place instead of W and U (and, per channel, K ⊙ e^G in w's), and stage 2 forms
   R = U − W S = T diag(β) (V − e^G ⊙ K S) itself: stage 1 reads no v and skips W's and U's products.

2. ``chunk_state_output_kernel``, grid (V / BV, N·HV), serial over the chunks of one sequence. It
   carries S [K, BV] fp32 in registers::

       R = U − W S              (delta)        R = V        (simple GLA)
         = T diag(β) (V − e^G ⊙ K S)            (delta, T_FORM)
       O = scale · ((Q ⊙ e^G) S + P R)
       S ← diag(e^{G_last}) S + (K ⊙ e^{G_last − G})ᵀ R

   and writes only o (and the final state): no per-chunk state tensor ever reaches memory.
   For scalar / no gates it can form P itself (``P_IN=False``), which simple GLA always does:
   simple GLA launches this kernel alone.

Numerics. Every exponential is of a non-positive number: e^{G_i − G_j} with i ≥ j, or of a factor
around a reference point. KDA's per-channel pairwise products factor around one reference per
chunk, r = G_last / 2 per channel, e^{G_i − G_j} = e^{G_i − r} · e^{r − G_j}, wherever every
|G_i − r| of a column chunk is under SPAN_MAX (both factors within e^{±80}: two products per column
chunk, ``AP_ONE_REF``); elsewhere around the last token r of each 16-token column block, both
factors ≤ 1, with the diagonal 16×16 blocks around the block start s (e^{G_i − s} · e^{s − G_j})
when the gates inside the block sum above −SPAN_MAX, else an exact pair-by-pair loop over that
block's columns.
Gates are clamped per token at G_FLOOR = −40 (NaN passes through): e^{−40} ≈ 4e-18 is 11 orders
under fp32's resolution, so the recurrence cannot tell the clamp from the true gate, while a hard
reset g = −1e4 would otherwise make the fp32 cumulative sums after it lose ~3 digits when
differenced (measured on the torch model of this kernel: output error 6e-5 unclamped, 9e-7 clamped,
"strong" gates of tests/helpers.make_inputs).

The backward may import ``chunk_prepare`` (recompute w, u, P) and the kernels themselves.
"""
from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from .common import (BC, BT, FAST_EXP, G_FLOOR, SPAN_FP16, SPAN_MAX, _INTERPRET, _alloc, _by_block,  # noqa: F401
                     _chunk_span, _dim, _ensure_allocator, _exp, _exp_or, _gate_kind, _mm, _mm_acc, _num_sms, _overlap,
                     _poison, _row_of, _rn_tf32, _side_stream, _signal_ready, _wait_ready, cdiv, chunk_slots,
                     chunks_whole, cut_state, next_pow2, on_tensor_device, pad_last, pad_state, padded_dims,
                     state_dtype)
from .configs import WIDE_16BIT_K, fp16_kda_in_fp32, wu_lowp_ok  # noqa: F401

# ------------------------------------------------------------------------------------------------
# 1. prepare: A, (I + A)^-1, W, U, P per chunk, on whole 64-row tiles
# ------------------------------------------------------------------------------------------------

@triton.jit
def _solve_unit_lower(A, PREC: tl.constexpr, BTc: tl.constexpr, BCc: tl.constexpr, DOUBLING: tl.constexpr = 0):
    """T = (I + A)⁻¹ for A [BT, BT] fp32 strictly lower triangular (BT = 4 BC). Returns [BT, BT] fp32.

    With D the 16×16 diagonal blocks of A and L = A − D (strictly block-lower):
        I + A = (I + D)(I + M),   M = (I + D)⁻¹ L,   M⁴ = 0
        (I + D)⁻¹: DOUBLING (the default): three levels X_2s = X_s − X_s L_s X_s over the 2×2, 4×4, 8×8
                   solved blocks (two products each, batched over the 4 blocks, [4, 16, 16]); else BC − 1 steps
                   of X ← I − D X (a register-level row-by-row substitution measured 1.2-1.5x slower on the
                   H200: benchmarks/NOTES.md)
        (I + M)⁻¹ = (I − M)(I + M²)
        T = (I + M)⁻¹ (I + D)⁻¹
    X ← I − D X is forward substitution done on all rows at once: after step n, rows 0..n are final,
    each e_i − Σ_{m<i} D_im X_m of final rows, so it rounds like substitution. The doubling levels are the
    exact inverse of a 2×2 block-lower matrix, [[I_a, 0], [L, I_b]]⁻¹ = [[I_a⁻¹, 0], [−I_b⁻¹ L I_a⁻¹, I_b⁻¹]]
    (recursive triangular inversion, as stable as substitution; under the interpreter, nearly parallel keys:
    5.60e-7 against 5.59e-7 from the float64 inverse), in 6 dependent products instead of 14. Powers of D are never
    formed: with nearly parallel keys (D ≈ −0.97 below the diagonal) the product form
    (I − D)(I + D²)(I + D⁴)(I + D⁸) cost 75× the error of a triangular solve (3.5e-5 vs 4.7e-7 in fp32,
    tests/test_triton_chunk_fwd.py::test_correlated_keys_fp32). M's powers stop at M² (4 block steps).
    Every product is a dot (tensor cores for bf16/fp16 inputs).
    """
    NB: tl.constexpr = BTc // BCc
    o_t = tl.arange(0, BTc)
    o_b = tl.arange(0, NB)
    o_c = tl.arange(0, BCc)
    same = (o_t // BCc)[:, None] == (o_t // BCc)[None, :]
    eye = tl.where(o_t[:, None] == o_t[None, :], 1., 0.)
    on_diag = (o_b[:, None] == o_b[None, :])[:, :, None, None]                          # [NB, NB, 1, 1]
    A4 = tl.permute(tl.reshape(A, [NB, BCc, NB, BCc]), (0, 2, 1, 3))                   # [b, c, i, j]
    Dd = tl.sum(tl.where(on_diag, A4, 0.), 1)                                          # [NB, BC, BC]
    eye_b = tl.where(o_c[:, None] == o_c[None, :], 1., 0.)[None, :, :]
    if DOUBLING:
        # (I + D)⁻¹ by doubling the solved block: with X_s the inverses of the s×s diagonal blocks, a 2s×2s
        # block [[I_a, 0], [L_s, I_b]] has the inverse X_2s = X_s − X_s L_s X_s (L_s: D's lower-left s×s block
        # in each 2s×2s block). Exact, no powers of D; 2 log2(BC / 2) products in sequence instead of BC − 2.
        s_rows = o_c[:, None]
        s_cols = o_c[None, :]
        m1 = (s_rows == s_cols + 1) & (s_rows % 2 == 1)
        X = eye_b - tl.where(m1[None, :, :], Dd, 0.)
        tl.static_assert(BCc == 16, "the doubling solve is written for 16×16 diagonal blocks")
        for lvl in tl.static_range(1, 4):
            m = ((s_rows >> lvl) % 2 == 1) & ((s_cols >> lvl) % 2 == 0) & (s_rows >> (lvl + 1) == s_cols >> (lvl + 1))
            Ls = tl.where(m[None, :, :], Dd, 0.)
            XL = _mm(X, Ls, PREC)                                                          # [NB, BC, BC] @ [NB, BC, BC]
            X = X - _mm(XL, X, PREC)                                                       # [NB, BC, BC] @ [NB, BC, BC]
    else:
        X = eye_b - Dd
        for _ in range(BCc - 2):
            X = eye_b - _mm(Dd, X, PREC)                                                   # [NB, BC, BC] @ [NB, BC, BC]
    Dinv = tl.reshape(tl.permute(tl.where(on_diag, tl.expand_dims(X, 1), 0.), (0, 2, 1, 3)), [BTc, BTc])
    L = tl.where(same, 0., A)
    M = _mm(Dinv, L, PREC)                                                                 # [BT, BT] @ [BT, BT]
    M2 = _mm(M, M, PREC)                                                                   # [BT, BT] @ [BT, BT]
    Y = eye - M
    Y = Y + _mm(Y, M2, PREC)                                                               # [BT, BT] @ [BT, BT]
    return _mm(Y, Dinv, PREC)                                                              # [BT, BT] @ [BT, BT]


@triton.jit
def _chunk_gate(g, bos, t0, T_seq, i_h, HV, BTc: tl.constexpr, g_floor: tl.constexpr, FULL_ROWS: tl.constexpr = 0):
    """G [BT] fp32: the chunk-local cumulative scalar gate of value head i_h, each token's gate clamped
    at g_floor (rows past the sequence end add 0; FULL_ROWS: the chunk is whole, no bounds check)."""
    o_t = tl.arange(0, BTc)
    if FULL_ROWS:
        b_g = tl.load(g + (bos + t0 + o_t) * HV + i_h).to(tl.float32)
    else:
        b_g = tl.load(g + (bos + t0 + o_t) * HV + i_h, mask=t0 + o_t < T_seq, other=0.).to(tl.float32)
    return tl.cumsum(tl.where(b_g < g_floor, g_floor, b_g), 0)


@triton.jit
def _kqg_tiles(k_base, q_base, g_base, r0, kc0, T_seq, H, HV, K, R: tl.constexpr, BKC: tl.constexpr,
               CHK: tl.constexpr):
    """Rows r0 .. r0 + R − 1, channels kc0 .. kc0 + BKC − 1 of k, q and the per-channel gate g, as fp32
    [R, BKC] tiles (zero past the sequence end and K; CHK: the bounds checked, chunk_prepare_kernel's)."""
    b_k = tl.load(tl.make_block_ptr(k_base, (T_seq, K), (H * K, 1), (r0, kc0), (R, BKC), (1, 0)),
                  boundary_check=CHK).to(tl.float32)
    b_q = tl.load(tl.make_block_ptr(q_base, (T_seq, K), (H * K, 1), (r0, kc0), (R, BKC), (1, 0)),
                  boundary_check=CHK).to(tl.float32)
    b_g = tl.load(tl.make_block_ptr(g_base, (T_seq, K), (HV * K, 1), (r0, kc0), (R, BKC), (1, 0)),
                  boundary_check=CHK).to(tl.float32)
    return b_k, b_q, b_g


@triton.jit
def _block_starts(b_G, BTc: tl.constexpr, BCc: tl.constexpr):
    """The 16-token blocks of a per-channel chunk gate b_G [BT, BKC]: (G at the ends of the first three
    blocks e0, e1, e2 [BKC]; each row's block start s_b (G before its block, 0 for the first) [BT, BKC];
    the most negative G_i − s_b, that is minus the widest block span)."""
    e0 = _row_of(b_G, BCc - 1, BTc)
    e1 = _row_of(b_G, 2 * BCc - 1, BTc)
    e2 = _row_of(b_G, 3 * BCc - 1, BTc)
    zero = tl.zeros_like(e0)
    s_rows = _by_block(zero[None, :], e0[None, :], e1[None, :], e2[None, :], BTc, BCc)
    return e0, e1, e2, s_rows, tl.min(tl.min(b_G - s_rows, 1), 0)


@triton.jit
def _kda_diag_exact(kf, qf, bk, b_G, skip, BTc: tl.constexpr, BCc: tl.constexpr):
    """KDA's diagonal 16×16 blocks of A (without β: bk = β k) and P, each column j exactly from
    e^{G_i − G_j}, i ≥ j in j's block, for blocks whose gates span too far to factor (rare: a loop, not
    unrolled). kf, qf, bk, b_G: [BT, BKC] fp32; skip [BT] int32: 1 for the columns of blocks left out (their
    columns stay zero). Returns (Ad, Pd) [BT, BT], zero off those blocks."""
    o_t = tl.arange(0, BTc)
    blk = o_t // BCc
    Ad = tl.zeros([BTc, BTc], dtype=tl.float32)
    Pd = tl.zeros([BTc, BTc], dtype=tl.float32)
    for j in range(BTc):
        if tl.sum(tl.where(o_t == j, skip, 0), 0) == 0:
            k_j = tl.sum(tl.where((o_t == j)[:, None], kf, 0.), 0)                      # [BKC]
            G_j = tl.sum(tl.where((o_t == j)[:, None], b_G, 0.), 0)                     # [BKC]
            m_j = (o_t >= j) & (blk == j // BCc)
            e = _exp(tl.where(m_j[:, None], b_G - G_j[None, :], float("-inf")))         # e^{G_i − G_j}
            Ad = tl.where((o_t == j)[None, :], tl.sum(bk * e * k_j[None, :], 1)[:, None], Ad)
            Pd = tl.where((o_t == j)[None, :], tl.sum(qf * e * k_j[None, :], 1)[:, None], Pd)
    return Ad, Pd


@triton.jit
def _stack_rows(x0, x1, x2, x3):
    """[4·R, N] from four [R, N] row blocks, in order."""
    R: tl.constexpr = x0.shape[0]
    N: tl.constexpr = x0.shape[1]
    x = tl.join(tl.join(x0, x1), tl.join(x2, x3))                                      # [R, N, 2, 2]: [.., b % 2, b // 2]
    return tl.reshape(tl.permute(x, (3, 2, 0, 1)), [4 * R, N])


@triton.jit
def _block_rows(x, b: tl.constexpr, BCc: tl.constexpr):
    """Rows b·BC .. b·BC + BC − 1 of x [4·BC, N] as [BC, N] (a masked sum over the block index)."""
    N: tl.constexpr = x.shape[1]
    sel = (tl.arange(0, 4) == b)[:, None, None]
    return tl.sum(tl.where(sel, tl.reshape(x, [4, BCc, N]), 0.), 0)


@triton.jit
def _kda_ap_rows(A0, A1, A2, A3, P0, P1, P2, P3, kf, qf, b_G, b_beta, k_base, q_base, g_base, beta, bos, t0,
                 T_seq, i_h, H, HV, K, kc0, MM_PREC: tl.constexpr, BTc: tl.constexpr, BCc: tl.constexpr,
                 BKC: tl.constexpr, g_floor: tl.constexpr, span_max: tl.constexpr, CHK: tl.constexpr):
    """One column chunk of KDA's A and P by 16-row blocks (stage-1 form 1). Row block b takes the start of
    its block s_b (the cumulative gate before it) as reference for every column j up to its own block:

        e^{G_i − G_j} = e^{G_i − s_b} · e^{s_b − G_j},   i in block b, j ≤ the end of block b
        A_b += (β k ⊙ e^{G − s_b})_b [BC, BKC] @ (k ⊙ e^{s_b − G})ᵀ [BKC, BT]          (P_b: q instead of β k)

    The row factor is ≤ 1; the column factor is ≤ 1 for earlier blocks and ≤ e^{span} within block b.
    One product per row block: a quarter of the eight-dot form's multiply-adds (whose [BT, BKC] row operands
    are zero outside one block). When a block spans below −span_max, no block takes its own columns here
    and the diagonal blocks come from the exact column loop, as in form 0. A_b, P_b: [BC, BT] fp32."""
    o_t = tl.arange(0, BTc)
    o_c = tl.arange(0, BCc)
    blk = o_t // BCc
    e0, e1, e2, _, worst = _block_starts(b_G, BTc, BCc)
    zero = tl.zeros_like(e0)
    own = tl.where(worst > -span_max, 1, 0)          # 1: each row block also takes its own block's columns
    for b in tl.static_range(4):
        if b == 0:
            s_b = zero
        elif b == 1:
            s_b = e0
        elif b == 2:
            s_b = e1
        else:
            s_b = e2
        keep = (blk < b + own)[:, None]                                                  # columns j taken
        cols = tl.where(keep, kf * _exp(tl.where(keep, s_b[None, :] - b_G, 0.)), 0.)     # k_j e^{s_b − G_j}
        r0 = t0 + b * BCc
        k_b, q_b, g_b = _kqg_tiles(k_base, q_base, g_base, r0, kc0, T_seq, H, HV, K, BCc, BKC, CHK)
        beta_b = tl.load(beta + (bos + r0 + o_c) * HV + i_h, mask=r0 + o_c < T_seq, other=0.).to(tl.float32)
        x_b = _exp(tl.cumsum(tl.where(g_b < g_floor, g_floor, g_b), 0))                  # e^{G_i − s_b} ≤ 1
        cT = tl.trans(cols)
        a_b = _mm(k_b * beta_b[:, None] * x_b, cT, MM_PREC)                             # [BC, BKC] @ [BKC, BT]
        p_b = _mm(q_b * x_b, cT, MM_PREC)                                               # [BC, BKC] @ [BKC, BT]
        if b == 0:
            A0 += a_b
            P0 += p_b
        elif b == 1:
            A1 += a_b
            P1 += p_b
        elif b == 2:
            A2 += a_b
            P2 += p_b
        else:
            A3 += a_b
            P3 += p_b
    if own == 0:
        # rare: the diagonal blocks exactly
        Ad, Pd = _kda_diag_exact(kf, qf, kf * b_beta[:, None], b_G, tl.zeros([BTc], dtype=tl.int32), BTc, BCc)
        A0 += _block_rows(Ad, 0, BCc)
        A1 += _block_rows(Ad, 1, BCc)
        A2 += _block_rows(Ad, 2, BCc)
        A3 += _block_rows(Ad, 3, BCc)
        P0 += _block_rows(Pd, 0, BCc)
        P1 += _block_rows(Pd, 1, BCc)
        P2 += _block_rows(Pd, 2, BCc)
        P3 += _block_rows(Pd, 3, BCc)
    return A0, A1, A2, A3, P0, P1, P2, P3


@triton.jit(do_not_specialize=["T", "NT", "H", "HV"])
def chunk_prepare_kernel(
    q, k, v, g, beta,            # [B,T,H,K] [B,T,H,K] [B,T,HV,V] None|[B,T,HV]|[B,T,HV,K] fp32, [B,T,HV]
    w, u, p,                     # out: [B,T,HV,K] [B,T,HV,V] [B,T,HV,BT] (input dtype)
    qg, kg, glast,               # out (GATE == 2): [B,T,HV,K] [B,T,HV,K] input dtype, [slots,HV,K] fp32
    gcum,                        # out (GC_OUT): GATE 1 [slots,HV,BT] fp32 G by chunk (glast then [slots,HV] G_last);
                                 # GATE 2 [B,T,HV,K] fp32 G per token and channel (for the backward)
    do, t_out, drl,              # BWD: [B,T,HV,V] in; out [B,T,HV,BT] fp32, [B,T,HV,V] (do's dtype)
    flag,                        # AP_ONE_REF 2 / 3: [chunks · B·HV] int32, per program: 1 where a column chunk's gate
                                 # left the one-reference span (written by 2, read by 3)
    ready,                       # SIGNAL: [slots, HV] int32, set to 1 once the chunk's outputs are stored (stage 2's WAIT)
    cu_seqlens, chunk_indices,   # varlen: [N+1], [NT_total, 2] (sequence, chunk in sequence)
    T, NT, H, HV, K, V, scale,
    BTc: tl.constexpr, BCc: tl.constexpr, BK: tl.constexpr, BVf: tl.constexpr, BKC: tl.constexpr,
    GATE: tl.constexpr,          # 0 none, 1 scalar, 2 per channel
    IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, MM_PREC: tl.constexpr, SOLVE_PREC: tl.constexpr,
    g_floor: tl.constexpr, span_max: tl.constexpr, WU_LOWP: tl.constexpr = 0, AP_FORM: tl.constexpr = 0,
    BWD: tl.constexpr = 0, STORE_T: tl.constexpr = 0, STORE_P: tl.constexpr = 1, GC_OUT: tl.constexpr = 0,
    AP_ONE_REF: tl.constexpr = 0, SOLVE_DOUBLING: tl.constexpr = 0, T_FORM: tl.constexpr = 0,
    AP_LOWP: tl.constexpr = 0, SOLVE_REDO: tl.constexpr = 0, REDO_PREC: tl.constexpr = "tf32",
    span16: tl.constexpr = SPAN_FP16, SIGNAL: tl.constexpr = 0, FULL_ROWS: tl.constexpr = 0,
    FULL_COLS: tl.constexpr = 0,
):
    """One chunk of one value head: see the module docstring (stage 1). Grid (chunks, B·HV); SIGNAL: (B·HV, chunks).

    BWD (the backward's recompute, scalar / no gate): instead of P, write T = (I + A)⁻¹ (fp32) and
    dR_local = scale Pᵀ dO, next to W and U; A and P never reach memory.
    STORE_T (forward, for a backward that reuses stage 1): also write T = (I + A)⁻¹ (fp32) to t_out.
    STORE_P = 0 (forward, scalar / no gate): no P (stage 2 forms it), q is not read.
    GC_OUT (forward, scalar gate): also write the chunk-local cumulative gate G per token and G_last per chunk,
    so that stage 2's serial loop neither scans nor reduces the gate; per-channel gate (a training forward): G
    [B,T,HV,K], which the backward then does not form again (its _gate_cumsum_kernel).
    AP_ONE_REF (per-channel gate, AP_FORM 0): 1 each column chunk takes the one-reference products where its gate
    allows them, else the block form (both built in); 2 the one-reference products only (the block form not built:
    fewer registers, no spills), flagging the programs where a column chunk's gate did not allow them (which then
    stop after A and P); 3 as 1, for the flagged programs alone (the others return at once), writing everything
    there.
    T_FORM (forward, not with BWD): write T diag(β) = (I + A)⁻¹ diag(β) [B,T,HV,BT] to u (input dtype) instead of
    W and U (v is not read; per channel no second column loop), and per channel K ⊙ e^G to w: stage 2 forms
    R = T diag(β) (V − (K ⊙ e^G) S) itself; with STORE_T (the training forward), T to t_out as well.
    SOLVE_PREC "fp16": where T comes out non-finite, the solve again at REDO_PREC (the input dtype's own). SOLVE_REDO
    (scalar / no gate): 1 flags those programs instead (the redo's code not built in), 2 redoes the flagged programs
    whole at SOLVE_PREC (the others return at once).
    AP_LOWP (the one-reference products): 1 A from bf16 operands; 2 (AP_ONE_REF 2) A and P from fp16 ones, the program
    flagged (for launch 3) where a column chunk's |G − G_last / 2| reaches span16 or A / P come out non-finite.
    SIGNAL (stage 2 running beside this launch, chunk_fwd's overlap): the grid chunk-major, so that every head's
    first chunks are done first, and each program, once its outputs are stored, sets ready[slot, head] (a program
    flagged to a second launch leaves that to it).
    FULL_ROWS (every chunk whole: no varlen, T a multiple of BTc) / FULL_COLS (K = BK, V = BVf): the tiles' row /
    column bounds checks left out (chunk_prepare's PREP_FULL)."""
    CHK: tl.constexpr = (() if FULL_COLS else (1,)) if FULL_ROWS else ((0,) if FULL_COLS else (0, 1))
    if SIGNAL:
        i_bh, i_t = tl.program_id(0), tl.program_id(1)
        n_t = tl.num_programs(1)
    else:
        i_t, i_bh = tl.program_id(0), tl.program_id(1)
        n_t = tl.num_programs(0)
    if AP_ONE_REF == 3 or SOLVE_REDO == 2:
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
    q_base = q + (bos * H + i_hk) * K
    k_base = k + (bos * H + i_hk) * K

    if GATE == 2:
        # per-channel gate, in column chunks of BKC channels (A and P are sums over channels, every
        # channel's gate is independent): few [BT, BKC] fp32 tiles live, shared memory bounded for K = 256.
        # Each e^{G_i − G_j} is factored around a block end or a block start, both factors ≤ 1.
        g_base = g + (bos * HV + i_h) * K
        if AP_FORM == 1:    # by 16-row blocks (_kda_ap_rows)
            A0 = tl.zeros([BCc, BTc], dtype=tl.float32)
            A1 = tl.zeros([BCc, BTc], dtype=tl.float32)
            A2 = tl.zeros([BCc, BTc], dtype=tl.float32)
            A3 = tl.zeros([BCc, BTc], dtype=tl.float32)
            P0 = tl.zeros([BCc, BTc], dtype=tl.float32)
            P1 = tl.zeros([BCc, BTc], dtype=tl.float32)
            P2 = tl.zeros([BCc, BTc], dtype=tl.float32)
            P3 = tl.zeros([BCc, BTc], dtype=tl.float32)
        else:
            A = tl.zeros([BTc, BTc], dtype=tl.float32)
            P = tl.zeros([BTc, BTc], dtype=tl.float32)
        n_out = tl.zeros([], dtype=tl.int32)     # AP_ONE_REF 2: column chunks whose gate left the one-reference span
        for i_kc in range(BK // BKC):
            kc0 = i_kc * BKC
            kf, qf, b_g = _kqg_tiles(k_base, q_base, g_base, t0, kc0, T_seq, H, HV, K, BTc, BKC, CHK)
            b_G = tl.cumsum(tl.where(b_g < g_floor, g_floor, b_g), 0)                   # [BT, BKC]
            G_last = _row_of(b_G, BTc - 1, BTc)                                          # [BKC]
            if AP_FORM == 1:
                A0, A1, A2, A3, P0, P1, P2, P3 = _kda_ap_rows(
                    A0, A1, A2, A3, P0, P1, P2, P3, kf, qf, b_G, b_beta, k_base, q_base, g_base, beta, bos, t0,
                    T_seq, i_h, H, HV, K, kc0, MM_PREC, BTc, BCc, BKC, g_floor, span_max, CHK)
                b_qg = qf * _exp(b_G)
                b_kg = kf * _exp(G_last[None, :] - b_G)
                if T_FORM:
                    b_kx = kf * _exp(b_G)
            else:
                # one reference for the whole chunk, r = G_last / 2 per channel, when every |G_i − r| of this
                # column chunk is under span_max: e^{G_i − G_j} = e^{G_i − r} · e^{r − G_j}, both factors in
                # [e^−span_max, e^span_max] (fp32's range), two products instead of eight
                r = 0.5 * G_last
                b_Gr = b_G - r[None, :]
                fast = False
                m_Gr = tl.max(tl.max(tl.abs(b_Gr), 1), 0)
                if AP_ONE_REF == 2:     # (the products may overflow where the span is left: launch 3 redoes those)
                    n_out += (m_Gr >= span_max).to(tl.int32)
                    fast = True
                elif AP_ONE_REF:
                    fast = m_Gr < span_max
                if fast:
                    x = _exp(b_Gr)                                                           # e^{G_i − r}
                    kinv = kf * _exp(-b_Gr)                                                  # k_j e^{r − G_j}
                    qx = qf * x
                    # AP_LOWP: A from bf16 operands (rounded to nearest; bf16 inputs: e^{±span_max} in range); 2: A and
                    # P from fp16 ones where this column chunk's span is under span16 (e^{±span16} in fp16's range)
                    A_PREC: tl.constexpr = "bf16" if AP_LOWP else MM_PREC
                    bkx = kf * b_beta[:, None] * x
                    if AP_LOWP == 2 and AP_ONE_REF == 2:
                        n_out += (m_Gr >= span16).to(tl.int32)
                        A += _mm(bkx, tl.trans(kinv), "fp16")                                # [BT, BKC] @ [BKC, BT]
                        P += _mm(qx, tl.trans(kinv), "fp16")                                 # [BT, BKC] @ [BKC, BT]
                    else:
                        A += _mm(bkx, tl.trans(kinv), A_PREC)                                # [BT, BKC] @ [BKC, BT]
                        P += _mm(qx, tl.trans(kinv), MM_PREC)                                # [BT, BKC] @ [BKC, BT]
                    b_qg = qx * _exp(r)[None, :]
                    b_kg = kinv * _exp(G_last - r)[None, :]
                    if T_FORM:
                        b_kx = kf * x * _exp(r)[None, :]                                     # k e^G
                else:
                    e0, e1, e2, s_rows, worst = _block_starts(b_G, BTc, BCc)                    # block ends, starts
                    e3 = _row_of(b_G, 4 * BCc - 1, BTc)
                    zero = tl.zeros_like(e0)
                    one = tl.full([BKC], 1., tl.float32)
                    x = _exp(b_G - s_rows)                                                       # e^{G_i − s_b} ≤ 1
                    ky = kf * _exp(_by_block(e0[None, :], e1[None, :], e2[None, :], e3[None, :], BTc, BCc) - b_G)
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
                    # diagonal blocks: around the block start when the block's gates sum above -span_max, else exact
                    # k_j e^{s_b − G_j} = ky_j e^{s_b − e_b}, at most e^{span_max}
                    shift = _by_block(-e0[None, :], (e0 - e1)[None, :], (e1 - e2)[None, :], (e2 - e3)[None, :],
                                      BTc, BCc)
                    if worst > -span_max:
                        kinv = ky * _exp(shift)
                        Ad = _mm(bkx, tl.trans(kinv), MM_PREC)                                   # [BT, BKC] @ [BKC, BT]
                        Pd = _mm(qx, tl.trans(kinv), MM_PREC)                                    # [BT, BKC] @ [BKC, BT]
                    else:
                        # rare: the blocks that span too far column by column from e^{G_i − G_j}, i ≥ j, the
                        # others factored as above (their shift kept, the far blocks' set to 0: finite, replaced)
                        NB: tl.constexpr = BTc // BCc
                        blk_min = tl.min(tl.reshape(tl.min(b_G - s_rows, 1), [NB, BCc]), 1)          # [NB]
                        ok = tl.reshape(tl.broadcast_to((blk_min > -span_max)[:, None], [NB, BCc]), [BTc])
                        kinv = ky * _exp(tl.where(ok[:, None], shift, 0.))
                        Ade, Pde = _kda_diag_exact(kf, qf, kf * b_beta[:, None], b_G, ok.to(tl.int32), BTc, BCc)
                        Ad = tl.where(ok[:, None], _mm(bkx, tl.trans(kinv), MM_PREC), Ade)       # [BT, BKC] @ [BKC, BT]
                        Pd = tl.where(ok[:, None], _mm(qx, tl.trans(kinv), MM_PREC), Pde)        # [BT, BKC] @ [BKC, BT]
                    A += tl.where(same & strict, Ad, 0.)
                    P += tl.where(same & incl, Pd, 0.)
                    b_qg = qf * _exp(b_G)
                    b_kg = kf * _exp(G_last[None, :] - b_G)
                    if T_FORM:
                        b_kx = kf * _exp(b_G)
            # q e^G, k e^{G_last − G} for stage 2 (both exponents ≤ 0)
            tl.store(tl.make_block_ptr(qg + (bos * HV + i_h) * K, (T_seq, K), (HV * K, 1), (t0, kc0),
                                       (BTc, BKC), (1, 0)), b_qg.to(qg.dtype.element_ty), boundary_check=CHK)
            tl.store(tl.make_block_ptr(kg + (bos * HV + i_h) * K, (T_seq, K), (HV * K, 1), (t0, kc0), (BTc, BKC),
                                       (1, 0)), b_kg.to(kg.dtype.element_ty), boundary_check=CHK)
            if GC_OUT:      # G itself, for the backward
                tl.store(tl.make_block_ptr(gcum + (bos * HV + i_h) * K, (T_seq, K), (HV * K, 1), (t0, kc0),
                                           (BTc, BKC), (1, 0)), b_G, boundary_check=CHK)
            o_k = kc0 + tl.arange(0, BKC)
            tl.store(glast + (slot * HV + i_h) * K + o_k, _exp(G_last), mask=o_k < K)
            if T_FORM:      # k e^G (exponent ≤ 0) for stage 2's (K ⊙ e^G) S, in W's place
                tl.store(tl.make_block_ptr(w + (bos * HV + i_h) * K, (T_seq, K), (HV * K, 1), (t0, kc0), (BTc, BKC),
                                           (1, 0)), b_kx.to(w.dtype.element_ty), boundary_check=CHK)
        if AP_ONE_REF == 2:     # flagged: nothing more to form here
            if AP_LOWP == 2:    # an fp16 operand past its range (keys or queries too large): an inf / NaN in A or P
                n_out += tl.sum(tl.sum(tl.where(tl.abs(A) + tl.abs(P) < float("inf"), 0, 1), 1), 0)
            tl.store(flag + i_bh * n_t + i_t, tl.minimum(n_out, 1))
            if n_out > 0:
                return
        if AP_FORM == 1:
            A = tl.where(strict, _stack_rows(A0, A1, A2, A3), 0.)
            P = tl.where(incl, _stack_rows(P0, P1, P2, P3), 0.)
        elif AP_ONE_REF:    # the one-reference products also filled the upper triangle (there up to e^{2 span_max})
            A = tl.where(strict, A, 0.)
            P = tl.where(incl, P, 0.)
    else:
        b_k = tl.load(tl.make_block_ptr(k_base, (T_seq, K), (H * K, 1), (t0, 0), (BTc, BK), (1, 0)),
                      boundary_check=CHK)
        KK = tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PREC)                       # [BT, BK] @ [BK, BT]
        if BWD or STORE_P:
            b_q = tl.load(tl.make_block_ptr(q_base, (T_seq, K), (H * K, 1), (t0, 0), (BTc, BK), (1, 0)),
                          boundary_check=CHK)
            QK = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)                   # [BT, BK] @ [BK, BT]
        if GATE == 1:
            Gc = _chunk_gate(g, bos, t0, T_seq, i_h, HV, BTc, g_floor, FULL_ROWS)       # [BT]
            if GC_OUT:
                tl.store(gcum + (slot * HV + i_h) * BTc + o_t, Gc)
                tl.store(glast + slot * HV + i_h, tl.sum(tl.where(o_t == BTc - 1, Gc, 0.), 0))
            dec = _exp(tl.where(incl, Gc[:, None] - Gc[None, :], float("-inf")))       # e^{G_i − G_j}, i ≥ j
            A = tl.where(strict, KK * dec, 0.) * b_beta[:, None]
            if BWD or STORE_P:
                P = QK * dec
            b_ks = b_beta * _exp(Gc)                                                    # W's row scale
        else:
            A = tl.where(strict, KK, 0.) * b_beta[:, None]
            if BWD or STORE_P:
                P = tl.where(incl, QK, 0.)
            b_ks = b_beta
    if not BWD and STORE_P:
        tl.store(tl.make_block_ptr(p + (bos * HV + i_h) * BTc, (T_seq, BTc), (HV * BTc, 1), (t0, 0), (BTc, BTc),
                                   (1, 0)), P.to(p.dtype.element_ty), boundary_check=CHK)

    Tm = _solve_unit_lower(A, SOLVE_PREC, BTc, BCc, SOLVE_DOUBLING)                      # (I + A)^-1
    if SOLVE_PREC == "fp16":
        # fp16 operands (rounded to nearest: tf32's significand) unless an operand left fp16's range, which leaves
        # an inf or NaN in T: then the chunk's solve again at REDO_PREC, here or (SOLVE_REDO 1) in a second launch
        bad = tl.sum(tl.sum(tl.where(tl.abs(Tm) < 65504.0, 0, 1), 1), 0) > 0        # (a NaN counts)
        if SOLVE_REDO == 1:
            tl.store(flag + i_bh * n_t + i_t, bad.to(tl.int32))
        elif bad:
            Tm = _solve_unit_lower(A, REDO_PREC, BTc, BCc, SOLVE_DOUBLING)
    if T_FORM:      # T diag(β) for stage 2, in U's place; no W, U (the training forward: T for the backward too)
        tl.store(tl.make_block_ptr(u + (bos * HV + i_h) * BTc, (T_seq, BTc), (HV * BTc, 1), (t0, 0),
                                   (BTc, BTc), (1, 0)), (Tm * b_beta[None, :]).to(u.dtype.element_ty),
                 boundary_check=CHK)
        if STORE_T:
            tl.store(tl.make_block_ptr(t_out + (bos * HV + i_h) * BTc, (T_seq, BTc), (HV * BTc, 1), (t0, 0),
                                       (BTc, BTc), (1, 0)), Tm.to(t_out.dtype.element_ty), boundary_check=CHK)
    else:
        if BWD or STORE_T:
            tl.store(tl.make_block_ptr(t_out + (bos * HV + i_h) * BTc, (T_seq, BTc), (HV * BTc, 1), (t0, 0),
                                       (BTc, BTc), (1, 0)), Tm.to(t_out.dtype.element_ty), boundary_check=CHK)
        if BWD:
            b_do = tl.load(tl.make_block_ptr(do + (bos * HV + i_h) * V, (T_seq, V), (HV * V, 1), (t0, 0), (BTc, BVf),
                                             (1, 0)), boundary_check=CHK)
            if WU_LOWP:     # P in the input dtype, as the backward's W / U recompute does at BWD_LOWP 2
                b_drl = _mm(tl.trans(P.to(b_do.dtype)), b_do, MM_PREC)                       # [BT, BT] @ [BT, BV]
            else:
                b_drl = _mm(tl.trans(P), b_do.to(tl.float32), MM_PREC)                       # [BT, BT] @ [BT, BV]
            tl.store(tl.make_block_ptr(drl + (bos * HV + i_h) * V, (T_seq, V), (HV * V, 1), (t0, 0), (BTc, BVf), (1, 0)),
                     (b_drl * scale).to(drl.dtype.element_ty), boundary_check=CHK)
        if WU_LOWP:         # W, U products in the input dtype (tensor cores at the 16-bit rate), as fla does
            Tm = Tm.to(w.dtype.element_ty)
        if GATE == 2:
            # W = T (β e^G K), the right-hand side formed again per column chunk (e^G ≤ 1)
            for i_kc in range(BK // BKC):
                kc0 = i_kc * BKC
                kf = tl.load(tl.make_block_ptr(k_base, (T_seq, K), (H * K, 1), (t0, kc0), (BTc, BKC), (1, 0)),
                             boundary_check=CHK).to(tl.float32)
                b_g = tl.load(tl.make_block_ptr(g + (bos * HV + i_h) * K, (T_seq, K), (HV * K, 1), (t0, kc0), (BTc, BKC),
                                                (1, 0)), boundary_check=CHK).to(tl.float32)
                b_G = tl.cumsum(tl.where(b_g < g_floor, g_floor, b_g), 0)
                Xk = kf * b_beta[:, None] * _exp(b_G)
                b_w = _mm(Tm, Xk.to(Tm.dtype), MM_PREC)                                      # [BT, BT] @ [BT, BKC]
                tl.store(tl.make_block_ptr(w + (bos * HV + i_h) * K, (T_seq, K), (HV * K, 1), (t0, kc0), (BTc, BKC),
                                           (1, 0)), b_w.to(w.dtype.element_ty), boundary_check=CHK)
        else:
            Xk = b_k.to(tl.float32) * b_ks[:, None]
            b_w = _mm(Tm, Xk.to(Tm.dtype), MM_PREC)                                          # [BT, BT] @ [BT, BK]
            tl.store(tl.make_block_ptr(w + (bos * HV + i_h) * K, (T_seq, K), (HV * K, 1), (t0, 0), (BTc, BK), (1, 0)),
                     b_w.to(w.dtype.element_ty), boundary_check=CHK)
        Xv = tl.load(tl.make_block_ptr(v + (bos * HV + i_h) * V, (T_seq, V), (HV * V, 1), (t0, 0), (BTc, BVf),
                                       (1, 0)), boundary_check=CHK).to(tl.float32) * b_beta[:, None]
        b_u = _mm(Tm, Xv.to(Tm.dtype), MM_PREC).to(u.dtype.element_ty)                      # [BT, BT] @ [BT, BV]
        tl.store(tl.make_block_ptr(u + (bos * HV + i_h) * V, (T_seq, V), (HV * V, 1), (t0, 0), (BTc, BVf), (1, 0)),
                 b_u, boundary_check=CHK)
    if SIGNAL:
        if SOLVE_REDO == 1:     # a flagged program is published by the redo's launch
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
    b_q = tl.load(tl.make_block_ptr(q + (bos * H + i_hk) * K, (T_seq, K), (H * K, 1), (t0, 0), (BTc, BK), (1, 0)),
                  boundary_check=(0, 1))
    b_k = tl.load(tl.make_block_ptr(k + (bos * H + i_hk) * K, (T_seq, K), (H * K, 1), (t0, 0), (BTc, BK), (1, 0)),
                  boundary_check=(0, 1))
    P = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)                            # [BT, BK] @ [BK, BT]
    if GATE == 1:
        Gc = _chunk_gate(g, bos, t0, T_seq, i_h, HV, BTc, g_floor)                      # [BT]
        P = P * _exp(tl.where(incl, Gc[:, None] - Gc[None, :], float("-inf")))         # e^{G_i − G_j}, i ≥ j
    else:
        P = tl.where(incl, P, 0.)
    tl.store(tl.make_block_ptr(p + (bos * HV + i_h) * BTc, (T_seq, BTc), (HV * BTc, 1), (t0, 0), (BTc, BTc), (1, 0)),
             P.to(p.dtype.element_ty), boundary_check=(0, 1))


# ------------------------------------------------------------------------------------------------
# 2. state + output: serial over the chunks of one sequence
# ------------------------------------------------------------------------------------------------

@triton.jit
def _state_step(i_t, S, k, v, g, bos, T_seq, i_h, i_hk, i_v, H, HV, K, V, BTc: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, GATE: tl.constexpr, DOT_PREC: tl.constexpr, g_floor: tl.constexpr):
    """One chunk of simple GLA's state alone (no output): S ← e^{G_last} S + (K ⊙ e^{G_last − G})ᵀ V.
    Returns (S, e^{G_last})."""
    o_t = tl.arange(0, BTc)
    t0 = i_t * BTc
    b_k = tl.load(tl.make_block_ptr(k + (bos * H + i_hk) * K, (T_seq, K), (H * K, 1), (t0, 0), (BTc, BK), (1, 0)),
                  boundary_check=(0, 1))
    b_v = tl.load(tl.make_block_ptr(v + (bos * HV + i_h) * V, (T_seq, V), (HV * V, 1), (t0, i_v * BV), (BTc, BV),
                                    (1, 0)), boundary_check=(0, 1))
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
def _chunk_decay(glast, slot0, i_t, c1, i_h, HV, K, BK: tl.constexpr, GATE: tl.constexpr, GC_IN: tl.constexpr):
    """Chunk i_t's decay from stage 1 (zero past c1): e^{G_last} [BK] (per-channel gate), G_last (scalar gate
    with GC_IN), else a dummy 0. Loaded one chunk ahead by the serial loop: a load the software pipeline does
    not take (not a product's operand) would otherwise expose its latency on every chunk."""
    o_k = tl.arange(0, BK)
    if GATE == 2:
        b_gl = tl.load(glast + ((slot0 + i_t) * HV + i_h) * K + o_k, mask=(o_k < K) & (i_t < c1), other=0.)
    elif GC_IN:
        b_gl = tl.load(glast + (slot0 + i_t) * HV + i_h, mask=i_t < c1, other=0.)
    else:
        b_gl = tl.zeros([], dtype=tl.float32)
    return b_gl


@triton.jit
def _tile(x, base, n_rows, n_cols, row_stride, r0, c0, R: tl.constexpr, C: tl.constexpr, TMA: tl.constexpr):
    """Rows r0 .. r0 + R − 1, columns c0 .. c0 + C − 1 of the [n_rows, n_cols] matrix at x + base (row stride
    row_stride), zero outside it. TMA: x is a tensor descriptor of that matrix (made once per program by
    _tma_view; one copy instruction per tile instead of per-thread addresses and masks)."""
    if TMA:
        t = x.load([r0, c0])
    else:
        t = tl.load(tl.make_block_ptr(x + base, (n_rows, n_cols), (row_stride, 1), (r0, c0), (R, C), (1, 0)),
                    boundary_check=(0, 1))
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
def _step_gate(g, gcum, b_gl, slot, bos, t0, T_seq, i_h, HV, BTc: tl.constexpr, GC_IN: tl.constexpr,
               g_floor: tl.constexpr):
    """A scalar gate's chunk in stage 2: (G [BT], e^{G_last}, e^G [BT], e^{G_last − G} [BT]). GC_IN: G from stage 1
    (chunk-major, [slots, HV, BT]: one contiguous row per chunk) and G_last = b_gl (_chunk_decay's), no scan or
    reduction on the serial path; else both formed here."""
    o_t = tl.arange(0, BTc)
    if GC_IN:
        Gc = tl.load(gcum + (slot * HV + i_h) * BTc + o_t, mask=t0 + o_t < T_seq, other=0.)         # [BT]
        G_last = b_gl
    else:
        Gc = _chunk_gate(g, bos, t0, T_seq, i_h, HV, BTc, g_floor)                                  # [BT]
        G_last = tl.sum(tl.where(o_t == BTc - 1, Gc, 0.), 0)
    return Gc, _exp(G_last), _exp(Gc), _exp(G_last - Gc)


@triton.jit
def _store_r(rs, b_R, bos, t0, T_seq, i_h, i_v, HV, V, BTc: tl.constexpr, BV: tl.constexpr, TRANS: tl.constexpr = 0):
    """R [BTc, BV] (TRANS: Rᵀ [BV, BTc]) -> its rows of rs [B, T, HV, V]. Its layout conversion takes a 4 KB
    shared-memory staging (as a block pointer's store did), which the output's store shares when that is not a TMA
    store (chunk_fwd's tma_o): offline sm_90 GDN's training stage 2 took 201296 B with both, past what leaves room for a
    stage-1 program beside it (on the H200 its forward went 1.4 -> 14.6 ms), 197200 B (as without R) with the output's
    plain store."""
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
def _state_output_step(i_t, S, b_gl, q, k, v, w, u, p, g, gcum, qg, kg, o_base, hs, rs, slot0, bos, T_seq, i_h, i_hk,
                       i_v, scale, H, HV, K, V,
                       BTc: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       GATE: tl.constexpr, DELTA: tl.constexpr, P_IN: tl.constexpr, GC_IN: tl.constexpr,
                       DOT_PREC: tl.constexpr, g_floor: tl.constexpr, TMA: tl.constexpr = 0,
                       TMA_O: tl.constexpr = 0, STORE_HR: tl.constexpr = 0, T_FORM: tl.constexpr = 0):
    """One chunk of stage 2: returns the state after chunk i_t, writes its rows of o. b_gl: _chunk_decay's.
    TMA: q, k, v, w, u, p, qg, kg are _tma_view descriptors; TMA_O: o_base too (the output's stores).
    STORE_HR (a forward saved for the backward, delta families): 1, the state entering the chunk -> hs [slots, HV, K,
    V] at slot slot0 + i_t, and R -> rs [B, T, HV, V] (before any gate scales it), in their dtype, as the backward's
    forward state pass would form them; 2, R alone (SAVE_R).
    T_FORM (delta rule): u is stage 1's T diag(β) [B, T, HV, BT], w (per-channel gate only) K ⊙ e^G [B, T, HV, K];
    R = T diag(β) (V − (K ⊙ e^G) S), which is U − W S with U = T diag(β) V, W = T diag(β) (K ⊙ e^G)."""
    o_k = tl.arange(0, BK)
    o_t = tl.arange(0, BTc)
    t0 = i_t * BTc
    if STORE_HR == 1:
        o_v = i_v * BV + tl.arange(0, BV)
        tl.store(hs + (((slot0 + i_t) * HV + i_h) * K + o_k[:, None]).to(tl.int64) * V + o_v[None, :],
                 S.to(hs.dtype.element_ty), mask=(o_k < K)[:, None] & (o_v < V)[None, :])
    if DELTA and T_FORM:
        b_T = _tile(u, (bos * HV + i_h) * BTc, T_seq, BTc, HV * BTc, t0, 0, BTc, BTc, TMA)
        b_v = _tile(v, (bos * HV + i_h) * V, T_seq, V, HV * V, t0, i_v * BV, BTc, BV, TMA)
        if GATE == 2:
            b_kx = _tile(w, (bos * HV + i_h) * K, T_seq, K, HV * K, t0, 0, BTc, BK, TMA)
    elif DELTA:
        b_w = _tile(w, (bos * HV + i_h) * K, T_seq, K, HV * K, t0, 0, BTc, BK, TMA)
        b_u = _tile(u, (bos * HV + i_h) * V, T_seq, V, HV * V, t0, i_v * BV, BTc, BV, TMA)
        b_R = b_u.to(tl.float32) - tl.dot(b_w, S.to(b_w.dtype), input_precision=DOT_PREC)   # [BT, BK] @ [BK, BV]
        if STORE_HR:
            _store_r(rs, b_R, bos, t0, T_seq, i_h, i_v, HV, V, BTc, BV)
    else:
        b_R = _tile(v, (bos * HV + i_h) * V, T_seq, V, HV * V, t0, i_v * BV, BTc, BV, TMA).to(tl.float32)
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
        b_R = tl.dot(b_T, b_Z.to(b_T.dtype), input_precision=DOT_PREC)              # [BT, BT] @ [BT, BV]
        if STORE_HR:
            _store_r(rs, b_R, bos, t0, T_seq, i_h, i_v, HV, V, BTc, BV)
    if P_IN:
        b_P = _tile(p, (bos * HV + i_h) * BTc, T_seq, BTc, HV * BTc, t0, 0, BTc, BTc, TMA)
    else:
        b_P = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)              # [BT, BK] @ [BK, BT]
        if GATE == 1:
            b_P = b_P * _exp(tl.where(o_t[:, None] >= o_t[None, :], Gc[:, None] - Gc[None, :], float("-inf")))
        else:
            b_P = tl.where(o_t[:, None] >= o_t[None, :], b_P, 0.)
        b_P = b_P.to(b_q.dtype)
    b_Rd = b_R.to(b_qd.dtype)
    # scalar gate: q and k reach the tensor cores unscaled; the decays scale rows of the products in fp32
    b_o = tl.dot(b_qd, S.to(b_qd.dtype), input_precision=DOT_PREC)               # [BT, BK] @ [BK, BV]
    if GATE == 1:
        b_o = b_o * b_eg[:, None]
    b_o += tl.dot(b_P.to(b_qd.dtype), b_Rd, input_precision=DOT_PREC)             # [BT, BT] @ [BT, BV]
    if TMA_O:       # o_base: a descriptor of this sequence's rows (the copy stops at its end)
        o_base.store([t0, i_v * BV], (b_o * scale).to(o_base.dtype))
    else:
        tl.store(tl.make_block_ptr(o_base, (T_seq, V), (HV * V, 1), (t0, i_v * BV), (BTc, BV), (1, 0)),
                 (b_o * scale).to(o_base.dtype.element_ty), boundary_check=(0, 1))
    if GATE == 1:
        S = S * b_dl
        b_Rd = (b_R * b_ek[:, None]).to(b_qd.dtype)
    elif GATE == 2:
        S = S * b_dl
    S += tl.dot(tl.trans(b_kd), b_Rd, input_precision=DOT_PREC)                  # [BK, BT] @ [BT, BV]
    return S


@triton.jit
def _state_output_step_t(i_t, St, b_gl, q, k, v, w, u, p, g, gcum, qg, kg, o_base, hs, rs, slot0, bos, T_seq, i_h,
                         i_hk, i_v, scale, H, HV, K, V,
                         BTc: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         GATE: tl.constexpr, DELTA: tl.constexpr, P_IN: tl.constexpr, GC_IN: tl.constexpr,
                         DOT_PREC: tl.constexpr, g_floor: tl.constexpr, TMA: tl.constexpr = 0,
                         TMA_O: tl.constexpr = 0, STORE_HR: tl.constexpr = 0, T_FORM: tl.constexpr = 0):
    """_state_output_step on the transposed state St = Sᵀ [BV, BK] (TRANS): every product takes St or Rᵀ, values
    in registers, as its first operand and a loaded tile as its second, so nothing on the state's chain is staged
    through shared memory, and at BV < 64 the products are warp-level (mma v2) ones the compiler can overlap::

        Rᵀ = Uᵀ − Sᵀ Wᵀ                                 [BV, C]
        oᵀ = scale · (Sᵀ (Q ⊙ e^G)ᵀ + Rᵀ Pᵀ)             [BV, C]
        Sᵀ = e^{G_last} Sᵀ + Rᵀ (K ⊙ e^{G_last − G})     [BV, K]

    T_FORM (delta rule): Rᵀ = (Vᵀ − Sᵀ (K ⊙ e^G)ᵀ) (T diag(β))ᵀ, both products with a register first operand."""
    o_k = tl.arange(0, BK)
    o_t = tl.arange(0, BTc)
    o_v = i_v * BV + tl.arange(0, BV)
    t0 = i_t * BTc
    if STORE_HR == 1:
        tl.store(hs + (((slot0 + i_t) * HV + i_h) * K + o_k[None, :]).to(tl.int64) * V + o_v[:, None],
                 St.to(hs.dtype.element_ty), mask=(o_k < K)[None, :] & (o_v < V)[:, None])
    if DELTA and T_FORM:
        b_T = _tile(u, (bos * HV + i_h) * BTc, T_seq, BTc, HV * BTc, t0, 0, BTc, BTc, TMA)
        b_v = _tile(v, (bos * HV + i_h) * V, T_seq, V, HV * V, t0, i_v * BV, BTc, BV, TMA)
        if GATE == 2:
            b_kx = _tile(w, (bos * HV + i_h) * K, T_seq, K, HV * K, t0, 0, BTc, BK, TMA)
        else:
            b_kx = _tile(k, (bos * H + i_hk) * K, T_seq, K, H * K, t0, 0, BTc, BK, TMA)
        b_Zt = tl.dot(St.to(b_kx.dtype), tl.trans(b_kx), input_precision=DOT_PREC)      # [BV, BK] @ [BK, BT]
        if GATE == 1:
            Gc, b_dl, b_eg, b_ek = _step_gate(g, gcum, b_gl, slot0 + i_t, bos, t0, T_seq, i_h, HV, BTc, GC_IN, g_floor)
            b_Zt = b_Zt * b_eg[None, :]
        b_Zt = tl.trans(b_v).to(tl.float32) - b_Zt
        b_Rt = tl.dot(b_Zt.to(b_T.dtype), tl.trans(b_T), input_precision=DOT_PREC)      # [BV, BT] @ [BT, BT]
        if STORE_HR:
            _store_r(rs, b_Rt, bos, t0, T_seq, i_h, i_v, HV, V, BTc, BV, True)
    elif DELTA:
        b_w = _tile(w, (bos * HV + i_h) * K, T_seq, K, HV * K, t0, 0, BTc, BK, TMA)
        b_u = _tile(u, (bos * HV + i_h) * V, T_seq, V, HV * V, t0, i_v * BV, BTc, BV, TMA)
        b_Rt = tl.trans(b_u).to(tl.float32) - tl.dot(St.to(b_w.dtype), tl.trans(b_w),
                                                     input_precision=DOT_PREC)     # [BV, BK] @ [BK, BT]
        if STORE_HR:
            _store_r(rs, b_Rt, bos, t0, T_seq, i_h, i_v, HV, V, BTc, BV, True)
    else:
        b_Rt = tl.trans(_tile(v, (bos * HV + i_h) * V, T_seq, V, HV * V, t0, i_v * BV, BTc, BV, TMA)).to(tl.float32)
    if GATE == 2:
        b_qd = _tile(qg, (bos * HV + i_h) * K, T_seq, K, HV * K, t0, 0, BTc, BK, TMA)
        b_kd = _tile(kg, (bos * HV + i_h) * K, T_seq, K, HV * K, t0, 0, BTc, BK, TMA)
    else:
        b_qd = _tile(q, (bos * H + i_hk) * K, T_seq, K, H * K, t0, 0, BTc, BK, TMA)
        b_kd = _tile(k, (bos * H + i_hk) * K, T_seq, K, H * K, t0, 0, BTc, BK, TMA)
        if GATE == 1 and not (DELTA and T_FORM):
            Gc, b_dl, b_eg, b_ek = _step_gate(g, gcum, b_gl, slot0 + i_t, bos, t0, T_seq, i_h, HV, BTc, GC_IN, g_floor)
    if P_IN:
        b_Pt = tl.trans(_tile(p, (bos * HV + i_h) * BTc, T_seq, BTc, HV * BTc, t0, 0, BTc, BTc, TMA))
    else:
        b_Pt = tl.dot(b_kd, tl.trans(b_qd), input_precision=DOT_PREC)            # [BT, BK] @ [BK, BT] = Pᵀ
        if GATE == 1:
            b_Pt = b_Pt * _exp(tl.where(o_t[:, None] <= o_t[None, :], Gc[None, :] - Gc[:, None], float("-inf")))
        else:
            b_Pt = tl.where(o_t[:, None] <= o_t[None, :], b_Pt, 0.)
        b_Pt = b_Pt.to(b_qd.dtype)
    b_ot = tl.dot(St.to(b_qd.dtype), tl.trans(b_qd), input_precision=DOT_PREC)    # [BV, BK] @ [BK, BT]
    if GATE == 1:
        b_ot = b_ot * b_eg[None, :]
    b_ot += tl.dot(b_Rt.to(b_qd.dtype), b_Pt.to(b_qd.dtype), input_precision=DOT_PREC)   # [BV, BT] @ [BT, BT]
    b_o = tl.trans(b_ot * scale)
    if TMA_O:
        o_base.store([t0, i_v * BV], b_o.to(o_base.dtype))
    else:
        tl.store(tl.make_block_ptr(o_base, (T_seq, V), (HV * V, 1), (t0, i_v * BV), (BTc, BV), (1, 0)),
                 b_o.to(o_base.dtype.element_ty), boundary_check=(0, 1))
    if GATE == 1:
        St = St * b_dl
        b_Rt = b_Rt * b_ek[None, :]
    elif GATE == 2:
        St = St * b_gl[None, :]
    St += tl.dot(b_Rt.to(b_qd.dtype), b_kd, input_precision=DOT_PREC)             # [BV, BT] @ [BT, BK]
    return St


@triton.jit
def _state_output_chunk(i_t, S, b_gl, q, k, v, w, u, p, g, gcum, qg, kg, o_base, hs, rs, slot0, bos, T_seq, i_h, i_hk,
                        i_v, scale, H, HV, K, V, BTc: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        GATE: tl.constexpr, DELTA: tl.constexpr, P_IN: tl.constexpr, GC_IN: tl.constexpr,
                        DOT_PREC: tl.constexpr, g_floor: tl.constexpr, TMA: tl.constexpr, TMA_O: tl.constexpr,
                        STORE_HR: tl.constexpr, TRANS: tl.constexpr, T_FORM: tl.constexpr = 0):
    """One chunk of stage 2 on S [BK, BV] (_state_output_step) or, TRANS, on Sᵀ [BV, BK] (_state_output_step_t)."""
    if TRANS:
        S = _state_output_step_t(i_t, S, b_gl, q, k, v, w, u, p, g, gcum, qg, kg, o_base, hs, rs, slot0, bos, T_seq,
                                 i_h, i_hk, i_v, scale, H, HV, K, V, BTc, BK, BV, GATE, DELTA, P_IN, GC_IN, DOT_PREC,
                                 g_floor, TMA, TMA_O, STORE_HR, T_FORM)
    else:
        S = _state_output_step(i_t, S, b_gl, q, k, v, w, u, p, g, gcum, qg, kg, o_base, hs, rs, slot0, bos, T_seq,
                               i_h, i_hk, i_v, scale, H, HV, K, V, BTc, BK, BV, GATE, DELTA, P_IN, GC_IN, DOT_PREC,
                               g_floor, TMA, TMA_O, STORE_HR, T_FORM)
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


@triton.jit(do_not_specialize=["T", "NT", "H", "HV", "seg_len"])
def chunk_state_output_kernel(
    q, k, v, w, u, p, g,         # [B,T,H,K] [B,T,H,K] [B,T,HV,V] [B,T,HV,K] [B,T,HV,V] [B,T,HV,BT] [B,T,HV] fp32
    qg, kg, glast,               # GATE == 2: [B,T,HV,K] [B,T,HV,K] [slots,HV,K] fp32; GC_IN: glast [slots,HV]
    gcum,                        # GC_IN: [slots,HV,BT] fp32 chunk-local cumulative scalar gate by chunk (stage 1)
    o, h0, ht,                   # out [B,T,HV,V]; [N,HV,·,·] any float; out [N,HV,·,·] fp32
    sloc, gam,                   # SEG > 0: [N·NSEG, HV, K, V] fp32 segment-local end states, [N·NSEG, HV] fp32 decays
    hs, rs,                      # STORE_HR: out [slots, HV, K, V], [B, T, HV, V] (the backward's h and R)
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
    TMA: tl.constexpr = 0, TMA_O: tl.constexpr = 0, STORE_HR: tl.constexpr = 0, TRANS: tl.constexpr = 0,
    T_FORM: tl.constexpr = 0, WAIT: tl.constexpr = 0, FENCE: tl.constexpr = 0,
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
    """
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
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

    if TRANS:
        S = tl.zeros([BV, BK], dtype=tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    c0 = 0
    c1 = n_chunks
    if SEG > 0:
        c0 = tl.minimum(i_s * seg_len, n_chunks)
        c1 = tl.minimum(c0 + seg_len, n_chunks)
    if SEG == 1:        # the segment's local end state and total decay
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
        if USE_H0:
            off, m = _state_offsets(o_k, o_v, s_h0k, s_h0v, K, V, TRANS)
            S += tl.load(h0 + i_n * s_h0n + i_h * s_h0h + off, mask=m, other=0.).to(tl.float32)
        if SEG == 2:    # the start state: the earlier (sub-)segments, in order
            for i_p in tl.static_range(NSEG * SUB - 1):
                if i_p < i_s * SUB:
                    i_seg = (i_n * NSEG * SUB + i_p).to(tl.int64)
                    S = S * tl.load(gam + i_seg * HV + i_h) + \
                        tl.load(sloc + ((i_seg * HV + i_h) * K + o_k[:, None]) * V + o_v[None, :], mask=m_kv, other=0.)
        if WAIT:        # the first WAIT chunks (the loop waits for chunk i + WAIT at step i)
            for i_w in tl.static_range(WAIT):
                if c0 + i_w < c1:
                    _wait_ready(ready, slot0 + c0 + i_w, i_h, HV, FENCE, not LOOP_WHILE)
        b_gl = _chunk_decay(glast, slot0, c0, c1, i_h, HV, K, BK, GATE, GC_IN)
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
        if LOOP_WHILE:      # the triton 3.6 interpreter cannot take a tensor bound in range()
            i_t = c0
            while i_t < c1:
                if WAIT:
                    _wait_ready(ready, slot0 + tl.minimum(i_t + WAIT, c1 - 1), i_h, HV, FENCE, not LOOP_WHILE)
                b_gl_next = _chunk_decay(glast, slot0, i_t + 1, c1, i_h, HV, K, BK, GATE, GC_IN)
                S = _state_output_chunk(i_t, S, b_gl, q, k, v, w, u, p, g, gcum, qg, kg, o_base, hs, rs, slot0, bos,
                                        T_seq, i_h, i_hk, i_v, scale, H, HV, K, V, BTc, BK, BV, GATE, DELTA, P_IN, GC_IN,
                                        DOT_PREC, g_floor, TMA, TMA_O, STORE_HR, TRANS, T_FORM)
                b_gl = b_gl_next
                i_t += 1
        else:               # compiled: a for loop, so that the loads of later chunks are pipelined
            for i_t in range(c0, c1):
                if WAIT:
                    _wait_ready(ready, slot0 + tl.minimum(i_t + WAIT, c1 - 1), i_h, HV, FENCE, not LOOP_WHILE)
                b_gl_next = _chunk_decay(glast, slot0, i_t + 1, c1, i_h, HV, K, BK, GATE, GC_IN)
                S = _state_output_chunk(i_t, S, b_gl, q, k, v, w, u, p, g, gcum, qg, kg, o_base, hs, rs, slot0, bos,
                                        T_seq, i_h, i_hk, i_v, scale, H, HV, K, V, BTc, BK, BV, GATE, DELTA, P_IN, GC_IN,
                                        DOT_PREC, g_floor, TMA, TMA_O, STORE_HR, TRANS, T_FORM)
                b_gl = b_gl_next

    if STORE_HT and SEG != 1:
        if i_s == NSEG - 1:     # the last segment (always, without SEG)
            off, m = _state_offsets(o_k, o_v, s_htk, s_htv, K, V, TRANS)
            tl.store(ht + i_n * s_htn + i_h * s_hth + off, S, mask=m)


# ------------------------------------------------------------------------------------------------
# launchers
# ------------------------------------------------------------------------------------------------

PRECISIONS = ("tf32", "tf32rn", "tf32x3", "ieee")


def prec_env(name: str, default: str) -> str:
    """A product precision from the environment variable ``name`` (one of PRECISIONS, see _mm)."""
    value = os.environ.get(name, default)
    if value not in PRECISIONS:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(PRECISIONS)}")
    return value


def _dot_prec(dtype, gate: int = 0) -> tuple[str, str, str]:
    """(input-dtype dots, fp32 factor products, the solve).

    fp32 inputs: tf32x3 everywhere (three tf32 products: ~fp32 accuracy on the tensor cores). "ieee"
    would be exact but lowers 64×64 products to FMA loops: the sm_90 builds took 230-300 s to compile
    here and spilled 38-41 KB per thread (tf32x3: 45-50 s, < 2.4 KB).
    bf16 / fp16 inputs: factored fp32 products in tf32 (10-bit mantissa, fp32 range); the solve in tf32
    (bf16: already finer than the bf16 inverse fla keeps) or tf32x3 (fp16). KDA with fp16 inputs (gate 2):
    its per-channel A / P / W / U products also in tf32x3 (CHUNKWISE_FP16_MM_PREC overrides: tf32, tf32rn):
    the tensor cores truncate fp32 operands to tf32 (toward zero, triton#4574), a bias that does not average
    out over the 128-channel sums. On the H200 (kda_fp16_prec.py: B2-T1000-H8 error, B1-T32768-H32 time; fla
    5.67e-4, 3.90 ms): tf32 1.16e-3 at 5.09 ms, tf32rn (operands rounded to the nearest tf32 first) 5.49e-4
    at 5.44 ms, tf32x3 4.23e-4 at 11.37 ms; on the GPU test's inputs tf32rn was 5.17e-4 against fla's
    4.71e-4 (tf32x3 3.85e-4), above fla's, so tf32x3 stays (bf16's own rounding, 3e-3, hides the bias).
    """
    if dtype == torch.float32:
        return "tf32x3", "tf32x3", "tf32x3"
    if dtype == torch.float16:
        mm = prec_env("CHUNKWISE_FP16_MM_PREC", "tf32x3") if gate == 2 else "tf32"
        return "tf32", mm, "tf32x3"
    return "tf32", "tf32", "tf32"


# Stage-1 launch per gate kind (0 none, 1 scalar, 2 per channel): (W/U products in the 16-bit input
# dtype, num_warps, column chunk BKC of the per-channel gate, form of KDA's A and P: 0 eight [BT, BKC] x
# [BKC, BT] products per column chunk, 1 four [BC, BKC] x [BKC, BT] ones by row block, a quarter of the
# multiply-adds, ``_kda_ap_rows``; form 1 is unmeasured on the GPU). From the stage-1 sweep on the H200
# (benchmarks/sweep_stage1.py, benchmarks/NOTES.md, runs of 0dcbe37 and 6ff14f7): the fastest variant whose
# bf16 output error against the float64 recurrence is at most 1.05x fla's. KDA keeps its W/U products in
# tf32: with bf16 products and BKC = 32 its output error was 4.0e-2 in both runs (fla 3.7e-3; BKC = 64:
# 3.8e-3), see NOTES, and with the one-reference A / P products (session 11) that build raised an illegal memory
# access on the H200 (sweep of b42e3c4): per-channel gates never take them (chunk_prepare ignores the knob).
PREP_CONFIG = {0: (1, 4, 64, 0), 1: (1, 4, 64, 0), 2: (0, 4, 32, 0)}
# KDA's A and P (form 0): a column chunk whose chunk gate stays within ±span_max of one reference (G_last / 2)
# takes two [BT, BKC] x [BKC, BT] products of e^{±(G − r)}-scaled operands instead of eight by blocks
# (chunk_prepare_kernel's AP_ONE_REF). 2 (default): two launches, the first built with the one-reference products
# only (offline sm_90, bf16, BKC 32, 3 stages: 255 registers and 192 B of spills with both forms built in, none
# without the block form), flagging the chunks whose gate leaves the span, which stop after A / P; the second the
# one-launch build on those alone. On the H200 (runs of b278c03 / 8f4f4a8, bf16, stage 1 ms, 1 / 2): B1-T32768-H32
# 2.517 / 2.248, B8-T4096-H32 2.485 / 2.228, B4-T8192-H16/HV32 2.464 / 2.220, varlen16 2.534 / 2.268; with steep
# gates (every chunk flagged: CHUNKWISE_BENCH_GATE_SCALE=4) 5.360 / 6.387. CHUNKWISE_KDA_ONE_REF (0 / 1 / 2)
# overrides.
KDA_ONE_REF = 2
# KDA's one-reference A product from bf16 operands (rounded to nearest) instead of tf32 ones (fp32 operands that the
# tensor cores truncate), bf16 inputs only (AP_LOWP). On the H200 (runs of 5a092d6 / 3dfaf46, B1-T32768-H32 stage 1
# ms, real-size bf16 output error against float64, fla 3.43e-3): tf32 1.374 / 3.11e-3, A from bf16 1.354 / 3.11e-3;
# P from bf16 too 1.261 / 3.77e-3 and P alone 1.332 / 3.77e-3 (P's operands carry the error); both from fp16 where
# they fit its range, else tf32 (both builds in one kernel), 1.600 / 3.03e-3. Under T_FORM only (the inference
# forward). 2 (opt-in, unmeasured): A and P both from fp16 operands (tf32's significand, rounded to nearest, at the
# 16-bit rate) in the one-reference launch, which flags for the full build's launch (at mode 1) every program with a
# column chunk past SPAN_FP16 or a non-finite A / P (keys or queries past fp16's range). Offline sm_90 (bf16, fp16
# solve): 255 registers, 20 -> 0 B of spills, 3880 -> 4016 instructions, the column loop still pipelined (24
# cp.async). Expected near session 18's bf16 A / P (stage 1 −7 %); with gates past SPAN_FP16 (trained KDA gates reach
# −1 per token on fast channels) a flagged program's column loop is wasted. (Session 19's first form checked Σ g
# before the loop, four unpipelined loads: stage 1 1.294 -> 1.560 ms; a choice of precision inside the loop stops the
# loop's pipelining: offline no cp.async at all.) CHUNKWISE_KDA_AP_LOWP (0 / 1 / 2) overrides.
KDA_AP_LOWP = 1


# The inference forward's solve (T_FORM) with bf16 operands for bf16 inputs (_mm's "bf16", fp32 accumulation)
# instead of tf32 ones, whose fp32 operands need tf32's register layouts (offline sm_90, bf16, T_FORM: GDN stage 1
# 2488 -> 1856 instructions, 211 -> 29 shuffles; DeltaNet 1792 -> 1288 and 162 -> 123 registers; KDA 3304 -> 2760).
# On the H200 (runs of 2593579 / bdce396): stage 1 −25 % (GDN), −37 % (DeltaNet), −6 % (KDA), forward GDN 1.14 ->
# 1.03 ms at B1, 0.88 -> 0.77 at B4; the output error unchanged with the tests' random keys, but with nearly parallel
# keys (an ill-conditioned I + A) past fla's: GDN 1.06x, KDA 1.07x, DeltaNet 1.83x (bf16 for only part of the solve
# too: NOTES session 18). So off; CHUNKWISE_SOLVE_BF16=1 opts in.
SOLVE_BF16 = 0
# The same with fp16 operands (11-bit significand rounded to nearest, at least tf32's accuracy) and the chunk's solve
# redone in tf32 where T came out non-finite (an operand past fp16's range). On the H200 (run of 1ac3b68): the error
# as tf32's with random and nearly parallel keys (GDN 5.091e-3 against 5.100e-3, fla 5.278e-3), forward GDN 0.884 ->
# 0.839 ms at B4-T8192-H16/HV32 (1.142 -> 1.128 at B1), KDA 2.054 -> 1.985 at B1. The whole GPU forward test file
# passed with it (run of 0a5dd96: 206 passed, 4 skipped), so on by default; CHUNKWISE_SOLVE_FP16=0 keeps tf32.
SOLVE_FP16 = 1
# Under SOLVE_FP16, GDN / DeltaNet's tf32 redo as a second launch over the programs the first flags (SOLVE_REDO), so
# that the first is built without it: offline sm_90 (bf16, T_FORM) GDN's stage 1 at its 168-register cap 76 -> 4 B
# of spills, as the bf16 build. On the H200 (run of 0a5dd96, forward ms, redo inside / as a second launch): GDN
# B1-T32768-H32 1.130 / 1.077 (stage 1 0.438 / 0.385), B8-T4096-H32 0.867 / 0.840; DeltaNet 0.906 / 0.907 and
# 0.683 / 0.678; the same error (forward_errors.py, random and nearly parallel keys). KDA keeps the redo inside: its
# one-reference launch flagging a non-finite T for the full build's launch (offline sm_90, bf16: 3880 -> 2920
# instructions) ran B1-T32768-H32 at 2.014 ms against 1.989 (stage 1 1.330 / 1.304; run of b6b420f).
# CHUNKWISE_SOLVE_FP16_SPLIT=0 keeps the redo inside for all.
SOLVE_FP16_SPLIT = 1


# (I + A)⁻¹'s 16×16 diagonal blocks by doubling (log-depth, _solve_unit_lower's DOUBLING) instead of substitution
# (CHUNKWISE_SOLVE_DOUBLING overrides)
SOLVE_DOUBLING = 1


def reg_cap(name: str) -> dict:
    """Launch option capping a kernel's registers per thread (Triton's ``maxnreg``), from CHUNKWISE_MAXNREG
    ("prep:168,bwd_dv:168", or with "/" between items, or "all:168"; names as the backward's BWD_WARPS keys, plus "fwd_o" for stage 2
    and "prep_fwd" for the forward's stage 1): {} unless set. A variant for the sweeps: on the H200 (ncu,
    run of cd0d241) the chunk-parallel kernels ran at 255 registers and 4 warps, two programs (8 warps) per
    SM, a third of their issue slots used; a cap trades spills for more programs per SM."""
    for item in filter(None, os.environ.get("CHUNKWISE_MAXNREG", "").replace("/", ",").split(",")):
        key, val = item.split(":")
        if key == name or key == "all":
            return {"maxnreg": int(val)}
    return {}


def prep_config(gate: int) -> tuple[int, int, int, int]:
    """The stage-1 launch of a gate kind: PREP_CONFIG, overridden by CHUNKWISE_PREP_CONFIG
    ("gate:lowp,warps[,bkc[,form]];..." as the sweep prints it) and then by CHUNKWISE_PREP_WU_LOWP /
    CHUNKWISE_PREP_WARPS / CHUNKWISE_PREP_BKC / CHUNKWISE_PREP_FORM (the sweep's single knobs)."""
    cfg = list(PREP_CONFIG[gate])
    for item in filter(None, os.environ.get("CHUNKWISE_PREP_CONFIG", "").split(";")):
        key, vals = item.split(":")
        if int(key) == gate:
            vals = [int(x) for x in vals.split(",")]
            cfg[:len(vals)] = vals
    for i, name in enumerate(("WU_LOWP", "WARPS", "BKC", "FORM")):
        env = os.environ.get(f"CHUNKWISE_PREP_{name}")
        if env:
            cfg[i] = int(env)
    return cfg[0], cfg[1], cfg[2], cfg[3]


# Software-pipeline depth of stage 1's launch (forward): only KDA's kernel has loops the pipeline can take (its
# column chunks); offline sm_90 (bf16, 4 warps, 32-channel chunks, one reference) 1 stage leaves all five of their
# loads plain (each waits on memory in the loop), 2 / 3 stages turn two of them into cp.async (spills 204 -> 208 /
# 192 B, same shared memory). Unmeasured on the GPU: CHUNKWISE_PREP_STAGES (1-4) overrides for a timing
# (`bench_forward --variants --variant-set pstages`). On the H200 (run of b5d9499, bf16, KDA stage 1 ms at 1 / 2 / 3
# stages): B1-T32768-H32 2.582 / 2.586 / 2.511, B8-T4096-H32 2.535 / 2.564 / 2.495; so 3 for KDA with bf16 inputs at
# K <= 128 (the case measured), 1 elsewhere (the other families' stage 1 has no loop for it to pipeline).
PREP_STAGES = 1
PREP_STAGES_KDA_BF16 = 3


# Registers per thread of stage 1 under T_FORM with P stored, per gate kind (Triton's maxnreg): GDN's build takes 186
# (offline sm_90, bf16), two programs per SM; capped at 168 (20 B of spills) three fit. On the H200 (run of 5b70710,
# bf16, GDN forward ms, uncapped / 168 / 160): B1-T32768-H32 1.194 / 1.136 / 1.133, B8-T4096-H32 0.962 / 0.912 /
# 0.900, B4-T8192-H16/HV32 0.922 / 0.877 / 0.873, varlen16-T32768-H32 1.045 / 0.967 / 0.983. CHUNKWISE_MAXNREG
# ("prep_fwd:N") overrides. Only for 16-bit inputs at K <= 128, the case measured
PREP_REGS_T_FORM = {1: 168}


def prep_regs(gate: int, t_form: bool, store_p: bool, dtype: torch.dtype, K: int) -> dict:
    """Stage 1's maxnreg launch option: CHUNKWISE_MAXNREG's "prep_fwd" if set, else PREP_REGS_T_FORM under T_FORM
    with P stored (16-bit inputs, K <= 128), else none."""
    env = reg_cap("prep_fwd")
    if env or not (t_form and store_p and gate in PREP_REGS_T_FORM and dtype in (torch.bfloat16, torch.float16)
                   and K <= 128):
        return env
    return {"maxnreg": PREP_REGS_T_FORM[gate]}


def prep_stages(gate: int = 0, dtype: torch.dtype = torch.float32, K: int = 0) -> int:
    """Stage 1's num_stages (PREP_STAGES; PREP_STAGES_KDA_BF16 for a per-channel gate with bf16 inputs at K <= 128;
    CHUNKWISE_PREP_STAGES overrides)."""
    default = PREP_STAGES_KDA_BF16 if gate == 2 and dtype == torch.bfloat16 and K <= 128 else PREP_STAGES
    return _env_choice("CHUNKWISE_PREP_STAGES", default, range(1, 5))


# Stage 1's launch without the bounds checks its tiles do not need (chunk_prepare_kernel's FULL_ROWS / FULL_COLS): rows
# when every chunk is whole (no varlen, T a multiple of 64), columns when K and V are the tiles' widths. Offline sm_90
# (GDN's inference stage 1: bf16, T form, P stored, beside stage 2, fp16 solve, its 168-register cap; K, V runtime
# multiples of 16 as a launch specializes them): 2080 instructions, 2032 without the row checks, 1992 without either
# (ISETP and PRMT the most of it), 0 B of spills in all three; KDA's (one-reference launch, 3 stages) 4024 -> 3928
# instructions, 8 -> 0 B of spills. GDN at B1 beside stage 2 is bound by stage 1's throughput on the slots stage 2
# leaves (session 28: a build with 56 instructions and 8 B of spills more took 1.034 ms against 0.982). On the H200
# (session 29, B1-T32768-H32 bf16, same run; stage 1 alone / the forward, ms): GDN 0.390 -> 0.362 / 0.970 -> 0.973
# (stage 2 bounds the forward there, not stage 1), KDA 1.294 -> 1.250 / 1.710 -> 1.676, DeltaNet 0.219 -> 0.219 /
# 0.907 -> 0.913; the training forward's stage 1 GDN 1.413 -> 1.371, DeltaNet 0.667 -> 0.638, KDA 2.055 -> 1.972.
# On (1) for every family. CHUNKWISE_PREP_FULL (0 / 1) overrides.
PREP_FULL = 1


def prep_full(T: int, K: int, V: int, varlen: bool) -> tuple[bool, bool]:
    """(FULL_ROWS, FULL_COLS) of stage 1's forward launch (PREP_FULL, CHUNKWISE_PREP_FULL)."""
    if not _env_switch("CHUNKWISE_PREP_FULL", PREP_FULL):
        return False, False
    return chunks_whole(T, varlen), K == _dim(K) and V == _dim(V)


def _solve_precs(dtype: torch.dtype, gate: int, t_form: bool) -> tuple[str, str]:
    """(stage 1's solve precision, the precision of its redo where an fp16 solve's T is not finite): the input dtype's
    (_dot_prec), or under T_FORM with bf16 inputs "bf16" (CHUNKWISE_SOLVE_BF16) / "fp16" (CHUNKWISE_SOLVE_FP16)."""
    solve = _dot_prec(dtype, gate)[2]
    if _env_switch("CHUNKWISE_SOLVE_BF16", SOLVE_BF16) and t_form and dtype == torch.bfloat16:
        return "bf16", solve
    if _env_switch("CHUNKWISE_SOLVE_FP16", SOLVE_FP16) and t_form and dtype == torch.bfloat16:
        return "fp16", solve
    return solve, solve


def _ap_lowp(dtype, gate: int, t_form: bool) -> int:
    """KDA's one-reference A / P operands in the inference stage 1 (chunk_prepare_kernel's AP_LOWP): 0 tf32, 1 A from
    bf16, 2 A and P from fp16 with the range flagged; bf16 inputs under T_FORM only (the training forward's T is what
    the backward reuses). CHUNKWISE_KDA_AP_LOWP (0 / 1 / 2) overrides KDA_AP_LOWP."""
    mode = _env_choice("CHUNKWISE_KDA_AP_LOWP", KDA_AP_LOWP, range(3))
    return mode if gate == 2 and t_form and dtype == torch.bfloat16 else 0


def chunk_prepare(q, k, v, g, beta, cu_seqlens=None, chunk_indices=None, save_t=False, store_p=True, t_form=False,
                  ready=None, save_g=False):
    """Stage 1 for the delta families.

    Args: q, k [B,T,H,K]; v [B,T,HV,V]; g None | [B,T,HV] fp32 | [B,T,HV,K] fp32 (raw log-decays);
    beta [B,T,HV]; cu_seqlens [N+1] with chunk_indices [NT_total, 2] (varlen, B = 1).
    Returns dict: w [B,T,HV,K], u [B,T,HV,V], p [B,T,HV,64] (q's dtype) and, for per-channel g,
    qg, kg [B,T,HV,K] (q's dtype) and glast [slots, HV, K] fp32 (e^{G_last} per chunk; the slot of
    chunk i of sequence n is n·NT + i, or n + start_token // 64 with cu_seqlens), for scalar g gcum [slots, HV, 64]
    fp32 (the chunk-local cumulative gate G, one row per chunk slot) and glast [slots, HV] fp32 (G_last per chunk); with ``save_t`` also
    t = (I + A)⁻¹ [B,T,HV,64] fp32 (for a backward that reuses stage 1). ``store_p=False`` (scalar / no
    gate): p is None, for a stage 2 that forms P itself. ``t_form``: u is (I + A)⁻¹ diag(β) [B,T,HV,64] and w
    (per-channel g) K ⊙ e^G [B,T,HV,K] or None, in q's dtype, for stage 2's T_FORM (with ``save_t`` at the training
    forward's precisions, t as well). ``ready`` ([slots, HV] int32, zeroed): the chunk-major grid, each program
    setting its entry once its outputs are stored, for a stage 2 launched beside it (chunk_fwd's overlap).
    ``save_g`` (per-channel g): also G [B,T,HV,K] fp32, the chunk-local cumulative gate, for the backward (key "G").
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    gate = _gate_kind(g)
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
        if gate == 1:       # G and G_last for stage 2 (GC_IN)
            gcum = _alloc((slots, HV, BT), torch.float32, dev)
            glast = _alloc((slots, HV), torch.float32, dev)
    t = None
    if save_t:      # fp32, or the input dtype where the backward takes T in it (chunk_bwd.saved_t_dtype)
        from .chunk_bwd import saved_t_dtype
        t = _alloc((B, T, HV, BT), saved_t_dtype(dt, K, gate, t_form), dev)
    dot_prec, mm_prec, _ = _dot_prec(dt, gate)
    # (the inference forward's precisions: a training forward's T, which the backward reuses, keeps tf32 operands)
    solve_prec, redo_prec = _solve_precs(dt, gate, t_form and not save_t)
    wu_lowp, warps, bkc, form = prep_config(gate)
    one_ref = _env_choice("CHUNKWISE_KDA_ONE_REF", KDA_ONE_REF, range(3)) if gate == 2 and form == 0 else 0
    # the fp16 solve's tf32 redo as a second launch over the flagged programs (scalar / no gate)
    redo_split = solve_prec == "fp16" and gate != 2 and _env_switch("CHUNKWISE_SOLVE_FP16_SPLIT", SOLVE_FP16_SPLIT)
    flag = torch.empty(n_chunks * B * HV, dtype=torch.int32, device=dev) if one_ref == 2 or redo_split else None
    ap_lowp = _ap_lowp(dt, gate, t_form and not save_t)
    launches = [(r, solve_prec, 0) for r in ((2, 3) if one_ref == 2 else (one_ref,))]
    if redo_split:
        launches = [(0, "fp16", 1), (0, redo_prec, 2)]
    grid = (n_chunks, B * HV) if ready is None else (B * HV, n_chunks)
    full = prep_full(T, K, V, cu_seqlens is not None)
    for ap_one_ref, s_prec, s_redo in launches if n_chunks > 0 else ():
        chunk_prepare_kernel[grid](
            q, k, v, g, beta, w, u, p, qg, kg, glast, gcum, None, t, None, flag, ready, cu_seqlens, chunk_indices, T, NT,
            H=H, HV=HV, K=K, V=V, scale=1.0, BTc=BT, BCc=BC, BK=_dim(K), BVf=_dim(V), BKC=min(bkc, _dim(K)), GATE=gate,
            IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_prec, MM_PREC=mm_prec, SOLVE_PREC=s_prec,
            g_floor=G_FLOOR, span_max=SPAN_MAX, WU_LOWP=bool(wu_lowp) and wu_lowp_ok(dt, K, V) and gate != 2,
            AP_FORM=form if gate == 2 else 0, STORE_T=save_t, STORE_P=store_p, GC_OUT=gcum is not None,
            AP_ONE_REF=ap_one_ref, SOLVE_DOUBLING=_env_switch("CHUNKWISE_SOLVE_DOUBLING", SOLVE_DOUBLING),
            T_FORM=t_form, AP_LOWP=ap_lowp if ap_one_ref == 2 else min(ap_lowp, int(dt == torch.bfloat16)),
            SOLVE_REDO=s_redo, REDO_PREC=redo_prec, span16=SPAN_FP16, SIGNAL=ready is not None, num_warps=warps,
            FULL_ROWS=full[0], FULL_COLS=full[1], num_stages=prep_stages(gate, dt, K),
            **prep_regs(gate, t_form, store_p, dt, K))
    # (the kernel's gcum: G by chunk for a scalar gate, stage 2's; G per token and channel for KDA, the backward's)
    return dict(w=w, u=u, p=p, qg=qg, kg=kg, glast=glast, t=t, gcum=gcum if gate == 1 else None,
                G=gcum if gate == 2 else None)


def chunk_prepare_bwd(q, k, v, g, beta, do, scale, w, u, t_out, drl, cu_seqlens=None, chunk_indices=None,
                      wu_lowp=True, num_warps=4):
    """The backward's recompute for the delta rule with a scalar gate or none, in one pass per chunk (BWD
    mode of chunk_prepare_kernel): fills w [B,T,HV,K], u [B,T,HV,V] (16-bit for 16-bit inputs), t_out =
    (I + A)⁻¹ [B,T,HV,64] fp32 and drl = scale Pᵀ dO [B,T,HV,V]. ``wu_lowp``: the products of T and P
    with 16-bit operands (16-bit inputs only), as chunk_bwd's BWD_LOWP level 2."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    gate = _gate_kind(g)
    assert gate != 2 and beta is not None, "chunk_prepare_bwd: delta rule, scalar gate or none"
    NT = cdiv(T, BT)
    n_chunks = chunk_indices.shape[0] if cu_seqlens is not None else NT
    dot_prec, mm_prec, solve_prec = _dot_prec(q.dtype)
    bkc = prep_config(gate)[2]
    if n_chunks > 0:
        chunk_prepare_kernel[(n_chunks, B * HV)](
            q, k, v, g, beta, w, u, None, None, None, None, None, do, t_out, drl, None, None, cu_seqlens, chunk_indices,
            T, NT,
            H=H, HV=HV, K=K, V=V, scale=scale, BTc=BT, BCc=BC, BK=_dim(K), BVf=_dim(V), BKC=min(bkc, _dim(K)),
            GATE=gate, IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_prec, MM_PREC=mm_prec, SOLVE_PREC=solve_prec,
            g_floor=G_FLOOR, span_max=SPAN_MAX, WU_LOWP=bool(wu_lowp) and wu_lowp_ok(q.dtype, K, V), BWD=True,
            SOLVE_DOUBLING=_env_switch("CHUNKWISE_SOLVE_DOUBLING", SOLVE_DOUBLING),
            num_warps=num_warps, num_stages=1, **reg_cap("prep"))


def chunk_p(q, k, g, v_heads, cu_seqlens=None, chunk_indices=None):
    """P [B, T, HV, 64] (q's dtype) alone, for simple GLA run with ``p_in=True`` (see chunk_p_kernel)."""
    B, T, H, K = q.shape
    HV = v_heads
    NT = cdiv(T, BT)
    p = _alloc((B, T, HV, BT), q.dtype, q.device)
    n_chunks = chunk_indices.shape[0] if cu_seqlens is not None else NT
    if n_chunks > 0:
        chunk_p_kernel[(n_chunks, B * HV)](
            q, k, g, p, cu_seqlens, chunk_indices, T, NT, H, HV, K, BTc=BT, BK=_dim(K), GATE=_gate_kind(g),
            IS_VARLEN=cu_seqlens is not None, DOT_PREC=_dot_prec(q.dtype)[0], g_floor=G_FLOOR, num_warps=4)
    return p


def _pick_bv(V: int, K: int, programs: int) -> int:
    """Value split of stage 2: BV = 64 while that still gives >= 128 programs (one per SM of an
    H200's 132), else 32. Measured on the H200 (benchmarks/NOTES.md, Forward): at B1-H32 BV = 32 (128 programs)
    beat 16 and 64; at 256+ heads BV = 64 beat 32."""
    env = os.environ.get("CHUNKWISE_FWD_BV")
    if env:
        return min(int(env), _dim(V))
    bv = 64 if K <= 128 else 32
    if bv == 64 and programs * cdiv(V, 64) < 128:
        bv = 32
    return min(bv, _dim(V))


def _pick_stages(elt: int, BK: int, bv: int, delta: bool, p_in: bool, busy: bool, t_tile: bool = False,
                 trans: bool = False) -> int:
    """Pipeline depth of stage 2: 3 (best measured for bf16, K = V = 128) while the tiles of one chunk,
    times the depth, stay under ~200 KB of the H200's 227 KB shared memory; fp32 or K = 256 get 1-2.
    ``busy`` (at least two programs per SM): the deepest of 2-3 stages at which two programs share an SM,
    where one exists (simple GLA: B8-T4096-H32, BV = 64, 0.96 -> 0.55 ms at 2 stages instead of 3; the delta
    families' three [C, K] tiles per stage leave no such depth). ``t_tile``: a [C, C] tile more (KDA's T_FORM), with
    212 KB for the tiles: at BV 32 its 3 stages compile to 221 KB of shared memory (sm_90, bf16, TMA), and on the H200
    (B1-T32768-H32) KDA's forward took 2.054 ms at 3 against 2.470 at 2. ``trans`` (the transposed step, which stages
    nothing on the state's chain through shared memory) with ``t_tile``: 216 KB, so that KDA's BV 64 takes 3 stages
    (222 KB compiled; on the H200, run of 3d1debd, B8-T4096-H32 1.905 ms at 2 against 1.744 at 3)."""
    per_stage = elt * (BT * BK * (3 if delta else 2) + (BT * BT if p_in else 0) + (BT * BT if t_tile else 0) + BT * bv)
    if busy and 2 * 2 * per_stage <= 200 * 1024:
        return min(3, (100 * 1024) // per_stage)
    return max(1, min(3, ((216 if t_tile and trans else 212 if t_tile else 200) * 1024) // per_stage))


SEG_MIN_CHUNKS = 16   # simple GLA's segments: at least this many chunks each (the split's overhead, once per segment)
SEG_P1_BV = 128       # simple GLA's split: the value block of its first pass (local end states), at 4 warps, 3 stages


def _pick_segments(NT: int, programs: int, n_sm: int) -> int:
    """Segments per sequence for simple GLA's split (a power of two, at most 16): the most that still fit the
    grid in one wave of two programs per SM (the kernel's 255 registers per thread allow two), each segment
    at least SEG_MIN_CHUNKS chunks long. On the H200 (run of cd0d241, B1-T32768-H32, 64 unsplit programs):
    4 segments 0.787 ms, 8 (two waves) 0.833, 16 0.820."""
    nseg = 1
    while programs * nseg * 2 <= 2 * n_sm and nseg < 16 and cdiv(NT, nseg * 2) >= SEG_MIN_CHUNKS:
        nseg *= 2
    return nseg


# GDN / DeltaNet forward (not saved for a backward), per gate kind: P from stage 1 (1) or formed in stage 2's
# serial loop (0; stage 1 then reads no q and writes no P). On the H200 (run of 310dd0e, bf16, ms, stage 1 /
# stage 2's P): DeltaNet B1-T32768-H32 1.329 / 1.227, B8-T4096-H32 1.078 / 1.002, B4-T8192-H16/HV32 1.071 /
# 1.008, varlen16 1.127 / 1.051; GDN 1.641 / 1.921, 1.445 / 1.645, 1.429 / 1.627, 1.529 / 1.681 (its decay
# mask e^{G_i − G_j} on the serial path costs more than stage 1 saves)
DELTA_P_IN = {0: 0, 1: 1}


# the serial stage's tile loads (TMA) and output stores (TMA_O) through tensor descriptors: one copy instruction
# per tile instead of per-thread addresses and masks. On the H200 (run of f109703, bf16, forward ms, plain / TMA
# loads / loads and stores; fla 0.6.0 in brackets):
#   B1-T32768-H32        GDN 1.553 / 1.426 / 1.407 (1.924)  KDA 4.144 / 4.081 / 4.080 (3.861)
#                        DeltaNet 1.229 / 1.178 / 1.166 (2.096)  simple GLA 0.689 / 0.652 / 0.662 (0.901)
#   B8-T4096-H32         GDN 1.270 / 1.184 / 1.186  KDA 4.064 / 3.894 / 3.895  DeltaNet 1.002 / 0.968 / 0.967
#                        simple GLA 0.552 / 0.531 / 0.471
#   B4-T8192-H16/HV32    GDN 1.255 / 1.152 / 1.144  KDA 4.052 / 3.867 / 3.857  DeltaNet 1.010 / 0.951 / 0.947
#                        simple GLA 0.632 / 0.580 / 0.569
#   varlen16-T32768-H32  GDN 1.602 / 1.285 / 1.279  KDA 4.159 / 4.029 / 4.026  DeltaNet 1.051 / 1.033 / 1.030
#                        simple GLA 0.579 / 0.601 / 0.509
# so both on, except the stores for simple GLA's segment split (B1). CHUNKWISE_FWD_TMA / CHUNKWISE_FWD_TMA_O
# (0 / 1) override; the stores go through a descriptor only with the loads.
FWD_TMA = 1
FWD_TMA_O = 1

# the serial stage on the transposed state Sᵀ [BV, K] (_state_output_step_t; not simple GLA's segment split), per
# gate kind of the delta rule (simple GLA: FWD_TRANS_GLA), at BV >= 64 only: the products take the state and R from registers as their first operand (wgmma with
# A in registers) instead of staging them through shared memory as the second. On the H200 (run of e227cb1, bf16,
# forward ms, plain / transposed at BV 64): DeltaNet B8-T4096-H32 0.951 / 0.918, B4-T8192-H16/HV32 0.919 / 0.881,
# varlen16 1.013 / 0.978; KDA 2.926 / 2.893, 2.891 / 2.855, 3.021 / 2.987; but GDN 1.153 / 1.289 (its per-token
# gate, loaded along the transposed tiles' columns, becomes 48 single-element cp.async per thread), simple GLA
# 0.469 / 0.526 at B8. At BV = 32 (B1, 128 programs) the products are mma.sync ones and the state is still staged
# (the warps split the columns): DeltaNet 1.157 / 1.288, GDN 1.380 / 1.490, KDA 3.110 / 3.170.
# Under T_FORM (R = T diag(β) (V − (K ⊙ e^G) S), both products with register first operands) on the H200 (run of
# 3d1debd, bf16, forward ms, plain / transposed at BV 64): DeltaNet B8-T4096-H32 0.681 / 0.633, B4-T8192-H16/HV32
# 0.665 / 0.608, varlen16 0.723 / 0.667; KDA B8 1.985 / 1.907, B4 1.995 / 1.885, and at 3 pipeline stages, which
# the transposed step leaves room for (_pick_stages), 1.744 and 1.708. At B1 (BV 32) KDA 1.972 / 1.981, DeltaNet
# 0.913 / 1.079. GDN under T_FORM and with its gate chunk-major (7b9fb2e), at 2 pipeline stages (TRANS_STAGES) on
# the H200 (runs of c26cd23, session 21, bf16, forward ms, plain at 3 stages / transposed at 3 / at 2; fla in the same
# process): B8-T4096-H32 0.849 / 0.827 / 0.794 (fla 1.699), B4-T8192-H16/HV32 0.812 / 0.779 / 0.714 (fla 1.650),
# varlen16-T32768-H32 0.921 / 0.881 / 0.837 (fla 2.071); B1 stays at BV 32 (plain 1.082; transposed BV 64 1.191).
# CHUNKWISE_FWD_TRANS (0 / 1) overrides, at any BV.
FWD_TRANS = {0: 1, 1: 1, 2: 1}
# the transposed step's pipeline depth per gate kind where it is less than _pick_stages's (GDN: 2, measured above;
# KDA keeps 3 for its T tile: 1.744 ms at 3 against 1.905 at 2, B8). DeltaNet was faster at 2 too (H200, bf16,
# forward ms at 3 / 2 stages, runs of c26cd23 and f22371b: B8-T4096-H32 0.645 / 0.629, B4-T8192-H16/HV32 0.607 /
# 0.583, varlen16-T32768-H32 0.669 / 0.661): 2 for it as well
TRANS_STAGES = {0: 2, 1: 2}
FWD_TRANS_GLA = 0      # simple GLA: 0.469 plain against 0.526 transposed at B8-T4096-H32 (run of e227cb1, above)

# The delta rule (not a forward saved for the backward), per gate kind: stage 1 writes T diag(β) [C, C] per chunk
# instead of W = T diag(β e^G) K and U = T diag(β) V (T_FORM; no v read, two [C, C] @ [C, 128] products and 512 B
# per token and head fewer written; per channel K ⊙ e^G in W's place, formed in the first column loop, so that the
# second one, W's, is gone), and stage 2 forms R = T diag(β) (V − e^G ⊙ K S): one [C, C] @ [C, BV] product more on
# its serial path, K S in place of W S.
# With the transposed stage 2 since session 19 (FWD_TRANS). On the H200 (run of 38d0bad, bf16, forward ms, W / U
# against T_FORM; stage 1 alone): GDN B1-T32768-H32 1.354 / 1.195 (0.732 / 0.508), B8-T4096-H32 1.143 / 0.971,
# B4-T8192-H16/HV32 1.098 / 0.928, varlen16-T32768-H32 1.247 / 1.056; DeltaNet 1.155 / 0.975 (0.518 / 0.289),
# 0.921 / 0.759, 0.888 / 0.731, 0.985 / 0.797; KDA (run of 8a265be; stage 1 2.232 -> 1.372 ms at B1) 2.837 / 2.054 (3 pipeline stages at BV 32;
# 2.470 at 2), 2.630 / 2.066, 2.607 / 2.048, 2.709 / 2.146, and with steep gates (about −3 per token, every chunk
# flagged) 7.035 / 6.436. CHUNKWISE_FWD_T_FORM (0 / 1) overrides
FWD_T_FORM = {0: 1, 1: 1, 2: 1}


def _env_choice(name: str, default: int, choices=range(2)) -> int:
    """A launch choice among the integers ``choices`` from the environment variable ``name`` (``default`` when
    unset); anything else is an error that names the variable."""
    allowed = [str(c) for c in choices]
    value = os.environ.get(name, str(default))
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: expected {', '.join(allowed[:-1])} or {allowed[-1]}")
    return int(value)


def _env_switch(name: str, default: int) -> bool:
    """A 0 / 1 launch choice from the environment variable ``name`` (``default`` when unset)."""
    return _env_choice(name, default) == 1


def delta_stage1_form(gate: int, save: bool = False, dtype: torch.dtype | None = None) -> tuple[bool, bool]:
    """How chunk_fwd launches the delta families' stage 1 by default, for a gate kind (``save``: kept for the
    backward, with inputs of ``dtype``): (P stored by stage 1 (DELTA_P_IN; always per channel or saved), T diag(β)
    instead of W, U (FWD_T_FORM; saved: SAVE_T_FORM)), with CHUNKWISE_FWD_P_IN / CHUNKWISE_FWD_T_FORM applied."""
    store_p = save or _env_switch("CHUNKWISE_FWD_P_IN", DELTA_P_IN.get(gate, 1)) or gate == 2
    t_form = save_t_form(gate, dtype) if save else _env_switch("CHUNKWISE_FWD_T_FORM", FWD_T_FORM[gate])
    return store_p, t_form


# The training forward (stage 1 kept for the backward) under T_FORM too, per gate kind: stage 1 also writes T (fp32)
# for the backward but neither W nor U, stage 2 forms R from T diag(β) as the inference forward does, and the
# backward forms W = T diag(β e^G) K and U = T diag(β) V in the launch that already forms dR_local (_wu_kernel,
# chunk_bwd.SAVE_WU_LOWP): KDA's stage 1 then has one column loop instead of two (its W loop re-reads k and g), for a
# backward launch that reads k, v, G and writes W, U. The products keep the training forward's precisions (the tf32
# solve; A, P from fp32 operands), and the forward saves O(T·HV·2·64) instead of O(T·HV·(K + V + 2·64)): KDA's peak
# at B1-T32768-H32 bf16 6944 -> 6432 MB. On the H200 (runs of 2cb4873 / 2eb2b43, B1-T32768-H32 bf16, fwd+bwd ms, W / U
# kept -> T_FORM with W / U from fp32 / 16-bit operands): KDA 12.07 -> 12.01 / 11.58 (stage 1 2.31 -> 1.43, the W / U
# launch 0.20 -> 1.10 / 0.67, stage 2 0.61 -> 0.69), DeltaNet 5.22 -> 5.56 / 5.21, GDN 6.48 -> 6.82 / 6.43: on for
# KDA only. Not with fp16 inputs: on the H200 KDA's fp16 gradients through it came out inf at small tiles (K = 16,
# V = 32; test_grads_saved_stage1) where the interpreter's are right, the sm_90 pattern of NOTES session 8. Not with
# CHUNKWISE_SAVE_STATES (its stage 2 stores R = U − W S). CHUNKWISE_SAVE_T_FORM (0 / 1) overrides (fp16 still excluded).
SAVE_T_FORM = {0: 0, 1: 0, 2: 1}


def save_t_form(gate: int, dtype: torch.dtype | None = None) -> bool:
    """Whether the training forward of a gate kind on inputs of ``dtype`` runs stage 1 / stage 2 under T_FORM
    (SAVE_T_FORM): the saved stage 1 is then P and T only, and the backward forms W and U."""
    return bool(_env_switch("CHUNKWISE_SAVE_T_FORM", SAVE_T_FORM[gate])) and dtype != torch.float16 and \
        not saves_states()


def saves_stage1(q, v, g, beta) -> bool:
    """Whether chunk_fwd(saved_out=...) fills saved_out for these inputs: the delta families at head dims the
    kernels take as they are (not padded, not 16-bit with K > WIDE_16BIT_K nor fp16 KDA on the GPU, whose backward
    runs in fp32: fp16_kda_in_fp32), except GDN and DeltaNet with fp16 inputs: on the H200 (triton 3.6) their saved
    stage 1 gave inf gradients at small tiles (K = 16, V = 32; the interpreter and real sizes were right, NOTES.md
    session 8), so their backward recomputes it with the intra / solve / wu kernels that fp16 always took before."""
    if beta is None or (q.dtype != torch.float32 and q.shape[-1] > WIDE_16BIT_K) or fp16_kda_in_fp32(q, g):
        return False
    if q.dtype == torch.float16 and _gate_kind(g) < 2:
        return False
    return padded_dims(q, v) == (q.shape[-1], v.shape[-1])


# Under autograd (a forward saved for the backward, saves_stage1), stage 2 also writes every chunk's entering state
# and R = U − W S (the backward's h and R, in the 16-bit input dtype) so that the backward skips its forward state
# pass (0.58 / 0.63 / 0.89 ms for DeltaNet / GDN / KDA at B1-T32768-H32 bf16 on the H200, session 13), for
# O(T·HV·V·(1 + K / 64)) more saved memory (0.8 GB there). Unmeasured on the GPU: off until timed;
# CHUNKWISE_SAVE_STATES=1 turns it on.
SAVE_STATES = 0

# Under autograd, stage 2 writes R = U − W S (the 16-bit input dtype, [B, T, HV, V]: O(T·HV·V) more saved memory, the
# buffer the backward allocated for it anyway) and the backward's forward state pass forms the per-chunk states
# from it, S ← γ S + Kendᵀ R, one product a step on the state's chain instead of two (R = U − W S first) and no
# W / U read. Not with SAVE_STATES (which saves R and the states). CHUNKWISE_SAVE_R (0 / 1) overrides.
SAVE_R = 1


# KDA under autograd: the forward's q ⊙ e^G and k ⊙ e^{G_last − G} (stage 1 forms them for stage 2) kept for the
# backward's state passes (chunk_bwd.gate_scaled_in), instead of its _gate_scaled_kernel forming them again. On the
# H200 (B1-T32768-H32 bf16, run of ff1b510) fwd+bwd 11.43 -> 11.23 ms but the step's peak memory 6432 -> 7456 MB
# (fla's 7196), so it was off; since autograd no longer materialises zero gradients (session 23) and with the forward
# state pass beside the W / U launch (chunk_bwd.BWD_OVERLAP), run of a55c075: fwd+bwd 11.17 -> 10.73 ms, peak 6046 ->
# 6558 MB (fla 7196 in the same run): on; CHUNKWISE_SAVE_GATE_SCALED=0 forms them again in the backward
SAVE_GATE_SCALED = 1


def saves_gate_scaled() -> bool:
    """Whether a forward that saves stage 1 also keeps KDA's qg, kg for the backward (SAVE_GATE_SCALED)."""
    return _env_switch("CHUNKWISE_SAVE_GATE_SCALED", SAVE_GATE_SCALED)


# KDA under autograd: stage 1's chunk-local cumulative gate G [B,T,HV,K] fp32 kept for the backward, which otherwise
# forms it again first (_gate_cumsum_kernel: 0.27 ms at B1-T32768-H32 on the H200, 1 GB moved). The backward holds its
# own G for all of its launches, so the step's peak (in the backward) does not grow; CHUNKWISE_SAVE_GATE_CUMSUM=0 off
SAVE_GATE_CUMSUM = 1


def saves_gate_cumsum() -> bool:
    """Whether a forward that saves stage 1 also keeps KDA's G for the backward (SAVE_GATE_CUMSUM)."""
    return _env_switch("CHUNKWISE_SAVE_GATE_CUMSUM", SAVE_GATE_CUMSUM)


def saves_states() -> bool:
    """Whether a forward that saves stage 1 also saves the per-chunk states and R (SAVE_STATES)."""
    return _env_switch("CHUNKWISE_SAVE_STATES", SAVE_STATES)


def saves_r() -> bool:
    """Whether a forward that saves stage 1 also saves R = U − W S, without the per-chunk states (SAVE_R)."""
    return not saves_states() and _env_switch("CHUNKWISE_SAVE_R", SAVE_R)


# DeltaNet (no gate) under autograd with R kept (saves_r): stage 2 also keeps the final state, fp32 in the state
# layout ([N, HV, K, V]: one state per sequence, not per chunk), and the backward's reverse state pass forms each
# chunk's entering state from it backwards, S_c = S_{c+1} − Kᵀ R_c (the same products the forward added: no gate to
# divide by), in the steps it takes anyway, instead of a forward state pass of its own (chunk_bwd's REV_H). On the
# H200 (B1-T32768-H32 bf16, run of bd3a8cb): fwd+bwd 4.60 -> 4.42 ms (the forward state pass's 0.366 ms gone, the
# reverse pass 0.633 -> 0.827), real-size gradient errors the same to three digits. Saved memory: N·HV·K·V fp32,
# within the O(T·HV·(K + V)) of the inputs for sequences of a chunk or more. CHUNKWISE_SAVE_HT (0 / 1) overrides.
SAVE_HT = 1


def saves_final_state(g, beta) -> bool:
    """Whether a forward that saves stage 1 also keeps the final state for the backward's reverse state pass to
    form the per-chunk states from (SAVE_HT: DeltaNet, with R kept)."""
    return beta is not None and g is None and saves_r() and _env_switch("CHUNKWISE_SAVE_HT", SAVE_HT)


def keeps_r() -> bool:
    """Whether a forward that saves stage 1 keeps R, alone (saves_r) or with the per-chunk states (saves_states);
    it then keeps no U, which the backward reads only to form R."""
    return saves_states() or saves_r()


# Stage 2 beside stage 1 (the delta rule, where stage 2's grid leaves SMs idle: B1-T32768-H32 runs 64-128 serial
# programs, each latency-bound at one per SM, while stage 1 is throughput-bound): stage 1 runs its grid chunk-major
# and publishes each chunk (ready[slot, head], release), stage 2 runs on a high-priority stream that waits for the
# inputs but not for stage 1, and each step waits for its chunk (acquire). Stage 1 never waits, and is launched
# first; stage 2's programs, spinning, hold fewer SMs than the GPU has, so stage 1 always has one to run on (and
# with launches serialised, CUDA_LAUNCH_BLOCKING=1 or the interpreter, stage 1 has finished when stage 2 starts).
# Where a stage-2 program fills its SM's shared memory, stage 1 runs only on the SMs stage 2 leaves: KDA at its tuned
# BV 32, 3 stages (128 programs of 217 KB) took 42.7 ms instead of 1.98 (stage 1 on 4 SMs). So per gate kind
# (16-bit inputs, tuned launches): 0 off; 1 at the tuned value block and depth; 2 at BV 64 and 2 pipeline stages
# where that grid takes at most half the SMs. H200, B1-T32768-H32 bf16, forward ms, one after the other / beside
# (run of ffc9820, NOTES.md session 22): GDN 1.076 / 0.981 at its tuned BV 32, 3 stages (1.198 / 1.139 at BV 64,
# 3 stages); KDA 1.975 / 1.723 at BV 64, 2 stages (the transposed step; a stage-1 program fits beside each of the
# 64 stage-2 programs); DeltaNet 0.906 / 0.985 (slower beside at every block and depth tried: off).
# CHUNKWISE_FWD_OVERLAP (0 / 1 / 2, every family) overrides.
FWD_OVERLAP = {0: 0, 1: 1, 2: 2}


def _overlap_mode(requested, gate: int, dtype: torch.dtype, tuned: bool) -> int:
    """Stage 2 beside stage 1 (FWD_OVERLAP's modes): ``requested`` True / False (chunk_fwd(overlap=)) at the launch's
    own value block and depth, else CHUNKWISE_FWD_OVERLAP, else FWD_OVERLAP for 16-bit inputs and tuned launches."""
    if requested is not None:
        return int(bool(requested))
    if os.environ.get("CHUNKWISE_FWD_OVERLAP") is not None:
        return _env_choice("CHUNKWISE_FWD_OVERLAP", 0, range(3))
    return FWD_OVERLAP[gate] if tuned and dtype in (torch.bfloat16, torch.float16) else 0


@on_tensor_device
def chunk_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, *,
              chunk_indices=None, transpose_state_layout=False, p_in=None, bv=None, num_stages=None, num_warps=4,
              segments=None, seg_phase1=None, seg_sub=None, saved_out=None, overlap=None):
    """The chunk forward of all four families (canonical inputs: see chunkwise.triton).

    Returns (o [B,T,HV,V] in q's dtype, final state fp32 [N,HV,K,V] ([N,HV,V,K] transposed) or None).
    ``p_in`` / ``bv`` / ``num_stages`` / ``num_warps`` (stage 2) override the tuned defaults (benchmarks);
    ``segments`` (simple GLA without varlen): split each sequence into that many segments run side by side
    (1: no split; default: the most that fit one wave of two programs per SM, segments of at least
    SEG_MIN_CHUNKS chunks);
    ``seg_phase1`` = (BV, num_warps[, num_stages]) of the split's first pass (local end states) and ``seg_sub``,
    that pass in this many sub-segments per segment (default, tuned: BV = 128 at 4 warps, sub-segments to fill
    one wave; with ``segments`` given: stage 2's BV and warps, no sub-segments).
    ``saved_out``: a dict that, for the delta families at head dims the kernels take as they are, receives
    stage 1's w, u, p and t = (I + A)⁻¹ (fp32, or the input dtype: chunk_bwd.saved_t_dtype) for a backward that
    reuses them (chunk_bwd's ``saved``; u only where R is not kept: keeps_r), and for a per-channel gate
    qg = q ⊙ e^G, kg = k ⊙ e^{G_last − G} (q's dtype).
    ``overlap`` (delta rule): stage 2 launched beside stage 1 rather than after it, each chunk's step waiting
    for that chunk's stage-1 program (default: FWD_OVERLAP's mode per family where _overlap allows it; True /
    False: on / off at the launch's value block and depth).
    Head dims the kernels do not take as they are run zero-padded (triton/align.py).
    """
    if q.dtype != torch.float32 and q.shape[-1] > WIDE_16BIT_K:
        # 16-bit inputs with K > 128 run in fp32 (see WIDE_16BIT_K); o is returned in the input dtype
        o, ht = chunk_fwd(q.float(), k.float(), v.float(), g, None if beta is None else beta.float(), scale,
                          initial_state, output_final_state, cu_seqlens, chunk_indices=chunk_indices,
                          transpose_state_layout=transpose_state_layout, p_in=p_in, bv=bv, num_stages=num_stages,
                          num_warps=num_warps, segments=segments, seg_phase1=seg_phase1, seg_sub=seg_sub,
                          overlap=overlap)
        return o.to(q.dtype), ht
    save = saved_out is not None and saves_stage1(q, v, g, beta)      # (on the unpadded inputs)
    K0, V0 = q.shape[-1], v.shape[-1]
    Kp, Vp = padded_dims(q, v)
    padded = (Kp, Vp) != (K0, V0)
    if padded:
        q, k, v = pad_last(q, Kp), pad_last(k, Kp), pad_last(v, Vp)
        g = g if g is None or g.dim() == 3 else pad_last(g, Kp)
        initial_state = pad_state(initial_state, Kp, Vp, transpose_state_layout)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    gate = _gate_kind(g)
    delta = beta is not None
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g = None if g is None else g.float().contiguous()
    beta = None if beta is None else beta.contiguous()
    NT = cdiv(T, BT)
    tuned = p_in is None and bv is None and num_stages is None
    bv_arg = bv
    bv = bv or _pick_bv(V, K, N * HV)
    n_sm = _num_sms(q.device)
    ov_mode = _overlap_mode(overlap, gate, q.dtype, tuned) if delta else 0
    if ov_mode == 2:    # stage 2 beside stage 1 at BV 64, 2 stages, where that grid takes at most half the SMs
        if cdiv(V, min(64, _dim(V))) * N * HV <= n_sm // 2:
            bv = bv_arg or min(64, _dim(V))
            num_stages = num_stages or 2
        else:
            ov_mode = 0
    # fewer than two programs per SM: each is alone with its serial loop (latency-bound)
    busy = cdiv(V, bv) * N * HV >= 2 * n_sm
    nseg = 1
    bv_seg = min(64 if K <= 128 else 32, _dim(V))
    few = cdiv(V, bv_seg) * N * HV < n_sm
    if not delta and gate != 2 and cu_seqlens is None and (segments is not None or (tuned and few)):
        # simple GLA: its state is linear, so a few segments per sequence can run side by side (SEG in
        # chunk_state_output_kernel) and fill the GPU at two programs per SM, as a large batch does. Only where
        # the unsplit grid leaves SMs idle: on the H200 (run of 703d009) B1-T32768-H32 (64 programs) went from
        # 0.96 to 0.83 ms, but B4-T8192-H16/HV32 (256 programs, 2 segments) from 0.64 to 0.79
        nseg = segments or _pick_segments(NT, cdiv(V, bv_seg) * N * HV, n_sm)
        if nseg > 1:
            bv, busy = bv_arg or bv_seg, True
            if tuned and segments is None and seg_phase1 is None and seg_sub is None:
                # the first pass over all of V (each k tile read once per head) at 4 warps, in sub-segments
                # that fill one wave of two programs per SM, its loads 3 stages deep: on the H200 (B1-T32768-H32)
                # 4 segments with 2 sub-segments and a 128-wide first pass 0.713 ms against 0.782 without (run of
                # 2f0b1da; 4 sub-segments 0.744, 8 warps 0.816), at 3 stages 0.689 (run of 9404717; 1 stage 0.732)
                seg_phase1 = (min(SEG_P1_BV, _dim(V)), 4, 3)
                p1 = cdiv(V, seg_phase1[0]) * N * HV * nseg
                seg_sub = 1
                while p1 * seg_sub * 2 <= 2 * n_sm and seg_sub < 8 and cdiv(NT, nseg * seg_sub * 2) >= 4:
                    seg_sub *= 2
    if p_in is None:
        # simple GLA (no prepare stage) forms P inside its serial loop when the SMs are busy, and takes it from
        # its own chunk-parallel kernel when they are not (H200, B1-T32768-H32: 1.17 -> 0.95 ms; B8-T4096-H32:
        # 0.55 ms inside at 2 stages, 0.67 taken at 3); GDN / KDA take it from stage 1, DeltaNet forms it in
        # stage 2 (DELTA_P_IN) unless stage 1 is saved for a backward (which needs P)
        p_in = delta_stage1_form(gate, save)[0] if delta else not busy
    if gate == 2:
        p_in = True
    if cu_seqlens is not None and chunk_indices is None and (delta or p_in):
        from ..utils import prepare_chunk_indices
        chunk_indices = prepare_chunk_indices(cu_seqlens, BT)

    # stage 2's outputs first: with the overlap, everything it writes exists before stage 1 is launched
    o = _alloc((B, T, HV, V), q.dtype, q.device)
    ht = None
    # (the final state kept for the backward's reverse state pass too: saves_final_state)
    keep_ht = save and saves_final_state(g, beta)
    if output_final_state or keep_ht:
        shape = (N, HV, V, K) if transpose_state_layout else (N, HV, K, V)
        ht = _alloc(shape, torch.float32, q.device)
        if keep_ht:
            saved_out.update(ht=ht)
    hs = rs = None
    if save and keeps_r():
        # R (the backward's forward state pass then forms the states from it) and, with SAVE_STATES, the per-chunk
        # states too (the backward skips that pass)
        sdt = state_dtype(q.dtype)
        rs = _alloc((B, T, HV, V), sdt, q.device)
        saved_out.update(r=rs)
        if saves_states():
            hs = _alloc((chunk_slots(N, T, cu_seqlens is not None), HV, K, V), sdt, q.device)
            saved_out.update(h=hs)

    # the delta rule: stage 1 writes T diag(β) (and per channel K ⊙ e^G) and stage 2 forms R from it (T_FORM)
    t_form = delta and delta_stage1_form(gate, save, q.dtype)[1]
    n_chunks = (chunk_indices.shape[0] if cu_seqlens is not None else NT) if delta else 0
    overlap = ov_mode > 0 and nseg == 1 and _overlap(cdiv(V, bv) * N * HV, n_sm, n_chunks, q.device)
    ready = side = None
    if overlap:         # stage 2 beside stage 1, on a stream of its own that does not wait for it (_overlap)
        ready = torch.zeros((chunk_slots(N, T, cu_seqlens is not None), HV), dtype=torch.int32, device=q.device)
        side = _side_stream(q.device)
    stage1 = chunk_prepare(q, k, v, g, beta, cu_seqlens, chunk_indices, save_t=save, store_p=p_in or save,
                           t_form=t_form, ready=ready, save_g=save and gate == 2 and saves_gate_cumsum()) \
        if delta else dict(w=None, u=None, p=None, qg=None, kg=None, glast=None, gcum=None)
    if save:    # under T_FORM stage 1's w, u are stage 2's operands (K ⊙ e^G, T diag(β)): the backward forms W, U
        saved_out.update(p=stage1["p"], t=stage1["t"])
        if gate == 2:       # q ⊙ e^G, k ⊙ e^{G_last − G}: what the backward's state passes take (chunk_bwd.gate_scaled_in)
            saved_out.update(qg=stage1["qg"], kg=stage1["kg"])
            if stage1["G"] is not None:
                saved_out.update(G=stage1["G"])
        if not t_form:
            saved_out.update(w=stage1["w"])
            if rs is None:      # (U only where R is not kept: R = U − W S is all the backward reads U for)
                saved_out.update(u=stage1["u"])
    if p_in and not delta:                # simple GLA with P formed once per chunk
        stage1["p"] = chunk_p(q, k, g, HV, cu_seqlens, chunk_indices)
    if not p_in:
        stage1["p"] = None

    def strides(x):
        if x is None:
            return (0, 0, 0, 0)
        sn, sh, s2, s3 = x.stride()
        return (sn, sh, s3, s2) if transpose_state_layout else (sn, sh, s2, s3)

    dot_prec = _dot_prec(q.dtype)[0]
    trans = _env_switch("CHUNKWISE_FWD_TRANS", int((FWD_TRANS[gate] if delta else FWD_TRANS_GLA) and bv >= 64))
    tma = _env_switch("CHUNKWISE_FWD_TMA", FWD_TMA)
    # (not where stage 2 stores R too: offline sm_90 the two stores' staging took GDN's training stage 2 past the
    # shared memory that leaves a stage-1 program room beside it, 197200 -> 201296 B; one staging is shared)
    tma_o = tma and _env_switch("CHUNKWISE_FWD_TMA_O", int(FWD_TMA_O and nseg == 1 and rs is None))
    if tma and not _INTERPRET:
        _ensure_allocator()
    if num_stages is None:
        num_stages = _pick_stages(q.element_size(), _dim(K), bv, delta, p_in, busy, t_form and gate == 2,
                                  trans and nseg == 1)
        if trans and nseg == 1 and delta:
            num_stages = min(num_stages, TRANS_STAGES.get(gate, num_stages))
    if num_stages == 1 and bv <= 32 and q.element_size() == 2 and not _INTERPRET:
        # (never picked: 16-bit inputs take 2-3 stages) on the H200 with triton 3.6 this build raised illegal memory
        # accesses (GDN, DeltaNet; B8-T4096-H32 and B1-T2048-H32) or gave a wrong output (KDA, 1.15 relative to the
        # float64 reference), while BV 64 at one stage and fp32 inputs at one stage were right (benchmarks/ns1_check.py,
        # NOTES.md session 20)
        raise ValueError(f"chunk_fwd: num_stages=1 with a {bv}-wide value block and {q.dtype} inputs is miscompiled on "
                         f"sm_90 (triton 3.6); use num_stages >= 2 or bv >= 64")
    grid = (cdiv(V, bv), N * nseg * HV)
    sloc = gam = None
    sub = (seg_sub or 1) if nseg > 1 else 1
    sub_len = cdiv(NT, nseg * sub)           # the first pass's (sub-)segments; a segment is sub of them
    seg_len = sub_len * sub
    if nseg > 1:
        sloc = _alloc((N * nseg * sub, HV, K, V), torch.float32, q.device)
        gam = _alloc((N * nseg * sub, HV), torch.float32, q.device)
    for seg_mode in ((1, 2) if nseg > 1 else (0,)):
        bv_m, warps_m, rows_m, len_m, nseg_m, stages_m = bv, num_warps, grid[1], seg_len, nseg, num_stages
        if seg_mode == 1:
            rows_m, len_m, nseg_m = N * nseg * sub * HV, sub_len, nseg * sub
            if seg_phase1 is not None:
                # the local-end-state pass with its own value block (it writes whole [K, V] states, which the
                # second pass reads at its own BV): a wider block reads each k tile once for more of V
                bv_m, warps_m = min(seg_phase1[0], _dim(V)), seg_phase1[1]
                stages_m = seg_phase1[2] if len(seg_phase1) > 2 else num_stages
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            chunk_state_output_kernel[(cdiv(V, bv_m), rows_m)](
                q, k, v, stage1["w"], stage1["u"], stage1["p"], g, stage1["qg"], stage1["kg"], stage1["glast"],
                stage1["gcum"], o, initial_state, ht, sloc, gam, hs, rs, ready, cu_seqlens, scale, T, NT, len_m,
                *strides(initial_state), *strides(ht),
                H=H, HV=HV, K=K, V=V, BTc=BT, BK=_dim(K), BV=bv_m, GATE=gate, DELTA=delta, P_IN=p_in,
                USE_H0=initial_state is not None, STORE_HT=ht is not None, IS_VARLEN=cu_seqlens is not None,
                DOT_PREC=dot_prec, g_floor=G_FLOOR, LOOP_WHILE=_INTERPRET, SEG=seg_mode, NSEG=nseg_m,
                SUB=sub if seg_mode == 2 else 1, GC_IN=delta and gate == 1, TMA=tma,
                TMA_O=tma_o, STORE_HR=1 if hs is not None else (2 if rs is not None else 0), TRANS=int(trans and seg_mode == 0),
                T_FORM=t_form,
                WAIT=stages_m + 1 if overlap else 0, FENCE=bool(overlap and tma and not _INTERPRET),
                num_warps=warps_m, num_stages=stages_m, **reg_cap("fwd_o"))
    if side is not None:
        torch.cuda.current_stream(q.device).wait_stream(side)
    if not output_final_state:
        ht = None
    if padded:
        o, ht = o[..., :V0].contiguous(), cut_state(ht, K0, V0, transpose_state_layout)
    return o, ht
