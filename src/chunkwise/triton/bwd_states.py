"""The backward's state passes (docs/design.md, section 6). Per chunk, with S the state entering it and dS' the
gradient of the state leaving it::

    forward pass:  R = U − W S   (no delta rule: R = V),   S ← γ S + Kendᵀ R
    reverse pass:  dR = dR_local + Kend dS',   dS = γ dS' + scale Qgᵀ dO − Wᵀ dR

Both are serial over a sequence's chunks, one program per (value block, sequence, value head), and store every
chunk's S (h) and dS' (dh) for the chunk-parallel passes after them. Also here: what feeds them besides stage 1's
operands (bwd_wy.py) — the chunk-local gate cumsum G and KDA's gate-scaled q, k — and the chunk bookkeeping and
launch arguments every backward kernel shares (Problem).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..utils import prepare_chunk_indices
from .common import (BT, G_FLOOR, INTERPRET, _alloc, _and, _dim, _exp, _mm, cdiv, chunk_slots, chunks_whole, gate_kind,
                     state_dtype)

# ------------------------------------------------------------------------------------------------
# chunk bookkeeping
# ------------------------------------------------------------------------------------------------


@triton.jit
def _chunk_len(t0, eos, C: tl.constexpr, FULL: tl.constexpr):
    """Valid rows of the chunk starting at token row t0 of a sequence ending at eos: at most C; FULL (every chunk
    whole: no varlen, T a multiple of C) the constant C, so that the masks built from it fold away."""
    if FULL:
        L = C
    else:
        L = tl.minimum(eos - t0, C)
    return L


@triton.jit
def _chunk_bounds(i_t, i_b, cu_seqlens, chunk_indices, T, C: tl.constexpr, IS_VARLEN: tl.constexpr,
                  FULL: tl.constexpr = 0):
    """Chunk i_t of batch row i_b -> (first token row t0 in the flat [B*T] axis, valid length L, chunk slot
    for the per-chunk state buffers: the numbering of common.chunk_slots)."""
    # int64 throughout: token rows times H·K, and chunk slots times HV·K·V, pass 2^31 at B8-T32768-H32
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
                   IS_VARLEN: tl.constexpr):
    """Where a chunk-parallel program of grid (chunks, B·HV) works: (value head i_h, the key head i_hk its group
    reads, the chunk's first token row t0, valid length L, chunk slot i_g) (_chunk_bounds)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // HV, i_bh % HV
    t0, L, i_g = _chunk_bounds(i_t, i_b, cu_seqlens, chunk_indices, T, C, IS_VARLEN)
    return i_h, i_h // (HV // H), t0, L, i_g


@triton.jit
def _seq_bounds(i_n, cu_seqlens, T, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Sequence i_n -> (first token row, last+1, slot of its first chunk, number of chunks).

    Varlen: sequence n's chunks take the slots i_n + bos // C + [0, chunks): distinct across sequences (the
    next sequence's first slot, i_n + 1 + (bos + len) // C, is past them) and fewer than N + T // C in all
    (common.chunk_slots), known from the shapes alone, as the forward numbers them."""
    if IS_VARLEN:     # int64: see _chunk_bounds
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        boh = i_n.to(tl.int64) + bos // C
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        boh = i_n.to(tl.int64) * tl.cdiv(T, C)
    return bos, eos, boh, tl.cdiv(eos - bos, C)


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
def _col_offsets(rows, m_t, o_k, m_k, i_h, i_hk, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr):
    """Key channels o_k of the token rows `rows`: (mask, offsets into q / k [., H, K], offsets into the per
    value head [., HV, K] gradients)."""
    m_tk = m_t[:, None] & m_k[None, :]
    p_tk = (rows[:, None] * H + i_hk) * K + o_k[None, :]
    p_hk = (rows[:, None] * HV + i_h) * K + o_k[None, :]
    return m_tk, p_tk, p_hk


@triton.jit
def _rev_cumsum(x):
    """Σ_{j ≥ i} x_j along the chunk's rows (axis 0) of x [C] or [C, BK] (a gate's dg from its per-row terms)."""
    return tl.sum(x, axis=0, keep_dims=True) - tl.cumsum(x, axis=0) + x


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


@triton.jit
def _gate_factors(b_G, b_last, GATE: tl.constexpr):
    """(e^G, e^{G_last − G}) broadcastable against [C, BK]."""
    if GATE == 2:
        return _exp(b_G), _exp(b_last[None, :] - b_G)
    else:
        return _exp(b_G)[:, None], _exp(b_last - b_G)[:, None]


# ------------------------------------------------------------------------------------------------
# the chunk-local gate cumsum
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


# ------------------------------------------------------------------------------------------------
# KDA: q ⊙ e^G and k ⊙ e^{G_last − G} for the state passes
# ------------------------------------------------------------------------------------------------

@triton.jit
def _gate_scaled_kernel(q, k, G, qd, kd, cu_seqlens, chunk_indices, T, H: tl.constexpr, HV: tl.constexpr,
                        K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Per-channel gate: qd = q ⊙ e^G, kd = k ⊙ e^{G_last − G} [B, T, HV, K] in the input dtype, what the serial
    state passes take as their products' 16-bit operands, formed once here instead of on their serial path (a
    [C, K] fp32 gate tile and two exponentials per element per chunk there)."""
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
# the forward state pass: S entering each chunk, and R = U − W S
# ------------------------------------------------------------------------------------------------

@triton.jit
def _seq_program(cu_seqlens, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, IS_VARLEN: tl.constexpr, TRANSPOSE: tl.constexpr):
    """Where a serial state pass's program of grid (cdiv(V, BV), N·HV) works: (value head i_h, its key head i_hk,
    the sequence's bounds bos, eos, first chunk slot boh and chunk count (_seq_bounds), the state tile's o_k [BK],
    o_v [BV], masks m_k, m_v, m_kv, and its offsets p0 [BK, BV] in an [N, HV, K, V] state (TRANSPOSE:
    [N, HV, V, K]))."""
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
    FULL: every chunk whole, L the constant C (_chunk_len)."""
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
    Issued a step ahead because Triton's software pipeline takes only loads that feed a product's operands: a tile
    that becomes a product's accumulator (dR_local in dR = dR_local + Kend dS') or a gate row scaling the state
    stays a plain load on the serial path."""
    t0 = bos + tl.maximum(i_c, 0) * C
    L = _chunk_len(t0, eos, C, 0)
    ok = (i_c >= 0) & (L > 0)
    if LOAD_X:
        o_t = tl.arange(0, C)
        m = _and(o_t < L, ok)[:, None] & (o_v < V)[None, :]
        b_x = tl.load(X + ((t0 + o_t).to(tl.int64)[:, None] * HV + i_h) * V + o_v[None, :], mask=m, other=0.)
    else:
        b_x = tl.zeros([C, BV], dtype=tl.float32)
    if LAST:
        o_k = tl.arange(0, BK)
        b_last = tl.load(G + ((t0 + L - 1).to(tl.int64) * HV + i_h) * K + o_k, mask=_and(o_k < K, ok), other=0.)
    else:
        b_last = tl.zeros([BK], dtype=tl.float32)
    return b_x, b_last


@triton.jit
def _fwd_h_step(k, v, G, W, U, h, R, b_S, i_c, bos, eos, boh, i_h, i_hk, o_v, H: tl.constexpr, HV: tl.constexpr,
                K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                GATE: tl.constexpr, DELTA: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr,
                KD_IN: tl.constexpr = 0, FULL: tl.constexpr = 0, STORE: tl.constexpr = 1):
    """One chunk of the forward state pass: store S (STORE), R = U − W S, S ← γ S + Kendᵀ R.
    LOWP: the products' operands in the 16-bit input dtype (S and R cast, fp32 accumulation), as the
    forward's serial stage does; else fp32 operands in PREC. KD_IN (per-channel gate, LOWP): k is
    _gate_scaled_kernel's kd [B, T, HV, K], already k ⊙ e^{G_last − G}."""
    o_t, o_k, m_t, m_k, m_v, m_kv, t0, L, rows = _step_tiles(bos, eos, i_c, o_v, K, V, BK, C, FULL)
    if STORE:
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
                  LOOP_WHILE: tl.constexpr, LOWP: tl.constexpr = 0, KD_IN: tl.constexpr = 0, FULL: tl.constexpr = 0,
                  ht=None, STORE_HT: tl.constexpr = 0):
    """h: [NC, HV, K, V], the state entering each chunk; R: [B, T, HV, V] (DELTA only), both in the dtype of their
    buffers (16-bit for 16-bit inputs). h0: [N, HV, K, V] ([N, HV, V, K] if TRANSPOSE). Where the forward saved R,
    the no-delta form runs with v = that R: S ← γ S + Kendᵀ R, no W / U. STORE_HT: each sequence's final state into
    ht [N, HV, K, V] fp32 (not TRANSPOSE), and nothing into h (simple GLA's split backward: segments' end states)."""
    i_h, i_hk, bos, eos, boh, NTs, o_k, o_v, m_k, m_v, m_kv, p0 = _seq_program(cu_seqlens, T, H, HV, K, V, BK, BV, C,
                                                                              IS_VARLEN, TRANSPOSE)
    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_S += tl.load(h0 + p0, mask=m_kv, other=0.).to(tl.float32)
    if LOOP_WHILE:  # the interpreter cannot take a loaded bound in range()
        i_c = 0
        while i_c < NTs:
            b_S = _fwd_h_step(k, v, G, W, U, h, R, b_S, i_c, bos, eos, boh, i_h, i_hk, o_v, H, HV, K, V, BK, BV, C,
                              GATE, DELTA, PREC, LOWP, KD_IN, FULL, not STORE_HT)
            i_c += 1
    else:
        for i_c in range(NTs):
            b_S = _fwd_h_step(k, v, G, W, U, h, R, b_S, i_c, bos, eos, boh, i_h, i_hk, o_v, H, HV, K, V, BK, BV, C,
                              GATE, DELTA, PREC, LOWP, KD_IN, FULL, not STORE_HT)
    if STORE_HT:
        tl.store(ht + p0, b_S, mask=m_kv)


