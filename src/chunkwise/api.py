"""Argument checking, in-op preludes, layouts and backend choice for every public op.

One general machinery: a family is (gate kind, delta rule on/off); every public function is a thin
entry point that names its family and hands its arguments to `_run`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._custom_ops import _eager_plain
from .utils import FLOAT_DTYPES, TRITON_MAX_HEAD_DIM, prepare_chunk_indices  # noqa: F401

BACKENDS = ("auto", "torch", "triton")
L2NORM_EPS = 1e-6


@dataclass(frozen=True)
class Family:
    name: str        # for messages
    gate: str        # "none" | "scalar" | "channel"
    delta: bool      # delta rule on/off


GDN = Family("gated_delta_rule", "scalar", True)
KDA = Family("kda", "channel", True)
DELTA = Family("delta_rule", "none", True)
GLA = Family("simple_gla", "scalar", False)


# ----------------------------------------------------------------------------------------------
# checking
# ----------------------------------------------------------------------------------------------

def _shape(x) -> str:
    return "None" if x is None else str(tuple(x.shape))


def _check_tensor(name: str, x, dims: int | None = None):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if dims is not None and x.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {_shape(x)}")


def _check_float(name: str, x: torch.Tensor):
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")


def check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B: int, T: int):
    """cu_seqlens: [N + 1] integers, 0 first, non-decreasing, T last; B must be 1.

    The values are checked on ``cu_seqlens_cpu`` when given (no device sync), else on a host copy.
    Under torch.compile only the shapes are checked: reading values would break the graph.
    Returns the host copy.
    """
    _check_tensor("cu_seqlens", cu_seqlens, 1)
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (sequences packed along T), got B={B}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must hold at least 2 offsets (N + 1 for N sequences), got shape {_shape(cu_seqlens)}")
    if cu_seqlens_cpu is not None and cu_seqlens_cpu.shape != cu_seqlens.shape:
        raise ValueError(f"cu_seqlens_cpu {_shape(cu_seqlens_cpu)} must match cu_seqlens {_shape(cu_seqlens)}")
    if torch.compiler.is_compiling():
        return cu_seqlens_cpu   # under torch.compile the values are not read (that would break the graph)
    host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.detach().cpu()
    if int(host[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(host[0])}")
    if bool((host[1:] < host[:-1]).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {host.tolist()[:16]}")
    if int(host[-1]) != T:
        raise ValueError(f"cu_seqlens must end at T={T} (the packed length of q), got {int(host[-1])}")
    return host


def _check_inputs(fam: Family, q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu,
                  transpose_state_layout, backend, use_gate_in_kernel, A_log, dt_bias, lower_bound,
                  state_indices=None):
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x, 4)
        _check_float(name, x)
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape [B, T, H, K]: q {_shape(q)}, k {_shape(k)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    B, T, H, K = q.shape
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [B, T, HV, V] with q's B and T: q {_shape(q)}, v {_shape(v)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H != 0:
        raise ValueError(f"the value heads HV={HV} (v {_shape(v)}) must be a multiple of the q/k heads H={H} (q {_shape(q)})")
    if K == 0 or V == 0:
        raise ValueError(f"head dims must be positive: K={K}, V={V}")

    devices = {name: x.device for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                                              ("initial_state", initial_state), ("cu_seqlens", cu_seqlens),
                                              ("A_log", A_log), ("dt_bias", dt_bias), ("state_indices", state_indices))
               if isinstance(x, torch.Tensor)}
    if len(set(devices.values())) > 1:
        raise ValueError("all tensors must be on one device, got " + ", ".join(f"{n} on {d}" for n, d in devices.items()))

    if fam.gate == "none":
        if g is not None:
            raise ValueError(f"{fam.name} takes no gate g")
    else:
        if g is None:
            raise ValueError(f"{fam.name} needs the gate g" + ("" if fam.delta else " (or g_gamma [HV]; g = 0 for no decay)"))
        want = (B, T, HV) if fam.gate == "scalar" else (B, T, HV, K)
        _check_tensor("g", g)
        _check_float("g", g)
        if tuple(g.shape) != want:
            raise ValueError(f"g must have shape {list(want)} ([B, T, HV{', K' if fam.gate == 'channel' else ''}]), got {_shape(g)}")
    if fam.delta:
        if beta is None:
            raise ValueError(f"{fam.name} needs beta [B, T, HV]")
        _check_tensor("beta", beta)
        _check_float("beta", beta)
        if tuple(beta.shape) != (B, T, HV):
            raise ValueError(f"beta must have shape [B, T, HV] = {[B, T, HV]}, got {_shape(beta)}")
    elif beta is not None:
        raise ValueError(f"{fam.name} takes no beta")

    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    if use_gate_in_kernel:
        if fam.gate == "none":
            raise ValueError(f"{fam.name} has no gate: use_gate_in_kernel is not available")
        if A_log is None and lower_bound is None:
            raise ValueError("use_gate_in_kernel=True needs A_log [HV] (KDA: or lower_bound, for "
                             "g = lower_bound·sigmoid(a + dt_bias))")
        if A_log is not None:
            _check_tensor("A_log", A_log)
            if tuple(A_log.shape) != (HV,):
                raise ValueError(f"A_log must have shape [HV] = [{HV}], got {_shape(A_log)}")
        if dt_bias is not None:
            _check_tensor("dt_bias", dt_bias)
            ok = [(HV,)] if fam.gate == "scalar" else [(HV * K,), (HV, K)]
            if tuple(dt_bias.shape) not in ok:
                raise ValueError(f"dt_bias must have shape {'[HV]' if fam.gate == 'scalar' else '[HV * K] or [HV, K]'}, got {_shape(dt_bias)}")
        if lower_bound is not None and fam.gate != "channel":
            raise ValueError("lower_bound is only available for KDA's per-channel gate")
    else:
        if A_log is not None or dt_bias is not None:
            raise ValueError("A_log and dt_bias are only used with use_gate_in_kernel=True")
        if lower_bound is not None:
            raise ValueError("lower_bound is only used with use_gate_in_kernel=True")

    N = B
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B, T)
        N = cu_seqlens.numel() - 1
    elif cu_seqlens_cpu is not None:
        raise ValueError("cu_seqlens_cpu is given but cu_seqlens is None")

    if state_indices is not None:
        _check_tensor("state_indices", state_indices, 1)
        if state_indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"state_indices must be int32 or int64, got {state_indices.dtype}")
        if state_indices.numel() != N:
            raise ValueError(f"state_indices must have one entry per sequence (N={N}), got {_shape(state_indices)}")
        if initial_state is None:
            raise ValueError("state_indices needs initial_state: the state pool [P, HV, K, V]")
        if state_indices.device.type == "cpu" and state_indices.numel() and _eager_plain(state_indices):
            # (on a GPU this check would cost a host sync per decode step: there the kernel treats an
            # index outside [0, P) as padding and never writes outside the pool)
            lo, hi = int(state_indices.min()), int(state_indices.max())
            if lo < -1 or hi >= initial_state.shape[0]:
                raise ValueError(f"state_indices must lie in [-1, P) = [-1, {initial_state.shape[0]}) for the pool "
                                 f"initial_state {_shape(initial_state)}, got values from {lo} to {hi}")
        check_live_indices_unique(state_indices)

    if initial_state is not None:
        _check_tensor("initial_state", initial_state, 4)
        if not (state_indices is not None and initial_state.dtype in QUANT_DTYPES):   # 8-bit pool: check_state_scales
            _check_float("initial_state", initial_state)
        tail = (HV, V, K) if transpose_state_layout else (HV, K, V)
        lead = initial_state.shape[0] if state_indices is not None else N
        if tuple(initial_state.shape) != (lead, *tail):
            layout = "[N, HV, V, K]" if transpose_state_layout else "[N, HV, K, V]"
            raise ValueError(f"initial_state must have shape {layout} = {[lead, *tail]}"
                             f"{' (a pool: any P first)' if state_indices is not None else ''}, got {_shape(initial_state)}")
    return B, T, H, HV, K, V, N


def check_live_indices_unique(state_indices: torch.Tensor) -> None:
    """Two live sequences (index >= 0) on one pool slot would race on its write: a ValueError. torch.unique
    is a host sync on the GPU, so this runs only in plain eager mode (not while torch.compile traces or a
    CUDA graph captures); there duplicates stay the caller's promise, as in vLLM and FlashInfer."""
    if not state_indices.numel() or not _eager_plain(state_indices):
        return
    if state_indices.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    live = state_indices[state_indices >= 0]
    if torch.unique(live).numel() != live.numel():
        raise ValueError(f"state_indices has a pool slot used by two live sequences: {state_indices.tolist()[:32]}")


