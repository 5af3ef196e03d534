"""Mamba2's SSD scan in mamba_ssm's terms, on top of `chunk_simple_gla`.

Per sequence, per head h (its B/C group is h // (nheads // ngroups)), per token t, with
dt_t processed as in mamba_ssm (dt + dt_bias, softplus if ``dt_softplus``, clamp to ``dt_limit``)::

    h_t = exp(A_h · dt_t) · h_{t-1} + dt_t · x_t B_tᵀ          h ∈ R^{headdim × dstate}, fp32
    y_t = h_t C_t + D_h ⊙ x_t
    y_t = y_t ⊙ silu(z_t)                                       when z is given

This is simple GLA with q = C, k = B, v = x·dt, g = A·dt, scale = 1, H = ngroups, HV = nheads
and the state in the [N, HV, V, K] layout (= mamba's [batch, nheads, headdim, dstate]); the D
skip connection and the z gate are applied here, outside the scan, in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .api import _shape, check_cu_seqlens
from .utils import FLOAT_DTYPES
from .ops import chunk_simple_gla


def _tensor(name: str, x, shape: tuple | None = None, what: str = ""):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {what} = {list(shape)}, got {_shape(x)}")


def _check(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_limit, cu_seqlens):
    _tensor("x", x)
    if x.dim() != 4:
        raise ValueError(f"x must be [batch, seqlen, nheads, headdim], got shape {_shape(x)}")
    b, l, h, p = x.shape
    _tensor("B", B)
    if B.dim() != 4 or B.shape[:2] != x.shape[:2]:
        raise ValueError(f"B must be [batch, seqlen, ngroups, dstate] with x's batch and seqlen: "
                         f"x {_shape(x)}, B {_shape(B)}")
    G, n = B.shape[2], B.shape[3]
    if G == 0 or h % G != 0:
        raise ValueError(f"nheads={h} (x {_shape(x)}) must be a multiple of ngroups={G} (B {_shape(B)})")
    _tensor("C", C, (b, l, G, n), "B's shape [batch, seqlen, ngroups, dstate]")
    _tensor("dt", dt, (b, l, h), "[batch, seqlen, nheads]")
    _tensor("A", A, (h,), "[nheads]")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if D is not None:
        _tensor("D", D)
        if tuple(D.shape) not in ((h, p), (h,)):
            raise ValueError(f"D must have shape [nheads, headdim] = {[h, p]} or [nheads] = {[h]}, got {_shape(D)}")
    if z is not None:
        _tensor("z", z, (b, l, h, p), "x's shape [batch, seqlen, nheads, headdim]")
    if dt_bias is not None:
        _tensor("dt_bias", dt_bias, (h,), "[nheads]")
    if (not isinstance(dt_limit, (tuple, list)) or len(dt_limit) != 2
            or not all(isinstance(d, (int, float)) for d in dt_limit) or dt_limit[0] > dt_limit[1]):
        raise ValueError(f"dt_limit must be a pair (dt_min, dt_max) with dt_min <= dt_max, got {dt_limit!r}")
    devices = {name: t.device for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D),
                                              ("z", z), ("dt_bias", dt_bias), ("initial_states", initial_states),
                                              ("seq_idx", seq_idx), ("cu_seqlens", cu_seqlens))
               if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        raise ValueError("all tensors must be on one device, got "
                         + ", ".join(f"{name} on {d}" for name, d in devices.items()))
    N = b
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, None, b, l)
        N = cu_seqlens.numel() - 1
    if seq_idx is not None:
        if not isinstance(seq_idx, torch.Tensor):
            raise TypeError(f"seq_idx must be a torch.Tensor, got {type(seq_idx).__name__}")
        if seq_idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"seq_idx must be int32 or int64, got {seq_idx.dtype}")
        if tuple(seq_idx.shape) != (b, l):
            raise ValueError(f"seq_idx must have shape [batch, seqlen] = {[b, l]}, got {_shape(seq_idx)}")
        if l > 1 and bool((seq_idx[:, 1:] < seq_idx[:, :-1]).any()):
            raise ValueError("seq_idx must be non-decreasing along seqlen (each run of one value is one sequence)")
        if initial_states is not None:
            raise ValueError("initial_states with seq_idx is not supported (which packed sequence would it "
                             "enter?): pack with cu_seqlens and pass initial_states [num_sequences, nheads, "
                             "headdim, dstate]")
    if initial_states is not None:
        _tensor("initial_states", initial_states, (N, h, p, n),
                "[num_sequences, nheads, headdim, dstate]" if cu_seqlens is not None
                else "[batch, nheads, headdim, dstate]")
    return b, l, h, p, G, n


def _segments(seq_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """seq_idx [b, l] (non-decreasing per row) -> cu_seqlens over the b·l tokens packed row after row
    (a new sequence at every row start and wherever seq_idx changes), and the index of each row's
    last sequence (whose final state is the row's final state, as in mamba_ssm)."""
    s = seq_idx.detach().cpu().long()
    b, l = s.shape
    start = torch.ones(b, l, dtype=torch.bool)
    start[:, 1:] = s[:, 1:] != s[:, :-1]
    starts = start.reshape(-1).nonzero().squeeze(1)
    cu = torch.cat([starts, torch.tensor([b * l])])
    last = start.sum(1).cumsum(0) - 1
    return cu, last


def mamba_chunk_scan_combined(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    *,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    return_varlen_states: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
):
    """Mamba2's chunked SSD scan with mamba_ssm's arguments (``mamba_ssm.ops.triton.ssd_combined``).

    Args:
        x: [batch, seqlen, nheads, headdim] inputs (float16 / bfloat16 / float32; float64 on the torch backend).
        dt: [batch, seqlen, nheads] raw time steps, any float dtype; processed in fp32 as
            dt ← clamp(softplus?(dt + dt_bias), *dt_limit) (softplus is the identity above 20, as in mamba_ssm).
        A: [nheads] the (negative) state decay rate; the log-decay of token t is A · dt_t.
        B: [batch, seqlen, ngroups, dstate] input projections (the keys); nheads a multiple of ngroups.
        C: [batch, seqlen, ngroups, dstate] output projections (the queries).
        chunk_size: chunk length of the torch backend's chunk algorithm; the result does not depend on it.
        D: [nheads, headdim] or [nheads] skip connection: y += D · x.
        z: [batch, seqlen, nheads, headdim] gate: y ← y · silu(z) (after the D term).
        dt_bias: [nheads] added to dt before the softplus.
        initial_states: [batch, nheads, headdim, dstate] (with cu_seqlens: [num_sequences, ...]) state entering
            each sequence, read in fp32.
        seq_idx: [batch, seqlen] int, non-decreasing per row: the state is reset wherever it changes (sequences
            packed in a row, as in mamba_ssm). Converted to cu_seqlens; not combinable with initial_states.
        dt_softplus: apply softplus to dt + dt_bias.
        dt_limit: (dt_min, dt_max) clamp applied after the softplus (mamba_ssm always clamps, default (0, inf)).
        return_final_states: also return the final state of each sequence (of each row's last sequence with
            seq_idx), [batch or num_sequences, nheads, headdim, dstate] fp32.
        return_varlen_states: also return the final state of every packed sequence, [num_sequences, nheads,
            headdim, dstate] fp32 (as mamba_ssm; needs cu_seqlens or seq_idx).
        cu_seqlens: [num_sequences + 1] int offsets of sequences packed along seqlen (batch must be 1), as in
            FlashAttention's varlen API; each sequence starts from its own initial state.
        backend: "auto", "torch" or "triton" (see `chunk_simple_gla`).

    Returns:
        y: [batch, seqlen, nheads, headdim] in x's dtype; with return_final_states, (y, final_states); with
        return_varlen_states, (y, varlen_states) or (y, final_states, varlen_states), mamba_ssm's order.
    """
    if return_varlen_states and cu_seqlens is None and seq_idx is None:
        raise ValueError("return_varlen_states=True needs cu_seqlens (or seq_idx): the packed sequences whose "
                         "final states it returns")
    b, l, h, p, G, n = _check(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_limit,
                              cu_seqlens)
    last, cu_cpu = None, None
    if seq_idx is not None:
        seg_cu, last = _segments(seq_idx)
        if cu_seqlens is not None:
            if b != 1 or not torch.equal(seg_cu, cu_seqlens.detach().cpu().long()):
                raise ValueError(f"seq_idx and cu_seqlens describe different sequences: seq_idx starts "
                                 f"{seg_cu.tolist()[:16]}, cu_seqlens {cu_seqlens.tolist()[:16]}")
            last = None
        else:
            cu_seqlens, cu_cpu = seg_cu.to(device=x.device, dtype=torch.int64), seg_cu   # host copy: no sync later

    # the one dtype of q, k, v (the op's contract); fp32 (fp64 for fp64 inputs) for the arithmetic here
    io = x.dtype if B.dtype == x.dtype and C.dtype == x.dtype else torch.promote_types(
        torch.promote_types(x.dtype, B.dtype), C.dtype)
    ct = torch.float64 if io == torch.float64 else torch.float32
    dt = dt.to(ct)
    if dt_bias is not None:
        dt = dt + dt_bias.to(ct)
    if dt_softplus:
        dt = F.softplus(dt)                       # threshold 20: identity above, as mamba_ssm
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    g = dt * A.to(ct)                             # [b, l, h]
    v = (x.to(ct) * dt[..., None]).to(io)         # [b, l, h, p]
    q, k = C.to(io), B.to(io)                     # [b, l, G, n]

    if seq_idx is not None and last is not None:  # rows of packed sequences -> one varlen batch
        q, k, v, g = (t.reshape(1, b * l, *t.shape[2:]) for t in (q, k, v, g))
    y, final = chunk_simple_gla(q, k, v, g, scale=1.0, initial_state=initial_states,
                                output_final_state=return_final_states or return_varlen_states,
                                cu_seqlens=cu_seqlens,
                                transpose_state_layout=True, chunk_size=chunk_size, backend=backend,
                                cu_seqlens_cpu=cu_cpu)
    y = y.reshape(b, l, h, p)
    varlen_states = final                         # one per packed sequence (with cu_seqlens or seq_idx)
    if final is not None and last is not None:
        final = final[last.to(final.device)]

    if D is not None or z is not None:
        y = y.to(ct)
        if D is not None:
            y = y + x.to(ct) * (D.to(ct) if D.dim() == 2 else D.to(ct)[:, None])
        if z is not None:
            y = y * F.silu(z.to(ct))
    y = y.to(x.dtype)
    out = (y, final) if return_final_states else (y,)
    if return_varlen_states:
        out = out + (varlen_states,)
    return out if len(out) > 1 else y