# ------------------------------------------------------------------------------------------------
# the reverse state pass: dh (gradient of the state leaving each chunk), dR, dh0
# ------------------------------------------------------------------------------------------------

@triton.jit
def _bwd_dh_step(q, k, G, W, dRl, do, dh, dR, h, Rs, b_dS, b_S, b_dRl, b_lastp, i_c, bos, eos, boh, i_h, i_hk,
                 o_v, scale, unit, H: tl.constexpr,
                 HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 C: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr,
                 KD_IN: tl.constexpr = 0, AHEAD: tl.constexpr = 1, FULL: tl.constexpr = 0, REV_H: tl.constexpr = 0,
                 STORE: tl.constexpr = 1):
    """One chunk of the reverse state pass: store dS', dR = dR_local + Kend dS', dS = γ dS' + ...
    Returns (dS, S). REV_H (no gate): b_S is the state leaving the chunk; S ← S − Kᵀ R (R: the forward's, Rs) is
    the state entering it, stored to h, formed backwards from the final state. STORE 0: dS alone, nothing stored.
    LOWP: the products' operands in the 16-bit input dtype (see _fwd_h_step). KD_IN: q, k are
    _gate_scaled_kernel's qd, kd [B, T, HV, K]. b_dRl, b_lastp: this chunk's dR_local tile and (KD_IN) G_last,
    loaded a step ahead (_step_ahead) where AHEAD is 1, else loaded here."""
    o_t, o_k, m_t, m_k, m_v, m_kv, t0, L, rows = _step_tiles(bos, eos, i_c, o_v, K, V, BK, C, FULL)
    if STORE:
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
    if AHEAD != 1:
        b_dRl = tl.load(dRl + p_tv, mask=m_tv, other=0.)
    if AHEAD == 2:      # a runtime 1.0: the product cannot take dR_local as its accumulator
        b_kdS = b_kdS * unit
    b_dR = b_dRl.to(tl.float32) + b_kdS
    if STORE:
        tl.store(dR + p_tv, b_dR, mask=m_tv)
    if GATE == 2:
        b_dS *= _exp(b_last)[:, None]
    elif GATE == 1:
        b_dS *= _exp(b_last)
    b_dS += scale * _mm(tl.trans(b_q), b_do.to(op_dt), PREC)                       # [BK, C] @ [C, BV]
    if DELTA:
        b_w = tl.load(W + (rows[:, None] * HV + i_h) * K + o_k[None, :], mask=m_tk, other=0.).to(op_dt)
        b_dS -= _mm(tl.trans(b_w), b_dR.to(op_dt), PREC)                            # [BK, C] @ [C, BV]
    return b_dS, b_S


