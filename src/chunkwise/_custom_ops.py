"""The cores of the public ops as `torch.library` custom ops: opaque to torch.compile, with fake
(meta) implementations for tracing and autograd registered through `torch.library.register_autograd`.

`chunkwise.api.run` does the argument checks and the in-op preludes (L2 norm, beta sigmoid, gate
from projections) in plain, traceable PyTorch, then calls one of these ops on the canonical
tensors (docs/design.md §1)::

    q, k: [B, T, H, K]        v: [B, T, HV, V]          g: None | [B, T, HV] | [B, T, HV, K] (fp32/fp64)
    beta: None | [B, T, HV]   initial_state: None | [N, HV, K, V] ([N, HV, V, K] if transpose_state_layout)
    cu_seqlens: None | [N + 1] int (then B == 1)

and it computes, per sequence, value head and token::

    S_t = diag(exp(g_t)) S_{t-1} + β_t k_t (v_t − (diag(exp(g_t)) S_{t-1})ᵀ k_t)ᵀ    (S' + k_t v_tᵀ without β)
    o_t = scale · S_tᵀ q_t

Ops (namespace ``chunkwise``):

    chunk_fwd / recurrent_fwd (q, k, v, g?, beta?, scale, initial_state?, output_final_state,
                               cu_seqlens?, chunk_indices?, transpose_state_layout, chunk_size, backend)
        -> (o [B, T, HV, V] in q's dtype,
            final_state [N, HV, K, V] fp32 (fp64 when computing in fp64), or an empty [0] tensor
            when output_final_state is False)
    chunk_bwd / recurrent_bwd (the forward's inputs, do, dht?, needs_grad) -> (dq, dk, dv, dg, dbeta, dh0)
        (an empty [0] tensor for each gradient that is not needed or whose input is None)
    chunk_fwd_saved (as chunk_fwd) -> (o, final_state, w, u, p, t, hs, mm, r, qg, kg, gc, ht): the triton chunk
        forward of a delta family under autograd, which also returns what its backward reuses
        (triton.chunk.saved_shapes; empty [0] tensors where it keeps nothing)
    chunk_bwd_saved (the forward's inputs, w, u, p, t, hs, mm, r, qg, kg, gc, ht, do, dht?, needs_grad)
        -> as chunk_bwd
    chunk_fwd_checkpoints (as chunk_fwd, checkpoints (mutated), checkpoint_slots [N + 1], checkpoint_every) -> as
        chunk_fwd, and each sequence's state after every checkpoint_every tokens in checkpoints (no autograd)
    recurrent_pool_fwd (..., pool [P, HV, K, V] (mutated), state_indices [N], ...) -> o
        vLLM-style state pool: sequence n reads pool[state_indices[n]] and writes its final state
        back in place (-1 = padding slot, skipped, output zero). No autograd (inference only).
    rollback (pool (mutated), state_indices [N], intermediate_states [N, T_draft, ...], num_accepted_tokens [N],
              state_scales? (mutated), backend) -> None: speculative decoding's rollback (chunkwise.speculative)

Backward: the torch backend recomputes the forward of the PyTorch chunk algorithm
(`reference/chunk.py`, or the token recurrence for the recurrent op) under autograd inside the
backward op; the triton chunk backward calls `chunkwise.triton.chunk.chunk_bwd`; the triton
recurrent op (a decode kernel without its own backward) recomputes with the fp32 PyTorch
recurrence. Forward saves only its inputs, except the triton chunk forward of the delta families under autograd,
which also saves its stage 1 and R (its backward then does not recompute them).

Host syncs: the ops read ``cu_seqlens`` on the host in their real implementations (the torch
backend pads varlen batches; the triton chunk path builds ``chunk_indices`` when it is not given).
That is invisible to torch.compile (the ops are opaque) but is a device sync on the GPU: for CUDA
graphs pass ``chunk_indices`` (or use the recurrent ops, which read no values on the host).
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _dispatch_mode

from .reference.chunk import chunk_forward, chunk_forward_checkpoints
from .reference.recurrent import pool_step as torch_pool_step, recurrent_forward
from .utils import prepare_chunk_indices

_EMPTY_SHAPE = (0,)


# ----------------------------------------------------------------------------------------------
# shapes and helpers shared by the real and the fake implementations
# ----------------------------------------------------------------------------------------------

def _compute_dtype(q: torch.Tensor, initial_state: Optional[torch.Tensor]) -> torch.dtype:
    f64 = q.dtype == torch.float64 or (initial_state is not None and initial_state.dtype == torch.float64)
    return torch.float64 if f64 else torch.float32


def _state_shape(q, v, cu_seqlens, transpose_state_layout):
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    return (N, HV, V, K) if transpose_state_layout else (N, HV, K, V)


def _empty(like: torch.Tensor, dtype=None) -> torch.Tensor:
    return like.new_empty(_EMPTY_SHAPE, dtype=dtype or like.dtype)


def _kv(state, transpose_state_layout):
    """A state in the user's layout -> the [., HV, K, V] view the reference computes in."""
    return None if state is None else (state.transpose(-1, -2) if transpose_state_layout else state)