def check_intermediate_states(intermediate_states, state_indices, initial_state, N, HV, K, V,
                              transpose_state_layout) -> None:
    """intermediate_states (the verify step of speculative decoding): needs the pool, [N, T_buf, HV, K, V]
    (or [.., V, K]), T_buf <= 16 draft tokens, the pool's dtype."""
    if intermediate_states is None:
        return
    if state_indices is None:
        raise ValueError("intermediate_states needs state_indices: the per-token states of a verify step over the pool")
    tail = (HV, V, K) if transpose_state_layout else (HV, K, V)
    if intermediate_states.dim() != 5 or intermediate_states.shape[0] != N or tuple(intermediate_states.shape[2:]) != tail:
        raise ValueError(f"intermediate_states must have shape [N, T_draft, *{list(tail)}] with N={N}, "
                         f"got {_shape(intermediate_states)}")
    if not 1 <= intermediate_states.shape[1] <= 16:
        raise ValueError(f"intermediate_states holds 1 to 16 draft tokens per sequence, got {intermediate_states.shape[1]}")
    want = torch.float32 if initial_state.dtype in QUANT_DTYPES else initial_state.dtype   # 8-bit pool: fp32 states
    if intermediate_states.dtype != want or intermediate_states.device != initial_state.device:
        raise TypeError(f"intermediate_states must be {want} on the pool's device {initial_state.device}, "
                        f"got {intermediate_states.dtype} on {intermediate_states.device}")
    if not intermediate_states.is_contiguous():
        raise ValueError("intermediate_states must be contiguous (chunkwise.rollback copies whole per-token states)")


