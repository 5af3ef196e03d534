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

Without the delta rule (simple GLA) W = 0 and U = V. The loop runs over chunks with every
sequence and head batched, so each intermediate is one chunk's [B, HV, C, ·] and stays in cache.
Inside a chunk, T = (I + A)⁻¹ comes from one batched triangular solve and R = T (β ⊙ V − (β ⊙ e^G ⊙ K) S)
(W is never formed); the products that add into a result are fused (baddbmm), and the output is
written in place. Per chunk of 64 tokens this is 6 batched matrix products and ~12 elementwise
passes over [B·HV, C, ·] tensors: at B = 1, T = 4096, HV = 16, K = V = 128 most of the time is in
the matrix products (3·K·V multiply-adds per token for the state, ≈ 4·C·K for the chunk).

Exponentials are only ever taken of differences G_i − G_j with i ≥ j (or of G itself, which is
≤ 0), so gates summing to −1e4 inside a chunk stay finite.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

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


_POOLS: dict[int, ThreadPoolExecutor] = {}
# a forked child (a DataLoader worker, say) inherits the dict but not the threads: start afresh there
os.register_at_fork(after_in_child=_POOLS.clear)


def _pool(workers: int) -> ThreadPoolExecutor:
    """A persistent pool of ``workers`` threads: fresh threads per call cost ~15 ms at T = 4096
    (each new thread's first matrix products set up their BLAS buffers again)."""
    if workers not in _POOLS:
        _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="chunkwise-cpu")
    return _POOLS[workers]


def _needs_grad(*xs) -> bool:
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)