@triton.jit
def _bwd_dh_kernel(q, k, G, W, dRl, do, dht, dh, dR, dh0, h, cu_seqlens, T, scale, unit,
                   H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, C: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr,
                   HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr, TRANSPOSE: tl.constexpr,
                   IS_VARLEN: tl.constexpr, PREC: tl.constexpr, LOOP_WHILE: tl.constexpr, LOWP: tl.constexpr = 0,
                   KD_IN: tl.constexpr = 0, AHEAD: tl.constexpr = 1, FULL: tl.constexpr = 0, ht=None, Rs=None,
                   REV_H: tl.constexpr = 0, STORE: tl.constexpr = 1):
    """dR = dR_local + Kend dS';  dS = γ dS' + scale Qgᵀ dO − Wᵀ dR.
    REV_H (DeltaNet: no gate; the forward saved R and its final state): the states entering the chunks, h, formed
    here backwards from the final state ht (fp32, the state layout: [N, HV, K, V], TRANSPOSE [N, HV, V, K]),
    S_c = S_{c+1} − K_cᵀ R_c with the forward's R (Rs), instead of by a forward state pass.
    AHEAD: where the loop's serial path waits least on the dR_local tile (and KDA's G_last), per gate kind: 1,
    loaded a step ahead (_step_ahead); 0, in the step; 2, in the step with K dS' scaled by ``unit`` (1.0, a
    runtime value) so that the compiler cannot fold dR_local into the product as its accumulator (which leaves
    the load to the software pipeline).
    dh: [NC, HV, K, V]; dR: [B, T, HV, V] (16-bit for 16-bit inputs); dht, dh0 in the state layout (dh0 fp32).
    STORE 0 (a split backward's first reverse pass): dh0 alone."""
    i_h, i_hk, bos, eos, boh, NTs, o_k, o_v, m_k, m_v, m_kv, p0 = _seq_program(cu_seqlens, T, H, HV, K, V, BK, BV, C,
                                                                              IS_VARLEN, TRANSPOSE)
    b_dS = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        b_dS += tl.load(dht + p0, mask=m_kv, other=0.).to(tl.float32)
    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if REV_H:
        b_S += tl.load(ht + p0, mask=m_kv, other=0.)
    LAST: tl.constexpr = GATE == 2 and KD_IN and AHEAD == 1
    AH: tl.constexpr = AHEAD == 1          # dR_local's tile loaded a step ahead
    b_dRl, b_last = _step_ahead(dRl, G, NTs - 1, bos, eos, i_h, o_v, HV, K, V, BK, BV, C, AH, LAST)
    if LOOP_WHILE:  # the interpreter cannot take a loaded bound in range()
        i_c = NTs - 1
        while i_c >= 0:
            b_dRn, b_lastn = _step_ahead(dRl, G, i_c - 1, bos, eos, i_h, o_v, HV, K, V, BK, BV, C, AH, LAST)
            b_dS, b_S = _bwd_dh_step(q, k, G, W, dRl, do, dh, dR, h, Rs, b_dS, b_S, b_dRl, b_last, i_c, bos,
                                     eos, boh, i_h, i_hk, o_v, scale, unit, H, HV, K, V, BK, BV, C, GATE, DELTA, PREC,
                                     LOWP, KD_IN, AHEAD, FULL, REV_H, STORE)
            b_dRl, b_last = b_dRn, b_lastn
            i_c -= 1
    else:
        for i_r in range(NTs):
            b_dRn, b_lastn = _step_ahead(dRl, G, NTs - 2 - i_r, bos, eos, i_h, o_v, HV, K, V, BK, BV, C, AH, LAST)
            b_dS, b_S = _bwd_dh_step(q, k, G, W, dRl, do, dh, dR, h, Rs, b_dS, b_S, b_dRl, b_last,
                                     NTs - 1 - i_r, bos, eos, boh, i_h, i_hk, o_v, scale, unit, H, HV, K, V, BK, BV, C,
                                     GATE, DELTA, PREC, LOWP, KD_IN, AHEAD, FULL, REV_H, STORE)
            b_dRl, b_last = b_dRn, b_lastn
    if HAS_H0:
        tl.store(dh0 + p0, b_dS, mask=m_kv)


