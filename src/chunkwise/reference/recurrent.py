"""The token recurrence, written to be read: the ground truth of every op.

Per sequence, per value head h (its q/k head is h // (HV // H)), per token t::

    S' = diag(exp(g_t)) · S_{t-1}                      decay first (g_t ≤ 0, log space)
    delta rule:   S_t = S' + β_t · k_t · (v_t − S'ᵀ k_t)ᵀ
    no delta:     S_t = S' + k_t · v_tᵀ                (simple GLA / Mamba2 SSD)
    o_t = scale · S_tᵀ q_t

All tensors here are in the canonical form the API hands over (gates already in log space,
q/k already normalised, β already squashed, state in [N, HV, K, V] layout).
"""
from __future__ import annotations

import torch

from .utils import expand_heads, sequence_bounds


def recurrent_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    scale: float,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence.

    Args:
        q, k: [B, T, H, K]
        v: [B, T, HV, V]
        g: None (no decay), [B, T, HV] (scalar log-decay) or [B, T, HV, K] (per channel)
        beta: None (no delta rule) or [B, T, HV]
        initial_state: None or [N, HV, K, V]
        cu_seqlens: None or [N + 1] (then B == 1)
        dtype: the arithmetic dtype (float64 for the ground truth)

    Returns:
        o: [B, T, HV, V] in ``dtype``; final_state: [N, HV, K, V] in ``dtype``.
    """
    HV = v.shape[2]
    q, k = expand_heads(q, HV).to(dtype), expand_heads(k, HV).to(dtype)
    v = v.to(dtype)
    g = None if g is None else g.to(dtype)
    beta = None if beta is None else beta.to(dtype)
    K, V = q.shape[-1], v.shape[-1]

    outputs, finals = [], []
    for n, (b, start, end) in enumerate(sequence_bounds(q.shape[0], q.shape[1], cu_seqlens)):
        S = (q.new_zeros(HV, K, V) if initial_state is None
             else initial_state[n].to(dtype))
        o_seq = []
        for t in range(start, end):
            q_t, k_t, v_t = q[b, t], k[b, t], v[b, t]                 # [HV, K], [HV, K], [HV, V]
            if g is not None:
                decay = g[b, t].exp()                                 # [HV] or [HV, K]
                S = S * (decay[:, None, None] if decay.dim() == 1 else decay[:, :, None])
            if beta is not None:
                v_old = torch.einsum("hk,hkv->hv", k_t, S)            # S'ᵀ k_t
                S = S + beta[b, t][:, None, None] * k_t[:, :, None] * (v_t - v_old)[:, None, :]
            else:
                S = S + k_t[:, :, None] * v_t[:, None, :]
            o_seq.append(scale * torch.einsum("hk,hkv->hv", q_t, S))   # S_tᵀ q_t
        outputs.append(torch.stack(o_seq) if o_seq else v.new_zeros(0, HV, V))
        finals.append(S)

    if cu_seqlens is None:
        o = torch.stack(outputs)                                        # [B, T, HV, V]
    else:
        o = torch.cat(outputs)[None]                                    # [1, T, HV, V]
    return o, torch.stack(finals)


def pool_step(q, k, v, g, beta, scale, pool, output_final_state, cu_seqlens, state_indices,
              transpose_state_layout, ct, intermediate_states=None, state_scales=None):
    """Token recurrence over a vLLM-style state pool: sequence n reads and writes pool[state_indices[n]]
    in place; -1 (or any index outside [0, P)) skips: zero output, no slot read or written. ct: the
    arithmetic dtype. With intermediate_states [N, T_buf, HV, K, V] ([.., V, K] transposed), the verify
    step of speculative decoding: the state after token t of sequence n goes to [n, t] (t < T_buf) and
    the pool is left as it was (see chunkwise.rollback). With state_scales [P, HV, R] the pool is 8-bit
    (int8 / float8_e4m3fn): see `dequantize` / `quantize`."""
    idx = state_indices.long()
    P = pool.shape[0]
    live = (idx >= 0) & (idx < P)
    rows = idx.clamp(0, max(P - 1, 0))
    h0 = pool[rows] if state_scales is None else dequantize(pool[rows], state_scales[rows])
    h0 = h0.transpose(-1, -2) if transpose_state_layout else h0
    h0 = torch.where(live[:, None, None, None], h0, torch.zeros_like(h0))
    if intermediate_states is None:
        o, ht = recurrent_forward(q, k, v, g, beta, scale, h0, cu_seqlens, dtype=ct)
    else:
        o, ht = _with_token_states(q, k, v, g, beta, scale, h0, cu_seqlens, ct, live, intermediate_states,
                                   transpose_state_layout)
    # outputs of skipped (padding) sequences are zero
    if cu_seqlens is None:
        o = o * live[:, None, None, None]
    else:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        o = o * torch.repeat_interleave(live, lengths)[None, :, None, None]
    if intermediate_states is None:
        with torch.no_grad():
            ht = ht.transpose(-1, -2) if transpose_state_layout else ht
            if state_scales is None:
                pool[idx[live]] = ht[live].to(pool.dtype)
            else:
                pool[idx[live]], state_scales[idx[live]] = quantize(ht[live], pool.dtype)
    return o.to(q.dtype), (pool if output_final_state else None)


QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def dequantize(stored: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An 8-bit state [..., R, C] (R = K, or V in the transposed layout) with one fp32 scale per row
    [..., R]: value = stored · scale."""
    return stored.float() * scales[..., None]


