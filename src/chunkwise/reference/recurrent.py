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
              transpose_state_layout, ct):
    """Token recurrence over a vLLM-style state pool: sequence n reads and writes pool[state_indices[n]]
    in place; -1 skips (zero output, slot untouched). ct: the arithmetic dtype."""
    idx = state_indices.long()
    live = idx >= 0
    h0 = (pool.transpose(-1, -2) if transpose_state_layout else pool)[idx.clamp_min(0)]
    h0 = torch.where(live[:, None, None, None], h0, torch.zeros_like(h0))
    o, ht = recurrent_forward(q, k, v, g, beta, scale, h0, cu_seqlens, dtype=ct)
    # outputs of skipped (padding) sequences are zero
    if cu_seqlens is None:
        o = o * live[:, None, None, None]
    else:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        o = o * torch.repeat_interleave(live, lengths)[None, :, None, None]
    with torch.no_grad():
        target = pool.transpose(-1, -2) if transpose_state_layout else pool
        target[idx[live]] = ht[live].to(pool.dtype)
    return o.to(q.dtype), (pool if output_final_state else None)