def _not_an_alias(x: torch.Tensor, *inputs) -> torch.Tensor:
    """Custom ops may not return (views of) their inputs: copy in that corner (e.g. T == 0)."""
    for y in inputs:
        if y is not None and x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr():
            return x.clone()
    return x


def _torch_core(mode, q, k, v, g, beta, scale, initial_state, cu_seqlens, transpose_state_layout, chunk_size):
    """The PyTorch forms (differentiable). Returns (o in q's dtype, final state in the user's layout)."""
    ct = _compute_dtype(q, initial_state)
    h0 = _kv(initial_state, transpose_state_layout)
    if mode == "chunk":
        o, ht = chunk_forward(q, k, v, g, beta, scale, h0, cu_seqlens, chunk_size=chunk_size, dtype=ct)
    else:
        o, ht = recurrent_forward(q, k, v, g, beta, scale, h0, cu_seqlens, dtype=ct)
    if transpose_state_layout:
        ht = ht.transpose(-1, -2)
    return o.to(q.dtype), ht.contiguous()


@contextlib.contextmanager
def _autograd_inside_op():
    """Record autograd inside a custom op's implementation.

    The dispatcher runs a custom op's implementation below the Autograd keys (they are in the
    thread-local exclude set), so a recompute there would build no graph even under enable_grad.
    Lift the exclusion for the duration of the recompute and restore it afterwards.
    """
    keys = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
            torch._C.DispatchKey.AutogradNestedTensor, torch._C.DispatchKey.ADInplaceOrView)
    before = [torch._C._dispatch_tls_is_dispatch_key_excluded(key) for key in keys]
    try:
        for key in keys:
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
        with torch.enable_grad():
            yield
    finally:
        for key, excluded in zip(keys, before):
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, excluded)


def _triton_chunk_indices(cu_seqlens, chunk_indices):
    if cu_seqlens is None or chunk_indices is not None:
        return chunk_indices
    return prepare_chunk_indices(cu_seqlens).to(cu_seqlens.device)


# ----------------------------------------------------------------------------------------------
# forward ops
# ----------------------------------------------------------------------------------------------

def _forward_impl(mode, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_indices,
                  transpose_state_layout, chunk_size, backend):
    if backend == "triton" and mode == "chunk":
        from .triton.chunk import chunk_fwd
        o, ht = chunk_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                          chunk_indices=_triton_chunk_indices(cu_seqlens, chunk_indices),
                          transpose_state_layout=transpose_state_layout)
    elif backend == "triton":
        from .triton.decode import recurrent_fwd
        o, ht = recurrent_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                              transpose_state_layout=transpose_state_layout)
    else:
        o, ht = _torch_core(mode, q, k, v, g, beta, scale, initial_state, cu_seqlens, transpose_state_layout,
                            chunk_size)
    if not output_final_state or ht is None:
        ht = _empty(q, _compute_dtype(q, initial_state))
    return _not_an_alias(o, q, k, v), _not_an_alias(ht, initial_state)


def _forward_fake(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_indices,
                  transpose_state_layout, chunk_size, backend):
    B, T, HV, V = q.shape[0], q.shape[1], v.shape[2], v.shape[3]
    o = q.new_empty(B, T, HV, V)
    ct = _compute_dtype(q, initial_state)
    if output_final_state:
        ht = q.new_empty(_state_shape(q, v, cu_seqlens, transpose_state_layout), dtype=ct)
    else:
        ht = q.new_empty(_EMPTY_SHAPE, dtype=ct)
    return o, ht


