"""The chunk algorithm (DESIGN.md §2) in batched PyTorch: the CPU backend and the autograd fallback.

Cut every sequence into chunks of C tokens. Inside a chunk, with G the cumulative log-decay and
Γ_ij = exp(G_i − G_j) (per channel for KDA)::

    A   = strict_tril(β_i ⟨k_i, Γ_ij ⊙ k_j⟩)          [C, C]
    W   = (I + A)⁻¹ (β ⊙ e^G ⊙ K)                    [C, K]   (the WY / UT transform)
    U   = (I + A)⁻¹ (β ⊙ V)                          [C, V]
    P   = tril(⟨q_i, Γ_ij ⊙ k_j⟩)                     [C, C]   (diagonal included)

and across chunks, with S the state entering the chunk::

    R   = U − W S                                    what is really new in this chunk
    O   = scale · ((Q ⊙ e^G) S + P R)
    S  ← diag(e^{G_last}) S + (K ⊙ e^{G_last − G})ᵀ R

Without the delta rule (simple GLA) W = 0 and U = V. Everything that does not depend on S is
computed for all chunks at once (one batched triangular solve); only the state hand-over loops
over chunks, and inside it one product gives both W S and (Q ⊙ e^G − P W) S.

Exponentials are only ever taken of differences G_i − G_j with i ≥ j (or of G itself, which is
≤ 0), so gates summing to −1e4 inside a chunk stay finite.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from .utils import expand_heads, pad_varlen, unpad_varlen, varlen_pad_index

SUB = 16  # sub-block of the per-channel pairwise products


def _exp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """exp of a gate difference formed in float64, taken in the arithmetic dtype."""
    return x.to(dtype).exp()


def _pairwise_scalar(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, diagonal: bool) -> torch.Tensor:
    """M_ij = ⟨a_i, b_j⟩ · exp(G_i − G_j) for j ≤ i (j < i when not ``diagonal``), else 0.

    a, b: [..., C, K]; G: [..., C] or None (no decay). Returns [..., C, C].
    """
    C = a.shape[-2]
    keep = torch.ones(C, C, dtype=torch.bool, device=a.device).tril(0 if diagonal else -1)
    ab = a @ b.transpose(-1, -2)                                        # [.., C, K] @ [.., K, C]
    if G is None:
        return ab.masked_fill(~keep, 0)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~keep, float("-inf")).to(ab.dtype).exp()
    return ab * decay


def _pairwise_channel(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, diagonal: bool) -> torch.Tensor:
    """M_ij = Σ_c a_ic b_jc exp(G_ic − G_jc) for j ≤ i (j < i when not ``diagonal``), else 0.

    a, b, G: [..., C, K]. Returns [..., C, C].

    Column block q (tokens q..r, r its last) against the rows after it factors exactly around r:
    exp(G_i − G_j) = exp(G_i − G_r) · exp(G_r − G_j) with both factors ≤ 1, so nothing overflows.
    The diagonal blocks are formed exactly, pair by pair.
    """
    C = a.shape[-2]
    columns = []
    for q in range(0, C, SUB):
        r = min(q + SUB, C) - 1
        s = r + 1 - q
        G_r = G[..., r:r + 1, :]
        a_q, b_q, G_q = a[..., q:r + 1, :], b[..., q:r + 1, :], G[..., q:r + 1, :]
        keep = torch.ones(s, s, dtype=torch.bool, device=a.device).tril(0 if diagonal else -1)
        diff = (G_q[..., :, None, :] - G_q[..., None, :, :]).masked_fill(~keep[..., None], float("-inf"))
        diag_block = torch.einsum("...ik,...jk,...ijk->...ij", a_q, b_q, diff.to(a.dtype).exp())  # [.., s, s]
        below = (a[..., r + 1:, :] * _exp(G[..., r + 1:, :] - G_r, a.dtype)) @ \
            (b_q * _exp(G_r - G_q, a.dtype)).transpose(-1, -2)                                  # [.., C-r-1, K] @ [.., K, s]
        above = a.new_zeros(*a.shape[:-2], q, s)
        columns.append(torch.cat([above, diag_block, below], dim=-2))
    return torch.cat(columns, dim=-1)


def chunk_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    scale: float,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk algorithm, differentiable through autograd.

    Args:
        q, k: [B, T, H, K]
        v: [B, T, HV, V]
        g: None (no decay), [B, T, HV] (scalar log-decay) or [B, T, HV, K] (per channel)
        beta: None (no delta rule: simple GLA) or [B, T, HV]
        initial_state: None or [N, HV, K, V]
        cu_seqlens: None or [N + 1] (then B == 1)
        dtype: arithmetic dtype (float32, or float64 for tests)

    Returns:
        o: [B, T, HV, V] in ``dtype``; final_state: [N, HV, K, V] in ``dtype``.
    """
    C = chunk_size
    HV = v.shape[2]
    q, k = expand_heads(q, HV).to(dtype), expand_heads(k, HV).to(dtype)
    v = v.to(dtype)
    g = None if g is None else g.to(dtype)
    beta = None if beta is None else beta.to(dtype)

    # varlen -> a zero-padded batch: padded tokens (k = v = g = β = 0) leave the state alone
    index = None
    if cu_seqlens is not None:
        index, N, T_pad = varlen_pad_index(cu_seqlens, C)
        q, k, v, g, beta = (pad_varlen(x, index, N, T_pad) for x in (q, k, v, g, beta))
    T = q.shape[1]
    pad = -T % C
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g = None if g is None else F.pad(g, (0, 0) * (g.dim() - 2) + (0, pad))
        beta = None if beta is None else F.pad(beta, (0, 0, 0, pad))

    # [B, T, HV, D] -> [B, HV, n, C, D]
    q, k, v = (rearrange(x, "b (n c) h d -> b h n c d", c=C) for x in (q, k, v))
    per_channel = g is not None and g.dim() == 4
    if g is None:
        G = None
    elif per_channel:
        G = rearrange(g.double(), "b (n c) h d -> b h n c d", c=C).cumsum(-2)   # [B, HV, n, C, K]
    else:
        G = rearrange(g.double(), "b (n c) h -> b h n c", c=C).cumsum(-1)       # [B, HV, n, C]
    # G is kept in float64: after a hard reset (g = -1e4) the cumulative sums are large and their
    # differences, which are all that is ever exponentiated, would lose ~3 digits in float32.
    pairwise = _pairwise_channel if per_channel else _pairwise_scalar

    if G is None:
        q_g, k_end = q, k                                                # no decay
    elif per_channel:
        q_g, k_end = q * _exp(G, dtype), k * _exp(G[..., -1:, :] - G, dtype)
    else:
        q_g, k_end = q * _exp(G, dtype)[..., None], k * _exp(G[..., -1:] - G, dtype)[..., None]
    P = pairwise(q, k, G, True)                                           # [B, HV, n, C, C]

    if beta is not None:
        b = rearrange(beta, "b (n c) h -> b h n c", c=C)[..., None]       # [B, HV, n, C, 1]
        A = pairwise(b * k, k, G, False)                                  # strict lower
        eye = torch.eye(C, dtype=dtype, device=q.device)
        k_g = k if G is None else (k * _exp(G, dtype) if per_channel else k * _exp(G, dtype)[..., None])
        rhs = torch.cat([b * k_g, b * v], dim=-1)                         # [.., C, K + V]
        WU = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)
        W, U = WU.split([k.shape[-1], v.shape[-1]], dim=-1)
        reads = torch.cat([W, q_g - P @ W], dim=-2)                       # [.., 2C, K]
        o_intra = P @ U                                                   # [.., C, C] @ [.., C, V]
    else:
        W, U, reads, o_intra = None, v, q_g, P @ v

    n_chunks = q.shape[2]
    S = (q.new_zeros(q.shape[0], HV, q.shape[-1], v.shape[-1]) if initial_state is None
         else initial_state.to(dtype))                                     # [B, HV, K, V]
    if G is None:
        decay_last = None
    elif per_channel:
        decay_last = _exp(G[..., -1, :], dtype)[..., None]                # [B, HV, n, K, 1]
    else:
        decay_last = _exp(G[..., -1], dtype)[..., None, None]             # [B, HV, n, 1, 1]
    outputs = []
    for i in range(n_chunks):
        read = reads[:, :, i] @ S                                         # [B, HV, 2C|C, K] @ [B, HV, K, V]
        if W is not None:
            R = U[:, :, i] - read[..., :C, :]                             # U − W S
            o_inter = read[..., C:, :]
        else:
            R, o_inter = U[:, :, i], read
        outputs.append(scale * (o_inter + o_intra[:, :, i]))
        if decay_last is not None:
            S = S * decay_last[:, :, i]
        S = S + k_end[:, :, i].transpose(-1, -2) @ R                     # [B, HV, K, C] @ [B, HV, C, V]

    o = rearrange(torch.stack(outputs, dim=2), "b h n c d -> b (n c) h d")[:, :T]
    if index is not None:
        o = unpad_varlen(o, index)
    return o, S
