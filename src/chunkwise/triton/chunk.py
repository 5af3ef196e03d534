"""Host orchestration of the chunk kernels: the forward as a short sequence of stage calls, what it keeps for the
backward, and the backward.

Stages (docs/design.md): stage 1 (triton/stage1.py) forms per chunk A, T = (I + A)⁻¹, W / U or T diag(β), P and
KDA's gated keys and queries, fully parallel; stage 2 (triton/stage2.py) runs the state through the chunks of each
sequence and writes the output. Launch choices come from the plan (triton/configs.py).
"""
from __future__ import annotations

import torch

from .common import (BT, _alloc, _num_sms, _overlap, _side_stream, cdiv, chunk_slots, cut_state, gate_kind,
                     on_tensor_device, pad_last, pad_state, padded_dims, state_dtype)
from .configs import (WIDE_16BIT_K, ForwardPlan, forward_plan, fp16_kda_in_fp32, gate_scaled_in, resolve_stage2,
                      saved_t_dtype)
from .stage1 import chunk_p, chunk_prepare
from .stage2 import chunk_state_output

# ------------------------------------------------------------------------------------------------
# what the forward keeps for the backward
# ------------------------------------------------------------------------------------------------

# the names of what a saving forward hands to the backward, in the order the custom op returns them (h, the
# per-chunk states, is never kept: the backward forms them from R)
SAVED = ("w", "u", "p", "t", "h", "r", "qg", "kg", "G", "ht")


def saves_stage1(q, v, g, beta) -> bool:
    """Whether chunk_fwd(saved_out=...) keeps stage 1 for these inputs: the delta families at head dims the kernels
    take as they are (not padded), except where the backward runs in fp32 (16-bit with K > WIDE_16BIT_K, fp16 KDA on
    the GPU) and GDN / DeltaNet with fp16 inputs (their saved stage 1 gave inf gradients at small tiles on sm_90;
    their backward recomputes it)."""
    if beta is None or (q.dtype != torch.float32 and q.shape[-1] > WIDE_16BIT_K) or fp16_kda_in_fp32(q, g):
        return False
    if q.dtype == torch.float16 and gate_kind(g) < 2:
        return False
    return padded_dims(q, v) == (q.shape[-1], v.shape[-1])


def saved_shapes(q, v, g, beta, cu_seqlens, transpose_state_layout=False) -> list:
    """(shape, dtype) per name of SAVED that chunk_fwd(saved_out=...) fills for these inputs, None where it keeps
    nothing: w (not under T_FORM, where the backward forms W, U from T), p, t, R (instead of u: R = U − W S is all the
    backward reads U for), KDA's qg, kg (where the backward's state passes take them) and G, and DeltaNet's final
    state (its backward's reverse state pass forms the per-chunk states from it)."""
    names = dict.fromkeys(SAVED)
    if not saves_stage1(q, v, g, beta):
        return list(names.values())
    B, T, HV, K, V = q.shape[0], q.shape[1], v.shape[2], q.shape[3], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    gate = gate_kind(g)
    t_form = forward_plan(q.device, q.dtype, gate, True, K, V, save=True).t_form
    if not t_form:
        names["w"] = ((B, T, HV, K), q.dtype)
    names["p"] = ((B, T, HV, BT), q.dtype)
    names["t"] = ((B, T, HV, BT), saved_t_dtype(q.dtype, K, gate, t_form))
    names["r"] = ((B, T, HV, V), state_dtype(q.dtype))
    if gate == 2:
        if gate_scaled_in(g, q):
            names["qg"] = names["kg"] = ((B, T, HV, K), q.dtype)
        names["G"] = ((B, T, HV, K), torch.float32)
    if gate == 0:
        names["ht"] = ((N, HV, V, K) if transpose_state_layout else (N, HV, K, V), torch.float32)
    return list(names.values())


# ------------------------------------------------------------------------------------------------
# forward
# ------------------------------------------------------------------------------------------------