# ------------------------------------------------------------------------------------------------
# launchers
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Problem:
    """The backward's shapes and the launch arguments every stage shares."""
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int                  # sequences
    NT: int                 # chunks: the chunk-parallel grid's first axis
    NC: int                 # per-chunk state slots (common.chunk_slots)
    gate: int               # 0 none, 1 scalar, 2 per channel
    delta: bool
    cu_seqlens: torch.Tensor | None
    chunk_indices: torch.Tensor | None
    device: torch.device
    C: int = BT

    @staticmethod
    def of(q, v, g, beta, cu_seqlens, chunk_indices) -> Problem:
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        if cu_seqlens is not None:
            if chunk_indices is None:
                chunk_indices = prepare_chunk_indices(cu_seqlens, BT).to(q.device)
            N, NT = cu_seqlens.numel() - 1, chunk_indices.shape[0]
            cu_seqlens, chunk_indices = cu_seqlens.contiguous(), chunk_indices.contiguous()
        else:
            N, NT = B, cdiv(T, BT)
        return Problem(B, T, H, HV, K, V, N, NT, chunk_slots(N, T, cu_seqlens is not None), gate_kind(g),
                       beta is not None, cu_seqlens, chunk_indices, q.device)

    @property
    def BK(self) -> int:
        return _dim(self.K)

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def grid_c(self) -> tuple:
        """The chunk-parallel grid: (chunks, B·HV)."""
        return (self.NT, self.B * self.HV)

    def grid_s(self, plan) -> tuple:
        """The serial passes' grid: (value blocks, N·HV)."""
        return (cdiv(self.V, plan.bv), self.N * self.HV)

    @property
    def chunks(self) -> dict:
        return dict(cu_seqlens=self.cu_seqlens, chunk_indices=self.chunk_indices, T=self.T)

    @property
    def seqs(self) -> dict:
        return dict(cu_seqlens=self.cu_seqlens, T=self.T)

    def full(self, name: str, plan) -> bool:
        """Whether launch ``name`` takes FULL: named in plan.full and every chunk whole."""
        return name in plan.full and chunks_whole(self.T, self.varlen)

    def alloc(self, *shape, dtype=torch.float32) -> torch.Tensor:
        return _alloc(shape, dtype, self.device)


