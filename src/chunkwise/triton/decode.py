"""The token-recurrent Triton kernel: decode (T = 1), speculative decoding (small T), any T.

One program per (sequence n, value head h, block of BV value columns). It holds its tile of the
state, S[:, block] ∈ R^{K×BV} in fp32, in registers, reads it once, steps over the tokens of the
sequence and writes it once::

    S' = diag(exp(g_t)) · S_{t-1}                        g_t scalar or per key channel, or absent
    delta rule:   S_t = S' + k_t · (β_t · (v_t − S'ᵀ k_t))ᵀ
    no delta:     S_t = S' + k_t · v_tᵀ                  (simple GLA / Mamba2 SSD)
    o_t = scale · S_tᵀ q_t

The columns of S are independent in every line above (S'ᵀ k_t is one number per column), so
splitting V across programs costs nothing but re-reading q_t and k_t (K values each), and lets a
batch-1 decode of 32 heads spread over many SMs.

State addressing: the state is read and written through four strides per tensor, as a logical
[N, HV, K, V] array, so the [N, HV, V, K] layout (``transpose_state_layout``) is the same kernel
with two strides swapped. With ``state_indices`` (vLLM-style pool) sequence n reads and writes
pool slot ``state_indices[n]`` in place, in the pool's dtype; slot -1 is a padding sequence: every
load of it is masked off, so its state stays 0, its outputs are written as exact zeros and nothing
is stored to the pool.

Speed (decode is a stream of the state through registers: read 4·K·V bytes, write them back): the
token loop is a software-pipelined ``tl.range`` on the GPU, so the small loads of the first token
(q, k, v, g, β) are issued with the state load instead of costing one global round trip each (their
layout conversions otherwise serialise them); under the interpreter it is a while loop (triton 3.6
with numpy 2 cannot take tensor loop bounds there). Launch configuration: `_launch_config`; its
measurements: docs/performance.md.

Autograd: like fla's fused_recurrent, this kernel has no backward. When grad is enabled and an
input requires it, `recurrent` runs the differentiable PyTorch token recurrence
(chunkwise.reference.recurrent.recurrent_forward) in fp32 on the same device instead.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .common import _and, cdiv, next_pow2, on_tensor_device

GATE_NONE, GATE_SCALAR, GATE_CHANNEL = 0, 1, 2


@triton.jit
def _token_step(b_h, p_q, p_k, p_v, p_g, p_beta, m_k, m_v, live, scale,
                GATE: tl.constexpr, DELTA: tl.constexpr, FUSED: tl.constexpr):
    """One token on the state tile b_h [BK, BV] fp32. Returns (S_t tile, o_t block [BV] fp32)."""
    b_q = tl.load(p_q, mask=m_k, other=0., eviction_policy="evict_last").to(tl.float32) * scale   # [BK]
    b_k = tl.load(p_k, mask=m_k, other=0., eviction_policy="evict_last").to(tl.float32)           # [BK]
    b_v = tl.load(p_v, mask=m_v, other=0., eviction_policy="evict_first").to(tl.float32)          # [BV]
    if GATE == 1:
        b_d = tl.exp(tl.load(p_g, mask=live, other=0.).to(tl.float32))                           # scalar
    if GATE == 2:
        b_dk = tl.exp(tl.load(p_g, mask=m_k, other=0.).to(tl.float32))                           # [BK]
    if DELTA:
        b_beta = tl.load(p_beta, mask=live, other=0.).to(tl.float32)                             # scalar
    if FUSED:
        # one pass over S for both products, S read before its update:
        #   a = S'ᵀ k,  b = S'ᵀ q,  u = β (v − a) (or v),  o = b + (kᵀq) u,  S_t = S' + k uᵀ
        if GATE == 2:
            b_kd, b_qd = b_k * b_dk, b_q * b_dk
        else:
            b_kd, b_qd = b_k, b_q
        b_b = tl.sum(b_h * b_qd[:, None], 0)                                 # [BV]
        if GATE == 1:
            b_b *= b_d
        if DELTA:
            b_a = tl.sum(b_h * b_kd[:, None], 0)                             # [BV], independent of b_b
            if GATE == 1:
                b_a *= b_d
            b_u = b_beta * (b_v - b_a)
        else:
            b_u = b_v
        b_o = b_b + tl.sum(b_k * b_q) * b_u                                  # S_tᵀ (scale q_t): [BV]
        if GATE == 1:
            b_h = b_h * b_d + b_k[:, None] * b_u[None, :]
        elif GATE == 2:
            b_h = b_h * b_dk[:, None] + b_k[:, None] * b_u[None, :]
        else:
            b_h += b_k[:, None] * b_u[None, :]
    else:
        # the recurrence as written: decay, delta correction, rank-1 update, read-out
        if GATE == 1:
            b_h *= b_d
        if GATE == 2:
            b_h *= b_dk[:, None]
        if DELTA:
            b_v = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))             # β (v − S'ᵀ k): [BV]
        b_h += b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0)                                  # S_tᵀ (scale q_t): [BV]
    return b_h, b_o


@triton.jit
def _token(i_t, bos, b_h, p_q, p_k, p_v, p_o, p_g, p_beta, p_i, m_k, m_v, m_h, o_v, live, scale, T_buf, s_i_t,
           H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, GATE: tl.constexpr,
           DELTA: tl.constexpr, FUSED: tl.constexpr, STORE_INTER: tl.constexpr, EVICT: tl.constexpr):
    """The token loop's body (both loops of recurrent_fwd_kernel): token i_t's step, its output (and with STORE_INTER
    its state) stored, the pointers moved on to the next token. EVICT: o's eviction policy. Returns (S_t tile, p_q,
    p_k, p_v, p_o, p_g, p_beta)."""
    b_h, b_o = _token_step(b_h, p_q, p_k, p_v, p_g, p_beta, m_k, m_v, live, scale, GATE, DELTA, FUSED)
    tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=o_v < V, eviction_policy=EVICT)    # padding sequences: exact 0
    if STORE_INTER:
        m_i = _and(m_h, i_t - bos < T_buf)
        tl.store(p_i + (i_t - bos) * s_i_t, b_h.to(p_i.dtype.element_ty), mask=m_i)
    p_q += H * K
    p_k += H * K
    p_v += HV * V
    p_o += HV * V
    if GATE == 1:
        p_g += HV
    if GATE == 2:
        p_g += HV * K
    if DELTA:
        p_beta += HV
    return b_h, p_q, p_k, p_v, p_o, p_g, p_beta


@triton.jit
def _onto_grid(b_q, QMAX: tl.constexpr, QUANT: tl.constexpr):
    """A tile scaled by its rows' QMAX / absmax -> the values the 8-bit format holds exactly (the cast after it is
    then exact), as chunkwise.reference.recurrent.quantize rounds: half up, on the int8 or the e4m3 grid."""
    b_q = tl.minimum(tl.maximum(b_q, -QMAX), QMAX)    # an fp32 rounding above QMAX would be NaN in e4m3
    if QUANT == 1:
        b_q = tl.floor(b_q + 0.5)
    else:   # onto the e4m3 grid (3 mantissa bits, subnormal below 2^-6) first: the cast is then exact
        b_step = tl.exp2(tl.floor(tl.log2(tl.maximum(tl.abs(b_q), 0.015625))) - 3.)
        b_q = tl.floor(b_q / b_step + 0.5) * b_step
    return b_q


@triton.jit(do_not_specialize=["T", "n_slots", "T_buf"])
def recurrent_fwd_kernel(
    q,              # [B, T, H, K]  contiguous, fp16/bf16/fp32
    k,              # [B, T, H, K]
    v,              # [B, T, HV, V]
    g,              # None | [B, T, HV] fp32 | [B, T, HV, K] fp32
    beta,           # None | [B, T, HV]
    o,              # [B, T, HV, V]  output, q's dtype
    h0,             # None | state read, logical [N or P, HV, K, V] through strides s_h0_*
    ht,             # None | state written, logical [N or P, HV, K, V] through strides s_ht_* (may alias h0)
    cu_seqlens,     # None | [N + 1] int
    state_indices,  # None | [N] int, -1 = padding sequence
    n_slots,        # pool size P (with state_indices): an index outside [0, P) is treated as padding
    inter,          # None | per-token states, logical [N, T_buf, HV, K, V] through strides s_i_* (verify step)
    T_buf,          # inter's token dim: tokens past it are not written (never a write outside the buffer)
    scales,         # None | 8-bit pool's scales [P, HV, R] fp32, one per stored row (R = K, or V transposed)
    s_sc_n, s_sc_h,
    scale,
    T,
    s_h0_n, s_h0_h, s_h0_k, s_h0_v,
    s_ht_n, s_ht_h, s_ht_k, s_ht_v,
    s_i_n, s_i_t, s_i_h, s_i_k, s_i_v,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GATE: tl.constexpr,             # 0 none, 1 scalar per (token, head), 2 per key channel
    DELTA: tl.constexpr,
    USE_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
    STORE_INTER: tl.constexpr,      # write the state after every token into inter
    QUANT: tl.constexpr,            # 8-bit pool: 0 none, 1 int8, 2 fp8 e4m3 (value = stored · scale of its row)
    QMAX: tl.constexpr,             # 127 (int8) or 448 (e4m3): a row's absmax is stored as QMAX
    SCALE_ON_K: tl.constexpr,       # the scale's row is a key row k ([K, V] layout), else a value row v
    IS_VARLEN: tl.constexpr,
    USE_INDICES: tl.constexpr,
    FUSED: tl.constexpr,            # both products of S in one pass (see _token_step)
    STREAM: tl.constexpr,           # streaming cache hints on the state load / store
    PIPELINE: tl.constexpr,         # num_stages of the pipelined token loop; 0: a while loop (interpreter)
):
    NV: tl.constexpr = (V + BV - 1) // BV
    i_nhv = tl.program_id(0).to(tl.int64)
    i_v, i_nh = i_nhv % NV, i_nhv // NV
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)

    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n * T
        eos = bos + T

    # which state slot: the sequence's own, or its pool slot (-1: padding, everything masked off)
    if USE_INDICES:
        i_s = tl.load(state_indices + i_n).to(tl.int64)
        live = (i_s >= 0) & (i_s < n_slots)         # out of range: never a write outside the pool
        i_s = tl.where(live, i_s, 0)
    else:
        i_s = i_n
        live = i_n >= 0  # always true

    # the tile masks as bounds (K, V, or 0 for a padding sequence): `vector & scalar-bool` is
    # typed int32 by the triton 3.9 interpreter, which then rejects it as a load mask
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < tl.where(live, K, 0)
    m_v = o_v < tl.where(live, V, 0)
    m_h = m_k[:, None] & m_v[None, :]

    # S tile [BK, BV], fp32, read once
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        p_h0 = h0 + i_s * s_h0_n + i_hv * s_h0_h + o_k[:, None] * s_h0_k + o_v[None, :] * s_h0_v
        if STREAM:
            b_h += tl.load(p_h0, mask=m_h, other=0., eviction_policy="evict_first").to(tl.float32)
        else:
            b_h += tl.load(p_h0, mask=m_h, other=0.).to(tl.float32)
        if QUANT > 0:
            if SCALE_ON_K:
                b_h *= tl.load(scales + i_s * s_sc_n + i_hv * s_sc_h + o_k, mask=m_k, other=0.)[:, None]
            else:
                b_h *= tl.load(scales + i_s * s_sc_n + i_hv * s_sc_h + o_v, mask=m_v, other=0.)[None, :]

    p_q = q + (bos * H + i_h) * K + o_k
    p_k = k + (bos * H + i_h) * K + o_k
    p_v = v + (bos * HV + i_hv) * V + o_v
    p_o = o + (bos * HV + i_hv) * V + o_v
    # without a gate / β: a stand-in pointer, never loaded nor advanced (the loop reassigns p_g and p_beta, and a
    # compiled loop may not reassign None)
    if GATE == 1:
        p_g = g + bos * HV + i_hv
    elif GATE == 2:
        p_g = g + (bos * HV + i_hv) * K + o_k
    else:
        p_g = p_q
    if DELTA:
        p_beta = beta + bos * HV + i_hv
    else:
        p_beta = p_q
    if STORE_INTER:
        p_i = inter + i_n * s_i_n + i_hv * s_i_h + o_k[:, None] * s_i_k + o_v[None, :] * s_i_v
    else:
        p_i = inter         # None: never stored to

    # the token loop: a software-pipelined tl.range on the GPU (the loads of the first token are issued
    # together, up front, instead of one global round trip per small load); a while loop under the
    # interpreter (triton 3.6 with numpy 2 cannot take tensor range bounds there)
    if PIPELINE > 0:
        for i_t in tl.range(bos, eos, num_stages=PIPELINE):
            b_h, p_q, p_k, p_v, p_o, p_g, p_beta = _token(
                i_t, bos, b_h, p_q, p_k, p_v, p_o, p_g, p_beta, p_i, m_k, m_v, m_h, o_v, live, scale, T_buf, s_i_t,
                H, HV, K, V, GATE, DELTA, FUSED, STORE_INTER, "evict_first")
    else:
        i_t = bos
        while i_t < eos:
            b_h, p_q, p_k, p_v, p_o, p_g, p_beta = _token(
                i_t, bos, b_h, p_q, p_k, p_v, p_o, p_g, p_beta, p_i, m_k, m_v, m_h, o_v, live, scale, T_buf, s_i_t,
                H, HV, K, V, GATE, DELTA, FUSED, STORE_INTER, "")
            i_t += 1

    # S tile written once (in place into the pool when ht aliases h0)
    if STORE_HT and QUANT > 0:
        # requantize with each row's new absmax (SCALE_ON_K: the launcher gives one program all of V)
        p_ht = ht + i_s * s_ht_n + i_hv * s_ht_h + o_k[:, None] * s_ht_k + o_v[None, :] * s_ht_v
        if SCALE_ON_K:
            b_amax = tl.max(tl.abs(b_h), 1)                                          # [BK]
            b_q = b_h * tl.where(b_amax > 0, QMAX / tl.maximum(b_amax, 1e-30), 0.)[:, None]
            tl.store(scales + i_s * s_sc_n + i_hv * s_sc_h + o_k, b_amax / QMAX, mask=m_k)
        else:
            b_amax = tl.max(tl.abs(b_h), 0)                                          # [BV]
            b_q = b_h * tl.where(b_amax > 0, QMAX / tl.maximum(b_amax, 1e-30), 0.)[None, :]
            tl.store(scales + i_s * s_sc_n + i_hv * s_sc_h + o_v, b_amax / QMAX, mask=m_v)
        tl.store(p_ht, _onto_grid(b_q, QMAX, QUANT).to(p_ht.dtype.element_ty), mask=m_h)
    elif STORE_HT:
        p_ht = ht + i_s * s_ht_n + i_hv * s_ht_h + o_k[:, None] * s_ht_k + o_v[None, :] * s_ht_v
        if STREAM:
            tl.store(p_ht, b_h.to(p_ht.dtype.element_ty), mask=m_h, cache_modifier=".cs")
        else:
            tl.store(p_ht, b_h.to(p_ht.dtype.element_ty), mask=m_h)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _launch_config(device: torch.device, NHV: int, K: int, V: int) -> tuple[int, int, int]:
    """(BK, BV, num_warps). The state tile is [BK, BV] fp32 in registers.

    Split V finely enough that N·HV·cdiv(V, BV) programs fill the GPU several times over (batch 1
    is latency bound: many small programs), but keep tiles large when there are programs to spare
    (fewer re-reads of q and k, fewer tiny stores). num_warps keeps ~64 state values per thread:
    then each thread's share of a 16-bit K-vector (q, k) is >= 4 bytes, which lets the pipelined
    token loop fetch it with cp.async alongside the state load (with 4 warps at BV = 32 it falls to
    2 bytes and two small loads stay serialized). BV = 32 / 2 warps was also the fastest configuration
    measured at batch 256.
    """
    BK = max(16, next_pow2(K))
    BV = min(max(8, next_pow2(V)), 32 if BK <= 128 else 16)
    if device.type != "cuda":   # the interpreter: fewest programs (it runs them one by one)
        BV = min(max(8, next_pow2(V)), 64)
        return BK, BV, 4
    n_sm = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    while BV > 8 and NHV * cdiv(V, BV) < 8 * n_sm:
        BV //= 2
    num_warps = max(1, min(8, BK * BV // 2048))
    return BK, BV, num_warps


@on_tensor_device
def recurrent_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, *,
                  state_indices=None, transpose_state_layout=False, o=None, final_state=None,
                  intermediate_states=None, state_scales=None, BV=None, num_warps=None, fused=False, stream=False, pipeline=None):
    """Launcher of `recurrent_fwd_kernel` (no autograd).

    Args (canonical, already checked by the API):
        q, k: [B, T, H, K]; v: [B, T, HV, V]; g: None | [B, T, HV] | [B, T, HV, K] (fp32);
        beta: None | [B, T, HV]; scale: float;
        initial_state: None | [N, HV, K, V] any float dtype, or with state_indices the pool
            [P, HV, K, V] ([.., V, K] with transpose_state_layout);
        cu_seqlens: None | [N + 1]; state_indices: None | [N] int (-1 = padding).
        o, final_state: optional preallocated outputs (tests pre-fill them with NaN).
        intermediate_states: None | [N, T_buf, HV, K, V] ([.., V, K] with transpose_state_layout), the
            verify step of speculative decoding (with state_indices): the state after token t of sequence
            n goes to [n, t] (tokens t >= T_buf are not stored), and the pool is left as it was.
        state_scales: None | [P, HV, K] fp32 ([P, HV, V] transposed): the pool is 8-bit (int8 or
            float8_e4m3fn), a stored row times its scale; the kernel requantizes each row it writes.
        BV, num_warps, fused, stream, pipeline: override the launch configuration / kernel variant
            (benchmarks): fused = both products of S in one pass, stream = streaming cache hints on
            the state, pipeline = num_stages of the token loop (0: while loop; default 2 on CUDA).
    Returns:
        o [B, T, HV, V] in q's dtype; the final state: None, or a new fp32 [N, HV, K, V] (layout as
        chosen), or with state_indices the pool itself (updated in place whatever output_final_state
        says; returned only if output_final_state).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g = None if g is None else g.contiguous()
    beta = None if beta is None else beta.contiguous()
    gate = GATE_NONE if g is None else (GATE_SCALAR if g.dim() == 3 else GATE_CHANNEL)

    if o is None:
        o = torch.empty(B, T, HV, V, dtype=q.dtype, device=q.device)
    assert o.shape == (B, T, HV, V) and o.is_contiguous()

    def kv_strides(s):  # strides of the logical [., HV, K, V] view
        st = s.stride()
        return (st[0], st[1], st[3], st[2]) if transpose_state_layout else st

    if state_indices is not None:
        assert initial_state is not None
        h0 = ht = initial_state
        s_h0 = s_ht = kv_strides(initial_state)
        ret = initial_state if output_final_state else None
        if intermediate_states is not None:     # verify step: the pool is read, not written
            ht, s_ht = None, (0, 0, 0, 0)
    else:
        h0 = initial_state
        s_h0 = kv_strides(initial_state) if initial_state is not None else (0, 0, 0, 0)
        if output_final_state:
            if final_state is None:
                shape = (N, HV, V, K) if transpose_state_layout else (N, HV, K, V)
                final_state = torch.empty(shape, dtype=torch.float32, device=q.device)
            ht = final_state
            s_ht = kv_strides(final_state)
        else:
            ht, s_ht = None, (0, 0, 0, 0)
        ret = ht

    BK, BV_auto, nw_auto = _launch_config(q.device, N * HV, K, V)
    quant = 0 if state_scales is None else (1 if initial_state.dtype == torch.int8 else 2)
    if quant and not transpose_state_layout:
        BV_auto = max(16, next_pow2(V))        # a key row's absmax needs all of V in one program
        nw_auto = max(nw_auto, min(8, BK * BV_auto // 2048)) if q.device.type == "cuda" else nw_auto
    BV = BV or BV_auto
    num_warps = num_warps or nw_auto
    if pipeline is None:
        pipeline = 2 if q.device.type == "cuda" else 0
    inter = intermediate_states
    if inter is None:
        s_i = (0, 0, 0, 0, 0)
    else:
        st = inter.stride()
        s_i = (st[0], st[1], st[2], st[4], st[3]) if transpose_state_layout else st
    grid = (N * HV * cdiv(V, BV),)
    recurrent_fwd_kernel[grid](
        q, k, v, g, beta, o, h0, ht, cu_seqlens, state_indices,
        initial_state.shape[0] if state_indices is not None else 0,
        inter, 0 if inter is None else inter.shape[1],
        state_scales, *((0, 0) if state_scales is None else state_scales.stride()[:2]), scale, T,
        *s_h0, *s_ht, *s_i,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, GATE=gate, DELTA=beta is not None,
        USE_H0=h0 is not None, STORE_HT=ht is not None, STORE_INTER=inter is not None,
        QUANT=quant, QMAX=127. if quant == 1 else 448., SCALE_ON_K=not transpose_state_layout, IS_VARLEN=cu_seqlens is not None,
        USE_INDICES=state_indices is not None, FUSED=fused, STREAM=stream,
        PIPELINE=pipeline, num_warps=num_warps, num_stages=1,
    )
    return o, ret


def _needs_grad(*xs) -> bool:
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)


def _recurrent_autograd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                        state_indices, transpose_state_layout):
    """Differentiable fallback: the PyTorch token recurrence in fp32 on the same device."""
    from ..reference.recurrent import pool_step, recurrent_forward
    if state_indices is not None:
        return pool_step(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                state_indices, transpose_state_layout, torch.float32)
    h0 = None if initial_state is None else (
        initial_state.transpose(-1, -2) if transpose_state_layout else initial_state)
    o, ht = recurrent_forward(q, k, v, g, beta, scale, h0, cu_seqlens, dtype=torch.float32)
    o = o.to(q.dtype)
    if not output_final_state:
        return o, None
    return o, (ht.transpose(-1, -2).contiguous() if transpose_state_layout else ht)


