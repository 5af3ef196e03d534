"""Context parallelism for the chunk ops: sequences split over the ranks of a torch.distributed group.

Every rank holds a contiguous slice of the tokens, in rank order (rank r holds global tokens
[a_r, a_r + T_r); the slices may have different lengths, each at least one token). Sequences may
cross any number of rank boundaries. The public chunk ops take ``cp_group=`` and otherwise keep
their arguments; `api.run` hands such calls to `chunk_cp`.

Conventions (the same tensors a single-process call would take, cut along T):

- dense batch (cu_seqlens None): q [B, T_r, H, K] etc.; every row b is one sequence running
  through all ranks. initial_state [B, HV, K, V] is read on rank 0.
- varlen: q [1, T_r, H, K] and ``cu_seqlens`` = the offsets of the WHOLE packed batch ([N + 1],
  last value Σ_r T_r), the same tensor on every rank (as FlashAttention / fla pass it before the
  split). initial_state [N, HV, K, V] (the same on every rank): row n is read only on the rank
  that holds sequence n's first token.
- final_state [N, HV, K, V] (or [N, HV, V, K]) on every rank: row n holds sequence n's final
  state on the rank that holds its last token and is zero on every other rank, so a SUM
  all-reduce over the group gives every final state everywhere (a zero-length sequence belongs to
  the rank whose slice contains its offset, the last rank when it sits at the end).
- gradients: q, k, v, g, beta get their local gradients; initial_state (and A_log, dt_bias) get,
  on each rank, the part of the gradient that flows through that rank: sum them over the group
  (as for any parameter replicated over a context-parallel group).
- every rank must call the op, and in training every rank must run backward through o or
  final_state (the backward holds one collective). Argument errors on any rank, and ranks that
  disagree on shapes, cu_seqlens or requires_grad, raise a ValueError on every rank (no hang).

The math. Per sequence and value head the recurrence is affine in the state: over a segment of
tokens 1..e with A_t = (I − β_t k_t k_tᵀ) diag(e^{g_t}) (simple GLA: A_t = e^{g_t} I) and the
prefix products M_t = A_t ⋯ A_1 [K, K],

    S_t = M_t · S_in + S⁰_t,        o_t = o⁰_t + S_inᵀ q̂_t,   q̂_t = scale · M_tᵀ q_t,

where S⁰, o⁰ are the states and outputs from a zero incoming state, and P = M_e is the segment's
transition (S_out = P · S_in + Q with Q = S⁰_e). Per rank:

1. the segment that came in from the left runs through the public op once with V + K value
   columns, values [v | 0] from the state [0 | I]: the columns are independent, so its states are
   [S⁰_t | M_t], its output [o⁰ | q̂] and its final state [Q | P] (two calls when V + K exceeds the
   Triton head-dim limit; for simple GLA q̂_t = scale · e^{G_t} q_t and P = e^{G_e} I in closed form);
2. the rest of the slice runs through the op as usual, every sequence from its own initial_state;
3. every rank contributes [P̃ | Q̃] for the row it carries out (P̃ = P when the carried-out sequence
   also came in from the left, else 0; Q̃ = its local final state, else 0) to one all-gather; each
   rank folds the ranks before it, S ← P̃_j S + Q̃_j, from the last rank where its sequence began;
4. o = o⁰ + q̂ S_in on the carried-in tokens, final state = Q + P S_in.

Everything is torch autograd over the public op (the Triton kernels on CUDA tensors) and one
differentiable all-gather (`_AllGather`: reduce-scatter in backward); README.md (Context parallelism)
gives the costs and what a fused kernel would do instead.
"""
from __future__ import annotations

import array
import bisect
import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import api
from .reference.utils import expand_heads


# ----------------------------------------------------------------------------------------------
# collectives
# ----------------------------------------------------------------------------------------------

class _AllGather(torch.autograd.Function):
    """x [*s] on every rank -> [W, *s] (rank order); backward: the gradients of slot r summed over
    the ranks, delivered to rank r (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        parts = [p.contiguous() for p in grad.unbind(0)]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=ctx.group)
        return out, None


class _Tie(torch.autograd.Function):
    """A copy of x whose graph also reaches ``anchor`` (with a zero gradient).

    Keeps the all-gather in every rank's backward graph, so every rank joins its reduce-scatter even
    when its own outputs do not depend on the other ranks (e.g. rank 0 of a dense batch).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        ctx.anchor = (anchor.shape, anchor.dtype, anchor.device)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.anchor
        return grad, torch.zeros(shape, dtype=dtype, device=device)