@torch.library.custom_op("chunkwise::chunk_fwd", mutates_args=())
def chunk_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
              beta: Optional[torch.Tensor], scale: float, initial_state: Optional[torch.Tensor],
              output_final_state: bool, cu_seqlens: Optional[torch.Tensor], chunk_indices: Optional[torch.Tensor],
              transpose_state_layout: bool, chunk_size: int, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk form. Returns (o [B, T, HV, V] q's dtype, final state or an empty [0] tensor)."""
    return _forward_impl("chunk", q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                         chunk_indices, transpose_state_layout, chunk_size, backend)


@torch.library.custom_op("chunkwise::recurrent_fwd", mutates_args=())
def recurrent_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
                  beta: Optional[torch.Tensor], scale: float, initial_state: Optional[torch.Tensor],
                  output_final_state: bool, cu_seqlens: Optional[torch.Tensor],
                  chunk_indices: Optional[torch.Tensor], transpose_state_layout: bool, chunk_size: int,
                  backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-recurrent form (decode). Returns (o [B, T, HV, V] q's dtype, final state or an empty [0] tensor)."""
    return _forward_impl("recurrent", q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                         chunk_indices, transpose_state_layout, chunk_size, backend)


chunk_fwd.register_fake(_forward_fake)
recurrent_fwd.register_fake(_forward_fake)


@torch.library.custom_op("chunkwise::chunk_fwd_checkpoints", mutates_args=("checkpoints",))
def chunk_fwd_checkpoints(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
                          beta: Optional[torch.Tensor], scale: float, initial_state: Optional[torch.Tensor],
                          output_final_state: bool, cu_seqlens: Optional[torch.Tensor],
                          chunk_indices: Optional[torch.Tensor], transpose_state_layout: bool, chunk_size: int,
                          backend: str, checkpoints: torch.Tensor, checkpoint_slots: torch.Tensor,
                          checkpoint_every: int) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk_fwd that also writes prefix checkpoints (inference: no autograd): sequence n's state after each whole
    checkpoint_every tokens into checkpoints[checkpoint_slots[n] + j] (chunkwise.prefill). The triton backend
    stores them from its stage-2 kernel; the torch backend runs the batch in pieces."""
    return _checkpoints_impl(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_indices,
                             transpose_state_layout, chunk_size, backend, checkpoints, checkpoint_slots,
                             checkpoint_every)


def _checkpoints_impl(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_indices,
                      transpose_state_layout, chunk_size, backend, checkpoints, checkpoint_slots, checkpoint_every):
    if backend == "triton":
        from .triton.chunk import chunk_fwd as triton_chunk_fwd
        o, ht = triton_chunk_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                 chunk_indices=_triton_chunk_indices(cu_seqlens, chunk_indices),
                                 transpose_state_layout=transpose_state_layout,
                                 checkpoints=(checkpoints, checkpoint_slots, checkpoint_every))
    else:
        o, ht = chunk_forward_checkpoints(q, k, v, g, beta, scale, _kv(initial_state, transpose_state_layout),
                                          cu_seqlens, checkpoint_every, _kv(checkpoints, transpose_state_layout),
                                          chunk_size, _compute_dtype(q, initial_state))
        o, ht = o.to(q.dtype), (ht.transpose(-1, -2) if transpose_state_layout else ht).contiguous()
    if not output_final_state or ht is None:
        ht = _empty(q, _compute_dtype(q, initial_state))
    return _not_an_alias(o, q, k, v), _not_an_alias(ht, initial_state)


@chunk_fwd_checkpoints.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_indices, transpose_state_layout,
      chunk_size, backend, checkpoints, checkpoint_slots, checkpoint_every):
    return _forward_fake(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_indices,
                         transpose_state_layout, chunk_size, backend)


def forward_checkpoints(q, k, v, g, beta, scale: float, initial_state, output_final_state: bool, cu_seqlens,
                        chunk_indices, transpose_state_layout: bool, chunk_size: int, backend: str, checkpoints,
                        checkpoint_slots, checkpoint_every: int):
    """Dispatch to chunk_fwd_checkpoints (or its implementation, see `_eager_plain`). Returns (o, final state or
    None)."""
    args = (q, k, v, g, beta, float(scale), initial_state, bool(output_final_state), cu_seqlens, chunk_indices,
            bool(transpose_state_layout), int(chunk_size), backend, checkpoints, checkpoint_slots,
            int(checkpoint_every))
    if _eager_plain(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, checkpoints, checkpoint_slots):
        o, ht = _checkpoints_impl(*args)
    else:
        o, ht = chunk_fwd_checkpoints(*args)
    return o, (ht if output_final_state else None)


# ----------------------------------------------------------------------------------------------
# backward ops
# ----------------------------------------------------------------------------------------------

def _backward_impl(mode, q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_indices, transpose_state_layout,
                   chunk_size, backend, do, dht, needs_grad, saved=None):
    inputs = (q, k, v, g, beta, initial_state)
    if backend == "triton" and mode == "chunk":
        from .triton.chunk import chunk_bwd
        grads = chunk_bwd(q, k, v, g, beta, scale, initial_state, do, dht, cu_seqlens,
                          chunk_indices=_triton_chunk_indices(cu_seqlens, chunk_indices),
                          transpose_state_layout=transpose_state_layout, saved=saved)
    else:
        # recompute the PyTorch form under autograd (the triton recurrent op is forward-only)
        with _autograd_inside_op():
            leaves = [None if x is None else x.detach().requires_grad_(bool(n))
                      for x, n in zip(inputs, needs_grad)]
            wanted = [x for x in leaves if x is not None and x.requires_grad]
            o, ht = _torch_core(mode, *leaves[:5], scale, leaves[5], cu_seqlens, transpose_state_layout, chunk_size)
            outs, douts = [o], [do]
            if dht is not None:
                outs.append(ht)
                douts.append(dht.to(ht.dtype))
            # an output that depends on no wanted input (the final state when only q wants a gradient) is
            # left out: autograd.grad refuses outputs without a graph
            pairs = [(t, d) for t, d in zip(outs, douts) if t.requires_grad]
            got = iter(torch.autograd.grad([t for t, _ in pairs], wanted, [d for _, d in pairs], allow_unused=True)) \
                if wanted and pairs else iter(())
            grads = [next(got, None) if x is not None and x.requires_grad else None for x in leaves]
    out = []
    for x, n, dx in zip(inputs, needs_grad, grads):
        if x is None or not n:
            out.append(_empty(q))
        elif dx is None:
            out.append(x.new_zeros(x.shape))
        else:
            out.append(_not_an_alias(dx.to(x.dtype).contiguous(), *inputs))
    return tuple(out)


def _backward_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_indices, transpose_state_layout,
                   chunk_size, backend, do, dht, needs_grad):
    inputs = (q, k, v, g, beta, initial_state)
    return tuple(x.new_empty(x.shape) if x is not None and n else _empty(q) for x, n in zip(inputs, needs_grad))


_GradTuple = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@torch.library.custom_op("chunkwise::chunk_bwd", mutates_args=())
def chunk_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
              beta: Optional[torch.Tensor], scale: float, initial_state: Optional[torch.Tensor],
              cu_seqlens: Optional[torch.Tensor], chunk_indices: Optional[torch.Tensor], transpose_state_layout: bool,
              chunk_size: int, backend: str, do: torch.Tensor, dht: Optional[torch.Tensor],
              needs_grad: Sequence[bool]) -> _GradTuple:
    """Gradients of chunk_fwd: (dq, dk, dv, dg, dbeta, dh0), an empty [0] tensor where not needed."""
    return _backward_impl("chunk", q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_indices,
                          transpose_state_layout, chunk_size, backend, do, dht, needs_grad)


@torch.library.custom_op("chunkwise::recurrent_bwd", mutates_args=())
def recurrent_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
                  beta: Optional[torch.Tensor], scale: float, initial_state: Optional[torch.Tensor],
                  cu_seqlens: Optional[torch.Tensor], chunk_indices: Optional[torch.Tensor],
                  transpose_state_layout: bool, chunk_size: int, backend: str, do: torch.Tensor,
                  dht: Optional[torch.Tensor], needs_grad: Sequence[bool]) -> _GradTuple:
    """Gradients of recurrent_fwd: (dq, dk, dv, dg, dbeta, dh0), an empty [0] tensor where not needed."""
    return _backward_impl("recurrent", q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_indices,
                          transpose_state_layout, chunk_size, backend, do, dht, needs_grad)


chunk_bwd.register_fake(_backward_fake)
recurrent_bwd.register_fake(_backward_fake)


# ----------------------------------------------------------------------------------------------
# triton chunk op that keeps stage 1 for the backward
# ----------------------------------------------------------------------------------------------

_StageTuple = tuple[(torch.Tensor,) * 13]


def _save_stage1_wanted(mode, backend, beta, *tensors) -> bool:
    """The forward keeps stage 1 for the backward instead of the backward recomputing it: the triton chunk op of a
    delta family under autograd (what it keeps for which inputs: triton.chunk.saves_stage1, saved_shapes)."""
    if mode != "chunk" or backend != "triton" or beta is None:
        return False
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _stage1_shapes(q, v, g, beta, cu_seqlens, transpose_state_layout=False):
    """(shape, dtype) of the saving forward's w, u, p, t, hs, mm, r, qg, kg, gc, ht (empty [0] tensors where it keeps
    nothing: triton.chunk.saved_shapes)."""
    from .triton.chunk import saved_shapes
    return [(_EMPTY_SHAPE, q.dtype) if s is None else s
            for s in saved_shapes(q, v, g, beta, cu_seqlens, transpose_state_layout)]


@torch.library.custom_op("chunkwise::chunk_fwd_saved", mutates_args=())
def chunk_fwd_saved(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
                    beta: Optional[torch.Tensor], scale: float, initial_state: Optional[torch.Tensor],
                    output_final_state: bool, cu_seqlens: Optional[torch.Tensor],
                    chunk_indices: Optional[torch.Tensor], transpose_state_layout: bool, chunk_size: int,
                    backend: str) -> _StageTuple:
    """chunk_fwd (triton, delta families) that also returns what its backward reuses: (o, final state or empty, and
    per name of triton.chunk.SAVED, w u p t hs mm r qg kg G ht, the tensor or an empty [0] one where the forward keeps
    nothing for these inputs; triton.chunk.saved_shapes). A kept final state is a copy of the final state output
    where that is asked for too: outputs may not alias."""
    from .triton.chunk import SAVED, chunk_fwd as triton_chunk_fwd
    saved: dict = {}
    o, ht = triton_chunk_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                             chunk_indices=_triton_chunk_indices(cu_seqlens, chunk_indices),
                             transpose_state_layout=transpose_state_layout, saved_out=saved)
    if saved.get("ht") is not None and saved["ht"] is ht:
        saved["ht"] = ht.clone()
    if not output_final_state or ht is None:
        ht = _empty(q, _compute_dtype(q, initial_state))
    stage = [saved[n] if saved.get(n) is not None else q.new_empty(_EMPTY_SHAPE) for n in SAVED]
    return (_not_an_alias(o, q, k, v), _not_an_alias(ht, initial_state), *stage)


@chunk_fwd_saved.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_indices, transpose_state_layout,
      chunk_size, backend):
    o, ht = _forward_fake(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_indices,
                          transpose_state_layout, chunk_size, backend)
    return (o, ht, *(q.new_empty(shape, dtype=dt)
                     for shape, dt in _stage1_shapes(q, v, g, beta, cu_seqlens, transpose_state_layout)))


@torch.library.custom_op("chunkwise::chunk_bwd_saved", mutates_args=())
def chunk_bwd_saved(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
                    beta: Optional[torch.Tensor], scale: float, initial_state: Optional[torch.Tensor],
                    cu_seqlens: Optional[torch.Tensor], chunk_indices: Optional[torch.Tensor],
                    transpose_state_layout: bool, chunk_size: int, backend: str, w: torch.Tensor, u: torch.Tensor,
                    p: torch.Tensor, t: torch.Tensor, hs: torch.Tensor, mm: torch.Tensor, r: torch.Tensor,
                    qg: torch.Tensor, kg: torch.Tensor, gc: torch.Tensor, ht: torch.Tensor, do: torch.Tensor,
                    dht: Optional[torch.Tensor], needs_grad: Sequence[bool]) -> _GradTuple:
    """Gradients of chunk_fwd_saved from its stage 1 (p, t and w, u; all recomputed where they are empty, w and u
    alone formed from t), R (r; recomputed where it is empty), a split forward's segment states and transitions
    (hs, mm: the backward runs split too), KDA's q ⊙ e^G, k ⊙ e^{G_last − G} (qg, kg; formed again where they are
    empty), G (gc; likewise) and the final state (ht: where kept, the reverse state pass forms the per-chunk states
    from it)."""
    saved = dict(w=w if w.numel() else None, u=u if u.numel() else None, p=p, t=t) if t.numel() else None
    if saved is not None and hs.numel():
        saved.update(hs=hs, mm=mm)
    if saved is not None and r.numel():
        saved.update(r=r)
    if saved is not None and qg.numel():
        saved.update(qg=qg, kg=kg)
    if saved is not None and gc.numel():
        saved.update(G=gc)
    if saved is not None and ht.numel():
        saved.update(ht=ht)
    return _backward_impl("chunk", q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_indices,
                          transpose_state_layout, chunk_size, backend, do, dht, needs_grad, saved=saved)


@chunk_bwd_saved.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_indices, transpose_state_layout, chunk_size, backend,
      w, u, p, t, hs, mm, r, qg, kg, gc, ht, do, dht, needs_grad):
    return _backward_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_indices, transpose_state_layout,
                          chunk_size, backend, do, dht, needs_grad)


# ----------------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------------

_FWD_ARGS = ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "cu_seqlens",
             "chunk_indices", "transpose_state_layout", "chunk_size", "backend")
_GRAD_SLOTS = (0, 1, 2, 3, 4, 6)   # positions of q, k, v, g, beta, initial_state among the forward's inputs


def _setup_context(ctx, inputs, output):
    """Saves the forward's inputs, and for chunk_fwd_saved its stage 1 (the outputs after o, final state)."""
    (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_indices,
     transpose_state_layout, chunk_size, backend) = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, *output[2:])
    ctx.options = (scale, output_final_state, transpose_state_layout, chunk_size, backend)
    # an output no loss reached (the final state, chunk_fwd_saved's stage-1 outputs) comes to the backward as None,
    # not as zeros autograd would write first: on the H200 (B1-T32768-H32 bf16) those zero fills were ~0.2 ms of every
    # delta family's fwd+bwd (T, P, and GDN's / DeltaNet's W, U: ~1 GB)
    ctx.set_materialize_grads(False)