def recurrent(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, *,
              state_indices=None, transpose_state_layout=False):
    """Entry point of the Triton recurrent ops (see chunkwise.triton for the canonical inputs).

    Returns (o [B, T, HV, V] in q's dtype, final state or pool or None); see `recurrent_fwd`.
    The kernel has no backward: with grad enabled and an input that requires grad, the result
    comes from the differentiable fp32 PyTorch recurrence on the same device (slow, exact).
    """
    if _needs_grad(q, k, v, g, beta, initial_state):
        return _recurrent_autograd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                   state_indices, transpose_state_layout)
    return recurrent_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                         state_indices=state_indices, transpose_state_layout=transpose_state_layout)


@triton.jit(do_not_specialize=["n_slots", "T_buf"])
def rollback_kernel(pool, state_indices, inter, num_accepted, scales, n_slots, T_buf, s_p_n, s_i_n, s_i_t, s_sc_n,
                    SIZE: tl.constexpr, BLOCK: tl.constexpr, ROW: tl.constexpr, BC: tl.constexpr,
                    QUANT: tl.constexpr, QMAX: tl.constexpr):
    """pool[state_indices[n]] = inter[n, num_accepted[n] - 1] over one block of the HV·K·V state (layout-free:
    a slot and a per-token state are both contiguous). Skipped (nothing read or written): 0 accepted, an index
    outside [0, P), a count above T_buf. An 8-bit pool (QUANT 1 int8, 2 e4m3): the block is BLOCK // BC whole
    rows of ROW values (the slot's last dim), each requantized with its absmax into the slot and scales[slot]."""
    i_n = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1)
    i_s = tl.load(state_indices + i_n).to(tl.int64)
    n_acc = tl.load(num_accepted + i_n).to(tl.int64)
    live = (i_s >= 0) & (i_s < n_slots) & (n_acc > 0) & (n_acc <= T_buf)
    i_s = tl.where(live, i_s, 0)
    i_t = tl.where(live, n_acc - 1, 0)
    if QUANT > 0:
        o_r = i_b * (BLOCK // BC) + tl.arange(0, BLOCK // BC)        # rows of the slot, [BLOCK // BC]
        o_c = tl.arange(0, BC)
        m_r = o_r < tl.where(live, SIZE // ROW, 0)
        m = m_r[:, None] & (o_c[None, :] < ROW)
        o = o_r[:, None] * ROW + o_c[None, :]
        b = tl.load(inter + i_n * s_i_n + i_t * s_i_t + o, mask=m, other=0.).to(tl.float32)
        b_amax = tl.max(tl.abs(b), 1)
        b_q = b * tl.where(b_amax > 0, QMAX / tl.maximum(b_amax, 1e-30), 0.)[:, None]
        tl.store(scales + i_s * s_sc_n + o_r, b_amax / QMAX, mask=m_r)
        tl.store(pool + i_s * s_p_n + o, _onto_grid(b_q, QMAX, QUANT).to(pool.dtype.element_ty), mask=m)
    else:
        o = i_b * BLOCK + tl.arange(0, BLOCK)
        m = o < tl.where(live, SIZE, 0)
        b = tl.load(inter + i_n * s_i_n + i_t * s_i_t + o, mask=m)
        tl.store(pool + i_s * s_p_n + o, b.to(pool.dtype.element_ty), mask=m)


@on_tensor_device
def rollback(pool, state_indices, intermediate_states, num_accepted_tokens, state_scales=None):
    """Launcher of `rollback_kernel` (arguments checked by chunkwise.speculative.rollback). state_scales: the
    [P, HV, R] fp32 scales of an int8 / float8_e4m3fn pool (R = the slot's second-to-last dim)."""
    N, T_buf = intermediate_states.shape[:2]
    size = pool[0].numel()
    if N == 0 or size == 0:
        return pool
    quant = 0 if state_scales is None else (1 if pool.dtype == torch.int8 else 2)
    row = pool.shape[-1]
    BC = next_pow2(row) if quant else 1
    BLOCK = min(4096, next_pow2(size)) if not quant else max(BC, min(4096, BC * next_pow2(size // row)))
    per_program = BLOCK // BC if quant else BLOCK
    n_blocks = cdiv(size // row, per_program) if quant else cdiv(size, BLOCK)
    rollback_kernel[(N, n_blocks)](
        pool, state_indices, intermediate_states, num_accepted_tokens, state_scales, pool.shape[0], T_buf,
        pool.stride(0), intermediate_states.stride(0), intermediate_states.stride(1),
        0 if state_scales is None else state_scales.stride(0), SIZE=size, BLOCK=BLOCK, ROW=row if quant else 1, BC=BC,
        QUANT=quant, QMAX=127. if quant == 1 else 448.)
    return pool