@on_tensor_device
def chunk_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, *, chunk_indices=None,
              transpose_state_layout=False, plan: ForwardPlan | None = None, saved_out: dict | None = None):
    """The chunk forward of all four families (canonical inputs: see chunkwise.triton).

    Returns (o [B,T,HV,V] in q's dtype, final state fp32 [N,HV,K,V] ([N,HV,V,K] transposed) or None).
    ``plan``: the launch plan (default: configs.forward_plan's for these inputs; its None fields are picked from the
    shapes). ``saved_out``: a dict that, where saves_stage1, receives what the backward reuses (SAVED, saved_shapes).
    Head dims the kernels do not take as they are run zero-padded; 16-bit inputs with K > WIDE_16BIT_K run in fp32.
    """
    if q.dtype != torch.float32 and q.shape[-1] > WIDE_16BIT_K:
        o, ht = chunk_fwd(q.float(), k.float(), v.float(), g, None if beta is None else beta.float(), scale,
                          initial_state, output_final_state, cu_seqlens, chunk_indices=chunk_indices,
                          transpose_state_layout=transpose_state_layout, plan=plan)
        return o.to(q.dtype), ht
    save = saved_out is not None and saves_stage1(q, v, g, beta)      # (on the unpadded inputs)
    keep_qk_gated = save and gate_kind(g) == 2 and gate_scaled_in(g, q)
    K0, V0 = q.shape[-1], v.shape[-1]
    Kp, Vp = padded_dims(q, v)
    padded = (Kp, Vp) != (K0, V0)
    if padded:
        q, k, v = pad_last(q, Kp), pad_last(k, Kp), pad_last(v, Vp)
        g = g if g is None or g.dim() == 3 else pad_last(g, Kp)
        initial_state = pad_state(initial_state, Kp, Vp, transpose_state_layout)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    varlen = cu_seqlens is not None
    gate, delta = gate_kind(g), beta is not None
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g = None if g is None else g.float().contiguous()
    beta = None if beta is None else beta.contiguous()
    if plan is None:
        plan = forward_plan(q.device, q.dtype, gate, delta, K, V, save)
    n_sm = _num_sms(q.device)
    launch = resolve_stage2(plan, N, T, HV, K, V, q.element_size(), gate, delta, varlen, n_sm)
    if varlen and chunk_indices is None and (delta or launch.p_in):
        from ..utils import prepare_chunk_indices
        chunk_indices = prepare_chunk_indices(cu_seqlens, BT)

    # stage 2's outputs first: beside stage 1, everything it writes exists before stage 1 is launched
    o = _alloc((B, T, HV, V), q.dtype, q.device)
    ht = None
    keep_ht = save and gate == 0     # DeltaNet: the backward forms the per-chunk states back from the final one
    if output_final_state or keep_ht:
        ht = _alloc((N, HV, V, K) if transpose_state_layout else (N, HV, K, V), torch.float32, q.device)
    rs = _alloc((B, T, HV, V), state_dtype(q.dtype), q.device) if save else None   # R, for the backward

    n_chunks = (chunk_indices.shape[0] if varlen else cdiv(T, BT)) if delta else 0
    overlap = launch.overlap_mode > 0 and launch.nseg == 1 and \
        _overlap(cdiv(V, launch.bv) * N * HV, n_sm, n_chunks, q.device)
    ready = side = None
    if overlap:         # stage 2 beside stage 1, on a stream of its own that does not wait for it
        ready = torch.zeros((chunk_slots(N, T, varlen), HV), dtype=torch.int32, device=q.device)
        side = _side_stream(q.device)

    if delta:
        stage1 = chunk_prepare(q, k, v, g, beta, cu_seqlens, chunk_indices, plan=plan, save_t=save,
                               store_p=launch.p_in or save, ready=ready, save_g=save and gate == 2)
    else:
        stage1 = dict(w=None, u=None, p=None, qg=None, kg=None, glast=None, gcum=None)
        if launch.p_in:                 # simple GLA with P formed once per chunk
            stage1["p"] = chunk_p(q, k, g, HV, cu_seqlens, chunk_indices)
    if not launch.p_in:
        stage1["p"] = None
    if save:
        saved_out.update(p=stage1["p"], t=stage1["t"], r=rs)
        if not plan.t_form:     # (under T_FORM, w and u are stage 2's operands: the backward forms W, U from T)
            saved_out.update(w=stage1["w"])
        if gate == 2:
            saved_out.update(G=stage1["G"])
            if keep_qk_gated:
                saved_out.update(qg=stage1["qg"], kg=stage1["kg"])
        if keep_ht:
            saved_out.update(ht=ht)

    chunk_state_output(q, k, v, g, beta, stage1, o, initial_state, ht, rs, ready, side, cu_seqlens, scale, plan,
                       launch, transpose_state_layout)
    if side is not None:
        torch.cuda.current_stream(q.device).wait_stream(side)
    if not output_final_state:
        ht = None
    if padded:
        o, ht = o[..., :V0].contiguous(), cut_state(ht, K0, V0, transpose_state_layout)
    return o, ht


# ------------------------------------------------------------------------------------------------
# backward (chunk_bwd, the backward's stages in order: triton/bwd_*.py)
# ------------------------------------------------------------------------------------------------