def _make_backward(bwd_op):
    """The autograd backward of a forward op; bwd_op takes the saved stage 1 (if any) before do."""
    def backward(ctx, do, dht, *_):
        q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, *stage1 = ctx.saved_tensors
        scale, output_final_state, transpose_state_layout, chunk_size, backend = ctx.options
        present = (q, k, v, g, beta, initial_state)
        needs = [bool(ctx.needs_input_grad[i]) and x is not None for i, x in zip(_GRAD_SLOTS, present)]
        if not output_final_state:
            dht = None
        if do is None:
            do = torch.zeros_like(q.new_empty(q.shape[0], q.shape[1], v.shape[2], v.shape[3]))
        grads = bwd_op(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_indices, transpose_state_layout,
                       chunk_size, backend, *stage1, do, dht, needs)
        dq, dk, dv, dg, dbeta, dh0 = (dx if n else None for dx, n in zip(grads, needs))
        return dq, dk, dv, dg, dbeta, None, dh0, None, None, None, None, None, None
    return backward


torch.library.register_autograd("chunkwise::chunk_fwd", _make_backward(chunk_bwd), setup_context=_setup_context)
torch.library.register_autograd("chunkwise::chunk_fwd_saved", _make_backward(chunk_bwd_saved),
                                setup_context=_setup_context)
