"""The delta families' sequence split: one long sequence spread over the SMs (intra-GPU context parallelism).

Stage 2 walks each sequence's chunks serially, one program per (sequence, value head, value block): with a few value
heads and one long sequence most SMs idle. Each long sequence is cut into segments of whole chunks, and the forward
runs on the batch of segments (the pseudo batch) instead:

1. stage 1 as usual, on the pseudo batch (the segments' chunks are the sequence's chunks: every per-chunk tile and
   every token-indexed output is what the unsplit forward forms, in the same memory);
2. ``segment_state_kernel``: for every segment but each sequence's last, its transition S_out = M·S_in + N, both from
   the recurrence over the segment's chunks (N from S = 0 with the values, M from S = I with zero values: the
   columns of S are independent, so M and N are separate column blocks of one grid), parallel over segments;
3. ``segment_start_kernel``: each segment's entering state, S ← M·S + N from the sequence's initial state, serial over
   the segments of one sequence (one [K, K] × [K, BV] product per segment);
4. stage 2 as usual on the pseudo batch, every segment from its entering state: the output, and the final state of
   each sequence as its last segment's.

A dense batch whose length is a multiple of the segment is the pseudo batch [B·S, T / S] as it stands (a view); any
other batch becomes a varlen one, its index tensors formed on the device (``split_index_kernel``, no host sync; the
segment length comes from the shapes alone, so a segment count per sequence is known only on the device and the
grids are sized for the most segments the shapes allow).

The backward runs on the same batch of segments (chunk.chunk_bwd), each segment's exiting state's gradient from the
reverse combine (``segment_grads``). Simple GLA, whose forward keeps nothing, splits its backward alone: its
transitions are scalar decays (``decay_transitions``), its segments' end states come from a state pass.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import BT, G_FLOOR, INTERPRET, _alloc, _and, _dim, _first_cut, _mm_acc, cdiv, chunk_slots
from .gate import _chunk_decay, _step_gate


# ------------------------------------------------------------------------------------------------
# the pseudo batch
# ------------------------------------------------------------------------------------------------

@dataclass
class SplitBatch:
    """The batch of segments the split forward runs on, and where each sequence's segments sit in it.

    q, k, v, g, beta: views of the inputs as the pseudo batch ([B·S, T / S, ...], or [1, B·T, ...] varlen);
    cu_seqlens, chunk_indices: its offsets and chunk rows (None for a dense view); N: its sequences (varlen: the most
    the shapes allow, the unused ones empty at the end); nseg: segments per sequence of a dense view (0 varlen);
    pfirst [N0 + 1] int32 (varlen): sequence n's segments are pseudo sequences pfirst[n] .. pfirst[n + 1] − 1;
    nl2p [NL] int32 (varlen): the pseudo sequence of each segment that is not its sequence's last (−1: unused);
    NL: how many such segments the grids cover; N0: the caller's sequences."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor | None
    beta: torch.Tensor
    cu_seqlens: torch.Tensor | None
    chunk_indices: torch.Tensor | None
    N: int
    nseg: int
    pfirst: torch.Tensor | None
    nl2p: torch.Tensor | None
    NL: int
    N0: int

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens is not None

    def view(self, x: torch.Tensor) -> torch.Tensor:
        """A token-indexed [B, T, ...] tensor as the pseudo batch sees it."""
        return x.view(self.q.shape[0], self.q.shape[1], *x.shape[2:])