_SUMMARY = ("tokens", "B", "H", "HV", "K", "V", "cu_seqlens (a checksum)", "requires_grad")


def _checksum(values: list[int] | None) -> int:
    """A 56-bit hash of cu_seqlens (-1 for None): ranks that pass different offsets disagree."""
    if values is None:
        return -1
    return int.from_bytes(hashlib.blake2b(array.array("q", values).tobytes(), digest_size=7).digest(), "little")


def _exchange_device(q, group) -> torch.device:
    """Where the collectives' tensors live: q's device, except that NCCL takes CUDA tensors only, so a group that
    runs on NCCL alone exchanges on the current CUDA device (torch.cuda.set_device, the caller's) when q is not a CUDA
    tensor; every rank still joins the summary exchange, and the error raised after it names q."""
    if isinstance(q, torch.Tensor) and q.device.type == "cuda":
        return q.device
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return q.device if isinstance(q, torch.Tensor) else torch.device("cpu")


def _gather_summary(summary: list[int] | None, device: torch.device, group) -> list[list[int] | None]:
    """Every rank's summary (see _SUMMARY; None where its own checks failed), in rank order.

    One small all-gather and a host sync.
    """
    row = [1, *summary] if summary is not None else [0] * (len(_SUMMARY) + 1)
    t = torch.tensor(row, dtype=torch.int64, device=device)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    rows = torch.stack(parts).tolist()
    return [r[1:] if r[0] else None for r in rows]


# ----------------------------------------------------------------------------------------------
# the plan: where each rank's tokens sit in the global batch (host-side integers)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankPlan:
    """One rank's share of the batch.

    start, end: its global token range [start, end).
    seqs: global ids of its local sequences, a contiguous range (dense: all B rows).
    local_cu: offsets of those sequences in its slice ([len(seqs) + 1]); None for a dense batch.
    carry_in: its first sequence(s) began on an earlier rank.
    carry_out: its last sequence(s) continue on a later rank.
    head: number of local tokens of the carried-in segment (0 without carry_in).
    through: the carried-in sequence is also the carried-out one (it covers the whole slice).
    ends: positions in ``seqs`` of the sequences whose last token is here (all but a carried-out one).
    """
    start: int
    end: int
    seqs: range
    local_cu: tuple[int, ...] | None
    carry_in: bool
    carry_out: bool
    head: int
    through: bool
    ends: range


def _bounds(lengths: list[int]) -> list[int]:
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return bounds


def plan_rank(r: int, lengths: list[int], cu: list[int] | None, B: int) -> RankPlan:
    """Rank r's plan from the ranks' token counts and the global offsets (None: a dense batch of B rows).

    O(log N + local sequences) host work (bisection on the offsets). A zero-length sequence belongs
    to the rank whose slice contains its offset, the last rank when it sits at the end.
    """
    W, bounds = len(lengths), _bounds(lengths)
    a, b = bounds[r], bounds[r + 1]
    if cu is None:
        carry_in, carry_out = r > 0, r < W - 1
        return RankPlan(a, b, range(B), None, carry_in, carry_out, (b - a) if carry_in else 0,
                        carry_in and carry_out, range(B) if r == W - 1 else range(0))
    N = len(cu) - 1
    n_in = bisect.bisect_right(cu, a) - 1                   # the sequence holding token a
    carry_in = cu[n_in] < a
    first = n_in if carry_in else bisect.bisect_left(cu, a)    # (zero-length sequences at a come first)
    last = N - 1 if r == W - 1 else bisect.bisect_right(cu, b - 1) - 1   # the sequence holding token b − 1
    carry_out = cu[last + 1] > b
    local_cu = tuple(min(max(c - a, 0), b - a) for c in cu[first:last + 2])
    n_local = last + 1 - first
    return RankPlan(a, b, range(first, last + 1), local_cu, carry_in, carry_out, local_cu[1] if carry_in else 0,
                    carry_in and carry_out and n_local == 1, range(n_local - 1 if carry_out else n_local))