torch.library.register_autograd("chunkwise::recurrent_fwd", _make_backward(recurrent_bwd),
                                setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# state pool (in-place, inference)
# ----------------------------------------------------------------------------------------------

@torch.library.custom_op("chunkwise::recurrent_pool_fwd", mutates_args=("pool", "intermediate_states", "state_scales"))
def recurrent_pool_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
                       beta: Optional[torch.Tensor], scale: float, pool: torch.Tensor, state_indices: torch.Tensor,
                       cu_seqlens: Optional[torch.Tensor], transpose_state_layout: bool, chunk_size: int,
                       backend: str, intermediate_states: Optional[torch.Tensor],
                       state_scales: Optional[torch.Tensor]) -> torch.Tensor:
    """Token-recurrent step over a state pool [P, HV, K, V] updated in place (or, with intermediate_states,
    the verify step: per-token states written there, the pool only read). Returns o [B, T, HV, V].
    (No defaults on the mutated arguments: torch 2.11's boxed redispatch drops trailing defaulted ones and then
    indexes them as mutated.)"""
    return _pool_impl(q, k, v, g, beta, scale, pool, state_indices, cu_seqlens, transpose_state_layout, chunk_size,
                      backend, intermediate_states, state_scales)


def _pool_impl(q, k, v, g, beta, scale, pool, state_indices, cu_seqlens, transpose_state_layout, chunk_size,
               backend, intermediate_states=None, state_scales=None):
    if backend == "triton":
        from .triton.decode import recurrent_fwd as launch
        o, _ = launch(q, k, v, g, beta, scale, pool, False, cu_seqlens, state_indices=state_indices,
                      transpose_state_layout=transpose_state_layout, intermediate_states=intermediate_states,
                      state_scales=state_scales)
    else:
        o, _ = torch_pool_step(q, k, v, g, beta, scale, pool, False, cu_seqlens, state_indices,
                                transpose_state_layout, _compute_dtype(q, pool), intermediate_states, state_scales)
    return _not_an_alias(o, q, k, v)