def quantize(S: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored, scales): each row's absmax maps to the format's largest value (127 int8, 448 e4m3);
    both round half up (on the e4m3 grid for fp8); an all-zero row gets scale 0."""
    qmax = QMAX[dtype]
    amax = S.float().abs().amax(-1)
    x = S.float() * torch.where(amax > 0, qmax / amax.clamp_min(1e-30), torch.zeros_like(amax))[..., None]
    x = x.clamp(-qmax, qmax)
    if dtype == torch.int8:
        x = torch.floor(x + 0.5)
    else:       # onto the e4m3 grid (3 mantissa bits, subnormal below 2^-6), as the kernel rounds
        step = torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -6))) - 3)
        x = torch.floor(x / step + 0.5) * step
    return x.to(dtype), amax / qmax


def _with_token_states(q, k, v, g, beta, scale, h0, cu_seqlens, ct, live, inter, transpose_state_layout):
    """`recurrent_forward` one token at a time, each state written to inter[n, t] (live sequences, t < T_buf)."""
    outputs, finals = [], []
    for n, (b, start, end) in enumerate(sequence_bounds(q.shape[0], q.shape[1], cu_seqlens)):
        S, o_seq = h0[n:n + 1], []
        for t in range(start, end):
            sl = lambda x: None if x is None else x[b:b + 1, t:t + 1]   # noqa: E731
            o_t, S = recurrent_forward(sl(q), sl(k), sl(v), sl(g), sl(beta), scale, S, dtype=ct)
            o_seq.append(o_t[0])
            if bool(live[n]) and t - start < inter.shape[1]:
                with torch.no_grad():
                    inter[n, t - start] = (S[0].transpose(-1, -2) if transpose_state_layout else S[0]).to(inter.dtype)
        outputs.append(torch.cat(o_seq) if o_seq else v.new_zeros(0, *v.shape[2:]).to(ct))
        finals.append(S[0])
    o = torch.stack(outputs) if cu_seqlens is None else torch.cat(outputs)[None]
    return o, torch.stack(finals)


def rollback(pool, state_indices, intermediate_states, num_accepted_tokens, state_scales=None):
    """pool[state_indices[n]] = intermediate_states[n, num_accepted_tokens[n] - 1] for every sequence that
    accepted at least one token (and whose index lies in [0, P)); other slots untouched. With state_scales
    (an 8-bit pool) the kept fp32 state is requantized into the slot and its row scales (`quantize`)."""
    idx, acc = state_indices.long(), num_accepted_tokens.long()
    keep = (idx >= 0) & (idx < pool.shape[0]) & (acc > 0) & (acc <= intermediate_states.shape[1])
    n = torch.nonzero(keep).flatten()
    kept = intermediate_states[n, acc[n] - 1]
    with torch.no_grad():
        if state_scales is None:
            pool[idx[n]] = kept.to(pool.dtype)
        else:
            pool[idx[n]], state_scales[idx[n]] = quantize(kept, pool.dtype)
    return pool
