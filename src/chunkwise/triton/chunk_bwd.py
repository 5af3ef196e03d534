"""The chunk backward's host orchestration (docs/design.md, section 6): chunk_bwd launches the stages of
bwd_states.py, bwd_tiles.py, bwd_wy.py and bwd_kda.py in order, on the plan configs.backward_plan gives."""
from __future__ import annotations

import contextlib

import torch

from ..utils import TRITON_MAX_HEAD_DIM as MAX_K   # the backward's kernels fit one SM's shared memory up to it
from .bwd_kda import pair_grads
from .bwd_states import Problem, forward_state_pass, gate_cumsum, gate_scaled, reverse_state_pass
from .bwd_tiles import group_sum, state_tile_pass
from .bwd_wy import recompute_stage1, stage1_from_saved, wy_pass
from .common import (_num_sms, _overlap, _side_stream, cdiv, cut_state, on_tensor_device, pad_last, pad_state,
                     padded_dims, state_dtype, target_arch)
from .configs import WIDE_16BIT_K, backward_plan, fp16_kda_in_fp32, gate_scaled_in, saved_t_dtype  # noqa: F401


@on_tensor_device
def chunk_bwd(q, k, v, g, beta, scale, initial_state, do, dht, cu_seqlens, *, chunk_indices=None,
              transpose_state_layout=False, saved=None, plan=None):
    """Gradients of the chunk op.

    q, k: [B, T, H, K]; v, do: [B, T, HV, V]; g: None | [B, T, HV] | [B, T, HV, K] fp32; beta: None | [B, T, HV];
    initial_state: None | [N, HV, K, V] ([N, HV, V, K] transposed); dht: None | like the final state (fp32, same
    layout); cu_seqlens: None | [N + 1] (B == 1). Returns (dq, dk, dv, dg, dbeta, dh0), each in its input's dtype
    and layout (None where the input is None). K > MAX_K raises NotImplementedError.
    ``saved``: what the saving forward kept (chunk_fwd's ``saved_out``: p, t, r, and w unless under the T form;
    KDA's G and, with 16-bit inputs, qg, kg; DeltaNet's final state ht), used instead of recomputing stage 1 and the
    forward state pass; ignored where the head dims are padded or the inputs run in fp32. ``plan``: the launch plan
    (default: configs.backward_plan for these inputs and this GPU; not applied where the inputs run in fp32).
    Head dims the kernels do not take as they are run zero-padded (common.padded_dims).
    """
    if q.dtype != torch.float32 and (WIDE_16BIT_K < q.shape[-1] <= MAX_K or fp16_kda_in_fp32(q, g)):
        # 16-bit inputs with K > 128, or fp16 KDA on the GPU, run in fp32; gradients in the inputs' dtypes
        dq, dk, dv, dg, dbeta, dh0 = chunk_bwd(
            q.float(), k.float(), v.float(), g, None if beta is None else beta.float(), scale, initial_state,
            do.float(), dht, cu_seqlens, chunk_indices=chunk_indices, transpose_state_layout=transpose_state_layout)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg, None if dbeta is None else dbeta.to(beta.dtype),
                dh0)
    K0, V0 = q.shape[-1], v.shape[-1]
    Kp, Vp = padded_dims(q, v)
    padded = (Kp, Vp) != (K0, V0) and K0 <= MAX_K
    if padded or beta is None or not saved:
        saved = None
    tr = transpose_state_layout
    if padded:
        q, k, v, do = pad_last(q, Kp), pad_last(k, Kp), pad_last(v, Vp), pad_last(do, Vp)
        g = g if g is None or g.dim() == 3 else pad_last(g, Kp)
        initial_state, dht = pad_state(initial_state, Kp, Vp, tr), pad_state(dht, Kp, Vp, tr)
    if q.shape[-1] > MAX_K:
        raise NotImplementedError(
            f"the triton chunk backward supports head dims K <= {MAX_K} (got K={q.shape[-1]}): wider keys would need "
            f"more shared memory than one SM has; use backend='torch' to train with K={q.shape[-1]}")
    p = Problem.of(q, v, g, beta, cu_seqlens, chunk_indices)
    plan = plan or backward_plan(p.gate, p.delta, q.dtype, p.K, p.V, target_arch(q.device))
    gate, delta, dev = p.gate, p.delta, q.device
    B, T, H, HV, K, V, C = p.B, p.T, p.H, p.HV, p.K, p.V, p.C
    q, k, v, do = (x.contiguous() for x in (q, k, v, do))
    if do.dtype != q.dtype:
        do = do.to(q.dtype)
    g = None if g is None else g.contiguous()
    beta = None if beta is None else beta.contiguous()
    h0 = None if initial_state is None else initial_state.contiguous()
    dht = None if dht is None else dht.contiguous()

    # the gate's chunk-local cumsum (KDA's saved by the forward)
    G = None
    if saved is not None and saved.get("G") is not None:
        G = saved["G"].contiguous()
    elif gate:
        G = gate_cumsum(g, p, plan)
    # fp32 scratch [B, T, HV, C]: A and P where the three recompute launches form them, the WY pass's dAᵀ (GDN),
    # KDA's dA and dP for the pair kernel (one buffer AP: it also takes the state-tile pass's dT shares)
    AP = Amat = Pmat = None
    recompute3 = saved is None and not plan.fused_prep
    if gate == 2:
        AP = p.alloc(2, B, T, HV, C)
        Amat, Pmat = AP[0], AP[1]
    else:
        Amat = p.alloc(B, T, HV, C) if delta and (recompute3 or plan.wy_da_scr) else None
        Pmat = p.alloc(B, T, HV, C) if recompute3 else None
    # KDA: the state passes' q ⊙ e^G, k ⊙ e^{G_last − G} (saved by the forward, or formed here)
    q_s, k_s = q, k
    if plan.kd_in:
        q_s, k_s = (saved["qg"].contiguous(), saved["kg"].contiguous()) if saved is not None else \
            gate_scaled(q, k, G, p, plan)
    # DeltaNet with saved stage 1: the reverse state pass forms the per-chunk states from the final state
    rev_h = saved is not None and gate == 0
    # KDA with saved stage 1: the forward state pass on a second stream beside the dR_local / W launch (it reads
    # R, not W), made to wait for the work launched so far
    beside = saved is not None and plan.overlap and \
        _overlap(p.grid_s(plan)[0] * p.grid_s(plan)[1], _num_sms(dev), p.NT, dev)
    side = _side_stream(dev) if beside else None

    # stage 1's operands: dR_local always, T, W (and U to form R) where the forward did not save them
    if saved is not None:
        Tmat, W, dRl = stage1_from_saved(k, v, beta, G, do, scale, saved, p, plan)
        R = saved["r"].contiguous()
    else:
        Tmat, W, U, dRl = recompute_stage1(q, k, v, g, beta, G, do, scale, Amat, Pmat, p, plan)
        R = p.alloc(B, T, HV, V, dtype=state_dtype(q.dtype)) if delta else None
    # the forward state pass: h (and R = U − W S where not saved)
    h = None
    if saved is not None and not rev_h:
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            h = forward_state_pass(k_s, R, G, None, None, None, h0, p, plan, tr, beside)
    elif saved is None:
        h = forward_state_pass(k_s, v, G, W, U, R, h0, p, plan, tr, False)
    if side is not None:
        torch.cuda.current_stream(dev).wait_stream(side)
    if rev_h:
        h = p.alloc(p.NC, HV, K, V, dtype=state_dtype(q.dtype))
    # the reverse state pass: dh, dR, dh0 (DeltaNet's h too, backwards from the final state)
    dh, dR, dh0 = reverse_state_pass(q_s, k_s, G, W, dRl, do, dht, h, h0, scale, p, plan, tr,
                                     ht=saved["ht"].contiguous() if rev_h else None, R=R if rev_h else None)
    del dRl, q_s, k_s

    # gradients leave the kernels in the input dtype unless the pair kernel finishes them (KDA: fp32 until then);
    # grouped value heads' per-head shares in it only with plan.group16, else fp32 for group_sum
    gdt = q.dtype if gate != 2 and (HV == H or plan.group16) else torch.float32
    dq, dk = p.alloc(B, T, HV, K, dtype=gdt), p.alloc(B, T, HV, K, dtype=gdt)
    dv = p.alloc(B, T, HV, V, dtype=v.dtype) if delta else None
    dbeta = p.alloc(B, T, HV) if delta else None
    dG = p.alloc(*g.shape) if gate else None
    # the state-tile pass: dq, dk1 (dk's state and P terms), dW, the gate's shares (per key column block, or per
    # channel: dG itself, with dT's and dβ's shares in dTp, dbs), then the WY pass
    nka = cdiv(K, plan.dqk_bk)
    dk1_dt = q.dtype if plan.dk1_16 else torch.float32
    dk1 = dk if not delta or dk.dtype == dk1_dt else p.alloc(B, T, HV, K, dtype=dk1_dt)
    dW = p.alloc(B, T, HV, K, dtype=q.dtype if plan.key_lowp else torch.float32) if delta and gate != 2 else None
    dGp = None if not gate else (dG if gate == 2 else p.alloc(nka, B, T, HV))
    dTp = dbs = None
    if gate == 2:   # (dTp in AP where two blocks or fewer: the WY pass reads its rows of it before it writes them)
        dTp = AP if nka <= 2 else p.alloc(nka, B, T, HV, C)
        dbs = p.alloc(nka, B, T, HV)
    state_tile_pass(q, k, v, G, h, dh, R if delta else None, dR, do, dq, dk1, dW, dGp, Tmat, beta, dTp, dbs, scale,
                    p, plan)
    wy_pass(k, v, beta, G, Tmat, dW, dR, dk1, dbs if gate == 2 else dGp, Amat, dv, dk, dbeta, dG,
            R if delta else None, do, Pmat, dTp, scale, p, plan)
    if not delta:       # dv = dR
        dv = dR if dR.dtype == v.dtype else dR.to(v.dtype)
    del dk1, dW, dGp, dTp, dbs
    if gate == 2:   # KDA: the pairwise gradients, each finished gradient stored in the input dtype unless summed after
        dq_o, dk_o = dq, dk
        if (HV == H or plan.group16) and q.dtype != dq.dtype:
            dq_o, dk_o = p.alloc(*dq.shape, dtype=q.dtype), p.alloc(*dk.shape, dtype=k.dtype)
        pair_grads(q, k, beta, G, Pmat, Amat, dq, dk, dbeta, dG, dq_o, dk_o, p, plan)
        dq, dk = dq_o, dk_o
    if HV != H:     # per value head -> per key head
        dq, dk = group_sum(dq, H, q.dtype), group_sum(dk, H, k.dtype)
    dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    dG = None if dG is None else dG.to(g.dtype)
    dh0 = None if dh0 is None else dh0.to(initial_state.dtype)
    if padded:
        dq, dk, dv = dq[..., :K0].contiguous(), dk[..., :K0].contiguous(), dv[..., :V0].contiguous()
        dG = dG if dG is None or dG.dim() == 3 else dG[..., :K0].contiguous()
        dh0 = cut_state(dh0, K0, V0, tr)
    return dq, dk, dv, dG, None if dbeta is None else dbeta.to(beta.dtype), dh0