def plan_ranks(lengths: list[int], cu: list[int] | None, B: int) -> list[RankPlan]:
    """Every rank's plan (see `plan_rank`)."""
    return [plan_rank(r, lengths, cu, B) for r in range(len(lengths))]


def _passes_through(j: int, lengths: list[int], cu: list[int] | None) -> bool:
    """Whether one sequence covers rank j's whole slice and continues on both sides."""
    if cu is None:
        return 0 < j < len(lengths) - 1
    bounds = _bounds(lengths)
    n = bisect.bisect_right(cu, bounds[j]) - 1
    return cu[n] < bounds[j] and cu[n + 1] > bounds[j + 1]


# ----------------------------------------------------------------------------------------------
# the transition of the carried-in segment
# ----------------------------------------------------------------------------------------------

def _carried_segment(fam: api.Family, q, k, v, g, beta, scale, chunk_size, backend, ct):
    """n segments of e tokens that came in from the left: their zero-state results and transitions.

    Returns o⁰ [n, e, HV, V] (q's dtype) and Q = S⁰_e [n, HV, K, V], the outputs and final states from
    a zero incoming state, and q̂ = scale · M_tᵀ q_t [n, e, HV, K] and P = M_e [n, HV, K, K] (dtype ct).

    M_t = A_t ⋯ A_1. The op acts on the columns of (values, state) independently, so run from the
    state [0 | I] with values [v | 0] its state is [S⁰_t | M_t]: one call with V + K value columns
    gives o = [o⁰ | q̂] and final state [Q | P], sharing the WY form between the two (two calls when
    V + K exceeds the Triton head-dim limit). Simple GLA: A_t = e^{g_t} I, so q̂_t = scale · e^{G_t} q_t
    and P = e^{G_e} I in closed form (G the running sum of g).
    """
    n, e, HV, V = v.shape
    K = q.shape[-1]
    if not fam.delta:
        o0, Q = api.run(fam, "chunk", q, k, v, g, beta, scale, None, True, None,
                        chunk_size=chunk_size, backend=backend)
        decay = g.double().cumsum(1).to(ct).exp()                                # [n, e, HV]
        q_hat = scale * expand_heads(q, HV).to(ct) * decay[..., None]           # [n, e, HV, K]
        P = torch.diag_embed(decay[:, -1, :, None].expand(n, HV, K))           # [n, HV, K, K]
        return o0, Q.to(ct), q_hat, P
    eye = torch.eye(K, dtype=ct, device=q.device).expand(n, HV, K, K)
    if V + K <= api.TRITON_MAX_HEAD_DIM:
        v_ext = torch.cat([v, v.new_zeros(n, e, HV, K)], dim=-1)                # [n, e, HV, V + K]
        h_ext = torch.cat([eye.new_zeros(n, HV, K, V), eye], dim=-1)            # [n, HV, K, V + K]
        o, ht = api.run(fam, "chunk", q, k, v_ext, g, beta, scale, h_ext, True, None,
                        chunk_size=chunk_size, backend=backend)
        return o[..., :V], ht[..., :V].to(ct), o[..., V:].to(ct), ht[..., V:].to(ct)
    o0, Q = api.run(fam, "chunk", q, k, v, g, beta, scale, None, True, None, chunk_size=chunk_size, backend=backend)
    q_hat, P = api.run(fam, "chunk", q, k, v.new_zeros(n, e, HV, K), g, beta, scale, eye.contiguous(), True, None,
                       chunk_size=chunk_size, backend=backend)
    return o0, Q.to(ct), q_hat.to(ct), P.to(ct)


# ----------------------------------------------------------------------------------------------
# the op
# ----------------------------------------------------------------------------------------------

