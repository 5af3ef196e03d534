"""Backward of the Triton chunk ops, for every family (gate none / scalar / per channel; delta on / off).

Per chunk (DESIGN.md §2), with S the state entering it, G the chunk-local cumsum of g and
Γ_ij = exp(G_i − G_j) (per channel for KDA)::

    A = strict_tril(β_i ⟨k_i, Γ_ij k_j⟩),   T = (I + A)⁻¹,   X = β ⊙ e^G ⊙ K,   Y = β ⊙ V
    W = T X,   U = T Y,   R = U − W S       (no delta rule: W = 0, R = V)
    P = tril(⟨q_i, Γ_ij k_j⟩),   Qg = Q ⊙ e^G,   Kend = K ⊙ e^{G_last − G},   γ = e^{G_last}
    O = scale (Qg S + P R),     S' = γ S + Kendᵀ R

Backward, given dO and dS' (dh: the gradient of the state leaving the chunk)::

    dR  = scale Pᵀ dO + Kend dS'                     (reverse pass over chunks)
    dS  = γ dS' + scale Qgᵀ dO − Wᵀ dR
    dW  = −dR Sᵀ,  dQg = scale dO Sᵀ,  dKend = R dS'ᵀ,  dγ = Σ_v S ⊙ dS',  dP = scale tril(dO Rᵀ)
    dX  = Tᵀ dW,   dY = Tᵀ dR,   dA = −Tᵀ (dW Xᵀ + dR Yᵀ) Tᵀ   (strict lower part)
    pairwise M_ij = Σ_c a_ic b_jc Γ_ijc:  da_i = Σ_j dM_ij b_j Γ_ij,  db_j = Σ_i dM_ij a_i Γ_ij,
                                            dG += a ⊙ da − b ⊙ db
    dg  = reverse cumsum of dG inside the chunk (dG_last collects the γ and Kend terms)

Stages (kernels below, all launched by chunk_bwd): gate cumsum -> A, P (-> their per-channel
diagonal blocks) -> T -> W, U, dR_local -> forward state pass (h, R) -> reverse state pass (dh, dR,
dh0) -> for a scalar gate or none (BWD_DQK): everything that reads the state tiles h / dh, by key column blocks
(dq, the dk and dg of the state and P terms, dW) -> the gradients through T per chunk (dv, dk, dβ, dg finished);
per channel: value-side gradients (dP, dT_v, dv, dβ) -> key-side gradients (dq, dk, dβ, dg) -> the pairwise
gradients through P and A by blocks of key channels, and the reverse cumsum (grouped value heads: dq, dk summed over
each group, group_sum). Per-chunk states are recomputed here and live only during the backward. Under autograd the
delta families' forward keeps its stage 1 (T, P, and W, U or KDA's q ⊙ e^G, k ⊙ e^{G_last − G}, G) and R = U − W S
(chunk_bwd's ``saved``): O(T·H·(K + V + C)), and the stages above that form them are skipped (the forward state pass
then forms only h, from R).

Per-channel numerics: Γ is never formed from e^{G_i} and e^{−G_j}. Where a chunk's gate stays within
±SPAN_MAX of r = G_last / 2 for a block of channels, Γ_ij = exp(G_i − r) · exp(r − G_j) over the whole
chunk (both factors in fp32's range: _pair_grads_one_ref); elsewhere, off the 16×16 diagonal blocks,
column block J (last token r) factors as exp(G_i − G_r) · exp(G_r − G_j), both ≤ 1, and the diagonal
blocks around their last token when they span less than SPAN_MAX, else pair by pair. The gate is clamped at −GATE_FLOOR per token before the cumsum:
exp of anything below −104 is 0 in fp32 already, and the clamp keeps |G| small enough that fp32
differences of cumsums stay accurate after a hard reset (g = −1e4).
"""
from __future__ import annotations

import contextlib
import os
import warnings

import torch
import triton
import triton.language as tl

from ..utils import TRITON_MAX_HEAD_DIM as MAX_K   # the backward's kernels fit one H200 SM's shared memory up to it
from .align import cdiv, cut_state, next_pow2, pad_last, pad_state, padded_dims
from .chunk_fwd import (WIDE_16BIT_K, _env_choice, _env_switch, _exp, _exp_or, _mm, _mm_acc, _num_sms, _overlap,
                        _side_stream, _signal_ready, _wait_ready, chunk_slots, chunks_whole, fp16_kda_in_fp32,
                        on_tensor_device, prec_env, reg_cap, state_dtype, wu_lowp_ok, FAST_EXP)

CHUNK = 64
SUB = 16
GATE_FLOOR = 40.0
SPAN_MAX = 80.0   # a 16-token diagonal block whose gates span more takes the exact pair-by-pair path
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# KDA's backward: the serial state passes take q ⊙ e^G and k ⊙ e^{G_last − G} from a chunk-parallel kernel (1)
# or form them per chunk on their serial path (0); CHUNKWISE_BWD_KD_IN overrides. Offline sm_90 the per-chunk
# form costs _bwd_dh_kernel 132 exponentials per thread per chunk and spills at 255 registers. On the H200 (run of
# ac0ebbf, KDA B1-T32768-H32 bf16 fwd+bwd) 1 took the reverse pass 2.24 -> 1.33 ms and the forward pass 1.51 ->
# 0.88, fwd+bwd 15.77 -> 14.63 ms (the chunk-parallel kernel included), the same gradients
BWD_KD_IN = 1
# The reverse state pass's dR_local tile (and KDA's G_last): per gate kind (none / scalar / per channel), loaded in the
# step (0), a step ahead (1), or in the step with the K dS' product kept apart from it (2); CHUNKWISE_BWD_DH_AHEAD
# overrides. Triton pipelines a product's operands, not its accumulator: without a gate the compiler folded dR_local
# into K dS' as its accumulator and each chunk waited a global load on the serial path, as KDA's G_last did. On the
# H200 (sweep_bwd --variants ahead, run of a7797c6, B1-T32768-H32 bf16; reverse pass ms 0 / 1 / 2, fwd+bwd):
# DeltaNet 1.178 / 1.078 / 0.649 (fwd+bwd 6.56 -> 6.04), KDA 1.344 / 0.796 / 0.856 (13.63 -> 13.07), GDN 0.815 /
# 0.879 / 0.822 (its scaled dR_local was pipelined already)
BWD_DH_AHEAD = {0: 2, 1: 0, 2: 1}
# Scalar / no gate with the forward's stage 1 saved: 1, the reverse state pass forms each chunk's dR_local = scale Pᵀ dO
# from the saved P (one more product per step, off its dependence on dS'); 0, a chunk-parallel launch writes dR_local
# for the pass to read (_wu_kernel, 0.20 ms). On the H200 (sweep_bwd --variants dqk, run of b5d9499, B1-T32768-H32
# bf16) the product doubled the serial pass: DeltaNet 0.654 -> 1.299 ms, GDN 0.810 -> 1.431 (fwd+bwd 5.70 -> 6.12,
# 7.25 -> 7.63): the serial loop's tensor-core groups are synchronous (NOTES.md, session 9). CHUNKWISE_BWD_P_IN_DH
BWD_P_IN_DH = 0
# KDA's state-tile pass (_bwd_dqk_kernel, per-channel gate) with FAST_EXP's gate factors too (1) or tl.exp's (0,
# the default); CHUNKWISE_FAST_EXP_KDA_DQK=1 (read at import) takes FAST_EXP's. On the H200 (KDA B1-T32768-H32 bf16,
# run of 62b8880, one process each) the pass took 2.38 / 2.39 ms with the fast factors against 2.23 with tl.exp
# (fwd+bwd 9.90 / 9.92 against 9.78), though offline sm_90 it has 6 % fewer instructions with them (3496 -> 3280)
FAST_EXP_KDA_DQK = tl.constexpr(bool(FAST_EXP) and os.environ.get("CHUNKWISE_FAST_EXP_KDA_DQK", "0") == "1")


def _bwd_dh_ahead(gate: int) -> int:
    """The reverse pass's AHEAD form (BWD_DH_AHEAD; CHUNKWISE_BWD_DH_AHEAD 0 / 1 / 2, see _bwd_dh_kernel)."""
    return _env_choice("CHUNKWISE_BWD_DH_AHEAD", BWD_DH_AHEAD[gate], range(3))


# ------------------------------------------------------------------------------------------------
# chunk bookkeeping shared by the chunk-parallel kernels
# ------------------------------------------------------------------------------------------------

@triton.jit
def _chunk_len(t0, eos, C: tl.constexpr, FULL: tl.constexpr):
    """Valid rows of the chunk starting at token row t0 of a sequence ending at eos: at most C; FULL (every chunk
    whole: no varlen, T a multiple of C) the constant C, so that the masks built from it fold away (BWD_FULL)."""
    if FULL:
        L = C
    else:
        L = tl.minimum(eos - t0, C)
    return L


@triton.jit
def _chunk_bounds(i_t, i_b, cu_seqlens, chunk_indices, T, C: tl.constexpr, IS_VARLEN: tl.constexpr,
                  FULL: tl.constexpr = 0):
    """Chunk i_t of batch row i_b -> (first token row t0 in the flat [B*T] axis, valid length L,
    global chunk id for the per-chunk state buffers). FULL (every chunk whole: no varlen, T a multiple of C): L is
    the constant C, so that the masks built from it fold away (chunk_bwd's BWD_FULL)."""
    # int64 throughout: token rows times H·K, and chunk ids times HV·K·V (the per-chunk states), pass
    # 2^31 from B·T = 256k tokens at 32 heads of 128 (B8-T32768-H32)
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
        i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        i_g = i_n + bos // C + i_c          # the chunk's slot (_seq_bounds)
    else:
        i_c = i_t.to(tl.int64)
        bos = i_b.to(tl.int64) * T
        eos = bos + T
        i_g = i_b.to(tl.int64) * tl.cdiv(T, C) + i_c
    t0 = bos + i_c * C
    return t0, _chunk_len(t0, eos, C, FULL), i_g


@triton.jit
def _chunk_program(cu_seqlens, chunk_indices, T, H: tl.constexpr, HV: tl.constexpr, C: tl.constexpr,
                   IS_VARLEN: tl.constexpr, CHUNK_MAJOR: tl.constexpr = 0, FULL: tl.constexpr = 0):
    """Where a chunk-parallel program of grid (chunks, B·HV) works: (value head i_h, the key head i_hk its group
    reads, the chunk's first token row t0, valid length L, chunk slot i_g) (_chunk_bounds). CHUNK_MAJOR: the grid
    is (B·HV, chunks), so that every head's first chunks are placed first (a launch a serial pass waits on)."""
    if CHUNK_MAJOR:
        i_bh, i_t = tl.program_id(0), tl.program_id(1)
    else:
        i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // HV, i_bh % HV
    t0, L, i_g = _chunk_bounds(i_t, i_b, cu_seqlens, chunk_indices, T, C, IS_VARLEN, FULL)
    return i_h, i_h // (HV // H), t0, L, i_g


@triton.jit
def _seq_bounds(i_n, cu_seqlens, T, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Sequence i_n -> (first token row, last+1, slot of its first chunk, number of chunks).

    Varlen: sequence n's chunks take the slots i_n + bos // C + [0, chunks): distinct across sequences (the
    next sequence's first slot, i_n + 1 + (bos + len) // C, is past them) and fewer than N + T // C in all
    (``chunk_slots``), known from the shapes alone, as the forward's stage 2 numbers them (chunk_fwd's glast)."""
    if IS_VARLEN:     # int64: see _chunk_bounds
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        boh = i_n.to(tl.int64) + bos // C
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        boh = i_n.to(tl.int64) * tl.cdiv(T, C)
    return bos, eos, boh, tl.cdiv(eos - bos, C)


# ------------------------------------------------------------------------------------------------
# stage 0: chunk-local cumsum of the gate
# ------------------------------------------------------------------------------------------------

@triton.jit
def _gate_cumsum_kernel(g, G, cu_seqlens, chunk_indices, T, floor,
                        HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr,
                        PER_CHANNEL: tl.constexpr, IS_VARLEN: tl.constexpr):
    """G_i = Σ_{j ≤ i in chunk} max(g_j, −floor).  g, G: [B, T, HV] or [B, T, HV, K] fp32."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // HV, i_bh % HV
    t0, L, _ = _chunk_bounds(i_t, i_b, cu_seqlens, chunk_indices, T, C, IS_VARLEN)
    o_t = tl.arange(0, C)
    m_t = o_t < L
    if PER_CHANNEL:
        o_k = tl.arange(0, BK)
        m = m_t[:, None] & (o_k < K)[None, :]
        p = ((t0 + o_t).to(tl.int64)[:, None] * HV + i_h) * K + o_k[None, :]
        b_g = tl.maximum(tl.load(g + p, mask=m, other=0.).to(tl.float32), -floor)
        tl.store(G + p, tl.cumsum(b_g, axis=0), mask=m)
    else:
        p = (t0 + o_t).to(tl.int64) * HV + i_h
        b_g = tl.maximum(tl.load(g + p, mask=m_t, other=0.).to(tl.float32), -floor)
        tl.store(G + p, tl.cumsum(b_g, axis=0), mask=m_t)


@triton.jit
def _rev_cumsum(x):
    """Σ_{j ≥ i} x_j along the chunk's rows (axis 0) of x [C] or [C, BK] (a gate's dg from its per-row terms)."""
    return tl.sum(x, axis=0, keep_dims=True) - tl.cumsum(x, axis=0) + x


@triton.jit
def _share_rows(acc, dGp, s_p, rows, i_h, m_t, HV: tl.constexpr, NKP: tl.constexpr):
    """acc + Σ_i dGp[i] at the token rows `rows` (mask m_t) and value head i_h of NKP per-row shares dGp [NKP, B, T,
    HV] fp32 (one share: s_p elements)."""
    for i_p in tl.static_range(NKP):
        acc += tl.load(dGp + i_p * s_p + rows * HV + i_h, mask=m_t, other=0.)
    return acc


@triton.jit
def _load_gate_cols(G, t0, L, i_h, o_k, m_k, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr):
    """Columns o_k of a per-channel chunk gate: (G [C, BKH] with rows past L = G_last, G_last [BKH])."""
    o_t = tl.arange(0, C)
    m_t = o_t < L
    p = ((t0 + o_t).to(tl.int64)[:, None] * HV + i_h) * K + o_k[None, :]
    b_G = tl.load(G + p, mask=m_t[:, None] & m_k[None, :], other=0.)
    b_last = tl.load(G + ((t0 + L - 1).to(tl.int64) * HV + i_h) * K + o_k, mask=m_k, other=0.)
    return tl.where(m_t[:, None], b_G, b_last[None, :]), b_last


@triton.jit
def _ref_offsets(G, t0, L, i_h, o_k, m_k, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr):
    """G − r [C, BKP] for the channels o_k [BKP] of a chunk, r = G_last / 2 per channel (rows past L at G_last). KDA's
    one-reference form fits a channel block where every |G_i − r| is under span_max (_ref_span): the one
    test every launch that splits the work by it must share."""
    b_G, b_last = _load_gate_cols(G, t0, L, i_h, o_k, m_k, HV, K, C)
    return b_G - 0.5 * b_last[None, :]


@triton.jit
def _ref_span(b_d):
    """The largest |G_i − r| of a channel block (_ref_offsets): the block fits one reference where it is under
    span_max."""
    return tl.max(tl.max(tl.abs(b_d), axis=1), axis=0)


@triton.jit
def _load_gate(G, t0, L, i_h, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr,
               PER_CHANNEL: tl.constexpr):
    """The chunk's cumulative gate, rows past L filled with G_last (what g = 0 padding gives).

    Returns (G [C, BK] (per channel) or [C], G_last [BK] or scalar)."""
    o_t = tl.arange(0, C)
    m_t = o_t < L
    if PER_CHANNEL:
        o_k = tl.arange(0, BK)
        b_G, b_last = _load_gate_cols(G, t0, L, i_h, o_k, o_k < K, HV, K, C)
    else:
        b_G = tl.load(G + (t0 + o_t).to(tl.int64) * HV + i_h, mask=m_t, other=0.)
        b_last = tl.load(G + (t0 + L - 1).to(tl.int64) * HV + i_h)
        b_G = tl.where(m_t, b_G, b_last)
    return b_G, b_last


# ------------------------------------------------------------------------------------------------
# stage 1: A = strict_tril(β ⟨k_i, Γ k_j⟩) and P = tril(⟨q_i, Γ k_j⟩)
# ------------------------------------------------------------------------------------------------

@triton.jit
def _intra_kernel(q, k, beta, G, Amat, Pmat, cu_seqlens, chunk_indices, T,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr,
                  BC: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr, IS_VARLEN: tl.constexpr,
                  PREC: tl.constexpr):
    """A, P: [B, T, HV, C] fp32 (row i of chunk, column j). GATE: 0 none, 1 scalar, 2 per channel.

    Per channel only the blocks off the BC×BC diagonal are written here (_intra_diag_kernel
    writes the diagonal blocks)."""
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
        # would need more shared memory than an SM has (sm_90, fp32 inputs: 262144 B)
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
    around its last token e: Γ_ij = e^{G_i − e} · e^{e − G_j}. Returns (e^{G − e} ≥ 1, e^{e − G} ≤ 1, whether
    every exponent stays within span_max, so that the factors and their products stay in fp32's range)."""
    BC: tl.constexpr = b_G.shape[0]
    b_e = tl.sum(tl.where((tl.arange(0, BC) == BC - 1)[:, None], b_G, 0.), axis=0)        # [BK]
    b_d = b_G - b_e[None, :]                                                               # ≥ 0
    fast = tl.max(tl.max(b_d, axis=1), axis=0) < span_max
    return _exp(tl.where(fast, b_d, 0.)), _exp(-b_d), fast


@triton.jit
def _diag_column(k, G, b_G, b_last, t0, L, ib, jj, i_h, i_hk, o_k, m_k, H: tl.constexpr, HV: tl.constexpr,
                 K: tl.constexpr, BC: tl.constexpr):
    """Column jj of diagonal block ib, exactly: (its chunk row j, whether it is inside the sequence, k_j [BK],
    e^{G_i − G_j} [BC, BK] for the block's rows i ≥ j, 0 above). b_G: the block's rows of the chunk gate."""
    o_i = tl.arange(0, BC)
    j = ib * BC + jj
    m_j = j < L
    row_j = (t0 + j).to(tl.int64)
    b_kj = tl.load(k + (row_j * H + i_hk) * K + o_k, mask=m_k & m_j, other=0.).to(tl.float32)
    b_Gj = tl.load(G + (row_j * HV + i_h) * K + o_k, mask=m_k & m_j, other=0.)
    b_Gj = tl.where(m_j, b_Gj, b_last)
    return j, m_j, b_kj, _exp(tl.where((o_i >= jj)[:, None], b_G - b_Gj[None, :], float("-inf")))


@triton.jit
def _intra_diag_kernel(q, k, beta, G, Amat, Pmat, cu_seqlens, chunk_indices, T,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr,
                       BC: tl.constexpr, DELTA: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
                       span_max: tl.constexpr):
    """Per-channel gates: the BC×BC diagonal blocks of A and P. A block whose gates span less than span_max
    takes two products of factored operands (_diag_factors); otherwise each column j exactly (rare)."""
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
        if DELTA:
            b_beta = tl.load(beta + rows * HV + i_h, mask=m_r, other=0.).to(tl.float32)
        else:
            b_beta = tl.zeros([BC], dtype=tl.float32)
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
                if DELTA:
                    b_A = tl.where((o_i == jj)[None, :], tl.sum(b_k * b_w, axis=1)[:, None], b_A)
        p = (rows[:, None] * HV + i_h) * C + o_r[None, :]
        m = m_r[:, None] & m_r[None, :]
        tl.store(Pmat + p, tl.where(o_i[:, None] >= o_i[None, :], b_P, 0.), mask=m)
        if DELTA:
            tl.store(Amat + p, tl.where(o_i[:, None] > o_i[None, :], b_A * b_beta[:, None], 0.), mask=m)


# ------------------------------------------------------------------------------------------------
# stage 2: T = (I + A)⁻¹ (blockwise: 16×16 forward substitution, then the off-diagonal blocks)
# ------------------------------------------------------------------------------------------------

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
                      mask=(o < i) & (row < L), other=0.)                          # [BC]
        b_new = tl.where(o == i, 1., 0.) - tl.sum(b_a[:, None] * b_T, axis=0)
        b_T = tl.where((o == i)[:, None], b_new[None, :], b_T)
    return b_T