@recurrent_pool_fwd.register_fake
def _(q, k, v, g, beta, scale, pool, state_indices, cu_seqlens, transpose_state_layout, chunk_size, backend,
      intermediate_states, state_scales):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2], v.shape[3])


@torch.library.custom_op("chunkwise::rollback", mutates_args=("pool", "state_scales"))
def rollback(pool: torch.Tensor, state_indices: torch.Tensor, intermediate_states: torch.Tensor,
             num_accepted_tokens: torch.Tensor, state_scales: Optional[torch.Tensor], backend: str) -> None:
    """Speculative decoding's rollback: pool[state_indices[n]] = intermediate_states[n, num_accepted_tokens[n] - 1]
    in place (requantized into the slot and state_scales for an 8-bit pool). See chunkwise.speculative."""
    rollback_impl(pool, state_indices, intermediate_states, num_accepted_tokens, state_scales, backend)


def rollback_impl(pool, state_indices, intermediate_states, num_accepted_tokens, state_scales, backend):
    if backend == "triton":
        from .triton.decode import rollback as launch
    else:
        from .reference.recurrent import rollback as launch
    launch(pool, state_indices, intermediate_states, num_accepted_tokens, state_scales)


@rollback.register_fake
def _(pool, state_indices, intermediate_states, num_accepted_tokens, state_scales, backend):
    return None