def chunk_cp(fam: api.Family, mode: str, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, *,
             cp_group, use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, use_gate_in_kernel=False,
             A_log=None, dt_bias=None, lower_bound=None, transpose_state_layout=False, chunk_size=32,
             backend="auto", cu_seqlens_cpu=None, chunk_indices=None, state_indices=None, allow_neg_eigval=False,
             safe_gate=False, g_gamma=None, state_v_first=False):
    """`api.run` for a call with ``cp_group``: the module docstring gives the conventions and the math.

    chunk_indices is a per-batch planning hint for the global batch; each rank plans its own slice,
    so it is not used here.
    """
    if mode != "chunk":
        raise ValueError("cp_group (context parallelism) is available for the chunk ops only")
    g, transpose_state_layout = api._fla_options(fam, v, g, use_beta_sigmoid_in_kernel, use_gate_in_kernel,
                                                 lower_bound, allow_neg_eigval, safe_gate, g_gamma,
                                                 transpose_state_layout, state_v_first)
    if state_indices is not None:
        raise ValueError("state_indices (a decode-time state pool) cannot be combined with cp_group")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("cp_group is given but torch.distributed is not initialized")
    rank = dist.get_rank(cp_group)
    if rank < 0:
        raise ValueError("this process is not a member of cp_group")

    # Checks. An argument error on one rank must not leave the others waiting in a collective: each
    # rank checks what it can alone, then one all-gather of a summary (tokens, shapes, a checksum of
    # cu_seqlens, whether a backward will follow) lets every rank raise the same error.
    error, summary, host_cu = None, None, None
    try:
        if dist.get_backend(cp_group) == dist.Backend.NCCL and isinstance(q, torch.Tensor) and q.device.type != "cuda":
            raise ValueError(f"cp_group runs on NCCL, which takes CUDA tensors; q is on {q.device}")
        B, T, H, HV, K, V, _ = api._check_inputs(
            fam, q, k, v, g, beta, scale, None, None, None, transpose_state_layout, backend, use_gate_in_kernel,
            A_log, dt_bias, lower_bound)
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        if cu_seqlens is not None:
            api._check_tensor("cu_seqlens", cu_seqlens, 1)
            if cu_seqlens.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
            if cu_seqlens.device != q.device:
                raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, q on {q.device}")
            host_cu = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.detach().cpu()).tolist()
        elif cu_seqlens_cpu is not None:
            raise ValueError("cu_seqlens_cpu is given but cu_seqlens is None")
        N = B if host_cu is None else len(host_cu) - 1
        if initial_state is not None:
            api._check_tensor("initial_state", initial_state, 4)
            api._check_float("initial_state", initial_state)
            want = (N, HV, V, K) if transpose_state_layout else (N, HV, K, V)
            if tuple(initial_state.shape) != want:
                raise ValueError(f"initial_state must have shape {list(want)} (one row per sequence of the whole "
                                 f"batch, the same on every rank), got {tuple(initial_state.shape)}")
            if initial_state.device != q.device:
                raise ValueError(f"initial_state is on {initial_state.device}, q on {q.device}")
        # the backward holds a collective: every rank must agree on whether there will be one
        needs_grad = torch.is_grad_enabled() and any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, v, g, beta, initial_state, A_log, dt_bias))
        summary = [T, B, H, HV, K, V, _checksum(host_cu), int(needs_grad)]
    except (TypeError, ValueError) as e:
        error = e
    table = _gather_summary(summary, _exchange_device(q, cp_group), cp_group)
    if error is not None:
        raise error
    failed = [r for r, row in enumerate(table) if row is None]
    if failed:
        raise ValueError(f"rank(s) {failed} of cp_group rejected their arguments (see the error raised there)")
    for i, what in enumerate(_SUMMARY[1:], 1):
        values = [row[i] for row in table]
        if len(set(values)) > 1:
            if what.startswith("cu_seqlens"):     # show which ranks agree, not the checksums
                values = [[r for r, x in enumerate(values) if x == y] for y in dict.fromkeys(values)]
                what = "cu_seqlens (ranks that agree)"
            raise ValueError(f"the ranks of cp_group disagree on {what}: {values} (every rank passes its slice of "
                             f"the same batch: the whole batch's cu_seqlens, the same shapes and requires_grad)")
    lengths = [row[0] for row in table]
    if min(lengths) < 1:
        raise ValueError(f"with cp_group every rank must hold at least one token; tokens per rank: {lengths}")
    T_all = sum(lengths)
    cu = None
    if cu_seqlens is not None:
        try:
            cu = api.check_cu_seqlens(cu_seqlens, torch.tensor(host_cu), B, T_all).tolist()
        except ValueError as e:
            raise ValueError(f"{e}; with cp_group, cu_seqlens holds the offsets of the whole batch: "
                             f"T = {T_all}, the sum of the ranks' tokens {lengths}") from None

    scale = K ** -0.5 if scale is None else float(scale)
    q, k, g, beta = api._prelude(fam, q, k, g, beta, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                                 use_gate_in_kernel, A_log, dt_bias, lower_bound, allow_neg_eigval)
    ct = api._compute_dtype(q, initial_state)
    me = plan_rank(rank, lengths, cu, B)
    h0 = api._to_kv(initial_state, transpose_state_layout)

    # 1. the segment that came in from the left: from zero, with its transition
    rows = B if cu is None else 1                                               # carried rows
    e = me.head
    if me.carry_in:
        o_head0, Q_head, q_hat, P = _carried_segment(
            fam, q[:, :e], k[:, :e], v[:, :e], None if g is None else g[:, :e],
            None if beta is None else beta[:, :e], scale, chunk_size, backend, ct)
    # 2. the rest of the slice: every sequence from its own initial state
    rest = e < T
    if rest:
        if cu is None:
            h0_rest, cu_rest, cu_rest_cpu = h0, None, None
        else:
            first = 1 if me.carry_in else 0
            h0_rest = None if h0 is None else h0[me.seqs.start + first:me.seqs.stop]
            cu_rest_cpu = torch.tensor([c - e for c in me.local_cu[first:]], dtype=cu_seqlens.dtype)
            cu_rest = cu_rest_cpu.to(cu_seqlens.device)
        o_rest, ht_rest = api.run(fam, "chunk", q[:, e:], k[:, e:], v[:, e:], None if g is None else g[:, e:],
                                  None if beta is None else beta[:, e:], scale, h0_rest, True, cu_rest,
                                  chunk_size=chunk_size, backend=backend, cu_seqlens_cpu=cu_rest_cpu)
        ht_rest = ht_rest.to(ct)                                                # [N_local (− 1), HV, K, V]
    ht0 = torch.cat([Q_head, ht_rest]) if me.carry_in and rest else (Q_head if me.carry_in else ht_rest)

    # 3. exchange [P̃ | Q̃] and fold the ranks before this one
    P_out = P if me.through else ht0.new_zeros(rows, HV, K, K)
    Q_out = ht0[-rows:] if me.carry_out else ht0.new_zeros(rows, HV, K, V)
    X = torch.cat([P_out, Q_out], dim=-1)                                       # [rows, HV, K, K + V]
    if needs_grad and not X.requires_grad:
        X.requires_grad_()    # (zeros here) the all-gather must be in every rank's backward graph
    gathered = _AllGather.apply(X, cp_group)                                    # [W, rows, HV, K, K + V]
    if me.carry_in:
        j0 = next(j for j in range(rank - 1, -1, -1) if not _passes_through(j, lengths, cu))
        S_in = gathered[j0, ..., K:]
        for j in range(j0 + 1, rank):
            S_in = gathered[j, ..., :K] @ S_in + gathered[j, ..., K:]           # [rows, HV, K, K] @ [rows, HV, K, V]

        # 4. correct the carried-in tokens and final state
        corr = torch.einsum("bthk,bhkv->bthv", q_hat, S_in)                     # [rows, e, HV, V]
        head = (o_head0.to(ct) + corr).to(o_head0.dtype)
        o = torch.cat([head, o_rest], dim=1) if rest else head
        ht_in = Q_head + P @ S_in                                               # [rows, HV, K, K] @ [rows, HV, K, V]
        ht_local = torch.cat([ht_in, ht_rest]) if rest else ht_in
    else:
        o = _Tie.apply(o_rest, gathered) if needs_grad else o_rest
        ht_local = ht0
    if not output_final_state:
        return o, None
    # rows seqs.start .. + len(ends) end here (a carried-out sequence is always the last local one)
    n0, n1 = me.seqs.start, me.seqs.start + len(me.ends)
    final = torch.cat([ht0.new_zeros(n0, HV, K, V), ht_local[:len(me.ends)], ht0.new_zeros(N - n1, HV, K, V)])
    final = _Tie.apply(final, gathered) if needs_grad else final
    if transpose_state_layout:
        final = final.transpose(-1, -2).contiguous()
    return o, final