# the Triton kernels' chunk length: a checkpoint falls on a chunk boundary (the kernel stores it there; the torch
# backend's pieces are then exact)
CHECKPOINT_CHUNK = 64


def checkpoint_slots(cu_seqlens: torch.Tensor, every: int) -> torch.Tensor:
    """Each sequence's first slot in the ``checkpoints`` buffer, [N + 1] (the last entry is the buffer's length).

    The buffer is packed sequence by sequence, in token order: sequence n's state after its first
    (j + 1)·every tokens is ``checkpoints[slots[n] + j]`` for j < ⌊len_n / every⌋. Computed on the device
    of ``cu_seqlens`` (no sync); pass a CPU copy to size the buffer on the host."""
    check_checkpoint_every(every)
    counts = torch.div(cu_seqlens[1:] - cu_seqlens[:-1], every, rounding_mode="floor")
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def check_checkpoint_every(every):
    if not isinstance(every, int) or isinstance(every, bool) or every <= 0 or every % CHECKPOINT_CHUNK:
        raise ValueError(f"checkpoint_every must be a positive multiple of the chunk size {CHECKPOINT_CHUNK}, "
                         f"got {every!r}")


def check_checkpoints(every, checkpoints, mode, tensors, initial_state, cu_seqlens, host_cu, B, T, HV, K, V,
                      transpose_state_layout) -> torch.Tensor:
    """checkpoint_every / checkpoints of a chunk op: a multiple of 64 and a contiguous float buffer
    [Σ ⌊len_n / every⌋, HV, K, V] (or [.., V, K]) on q's device (its length checked where the lengths are on the
    host). Inference only. Returns each sequence's first slot [N + 1] on the device (no sync)."""
    if mode != "chunk":
        raise ValueError("checkpoint_every goes with the chunk ops (prefill)")
    if every is None or checkpoints is None:
        raise ValueError("checkpoint_every and checkpoints go together")
    check_checkpoint_every(every)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in (*tensors, initial_state)):
        raise RuntimeError("checkpoint_every is an inference feature: call it under torch.no_grad() (or detach the "
                           "inputs)")
    q = tensors[0]
    tail = (HV, V, K) if transpose_state_layout else (HV, K, V)
    _check_tensor("checkpoints", checkpoints, 4)
    if (tuple(checkpoints.shape[1:]) != tail or checkpoints.dtype not in FLOAT_DTYPES or checkpoints.device != q.device
            or not checkpoints.is_contiguous()):
        raise ValueError(f"checkpoints must be a contiguous float tensor [n, {', '.join(map(str, tail))}] on "
                         f"{q.device}, got {_shape(checkpoints)} {checkpoints.dtype} on {checkpoints.device}")
    if cu_seqlens is None:
        slots = torch.arange(B + 1, device=q.device) * (T // every)
        count = B * (T // every)
    else:
        slots = checkpoint_slots(cu_seqlens, every)
        count = None if host_cu is None else int(checkpoint_slots(host_cu, every)[-1])
    if count is not None and checkpoints.shape[0] != count:
        raise ValueError(f"checkpoints must be a tensor [{count}, {', '.join(map(str, tail))}] (⌊len_n / "
                         f"checkpoint_every⌋ states per sequence, packed as checkpoint_slots says), got "
                         f"{_shape(checkpoints)}")
    return slots


QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)


def check_state_scales(state_scales, state_indices, initial_state, mode, HV, K, V, transpose_state_layout) -> None:
    """An 8-bit pool (int8 / float8_e4m3fn) comes with state_scales [P, HV, K] fp32 ([P, HV, V] transposed): one
    scale per stored row. Only the token-recurrent ops read and write it."""
    quant = initial_state is not None and initial_state.dtype in QUANT_DTYPES
    if state_scales is None:
        if quant:
            raise TypeError(f"an 8-bit state pool ({initial_state.dtype}) needs state_scales [P, HV, "
                            f"{'V' if transpose_state_layout else 'K'}] fp32")
        return
    if not quant or state_indices is None:
        raise ValueError("state_scales goes with an 8-bit state pool (int8 or float8_e4m3fn initial_state and "
                         "state_indices)")
    if mode != "recurrent":
        raise ValueError("8-bit state pools are read and written by the fused_recurrent_* ops only")
    rows = V if transpose_state_layout else K
    if (tuple(state_scales.shape) != (initial_state.shape[0], HV, rows) or state_scales.dtype != torch.float32
            or state_scales.device != initial_state.device or not state_scales.is_contiguous()):
        raise ValueError(f"state_scales must be a contiguous fp32 [P, HV, {'V' if transpose_state_layout else 'K'}] = "
                         f"{[initial_state.shape[0], HV, rows]} on the pool's device, got {_shape(state_scales)} "
                         f"{state_scales.dtype} on {state_scales.device}")


# ----------------------------------------------------------------------------------------------
# in-op preludes (differentiable torch; the Triton kernels may fuse them)
# ----------------------------------------------------------------------------------------------

def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(Σ x² + 1e-6) over the last dim, computed in fp32, returned in x's dtype."""
    xf = x.float() if x.dtype != torch.float64 else x
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


def gate_from_projections(fam: Family, a: torch.Tensor, A_log: torch.Tensor, dt_bias, lower_bound):
    """GDN: g = −exp(A_log) · softplus(a + dt_bias), a [B, T, HV].
    KDA: the same per channel, a [B, T, HV, K], dt_bias [HV·K]; with ``lower_bound``:
    g = lower_bound · sigmoid(exp(A_log) · (a + dt_bias)), or lower_bound · sigmoid(a + dt_bias) without A_log.
    """
    ct = torch.float64 if a.dtype == torch.float64 else torch.float32
    a = a.to(ct)
    if fam.gate == "channel" and dt_bias is not None:
        a = a + dt_bias.to(ct).reshape(a.shape[-2], a.shape[-1])
    elif dt_bias is not None:
        a = a + dt_bias.to(ct)
    if A_log is None:           # (checked: only with lower_bound)
        return lower_bound * torch.sigmoid(a)
    A = A_log.to(ct).exp()
    A = A[:, None] if fam.gate == "channel" else A
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(A * a)
    return -A * F.softplus(a)


def _prelude(fam, q, k, g, beta, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
             use_gate_in_kernel, A_log, dt_bias, lower_bound, allow_neg_eigval=False):
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if fam.delta and use_beta_sigmoid_in_kernel:
        beta = beta.float().sigmoid() if beta.dtype != torch.float64 else beta.sigmoid()
        if allow_neg_eigval:      # β in (0, 2): eigenvalues of I − β k kᵀ in (−1, 1]
            beta = 2 * beta
    if use_gate_in_kernel:
        g = gate_from_projections(fam, g, A_log, dt_bias, lower_bound)
    elif g is not None and g.dtype not in (torch.float32, torch.float64):
        g = g.float()
    return q, k, g, beta


# ----------------------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------------------

def _choose_backend(backend: str, device: torch.device, K: int, V: int) -> str:
    if backend == "torch":
        return "torch"
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        backend = "triton"
    if K > TRITON_MAX_HEAD_DIM or V > TRITON_MAX_HEAD_DIM:
        raise ValueError(f"the triton backend supports head dims up to {TRITON_MAX_HEAD_DIM}, got K={K}, V={V}")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available():
        # the compiled kernels read device memory only; Triton's interpreter runs them on CPU tensors (and
        # benchmarks/tools.py builds them for sm_90 from CPU tensors on a machine without a GPU)
        raise ValueError(f"backend='triton' takes CUDA tensors, got q on {device} (TRITON_INTERPRET=1 runs the "
                         "kernels on CPU tensors under Triton's interpreter)")
    return "triton"


def _compute_dtype(q: torch.Tensor, initial_state=None) -> torch.dtype:
    """The state's dtype: float32, or float64 where q is float64 (the torch backend). `run` reads an initial
    state of any other float dtype in it, so the final state always comes back in this dtype."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _to_kv(state, transpose_state_layout):
    return None if state is None else (state.transpose(-1, -2) if transpose_state_layout else state)


def _fla_options(fam: Family, v, g, use_beta_sigmoid_in_kernel, use_gate_in_kernel, lower_bound,
                 allow_neg_eigval, safe_gate, g_gamma, transpose_state_layout, state_v_first):
    """fla 0.6.0's spellings: state_v_first (transpose_state_layout's new name), allow_neg_eigval (β = 2·sigmoid of
    the logits), KDA's safe_gate (a promise that the gate lies in [lower_bound, 0): fla's faster path; checked as fla
    checks it, our kernels take any gate), simple GLA's g_gamma ([HV] decay per head, the same at every token; fla
    also runs simple GLA with neither gate, which here stays an error: pass g = 0 for no decay). Returns (g, layout)."""
    if allow_neg_eigval:
        if not fam.delta:
            raise ValueError(f"{fam.name} has no beta: allow_neg_eigval is not available")
        if not use_beta_sigmoid_in_kernel:
            raise ValueError("allow_neg_eigval=True needs use_beta_sigmoid_in_kernel=True (beta = 2·sigmoid(beta))")
    if safe_gate:
        if fam.gate != "channel":
            raise ValueError("safe_gate is only available for KDA's per-channel gate")
        if use_gate_in_kernel and (lower_bound is None or not -5 <= lower_bound < 0):
            raise ValueError(f"safe_gate=True with use_gate_in_kernel=True needs lower_bound in [-5, 0), got {lower_bound}")
    if fam.gate == "scalar" and not fam.delta:
        if g_gamma is not None:
            if g is not None:
                raise ValueError("pass the gate g [B, T, HV] or g_gamma [HV], not both")
            if use_gate_in_kernel:
                raise ValueError("g_gamma is a decay already: use_gate_in_kernel is not available with it")
            _check_tensor("g_gamma", g_gamma, 1)
            _check_float("g_gamma", g_gamma)
            if isinstance(v, torch.Tensor) and v.dim() == 4:
                if g_gamma.device != v.device:
                    raise ValueError(f"all tensors must be on one device, got g_gamma on {g_gamma.device}, v on {v.device}")
                if tuple(g_gamma.shape) != (v.shape[2],):
                    raise ValueError(f"g_gamma must have shape [HV] = [{v.shape[2]}], got {_shape(g_gamma)}")
                ct = torch.float64 if g_gamma.dtype == torch.float64 else torch.float32
                g = g_gamma.to(ct).expand(v.shape[0], v.shape[1], v.shape[2]).contiguous()
    elif g_gamma is not None:
        raise ValueError(f"g_gamma is simple GLA's; {fam.name} takes no g_gamma")
    return g, bool(transpose_state_layout or state_v_first)


def run(fam: Family, mode: str, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, *,
        use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, use_gate_in_kernel=False,
        A_log=None, dt_bias=None, lower_bound=None, transpose_state_layout=False, chunk_size=32,
        backend="auto", cu_seqlens_cpu=None, chunk_indices=None, state_indices=None,
        allow_neg_eigval=False, safe_gate=False, g_gamma=None, state_v_first=False, intermediate_states=None,
        state_scales=None, checkpoint_every=None, checkpoints=None):
    """The one path behind every public op. mode: "chunk" or "recurrent".

    The state is float32, or float64 where q is float64 (the torch backend): an initial state of any float dtype
    is read in it and the final state comes back in it (a pool, ``state_indices``, keeps its own dtype)."""
    g, transpose_state_layout = _fla_options(fam, v, g, use_beta_sigmoid_in_kernel, use_gate_in_kernel,
                                             lower_bound, allow_neg_eigval, safe_gate, g_gamma,
                                             transpose_state_layout, state_v_first)
    B, T, H, HV, K, V, N = _check_inputs(
        fam, q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu, transpose_state_layout,
        backend, use_gate_in_kernel, A_log, dt_bias, lower_bound, state_indices)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    check_intermediate_states(intermediate_states, state_indices, initial_state, N, HV, K, V, transpose_state_layout)
    check_state_scales(state_scales, state_indices, initial_state, mode, HV, K, V, transpose_state_layout)
    slots = None
    if checkpoint_every is not None or checkpoints is not None:
        host_cu = None
        if cu_seqlens is not None and not torch.compiler.is_compiling():
            host_cu = cu_seqlens_cpu if cu_seqlens_cpu is not None else (
                cu_seqlens if cu_seqlens.device.type == "cpu" else None)   # never a device sync
        slots = check_checkpoints(checkpoint_every, checkpoints, mode, (q, k, v, g, beta, A_log, dt_bias),
                                  initial_state, cu_seqlens, host_cu, B, T, HV, K, V, transpose_state_layout)
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, g, beta = _prelude(fam, q, k, g, beta, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                             use_gate_in_kernel, A_log, dt_bias, lower_bound, allow_neg_eigval)
    which = _choose_backend(backend, q.device, K, V)
    if (initial_state is not None and state_indices is None and initial_state.dtype == torch.float64
            and q.dtype != torch.float64):
        # read in fp32 like any other dtype, so that the final state comes back in fp32 (a pool, state_indices,
        # is written back in place, in its own dtype)
        initial_state = initial_state.float()

    if which == "triton":
        if q.dtype == torch.float64:
            raise TypeError("the triton backend takes float16, bfloat16 or float32 tensors, not float64; use backend='torch'")
        if (mode == "chunk" and cu_seqlens is not None and chunk_indices is None and cu_seqlens_cpu is not None
                and not torch.compiler.is_compiling()):
            chunk_indices = prepare_chunk_indices(cu_seqlens_cpu).to(q.device)   # planned on the host, no sync

    # the cores are torch.library custom ops (chunkwise._custom_ops): opaque to torch.compile, with
    # fake implementations and registered autograd
    from . import _custom_ops
    if state_indices is not None:
        return _custom_ops.pool_step(q, k, v, g, beta, scale, initial_state, state_indices, output_final_state,
                                     cu_seqlens, transpose_state_layout, chunk_size, which, intermediate_states,
                                     state_scales)
    if slots is not None:
        return _custom_ops.forward_checkpoints(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                               chunk_indices, transpose_state_layout, chunk_size, which, checkpoints,
                                               slots, checkpoint_every)
    return _custom_ops.forward(mode, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                               chunk_indices, transpose_state_layout, chunk_size, which)
