"""The gate's chunk-local cumulative sums, G = cumsum(max(g, G_FLOOR)) within each 64-token chunk, as the stages
take them: a scalar gate's G per chunk (stage 1, or stage 2 when stage 1 did not hand it over), its decay over a
chunk (stage 2's serial loop), and the 16-token block starts of a per-channel gate (KDA's pairwise products).

Every exponential the kernels take of a gate is of a non-positive number, e^{G_i − G_j} with i ≥ j, or of a factor
around a reference point whose span is bounded (docs/design.md).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import _and, _by_block, _exp, _row_of


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
def _block_starts(b_G, BTc: tl.constexpr, BCc: tl.constexpr):
    """The 16-token blocks of a per-channel chunk gate b_G [BT, BKC]: (G at the ends of the first three
    blocks e0, e1, e2 [BKC]; each row's block start s_b (G before its block, 0 for the first) [BT, BKC];
    each block's most negative G_i − s_b, that is minus its widest span over the channels [BT // BC])."""
    e0 = _row_of(b_G, BCc - 1, BTc)
    e1 = _row_of(b_G, 2 * BCc - 1, BTc)
    e2 = _row_of(b_G, 3 * BCc - 1, BTc)
    zero = tl.zeros_like(e0)
    s_rows = _by_block(zero[None, :], e0[None, :], e1[None, :], e2[None, :], BTc, BCc)
    NB: tl.constexpr = BTc // BCc
    return e0, e1, e2, s_rows, tl.min(tl.reshape(tl.min(b_G - s_rows, 1), [NB, BCc]), 1)


@triton.jit
def _chunk_decay(glast, slot0, i_t, c1, i_h, HV, K, BK: tl.constexpr, GATE: tl.constexpr, GC_IN: tl.constexpr):
    """Chunk i_t's decay from stage 1 (zero past c1): e^{G_last} [BK] (per-channel gate), G_last (scalar gate
    with GC_IN), else a dummy 0. Loaded one chunk ahead by the serial loop: a load the software pipeline does
    not take (not a product's operand) would otherwise expose its latency on every chunk."""
    o_k = tl.arange(0, BK)
    if GATE == 2:
        b_gl = tl.load(glast + ((slot0 + i_t) * HV + i_h) * K + o_k, mask=_and(o_k < K, i_t < c1), other=0.)
    elif GC_IN:
        b_gl = tl.load(glast + (slot0 + i_t) * HV + i_h, mask=i_t < c1, other=0.)
    else:
        b_gl = tl.zeros([], dtype=tl.float32)
    return b_gl


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