@triton.jit
def split_index_kernel(cu, ci, cu1, ci1, pfirst, nl2p, N, T, NT, n_rows, NP, NL, L, BTc: tl.constexpr,
                       DENSE: tl.constexpr, BLOCK: tl.constexpr, PHASE: tl.constexpr):
    """The pseudo batch's index tensors, segments of L chunks. PHASE 1 (one program): per sequence its segment count
    max(1, ⌈chunks / L⌉) and first pseudo sequence (pfirst, an exclusive scan), each first segment's start in cu1,
    the unused tail of cu1 (the total token count) and of nl2p (−1). PHASE 2 (grid over chunk rows): each chunk's row
    (pseudo sequence, chunk in it) in ci1, the other segments' starts in cu1, nl2p of every segment that is not its
    sequence's last. DENSE: the caller's batch is N dense rows of T tokens (NT chunks), cu and ci unused."""
    o = tl.arange(0, BLOCK)
    if PHASE == 1:
        carry = tl.zeros([], dtype=tl.int32)
        b = tl.zeros([], dtype=tl.int32)
        while b < N:        # (while loops: the interpreter takes no tensor bound in range(); nothing to pipeline)
            n = b + o
            m = n < N
            if DENSE:
                start = n * T
                length = tl.where(m, T, 0)
            else:
                start = tl.load(cu + n, mask=m, other=0)
                length = tl.load(cu + n + 1, mask=m, other=0) - start
            s = tl.where(m, tl.maximum((length + BTc * L - 1) // (BTc * L), 1), 0)
            first = tl.cumsum(s, 0) - s + carry
            tl.store(pfirst + n, first, mask=m)
            tl.store(cu1 + first, start, mask=m)
            carry += tl.sum(s, 0)
            b += BLOCK
        tl.store(pfirst + N, carry)
        if DENSE:
            total = N * T
        else:
            total = tl.load(cu + N)
        b = carry // BLOCK * BLOCK
        while b <= NP:
            p = b + o
            tl.store(cu1 + p, total + 0 * p, mask=(p >= carry) & (p <= NP))
            b += BLOCK
        b = (carry - N) // BLOCK * BLOCK
        while b < NL:
            i = b + o
            tl.store(nl2p + i, tl.full([BLOCK], -1, tl.int32), mask=(i >= carry - N) & (i < NL))
            b += BLOCK
    else:
        r = tl.program_id(0) * BLOCK + o
        m = r < n_rows
        if DENSE:
            n = r // NT
            c = r % NT
            start = n * T
        else:
            n = tl.load(ci + 2 * r, mask=m, other=0)
            c = tl.load(ci + 2 * r + 1, mask=m, other=0)
            start = tl.load(cu + n, mask=m, other=0)
        pf = tl.load(pfirst + n, mask=m, other=0)
        cnt = tl.load(pfirst + n + 1, mask=m, other=0) - pf
        j = c // L
        tl.store(ci1 + 2 * r, pf + j, mask=m)
        tl.store(ci1 + 2 * r + 1, c % L, mask=m)
        head = m & (c % L == 0)
        tl.store(cu1 + pf + j, start + c * BTc, mask=head & (j > 0))
        tl.store(nl2p + pf - n + j, pf + j, mask=head & (j < cnt - 1))


def pseudo_count(B: int, T: int, N0: int, varlen: bool, L: int) -> int:
    """Pseudo sequences of the split of N0 sequences (B rows of T tokens, or T in all varlen) into segments of L
    chunks, from the shapes alone: B·T / (L·BT) for a dense view, else N0 and at most one more per L of the
    chunks (Σ_n (⌈c_n / L⌉ − 1) <= Σ_n c_n / L, and Σ_n c_n <= N0 + T // BT: common.chunk_slots)."""
    if not varlen and T % (L * BT) == 0:
        return B * (T // (L * BT))
    return N0 + (N0 * cdiv(T, BT) if not varlen else chunk_slots(N0, T, True)) // L


def split_batch(q, k, v, g, beta, cu_seqlens, chunk_indices, seg_chunks: int) -> SplitBatch:
    """The pseudo batch of segments of ``seg_chunks`` chunks (the inputs contiguous, canonical; chunk_indices given
    with cu_seqlens)."""
    B, T = q.shape[0], q.shape[1]
    L = seg_chunks
    if cu_seqlens is None and T % (L * BT) == 0:        # equal segments: a dense view
        nseg = T // (L * BT)
        T1 = L * BT

        def dense_view(x):
            return None if x is None else x.view(B * nseg, T1, *x.shape[2:])
        return SplitBatch(dense_view(q), dense_view(k), dense_view(v), dense_view(g), dense_view(beta), None, None,
                          B * nseg, nseg, None, None, B * (nseg - 1), B)
    dense = cu_seqlens is None
    N0 = B if dense else cu_seqlens.numel() - 1
    NT = cdiv(T, BT)
    n_rows = N0 * NT if dense else chunk_indices.shape[0]
    NP = pseudo_count(B, T, N0, not dense, L)
    NL = NP - N0
    dev = q.device
    cu1 = torch.empty(NP + 1, dtype=torch.int32, device=dev)
    ci1 = torch.empty(max(n_rows, 1), 2, dtype=torch.int32, device=dev)[:n_rows]
    pfirst = torch.empty(N0 + 1, dtype=torch.int32, device=dev)
    nl2p = torch.empty(max(NL, 1), dtype=torch.int32, device=dev)
    args = (cu_seqlens, chunk_indices, cu1, ci1, pfirst, nl2p, N0, T, NT, n_rows, NP, NL, L)
    split_index_kernel[(1,)](*args, BTc=BT, DENSE=dense, BLOCK=256, PHASE=1)
    if n_rows:
        split_index_kernel[(cdiv(n_rows, 256),)](*args, BTc=BT, DENSE=dense, BLOCK=256, PHASE=2)

    def flat(x):
        return None if x is None else x.view(1, B * T, *x.shape[2:])
    return SplitBatch(flat(q), flat(k), flat(v), flat(g), flat(beta), cu1, ci1, NP, 0, pfirst, nl2p, NL, N0)


# ------------------------------------------------------------------------------------------------
# the segments' transitions
# ------------------------------------------------------------------------------------------------

@triton.jit
def _rows(x, bos, t0, T_seq, heads, i_h, D, R: tl.constexpr, C: tl.constexpr, TR: tl.constexpr = 0, c0=0):
    """Token rows t0 .. t0 + R − 1 of head i_h, columns c0 .. c0 + C − 1 of x [.., heads, D] (zero past the segment
    end and D), as [R, C], or transposed as [C, R] (TR)."""
    o_r = t0 + tl.arange(0, R)
    o_c = c0 + tl.arange(0, C)
    if TR:
        t = tl.load(x + ((bos + o_r[None, :]) * heads + i_h) * D + o_c[:, None],
                    mask=(o_r < T_seq)[None, :] & (o_c < D)[:, None], other=0.)
    else:
        t = tl.load(x + ((bos + o_r[:, None]) * heads + i_h) * D + o_c[None, :],
                    mask=(o_r < T_seq)[:, None] & (o_c < D)[None, :], other=0.)
    return t


@triton.jit
def _segment_step(i_t, St, b_gl, k, v, w, u, g, gcum, kg, slot0, bos, T_seq, i_h, i_hk, c0, vals, H, HV, K, V,
                  BTc: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, T_FORM: tl.constexpr,
                  DOT_PREC: tl.constexpr, g_floor: tl.constexpr):
    """One chunk of the state alone on Sᵀ [BV, BK] (stage 2's transposed step without its output)::

        Rᵀ = (Vᵀ − Sᵀ (K ⊙ e^G)ᵀ) (T diag(β))ᵀ   (T_FORM)      Rᵀ = Uᵀ − Sᵀ Wᵀ
        Sᵀ = e^{G_last} Sᵀ + Rᵀ (K ⊙ e^{G_last − G})

    value columns c0 .. c0 + BV − 1 where ``vals`` (N's blocks), else no values (M's blocks: vals false, no loads)."""
    t0 = i_t * BTc
    if GATE == 2:
        b_kd = _rows(kg, bos, t0, T_seq, HV, i_h, K, BTc, BK)
    else:
        b_kd = _rows(k, bos, t0, T_seq, H, i_hk, K, BTc, BK)
    T_vals = tl.where(vals, T_seq, 0)       # a zero row count: the value tiles' loads are masked off entirely
    if GATE == 1:
        Gc, b_dl, b_eg, b_ek = _step_gate(g, gcum, b_gl, slot0 + i_t, bos, t0, T_seq, i_h, HV, BTc, 1, g_floor)
    if T_FORM:
        if GATE == 2:
            b_kx = _rows(w, bos, t0, T_seq, HV, i_h, K, BTc, BK)
        else:
            b_kx = b_kd
        b_Zt = tl.dot(St.to(b_kx.dtype), tl.trans(b_kx), input_precision=DOT_PREC)      # [BV, BK] @ [BK, BT]
        if GATE == 1:
            b_Zt = b_Zt * b_eg[None, :]
        b_Zt = _rows(v, bos, t0, T_vals, HV, i_h, V, BTc, BV, 1, c0).to(tl.float32) - b_Zt
        b_T = _rows(u, bos, t0, T_seq, HV, i_h, BTc, BTc, BTc)
        b_Rt = tl.dot(b_Zt.to(b_T.dtype), tl.trans(b_T), input_precision=DOT_PREC)       # [BV, BT] @ [BT, BT]
    else:
        b_w = _rows(w, bos, t0, T_seq, HV, i_h, K, BTc, BK)
        b_Rt = _rows(u, bos, t0, T_vals, HV, i_h, V, BTc, BV, 1, c0).to(tl.float32) - \
            tl.dot(St.to(b_w.dtype), tl.trans(b_w), input_precision=DOT_PREC)             # [BV, BK] @ [BK, BT]
    if GATE == 1:
        St = St * b_dl
        b_Rt = b_Rt * b_ek[None, :]
    elif GATE == 2:
        St = St * b_gl[None, :]
    St += tl.dot(b_Rt.to(b_kd.dtype), b_kd, input_precision=DOT_PREC)                      # [BV, BT] @ [BT, BK]
    return St


@triton.jit
def _segment_chunk(i_t, n_chunks, St, b_gl, k, v, w, u, g, gcum, glast, kg, slot0, bos, T_seq, i_h, i_hk, c0,
                   vals, H, HV, K, V, BTc: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr,
                   T_FORM: tl.constexpr, DOT_PREC: tl.constexpr, g_floor: tl.constexpr):
    """The chunk loop's body (both loops of segment_state_kernel): chunk i_t's step with its decay b_gl, loaded the
    chunk before; the next chunk's loaded ahead of the step. Returns (Sᵀ, the next chunk's b_gl)."""
    b_gl_next = _chunk_decay(glast, slot0, i_t + 1, n_chunks, i_h, HV, K, BK, GATE, GATE == 1)
    St = _segment_step(i_t, St, b_gl, k, v, w, u, g, gcum, kg, slot0, bos, T_seq, i_h, i_hk, c0, vals,
                       H, HV, K, V, BTc, BK, BV, GATE, T_FORM, DOT_PREC, g_floor)
    return St, b_gl_next


@triton.jit(do_not_specialize=["T", "NT", "NSEG", "NL", "H", "HV"])
def segment_state_kernel(
    k, v, w, u, g, gcum, glast, kg,   # the pseudo batch's k, v and stage 1's outputs (stage 2's operands)
    nf,                               # stage 1's [slots, HV] int32: each chunk's first row with a non-finite input
    nn, mm,                           # out, fp32: N [NL, HV, K, V] by transition, M [pseudo seqs, HV, K, K] by segment
    nl2p, pfirst, cu,                 # varlen: SplitBatch's
    T, NT, NSEG, NL, H, HV, K, V,
    BTc: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, T_FORM: tl.constexpr,
    USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, g_floor: tl.constexpr,
    LOOP_WHILE: tl.constexpr, EVERY_M: tl.constexpr = 0,
):
    """Grid (⌈V / BV⌉ + ⌈K / BV⌉, NL·HV): program (c, l·HV + h) runs segment l (not its sequence's last) of value head
    h over its chunks, on value columns c (c < ⌈V / BV⌉: N's, from S = 0 with the values) or on columns c − ⌈V / BV⌉
    of M (from S = I, no values), and stores that block (N at l, M at the segment's pseudo sequence). M of a
    sequence's first segment only with an initial state (USE_H0; without one the first segment's end state is N).
    EVERY_M (a saving forward: the backward's reverse combine reads M of every segment but a first one): N0·HV more
    programs on axis 1, l = NL + n forming M of sequence n's last segment where it is not also its first."""
    i_c, i_lh = tl.program_id(0), tl.program_id(1)
    i_l, i_h = i_lh // HV, i_lh % HV
    i_hk = i_h // (HV // H)
    nvb = (V + BV - 1) // BV
    is_m = i_c >= nvb
    if EVERY_M and i_l >= NL:       # sequence i_l − NL's last segment
        if IS_VARLEN:
            p = tl.load(pfirst + i_l - NL + 1) - 1
            first = p == tl.load(pfirst + i_l - NL)
        else:
            p = (i_l - NL + 1) * NSEG - 1
            first = NSEG == 1
        run = is_m & ~first
    else:
        if IS_VARLEN:
            p = tl.load(nl2p + i_l)
            i_n = p - i_l                   # (each sequence before has exactly one segment more than its transitions)
            first = p == tl.load(pfirst + i_n, mask=p >= 0, other=-1)
        else:
            i_n = i_l // (NSEG - 1)
            p = i_n * NSEG + i_l % (NSEG - 1)
            first = i_l % (NSEG - 1) == 0
        run = p >= 0
        if not USE_H0:
            run = run & ~(is_m & first)
    if run:
        if IS_VARLEN:
            bos = tl.load(cu + p).to(tl.int64)
            eos = tl.load(cu + p + 1).to(tl.int64)
            slot0 = p + bos // BTc
        else:
            bos = p.to(tl.int64) * T
            eos = bos + T
            slot0 = p.to(tl.int64) * NT
        T_seq = (eos - bos).to(tl.int32)
        n_chunks = (T_seq + BTc - 1) // BTc
        c0 = tl.where(is_m, (i_c - nvb) * BV, i_c * BV)
        o_c = c0 + tl.arange(0, BV)
        o_k = tl.arange(0, BK)
        St = tl.where(is_m & (o_c[:, None] == o_k[None, :]), 1., 0.).to(tl.float32)     # [BV, BK]: Mᵀ's rows
        vals = ~is_m
        b_gl = _chunk_decay(glast, slot0, 0, n_chunks, i_h, HV, K, BK, GATE, GATE == 1)
        if LOOP_WHILE:      # the triton 3.6 interpreter cannot take a tensor bound in range()
            i_t = 0
            while i_t < n_chunks:
                St, b_gl = _segment_chunk(
                    i_t, n_chunks, St, b_gl, k, v, w, u, g, gcum, glast, kg, slot0, bos, T_seq, i_h, i_hk,
                    c0, vals, H, HV, K, V, BTc, BK, BV, GATE, T_FORM, DOT_PREC, g_floor)
                i_t += 1
        else:
            for i_t in range(0, n_chunks):
                St, b_gl = _segment_chunk(
                    i_t, n_chunks, St, b_gl, k, v, w, u, g, gcum, glast, kg, slot0, bos, T_seq, i_h, i_hk,
                    c0, vals, H, HV, K, V, BTc, BK, BV, GATE, T_FORM, DOT_PREC, g_floor)
        # a non-finite input leaves the transition non-finite by itself, except what stage 1 took as 0 (g, β) and
        # cut: then the whole transition is NaN, so that every later segment's outputs are
        St = tl.where(_first_cut(nf, slot0, 0, n_chunks, i_h, HV, BTc) < BTc, float("nan"), St)
        m_k = (o_k < K)[None, :]
        base = (i_l.to(tl.int64) * HV + i_h) * K
        tl.store(nn + (base + o_k[None, :]) * V + o_c[:, None], St, mask=_and(m_k & (o_c < V)[:, None], vals))
        base = (p.to(tl.int64) * HV + i_h) * K
        tl.store(mm + (base + o_k[None, :]) * K + o_c[:, None], St, mask=_and(m_k & (o_c < K)[:, None], is_m))


# ------------------------------------------------------------------------------------------------
# the segments' entering states
# ------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["NSEG", "HV"])
def segment_start_kernel(h0, nn, mm, hs, pfirst, NSEG, s_h0n, s_h0h, s_h0k, s_h0v, HV, K, V,
                         BK: tl.constexpr, BV: tl.constexpr, MM_PREC: tl.constexpr, USE_H0: tl.constexpr,
                         IS_VARLEN: tl.constexpr, LOOP_WHILE: tl.constexpr, REVERSE: tl.constexpr = 0):
    """Grid (⌈V / BV⌉, N0·HV): sequence n's segments' entering states into hs [pseudo sequences, HV, K, V] fp32, in
    order: the first the initial state h0 (zero without one), each next M·S + N of the one before. The state stays in
    registers; the loads of M and N do not depend on it, so the compiled loop's pipeline fetches the next segment's
    while this one's product runs.
    REVERSE (the backward): the gradients of the segments' exiting states instead, last to first: the last one's
    h0 (the final state's gradient, zero without one), each one before Mᵀ·dS + N of the one after (its gradient of
    the entering state from a zero exiting one: nn [pseudo sequences, HV, K, V])."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    if IS_VARLEN:
        p0 = tl.load(pfirst + i_n)
        cnt = tl.load(pfirst + i_n + 1) - p0
    else:
        p0 = i_n * NSEG
        cnt = NSEG + 0 * p0
    l0 = p0 - i_n                           # the sequence's first segment among those with a transition
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    m_kk = (o_k < K)[:, None] & (o_k < K)[None, :]
    off = o_k[:, None] * V + o_v[None, :]
    if USE_H0:
        S = tl.load(h0 + i_n * s_h0n + i_h * s_h0h + o_k[:, None] * s_h0k + o_v[None, :] * s_h0v, mask=m_kv,
                    other=0.).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    if REVERSE:
        tl.store(hs + ((p0 + cnt - 1).to(tl.int64) * HV + i_h) * K * V + off, S, mask=m_kv)
    else:
        tl.store(hs + (p0.to(tl.int64) * HV + i_h) * K * V + off, S, mask=m_kv)
    if LOOP_WHILE:          # the triton 3.6 interpreter cannot take a tensor bound in range()
        j = tl.zeros([], dtype=tl.int32)
        while j < cnt - 1:
            S = _segment_start_step(j, S, nn, mm, hs, p0, l0, cnt, i_h, HV, K, V, off, m_kv, m_kk, o_k, o_v, MM_PREC,
                                    USE_H0, REVERSE)
            j += 1
    else:
        for j in range(0, cnt - 1):
            S = _segment_start_step(j, S, nn, mm, hs, p0, l0, cnt, i_h, HV, K, V, off, m_kv, m_kk, o_k, o_v, MM_PREC,
                                    USE_H0, REVERSE)


@triton.jit
def _segment_start_step(j, S, nn, mm, hs, p0, l0, cnt, i_h, HV, K, V, off, m_kv, m_kk, o_k, o_v,
                        MM_PREC: tl.constexpr, USE_H0: tl.constexpr, REVERSE: tl.constexpr):
    """The entering state of segment j + 1 from segment j's (S) and transition: M·S + N, stored, returned
    (REVERSE: the exiting state's gradient of segment cnt − 2 − j from that of the one after, Mᵀ·dS + N)."""
    if REVERSE:
        i_p = (p0 + cnt - 1 - j).to(tl.int64)
        b_n = tl.load(nn + ((i_p * HV + i_h) * K + o_k[:, None]) * V + o_v[None, :], mask=m_kv, other=0.)
        b_m = tl.load(mm + ((i_p * HV + i_h) * K + o_k[None, :]) * K + o_k[:, None], mask=m_kk, other=0.)  # Mᵀ
        S_next = _mm_acc(b_n, b_m, S, MM_PREC)                          # [BK, BK] @ [BK, BV]
        tl.store(hs + ((i_p - 1) * HV + i_h) * K * V + off, S_next, mask=m_kv)
    else:
        i_l = (l0 + j).to(tl.int64)
        i_p = (p0 + j).to(tl.int64)
        b_n = tl.load(nn + ((i_l * HV + i_h) * K + o_k[:, None]) * V + o_v[None, :], mask=m_kv, other=0.)
        b_m = tl.load(mm + ((i_p * HV + i_h) * K + o_k[:, None]) * K + o_k[None, :], mask=m_kk, other=0.)
        S_next = _mm_acc(b_n, b_m, S, MM_PREC)                          # [BK, BK] @ [BK, BV]
        if not USE_H0:      # a first segment's M is not formed without an initial state: its end state is N
            S_next = tl.where(j == 0, b_n, S_next)
        tl.store(hs + ((p0 + j + 1).to(tl.int64) * HV + i_h) * K * V + off, S_next, mask=m_kv)
    return S_next


# ------------------------------------------------------------------------------------------------
# launchers
# ------------------------------------------------------------------------------------------------

def segment_starts(sb: SplitBatch, stage1: dict, g, initial_state, transpose_state_layout: bool, gate: int,
                   t_form: bool, dot_prec: str, mm_prec: str, HV: int, K: int, V: int,
                   launch: tuple, combine_at: tuple, every_m: bool = False) -> tuple:
    """(hs, mm): every segment's entering state, hs [sb.N, HV, K, V] fp32 (stage 2's initial states for the pseudo
    batch), and the transitions M [sb.N, HV, K, K] fp32 that the combine read, from stage 1's ``stage1`` dict on the
    pseudo batch. ``launch``, ``combine_at``: the segment pass's and the combine's (value block, warps, pipeline
    depth). ``every_m`` (a saving forward): M of every segment but a first one, the backward's reverse combine
    (segment_grads) reads them."""
    H = sb.q.shape[2]
    T, NT = sb.q.shape[1], cdiv(sb.q.shape[1], BT)
    dev = sb.q.device
    nn = _alloc((max(sb.NL, 1), HV, K, V), torch.float32, dev)
    mm = _alloc((sb.N, HV, K, K), torch.float32, dev)
    bv, warps, stages = launch
    args = (sb.k, sb.v, stage1["w"], stage1["u"], g, stage1["gcum"], stage1["glast"], stage1["kg"], stage1["nf"], nn,
            mm, sb.nl2p, sb.pfirst, sb.cu_seqlens, T, NT, sb.nseg, sb.NL, H, HV, K, V)
    rows = sb.NL + (sb.N0 if every_m else 0)
    if sb.NL > 0:
        segment_state_kernel[(cdiv(V, bv) + cdiv(K, bv), rows * HV)](
            *args, BTc=BT, BK=_dim(K), BV=bv, GATE=gate, T_FORM=t_form, USE_H0=initial_state is not None,
            IS_VARLEN=sb.varlen, DOT_PREC=dot_prec, g_floor=G_FLOOR, LOOP_WHILE=INTERPRET, EVERY_M=every_m,
            num_warps=warps, num_stages=stages)
    return combine(sb, initial_state, nn, mm, transpose_state_layout, mm_prec, combine_at), mm


def _combine(sb: SplitBatch, s0, nn, mm, out, transpose_state_layout: bool, mm_prec: str, launch: tuple,
             reverse: int):
    """segment_start_kernel over every sequence: from s0 (the initial state, or REVERSE the final state's gradient;
    None: zero), the segments' entering states (or exiting states' gradients) into out [sb.N, HV, K, V]; ``launch``:
    (value block, warps, pipeline depth)."""
    HV, K, V = out.shape[1], out.shape[2], out.shape[3]
    s = (0, 0, 0, 0)
    if s0 is not None:
        sn, sh, s2, s3 = s0.stride()
        s = (sn, sh, s3, s2) if transpose_state_layout else (sn, sh, s2, s3)
    bv, warps, stages = launch
    segment_start_kernel[(cdiv(V, bv), sb.N0 * HV)](
        s0, nn, mm, out, sb.pfirst, sb.nseg, *s, HV, K, V, BK=_dim(K), BV=bv, MM_PREC=mm_prec,
        USE_H0=s0 is not None, IS_VARLEN=sb.varlen, LOOP_WHILE=INTERPRET, REVERSE=reverse, num_warps=warps,
        num_stages=stages)


def segment_grads(sb: SplitBatch, nq: torch.Tensor, mm: torch.Tensor, dht, transpose_state_layout: bool,
                  mm_prec: str, launch: tuple) -> torch.Tensor:
    """The backward's reverse combine: the gradient of every segment's exiting state, [sb.N, HV, K, V] fp32, from
    the final states' gradient dht ([N0, HV, K, V], [N0, HV, V, K] transposed, or None), each segment's gradient of
    its entering state from a zero exiting one (nq [sb.N, HV, K, V]: a reverse state pass without dht) and the
    transitions mm (segment_starts(every_m=True)); ``launch`` as _combine's."""
    dxs = _alloc(nq.shape, torch.float32, nq.device)
    _combine(sb, dht, nq, mm, dxs, transpose_state_layout, mm_prec, launch, 1)
    return dxs


def decay_transitions(sb: SplitBatch, g: torch.Tensor, K: int) -> torch.Tensor:
    """Simple GLA's segment transitions, M = e^{Σ g} · I [sb.N, HV, K, K] fp32: its state only decays by the scalar
    gate, so a segment's M is the product of its tokens' decays (each gate clamped at G_FLOOR, as the kernels take it;
    summed in fp64). g: the pseudo batch's gate [.., .., HV]."""
    HV = g.shape[2]
    g = g.double().clamp(min=G_FLOOR)           # (NaN passes: the segment's M, and what follows it, turn NaN)
    if sb.varlen:       # each token's segment from the pseudo batch's offsets, on the device
        tokens = torch.arange(g.shape[1], device=g.device, dtype=sb.cu_seqlens.dtype)
        seg = torch.searchsorted(sb.cu_seqlens[1:], tokens, right=True)
        total = torch.zeros(sb.N, HV, dtype=torch.float64, device=g.device).index_add_(0, seg, g[0])
    else:
        total = g.sum(1)
    return torch.diag_embed(total.exp().float()[..., None].expand(sb.N, HV, K))


def transition_rows(sb: SplitBatch, ends: torch.Tensor) -> torch.Tensor:
    """The end states from zero ends [sb.N, HV, K, V] of the segments that are not their sequence's last, in the
    order the forward combine reads its N (segment_start_kernel)."""
    if sb.varlen:
        return ends.index_select(0, sb.nl2p.clamp(min=0).long())
    return ends.view(sb.N0, sb.nseg, *ends.shape[1:])[:, :-1].reshape(-1, *ends.shape[1:])


def combine(sb: SplitBatch, s0, nn, mm, transpose_state_layout: bool, mm_prec: str, launch: tuple) -> torch.Tensor:
    """Every segment's entering state [sb.N, HV, K, V] fp32 from the initial state s0 (None: zero), the transitions'
    N (transition_rows) and M; ``launch`` as _combine's."""
    hs = _alloc((sb.N, *nn.shape[1:]), torch.float32, nn.device)
    _combine(sb, s0, nn, mm, hs, transpose_state_layout, mm_prec, launch, 0)
    return hs


def first_states(sb: SplitBatch, xs: torch.Tensor, transpose_state_layout: bool) -> torch.Tensor:
    """Each sequence's first segment's row of a per-segment state xs [sb.N, HV, K, V] as [N0, HV, K, V] ([N0, HV,
    V, K] transposed): the backward's dh0."""
    if sb.varlen:
        first = xs.index_select(0, sb.pfirst[:-1].long())
    else:
        first = xs.view(sb.N0, sb.nseg, *xs.shape[1:])[:, 0]
    return (first.transpose(-1, -2) if transpose_state_layout else first).contiguous()


def final_states(sb: SplitBatch, hs: torch.Tensor, ht: torch.Tensor, transpose_state_layout: bool):
    """Each sequence's final state into ht [N0, HV, K, V] ([N0, HV, V, K] transposed): its last segment's, from hs
    (where stage 2 stored the pseudo batch's final states)."""
    if sb.varlen:
        last = hs.index_select(0, (sb.pfirst[1:] - 1).long())
    else:
        last = hs.view(sb.N0, sb.nseg, *hs.shape[1:])[:, -1]
    ht.copy_(last.transpose(-1, -2) if transpose_state_layout else last)