@triton.jit
def _solve_kernel(Amat, Tmat, cu_seqlens, chunk_indices, T, HV: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
                  IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    """T = (I + A)⁻¹ for C = 4·BC.  A, T: [B, T, HV, C] fp32 (T's upper blocks are not written)."""
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
# stage 3: W = T X, U = T Y, dR_local = scale Pᵀ dO
# ------------------------------------------------------------------------------------------------

@triton.jit
def _gate_factors(b_G, b_last, GATE: tl.constexpr):
    """(e^G, e^{G_last − G}) broadcastable against [C, BK]."""
    if GATE == 2:
        return _exp(b_G), _exp(b_last[None, :] - b_G)
    else:
        return _exp(b_G)[:, None], _exp(b_last - b_G)[:, None]


@triton.jit
def _wu_kernel(k, v, beta, G, Tmat, Pmat, do, W, U, dRl, cu_seqlens, chunk_indices, T, scale,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, C: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr,
               IS_VARLEN: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr = 0, ready=None,
               SIGNAL: tl.constexpr = 0, STORE_U: tl.constexpr = 1):
    """W: [B, T, HV, K], U, dRl: [B, T, HV, V] (16-bit storage for 16-bit inputs); U only with STORE_U (not
    where the forward saved R, which is all the backward reads U for). LOWP: 1, the products'
    operands (T, P, β e^G K, β V, dO) in the 16-bit input dtype, fp32 accumulation: W and U as the
    forward's stage 1 forms them with its bf16 W/U products; 2, in fp16, each tile scaled by a power of two
    first (_fp16_scaled: no overflow, no subnormals at its top 14 binades, 11 significant bits rounded to
    nearest where tf32 keeps 11 truncated); 0, fp32 operands at PREC.
    SIGNAL (the forward state pass running beside this launch, chunk_bwd's overlap): the grid (B·HV, chunks),
    chunk-major, and each program, once its W / U are stored, sets ready[slot, head] (chunk_fwd._signal_ready)."""
    i_h, i_hk, t0, L, i_g = _chunk_program(cu_seqlens, chunk_indices, T, H, HV, C, IS_VARLEN, SIGNAL)
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
    if SIGNAL:
        _signal_ready(ready, i_g, i_h, HV)


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


@triton.jit
def _gate_scaled_kernel(q, k, G, qd, kd, cu_seqlens, chunk_indices, T, H: tl.constexpr, HV: tl.constexpr,
                        K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Per-channel gate (KD_IN): qd = q ⊙ e^G, kd = k ⊙ e^{G_last − G} [B, T, HV, K] in the input dtype, what the
    serial state passes take as their products' 16-bit operands, formed once here instead of on their serial
    path (a [C, K] fp32 gate tile and two exponentials per element per chunk there)."""
    i_h, i_hk, t0, L, _ = _chunk_program(cu_seqlens, chunk_indices, T, H, HV, C, IS_VARLEN)
    o_t = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    rows = (t0 + o_t).to(tl.int64)
    m_tk = (o_t < L)[:, None] & (o_k < K)[None, :]
    b_G, b_last = _load_gate(G, t0, L, i_h, HV, K, BK, C, True)
    b_eG, b_ekend = _gate_factors(b_G, b_last, 2)
    p_in = (rows[:, None] * H + i_hk) * K + o_k[None, :]
    p_out = (rows[:, None] * HV + i_h) * K + o_k[None, :]
    b_q = tl.load(q + p_in, mask=m_tk, other=0.).to(tl.float32)
    b_k = tl.load(k + p_in, mask=m_tk, other=0.).to(tl.float32)
    tl.store(qd + p_out, (b_q * b_eG).to(qd.dtype.element_ty), mask=m_tk)
    tl.store(kd + p_out, (b_k * b_ekend).to(kd.dtype.element_ty), mask=m_tk)


# ------------------------------------------------------------------------------------------------
# stage 4: forward state pass (recomputes S entering each chunk and R = U − W S)
# ------------------------------------------------------------------------------------------------

@triton.jit
def _seq_program(cu_seqlens, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, IS_VARLEN: tl.constexpr, TRANSPOSE: tl.constexpr):
    """Where a serial state pass's program of grid (cdiv(V, BV), N·HV) works: (value head i_h, its key head i_hk,
    the sequence's bounds bos, eos, first chunk slot boh and chunk count (_seq_bounds), the state tile's o_k [BK],
    o_v [BV], masks m_k, m_v, m_kv, and its offsets p0 [BK, BV] in an [N, HV, K, V] state (TRANSPOSE: [N, HV, V, K]))."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    bos, eos, boh, NTs = _seq_bounds(i_n, cu_seqlens, T, C, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    if TRANSPOSE:
        p0 = (i_nh * V + o_v[None, :]).to(tl.int64) * K + o_k[:, None]
    else:
        p0 = (i_nh * K + o_k[:, None]).to(tl.int64) * V + o_v[None, :]
    return i_h, i_h // (HV // H), bos, eos, boh, NTs, o_k, o_v, m_k, m_v, m_k[:, None] & m_v[None, :], p0


@triton.jit
def _step_tiles(bos, eos, i_c, o_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, C: tl.constexpr,
                FULL: tl.constexpr = 0):
    """A serial pass's chunk i_c of the sequence [bos, eos): (o_t [C], o_k [BK], their masks m_t, m_k, the value
    columns' m_v, the state tile's m_kv [BK, BV], first token row t0, valid length L, token rows [C] as int64).
    FULL: every chunk whole, L the constant C (_chunk_bounds)."""
    o_t = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_v = o_v < V
    t0 = bos + i_c * C
    L = _chunk_len(t0, eos, C, FULL)
    return o_t, o_k, o_t < L, m_k, m_v, m_k[:, None] & m_v[None, :], t0, L, (t0 + o_t).to(tl.int64)


@triton.jit
def _step_ahead(X, G, i_c, bos, eos, i_h, o_v, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, LOAD_X: tl.constexpr, LAST: tl.constexpr):
    """The loads of chunk i_c that a serial pass's step would otherwise wait on: X's [C, BV] tile (as stored)
    and the per-channel G_last [BK] (fp32), each where asked, else zeros; zeros too where there is no chunk
    i_c (i_c < 0, or an empty sequence).
    The passes issue them a step ahead because Triton's software pipeline takes only loads that feed a
    product's operands: a tile that becomes a product's accumulator (dR_local in dR = dR_local + Kend dS') or
    a gate row scaling the state stays a plain load on the serial path (offline sm_90: DeltaNet's reverse pass
    1.17 ms against GDN's 0.83 on the H200, whose scaled dR_local was pipelined)."""
    t0 = bos + tl.maximum(i_c, 0) * C
    L = _chunk_len(t0, eos, C, 0)
    ok = (i_c >= 0) & (L > 0)
    if LOAD_X:
        o_t = tl.arange(0, C)
        m = ((o_t < L) & ok)[:, None] & (o_v < V)[None, :]
        b_x = tl.load(X + ((t0 + o_t).to(tl.int64)[:, None] * HV + i_h) * V + o_v[None, :], mask=m, other=0.)
    else:
        b_x = tl.zeros([C, BV], dtype=tl.float32)
    if LAST:
        o_k = tl.arange(0, BK)
        b_last = tl.load(G + ((t0 + L - 1).to(tl.int64) * HV + i_h) * K + o_k, mask=(o_k < K) & ok, other=0.)
    else:
        b_last = tl.zeros([BK], dtype=tl.float32)
    return b_x, b_last


@triton.jit
def _fwd_h_step(k, v, G, W, U, h, R, b_S, i_c, bos, eos, boh, i_h, i_hk, o_v, H: tl.constexpr, HV: tl.constexpr,
                K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                GATE: tl.constexpr, DELTA: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr,
                KD_IN: tl.constexpr = 0, FULL: tl.constexpr = 0):
    """One chunk of the forward state pass: store S, R = U − W S, S ← γ S + Kendᵀ R.
    LOWP: the products' operands in the 16-bit input dtype (S and R cast, fp32 accumulation), as the
    forward's serial stage does; else fp32 operands in PREC. KD_IN (per-channel gate, LOWP): k is
    _gate_scaled_kernel's kd [B, T, HV, K], already k ⊙ e^{G_last − G}."""
    o_t, o_k, m_t, m_k, m_v, m_kv, t0, L, rows = _step_tiles(bos, eos, i_c, o_v, K, V, BK, C, FULL)
    tl.store(h + (((boh + i_c) * HV + i_h) * K + o_k[:, None]).to(tl.int64) * V + o_v[None, :], b_S, mask=m_kv)
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    p_tv = (rows[:, None] * HV + i_h) * V + o_v[None, :]
    if KD_IN:
        b_k = tl.load(k + (rows[:, None] * HV + i_h) * K + o_k[None, :], mask=m_tk, other=0.)
    else:
        b_k = tl.load(k + (rows[:, None] * H + i_hk) * K + o_k[None, :], mask=m_tk, other=0.)
    op_dt = b_k.dtype if LOWP else tl.float32                                       # the products' operands
    if DELTA:
        b_w = tl.load(W + (rows[:, None] * HV + i_h) * K + o_k[None, :], mask=m_tk, other=0.).to(op_dt)
        b_R = tl.load(U + p_tv, mask=m_tv, other=0.).to(tl.float32) - \
            _mm(b_w, b_S.to(op_dt), PREC)                                            # [C, BK] @ [BK, BV]
        tl.store(R + p_tv, b_R, mask=m_tv)
    else:
        b_R = tl.load(v + p_tv, mask=m_tv, other=0.).to(tl.float32)
    if GATE == 2 and KD_IN:
        _, b_lastp = _step_ahead(G, G, i_c, bos, eos, i_h, o_v, HV, K, V, BK, BV, C, False, True)
        b_S *= _exp(b_lastp)[:, None]
    elif GATE == 2:
        b_G, b_last = _load_gate(G, t0, L, i_h, HV, K, BK, C, True)
        _, b_ekend = _gate_factors(b_G, b_last, GATE)
        b_k = b_k.to(tl.float32) * b_ekend
        b_S *= _exp(b_last)[:, None]
    elif GATE == 1:  # a scalar gate scales rows: apply it to R [C, BV] rather than K [C, BK]
        b_G, b_last = _load_gate(G, t0, L, i_h, HV, K, BK, C, False)
        b_R = b_R * _exp(b_last - b_G)[:, None]
        b_S *= _exp(b_last)
    b_S += _mm(tl.trans(b_k.to(op_dt)), b_R.to(op_dt), PREC)                       # [BK, C] @ [C, BV]
    return b_S


@triton.jit
def _fwd_h_kernel(k, v, G, W, U, h0, h, R, cu_seqlens, T,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, C: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr,
                  HAS_H0: tl.constexpr, TRANSPOSE: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
                  LOOP_WHILE: tl.constexpr, LOWP: tl.constexpr = 0, KD_IN: tl.constexpr = 0, ready=None,
                  WAIT: tl.constexpr = 0, FULL: tl.constexpr = 0):
    """h: [NC, HV, K, V], the state entering each chunk; R: [B, T, HV, V] (delta only), both in the dtype of their
    buffers (16-bit for 16-bit inputs). h0: [N, HV, K, V] ([N, HV, V, K] if TRANSPOSE). Where the forward kept R
    (chunk_fwd.SAVE_R) chunk_bwd launches the no-delta form with v = that R: S ← γ S + Kendᵀ R, no W / U.
    WAIT (this pass beside the W / U launch, _wu_kernel's SIGNAL): step i first waits for ready[slot of chunk
    i + WAIT, head] (chunk_fwd._wait_ready), WAIT past the software pipeline's depth, so that the loads it issues
    ahead read only published chunks; the first WAIT chunks before the loop."""
    i_h, i_hk, bos, eos, boh, NTs, o_k, o_v, m_k, m_v, m_kv, p0 = _seq_program(cu_seqlens, T, H, HV, K, V, BK, BV, C,
                                                                              IS_VARLEN, TRANSPOSE)
    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_S += tl.load(h0 + p0, mask=m_kv, other=0.).to(tl.float32)
    if WAIT:
        for i_w in tl.static_range(WAIT):
            if i_w < NTs:
                _wait_ready(ready, boh + i_w, i_h, HV, False, not LOOP_WHILE)
    if LOOP_WHILE:  # the interpreter cannot take a loaded bound in range()
        i_c = 0
        while i_c < NTs:
            if WAIT:
                _wait_ready(ready, boh + tl.minimum(i_c + WAIT, NTs - 1), i_h, HV, False, not LOOP_WHILE)
            b_S = _fwd_h_step(k, v, G, W, U, h, R, b_S, i_c, bos, eos, boh, i_h, i_hk, o_v, H, HV, K, V, BK, BV, C,
                              GATE, DELTA, PREC, LOWP, KD_IN, FULL)
            i_c += 1
    else:
        for i_c in range(NTs):
            if WAIT:
                _wait_ready(ready, boh + tl.minimum(i_c + WAIT, NTs - 1), i_h, HV, False, not LOOP_WHILE)
            b_S = _fwd_h_step(k, v, G, W, U, h, R, b_S, i_c, bos, eos, boh, i_h, i_hk, o_v, H, HV, K, V, BK, BV, C,
                              GATE, DELTA, PREC, LOWP, KD_IN, FULL)


# ------------------------------------------------------------------------------------------------
# stage 5: reverse state pass: dh (gradient of the state leaving each chunk), dR, dh0
# ------------------------------------------------------------------------------------------------

@triton.jit
def _bwd_dh_step(q, k, G, W, dRl, do, dh, dR, h, dgam, Rs, b_dS, b_S, b_dRl, b_lastp, i_c, bos, eos, boh, i_h, i_hk,
                 o_v, scale, unit, H: tl.constexpr,
                 HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 C: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr,
                 KD_IN: tl.constexpr = 0, AHEAD: tl.constexpr = 1, PL: tl.constexpr = 0, DGAM: tl.constexpr = 0,
                 FULL: tl.constexpr = 0, REV_H: tl.constexpr = 0):
    """One chunk of the reverse state pass: store dS', dR = dR_local + Kend dS', dS = γ dS' + ...
    Returns (dS, S). REV_H (no gate): b_S is the state leaving the chunk; S ← S − Kᵀ R (R: the forward's, Rs) is
    the state entering it, stored to h (the forward state pass's output, formed backwards from the final state).
    LOWP: the products' operands in the 16-bit input dtype (see _fwd_h_step). KD_IN: q, k are
    _gate_scaled_kernel's qd, kd [B, T, HV, K]. b_dRl, b_lastp: this chunk's dR_local tile and (KD_IN) G_last,
    loaded a step ahead (_step_ahead) where AHEAD, else loaded here. PL: dRl is P [B, T, HV, C] (the forward's
    stage 1) and dR_local = scale Pᵀ dO is formed here, off the step's dependence on dS'. DGAM (scalar gate): the
    step's dS is chunk i_c − 1's dS'; the state entering that chunk is loaded first and Σ_v S ⊙ dS' over this
    program's value columns stored at the end (_dgam_rows), when the load has had the step to arrive."""
    o_t, o_k, m_t, m_k, m_v, m_kv, t0, L, rows = _step_tiles(bos, eos, i_c, o_v, K, V, BK, C, FULL)
    if DGAM:    # the state entering chunk i_c − 1, for the end of the step
        b_Sp = _state_ahead(h, i_c - 1, boh, i_h, o_v, HV, K, V, BK, BV)
    tl.store(dh + (((boh + i_c) * HV + i_h) * K + o_k[:, None]).to(tl.int64) * V + o_v[None, :], b_dS, mask=m_kv)
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    p_tv = (rows[:, None] * HV + i_h) * V + o_v[None, :]
    if KD_IN:
        p_tk = (rows[:, None] * HV + i_h) * K + o_k[None, :]
    else:
        p_tk = (rows[:, None] * H + i_hk) * K + o_k[None, :]
    b_k = tl.load(k + p_tk, mask=m_tk, other=0.)
    b_q = tl.load(q + p_tk, mask=m_tk, other=0.)
    op_dt = b_k.dtype if LOWP else tl.float32                                       # the products' operands
    b_do = tl.load(do + p_tv, mask=m_tv, other=0.).to(tl.float32)
    if PL:
        b_Pt = tl.load(dRl + (rows[None, :] * HV + i_h) * C + o_t[:, None],
                       mask=m_t[:, None] & m_t[None, :] & (o_t[None, :] >= o_t[:, None]), other=0.)       # Pᵀ [C, C]
        b_dRl = scale * _mm(b_Pt.to(op_dt), b_do.to(op_dt), PREC)                   # [C, C] @ [C, BV]
    if GATE == 2 and KD_IN and AHEAD == 1:
        b_last = b_lastp
    elif GATE == 2 and KD_IN:
        _, b_last = _step_ahead(G, G, i_c, bos, eos, i_h, o_v, HV, K, V, BK, BV, C, False, True)
    elif GATE == 2:
        b_G, b_last = _load_gate(G, t0, L, i_h, HV, K, BK, C, True)
        b_eG, b_ekend = _gate_factors(b_G, b_last, GATE)
        b_k = b_k.to(tl.float32) * b_ekend
        b_q = b_q.to(tl.float32) * b_eG
    b_k, b_q = b_k.to(op_dt), b_q.to(op_dt)
    if REV_H:
        b_Rs = tl.load(Rs + p_tv, mask=m_tv, other=0.).to(op_dt)
        b_S -= _mm(tl.trans(b_k), b_Rs, PREC)                                       # [BK, C] @ [C, BV]
        tl.store(h + (((boh + i_c) * HV + i_h) * K + o_k[:, None]).to(tl.int64) * V + o_v[None, :],
                 b_S.to(h.dtype.element_ty), mask=m_kv)
    b_kdS = _mm(b_k, b_dS.to(op_dt), PREC)                                          # [C, BK] @ [BK, BV]
    if GATE == 1:   # a scalar gate scales rows: apply it to the [C, BV] side, not to [C, BK]
        b_G, b_last = _load_gate(G, t0, L, i_h, HV, K, BK, C, False)
        b_kdS = b_kdS * _exp(b_last - b_G)[:, None]
        b_do = b_do * _exp(b_G)[:, None]
    if AHEAD != 1 and not PL:
        b_dRl = tl.load(dRl + p_tv, mask=m_tv, other=0.)
    if AHEAD == 2:      # a runtime 1.0: the product cannot take dR_local as its accumulator
        b_kdS = b_kdS * unit
    b_dR = b_dRl.to(tl.float32) + b_kdS
    tl.store(dR + p_tv, b_dR, mask=m_tv)
    if GATE == 2:
        b_dS *= _exp(b_last)[:, None]
    elif GATE == 1:
        b_dS *= _exp(b_last)
    b_dS += scale * _mm(tl.trans(b_q), b_do.to(op_dt), PREC)                       # [BK, C] @ [C, BV]
    if DELTA:
        b_w = tl.load(W + (rows[:, None] * HV + i_h) * K + o_k[None, :], mask=m_tk, other=0.).to(op_dt)
        b_dS -= _mm(tl.trans(b_w), b_dR.to(op_dt), PREC)                            # [BK, C] @ [C, BV]
    if DGAM:
        _dgam_rows(dgam, b_Sp, b_dS, i_c - 1, boh, i_h, HV, BK)
    return b_dS, b_S


@triton.jit
def _state_ahead(h, i_c, boh, i_h, o_v, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr):
    """The [BK, BV] tile of h (per-chunk states) of chunk i_c, zeros where i_c < 0."""
    o_k = tl.arange(0, BK)
    m = ((o_k < K) & (i_c >= 0))[:, None] & (o_v < V)[None, :]
    return tl.load(h + (((boh + tl.maximum(i_c, 0)) * HV + i_h) * K + o_k[:, None]).to(tl.int64) * V + o_v[None, :],
                   mask=m, other=0.)


@triton.jit
def _dgam_rows(dgam, b_S, b_dSn, i_c, boh, i_h, HV: tl.constexpr, BK: tl.constexpr):
    """Chunk i_c's Σ_v S ⊙ dS' over this program's value columns, per key row: dgam[slot, i_h, i_v, :] (nothing where
    i_c < 0). Rows, not the scalar: the sum over a row stays within a warp (no barrier on the serial path); the WY
    pass sums the rest. Loaded in the step and used mid-step instead, S's DRAM latency took GDN's reverse pass from
    0.81 to 1.18 ms on the H200 (run of 804bdbc)."""
    o_k = tl.arange(0, BK)
    b_r = tl.sum(b_S.to(tl.float32) * b_dSn, axis=1)
    p = (((boh + tl.maximum(i_c, 0)) * HV + i_h) * tl.num_programs(0) + tl.program_id(0)).to(tl.int64) * BK
    tl.store(dgam + p + o_k, b_r, mask=(o_k < BK) & (i_c >= 0))


@triton.jit
def _bwd_dh_kernel(q, k, G, W, dRl, do, dht, dh, dR, dh0, h, dgam, cu_seqlens, T, scale, unit,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, C: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr,
                   HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr, TRANSPOSE: tl.constexpr,
                   IS_VARLEN: tl.constexpr, PREC: tl.constexpr, LOOP_WHILE: tl.constexpr, LOWP: tl.constexpr = 0,
                   KD_IN: tl.constexpr = 0, AHEAD: tl.constexpr = 1, PL: tl.constexpr = 0, DGAM: tl.constexpr = 0,
                   FULL: tl.constexpr = 0, ht=None, Rs=None, REV_H: tl.constexpr = 0):
    """dR = dR_local + Kend dS';  dS = γ dS' + scale Qgᵀ dO − Wᵀ dR.
    REV_H (DeltaNet: no gate; the forward kept R and its final state): the states entering the chunks, h, formed
    here backwards from the final state ht (fp32, the state layout: [N, HV, K, V], TRANSPOSE [N, HV, V, K]),
    S_c = S_{c+1} − K_cᵀ R_c with the forward's R (Rs), instead of by the forward state pass.
    DGAM (scalar gate): dgam [NC, HV, NV, BK] fp32 gets each chunk's Σ_v S ⊙ dS' per key row over value block i_v
    (h: the states entering the chunks, the forward state pass's)
    PL: dRl is P (the forward's stage 1, [B, T, HV, C]) and each step forms dR_local = scale Pᵀ dO itself.
    AHEAD (BWD_DH_AHEAD): 1, dR_local (and KDA's G_last) loaded a step ahead (_step_ahead); 0, in the step; 2, in
    the step with K dS' scaled by ``unit`` (1.0, a runtime value) so that the compiler cannot fold dR_local into the
    product as its accumulator, which leaves the load to the software pipeline.
    dh: [NC, HV, K, V] fp32; dR: [B, T, HV, V] fp32; dht, dh0 in the state layout (dh0 fp32)."""
    i_h, i_hk, bos, eos, boh, NTs, o_k, o_v, m_k, m_v, m_kv, p0 = _seq_program(cu_seqlens, T, H, HV, K, V, BK, BV, C,
                                                                              IS_VARLEN, TRANSPOSE)
    b_dS = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        b_dS += tl.load(dht + p0, mask=m_kv, other=0.).to(tl.float32)
    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if REV_H:
        b_S += tl.load(ht + p0, mask=m_kv, other=0.)
    LAST: tl.constexpr = GATE == 2 and KD_IN and AHEAD == 1
    AH: tl.constexpr = AHEAD == 1 and not PL          # dR_local's tile loaded a step ahead
    b_dRl, b_last = _step_ahead(dRl, G, NTs - 1, bos, eos, i_h, o_v, HV, K, V, BK, BV, C, AH, LAST)
    if DGAM:    # the last chunk's pair: its dS' is dht (or zero)
        _dgam_rows(dgam, _state_ahead(h, NTs - 1, boh, i_h, o_v, HV, K, V, BK, BV), b_dS, NTs - 1, boh, i_h, HV, BK)
    if LOOP_WHILE:  # the interpreter cannot take a loaded bound in range()
        i_c = NTs - 1
        while i_c >= 0:
            b_dRn, b_lastn = _step_ahead(dRl, G, i_c - 1, bos, eos, i_h, o_v, HV, K, V, BK, BV, C, AH, LAST)
            b_dS, b_S = _bwd_dh_step(q, k, G, W, dRl, do, dh, dR, h, dgam, Rs, b_dS, b_S, b_dRl, b_last, i_c, bos,
                                     eos, boh, i_h, i_hk, o_v, scale, unit, H, HV, K, V, BK, BV, C, GATE, DELTA, PREC,
                                     LOWP, KD_IN, AHEAD, PL, DGAM, FULL, REV_H)
            b_dRl, b_last = b_dRn, b_lastn
            i_c -= 1
    else:
        for i_r in range(NTs):
            b_dRn, b_lastn = _step_ahead(dRl, G, NTs - 2 - i_r, bos, eos, i_h, o_v, HV, K, V, BK, BV, C, AH, LAST)
            b_dS, b_S = _bwd_dh_step(q, k, G, W, dRl, do, dh, dR, h, dgam, Rs, b_dS, b_S, b_dRl, b_last,
                                     NTs - 1 - i_r, bos, eos, boh, i_h, i_hk, o_v, scale, unit, H, HV, K, V, BK, BV, C,
                                     GATE, DELTA, PREC, LOWP, KD_IN, AHEAD, PL, DGAM, FULL, REV_H)
            b_dRl, b_last = b_dRn, b_lastn
    if HAS_H0:
        tl.store(dh0 + p0, b_dS, mask=m_kv)


# ------------------------------------------------------------------------------------------------
# stage 6: chunk-parallel gradients
# ------------------------------------------------------------------------------------------------

@triton.jit
def _chunk_rows(t0, L, i_h, HV: tl.constexpr, C: tl.constexpr):
    """The chunk's token rows t0 + [0, C) of value head i_h, L of them real: (o_t [C], m_t [C], rows [C] int64,
    m_cc [C, C] (both rows real), offsets of element [i, j] and of element [j, i] in a per-chunk [B, T, HV, C]
    matrix such as Pmat / Amat / Tmat)."""
    o_t = tl.arange(0, C)
    m_t = o_t < L
    rows = (t0 + o_t).to(tl.int64)
    m_cc = m_t[:, None] & m_t[None, :]
    p_cc = (rows[:, None] * HV + i_h) * C + o_t[None, :]
    p_ccT = (rows[None, :] * HV + i_h) * C + o_t[:, None]
    return o_t, m_t, rows, m_cc, p_cc, p_ccT


@triton.jit
def _bwd_dv_kernel(q, k, v, beta, G, Tmat, h, R, dR, do, Pmat, Amat, dq, dv, dbeta, dG, cu_seqlens, chunk_indices,
                   T, scale, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, C: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr,
                   IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    """The value side of the gradients (no K-sized tile):
        dP = scale tril(dO Rᵀ) -> Pmat,   dv = β (Tᵀ dR), dβ = Σ_v V ⊙ Tᵀ dR -> dbeta (partial),
        dT_v = dR (β V)ᵀ -> Amat        (no delta rule: dv = dR)
        dq = scale (dO Sᵀ) ⊙ e^G  (+ (dP ⊙ Γ) K for scalar / no gates: dq final, and the row sums
        of q ⊙ dq -> dG as the start of dG; per channel dq stays partial, finished by the key side)
    Pmat, Amat: [B, T, HV, C] fp32 (their forward contents are no longer needed); dv in v's dtype."""
    i_h, i_hk, t0, L, i_g = _chunk_program(cu_seqlens, chunk_indices, T, H, HV, C, IS_VARLEN)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    p_h = (i_g * HV + i_h).to(tl.int64) * K * V
    b_dqg = tl.zeros([C, BK], dtype=tl.float32)
    o_t, m_t, rows, m_cc, p_cc, p_ccT = _chunk_rows(t0, L, i_h, HV, C)
    # operands as stored (16-bit for 16-bit inputs: exact), fp32 accumulation
    if DELTA:
        b_beta = tl.load(beta + rows * HV + i_h, mask=m_t, other=0.).to(tl.float32)
        b_Tt = tl.load(Tmat + p_ccT, mask=m_cc & (o_t[None, :] >= o_t[:, None]), other=0.).to(dR.dtype.element_ty)  # Tᵀ [C, C]
    b_dP = tl.zeros([C, C], dtype=tl.float32)
    b_dTv = tl.zeros([C, C], dtype=tl.float32)
    b_db = tl.zeros([C], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_tv = (rows[:, None] * HV + i_h) * V + o_v[None, :]
        b_do = tl.load(do + p_tv, mask=m_tv, other=0.)
        b_dR = tl.load(dR + p_tv, mask=m_tv, other=0.)
        if DELTA:
            b_R = tl.load(R + p_tv, mask=m_tv, other=0.)
            b_v = tl.load(v + p_tv, mask=m_tv, other=0.)
            b_vb = (b_v.to(tl.float32) * b_beta[:, None]).to(dR.dtype.element_ty)
            b_dTv += _mm(b_dR, tl.trans(b_vb), PREC)                                    # [C, BV] @ [BV, C]
            b_dy = _mm(b_Tt, b_dR, PREC)                                                # [C, C] @ [C, BV]
            tl.store(dv + p_tv, b_dy * b_beta[:, None], mask=m_tv)
            b_db += tl.sum(b_v.to(tl.float32) * b_dy, axis=1)
        else:
            b_R = tl.load(v + p_tv, mask=m_tv, other=0.)
            tl.store(dv + p_tv, b_dR, mask=m_tv)
        b_dP += _mm(b_do, tl.trans(b_R), PREC)                                          # [C, BV] @ [BV, C]
        b_S = tl.load(h + p_h + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & (o_v < V)[None, :], other=0.)
        b_dqg += _mm(b_do, tl.trans(b_S), PREC)                                         # [C, BV] @ [BV, BK]
    b_dP = tl.where(o_t[:, None] >= o_t[None, :], b_dP * scale, 0.)
    tl.store(Pmat + p_cc, b_dP, mask=m_cc)
    m_tk = m_t[:, None] & m_k[None, :]
    p_hk = (rows[:, None] * HV + i_h) * K + o_k[None, :]
    if GATE > 0:
        b_G, b_last = _load_gate(G, t0, L, i_h, HV, K, BK, C, GATE == 2)
        b_eG, _ = _gate_factors(b_G, b_last, GATE)
        b_dq = scale * b_dqg * b_eG
    else:
        b_dq = scale * b_dqg
    if GATE == 2:
        tl.store(dq + p_hk, b_dq, mask=m_tk)
    else:
        b_q = tl.load(q + (rows[:, None] * H + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_k = tl.load(k + (rows[:, None] * H + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        if GATE == 1:
            b_dP = b_dP * _exp(tl.where(o_t[:, None] >= o_t[None, :], b_G[:, None] - b_G[None, :], float("-inf")))
        b_dq += _mm(b_dP, b_k, PREC)                                                      # [C, C] @ [C, BK]
        tl.store(dq + p_hk, b_dq, mask=m_tk)
        if GATE == 1:
            tl.store(dG + rows * HV + i_h, tl.sum(b_q * b_dq, axis=1), mask=m_t)
    if DELTA:
        tl.store(Amat + p_cc, b_dTv, mask=m_cc)
        tl.store(dbeta + rows * HV + i_h, b_db, mask=m_t)


@triton.jit
def _col_offsets(rows, m_t, o_k, m_k, i_h, i_hk, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr):
    """Key channels o_k of the token rows `rows`: (mask, offsets into q / k [., H, K], offsets into the per
    value head [., HV, K] gradients)."""
    m_tk = m_t[:, None] & m_k[None, :]
    p_tk = (rows[:, None] * H + i_hk) * K + o_k[None, :]
    p_hk = (rows[:, None] * HV + i_h) * K + o_k[None, :]
    return m_tk, p_tk, p_hk


@triton.jit
def _value_block(i_v, rows, m_t, m_k, i_h, HV: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """Value block i_v of the chunk's rows: (value columns o_v [BV], the state-tile mask [BK, BV] under key mask m_k,
    the token-tile mask [C, BV] and offsets into a per value head [., HV, V] tensor such as dO, R, dR, v)."""
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    return o_v, m_k[:, None] & m_v[None, :], m_t[:, None] & m_v[None, :], (rows[:, None] * HV + i_h) * V + o_v[None, :]


@triton.jit
def _r_tile(R, v, p_tv, m_tv, DELTA: tl.constexpr):
    """The chunk's R tile at p_tv: R = U − W S with the delta rule, V itself without."""
    if DELTA:
        return tl.load(R + p_tv, mask=m_tv, other=0.)
    else:
        return tl.load(v + p_tv, mask=m_tv, other=0.)


@triton.jit
def _key_side_vloop(h, dh, R, dR, v, p_h, rows, i_h, o_k, m_k, m_t, HV: tl.constexpr, V: tl.constexpr,
                    C: tl.constexpr, BKW: tl.constexpr, BV: tl.constexpr, DELTA: tl.constexpr, PREC: tl.constexpr):
    """The key side's loop over value blocks, for the key channels o_k [BKW]:
    dW = −dR Sᵀ, dK_end = R dS'ᵀ ([C, BKW] each) and dγ = Σ_v S ⊙ dS' ([BKW]); operands as stored
    (16-bit for 16-bit inputs: exact), fp32 accumulation."""
    b_dw = tl.zeros([C, BKW], dtype=tl.float32)
    b_dkend = tl.zeros([C, BKW], dtype=tl.float32)
    b_dgam = tl.zeros([BKW], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v, m_kv, m_tv, p_tv = _value_block(i_v, rows, m_t, m_k, i_h, HV, V, BV)
        b_S = tl.load(h + p_h + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_dSn = tl.load(dh + p_h + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        if DELTA:
            b_R = tl.load(R + p_tv, mask=m_tv, other=0.)
            b_dR = tl.load(dR + p_tv, mask=m_tv, other=0.)
            b_dw -= _mm(b_dR, tl.trans(b_S), PREC)                                      # [C, BV] @ [BV, BKW]
        else:
            b_R = tl.load(v + p_tv, mask=m_tv, other=0.)
        b_dkend += _mm(b_R, tl.trans(b_dSn), PREC)                                      # [C, BV] @ [BV, BKW]
        b_dgam += _state_inner_rows(h, dh, p_h, o_k, o_v, m_kv, V)
    return b_dw, b_dkend, b_dgam


@triton.jit
def _state_inner_rows(h, dh, p_h, o_k, o_v, m_kv, V: tl.constexpr):
    """Σ_v S ⊙ dS' over the value columns o_v, per key row o_k ([BK] fp32), from loads of S and dS' of their own
    (_state_tiles_own)."""
    b_S, b_dSn = _state_tiles_own(h, dh, p_h, o_k, o_v, m_kv, V)
    return tl.sum(b_S.to(tl.float32) * b_dSn.to(tl.float32), axis=1)


@triton.jit
def _state_tiles_own(h, dh, p_h, o_k, o_v, m_kv, V: tl.constexpr):
    """S and dS' at key rows o_k, value columns o_v ([BK, BV] each), loaded for an elementwise use only.

    Not the tiles the same loop feeds to products: triton 3.6's pipeliner gives a loaded tile that feeds both an
    async wgmma and a register load the register load's buffer count (triton #6691, PR #7110), so the copy of a later
    iteration overwrote S / dS' while an unwaited product still read them (on the H200 GDN's dq / dk / dg changed from
    run to run by ~5e-3, benchmarks/repeat_bwd.py). A different cache modifier keeps CSE from merging the loads."""
    p = p_h + o_k[:, None] * V + o_v[None, :]
    return (tl.load(h + p, mask=m_kv, other=0., cache_modifier=".cg"),
            tl.load(dh + p, mask=m_kv, other=0., cache_modifier=".cg"))


@triton.jit
def _pairwise_grads_channel(b_dP, b_dPt, b_dA, b_dAt, b_q, b_k, b_kb, b_G, C: tl.constexpr, BC: tl.constexpr,
                            DELTA: tl.constexpr, PREC: tl.constexpr, OPD: tl.constexpr):
    """Per-channel gate: the gradients through P = tril(⟨q_i, Γ_ij k_j⟩) and A = strict_tril(⟨βk_i, Γ_ij k_j⟩)
    off the 16×16 diagonal blocks, for the channels of b_q, b_k, b_kb, b_G [C, BKW]: (dq, dk from P and
    from A's right side, dk from A's left side, that is d(βk)). Column block J (last token r) factors
    Γ_ij = e^{G_i − G_r} e^{G_r − G_j}, both ≤ 1. OPD: the products' operand dtype (fp32 accumulation)."""
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
        b_kr = b_kr.to(OPD)
        b_dqp += _mm(b_dP, b_kr, PREC) * b_left                                            # [C, C] @ [C, BKW]
        b_dkp += _mm(b_dPt, (b_q * b_left).to(OPD), PREC) * b_right                       # [C, C] @ [C, BKW]
        if DELTA:
            b_dkb += _mm(b_dA, b_kr, PREC) * b_left                                        # [C, C] @ [C, BKW]
            b_dkp += _mm(b_dAt, (b_kb * b_left).to(OPD), PREC) * b_right                      # [C, C] @ [C, BKW]
    return b_dqp, b_dkp, b_dkb


@triton.jit
def _bwd_grad_kernel(q, k, v, beta, G, Tmat, Pmat, Amat, h, dh, R, dR, do, dq, dk, dbeta, dG,
                           cu_seqlens, chunk_indices, T, scale,
                           H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                           BKH: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
                           GATE: tl.constexpr, DELTA: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
                           LOWP: tl.constexpr = 0, ONE_REF: tl.constexpr = 0, span_max: tl.constexpr = 80.0):
    """The key side, after _bwd_dv_kernel (which left dP in Pmat, dT_v in Amat, the value part of dβ):
    dq, dk: [B, T, HV, K] (per value head); dbeta: [B, T, HV] fp32 (completed; per channel the pair kernel
    adds its share);
    dG: [B, T, HV(, K)] fp32 -- for scalar gates already the reverse cumsum (dg); per channel the
    gradient of G without the pairwise terms (finished by _bwd_pair_kernel, which reads dA, dP
    from Amat, Pmat).

    In column blocks of BKH key channels ([C, BKH] tiles: fewer registers, less shared memory per
    program; BKH = BK is one block). Everything on the key side is row-local in the channels except
    dT = dT_v + dW Xᵀ (summed over channels) and the dA it feeds, so:

        pass 1, per column block: the V loop (dW, dK_end, dγ), dX = Tᵀ dW, dT += dW Xᵀ, the row-local
                 parts of dk (-> dk), of dG (-> dG per channel, row sums for a scalar gate) and of dβ;
        dA = −Tᵀ dT Tᵀ (strict lower) -> Amat;
        pass 2, per column block: the pairwise products P (q, k) and A (βk, k): dq (per channel), dk,
                 dβ and dG completed from what pass 1 left in dk / dG (per-channel gates: in
                 _bwd_pair_kernel, split over key channels; with ONE_REF, here for each column block whose chunk
                 gate fits one reference (_pair_grads_one_ref), the pair kernel doing only the others).
    The V loop runs once per column block: R and dR are read K / BKH times. LOWP: 1, the products of T, dW,
    X, dT, dA and dP take 16-bit operands (the input dtype; fp32 accumulation), as fla's do; 2, only those of
    pass 1 and dA (T, dW, X, dT), pass 2's pairwise products (dP, dA with q, k) in fp32 operands."""
    i_h, i_hk, t0, L, i_g = _chunk_program(cu_seqlens, chunk_indices, T, H, HV, C, IS_VARLEN)
    o_t, m_t, rows, m_cc, p_cc, p_ccT = _chunk_rows(t0, L, i_h, HV, C)
    i_ge_j = o_t[:, None] >= o_t[None, :]
    p_h = (i_g * HV + i_h).to(tl.int64) * K * V
    OPD: tl.constexpr = q.dtype.element_ty if LOWP else tl.float32                    # the products' operands
    OPD2: tl.constexpr = q.dtype.element_ty if LOWP == 1 else tl.float32              # pass 2's (dP, dA, q, k)
    if DELTA:
        b_beta = tl.load(beta + rows * HV + i_h, mask=m_t, other=0.).to(tl.float32)
        b_db = tl.load(dbeta + rows * HV + i_h, mask=m_t, other=0.)
        b_T = tl.load(Tmat + p_cc, mask=m_cc & i_ge_j, other=0.).to(OPD)
        b_dT = tl.load(Amat + p_cc, mask=m_cc, other=0.)                                  # dT_v, + dW Xᵀ below
    else:
        b_beta = tl.zeros([C], dtype=tl.float32)
        b_db = tl.zeros([C], dtype=tl.float32)
    if GATE == 1:
        b_G, b_last = _load_gate(G, t0, L, i_h, HV, K, BK, C, False)
        b_eG, b_ekend = _gate_factors(b_G, b_last, GATE)
        b_dGr = tl.load(dG + rows * HV + i_h, mask=m_t, other=0.)
        b_dlast = tl.sum(tl.zeros([C], dtype=tl.float32), axis=0)

    # pass 1
    for i_k in range(tl.cdiv(K, BKH)):
        o_k = i_k * BKH + tl.arange(0, BKH)
        m_k = o_k < K
        m_tk, p_tk, p_hk = _col_offsets(rows, m_t, o_k, m_k, i_h, i_hk, H, HV, K)
        b_dw, b_dkend, b_dgam = _key_side_vloop(h, dh, R, dR, v, p_h, rows, i_h, o_k, m_k, m_t, HV, V, C, BKH, BV,
                                                DELTA, PREC)
        b_k = tl.load(k + p_tk, mask=m_tk, other=0.).to(tl.float32)
        if GATE == 2:
            b_Gh, b_lasth = _load_gate_cols(G, t0, L, i_h, o_k, m_k, HV, K, C)
            b_eGh, b_ekendh = _gate_factors(b_Gh, b_lasth, GATE)
            b_dk = b_dkend * b_ekendh
            b_dGm = -b_k * b_dk
            b_dlasth = tl.sum(b_k * b_dk, axis=0) + _exp(b_lasth) * b_dgam              # [BKH]
        elif GATE == 1:
            b_eGh = b_eG
            b_dk = b_dkend * b_ekend
            b_kdk = tl.sum(b_k * b_dk, axis=1)
            b_dGr -= b_kdk
            b_dlast += tl.sum(b_kdk, axis=0) + _exp(b_last) * tl.sum(b_dgam, axis=0)
        else:
            b_dk = b_dkend
        if DELTA:
            if GATE > 0:
                b_ke = b_k * b_eGh
            else:
                b_ke = b_k
            b_x = b_ke * b_beta[:, None]
            b_dwo = b_dw.to(OPD)
            b_dx = _mm(tl.trans(b_T), b_dwo, PREC)                                       # [C, C] @ [C, BKH]
            b_dT += _mm(b_dwo, tl.trans(b_x.to(OPD)), PREC)                              # [C, BKH] @ [BKH, C]
            if GATE > 0:
                b_dk += b_beta[:, None] * b_eGh * b_dx
            else:
                b_dk += b_beta[:, None] * b_dx
            b_db += tl.sum(b_ke * b_dx, axis=1)
            if GATE == 2:
                b_dGm += b_x * b_dx
            elif GATE == 1:
                b_dGr += tl.sum(b_x * b_dx, axis=1)
        tl.store(dk + p_hk, b_dk, mask=m_tk)
        if GATE == 2:
            b_dGm += tl.where((o_t == L - 1)[:, None], b_dlasth[None, :], 0.)
            tl.store(dG + p_hk, b_dGm, mask=m_tk)

    # dA = −Tᵀ dT Tᵀ (strict lower), then its transpose and dPᵀ through memory (never tl.trans of a
    # dot accumulator: fla #640)
    tl.debug_barrier()          # every thread has read dT_v from Amat and written its dk / dG columns
    if DELTA:
        b_dA = _mm(_mm(tl.trans(b_T), b_dT.to(OPD), PREC).to(OPD), tl.trans(b_T), PREC)  # [C, C] @ [C, C] @ [C, C]
        b_dA = tl.where(m_cc & (o_t[:, None] > o_t[None, :]), -b_dA, 0.)
        if GATE == 1:
            b_dA = b_dA * _exp(tl.where(i_ge_j, b_G[:, None] - b_G[None, :], float("-inf")))
        tl.store(Amat + p_cc, b_dA, mask=m_cc)
    # pass 2 (per-channel gates: in _bwd_pair_kernel, but for the column blocks that fit one reference with ONE_REF)
    if GATE == 2 and ONE_REF:
        tl.debug_barrier()      # every thread has written its dk / dG columns and dA
        b_dPf = tl.load(Pmat + p_cc, mask=m_cc & i_ge_j, other=0.)                                   # dP [C, C]
        b_dPtf = tl.load(Pmat + p_ccT, mask=m_cc & (o_t[None, :] >= o_t[:, None]), other=0.)         # dPᵀ
        if DELTA:
            b_dAtf = tl.load(Amat + p_ccT, mask=m_cc, other=0.)                                      # dAᵀ
        else:
            b_dA = b_dPf
            b_dAtf = b_dPtf
        for i_k in range(tl.cdiv(K, BKH)):
            o_k = i_k * BKH + tl.arange(0, BKH)
            m_k = o_k < K
            b_d = _ref_offsets(G, t0, L, i_h, o_k, m_k, HV, K, C)                             # G − r, r = G_last / 2
            if _ref_span(b_d) < span_max:                                    # the same test as _bwd_pair_kernel's
                b_db += _pair_grads_one_ref(q, k, dq, dk, dG, dq, dk, b_dPf, b_dPtf, b_dA, b_dAtf, b_beta, b_d, rows,
                                            m_t, o_k, m_k, i_h, i_hk, H, HV, K, DELTA, PREC)
    if GATE != 2:
        tl.debug_barrier()
        b_dPt = tl.load(Pmat + p_ccT, mask=m_cc & (o_t[None, :] >= o_t[:, None]), other=0.)
        if GATE == 1:
            b_dPt *= _exp(tl.where(o_t[None, :] >= o_t[:, None], b_G[None, :] - b_G[:, None], float("-inf")))
        b_dPt = b_dPt.to(OPD2)
        if DELTA:
            b_dAt = tl.load(Amat + p_ccT, mask=m_cc, other=0.).to(OPD2)
            b_dA = b_dA.to(OPD2)

        for i_k in range(tl.cdiv(K, BKH)):
            o_k = i_k * BKH + tl.arange(0, BKH)
            m_k = o_k < K
            m_tk, p_tk, p_hk = _col_offsets(rows, m_t, o_k, m_k, i_h, i_hk, H, HV, K)
            b_q = tl.load(q + p_tk, mask=m_tk, other=0.).to(tl.float32)
            b_k = tl.load(k + p_tk, mask=m_tk, other=0.).to(tl.float32)
            b_kb = b_k * b_beta[:, None]
            b_dkb = tl.zeros([C, BKH], dtype=tl.float32)
            b_dkp = _mm(b_dPt, b_q.to(OPD2), PREC)                                            # [C, C] @ [C, BKH]
            if DELTA:
                b_dkb = _mm(b_dA, b_k.to(OPD2), PREC)                                         # [C, C] @ [C, BKH]
                b_dkp += _mm(b_dAt, b_kb.to(OPD2), PREC)                                      # [C, C] @ [C, BKH]
            if GATE == 1:
                b_dGr += tl.sum(b_kb * b_dkb - b_k * b_dkp, axis=1)
            b_dk = tl.load(dk + p_hk, mask=m_tk, other=0.) + b_dkp + b_beta[:, None] * b_dkb
            tl.store(dk + p_hk, b_dk, mask=m_tk)
            b_db += tl.sum(b_k * b_dkb, axis=1)

    if DELTA:
        tl.store(dbeta + rows * HV + i_h, b_db, mask=m_t)
    if GATE == 1:
        b_dGs = b_dGr + tl.where(o_t == L - 1, b_dlast, 0.)
        tl.store(dG + rows * HV + i_h, _rev_cumsum(b_dGs), mask=m_t)


# ------------------------------------------------------------------------------------------------
# scalar / no gate: the value and key sides as a state-tile pass split over key columns and a per-chunk WY pass
# ------------------------------------------------------------------------------------------------

@triton.jit
def _bwd_dqk_kernel(q, k, v, G, h, dh, R, dR, do, dq, dk1, dW, dGp, dgam, Tmat, beta, dTp, dbs, cu_seqlens,
                    chunk_indices, T, scale,
                    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr, C: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr,
                    IS_VARLEN: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr = 0, EARLY: tl.constexpr = 0,
                    DGAM: tl.constexpr = 0, NVD: tl.constexpr = 0, KD: tl.constexpr = 16, SDS_OWN: tl.constexpr = 1,
                    FULL: tl.constexpr = 0, INPLACE: tl.constexpr = 0):
    """Scalar / no gate, one program per (key column block of BK, chunk, value head); everything that needs the
    chunk's state tiles h (S) and dh (dS'), read once::

        V loop:  dP = dO Rᵀ,  dPᵀ = R dOᵀ  ([C, C]),  dQg = dO Sᵀ,  dK_end = R dS'ᵀ,  dW = −dR Sᵀ  ([C, BK])
        dP ← scale tril(dP) ⊙ Γ  (dPᵀ alike: it is a product of its own, never tl.trans of an accumulator, fla #640)
        dq  = scale dQg ⊙ e^G + dP K                       -> dq (final)
        dk1 = dK_end ⊙ e^{G_last − G} + dPᵀ Q              -> dk1 (fp32; the WY pass adds the rest) or dk (no delta)
        dW                                                 -> dW (the products' operand dtype)
        scalar gate: Σ_k (q ⊙ dq − k ⊙ dk1) per row, + dG_last's share (Σ k ⊙ dK_end e^{..} + e^{G_last} Σ S ⊙ dS')
                     on the last row                       -> dGp[i_k] (summed over column blocks by _bwd_wy_kernel)

    R: R = U − W S with the delta rule, V without. LOWP as _bwd_grad_kernel's: the pairwise products (dP, dPᵀ with
    k, q) take fp32 operands unless LOWP is 1; LOWP 3 is 2 with dPᵀ q in 16 bits; LOWP 4 is 2 with both products
    from 16-bit q, k and dP / dPᵀ split into two 16-bit parts (_mm_split16). EARLY: q, k and the gate are
    loaded before the V loop (their latency under it), else after it. dk1's dtype: fp32, or 16-bit (then the sum
    with the WY pass's terms is rounded twice, as fla's dk is). INPLACE (LOWP 4): the split products accumulate into
    dq / dk themselves (_mm_split16) instead of into a zeroed tile added after (one [C, BK] fp32 tile fewer live).
    DGAM: the reverse state pass formed ⟨S, dS'⟩ (its dgam) and the WY pass adds e^{G_last} times it, so that the V
    loop here has no elementwise S ⊙ dS' (the tiles stay product operands).
    SDS_OWN (gates, not DGAM): ⟨S, dS'⟩ from loads of S and dS' of their own (_state_tiles_own). 0 (delta rule only):
    from the product tiles, with dW's product issued last, whose wait (its result is used at once) finishes dq's and
    dk's products before the loop's next copies into those tiles' buffers (triton 3.6 gives a tile with a register
    use too few buffers for an async product: _state_tiles_own).

    Per-channel gate (GATE 2, KDA): no pairwise products here (dP, dA and their gradients are _bwd_wy_kernel's and
    _bwd_pair_kernel's), but the WY form's column-local terms, since this program holds its columns' whole dW:
        dX = Tᵀ dW,  X = β K ⊙ e^G
        dk1 = dK_end ⊙ e^{G_last − G} + β e^G ⊙ dX                  -> dk1 (fp32, the pair kernel finishes it)
        dG  = −k ⊙ dK_end e^{..} + X ⊙ dX, + on the last row Σ_t k ⊙ dK_end e^{..} + e^{G_last} Σ_v S ⊙ dS'
                                                                     -> dGp ([B, T, HV, K] per channel)
        dq  = scale dQg ⊙ e^G                                        -> dq (fp32, likewise)
        dT's share dW Xᵀ -> dTp[i_k] ([NK, B, T, HV, C] fp32), dβ's share Σ_k K e^G ⊙ dX -> dbs[i_k] ([NK, B, T, HV])
    (with DGAM, Σ_v S ⊙ dS' from the reverse pass's rows dgam [NC, HV, NVD, KD], summed here); dW is not stored."""
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
    OPD2: tl.constexpr = q.dtype.element_ty if LOWP == 1 else tl.float32
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
        if GATE > 0 and not DGAM and SDS_OWN:   # for ⟨S, dS'⟩, loaded first: their latency under the products
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
        if GATE > 0 and not DGAM:
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
        b_eG = _exp_or(b_G, FAST_EXP_KDA_DQK)
        tl.store(dq + p_hk, b_dq * scale * b_eG, mask=m_tk)
        b_dk = b_dk * _exp_or(b_last[None, :] - b_G, FAST_EXP_KDA_DQK)          # a: the state part
        b_Tt = tl.load(Tmat + p_ccT, mask=m_cc & (o_t[None, :] >= o_t[:, None]), other=0.).to(OPD)   # Tᵀ
        b_dx = _mm(b_Tt, b_dwo, PREC)                                                          # [C, C] @ [C, BK]
        b_beta = tl.load(beta + rows * HV + i_h, mask=m_t, other=0.).to(tl.float32)
        b_ke = b_k * b_eG
        tl.store(dbs + i_k * s_p + rows * HV + i_h, tl.sum(b_ke * b_dx, axis=1), mask=m_t)
        b_dx = b_dx * b_eG * b_beta[:, None]                                                   # b = β e^G dX
        if DGAM:
            for i_p in tl.static_range(NVD):
                b_dgam += tl.load(dgam + ((i_g * HV + i_h) * NVD + i_p).to(tl.int64) * KD + o_k, mask=m_k, other=0.)
        b_dlast = tl.sum(b_k * b_dk, axis=0) + _exp_or(b_last, FAST_EXP_KDA_DQK) * b_dgam      # [BK]
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
            if not DGAM:
                b_dlast += _exp(b_last) * tl.sum(b_dgam, axis=0)
            b_dP = tl.where(i_ge_j, b_dP * _exp(b_G[:, None] - b_G[None, :]), 0.) * scale
            b_dPt = tl.where(o_t[None, :] >= o_t[:, None], b_dPt * _exp(b_G[None, :] - b_G[:, None]), 0.) * scale
        else:
            b_dq = b_dq * scale
            b_dP = tl.where(i_ge_j, b_dP, 0.) * scale
            b_dPt = tl.where(o_t[None, :] >= o_t[:, None], b_dPt, 0.) * scale
        if LOWP == 4:   # dP, dPᵀ as two 16-bit parts (hi + lo: ~16 significant bits) against 16-bit q, k
            if INPLACE:     # both parts' products accumulate into dq / dk themselves
                b_dq = _mm_split16(b_dq, b_dP, b_k0, PREC)                                      # [C, C] @ [C, BK]
                b_dk = _mm_split16(b_dk, b_dPt, b_q0, PREC)                                     # [C, C] @ [C, BK]
            else:           # (a second [C, BK] accumulator live for the parts' sum)
                b_dq += _mm_split16(tl.zeros([C, BK], dtype=tl.float32), b_dP, b_k0, PREC)      # [C, C] @ [C, BK]
                b_dk += _mm_split16(tl.zeros([C, BK], dtype=tl.float32), b_dPt, b_q0, PREC)     # [C, C] @ [C, BK]
        else:
            OPD3: tl.constexpr = q.dtype.element_ty if LOWP == 1 or LOWP == 3 else tl.float32  # dk's (LOWP 3)
            b_dq += _mm(b_dP.to(OPD2), b_k.to(OPD2), PREC)                                      # [C, C] @ [C, BK]
            b_dk += _mm(b_dPt.to(OPD3), b_q.to(OPD3), PREC)                                     # [C, C] @ [C, BK]
        tl.store(dq + p_hk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
        tl.store(dk1 + p_hk, b_dk.to(dk1.dtype.element_ty), mask=m_tk)
        if GATE == 1:
            b_dg = tl.sum(b_q * b_dq - b_k * b_dk, axis=1) + tl.where(o_t == L - 1, b_dlast, 0.)
            tl.store(dGp + i_k * (tl.num_programs(1).to(tl.int64) * T) + rows * HV + i_h, b_dg, mask=m_t)


@triton.jit
def _pair_term(acc, b_d, b_x16, PREC: tl.constexpr, LOWP: tl.constexpr, SIXTEEN: tl.constexpr):
    """acc + b_d @ X for a gated, masked [C, C] fp32 tile b_d and a 16-bit [C, BK] tile X of q or k, accumulated into
    acc [C, BK]: split (LOWP 4: _mm_split16), both operands in X's dtype (SIXTEEN), or both in fp32 (the tf32 / ieee
    product of PREC)."""
    if LOWP == 4:
        return _mm_split16(acc, b_d, b_x16, PREC)                                              # [C, C] @ [C, BK]
    elif SIXTEEN:
        return _mm_acc(acc, b_d.to(b_x16.dtype), b_x16, PREC)                                  # [C, C] @ [C, BK]
    else:
        return _mm_acc(acc, b_d, b_x16.to(tl.float32), PREC)                                   # [C, C] @ [C, BK]


@triton.jit
def _bwd_dqk_sides_kernel(q, k, v, G, h, dh, R, dR, do, dq, dk1, dW, dGp, cu_seqlens, chunk_indices, T, scale,
                          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr, C: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr,
                          IS_VARLEN: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr = 0, DGAM: tl.constexpr = 0,
                          NS: tl.constexpr = 2, FULL: tl.constexpr = 0):
    """Scalar / no gate: _bwd_dqk_kernel's work split by side instead of by key column block. Two programs per (chunk,
    value head), each over all BK >= K key columns; the first forms dP and the query side, the second dPᵀ and the key
    side::

        side 0:  V loop  dP = dO Rᵀ ([C, C]),  dQg = dO Sᵀ,  dW = −dR Sᵀ ([C, BK])        reads dO, R, dR, S
                 dq = scale dQg ⊙ e^G + (scale tril(dP) ⊙ Γ) K                    -> dq, dW
        side 1:  V loop  dPᵀ = R dOᵀ ([C, C]),  dK_end = R dS'ᵀ ([C, BK])               reads dO, R, dS'
                 dk1 = dK_end ⊙ e^{G_last − G} + (scale triu(dPᵀ) ⊙ Γᵀ) Q          -> dk1 (dk without the delta rule)

    By column blocks (_bwd_dqk_kernel) both programs of a chunk form both [C, C] tiles, 4 of their 10 products a V
    step (and, with a gate, both Γ tiles); here 8 products a chunk and V step, each [C, C] tile formed and gated once,
    and each state tile read by one program (S by side 0, dS' by side 1; with a gate side 1 also loads S for
    ⟨S, dS'⟩, unless DGAM). The pairwise products accumulate into dq / dk in place (_pair_term).
    Scalar gate: side 0 stores Σ_k q ⊙ dq per row in dGp[0], side 1 −Σ_k k ⊙ dk1 in dGp[1], plus on the last row
    dG_last's share Σ k ⊙ dK_end e^{..} (+ e^{G_last} Σ S ⊙ dS' unless DGAM: then the WY pass adds the reverse
    pass's rows).
    LOWP: the pairwise products' operands (_pair_term): 4 split, 1 both 16-bit, 3 only side 1's 16-bit, else fp32.
    NS 3 (delta rule): dW = −dR Sᵀ in a third program of its own (reads dR, S), so that no program holds more than
    one [C, C] and two [C, BK] accumulators' worth (side 0 then holds dP and dq only).
    (Session 35's form with the WY pass's work in side 1, dk1 and dW kept in registers, was measured slower on an
    H100 and wrong at small tiles on the GPU in session 37, and removed in session 38: benchmarks/NOTES.md.)"""
    i_s, i_t = tl.program_id(0) % NS, tl.program_id(0) // NS
    W_IN_0: tl.constexpr = DELTA and NS == 2
    W_OWN: tl.constexpr = DELTA and NS == 3
    i_bh = tl.program_id(1)
    i_b, i_h = i_bh // HV, i_bh % HV
    i_hk = i_h // (HV // H)
    t0, L, i_g = _chunk_bounds(i_t, i_b, cu_seqlens, chunk_indices, T, C, IS_VARLEN, FULL)
    o_t, m_t, rows, m_cc, p_cc, p_ccT = _chunk_rows(t0, L, i_h, HV, C)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    p_h = (i_g * HV + i_h).to(tl.int64) * K * V
    m_tk, p_tk, p_hk = _col_offsets(rows, m_t, o_k, m_k, i_h, i_hk, H, HV, K)
    s_p = tl.num_programs(1).to(tl.int64) * T                                               # one dGp share: [B, T, HV]
    if i_s == 0:
        b_dq = tl.zeros([C, BK], dtype=tl.float32)
        if W_IN_0:
            b_dw = tl.zeros([C, BK], dtype=tl.float32)
        b_dP = tl.zeros([C, C], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            o_v, m_kv, m_tv, p_tv = _value_block(i_v, rows, m_t, m_k, i_h, HV, V, BV)
            b_do = tl.load(do + p_tv, mask=m_tv, other=0.)
            b_S = tl.load(h + p_h + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
            b_R = _r_tile(R, v, p_tv, m_tv, DELTA)
            b_dP += _mm(b_do, tl.trans(b_R), PREC)                                              # [C, BV] @ [BV, C]
            b_dq += _mm(b_do, tl.trans(b_S), PREC)                                              # [C, BV] @ [BV, BK]
            if W_IN_0:
                b_dw -= _mm(tl.load(dR + p_tv, mask=m_tv, other=0.), tl.trans(b_S), PREC)       # [C, BV] @ [BV, BK]
        if W_IN_0:
            tl.store(dW + p_hk, b_dw.to(dW.dtype.element_ty), mask=m_tk)
        b_k16 = tl.load(k + p_tk, mask=m_tk, other=0.)
        i_ge_j = o_t[:, None] >= o_t[None, :]
        if GATE == 1:
            b_G, b_last = _load_gate(G, t0, L, i_h, HV, K, BK, C, False)
            b_dq = b_dq * scale * _exp(b_G)[:, None]
            b_dP = tl.where(i_ge_j, b_dP * _exp(b_G[:, None] - b_G[None, :]), 0.) * scale
        else:
            b_dq = b_dq * scale
            b_dP = tl.where(i_ge_j, b_dP, 0.) * scale
        b_dq = _pair_term(b_dq, b_dP, b_k16, PREC, LOWP, LOWP == 1)                            # [C, C] @ [C, BK]
        tl.store(dq + p_hk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
        if GATE == 1:
            b_q = tl.load(q + p_tk, mask=m_tk, other=0.).to(tl.float32)
            tl.store(dGp + rows * HV + i_h, tl.sum(b_q * b_dq, axis=1), mask=m_t)
    if W_OWN:
        if i_s == 2:
            b_dw = tl.zeros([C, BK], dtype=tl.float32)
            for i_v in range(tl.cdiv(V, BV)):
                o_v, m_kv, m_tv, p_tv = _value_block(i_v, rows, m_t, m_k, i_h, HV, V, BV)
                b_S = tl.load(h + p_h + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
                b_dR = tl.load(dR + p_tv, mask=m_tv, other=0.)
                b_dw -= _mm(b_dR, tl.trans(b_S), PREC)                                          # [C, BV] @ [BV, BK]
            tl.store(dW + p_hk, b_dw.to(dW.dtype.element_ty), mask=m_tk)
    if i_s == 1:
        b_dk = tl.zeros([C, BK], dtype=tl.float32)
        b_dPt = tl.zeros([C, C], dtype=tl.float32)
        b_dgam = tl.zeros([BK], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            o_v, m_kv, m_tv, p_tv = _value_block(i_v, rows, m_t, m_k, i_h, HV, V, BV)
            if GATE == 1 and not DGAM:  # ⟨S, dS'⟩ from loads of their own, first: their latency under the products
                b_dgam += _state_inner_rows(h, dh, p_h, o_k, o_v, m_kv, V)
            b_do = tl.load(do + p_tv, mask=m_tv, other=0.)
            b_dSn = tl.load(dh + p_h + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
            b_R = _r_tile(R, v, p_tv, m_tv, DELTA)
            b_dPt += _mm(b_R, tl.trans(b_do), PREC)                                             # [C, BV] @ [BV, C]
            b_dk += _mm(b_R, tl.trans(b_dSn), PREC)                                             # [C, BV] @ [BV, BK]
        b_q16 = tl.load(q + p_tk, mask=m_tk, other=0.)
        j_ge_i = o_t[None, :] >= o_t[:, None]
        if GATE == 1:
            b_G, b_last = _load_gate(G, t0, L, i_h, HV, K, BK, C, False)
            b_dk = b_dk * _exp(b_last - b_G)[:, None]
            b_dlast = tl.sum(tl.sum(tl.load(k + p_tk, mask=m_tk, other=0.).to(tl.float32) * b_dk, axis=1), axis=0)
            if not DGAM:
                b_dlast += _exp(b_last) * tl.sum(b_dgam, axis=0)
            b_dPt = tl.where(j_ge_i, b_dPt * _exp(b_G[None, :] - b_G[:, None]), 0.) * scale
        else:
            b_dPt = tl.where(j_ge_i, b_dPt, 0.) * scale
        b_dk = _pair_term(b_dk, b_dPt, b_q16, PREC, LOWP, LOWP == 1 or LOWP == 3)              # [C, C] @ [C, BK]
        tl.store(dk1 + p_hk, b_dk.to(dk1.dtype.element_ty), mask=m_tk)
        if GATE == 1:
            b_k = tl.load(k + p_tk, mask=m_tk, other=0., cache_modifier=".cg").to(tl.float32)   # (again: not live
            b_dg = tl.where(o_t == L - 1, b_dlast, 0.) - tl.sum(b_k * b_dk, axis=1)           # across the product)
        if GATE == 1:
            tl.store(dGp + s_p + rows * HV + i_h, b_dg, mask=m_t)


@triton.jit
def _mm_split16(acc, a, b, PREC: tl.constexpr):
    """acc + a @ b for an fp32 a [M, N] and a 16-bit b [N, P], as two products with 16-bit operands: a = hi + lo, hi
    its rounding to b's dtype, lo the rounding of the rest (a's 24-bit significand kept to ~16 bits, finer than
    tf32's 11; fp32 accumulation). For bf16 (fp16's narrow range would overflow or flush the parts). Both products
    accumulate into acc (_mm_acc): ``acc + (hi b + lo b)`` kept a second [M, P] fp32 accumulator live."""
    a_hi = a.to(b.dtype)
    a_lo = (a - a_hi.to(tl.float32)).to(b.dtype)
    return _mm_acc(_mm_acc(acc, a_hi, b, PREC), a_lo, b, PREC)                                 # [M, N] @ [N, P]


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
def _wy_pair_operands(b_dA, b_dAt, b_beta, dt: tl.constexpr, OPD2: tl.constexpr, LOWP: tl.constexpr):
    """dA and dAᵀ as the key loop's products take them: LOWP 4, dA and dAᵀ β each split into two parts of the 16-bit
    dtype dt (high, low); else dA, dAᵀ in OPD2 (low parts returned as the high ones, unused)."""
    if LOWP == 4:
        b_dAh = b_dA.to(dt)
        b_dAl = (b_dA - b_dAh.to(tl.float32)).to(dt)
        b_dAt = b_dAt * b_beta[None, :]
        b_dAth = b_dAt.to(dt)
        b_dAtl = (b_dAt - b_dAth.to(tl.float32)).to(dt)
    else:
        b_dAh, b_dAth = b_dA.to(OPD2), b_dAt.to(OPD2)
        b_dAl, b_dAtl = b_dAh, b_dAth
    return b_dAh, b_dAl, b_dAth, b_dAtl


@triton.jit
def _wy_key_terms(b_k16, b_dw, b_dk1, b_Ttl, b_dAh, b_dAl, b_dAth, b_dAtl, b_beta, b_eG, m_tk, OPD2: tl.constexpr,
                  PREC: tl.constexpr, LOWP: tl.constexpr, GATE: tl.constexpr):
    """dk for key columns [C, BK] from dk1 (the state-tile pass's share) and the WY pass's, with that share's row sums
    into dβ and (GATE 1) dG: dX = Tᵀ dW, dk = dk1 + β e^G dX + dAᵀ (βK) + β (dA K). b_k16: K as loaded, b_dw: dW in
    the products' dtype, the dA operands as _wy_pair_operands gives them, b_eG: e^G [C, 1] (GATE 1). Returns (dk,
    dβ share, dG share)."""
    b_k = b_k16.to(tl.float32)
    b_kb = b_k * b_beta[:, None]
    if GATE == 1:
        b_ke = b_k * b_eG
    else:
        b_ke = b_k
    b_dx = _mm(b_Ttl, b_dw, PREC)                                                            # [C, C] @ [C, BK]
    if LOWP == 4 or LOWP == 1:
        # 16-bit K through registers, so that the products read a shared copy of their own, as the tf32 build's do,
        # not the software pipeline's buffer of the load, which the register math reads too
        b_kl = tl.where(m_tk, b_k16, 0.)
    else:
        b_kl = b_k.to(OPD2)
    if LOWP == 4:
        b_dkb = _mm(b_dAh, b_kl, PREC) + _mm(b_dAl, b_kl, PREC)                              # [C, C] @ [C, BK]
        b_dkp = _mm(b_dAth, b_kl, PREC) + _mm(b_dAtl, b_kl, PREC)                            # [C, C] @ [C, BK]
    else:
        b_dkb = _mm(b_dAh, b_kl, PREC)                                                       # [C, C] @ [C, BK]
        b_dkp = _mm(b_dAth, b_kb.to(OPD2), PREC)                                             # [C, C] @ [C, BK]
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
def _bwd_wy_kernel(k, v, beta, G, Tmat, dW, dR, dk1, dGp, dgam, Ascr, dv, dk, dbeta, dG, R, do, Pmat, dTp,
                   cu_seqlens, chunk_indices, T, scale,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, C: tl.constexpr, NKP: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr,
                   IS_VARLEN: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr = 0, NVD: tl.constexpr = 0,
                   KD: tl.constexpr = 16, T_TRANS: tl.constexpr = 0, DK1_AHEAD: tl.constexpr = 0,
                   DA_SCR: tl.constexpr = 0, FULL: tl.constexpr = 0):
    """Scalar / no gate, one program per (chunk, value head), after _bwd_dqk_kernel: the gradients through T
    (the WY form W = T X, U = T Y), then dk, dβ, dg finished::

        V loop:  dT = dR (βV)ᵀ, dTᵀ = (βV) dRᵀ,  dv = β (Tᵀ dR),  dβ = Σ_v V ⊙ Tᵀ dR
        K loop:  dT += dW Xᵀ, dTᵀ += X dWᵀ                  (X = β e^G K)
        dA = −Tᵀ dT Tᵀ (strict lower) ⊙ Γ,  dAᵀ = −T dTᵀ T (strict upper) ⊙ Γᵀ
        K loop:  dX = Tᵀ dW;  dk = dk1 + β e^G dX + dAᵀ (βK) + β (dA K);  dβ += Σ_k (K e^G ⊙ dX + K ⊙ dA K)
        scalar gate: dG = Σ of _bwd_dqk_kernel's NKP column-block shares + Σ_k (X ⊙ dX + βK ⊙ dA K − K ⊙ dAᵀ βK),
                     dg its reverse cumsum in the chunk
    Without the delta rule only the last step runs (dv = dR and dk = dk1 are the caller's). BK: the key loops'
    column block. LOWP as _bwd_grad_kernel's (T, dW, X, dT in 16 bits from 1, dA with K in 16 bits at 1 only); 4 is 2
    with the last loop's pairwise products dA K and dAᵀ (βK) = (dAᵀ β) K from 16-bit K, dA and dAᵀ β each split into
    two 16-bit parts (as _mm_split16; 16-bit inputs, bf16 only).
    NVD > 0 (scalar gate): the last row's dG also takes e^{G_last} ⟨S, dS'⟩, summed from the reverse state pass's
    rows in dgam [NC, HV, NVD, KD]. T_TRANS: T is Tᵀ's tile transposed (a loaded tile, not a product's
    accumulator) instead of a second load of Tmat, whose latency the program waited on. DK1_AHEAD: the last key
    loop loads dk1's next column block an iteration ahead (a plain load: Triton's pipeline leaves it out, and in the
    iteration that uses it the program waited on it). DA_SCR: dAᵀ read back transposed from the chunk's rows of Ascr
    ([B, T, HV, C] fp32 scratch) after dA is stored there and the program's threads meet at a barrier, instead of
    formed by products of its own (dTᵀ in both loops and −T dTᵀ T: 12 of the pass's 40 [64, 32, 64] products).

    Per-channel gate (GATE 2, KDA; after _bwd_dqk_kernel, before _bwd_pair_kernel): no key loops: dT = dR (βV)ᵀ + the
    state-tile pass's NKP shares in dTp ([NKP, B, T, HV, C]), dβ = Σ_v V ⊙ Tᵀ dR + its shares in dGp ([NKP, B, T,
    HV]); no pairwise products and no dAᵀ: dA (no gate factor) goes to Ascr (Amat) and dP = scale tril(dO Rᵀ) to
    Pmat, fp32, for the pair kernel, which finishes dq, dk, dG, dβ. (Ascr and Pmat may be dTp's first two blocks:
    each program reads its rows of dTp before it writes them.) FULL: every chunk whole (_chunk_bounds)."""
    i_h, i_hk, t0, L, i_g = _chunk_program(cu_seqlens, chunk_indices, T, H, HV, C, IS_VARLEN, 0, FULL)
    o_t, m_t, rows, m_cc, p_cc, p_ccT = _chunk_rows(t0, L, i_h, HV, C)
    OPD: tl.constexpr = k.dtype.element_ty if LOWP else tl.float32
    OPD2: tl.constexpr = k.dtype.element_ty if LOWP == 1 else tl.float32
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
            if T_TRANS:
                b_Tl = tl.trans(b_Ttl)                                                      # T
            else:
                b_Tl = tl.load(Tmat + p_cc, mask=m_cc & (o_t[:, None] >= o_t[None, :]), other=0.).to(OPD)
        if DK1_AHEAD and GATE != 2:     # the first column block of dk1, its latency under the dA products
            b_dk1n = _cols_ahead(dk1, rows, m_t, 0, i_h, HV, K, BK)
        b_dA, b_dAt = _wy_dA(b_Ttl, b_Tl, b_dT, b_dTt, b_G if GATE == 1 else b_beta, o_t, m_cc, p_cc, p_ccT, Ascr,
                             OPD, PREC, GATE, DA_SCR)
    if DELTA and GATE == 2:     # dA and dP for the pair kernel
        tl.store(Ascr + p_cc, b_dA, mask=m_cc)
        tl.store(Pmat + p_cc, tl.where(o_t[:, None] >= o_t[None, :], b_dP * scale, 0.), mask=m_cc)
        tl.store(dbeta + rows * HV + i_h, b_db, mask=m_t)
    elif DELTA:
        # dA K and dAᵀ (βK) from 16-bit K with dA, dAᵀ β split in two 16-bit parts each (LOWP 4)
        b_dAh, b_dAl, b_dAth, b_dAtl = _wy_pair_operands(b_dA, b_dAt, b_beta, k.dtype.element_ty, OPD2, LOWP)
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_tk, p_tk, p_hk = _col_offsets(rows, m_t, o_k, o_k < K, i_h, i_hk, H, HV, K)
            b_k16 = tl.load(k + p_tk, mask=m_tk, other=0.)
            b_dw = tl.load(dW + p_hk, mask=m_tk, other=0.).to(OPD)
            if DK1_AHEAD:
                b_dk1 = b_dk1n
                b_dk1n = _cols_ahead(dk1, rows, m_t, (i_k + 1) * BK, i_h, HV, K, BK)
            else:
                b_dk1 = tl.load(dk1 + p_hk, mask=m_tk, other=0.)
            b_dk, b_dbk, b_dGk = _wy_key_terms(b_k16, b_dw, b_dk1, b_Ttl, b_dAh, b_dAl, b_dAth, b_dAtl, b_beta,
                                               b_eG if GATE == 1 else b_beta, m_tk, OPD2, PREC, LOWP, GATE)
            b_db += b_dbk
            if GATE == 1:
                b_dGr += b_dGk
            tl.store(dk + p_hk, b_dk.to(dk.dtype.element_ty), mask=m_tk)
        tl.store(dbeta + rows * HV + i_h, b_db, mask=m_t)
    if GATE == 1:
        if NVD > 0:     # e^{G_last} ⟨S, dS'⟩ on the last row, from the reverse pass's rows
            o_d = tl.arange(0, KD)
            b_sds = tl.zeros([KD], dtype=tl.float32)
            for i_p in tl.static_range(NVD):
                b_sds += tl.load(dgam + ((i_g * HV + i_h) * NVD + i_p).to(tl.int64) * KD + o_d)
            b_dGr += tl.where(o_t == L - 1, _exp(b_last) * tl.sum(b_sds, axis=0), 0.)
        tl.store(dG + rows * HV + i_h, _rev_cumsum(b_dGr), mask=m_t)


@triton.jit
def _diag_grads_exact(k, G, Pmat, Amat, b_q, b_kb, b_G, b_last, t0, L, ib, rows, m_r, i_h, i_hk, o_k, m_k,
                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr,
                      BC: tl.constexpr, DELTA: tl.constexpr):
    """The gradients through diagonal block ib of P and A (dP, dA in Pmat, Amat) column by column, with
    the exact Γ_ij = e^{G_i − G_j} (blocks whose gates span too far to factor). Returns (dq, d(βk), dk) [BC, BK]."""
    o_i = tl.arange(0, BC)
    b_dqd = tl.zeros([BC, BK], dtype=tl.float32)
    b_dkbd = tl.zeros([BC, BK], dtype=tl.float32)
    b_dkd = tl.zeros([BC, BK], dtype=tl.float32)
    for jj in range(BC):
        j, m_j, b_kj, b_e = _diag_column(k, G, b_G, b_last, t0, L, ib, jj, i_h, i_hk, o_k, m_k, H, HV, K, BC)
        b_dPc = tl.load(Pmat + (rows * HV + i_h) * C + j, mask=m_r & m_j, other=0.)        # [BC]
        b_w = b_kj[None, :] * b_e
        b_dqd += b_dPc[:, None] * b_w
        b_z = b_dPc[:, None] * b_q
        if DELTA:
            b_dAc = tl.load(Amat + (rows * HV + i_h) * C + j, mask=m_r & m_j, other=0.)
            b_dkbd += b_dAc[:, None] * b_w
            b_z += b_dAc[:, None] * b_kb
        b_dkd = tl.where((o_i == jj)[:, None], tl.sum(b_z * b_e, axis=0)[None, :], b_dkd)
    return b_dqd, b_dkbd, b_dkd


@triton.jit
def _pair_grads_one_ref(q, k, dq, dk, dG, dq_o, dk_o, b_dP, b_dPt, b_dA, b_dAt, b_beta, b_d, rows, m_t, o_k, m_k,
                        i_h, i_hk, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, DELTA: tl.constexpr,
                        PREC: tl.constexpr):
    """The pairwise gradients of KDA's P and A for the channels o_k of one chunk around one reference r, b_d = G − r
    [C, BKP] with every |G_i − r| under span_max: Γ_ij = x_i y_j, x = e^{G − r}, y = e^{r − G} (both in fp32's
    range), so over the whole chunk (the diagonal blocks included)

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
    if DELTA:
        b_kb = b_k * b_beta[:, None]
        b_dkb = _mm(b_dA, b_ky, PREC) * b_x                                             # [C, C] @ [C, BKP]
        b_dkp += _mm(b_dAt, b_kb * b_x, PREC)                                           # [C, C] @ [C, BKP]
    else:
        b_kb = tl.zeros_like(b_k)
        b_dkb = tl.zeros_like(b_k)
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
                       BC: tl.constexpr, DELTA: tl.constexpr, PREC: tl.constexpr, span_max: tl.constexpr,
                       OFFDIAG: tl.constexpr, LOWP: tl.constexpr, DIAG: tl.constexpr):
    """_bwd_pair_kernel's block form for the channels o_k of one chunk (OFFDIAG, DIAG: see there). The diagonal
    blocks' pass stores the finished dq, dk to dq_o, dk_o."""
    o_i = tl.arange(0, BC)
    if OFFDIAG:
        o_t, m_t, rows, m_cc, p_cc, p_ccT = _chunk_rows(t0, L, i_h, HV, C)
        OPD: tl.constexpr = q.dtype.element_ty if LOWP else tl.float32
        b_dP = tl.load(Pmat + p_cc, mask=m_cc & (o_t[:, None] >= o_t[None, :]), other=0.).to(OPD)   # dP [C, C]
        b_dPt = tl.load(Pmat + p_ccT, mask=m_cc, other=0.).to(OPD)                                   # dPᵀ
        if DELTA:
            b_dA = tl.load(Amat + p_cc, mask=m_cc, other=0.).to(OPD)                                 # dA (strict lower)
            b_dAt = tl.load(Amat + p_ccT, mask=m_cc, other=0.).to(OPD)                               # dAᵀ
            b_beta = tl.load(beta + rows * HV + i_h, mask=m_t, other=0.).to(tl.float32)
        else:
            b_dA = b_dP
            b_dAt = b_dPt
            b_beta = tl.zeros([C], dtype=tl.float32)
        m_tk, p_tk, p_hk = _col_offsets(rows, m_t, o_k, m_k, i_h, i_hk, H, HV, K)
        b_q = tl.load(q + p_tk, mask=m_tk, other=0.).to(tl.float32)
        b_k = tl.load(k + p_tk, mask=m_tk, other=0.).to(tl.float32)
        b_kb = b_k * b_beta[:, None]
        b_Gh = _load_gate_cols(G, t0, L, i_h, o_k, m_k, HV, K, C)[0]
        b_dqp, b_dkp, b_dkb = _pairwise_grads_channel(b_dP, b_dPt, b_dA, b_dAt, b_q, b_k, b_kb, b_Gh, C, BC,
                                                      DELTA, PREC, OPD)
        b_dq = tl.load(dq + p_hk, mask=m_tk, other=0.) + b_dqp
        tl.store(dq + p_hk, b_dq, mask=m_tk)
        b_dGm = tl.load(dG + p_hk, mask=m_tk, other=0.) + b_q * b_dq + b_kb * b_dkb - b_k * b_dkp
        tl.store(dG + p_hk, b_dGm, mask=m_tk)
        tl.store(dk + p_hk, tl.load(dk + p_hk, mask=m_tk, other=0.) + b_dkp + b_beta[:, None] * b_dkb, mask=m_tk)
        if DELTA:
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
            if DELTA:
                b_beta = tl.load(beta + rows * HV + i_h, mask=m_r, other=0.).to(tl.float32)
            else:
                b_beta = tl.zeros([BC], dtype=tl.float32)
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
                if DELTA:
                    b_dAb = tl.load(Amat + p_bb, mask=m_bb, other=0.)
                    b_dkbd = _mm(b_dAb, b_kc, PREC) * b_xr                                       # [BC, BC] @ [BC, BKP]
                    b_dkd += _mm(tl.trans(b_dAb), b_kb * b_xr, PREC)                             # [BC, BC] @ [BC, BKP]
                else:
                    b_dkbd = tl.zeros([BC, BKP], dtype=tl.float32)
                b_dkd = b_dkd * b_xc
            else:
                b_dqd, b_dkbd, b_dkd = _diag_grads_exact(k, G, Pmat, Amat, b_q, b_kb, b_G, b_last, t0, L, ib, rows, m_r,
                                                         i_h, i_hk, o_k, m_k, H, HV, K, BKP, C, BC, DELTA)
            b_dGd = b_q * b_dqd + b_kb * b_dkbd - b_k * b_dkd
            tl.store(dq_o + p_hk, (tl.load(dq + p_hk, mask=m_rk, other=0.) + b_dqd).to(dq_o.dtype.element_ty), mask=m_rk)
            tl.store(dk_o + p_hk, (tl.load(dk + p_hk, mask=m_rk, other=0.) + b_dkd + b_beta[:, None] * b_dkbd).to(
                dk_o.dtype.element_ty),
                     mask=m_rk)
            if DELTA:
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
                     BC: tl.constexpr, DELTA: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
                     span_max: tl.constexpr, OFFDIAG: tl.constexpr, LOWP: tl.constexpr = 0,
                     DIAG: tl.constexpr = True, ONE_REF: tl.constexpr = 0, KLOOP: tl.constexpr = 0,
                     FITB: tl.constexpr = 16, FLAG: tl.constexpr = 0):
    """Per-channel gates, after _bwd_grad_kernel: the gradients through the pairwise products P = tril(⟨q_i,
    Γ_ij k_j⟩) and A = strict_tril(⟨βk_i, Γ_ij k_j⟩) (dP, dA in Pmat, Amat), added to dq, dk (fp32), the
    finished sums stored to dq_o, dk_o (dq, dk themselves, or the gradients in their own dtype), and to dG, which
    then becomes dg (reverse cumsum over the chunk). Grid (chunks, B·HV, cdiv(K, BKP)): everything here is
    local to a key channel, so each program takes one block of BKP channels.

        OFFDIAG: the blocks off the 16×16 diagonal first, on whole [C, BKP] tiles (_pairwise_grads_channel);
                 off only in the diagonal-only second launch (DIAG below).
        DIAG:    then the diagonal blocks, last to first: four products of factored operands when a block's
                 gates span less than span_max (_diag_factors), else the exact column loop (rare), and the
                 reverse cumsum; otherwise a second launch (OFFDIAG off, all channels) does them.
        ONE_REF: 1, a program whose channels' chunk gate stays within ±span_max of r = G_last / 2 does all of
                 it (both parts and the reverse cumsum) with four [C, C] x [C, BKP] products of e^{±(G − r)}-scaled
                 operands (_pair_grads_one_ref), the others nothing; 2, the others do the above, those nothing
                 (a second launch: the block form's registers stay out of the one-reference kernel); 3, the
                 diagonal blocks' launch over all channels for a second launch without DIAG, leaving out the
                 channels of the FITB-channel blocks that fit.

    dβ's share of this column block goes to dbp[i_kb] (fp32 [NKB, B·T·HV], summed by the launcher: no
    atomics, so the result does not depend on the order of the programs). LOWP: the off-diagonal products
    take 16-bit operands (the key side's BWD_LOWP level 3). FLAG: the ONE_REF 1 launch writes, per chunk, value head
    and channel block, whether the block did not fit (flag, int32 [chunks, B·HV, cdiv(K, FITB)]; FITB = the first
    launch's BKP in all three); the ONE_REF 2 / 3 launches read it instead of testing the gate's span again, so that
    their programs return at once where every block fit."""
    i_t, i_bh, i_kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NKF: tl.constexpr = (K + FITB - 1) // FITB        # the flags' channel blocks (the ONE_REF 1 launch's, FITB wide)
    if FLAG:
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
    if ONE_REF == 0:
        _pair_grads_blocks(q, k, beta, G, Pmat, Amat, dq, dk, dbp, dG, dq_o, dk_o, t0, L, i_h, i_hk, i_kb, o_k, m_k,
                           b_last, s_dbp, H, HV, K, BKP, C, BC, DELTA, PREC, span_max, OFFDIAG, LOWP, DIAG)
    elif ONE_REF == 1:
        # one reference for the whole chunk, r = G_last / 2 per channel, where every |G_i − r| of these channels
        # is under span_max: Γ_ij = e^{G_i − r} e^{r − G_j}, both factors in fp32's range. KLOOP: one program per
        # chunk takes every channel block in turn (dP, dA loaded once), else one block per program.
        o_t, m_t, rows, m_cc, p_cc, p_ccT = _chunk_rows(t0, L, i_h, HV, C)
        b_dP = tl.load(Pmat + p_cc, mask=m_cc & (o_t[:, None] >= o_t[None, :]), other=0.)           # dP [C, C]
        if DELTA:
            b_beta = tl.load(beta + rows * HV + i_h, mask=m_t, other=0.).to(tl.float32)
            b_dA = tl.load(Amat + p_cc, mask=m_cc & (o_t[:, None] > o_t[None, :]), other=0.)        # dA [C, C]
        else:
            b_beta = tl.zeros([C], dtype=tl.float32)
            b_dA = b_dP
        for i_kc in range(tl.cdiv(K, BKP) if KLOOP else 1):
            i_kb2 = i_kb + i_kc
            o_k2 = i_kb2 * BKP + tl.arange(0, BKP)
            m_k2 = o_k2 < K
            b_d = _ref_offsets(G, t0, L, i_h, o_k2, m_k2, HV, K, C)                             # [C, BKP]
            fits = _ref_span(b_d) < span_max
            if FLAG:
                tl.store(p_flag + i_kb2, (fits == 0).to(tl.int32))
            if fits:
                b_db = _pair_grads_one_ref(q, k, dq, dk, dG, dq_o, dk_o, b_dP, tl.trans(b_dP), b_dA, tl.trans(b_dA),
                                           b_beta, b_d, rows, m_t, o_k2, m_k2, i_h, i_hk, H, HV, K, DELTA, PREC)
                if DELTA:
                    tl.store(dbp + i_kb2.to(tl.int64) * s_dbp + rows * HV + i_h, b_db, mask=m_t)
    elif ONE_REF == 2:
        # the block form where one reference does not fit (the same test as above; FLAG: only those programs are here)
        if FLAG or _ref_span(_ref_offsets(G, t0, L, i_h, o_k, m_k, HV, K, C)) >= span_max:
            _pair_grads_blocks(q, k, beta, G, Pmat, Amat, dq, dk, dbp, dG, dq_o, dk_o, t0, L, i_h, i_hk, i_kb, o_k,
                               m_k, b_last, s_dbp, H, HV, K, BKP, C, BC, DELTA, PREC, span_max, OFFDIAG, LOWP, DIAG)
    else:
        # ONE_REF 3: the diagonal blocks' launch over every channel, but for the channels of the FITB-channel blocks
        # that fit one reference (the same test as above, block by block), which the first launch finished (FLAG:
        # the first launch's flags say whether any block of this chunk is left before the test reads the gate)
        missed = True
        if FLAG:
            o_f = tl.arange(0, BKP // FITB)
            missed = tl.sum(tl.load(p_flag + o_f, mask=o_f < NKF, other=0), axis=0) > 0
        b_fit = tl.full([BKP], 1, tl.int1)
        if missed:
            b_a = tl.max(tl.abs(_ref_offsets(G, t0, L, i_h, o_k, m_k, HV, K, C)), axis=0)            # [BKP]
            b_blk = tl.max(tl.reshape(b_a, [BKP // FITB, FITB]), axis=1)                     # [BKP / FITB]
            b_fit = tl.reshape(tl.broadcast_to(b_blk[:, None], [BKP // FITB, FITB]), [BKP]) < span_max
        if tl.max(tl.where(b_fit, 0, 1), axis=0) > 0:
            _pair_grads_blocks(q, k, beta, G, Pmat, Amat, dq, dk, dbp, dG, dq_o, dk_o, t0, L, i_h, i_hk, i_kb, o_k,
                               m_k & (b_fit == 0), b_last, s_dbp, H, HV, K, BKP, C, BC, DELTA, PREC, span_max, OFFDIAG,
                               LOWP, DIAG)
        elif DELTA:     # every block done by the first launch: this launch's share of dβ is 0
            o_t, m_t, rows, m_cc, p_cc, p_ccT = _chunk_rows(t0, L, i_h, HV, C)
            tl.store(dbp + i_kb.to(tl.int64) * s_dbp + rows * HV + i_h, tl.zeros([C], dtype=tl.float32), mask=m_t)


@triton.jit
def _group_sum_kernel(x, y, n_rows, G: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    """Grouped value heads: y[r, :] = Σ_g x[r, g, :] over a row's G value heads, in fp32, stored in y's dtype.
    x: [n_rows, G, K] (the per-value-head dq or dk in the input dtype or fp32, rows = B·T·H), y: [n_rows, K]. One
    pass: the sum and the cast to the input dtype as two torch launches moved 1.8x the bytes (an fp32 [B, T, H, K]
    written and read back)."""
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_k = tl.arange(0, BK)
    m = (o_r < n_rows)[:, None] & (o_k < K)[None, :]
    b_y = tl.zeros([BR, BK], dtype=tl.float32)
    for i_g in tl.static_range(G):
        b_y += tl.load(x + (o_r[:, None] * G + i_g) * K + o_k[None, :], mask=m, other=0.).to(tl.float32)
    tl.store(y + o_r[:, None] * K + o_k[None, :], b_y.to(y.dtype.element_ty), mask=m)


def group_sum(x: torch.Tensor, H: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, HV, K] gradients of the value heads (input dtype or fp32) -> [B, T, H, K] in ``dtype``, summed in fp32
    over each key head's HV / H value heads (_group_sum_kernel)."""
    B, T, HV, K = x.shape
    x = x.contiguous()
    y = torch.empty(B, T, H, K, device=x.device, dtype=dtype)
    n_rows, BR = B * T * H, 16
    _group_sum_kernel[(cdiv(n_rows, BR),)](x, y, n_rows, G=HV // H, K=K, BK=next_pow2(K), BR=BR, num_warps=4)
    return y


# ------------------------------------------------------------------------------------------------
# launcher
# ------------------------------------------------------------------------------------------------

def _num_stages(dtype: torch.dtype, BK: int, state_pass: bool = False, reverse_per_channel: bool = False) -> int:
    """Software-pipeline depth of a backward kernel (``state_pass``: the serial fwd_h / bwd_dh;
    ``reverse_per_channel``: KDA's bwd_dh).

    3 (Triton's default: the measured bf16 path) except where one H200 block's shared memory (232448 B)
    would not hold it (sizes of the sm_90 builds, compiled off the device with triton 3.6,
    benchmarks/bwd_sass.py):
    - fp32 inputs, BK = 128: 2. At 3 stages _bwd_dh_kernel needs 246792 B (GDN) / 345088 B (KDA),
      _fwd_h_kernel 254976 B (KDA); at 2, _bwd_dh_kernel 131588 / 205312 B. KDA's _bwd_dh_kernel has since
      grown to 238080 B at 2 stages (offline, session 24: the H200 refused it, OutOfResources, in the real-size
      fp16 KDA test, whose backward runs in fp32), 98304 B at 1: one stage.
    - BK = 256: 2 for 16-bit inputs, 1 for fp32, and 1 for the state passes. At K = V = 128 (BV = 32) the
      16-bit state passes take 156-230 KB at 2 stages (GDN / DeltaNet, 16-bit products), the fp32 ones at
      1 stage 64 KB (GDN) to 192 KB (KDA _bwd_dh_kernel); the other kernels at most 164 KB.
    """
    if BK > 128:
        return 1 if state_pass or dtype == torch.float32 else 2
    if reverse_per_channel and dtype == torch.float32 and BK > 64:
        return 1
    return 2 if dtype == torch.float32 and BK > 64 else 3


# Warps per program of each backward kernel, and the key side's column block, from the H200 sweeps
# (benchmarks/sweep_bwd.py, B1-T32768-H32 bf16 fwd+bwd; tables in benchmarks/NOTES.md): each kernel at the
# faster of 4 and 8 warps. The key side (dq, dk, dβ, dG) runs in 64-wide column blocks wherever K > 64:
# 3.10 vs 3.65 ms in one block (GDN, 4 warps), 2.08 vs 2.78 (DeltaNet), 12.1 vs 13.7 (KDA, 8 warps; run of
# 51c42ee). With 16-bit products in the serial passes (BWD_LOWP, run of 3422a18) the reverse state pass is
# faster at 4 warps for scalar / no gates (GDN 0.79 vs 0.91 ms, DeltaNet 1.17 vs 1.32) and at 8 for KDA
# (2.21 vs 2.79), as is KDA's forward pass (1.55 vs 1.80) and its diagonal-block recompute (2.19 vs 2.72).
# CHUNKWISE_BWD_WARPS="wu:4,bwd_grad:4" (or "/" between items; "all:N" for every kernel) and CHUNKWISE_BWD_KSPLIT (0: one block)
# override these (the sweep's knobs).
BWD_WARPS = {"gate_cumsum": 4, "intra": 4, "intra_diag": 4, "solve": 4, "wu": 4, "fwd_h": 4, "bwd_dh": 4,
             "bwd_dv": 4, "bwd_grad": 4, "bwd_diag": 4, "bwd_pair": 4, "bwd_pair_ref": 4, "prep": 4,
             "bwd_dqk": 4, "bwd_dqk_sides": 8, "bwd_wy": 4}     # prep: the fused recompute (BWD_FUSED_PREP)
BWD_WARPS_PER_CHANNEL = {"fwd_h": 8, "bwd_dh": 8, "bwd_grad": 8}     # KDA (per-channel gate)
# (KDA's bwd_dqk stays at 4 warps: offline sm_90 bf16 255 registers and 240 B of spills against 208 and none at 8, but
# on the H200 2.41 ms against 2.90 at 8, run of c470c78)
BWD_KSPLIT = 64
# Scalar / no gate: the value and key sides as _bwd_dqk_kernel (everything that reads the state tiles h / dh, one program
# per BWD_DQK_BK key columns of a chunk) then _bwd_wy_kernel (the gradients through T, per chunk), instead of
# _bwd_dv_kernel + _bwd_grad_kernel (255 registers each, dP / dT_v / dA through fp32 round trips). On the H200 (sweep_bwd
# --variants dqk, run of b5d9499, B1-T32768-H32 bf16, ms): DeltaNet 1.187 + 1.920 -> 1.223 + 1.535 (1.344 with the WY
# pass's key loops at 32 columns), GDN 1.537 + 2.745 -> 2.123 + 1.740 (1.656); 8 warps slower for both kernels, 32-wide
# state-pass blocks slower (1.318 / 2.397), a 64-wide value block slower. CHUNKWISE_BWD_DQK=0 takes the two kernels,
# CHUNKWISE_BWD_DQK_BK sets the column block, CHUNKWISE_BWD_DQK_BV _bwd_dqk_kernel's value block (default: BV, 32)
BWD_DQK = 1
BWD_DQK_BK = 64
# Scalar / no gate: the state-tile pass split by side (_bwd_dqk_sides_kernel: one program forms dP and dq, dW over all
# key columns, the other dPᵀ and dk1) instead of by BWD_DQK_BK key column blocks (both programs of a chunk forming dP
# and dPᵀ): 8 products a chunk and V step instead of 10, each [C, C] tile gated once; K <= 128 only (two [C, K] fp32
# accumulators beside a [C, C] one in side 0); 3, with the delta rule dW in a third program of its own. Offline sm_90
# (bf16, level 4, 8 warps; registers / spill B): DeltaNet 2: 147 / 0, 3: 110 / 0 (two 8-warp programs per SM, twice
# the column blocks' warps); GDN 231 / 0 and 176 / 0 (capped at 128: 52 B); simple GLA 181 / 0 (4 warps: spills, but
# for DeltaNet 3 at 174 / 0). Off (CHUNKWISE_BWD_DQK_SIDES=2 or 3; 0 by column blocks); per gate kind (KDA's
# per-channel gate never takes it). Session 37, an H100 (B1-T32768-H32 bf16; the pass / fwd+bwd ms, column blocks
# DeltaNet 1.218 / 5.15, GDN 1.711 / 6.26): 3 at 4 warps 1.175 / 5.10 and 1.658 / 6.19, 3 at 8 warps 1.389 / 5.30 and
# 2.496 / 8.27, 2 1.757 / 5.66 and 2.540 / 7.04: no default until the H200 says more than ~1 %
BWD_DQK_SIDES = {0: 0, 1: 0, 2: 0}
# The column-block pass's split pairwise products (PAIR16 3) accumulated into dq / dk by the products themselves (1)
# or summed into a zeroed tile that is then added (0, as measured so far). Offline sm_90 (bf16, level 4, 4 warps;
# registers / spill B / instructions, 0 -> 1): DeltaNet 250 / 0 / 1544 -> 236 / 0 / 1472, GDN 255 / 104 / 2976 ->
# 255 / 52 / 2928, simple GLA 255 / 88 / 2672 -> 255 / 36 / 2568. Session 37, an H100 (B1-T32768-H32 bf16 fwd+bwd):
# DeltaNet 5.15 -> 5.15 ms, GDN 6.26 -> 6.19: off until timed on the H200 (CHUNKWISE_BWD_SPLIT_INPLACE=1), per gate
# kind. _bwd_dqk_sides_kernel always accumulates in place
BWD_SPLIT_INPLACE = {0: 0, 1: 0, 2: 0}
BWD_WY_BK = 32          # _bwd_wy_kernel's key loops' column block (CHUNKWISE_BWD_WY_BK)
# _bwd_dqk_kernel's q, k (and gate) loads before its V loop, per gate kind (CHUNKWISE_BWD_DQK_EARLY), and dk1 between
# the two kernels in the 16-bit input dtype (CHUNKWISE_BWD_DK1_16; fp32 otherwise). H200 (run of 05fc501,
# B1-T32768-H32 bf16, state-tile pass / WY pass ms): DeltaNet 1.224 / 1.329 -> early 1.282, 16-bit dk1 1.154 / 1.304,
# both 1.104 / 1.304 (fwd+bwd 5.50 -> 5.35); GDN 2.117 / 1.585 -> early 1.986, 16-bit dk1 1.669 / 1.529, both 1.959
# (fwd+bwd 7.09 -> 6.59 with 16-bit dk1 alone; offline its spills 188 -> 64 B). dk is then rounded twice, as fla's
BWD_DQK_EARLY = {0: 1, 1: 0, 2: 0}
# KDA: the state-tile pass and the WY pass without the pairwise products (those stay the pair kernel's), instead of
# _bwd_dv_kernel + _bwd_grad_kernel (CHUNKWISE_BWD_DQK_KDA=0)
BWD_DQK_KDA = 1
# Gates on the dqk path: the gate's ⟨S, dS'⟩ term (dG_last's share e^{G_last} Σ S ⊙ dS') formed by the reverse state
# pass, which holds dS' in registers and loads S per chunk (CHUNKWISE_BWD_DGAM_DH=1), instead of by _bwd_dqk_kernel's V
# loop (0). On the H200 (GDN B1-T32768-H32 bf16, runs of 804bdbc and 21cb7e1) the state-tile pass gained 0.10 ms
# but the reverse pass lost 0.37-0.40 (0.81 -> 1.18 / 1.21 ms) with S loaded in mid-step and used there, and as much
# with S loaded at the step's start and used at its end: off
BWD_DGAM_DH = 0
# ⟨S, dS'⟩ in _bwd_dqk_kernel's V loop (gates, not BWD_DGAM_DH): from loads of their own (1; always without the delta
# rule) or from the product tiles after dW's product, issued last, has waited for every product (0; see SDS_OWN there)
BWD_SDS_OWN = 0
# _bwd_wy_kernel's two plain loads that Nsight Compute's long-scoreboard stalls point at (DeltaNet B1-T32768-H32 bf16,
# run of 804bdbc: 1.30 ms, 2 programs per SM, issue slots 23 % busy, long scoreboard 2.97 cycles per issue): T read a
# second time (BWD_WY_T_TRANS=1: Tᵀ's tile transposed instead) and dk1 loaded in every iteration of the last key
# loop where it is used (offline sm_90: a plain load, the product accumulator it feeds keeps it out of the software
# pipeline; BWD_WY_DK1_AHEAD=1: loaded an iteration ahead). CHUNKWISE_BWD_WY_T_TRANS / CHUNKWISE_BWD_WY_DK1_AHEAD
# override
BWD_WY_T_TRANS = 1
BWD_WY_DK1_AHEAD = 1

# The chunk-parallel launches whose chunk length is the constant C where every chunk is whole (no varlen, T a multiple
# of C; _chunk_bounds' FULL), so that their row masks fold away. Offline sm_90 (bf16, K = V = 128, 4 warps, LOWP 2;
# registers / spill B / instructions, masked -> folded): the WY pass GDN 239 / 0 / 3632 -> 212 / 0 / 3000, DeltaNet
# 250 / 0 / 2448 -> 237 / 0 / 2376, KDA 247 / 0 / 1952 -> 186 / 0 / 1904; the state-tile pass KDA 255 / 240 / 3496 ->
# 255 / 208 / 3088, but GDN 255 / 72 / 3264 -> 255 / 200 / 3136 and DeltaNet 242 / 0 / 1536 -> 226 / 0 / 1552; the W / U
# launch more instructions (+8-13 %), so not it. The serial state passes (_step_tiles' FULL), whose steps are
# latency-bound: the forward state pass GDN 155 / 0 / 1416 -> 120 / 0 / 1064, DeltaNet 119 / 0 / 1056 -> 90 / 0 / 896,
# KDA 248 / 0 / 2208 -> 164 / 0 / 1744; the reverse pass GDN 199 / 0 / 1872 -> 144 / 0 / 1584, DeltaNet 148 / 0 / 1504
# -> 126 / 0 / 1168, KDA 255 / 52 / 3144 -> 194 / 0 / 2616. On the H200 (session 29, `sweep_bwd --variants full`,
# B1-T32768-H32 bf16, one run; per-kernel ms masked -> folded): KDA the state-tile pass 2.41 -> 2.24, the forward
# state pass 1.05 -> 0.84-0.98, the reverse pass 0.82 -> 0.81, but its WY pass 0.950 -> 0.977, fwd+bwd 10.26 -> 10.05
# with all four and PREP_FULL; GDN the serial passes 0.424 -> 0.416 and 0.803 -> 0.788, but its WY pass 1.42 -> 1.52
# and the state-tile pass 1.68 -> 1.77 (its spills); DeltaNet within noise everywhere (the reverse pass 0.640 ->
# 0.652, the state-tile pass 1.130 -> 1.160), so none. Per gate kind: the serial passes for scalar gates (GDN, simple
# GLA), those and the state-tile pass for per-channel ones (KDA).
# CHUNKWISE_BWD_FULL (kernel names among "bwd_wy", "bwd_dqk", "fwd_h", "bwd_dh", joined by "," or "+"; "" or "0" none)
# overrides for every gate kind.
BWD_FULL: dict = {0: frozenset(), 1: frozenset({"fwd_h", "bwd_dh"}), 2: frozenset({"bwd_dqk", "fwd_h", "bwd_dh"})}


def bwd_full(kernel: str, gate: int, T: int, varlen: bool) -> bool:
    """Whether the launch ``kernel`` takes FULL (BWD_FULL[gate], CHUNKWISE_BWD_FULL): every chunk whole, and named
    there."""
    env = os.environ.get("CHUNKWISE_BWD_FULL")
    names = BWD_FULL[gate] if env is None else \
        frozenset(n for n in env.replace("+", ",").split(",") if n not in ("", "0"))
    unknown = names - {"bwd_wy", "bwd_dqk", "fwd_h", "bwd_dh"}
    if unknown:
        raise ValueError(f"CHUNKWISE_BWD_FULL={env!r}: expected kernel names among bwd_wy, bwd_dqk, fwd_h, bwd_dh "
                         f"(got {', '.join(sorted(unknown))})")
    return kernel in names and chunks_whole(T, varlen)
# _bwd_wy_kernel's dAᵀ through a per-chunk fp32 scratch (Amat) and a barrier instead of its own products (30 % fewer
# products and one [C, C] accumulator less, for a 16 KB store, a barrier and an L2 read per chunk), per gate kind
# (CHUNKWISE_BWD_WY_DA_SCR overrides). H200 (run of 21cb7e1, B1-T32768-H32 bf16, WY pass ms, products / scratch):
# DeltaNet 1.164 / 1.267, GDN 1.556 / 1.461. (T_TRANS + DK1_AHEAD above, same run: DeltaNet 1.298 -> 1.164, GDN
# 1.552 -> 1.556)
BWD_WY_DA_SCR = {0: 0, 1: 1, 2: 0}
BWD_DK1_16 = 1
# 16-bit inputs: the products' operands in the input dtype, fp32 accumulation. 1: the two serial state
# passes (fwd_h, bwd_dh); 2: also the W / U / dR_local recompute; 3: also the key side's products of T, dW,
# X, dT, dA and dP (a variant: on the H200, run of a3986d3, fwd+bwd DeltaNet 7.07 -> 6.36 ms, GDN 8.42 -> 7.68,
# KDA 26.49 -> 25.08, but at real size in bf16 GDN's dg error rose to 9.5e-3 and GLA's to 1.6e-2 (bound 8e-3,
# LOWP 2: 1.9-3.3e-3), and with fp16 inputs dk / dβ / dg errors reached 0.6-4.7 (verify_d9ad4c6): not a
# default). 4: level 3 but the pairwise products (dP, dA with q, k) in fp32 operands, where the dg error comes
# from: the default for bf16 inputs at a 128-wide key tile (BWD_LOWP_BF16_128). On the H200 (run of 028da63,
# B1-T32768-H32 bf16 fwd+bwd, levels 2 / 4) KDA 21.46 / 21.22 ms, DeltaNet 6.89 / 6.69, GDN 8.08 / 7.91 (the
# key side 0.17-0.19 ms faster), and every real-size bf16 test and both Hopper pins passed at level 4
# (sessions 7 and 8: DeltaNet dk 5.52e-3 against fla's 5.72e-3, GDN's pinned dg 1.95e-3); KDA and GLA at
# small tiles (K = 16 / 64) too. Not for fp16: at K = 16 DeltaNet's dk was 0.52 (an sm_90-only failure, like
# level 3's) and GDN's dg 4.0e-3 (bound 2e-3); nor at other key tiles (unchecked on the GPU). On the H200 (run
# of 3422a18, B1-T32768-H32) level 2 took fwd+bwd from 11.71 to 9.05 ms (GDN), 10.27 to 7.77 (DeltaNet),
# 38.15 to 35.85 (KDA), with gradient errors against float64 at fla's (ours / fla, bf16: DeltaNet k 5.41e-3 /
# 5.72e-3, v 4.06e-3 / 4.05e-3; KDA beta 3.45e-3 / 3.42e-3, every other input at or under fla's).
# CHUNKWISE_BWD_LOWP overrides both, within what was correct on the GPU: there level 3 is never taken and
# level 4 only for bf16 at a 128-wide key tile (on the H200, session 9, fp16 at K = 16 forced to level 3 / 4
# still gave GDN / DeltaNet dk errors of 0.5-1.2); the rest falls back to the default with a warning. Under
# the interpreter (CPU tests) every level runs as asked.
BWD_LOWP = 2
BWD_LOWP_BF16_128 = 4
# Gate kinds that may take level 3 on the GPU by CHUNKWISE_BWD_LOWP=3 (bf16 at a 128-wide key tile): without a gate
# (DeltaNet) the pairwise products' fp32 operands serve no dg, and fla's dqkwg / wy_bwd take them in bf16 too.
# Offline sm_90 (bf16, 4 warps, level 4 -> 3): the state-tile pass 255 registers / 56 B spilled / 1568 instructions
# -> 236 / 0 / 1200, the WY pass 250 / 0 / 2448 -> 242 / 0 / 2264 (on the H200 the level-4 state-tile pass issued
# 3.7M spill requests: Nsight Compute, session 31). Opt-in only: on the H200 (session 32) the WY pass lost more at
# level 3 than the state-tile pass gained (BWD_DQK_PAIR16 below); the gated families keep level 3 refused (their dg
# error passed the bound there, sessions 7-8). That level-3 WY build read K for dA K straight from the software
# pipeline's buffer of the load (see BWD_WY_PAIR16); since session 33 K goes through registers there (offline 244
# registers, no spill), untimed
BWD_LOWP3_OPT_IN = frozenset({0})
# At level 4, the state-tile pass's pairwise products in 16 bits, per gate kind: 1 dk's (dPᵀ Q; LOWP 3 there), 2 dq's
# (dP K) too (level 3 in that pass), 3 both from 16-bit q, k with dP / dPᵀ split into two 16-bit parts (_mm_split16,
# LOWP 4 there: ~16 significant bits of dP against tf32's 11; two bf16 products issue in the time of one tf32
# product), 0 neither; the WY pass stays at level 4. CHUNKWISE_BWD_DQK_PAIR16 (0-3, dqk_pair16) overrides. On the
# H200 (B1-T32768-H32 bf16): level 3 in both passes (run of 728c199) took the state-tile pass 1.122 -> 0.973 ms (its
# spills gone) but the WY pass 1.157 -> 1.382, fwd+bwd 4.72 -> 4.81. DeltaNet, state-tile pass / fwd+bwd ms and
# real-size bf16 dq / dk errors against float64 (fla's 4.607e-3 / 5.722e-3): 0 1.121 / 4.72, 4.539e-3 / 5.497e-3;
# 1 1.055 / 4.65, 4.539e-3 / 5.527e-3; 2 0.958 / 4.55, 4.613e-3 (past fla's) / 5.527e-3; 3 (run of 63e52fb) 0.990 /
# 4.59, 4.534e-3 / 5.494e-3: faster than 1 and closer than 0. The scalar gate at 3 (same run): GDN's pass 1.659 ->
# 1.517 ms, fwd+bwd 5.93 -> 5.78, dq / dk / dg errors 3.44e-3 / 3.85e-3 / 3.07e-3 -> 3.42e-3 / 3.84e-3 / 3.05e-3;
# simple GLA's pass 1.550 -> 1.326, fwd+bwd 4.16 -> 3.84, errors lower too. Offline sm_90 (bf16, 4 warps; 0 -> 3):
# DeltaNet 255 registers / 56 B spilled / 1568 instructions -> 252 / 0 / 1528; GDN 255 / 60 B / 3056 -> 255 / 104 B
# / 2976. The scalar gate refuses 1 / 2 (its dg reads dq, dk; the split keeps more of dP than tf32 does, 1 / 2 less)
# with a warning and takes its default; KDA's pairwise products are the pair kernel's
BWD_DQK_PAIR16 = {0: 3, 1: 3, 2: 0}
# At level 4, the WY pass's pairwise products dA K and dAᵀ (βK) of its last key loop (tf32 at 0) from 16-bit K with dA
# and dAᵀ β split into two 16-bit parts each, as BWD_DQK_PAIR16 3 (scalar / no gate; KDA's are the pair kernel's).
# CHUNKWISE_BWD_WY_PAIR16 (0 / 1) overrides. Offline sm_90 (bf16, 4 warps; 0 -> 1): DeltaNet 250 registers / 0 spilled /
# 2448 instructions -> 238 / 0 / 2592, GDN 244 / 0 / 3432 -> 255 / 40 B / 3648. On the H200 (B1-T32768-H32, run of
# 2c10996) the pass is far slower: DeltaNet 1.159 -> 1.603 ms, GDN 1.412 -> 1.750 (real-size errors the same to 3
# digits), as level 3 was (its dA K products with 16-bit dA too): off. In both slow builds (TTGIR, offline) those
# products read K straight from the software pipeline's shared buffer of the load (a mutable memdesc, the register
# math reading the same buffer), where the tf32 build's read a local_alloc of their own. Since then K goes through a
# register select first, which gives it its own shared copy (offline: 238 registers, no spill, 2624 instructions);
# that form is untimed
BWD_WY_PAIR16 = 0


def dqk_pair16(gate: int) -> int:
    """BWD_DQK_PAIR16 for a gate kind with CHUNKWISE_BWD_DQK_PAIR16 applied: any of 0-3 without a gate, 0 or 3 with
    a scalar gate (1 / 2 warn and give the default: their dg errors passed the bound on the H200, sessions 7-8), the
    default with a per-channel gate (KDA's pairwise products are the pair kernel's)."""
    if gate == 2:
        return BWD_DQK_PAIR16[gate]
    choice = _env_choice("CHUNKWISE_BWD_DQK_PAIR16", BWD_DQK_PAIR16[gate], range(4))
    if gate == 1 and choice in (1, 2):
        warnings.warn(f"CHUNKWISE_BWD_DQK_PAIR16={choice}: the scalar gate's dg takes 0 or 3 only; using "
                      f"{BWD_DQK_PAIR16[gate]}", RuntimeWarning, stacklevel=3)
        return BWD_DQK_PAIR16[gate]
    return choice


def gate_scaled_in(g, q) -> bool:
    """Whether chunk_bwd's serial state passes take q ⊙ e^G and k ⊙ e^{G_last − G} [B, T, HV, K] (KD_IN: per-channel
    gate, 16-bit product operands), which a forward that saves stage 1 can hand over (its stage 1 forms both for
    its own serial stage: saved ``qg``, ``kg``) instead of _gate_scaled_kernel forming them again."""
    return g is not None and g.dim() == 4 and bwd_lowp_level(q.dtype, max(16, next_pow2(q.shape[-1])), 2) >= 1 and \
        _env_switch("CHUNKWISE_BWD_KD_IN", BWD_KD_IN)


# The training forward's T = (I + A)⁻¹ in the 16-bit input dtype (1) where the backward rounds it to that dtype anyway
# before every product that reads it (the WY pass at levels 3 / 4: its T and Tᵀ operands in the input dtype): the
# same gradients, bit for bit, for half of T's bytes (written by stage 1, read by the WY pass: 2 x 128 B per token and
# head), or fp32 (0); per gate kind, CHUNKWISE_SAVE_T_16 overrides. On the H200 (run of a43829e, B1-T32768-H32 bf16,
# fwd+bwd fp32 / bf16 T): DeltaNet 4.80 -> 4.73 ms (stage 1 0.71 -> 0.66, peak −128 MB), but GDN 6.11 -> 6.30: its WY
# pass (dAᵀ through the scratch, DA_SCR) went 1.44 -> 1.66 ms with the bf16 tile. Per-channel gates always fp32 (KDA's
# W / U are formed from T in fp16-scaled operands)
SAVE_T_16 = {0: 1, 1: 0, 2: 0}


def saved_t_dtype(dtype: torch.dtype, K: int, gate: int, t_form: bool = False) -> torch.dtype:
    """The dtype a saving forward stores T in for inputs of ``dtype`` at head dim K (gate 0 / 1 / 2): ``dtype`` where
    the backward's only reader of T (_bwd_wy_kernel, BWD_DQK) takes it in ``dtype`` (key-side level 3 / 4), else fp32;
    always fp32 under T_FORM (``t_form``: the backward forms W / U from T)."""
    if t_form or gate == 2 or dtype == torch.float32 or not _env_switch("CHUNKWISE_SAVE_T_16", SAVE_T_16[gate]) \
            or not _env_switch("CHUNKWISE_BWD_DQK", BWD_DQK):
        return torch.float32
    return dtype if bwd_lowp_level(dtype, max(16, next_pow2(K)), gate) in (3, 4) else torch.float32


def bwd_lowp_level(dtype: torch.dtype, BK: int, gate: int | None = None) -> int:
    """The 16-bit product level (above) of inputs of this dtype at key tile BK (gate kind ``gate``: 0 none, 1 scalar,
    2 per channel; None unknown): 0 for fp32 inputs, CHUNKWISE_BWD_LOWP if set and allowed on the GPU for this
    dtype, tile and gate (BWD_LOWP3_OPT_IN), else 4 for bf16 at BK = 128 and 2 otherwise."""
    if dtype not in (torch.bfloat16, torch.float16):
        return 0
    default = BWD_LOWP_BF16_128 if dtype == torch.bfloat16 and BK == 128 else BWD_LOWP
    env = os.environ.get("CHUNKWISE_BWD_LOWP")
    if env is None:
        return default
    if env not in ("0", "1", "2", "3", "4"):
        raise ValueError(f"CHUNKWISE_BWD_LOWP={env!r}: expected 0, 1, 2, 3 or 4")
    level = int(env)
    opt_in = level == 3 and dtype == torch.bfloat16 and BK == 128 and gate in BWD_LOWP3_OPT_IN
    if not _INTERPRET and ((level == 3 and not opt_in) or (level == 4 and default != 4)):
        # (the warnings registry shows each message once per calling line)
        warnings.warn(f"CHUNKWISE_BWD_LOWP={level} gave wrong gradients on the GPU for {dtype} at key tile {BK} "
                      f"(benchmarks/NOTES.md); using level {default}", RuntimeWarning, stacklevel=3)
        return default
    return level


# Scalar / no gate with the delta rule: recompute T, W, U and dR_local in one pass per chunk with the forward's
# stage-1 kernel (A and P never reach memory: ~2.4 GB of traffic instead of ~5.4 GB at B1-T32768-H32)
# instead of the intra / solve / wu kernels (1.5-1.6 ms on the H200, run of b699467). Unmeasured on the GPU;
# CHUNKWISE_BWD_FUSED_PREP=0 takes the three kernels.
BWD_FUSED_PREP = 1
# Per-channel gates: the key side's gradients through P and A (off the diagonal blocks) run in their own kernel
# with the diagonal blocks (_bwd_pair_kernel), BWD_PAIR_SPLIT key channels per program, instead of as the
# key-side kernel's second pass (its 12.96 ms for KDA, B1-T32768-H32, run of 703d009: 255 registers and
# 1.5 KB spilled per thread at 8 warps, 148 KB of shared memory, offline sm_90). Offline sm_90 at 8 warps:
# the key side without that pass 4 B spilled, 106 KB; the pair kernel at 16 / 32 / 64 channels 0 / 64 /
# 448 B spilled, 72 / 80 / 96 KB. On the H200 (sweep of a3986d3) 9.45 ms at 4 warps; KDA fwd+bwd 31.72 -> 26.49 ms.
# CHUNKWISE_BWD_PAIR_SPLIT=0: one program over all channels.
BWD_PAIR_SPLIT = 32
# Grouped value heads (HV > H) with bf16 inputs: each value head's dq / dk leaves the kernels in bf16 (1) and group_sum
# adds them in fp32, or in fp32 (0). Each head's share is then rounded once before the sum, as fla's gradients of q / k
# repeated over the group are (autograd sums the repeat's bf16 gradients); half the bytes of the fp32 shares, written
# and read back (2 x 0.5 GB at B4-T8192-H16/HV32; H200, session 27: fwd+bwd GDN 6.68 -> 6.14 ms, DeltaNet 5.26 ->
# 4.93, simple GLA 4.82 -> 4.34, KDA 10.94 -> 10.71). fp16 keeps fp32 shares by default: its finer rounding made that
# per-head rounding the largest difference between two backward forms of the same gradients (DeltaNet dk 5.2e-4 at
# K = 32 in the interpreter, test_value_key_side_forms). CHUNKWISE_BWD_GROUP_16 (0 / 1) overrides for every 16-bit dtype
GRAD_GROUP_16 = 1
# W and U formed by the backward from a forward under T_FORM's T (chunk_fwd.SAVE_T_FORM): from 16-bit operands where
# the recompute takes them (1: BWD_LOWP level 2 and up at 128-wide key tiles, as the backward's recompute without a
# saved stage 1 and as fla forms them), or from fp32 ones in tf32 (0), as the forward's stage 1 forms them when it
# keeps them. On the H200 (run of 2eb2b43, KDA B1-T32768-H32 bf16) the launch took 1.103 ms at 0 and 0.674 at 1
# (0.202 without W, U), fwd+bwd 12.01 / 11.58 against 12.07 keeping W, U; the gradients moved by 7e-5 at 0 and 3.7e-3
# at 1 (relative, against keeping W, U). 0 until the real-size gradient test against fla has run at 1 (it did not
# finish in that session's device time). Session 21 (run of c26cd23): at 1 the real-size bf16 gradients against the
# float64 reference were over fla's on q, k, g by 2-8 % (dg 3.30e-3 against fla's 3.05e-3), at 0 under them. 2: fp16
# operands, each tile scaled by a power of two (_fp16_scaled): 16-bit products at a rounding no coarser than tf32's.
# CHUNKWISE_SAVE_WU_LOWP (0 / 1 / 2) overrides.
SAVE_WU_LOWP = 2
# KDA's pairwise gradients with one reference per chunk where its gate allows: 1, in a launch of their own
# (_bwd_pair_kernel ONE_REF 1); 2, in the key side's second pass (_bwd_grad_kernel ONE_REF); then the pair kernel's
# block form for the others; 0, the block form everywhere. CHUNKWISE_BWD_ONE_REF (0 / 1 / 2) overrides. On the
# H200 (KDA B1-T32768-H32 bf16 fwd+bwd; runs of ac0ebbf and b42e3c4) the pair kernels 7.97 -> 3.78-3.93 ms at 1,
# fwd+bwd 20.90 -> 14.50 ms (with BWD_KD_IN); at 2 the key side took 2.54 -> 6.61 ms (its second pass holds dP, dPᵀ,
# dA, dAᵀ in registers next to pass 1's state: 255 registers, 204 B of spills at 8 warps offline), fwd+bwd 14.98.
BWD_ONE_REF = 1
# ONE_REF 1: one program per chunk over every channel block (dP, dA read once; 1) or one per block (0);
# CHUNKWISE_BWD_PAIR_KLOOP overrides. H200 (run of d51f7fa, KDA B1-T32768-H32 bf16 fwd+bwd, 4 warps): the
# one-reference launch 3.11 against 3.19 ms, fwd+bwd 13.52 against 13.58, identical gradients; at 8 warps
# 4.90 / 3.86 ms
BWD_PAIR_KLOOP = 1
# ONE_REF 1: the one-reference launch flags the chunk / channel blocks it left to the block form, and the two launches
# after it read the flags instead of the gate (1), so that their programs return at once where every block fit; or
# they test the gate's span again (0). On the H200 (ncu of 2cb4873, KDA B1-T32768-H32 bf16, every block fitting)
# those two launches took 0.285 and 0.171 ms to find nothing to do. CHUNKWISE_BWD_PAIR_FLAG (0 / 1) overrides.
BWD_PAIR_FLAG = 1
BWD_PAIR_DIAG = 0     # 0: the diagonal blocks in a second launch over all channels (bwd_diag warps), the split
# launch only the off-diagonal part. On the H200 (sweep of 1695bb2, KDA B1-T32768-H32 bf16) the pair kernels
# 9.53 -> 8.10 ms, fwd+bwd 26.74 -> 25.31 ms (offline sm_90, 32 channels: the off-diagonal part alone 73
# barriers and 3272 instructions per program at 4 warps, with the diagonal blocks 284 and 7096; at 8 warps the
# off-diagonal part took 10.17 ms). 1: the diagonal blocks in every channel block's program.


# Per-channel gates (KDA), 16-bit inputs at K <= 128: registers per thread capped (Triton's maxnreg) in three small
# chunk-parallel kernels, for a third / fourth program per SM. On the H200 (sweep_bwd --variants regs, run of
# 2f0b1da, B1-T32768-H32): intra_diag 1.16 -> 1.00 ms at 168, solve 0.50 -> 0.43 at 128, wu 0.78 -> 0.73 at 168,
# same gradients; every other kernel was slower capped (bwd_dv 1.24 -> 1.76, stage 1 3.49 -> 3.92, intra
# 1.82 -> 3.48 at 168). CHUNKWISE_MAXNREG overrides (chunk_fwd.reg_cap).
BWD_REGS_PER_CHANNEL = {"intra_diag": 168, "solve": 128, "wu": 168}


# The forward state pass beside the W / U launch where the forward's stage 1 is saved (chunk_bwd's ``beside``), per gate
# kind (0 none, 1 scalar, 2 per channel): 1 on, 0 off; CHUNKWISE_BWD_OVERLAP (0 / 1, every family) overrides. The
# serial pass runs (cdiv(V, 32), N·HV) programs, one per SM at B1-H32, each latency-bound; the W / U launch is
# throughput-bound (KDA: W, U and dR_local, 0.84 ms at B1-T32768-H32 bf16; GDN / DeltaNet: dR_local alone, 0.20 ms).
# KDA's pass runs at 4 warps beside it (at its 8 warps and 115 registers one 168-register W / U program fits beside it,
# at 4 two). H200, B1-T32768-H32 bf16 fwd+bwd ms after / beside (run of 666e1d0, NOTES.md session 24): KDA 11.40 /
# 11.83 at 8 warps, 11.22 at 4 (the W / U launch bounds both: 0.84 ms alone, 2.16 beside the 8-warp pass, 1.37 beside
# the 4-warp one, against the pass's 0.90 alone); GDN 6.25 / 6.16; DeltaNet 4.94 / 4.97 (off).
BWD_OVERLAP = {0: 0, 1: 1, 2: 1}
# The same where the forward saved R (chunk_fwd.SAVE_R: the pass reads k, R, G and no W / U). H200, B1-T32768-H32 bf16
# (sweep_bwd --variants saver, session 26): the pass alone / beside GDN's dR_local launch 0.43 / 0.77 ms (with that
# launch 0.20 / 0.27): off; KDA fwd+bwd after / beside 10.39 / 10.22 (W and dR_local 0.65 alone): on
BWD_OVERLAP_R = {0: 0, 1: 0, 2: 1}


def bwd_overlap(gate: int, r_saved: bool = False) -> bool:
    """Whether the backward's forward state pass may run beside its W / U launch (BWD_OVERLAP, BWD_OVERLAP_R where
    the forward saved R)."""
    if os.environ.get("CHUNKWISE_BWD_OVERLAP") is not None:
        return bool(_env_choice("CHUNKWISE_BWD_OVERLAP", 0, range(2)))
    return bool((BWD_OVERLAP_R if r_saved else BWD_OVERLAP)[gate])


def _regs(name: str, gate: int, wide_ok: bool = True) -> dict:
    """maxnreg launch option of a backward kernel ({} for the compiler's choice)."""
    env = reg_cap(name)
    if env:
        return env
    if gate == 2 and wide_ok and name in BWD_REGS_PER_CHANNEL:
        return {"maxnreg": BWD_REGS_PER_CHANNEL[name]}
    return {}


def _env_block(name: str, default: int, cap: int) -> int:
    """A column / value block width from the environment variable ``name`` (``default`` when unset): the next power
    of two, at least 16 and at most ``cap``; 0 or less means ``cap`` (one block)."""
    n = int(os.environ.get(name, default))
    return cap if n <= 0 else min(max(16, next_pow2(n)), cap)


def _warps(name: str, gate: int, wide_ok: bool = True) -> int:
    """num_warps of a backward kernel. ``wide_ok``: the per-channel 8-warp picks may apply, which they do only
    where they were measured and checked, 16-bit inputs at K <= 128: on the H200 (run of e1f8201,
    benchmarks/results/h200/diag_e1f8201) KDA's key side at 8 warps raised illegal memory accesses or gave
    wrong dk / dg / dβ (errors 0.1-0.3) with fp32 inputs at K = 16 and 40, and its reverse state pass at
    K = 160 / 256 (fp32), while every one of those cases passed at 4 warps."""
    for item in filter(None, os.environ.get("CHUNKWISE_BWD_WARPS", "").replace("/", ",").split(",")):
        key, val = item.split(":")
        if key == name or key == "all":
            return int(val)
    if gate == 2 and wide_ok and name in BWD_WARPS_PER_CHANNEL:
        return BWD_WARPS_PER_CHANNEL[name]
    return BWD_WARPS[name]


@on_tensor_device
def chunk_bwd(q, k, v, g, beta, scale, initial_state, do, dht, cu_seqlens, *, chunk_indices=None,
              transpose_state_layout=False, saved=None):
    """Gradients of the chunk op (see the module docstring for the equations).

    q, k: [B, T, H, K]; v, do: [B, T, HV, V]; g: None | [B, T, HV] | [B, T, HV, K] fp32;
    beta: None | [B, T, HV]; initial_state: None | [N, HV, K, V] ([N, HV, V, K] transposed);
    dht: None | like the final state (fp32, same layout); cu_seqlens: None | [N + 1] (B == 1).
    Returns (dq, dk, dv, dg, dbeta, dh0), each in its input's dtype and layout (None where the
    input is None). K > MAX_K raises NotImplementedError. ``saved``: stage 1 of the forward (chunk_fwd's
    ``saved_out``: w, u, p, t) for the delta families, used instead of recomputing T, W, U (only dR_local
    = scale Pᵀ dO is formed here); ignored where the head dims are padded or 16-bit K > 128 runs in fp32. Head dims
    the kernels do not take as they are run zero-padded (triton/align.py).
    """
    if q.dtype != torch.float32 and (WIDE_16BIT_K < q.shape[-1] <= MAX_K or fp16_kda_in_fp32(q, g)):
        # 16-bit inputs with K > 128 (chunk_fwd.WIDE_16BIT_K), or fp16 KDA on the GPU (chunk_fwd.FP16_KDA_FP32), run
        # in fp32; gradients in the inputs' dtypes
        prec_env("CHUNKWISE_BWD_PREC16", "tf32")        # (checked here too: the fp32 run does not read it)
        dq, dk, dv, dg, dbeta, dh0 = chunk_bwd(
            q.float(), k.float(), v.float(), g, None if beta is None else beta.float(), scale, initial_state,
            do.float(), dht, cu_seqlens, chunk_indices=chunk_indices, transpose_state_layout=transpose_state_layout)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg, None if dbeta is None else dbeta.to(beta.dtype),
                dh0)
    K0, V0 = q.shape[-1], v.shape[-1]
    Kp, Vp = padded_dims(q, v)
    padded = (Kp, Vp) != (K0, V0) and K0 <= MAX_K
    if padded or beta is None or not saved:
        saved = None
    tr = transpose_state_layout
    if padded:
        q, k, v, do = pad_last(q, Kp), pad_last(k, Kp), pad_last(v, Vp), pad_last(do, Vp)
        g = g if g is None or g.dim() == 3 else pad_last(g, Kp)
        initial_state, dht = pad_state(initial_state, Kp, Vp, tr), pad_state(dht, Kp, Vp, tr)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K > MAX_K:
        raise NotImplementedError(
            f"the triton chunk backward supports head dims K <= {MAX_K} (got K={K}): wider keys would need more "
            f"shared memory than one SM has; use backend='torch' to train with K={K}")
    C, BC = CHUNK, SUB
    dev = q.device
    varlen = cu_seqlens is not None
    if varlen:
        if chunk_indices is None:
            from ..utils import prepare_chunk_indices
            chunk_indices = prepare_chunk_indices(cu_seqlens, C).to(dev)
        N = cu_seqlens.numel() - 1
        NT = chunk_indices.shape[0]
        cu_seqlens = cu_seqlens.contiguous()
        chunk_indices = chunk_indices.contiguous()
    else:
        N = B
        NT = cdiv(T, C)
    gate = 0 if g is None else (1 if g.dim() == 3 else 2)
    delta = beta is not None
    has_h0 = initial_state is not None
    BK = max(16, next_pow2(K))
    BV = min(32, max(16, next_pow2(V)))
    # fp32: three tf32 products (~fp32 accuracy on the tensor cores); "ieee" lowers every product to FMA
    # loops: offline sm_90 at K = 128 the key-side kernel took 90.6 s to compile and spilled 102 KB per
    # thread (tf32x3: 15.1 s, 7.5 KB)
    # 16-bit inputs: the products of fp32 operands in tf32 (bf16) or "tf32rn" (fp16: operands rounded to the
    # nearest tf32 first, since the tensor cores truncate fp32 operands toward zero, a bias fp16's finer
    # rounding does not hide: on the H200 KDA's fp16 dq / dg were 8.2e-4 / 1.4e-3 at tf32 against fla's
    # 4.8e-4 / 6.0e-4, NOTES.md session 8); KDA with fp16 inputs takes tf32x3 (session 9: at tf32rn its
    # real-size dg error was still 1.16e-3 against fla's 5.97e-4, with tf32x3 under fla's; levels 0 / 1 and the
    # recompute did not change it); CHUNKWISE_BWD_PREC16 overrides (tf32, tf32rn, tf32x3)
    prec16 = ("tf32x3" if gate == 2 else "tf32rn") if q.dtype == torch.float16 else "tf32"
    prec = "tf32x3" if q.dtype == torch.float32 else prec_env("CHUNKWISE_BWD_PREC16", prec16)
    # 16-bit product operands (BWD_LOWP), 16-bit inputs only
    level = bwd_lowp_level(q.dtype, BK, gate)
    # W / U with 16-bit operands only at 128-wide key tiles and value tiles of at least 64, as in the forward's
    # stage 1 (wu_lowp_ok): on the H200 (session 9) KDA's bf16 recompute at K = 64 gave gradient errors of ~1 with them
    lowp, lowp_wu = level >= 1, level >= 2 and wu_lowp_ok(q.dtype, K, v.shape[-1])
    # the key side's LOWP constexpr: level 3 every product in 16 bits (True), level 4 all but the pairwise ones (2)
    lowp_key = {3: True, 4: 2}.get(level, False)
    # the state-tile pass's (BWD_DQK_PAIR16) at level 4: dk's pairwise product (LOWP 3) or both (True) in 16 bits, or
    # both split (4)
    lowp_dqk = {1: 3, 2: True, 3: 4}.get(dqk_pair16(gate), lowp_key) if level == 4 else lowp_key
    # the WY pass's (BWD_WY_PAIR16) at level 4: its pairwise products dA K, dAᵀ (βK) split as the state-tile pass's
    lowp_wy = 4 if level == 4 and gate != 2 and _env_switch("CHUNKWISE_BWD_WY_PAIR16", BWD_WY_PAIR16) else lowp_key
    ns = _num_stages(q.dtype, BK)
    # the per-channel 8-warp picks apply (not with tf32x3 products: at 8 warps they gave wrong KDA gradients at
    # small tiles on the H200, fp32 inputs in session 5, fp16 with CHUNKWISE_BWD_PREC16=tf32x3 in session 8)
    wide8 = q.dtype in (torch.bfloat16, torch.float16) and BK <= 128 and prec != "tf32x3"
    ns_state = _num_stages(q.dtype, BK, state_pass=True)
    ns_dh = _num_stages(q.dtype, BK, state_pass=True, reverse_per_channel=gate == 2)
    q, k, v, do = (x.contiguous() for x in (q, k, v, do))
    if do.dtype != q.dtype:
        do = do.to(q.dtype)
    g = None if g is None else g.contiguous()
    beta = None if beta is None else beta.contiguous()
    h0 = initial_state.contiguous() if has_h0 else None
    dht = None if dht is None else dht.contiguous()

    # what the backward writes and reads back in bulk (W, U, R, dR, dR_local, h, dh) is kept in the
    # input dtype when that is 16-bit (as fla keeps h, w, u, v_new); A, P, T, G and every
    # accumulation stay fp32
    sdt = state_dtype(q.dtype)

    def buf(*shape, dtype=torch.float32):
        # NaN when poisoned (tests: CHUNKWISE_POISON=1) or interpreted, so that a read of an unwritten element shows
        poison = _INTERPRET or os.environ.get("CHUNKWISE_POISON") == "1"
        return (torch.full(shape, float("nan"), device=dev, dtype=dtype) if poison
                else torch.empty(shape, device=dev, dtype=dtype))

    common = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T)
    grid_c = (NT, B * HV)
    grid_s = (cdiv(V, BV), N * HV)

    G = None
    if gate and saved is not None and saved.get("G") is not None:      # the forward's own (chunk_fwd.saves_gate_cumsum)
        G = saved["G"].contiguous()
    elif gate:
        G = buf(*g.shape)
        _gate_cumsum_kernel[grid_c](g, G, floor=GATE_FLOOR, HV=HV, K=K, BK=BK, C=C, PER_CHANNEL=gate == 2,
                                    IS_VARLEN=varlen, num_warps=_warps("gate_cumsum", gate, wide8), **_regs("gate_cumsum", gate, wide8), num_stages=ns, **common)
    # scalar / no gate: the dqk path (BWD_DQK) needs no Amat / Pmat scratch but where the recompute takes the three
    # chunk kernels (no saved stage 1, no fused pass) or the WY pass reads dAᵀ back through Amat (BWD_WY_DA_SCR)
    # per-channel gate (KDA): the same two kernels without the pairwise products, then the pair kernel (BWD_DQK_KDA;
    # not with the key side's one-reference pass, CHUNKWISE_BWD_ONE_REF=2, which only the older key side has)
    one_ref = _env_choice("CHUNKWISE_BWD_ONE_REF", BWD_ONE_REF, range(3)) if gate == 2 else 0
    dqk = _env_switch("CHUNKWISE_BWD_DQK", BWD_DQK) and (
        gate != 2 or (delta and one_ref != 2 and _env_switch("CHUNKWISE_BWD_DQK_KDA", BWD_DQK_KDA)))
    fused_prep = saved is None and delta and gate != 2 and q.dtype != torch.float16 and \
        int(os.environ.get("CHUNKWISE_BWD_FUSED_PREP", BWD_FUSED_PREP))
    da_scr = dqk and delta and gate != 2 and _env_switch("CHUNKWISE_BWD_WY_DA_SCR", BWD_WY_DA_SCR[gate])
    scratch = not dqk or gate == 2 or (saved is None and not fused_prep)
    if dqk and gate == 2:   # one buffer, so that it can also take the state-tile pass's dT shares (dTp)
        AP = buf(2, B, T, HV, C)
        Amat, Pmat = AP[0], AP[1]
    else:
        Amat = buf(B, T, HV, C) if delta and (scratch or da_scr) else None
        Pmat = buf(B, T, HV, C) if scratch else None
    Tmat = W = U = R = None
    wu_from_t = False
    # the forward's stage 2 may have kept every chunk's entering state and R (chunk_fwd.saves_states), or R alone
    # (chunk_fwd.saves_r): then the forward state pass forms the states from R as the no-delta pass does from V,
    # S ← γ S + Kendᵀ R, without W, U
    states_saved = saved is not None and saved.get("h") is not None
    r_saved = saved is not None and saved.get("r") is not None
    # the forward kept its final state too (chunk_fwd.saves_final_state, DeltaNet): the reverse state pass forms the
    # per-chunk states backwards from it (REV_H) and the forward state pass is not launched
    rev_h = r_saved and not states_saved and gate == 0 and delta and saved.get("ht") is not None
    if saved is not None:
        # the forward's stage 1 (T, W, U in the dtypes the recompute would give; P in the input dtype, as the
        # 16-bit W / U recompute takes it): only dR_local = scale Pᵀ dO is left to form, and W, U where a forward
        # under T_FORM kept T alone (chunk_fwd.save_t_form)
        Tmat = saved["t"].contiguous()
        wu_from_t = saved.get("w") is None
        if wu_from_t:       # (U only where R is not saved: R = U − W S is all the backward reads it for)
            W, U = buf(B, T, HV, K, dtype=sdt), None if r_saved else buf(B, T, HV, V, dtype=sdt)
        else:
            W, U = saved["w"].contiguous(), None if r_saved else saved["u"].contiguous()
    elif delta:
        Tmat = buf(B, T, HV, C)
        W, U = buf(B, T, HV, K, dtype=sdt), buf(B, T, HV, V, dtype=sdt)
    # with stage 1 saved (scalar / no gate), the reverse state pass forms dR_local = scale Pᵀ dO per chunk itself
    p_in_dh = saved is not None and gate != 2 and not wu_from_t and _env_switch("CHUNKWISE_BWD_P_IN_DH", BWD_P_IN_DH)
    dRl = saved["p"].contiguous() if p_in_dh else buf(B, T, HV, V, dtype=sdt)
    NC = chunk_slots(N, T, varlen)
    if states_saved:
        h, R = saved["h"].contiguous(), saved["r"].contiguous()
    else:
        h = buf(NC, HV, K, V, dtype=sdt)
        if r_saved:
            R = saved["r"].contiguous()
        elif delta:
            R = buf(B, T, HV, V, dtype=sdt)
    seq = dict(cu_seqlens=cu_seqlens, T=T)
    # per-channel gate with 16-bit operands: the state passes take q ⊙ e^G and k ⊙ e^{G_last − G} formed once by a
    # chunk-parallel kernel or kept by the forward (gate_scaled_in, the rule the saving forward also asks)
    kd_in = gate_scaled_in(g, q)
    q_s, k_s = q, k
    if kd_in and saved is not None and saved.get("qg") is not None:
        # the forward's stage 1 formed both (q e^G, k e^{G_last − G} for its serial stage) and kept them
        q_s, k_s = saved["qg"].contiguous(), saved["kg"].contiguous()
    elif kd_in:
        q_s, k_s = buf(B, T, HV, K, dtype=q.dtype), buf(B, T, HV, K, dtype=q.dtype)
        _gate_scaled_kernel[grid_c](q, k, G, q_s, k_s, H=H, HV=HV, K=K, BK=BK, C=C, IS_VARLEN=varlen, **common)
    # the forward state pass beside the W / U launch (BWD_OVERLAP): where the forward's stage 1 is saved, _wu_kernel
    # forms dR_local (and W, U where the forward kept T alone, KDA) and the state pass reads only W, U of it: it runs on
    # a high-priority stream of its own, each step waiting for its chunk's W / U (flags) or, with W / U saved, at once
    beside = saved is not None and not p_in_dh and not states_saved and not rev_h and bwd_overlap(gate, r_saved) and \
        _overlap(grid_s[0] * grid_s[1], _num_sms(dev), NT, dev)
    ready = side = None
    if beside:
        if wu_from_t and not r_saved:   # (from R the pass reads no W / U: it waits for nothing)
            ready = torch.zeros((NC, HV), dtype=torch.int32, device=dev)
        side = _side_stream(dev)
    # fp16 takes the three kernels: on the H200 (run of e1f8201) the fused pass with fp16 products at 4 warps gave
    # gradient errors of 1.1 (GDN) and inf (DeltaNet) at K = 16 while bf16 passed at real size
    if saved is not None:
        if not p_in_dh:     # (never with wu_from_t)
            # dR_local = scale Pᵀ dO from the saved P, and W, U from T where the forward kept T alone (SAVE_WU_LOWP: their
            # operands' precision)
            wu_lowp = 0 if not lowp_wu else _env_choice("CHUNKWISE_SAVE_WU_LOWP", SAVE_WU_LOWP, range(3)) \
                if wu_from_t else 1
            _wu_kernel[grid_c if ready is None else grid_c[::-1]](
                k, v, beta, G, Tmat if wu_from_t else None, saved["p"].contiguous(), do, W if wu_from_t else None,
                U if wu_from_t else None, dRl, scale=scale, H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, C=C, GATE=gate,
                DELTA=wu_from_t, IS_VARLEN=varlen, PREC=prec, LOWP=wu_lowp, ready=ready, SIGNAL=ready is not None,
                STORE_U=U is not None,
                num_warps=_warps("wu", gate, wide8), **_regs("wu", gate, wide8), num_stages=ns, **common)
    elif fused_prep:
        # one pass per chunk (the forward's stage-1 kernel): T, W, U, dR_local; A and P stay in registers,
        # Amat and Pmat are only the scratch the value and key sides write dT_v / dA / dP into
        from .chunk_fwd import chunk_prepare_bwd
        chunk_prepare_bwd(q, k, v, g, beta, do, scale, W, U, Tmat, dRl, cu_seqlens, chunk_indices, wu_lowp=lowp_wu,
                          num_warps=_warps("prep", gate, wide8))
    else:
        _intra_kernel[grid_c](q, k, beta, G, Amat, Pmat, H=H, HV=HV, K=K, BK=BK, C=C, BC=BC, GATE=gate, DELTA=delta,
                              IS_VARLEN=varlen, PREC=prec, num_warps=_warps("intra", gate, wide8), **_regs("intra", gate, wide8), num_stages=ns, **common)
        if gate == 2:
            _intra_diag_kernel[grid_c](q, k, beta, G, Amat, Pmat, H=H, HV=HV, K=K, BK=BK, C=C, BC=BC, DELTA=delta,
                                       IS_VARLEN=varlen, PREC=prec, span_max=SPAN_MAX, num_warps=_warps("intra_diag", gate, wide8), **_regs("intra_diag", gate, wide8),
                                       num_stages=ns, **common)
        if delta:
            _solve_kernel[grid_c](Amat, Tmat, HV=HV, C=C, BC=BC, IS_VARLEN=varlen, PREC=prec, num_warps=_warps("solve", gate, wide8), **_regs("solve", gate, wide8), num_stages=ns, **common)
        _wu_kernel[grid_c](k, v, beta, G, Tmat, Pmat, do, W, U, dRl, scale=scale, H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
                           C=C, GATE=gate, DELTA=delta, IS_VARLEN=varlen, PREC=prec, LOWP=lowp_wu, num_warps=_warps("wu", gate, wide8), **_regs("wu", gate, wide8),
                           num_stages=ns, **common)

    if not states_saved and not rev_h:
        # (v, W, U in, R out; from a kept R: the no-delta form with R as its v)
        pass_v, pass_w, pass_u, pass_r = (R, None, None, None) if r_saved else (v, W, U, R)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            _fwd_h_kernel[grid_s](k_s, pass_v, G, pass_w, pass_u, h0, h, pass_r, H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
                                  C=C, GATE=gate, DELTA=delta and not r_saved, HAS_H0=has_h0,
                                  TRANSPOSE=transpose_state_layout, IS_VARLEN=varlen,
                                  PREC=prec, LOOP_WHILE=_INTERPRET, LOWP=lowp, KD_IN=kd_in, ready=ready,
                                  WAIT=ns_state + 1 if ready is not None else 0,
                                  FULL=bwd_full("fwd_h", gate, T, varlen),
                                  num_warps=_warps("fwd_h", gate, wide8 and not beside),
                                  **_regs("fwd_h", gate, wide8),
                                  num_stages=ns_state, **seq)
    if side is not None:
        torch.cuda.current_stream(dev).wait_stream(side)
    dh = buf(NC, HV, K, V, dtype=sdt)
    dR = buf(B, T, HV, V, dtype=sdt)
    dh0 = buf(*h0.shape) if has_h0 else None
    # gates on the dqk path: ⟨S, dS'⟩ per chunk from the reverse pass (BWD_DGAM_DH, off by default)
    dgam_dh = dqk and gate > 0 and _env_switch("CHUNKWISE_BWD_DGAM_DH", BWD_DGAM_DH)
    dgam = buf(NC, HV, grid_s[0], BK) if dgam_dh else None
    _bwd_dh_kernel[grid_s](q_s, k_s, G, W, dRl, do, dht, dh, dR, dh0, h, dgam, scale=scale, unit=1.0, H=H, HV=HV, K=K,
                           V=V, BK=BK,
                           BV=BV, C=C, GATE=gate, DELTA=delta, HAS_DHT=dht is not None, HAS_H0=has_h0,
                           TRANSPOSE=transpose_state_layout, IS_VARLEN=varlen, PREC=prec, LOOP_WHILE=_INTERPRET,
                           LOWP=lowp, KD_IN=kd_in, AHEAD=_bwd_dh_ahead(gate), PL=p_in_dh, DGAM=dgam_dh,
                           FULL=bwd_full("bwd_dh", gate, T, varlen), num_warps=_warps("bwd_dh", gate, wide8),
                           **_regs("bwd_dh", gate, wide8), num_stages=ns_dh,
                           ht=saved["ht"].contiguous() if rev_h else None, Rs=R if rev_h else None, REV_H=rev_h, **seq)
    del dRl, q_s, k_s

    # gradients go out in the input dtype directly unless finished by the per-channel pair kernels (those accumulate
    # in fp32). Grouped value heads too where GRAD_GROUP_16 takes the dtype: each value head's dq / dk in it, summed
    # over its group in fp32 by group_sum, as fla's gradients of q / k repeated over the group are
    group16 = _env_switch("CHUNKWISE_BWD_GROUP_16", int(GRAD_GROUP_16 and q.dtype == torch.bfloat16))
    gdt = q.dtype if gate != 2 and (HV == H or group16) else torch.float32
    dq, dk = buf(B, T, HV, K, dtype=gdt), buf(B, T, HV, K, dtype=gdt)
    dv = None if dqk and not delta else buf(B, T, HV, V, dtype=v.dtype)
    dbeta = buf(B, T, HV) if delta else None
    dG = buf(*g.shape) if gate else None
    bkp = _env_block("CHUNKWISE_BWD_PAIR_SPLIT", BWD_PAIR_SPLIT, BK)   # the pair kernel's channel block (0: all)
    if dqk:
        # the state tiles' pass split over key column blocks of bka, or by side (BWD_DQK_SIDES: two dGp shares), then
        # the per-chunk WY pass (per channel: then the pair kernel)
        sides = _env_choice("CHUNKWISE_BWD_DQK_SIDES", BWD_DQK_SIDES[gate], (0, 2, 3)) if gate != 2 and BK <= 128 else 0
        bka = _env_block("CHUNKWISE_BWD_DQK_BK", BWD_DQK_BK, BK)
        nka = 2 if sides else cdiv(K, bka)
        bva = _env_block("CHUNKWISE_BWD_DQK_BV", BV, max(16, next_pow2(V)))
        # dk1 (the state and P terms of dk) for the WY pass to finish: fp32, or 16-bit with CHUNKWISE_BWD_DK1_16;
        # per channel fp32 in dk itself (the pair kernel adds to it)
        dk1_16 = delta and gate != 2 and q.dtype != torch.float32 and _env_switch("CHUNKWISE_BWD_DK1_16", BWD_DK1_16)
        dk1_dt = q.dtype if dk1_16 else torch.float32
        dk1 = dk if not delta or dk.dtype == dk1_dt else buf(B, T, HV, K, dtype=dk1_dt)
        dW = buf(B, T, HV, K, dtype=q.dtype if lowp_key else torch.float32) if delta and gate != 2 else None
        # the gate's shares: per column block and row (scalar gate), or dG itself per channel; per channel also dT's and
        # dβ's shares by column block (dTp in Amat / Pmat where two blocks or fewer: the WY pass reads its rows first)
        dGp = None if not gate else (dG if gate == 2 else buf(nka, B, T, HV))
        dTp = dbs = None
        if gate == 2:
            dTp = AP if nka <= 2 else buf(nka, B, T, HV, C)
            dbs = buf(nka, B, T, HV)
        nvd = grid_s[0] if dgam_dh else 0
        if sides:
            n_sides = 3 if delta and sides == 3 else 2
            _bwd_dqk_sides_kernel[(n_sides * NT, B * HV)](
                q, k, v, G, h, dh, R if delta else None, dR, do, dq, dk1, dW, dGp, scale=scale, H=H, HV=HV, K=K, V=V,
                BK=BK, BV=bva, C=C, GATE=gate, DELTA=delta, IS_VARLEN=varlen, PREC=prec, LOWP=lowp_dqk, DGAM=dgam_dh,
                NS=n_sides, FULL=bwd_full("bwd_dqk", gate, T, varlen), num_warps=_warps("bwd_dqk_sides", gate),
                **_regs("bwd_dqk_sides", gate), num_stages=ns, **common)
        else:
            _bwd_dqk_kernel[(nka * NT, B * HV)](q, k, v, G, h, dh, R if delta else None, dR, do, dq, dk1, dW, dGp, dgam,
                                                Tmat, beta, dTp, dbs,
                                                scale=scale, H=H, HV=HV, K=K, V=V, BK=bka, BV=bva, C=C, GATE=gate,
                                                DELTA=delta, IS_VARLEN=varlen, PREC=prec, LOWP=lowp_dqk,
                                                EARLY=_env_switch("CHUNKWISE_BWD_DQK_EARLY", BWD_DQK_EARLY[gate]),
                                                DGAM=dgam_dh, NVD=nvd, KD=BK,
                                                SDS_OWN=not delta or _env_switch("CHUNKWISE_BWD_SDS_OWN", BWD_SDS_OWN),
                                                FULL=bwd_full("bwd_dqk", gate, T, varlen),
                                                INPLACE=_env_switch("CHUNKWISE_BWD_SPLIT_INPLACE", BWD_SPLIT_INPLACE[gate]),
                                                num_warps=_warps("bwd_dqk", gate, wide8), **_regs("bwd_dqk", gate),
                                                num_stages=ns, **common)
        if delta or gate:
            bkw = _env_block("CHUNKWISE_BWD_WY_BK", BWD_WY_BK, BK)
            _bwd_wy_kernel[grid_c](k, v, beta, G, Tmat, dW, dR, dk1, dbs if gate == 2 else dGp, dgam, Amat, dv, dk,
                                   dbeta, dG, R if delta else None, do, Pmat, dTp, scale=scale, H=H, HV=HV,
                                   K=K, V=V, BK=bkw, BV=BV, C=C, NKP=nka, GATE=gate, DELTA=delta, IS_VARLEN=varlen,
                                   PREC=prec, LOWP=lowp_wy, NVD=nvd, KD=BK,
                                   T_TRANS=_env_switch("CHUNKWISE_BWD_WY_T_TRANS", BWD_WY_T_TRANS),
                                   DK1_AHEAD=_env_switch("CHUNKWISE_BWD_WY_DK1_AHEAD", BWD_WY_DK1_AHEAD),
                                   DA_SCR=da_scr, FULL=bwd_full("bwd_wy", gate, T, varlen),
                                   num_warps=_warps("bwd_wy", gate), **_regs("bwd_wy", gate),
                                   num_stages=ns, **common)
        if not delta:       # dv = dR
            dv = dR if dR.dtype == v.dtype else dR.to(v.dtype)
        del dk1, dW, dGp, dgam, dTp, dbs
    else:     # the value side, the key side (and per channel the pairwise kernels)
        _bwd_dv_kernel[grid_c](q, k, v, beta, G, Tmat, h, R, dR, do, Pmat, Amat, dq, dv, dbeta, dG, scale=scale, H=H,
                               HV=HV, K=K, V=V, BK=BK, BV=BV, C=C, GATE=gate, DELTA=delta, IS_VARLEN=varlen, PREC=prec,
                               num_warps=_warps("bwd_dv", gate, wide8), **_regs("bwd_dv", gate, wide8), num_stages=ns, **common)
        bkh = _env_block("CHUNKWISE_BWD_KSPLIT", BWD_KSPLIT, BK)     # the key side's column block (0: one block)
        if one_ref == 2:    # the key side does the column blocks that fit; the pair kernel the others, on the same blocks
            bkp = bkh
        _bwd_grad_kernel[grid_c](q, k, v, beta, G, Tmat, Pmat, Amat, h, dh, R, dR, do, dq, dk, dbeta, dG,
                                 scale=scale, H=H, HV=HV, K=K, V=V, BK=BK, BKH=bkh, BV=BV, C=C, BC=BC, GATE=gate,
                                 DELTA=delta, IS_VARLEN=varlen, PREC=prec, LOWP=lowp_key, ONE_REF=one_ref == 2,
                                 span_max=SPAN_MAX, num_warps=_warps("bwd_grad", gate, wide8), **_regs("bwd_grad", gate, wide8),
                                 num_stages=ns, **common)
    if gate == 2:   # per-channel gates: the pairwise gradients in their own kernel, BWD_PAIR_SPLIT channels each
        nkb = cdiv(K, bkp)
        # the diagonal blocks in their own launch over all channels (BWD_PAIR_DIAG=0, the default) or with the rest
        split_diag = nkb > 1 and one_ref != 2 and not int(os.environ.get("CHUNKWISE_BWD_PAIR_DIAG", BWD_PAIR_DIAG))
        # dβ's shares by channel block; with the key side taking blocks (ONE_REF 2), those the pair kernel skips are 0
        dbp = None if not delta else (torch.zeros(nkb, B * T * HV, device=dev) if one_ref == 2
                                      else buf(nkb + split_diag, B * T * HV))
        # the launch that finishes a gradient element stores it in the input's dtype (no cast afterwards), where
        # nothing follows but group_sum of 16-bit shares (group16): not for grouped heads with fp32 shares nor when the
        # key side finishes some
        dq_o, dk_o = dq, dk
        if (HV == H or group16) and one_ref != 2 and q.dtype != dq.dtype:
            dq_o, dk_o = buf(*dq.shape, dtype=q.dtype), buf(*dk.shape, dtype=k.dtype)
        pair = dict(s_dbp=B * T * HV, H=H, HV=HV, K=K, C=C, BC=BC, DELTA=delta, IS_VARLEN=varlen, PREC=prec,
                    span_max=SPAN_MAX, LOWP=lowp_key is True, num_stages=ns, **common)
        # the one-reference launch's flags (BWD_PAIR_FLAG): which chunk / channel blocks the block form has left
        flag = torch.empty(NT * B * HV * nkb, dtype=torch.int32, device=dev) \
            if one_ref == 1 and _env_switch("CHUNKWISE_BWD_PAIR_FLAG", BWD_PAIR_FLAG) else None
        pair.update(flag=flag, FLAG=flag is not None)
        if one_ref == 1:    # the one-reference programs, then the block form where a chunk's gate spans too far
            kloop = _env_switch("CHUNKWISE_BWD_PAIR_KLOOP", BWD_PAIR_KLOOP)
            _bwd_pair_kernel[(NT, B * HV, 1 if kloop else nkb)](q, k, beta, G, Pmat, Amat, dq, dk, dbp, dG, dq_o, dk_o,
                                                BKP=bkp, OFFDIAG=True, DIAG=True, ONE_REF=1, KLOOP=kloop, FITB=bkp,
                                                num_warps=_warps("bwd_pair_ref", gate, wide8),
                                                **_regs("bwd_pair_ref", gate, wide8), **pair)
        _bwd_pair_kernel[(NT, B * HV, nkb)](q, k, beta, G, Pmat, Amat, dq, dk, dbp, dG, dq_o, dk_o, BKP=bkp, OFFDIAG=True,
                                            DIAG=not split_diag, ONE_REF=2 if one_ref else 0, FITB=bkp,
                                            num_warps=_warps("bwd_pair", gate, wide8), **_regs("bwd_pair", gate, wide8), **pair)
        if split_diag:
            _bwd_pair_kernel[(NT, B * HV, 1)](q, k, beta, G, Pmat, Amat, dq, dk, None if dbp is None else dbp[nkb:], dG,
                                              dq_o, dk_o, BKP=BK, OFFDIAG=False, DIAG=True, ONE_REF=3 if one_ref else 0,
                                              FITB=bkp, num_warps=_warps("bwd_diag", gate, wide8),
                                              **_regs("bwd_diag", gate, wide8), **pair)
        if delta:
            dbeta += dbp.view(-1, B, T, HV).sum(0)
        dq, dk = dq_o, dk_o
    if HV != H:     # per value head (gdt, or the pair kernels' dq_o / dk_o) -> per key head
        dq, dk = group_sum(dq, H, q.dtype), group_sum(dk, H, k.dtype)
    dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    dG = None if dG is None else dG.to(g.dtype)
    dh0 = None if dh0 is None else dh0.to(initial_state.dtype)
    if padded:
        dq, dk, dv = dq[..., :K0].contiguous(), dk[..., :K0].contiguous(), dv[..., :V0].contiguous()
        dG = dG if dG is None or dG.dim() == 3 else dG[..., :K0].contiguous()
        dh0 = cut_state(dh0, K0, V0, tr)
    return dq, dk, dv, dG, None if dbeta is None else dbeta.to(beta.dtype), dh0