def gate_cumsum(g, p: Problem, plan) -> torch.Tensor:
    """The chunk-local cumulative gate G (fp32, g's shape), each token's gate clamped at G_FLOOR first."""
    G = p.alloc(*g.shape)
    _gate_cumsum_kernel[p.grid_c](g, G, floor=-G_FLOOR, HV=p.HV, K=p.K, BK=p.BK, C=p.C, PER_CHANNEL=p.gate == 2,
                                  IS_VARLEN=p.varlen, num_warps=plan.num_warps, num_stages=plan.num_stages, **p.chunks)
    return G


def gate_scaled(q, k, G, p: Problem, plan) -> tuple:
    """KDA: (q ⊙ e^G, k ⊙ e^{G_last − G}) [B, T, HV, K] in q's dtype, the state passes' operands."""
    qg, kg = p.alloc(p.B, p.T, p.HV, p.K, dtype=q.dtype), p.alloc(p.B, p.T, p.HV, p.K, dtype=q.dtype)
    _gate_scaled_kernel[p.grid_c](q, k, G, qg, kg, H=p.H, HV=p.HV, K=p.K, BK=p.BK, C=p.C, IS_VARLEN=p.varlen,
                                  **p.chunks)
    return qg, kg


def forward_state_pass(k, v, G, W, U, R, h0, p: Problem, plan, transpose: bool, beside: bool,
                       ends: bool = False) -> torch.Tensor:
    """The state entering each chunk, h [NC, HV, K, V] (and R = U − W S into R with the delta rule where W is given;
    without W, v is the forward's R or simple GLA's v). ``beside``: on a second stream beside the dR_local launch,
    at plan.num_warps so that that launch's programs fit beside it. ``ends``: instead of h, each sequence's final
    state [N, HV, K, V] fp32 (h0 not transposed)."""
    h = ht = None
    if ends:
        ht = p.alloc(p.N, p.HV, p.K, p.V)
    else:
        h = p.alloc(p.NC, p.HV, p.K, p.V, dtype=state_dtype(k.dtype))
    _fwd_h_kernel[p.grid_s(plan)](k, v, G, W, U, h0, h, R, H=p.H, HV=p.HV, K=p.K, V=p.V, BK=p.BK, BV=plan.bv, C=p.C,
                                  GATE=p.gate, DELTA=W is not None, HAS_H0=h0 is not None, TRANSPOSE=transpose,
                                  IS_VARLEN=p.varlen, PREC=plan.prec, LOOP_WHILE=INTERPRET, LOWP=plan.state_lowp,
                                  KD_IN=plan.kd_in, FULL=p.full("fwd_h", plan),
                                  num_warps=plan.num_warps if beside else plan.state_warps,
                                  num_stages=plan.fwd_h_stages, ht=ht, STORE_HT=ends, **p.seqs)
    return ht if ends else h