def chunk_forward(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None, chunk_size=64,
                  dtype=torch.float32):
    """The chunk algorithm (see `_chunk_forward` for the shapes), differentiable through autograd.

    On the CPU, without autograd and with several torch threads, the q/k head groups are split over
    that many Python threads that each run `_chunk_forward` single-threaded (the matrix products
    release the GIL). Every op of the chunk loop is small ([B·HV, C, ·], ~0.5 MB), so splitting the
    heads scales far better than intra-op OpenMP threads, which synchronise ~20 times per chunk and
    stall whenever a core is busy. The result is bit-identical to the single-threaded call.
    """
    workers = min(torch.get_num_threads(), q.shape[2])
    if (workers < 2 or q.device.type != "cpu"
            or _needs_grad(q, k, v, g, beta, initial_state)):
        return _chunk_forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, dtype)
    H, HV = q.shape[2], v.shape[2]
    bounds = [H * i // workers for i in range(workers + 1)]            # q/k heads of each worker
    group = HV // H

    def part(i):
        qk, vh = slice(bounds[i], bounds[i + 1]), slice(bounds[i] * group, bounds[i + 1] * group)
        torch.set_num_threads(1)
        return _chunk_forward(q[:, :, qk], k[:, :, qk], v[:, :, vh], None if g is None else g[:, :, vh],
                              None if beta is None else beta[:, :, vh], scale,
                              None if initial_state is None else initial_state[:, vh], cu_seqlens,
                              chunk_size, dtype)

    threads = torch.get_num_threads()
    try:
        results = list(_pool(workers).map(part, range(workers)))
    finally:
        torch.set_num_threads(threads)      # the MKL / OpenMP setting is process-wide: restore it
    # (the parts are concatenated here: workers writing their heads into one shared output
    # measured 4-6 % slower, the two threads faulting in the same fresh pages)
    return torch.cat([o for o, _ in results], 2), torch.cat([S for _, S in results], 1)


def _chunk_forward(
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

    One chunk at a time, all sequences and heads batched: every intermediate is [B, HV, C, ·]
    (512 KB at HV = 16, C = 64, K = V = 128, fp32), so it stays in cache and is reused by the
    allocator. Materialising them for all chunks at once ([B, HV, T/C, C, ·], tens of MB each) made
    the CPU backend memory- and page-fault-bound: 3-10x slower at T = 4096.
    """
    C = chunk_size
    HV = v.shape[2]

    # varlen -> a zero-padded batch: padded tokens (k = v = g = β = 0) leave the state alone
    index = None
    if cu_seqlens is not None:
        index, N, T_pad = varlen_pad_index(cu_seqlens, C)
        q, k, v, g, beta = (pad_varlen(x, index, N, T_pad) for x in (q, k, v, g, beta))
    B, T = q.shape[:2]
    per_channel = g is not None and g.dim() == 4
    pairwise = _pairwise_channel if per_channel else _pairwise_scalar
    K, V = q.shape[-1], v.shape[-1]
    BH = B * HV

    def heads(x, s, e):  # x[:, s:e]: [B, c, H|HV, ...] -> [B·HV, c, ...] in the arithmetic dtype
        return expand_heads(x[:, s:e], HV).transpose(1, 2).flatten(0, 1).to(dtype)

    S = (q.new_zeros(BH, K, V, dtype=dtype) if initial_state is None
         else initial_state.to(dtype).reshape(BH, K, V))                    # [B·HV, K, V]
    # without autograd, S is updated in place (a fresh 1 MB state per chunk costs page faults)
    in_place = not _needs_grad(q, k, v, g, beta, initial_state)
    if in_place and initial_state is not None:
        S = S.clone()
    eyes: dict[int, torch.Tensor] = {}
    masks: dict[int, torch.Tensor] = {}
    o = v.new_empty(B, T, HV, V, dtype=dtype)
    # the per-token scalars of every chunk at once (few, small tensors; the chunk loop only slices
    # them): the chunk-local cumulative gate G in float64 -- after a hard reset (g = -1e4) the
    # cumulative sums are large and their differences, the only thing ever exponentiated, would lose
    # ~3 digits in float32 -- and its three exponentials, and β
    NT = -(-T // C)
    scalars = g is not None and not per_channel
    if scalars:
        g_all = torch.nn.functional.pad(g.transpose(1, 2).flatten(0, 1).double(), (0, NT * C - T))
        G_all = g_all.view(BH, NT, C).cumsum(2)                              # [BH, NT, C]
        G_last = G_all[..., -1:]            # [BH, NT, 1]: the padding (g = 0) adds nothing after the last token
        eG_all, eend_all = _exp(G_all, dtype), _exp(G_last - G_all, dtype)   # [BH, NT, C]
        last_all = _exp(G_last, dtype)                                       # [BH, NT, 1]
    if beta is not None:
        b_all = beta.transpose(1, 2).flatten(0, 1).to(dtype)                 # [BH, T]
    for s in range(0, T, C):
        e = min(s + C, T)
        c, n = e - s, s // C
        q_c, k_c, v_c = heads(q, s, e), heads(k, s, e), heads(v, s, e)     # [BH, c, K|V]
        if g is None:
            G = None
            e_G, q_g, k_end = None, q_c * scale, k_c                         # no decay
        elif scalars:
            G = G_all[:, n, :c]                                              # [BH, c]
            e_G, e_end = eG_all[:, n, :c, None], eend_all[:, n, :c, None]
            last = last_all[:, n, :, None]                                   # [BH, 1, 1]
            q_g, k_end = q_c * (scale * e_G), k_c * e_end
        else:
            G = g[:, s:e].transpose(1, 2).flatten(0, 1).double().cumsum(1)  # [BH, c, K]
            if per_channel:
                e_G, e_end = _exp(G, dtype), _exp(G[..., -1:, :] - G, dtype)
                last = _exp(G[..., -1, :], dtype)[..., None]                 # [BH, K, 1]
            else:
                e_G, e_end = _exp(G, dtype)[..., None], _exp(G[..., -1:] - G, dtype)[..., None]
                last = _exp(G[..., -1], dtype)[..., None, None]              # [BH, 1, 1]
            q_g, k_end = q_c * (scale * e_G), k_c * e_end
        if per_channel:
            P = pairwise(q_c, k_c, G, True)                                  # [BH, c, c]
        else:   # one decay matrix Γ_ij = exp(G_i − G_j) (j ≤ i) for both P and A
            if c not in masks:
                masks[c] = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
            D = None
            if G is not None:
                D = torch.sub(G[..., :, None], G[..., None, :]).to(dtype)
                D = D.masked_fill_(~masks[c], float("-inf")).exp_()          # [BH, c, c]
            P = q_c @ k_c.transpose(-1, -2)                                  # [BH, c, K] @ [BH, K, c]
            P = P.tril_() if D is None else P.mul_(D)

        if beta is not None:
            b = b_all[:, s:e, None]                                          # [BH, c, 1]
            if per_channel:
                A = pairwise(b * k_c, k_c, G, False)                         # strict lower
            else:               # β_i ⟨k_i, k_j⟩ Γ_ij: β scales the rows of the [c, c] product, not k
                A = (k_c @ k_c.transpose(-1, -2)).mul_(b if D is None else D * b)   # [BH, c, K] @ [BH, K, c]
            if c not in eyes:
                eyes[c] = torch.eye(c, dtype=dtype, device=q.device)
            # T = (I + A)⁻¹ (unitriangular: the diagonal and upper triangle of A are not read, and
            # autograd gives A a strictly lower gradient); then R = U − W S = T (β V − (β e^G K) S)
            # (solved as X (I + A) = I: the same two-sided inverse, 1.7-2x faster than the left solve
            # for [16, 64, 64] in torch 2.13's CPU LAPACK path)
            Tinv = torch.linalg.solve_triangular(A, eyes[c], upper=False, unitriangular=True, left=False)
            # R = U − W S = T (β V − (β e^G K) S) = (T diag(β)) (V − (e^G K) S): β scales T's columns
            k_g = k_c if e_G is None else k_c * e_G                          # e^G ⊙ K
            R = (Tinv * b.transpose(-1, -2)) @ torch.baddbmm(v_c, k_g, S, alpha=-1)   # [BH, c, c] @ [BH, c, V]
        else:
            R = v_c
        o_c = (q_g @ S).baddbmm_(P, R, alpha=scale)                          # scale ((Q e^G) S + P R)
        o[:, s:e] = o_c.view(B, HV, c, V).transpose(1, 2)
        if in_place:                                                         # diag(e^{G_last}) S + K_endᵀ R
            (S if G is None else S.mul_(last)).baddbmm_(k_end.transpose(-1, -2), R)
        else:
            S = torch.baddbmm(S if G is None else S * last, k_end.transpose(-1, -2), R)

    if index is not None:
        o = unpad_varlen(o, index)
    return o, S.view(B, HV, K, V)