# ----------------------------------------------------------------------------------------------
# the calls `chunkwise.api.run` makes
# ----------------------------------------------------------------------------------------------

def _eager_plain(*tensors) -> bool:
    """True when a call may skip the custom op and run its implementation directly: plain eager
    execution (no dynamo or jit trace, no Python dispatch mode such as FakeTensorMode), plain
    torch.Tensor inputs (no subclass: fake, functional, DTensor, ...) and no gradient wanted. The op's
    dispatch costs ~35 us per call (measured on the CPU: 110 vs 76 us for a one-token step), several
    times the H200 decode kernel itself; the result is the same (tests/test_compile.py)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or _dispatch_mode() is not None:
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) is not torch.Tensor or (grad and t.requires_grad)):
            return False
    return True


def forward(mode: str, q, k, v, g, beta, scale: float, initial_state, output_final_state: bool, cu_seqlens,
            chunk_indices, transpose_state_layout: bool, chunk_size: int, backend: str):
    """Dispatch to chunk_fwd / recurrent_fwd (or their implementation, see `_eager_plain`).
    Returns (o, final_state or None)."""
    args = (q, k, v, g, beta, float(scale), initial_state, bool(output_final_state), cu_seqlens, chunk_indices,
            bool(transpose_state_layout), int(chunk_size), backend)
    if _save_stage1_wanted(mode, backend, beta, q, k, v, g, beta, initial_state):
        o, ht = chunk_fwd_saved(*args)[:2]
    elif _eager_plain(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices):
        o, ht = _forward_impl(mode, *args)
    else:
        o, ht = (chunk_fwd if mode == "chunk" else recurrent_fwd)(*args)
    return o, (ht if output_final_state else None)


def pool_step(q, k, v, g, beta, scale: float, pool, state_indices, output_final_state: bool, cu_seqlens,
              transpose_state_layout: bool, chunk_size: int, backend: str, intermediate_states=None, state_scales=None):
    """Dispatch to recurrent_pool_fwd (or its implementation, see `_eager_plain`).
    Returns (o, the pool if output_final_state else None)."""
    args = (q, k, v, g, beta, float(scale), pool, state_indices, cu_seqlens, bool(transpose_state_layout),
            int(chunk_size), backend, intermediate_states, state_scales)
    if _eager_plain(q, k, v, g, beta, pool, state_indices, cu_seqlens, intermediate_states, state_scales):
        o = _pool_impl(*args)
    else:
        o = recurrent_pool_fwd(*args)
    return o, (pool if output_final_state else None)