def reverse_state_pass(q, k, G, W, dRl, do, dht, h, h0, scale, p: Problem, plan, transpose: bool, ht=None, R=None,
                       store=True):
    """dh [NC, HV, K, V] (the gradient of the state leaving each chunk), dR [B, T, HV, V] and dh0 (fp32, where there
    is an initial state h0). With ``ht`` (DeltaNet's saved final state) and the saved ``R`` it also forms h backwards.
    q, k: KDA's gate-scaled ones where plan.kd_in. ``store`` False: dh0 alone (dh and dR None)."""
    sdt = state_dtype(do.dtype)
    dh = dR = None
    if store:
        dh, dR = p.alloc(p.NC, p.HV, p.K, p.V, dtype=sdt), p.alloc(p.B, p.T, p.HV, p.V, dtype=sdt)
    dh0 = None if h0 is None else p.alloc(*h0.shape)
    _bwd_dh_kernel[p.grid_s(plan)](q, k, G, W, dRl, do, dht, dh, dR, dh0, h, scale=scale, unit=1.0, H=p.H, HV=p.HV,
                                   K=p.K, V=p.V, BK=p.BK, BV=plan.bv, C=p.C, GATE=p.gate, DELTA=p.delta,
                                   HAS_DHT=dht is not None, HAS_H0=h0 is not None, TRANSPOSE=transpose,
                                   IS_VARLEN=p.varlen, PREC=plan.prec, LOOP_WHILE=INTERPRET, LOWP=plan.state_lowp,
                                   KD_IN=plan.kd_in, AHEAD=plan.dh_ahead, FULL=p.full("bwd_dh", plan),
                                   num_warps=plan.state_warps, num_stages=plan.bwd_dh_stages, ht=ht, Rs=R,
                                   REV_H=ht is not None, STORE=store, **p.seqs)
    return dh, dR, dh0
