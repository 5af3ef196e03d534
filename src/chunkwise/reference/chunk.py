"""The chunk algorithm (docs/design.md §2) in batched PyTorch: the CPU backend and the autograd fallback.

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

Without the delta rule (simple GLA) W = 0 and U = V. Every sequence and head is batched. The loop
runs over blocks of chunks (256 tokens): the state-independent part (P, A, T = (I + A)⁻¹ from one
batched triangular solve, the decayed q and k) for all the block's chunks at once, then the state
hand-over chunk by chunk, R = T diag(β) (V − (e^G K) S) (W is never formed), five batched products
per chunk with the sums fused (baddbmm) and the output written in place. Intermediates are a block's
[nb·B·HV, C, ·] tensors and stay in cache. At B = 1, T = 4096, HV = 16, K = V = 128 most of the time
is in the matrix products (3·K·V multiply-adds per token for the state, ≈ 4·C·K for the chunk); the
default C = 32 halves the second term against 64 and the blocks keep the Python calls per token low.

Exponentials are only ever taken of differences G_i − G_j with i ≥ j (or of G itself, which is
≤ 0), so gates summing to −1e4 inside a chunk stay finite.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from .utils import expand_heads, pad_varlen, unpad_varlen, varlen_pad_index

SUB = 16  # sub-block of the per-channel pairwise products
BLOCK_TOKENS = 256  # tokens per block of chunks whose state-independent work is batched (_chunk_forward)


def _exp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """exp of a gate difference formed in float64, taken in the arithmetic dtype."""
    return x.to(dtype).exp()


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
    """A persistent pool of ``workers`` threads: a fresh thread's first matrix products set up their
    BLAS buffers again, a cost paid on every call with threads made per call."""
    if workers not in _POOLS:
        _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="chunkwise-cpu")
    return _POOLS[workers]


def _needs_grad(*xs) -> bool:
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)


def chunk_forward(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None, chunk_size=32,
                  dtype=torch.float32):
    """The chunk algorithm (see `_chunk_forward` for the shapes), differentiable through autograd.

    A non-finite input reaches earlier tokens of its chunk through the triangular products (0 · NaN
    is NaN), which the recurrence never does; `_causal_nonfinite` puts those tokens right.

    On the CPU, without autograd and with several torch threads, the q/k head groups are split over
    that many Python threads that each run `_chunk_forward` single-threaded (the matrix products
    release the GIL). Every op of the chunk loop is small ([B·HV, C, ·]), so splitting the heads
    scales far better than intra-op OpenMP threads, which synchronise at every op of every chunk and
    stall whenever a core is busy. The result is bit-identical to the single-threaded call.
    """
    o, S, finite = _chunk_forward_heads(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, dtype)
    # a non-finite k, v, g or β always leaves the final state non-finite, so a check of the state is all the
    # finite case pays (q enters its own token's row only and cannot reach an earlier one)
    if not finite:
        o = _causal_nonfinite(o, q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, dtype)
    return o, S


def _causal_nonfinite(o, q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, dtype):
    """o with the tokens before each sequence's first non-finite input (any of q, k, v, g, β) taken
    from a run on that sequence's prefix alone (its later tokens zeroed), as the recurrence gives them;
    tokens at or after it keep the run's values. The zeroed tokens meet the prefix's rows only through
    products with the triangular zeros, so those rows are the same as with any finite input there."""
    after = None                                                        # [B, T]: at or after a non-finite input
    for x in (q, k, v, g, beta):
        if x is not None:
            bad = ~torch.isfinite(x).flatten(2).all(-1)
            after = bad if after is None else after | bad
    if not bool(after.any()):
        return o                                                         # finite inputs that overflowed
    count = after.cumsum(1)                                              # non-finite tokens up to each one
    if cu_seqlens is not None:                                           # counted from each sequence's start
        start = torch.cat([count.new_zeros(1, 1), count], 1)[0, cu_seqlens[:-1].long()]
        count = count - start.repeat_interleave((cu_seqlens[1:] - cu_seqlens[:-1]).long())[None]
    after = count > 0
    clean = [None if x is None else x.masked_fill(after.view(*after.shape, *[1] * (x.dim() - 2)), 0)
             for x in (q, k, v, g, beta)]
    o_prefix = _chunk_forward_heads(*clean, scale, initial_state, cu_seqlens, chunk_size, dtype)[0]
    return torch.where(after[:, :, None, None], o, o_prefix)


def _chunk_forward_heads(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, dtype):
    """`_chunk_forward`, its heads split over threads where that pays (see `chunk_forward`).
    Returns (o, final state, whether the final state is finite)."""
    workers = min(torch.get_num_threads(), q.shape[2])
    if (workers < 2 or q.device.type != "cpu"
            or _needs_grad(q, k, v, g, beta, initial_state)):
        o, S = _chunk_forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, dtype)
        return o, S, bool(torch.isfinite(S).all())
    H, HV = q.shape[2], v.shape[2]
    bounds = [H * i // workers for i in range(workers + 1)]            # q/k heads of each worker
    group = HV // H

    def part(i):
        qk, vh = slice(bounds[i], bounds[i + 1]), slice(bounds[i] * group, bounds[i + 1] * group)
        torch.set_num_threads(1)
        o, S = _chunk_forward(q[:, :, qk], k[:, :, qk], v[:, :, vh], None if g is None else g[:, :, vh],
                              None if beta is None else beta[:, :, vh], scale,
                              None if initial_state is None else initial_state[:, vh], cu_seqlens,
                              chunk_size, dtype)
        return o, S, bool(torch.isfinite(S).all())     # (checked here, single-threaded, while S is in cache)

    threads = torch.get_num_threads()
    try:
        results = list(_pool(workers).map(part, range(workers)))
    finally:
        torch.set_num_threads(threads)      # the MKL / OpenMP setting is process-wide: restore it
    # (the parts are concatenated here: workers writing their heads into one shared output were no faster)
    return (torch.cat([o for o, _, _ in results], 2), torch.cat([S for _, S, _ in results], 1),
            all(finite for _, _, finite in results))


def _chunk_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    scale: float,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 32,
    dtype: torch.dtype = torch.float32,
    block: int | None = None,
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
        block: chunks per block (default BLOCK_TOKENS // chunk_size)

    Returns:
        o: [B, T, HV, V] in ``dtype``; final_state: [N, HV, K, V] in ``dtype``.

    Two loops. Over blocks of a few chunks, everything that does not depend on the state, for all the
    block's chunks in one batch of [nb·B·HV, C, ·] tensors: P, A, T = (I + A)⁻¹ diag(β), Q e^G, K e^G,
    K e^{G_last − G}. Then over the block's chunks, the state hand-over: five products per chunk
    (R = T diag(β) (V − (e^G K) S): W and U are never formed, which would save one product in the loop
    but cost C²K more multiply-adds per chunk). Every intermediate is a block's, so it stays in cache and
    is reused by the allocator; materialised for the whole sequence ([B, HV, T/C, C, ·]) they make the
    CPU backend memory- and page-fault-bound. Batching the chunks of a block cuts the Python calls per
    token, which is what limits two threads sharing the GIL (benchmarks/bench_cpu.py; the timings are
    in docs/performance.md).
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
    K, V = q.shape[-1], v.shape[-1]
    BH = B * HV
    NB = block or max(1, BLOCK_TOKENS // C)

    S = (q.new_zeros(BH, K, V, dtype=dtype) if initial_state is None
         else initial_state.to(dtype).reshape(BH, K, V))                    # [B·HV, K, V]
    # without autograd, S is updated in place (a fresh 1 MB state per chunk costs page faults)
    in_place = not _needs_grad(q, k, v, g, beta, initial_state)
    if in_place and initial_state is not None:
        S = S.clone()
    consts: dict[tuple, torch.Tensor] = {}

    def const(kind, c):
        if (kind, c) not in consts:
            ones = torch.ones(c, c, dtype=torch.bool, device=q.device)
            consts[kind, c] = torch.eye(c, dtype=dtype, device=q.device) if kind == "eye" else ones.tril()
        return consts[kind, c]

    o = v.new_empty(B, T, HV, V, dtype=dtype)
    # the per-token scalars of every chunk at once (few, small tensors; the block loop only slices
    # them): the chunk-local cumulative gate G in float64 -- after a hard reset (g = -1e4) the
    # cumulative sums are large and their differences, the only thing ever exponentiated, would lose
    # ~3 digits in float32 -- and its exponentials, and β
    NT = -(-T // C)
    scalars = g is not None and not per_channel

    def chunk_major(x, pad_dtype):   # [B, T, HV] -> [NT, B·HV, C] (zero-padded past T)
        x = torch.nn.functional.pad(x.permute(0, 2, 1).reshape(BH, T).to(pad_dtype), (0, NT * C - T))
        return x.view(BH, NT, C).transpose(0, 1).contiguous()

    if scalars:
        G_all = chunk_major(g, torch.float64).cumsum(2)                      # [NT, BH, C]
        G_last = G_all[..., -1:]            # [NT, BH, 1]: the padding (g = 0) adds nothing after the last token
        eG_all, eend_all = _exp(G_all, dtype), _exp(G_last - G_all, dtype)   # [NT, BH, C]
        last_all = _exp(G_last, dtype)                                       # [NT, BH, 1]
    if beta is not None:
        b_all = chunk_major(beta, dtype)                                     # [NT, BH, C]

    def blocked(x, s, nb, c):
        """x[:, s : s + nb·c] ([B, ·, H|HV, ...]) -> [nb·B·HV, c, ...] (chunk-major) in the arithmetic dtype."""
        x = expand_heads(x[:, s:s + nb * c], HV).unflatten(1, (nb, c))      # [B, nb, c, HV, ...]
        return x.transpose(2, 3).transpose(0, 1).reshape(nb * BH, c, *x.shape[4:]).to(dtype)

    # blocks of NB whole chunks, then the partial last chunk alone
    spans = [(s, min(NB, (T - s) // C), C) for s in range(0, T - T % C, NB * C)]
    if T % C:
        spans.append((T - T % C, 1, T % C))
    for s, nb, c in spans:
        n0 = s // C
        q_c, k_c, v_c = blocked(q, s, nb, c), blocked(k, s, nb, c), blocked(v, s, nb, c)   # [nb·BH, c, K|V]
        if g is None:
            G = e_G = None
            q_g, k_end = q_c * scale, k_c                                    # no decay
        elif scalars:
            G = G_all[n0:n0 + nb, :, :c].flatten(0, 1)                      # [nb·BH, c]
            e_G = eG_all[n0:n0 + nb, :, :c].flatten(0, 1)[..., None]        # [nb·BH, c, 1]
            e_end = eend_all[n0:n0 + nb, :, :c].flatten(0, 1)[..., None]
            last = last_all[n0:n0 + nb].flatten(0, 1)[..., None]            # [nb·BH, 1, 1]
            q_g, k_end = q_c * (scale * e_G), k_c * e_end
        else:
            G = blocked(g, s, nb, c).double().cumsum(1)                      # [nb·BH, c, K]
            e_G, e_end = _exp(G, dtype), _exp(G[..., -1:, :] - G, dtype)
            last = _exp(G[..., -1, :], dtype)[..., None]                     # [nb·BH, K, 1]
            q_g, k_end = q_c * (scale * e_G), k_c * e_end
        if per_channel:
            P = _pairwise_channel(q_c, k_c, G, True)                         # [nb·BH, c, c]
        else:   # one decay matrix Γ_ij = exp(G_i − G_j) (j ≤ i) for both P and A
            D = None
            if G is not None:
                D = torch.sub(G[..., :, None], G[..., None, :]).to(dtype)
                D = D.masked_fill_(~const("tril", c), float("-inf")).exp_()  # [nb·BH, c, c]
            P = q_c @ k_c.transpose(-1, -2)                                  # [nb·BH, c, K] @ [nb·BH, K, c]
            P = P.tril_() if D is None else P.mul_(D)
        if beta is not None:
            b = b_all[n0:n0 + nb, :, :c].flatten(0, 1)[..., None]           # [nb·BH, c, 1]
            if per_channel:
                A = _pairwise_channel(b * k_c, k_c, G, False)                # strict lower
            else:               # β_i ⟨k_i, k_j⟩ Γ_ij: β scales the rows of the [c, c] product, not k
                A = (k_c @ k_c.transpose(-1, -2)).mul_(b if D is None else D * b)   # [nb·BH, c, K] @ [nb·BH, K, c]
            # T = (I + A)⁻¹ (unitriangular: the diagonal and upper triangle of A are not read, and
            # autograd gives A a strictly lower gradient), solved as X (I + A) = I: the same two-sided
            # inverse, and faster than the left solve in torch's CPU LAPACK path
            Tinv = torch.linalg.solve_triangular(A, const("eye", c), upper=False, unitriangular=True, left=False)
            Tb = Tinv * b.transpose(-1, -2)                                  # T diag(β)
            k_g = k_c if e_G is None else k_c * e_G                          # e^G ⊙ K
        # the state hand-over, chunk by chunk: R = U − W S = (T diag(β)) (V − (e^G K) S)
        split = lambda x: x.unflatten(0, (nb, BH)).unbind(0) if x is not None else [None] * nb  # noqa: E731
        o_b = v_c.new_empty(nb, BH, c, V) if in_place else None
        outs = o_b.unbind(0) if in_place else []
        pre = zip(split(v_c), [None] * nb if beta is None else zip(split(Tb), split(k_g)))
        for q_j, kT_j, P_j, l_j, (x_j, y_j), o_j in zip(split(q_g), split(k_end.transpose(-1, -2)), split(P),
                                                      split(last if G is not None else None), pre,
                                                      outs if in_place else [None] * nb):
            R = x_j if y_j is None else y_j[0] @ torch.baddbmm(x_j, y_j[1], S, alpha=-1)   # [BH, c, c] @ [BH, c, V]
            if in_place:                                                     # scale ((Q e^G) S + P R)
                torch.bmm(q_j, S, out=o_j).baddbmm_(P_j, R, alpha=scale)
                (S if l_j is None else S.mul_(l_j)).baddbmm_(kT_j, R)
            else:
                outs.append(torch.baddbmm(q_j @ S, P_j, R, alpha=scale))
                S = torch.baddbmm(S if l_j is None else S * l_j, kT_j, R)
        o_b = o_b if in_place else torch.stack(outs)                          # [nb, BH, c, V]
        o[:, s:s + nb * c].unflatten(1, (nb, c)).copy_(o_b.view(nb, B, HV, c, V).permute(1, 0, 3, 2, 4))

    if index is not None:
        o = unpad_varlen(o, index)
    return o, S.view(B, HV, K, V)


def chunk_forward_checkpoints(q, k, v, g, beta, scale, initial_state, cu_seqlens, every, checkpoints, chunk_size=32,
                              dtype=torch.float32):
    """`chunk_forward` that also writes prefix checkpoints: sequence n's state after its first (j + 1)·every tokens
    to checkpoints[slots[n] + j] ([n, HV, K, V], any float dtype; slots: chunkwise.checkpoint_slots), for every whole
    ``every`` tokens. The PyTorch backend's way: the batch in ``every``-token pieces with the state handed over
    (one chunk_forward per round of pieces, planned on the host: it reads cu_seqlens there). Exact, since a piece
    boundary is a chunk boundary. Returns (o, final states) as chunk_forward does."""
    B, T, HV, V = q.shape[0], q.shape[1], v.shape[2], v.shape[3]
    tensors = (q, k, v, g, beta)
    if cu_seqlens is None:
        bounds = [b * T for b in range(B + 1)]
        tensors = tuple(None if t is None else t.reshape(1, B * T, *t.shape[2:]) for t in tensors)
    else:
        bounds = cu_seqlens.tolist()
    N = len(bounds) - 1
    lens = [bounds[n + 1] - bounds[n] for n in range(N)]
    slots = [0]
    for L in lens:
        slots.append(slots[-1] + L // every)
    state = (q.new_zeros(N, HV, q.shape[-1], V, dtype=dtype) if initial_state is None
             else initial_state.to(dtype).clone())
    pieces = [[] for _ in range(N)]
    for start in range(0, max(lens, default=0), every):
        seqs = [n for n in range(N) if lens[n] > start]
        spans = [(bounds[n] + start, bounds[n] + min(start + every, lens[n])) for n in seqs]
        part = tuple(None if t is None else torch.cat([t[:, a:b] for a, b in spans], 1) for t in tensors)
        cu = torch.tensor([0] + [b - a for a, b in spans]).cumsum(0).to(q.device)
        rows = torch.tensor(seqs, device=q.device)
        o, ht = chunk_forward(*part, scale, state.index_select(0, rows), cu, chunk_size=chunk_size, dtype=dtype)
        state.index_copy_(0, rows, ht)
        for i, n in enumerate(seqs):
            pieces[n].append(o[:, cu[i]:cu[i + 1]])
            if start + every <= lens[n] and slots[n] + start // every < checkpoints.shape[0]:
                checkpoints[slots[n] + start // every].copy_(ht[i])
    o = torch.cat([p for n in range(N) for p in pieces[n]], 1) if T and N else q.new_zeros(1, 0, HV, V, dtype=dtype)
    return (o.reshape(B, T, HV, V) if cu_seqlens is None else o), state
